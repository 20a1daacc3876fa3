"""Every flowjax bijection and flow constructor of the installed version, and every numpyro
transform, taken as they are (issue 32): the forward map alone, inverted and log-det'ed by
jaxrev, against the library's own inverse and log-det (float64, 1e-8), or round-tripping
where the library has none (flowjax's tanh planar layers, block neural autoregressive
networks). What jaxrev does not invert is refused with a jaxrev error naming the primitive
and the library's line: `REFUSED` lists them, so that a refusal that appears, or a case that
starts to invert, shows here. Never a silent wrong value.

The default run takes one representative case of each kind of map (`ONE_WAY`, `NP_ONE_WAY`)
one way (eager, `jit` or `vmap`, in turn); ``-m slow`` takes every case every way.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrev as jr

jax.config.update("jax_enable_x64", True)
pytest.importorskip("flowjax")
pytest.importorskip("numpyro")
from programs import flowjax_cases as fc  # noqa: E402
from programs import numpyro_cases as nc  # noqa: E402
from tiers import cover, tiered  # noqa: E402

HOWS = ("eager", "jit", "vmap")

# what jaxrev refuses, and the primitive its error names: nothing of flowjax's since the
# masked autoregressive layer's inverse loop with spline transformers inverted (each step's
# spline a choice group solved on the element `rank`, a window decided when the program runs)
REFUSED: dict[str, str] = {}
NAMES = fc.all_names()


@pytest.mark.slow  # builds every case (about 40 s)
def test_flowjax_cases_without_an_inverse_are_those_listed():
    probed = {name for name in fc.CASES if not fc.has_inverse(fc.case(name)[0])}
    assert probed == fc.NO_INVERSE, sorted(probed ^ fc.NO_INVERSE)


def _expect(name: str, run) -> None:
    prim = REFUSED.get(name)
    if prim is None:
        assert run() == "ok"
        return
    with pytest.raises(jr.JaxrevError) as info:
        run()
    msg = str(info.value)
    assert f"`{prim}`" in msg, msg
    assert re.search(r"\.py:\d+", msg), msg  # the library's (or Equinox's) line


# the default run's cases: one of each kind of map, refusals included (every case every way
# is `slow`: test_flowjax_every_way)
ONE_WAY = [
    "Affine",  # elementwise, linear
    "TriangularAffine/lower@inverted",  # a triangular solve
    "LeakyTanh",  # piecewise: a choice
    "Planar/leaky_relu",  # a rank-one update: a scalar root
    "RationalQuadraticSpline/tail",  # a spline: knots found by search, linear tails
    "Coupling/conditional",  # a coupling whose parameters an MLP of a condition computes
    "Chain",  # composition
    "Scan",  # flowjax's layer stacking
    "coupling_flow/affine",  # a flow constructor
    "planar_flow",  # no library inverse: a round trip
    "MaskedAutoregressive/affine@inverted",  # flowjax's MAF inverse: a scan over elements
    "DiscreteCosine",  # FFTs and `real`: one lump over the reals
    # flowjax's default MAF with splines: its element loop, each step's spline solved on one
    # element decided when the program runs
    "masked_autoregressive_flow/spline",
]


def test_flowjax_one_way_cases_exist():
    assert set(ONE_WAY) <= set(NAMES), sorted(set(ONE_WAY) - set(NAMES))


# by default every way of calling (HOWS) and every kind of step but the costliest: the
# spline's tails, the conditional and the stacked couplings, the planar flow
@pytest.mark.parametrize(
    "name",
    tiered(
        ONE_WAY,
        slow={
            "RationalQuadraticSpline/tail",
            "Coupling/conditional",
            "coupling_flow/affine",
            "planar_flow",
        },
    ),
)
def test_flowjax_one_way(name):
    how = HOWS[ONE_WAY.index(name) % 3]
    _expect(name, lambda: fc.check(name, how))


# the slow tier: every case, each of the three ways by turns; `-m soak`: every case every way
@pytest.mark.parametrize(
    "name,how", cover(NAMES, HOWS, marks=pytest.mark.slow, rest=pytest.mark.soak)
)
def test_flowjax_every_way(name, how):
    _expect(name, lambda: fc.check(name, how))


# --------------------------------------------------------------------------- numpyro

NP_REFUSED = {
    # stick-breaking, ``t * pad(cumprod(1 - |t[:-1]|))``: triangular in t, but each
    # coordinate's sign (the `abs`) is a decision per element of a group its cumulative
    # product couples, which the choice groups do not split (the signs are the output's,
    # where the product is positive: a range fact the walk does not derive)
    "L1BallTransform": "mul",
}


def _numpyro_check(name: str, how: str) -> str:
    t, x = nc.SQUARE[name]()
    y = t(x)
    ld_ref = jnp.sum(t.log_abs_det_jacobian(x, y))
    fwd, inv = jr.forward_and_slogdet(t), jr.inverse_and_slogdet(t)
    if how == "jit":
        fwd, inv = jax.jit(fwd), jax.jit(inv)
    if how == "vmap":
        yv, ldv = jax.vmap(fwd)(jnp.stack([x, x]))
        xv, ldiv = jax.vmap(inv)(jnp.stack([y, y]))
        got_y, ld, xi, ldi = yv[1], ldv[1], xv[1], ldiv[1]
    else:
        got_y, ld = fwd(x)
        xi, ldi = inv(y)
    tol = dict(rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(got_y, y, **tol)
    np.testing.assert_allclose(ld, ld_ref, **tol)
    np.testing.assert_allclose(xi, t.inv(y) if nc.has_inverse(t, y) else x, **tol)
    np.testing.assert_allclose(ldi, -ld_ref, **tol)
    return "ok"


NP_NAMES = list(nc.SQUARE)
# the default run's transforms, one of each kind (every transform every way is `slow`)
NP_ONE_WAY = [
    "AffineTransform",  # elementwise, linear
    "LowerCholeskyAffine",  # a triangular solve
    "RecursiveLinearTransform",  # a scan
    "ComposeTransform",  # composition (affine, permutation, clipped sigmoid)
    "DiscreteCosineTransform",  # FFTs and `real`: one lump over the reals
]


def test_numpyro_one_way_cases_exist():
    assert set(NP_ONE_WAY) <= set(NP_NAMES), sorted(set(NP_ONE_WAY) - set(NP_NAMES))


@pytest.mark.parametrize("name", NP_ONE_WAY)
def test_numpyro_transform_one_way(name):
    _numpyro_expect(name, HOWS[NP_ONE_WAY.index(name) % 3])


@pytest.mark.parametrize(
    "name,how", cover(NP_NAMES, HOWS, marks=pytest.mark.slow, rest=pytest.mark.soak)
)
def test_numpyro_transform_every_way(name, how):
    _numpyro_expect(name, how)


def _numpyro_expect(name, how):
    prim = NP_REFUSED.get(name)
    if prim is None:
        assert _numpyro_check(name, how) == "ok"
        return
    with pytest.raises(jr.JaxrevError, match=f"`{prim}` at .*py:\\d+"):
        _numpyro_check(name, how)


@pytest.mark.parametrize("name", list(nc.RECTANGULAR))
def test_numpyro_rectangular_transforms_are_refused_naming_the_transform(name):
    """A transform that changes the number of elements has no Jacobian determinant: the
    log-det transforms refuse it naming the transform (numpyro's own log-det is in the
    transform's coordinates), and `reverse` asks for the input's shape."""
    t, x = nc.RECTANGULAR[name]()
    with pytest.raises(ValueError, match=type(t).__name__):
        jr.inverse_and_slogdet(t)(t(x))


def test_numpyro_clipped_sigmoid_inverts_inside_and_refuses_at_the_clip():
    """numpyro clips its sigmoid to [tiny, 1 - eps]: inside, jaxrev's inverse is numpyro's;
    an output at the clip (an input past it, where the map is flat) is refused naming
    numpyro's line, or NaN on request. numpyro's own `inv` returns a wrong value there."""
    from numpyro.distributions.transforms import SigmoidTransform

    t = SigmoidTransform()
    x = jnp.array([0.3, -1.0, 50.0])
    y = t(x)
    assert abs(float(t.inv(y)[2]) - 50.0) > 10.0  # numpyro: silently wrong
    with pytest.raises(jr.NotInvertibleError, match="`min` at .*numpyro.*transforms.py"):
        jr.inverse_and_slogdet(t)(y)
    with pytest.raises(Exception, match="saturated clip"):
        jax.block_until_ready(jax.jit(jr.inverse_and_slogdet(t))(y))
    got, _ = jr.inverse_and_slogdet(t, on_error="nan")(y)
    np.testing.assert_allclose(got[:2], x[:2], rtol=1e-12)
    assert np.isnan(got[2])


def test_flowjax_spline_at_its_interval_end_is_refused_not_wrong():
    """flowjax's spline maps the interval's end to itself, where its output clip's saturated
    branch would make the same value: refused there when the program runs, naming flowjax's
    clip; any other point inverts."""
    import flowjax.bijections as fb

    bij = fc._perturbed(fb.RationalQuadraticSpline(knots=5, interval=3.0))
    f = lambda x: bij.transform(x)  # noqa: E731
    xs = jnp.array([-4.0, -3.0 + 1e-9, 0.7, 2.9])
    ys = jax.vmap(f)(xs)
    np.testing.assert_allclose(jax.vmap(jr.reverse(f))(ys), xs, rtol=1e-9)
    with pytest.raises(jr.NotInvertibleError, match="`(min|max)` at .*rational_quadratic_spline"):
        jr.reverse(f)(f(jnp.asarray(3.0)))


def test_a_preimage_not_found_under_on_error_nan_has_a_nan_log_det():
    """Under ``on_error="nan"`` the refusal at flowjax's interval end leaves NaN in the
    preimage there, and the log-det is NaN with it (it was a finite number, the map's
    terms at the other elements: found by a review), eager, jitted and vmapped; the other
    points' log-dets are the map's."""
    import flowjax.bijections as fb

    bij = fc._perturbed(fb.RationalQuadraticSpline(knots=5, interval=3.0))
    f = jax.vmap(lambda x: bij.transform(x))  # noqa: E731
    inv = jr.inverse_and_slogdet(f, on_error="nan")
    for x, bad in ((jnp.array([3.0, 0.7, -0.2]), True), (jnp.array([2.0, 0.7, -0.2]), False)):
        want = -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1]
        for call in (inv, jax.jit(inv), lambda y: jax.vmap(inv)(y[None])):
            got_x, got_ld = call(f(x))
            assert np.isnan(np.asarray(got_x)).any() == bad
            if bad:
                assert np.isnan(got_ld).all()
            else:
                np.testing.assert_allclose(got_ld, want, rtol=1e-9)


def test_a_spline_couplings_log_det_is_its_diagonal_not_a_dense_jacobian():
    """A spline coupling's bins are searched over a table (not an elementwise program), yet
    each element's piece is computed from that element alone: the log-det sums the logs of
    its derivatives (one JVP), with no dense Jacobian and no LU of the transformed half,
    inverse and forward, and equals flowjax's."""
    import flowjax.bijections as fb
    import flowjax.flows as ff
    from flowjax.distributions import Normal
    from helpers import all_eqns

    flow = ff.coupling_flow(
        jax.random.key(0),
        base_dist=Normal(jnp.zeros(6)),
        transformer=fb.RationalQuadraticSpline(knots=6, interval=3.0),
        flow_layers=1,
    )
    bij = fc._perturbed(flow.bijection)
    f = lambda x: bij.transform(x)  # noqa: E731
    x = 0.7 * jax.random.normal(jax.random.key(1), (6,))
    y, lib_logdet = bij.transform_and_log_det(x)
    inverse = jax.make_jaxpr(jr.inverse_and_slogdet(f))(y)
    forward = jax.make_jaxpr(jr.forward_and_slogdet(f))(x)
    got_x, inv_logdet = jax.extend.core.jaxpr_as_fun(inverse)(y)
    got_y, fwd_logdet = jax.extend.core.jaxpr_as_fun(forward)(x)
    np.testing.assert_allclose(got_x, x, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(got_y, y, rtol=1e-12)
    np.testing.assert_allclose(inv_logdet, -lib_logdet, rtol=1e-9)
    np.testing.assert_allclose(fwd_logdet, lib_logdet, rtol=1e-9)
    for program in (inverse, forward):
        names = {e.primitive.name for e in all_eqns(program.jaxpr)}
        assert "lu" not in names, sorted(names)


def test_flowjax_default_maf_inverse_holds_no_copy_of_the_state_per_step():
    """flowjax's default masked autoregressive flow (`invert=True`: its `transform` the loop
    that writes element `rank` per step) inverts with its steps undone at once, each step's
    element written into the final state once (`rules.scan._owned_windows`), and the walk
    reading a window it has just written as the piece it wrote (`elements.written_window`):
    no float array of steps x elements per sample in the compiled program (a copy of the
    state per step, D x D values a sample: at D = 64 they took three fifths of the inverse's
    time, 6x flowjax's, now 1.0x); values and log-det are flowjax's own inverse's."""
    import re

    import flowjax.flows as ff
    from flowjax.distributions import Normal

    d = 24  # (the network's width is flowjax's 50: no weight has two axes of d)
    flow = ff.masked_autoregressive_flow(
        jax.random.key(0), base_dist=Normal(jnp.zeros(d)), flow_layers=2
    )
    bij = fc._perturbed(flow.bijection)
    f = lambda x: bij.transform(x)  # noqa: E731
    xs = jax.random.normal(jax.random.key(1), (3, d))
    ys = jax.vmap(f)(xs)
    inv = jax.jit(jax.vmap(jr.inverse_and_slogdet(f)))
    hlo = inv.lower(ys).compile().as_text()
    copies = re.findall(rf"\bf(?:32|64)\[[0-9,]*\b{d},(?:[0-9]+,)*{d}\b[0-9,]*\]", hlo)
    assert not copies, copies[:4]
    back, logdet = inv(ys)
    want, want_logdet = jax.vmap(bij.inverse_and_log_det)(ys)
    np.testing.assert_allclose(back, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(back, xs, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logdet, want_logdet, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- protocols


def _coupling_module():
    """A user's invertible map as an Equinox module: an additive coupling whose shift an MLP
    computes, then a per-dimension scale."""
    eqx = pytest.importorskip("equinox")

    class Coupling(eqx.Module):
        mlp: eqx.nn.MLP
        log_scale: jax.Array

        def __call__(self, x, condition=None):
            a, b = x[:2], x[2:]
            b = b + self.mlp(a if condition is None else a + condition)
            return jnp.concatenate([a, b]) * jnp.exp(self.log_scale)

    k1, k2 = jax.random.split(jax.random.key(3))
    return Coupling(eqx.nn.MLP(2, 2, 8, 1, key=k1), 0.3 * jax.random.normal(k2, (4,)))


def _dense_logdet(f, x):
    return jnp.linalg.slogdet(jax.jacfwd(f)(x))[1]


@pytest.mark.parametrize("how", tiered(HOWS, slow={"eager", "vmap"}))
def test_flowjax_numerical_inverse_is_inverted_by_the_map_it_solves(how):
    """flowjax's block neural autoregressive flow with its defaults (`invert=True`, a
    condition): the flow's `transform` is flowjax's bisection (`NumericalInverse`), which
    jaxrev inverts by the network it solves (`jaxrev.flowjax`: marked while jaxrev traces).
    Forward and inverse with their log-dets equal flowjax's own, eagerly, under jit and vmap;
    outside jaxrev's traces, and after a trace that raised, flowjax's class is untouched."""
    import flowjax.bijections as fb
    import flowjax.flows as ff
    from flowjax.distributions import Normal

    flow = ff.block_neural_autoregressive_flow(
        jax.random.key(1),
        base_dist=Normal(jnp.zeros(3)),
        cond_dim=2,
        flow_layers=2,
        nn_block_dim=3,
    )
    bij = flow.bijection
    x, c = jnp.array([0.4, -1.1, 0.7]), jnp.array([0.3, -0.5])
    fwd = jr.forward_and_slogdet(lambda v, c: bij.transform(v, c))
    inv = jr.inverse_and_slogdet(lambda v, c: bij.transform(v, c))
    lib_f, lib_i = bij.transform_and_log_det, bij.inverse_and_log_det
    if how == "jit":
        fwd, inv = jax.jit(fwd), jax.jit(inv)
    if how == "vmap":
        x = jnp.stack([x, -0.5 * x])
        fwd, inv = jax.vmap(fwd, (0, None)), jax.vmap(inv, (0, None))
        lib_f, lib_i = jax.vmap(lib_f, (0, None)), jax.vmap(lib_i, (0, None))
    y_ref, ld_ref = lib_f(x, c)
    y, ld = fwd(x, c)
    np.testing.assert_allclose(y, y_ref, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(ld, ld_ref, rtol=1e-8, atol=1e-8)
    xi_ref, ldi_ref = lib_i(y_ref, c)
    xi, ldi = inv(y_ref, c)
    np.testing.assert_allclose(xi, xi_ref, rtol=1e-8, atol=1e-8)
    np.testing.assert_allclose(ldi, ldi_ref, rtol=1e-8, atol=1e-8)
    # (the bisection's own tolerance: the inverse gives back x to flowjax's accuracy)
    np.testing.assert_allclose(xi, x, atol=1e-3)
    assert fb.NumericalInverse.inverse_and_log_det.__module__.startswith("flowjax")
    with pytest.raises(jr.JaxrevError):
        jr.reverse(lambda v: jnp.floor(bij.transform(v, c)))(jnp.atleast_2d(y_ref)[0])
    assert fb.NumericalInverse.inverse_and_log_det.__module__.startswith("flowjax")


def _marked_bnaf(layers: int) -> object:
    """flowjax's default block neural autoregressive flow of dimension 3 (its `transform`
    the bisection)."""
    import flowjax.flows as ff
    from flowjax.distributions import Normal

    return ff.block_neural_autoregressive_flow(
        jax.random.key(0), base_dist=Normal(jnp.zeros(3)), flow_layers=layers, nn_block_dim=3
    ).bijection


@pytest.mark.slow  # about 10 s
def test_reversible_through_flowjax_bisection_equals_jax_grad():
    """`jr.reversible` over flowjax's default block neural autoregressive flow: the backward
    run rebuilds each layer's input by the network (`jaxrev.flowjax`), to the bisection's
    tolerance only; the default sees that drift and recomputes the layers' loop from its
    checkpoint through JAX's VJP, which passes the bisection by flowjax's implicit
    derivative (a `while_loop` inside a `custom_jvp`): the gradient is `jax.grad`'s."""
    bij = _marked_bnaf(layers=2)
    x = jnp.array([0.3, -0.4, 0.9])
    want = jax.grad(lambda x: jnp.sum(jnp.sin(bij.transform(x))))(x)
    seen = []
    run = jr.reversible(lambda x: bij.transform(x), report=seen.append)
    got = jax.grad(lambda x: jnp.sum(jnp.sin(run(x))))(x)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert seen and sum(loop.repaired for loop in seen[0].loops) >= 1


def test_derivatives_through_the_marked_bisection_are_flowjaxs():
    """The marked solve is differentiated through the network it solves (the implicit
    function theorem, `custom_inverse(..., differentiate="inverse")`), never through the
    bisection's iterations, whose own derivative is zero (what JAX 0.12's lowering of the
    solve left: flowjax's implicit JVP dropped): Jacobians of jaxrev's forward value and
    log-det equal `jax`'s of flowjax's own, in the input and in the weights, one sample and
    a batch (`grad` of a `vmap`: one dense block per sample)."""
    import equinox as eqx

    bij = _marked_bnaf(layers=1)
    x = jnp.array([0.3, -0.4, 0.9])
    fwd = jax.jit(jr.forward_and_slogdet(lambda v: bij.transform(v)))
    np.testing.assert_allclose(
        jax.jacfwd(lambda v: fwd(v)[0])(x), jax.jacfwd(bij.transform)(x), rtol=1e-10, atol=1e-12
    )
    np.testing.assert_allclose(
        jax.grad(lambda v: fwd(v)[1])(x),
        jax.grad(lambda v: bij.transform_and_log_det(v)[1])(x),
        rtol=1e-10,
        atol=1e-12,
    )
    xs = jnp.stack([x, -0.5 * x, jnp.array([1.1, 0.2, -0.7])])
    arrays, static = eqx.partition(bij, eqx.is_inexact_array)

    def loss(arrays, which):
        b = eqx.combine(arrays, static)
        if which == "jaxrev":
            y, ld = jax.vmap(jr.forward_and_slogdet(lambda v: b.transform(v)))(xs)
        else:
            y, ld = jax.vmap(b.transform_and_log_det)(xs)
        return jnp.sum(jnp.sin(y)) + jnp.sum(ld)

    got = jax.jit(jax.grad(loss), static_argnums=1)(arrays, "jaxrev")
    want = jax.grad(loss)(arrays, "flowjax")
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-8, atol=1e-10)
    assert any(float(jnp.max(jnp.abs(w))) > 1e-3 for w in jax.tree_util.tree_leaves(want))


def test_the_numerical_inverse_mark_holds_in_the_tracing_thread_only():
    """While one thread is inside `numerical_inverses_marked` (a jaxrev trace), another
    thread's flowjax calls are flowjax's own (no `custom_inverse` step); the class's own
    method is back after."""
    import threading

    import flowjax.bijections as fb
    import flowjax.flows as ff
    from flowjax.distributions import Normal

    from jaxrev.flowjax import numerical_inverses_marked

    bij = ff.block_neural_autoregressive_flow(
        jax.random.key(2), base_dist=Normal(jnp.zeros(2)), flow_layers=1, nn_block_dim=2
    ).bijection
    y = jnp.array([0.2, -0.3])

    def names(out: list) -> None:  # (the program's text: the solve sits inside a `jit`)
        out.append(str(jax.make_jaxpr(bij.transform)(y)))

    here, there = [], []
    with numerical_inverses_marked():
        names(here)
        other = threading.Thread(target=names, args=(there,))
        other.start()
        other.join()
    assert "jaxrev_custom_inverse" in here[0]
    assert there and "jaxrev_custom_inverse" not in there[0]
    assert fb.NumericalInverse.inverse_and_log_det.__module__.startswith("flowjax")


def test_jaxrev_bijection_in_a_flowjax_distribution():
    """`jaxrev.flowjax.Bijection` is a flowjax bijection: in a `Transformed` distribution its
    log-density is the change of variables with the dense log-det (float64), it samples, and
    `fit_to_data` trains the module's weights through jaxrev's inverse and log-det."""
    from flowjax.distributions import Normal, Transformed
    from flowjax.train import fit_to_data

    from jaxrev.flowjax import Bijection

    m = _coupling_module()
    dist = Transformed(Normal(jnp.zeros(4)), Bijection(m, shape=(4,)))
    x = jax.random.normal(jax.random.key(4), (4,))
    y = m(x)
    want = Normal(jnp.zeros(4)).log_prob(x) - _dense_logdet(m, x)
    np.testing.assert_allclose(dist.log_prob(y), want, rtol=1e-10)
    s = dist.sample(jax.random.key(5), (3,))
    np.testing.assert_allclose(
        jax.vmap(dist.log_prob)(s),
        jax.vmap(
            lambda v: (
                Normal(jnp.zeros(4)).log_prob(jr.reverse(m)(v)) - _dense_logdet(m, jr.reverse(m)(v))
            )
        )(s),
        rtol=1e-10,
    )
    data = jax.random.normal(jax.random.key(6), (256, 4)) * jnp.array([2.0, 0.5, 1.0, 3.0])
    trained, losses = fit_to_data(jax.random.key(7), dist, data, max_epochs=20, show_progress=False)
    assert losses["train"][-1] < losses["train"][0] - 0.1


def test_jaxrev_bijection_with_a_condition():
    from jaxrev.flowjax import Bijection

    m = _coupling_module()
    b = Bijection(m, shape=(4,), cond_shape=(2,))
    x, c = jax.random.normal(jax.random.key(8), (4,)), jnp.array([0.3, -0.7])
    eqx = pytest.importorskip("equinox")
    y, ld = eqx.filter_jit(b.transform_and_log_det)(x, c)
    xi, ldi = b.inverse_and_log_det(y, c)
    np.testing.assert_allclose(xi, x, rtol=1e-10)
    np.testing.assert_allclose(ld, _dense_logdet(lambda v: m(v, c), x), rtol=1e-10)
    np.testing.assert_allclose(ldi, -ld, rtol=1e-10)


def test_jaxrev_transform_in_a_numpyro_distribution():
    """`jaxrev.numpyro.Transform` in a `TransformedDistribution`: log-density by the dense
    log-det, samples inverted back, batches of events."""
    import numpyro.distributions as dist

    from jaxrev.numpyro import Transform

    m = _coupling_module()
    base = dist.Normal(jnp.zeros(4), 1.0).to_event(1)
    d = dist.TransformedDistribution(base, Transform(m))
    x = jax.random.normal(jax.random.key(9), (5, 4))
    y = jax.vmap(m)(x)
    want = base.log_prob(x) - jax.vmap(lambda v: _dense_logdet(m, v))(x)
    np.testing.assert_allclose(d.log_prob(y), want, rtol=1e-10)
    s = d.sample(jax.random.key(10), (3,))
    assert s.shape == (3, 4)
    np.testing.assert_allclose(jax.vmap(m)(Transform(m).inv(s)), s, rtol=1e-10)
