"""Programs whose steps are invertible only as nonlinear groups (docs/design.md §3.6), shared by
`test_nonlinear.py` and the sharded run of `test_sharding.py`.

Each case is ``(fun, state, param)`` with ``fun(state, param)`` returning the state's
structure: `reverse` inverts it, `reversible` differentiates it.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax


def simultaneous(n: int, h: float = 1.0):
    """n steps of the simultaneous update ``(x, y) -> (x + h tanh(t y), y + h sin(x))``."""

    def fun(s, t):
        def step(c, _):
            x, y = c
            return (x + h * jnp.tanh(t * y), y + h * jnp.sin(x)), None

        return lax.scan(step, s, None, length=n)[0]

    return fun


def heun(n: int, dt: float = 0.01):
    """n steps of McCallum et al.'s reversible Heun method for ``dz/dt = tanh(W z)``."""

    def fun(s, W):
        f = lambda v: jnp.tanh(W @ v)  # noqa: E731

        def step(c, _):
            y, z = c
            z1 = 2.0 * y - z + dt * f(z)
            y1 = y + 0.5 * dt * (f(z) + f(z1))
            return (y1, z1), None

        return lax.scan(step, s, None, length=n)[0]

    return fun


def residual(x, a):
    """``x + a tanh(x)``: monotone for a > -1, no closed-form inverse."""
    return x + a * jnp.tanh(x)


def logit(p, scale):
    """The logit written as ``log(p) - log1p(-p)`` (two uses of p), scaled."""
    return scale * (jnp.log(p) - jnp.log1p(-p))


def _field(q, p):
    return p, -jnp.sin(q) - 0.1 * q**3


def midpoint(n: int, iterations: int = 30):
    """n implicit-midpoint steps of a nonlinear oscillator, each step's equation
    ``y1 = y + h f((y + y1) / 2)`` solved by fixed-point iterations in a fori_loop."""

    def fun(s, h):
        def one(s):
            q, p = s

            def fp(_, c):
                dq, dp = _field((q + c[0]) / 2, (p + c[1]) / 2)
                return q + h * dq, p + h * dp

            return lax.fori_loop(0, iterations, fp, (q, p))

        return lax.scan(lambda c, _: (one(c), None), s, None, length=n)[0]

    return fun


ROUND_TRIP = {"heun-1000": 1e-12, "simultaneous-50": 1e-9}
"""The round trips' bounds by case, 1e-10 for the others: 1e-12 where elimination solves the
group exactly (Heun), 1e-10 where Newton's method does (it stops at the rounding floor, and
the backward run of an expanding map amplifies that floor). The 50-step simultaneous map's
inverse grows |x| <= 1 to |y| near 46: its round trip is 1e-10 compiled with XLA's
optimizations and 4e-10 without (as the tests compile, in process and in the subprocesses
they start: tests/conftest.py)."""


def cases(width: int = 16) -> dict:
    """name -> (fun, state, param), float64, states of `width` elements (Heun: 64)."""
    rng = np.random.default_rng(0)
    lin = np.linspace(-1.0, 1.0, width)
    W = rng.standard_normal((64, 64)) / 8.0
    z0 = rng.standard_normal(64) * 0.5
    return {
        "simultaneous-50": (simultaneous(50), (lin, 0.5 * lin[::-1]), 0.7),
        "simultaneous-1000": (simultaneous(1000, h=0.05), (lin, 0.5 * lin[::-1]), 0.7),
        "heun-1000": (heun(1000), (z0, z0), W),
        "residual": (residual, 3.0 * lin, 0.5),
        "logit": (logit, np.linspace(0.02, 0.98, width), 1.5),
        "midpoint-100": (midpoint(100), (0.8 * lin, 0.3 * lin[::-1]), 0.1),
    }
