"""Newton steps by inverse accumulation against dense, Lineax (GMRES, CG), Optimistix and Optax.

Workload (issue 5, item 4): the chained Rosenbrock function
f(x) = sum_{i<n-1} 100 (x_{i+1} - x_i^2)^2 + (1 - x_i)^2, in float64. Its Hessian is
tridiagonal, which `jr.optim.newton_direction` solves by banded elimination without forming it.

- Part A, one Newton direction d with H d = g at x = 1 + 0.01 N(0, 1) (a fixed key; near the
  minimum, so H is positive definite), n in {100, 300, 1000, 3000, 4000, 10000}:
  `jr.optim.newton_direction`; dense `jnp.linalg.solve(jax.hessian(f)(x), g)` (n <= 4000: an
  n x n Hessian and an O(n^3) LU); Lineax GMRES and CG on Hessian-vector products (`jax.jvp`
  of `jax.grad`). Time, and the relative residual ||H d - g|| / ||g|| (H d by an HVP).
- Part B, minimisation from the standard start x_i = -1.2 (i even), 1 (i odd) to
  max |grad f| <= 1e-8, n in {100, 1000, 4000}: `jr.optim.minimize` ("trust-region",
  "newton"); Optimistix BFGS (n <= 1000: it updates an n x n inverse Hessian) and Newton root
  finding on grad f (n <= 100: it materialises and LUs the n x n Hessian every step); Optax
  L-BFGS with its zoom line search in a `lax.while_loop`. Steps, final f, final max |grad f|
  (recomputed here for every solver) and time.

Everything is compiled ahead of time; times are medians of interleaved runs, compile excluded
(a first run gives the outputs checked and sets the number of timed runs: 25 for the fastest,
one for the slowest). Writes results/newton.{json,md,png}; --quick runs
fewer sizes and writes results/newton_quick.*.

- Part C (issue 20), a dense problem: L2-regularised logistic regression, 1000 samples x 200
  features, time to max |grad| <= 1e-8 for `jr.optim.minimize` (its dense-Hessian path, and
  with it off), naive Newton (`jax.hessian` + solve), Optimistix BFGS and Newton, Optax
  L-BFGS. `--logistic` runs only this part (results/newton_logistic.*).

    python benchmarks/newton.py [--quick] [--logistic]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

# one BLAS thread: on a busy 2-core machine OpenBLAS threads spinning made a 200 x 200 solve
# take ~60 ms instead of < 1 ms, distorting every dense path's time
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402  (a dependency of jaxrev.optim)
from jax import lax  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    optional,
    progress,  # noqa: E402
    pyplot,
    write_results,
)

import jaxrev as jr  # noqa: E402

lx = optional("lineax")
optx = optional("optimistix")

SIZES_A = (100, 300, 1000, 3000, 4000, 10000)
SIZES_A_QUICK = (100, 1000, 4000)
SIZES_B = (100, 1000, 4000)
SIZES_B_QUICK = (100, 1000)
DENSE_MAX_N = 4000  # dense Hessian + LU: 128 MB and 1-2 s at 4000, O(n^3) beyond
BFGS_MAX_N = 1000  # Optimistix BFGS updates an n x n inverse Hessian: ~15 s a run at 1000
BFGS_MAX_N_QUICK = 100
# Optimistix Newton materialises and LUs the n x n Hessian every step: at n = 1000 it converges
# in 1329 steps but takes 25 s a run on an idle 2-core machine, minutes on a busy one
OPTX_NEWTON_MAX_N = 100
TARGET_N = 4000
# Lineax's tolerance is relative to max |g|; its GMRES tests it only between restarts, so
# its residual lands far below
KRYLOV_RTOL = 1e-10
GMRES_RESTART = 20  # Lineax's default, and the fastest of 20/50/100 on this Hessian
GTOL = 1e-8
MAX_STEPS = 50_000  # L-BFGS needs ~20k at n = 4000, jaxrev's trust region ~10k
OPTX_NEWTON_MAX_STEPS = 5_000
BFGS_TOL = 1e-11  # Optimistix stops on small steps, not on grad: this gives max|grad| <= GTOL
# (first run under this many seconds, timed runs): many runs of the sub-millisecond directions,
# for a stable median on a busy machine; one of the runs that take a minute
TIERS_A = ((0.1, 25), (5.0, 5), (float("inf"), 1))
TIERS_B = ((1.0, 5), (20.0, 3), (float("inf"), 1))

DIRECTION = "jaxrev newton_direction"
DENSE = "dense hessian + solve"
GMRES = "lineax GMRES"
CG = "lineax CG"
METHODS_A = (DIRECTION, DENSE, GMRES, CG)
METHODS_B = (
    "jaxrev trust-region",
    "jaxrev newton",
    "optimistix BFGS",
    "optimistix Newton (root of grad)",
    "optax L-BFGS",
)


def rosenbrock(x: jax.Array) -> jax.Array:
    """Chained Rosenbrock function; its minimum is f(1, ..., 1) = 0."""
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def hvp(x: jax.Array, v: jax.Array) -> jax.Array:
    """Hessian-vector product H(x) v, forward over reverse."""
    return jax.jvp(jax.grad(rosenbrock), (x,), (v,))[1]


def compile_run_time(
    fns: dict[str, Callable[[Any], Any]], arg: Any, tiers: tuple[tuple[float, int], ...]
) -> tuple[dict[str, Any], dict[str, float], dict[str, int]]:
    """Compile each `fn(arg)` ahead of time, run it once (its output is returned; the run
    warms it up and sizes its repetitions), then time with interleaved medians. `tiers` is
    ((seconds, reps), ...): a method whose first run took under `seconds` gets `reps` timed
    runs (the first tier that fits); methods with equal reps are interleaved together. Returns
    (outputs, median seconds, reps)."""
    compiled = {k: jax.jit(fn).lower(arg).compile() for k, fn in fns.items()}
    outs, reps = {}, {}
    for k, c in compiled.items():
        t0 = time.perf_counter()
        outs[k] = jax.block_until_ready(c(arg))
        reps[k] = next(r for limit, r in tiers if time.perf_counter() - t0 < limit)
    times: dict[str, float] = {}
    for r in sorted(set(reps.values())):
        times.update(
            interleaved_medians(
                {k: partial(c, arg) for k, c in compiled.items() if reps[k] == r}, reps=r, warmup=0
            )
        )
    return outs, times, reps


# --------------------------------------------------------------------------- part A


def krylov_direction(solver: Any, tag: object) -> Callable[[jax.Array], tuple]:
    """A Lineax solve of H d = g on HVPs; returns (d, {converged, steps})."""

    def solve(x):
        op = lx.FunctionLinearOperator(
            lambda v: hvp(x, v), jax.ShapeDtypeStruct(x.shape, x.dtype), tags=tag
        )
        sol = lx.linear_solve(op, jax.grad(rosenbrock)(x), solver, throw=False)
        return sol.value, {
            "converged": sol.result == lx.RESULTS.successful,
            "steps": sol.stats["num_steps"],
        }

    return solve


def direction_solvers(n: int) -> dict[str, Callable[[jax.Array], tuple]]:
    """Part A's solvers at size n, each x -> (d, aux)."""
    fns = {DIRECTION: lambda x: (jr.optim.newton_direction(rosenbrock, x), {})}
    if n <= DENSE_MAX_N:
        fns[DENSE] = lambda x: (
            jnp.linalg.solve(jax.hessian(rosenbrock)(x), jax.grad(rosenbrock)(x)),
            {},
        )
    if lx is not None:
        fns[GMRES] = krylov_direction(
            lx.GMRES(rtol=KRYLOV_RTOL, atol=0.0, restart=GMRES_RESTART, max_steps=1000),
            lx.symmetric_tag,
        )
        fns[CG] = krylov_direction(
            lx.CG(rtol=KRYLOV_RTOL, atol=0.0, max_steps=20 * n), lx.positive_semidefinite_tag
        )
    return fns


