"""flowjax's and numpyro's bijections taken as they are (issue 33): the forward map alone,
inverted and log-det'ed by jaxrev, against the library's own inverse and log-det.

What each test pins down: a float power's inverse is right on both signs or refused (never
the positive root for a negative input); flowjax's layer stacking (a `scan` carrying a log-det
it never returns) inverts; Equinox's `error_if` checks are checks, not steps to invert, and
never fire on good inputs inside jaxrev's own tracing; a whole flowjax module passes as an
argument (its Python ints are static, as `eqx.filter_jit` keeps them); numpyro's reshape and
unpack transforms are answered with `state=`, or refused naming the transform.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import jaxrev as jr

jax.config.update("jax_enable_x64", True)
eqx = pytest.importorskip("equinox")
fb = pytest.importorskip("flowjax.bijections")
flows = pytest.importorskip("flowjax.flows")
from flowjax.distributions import Normal  # noqa: E402

KEY = jax.random.key(0)


def close(a, b, tol=1e-10):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- float powers


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
@pytest.mark.parametrize("p", [3.0, -3.0, 1.0, 5.0])
def test_odd_float_power_inverts_on_both_signs(p, how):
    f = lambda x: jnp.power(x, p)  # noqa: E731
    x = jnp.array([-2.0, -0.5, 0.75, 3.0])
    inv = jr.reverse(f)
    got = {
        "eager": lambda: inv(f(x)),
        "jit": lambda: jax.jit(inv)(f(x)),
        "vmap": lambda: jax.vmap(inv)(f(x)),
    }[how]()
    close(got, x, 1e-12)


@pytest.mark.parametrize("p", [2.0, -2.0, 4.0])
def test_even_float_power_is_refused_naming_the_line(p):
    def f(x):
        return jnp.power(x, p)

    with pytest.raises(jr.NotInvertibleError) as e:
        jr.reverse(f)(jnp.array([4.0, 9.0]))
    msg = str(e.value)
    assert "`pow`" in msg and "loses the sign" in msg
    assert f"{__file__}:{f.__code__.co_firstlineno + 1}" in msg


def test_non_integer_power_is_the_root_on_its_domain():
    f = lambda x: jnp.power(x, 0.5) + x**1.5  # noqa: E731
    x = jnp.array([0.25, 2.0, 7.0])
    close(jr.reverse(f)(f(x)), x, 1e-10)


def test_negative_output_of_a_non_negative_power_is_refused():
    """`x ** 0.5` never gives a negative value: inverting one raises (eagerly at once, under
    `jr.jit` when the program runs) instead of squaring it into a wrong base."""
    f = lambda x: jnp.power(x, 0.5)  # noqa: E731
    with pytest.raises(
        jr.ReversibilityError,
        match=r"outside the map's range at element \(0,\) at `pow` at .*test_library_bijections",
    ):
        jr.reverse(f)(jnp.array([-2.0, 3.0]))
    with pytest.raises(jr.ReversibilityError, match="outside the map's range"):
        jr.jit(jr.reverse(f))(jnp.array([-2.0, 3.0]))
    got = jr.reverse(f, on_error="nan")(jnp.array([-2.0, 3.0]))
    assert np.isnan(got[0]) and got[1] == 9.0


def test_power_of_a_visibly_non_negative_base_inverts():
    for f in (
        lambda z: jnp.power(jnp.exp(z), 2.0),
        lambda z: jnp.exp(z) ** 2,
        lambda z: jnp.power(jax.nn.sigmoid(z) * 3.0, 4.0) - 1.0,
    ):
        z = jnp.array([-1.5, 0.0, 2.0])
        close(jax.jit(jr.reverse(f))(f(z)), z, 1e-10)


EXPONENTS = [1.0, -1.0, 3.0, -3.0, 5.0, 0.5, 1.5, 2.5, -0.5, 2.0, -2.0, 4.0]


@settings(max_examples=25, deadline=None)
@given(
    p=st.sampled_from(EXPONENTS),
    scale=st.floats(0.1, 5.0),
    x=hnp.arrays(np.float64, 4, elements=st.floats(-4.0, 4.0).filter(lambda v: abs(v) > 0.05)),
)
def test_float_powers_never_invert_silently_wrong(p, scale, x):
    """Random exponents and inputs: an even integer exponent is refused when traced; any
    other inverts the inputs on which the power is defined (a non-integer exponent: the
    non-negative ones) to 1e-10."""
    f = lambda x: scale * jnp.power(x, p)  # noqa: E731
    x = jnp.asarray(x) if float(p).is_integer() else jnp.abs(jnp.asarray(x))
    if float(p).is_integer() and int(p) % 2 == 0:
        with pytest.raises(jr.NotInvertibleError, match="`pow`"):
            jr.reverse(f)(f(x))
        return
    close(jr.reverse(f)(f(x)), x, 1e-10)


def test_exponent_known_only_when_the_program_runs():
    f = lambda x, p: jnp.power(x, p)  # noqa: E731
    x = jnp.array([-2.0, 3.0])
    close(jax.jit(jr.reverse(f))(f(x, 3.0), jnp.asarray(3.0)), x, 1e-12)
    with pytest.raises(jr.NotInvertibleError, match="`pow`.*even integer"):
        jr.jit(jr.reverse(f))(f(x, 2.0), jnp.asarray(2.0))


def test_exponent_recovered_from_a_known_base():
    f = lambda p, x: jnp.power(x, p)  # noqa: E731
    x, p = jnp.array([-2.0, 3.0, 0.5]), jnp.array([3.0, 0.7, -1.25])
    close(jr.reverse(f)(f(p, x), x), p, 1e-12)
    with pytest.raises(jr.NotInvertibleError, match="base"):
        jr.reverse(f)(jnp.ones(2), jnp.array([1.0, 2.0]))


def test_power_gradient_through_reversible_matches_jax_grad():
    f = lambda x, w: jnp.power(x, 3.0) * jnp.exp(w) + w  # noqa: E731
    x, w = jnp.array([-1.2, 0.4, 2.0]), jnp.array([0.7, -1.1, 0.3])
    loss = lambda g: lambda x, w: jnp.sum(jnp.sin(g(x, w)))  # noqa: E731
    close(jax.grad(loss(jr.reversible(f)), (0, 1))(x, w), jax.grad(loss(f), (0, 1))(x, w))


# --------------------------------------------------------------------------- flowjax


def _dim4():
    return jax.random.normal(jax.random.key(1), (4,))


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_flowjax_coupling_flow_inverted_from_its_forward_map(how):
    """`coupling_flow` stacks its layers with a `scan` whose carry also accumulates the
    log-det, which `transform` drops: the dead carry goes, the loop inverts."""
    flow = flows.coupling_flow(KEY, base_dist=Normal(jnp.zeros(4)), flow_layers=3)
    bij = flow.bijection
    fwd = lambda x: bij.transform(x)  # noqa: E731
    xs = jax.random.normal(jax.random.key(2), (5, 4))
    if how == "vmap":
        y = jax.vmap(fwd)(xs)
        x, ld = jax.vmap(jr.inverse_and_slogdet(fwd))(y)
        xr, ldr = jax.vmap(bij.inverse_and_log_det)(y)
    else:
        t = (lambda g: g) if how == "eager" else jax.jit
        y = fwd(xs[0])
        x, ld = t(jr.inverse_and_slogdet(fwd))(y)
        xr, ldr = bij.inverse_and_log_det(y)
        y2, ld2 = t(jr.forward_and_slogdet(fwd))(xs[0])
        close(ld2, bij.transform_and_log_det(xs[0])[1], 1e-8)
    close(x, xr, 1e-8)
    close(ld, ldr, 1e-8)


def test_flowjax_module_as_an_argument():
    """The whole module as an argument: its `shape` (a tuple of ints) and flags are static,
    its arrays traced; `eqx.filter_jit` and `eqx.filter_grad` compose."""
    bij = flows.coupling_flow(KEY, base_dist=Normal(jnp.zeros(4)), flow_layers=2).bijection
    f = lambda x, b: b.transform(x)  # noqa: E731
    x = _dim4()
    y = f(x, bij)
    close(jr.reverse(f)(y, bij), x, 1e-10)
    close(eqx.filter_jit(jr.reverse(f))(y, bij), x, 1e-10)
    ld = eqx.filter_jit(jr.forward_and_slogdet(f))(x, bij)[1]
    close(ld, bij.transform_and_log_det(x)[1], 1e-8)
    loss = lambda g: lambda b: jnp.sum(g(x, b) ** 2)  # noqa: E731
    got = eqx.filter_grad(loss(jr.reversible(f)))(bij)
    want = eqx.filter_grad(loss(f))(bij)
    close(got, want, 1e-8)


def test_python_numbers_inside_modules_are_static():
    """`jr.reverse` keys and traces a module's Python int as Equinox does: a flag that picks
    a Python branch works; a Python float passed on its own is still traced."""

    class Scale(eqx.Module):
        w: jax.Array
        times: int = 2

        def __call__(self, x):
            for _ in range(self.times):  # a Python loop over a static int
                x = x * jnp.exp(self.w)
            return x

    m, x = Scale(jnp.array([0.5, -0.25])), jnp.array([1.0, 2.0])
    f = lambda x, m: m(x)  # noqa: E731
    close(jr.reverse(f)(f(x, m), m), x)
    g = lambda x, s: x * s  # noqa: E731
    close(jax.grad(lambda s: jnp.sum(jr.reversible(g)(x, s)))(3.0), jnp.sum(x))


@pytest.mark.parametrize("p", [3.0, 2.0, 0.5])
def test_flowjax_power_inverse_and_logdet(p):
    """`Power` checks `x >= 0` with `eqx.error_if` before `x ** p`: the check is no step to
    invert, it tells the walker the base is non-negative (so even 2.0 inverts), and it does
    not fire on good inputs while jaxrev traces the log-det."""
    bij = fb.Power(p, shape=(3,))
    f = lambda x: bij.transform(x)  # noqa: E731
    x = jnp.array([0.5, 1.0, 2.5])
    y, ld = jr.forward_and_slogdet(f)(x)
    yr, ldr = bij.transform_and_log_det(x)
    close(y, yr)
    close(ld, ldr)
    xi, ldi = jax.jit(jr.inverse_and_slogdet(f))(yr)
    close(xi, x)
    close(ldi, bij.inverse_and_log_det(yr)[1])
    close(
        jax.vmap(jr.reverse(f))(jnp.stack([yr, 2 * yr])),
        jax.vmap(bij.inverse)(jnp.stack([yr, 2 * yr])),
    )


def test_equinox_error_if_is_a_check_not_a_step():
    """`eqx.error_if` on a parameter or on the state: the branch that raises is no case; the
    inverse of an output the forward map cannot make (its preimage fails the check) raises
    jaxrev's error naming the check, never a value."""
    f = lambda x, p: 2.0 * eqx.error_if(x, p < 0, "p must be non-negative") + p  # noqa: E731
    x, p = jnp.array([1.0, -2.0]), jnp.asarray(0.5)
    close(jr.reverse(f)(f(x, p), p), x)
    close(jax.jit(jr.reverse(f))(f(x, p), p), x)
    g = lambda x, p: jnp.exp(p) * eqx.error_if(x, jnp.any(x > 10.0), "too big")  # noqa: E731
    close(jr.reverse(g)(g(x, p), p), x)
    close(jax.vmap(jr.reverse(g), (0, None))(jnp.stack([g(x, p), g(-x, p)]), p), jnp.stack([x, -x]))
    with pytest.raises(jr.ReversibilityError, match="no branch"):
        jr.reverse(g)(g(x, p) * 20.0, p)


