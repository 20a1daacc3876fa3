"""Issue 28: the flows entry points and the user's rules.

- a `deflogdet` rule is what every entry point (`slogdet_jacobian`, `forward_and_slogdet`,
  `inverse_and_slogdet`, `Bijector`) returns for its step, eagerly, under `jit` and under
  `vmap`, alone and inside a larger program (the rule gives its step's part, the sweep the
  rest): a rule that returns the true log|det| plus `OFFSET` proves it is used, and a correct
  rule matches `slogdet(jacfwd)` in float64;
- a singular step raises, eagerly, a `SingularJacobianError` naming its primitive and this
  file's line, from every entry point;
- the dense fall-back passes `jax.custom_vjp` functions (forward mode through their primal
  computation, reverse mode through the user's rule where forward mode is not available).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxrev as jr

TOL = 1e-10
HERE = os.path.basename(__file__)
OFFSET = 1.25  # what the user's (deliberately different) rule adds to the true log|det|
N = 5
W = jnp.linspace(-0.5, 0.5, N)
XS = jnp.stack([jnp.linspace(-1, 1, N), jnp.linspace(0.3, -0.9, N), jnp.linspace(2, 1, N)])


def _true_logdet(x):
    return jnp.sum(jnp.log1p(0.5 * jnp.cos(x)))


def _bump(rule):
    """x + sin(x)/2 (monotone, no closed-form inverse) with Newton's method as its inverse
    and `rule` as its log-determinant."""

    @jr.custom_inverse
    def f(x):
        return x + 0.5 * jnp.sin(x)

    @f.definverse
    def f_inv(y):
        return lax.fori_loop(
            0, 40, lambda i, x: x - (x + 0.5 * jnp.sin(x) - y) / (1 + 0.5 * jnp.cos(x)), y
        )

    f.deflogdet(rule)
    return f


def _composed(f):
    """The custom step inside a larger program: scaled before, mixed (cumsum), scaled and
    reversed after; log|det| = the step's + N log 2 + ΣW, sign +1."""
    return lambda x: jnp.cumsum(f(2.0 * x) * jnp.exp(W))[::-1]


def _rest(x):
    """The part of `_composed`'s log|det| that the sweep gives, and the custom step's input."""
    return N * np.log(2.0) + float(jnp.sum(W)), 2.0 * x


def _entry_points(g):
    """log|det| of `g` at each sample of XS, and the sign where one is returned, from every
    entry point, eagerly, under jit and under vmap."""
    ys = jax.vmap(g)(XS)
    sd = lambda x: jr.slogdet_jacobian(g, x)  # noqa: E731
    b = jr.Bijector(g)
    out = {
        "slogdet": [sd(x) for x in XS],
        "slogdet jit": [jax.jit(sd)(x) for x in XS],
        "slogdet vmap": list(zip(*jax.vmap(sd)(XS))),
        "forward": [jr.forward_and_slogdet(g)(x)[1] for x in XS],
        "forward jit": [jax.jit(jr.forward_and_slogdet(g))(x)[1] for x in XS],
        "forward vmap": list(jax.vmap(jr.forward_and_slogdet(g))(XS)[1]),
        "inverse": [-jr.inverse_and_slogdet(g)(y)[1] for y in ys],
        "inverse jit": [-jax.jit(jr.inverse_and_slogdet(g))(y)[1] for y in ys],
        "inverse vmap": list(-jax.vmap(jr.inverse_and_slogdet(g))(ys)[1]),
        "bijector forward": list(b.forward_log_det_jacobian(XS)),
        "bijector forward one": [b.forward_and_log_det(x)[1] for x in XS],
        "bijector forward jit": list(jax.jit(b.forward_log_det_jacobian)(XS)),
        "bijector inverse": list(-b.inverse_log_det_jacobian(ys)),
        "bijector inverse one": [-b.inverse_and_log_det(y)[1] for y in ys],
        "bijector inverse jit": list(-jax.jit(b.inverse_log_det_jacobian)(ys)),
    }
    return out


