"""A reversible GRU (MacKay, Vicol, Ba & Grosse 2018): two halves of the hidden state, each
updated by ``z * h + (1 - z) * tanh(...)`` with a gate z computed from the other half and the
input, limited to forgetting at most half a step (z in [0.5, 1]). Each gate multiplies its half
by a factor per element and step: exact reversal's elementwise multiplications (its test and
`benchmarks/exact_reversal.py` share it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

WEIGHTS = ("wz", "wg", "vz", "vg")
"""The weight matrices, each (hidden + inputs) x hidden: the first half's gate and candidate,
then the second half's."""


def reversible_gru(h, P, xs):
    """The halves `h = (h1, h2)` after the inputs `xs` (steps x batch x inputs), weights `P`."""

    def step(c, x):
        h1, h2 = c
        u = jnp.concatenate([h2, x], -1)
        z = 0.5 + 0.5 * jax.nn.sigmoid(u @ P["wz"])
        h1 = z * h1 + (1 - z) * jnp.tanh(u @ P["wg"])
        u = jnp.concatenate([h1, x], -1)
        z = 0.5 + 0.5 * jax.nn.sigmoid(u @ P["vz"])
        h2 = z * h2 + (1 - z) * jnp.tanh(u @ P["vg"])
        return (h1, h2), None

    return lax.scan(step, h, xs)[0]
