"""Tracing cost against program size, on families of masked-step programs (issues 15 and 28).

Every family is k coupling steps masked as diffrax masks its steps,

    a2 = a + tanh(P b); b2 = b + sin(Q a2)
    a, b = where(keep, a2, a), where(keep, b2, b)

and the families differ in what moves elements between the halves (`P`, `Q`: nothing, a
reversal, a roll, a gather by a fixed permutation) and in where `keep` comes from (one
predicate array shared by every step, a predicate per step from a scalar parameter, diffrax's
``t_i < t1`` from a time array, the steps run by `lax.scan`): `tests/programs/families.py`.
No predicate depends on the state, so no walk needs to split on them; before issue 28 the
per-step families traced in time exponential in k (50 s at k = 4, reversals).

For each family, each transform (`reverse`, `reversible`'s gradient, `inverse_jvp`,
`forward_and_slogdet`) and k in 1, 2, 5, 10, 20, 50 it measures the seconds to trace
(`jax.make_jaxpr`, with the defaults a user gets) and the walker's rule applications, and fits
both against k on a log-log scale for k >= 10 (1 is linear; times are medians of three).
For k up to `CHECK_UPTO` it also measures XLA's compile time of each transform's program
beside `jax.grad`'s of the same program (issue 43 item 4). Each result is checked in float64:
the round trip, the gradient against `jax.grad`, the inverse JVP against a dense solve and the
log-determinant against `jnp.linalg.slogdet` of the dense Jacobian, up to k = 5 (see
`CHECK_UPTO`). Writes results/tracing.{json,md,png}.

    python benchmarks/tracing.py [--quick] [--families per_step,roll]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads spinning on a busy CPU
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from _common import RESULTS, device_info, progress, pyplot, write_results  # noqa: E402
from programs.families import FAMILIES, family, loss  # noqa: E402

import jaxrev as jr  # noqa: E402
from jaxrev._stats import counting  # noqa: E402

TRANSFORMS = ("reverse", "reversible grad", "inverse_jvp", "forward_and_slogdet")
TIME_LIMIT = 5.0  # seconds to trace at k = 50 (issue 28)
SLOPE_LIMIT = 1.2
CHECK_UPTO = 5
FIT_FROM = 10
"""Slopes are fitted from this k on (below it a trace takes a few hundredths of a second, and
fixed costs and noise dominate)."""
"""Results are checked up to this k: XLA:CPU's instruction fusion duplicates the cheap
elementwise chains these programs are made of, so compiling them takes time exponential in
k (`jax.grad` of the reversal family itself: 2.4 s at k = 8, minutes at k = 20; the inverse
JVP's program 17.8 s at k = 8)."""


def _programs(name: str, k: int) -> dict:
    """Per transform, the function to trace and its arguments, and a check of its result."""
    f, s, p = family(name, k)
    y = f(s, p)
    flat = lambda v: jnp.concatenate(f((v[:16], v[16:]), p))  # noqa: E731
    x = jnp.concatenate(s)
    J = jax.jacfwd(flat)(x)

    def err(got, want):
        got, want = (
            jnp.concatenate([jnp.ravel(t) for t in jax.tree_util.tree_leaves(a)])
            for a in (got, want)
        )
        return float(jnp.max(jnp.abs(got - want)) / max(1.0, float(jnp.max(jnp.abs(want)))))

    grad = jax.grad(loss(jr.reversible(f)), argnums=(0, 1))
    ijvp = lambda s, p: jr.inverse_jvp(lambda s: f(s, p), (s,), s)[1][0]  # noqa: E731
    fas = lambda s, p: jr.forward_and_slogdet(f)(s, p)[1]  # noqa: E731
    v = jnp.concatenate(s)
    return {
        "reverse": (jr.reverse(f), (y, p), lambda out: err(out, s)),
        "reversible grad": (
            grad,
            (s, p),
            lambda out: err(out, jax.grad(loss(f), argnums=(0, 1))(s, p)),
        ),
        "inverse_jvp": (ijvp, (s, p), lambda out: err(out, jnp.linalg.solve(J, v))),
        "forward_and_slogdet": (fas, (s, p), lambda out: err(out, jnp.linalg.slogdet(J)[1])),
    }


def measure(name: str, k: int, repeats: int = 3) -> dict:
    """Seconds to trace: the median of `repeats` traces of freshly built programs (a shared
    machine adds noise, never removes it); rule applications: those of one trace; for k up to
    `CHECK_UPTO`, seconds to lower and compile (XLA) each transform's program and `jax.grad`'s
    of the same program (once: a fresh `jit` each)."""
    out = {"family": name, "k": k}
    times: dict[str, list] = {}
    for rep in range(repeats):
        for what, (fn, args, check) in _programs(name, k).items():
            t0 = time.perf_counter()
            with counting() as c:
                jax.make_jaxpr(fn)(*args)
            times.setdefault(what, []).append(time.perf_counter() - t0)
            out[f"{what} rules"] = c["rules"] + c["elements"]
            if rep == 0:
                out[f"{what} err"], out[f"{what} compile s"] = None, None
                if k <= CHECK_UPTO:
                    t0 = time.perf_counter()
                    compiled = jax.jit(fn).lower(*args).compile()
                    out[f"{what} compile s"] = time.perf_counter() - t0
                    out[f"{what} err"] = check(compiled(*args))
    out["jax.grad compile s"] = None
    if k <= CHECK_UPTO:  # the peer: XLA's compile of jax.grad of the same program
        f, s, p = family(name, k)
        t0 = time.perf_counter()
        jax.jit(jax.grad(loss(f), argnums=(0, 1))).lower(s, p).compile()
        out["jax.grad compile s"] = time.perf_counter() - t0
    for what, ts in times.items():
        out[f"{what} s"] = float(np.median(ts))
    return out


def slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(np.maximum(ys, 1e-9)), 1)[0])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="k up to 10")
    ap.add_argument("--families", default=",".join(FAMILIES))
    args = ap.parse_args(argv)
    ks = [1, 2, 5, 10] if args.quick else [1, 2, 5, 10, 20, 50]
    names = args.families.split(",")
    measure("shared", 1)  # warm-up: first-time imports and compilations
    rows = [
        measure(n, k) for n, k in progress([(n, k) for n in names for k in ks], desc="families x k")
    ]
    fit_from = 5 if args.quick else FIT_FROM
    fits = {}
    for n in names:
        rs = [r for r in rows if r["family"] == n and r["k"] >= fit_from]
        fits[n] = {
            w: {
                "time": slope([r["k"] for r in rs], [r[f"{w} s"] for r in rs]),
                "rules": slope([r["k"] for r in rs], [r[f"{w} rules"] for r in rs]),
            }
            for w in TRANSFORMS
        }
    data = {
        "device": device_info(),
        "ks": ks,
        "rows": rows,
        "fit from k": fit_from,
        "log-log slopes": fits,
    }
    table = make_table(data)
    suffix = "_quick" if args.quick else ""
    write_results("tracing" + suffix, data, table)
    plot(data, os.path.join(RESULTS, f"tracing{suffix}.png"))
    print(table)


