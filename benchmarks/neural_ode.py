"""A neural ODE's gradient through diffrax: `jaxrev.diffrax.ReversibleAdjoint` against diffrax's
`RecursiveCheckpointAdjoint` (its default) and `BacksolveAdjoint`, at 10^3 .. 10^5 steps.

The vector field is an `eqx.nn.MLP` (8 -> 32 -> 32 -> 8, tanh), solved by `ReversibleHeun` at a
constant step on [0, 1] for a batch of 16 initial states (vmapped, as diffrax's neural-ODE
example does), saved at 10 times; the gradient is of a mean-squared loss with respect to the
MLP's parameters, float64. Memory is XLA's plan for the jitted gradient
(`compile().memory_analysis().temp_size_in_bytes`); time is the median of interleaved runs in
one process. Gradient errors are relative to the largest entry, against `DirectAdjoint` (the
exact gradient of the discretised solve) where it fits in the time (up to 10^4 steps), and
against `RecursiveCheckpointAdjoint` (the same gradient, by other arithmetic) at every size.
Writes results/neural_ode.{json,md,png}.

    python benchmarks/neural_ode.py            # full run (about 10 minutes)
    python benchmarks/neural_ode.py --quick    # 10^3 steps only, a smoke test
    python benchmarks/neural_ode.py --rk       # reversible Tsit5 / Dopri5 (neural_ode_rk.py)
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrev.diffrax import ReversibleAdjoint  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    device_info,
    interleaved_medians,
    plot_memory_and_time,  # noqa: E402
    progress,
    rel_err,
    write_results,
)

DIM, WIDTH, BATCH, SAVES = 8, 32, 16, 10
DIRECT_MAX = 10_000


def loss_grad(n: int, adjoint):
    ts = jnp.linspace(0.0, 1.0, SAVES)

    def solve(field, y0):
        term = diffrax.ODETerm(lambda t, y, f: f(y))
        return diffrax.diffeqsolve(
            term,
            diffrax.ReversibleHeun(),
            0.0,
            1.0,
            1.0 / n,
            y0,
            args=field,
            saveat=diffrax.SaveAt(ts=ts),
            adjoint=adjoint,
            max_steps=n + 1,
        ).ys

    def loss(params, static, y0, target):
        field = eqx.combine(params, static)
        return jnp.mean((jax.vmap(lambda y: solve(field, y))(y0) - target) ** 2)

    return jax.grad(loss)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--rk",
        action="store_true",
        help="Reversible(Tsit5/Dopri5) + ReversibleAdjoint (neural_ode_rk.py)",
    )
    args = ap.parse_args(argv)
    if args.rk:
        import neural_ode_rk

        return neural_ode_rk.main(["--quick"] if args.quick else [])
    sizes = [1000] if args.quick else [1000, 10_000, 100_000]
    key = jax.random.PRNGKey(0)
    field = eqx.nn.MLP(DIM, DIM, WIDTH, 2, activation=jnp.tanh, key=key)
    params, static = eqx.partition(field, eqx.is_inexact_array)
    y0 = jax.random.normal(jax.random.PRNGKey(1), (BATCH, DIM))
    target = jax.random.normal(jax.random.PRNGKey(2), (BATCH, SAVES, DIM)) * 0.1
    adjoints = {
        "ReversibleAdjoint": ReversibleAdjoint(),
        "RecursiveCheckpointAdjoint": diffrax.RecursiveCheckpointAdjoint(),
        "BacksolveAdjoint": diffrax.BacksolveAdjoint(),
    }
    names = list(adjoints)
    rows = []
    for n in progress(sizes, desc="neural ODE steps"):
        grads = {k: jax.jit(loss_grad(n, a), static_argnums=1) for k, a in adjoints.items()}
        row = {"steps": n, "mem": {}, "time": {}, "err_direct": {}, "err_rc": {}}
        for k in names:
            row["mem"][k] = int(
                grads[k]
                .lower(params, static, y0, target)
                .compile()
                .memory_analysis()
                .temp_size_in_bytes
            )
        out = {k: g(params, static, y0, target) for k, g in grads.items()}
        if n <= DIRECT_MAX:
            direct = jax.jit(loss_grad(n, diffrax.DirectAdjoint()), static_argnums=1)(
                params, static, y0, target
            )
            row["err_direct"] = {k: rel_err(direct, out[k]) for k in names}
        row["err_rc"] = {k: rel_err(out["RecursiveCheckpointAdjoint"], out[k]) for k in names}
        row["time"] = interleaved_medians(
            {k: (lambda g=g: g(params, static, y0, target)) for k, g in grads.items()},
            reps=3 if n >= 100_000 else 5,
        )
        rows.append(row)

    lines = [
        f"# Neural ODE gradient through diffrax ({device_info()['backend']}, "
        f"JAX {jax.__version__}, diffrax {diffrax.__version__})",
        "",
        f"`eqx.nn.MLP` {DIM} -> {WIDTH} -> {WIDTH} -> {DIM} (tanh) vector field, "
        f"ReversibleHeun at constant step on [0, 1], batch {BATCH} (vmapped), saved at "
        f"{SAVES} times; gradient of an MSE loss w.r.t. the MLP, float64.",
        "",
        "| steps | "
        + " | ".join(f"{k} temp MB" for k in names)
        + " | "
        + " | ".join(f"{k} time (s)" for k in names)
        + " |",
        "|---" * (2 * len(names) + 1) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['steps']} | "
            + " | ".join(f"{r['mem'][k] / 1e6:.3f}" for k in names)
            + " | "
            + " | ".join(f"{r['time'][k]:.3f}" for k in names)
            + " |"
        )
    lines += [
        "",
        "Ratios (ReversibleAdjoint / peer) and gradient errors (relative to the largest entry):",
        "",
        "| steps | memory / RecursiveCheckpoint | memory / Backsolve | "
        "time / RecursiveCheckpoint | time / Backsolve | "
        + " | ".join(f"{k} error vs DirectAdjoint" for k in names)
        + " | ReversibleAdjoint error vs RecursiveCheckpoint |",
        "|---" * (5 + len(names)) + "|",
    ]
    rev = "ReversibleAdjoint"
    for r in rows:
        m, t = r["mem"], r["time"]
        errs = " | ".join(
            f"{r['err_direct'][k]:.1e}" if r["err_direct"] else "not run" for k in names
        )
        lines.append(
            f"| {r['steps']} | {m[rev] / max(m['RecursiveCheckpointAdjoint'], 1):.3f}"
            f" | {m[rev] / max(m['BacksolveAdjoint'], 1):.3f}"
            f" | {t[rev] / t['RecursiveCheckpointAdjoint']:.2f}"
            f" | {t[rev] / t['BacksolveAdjoint']:.2f} | {errs}"
            f" | {r['err_rc'][rev]:.1e} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.quick:
        return
    write_results("neural_ode", {"device": device_info(), "rows": rows}, table)
    plot_memory_and_time(
        "neural_ode", sizes, rows, names, ("memory of the gradient", "time of the gradient")
    )


if __name__ == "__main__":
    main()
