"""Splines written as their libraries write them, for tests of jaxrev's choices on them."""

from __future__ import annotations

import jax.numpy as jnp


def one_hot_spline(x, xs, ys, d):
    """A rational-quadratic spline of a scalar as distrax writes one: the bin by a one-hot mask
    over bins (no index, no search: comparisons with both ends of every bin), its parameters
    picked by masked sums, the ratio's argument clipped to [0, 1], linear tails by `where`.
    `xs`, `ys`: the knots (increasing for a monotone map); `d`: the slopes at them."""
    below, above = x <= xs[0], x >= xs[-1]  # <one-hot bins>
    in_bin = (x >= xs[:-1]) & (x < xs[1:])
    in_bin = jnp.where(jnp.any(in_bin), in_bin, jnp.arange(in_bin.shape[0]) == 0)
    table = jnp.stack([xs, ys, d], axis=1)
    left = jnp.sum(in_bin[:, None] * table[:-1], axis=0)
    right = jnp.sum(in_bin[:, None] * table[1:], axis=0)
    width, height = right[0] - left[0], right[1] - left[1]
    s = height / width
    z = jnp.clip((x - left[0]) / width, 0.0, 1.0)
    y = left[1] + height * (s * z**2 + left[2] * z * (1 - z)) / (
        s + (right[2] + left[2] - 2 * s) * z * (1 - z)
    )
    y = jnp.where(below, (x - xs[0]) * d[0] + ys[0], y)
    return jnp.where(above, (x - xs[-1]) * d[-1] + ys[-1], y)
