"""Tracing cost of spline coupling chains under `jit` (issue 33), against the number of layers.

Two families, each a chain of n rational-quadratic spline coupling layers on dimension 8 in
float64, with the defaults a user gets:

- "flowjax": flowjax's own `Chain` of `Coupling(transformer=RationalQuadraticSpline(knots=8,
  interval=4))` layers with MLP conditioners, closed over as flowjax users write
  ``lambda x: chain.transform(x)``; `jr.forward_and_slogdet` under `jit` (flowjax's spline
  clips its output, which the walker refuses to invert: `tests/test_library_bijections.py`);
- "searchsorted": the spline written as distrax writes it (the bin by `searchsorted`, its knots
  by indexing, softmax widths and softplus slopes from an MLP conditioner, a reversal between
  layers), parameters passed as arguments; `jr.forward_and_slogdet` and `jr.inverse_and_slogdet`
  under `jit`.

For n in 1, 2, 3, 4, 6, 8 it measures the seconds of the first jitted call (tracing, jaxrev's
walks and XLA's compilation: what a user waits for) and of tracing alone (`jax.make_jaxpr`),
medians of two, and checks each result against flowjax's log-det or a dense
`jnp.linalg.slogdet` of `jax.jacfwd` (float64). The slope of log(seconds) against log(n) is
fitted from n = 2 (1: linear). Writes results/spline_chain.{json,md,png}.

    python benchmarks/spline_chain.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import RESULTS, device_info, progress, pyplot, write_results  # noqa: E402

import jaxrev as jr  # noqa: E402

D, KNOTS, BOUND, WIDTH = 8, 8, 4.0, 32
LIMIT_S = 10.0  # issue 33: three layers under jit in under 10 s
REPEATS = 2


def searchsorted_spline(x, raw):
    """One element's spline on [-B, B] (identity outside), from its unconstrained parameters."""
    w = jax.nn.softmax(raw[:KNOTS]) * 2 * BOUND
    h = jax.nn.softmax(raw[KNOTS : 2 * KNOTS]) * 2 * BOUND
    d = jnp.concatenate(
        [jnp.ones(1), jax.nn.softplus(raw[2 * KNOTS : 3 * KNOTS - 1]) + 1e-3, jnp.ones(1)]
    )
    xk = jnp.concatenate([jnp.full(1, -BOUND), -BOUND + jnp.cumsum(w)])
    yk = jnp.concatenate([jnp.full(1, -BOUND), -BOUND + jnp.cumsum(h)])
    inside = (x > -BOUND) & (x < BOUND)
    k = jnp.clip(jnp.searchsorted(xk, x, side="right") - 1, 0, KNOTS - 1)
    x0, x1, y0, y1, d0, d1 = xk[k], xk[k + 1], yk[k], yk[k + 1], d[k], d[k + 1]
    s = (y1 - y0) / (x1 - x0)
    z = (x - x0) / (x1 - x0)
    num = (y1 - y0) * (s * z * z + d0 * z * (1 - z))
    den = s + (d1 + d0 - 2 * s) * z * (1 - z)
    return jnp.where(inside, y0 + num / den, x)


def searchsorted_chain(x, params):
    h = D // 2
    for p in params:
        a, b = x[:h], x[h:]
        hid = jnp.tanh(p["W1"] @ a + p["b1"])
        raw = (p["W2"] @ hid + p["b2"]).reshape(h, 3 * KNOTS - 1)
        x = jnp.concatenate([jax.vmap(searchsorted_spline)(b, raw), a])[::-1]
    return x


