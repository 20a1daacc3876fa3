"""Timing for the examples' printed figures (the benchmarks have their own, interleaved)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax


def seconds_per_call(f: Callable, *args: Any, number: int = 10, repeat: int = 5) -> float:
    """Best of `repeat` timings of `number` calls (after a warm-up call that compiles)."""
    jax.block_until_ready(f(*args))
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(number):
            out = f(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / number)
    return best