def run_direction(n: int) -> dict:
    """Part A at size n: times, residuals and Krylov statistics."""
    x = 1.0 + 0.01 * jax.random.normal(jax.random.key(0), (n,), jnp.float64)
    g = jax.grad(rosenbrock)(x)
    outs, times, used = compile_run_time(direction_solvers(n), x, TIERS_A)
    res_fn = jax.jit(lambda x, d, g: jnp.linalg.norm(hvp(x, d) - g) / jnp.linalg.norm(g))
    row = {
        "n": n,
        "times": times,
        "reps": used,
        "residuals": {k: float(res_fn(x, d, g)) for k, (d, _) in outs.items()},
        "krylov": {
            k: {"converged": bool(a["converged"]), "steps": int(a["steps"])}
            for k, (_, a) in outs.items()
            if a
        },
        "skipped": {},
    }
    if DENSE not in times:
        row["skipped"][DENSE] = f"n > {DENSE_MAX_N}"
    return row


# --------------------------------------------------------------------------- part B


def standard_start(n: int) -> jax.Array:
    return jnp.where(jnp.arange(n) % 2 == 0, -1.2, 1.0)


def lbfgs(x0: jax.Array, fun: Callable = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Optax L-BFGS (zoom line search) until max |grad| <= GTOL; (x, steps, converged)."""
    fun = fun or rosenbrock
    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(fun)

    def gnorm(state):
        # the line search leaves the new point's gradient in the state: no extra evaluation
        return jnp.max(jnp.abs(optax.tree.get(state, "grad")))

    def body(c):
        x, state, k = c
        value, grad = value_and_grad(x, state=state)
        updates, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=fun)
        return optax.apply_updates(x, updates), state, k + 1

    def cond(c):
        _, state, k = c
        # before the first step the state holds no gradient yet
        return ((k == 0) | (gnorm(state) > GTOL)) & (k < MAX_STEPS)

    x, state, k = lax.while_loop(cond, body, (x0, opt.init(x0), jnp.zeros([], jnp.int32)))
    return x, k, gnorm(state) <= GTOL


def optx_limits(bfgs_max_n: int) -> dict[str, tuple[int, str]]:
    """Largest n each Optimistix solver runs at, and why."""
    return {
        "optimistix BFGS": (bfgs_max_n, "updates an n x n inverse Hessian every step"),
        "optimistix Newton (root of grad)": (
            OPTX_NEWTON_MAX_N,
            "jacfwd and LU of the n x n Hessian every step",
        ),
    }


def jaxrev_minimize(fun: Callable, method: str) -> Callable[[jax.Array], tuple]:
    def run(x0):
        x, info = jr.optim.minimize(
            fun, x0, method=method, tol=GTOL, maxiter=MAX_STEPS, throw=False
        )  # (the table reports a solve that does not converge; it does not stop the run)
        return x, info.iterations, info.status == 0

    return run


def optx_bfgs(fun: Callable) -> Callable[[jax.Array], tuple]:
    def run(x0):
        sol = optx.minimise(
            lambda x, _: fun(x),
            optx.BFGS(rtol=BFGS_TOL, atol=BFGS_TOL),
            x0,
            max_steps=MAX_STEPS,
            throw=False,
        )
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    return run


def optx_newton_root(fun: Callable) -> Callable[[jax.Array], tuple]:
    def run(x0):
        # Cauchy termination with atol = GTOL: max |grad| < GTOL and a small last step
        sol = optx.root_find(
            lambda x, _: jax.grad(fun)(x),
            optx.Newton(rtol=GTOL, atol=GTOL),
            x0,
            max_steps=OPTX_NEWTON_MAX_STEPS,
            throw=False,
        )
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    return run


def minimizers(n: int, bfgs_max_n: int) -> dict[str, Callable[[jax.Array], tuple]]:
    """Part B's solvers at size n (Optimistix's within `optx_limits`), each
    x0 -> (x, steps, converged as the solver reports it)."""
    bfgs, newton_root = optx_bfgs(rosenbrock), optx_newton_root(rosenbrock)
    fns = {
        "jaxrev trust-region": jaxrev_minimize(rosenbrock, "trust-region"),
        "jaxrev newton": jaxrev_minimize(rosenbrock, "newton"),
    }
    if optx is not None:
        limits = optx_limits(bfgs_max_n)
        for k, fn in (("optimistix BFGS", bfgs), ("optimistix Newton (root of grad)", newton_root)):
            if n <= limits[k][0]:
                fns[k] = fn
    fns["optax L-BFGS"] = lbfgs
    return fns


def run_minimize(n: int, bfgs_max_n: int) -> dict:
    """Part B at size n: time to tolerance, steps, final f and max |grad f| per solver."""
    x0 = standard_start(n)
    outs, times, used = compile_run_time(minimizers(n, bfgs_max_n), x0, TIERS_B)
    check = jax.jit(lambda x: (rosenbrock(x), jnp.max(jnp.abs(jax.grad(rosenbrock)(x)))))
    runs = {}
    for k, (x, steps, ok) in outs.items():
        value, gmax = check(x)
        runs[k] = {
            "seconds": times[k],
            "reps": used[k],
            "steps": int(steps),
            "value": float(value),
            "grad_max": float(gmax),
            "solver_converged": bool(ok),
            "converged": bool(gmax <= GTOL),
        }
    skipped = {
        k: f"n > {lim}, {why}"
        for k, (lim, why) in optx_limits(bfgs_max_n).items()
        if n > lim and optx is not None
    }
    return {"n": n, "runs": runs, "skipped": skipped}


# --------------------------------------------------------------------------- part C


LOGISTIC = (1000, 200)  # samples, features
TIERS_C = ((1.0, 15), (float("inf"), 3))
NAIVE = "naive Newton (jax.hessian + solve)"


def logistic_loss(n_samples: int, n_features: int, seed: int = 0) -> Callable:
    """L2-regularised logistic regression on generated data (a dense Hessian XᵀDX)."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n_samples, n_features)) / np.sqrt(n_features)
    w = rng.standard_normal(n_features)
    y = (rng.random(n_samples) < 1.0 / (1.0 + np.exp(-X @ w))).astype(float)
    X, y = jnp.asarray(X), jnp.asarray(y)

    def loss(w):
        z = X @ w
        return jnp.mean(jnp.logaddexp(0.0, z) - y * z) + 1e-3 * jnp.sum(w**2)

    return loss


