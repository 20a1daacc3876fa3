"""Shared benchmark plumbing: XLA memory plans, interleaved timing, result files."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

# JAXREV_RESULTS: another folder (benchmarks/gpu.sh writes results/gpu/)
RESULTS = os.environ.get("JAXREV_RESULTS") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results"
)


def temp_bytes(fn: Callable, *args: Any) -> int:
    """XLA's planned scratch memory for `jit(fn)(*args)` (docs/design.md §4)."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def interleaved_medians(
    fns: dict[str, Callable[[], Any]], reps: int = 5, warmup: int = 1
) -> dict[str, float]:
    """Median seconds per call; calls are interleaved so machine noise hits all alike."""
    for f in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def write_results(name: str, data: dict, table: str) -> tuple[str, str]:
    os.makedirs(RESULTS, exist_ok=True)
    jpath = os.path.join(RESULTS, f"{name}.json")
    mpath = os.path.join(RESULTS, f"{name}.md")
    with open(jpath, "w") as f:
        json.dump(data, f, indent=1, default=float)
    with open(mpath, "w") as f:
        f.write(table)
    return jpath, mpath


def rel_err(ref: Any, got: Any) -> float:
    """max |ref - got| over every leaf, relative to the largest entry of `ref`."""
    la, lb = jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)
    scale = max(float(jnp.max(jnp.abs(a))) for a in la)
    return max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(la, lb)) / scale


def device_info() -> dict:
    d = jax.devices()[0]
    return {"backend": jax.default_backend(), "device": str(d.device_kind), "jax": jax.__version__}


def optional(module: str) -> Any:
    """A peer's module (from the `bench` extra), or None when it is not installed."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:  # pragma: no cover
        return None


def progress(iterable, **kwargs):
    """A tqdm progress bar when tqdm is installed (the `bench` extra), else the iterable."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return iterable
    return tqdm(iterable, **kwargs)


def pyplot():
    """matplotlib's pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    return plt


def plot_memory_and_time(
    name: str, steps: list, rows: list, names: list, titles: tuple[str, str] = ("memory", "time")
) -> None:
    """results/<name>.png: each method's temp memory (MB) and seconds against the number of
    steps, on log-log axes (rows hold ``mem`` and ``time`` dicts keyed by method)."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for k in names:
        ax[0].loglog(steps, [r["mem"][k] / 1e6 for r in rows], "o-", label=k)
        ax[1].loglog(steps, [r["time"][k] for r in rows], "o-", label=k)
    ax[0].set(xlabel="steps", ylabel="temp memory (MB)", title=titles[0])
    ax[1].set(xlabel="steps", ylabel="seconds", title=titles[1])
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=120)
