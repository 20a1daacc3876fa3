"""The NiLang paper's workloads (its Tables 2-6) in JAX: jaxrev's ratios beside the paper's.

For each workload and size, from one run: the objective time (O), the derivative time by
jaxrev (`jr.reversible`) and by plain JAX (`jax.grad`, `jax.vmap(jax.jacrev)`,
`jax.hessian`), their ratios to the objective, XLA's planned temp memory of each, and the
largest relative difference between jaxrev's and JAX's derivative. The paper's NiLang and
Tapenade ratios (derivative time / objective time, computed from its absolute timings, each
against its own objective: Julia's for NiLang, Tapenade's for Tapenade) are copied beside.

Workloads (the examples' `problem(...)` functions, so the benchmark measures the examples):
- Bessel J_2(1.0) by its series in a `while` loop (Table 3), and a vmapped batch of 4000;
- sparse dot trace(AᵀB), 1000 x 1000 at density 0.05 (Table 2);
- Petersen graph embedding, gradient and Hessian, k = 2..10 (Table 4);
- ADBench GMM on the 10k-point inputs, D <= 32 (Table 5);
- ADBench bundle adjustment, the sparse Jacobian (Table 6).

Writes results/nilang_tables.{json,md,png}.

    python benchmarks/nilang_tables.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # no BLAS threads spinning on a busy CPU
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
from collections.abc import Callable  # noqa: E402
from typing import Any

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
from _common import (
    device_info,
    interleaved_medians,
    progress,
    pyplot,  # noqa: E402
    temp_bytes,
    write_results,
)

# ---------------------------------------------------------------- the paper's numbers

# Table 3 (ns): J_2(1.0). NiLang-G / Julia-O; Tapenade-G (backward) / Tapenade-O.
PAPER_BESSEL = {"NiLang": 231 / 17, "Tapenade": 111 / 32}
# Table 2 (s), sparse dot: the gradient is NiLang-O + NiLang-B, against Julia-O.
PAPER_SPARSE = {"NiLang": (4.675e-4 + 5.821e-4) / 3.493e-4}
# Table 4 (s), by k: Julia-O, NiLang-G, (NiLang+F)-H.
PAPER_GRAPH = {
    2: (4.477e-6, 1.509e-5, 4.528e-4),
    4: (4.729e-6, 1.690e-5, 1.025e-3),
    6: (4.959e-6, 1.872e-5, 1.740e-3),
    8: (5.196e-6, 2.076e-5, 2.577e-3),
    10: (5.567e-6, 2.266e-5, 3.558e-3),
}
# Table 5 (s), by parameter count: Julia-O, NiLang-G, Tapenade-O, Tapenade-G.
PAPER_GMM = {
    30: (9.844e-3, 9.102e-3, 1.484e-3, 5.484e-3),
    330: (1.166e-2, 3.709e-2, 3.747e-3, 1.434e-2),
    1200: (2.797e-1, 2.830e-1, 4.836e-2, 2.205e-1),
    3300: (9.745e-2, 3.556e-1, 3.578e-2, 1.497e-1),
    10700: (3.903e-2, 6.652e-1, 5.314e-2, 4.396e-1),
    21500: (7.476e-2, 1.449e0, 1.069e-1, 9.588e-1),
    53600: (2.284e-1, 3.590e0, 2.583e-1, 2.586e0),
    429000: (3.593e0, 3.342e1, 2.200e0, 2.442e1),
}
# Table 6 (s), by measurements: Julia-O, NiLang-J, Tapenade-O, Tapenade-J.
PAPER_BA = {
    31800: (2.020e-3, 1.651e-2, 1.632e-3, 1.940e-2),
    204000: (1.292e-2, 1.182e-1, 1.056e-2, 1.255e-1),
    287000: (1.812e-2, 1.668e-1, 1.540e-2, 1.769e-1),
    564000: (3.563e-2, 3.273e-1, 2.927e-2, 3.489e-1),
    1090000: (6.904e-2, 6.375e-1, 5.687e-2, 6.720e-1),
    4750000: (3.447e-1, 2.785e0, 2.481e-1, 2.935e0),
    9130000: (6.671e-1, 5.535e0, 4.780e-1, 6.027e0),
}


def _nearest(table: dict[int, Any], key: float, tol: float = 0.1):
    """The paper's column whose size is within `tol` (relative) of `key`, else None."""
    best = min(table, key=lambda k: abs(np.log(k / key)))
    return table[best] if abs(best - key) <= tol * best else None