def naive_newton(fun: Callable) -> Callable[[jax.Array], tuple]:
    """Full Newton steps with `jax.hessian` and a dense solve, until max |grad| <= GTOL."""
    g, H = jax.grad(fun), jax.hessian(fun)

    def run(x0):
        def body(c):
            x, k = c
            return x - jnp.linalg.solve(H(x), g(x)), k + 1

        x, k = lax.while_loop(
            lambda c: (jnp.max(jnp.abs(g(c[0]))) > GTOL) & (c[1] < 100),
            body,
            (x0, jnp.zeros([], jnp.int32)),
        )
        return x, k, jnp.max(jnp.abs(g(x))) <= GTOL

    return run


def without_dense_path(fn: Callable) -> Callable:
    """`fn` traced with jaxrev's dense-Hessian path off (inverse accumulation throughout)."""

    def run(x0):
        old, jr.optim.DENSE_MAX = jr.optim.DENSE_MAX, 0
        try:
            return fn(x0)
        finally:
            jr.optim.DENSE_MAX = old

    return run


def run_logistic() -> dict:
    """Part C: time to max |grad| <= GTOL on logistic regression, from w = 0."""
    loss = logistic_loss(*LOGISTIC)
    fns = {
        "jaxrev newton": jaxrev_minimize(loss, "newton"),
        "jaxrev trust-region": jaxrev_minimize(loss, "trust-region"),
        "jaxrev newton, dense path off": without_dense_path(jaxrev_minimize(loss, "newton")),
        NAIVE: naive_newton(loss),
    }
    if optx is not None:
        fns["optimistix BFGS"] = optx_bfgs(loss)
        fns["optimistix Newton (root of grad)"] = optx_newton_root(loss)
    fns["optax L-BFGS"] = partial(lbfgs, fun=loss)
    x0 = jnp.zeros(LOGISTIC[1])
    outs, times, used = compile_run_time(fns, x0, TIERS_C)
    gmax = jax.jit(lambda x: jnp.max(jnp.abs(jax.grad(loss)(x))))
    runs = {
        k: {
            "seconds": times[k],
            "reps": used[k],
            "steps": int(steps),
            "value": float(loss(x)),
            "grad_max": float(gmax(x)),
            "converged": bool(gmax(x) <= GTOL),
        }
        for k, (x, steps, ok) in outs.items()
    }
    return {"samples": LOGISTIC[0], "features": LOGISTIC[1], "runs": runs}


