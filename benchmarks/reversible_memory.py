"""Memory and time of reversible gradients against jax.grad, jax.checkpoint and Equinox.

Workload 1 (issue 3): a coupled scan ``x += tanh(th0 * y); y += sin(th1 * x)`` on a 2 x 20000
float64 state, gradient of ``sum(x**2) + sum(y)`` with respect to the state and ``th``, at depths
10^2..10^4. Workload 2: an unrolled 60-block additive-coupling network (Python loop).

Memory is XLA's plan (`compile().memory_analysis().temp_size_in_bytes`); time is the median of
interleaved runs in one process. Writes results/reversible_memory.{json,md,png}.

    python benchmarks/reversible_memory.py            # full run
    python benchmarks/reversible_memory.py --quick    # small sizes, a smoke test
    python benchmarks/reversible_memory.py --only dial   # the time-space dial (issue 19)

The dial section (results/reversible_dial.*) measures `checkpoint_every` / `memory_budget` /
"auto" at depth 10^4 in float64 (theta = (0.9, 1.1), state 2 x 2000) and float32 at depth
10^3, and the cost of the drift check.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads spinning on a busy CPU
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    optional,
    progress,  # noqa: E402
    pyplot,
    temp_bytes,
    write_results,
)

import jaxrev as jr  # noqa: E402

eqx = optional("equinox")


# The fully reversible mode (no checkpoints): an opt-in row, its drift reported as a warning
FULLY_REVERSIBLE = dict(checkpoint_every=None, on_drift="warn")


def step(c, th):
    x, y = c
    x = x + jnp.tanh(th[0] * y)
    y = y + jnp.sin(th[1] * x)
    return x, y


def coupled(depth):
    def f(c, th):
        return jax.lax.scan(lambda c, _: (step(c, th), None), c, None, length=depth)[0]

    return f


def coupled_checkpoint(depth):
    def f(c, th):
        body = jax.checkpoint(lambda c: step(c, th))
        return jax.lax.scan(lambda c, _: (body(c), None), c, None, length=depth)[0]

    return f


def coupled_equinox(depth, checkpoints=100):
    def f(c, th):
        def body(s):
            k, c = s
            return k + 1, step(c, th)

        return eqx.internal.while_loop(
            lambda s: s[0] < depth,
            body,
            (0, c),
            max_steps=depth,
            kind="checkpointed",
            checkpoints=checkpoints,
        )[1]

    return f


def loss_of(f):
    def loss(c, th):
        x, y = f(c, th)
        return jnp.sum(x**2) + jnp.sum(y)

    return jax.grad(loss, argnums=(0, 1))


def rel_err(a, b):
    return max(
        float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(u)))
        for u, v in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )


def unrolled_net(n_blocks, width, hidden, batch):
    def net(s, ws):
        x1, x2 = s
        for a1, b1, a2, b2 in ws:
            x1 = x1 + jnp.tanh(x2 @ a1) @ b1
            x2 = x2 + jnp.tanh(x1 @ a2) @ b2
        return x1, x2

    keys = jax.random.split(jax.random.PRNGKey(0), 4 * n_blocks)
    ws = [
        tuple(
            jax.random.normal(keys[4 * i + j], shp) / np.sqrt(shp[0])
            for j, shp in enumerate([(width, hidden), (hidden, width)] * 2)
        )
        for i in range(n_blocks)
    ]
    s = (
        jax.random.normal(jax.random.PRNGKey(1), (batch, width)),
        jax.random.normal(jax.random.PRNGKey(2), (batch, width)),
    )
    return net, s, ws


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument(
        "--time-limit-bytes",
        type=float,
        default=4e9,
        help="time jax.grad / checkpoint only where their plan fits in this",
    )
    ap.add_argument(
        "--only",
        choices=["all", "memory", "dial"],
        default="all",
        help="the memory tables (results/reversible_memory.*), the time-space "
        "dial (results/reversible_dial.*), or both",
    )
    args = ap.parse_args(argv)
    if args.only in ("all", "dial"):
        dial_main(args.quick)
    if args.only in ("all", "memory"):
        memory_main(args)


def memory_main(args):
    n = 2000 if args.quick else args.n
    depths = [100, 300, 1000] if args.quick else [100, 300, 1000, 3000, 10000]
    acc_depth = 300 if args.quick else 1000
    c = (jnp.linspace(0.0, 1.0, n), jnp.linspace(1.0, 2.0, n))
    th = jnp.array([0.5, 0.5])
    methods = {
        "jax.grad": coupled,
        "jax.checkpoint": coupled_checkpoint,
        "jr.reversible": lambda d: jr.reversible(coupled(d)),
        "jr.reversible fully reversible": lambda d: jr.reversible(coupled(d), **FULLY_REVERSIBLE),
    }
    if eqx is not None:
        methods["equinox checkpointed"] = coupled_equinox
    rows = []
    for depth in progress(depths, desc="coupled scan depths"):
        row = {"depth": depth, "mem": {}, "time": {}}
        fns = {}
        for name, mk in methods.items():
            g = jax.jit(loss_of(mk(depth)))
            mem = temp_bytes(g, c, th)
            row["mem"][name] = mem
            if name.startswith("jr.") or name.startswith("equinox") or mem < args.time_limit_bytes:
                fns[name] = lambda g=g: g(c, th)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jr.DriftWarning)
            row["time"] = interleaved_medians(fns, reps=3 if depth >= 3000 else 5)
        rows.append(row)

    # accuracy against jax.grad, float64 and float32. Rebuilding by inversion drifts as fast
    # as the backward dynamics amplify rounding, so it depends on how expanding the map is:
    # measured at the benchmark's parameters and at a more expanding pair.
    acc = []
    for th_a in ([0.5, 0.5], [0.7, 1.3]):
        th_a = jnp.array(th_a)
        ref = jax.jit(loss_of(coupled(acc_depth)))(c, th_a)
        got = jax.jit(loss_of(jr.reversible(coupled(acc_depth))))(c, th_a)
        c32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), c)
        th32 = th_a.astype(jnp.float32)
        got32 = jax.jit(loss_of(jr.reversible(coupled(acc_depth))))(c32, th32)
        ref32 = jax.jit(loss_of(coupled(acc_depth)))(c32, th32)
        acc.append(
            {
                "depth": acc_depth,
                "theta": [float(t) for t in th_a],
                "float64_rel_err": rel_err(ref, got),
                "float32_rel_err_vs_float64": rel_err(ref, got32),
                "jax.grad_float32_rel_err_vs_float64": rel_err(ref, ref32),
            }
        )

    # the unrolled network
    nb = 10 if args.quick else 60
    net, s, ws = unrolled_net(nb, 64, 256, 256)

    def nloss(f):
        def loss(s, ws):
            x1, x2 = f(s, ws)
            return jnp.sum(x1**2) + jnp.sum(jnp.tanh(x2))

        return jax.grad(loss, argnums=(0, 1))

    def ckpt_net(s, ws):
        x1, x2 = s
        for blk in ws:
            x1, x2 = jax.checkpoint(lambda x1, x2, blk: net((x1, x2), [blk]))(x1, x2, blk)
        return x1, x2

    unet = {
        "blocks": nb,
        "mem": {
            "jax.grad": temp_bytes(jax.jit(nloss(net)), s, ws),
            "jax.checkpoint per block": temp_bytes(jax.jit(nloss(ckpt_net)), s, ws),
            "jr.reversible": temp_bytes(jax.jit(nloss(jr.reversible(net))), s, ws),
        },
    }
    unet["time"] = interleaved_medians(
        {
            k: (lambda f=f: jax.jit(nloss(f))(s, ws))
            for k, f in [("jax.grad", net), ("jr.reversible", jr.reversible(net))]
        }
    )
    unet["grad_rel_err"] = rel_err(
        jax.jit(nloss(net))(s, ws), jax.jit(nloss(jr.reversible(net)))(s, ws)
    )

    data = {
        "device": device_info(),
        "n": n,
        "coupled_scan": rows,
        "accuracy": acc,
        "unrolled_net": unet,
    }
    table = make_table(data)
    write_results("reversible_memory" + ("_quick" if args.quick else ""), data, table)
    plot(
        data, os.path.join(RESULTS, "reversible_memory" + ("_quick" if args.quick else "") + ".png")
    )
    print(table)


# --------------------------------------------------------------------------- the dial (issue 19)


def dial_main(quick: bool) -> None:
    """The time-space dial on the coupled scan: float64 at depth 10^4 with theta = (0.9, 1.1)
    (checkpoint_every K, a memory budget of 1 % of jax.grad's, "auto"), and float32 at depth
    10^3 with theta = (0.5, 0.5) against float32 jax.grad; the cost of the drift check."""
    n64, d64 = (500, 1000) if quick else (2000, 10000)
    n32, d32 = (2000, 300) if quick else (20000, 1000)
    # float64: the reference, its memory and the problem's sensitivity to one ulp of theta_0
    c = (jnp.linspace(0.0, 1.0, n64), jnp.linspace(1.0, 2.0, n64))
    th = jnp.array([0.9, 1.1])
    g_ref = jax.jit(loss_of(coupled(d64)))
    ref = g_ref(c, th)
    mem_grad = temp_bytes(g_ref, c, th)
    sens = rel_err(ref, g_ref(c, th.at[0].set(jnp.nextafter(th[0], 2.0))))
    budget = int(0.01 * mem_grad)
    settings = {"default (repair, auto)": {}, "on_drift=raise (strict)": dict(on_drift="raise")}
    settings.update({f"K={k}": dict(checkpoint_every=k) for k in (1, 10, 100)})
    settings["memory_budget=1%"] = dict(memory_budget=budget)
    settings["fully reversible (opt-in)"] = FULLY_REVERSIBLE
    rows, fns = [], {"jax.grad": (lambda: g_ref(c, th))}
    for name, kw in progress(list(settings.items()), desc="dial settings (float64)"):
        g = jr.jit(loss_of(jr.reversible(coupled(d64), **kw)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                got = jax.block_until_ready(g(c, th))
            except jr.DriftError as e:  # the strict mode: a drift that moves the gradient
                rows.append(
                    {
                        "setting": name,
                        "mem": temp_bytes(g, c, th),
                        "err": None,
                        "raised": f"DriftError: moves the gradient {e.drift:.3g}x",
                    }
                )
                continue
        rows.append({"setting": name, "mem": temp_bytes(g, c, th), "err": rel_err(ref, got)})
        fns[name] = lambda g=g: g(c, th)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = interleaved_medians(fns, reps=3 if quick else 5)
    for r in rows:
        r["time"] = times.get(r["setting"])
    # float32 against float64 jax.grad
    c32f = (jnp.linspace(0.0, 1.0, n32), jnp.linspace(1.0, 2.0, n32))
    th5 = jnp.array([0.5, 0.5])
    ref64 = jax.jit(loss_of(coupled(d32)))(c32f, th5)
    c32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), c32f)
    th32 = th5.astype(jnp.float32)
    g32 = jax.jit(loss_of(coupled(d32)))
    mem32 = temp_bytes(g32, c32, th32)
    err32 = rel_err(ref64, g32(c32, th32))
    rows32 = []
    for name, kw in progress(
        [
            ("default (repair, auto)", {}),
            ("fully reversible (opt-in)", FULLY_REVERSIBLE),
            ("memory_budget=5%", dict(memory_budget=int(0.05 * mem32))),
            ("K=10", dict(checkpoint_every=10)),
        ],
        desc="dial settings (float32)",
    ):
        g = jax.jit(loss_of(jr.reversible(coupled(d32), **kw)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jr.DriftWarning)
            got = g(c32, th32)
        rows32.append(
            {
                "setting": name,
                "mem_frac": temp_bytes(g, c32, th32) / mem32,
                "err": rel_err(ref64, got),
            }
        )
    data = {
        "device": device_info(),
        "float64": {
            "n": n64,
            "depth": d64,
            "theta": [0.9, 1.1],
            "jax.grad_mem": mem_grad,
            "jax.grad_time": times["jax.grad"],
            "sensitivity_1ulp": sens,
            "budget": budget,
            "rows": rows,
        },
        "float32": {
            "n": n32,
            "depth": d32,
            "theta": [0.5, 0.5],
            "jax.grad_mem": mem32,
            "jax.grad_err": err32,
            "rows": rows32,
        },
    }
    name = "reversible_dial" + ("_quick" if quick else "")
    table = dial_table(data)
    write_results(name, data, table)
    dial_plot(data, os.path.join(RESULTS, name + ".png"))
    print(table)


def dial_table(d):
    f = d["float64"]
    out = [
        f"# Time-space dial: memory, error and time ({d['device']['backend']}, "
        f"JAX {d['device']['jax']})",
        "",
        f"Coupled scan, state 2 x {f['n']} float64, depth {f['depth']}, theta = "
        f"{tuple(f['theta'])}; gradient w.r.t. state and theta, relative max-norm error "
        f"against jax.grad. jax.grad: {f['jax.grad_mem'] / 1e6:.1f} MB temp, "
        f"{f['jax.grad_time']:.3f} s. The problem's 1-ulp sensitivity (jax.grad's change "
        f"when theta_0 moves by one ulp): {f['sensitivity_1ulp']:.2e}. "
        f"memory_budget = 1 % of jax.grad's temp = {f['budget'] / 1e6:.2f} MB.",
        "",
        "| setting | temp MB | / jax.grad memory | gradient error | error / sensitivity | "
        "time / jax.grad |",
        "|---|---|---|---|---|---|",
    ]
    for r in f["rows"]:
        if r.get("err") is None:
            out.append(
                f"| {r['setting']} | {r['mem'] / 1e6:.2f} | "
                f"{r['mem'] / f['jax.grad_mem'] * 100:.2f} % | {r['raised']} | | |"
            )
            continue
        out.append(
            f"| {r['setting']} | {r['mem'] / 1e6:.2f} | "
            f"{r['mem'] / f['jax.grad_mem'] * 100:.2f} % | {r['err']:.2e} | "
            f"{r['err'] / f['sensitivity_1ulp']:.2g} | "
            f"{r['time'] / f['jax.grad_time']:.2f} |"
        )
    by = {r["setting"]: r for r in f["rows"]}
    dflt, full = by["default (repair, auto)"], by["fully reversible (opt-in)"]
    out += [
        "",
        f"Default: {f['jax.grad_mem'] / dflt['mem']:.0f}x less memory than jax.grad, "
        f"{dflt['time'] / f['jax.grad_time']:.2f}x its time, gradient error "
        f"{dflt['err'] / f['sensitivity_1ulp']:.2g}x the 1-ulp sensitivity. Fully "
        f"reversible: {f['jax.grad_mem'] / full['mem']:.0f}x less memory.",
        "",
    ]
    g = d["float32"]
    out += [
        f"Float32, state 2 x {g['n']}, depth {g['depth']}, theta = {tuple(g['theta'])}: "
        f"error against float64 jax.grad; float32 jax.grad's own: {g['jax.grad_err']:.3e} "
        f"({g['jax.grad_mem'] / 1e6:.1f} MB temp).",
        "",
        "| setting | memory / float32 jax.grad | error | error / jax.grad's |",
        "|---|---|---|---|",
    ]
    for r in g["rows"]:
        out.append(
            f"| {r['setting']} | {r['mem_frac'] * 100:.2f} % | {r['err']:.3e} | "
            f"{r['err'] / g['jax.grad_err']:.2f} |"
        )
    return "\n".join(out + [""])


def dial_plot(d, path):
    plt = pyplot()
    if plt is None:
        return
    f = d["float64"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for r in f["rows"]:
        if r.get("err") is None:  # raised (the strict mode)
            continue
        ax[0].loglog(r["mem"] / 1e6, max(r["err"], 1e-18), "o")
        ax[0].annotate(
            r["setting"].split(",")[0], (r["mem"] / 1e6, max(r["err"], 1e-18)), fontsize=7
        )
        ax[1].semilogx(r["mem"] / 1e6, r["time"] / f["jax.grad_time"], "o")
    ax[0].axhline(f["sensitivity_1ulp"], ls="--", c="k", lw=0.8, label="1-ulp sensitivity")
    ax[0].set(
        xlabel="temp memory (MB)", ylabel="gradient error", title=f"float64, depth {f['depth']}"
    )
    ax[0].legend(fontsize=8)
    ax[1].axhline(1.0, ls="--", c="k", lw=0.8)
    ax[1].set(xlabel="temp memory (MB)", ylabel="time / jax.grad", title="time")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def make_table(d):
    rows = d["coupled_scan"]
    names = list(rows[0]["mem"])
    out = [
        f"# Reversible gradients: memory and time ({d['device']['backend']}, "
        f"{d['device']['device']}, JAX {d['device']['jax']})",
        "",
        f"Coupled scan, state 2 x {d['n']} float64; gradient w.r.t. state and parameters.",
        "",
        "| depth | "
        + " | ".join(f"{k} temp MB" for k in names)
        + " | grad / reversible memory | reversible time / grad time | "
        "equinox time / reversible time |",
        "|---" * (len(names) + 4) + "|",
    ]
    for r in rows:
        m, t = r["mem"], r["time"]
        mem_ratio = m["jax.grad"] / max(m["jr.reversible"], 1)
        tr = f"{t['jr.reversible'] / t['jax.grad']:.2f}" if "jax.grad" in t else "n/a"
        te = (
            f"{t['equinox checkpointed'] / t['jr.reversible']:.2f}"
            if "equinox checkpointed" in t
            else "n/a"
        )
        out.append(
            f"| {r['depth']} | "
            + " | ".join(f"{m[k] / 1e6:.2f}" for k in names)
            + f" | {mem_ratio:.0f} | {tr} | {te} |"
        )
    flat = rows[-1]["mem"]["jr.reversible"] / max(rows[0]["mem"]["jr.reversible"], 1)
    out += [
        "",
        f"Reversible temp memory at depth {rows[-1]['depth']} / depth "
        f"{rows[0]['depth']}: {flat:.3f}",
        "",
        "Times (s, median of interleaved runs):",
        "",
        "| depth | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for r in rows:
        out.append(
            f"| {r['depth']} | "
            + " | ".join(
                f"{r['time'][k]:.4f}" if k in r["time"] else "not run (memory)" for k in names
            )
            + " |"
        )
    out += [
        "",
        "Gradient accuracy against jax.grad (relative max-norm error):",
        "",
        "| depth | theta | float64 reversible | float32 reversible vs float64 | "
        "float32 jax.grad vs float64 |",
        "|---|---|---|---|---|",
    ]
    for a in d["accuracy"]:
        out.append(
            f"| {a['depth']} | {tuple(a['theta'])} | {a['float64_rel_err']:.2e} | "
            f"{a['float32_rel_err_vs_float64']:.2e} | "
            f"{a['jax.grad_float32_rel_err_vs_float64']:.2e} |"
        )
    out.append("")
    u = d["unrolled_net"]
    out += [
        f"Unrolled {u['blocks']}-block coupling network (batch 256, width 64, hidden 256):",
        "",
        "| method | temp MB |",
        "|---|---|",
    ]
    for k, v in u["mem"].items():
        out.append(f"| {k} | {v / 1e6:.2f} |")
    out += [
        "",
        f"jax.grad / reversible memory: "
        f"{u['mem']['jax.grad'] / max(u['mem']['jr.reversible'], 1):.1f}x; "
        "time reversible / grad: "
        f"{u['time']['jr.reversible'] / u['time']['jax.grad']:.2f}; "
        f"gradient relative error {u['grad_rel_err']:.1e}",
        "",
    ]
    return "\n".join(out)


def plot(d, path):
    plt = pyplot()
    if plt is None:
        return
    rows = d["coupled_scan"]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    depths = [r["depth"] for r in rows]
    for k in rows[0]["mem"]:
        ax[0].loglog(depths, [max(r["mem"][k], 1) / 1e6 for r in rows], "o-", label=k)
        ts = [(r["depth"], r["time"][k]) for r in rows if k in r["time"]]
        if ts:
            ax[1].loglog(*zip(*ts), "o-", label=k)
    ax[0].set(
        xlabel="depth (scan iterations)",
        ylabel="temp memory (MB)",
        title="gradient memory (XLA plan)",
    )
    ax[1].set(xlabel="depth", ylabel="seconds", title="gradient time")
    ax[0].legend(fontsize=8)
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