def make_table(d) -> str:
    kmax = max(d["ks"])
    out = [
        f"# Tracing cost of masked-step families ({d['device']['backend']}, "
        f"JAX {d['device']['jax']})",
        "",
        f"Seconds to trace (`jax.make_jaxpr`, defaults) at k = {kmax}, the log-log slopes "
        f"of time (the median of three traces) and of the walker's rule applications "
        f"against k (k >= {d['fit from k']}; 1 is linear), "
        "and the largest error of the result (float64; the gradient against `jax.grad`, "
        "the inverse JVP against a dense solve, log|det| against `slogdet`) for k <= "
        f"{CHECK_UPTO} (compiling these programs, `jax.grad`'s included, takes XLA:CPU "
        "time exponential in k: its fusion duplicates their elementwise chains).",
        "",
        f"| family | transform | s at k = {kmax} | slope (time) | slope (rules) | "
        f"rules at k = {kmax} | max error | compile s at k = {CHECK_UPTO} "
        f"(jax.grad's) | compile slope, k <= {CHECK_UPTO} (jax.grad's) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    worst = {"s": 0.0, "slope": 0.0, "err": 0.0}
    for n, fit in d["log-log slopes"].items():
        rs = [r for r in d["rows"] if r["family"] == n]
        last = [r for r in rs if r["k"] == kmax][0]
        for w in TRANSFORMS:
            e = max(r[f"{w} err"] for r in rs if r[f"{w} err"] is not None)
            compiled = [r for r in rs if r.get(f"{w} compile s") is not None]
            c_last = max(compiled, key=lambda r: r["k"])
            ks_c = [r["k"] for r in compiled]
            c_slope = slope(ks_c, [r[f"{w} compile s"] for r in compiled])
            g_slope = slope(ks_c, [r["jax.grad compile s"] for r in compiled])
            out.append(
                f"| {n} | {w} | {last[f'{w} s']:.2f} | {fit[w]['time']:.2f} | "
                f"{fit[w]['rules']:.2f} | {last[f'{w} rules']} | {e:.1e} | "
                f"{c_last[f'{w} compile s']:.2f} ({c_last['jax.grad compile s']:.2f}) | "
                f"{c_slope:.2f} ({g_slope:.2f}) |"
            )
            worst["s"] = max(worst["s"], last[f"{w} s"])
            worst["slope"] = max(worst["slope"], fit[w]["time"], fit[w]["rules"])
            worst["err"] = max(worst["err"], e)
    out += [
        "",
        f"Worst: {worst['s']:.2f} s at k = {kmax} (target < {TIME_LIMIT:g} s at k = "
        f"50), slope {worst['slope']:.2f} (target <= {SLOPE_LIMIT}), error "
        f"{worst['err']:.1e} (target 1e-10).",
        "",
        "Before issue 28, `jax.grad` through `reversible` of the reversal family with "
        "per-step predicates took 0.08, 1.6, 6.8, 50 s for k = 1..4 (issue 28's report).",
    ]
    return "\n".join(out) + "\n"


def plot(d, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(TRANSFORMS), figsize=(4 * len(TRANSFORMS), 4), sharey=True)
    names = list(d["log-log slopes"])
    for ax, w in zip(axes, TRANSFORMS):
        for n in names:
            rs = [r for r in d["rows"] if r["family"] == n]
            ax.loglog([r["k"] for r in rs], [r[f"{w} s"] for r in rs], "o-", label=n)
        if w == "reversible grad":
            ax.loglog(
                [1, 2, 3, 4],
                [0.08, 1.6, 6.8, 50],
                "x:",
                color="k",
                label="reversal, before issue 28",
            )
        ax.axhline(TIME_LIMIT, color="gray", lw=0.5)
        ax.set_title(w)
        ax.set_xlabel("masked steps k")
    axes[0].set_ylabel("seconds to trace")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
