"""Programs of many shapes (calls, loops and branches nested in each other, inverses of inverses):
regression tests for the defects random-program testing found (issue 18), each a minimal
program written from the defect's description."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from programs.elements import rq_knots
from programs.families import family, loss

import jaxrev as jr

jax.config.update("jax_enable_x64", True)


def _loss(g):
    return lambda *a: sum(jnp.sum(jnp.sin(v)) for v in jax.tree_util.tree_leaves(g(*a)))


def _close(a, b, tol=1e-10):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_custom_jvp_closing_over_the_loop_counter():
    """1. A custom_jvp function closing over a fori_loop's counter, inside the loop body."""

    def f(s, P, custom=True):
        def body(i, c):
            s0, s1 = c

            def sub(P, s0, s1):
                s0 = s0 + 0.1 * i.astype(s0.dtype)
                return s0 + jnp.tanh(P[0] * s1), s1

            g = sub
            if custom:
                g = jax.custom_jvp(sub)
                g.defjvp(lambda pr, tg: jax.jvp(sub, pr, tg))
            s0, s1 = g(P, s0, s1)
            return s1, s0

        return lax.fori_loop(0, 3, body, s)

    P, s = jnp.array([0.7]), (jnp.ones(3), jnp.arange(3.0))
    want = jax.grad(_loss(lambda s, P: f(s, P, custom=False)), argnums=(0, 1))(s, P)
    got = jax.grad(_loss(jr.reversible(f)), argnums=(0, 1))(s, P)
    _close(got, want)


@pytest.mark.parametrize("inner", ["zero_trip", "fori", "masked", "while"])
def test_loop_nested_in_a_while_loop(inner):
    """2. A loop nested in a `jr.while_loop` body (a zero-trip loop, a fori_loop, one whose
    body selects with a mask it closes over, a plain while loop counting to a bound): the body
    inverts, and `reversible` stores nothing per iteration (the inner trip count follows from
    its counter)."""
    m = jnp.array([True, False, True])

    def f(s, P, ref=False):
        def step(x):
            if inner == "zero_trip":
                return lax.fori_loop(0, 0, lambda i, x: x * 2.0, x)
            if inner == "fori":
                return lax.fori_loop(0, 2, lambda i, x: x * P[0], x)
            body = lambda c: (c[0] + 1, jnp.where(m, c[1], c[1] + jnp.tanh(jnp.sum(c[1] * m))))
            if ref or inner == "masked":
                return lax.fori_loop(0, 2, lambda i, z: body((i, z))[1], x)
            return lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]

        if ref:  # the same program with its trip count fixed: what jax.grad differentiates
            return s[0] + 3.0, lax.fori_loop(0, 3, lambda i, x: step(x), s[1])
        return jr.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1.0, step(c[1])), s, lambda c: c[0] > 0
        )

    P, s = jnp.array([0.7]), (jnp.array(0.0), jnp.arange(3.0) - 0.5)
    _close(jr.reverse(f)(f(s, P), P), s)
    want = jax.grad(_loss(lambda s, P: f(s, P, ref=True)), argnums=(0, 1))(s, P)
    _close(jax.grad(_loss(jr.reversible(f)), argnums=(0, 1))(s, P), want)


def test_inverse_ad_through_custom_vjp():
    """3. inverse_jvp / inverse_vjp / slogdet_jacobian differentiate a custom_vjp function's
    primal computation (also inside a scan)."""

    def prim(x, p):
        return x + jnp.tanh(p * x[::-1])

    g = jax.custom_vjp(prim)
    g.defvjp(lambda x, p: (prim(x, p), (x, p)), lambda r, ct: jax.vjp(prim, *r)[1](ct))

    def f(x, use=g):
        return lax.scan(lambda c, _: (use(c, 0.4) * 1.5, None), x, None, length=2)[0]

    x = jnp.arange(4.0) * 0.3
    v = jnp.cos(jnp.arange(4.0))
    J = jax.jacfwd(lambda x: f(x, prim))(x)
    _close(jr.inverse_jvp(f, (x,), v)[1][0], jnp.linalg.solve(J, v))
    _close(jr.inverse_vjp(f, x)[1]((v,)), jnp.linalg.solve(J.T, v))
    sign, logdet = jr.slogdet_jacobian(f, x)
    want = jnp.linalg.slogdet(J)
    assert float(sign) == float(want[0])
    _close(logdet, want[1])
    # a custom_jvp whose rule differentiates the custom_vjp function (JAX cannot JVP it)
    h = jax.custom_jvp(lambda x: f(x))
    h.defjvp(lambda pr, tg: jax.jvp(lambda x: f(x), pr, tg))
    _close(jr.inverse_jvp(h, (x,), v)[1][0], jnp.linalg.solve(J, v))


