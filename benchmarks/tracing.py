"""Tracing cost against program size (issue 15): masked steps, as diffrax writes every step.

    a2 = a + tanh(b); b2 = b + sin(a2)
    a, b = where(keep, a2, a), where(keep, b2, b)       # repeated k times

`keep` is known only when the program runs (a function of time, as in diffrax). Before
element-level inversion, every `select_n` split the walk into one propagation per case, each
walking what the other had walked (issue 15 reports 0.1, 0.5, 2.0, 9.4 and 51 s for k = 1..5 in
its variant). Now the selects' cases are known where `keep` picks them, each equation is
inverted once, and the walker revisits an equation only when its variables change.

For k in 1, 2, 5, 10, 20, 50 it measures the time to trace (`jax.make_jaxpr`) the gradient
through `jr.reversible` and `jr.reverse` itself, and counts the walker's rule applications;
then fits time and applications against k (a slope near 1 on the log-log plot is linear).
With ``--before PATH`` it also times the gradient with the jaxrev checkout at PATH (in a
subprocess), for the same programs. Writes results/tracing.{json,md,png}.

    python benchmarks/tracing.py [--quick] [--before PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")   # no BLAS threads spinning on a busy CPU
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
                      "intra_op_parallelism_threads=1")
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import jaxrev as jr  # noqa: E402
from programs.elements import masked_steps  # noqa: E402  (the tests' program)
from jaxrev._stats import counting  # noqa: E402
from _common import RESULTS, device_info, progress, pyplot, write_results  # noqa: E402


def measure(k: int, n: int = 64) -> dict:
    f = masked_steps(k)
    ab, t, grad = _grad_of(k, n)
    out = {"k": k, "equations": len(jax.make_jaxpr(f)(ab, t).jaxpr.eqns)}
    for what, fn, args in (("reversible grad", grad, (ab, t)),
                           ("reverse", jr.reverse(f), (f(ab, t), t))):
        t0 = time.perf_counter()
        with counting() as c:
            jax.make_jaxpr(fn)(*args)
        out[f"{what} s"] = time.perf_counter() - t0
        out[f"{what} rule applications"] = c["rules"] + c["elements"]
    # and it is right: the gradient against jax.grad's
    want = jax.jit(jax.grad(lambda ab, t: jnp.sum(f(ab, t)[1] ** 2)))(ab, t)
    got = jax.jit(grad)(ab, t)
    out["grad rel err"] = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                              for a, b in zip(got, want))
    return out


def grad_trace_seconds(k: int, n: int = 64) -> float:
    """Only the time to trace the reversible gradient (what `--before` measures)."""
    ab, t, grad = _grad_of(k, n)
    t0 = time.perf_counter()
    jax.make_jaxpr(grad)(ab, t)
    return time.perf_counter() - t0


def _grad_of(k: int, n: int) -> tuple:
    f = masked_steps(k)
    ab = (jnp.linspace(-1, 1, n), jnp.linspace(1, -1, n))
    t = jnp.linspace(0, 1, n)
    return ab, t, jax.grad(lambda ab, t: jnp.sum(jr.reversible(f)(ab, t)[1] ** 2))


def before(path: str, ks: list[int]) -> dict:
    """The reversible gradient's tracing time with an older jaxrev checkout, in a subprocess."""
    here = os.path.dirname(os.path.abspath(__file__))
    tests = os.path.join(here, "..", "tests")
    code = (f"import sys; sys.path.insert(0, {path!r}); sys.path[1:1] = [{here!r}, {tests!r}]\n"
            "import json, tracing\n"
            "tracing.grad_trace_seconds(1)\n"
            f"print(json.dumps({{k: tracing.grad_trace_seconds(k) for k in {ks!r}}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=3600, env={**os.environ, "PYTHONPATH": path})
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--before", help="an older jaxrev checkout to compare with")
    args = ap.parse_args(argv)
    ks = [1, 2, 5, 10] if args.quick else [1, 2, 5, 10, 20, 50]
    measure(1)   # warm-up: first-time imports and compilations
    rows = [measure(k) for k in progress(ks, desc="masked steps")]
    if args.before:
        old = before(args.before, ks)
        for r in rows:
            r["before: reversible grad s"] = old[r["k"]]
    fits = {what: {"time": slope(ks[1:], [r[f"{what} s"] for r in rows[1:]]),
                   "rule applications": slope(ks[1:], [r[f"{what} rule applications"]
                                                       for r in rows[1:]])}
            for what in ("reversible grad", "reverse")}
    data = {"device": device_info(), "rows": rows, "log-log slopes (k >= 2)": fits}
    table = make_table(data)
    suffix = "_quick" if args.quick else ""
    write_results("tracing" + suffix, data, table)
    plot(data, os.path.join(RESULTS, f"tracing{suffix}.png"))
    print(table)


def make_table(d) -> str:
    old = "before: reversible grad s" in d["rows"][0]
    out = [f"# Tracing cost of masked steps ({d['device']['backend']}, JAX {d['device']['jax']})",
           "", "Seconds to trace (`jax.make_jaxpr`) and the walker's rule applications; the "
           "gradient's error against `jax.grad` (float64)."
           + (" \"before\": the same, with the jaxrev of before issue 15." if old else ""), "",
           "| k | equations | reversible grad s | rule applications | reverse s | "
           "rule applications | grad rel err |" + (" before: reversible grad s |" if old else ""),
           "|---|---|---|---|---|---|---|" + ("---|" if old else "")]
    for r in d["rows"]:
        out.append(f"| {r['k']} | {r['equations']} | {r['reversible grad s']:.3f} | "
                   f"{r['reversible grad rule applications']} | {r['reverse s']:.3f} | "
                   f"{r['reverse rule applications']} | {r['grad rel err']:.1e} |"
                   + (f" {r['before: reversible grad s']:.3f} |" if old else ""))
    out += ["", "Log-log slopes against k (1 is linear): " + "; ".join(
        f"{w}: time {s['time']:.2f}, rule applications {s['rule applications']:.2f}"
        for w, s in d["log-log slopes (k >= 2)"].items()) + ".",
        "", "Issue 15 reported 0.1, 0.5, 2.0, 9.4, 51 s for k = 1..5 (its variant of the "
        "program, before element-level inversion)."]
    return "\n".join(out) + "\n"


def plot(d, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    ks = [r["k"] for r in d["rows"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for what in ("reversible grad", "reverse"):
        ax.loglog(ks, [r[f"{what} s"] for r in d["rows"]], "o-", label=f"{what} (now)")
    if "before: reversible grad s" in d["rows"][0]:
        ax.loglog(ks, [r["before: reversible grad s"] for r in d["rows"]], "s--",
                  label="reversible grad (before issue 15)")
    ax.loglog([1, 2, 3, 4, 5], [0.1, 0.5, 2.0, 9.4, 51], "x:",
              label="reversible grad (issue 15's report)")
    ax.set_xlabel("masked steps k")
    ax.set_ylabel("seconds to trace")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
