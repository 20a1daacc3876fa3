"""Eager calls of jaxrev's transforms, repeated: what the cache (`jaxrev/_cache.py`) makes of them.

The issue's figure: the second and later eager calls of `jax.grad(jr.reversible(f))` on a
100-step scan, against `jax.jit(jax.grad(f))` (the same gradient compiled). Beside it, in the
same run:

- `jax.jit(jax.grad(reversible(f)))`: the reversible gradient's own compiled cost (its
  backward run inverts every step, so it costs more than `jax.grad`'s);
- eager `jax.grad(jax.jit(f))`: JAX's own eager gradient of a compiled function, the least an
  eager `grad` costs in JAX (its linearization and transposition run in Python on every call);
- eager `jax.grad(f)` without `jit`: what JAX does with the scan itself, op by op;
- the first eager call of the reversible gradient (trace, plan, compile);
- `reverse(f)` and `inverse_jvp` on the same scan: repeated eager calls against their
  `jax.jit` versions.

The program: ``(a, b) -> (a + tanh(th b), b + sin(a) / 2)`` 100 times, state 2 x N, N = 100,
1000, 10000, float64. Times are medians of interleaved calls (`block_until_ready`).
Writes results/eager_cache.{json,md,png} (eager_cache_quick.* with --quick).

    python benchmarks/eager_cache.py            # about 2 minutes
    python benchmarks/eager_cache.py --quick    # N = 100, 1000 only
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxrev as jr  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    progress,
    pyplot,  # noqa: E402
    rel_err,
    write_results,
)

STEPS = 100
SIZES = (100, 1000, 10000)


def run(xy, th):
    def body(c, _):
        a, b = c
        a = a + jnp.tanh(th * b)
        return (a, b + 0.5 * jnp.sin(a)), None

    return lax.scan(body, xy, None, length=STEPS)[0]


def loss_of(fun):
    return lambda xy, th: jnp.vdot(*fun(xy, th))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--quick", action="store_true", help="N = 100, 1000 only (results/eager_cache_quick.*)"
    )
    args = ap.parse_args(argv)
    sizes = SIZES[:2] if args.quick else SIZES
    name = "eager_cache_quick" if args.quick else "eager_cache"
    rows = []
    rrun = jr.reversible(run)
    for n in progress(sizes, desc="state sizes"):
        xy = (jnp.linspace(-1.0, 1.0, n), jnp.linspace(0.5, -0.5, n))
        th = 0.3
        g_jit = jax.jit(jax.grad(loss_of(run), argnums=(0, 1)))
        g_rev_jit = jax.jit(jax.grad(loss_of(rrun), argnums=(0, 1)))
        g_rev = jax.grad(loss_of(rrun), argnums=(0, 1))
        g_eager_jit = jax.grad(jax.jit(loss_of(run)), argnums=(0, 1))
        g_eager = jax.grad(loss_of(run), argnums=(0, 1))

        # a fresh function, so that its first call traces, plans and compiles
        fresh = jr.reversible(lambda xy, th: run(xy, th))
        t0 = time.perf_counter()
        jax.block_until_ready(jax.grad(loss_of(fresh), argnums=(0, 1))(xy, th))
        first = time.perf_counter() - t0

        ys = run(xy, th)
        inv = jr.reverse(run)
        inv_jit = jax.jit(jr.reverse(run))
        # th is a parameter of the map whose Jacobian is inverted: a closure, which the
        # cache keys on
        ijvp = lambda: jr.inverse_jvp(lambda s: run(s, th), (xy,), xy)  # noqa: E731
        ijvp_jit = jax.jit(lambda s: jr.inverse_jvp(lambda z: run(z, th), (s,), xy))

        t = interleaved_medians(
            {
                "jit(grad(f))": lambda: g_jit(xy, th),
                "eager grad(reversible(f))": lambda: g_rev(xy, th),
                "jit(grad(reversible(f)))": lambda: g_rev_jit(xy, th),
                "eager grad(jit(f))": lambda: g_eager_jit(xy, th),
                "eager reverse(f)": lambda: inv(ys, th),
                "jit(reverse(f))": lambda: inv_jit(ys, th),
                "eager inverse_jvp": ijvp,
                "jit(inverse_jvp)": lambda: ijvp_jit(xy),
            },
            reps=31,
            warmup=2,
        )
        t.update(
            interleaved_medians(
                {"eager grad(f) (JAX, no jit)": lambda: g_eager(xy, th)}, reps=3, warmup=1
            )
        )
        err = rel_err(g_jit(xy, th), g_rev(xy, th))
        rows.append({"n": n, "time": t, "first_call": first, "grad_rel_err": err})

    meta = device_info()
    names = list(rows[0]["time"])
    lines = [
        f"# Eager calls, repeated ({meta['backend']}, JAX {meta['jax']})",
        "",
        f"A {STEPS}-step scan on a 2 x N float64 state; median ms per call of interleaved "
        "runs (the second and later calls; the first call of the reversible gradient "
        "traces, plans and compiles).",
        "",
        "| N | " + " | ".join(names) + " | first call of eager grad(reversible(f)) |",
        "|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        lines.append(
            f"| {r['n']} | "
            + " | ".join(f"{r['time'][k] * 1e3:.3f}" for k in names)
            + f" | {r['first_call'] * 1e3:.0f} |"
        )
    lines += [
        "",
        "Ratios:",
        "",
        "| N | eager grad(reversible) / jit(grad(f)) | eager grad(reversible) / "
        "jit(grad(reversible)) | eager grad(reversible) / eager grad(jit(f)) | "
        "eager reverse / jit(reverse) | eager inverse_jvp / jit(inverse_jvp) | "
        "gradient error vs jax.grad (relative to its largest entry) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["time"]
        e = t["eager grad(reversible(f))"]
        lines.append(
            f"| {r['n']} | {e / t['jit(grad(f))']:.2f} | "
            f"{e / t['jit(grad(reversible(f)))']:.2f} | "
            f"{e / t['eager grad(jit(f))']:.2f} | "
            f"{t['eager reverse(f)'] / t['jit(reverse(f))']:.2f} | "
            f"{t['eager inverse_jvp'] / t['jit(inverse_jvp)']:.2f} | "
            f"{r['grad_rel_err']:.1e} |"
        )
    table = "\n".join(lines) + "\n"
    write_results(name, {"meta": meta, "steps": STEPS, "rows": rows}, table)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for k in names:
            ax.loglog([r["n"] for r in rows], [r["time"][k] * 1e3 for r in rows], "o-", label=k)
        ax.set(
            xlabel="N (state 2 x N)",
            ylabel="ms per call",
            title=f"repeated eager calls, {STEPS}-step scan",
        )
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=120)
    print(table)


if __name__ == "__main__":
    main()
