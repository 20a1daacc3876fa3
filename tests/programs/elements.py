"""Programs written the way users write them, with masks, `where`, splits, `.at[i]` loops and
state-dependent selects (issue 15): shared by tests/test_elements.py and the benchmarks.

Every entry of `PROGRAMS` is ``name -> (fun, state, params)``; `fun(state, params)` is a
bijection of the state. The bijectors follow distrax's and TFP's own formulations:
`MaskedCoupling` masks the conditioner's input with ``where(mask, x, 0.)`` and the output with
``where(mask, x, y0)``; `SplitCoupling` splits with `jnp.split`; the sigmoid and softplus are
distrax's ``_more_stable_sigmoid`` / ``_more_stable_softplus``; the rational-quadratic spline is
Durkan et al.'s, with a bin search, gathered knots and linear tails outside the interval.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def mlp_params(key: jax.Array, n_in: int, hidden: int, n_out: int, scale: float = 0.1) -> dict:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (n_in, hidden)) / np.sqrt(n_in),
        "b1": jnp.zeros(hidden),
        "w2": scale * jax.random.normal(k2, (hidden, n_out)) / np.sqrt(hidden),
        "b2": jnp.zeros(n_out),
    }


def mlp(p: dict, x: jax.Array) -> jax.Array:
    return jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]


# --------------------------------------------------------------------------- couplings


def masked_coupling(x: jax.Array, p: dict, mask: jax.Array) -> jax.Array:
    """distrax.MaskedCoupling with an affine inner bijector and an MLP conditioner."""
    masked_x = jnp.where(mask, x, 0.0)
    out = mlp(p, masked_x)
    n = x.shape[-1]
    log_scale, shift = jnp.tanh(out[..., :n]), out[..., n:]
    y0 = x * jnp.exp(log_scale) + shift
    return jnp.where(mask, x, y0)


def split_coupling(x: jax.Array, p: dict) -> jax.Array:
    """distrax.SplitCoupling: split, condition the second half on the first, recombine."""
    x1, x2 = jnp.split(x, [x.shape[-1] // 2], axis=-1)
    out = mlp(p, x1)
    k = x2.shape[-1]
    y2 = x2 * jnp.exp(jnp.tanh(out[..., :k])) + out[..., k:]
    return jnp.concatenate([x1, y2], axis=-1)


def arithmetic_masked_coupling(x: jax.Array, p: dict, mask: jax.Array) -> jax.Array:
    """The mask as a float, by arithmetic (as Glow/RealNVP code often writes it):
    ``x * m + (1 - m) * (x * exp(s) + t)`` with the conditioner on ``x * m``."""
    m = mask.astype(x.dtype)
    xm = x * m
    out = mlp(p, xm)
    n = x.shape[-1]
    return xm + (1 - m) * (x * jnp.exp(jnp.tanh(out[..., :n])) + out[..., n:])


def realnvp(x: jax.Array, ps: list) -> jax.Array:
    """Four masked couplings with alternating (checkerboard) masks."""
    n = x.shape[-1]
    even = jnp.arange(n) % 2 == 0
    for k, p in enumerate(ps):
        x = masked_coupling(x, p, even if k % 2 == 0 else ~even)
    return x


# --------------------------------------------------------------------------- selects on the state


def leaky_net(x: jax.Array, ws: list) -> jax.Array:
    """A leaky-relu network of square, well-conditioned layers."""
    for w in ws:
        x = jax.nn.leaky_relu(x @ w, 0.1)
    return x


def more_stable_sigmoid(x: jax.Array, p: dict) -> jax.Array:
    """distrax's `_more_stable_sigmoid`, after an affine map."""
    x = x * p["a"] + p["b"]
    return jnp.where(x < -9, jnp.exp(x), jax.nn.sigmoid(x))


def more_stable_softplus(x: jax.Array, p: dict) -> jax.Array:
    """distrax's `_more_stable_softplus` (`jax.nn.softplus` is `logaddexp(x, 0)`: a max and
    an abs), after an affine map."""
    x = x * p["a"] + p["b"]
    return jnp.where(x < -9, jnp.log1p(jnp.exp(x)), jax.nn.softplus(x))


def rq_knots(key: jax.Array, bins: int = 6, bound: float = 3.0) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    w = jax.nn.softmax(jax.random.normal(k1, (bins,))) * 2 * bound
    h = jax.nn.softmax(jax.random.normal(k2, (bins,))) * 2 * bound
    d = jnp.concatenate(
        [jnp.ones(1), jax.nn.softplus(jax.random.normal(k3, (bins - 1,))) + 1e-3, jnp.ones(1)]
    )
    xk = jnp.concatenate([jnp.full(1, -bound), -bound + jnp.cumsum(w)])
    yk = jnp.concatenate([jnp.full(1, -bound), -bound + jnp.cumsum(h)])
    return {"xk": xk, "yk": yk, "d": d}


def rq_spline(x: jax.Array, p: dict, bound: float = 3.0) -> jax.Array:
    """A monotone rational-quadratic spline on [-bound, bound], identity outside: the bin by
    `searchsorted`, its knots by `take`, the interval by `where`."""
    xk, yk, d = p["xk"], p["yk"], p["d"]
    bins = xk.shape[0] - 1
    inside = (x > -bound) & (x < bound)
    idx = jnp.clip(jnp.searchsorted(xk, x, side="right") - 1, 0, bins - 1)
    x0, x1 = jnp.take(xk, idx), jnp.take(xk, idx + 1)
    y0, y1 = jnp.take(yk, idx), jnp.take(yk, idx + 1)
    d0, d1 = jnp.take(d, idx), jnp.take(d, idx + 1)
    w, h = x1 - x0, y1 - y0
    s = h / w
    z = (x - x0) / w
    num = h * (s * z * z + d0 * z * (1 - z))
    den = s + (d1 + d0 - 2 * s) * z * (1 - z)
    return jnp.where(inside, y0 + num / den, x)