@pytest.mark.parametrize(
    "name",
    [
        "roll0",
        "roll",
        "sqrt",
        "cbrt",
        "rsqrt",
        "logistic",
        "strided",
        "strided_set",
        "slice_of_strided_slice",
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_reverse_of_an_inverse(name, jit):
    """4. `reverse(reverse(f)) == f` where an inverse rule emits a scatter, a power or a log."""
    f = {
        "roll0": lambda x: jnp.roll(x, 0, axis=1),
        "roll": lambda x: jnp.roll(x, 2, axis=1) * 2.0,
        "sqrt": lambda x: jnp.sqrt(x) + 1.0,
        "cbrt": lambda x: jnp.cbrt(x) * 3.0,
        "rsqrt": lambda x: lax.rsqrt(x) - 1.0,
        "logistic": lambda x: jax.nn.sigmoid(x) * 2.0,
        "strided": lambda x: jnp.concatenate([x[:, ::2], x[:, 1::2]], axis=1),
        "strided_set": lambda x: x.at[:, ::2].multiply(2.0),
        # a scatter into column 1 of a slice of a strided slice (indices from `iota`)
        "slice_of_strided_slice": lambda x: x.at[:, 1::2].add(x[:, ::2][:, :1]),
    }[name]
    x = jnp.arange(6.0).reshape(2, 3) + 1.0
    rr = jr.reverse(jr.reverse(f))
    _close((jax.jit(rr) if jit else rr)(x), f(x), 1e-12)


@pytest.mark.parametrize("where", ["top", "scan"])
def test_cond_passing_a_leaf_through(where):
    """5. A `lax.cond` whose branches pass a leaf through unchanged."""

    def step(a, b, k):
        return lax.cond(
            k > 0, lambda a, b: (a * 2.0 + jnp.tanh(b), b), lambda a, b: (a + 1.0, b), a, b
        )

    def f(s, k):
        if where == "top":
            a, b = step(*s, k)
            return a, b
        return lax.scan(lambda c, _: (step(*c, k)[::-1], None), s, None, length=3)[0]

    s, k = (jnp.ones(3), jnp.arange(3.0)), 1
    y = f(s, k)
    _close(jr.reverse(f)(y, k), s)
    _close(jax.jit(jr.reverse(f))(y, k), s)
    _close(jr.reverse(jr.reverse(f))(s, k), y)  # the inverse's own cond passes `b` through
    _close(jax.grad(_loss(jr.reversible(f)))(s, k), jax.grad(_loss(f))(s, k))
    J = jax.jacfwd(lambda v: jnp.concatenate(f((v[:3], v[3:]), k)))(jnp.concatenate(s))
    sign, logdet = jr.slogdet_jacobian(lambda s: f(s, k), s)
    _close(logdet, jnp.linalg.slogdet(J)[1])


def test_a_lossy_step_whose_input_is_known_elsewhere_is_not_singular():
    """A zero factor (`0 * sum(x * mask)`) destroys nothing when `sum(x * mask)` follows from
    the elements a `where` kept: J⁻¹v is not refused as singular."""
    m = jnp.array([True, False, True])

    def f(x, w):
        s = jnp.sum(x * m)
        return jnp.where(m, x, x * jnp.exp(0.3 * jnp.tanh(w * s)) + jnp.tanh(s))

    x, w = jnp.array([0.3, -0.4, 0.9]), jnp.zeros(3)
    J = jax.jacfwd(lambda x: f(x, w))(x)
    v = jnp.cos(jnp.arange(3.0))
    _close(
        jr.inverse_jvp(lambda x: f(x, w), (x,), v, method="reverse")[1][0], jnp.linalg.solve(J, v)
    )


def test_reverse_of_an_inverse_whose_cond_one_branch_does_not_read():
    """5 (found by the grammar). The inverse of a cond whose branches pass `a` through is a
    cond that reads `a` in one branch only; reversing it, `a` comes from outside the cond."""
    m = jnp.array([False, True, False, False])

    def f(s, p):
        a, b = s
        for w in p["w"]:
            a = a * jnp.exp(0.3 * w)
        return lax.cond(
            p["k"] > 0,
            lambda a, b: (a, jnp.where(m, b, b * jnp.exp(0.3 * jnp.tanh(a)) + jnp.tanh(a))),
            lambda a, b: (a, b * 1.25),
            a,
            b,
        )

    p = {"w": jnp.array([[0.0] * 4, [0.0] * 4, [0.0, -0.86, -0.24, 0.97]]), "k": jnp.array(0.16)}
    s = (jnp.array([0.95, 0.0025, 0.00375, 0.0628]), jnp.array([0.00625, -0.99, 0.47, 1.22]))
    inv = jr.reverse(f)
    _close(inv(f(s, p), p), s)
    _close(jr.reverse(inv)(s, p), f(s, p))
    _close(jax.jit(jr.reverse(inv))(s, p), f(s, p))


def test_counted_plain_while_loop_runs_backwards():
    """A plain `lax.while_loop` whose condition reads only a counter: `reverse` computes the
    trip count from the counter (eagerly, under jit, twice reversed), `reversible` stores
    nothing; one whose condition reads the state is still refused, naming its line."""

    def f(s, p):
        def body(c):
            k, a, b = c
            return k + 1, b, a + jnp.tanh(p * b)

        _, a, b = lax.while_loop(lambda c: c[0] < 3, body, (0, *s))
        return a, b

    s, p = (jnp.ones(3), jnp.arange(3.0)), 0.5
    y = f(s, p)
    _close(jr.reverse(f)(y, p), s)
    _close(jax.jit(jr.reverse(f))(y, p), s)
    _close(jr.reverse(jr.reverse(f))(s, p), y)
    assert "stores nothing" in str(jr.memory_report(f, s, p, checkpoint_every=None))

    def g(s, p):  # the trip count depends on the state: <state while>
        return lax.while_loop(lambda c: c[0][0] < 3.0, lambda c: (c[0] + 1.0, c[1] * p), s)

    s2 = (jnp.zeros(1), jnp.ones(2))
    with pytest.raises(jr.NotInvertibleError, match="does not record how many times") as e:
        jr.reverse(g)(g(s2, 2.0), 2.0)
    line = next(k for k, t in enumerate(open(__file__), 1) if "<state while>" in t)
    assert f"test_program_shapes.py:{line + 1}:" in str(e.value)


@pytest.mark.parametrize("loop", ["fori", "while"])
def test_cond_branch_reading_the_loop_counter(loop):
    """(found by the grammar) A cond in a loop body whose one branch reads the loop counter:
    the counter is rebuilt from its increment, so `reversible` stores nothing and a plain
    while loop of a fixed trip count is not refused."""
    w = jnp.array([0.0, -0.18, 0.1, 0.0])

    def f(c, k, ref=False):
        def body(i, c):
            def yes(c):
                c = c + 0.1 * i.astype(c.dtype)
                return lax.fori_loop(1, 4, lambda j, x: x.at[j].add(jnp.tanh(w[j] * x[j - 1])), c)

            return lax.cond(k > 0, yes, lambda c: c * 1.25, c)

        if loop == "fori" or ref:
            return lax.fori_loop(0, 2, body, c)
        return lax.while_loop(lambda s: s[0] < 2, lambda s: (s[0] + 1, body(*s)), (0, c))[1]

    c = jnp.array([0.3, -0.2, 0.5, 0.1])
    want = jax.grad(_loss(lambda c: f(c, 0.6, ref=True)))(c)
    _close(jax.grad(_loss(jr.reversible(lambda c: f(c, 0.6))))(c), want)
    assert "stores nothing" in str(jr.memory_report(f, c, 0.6, checkpoint_every=None))


def test_inverse_vjp_goes_on_when_the_programs_own_grouping_looks_singular():
    """(found by the grammar) A masked coupling after `jnp.roll`: the inverse program's
    grouping of steps looks singular, the step Jacobians ("linearize") are not."""
    m = jnp.array([False, False, False, True])
    w = jnp.array([0.0, -0.5838, 0.0236, -0.8914])

    def f(a):
        a = jnp.roll(a, 2)
        s = jnp.sum(a * m)
        return jnp.where(m, a, a * jnp.exp(0.3 * jnp.tanh(w * s)) + jnp.tanh(s))

    a = jnp.array([0.3, -0.2, 0.5, 0.1])
    J = jax.jacfwd(f)(a)
    v = jnp.cos(jnp.arange(4.0))
    _close(jr.inverse_vjp(f, a)[1]((v,)), jnp.linalg.solve(J.T, v))
    _close(jr.inverse_jvp(f, (a,), v)[1][0], jnp.linalg.solve(J, v))


# ----------------------------------------------------------------------------- issue 28


def test_mask_from_a_parameter_inside_vmap():
    """`where(P[1] > 0, s0 * P[2], s0 + P[3])` per row under `vmap`: the factors broadcast over
    the batch axis as `(1, n)` operands of `mul`/`add` (lax broadcasts size-1 axes), which the
    element rules read like scalars; each case is an invertible affine map chosen by a known
    mask."""

    def f(s, P):
        def row(s0):
            s0 = s0 * P[0]
            return jnp.where(P[1] > 0, s0 * P[2], s0 + P[3])

        return jax.vmap(row)(s)

    s = jnp.array([[1.0, 2.0], [3.0, -4.0]])
    P = jnp.array([[1.5, 2.0], [1.0, -1.0], [2.0, 3.0], [0.5, 0.7]])
    y = f(s, P)
    _close(jr.reverse(f)(y, P), s, 1e-12)
    _close(jax.jit(jr.reverse(f))(y, P), s, 1e-12)
    _close(
        jax.grad(_loss(jr.reversible(f)), argnums=(0, 1))(s, P),
        jax.grad(_loss(f), argnums=(0, 1))(s, P),
    )


def _spline_by_select(x, p, bound=3.0):
    """A rational-quadratic spline written as `jnp.select` over its bins (each bin's piece
    computed everywhere, the bin's own condition picks it), identity outside [-B, B)."""
    xk, yk, d = p["xk"], p["yk"], p["d"]
    conds, vals = [], []
    for i in range(xk.shape[0] - 1):
        w, h = xk[i + 1] - xk[i], yk[i + 1] - yk[i]
        s = h / w
        z = (x - xk[i]) / w
        num = h * (s * z * z + d[i] * z * (1 - z))
        den = s + (d[i + 1] + d[i] - 2 * s) * z * (1 - z)
        conds.append((x >= xk[i]) & (x < xk[i + 1]))
        vals.append(yk[i] + num / den)
    return jnp.where(jnp.abs(x) < bound, jnp.select(conds, vals, x), x)


@pytest.mark.parametrize(
    "how",
    [
        pytest.param("eager", marks=pytest.mark.slow),
        "jit",
        "vmap",
        pytest.param("vmap inside", marks=pytest.mark.slow),
        "jit inside",
    ],
)
def test_spline_by_select_over_bins(how):
    """The bin index is an argmax over the stacked conditions: it only decides the select's
    case, so each branch inverts one bin's piece (consistency picks the bin). A candidate near
    0 computed through knots of order 1 agrees with the others to their rounding."""
    p = rq_knots(jax.random.PRNGKey(3))
    x = jnp.linspace(-4.0, 4.0, 11) + 0.013  # 0.013: inside a bin, next to 0
    y = _spline_by_select(x, p)
    f = _spline_by_select
    if how == "eager":
        got = jr.reverse(f)(y, p)
    elif how == "jit":
        got = jax.jit(jr.reverse(f))(y, p)
    elif how == "vmap":
        got = jax.vmap(jr.reverse(f), (0, None))(y[:, None], p)[:, 0]
    elif how == "vmap inside":
        got = jr.reverse(lambda x, p: jax.vmap(lambda e: f(e, p))(x))(y, p)
    else:
        got = jr.reverse(jax.jit(f))(y, p)
    _close(got, x, 1e-12)
    if how == "eager":
        _close(
            jax.grad(_loss(jr.reversible(f)), argnums=(0, 1))(x, p),
            jax.grad(_loss(f), argnums=(0, 1))(x, p),
        )


def test_masked_steps_with_a_batched_mask():
    """Per-step masks from a time parameter that differs per batch element."""
    f, s, _ = family("per_step", 4, n=6)
    S = jax.tree_util.tree_map(lambda v: jnp.stack([v, 0.5 * v, -v]), s)
    P = {"t": jnp.array([1.5, 2.5, 4.5])}
    Y = jax.vmap(f)(S, P)
    _close(jax.vmap(jr.reverse(f))(Y, P), S, 1e-12)
    _close(jax.jit(jax.vmap(jr.reverse(f)))(Y, P), S, 1e-12)
    _close(jr.reverse(jax.vmap(f))(Y, P), S, 1e-12)
    _close(
        jax.vmap(jax.grad(loss(jr.reversible(f)), argnums=(0, 1)))(S, P),
        jax.vmap(jax.grad(loss(f), argnums=(0, 1)))(S, P),
    )


@pytest.mark.parametrize(
    "name",
    ["coupled steps", "masked coupling", "jr.cond", pytest.param("spline", marks=pytest.mark.slow)],
)
def test_reverse_is_closed_under_its_own_inverses(name):
    """reverse(reverse(f)) == f for what the walk emits with element masks, fill values and
    consistent-case choices (the inverse is one step whose inverse is f), eager and jitted."""
    if name == "coupled steps":  # issue 28's forty unrolled steps

        def f(s, c):
            x, y = s
            for i in range(40):
                x = x + jnp.tanh(c * y + i)
                y = y - jax.nn.softplus(x) * 0.1
            return x, y

        s, c = (jnp.linspace(-1.0, 1.0, 5), jnp.linspace(0.0, 1.0, 5)), jnp.asarray(0.7)
    elif name == "masked coupling":  # found by the grammar: a per-element parameter mask

        def f(s, c):
            a, b = s
            t2 = a + jnp.tanh(b[::-1])
            u3 = b + jnp.sin(c["w4"] * t2)
            return jnp.where(c["w1"] > 0, t2, a), jnp.where(c["w1"] > 0, u3, b)

        s = (jnp.array([0.0025, 0.005]), jnp.array([0.0075, 0.01]))
        c = {"w1": jnp.array([0.3, -0.2]), "w4": jnp.array([0.5, 0.7])}
    elif name == "jr.cond":

        def f(s, c):
            return (
                jr.cond(s[0] > 0, lambda v: v * 2.0, lambda v: v - 10.0, s, post=lambda v: v[0] > 0)
                * c
            )

        s, c = jnp.array([0.5, -1.0, 2.0]), jnp.asarray(1.5)
    else:
        f = _spline_by_select
        s, c = jnp.linspace(-2.5, 2.5, 7) + 0.01, rq_knots(jax.random.PRNGKey(3))
    y = f(s, c)
    inv = jr.reverse(f)
    _close(inv(y, c), s, 1e-10)
    _close(jr.reverse(inv)(s, c), y, 1e-10)
    _close(jax.jit(jr.reverse(inv))(s, c), y, 1e-10)
    _close(jr.reverse(jr.reverse(inv))(y, c), s, 1e-10)
