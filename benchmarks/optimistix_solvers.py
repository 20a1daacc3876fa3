"""jaxrev's Newton solvers against Optimistix's on large structured problems (issue 45).

Problems, each at n = 1 000 and 10 000, float64 and float32, from fixed starts:

- extended Rosenbrock (n/2 independent pairs) from (-1.2, 1, -1.2, 1, ...): minimisation,
  and least squares on its residuals (10 (x_{2i+1} - x_{2i}^2), 1 - x_{2i});
- chained Rosenbrock (tridiagonal Hessian) from the same start: minimisation;
- diagonal bowl sum_i (0.1 + w_i) x_i^2 from x = 1 (w fixed random): minimisation;
- Bratu's problem -u'' = 3 exp(u) on (0, 1), u = 0 at the ends, finite differences from 0:
  root finding.

Solvers, each with the library's defaults and tolerances chosen for the same accuracy (the
table reports the accuracy each reached, recomputed here: max |grad f| for minimisation and
least squares, max |F| for roots):

- `jr.optim.minimize` (its default trust region), `optx.minimise(...,
  jaxrev.optimistix.NewtonMinimiser)`, Optimistix's `BFGS` (n <= 1 000: it updates an n x n
  inverse Hessian);
- least squares: `jr.optim.least_squares` (Levenberg-Marquardt, its default), and
  `optx.least_squares` with `jaxrev.optimistix.LevenbergMarquardt` and with Optimistix's
  `LevenbergMarquardt` (QR of the dense Jacobian: n <= 1 000);
- roots: `jr.optim.root`, `optx.root_find` with `jaxrev.optimistix.Newton` and with
  Optimistix's `Newton` (LU of the dense Jacobian: n <= 1 000).

Everything is jitted; the first call (trace + compile + one run) is timed beside the run
time, a median of interleaved runs (fewer for slow solvers). One thread for XLA and BLAS.
Writes results/optimistix_solvers.{json,md,png}; ``--quick`` runs n = 1 000 only and writes
results/optimistix_solvers_quick.*.

    python benchmarks/optimistix_solvers.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (  # noqa: E402
    RESULTS,
    device_info,
    interleaved_medians,
    optional,
    progress,
    pyplot,
    write_results,
)

import jaxrev as jr  # noqa: E402

optx = optional("optimistix")
jro = optional("jaxrev.optimistix")

SIZES = (1000, 10_000)
SIZES_QUICK = (1000,)
DTYPES = ("float64", "float32")
DENSE_MAX_N = 1000  # BFGS's n x n inverse Hessian, QR / LU of a dense Jacobian
MAX_STEPS = 100_000
# Optimistix's root rule asks |F| <= atol, which a discretised operator's F (of order 1/h²)
# never meets: its Newton runs to max_steps, a dense LU each, at the rounding it reached in
# a few; jr.optim.root's default maxiter
ROOT_MAX_STEPS = 50
# accuracy targets: what each solver is asked for, in its own convention
GTOL = {"float64": 1e-8, "float32": 1e-3}  # max |grad| (jr.optim.minimize's tol)
STEP_TOL = {"float64": 1e-10, "float32": 1e-5}  # Optimistix's rtol = atol on steps
ROOT_TOL = {"float64": 1e-10, "float32": 2e-5}


def start(n: int, dtype) -> jax.Array:
    return jnp.tile(jnp.array([-1.2, 1.0], dtype), n // 2)


def extended_rosenbrock_residuals(x, args=None):
    a, b = x[0::2], x[1::2]
    return jnp.concatenate([10.0 * (b - a**2), 1.0 - a])


def extended_rosenbrock(x, args=None):
    return jnp.sum(extended_rosenbrock_residuals(x) ** 2)


def chained_rosenbrock(x, args=None):
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def diagonal_bowl(n: int, dtype) -> Callable:
    w = jnp.asarray(np.random.default_rng(0).uniform(0.0, 2.0, n), dtype)
    return lambda x, args=None: jnp.sum((0.1 + w) * x**2)


def bratu(n: int, dtype) -> Callable:
    h = 1.0 / (n + 1)

    def F(u, args=None):
        padded = jnp.pad(u, 1)
        return (2 * u - padded[:-2] - padded[2:]) / h**2 - jnp.asarray(3.0, dtype) * jnp.exp(u)

    return F


def problems(n: int, dtype) -> dict[str, tuple[str, Callable, jax.Array]]:
    """name -> (kind, function, start)."""
    x0 = start(n, dtype)
    return {
        "extended Rosenbrock": ("minimise", extended_rosenbrock, x0),
        "extended Rosenbrock (least squares)": ("lsq", extended_rosenbrock_residuals, x0),
        "chained Rosenbrock": ("minimise", chained_rosenbrock, x0),
        "diagonal bowl": ("minimise", diagonal_bowl(n, dtype), jnp.ones(n, dtype)),
        "Bratu": ("root", bratu(n, dtype), jnp.zeros(n, dtype)),
    }


def solvers(kind: str, fn: Callable, n: int, dt: str) -> dict[str, Callable]:
    """name -> jittable x0 -> (x, steps)."""
    s, g = STEP_TOL[dt], GTOL[dt]
    out: dict[str, Callable] = {}
    # each jaxrev entry twice: as a user calls it (its defaults: its dtype's tolerance and
    # throw=True, a run-time check that raises where it did not converge), and with the
    # tolerance the table asks of every solver and throw=False (Optimistix's solvers are
    # given throw=False too), so that a case short of its tolerance still gets its row
    if kind == "minimise":
        out["jr.optim.minimize (defaults)"] = lambda x0: _jr(jr.optim.minimize(fn, x0))
        out["jr.optim.minimize"] = lambda x0: _jr(jr.optim.minimize(fn, x0, tol=g, throw=False))
        if optx is not None:
            out["optx + jaxrev NewtonMinimiser"] = _optx_min(fn, jro.NewtonMinimiser(s, s))
            if n <= DENSE_MAX_N:
                out["optx BFGS"] = _optx_min(fn, optx.BFGS(s, s))
    elif kind == "lsq":
        out["jr.optim.least_squares (defaults)"] = lambda x0: _jr(jr.optim.least_squares(fn, x0))
        out["jr.optim.least_squares"] = lambda x0: _jr(
            jr.optim.least_squares(fn, x0, tol=g, throw=False)
        )
    if kind == "lsq" and optx is not None:
        out["optx + jaxrev LevenbergMarquardt"] = _optx_lsq(fn, jro.LevenbergMarquardt(s, s))
        if n <= DENSE_MAX_N:
            out["optx LevenbergMarquardt"] = _optx_lsq(fn, optx.LevenbergMarquardt(s, s))
    elif kind == "root":
        r = ROOT_TOL[dt]
        out["jr.optim.root (defaults)"] = lambda x0: _jr(jr.optim.root(fn, x0))
        out["jr.optim.root"] = lambda x0: _jr(jr.optim.root(fn, x0, rtol=r, atol=r, throw=False))
        if optx is not None:
            out["optx + jaxrev Newton"] = _optx_root(fn, jro.Newton(r, r))
            if n <= DENSE_MAX_N:
                out["optx Newton"] = _optx_root(fn, optx.Newton(r, r))
    return out


def _jr(result):
    x, info = result
    return x, info.iterations, info.status == jr.optim.Status.converged


def _optx_min(fn, solver):
    def run(x0):
        sol = optx.minimise(fn, solver, x0, max_steps=MAX_STEPS, throw=False)
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    return run


def _optx_lsq(fn, solver):
    def run(x0):
        sol = optx.least_squares(fn, solver, x0, max_steps=MAX_STEPS, throw=False)
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    return run


def _optx_root(fn, solver):
    def run(x0):
        sol = optx.root_find(fn, solver, x0, max_steps=ROOT_MAX_STEPS, throw=False)
        return sol.value, sol.stats["num_steps"], sol.result == optx.RESULTS.successful

    return run


def accuracy(kind: str, fn: Callable, x: jax.Array) -> float:
    """max |grad f| (minimisation, least squares: of ||r||^2), max |F| (roots), in float64."""
    x = jnp.asarray(x, jnp.float64)
    if kind == "root":
        return float(jnp.max(jnp.abs(fn(x))))
    f = fn if kind == "minimise" else (lambda x: jnp.sum(fn(x) ** 2))
    return float(jnp.max(jnp.abs(jax.grad(f)(x))))


def run_case(n: int, dt: str) -> list[dict]:
    rows = []
    dtype = jnp.dtype(dt)
    for name, (kind, fn, x0) in problems(n, dtype).items():
        fns = solvers(kind, fn, n, dt)
        compiled, first, outs = {}, {}, {}
        for k, f in list(fns.items()):
            t0 = time.perf_counter()
            try:
                # (jr.raise_runtime_errors: a default call that did not converge raises its
                # jr.NotConvergedError, said in the table, as a user's call would)
                with jr.raise_runtime_errors():
                    compiled[k] = jax.jit(f).lower(x0).compile()
                    outs[k] = jax.block_until_ready(compiled[k](x0))
            except Exception as e:  # a solver that cannot run this case: said in the table
                rows.append(dict(problem=name, n=n, dtype=dt, solver=k, error=_reason(e)))
                del fns[k]
                continue
            first[k] = time.perf_counter() - t0
            print(f"  {name}, n = {n}, {dt}: {k} first call {first[k]:.1f} s", flush=True)
        slow = {k for k in fns if first[k] > 20.0}
        times = interleaved_medians(
            {k: (lambda c=compiled[k]: c(x0)) for k in fns if k not in slow}, reps=3
        )
        times.update({k: first[k] for k in slow})  # (one run: compile included, said so)
        for k in fns:
            x, steps, ok = outs[k]
            rows.append(
                dict(
                    problem=name,
                    n=n,
                    dtype=dt,
                    solver=k,
                    steps=int(steps),
                    accuracy=accuracy(kind, fn, x),
                    time_s=times[k],
                    first_call_s=first[k],
                    single_run=k in slow,
                    converged=bool(ok),
                )
            )
    return rows


def _reason(e: Exception) -> str:
    """The first line of an error, for the table."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def make_table(rows: list[dict]) -> str:
    lines = [
        "# jaxrev's Newton solvers against Optimistix's",
        "",
        "Accuracy: max |grad f| (minimisation, least squares) or max |F| (roots) at the "
        "solution, recomputed in float64. Time: median of 3 interleaved runs (a run of over "
        "20 s is timed once, compile included: marked *). First call: trace + compile + one run. "
        "Optimistix's root rule needs |F| <= atol, which Bratu's F (of order 1/h²) never "
        "meets, so its Newton stops at max_steps = 50, at the rounding it reached early. "
        "Optimistix's LevenbergMarquardt raises on float32 problems when float64 is enabled "
        "(its damping parameter is float64), whatever its linear solver. Bratu at "
        "n = 10 000 in float32 is past float32's reach: its Jacobian's condition number "
        "(about n²) times float32's epsilon is of order 10, so F stalls at its rounding "
        "(max |F| about 7, F being of order 1/h² = 10⁸) with a Newton step still above "
        "the tolerance, and `jr.optim.root` says it did not converge (`throw=False` here). "
        "Rows marked (defaults) call jaxrev as a user does: its dtype's tolerances and "
        "`throw=True` (a run-time check that raises `jr.NotConvergedError` where a solve falls "
        "short, as on that case); the other jaxrev rows share the tolerance asked of every "
        "solver, with `throw=False` as Optimistix's are given.",
        "",
        "| problem | n | dtype | solver | says converged | steps | accuracy | time (ms) | "
        "first call (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['problem']} | {r['n']} | {r['dtype']} | {r['solver']} | raises: "
                f"{r['error']} | | | | |"
            )
            continue
        star = "*" if r["single_run"] else ""
        lines.append(
            f"| {r['problem']} | {r['n']} | {r['dtype']} | {r['solver']} | "
            f"{'yes' if r['converged'] else 'no'} | {r['steps']} | "
            f"{r['accuracy']:.1e} | {1e3 * r['time_s']:.3g}{star} | {r['first_call_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    cases = sorted({(r["problem"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(3.2 * len(cases), 3.6), squeeze=False)
    for ax, (prob, dt) in zip(axes[0], cases):
        for solver in sorted({r["solver"] for r in rows if r["problem"] == prob}):
            pts = [
                (r["n"], r["time_s"])
                for r in rows
                if (r["problem"], r["dtype"], r["solver"]) == (prob, dt, solver)
                and "error" not in r
            ]
            if pts:
                ax.loglog(*zip(*pts), "o-", label=solver)
        ax.set(title=f"{prob}\n{dt}", xlabel="n", ylabel="seconds")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    sizes = SIZES_QUICK if args.quick else SIZES
    rows: list[dict] = []
    for n, dt in progress([(n, dt) for n in sizes for dt in DTYPES], desc="optimistix_solvers"):
        rows.extend(run_case(n, dt))
    name = "optimistix_solvers_quick" if args.quick else "optimistix_solvers"
    table = make_table(rows)
    write_results(name, {"device": device_info(), "rows": rows}, table)
    plot(rows, os.path.join(RESULTS, f"{name}.png"))
    print(table)


if __name__ == "__main__":
    main()
