"""Reversible Runge–Kutta for diffrax (issue 31): `jaxrev.diffrax.Reversible(solver)` makes any
explicit Runge–Kutta solver algebraically reversible (McCallum & Foster 2024) and
`ReversibleAdjoint` differentiates it by running it backwards, at constant and adaptive steps.

Checked against `DirectAdjoint` on the same `Reversible(...)` solve (float64), the order of the
scheme measured against a fine reference, memory against the number of steps, and the refusals.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from tiers import tiered

jax.config.update("jax_enable_x64", True)
diffrax = pytest.importorskip("diffrax")
eqx = pytest.importorskip("equinox")

import jaxrev as jr  # noqa: E402
from jaxrev.diffrax import Reversible, ReversibleAdjoint  # noqa: E402

SOLVERS = ["Euler", "Heun", "Midpoint", "Ralston", "Bosh3", "Tsit5", "Dopri5", "Dopri8"]
Y0 = jnp.linspace(0.1, 0.5, 4)
TH = jax.random.normal(jax.random.PRNGKey(0), (4, 4)) * 0.5


def field(t, y, th):
    return jnp.tanh(th @ y) - 0.1 * y * jnp.sin(t)


# max_steps: 200 constant steps, or the adaptive solves' few dozen, with room (DirectAdjoint
# compiles its nested checkpointed loops for max_steps: 4096 took 60 % longer than 256)
def solve(
    th, y0, solver, adjoint, *, t1=1.0, dt0=1.0 / 200, saveat=None, controller=None, max_steps=256
):
    return diffrax.diffeqsolve(
        diffrax.ODETerm(field),
        solver,
        0.0,
        t1,
        dt0,
        y0,
        args=th,
        saveat=saveat or diffrax.SaveAt(t1=True),
        adjoint=adjoint,
        stepsize_controller=controller or diffrax.ConstantStepSize(),
        max_steps=max_steps,
    )


def value_and_grads(adjoint, solver, **kw):
    def loss(th, y0, t1):
        ys = jax.tree_util.tree_leaves(solve(th, y0, solver, adjoint, t1=t1, **kw).ys)
        return sum(jnp.sum(jnp.sin(y) * jnp.arange(1, y.shape[-1] + 1)) for y in ys)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(TH, Y0, 1.0)


def assert_close(got, ref, rtol):
    for a, b in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        scale = float(jnp.max(jnp.abs(a))) or 1.0
        assert float(jnp.max(jnp.abs(a - b))) <= rtol * scale, (a, b)


# by default one solver of each tableau shape (1, 2, 3 and 7 stages, FSAL included); the
# other two-stage ones and Dopri5 take the same path, slowly; Dopri8's 13 stages (2.5 min
# of the slow tier) only in the soak tier
@pytest.mark.parametrize(
    "name", tiered(SOLVERS, slow={"Midpoint", "Ralston", "Dopri5"}, soak={"Dopri8"})
)
def test_every_explicit_solver_equals_direct_adjoint(name):
    """200 constant steps: the value and the gradients (parameters, y0 and t1) of the
    backward-run solve equal DirectAdjoint's on the same reversible solve."""
    solver = Reversible(getattr(diffrax, name)())
    ref = value_and_grads(diffrax.DirectAdjoint(), solver)
    got = value_and_grads(ReversibleAdjoint(), solver)
    assert_close(got, ref, 1e-10)


def _order(name, n0=16):
    """The observed order of Reversible(name) on a pendulum over [0, 4]: the slope of the
    final error against a fine Dopri8 reference as the step halves."""
    term = diffrax.ODETerm(lambda t, y, a: jnp.stack([y[1], -jnp.sin(y[0]) - 0.1 * y[1]]))
    y0 = jnp.array([1.2, 0.0])
    ref = diffrax.diffeqsolve(term, diffrax.Dopri8(), 0.0, 4.0, 4.0 / 4096, y0, max_steps=5000).ys[
        -1
    ]
    errs = []
    for n in (n0, 2 * n0, 4 * n0):
        y = diffrax.diffeqsolve(
            term, Reversible(getattr(diffrax, name)()), 0.0, 4.0, 4.0 / n, y0, max_steps=n + 1
        ).ys[-1]
        errs.append(float(jnp.max(jnp.abs(y - ref))))
    return np.log2(errs[0] / errs[1]), np.log2(errs[1] / errs[2])


def test_order_of_the_base_method_is_kept():
    tsit = _order("Tsit5")
    heun = _order("Heun")
    assert min(tsit) >= 4.0, tsit
    assert min(heun) >= 1.8, heun