# --------------------------------------------------------------------------- element loops


def add_up(x: jax.Array, p: dict) -> jax.Array:
    """NiLang's chain: x[i] += tanh(w[i] x[i-1]), running up."""
    n = x.shape[0]
    return lax.fori_loop(1, n, lambda i, x: x.at[i].add(jnp.tanh(p["w"][i] * x[i - 1])), x)


def add_down(x: jax.Array, p: dict) -> jax.Array:
    """The same chain running down: x[n-2-k] += sin(x[n-1-k])."""
    n = x.shape[0]
    return lax.fori_loop(
        0, n - 1, lambda k, x: x.at[n - 2 - k].add(jnp.sin(p["w"][k] * x[n - 1 - k])), x
    )


def mul_chain(x: jax.Array, p: dict) -> jax.Array:
    """x[i] *= 1.5 + tanh(x[i-1]): a positive factor read off the previous slot."""
    n = x.shape[0]
    return lax.fori_loop(1, n, lambda i, x: x.at[i].multiply(1.5 + jnp.tanh(x[i - 1])), x)


def swaps(x: jax.Array, p: dict) -> jax.Array:
    """Reverse the array by swaps, then a step that makes the order matter."""
    n = x.shape[0]

    def body(i, x):
        j = n - 1 - i
        x = x.at[i].set(x[j]).at[j].set(x[i])
        return x.at[j].add(0.5 * jnp.tanh(x[i]))

    return lax.fori_loop(0, n // 2, body, x)


def windows(x: jax.Array, p: dict) -> jax.Array:
    """A sliding window of two updated from the element past it (`dynamic_update_slice`)."""
    n = x.shape[0]

    def body(i, x):
        seg = lax.dynamic_slice(x, (i,), (2,))
        nxt = lax.dynamic_slice(x, (i + 2,), (1,))
        return lax.dynamic_update_slice(x, seg + p["w"][i] * jnp.sin(nxt), (i,))

    return lax.fori_loop(0, n - 2, body, x)


def strided(x: jax.Array, p: dict) -> jax.Array:
    """Odd slots from even ones, then even slots scaled by their odd neighbours."""
    n = x.shape[0]
    x = lax.fori_loop(0, n // 2, lambda i, x: x.at[2 * i + 1].add(jnp.tanh(x[2 * i])), x)
    return lax.fori_loop(
        0, n // 2, lambda i, x: x.at[2 * i].multiply(jnp.exp(0.5 * jnp.tanh(x[2 * i + 1]))), x
    )


def scan_chain(x: jax.Array, p: dict) -> jax.Array:
    """A scan whose index comes as its `xs` (a static `arange`)."""
    n = x.shape[0]
    return lax.scan(lambda x, i: (x.at[i].add(jnp.tanh(x[i - 1]) ** 3), None), x, jnp.arange(1, n))[
        0
    ]


def masked_steps(k: int):
    """diffrax's way: every step masked with ``where(keep, new, old)``, `keep` known only when
    the program runs (a function of time): issue 15's tracing-cost program."""

    def f(ab: tuple, t: jax.Array) -> tuple:
        a, b = ab
        keep = t > 0.5
        for _ in range(k):
            a2 = a + jnp.tanh(b)
            b2 = b + jnp.sin(a2)
            a, b = jnp.where(keep, a2, a), jnp.where(keep, b2, b)
        return a, b

    return f


# --------------------------------------------------------------------------- the catalogue


def programs(n: int = 16, seed: int = 0) -> dict:
    """name -> (fun, state, params) for the default sizes of the tests."""
    key = jax.random.PRNGKey(seed)
    keys = jax.random.split(key, 8)
    x = jax.random.normal(keys[0], (n,))
    even = jnp.arange(n) % 2 == 0
    ws = [jnp.eye(n) + 0.3 * jax.random.normal(k, (n, n)) / np.sqrt(n) for k in keys[1:4]]
    w = {"w": 0.5 + 0.5 * jax.random.uniform(keys[4], (n,))}
    ab = {"a": jnp.asarray(4.0), "b": jnp.asarray(-2.0)}
    return {
        "masked_coupling": (
            lambda x, p: masked_coupling(x, p, even),
            x,
            mlp_params(keys[5], n, 32, 2 * n),
        ),
        "arithmetic_masked_coupling": (
            lambda x, p: arithmetic_masked_coupling(x, p, ~even),
            x,
            mlp_params(keys[6], n, 32, 2 * n),
        ),
        "split_coupling": (split_coupling, x, mlp_params(keys[6], n // 2, 32, n)),
        "realnvp": (
            realnvp,
            x,
            [mlp_params(k, n, 32, 2 * n) for k in jax.random.split(keys[7], 4)],
        ),
        "leaky_net": (leaky_net, x, ws),
        "stable_sigmoid": (more_stable_sigmoid, x, ab),
        "stable_softplus": (more_stable_softplus, x, ab),
        "rq_spline": (rq_spline, 2.0 * x, rq_knots(keys[5])),
        "add_up": (add_up, x, w),
        "add_down": (add_down, x, w),
        "mul_chain": (mul_chain, x, w),
        "swaps": (swaps, x, w),
        "windows": (windows, x, w),
        "strided": (strided, x, w),
        "scan_chain": (scan_chain, 0.5 * x, w),
    }


LOOPS = ["add_up", "add_down", "mul_chain", "swaps", "windows", "strided", "scan_chain"]