def test_error_if_in_a_loop_stores_nothing_under_reversible():
    """The check's raising branch needs nothing rebuilt: `reversible` stores nothing for it
    per iteration, and its gradient is `jax.grad`'s."""

    def f(x, p):
        def body(i, x):
            x = eqx.error_if(x, p < 0, "p must be non-negative")
            return x + jnp.tanh(p * x[::-1])

        return jax.lax.fori_loop(0, 100, body, x)

    x, p = jnp.linspace(-1.0, 1.0, 8), jnp.asarray(0.5)
    assert "stores nothing" in str(jr.memory_report(f, x, p, checkpoint_every=None))
    loss = lambda g: lambda x, p: jnp.sum(g(x, p) ** 2)  # noqa: E731
    close(
        jax.jit(jax.grad(loss(jr.reversible(f)), (0, 1)))(x, p),
        jax.grad(loss(f), (0, 1))(x, p),
        1e-9,
    )


@pytest.mark.slow  # about 20 s of tracing a block neural flow (issue 44's figures)
def test_flowjax_bnaf_logdet_without_equinox_errors():
    """Block neural autoregressive flows hold a bisection (`eqx.error_if(width, width <= 0)`
    on its own constants): the log-det's linearized sweep must not run that check's host
    callback on constants while it traces."""
    flow = flows.block_neural_autoregressive_flow(KEY, base_dist=Normal(jnp.zeros(3)))
    bij = flow.bijection
    f = lambda x: bij.transform(x)  # noqa: E731
    x = jax.random.normal(jax.random.key(3), (3,))
    y, ld = jr.forward_and_slogdet(f)(x)
    yr, ldr = bij.transform_and_log_det(x)
    close(y, yr, 1e-8)
    close(ld, ldr, 1e-6)