def logistic_table(d: dict) -> str:
    c = d["part_c"]
    base = c["runs"][NAIVE]["seconds"]
    out = [
        f"# Newton on a dense problem: logistic regression ({d['device']['backend']}, "
        f"JAX {d['device']['jax']})",
        "",
        f"L2-regularised logistic regression, {c['samples']} samples x {c['features']} "
        f"features, float64, from w = 0 to max |grad| <= {GTOL:g}. jaxrev's Newton finds "
        "the Hessian dense when traced (a few of its columns at a stand-in point), forms it "
        "with one vmapped batch of Hessian-vector products and solves by Cholesky. Seconds "
        "are medians of interleaved runs, compile excluded; OPENBLAS_NUM_THREADS=1, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}.",
        "",
        "| solver | steps | milliseconds | / naive Newton | max abs grad | converged |",
        "|---|---|---|---|---|---|",
    ]
    for k, r in c["runs"].items():
        out.append(
            f"| {k} | {r['steps']} | {r['seconds'] * 1e3:.2f} | "
            f"{r['seconds'] / base:.2f} | {r['grad_max']:.1e} | {r['converged']} |"
        )
    return "\n".join(out + [""])


# --------------------------------------------------------------------------- report


def target_ratios(rows_a: list[dict]) -> dict:
    """The n = TARGET_N direction-time ratios (others / jaxrev) against the issue's targets."""
    row = next((r for r in rows_a if r["n"] == TARGET_N), None)
    if row is None:
        return {}
    t, base = row["times"], row["times"][DIRECTION]
    out = {"n": TARGET_N, "jaxrev_residual": row["residuals"][DIRECTION]}
    for k, key in ((DENSE, "dense"), (GMRES, "gmres"), (CG, "cg")):
        if k in t:
            out[f"{key} / jaxrev"] = t[k] / base
    out["targets"] = {
        "dense / jaxrev >= 20": out.get("dense / jaxrev", 0.0) >= 20,
        "gmres / jaxrev >= 3": out.get("gmres / jaxrev", 0.0) >= 3,
        "jaxrev residual <= 1e-9": out["jaxrev_residual"] <= 1e-9,
    }
    return out


