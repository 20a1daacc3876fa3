"""Loops that read large constants a little at a time (docs/design.md §3.8: their cotangents
are accumulated in place): gradients equal to `jax.grad`'s, drifting or not, without a copy of
the constants' cotangents per segment."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxrev as jr

TABLE = 20_000  # constants far larger than a segment's work: accumulated in place
STEPS = 2_000


def lookup_sum(state, table, idx):
    """acc += table[idx[t]] * x, x += 1e-3 acc: scalar steps reading one table entry each."""

    def step(carry, i):
        x, acc = carry
        acc = acc + table[i] * x
        return (x + 1e-3 * acc, acc), None

    return lax.scan(step, state, idx)[0]


def heavy_ball(state, table, idx):
    """v = 0.9 v + table[idx[t]] tanh x, x += 0.01 v: run backwards, v is divided by 0.9 a
    step, so the fully reversible rebuild drifts by 1/0.9^T."""

    def step(carry, i):
        x, v = carry
        v = 0.9 * v + table[i] * jnp.tanh(x)
        return (x + 0.01 * v, v), None

    return lax.scan(step, state, idx)[0]


def data(seed=0):
    rng = np.random.default_rng(seed)
    table = jnp.asarray(rng.standard_normal(TABLE))
    idx = jnp.asarray(rng.integers(0, TABLE, STEPS), jnp.int32)
    return table, idx


def loss_of(loop):
    def loss(state, table, idx):
        x, y = loop(state, table, idx)
        return x**2 + jnp.sin(y)

    return loss


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("program", [lookup_sum, heavy_ball])
def test_gradient_equals_jax_grad(program):
    table, idx = data()
    state = (jnp.asarray(0.3), jnp.asarray(0.1))
    ref = jax.grad(loss_of(program), argnums=(0, 1))(state, table, idx)
    got = jax.jit(jax.grad(loss_of(jr.reversible(program)), argnums=(0, 1)))(state, table, idx)
    for r, g in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        assert rel(g, r) < 1e-10
    if program is heavy_ball:  # the repair did something: the fully reversible one is off
        fully = jr.reversible(program, checkpoint_every=None, on_drift="ignore")
        bad = jax.jit(jax.grad(loss_of(fully), argnums=1))(state, table, idx)
        assert not rel(bad, ref[1]) < 1e-6


def test_no_copy_of_the_constants_cotangent_per_segment():
    """The default's scratch is the fully reversible mode's plus its checkpoints and one
    segment's carries: no table-sized buffer beyond the gradient itself."""
    table, idx = data()
    state = (jnp.asarray(0.3), jnp.asarray(0.1))

    def scratch(loop):
        g = jax.grad(loss_of(loop), argnums=1)
        return jax.jit(g).lower(state, table, idx).compile().memory_analysis().temp_size_in_bytes

    fully = scratch(jr.reversible(lookup_sum, checkpoint_every=None, on_drift="ignore"))
    default = scratch(jr.reversible(lookup_sum))
    assert default - fully < table.nbytes / 4, (fully, default)


def test_vmap_and_eager_agree_with_jit():
    table, idx = data(1)
    x0 = jnp.linspace(-1.0, 1.0, 3)
    loss = loss_of(jr.reversible(heavy_ball))
    grad = jax.grad(lambda x, t: loss((x, jnp.asarray(0.0)), t, idx), argnums=(0, 1))
    batched = jax.jit(jax.vmap(grad, in_axes=(0, None)))(x0, table)
    ref = jax.vmap(
        jax.grad(lambda x, t: loss_of(heavy_ball)((x, jnp.asarray(0.0)), t, idx), argnums=(0, 1)),
        in_axes=(0, None),
    )(x0, table)
    for r, g in zip(ref, batched):
        assert rel(g, r) < 1e-10
    eager = grad(x0[0], table)
    assert rel(eager[1], batched[1][0]) < 1e-12
