"""Reversible Heun (McCallum et al.) through `jr.reversible`: memory and time against
`jax.grad` and against the same scan with `jax.checkpoint` on the step (issue 16).

The step ``z1 = 2y - z + dt f(z)``, ``y1 = y + dt/2 (f(z) + f(z1))`` with ``f = tanh(W .)``
(64-dim, dt = 0.01) is not invertible equation by equation; `reversible` inverts it by exact
linear elimination (``z = 2 y1 - z1 - dt f(z1)``) and stores nothing per step. Gradient of a
loss of the final state with respect to the initial state and W, at 10^2 .. 10^4 steps.

Memory is XLA's plan (`compile().memory_analysis().temp_size_in_bytes`); time is the median of
interleaved runs in one process. Writes results/reversible_heun.{json,md,png}.

    python benchmarks/reversible_heun.py            # full run (about 5 minutes)
    python benchmarks/reversible_heun.py --quick    # small sizes, a smoke test
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    device_info,
    interleaved_medians,
    plot_memory_and_time,  # noqa: E402
    progress,
    rel_err,
    temp_bytes,
    write_results,
)

import jaxrev as jr  # noqa: E402

DIM, DT = 64, 0.01


def heun(n: int, checkpoint: bool = False):
    def step(c, W):
        y, z = c
        f = lambda v: jnp.tanh(W @ v)  # noqa: E731
        z1 = 2.0 * y - z + DT * f(z)
        return y + 0.5 * DT * (f(z) + f(z1)), z1

    if checkpoint:
        step = jax.checkpoint(step)

    def fun(s, W):
        return lax.scan(lambda c, _: (step(c, W), None), s, None, length=n)[0]

    return fun


def loss_of(fun):
    return jax.grad(
        lambda s, W: jnp.sum(jnp.sin(fun(s, W)[0])) + jnp.sum(fun(s, W)[1] ** 2), argnums=(0, 1)
    )


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    steps = [100, 1000] if args.quick else [100, 1000, 3000, 10000]
    rng = np.random.default_rng(0)
    W = jnp.asarray(rng.standard_normal((DIM, DIM)) / 8.0)
    z0 = jnp.asarray(rng.standard_normal(DIM) * 0.5)
    s = (z0, z0)
    methods = {
        "jax.grad": lambda n: heun(n),
        "jax.checkpoint": lambda n: heun(n, True),
        "jr.reversible": lambda n: jr.reversible(heun(n)),
    }
    rows = []
    for n in progress(steps, desc="reversible Heun steps"):
        row = {"steps": n, "mem": {}, "time": {}}
        grads = {k: jax.jit(loss_of(mk(n))) for k, mk in methods.items()}
        for k, g in grads.items():
            row["mem"][k] = temp_bytes(g, s, W)
        ref = grads["jax.grad"](s, W)
        row["err"] = rel_err(ref, grads["jr.reversible"](s, W))
        # float32, both against the float64 reference: the default within 2x jax.grad's own
        s32, W32 = [a.astype(jnp.float32) for a in s], W.astype(jnp.float32)
        row["err32"] = {
            k: rel_err(ref, grads[k](tuple(s32), W32)) for k in ("jax.grad", "jr.reversible")
        }
        row["report_bytes"] = jr.memory_report(heun(n), s, W).total_bytes
        row["time"] = interleaved_medians(
            {k: (lambda g=g: g(s, W)) for k, g in grads.items()}, reps=5
        )
        rows.append(row)

    names = list(methods)
    lines = [
        f"# Reversible Heun, {DIM}-dim, dt = {DT} ({device_info()['backend']}, "
        f"JAX {jax.__version__})",
        "",
        "Gradient of a loss of the final state w.r.t. the initial state and W; float64, "
        "and float32 against float64 jax.grad; jr.reversible with its defaults.",
        "",
        "| steps | "
        + " | ".join(f"{k} temp MB" for k in names)
        + " | grad / reversible memory | checkpoint / reversible memory | "
        "reversible time / grad time | reversible time / checkpoint time | "
        "gradient rel. error | float32 jax.grad error | float32 reversible error | "
        "memory_report bytes |",
        "|---" * (len(names) + 9) + "|",
    ]
    for r in rows:
        m, t = r["mem"], r["time"]
        lines.append(
            f"| {r['steps']} | "
            + " | ".join(f"{m[k] / 1e6:.3f}" for k in names)
            + f" | {m['jax.grad'] / max(m['jr.reversible'], 1):.0f}"
            + f" | {m['jax.checkpoint'] / max(m['jr.reversible'], 1):.0f}"
            + f" | {t['jr.reversible'] / t['jax.grad']:.2f}"
            + f" | {t['jr.reversible'] / t['jax.checkpoint']:.2f}"
            + f" | {r['err']:.1e} | {r['err32']['jax.grad']:.1e}"
            + f" | {r['err32']['jr.reversible']:.1e} | {r['report_bytes']} |"
        )
    lines += [
        "",
        "Times (s, median of interleaved runs):",
        "",
        "| steps | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for r in rows:
        lines.append(f"| {r['steps']} | " + " | ".join(f"{r['time'][k]:.4f}" for k in names) + " |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.quick:
        return
    write_results("reversible_heun", {"device": device_info(), "rows": rows}, table)
    plot_memory_and_time("reversible_heun", steps, rows, names)


if __name__ == "__main__":
    main()
