"""diffrax solves differentiated by jaxrev, written as diffrax users write them (issue 20).

Two ways. `jr.reversible(solve, max_steps=N)` over diffrax's own loop (Equinox's checkpointed
`while_loop`, whose body keeps flags and counters that are not invertible: `reversible` stores
those per iteration, so its memory is not flat). `diffeqsolve(..., adjoint=ReversibleAdjoint())`
(`jaxrev.diffrax`): jaxrev's own step loop, nothing stored per step, checked here against
`DirectAdjoint` (values and gradients) for every `SaveAt` form it supports.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrev as jr

jax.config.update("jax_enable_x64", True)
diffrax = pytest.importorskip("diffrax")

STEPS = 50


def solve(y0, th, adjoint=None):
    term = diffrax.ODETerm(lambda t, y, th: jnp.tanh(th * y[::-1]))
    sol = diffrax.diffeqsolve(
        term,
        diffrax.ReversibleHeun(),
        0.0,
        1.0,
        1.0 / STEPS,
        y0,
        args=th,
        saveat=diffrax.SaveAt(t1=True),
        adjoint=adjoint or diffrax.RecursiveCheckpointAdjoint(),
        max_steps=STEPS + 10,
    )
    return sol.ys[0]


def test_reversible_over_diffeqsolve():
    y0 = jnp.linspace(-1.0, 1.0, 4)
    ref = jax.grad(
        lambda y, th: jnp.sum(solve(y, th, diffrax.DirectAdjoint()) ** 2), argnums=(0, 1)
    )(y0, 0.5)
    f = jr.reversible(solve, max_steps=STEPS + 10)
    got = jax.jit(jax.grad(lambda y, th: jnp.sum(f(y, th) ** 2), argnums=(0, 1)))(y0, 0.5)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
    # without a bound, the lossy loop body is named
    with pytest.raises(jr.NotInvertibleError, match="max_steps"):
        jax.grad(lambda th: jnp.sum(jr.reversible(solve)(y0, th) ** 2))(0.5)


# --------------------------------------------------------------------------- ReversibleAdjoint

from jaxrev.diffrax import ReversibleAdjoint  # noqa: E402

eqx = pytest.importorskip("equinox")


def _solve_with(adjoint, y0, args, saveat, dt=1.0 / STEPS, field=None, controller=None):
    term = diffrax.ODETerm(field or (lambda t, y, th: jnp.tanh(th * y[::-1]) + 0.1 * t))
    return diffrax.diffeqsolve(
        term,
        diffrax.ReversibleHeun(),
        0.0,
        1.0,
        dt,
        y0,
        args=args,
        saveat=saveat,
        adjoint=adjoint,
        max_steps=256,  # 50 steps at most; DirectAdjoint compiles for max_steps
        stepsize_controller=controller or diffrax.ConstantStepSize(),
    )


SAVEATS = [
    diffrax.SaveAt(t1=True),
    diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 7)),
    diffrax.SaveAt(t0=True, ts=jnp.array([0.013, 0.5, 0.5, 0.77]), t1=True),
    diffrax.SaveAt(
        subs=[
            diffrax.SubSaveAt(ts=jnp.array([0.9, 0.95])),
            diffrax.SubSaveAt(ts=jnp.array([0.1, 0.3]), fn=lambda t, y, a: y[0] * t),
        ]
    ),
]


# dt = 0.3 does not divide the interval (diffrax then steps 0.3, 0.5, 0.75, 1.0); the other
# uneven cases, and the even step's t0-ts-t1 (the form the default run checks at the uneven
# step: 98 s of a worker under load), are slow-marked to keep the default suite short
CASES = [
    pytest.param(s, 1.0 / STEPS, id=f"even-{n}", marks=pytest.mark.slow if n == "t0-ts-t1" else ())
    for s, n in zip(SAVEATS, ["t1", "ts", "t0-ts-t1", "subs"])
] + [
    pytest.param(s, 0.3, id=f"uneven-{n}", marks=() if n == "t0-ts-t1" else pytest.mark.slow)
    for s, n in zip(SAVEATS, ["t1", "ts", "t0-ts-t1", "subs"])
]


@pytest.mark.parametrize("saveat,dt", CASES)
def test_reversible_adjoint_equals_direct_adjoint(saveat, dt):
    y0 = jnp.linspace(-1.0, 1.0, 4)
    a = _solve_with(diffrax.DirectAdjoint(), y0, 0.5, saveat, dt)
    b = _solve_with(ReversibleAdjoint(), y0, 0.5, saveat, dt)
    for x, z in zip(
        jax.tree_util.tree_leaves((a.ts, a.ys, a.stats)),
        jax.tree_util.tree_leaves((b.ts, b.ys, b.stats)),
    ):
        np.testing.assert_allclose(z, x, rtol=1e-13, atol=1e-14)

    def loss(adjoint):
        return lambda y, th: sum(
            jnp.sum(leaf**2)
            for leaf in jax.tree_util.tree_leaves(_solve_with(adjoint, y, th, saveat, dt).ys)
        )

    ref = jax.grad(loss(diffrax.DirectAdjoint()), argnums=(0, 1))(y0, 0.5)
    got = jax.jit(jax.grad(loss(ReversibleAdjoint()), argnums=(0, 1)))(y0, 0.5)
    for x, z in zip(ref, got):
        np.testing.assert_allclose(z, x, rtol=1e-10, atol=1e-12)


def test_reversible_adjoint_on_an_equinox_mlp_under_vmap():
    """diffrax's neural-ODE pattern: an eqx.nn.MLP field, a vmapped batch, filter_grad. The
    MLP ends in an affine layer, which made the step's linear lump look square but singular
    in a cut window (now refused, so the window widens)."""
    mlp = eqx.nn.MLP(4, 4, 16, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    y0 = jax.random.normal(jax.random.PRNGKey(1), (3, 4))
    saveat = diffrax.SaveAt(ts=jnp.linspace(0.0, 1.0, 5))

    def loss(model, adjoint):
        def one(y):
            return _solve_with(adjoint, y, model, saveat, 0.02, field=lambda t, y, m: m(y)).ys

        return jnp.sum(jax.vmap(one)(y0) ** 2)

    ref = eqx.filter_grad(loss)(mlp, diffrax.DirectAdjoint())
    got = eqx.filter_jit(eqx.filter_grad(loss))(mlp, ReversibleAdjoint())
    for x, z in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        np.testing.assert_allclose(z, x, rtol=1e-9, atol=1e-12)


def test_reversible_adjoint_step_to_and_max_steps():
    y0 = jnp.linspace(-1.0, 1.0, 4)
    ts = jnp.array([0.0, 0.1, 0.25, 0.3, 0.6, 1.0])
    ctrl = diffrax.StepTo(ts=ts)
    saveat = diffrax.SaveAt(ts=jnp.array([0.2, 0.7]), t1=True)
    a = _solve_with(diffrax.DirectAdjoint(), y0, 0.5, saveat, None, controller=ctrl)
    b = _solve_with(ReversibleAdjoint(), y0, 0.5, saveat, None, controller=ctrl)
    np.testing.assert_allclose(b.ys, a.ys, rtol=1e-13)
    g = jax.grad(
        lambda th: jnp.sum(
            _solve_with(ReversibleAdjoint(), y0, th, saveat, None, controller=ctrl).ys ** 2
        )
    )(0.5)
    r = jax.grad(
        lambda th: jnp.sum(
            _solve_with(diffrax.DirectAdjoint(), y0, th, saveat, None, controller=ctrl).ys ** 2
        )
    )(0.5)
    np.testing.assert_allclose(g, r, rtol=1e-10)
    # past max_steps the solve reports it, as diffrax does (throw=True raises)
    term = diffrax.ODETerm(lambda t, y, th: -th * y)
    with pytest.raises(Exception, match="max_steps|maximum number of solver steps"):
        diffrax.diffeqsolve(
            term,
            diffrax.ReversibleHeun(),
            0.0,
            1.0,
            0.01,
            y0,
            args=0.5,
            adjoint=ReversibleAdjoint(),
            max_steps=10,
        )


def test_reversible_adjoint_memory_is_flat_in_the_number_of_steps():
    y0 = jnp.linspace(-1.0, 1.0, 64)

    def temp(n, adjoint, bound=3001):
        def loss(th):
            sol = diffrax.diffeqsolve(
                diffrax.ODETerm(lambda t, y, th: jnp.tanh(th * y)),
                diffrax.ReversibleHeun(),
                0.0,
                1.0,
                1.0 / n,
                y0,
                args=th,
                adjoint=adjoint,
                max_steps=bound,
            )
            return jnp.sum(sol.ys**2)

        return jax.jit(jax.grad(loss)).lower(0.5).compile().memory_analysis().temp_size_in_bytes

    # the default stores nothing per step (its drift is checked at y0): flat in the number of
    # steps and in the bound; checkpoint_every="auto" keeps ⌈√max_steps⌉ checkpoints of the
    # carry so that a drifting segment is repaired: flat in the steps taken, not in the bound
    small, large = temp(100, ReversibleAdjoint(), 101), temp(3000, ReversibleAdjoint())
    assert large <= small * 1.05 + 1024
    assert large < temp(3000, diffrax.RecursiveCheckpointAdjoint()) / 4
    auto = ReversibleAdjoint(checkpoint_every="auto")
    assert temp(3000, auto) <= temp(100, auto) * 1.05 + 1024


def test_reversible_adjoint_refuses_what_it_cannot_do():
    y0 = jnp.ones(2)
    term = diffrax.ODETerm(lambda t, y, a: -y)
    kw = dict(adjoint=ReversibleAdjoint(), max_steps=100)
    with pytest.raises(ValueError, match="finite max_steps"):
        diffrax.diffeqsolve(
            term,
            diffrax.ReversibleHeun(),
            0.0,
            1.0,
            0.1,
            y0,
            stepsize_controller=diffrax.PIDController(rtol=1e-3, atol=1e-3),
            adjoint=ReversibleAdjoint(),
            max_steps=None,
        )
    with pytest.raises(ValueError, match="steps=True"):
        diffrax.diffeqsolve(
            term,
            diffrax.ReversibleHeun(),
            0.0,
            1.0,
            0.1,
            y0,
            saveat=diffrax.SaveAt(steps=True),
            **kw,
        )
    with pytest.raises(ValueError, match="dense"):
        diffrax.diffeqsolve(
            term,
            diffrax.ReversibleHeun(),
            0.0,
            1.0,
            0.1,
            y0,
            saveat=diffrax.SaveAt(dense=True),
            **kw,
        )
    # an explicit Runge–Kutta solver as it is loses information: the message says to wrap it
    with pytest.raises(ValueError, match=r"Tsit5.*Reversible\(Tsit5\(\)\)"):
        diffrax.diffeqsolve(term, diffrax.Tsit5(), 0.0, 1.0, 0.1, y0, **kw)
