"""Reversible Runge–Kutta (issue 31): `Reversible(Tsit5())` / `Reversible(Dopri5())` with
`jaxrev.diffrax.ReversibleAdjoint`, against the base solver with diffrax's
`RecursiveCheckpointAdjoint` (its default) and `BacksolveAdjoint`, as in McCallum & Foster
(2024, §6: a neural ODE, the gradient of one loss, time and memory against the steps).

Setup: `eqx.nn.MLP` field 8 -> 64 -> 64 -> 8 (tanh), a batch of 32 initial states (vmapped),
constant steps on [0, 1] (2 000 and 10 000 steps), an MSE loss on the final state, float64,
everything at its defaults. Time: the median of interleaved calls of one jitted
`value_and_grad`. Memory: XLA's scratch plan of that call. Gradient error: relative to the
largest entry, against `DirectAdjoint` on the same solver (the exact gradient of the
discretised solve; for the base solver's adjoints, the base solver's).

Stability (where reversing a solve is hard): the same field plus a stiff relaxation
-20 (y - sin t), on [0, 5] at 2 000 steps, the loss reading 20 saved times: integrating it
backwards amplifies rounding by up to e^95. `ReversibleAdjoint` and Backsolve both rebuild the
forward trajectory backwards (the reversible scheme's inverse is stable where its forward step
is: its backward growth is 1/√coupling a step); the table shows each gradient's error against
DirectAdjoint's. (At 500 steps, h·20 = 0.2 is outside the reversible scheme's own stability
region: its forward solve grows a parasitic mode there, as the paper's analysis says.)

    python benchmarks/neural_ode.py --rk          # this part alone (about 15 minutes)
    python benchmarks/neural_ode_rk.py --quick    # 500 steps, a smoke test
    python benchmarks/neural_ode_rk.py --one-state  # issue 43's layout alone (about 3 minutes)
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import diffrax  # noqa: E402
import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxrev.diffrax import Reversible, ReversibleAdjoint  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    progress,  # noqa: E402
    pyplot,
    rel_err,
    write_results,
)

DIM, WIDTH, BATCH = 8, 64, 32
METHODS = ("Reversible + ReversibleAdjoint", "RecursiveCheckpointAdjoint", "BacksolveAdjoint")
DIRECT_MAX = 2000
STIFF = 20.0
COUPLING = 0.5  # the reversible scheme's forward step is stable on the stiff problem
STABILITY = (
    "Reversible + ReversibleAdjoint",
    "Reversible + ReversibleAdjoint(checkpoint_every='auto')",
    "RecursiveCheckpointAdjoint",
    "BacksolveAdjoint",
)


def value_and_grad(
    base,
    method: str,
    n: int,
    t1: float = 1.0,
    stiff: float = 0.0,
    saves: int = 0,
    coupling: float = 0.999,
    one_state: bool = False,
):
    """jit(value_and_grad) of the batch's loss for `method` ("Direct" and "Direct Reversible"
    are the references, "RC Reversible" the reference where DirectAdjoint does not fit).
    `stiff`: the field is f(y) - stiff (y - sin t); `saves`: the loss reads the solution at
    that many times (else the final state); `one_state`: the batch is one state, the field
    vmapped over it inside the solve (issue 43's layout), instead of one solve per sample."""
    solver = Reversible(base, coupling) if "Reversible" in method else base
    adjoint = {
        "Reversible + ReversibleAdjoint": ReversibleAdjoint(),
        "Reversible + ReversibleAdjoint(checkpoint_every='auto')": ReversibleAdjoint(
            checkpoint_every="auto"
        ),
        "RecursiveCheckpointAdjoint": diffrax.RecursiveCheckpointAdjoint(),
        "RC Reversible": diffrax.RecursiveCheckpointAdjoint(),
        "BacksolveAdjoint": diffrax.BacksolveAdjoint(),
    }.get(method, diffrax.DirectAdjoint())
    saveat = (
        diffrax.SaveAt(ts=jnp.linspace(t1 / saves, t1, saves)) if saves else diffrax.SaveAt(t1=True)
    )

    def loss(params, static, y0, target):
        field = eqx.combine(params, static)

        def vf(t, y, f):
            return f(y) - stiff * (y - jnp.sin(t))

        # (the batch as one state: the field vmapped over its rows inside the solve)
        rows = lambda t, y, f: jax.vmap(lambda r: vf(t, r, f))(y)  # noqa: E731
        term = diffrax.ODETerm(rows if one_state else vf)

        def one(y):
            return diffrax.diffeqsolve(
                term,
                solver,
                0.0,
                t1,
                t1 / n,
                y,
                args=field,
                saveat=saveat,
                adjoint=adjoint,
                max_steps=n,
            ).ys

        if one_state:
            return jnp.mean((one(y0)[0] - target) ** 2)
        return jnp.mean((jax.vmap(one)(y0) - target[:, None]) ** 2)

    return jax.jit(jax.value_and_grad(loss), static_argnums=1)


def problem():
    field = eqx.nn.MLP(DIM, DIM, WIDTH, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0))
    params, static = eqx.partition(field, eqx.is_inexact_array)
    y0 = jax.random.normal(jax.random.PRNGKey(1), (BATCH, DIM))
    target = jax.random.normal(jax.random.PRNGKey(2), (BATCH, DIM)) * 0.1
    return params, static, y0, target