def cell_a(row: dict, k: str) -> str:
    if k in row["skipped"]:
        return f"skipped: {row['skipped'][k]}"
    if k not in row["times"]:
        return "n/a"
    s = f"{row['times'][k]:.2e} ({row['residuals'][k]:.1e}"
    kr = row["krylov"].get(k)
    if kr is not None:
        s += f", {kr['steps']} steps" + ("" if kr["converged"] else ", NOT converged")
    return s + ")"


def ratio(row: dict, k: str) -> str:
    t = row["times"]
    return f"{t[k] / t[DIRECTION]:.3g}" if k in t else "-"


def make_table(d: dict) -> str:
    dev = d["device"]
    out = [
        f"# Newton steps on chained Rosenbrock ({dev['backend']}: {dev['device']}, "
        f"JAX {dev['jax']})",
        "",
        "f(x) = sum_{i<n-1} 100 (x_{i+1} - x_i^2)^2 + (1 - x_i)^2 (tridiagonal Hessian), "
        "float64. Everything jit-compiled; seconds are medians of interleaved runs, compile "
        "excluded (timed runs per method, from how long its first run took, in the JSON's "
        "'reps').",
        "",
        "## A. One Newton direction d = H⁻¹g at x = 1 + 0.01 N(0, 1)",
        "",
        "Seconds per direction (relative residual ‖H d − g‖ / ‖g‖, H d by an HVP). Lineax "
        f"solvers run on HVPs (jax.jvp of jax.grad): GMRES(rtol={KRYLOV_RTOL:g}, "
        f"restart={GMRES_RESTART}), its steps are restart cycles of {GMRES_RESTART} HVPs; "
        f"CG(rtol={KRYLOV_RTOL:g}), one HVP a step. Ratios: others' time / jaxrev's.",
        "",
        "| n | " + " | ".join(METHODS_A) + " | dense / jaxrev | GMRES / jaxrev | CG / jaxrev |",
        "|---" * (len(METHODS_A) + 4) + "|",
    ]
    for r in d["part_a"]:
        out.append(
            f"| {r['n']} | "
            + " | ".join(cell_a(r, k) for k in METHODS_A)
            + " | "
            + " | ".join(ratio(r, k) for k in (DENSE, GMRES, CG))
            + " |"
        )
    t = d["targets"]
    if t:
        met = t["targets"]
        out += [
            "",
            f"At n = {t['n']}: dense / jaxrev = {t.get('dense / jaxrev', 0):.1f} "
            f"(target ≥ 20: {'met' if met['dense / jaxrev >= 20'] else 'NOT met'}), "
            f"GMRES / jaxrev = {t.get('gmres / jaxrev', 0):.1f} "
            f"(target ≥ 3: {'met' if met['gmres / jaxrev >= 3'] else 'NOT met'}), "
            f"CG / jaxrev = {t.get('cg / jaxrev', 0):.1f}; jaxrev residual "
            f"{t['jaxrev_residual']:.1e} (target ≤ 1e-9: "
            f"{'met' if met['jaxrev residual <= 1e-9'] else 'NOT met'}).",
        ]
    out += [
        "",
        f"## B. Minimisation from x_i = −1.2 (i even), 1 (i odd) to max |∇f| ≤ {GTOL:g}",
        "",
        "Steps as each solver counts them; f and max |∇f| recomputed at the returned "
        "point; 'converged' means max |∇f| ≤ tolerance there (the solver's own verdict in "
        f"brackets when it differs). Optimistix BFGS(rtol=atol={BFGS_TOL:g}), Newton("
        f"rtol=atol={GTOL:g}, max_steps={OPTX_NEWTON_MAX_STEPS}); optax.lbfgs() with its "
        "zoom line search.",
        "",
        "| n | method | seconds | steps | f | max abs grad | converged |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in d["part_b"]:
        for k in METHODS_B:
            if k in r["skipped"]:
                out.append(f"| {r['n']} | {k} | skipped: {r['skipped'][k]} | | | | |")
                continue
            if k not in r["runs"]:
                continue
            u = r["runs"][k]
            conv = "yes" if u["converged"] else "no"
            if u["solver_converged"] != u["converged"]:
                conv += f" (solver: {'yes' if u['solver_converged'] else 'no'})"
            out.append(
                f"| {r['n']} | {k} | {u['seconds']:.3g} | {u['steps']} | "
                f"{u['value']:.2e} | {u['grad_max']:.1e} | {conv} |"
            )
    return "\n".join(out) + "\n"


def plot(d: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, (ax_a, ax_b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k in METHODS_A:
        pts = [(r["n"], r["times"][k]) for r in d["part_a"] if k in r["times"]]
        if pts:
            ax_a.plot(*zip(*pts), "o-", label=k)
    ax_a.set_title("one Newton direction H⁻¹g")
    for k in METHODS_B:
        pts = [
            (r["n"], r["runs"][k]["seconds"], r["runs"][k]["converged"])
            for r in d["part_b"]
            if k in r["runs"]
        ]
        if not pts:
            continue
        ns, ts, ok = zip(*pts)
        (line,) = ax_b.plot(ns, ts, "-", label=k)
        # hollow markers: stopped without reaching the gradient tolerance
        ax_b.scatter(
            ns,
            ts,
            color=line.get_color(),
            facecolors=[line.get_color() if c else "none" for c in ok],
        )
    ax_b.set_title(f"minimisation to max |∇f| ≤ {GTOL:g} (hollow: not converged)")
    for ax in (ax_a, ax_b):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("n")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("chained Rosenbrock, float64, " + d["device"]["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--logistic", action="store_true", help="only part C (results/newton_logistic.*)"
    )
    args = ap.parse_args(argv)
    q = args.quick
    if args.logistic:
        data = {"device": device_info(), "part_c": run_logistic()}
        table = logistic_table(data)
        write_results("newton_logistic", data, table)
        logistic_plot(data, os.path.join(RESULTS, "newton_logistic.png"))
        print(table)
        return
    part_a = [
        run_direction(n)
        for n in progress(SIZES_A_QUICK if q else SIZES_A, desc="Newton directions")
    ]
    bfgs_max_n = BFGS_MAX_N_QUICK if q else BFGS_MAX_N
    part_b = [
        run_minimize(n, bfgs_max_n)
        for n in progress(SIZES_B_QUICK if q else SIZES_B, desc="minimisation")
    ]
    data = {
        "device": device_info(),
        "part_a": part_a,
        "targets": target_ratios(part_a),
        "part_b": part_b,
    }
    table = make_table(data)
    suffix = "_quick" if q else ""
    write_results("newton" + suffix, data, table)
    plot(data, os.path.join(RESULTS, f"newton{suffix}.png"))
    print(table)


def logistic_plot(d: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    runs = d["part_c"]["runs"]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(runs)
    ax.barh(names, [runs[k]["seconds"] * 1e3 for k in names])
    ax.set(xlabel="milliseconds to max |grad| <= 1e-8", title="logistic regression, 200 features")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