def _check(got, want_logdet, want_sign=None):
    for name, vals in got.items():
        for k, v in enumerate(vals):
            if name.startswith("slogdet"):
                sign, v = v
                if want_sign is not None:
                    assert float(sign) == float(want_sign[k]), (name, k)
            assert abs(float(v) - float(want_logdet[k])) < TOL * max(1.0, abs(want_logdet[k])), (
                name,
                k,
                float(v),
                float(want_logdet[k]),
            )


@pytest.mark.parametrize("signed", [False, True])
def test_deflogdet_rule_is_used_by_every_entry_point(signed):
    if signed:  # a stated sign (not the true one: the Jacobian's is +1) is returned as it is
        f = _bump(lambda x: (-1.0, _true_logdet(x) + OFFSET))
    else:  # log|det| only: the sign is the true Jacobian's
        f = _bump(lambda x: _true_logdet(x) + OFFSET)
    sign = [-1.0 if signed else 1.0] * len(XS)
    _check(_entry_points(f), [float(_true_logdet(x)) + OFFSET for x in XS], sign)
    # inside a larger program: the rule gives its step's part, the sweep the rest
    want = []
    for x in XS:
        rest, inner = _rest(x)
        want.append(rest + float(_true_logdet(inner)) + OFFSET)
    _check(_entry_points(_composed(f)), want, sign)
    # vmapped inside the program: the rule per sample, summed
    s, ld = jr.slogdet_jacobian(lambda xs: jax.vmap(f)(xs), XS)
    assert abs(float(ld) - (float(sum(_true_logdet(x) for x in XS)) + len(XS) * OFFSET)) < TOL
    assert float(s) == ((-1.0) ** len(XS) if signed else 1.0)
    how = jr.logdet_strategy(_composed(f), XS[0])
    assert how == "sweep" if signed else how.startswith("sweep (log|det| only: a `deflogdet`")


def _solve_bump(rule):
    """The inverse of `_bump`'s map as the function (Newton's method: the costly direction),
    the map itself as its inverse, and `rule` the log-determinant of that inverse at the
    outputs (``deflogdet(..., of_inverse=True)``)."""

    @jr.custom_inverse
    def f(y):
        return lax.fori_loop(
            0, 40, lambda i, x: x - (x + 0.5 * jnp.sin(x) - y) / (1 + 0.5 * jnp.cos(x)), y
        )

    f.definverse(lambda x: x + 0.5 * jnp.sin(x))
    f.deflogdet(rule, of_inverse=True)
    return f


def test_an_inverse_rule_at_the_outputs_gives_the_functions_log_det():
    """The default tier's check of ``of_inverse=True`` (the slow test below takes every entry
    point): forward eagerly, inverse under jit, a vmapped `slogdet_jacobian`."""
    f = _solve_bump(lambda x: _true_logdet(x) + OFFSET)
    want = [-float(_true_logdet(f(x))) - OFFSET for x in XS]
    y, ld = jr.forward_and_slogdet(f)(XS[0])
    assert abs(float(ld) - want[0]) < TOL
    x, ldi = jax.jit(jr.inverse_and_slogdet(f))(y)
    assert abs(float(ldi) + want[0]) < TOL and float(jnp.max(jnp.abs(x - XS[0]))) < TOL
    s, lds = jax.vmap(lambda x: jr.slogdet_jacobian(f, x))(XS)
    np.testing.assert_allclose(lds, want, rtol=TOL, atol=TOL)
    assert np.all(np.asarray(s) == 1.0)