def run(sizes=(2000, 10_000), stability_steps=2000, reps=3) -> dict:
    args = problem()
    rows = []
    cases = [(s, n) for s in ("Tsit5", "Dopri5") for n in sizes]
    for name, n in progress(cases, desc="reversible RK"):
        base = getattr(diffrax, name)()
        fns = {m: value_and_grad(base, m, n) for m in METHODS}
        row = {"solver": name, "steps": n, "mem": {}, "time": {}, "err": {}}
        for m, f in fns.items():
            row["mem"][m] = int(f.lower(*args).compile().memory_analysis().temp_size_in_bytes)
        out = {m: f(*args) for m, f in fns.items()}  # also the warm-up call
        # DirectAdjoint keeps every stage of every step: past DIRECT_MAX steps it does not fit
        # in memory, and RecursiveCheckpointAdjoint (the same gradient) is the reference
        direct = "Direct" if n <= DIRECT_MAX else "RC"
        row["reference"] = f"{direct}Adjoint"
        ref_rev = value_and_grad(base, f"{direct} Reversible", n)(*args)
        ref_base = (
            value_and_grad(base, "Direct", n)(*args)
            if n <= DIRECT_MAX
            else out["RecursiveCheckpointAdjoint"]
        )
        for m in METHODS:
            ref = ref_rev if m.startswith("Reversible") else ref_base
            row["err"][m] = rel_err(ref[1], out[m][1])
        row["time"] = interleaved_medians(
            {m: (lambda f=f: f(*args)) for m, f in fns.items()}, reps=reps, warmup=0
        )
        rows.append(row)
    stab = []
    for saves in progress((0, 20), desc="stiff problem"):
        kw = dict(n=stability_steps, t1=5.0, stiff=STIFF, saves=saves, coupling=COUPLING)
        base = diffrax.Tsit5()
        r = {"solver": "Tsit5", "steps": stability_steps, "saves": saves, "err": {}}
        ref_rev = value_and_grad(base, "Direct Reversible", **kw)(*args)
        ref_base = value_and_grad(base, "Direct", **kw)(*args)
        for m in STABILITY:
            try:
                got = value_and_grad(base, m, **kw)(*args)
                ref = ref_rev if m.startswith("Reversible") else ref_base
                r["err"][m] = rel_err(ref[1], got[1])
            except Exception as e:  # a drift error is an answer too: say which
                r["err"][m] = "DriftError raised" if "DriftError" in str(e) else type(e).__name__
        stab.append(r)
    return {
        "device": device_info(),
        "rows": rows,
        "stability": stab,
        "one_state": one_state_rows(sizes, reps),
    }