@pytest.mark.slow
def test_flowjax_bnaf_inverse_transforms_without_equinox_errors():
    """The inverse transforms linearize it too (about 15 s: slow)."""
    bij = flows.block_neural_autoregressive_flow(KEY, base_dist=Normal(jnp.zeros(3))).bijection
    f = lambda x: bij.transform(x)  # noqa: E731
    x = jax.random.normal(jax.random.key(3), (3,))
    J, v = jax.jacfwd(f)(x), jnp.array([1.0, -0.5, 2.0])
    close(jr.inverse_jvp(f, (x,), v)[1][0], jnp.linalg.solve(J, v), 1e-8)
    close(jr.inverse_vjp(f, x)[1]((v,)), jnp.linalg.solve(J.T, v), 1e-8)


def _spline_chain(D: int, n: int, inverted: bool):
    layers = [
        fb.Coupling(
            k,
            transformer=fb.RationalQuadraticSpline(knots=6, interval=3),
            untransformed_dim=D // 2,
            dim=D,
            nn_width=16,
            nn_depth=1,
        )
        for k in jax.random.split(KEY, n)
    ]
    return fb.Chain([fb.Invert(c) for c in layers] if inverted else layers)


@pytest.mark.slow  # about 20 s of tracing; test_library_flows inverts flowjax's spline by default
def test_spline_coupling_chain_under_jit():
    """Three rational-quadratic spline couplings in a `Chain`, inverted and log-det'ed under
    `jit` against flowjax's (the tracing time is `benchmarks/spline_chain.py`'s). flowjax
    clips `x` to the interval, selects on ``in_bounds`` and clips the spline's value again: the
    saturated branches of the first clip cannot hold under the in-bounds case, those of the
    second are refused only where the output is the interval's end (issue 32)."""
    D = 6
    x = 1.5 * jax.random.normal(jax.random.key(4), (D,))
    ch = _spline_chain(D, 3, inverted=False)
    f = lambda x: ch.transform(x)  # noqa: E731
    y, ld = jax.jit(jr.forward_and_slogdet(f))(x)
    yr, ldr = ch.transform_and_log_det(x)
    close(y, yr, 1e-10)
    close(ld, ldr, 1e-8)
    xi, ldi = jax.jit(jr.inverse_and_slogdet(f))(yr)
    close(xi, x, 1e-9)
    close(ldi, ch.inverse_and_log_det(yr)[1], 1e-8)


