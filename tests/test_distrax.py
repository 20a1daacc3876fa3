"""distrax's spline bijectors taken as they are (issue 44): the forward map alone, inverted and
log-det'ed by jaxrev, against distrax's own inverse and log-det.

distrax finds a rational-quadratic spline's bin by a one-hot mask (``x >= x_pos[:-1]`` and
``x < x_pos[1:]``, multiplied into its knot table), not by an index: jaxrev decides those
comparisons together by the piece of the line the state lies in, found by one search
(`choices._Piece`). Skipped where distrax is not installed (it is in the `test` extra).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrev as jr

jax.config.update("jax_enable_x64", True)
distrax = pytest.importorskip("distrax")

K = 8


def _spline(boundary_slopes, n=5, seed=0, dtype=jnp.float64):
    params = 0.5 * jax.random.normal(jax.random.key(seed), (n, 3 * K + 1), dtype)
    return distrax.RationalQuadraticSpline(
        params, range_min=-3.0, range_max=3.0, boundary_slopes=boundary_slopes
    )


@pytest.mark.parametrize(
    "how",
    [
        # (eagerly, a first call runs operation by operation: some 450 small compilations,
        # 25 s in a fresh process, so in the slow tier; later calls run compiled)
        pytest.param("eager", marks=pytest.mark.slow),
        "jit",
        "vmap",
    ],
)
@pytest.mark.parametrize("boundary_slopes", ["identity", "unconstrained", "lower_identity"])
def test_rational_quadratic_spline_inverts_with_distrax_log_det(boundary_slopes, how):
    """Inside the range, on its ends (the knots where the one-hot mask switches) and on both
    linear tails: the inverse is the input, the log-det distrax's own (`vmap` under `jit`)."""
    bij = _spline(boundary_slopes)
    x = jnp.array([-4.5, -3.0, -0.7, 1.1, 3.0])
    f = bij.forward
    y = f(x)
    t = jr.inverse_and_slogdet(f)
    if how == "eager":
        xr, ld = t(y)
    elif how == "jit":
        xr, ld = jax.jit(t)(y)
    else:
        xr, ld = jax.jit(jax.vmap(t))(jnp.stack([y, y]))
        xr, ld = xr[1], ld[1]
    np.testing.assert_allclose(xr, x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, jnp.sum(bij.inverse_and_log_det(y)[1]), rtol=1e-10)


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_split_coupling_with_a_spline_conditioner_inverts(slow):
    """distrax's `SplitCoupling` (its conditioner reads the kept half, its bijector a spline
    per element of the other): refused at `split` before; now the inverse and the log-det
    are distrax's own, under `jit` (eagerly in the slow tier)."""
    w = 0.3 * jax.random.normal(jax.random.key(1), (3, 3 * (3 * K + 1)))

    def conditioner(x):
        return jnp.tanh(x @ w).reshape(x.shape[:-1] + (3, 3 * K + 1))

    layer = distrax.SplitCoupling(
        split_index=3,
        event_ndims=1,
        conditioner=conditioner,
        bijector=lambda p: distrax.RationalQuadraticSpline(p, range_min=-3.0, range_max=3.0),
    )
    x = 1.5 * jax.random.normal(jax.random.key(2), (6,))
    y = layer.forward(x)
    want_x, want_ld = layer.inverse_and_log_det(y)
    t = jr.inverse_and_slogdet(layer.forward)
    for t in [jax.jit(t)] + ([t] if slow else []):
        xr, ld = t(y)
        np.testing.assert_allclose(xr, x, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(xr, want_x, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ld, want_ld, rtol=1e-10)


def test_a_float32_spline_flow_under_jit_and_vmap_is_as_accurate_as_distrax():
    """Two spline couplings chained, float32, a batch under `jit(vmap(...))`: the inverse's
    error against the true input no worse than 4x distrax's own inverse's (float32 rounding
    through the same quadratic)."""

    def layer(seed, split, swap):
        w = 0.3 * jax.random.normal(jax.random.key(seed), (split, (4 - split) * (3 * K + 1)))

        def conditioner(x):
            return jnp.tanh(x @ w.astype(x.dtype)).reshape(x.shape[:-1] + (4 - split, 3 * K + 1))

        return distrax.SplitCoupling(
            split_index=split,
            event_ndims=1,
            conditioner=conditioner,
            bijector=lambda p: distrax.RationalQuadraticSpline(p, range_min=-4.0, range_max=4.0),
            swap=swap,
        )

    flow = distrax.Chain([layer(3, 2, False), layer(4, 2, True)])
    x = jax.random.normal(jax.random.key(5), (64, 4), jnp.float32) * 1.5
    y = jax.vmap(flow.forward)(x)
    xr, ld = jax.jit(jax.vmap(jr.inverse_and_slogdet(flow.forward)))(y)
    xl, ldl = jax.vmap(flow.inverse_and_log_det)(y)
    assert xr.dtype == jnp.float32
    err, lib = float(jnp.max(jnp.abs(xr - x))), float(jnp.max(jnp.abs(xl - x)))
    assert err <= 4 * lib + 1e-6, (err, lib)
    np.testing.assert_allclose(ld, ldl, rtol=1e-4, atol=1e-4)