def paper_ratios(workload: str, prob: dict) -> dict[str, float | None]:
    if workload == "bessel":
        return dict(PAPER_BESSEL) if prob["size"] == 1 else {"NiLang": None, "Tapenade": None}
    if workload == "sparse":
        return {**PAPER_SPARSE, "Tapenade": None}
    if workload == "graph":
        row = PAPER_GRAPH.get(prob["size"])
        return {
            "NiLang": row[1] / row[0] if row else None,
            "Tapenade": None,
            "NiLang Hessian": row[2] / row[0] if row else None,
        }
    table, key = (
        (PAPER_GMM, prob["parameters"]) if workload == "gmm" else (PAPER_BA, prob["measurements"])
    )
    row = _nearest(table, key)
    if row is None:
        return {"NiLang": None, "Tapenade": None}
    return {"NiLang": row[1] / row[0], "Tapenade": row[3] / row[2]}


# ---------------------------------------------------------------- the workloads


def workloads(quick: bool) -> list[tuple[str, Callable[[], dict], Any]]:
    """(workload, a thunk building the problem, its size), lazily so big inputs load one at a
    time."""
    import bessel
    import bundle_adjustment
    import gmm
    import graph_embedding
    import sparse_dot

    out: list[tuple[str, Callable[[], dict], Any]] = []
    for size in (1, 4000):
        out.append(("bessel", lambda s=size: bessel.problem(s), size))
    out.append(("sparse", lambda: sparse_dot.problem(1000), 1000))
    for k in (2, 6, 10) if quick else (2, 4, 6, 8, 10):
        out.append(("graph", lambda k=k: graph_embedding.problem(k), k))
    for size in GMM_QUICK if quick else GMM_FULL:
        out.append(("gmm", lambda s=size: gmm.problem(s), size))
    for size in BA_QUICK if quick else BA_FULL:
        out.append(("ba", lambda s=size: bundle_adjustment.problem(s), size))
    return out


# the inputs nearest the paper's Table 5 columns (30 ... 5.36e4 parameters; its 4.29e5 column,
# D = 64, has no 10k-point input) and all seven of Table 6's (3.18e4 ... 9.13e6 observations)
GMM_FULL = [(2, 5), (10, 5), (2, 200), (10, 50), (20, 50), (20, 100), (32, 100)]
GMM_QUICK = [(2, 5), (10, 5)]
BA_FULL = [1, 4, 7, 10, 13, 16, 19]
BA_QUICK = [1]


def rel_diff(a, b) -> float:
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(a)])
    b = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(b)])
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-300))


def measure(prob: dict, reps: int) -> dict:
    """Times (interleaved medians), temp memory and agreement for one problem."""
    args = prob["args"]
    names = [
        k for k in ("objective", "jaxrev", "jax", "jaxrev_hessian", "jax_hessian") if k in prob
    ]
    jitted = {k: jax.jit(prob[k]) for k in names}
    times = interleaved_medians({k: (lambda f=f: f(*args)) for k, f in jitted.items()}, reps=reps)
    mem = {k: temp_bytes(prob[k], *args) for k in names}
    row = {
        "label": prob["label"],
        "time": times,
        "temp_bytes": mem,
        "grad_rel_diff": rel_diff(jitted["jaxrev"](*args), jitted["jax"](*args)),
    }
    if "jaxrev_hessian" in jitted:
        row["hessian_rel_diff"] = rel_diff(
            jitted["jaxrev_hessian"](*args), jitted["jax_hessian"](*args)
        )
    o = times["objective"]
    row["ratio"] = {k: times[k] / o for k in names if k != "objective"}
    return row


# ---------------------------------------------------------------- output