ADAPTIVE = diffrax.PIDController(rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "saveat",
    # by default the save at t0, intermediate times (one repeated) and t1, whose path holds
    # the plain t1 one's
    [
        pytest.param(diffrax.SaveAt(t1=True), marks=pytest.mark.slow),
        diffrax.SaveAt(t0=True, ts=jnp.array([0.05, 0.3, 0.3, 0.8]), t1=True),
        pytest.param(
            diffrax.SaveAt(
                subs=[
                    diffrax.SubSaveAt(ts=jnp.array([0.6, 0.9])),
                    diffrax.SubSaveAt(t1=True, fn=lambda t, y, a: y[:2] * t),
                ]
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["t1", "t0-ts-t1", "subs"],
)
def test_adaptive_steps_equal_direct_adjoint(saveat):
    """PIDController: the accepted steps are found by a solve that is not differentiated
    (diffrax's controller stops gradients through its step sizes too) and replayed
    backwards; t1's gradient moves the last step, as in diffrax."""
    solver = Reversible(diffrax.Tsit5())
    kw = dict(saveat=saveat, controller=ADAPTIVE, dt0=0.05)
    ref = value_and_grads(diffrax.DirectAdjoint(), solver, **kw)
    got = value_and_grads(ReversibleAdjoint(), solver, **kw)
    assert_close(got, ref, 1e-8)


def test_adaptive_under_vmap_with_an_equinox_field_and_filter_grad():
    mlp = eqx.nn.MLP(3, 3, 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(1))
    y0s = jax.random.normal(jax.random.PRNGKey(2), (5, 3))

    def loss(model, adjoint):
        def one(y0):
            return diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, m: m(y)),
                Reversible(diffrax.Bosh3()),
                0.0,
                1.5,
                0.1,
                y0,
                args=model,
                adjoint=adjoint,
                max_steps=512,
                stepsize_controller=diffrax.PIDController(rtol=1e-5, atol=1e-7),
            ).ys[-1]

        return jnp.sum(jax.vmap(one)(y0s) ** 2)

    ref = eqx.filter_jit(eqx.filter_value_and_grad(loss))(mlp, diffrax.DirectAdjoint())
    got = eqx.filter_jit(eqx.filter_value_and_grad(loss))(mlp, ReversibleAdjoint())
    assert_close(got, ref, 1e-8)


def test_float32_gradients_as_accurate_as_direct_adjoint():
    """float32, 2 000 Tsit5 steps, the defaults: no drift error, and the gradient is as close
    to the float64 one as DirectAdjoint's float32 gradient is."""
    solver = Reversible(diffrax.Tsit5())

    def grads(adjoint, dtype):
        def loss(th):
            ys = diffrax.diffeqsolve(
                diffrax.ODETerm(field),
                solver,
                0.0,
                4.0,
                4.0 / 2000,
                Y0.astype(dtype),
                args=th,
                adjoint=adjoint,
                max_steps=2001,
            ).ys
            return jnp.sum(ys**2)

        return jax.jit(jax.grad(loss))(TH.astype(dtype))

    exact = grads(diffrax.DirectAdjoint(), jnp.float64)
    err = lambda g: rel_error(g, exact)
    ours = err(grads(ReversibleAdjoint(), jnp.float32))
    theirs = err(grads(diffrax.DirectAdjoint(), jnp.float32))
    assert ours <= 2 * theirs + 1e-6, (ours, theirs)


def test_memory_is_flat_in_the_number_of_steps():
    """Scratch of one jitted gradient of a Tsit5 solve with max_steps = steps, from 10³ to
    1.6 × 10⁴ steps: nothing is stored per step."""
    y0 = jnp.linspace(-1.0, 1.0, 64)

    def temp(n):
        def loss(th):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, th: jnp.tanh(th * y)),
                Reversible(diffrax.Tsit5()),
                0.0,
                1.0,
                1.0 / n,
                y0,
                args=th,
                adjoint=ReversibleAdjoint(),
                max_steps=n,
            )
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss)).lower(0.5).compile().memory_analysis().temp_size_in_bytes

    small, large = temp(1000), temp(16000)
    assert large <= small * 1.05 + 1024, (small, large)


@pytest.mark.slow  # (its two compiles; the dial's choice itself: tests/test_drift.py)
def test_a_memory_budget_the_repair_cannot_meet_is_said_and_the_gradient_kept():
    """`ReversibleAdjoint(memory_budget=...)` below what a repairing solve needs (the
    checkpoints and one segment's carries) takes that least and warns, naming the adjoint;
    the gradient is diffrax's (RecursiveCheckpointAdjoint through the same solve)."""
    solver = Reversible(diffrax.Tsit5())
    steps = dict(dt0=1.0 / 50, max_steps=50)
    ref = value_and_grads(diffrax.RecursiveCheckpointAdjoint(), solver, **steps)
    with pytest.warns(jr.PerformanceWarning, match=r"ReversibleAdjoint.*memory_budget=200 "):
        got = value_and_grads(ReversibleAdjoint(memory_budget=200), solver, **steps)
    assert_close(got, ref, 1e-10)


def test_solvers_that_cannot_be_made_reversible_are_refused():
    with pytest.raises(ValueError, match=r"explicit Runge.*not Kvaerno5"):
        Reversible(diffrax.Kvaerno5())
    with pytest.raises(ValueError, match=r"explicit Runge.*not SemiImplicitEuler"):
        Reversible(diffrax.SemiImplicitEuler())
    with pytest.raises(ValueError, match=r"explicit Runge.*not SRA1"):
        Reversible(diffrax.SRA1())
    with pytest.raises(ValueError, match="coupling"):
        Reversible(diffrax.Tsit5(), coupling=0.0)
    term = diffrax.ODETerm(lambda t, y, a: -y)
    kw = dict(adjoint=ReversibleAdjoint(), max_steps=100)
    with pytest.raises(ValueError, match=r"Kvaerno5.*Reversible\(s\)"):
        diffrax.diffeqsolve(
            term, diffrax.Kvaerno5(), 0.0, 1.0, 0.1, jnp.ones(2), stepsize_controller=ADAPTIVE, **kw
        )
    with pytest.raises(ValueError, match=r"SemiImplicitEuler.*Reversible\(s\)"):
        diffrax.diffeqsolve(
            (term, term),
            diffrax.SemiImplicitEuler(),
            0.0,
            1.0,
            0.1,
            (jnp.ones(2), jnp.ones(2)),
            **kw,
        )
    with pytest.raises(ValueError, match=r"Dopri5.*Reversible\(Dopri5\(\)\)"):
        diffrax.diffeqsolve(term, diffrax.Dopri5(), 0.0, 1.0, 0.1, jnp.ones(2), **kw)
