"""`jr.reversible` over a diffrax solve, written as diffrax users write it (issue 20, part).

diffrax's step loop is Equinox's checkpointed `while_loop`, whose body keeps flags and
counters that are not invertible (`and` of step flags): with `max_steps` (the solve's own
bound) `reversible` stores those per iteration and differentiates the solve. What it stores
is listed by `memory_report`; it is not yet flat in the number of steps (Equinox's
`select_if_vmap` / `unvmap_*` primitives have no inverse rules).
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
    sol = diffrax.diffeqsolve(term, diffrax.ReversibleHeun(), 0.0, 1.0, 1.0 / STEPS, y0,
                              args=th, saveat=diffrax.SaveAt(t1=True),
                              adjoint=adjoint or diffrax.RecursiveCheckpointAdjoint(),
                              max_steps=STEPS + 10)
    return sol.ys[0]


def test_reversible_over_diffeqsolve():
    y0 = jnp.linspace(-1.0, 1.0, 4)
    ref = jax.grad(lambda y, th: jnp.sum(solve(y, th, diffrax.DirectAdjoint()) ** 2),
                   argnums=(0, 1))(y0, 0.5)
    f = jr.reversible(solve, max_steps=STEPS + 10)
    got = jax.jit(jax.grad(lambda y, th: jnp.sum(f(y, th) ** 2), argnums=(0, 1)))(y0, 0.5)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
    # without a bound, the lossy loop body is named
    with pytest.raises(jr.NotInvertibleError, match="max_steps"):
        jax.grad(lambda th: jnp.sum(jr.reversible(solve)(y0, th) ** 2))(0.5)