TITLES = {
    "bessel": "Bessel J_2 (Table 3): gradient through a while loop",
    "sparse": "Sparse dot trace(AᵀB) (Table 2): gradient w.r.t. the non-zeros",
    "graph": "Petersen graph embedding (Table 4): gradient and Hessian",
    "gmm": "Gaussian mixture model, ADBench 10k points (Table 5): gradient",
    "ba": "Bundle adjustment, ADBench (Table 6): sparse Jacobian",
}


def _f(x: float | None, fmt: str = ".3g") -> str:
    return "–" if x is None else format(x, fmt)


def markdown(rows: list[dict], info: dict) -> str:
    lines = [
        f"# The NiLang paper's workloads in JAX ({info['backend']}: {info['device']}, "
        f"JAX {info['jax']})",
        "",
        "Ratios are derivative time / objective time, each implementation against its "
        "own objective (jaxrev's and JAX's against the same jitted JAX objective; the "
        "paper's NiLang against Julia's, Tapenade against Tapenade's). Times are medians "
        "of interleaved runs, compile excluded; memory is XLA's planned temp bytes. "
        "`rel diff` is jaxrev's derivative against JAX's.",
        "",
    ]
    for w in TITLES:
        sub = [r for r in rows if r["workload"] == w]
        if not sub:
            continue
        hess = any("jaxrev_hessian" in r["time"] for r in sub)
        lines += [f"## {TITLES[w]}", ""]
        head = [
            "size",
            "objective s",
            "jaxrev s",
            "JAX s",
            "jaxrev / O",
            "JAX / O",
            "NiLang / O (paper)",
            "Tapenade / O (paper)",
            "jaxrev temp",
            "JAX temp",
            "rel diff",
        ]
        if hess:
            head += ["jaxrev H / O", "jax.hessian / O", "NiLang+F H / O (paper)", "H rel diff"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in sub:
            t, m, q, p = r["time"], r["temp_bytes"], r["ratio"], r["paper"]
            cells = [
                r["label"],
                _f(t["objective"]),
                _f(t["jaxrev"]),
                _f(t["jax"]),
                _f(q["jaxrev"], ".2f"),
                _f(q["jax"], ".2f"),
                _f(p.get("NiLang"), ".2f"),
                _f(p.get("Tapenade"), ".2f"),
                f"{m['jaxrev']:,}",
                f"{m['jax']:,}",
                _f(r["grad_rel_diff"], ".1e"),
            ]
            if hess:
                cells += [
                    _f(q.get("jaxrev_hessian"), ".1f"),
                    _f(q.get("jax_hessian"), ".1f"),
                    _f(p.get("NiLang Hessian"), ".1f"),
                    _f(r.get("hessian_rel_diff"), ".1e"),
                ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(10, 4.5))
    labels, ours, jaxs, nilang = [], [], [], []
    for r in rows:
        labels.append(f"{r['workload']}:{r['size']}")
        ours.append(r["ratio"]["jaxrev"])
        jaxs.append(r["ratio"]["jax"])
        nilang.append(r["paper"].get("NiLang") or np.nan)
    x = np.arange(len(rows))
    ax.bar(x - 0.27, ours, 0.27, label="jaxrev / objective")
    ax.bar(x, jaxs, 0.27, label="JAX / objective")
    ax.bar(x + 0.27, nilang, 0.27, label="NiLang / objective (paper)")
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_ylabel("derivative time / objective time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes, fewer repetitions")
    a = ap.parse_args()
    reps = 3 if a.quick else 5
    rows = []
    for workload, build, size in progress(workloads(a.quick), desc="nilang tables"):
        prob = build()
        prob["size"] = size
        row = measure(prob, reps)
        row.update(
            workload=workload,
            size=str(size) if not isinstance(size, int) else size,
            paper=paper_ratios(workload, prob),
        )
        rows.append(row)
        del prob
    info = device_info()
    name = "nilang_tables_quick" if a.quick else "nilang_tables"
    table = markdown(rows, info)
    write_results(name, {"device": info, "rows": rows}, table)
    plot(rows, os.path.join(HERE, "results", f"{name}.png"))
    print(table)


if __name__ == "__main__":
    main()