ONE_STATE = ("Reversible + ReversibleAdjoint", "RecursiveCheckpointAdjoint")


def one_state_rows(sizes=(2000, 10_000), reps=3) -> list[dict]:
    """Issue 43's layout: the batch of 32 is one state (32 x 8), the field vmapped over it
    inside one solve; Tsit5, memory and time of `ReversibleAdjoint` against diffrax's
    default adjoint."""
    args = problem()
    rows = []
    for n in progress(sizes, desc="one state"):
        base = diffrax.Tsit5()
        fns = {m: value_and_grad(base, m, n, one_state=True) for m in ONE_STATE}
        row = {"solver": "Tsit5", "steps": n, "mem": {}}
        for m, f in fns.items():
            row["mem"][m] = int(f.lower(*args).compile().memory_analysis().temp_size_in_bytes)
        out = {m: f(*args) for m, f in fns.items()}
        row["err vs RC"] = rel_err(out[ONE_STATE[1]][1], out[ONE_STATE[0]][1])
        row["time"] = interleaved_medians(
            {m: (lambda f=f: f(*args)) for m, f in fns.items()}, reps=reps, warmup=0
        )
        rows.append(row)
    return rows


def one_state_table(rows: list[dict]) -> list[str]:
    rev, rc = ONE_STATE
    lines = [
        "",
        "The batch as one state (issue 43's layout): `y0` of shape 32 x 8, the MLP vmapped "
        "over it inside one solve, Tsit5. The scratch is no longer dominated by "
        "RecursiveCheckpointAdjoint's per-sample checkpoints, and the reversible backward "
        "step's own buffers show: one step's 12 stage evaluations (two steps of the base "
        "solver) and their activations. Their 64 x 64 weight-gradient products are added "
        "one at a time (`sweep/sums.py`; XLA:CPU fused their sum and held all 12: 0.709 MB "
        "before).",
        "",
        f"| steps | {rev} MB | {rc} MB | memory / RC | {rev} s | {rc} s | time / RC | "
        "gradient vs RC |",
        "|---" * 8 + "|",
    ]
    for r in rows:
        m, t = r["mem"], r["time"]
        lines.append(
            f"| {r['steps']} | {m[rev] / 1e6:.3f} | {m[rc] / 1e6:.3f} | "
            f"{m[rev] / max(m[rc], 1):.2f} | {t[rev]:.2f} | {t[rc]:.2f} | "
            f"{t[rev] / t[rc]:.2f} | {r['err vs RC']:.1e} |"
        )
    return lines


