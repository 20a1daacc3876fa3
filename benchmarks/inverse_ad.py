"""Inverse accumulation against jax.jvp, Lineax (LU, GMRES) and dense jacfwd + solve.

Workloads (issue 4):
- single-slot chain, n = 4000: x_i += tanh(w_i x_{i-1}) for i = 1..n-1 in turn (a `scan` over
  the slots that carries the new value of the previous slot), then x = sinh(x). Its inverse is
  parallel: each iteration's incoming carry is the previous iteration's output.
- leapfrog chain of a nonlinear Klein-Gordon lattice, n = 2000 (1000 sites, q and p), 200
  kick-drift-kick steps. Invertible (a symplectic map).
- the single-slot chain written the way NiLang writes it, n = 4000: a `fori_loop` of
  ``x.at[i].add(tanh(w[i] x[i-1]))``, then x = sinh(x). Its inverse is the loop run backwards,
  one element update per iteration (element-level inversion, issue 15); its log-determinant is
  timed too (`jr.slogdet_jacobian`, against dense `slogdet` of jacfwd).
- coupling chain with `.at[1:].add` updates, n = 2000: x.at[1:].add(tanh(w x[:-1])) then an
  elementwise scale, 4 times. Not invertible step by step (each update reads the values it
  shifts), its tangent program is: the "linearize" strategy.

For each: time (median of interleaved runs) of jr.inverse_jvp, jr.inverse_vjp, jax.jvp,
Lineax LU on the materialised Jacobian, Lineax GMRES on `JacobianLinearOperator`, and dense
jacfwd + `jnp.linalg.solve`; relative residuals ||J t - v|| / ||v||. Writes
results/inverse_ad.{json,md,png}.

    python benchmarks/inverse_ad.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

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
    write_results,
)

import jaxrev as jr  # noqa: E402

lx = optional("lineax")


def single_slot_chain(n):
    w = jnp.asarray(np.random.default_rng(0).standard_normal(n) * 0.5)

    def f(x):
        def body(prev, xw):  # slot i is pushed by the new value of slot i - 1
            xi, wi = xw
            xi = xi + jnp.tanh(wi * prev)
            return xi, xi

        _, rest = jax.lax.scan(body, x[0], (x[1:], w[1:]))
        return jnp.sinh(jnp.concatenate([x[:1], rest]))

    return f, jnp.asarray(np.random.default_rng(1).standard_normal(n))


def at_add_chain(n):
    w = jnp.asarray(np.random.default_rng(0).standard_normal(n) * 0.5)

    def f(x):
        x = jax.lax.fori_loop(1, n, lambda i, x: x.at[i].add(jnp.tanh(w[i] * x[i - 1])), x)
        return jnp.sinh(x)

    return f, jnp.asarray(np.random.default_rng(1).standard_normal(n))


def klein_gordon(n, steps=200, dt=0.02):
    sites = n // 2

    def force(q):
        lap = jnp.roll(q, 1) + jnp.roll(q, -1) - 2.0 * q
        return lap - q - q**3

    def f(x):
        q, p = x[:sites], x[sites:]

        def body(_, s):
            q, p = s
            p = p + 0.5 * dt * force(q)
            q = q + dt * p
            return q, p + 0.5 * dt * force(q)

        q, p = jax.lax.fori_loop(0, steps, body, (q, p))
        return jnp.concatenate([q, p])

    x0 = jnp.concatenate(
        [jnp.asarray(0.5 * np.sin(np.linspace(0, 6 * np.pi, sites))), jnp.zeros(sites)]
    )
    return f, x0


def coupling_chain(n, layers=4):
    ws = [jnp.asarray(np.random.default_rng(k).standard_normal(n - 1) * 0.5) for k in range(layers)]

    def f(x):
        for w in ws:
            x = x.at[1:].add(jnp.tanh(w * x[:-1]))
            x = x * 1.1 + 0.1 * jnp.sin(x)
        return x

    return f, jnp.asarray(np.random.default_rng(2).standard_normal(n))


def residual(f, x, t, v):
    jt = jax.jvp(f, (x,), (t,))[1]
    return float(jnp.linalg.norm(jt - v) / jnp.linalg.norm(v))


def residual_t(f, x, w, c):
    wj = jax.vjp(f, x)[1](w)[0]
    return float(jnp.linalg.norm(wj - c) / jnp.linalg.norm(c))


def run_workload(name, f, x, dense_ok=True, reps=5, slogdet=False):
    n = x.shape[0]
    v = jnp.asarray(np.random.default_rng(3).standard_normal(n))
    fns = {
        "jax.jvp": jax.jit(lambda x, v: jax.jvp(f, (x,), (v,))[1]),
        "jr.inverse_jvp": jax.jit(lambda x, v: jr.inverse_jvp(f, (x,), v)[1][0]),
        "jr.inverse_vjp": jax.jit(lambda x, v: jr.inverse_vjp(f, x)[1]((v,))),
    }
    if slogdet:
        fns["jr.slogdet_jacobian"] = jax.jit(lambda x, v: jr.slogdet_jacobian(f, x)[1])
        fns["dense slogdet"] = jax.jit(lambda x, v: jnp.linalg.slogdet(jax.jacfwd(f)(x))[1])
    if dense_ok:
        fns["dense jacfwd + solve"] = jax.jit(lambda x, v: jnp.linalg.solve(jax.jacfwd(f)(x), v))
    if lx is not None:
        if dense_ok:
            fns["lineax LU"] = jax.jit(
                lambda x, v: (
                    lx.linear_solve(lx.MatrixLinearOperator(jax.jacfwd(f)(x)), v, lx.LU()).value
                )
            )
        gm = lx.GMRES(rtol=1e-10, atol=1e-10, restart=50, max_steps=4000)
        fns["lineax GMRES"] = jax.jit(
            lambda x, v: (
                lx.linear_solve(
                    lx.JacobianLinearOperator(lambda x, _: f(x), x), v, gm, throw=False
                ).value
            )
        )
    out = {}
    for k, g in fns.items():
        out[k] = g(x, v)
    res = {
        k: (residual_t(f, x, o, v) if k == "jr.inverse_vjp" else residual(f, x, o, v))
        for k, o in out.items()
        if k not in ("jax.jvp", "jr.slogdet_jacobian", "dense slogdet")
    }
    if slogdet:  # the log-determinant's error against the dense one
        ref = out["dense slogdet"]
        res["jr.slogdet_jacobian"] = float(
            abs(out["jr.slogdet_jacobian"] - ref) / max(1.0, abs(float(ref)))
        )
    times = interleaved_medians({k: (lambda g=g: g(x, v)) for k, g in fns.items()}, reps=reps)
    method = "reverse"
    try:
        jax.eval_shape(lambda x, v: jr.inverse_jvp(f, (x,), v, method="reverse"), x, v)
    except jr.NotInvertibleError:
        method = "linearize"
    return {"name": name, "n": n, "times": times, "residuals": res, "strategy": method}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    q = args.quick
    work = [
        ("single-slot chain", *single_slot_chain(400 if q else 4000), False),
        ("single-slot chain, fori_loop of .at[i].add", *at_add_chain(400 if q else 4000), True),
        ("Klein-Gordon leapfrog, 200 steps", *klein_gordon(200 if q else 2000), False),
        ("coupling chain .at[1:].add", *coupling_chain(300 if q else 2000), False),
    ]
    rows = []
    for name, f, x, sld in progress(work, desc="inverse AD workloads"):
        rows.append(run_workload(name, f, x, slogdet=sld))
    data = {"device": device_info(), "rows": rows}
    table = make_table(data)
    suffix = "_quick" if q else ""
    write_results("inverse_ad" + suffix, data, table)
    plot(data, os.path.join(RESULTS, f"inverse_ad{suffix}.png"))
    print(table)


def make_table(d):
    rows = d["rows"]
    names = list(dict.fromkeys(k for r in rows for k in r["times"]))
    out = [
        f"# Inverse accumulation ({d['device']['backend']}, JAX {d['device']['jax']})",
        "",
        "Seconds (median of interleaved runs, jit-compiled); relative residual in brackets.",
        "",
        "| workload | n | strategy | " + " | ".join(names) + " |",
        "|---" * (len(names) + 3) + "|",
    ]
    for r in rows:
        cells = []
        for k in names:
            t = r["times"].get(k)
            res = r["residuals"].get(k)
            cells.append(
                "n/a" if t is None else f"{t:.4f}" + (f" ({res:.1e})" if res is not None else "")
            )
        out.append(f"| {r['name']} | {r['n']} | {r['strategy']} | " + " | ".join(cells) + " |")
    out += [
        "",
        "Ratios (others / jr.inverse_jvp; inverse_vjp / jax.jvp):",
        "",
        "| workload | GMRES / inverse_jvp | dense LU (lineax) / inverse_jvp | "
        "jacfwd+solve / inverse_jvp | inverse_vjp / jvp | inverse_jvp / jvp |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = r["times"]
        ij = t["jr.inverse_jvp"]

        def ratio(k, base=ij):
            return f"{t[k] / base:.1f}" if k in t else "n/a"

        out.append(
            f"| {r['name']} | {ratio('lineax GMRES')} | {ratio('lineax LU')} | "
            f"{ratio('dense jacfwd + solve')} | "
            f"{t['jr.inverse_vjp'] / t['jax.jvp']:.2f} | {ij / t['jax.jvp']:.2f} |"
        )
    return "\n".join(out) + "\n"


def plot(d, path):
    plt = pyplot()
    if plt is None:
        return
    rows = d["rows"]
    names = list(dict.fromkeys(k for r in rows for k in r["times"]))
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(names)
    for j, k in enumerate(names):
        ax.bar(
            [i + j * width for i in range(len(rows))],
            [r["times"].get(k, np.nan) for r in rows],
            width,
            label=k,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['name']}\nn={r['n']}" for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("seconds")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
