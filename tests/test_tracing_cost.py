"""Tracing cost linear in program size on families of masked-step programs (issue 28,
docs/design.md §3.5): predicates known only when the program runs, one per step or shared,
with reversals, permutations and diffrax's time arrays between the couplings, never split a
walk. Counted in the walker's rule applications (never wall-clock time), per transform."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from programs.families import family, loss

import jaxrev as jr
from jaxrev._stats import counting

jax.config.update("jax_enable_x64", True)

LINEAR = ("shared", "per_step", "reversal", "roll", "permutation", "time_array", "scan")


def _applications(name: str, k: int, what: str) -> int:
    f, s, p = family(name, k)
    with counting() as c:
        if what == "reverse":
            jax.make_jaxpr(jr.reverse(f))(f(s, p), p)
        elif what == "inverse_jvp":
            jax.make_jaxpr(lambda s, p: jr.inverse_jvp(lambda s: f(s, p), (s,), s))(s, p)
        elif what == "forward_and_slogdet":
            jax.make_jaxpr(jr.forward_and_slogdet(f))(s, p)
        else:
            jax.make_jaxpr(jax.grad(loss(jr.reversible(f))))(s, p)
    return c["rules"] + c["elements"]


@pytest.mark.parametrize("what", ["reverse", "reversible grad"])
@pytest.mark.parametrize("name", LINEAR)
def test_rule_applications_grow_linearly_with_the_steps(name, what):
    n5, n10, n20 = (_applications(name, k, what) for k in (5, 10, 20))
    # a doubling of the steps at most doubles the work, up to the fixed part of the program
    assert n10 <= 2.3 * n5 and n20 <= 2.3 * n10, (n5, n10, n20)


@pytest.mark.parametrize("what", ["inverse_jvp", "forward_and_slogdet"])
@pytest.mark.parametrize("name", ["per_step", "roll", "time_array"])
def test_inverse_transforms_grow_linearly_with_the_steps(name, what):
    n5, n10, n20 = (_applications(name, k, what) for k in (5, 10, 20))
    assert n10 <= 2.3 * n5 and n20 <= 2.3 * n10, (n5, n10, n20)


@pytest.mark.parametrize("name", LINEAR)
def test_families_invert_and_differentiate_right(name):
    f, s, p = family(name, 6)
    y = f(s, p)
    back = jr.reverse(f)(y, p)
    for a, b in zip(back, s):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    got = jax.grad(loss(jr.reversible(f)), argnums=(0, 1))(s, p)
    want = jax.grad(loss(f), argnums=(0, 1))(s, p)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


class _Compiles(logging.Handler):
    """Counts the XLA compilations JAX logs (`jax.log_compiles`)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "Finished XLA compilation" in record.getMessage():
            self.n += 1


def test_what_constants_compute_is_compiled_at_once_not_op_by_op():
    """Tracing a flow whose weights are computed from constants (flowjax's block neural
    autoregressive flow: weight normalisation, masks, softplus of its diagonal blocks): the
    walks read those values, and the static values of the loop over layers, computed from
    constants as one compiled program each (`compiled_eqns`), not one XLA program per
    operation: 116-117 compilations while tracing before, 64-65 now (JAX 0.10 and 0.12),
    and the answer is flowjax's."""
    ff = pytest.importorskip("flowjax.flows")
    from flowjax.distributions import Normal

    flow = ff.block_neural_autoregressive_flow(
        jax.random.key(0), base_dist=Normal(jax.numpy.zeros(5)), invert=False
    )
    bij = flow.bijection
    x = jax.numpy.linspace(-1.0, 1.0, 5)
    want = bij.transform_and_log_det(x)
    f = jr.forward_and_slogdet(lambda x: bij.transform(x))
    n = _compiles_while_tracing(f, x)
    assert n <= 80, n
    got = jax.jit(f)(x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-12)


NEWTON_COMPILES = 30
"""Compilations allowed while tracing the planar flow's forward + log-det (72 op by op; 32 with
its Newton solve traced, 25 with the plan solving nothing: `Settings.values`)."""


def _compiles_while_tracing(f, *args) -> int:
    """How many XLA compilations tracing `f` makes (an upper bound of a fresh process's: a
    program compiled earlier in the process is not compiled again)."""
    counter, logger = _Compiles(), logging.getLogger("jax")
    level = logger.level
    logger.addHandler(counter)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles():
            jax.make_jaxpr(f)(*args)
    finally:
        logger.removeHandler(counter)
        logger.setLevel(level)
    return counter.n


def test_a_newton_groups_structure_is_probed_in_one_program_per_probe():
    """flowjax's planar flow, forward + log-det: the log-det's plan walks the inverse, a Newton
    group per layer, whose affine part, stand-ins and matrix are found at trace time on
    concrete values. Each probe runs as one compiled program (the stand-ins' sources, the
    matrix's columns) and its unit vectors are numpy constants: one XLA program per operation
    before, 72 compilations while tracing this 6-dimensional 3-layer flow in a fresh process
    (float64, JAX 0.10), 32 now."""
    ff = pytest.importorskip("flowjax.flows")
    from flowjax.distributions import Normal

    flow = ff.planar_flow(
        jax.random.key(0), base_dist=Normal(jax.numpy.zeros(6)), flow_layers=3, invert=False
    )
    bij = flow.bijection
    x = jax.numpy.linspace(-1.0, 1.0, 6)
    want = bij.transform_and_log_det(x)
    f = jr.forward_and_slogdet(lambda x: bij.transform(x))
    n = _compiles_while_tracing(f, x)
    assert n <= NEWTON_COMPILES, n
    got = jax.jit(f)(x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10)


def test_the_forward_log_dets_plan_solves_nothing():
    """The forward log-det's plan walks the inverse only for its steps (`Settings.values`):
    a flowjax spline coupling's bins are neither searched nor their roots taken, no
    candidate is checked, and what the solves would run is not traced. 58 compilations while
    tracing this 2-d layer before (fresh process, JAX 0.10: the search's and the
    candidates' operations on constants, each compiled on its own), 24 now; the answer
    is flowjax's."""
    ff = pytest.importorskip("flowjax.flows")
    fb = pytest.importorskip("flowjax.bijections")
    from flowjax.distributions import Normal

    flow = ff.coupling_flow(
        jax.random.key(0),
        base_dist=Normal(jax.numpy.zeros(2)),
        transformer=fb.RationalQuadraticSpline(knots=6, interval=3),
        flow_layers=1,
        invert=False,
    )
    bij = flow.bijection
    x = jax.numpy.linspace(-1.0, 1.0, 2)
    want = bij.transform_and_log_det(x)
    f = jr.forward_and_slogdet(lambda x: bij.transform(x))
    with counting() as c:
        n = _compiles_while_tracing(f, x)
    assert c["roots"] == 0 and c["newton"] == 0, dict(c)
    assert n <= 35, n
    got = jax.jit(f)(x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-10)
    # (the inverse still solves: its roots taken)
    with counting() as c:
        jax.make_jaxpr(jr.inverse_and_slogdet(lambda x: bij.transform(x)))(want[0])
    assert c["roots"] > 0