def searchsorted_params(n):
    out = []
    for k in jax.random.split(jax.random.key(0), n):
        k1, k2 = jax.random.split(k)
        out.append(
            {
                "W1": 0.3 * jax.random.normal(k1, (WIDTH, D // 2)),
                "b1": jnp.zeros(WIDTH),
                "W2": 0.1 * jax.random.normal(k2, (D // 2 * (3 * KNOTS - 1), WIDTH)),
                "b2": jnp.zeros(D // 2 * (3 * KNOTS - 1)),
            }
        )
    return out


def flowjax_chain(n):
    import flowjax.bijections as fb

    return fb.Chain(
        [
            fb.Coupling(
                k,
                transformer=fb.RationalQuadraticSpline(knots=KNOTS, interval=BOUND),
                untransformed_dim=D // 2,
                dim=D,
                nn_width=WIDTH,
                nn_depth=1,
            )
            for k in jax.random.split(jax.random.key(1), n)
        ]
    )


def _timed(make_call, trace):
    first, traced = [], []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = jax.block_until_ready(make_call())
        first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        trace()
        traced.append(time.perf_counter() - t0)
    return out, float(np.median(first)), float(np.median(traced))


def measure(n: int) -> list[dict]:
    x = 1.5 * jax.random.normal(jax.random.key(2), (D,))
    rows = []
    ch = flowjax_chain(n)
    f = lambda x: ch.transform(x)  # noqa: E731
    # a fresh jit per call: each first call traces and compiles again
    (_, ld), first, traced = _timed(
        lambda: jax.jit(jr.forward_and_slogdet(f))(x),
        lambda: jax.make_jaxpr(jr.forward_and_slogdet(f))(x),
    )
    rows.append(
        {
            "family": "flowjax",
            "transform": "forward_and_slogdet",
            "n": n,
            "first call s": first,
            "trace s": traced,
            "err": abs(float(ld - ch.transform_and_log_det(x)[1])),
        }
    )
    ps = searchsorted_params(n)
    ref = float(jnp.linalg.slogdet(jax.jacfwd(searchsorted_chain)(x, ps))[1])
    (_, ld), first, traced = _timed(
        lambda: jax.jit(jr.forward_and_slogdet(searchsorted_chain))(x, ps),
        lambda: jax.make_jaxpr(jr.forward_and_slogdet(searchsorted_chain))(x, ps),
    )
    rows.append(
        {
            "family": "searchsorted",
            "transform": "forward_and_slogdet",
            "n": n,
            "first call s": first,
            "trace s": traced,
            "err": abs(float(ld) - ref),
        }
    )
    y = searchsorted_chain(x, ps)
    (xi, ld), first, traced = _timed(
        lambda: jax.jit(jr.inverse_and_slogdet(searchsorted_chain))(y, ps),
        lambda: jax.make_jaxpr(jr.inverse_and_slogdet(searchsorted_chain))(y, ps),
    )
    rows.append(
        {
            "family": "searchsorted",
            "transform": "inverse_and_slogdet",
            "n": n,
            "first call s": first,
            "trace s": traced,
            "err": max(abs(float(ld) + ref), float(jnp.max(jnp.abs(xi - x)))),
        }
    )
    return rows


def slope(xs, ys) -> float:
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="n up to 3")
    args = ap.parse_args(argv)
    ns = [1, 2, 3] if args.quick else [1, 2, 3, 4, 6, 8]
    measure(1)  # warm-up: first-time imports and compilations
    rows = [r for n in progress(ns, desc="layers") for r in measure(n)]
    keys = sorted({(r["family"], r["transform"]) for r in rows})
    fits = {
        f"{f} {t}": slope(
            [r["n"] for r in rows if (r["family"], r["transform"]) == (f, t) and r["n"] >= 2],
            [
                r["first call s"]
                for r in rows
                if (r["family"], r["transform"]) == (f, t) and r["n"] >= 2
            ],
        )
        for f, t in keys
    }
    three = {f"{r['family']} {r['transform']}": r["first call s"] for r in rows if r["n"] == 3}
    data = {
        "device": device_info(),
        "ns": ns,
        "rows": rows,
        "log-log slope from n=2": fits,
        "three layers first call s": three,
        "limit s": LIMIT_S,
        "three layers within limit": all(v <= LIMIT_S for v in three.values()),
    }
    table = make_table(data)
    suffix = "_quick" if args.quick else ""
    write_results("spline_chain" + suffix, data, table)
    plot(data, os.path.join(RESULTS, f"spline_chain{suffix}.png"))
    print(table)


def make_table(d) -> str:
    out = [
        f"# Spline coupling chains under jit ({d['device']['backend']}, jax "
        f"{d['device']['jax']}, dimension {D}, {KNOTS} bins, float64)",
        "",
        "Seconds of the first jitted call (trace, jaxrev's walks, XLA compile) and of tracing "
        "alone, against the number of layers; `err` against flowjax's log-det or a dense "
        "slogdet (inverse: also the round trip).",
        "",
        "| family | transform | layers | first call (s) | trace (s) | err |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in d["rows"]:
        out.append(
            f"| {r['family']} | {r['transform']} | {r['n']} | {r['first call s']:.2f} | "
            f"{r['trace s']:.2f} | {r['err']:.1e} |"
        )
    out += [
        "",
        "log-log slope of the first call's seconds against layers, from 2 layers (1 is "
        "linear): " + ", ".join(f"{k} {v:.2f}" for k, v in d["log-log slope from n=2"].items()),
        "",
        f"Three layers within {d['limit s']:.0f} s: {d['three layers within limit']}",
    ]
    return "\n".join(out) + "\n"


def plot(d, path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    keys = sorted({(r["family"], r["transform"]) for r in d["rows"]})
    for f, t in keys:
        rs = [r for r in d["rows"] if (r["family"], r["transform"]) == (f, t)]
        ax.loglog([r["n"] for r in rs], [r["first call s"] for r in rs], "o-", label=f"{f} {t}")
    ax.axhline(d["limit s"], color="grey", ls=":", label="issue 33's limit at 3 layers")
    ax.set(xlabel="layers", ylabel="first jitted call (s)", title="spline chains under jit")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