@pytest.mark.slow  # every entry point, each three ways (about 13 s each)
@pytest.mark.parametrize("signed", [False, True])
def test_an_inverse_rule_at_the_outputs_is_used_by_every_entry_point(signed):
    """`deflogdet(rule, of_inverse=True)`: `rule` takes the outputs and gives the inverse's
    log|det|; every entry point uses its negative (the sign as stated), eagerly, under jit
    and vmap, alone and inside a larger program."""
    if signed:
        f = _solve_bump(lambda x: (-1.0, _true_logdet(x) + OFFSET))
    else:
        f = _solve_bump(lambda x: _true_logdet(x) + OFFSET)
    sign = [-1.0 if signed else 1.0] * len(XS)
    _check(_entry_points(f), [-float(_true_logdet(f(x))) - OFFSET for x in XS], sign)
    want = []
    for x in XS:
        rest, inner = _rest(x)
        want.append(rest - float(_true_logdet(f(inner))) - OFFSET)
    _check(_entry_points(_composed(f)), want, sign)
    # a correct rule is the dense Jacobian's
    g = _solve_bump(lambda x: (1.0, _true_logdet(x)))
    ref = [jnp.linalg.slogdet(jax.jacfwd(g)(x)) for x in XS]
    got = [jr.slogdet_jacobian(g, x) for x in XS]
    for (s_ref, l_ref), (s_got, l_got) in zip(ref, got):
        assert float(s_got) == float(s_ref) and abs(float(l_got) - float(l_ref)) < TOL


@pytest.mark.parametrize("signed", [False, True])
def test_correct_rule_matches_the_dense_slogdet(signed):
    f = _bump((lambda x: (1.0, _true_logdet(x))) if signed else _true_logdet)
    g = _composed(f)
    ref = [jnp.linalg.slogdet(jax.jacfwd(g)(x)) for x in XS]
    _check(_entry_points(g), [float(r[1]) for r in ref], [float(r[0]) for r in ref])


# --------------------------------------------------------------------------- singular steps


def scale(x, w):
    return jnp.cumsum(x * w)  # singular where w has a zero (a parameter's pivot)


def cube(x):
    return jnp.cumsum(x**3)  # singular where x has a zero (the state's pivot)


def swapped(x):
    x = lax.fori_loop(0, 2, lambda i, x: x.at[i].set(x[3 - i]).at[3 - i].set(x[i]), x)
    return x**3  # singular; the swaps' sign is decided at run time


@jr.custom_inverse
def _flat_spot(x):
    return x**3


_flat_spot.definverse(jnp.cbrt)
_flat_spot.deflogdet(lambda x: jnp.sum(jnp.log(3 * x**2)))


def custom(x):
    return _flat_spot(x) + 1.0  # the rule's log|det| is -inf where x has a zero


X0 = jnp.array([1.0, 0.5, -2.0, 0.7])
WZ = jnp.array([1.0, 0.0, 2.0, 0.5])
XZ = jnp.array([1.0, 0.0, -2.0, 0.7])
SINGULAR = {  # name: (fun, x, params, primitive, line)
    "scale": (scale, X0, (WZ,), "mul", scale.__code__.co_firstlineno + 1),
    "cube": (cube, XZ, (), "integer_pow", cube.__code__.co_firstlineno + 1),
    "swapped": (swapped, XZ, (), "integer_pow", swapped.__code__.co_firstlineno + 2),
    "custom": (custom, XZ, (), "jaxrev_custom_inverse", custom.__code__.co_firstlineno + 1),
}


def _singular_calls(f, x, params):
    y = f(x, *params)
    b = jr.Bijector(f)
    return {
        "slogdet_jacobian": lambda: jr.slogdet_jacobian(f, x, *params),
        "forward_and_slogdet": lambda: jr.forward_and_slogdet(f)(x, *params),
        "inverse_and_slogdet": lambda: jr.inverse_and_slogdet(f)(y, *params),
        "Bijector.forward_and_log_det": lambda: b.forward_and_log_det(x, *params),
        "Bijector.inverse_and_log_det": lambda: b.inverse_and_log_det(y, *params),
        # a batch, called eagerly: the failed sample runs again alone to name the step
        "Bijector.forward_log_det_jacobian": lambda: b.forward_log_det_jacobian(
            jnp.stack([0.5 + jnp.abs(x), x]), *params
        ),
        "Bijector.inverse_log_det_jacobian": lambda: b.inverse_log_det_jacobian(
            jnp.stack([y, y]), *params
        ),
    }