def test_flowjax_masked_autoregressive_flow_inverts_both_ways():
    """A masked autoregressive flow's forward map inverts from the masked products (D passes
    through the network: issue 32) to flowjax's inverse; flowjax's own inverse loop (the
    default `invert=True` flow's `transform`: a scan overwriting element `rank`) inverts to
    flowjax's forward map (issue 44; it was refused at `dynamic_slice`)."""
    x = _dim4()
    b = flows.masked_autoregressive_flow(
        KEY, base_dist=Normal(jnp.zeros(4)), flow_layers=2, invert=False
    ).bijection
    f = lambda x: b.transform(x)  # noqa: E731
    close(jr.forward_and_slogdet(f)(x)[1], b.transform_and_log_det(x)[1], 1e-8)
    xi, ldi = jax.jit(jr.inverse_and_slogdet(f))(f(x))
    close(xi, x, 1e-10)
    close(ldi, b.inverse_and_log_det(f(x))[1], 1e-8)
    b = flows.masked_autoregressive_flow(
        KEY, base_dist=Normal(jnp.zeros(4)), flow_layers=2, invert=True
    ).bijection
    g = lambda x: b.transform(x)  # noqa: E731
    close(jr.forward_and_slogdet(g)(x)[1], b.transform_and_log_det(x)[1], 1e-8)
    xi, ldi = jax.jit(jr.inverse_and_slogdet(g))(g(x))
    close(xi, x, 1e-10)
    close(ldi, b.inverse_and_log_det(g(x))[1], 1e-8)


