"""The reversible transformer of `examples/reversible_transformer.py`, sharded data x tensor
parallel over a 2 x 2 mesh: per-device scratch, step time and loss curves of `jr.reversible`
(its defaults) against `jax.grad`, and `jax.checkpoint` per block with `nothing_saveable` (the
usual remat) and `dots_saveable`.

    python benchmarks/transformer.py            # CPU: makes 4 CPU devices (about 15 minutes)
    python benchmarks/transformer.py --quick    # smaller, a few minutes
    python benchmarks/transformer.py --gpu      # one accelerator: the 1 x 1 mesh, d_model 1024

Memory is XLA's plan for the compiled sharded gradient step (`memory_analysis()`, per device)
at the issue's sizes: depth 12, 24, 48, 96, d_model 256, 4 heads, sequence 256, batch 8 per
data shard, float32 and bfloat16 activations. On CPU the step time is measured at a smaller
width (d_model 64, sequence 64: the issue's sizes take minutes a step on two cores), time
interleaved, medians; the loss curves (100 float32 AdamW steps, every method from the same
start and batches) at that width and depth 12. Writes
results/transformer{,_quick,_gpu}.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax

if __name__ == "__main__":
    if "--gpu" not in sys.argv:
        jax.config.update("jax_num_cpu_devices", 4)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import reversible_transformer as rt  # noqa: E402
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    progress,
    pyplot,  # noqa: E402
    write_results,
)

DIAL = "reversible, checkpoint_every=None"
METHODS = (*rt.METHODS, DIAL)
"""The four methods, and `jr.reversible`'s dial set to store no checkpoints (the drift of
the rebuilt input still checked: a miss raises)."""


def setup(depth, d, seq, batch_per_shard, dtype, mesh, vocab=64):
    params, block = rt.init(
        "equinox", jax.random.key(0), vocab=vocab, depth=depth, d=d, heads=4, seq=seq
    )
    params = jax.device_put(params, rt.param_shardings(params, mesh))
    rows = batch_per_shard * mesh.shape["data"]
    batch = np.random.default_rng(0).integers(0, vocab, (rows, seq + 1)).astype(np.int32)
    batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
    fns = {m: jax.jit(rt.grad_fn(block, m, dtype, mesh)) for m in rt.METHODS}
    fns[DIAL] = jax.jit(rt.grad_fn(block, "reversible", dtype, mesh, checkpoint_every=None))
    return params, batch, block, fns


def memory(depth, d, seq, bps, dtype, mesh) -> dict:
    params, batch, _, fns = setup(depth, d, seq, bps, dtype, mesh)
    return {
        m: int(f.lower(params, batch).compile().memory_analysis().temp_size_in_bytes)
        for m, f in fns.items()
    }


def step_time(depth, d, seq, bps, dtype, mesh, reps) -> dict:
    params, batch, _, fns = setup(depth, d, seq, bps, dtype, mesh)
    return interleaved_medians(
        {m: (lambda f=f: f(params, batch)) for m, f in fns.items()}, reps=reps
    )


def loss_curves(depth, d, seq, bps, mesh, steps) -> dict:
    """100 float32 AdamW steps per method from the same start on the same batches."""
    params0, _, block, _ = setup(depth, d, seq, bps, jnp.float32, mesh)
    text = rt.corpus()
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    rng = np.random.default_rng(1)
    starts = rng.integers(0, len(data) - seq - 1, (steps, bps * mesh.shape["data"]))
    sh = NamedSharding(mesh, P("data"))
    opt = optax.adamw(1e-3, weight_decay=1e-4)
    out = {}
    for m in rt.METHODS:
        vg = rt.grad_fn(block, m, jnp.float32, mesh)

        @jax.jit
        def step(p, s, b):
            loss, g = vg(p, b)
            u, s = opt.update(g, s, p)
            return optax.apply_updates(p, u), s, loss

        p, s, losses = params0, opt.init(params0), []
        for t in range(steps):
            b = np.stack([data[i : i + seq + 1] % 64 for i in starts[t]])
            p, s, loss = step(p, s, jax.device_put(b, sh))
            losses.append(float(loss))
        out[m] = losses
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--gpu", action="store_true")
    args = ap.parse_args()
    if args.gpu:
        devs = jax.devices()
        mesh = Mesh(
            np.array(devs[:4] if len(devs) >= 4 else devs[:1]).reshape(
                (2, 2) if len(devs) >= 4 else (1, 1)
            ),
            ("data", "model"),
        )
        mem_cfg = dict(d=1024, seq=512, bps=8)
        time_cfg = mem_cfg
        depths = (12, 24, 48)
        curve_cfg = dict(depth=12, d=256, seq=128, bps=8, steps=100)
        reps = 5
    else:
        mesh = rt.make_mesh()
        mem_cfg = dict(d=256, seq=256, bps=8)
        time_cfg = dict(d=64, seq=64, bps=8)
        depths = (12, 24) if args.quick else (12, 24, 48, 96)
        curve_cfg = dict(depth=12, d=64, seq=64, bps=8, steps=30 if args.quick else 100)
        reps = 3 if args.quick else 5
    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    rows = []
    jobs = [(L, n) for L in depths for n in dtypes]
    for L, name in progress(jobs, desc="memory and time", ncols=80):
        mem = memory(L, mem_cfg["d"], mem_cfg["seq"], mem_cfg["bps"], dtypes[name], mesh)
        t = step_time(L, time_cfg["d"], time_cfg["seq"], time_cfg["bps"], dtypes[name], mesh, reps)
        rows.append({"depth": L, "dtype": name, "mem": mem, "time": t})
    curves = loss_curves(
        curve_cfg["depth"],
        curve_cfg["d"],
        curve_cfg["seq"],
        curve_cfg["bps"],
        mesh,
        curve_cfg["steps"],
    )
    ref = np.array(curves["jax.grad"])
    curve_err = {
        m: float(np.max(np.abs(np.array(v) - ref) / np.abs(ref))) for m, v in curves.items()
    }

    name = "transformer" + ("_gpu" if args.gpu else "_quick" if args.quick else "")
    lines = [
        f"# Reversible transformer: per-device scratch and step time ({device_info()})",
        "",
        f"Mesh {dict(mesh.shape)} (data x model). Memory: d_model {mem_cfg['d']}, "
        f"4 heads, sequence {mem_cfg['seq']}, batch {mem_cfg['bps']} per data shard. "
        f"Time: d_model {time_cfg['d']}, sequence {time_cfg['seq']}. `reversible` runs "
        "with its defaults (drift checked and repaired).",
        "",
        "| depth | activations | "
        + " | ".join(f"{m} scratch" for m in METHODS)
        + " | remat / reversible memory | remat / dial memory | "
        + " | ".join(f"{m} step" for m in METHODS)
        + " | reversible / remat time |",
        "|" + "---|" * (5 + 2 * len(METHODS)),
    ]
    for r in rows:
        mem, t = r["mem"], r["time"]
        lines.append(
            f"| {r['depth']} | {r['dtype']} | "
            + " | ".join(f"{mem[m] / 1e6:.1f} MB" for m in METHODS)
            + f" | {mem['remat'] / mem['reversible']:.2f}x"
            + f" | {mem['remat'] / mem[DIAL]:.2f}x | "
            + " | ".join(f"{1e3 * t[m]:.0f} ms" for m in METHODS)
            + f" | {t['reversible'] / t['remat']:.2f}x |"
        )
    lines += [
        "",
        f"Loss curves ({curve_cfg['steps']} float32 AdamW steps, depth "
        f"{curve_cfg['depth']}, d_model {curve_cfg['d']}): largest relative difference "
        "from jax.grad's curve: "
        + ", ".join(f"{m} {e:.1e}" for m, e in curve_err.items() if m != "jax.grad"),
        f"; loss {curves['jax.grad'][0]:.3f} -> {curves['jax.grad'][-1]:.3f}.",
        "",
    ]
    table = "\n".join(lines)
    write_results(
        name,
        {
            "device": device_info(),
            "mesh": dict(mesh.shape),
            "memory_config": mem_cfg,
            "time_config": time_cfg,
            "rows": rows,
            "loss_curves": curves,
            "curve_rel_err": curve_err,
        },
        table,
    )
    print(table)
    plt = pyplot()
    if plt is not None:
        fig, ax = plt.subplots(1, 3, figsize=(15, 4))
        for m in METHODS:
            for dt, style in (("float32", "o-"), ("bfloat16", "s--")):
                rs = [r for r in rows if r["dtype"] == dt]
                ax[0].loglog(
                    [r["depth"] for r in rs],
                    [r["mem"][m] / 1e6 for r in rs],
                    style,
                    label=f"{m} ({dt})",
                )
                ax[1].loglog(
                    [r["depth"] for r in rs], [r["time"][m] for r in rs], style, label=f"{m} ({dt})"
                )
            if m in curves:
                ax[2].plot(curves[m], label=m)
        ax[0].set(xlabel="depth (blocks)", ylabel="per-device scratch (MB)", title="memory")
        ax[1].set(xlabel="depth (blocks)", ylabel="seconds per gradient step", title="time")
        ax[2].set(xlabel="AdamW step", ylabel="loss", title="loss curves (float32)")
        ax[0].legend(fontsize=6)
        ax[2].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, f"{name}.png"), dpi=120)


if __name__ == "__main__":
    main()