@pytest.mark.parametrize("name", sorted(SINGULAR))
def test_singular_step_is_named_eagerly_by_every_entry_point(name):
    f, x, params, prim, line = SINGULAR[name]
    if name == "swapped":
        assert "log|det| only" in jr.logdet_strategy(f, X0)
    for entry, call in _singular_calls(f, x, params).items():
        with pytest.raises(jr.SingularJacobianError) as e:
            call()
        msg = str(e.value)
        assert e.value.primitive == prim, (entry, msg)
        assert e.value.line == line and f"{HERE}:{line}:" in msg, (entry, msg)
        assert f"`{prim}`" in msg and "singular" in msg, (entry, msg)
    # on_error="nan": the exact answer instead, sign 0 and -inf
    sign, ld = jr.slogdet_jacobian(f, x, *params, on_error="nan")
    assert float(sign) == 0.0 and float(ld) == -np.inf


def test_dense_fallback_singular_says_why_it_is_dense():
    K = jnp.zeros((3, 3, 2, 2)).at[1, 1].set(jnp.array([[1.0, 0.0], [0.0, 0.0]]))
    f = lambda x: lax.conv_general_dilated(  # noqa: E731  (the step the sweep cannot take)
        x[None], K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )[0]
    line = f"{HERE}:{f.__code__.co_firstlineno}"
    x = jnp.linspace(-1, 1, 18).reshape(3, 3, 2)
    assert jr.logdet_strategy(f, x).startswith("dense:")
    for call in (lambda: jr.slogdet_jacobian(f, x), lambda: jr.forward_and_slogdet(f)(x)):
        with pytest.raises(jr.SingularJacobianError, match="dense Jacobian") as e:
            call()
        assert "conv_general_dilated" in str(e.value) and line in str(e.value)
    sign, ld = jr.slogdet_jacobian(f, x, method="dense", on_error="nan")
    assert float(sign) == 0.0 and float(ld) == -np.inf


# --------------------------------------------------------------------------- custom_vjp


@jax.custom_vjp
def softsign(x):
    return x / (1 + jnp.abs(x))


softsign.defvjp(lambda x: (softsign(x), x), lambda x, g: (g / (1 + jnp.abs(x)) ** 2,))


@jax.custom_vjp
def host_tanh(x):
    # a callback: forward mode cannot pass it, only the user's VJP can
    return jax.pure_callback(
        np.tanh, jax.ShapeDtypeStruct(x.shape, x.dtype), x, vmap_method="sequential"
    )


host_tanh.defvjp(lambda x: (host_tanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))

_K = jnp.zeros((3, 3, 2, 2)).at[1, 1].set(jnp.eye(2)) + 0.05 * jax.random.normal(
    jax.random.PRNGKey(0), (3, 3, 2, 2)
)


def _conv(x):
    return lax.conv_general_dilated(
        x[None], _K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )[0]