# --------------------------------------------------------------------------- numpyro


@pytest.fixture
def nt():
    return pytest.importorskip("numpyro.distributions.transforms")


def test_numpyro_reshape_refused_clearly_then_answered_with_state(nt):
    t = nt.ReshapeTransform((2, 3), (6,))
    x = jnp.arange(6.0) - 2.5
    with pytest.raises(ValueError, match="ReshapeTransform.*state="):
        jr.inverse_and_slogdet(t)(t(x))
    with pytest.raises(ValueError, match="ReshapeTransform.*state="):
        jr.reverse(t)(t(x))
    s = jax.ShapeDtypeStruct((6,), x.dtype)
    for got in (
        jr.inverse_and_slogdet(t, state=s)(t(x)),
        jax.jit(jr.inverse_and_slogdet(t, state=s))(t(x)),
    ):
        close(got[0], t.inv(t(x)))
        close(got[1], -t.log_abs_det_jacobian(x, t(x)))
    close(jr.reverse(t, state=s)(t(x)), x)


def test_numpyro_unpack_answered_with_state(nt):
    t = nt.UnpackTransform(lambda v: {"a": v[:2], "b": v[2:]})
    v = jnp.arange(5.0)
    with pytest.raises(ValueError, match="UnpackTransform.*state="):
        jr.inverse_and_slogdet(t)(t(v))
    s = jax.ShapeDtypeStruct((5,), v.dtype)
    x, ld = jax.vmap(jr.inverse_and_slogdet(t, state=s))(jax.vmap(t)(jnp.stack([v, -v])))
    close(x, jnp.stack([v, -v]))
    close(ld, jnp.zeros(2))
    y, ld = jr.forward_and_slogdet(t)(v)
    close(y, t(v))
    close(ld, 0.0)
