"""`jr.custom_inverse`: a user-supplied inverse honoured by reverse, reversible, inverse AD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaf_rel_error

import jaxrev as jr


@jr.custom_inverse
def kepler(x):
    """Monotone (derivative >= 0.5): its inverse is found by Newton iterations only."""
    return x + 0.5 * jnp.sin(x)


@kepler.definverse
def kepler_inv(y):
    def newton(_, x):
        return x - (x + 0.5 * jnp.sin(x) - y) / (1.0 + 0.5 * jnp.cos(x))

    return jax.lax.fori_loop(0, 40, newton, y)


def program(x, w):
    """kepler inside a larger invertible program, with parameters."""

    def body(c, _):
        a, b = c
        a = a + jnp.tanh(w * b)
        b = kepler(b * 1.3) + 0.1 * a
        return (a, b), None

    return jax.lax.scan(body, x, None, length=5)[0]


X = (jnp.linspace(-1.0, 1.0, 4), jnp.linspace(0.5, 2.0, 4))
W = jnp.array([0.3, -0.7, 1.1, 0.2])


def test_function_itself_is_unchanged():
    x = jnp.linspace(-2, 2, 5)
    plain = lambda x: x + 0.5 * jnp.sin(x)  # noqa: E731
    assert leaf_rel_error(kepler(x), plain(x)) == 0
    assert (
        leaf_rel_error(
            jax.grad(lambda x: jnp.sum(kepler(x) ** 2))(x),
            jax.grad(lambda x: jnp.sum(plain(x) ** 2))(x),
        )
        < 1e-15
    )
    assert leaf_rel_error(jax.jit(jax.vmap(kepler))(x[:, None]), plain(x[:, None])) < 1e-15
    assert leaf_rel_error(jax.jvp(kepler, (x,), (x,))[1], jax.jvp(plain, (x,), (x,))[1]) < 1e-15


def test_reverse_uses_the_inverse():
    x = jnp.linspace(-2, 2, 5)
    assert leaf_rel_error(jr.reverse(kepler)(kepler(x)), x) < 1e-14
    y = program(X, W)
    assert leaf_rel_error(jr.reverse(program)(y, W), X) < 1e-12
    # vmapped, and under jit
    Xb = jax.tree_util.tree_map(lambda a: jnp.stack([a, a * 0.5]), X)
    Yb = jax.vmap(program, (0, None))(Xb, W)
    assert leaf_rel_error(jax.jit(jax.vmap(jr.reverse(program), (0, None)))(Yb, W), Xb) < 1e-12


def test_state_arguments_out_of_order():
    """`argnums=(1, 0)`: `fun` returns, and `inv_fun` takes in the state positions and
    returns, the state in `argnums`' order; the inverse, the log-det rule (at the inputs,
    or the inverse's at the outputs) and `vmap` put each leaf where it belongs (they were
    swapped, silently: a wrong inverse and log-det)."""
    a, b = jnp.asarray(0.7), jnp.asarray(1.3)
    for of_inverse in (False, True):
        f = jr.custom_inverse(lambda a, b: (2.0 * b, jnp.exp(a)), argnums=(1, 0))
        f.definverse(lambda p0, p1: (p1 / 2.0, jnp.log(p0)))  # p0 = exp(a), p1 = 2 b
        if of_inverse:
            f.deflogdet(lambda p0, p1: -jnp.log(2.0) - jnp.log(p0), of_inverse=True)
        else:
            f.deflogdet(lambda a, b: jnp.log(2.0) + a)
        g = lambda v, f=f: jnp.stack(f(v[0], v[1]))  # noqa: E731
        v = jnp.stack([a, b])
        y = g(v)
        np.testing.assert_allclose(y, [2.6, np.exp(0.7)], rtol=1e-14)
        np.testing.assert_allclose(jr.reverse(g)(y), v, rtol=1e-14)
        want = jnp.linalg.slogdet(jax.jacfwd(g)(v))[1]
        np.testing.assert_allclose(jr.forward_and_slogdet(g)(v)[1], want, rtol=1e-14)
        np.testing.assert_allclose(jr.inverse_and_slogdet(g)(y)[1], -want, rtol=1e-14)
        vs = jnp.stack([v, 0.5 * v])
        np.testing.assert_allclose(
            jax.vmap(jr.forward_and_slogdet(g))(vs)[1],
            jax.vmap(lambda v: jnp.linalg.slogdet(jax.jacfwd(g)(v))[1])(vs),
            rtol=1e-14,
        )


def test_reversible_gradients():
    loss = lambda f: lambda x, w: jnp.sum(f(x, w)[0] ** 2) + jnp.sum(jnp.sin(f(x, w)[1]))  # noqa
    g_ref = jax.grad(loss(program), argnums=(0, 1))(X, W)
    g = jax.grad(loss(jr.reversible(program)), argnums=(0, 1))(X, W)
    assert leaf_rel_error(g, g_ref) < 1e-11
    assert jr.memory_report(program, X, W, checkpoint_every=None).total_bytes == 0


def test_inverse_jvp_is_exact():
    flat = lambda z: jnp.concatenate(program((z[:4], z[4:]), W))  # noqa: E731
    z = jnp.concatenate(X)
    v = jnp.asarray(np.random.default_rng(0).standard_normal(8))
    _, (t,) = jr.inverse_jvp(flat, (z,), v, method="reverse")
    J = jax.jacfwd(flat)(z)
    assert leaf_rel_error(t, jnp.linalg.solve(J, v)) < 1e-10


def test_errors_name_the_function():
    @jr.custom_inverse
    def g(x):
        return x * 2.0

    with pytest.raises(TypeError, match="custom_inverse function g has no inverse"):
        g(jnp.ones(2))

    g.definverse(lambda y: y[:1])
    with pytest.raises(ValueError, match="the inverse <lambda> of g must return"):
        g(jnp.ones(2))

    @jr.custom_inverse
    def h(x):
        return x[:1]

    h.definverse(lambda y: y)
    with pytest.raises(ValueError, match="jaxrev.custom_inverse: h's output leaf 0"):
        h(jnp.ones(2))
    with pytest.raises(TypeError, match="expects a callable"):
        h.definverse(3)

    @jr.custom_inverse
    def k(x, w):
        return x * w

    k.definverse(lambda y: y)  # forgot the parameter
    with pytest.raises(TypeError, match="the inverse <lambda> of k must take k's arguments"):
        k(jnp.ones(2), 2.0)


# --------------------------------------------------------------------------- hook, nestlevel


def test_hook_flips_the_gradient():
    assert float(jax.grad(lambda x: jr.hook(lambda g: -g, x) ** 2)(3.0)) == -6.0

    # pytrees, and clipping inside a larger gradient
    def loss(p):
        p = jr.hook(lambda g: jax.tree_util.tree_map(lambda a: jnp.clip(a, -1.0, 1.0), g), p)
        return jnp.sum(p["w"] ** 3) + p["b"] * 10.0

    g = jax.jit(jax.grad(loss))({"w": jnp.array([0.1, 2.0]), "b": 1.0})
    assert np.allclose(g["w"], [0.03, 1.0]) and float(g["b"]) == 1.0
    # forward values untouched
    assert float(jr.hook(lambda g: 2 * g, 5.0)) == 5.0


def test_hook_errors_name_the_hook():
    with pytest.raises(TypeError, match="jr.hook expects a callable"):
        jr.hook(3.0, 1.0)

    def bad(g):
        return (g, g)

    with pytest.raises(ValueError, match="jr.hook: bad must return a cotangent"):
        jax.grad(lambda x: jr.hook(bad, x) ** 2)(1.0)


def test_nestlevel():
    seen = []

    def f(x):
        seen.append(jr.nestlevel())
        return x**3

    f(2.0)
    jax.grad(f)(2.0)
    jax.grad(jax.grad(f))(2.0)
    jax.hessian(f)(2.0)
    jax.jit(jax.grad(f))(2.0)
    assert seen == [0, 1, 2, 2, 1]


# --------------------------------------------------------------------------- forward_mode


def test_forward_mode_gradients_and_no_reevaluation():
    def f(a, b):
        return {"u": jnp.sin(a) * b[0], "v": jnp.exp(a * b[1]).sum()}

    fm = jr.forward_mode(f)
    a, b = jnp.array([0.3, -1.2, 0.7]), jnp.array([1.5, 0.25])
    loss = lambda f: lambda a, b: jnp.sum(f(a, b)["u"] ** 2) + f(a, b)["v"]  # noqa: E731
    g_ref = jax.grad(loss(f), argnums=(0, 1))(a, b)
    g = jax.grad(loss(fm), argnums=(0, 1))(a, b)
    assert leaf_rel_error(g, g_ref) < 1e-12
    # the backward pass applies the stored Jacobian: no sin / exp left in it
    _, pull = jax.vjp(fm, a, b)
    back = str(jax.make_jaxpr(pull)(fm(a, b)))
    assert "sin" not in back and "exp" not in back
    with pytest.raises(TypeError, match="forward_mode"):
        jr.forward_mode(lambda n: n * 2)(jnp.arange(3))


# --------------------------------------------------------------------------- store / recompute


def _temp(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _loop(step, n=50):
    return lambda x, th: jax.lax.fori_loop(0, n, lambda i, c: step(c, th), x)


def _coupled(c, th, mark=lambda v: v):
    x, y = c
    x = x + jnp.tanh(th * y)
    return x, mark(y + jnp.sin(x))


def test_store_keeps_values_and_costs_memory():
    c = (jnp.linspace(0, 1, 512), jnp.linspace(1, 2, 512))
    plain, kept = _loop(_coupled), _loop(lambda c, th: _coupled(c, th, jr.store))
    # nothing: the fori_loop's final counter, which the output discards, is run forward
    assert jr.memory_report(plain, c, 0.5, checkpoint_every=None).total_bytes == 0
    rep = jr.memory_report(kept, c, 0.5, checkpoint_every=None)
    entry = [e for e in rep.entries if e["what"] == "value kept by jr.store"]
    assert len(entry) == 1 and entry[0]["count"] == 50 and entry[0]["bytes"] == 512 * 8
    assert "test_custom.py" in entry[0]["where"]
    loss = lambda f, **dial: jax.grad(  # noqa: E731
        lambda c, th: jnp.sum(jr.reversible(f, **dial)(c, th)[0]),
        argnums=(0, 1),
    )
    # measured without checkpoints: with them (the default) the checkpoints' and a repair's
    # buffers are not the same in both programs (170 kB without the store, 80 kB with it),
    # which hides the store's own cost
    bare = {"checkpoint_every": None, "on_drift": "ignore"}
    m_plain, m_kept = _temp(loss(plain, **bare), c, 0.5), _temp(loss(kept, **bare), c, 0.5)
    assert m_kept > m_plain + 0.9 * 50 * 512 * 8
    # and the gradient is still jax.grad's
    assert (
        leaf_rel_error(
            loss(kept)(c, 0.5),
            jax.grad(lambda c, th: jnp.sum(plain(c, th)[0]), argnums=(0, 1))(c, 0.5),
        )
        < 1e-10
    )


def test_recompute_changes_what_is_stored():
    def f(x, w, mark=lambda v: v):
        h = mark(jnp.maximum(jnp.sum(x) * w, 0.0))  # one number the output needs back
        return x + h

    x, w = jnp.linspace(-1.0, 2.0, 4), 3.0
    plain = jr.memory_report(f, x, w, checkpoint_every=None)
    marked = jr.memory_report(lambda x, w: f(x, w, jr.recompute), x, w, checkpoint_every=None)
    # by default the relu's output is kept; marked with jr.recompute it is recomputed from the
    # value kept in its place (its input, the same 8 bytes)
    assert "`max`" in plain.entries[0]["made"] and plain.total_bytes == 8, str(plain)
    assert all("`max`" not in e["made"] for e in marked.entries), str(marked)
    assert "`mul`" in marked.entries[0]["made"] and marked.total_bytes == 8, str(marked)
    L = lambda f: jax.grad(lambda x, w: jnp.sum(jnp.sin(f(x, w))), argnums=(0, 1))  # noqa: E731
    assert (
        leaf_rel_error(L(jr.reversible(lambda x, w: f(x, w, jr.recompute)))(x, w), L(f)(x, w))
        < 1e-13
    )


# --------------------------------------------------------------------------- register_inverse_jvp


def _cube_primitive(with_jvp_rule):
    from jax.extend.core import Primitive

    p = Primitive("test_cube")
    p.def_impl(lambda x: x**3)
    p.def_abstract_eval(lambda a: a)
    from jaxrev._compat import primitive_jvps

    primitive_jvps[p] = lambda xs, ts: (p.bind(xs[0]), 3 * xs[0] ** 2 * ts[0])
    # the inverse is computed where JAX cannot differentiate it
    jr.register_inverse(p, lambda out, x: [jax.lax.stop_gradient(jnp.cbrt(out))])
    if with_jvp_rule:
        jr.register_inverse_jvp(p, lambda t, out, x: [t / (3 * x**2)])
    return p


def test_register_inverse_jvp_gives_the_inverse_its_derivative():
    plain, ruled = _cube_primitive(False), _cube_primitive(True)
    y = jnp.array([8.0, -27.0, 0.125])
    assert float(jnp.max(jnp.abs(jax.jvp(jr.reverse(plain.bind), (y,), (jnp.ones(3),))[1]))) == 0
    t = jax.jvp(jr.reverse(ruled.bind), (y,), (jnp.ones(3),))[1]
    assert leaf_rel_error(t, 1.0 / (3 * jnp.cbrt(y) ** 2)) < 1e-14
    # inverse_jvp's "reverse" strategy goes through it, also with a parameter in the step
    f = lambda x, a: ruled.bind(x * a) + a  # noqa: E731
    x = jnp.array([0.5, 1.5, -2.0])
    _, (tx,) = jr.inverse_jvp(lambda x: f(x, 2.0), (x,), jnp.ones(3), method="reverse")
    J = jax.jacfwd(lambda x: f(x, 2.0))(x)
    assert leaf_rel_error(tx, jnp.linalg.solve(J, jnp.ones(3))) < 1e-12
    # the parameter's tangent is accounted for: d/da of reverse(f)(y, a)
    g = jax.grad(lambda a: jnp.sum(jr.reverse(f)(jnp.array([9.0, 3.5, 30.0]), a)))(2.0)
    g_ref = jax.grad(lambda a: jnp.sum(jnp.cbrt(jnp.array([9.0, 3.5, 30.0]) - a) / a))(2.0)
    assert abs(float(g) - float(g_ref)) < 1e-12


def test_register_inverse_jvp_errors():
    with pytest.raises(TypeError, match="expects a jax.extend.core.Primitive"):
        jr.register_inverse_jvp("cube", lambda *a: None)
    p = _cube_primitive(False)
    with pytest.raises(TypeError, match="expects a callable rule"):
        jr.register_inverse_jvp(p, 3)

    def bad_rule(t, out, x):
        return t

    jr.register_inverse_jvp(p, bad_rule)
    with pytest.raises(TypeError, match="inverse-JVP rule .*bad_rule for `test_cube`"):
        jax.jvp(jr.reverse(p.bind), (jnp.ones(2),), (jnp.ones(2),))


def test_recompute_changes_measured_memory():
    def step(x, w, mark):
        s = mark(jnp.sum(x))
        h = mark(jnp.maximum(mark(s * w), 0.0))  # one number a lossy step needs
        return x + mark(0.001 * h)

    def loop(mark):
        return lambda x, w: jax.lax.fori_loop(0, 50, lambda i, x: step(x, w, mark), x)

    x, w = jnp.linspace(-1.0, 1.0, 1000), 0.3
    plain, marked = loop(lambda v: v), loop(jr.recompute)
    # by default one number per iteration is kept; with every candidate marked, the loop's
    # carry (1000 numbers) is kept instead and the marked values are recomputed from it (the
    # final counter, which the output discards, is run forward, not stored)
    assert jr.memory_report(plain, x, w, checkpoint_every=None).total_bytes == 50 * 8
    assert jr.memory_report(marked, x, w, checkpoint_every=None).total_bytes == 50 * 1000 * 8
    # measured without checkpoints, as the report is (with them the checkpoint buffers
    # differ between the two programs and hide part of the difference)
    grad = lambda f: jax.grad(  # noqa: E731
        lambda x, w: jnp.sum(jr.reversible(f, checkpoint_every=None)(x, w) ** 2),
        argnums=(0, 1),
    )
    assert _temp(grad(marked), x, w) > _temp(grad(plain), x, w) + 0.9 * 50 * 1000 * 8
    ref = jax.grad(lambda x, w: jnp.sum(plain(x, w) ** 2), argnums=(0, 1))(x, w)
    assert (
        leaf_rel_error(grad(marked)(x, w), ref) < 1e-12
        and leaf_rel_error(grad(plain)(x, w), ref) < 1e-12
    )


def test_hook_and_forward_mode_compose_with_jvp():
    x, y = jnp.array([0.3, 0.7]), jnp.array([1.1, -0.4])
    f = lambda x, y: (jnp.sin(x) * y, x * y**2)  # noqa: E731
    assert (
        leaf_rel_error(
            jax.jvp(jr.forward_mode(f), (x, y), (x, y))[1], jax.jvp(f, (x, y), (x, y))[1]
        )
        < 1e-14
    )
    h = lambda x: jnp.sum(jr.hook(lambda g: 2 * g, x) ** 3)  # noqa: E731
    assert float(jax.jvp(h, (x,), (x,))[1]) == float(
        jax.jvp(lambda x: jnp.sum(x**3), (x,), (x,))[1]
    )
    assert (
        leaf_rel_error(jax.hessian(h)(x), jnp.diag(12 * x)) < 1e-14
    )  # the hook doubles the cotangent
    assert (
        leaf_rel_error(jax.vmap(jax.grad(h))(jnp.stack([x, y])), 6 * jnp.stack([x, y]) ** 2) < 1e-14
    )


def _bisection_cube(y, a):
    """x with x**3 + a x = y (a > 0), by bisection: a root-finder whose own derivative (through
    its iterations) is zero."""

    def body(_, lohi):
        lo, hi = lohi
        mid = 0.5 * (lo + hi)
        above = mid**3 + a * mid > y
        return jnp.where(above, lo, mid), jnp.where(above, mid, hi)

    lo, hi = jax.lax.fori_loop(0, 80, body, (jnp.full_like(y, -10.0), jnp.full_like(y, 10.0)))
    return 0.5 * (lo + hi)


def _implicit_root():
    solve = jr.custom_inverse(_bisection_cube, differentiate="inverse")
    solve.definverse(lambda x, a: x**3 + a * x)
    return solve


@pytest.mark.parametrize("how", ["jvp", "grad", "grad_of_vmap", "vmap_of_grad", "jit"])
def test_differentiate_through_the_inverse_is_the_implicit_derivative(how):
    """``custom_inverse(fun, differentiate="inverse")``: `fun`'s derivatives come from its
    inverse by the implicit function theorem (dx/dy = 1 / (3x² + a), dx/da = -x / (3x² + a)),
    not from the bisection's iterations (zero), in the state and in a parameter, one sample
    and a batch (one block per sample), eagerly and under `jit`."""
    solve = _implicit_root()
    y, a = jnp.array([0.7, -2.0, 5.0]), jnp.asarray(1.3)
    x = _bisection_cube(y, a)
    dx_dy, dx_da = 1 / (3 * x**2 + a), -x / (3 * x**2 + a)
    if how == "jvp":
        _, t = jax.jvp(solve, (y, a), (jnp.ones_like(y), jnp.asarray(0.5)))
        np.testing.assert_allclose(t, dx_dy + 0.5 * dx_da, rtol=1e-10)
        return
    loss = lambda y, a: jnp.sum(jnp.sin(solve(y, a)))  # noqa: E731
    want = (jnp.cos(x) * dx_dy, jnp.sum(jnp.cos(x) * dx_da))
    if how == "grad_of_vmap":
        got = jax.grad(
            lambda y, a: jnp.sum(jnp.sin(jax.vmap(solve, (0, None))(y, a))), argnums=(0, 1)
        )(y, a)
    elif how == "vmap_of_grad":
        g = jax.vmap(jax.grad(lambda y, a: jnp.sin(solve(y, a)), argnums=(0, 1)), (0, None))
        gy, ga = g(y, a)
        got = (gy, jnp.sum(ga))
    else:
        grad = jax.grad(loss, argnums=(0, 1))
        got = (jax.jit(grad) if how == "jit" else grad)(y, a)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10)
    # (the bisection's own derivative, for contrast: zero)
    plain = jr.custom_inverse(_bisection_cube)
    plain.definverse(lambda x, a: x**3 + a * x)
    assert float(jnp.max(jnp.abs(jax.grad(lambda y: jnp.sum(plain(y, a)))(y)))) == 0.0


def test_differentiate_through_the_inverse_refuses_what_only_the_function_sees():
    """A differentiated value that `fun` closes over and the inverse does not take has no
    implicit derivative: refused, saying to pass it as an argument; an unknown option is
    named."""
    a = jnp.asarray(1.3)

    def f(b):
        solve = jr.custom_inverse(lambda y: _bisection_cube(y, b), differentiate="inverse")
        solve.definverse(lambda x: x**3 + a * x)
        return jnp.sum(solve(jnp.array([0.7, 2.0])))

    with pytest.raises(TypeError, match="closes over a value being differentiated"):
        jax.grad(f)(a)
    with pytest.raises(ValueError, match="differentiate must be 'fun' or 'inverse'"):
        jr.custom_inverse(jnp.sin, differentiate="implicit")
    # (an integer state leaf beside a float one: nothing to solve for)
    both = jr.custom_inverse(
        lambda y, k: (_bisection_cube(y, a), k), argnums=(0, 1), differentiate="inverse"
    )
    both.definverse(lambda x, k: (x**3 + a * x, k))
    with pytest.raises(TypeError, match="integer or a complex leaf"):
        jax.jvp(lambda y: both(y, jnp.arange(2))[0], (jnp.array([0.7, 2.0]),), (jnp.ones(2),))


def test_differentiate_through_the_inverse_in_low_precision():
    """bfloat16 and float16 states: the implicit derivative's linear solve runs in float32
    (XLA has no LU below it) and comes back in the state's dtype, to its precision."""
    solve = _implicit_root()
    for dt, tol in ((jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)):
        y, a = jnp.array([0.7, -2.0, 5.0], dt), jnp.asarray(1.3, dt)
        g = jax.grad(lambda y: jnp.sum(solve(y, a)).astype(jnp.float32))(y)
        x = _bisection_cube(y.astype(jnp.float32), jnp.float32(1.3))
        assert g.dtype == dt
        np.testing.assert_allclose(g.astype(jnp.float32), 1 / (3 * x**2 + 1.3), rtol=tol)


def test_differentiate_through_the_inverse_edges():
    """A complex state is refused (its inverse need not be holomorphic: `conj`); an empty
    batch differentiates to an empty gradient, as `differentiate="fun"` does."""
    c = jr.custom_inverse(lambda x, p: jnp.conj(x) * p, differentiate="inverse")
    c.definverse(lambda y, p: jnp.conj(y / p))
    x = jnp.array([1.0 + 2.0j, 0.5 - 1.0j])
    with pytest.raises(TypeError, match="integer or a complex leaf"):
        jax.jvp(c, (x, 0.7), (jnp.array([1j, 1.0 + 0j]), 0.0))
    solve = _implicit_root()
    g = jax.grad(lambda Y: jnp.sum(jax.vmap(solve, (0, None))(Y, 1.3)))(jnp.zeros((0, 3)))
    assert g.shape == (0, 3)