def table(res: dict) -> str:
    rev, rc, bs = METHODS
    lines = [
        f"# Reversible Runge–Kutta through diffrax ({res['device']['backend']}, "
        f"JAX {jax.__version__}, diffrax {diffrax.__version__})",
        "",
        f"`eqx.nn.MLP` {DIM} -> {WIDTH} -> {WIDTH} -> {DIM} (tanh) field, batch {BATCH} "
        "(vmapped), constant steps on [0, 1], MSE of the final state, float64, defaults. "
        "Time: one jitted `value_and_grad` call (median of interleaved calls). Errors: "
        "relative to the largest entry, against `DirectAdjoint` on the same solver.",
        "",
        "| solver | steps | "
        + " | ".join(f"{m} MB" for m in METHODS)
        + " | "
        + " | ".join(f"{m} s" for m in METHODS)
        + " | memory / RC | time / RC | "
        + " | ".join(f"{m} error" for m in METHODS)
        + " |",
        "|---" * (2 + 3 * len(METHODS) + 2) + "|",
    ]
    for r in res["rows"]:
        m, t, e = r["mem"], r["time"], r["err"]
        lines.append(
            f"| {r['solver']} | {r['steps']} | "
            + " | ".join(f"{m[k] / 1e6:.3f}" for k in METHODS)
            + " | "
            + " | ".join(f"{t[k]:.2f}" for k in METHODS)
            + f" | {m[rev] / max(m[rc], 1):.3f} | {t[rev] / t[rc]:.2f} | "
            + " | ".join(
                "(the reference)"
                if k == rc and r.get("reference") == "RCAdjoint"
                else f"{e[k]:.1e}"
                for k in METHODS
            )
            + " |"
        )
    lines += [
        "",
        "Gradient errors past 2 000 steps are against `RecursiveCheckpointAdjoint` on "
        "the same solver (the same discretised gradient: `DirectAdjoint` keeps every "
        "stage of every step and does not fit in memory).",
        "",
        f"Stiff problem: field − {STIFF:g} (y − sin t) on [0, 5], Tsit5 (the reversible "
        f"one with coupling {COUPLING}: at 0.999 its own forward step is unstable here, "
        "a parasitic mode growing like e^{20 h} a step), the loss reading the final state "
        "or 20 saved times. Integrating backwards amplifies rounding by up to "
        f"e^{STIFF * 5 * 0.95:.0f}. Gradient error against `DirectAdjoint` on the same "
        "solver.",
        "",
        "| saved times | steps | " + " | ".join(STABILITY) + " |",
        "|---" * (2 + len(STABILITY)) + "|",
    ]
    for r in res["stability"]:
        lines.append(
            f"| {r['saves'] or 'final'} | {r['steps']} | "
            + " | ".join(
                f"{v:.1e}" if isinstance(v, float) else v for v in (r["err"][k] for k in STABILITY)
            )
            + " |"
        )
    if res.get("one_state"):
        lines += one_state_table(res["one_state"])
    return "\n".join(lines) + "\n"


def one_state_plot(rows: list[dict]) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    steps = [r["steps"] for r in rows]
    for m, style in zip(ONE_STATE, ("-o", "--s")):
        axes[0].plot(steps, [r["mem"][m] / 1e6 for r in rows], style, label=m)
        axes[1].plot(steps, [r["time"][m] for r in rows], style, label=m)
    for ax, title, unit in ((axes[0], "scratch memory", "MB"), (axes[1], "time", "s")):
        ax.set_xscale("log")
        ax.set_xlabel("steps")
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, batch as one state")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "neural_ode_rk_one_state.png"), dpi=120)


def plot(res: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for solver, style in (("Tsit5", "-o"), ("Dopri5", "--s")):
        rows = [r for r in res["rows"] if r["solver"] == solver]
        steps = [r["steps"] for r in rows]
        for m in METHODS:
            axes[0].plot(steps, [r["mem"][m] / 1e6 for r in rows], style, label=f"{solver} {m}")
            axes[1].plot(steps, [r["time"][m] for r in rows], style, label=f"{solver} {m}")
    for ax, title, unit in ((axes[0], "scratch memory", "MB"), (axes[1], "time", "s")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("steps")
        ax.set_ylabel(unit)
        ax.set_title(title)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "neural_ode_rk.png"), dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--one-state",
        action="store_true",
        help="only issue 43's layout (the batch as one state): results/neural_ode_rk_one_state",
    )
    a = ap.parse_args(argv)
    if a.one_state:
        rows = one_state_rows()
        text = "\n".join(one_state_table(rows)[1:]) + "\n"
        print(text)
        write_results("neural_ode_rk_one_state", {"device": device_info(), "rows": rows}, text)
        one_state_plot(rows)
        return
    res = run((500,), 2000, reps=2) if a.quick else run()
    text = table(res)
    print(text)
    if not a.quick:
        write_results("neural_ode_rk", res, text)
        plot(res)


if __name__ == "__main__":
    main()