@pytest.mark.parametrize("helper", [softsign, host_tanh], ids=["softsign", "host_tanh"])
def test_dense_fallback_through_custom_vjp(helper):
    f = lambda x: _conv(helper(x)) + 0.1 * x  # noqa: E731
    xs = jnp.stack([jnp.linspace(-1, 1, 32), jnp.linspace(0.9, -0.4, 32)]).reshape(2, 4, 4, 2)
    assert jr.logdet_strategy(f, xs[0]).startswith("dense:")
    ref = [
        jnp.linalg.slogdet(jax.jacrev(lambda v: f(v.reshape(x.shape)).reshape(-1))(x.reshape(-1)))
        for x in xs
    ]
    sd = lambda x: jr.slogdet_jacobian(f, x)  # noqa: E731
    fw = jr.forward_and_slogdet(f)
    for k, x in enumerate(xs):
        for s, ld in (sd(x), jax.jit(sd)(x)):
            assert float(s) == float(ref[k][0]) and abs(float(ld - ref[k][1])) < TOL
        for y, ld in (fw(x), jax.jit(fw)(x)):
            assert abs(float(ld - ref[k][1])) < TOL
            assert float(jnp.max(jnp.abs(y - f(x)))) < 1e-14
    s, ld = jax.vmap(sd)(xs)
    _, ld2 = jax.vmap(fw)(xs)
    for k in range(len(xs)):
        assert float(s[k]) == float(ref[k][0]) and abs(float(ld[k] - ref[k][1])) < TOL
        assert abs(float(ld2[k] - ref[k][1])) < TOL
    s, ld = jr.slogdet_jacobian(f, xs[0], method="dense")
    assert float(s) == float(ref[0][0]) and abs(float(ld - ref[0][1])) < TOL


@jax.custom_vjp
def ctanh(x):
    return jnp.tanh(x)


ctanh.defvjp(lambda x: (ctanh(x), x), lambda x, g: (g * (1 - jnp.tanh(x) ** 2),))


def test_linearized_sweep_through_custom_vjp():
    w = jnp.linspace(0.2, 1.0, 12)

    def f(x):
        for _ in range(2):
            x = x.at[1:].add(ctanh(w[1:] * x[:-1]))
            x = x * 1.1 + 0.1 * x**3
        return x

    x = jnp.linspace(-1, 1, 12)
    assert jr.logdet_strategy(f, x) == "sweep (linearized)"
    rs, rl = jnp.linalg.slogdet(jax.jacrev(f)(x))
    for s, ld in (jr.slogdet_jacobian(f, x), jax.jit(lambda x: jr.slogdet_jacobian(f, x))(x)):
        assert float(s) == float(rs) and abs(float(ld - rl)) < TOL
    assert abs(float(jr.forward_and_slogdet(f)(x)[1] - rl)) < TOL


@pytest.mark.parametrize(
    "lower,trans,unit,left",
    [
        (True, 0, False, True),
        (False, 1, False, True),
        (True, 0, True, True),
        (False, 0, False, False),
    ],
)
def test_triangular_solve_inverts_and_logdets_by_its_own_rule(lower, trans, unit, left):
    """`solve_triangular(A, x)` (flowjax's inverted `TriangularAffine`) inverts by the product
    it undoes; its log-det is the diagonal's, once per solved column, from the rule (the sweep,
    not the dense Jacobian)."""
    A = jnp.tril(0.4 * jax.random.normal(jax.random.key(1), (4, 4)), -1) + jnp.diag(
        jnp.array([1.5, -0.7, 2.0, 0.9])
    )
    A = A if lower else A.T
    f = (
        (
            lambda x: jax.scipy.linalg.solve_triangular(
                A, x, lower=lower, trans=trans, unit_diagonal=unit
            )
        )
        if left
        else (lambda x: lax.linalg.triangular_solve(A, x, left_side=False, lower=lower))
    )
    x = jax.random.normal(jax.random.key(2), (4, 3) if left else (3, 4))
    np.testing.assert_allclose(jax.jit(jr.reverse(f))(f(x)), x, rtol=1e-12, atol=1e-12)
    s, ld = jr.slogdet_jacobian(f, x)
    J = jax.jacfwd(f)(x).reshape(x.size, x.size)
    rs, rl = jnp.linalg.slogdet(J)
    assert float(s) == float(rs) and abs(float(ld - rl)) < TOL
    assert jr.logdet_strategy(f, x) == "sweep"
