"""Exact reversal (`jr.reversible(f, exact=True)`) against `jax.grad`, the default and the fully
reversible mode, on loops that drift when run backwards and on reversible networks.

Families (each differentiated four ways in one process):
- SGD with momentum, hypergradients through 10^4 steps (`examples/hypergradients.py`: optax's
  `sgd(lr, momentum)` in `lax.fori_loop`; d validation loss / d (lr, momentum)), momentum 0.9
  and 0.5, float64 and float32 parameters: running it backwards divides by the momentum each
  step, so the fully reversible gradient is garbage there (3e72, NaN), the default recomputes
  its segments, and exact reversal holds it in fixed point with the bits momentum destroys in
  its information buffer;
- the same training on a 3-layer MLP (6 parameter leaves: the buffer's pushes and pops for all
  leaves are batched), 2 000 steps;
- a float32 leapfrog of 10 masses with anharmonic springs through 10^4 steps (additive:
  nothing to keep; the fixed point holds the positions and momenta more finely than float32),
  against the float64 gradient;
- a RevNet of 64 additive-coupling blocks scanned over stacked weights, in bfloat16 (error
  against the float32 gradient, where `jax.grad`'s own bfloat16 rounding is the yardstick);
- a reversible GRU (MacKay et al. 2018) in float32 over 200 steps: a gate per element and step
  multiplies each half (held as n / 2**k, its lost bits in the buffer).

Reported: run time (median of interleaved calls, one XLA thread), XLA's planned scratch
memory (`compile().memory_analysis()`), the first call (trace, compile, run), the gradient's
relative error against the reference (`jax.grad` in float64, or float32 for the RevNet), and
Writes results/exact_reversal.{json,md,png} (--quick: exact_reversal_quick.*).

    python benchmarks/exact_reversal.py          # every family (about 2-3 minutes)
    python benchmarks/exact_reversal.py --quick  # shorter loops (2 000 training steps)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

jax.config.update("jax_enable_x64", True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import hypergradients as hg  # noqa: E402
from _common import (  # noqa: E402
    device_info,
    interleaved_medians,
    progress,
    pyplot,
    write_results,
)
from programs.gru import WEIGHTS, reversible_gru  # noqa: E402

import jaxrev as jr  # noqa: E402

METHODS = ("jax.grad", "fully reversible", "default", "exact")
WRAP: dict[str, Callable[[Callable], Callable]] = {
    "jax.grad": lambda f: f,
    "fully reversible": lambda f: jr.reversible(f, checkpoint_every=None, on_drift="ignore"),
    "default": jr.reversible,
    "exact": lambda f: jr.reversible(f, exact=True),
}


@dataclass(frozen=True)
class Case:
    """`program(wrap) -> (loss, args, reference)`: `loss(*args)` a scalar whose loop is
    `wrap(f)`; gradients are taken with respect to `args[0]`; `reference()` is the gradient
    errors are measured against."""

    name: str
    steps: int
    program: Callable[[Callable], tuple[Callable, tuple, Callable[[], Any]]]


# ------------------------------------------------------------------ the families


def momentum_sgd(steps: int, momentum: float, dtype: str) -> Callable:
    def program(wrap: Callable) -> tuple[Callable, tuple, Callable[[], Any]]:
        dt = jnp.dtype(dtype)
        data = hg.make_data(dt)
        val = hg.validation(wrap(hg.trainer(steps)), data)
        hyper = (jnp.asarray(0.05, dt), jnp.asarray(momentum, dt))
        data64 = hg.make_data(jnp.float64)
        hyper64 = (jnp.asarray(0.05), jnp.asarray(momentum))
        ref = lambda: jax.jit(jax.grad(hg.validation(hg.trainer(steps), data64)))(hyper64)
        return val, (hyper,), ref

    return program


def mlp_sgd(steps: int) -> Callable:
    """optax SGD with momentum 0.9 on a 16-32-32-1 MLP (6 parameter leaves)."""

    def program(wrap: Callable) -> tuple[Callable, tuple, Callable[[], Any]]:
        X, y, Xv, yv = hg.make_data(jnp.float64)
        sizes = (16, 32, 32, 1)
        keys = jax.random.split(jax.random.PRNGKey(1), len(sizes))
        w0 = [
            {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:])
        ]

        def model(w, X):
            for layer in w[:-1]:
                X = jnp.tanh(X @ layer["w"] + layer["b"])
            return (X @ w[-1]["w"] + w[-1]["b"])[..., 0]

        def train(state, hyper):
            lr, mom = hyper
            opt = optax.sgd(learning_rate=lr, momentum=mom)

            def step(i, state):
                w, s = state
                b = i % X.shape[0]
                g = jax.grad(lambda w: jnp.mean((model(w, X[b]) - y[b]) ** 2))(w)
                upd, s = opt.update(g, s, w)
                return optax.apply_updates(w, upd), s

            return lax.fori_loop(0, steps, step, state)

        def val(hyper, train=train):
            opt = optax.sgd(learning_rate=0.1, momentum=0.9)
            w, _ = train((w0, opt.init(w0)), hyper)
            return jnp.mean((model(w, Xv) - yv) ** 2)

        wrapped = wrap(train)
        hyper = (jnp.asarray(0.02), jnp.asarray(0.9))
        return (
            lambda h: val(h, wrapped),
            (hyper,),
            lambda: jax.jit(jax.grad(val))(hyper),
        )

    return program


def leapfrog(steps: int) -> Callable:
    """A float32 leapfrog of a chain of 10 unit masses with springs k x + x^3 (fixed ends),
    d energy-like loss / d k; the reference is the same program in float64."""

    def program(wrap: Callable) -> tuple[Callable, tuple, Callable[[], Any]]:
        dt = 0.01

        def force(q, k):
            ext = jnp.concatenate([jnp.zeros(1, q.dtype), q, jnp.zeros(1, q.dtype)])
            stretch = ext[1:] - ext[:-1]
            tension = k * stretch + stretch**3
            return tension[1:] - tension[:-1]

        def run(state, k):
            def kdk(_, s):
                q, p = s
                p = p + 0.5 * dt * force(q, k)
                q = q + dt * p
                return q, p + 0.5 * dt * force(q, k)

            return lax.fori_loop(0, steps, kdk, state)

        def loss(k, run, q0):
            q, p = run((q0, jnp.zeros_like(q0)), k)
            return jnp.sum(q**2) + 0.5 * jnp.sum(p**2)

        q0 = 0.3 * jnp.sin(jnp.arange(1.0, 11.0))
        wrapped = wrap(run)
        k32 = jnp.asarray(1.5, jnp.float32)
        ref = lambda: jax.jit(jax.grad(loss), static_argnums=1)(jnp.asarray(1.5), run, q0)
        return lambda k: loss(k, wrapped, q0.astype(jnp.float32)), (k32,), ref

    return program


def revnet(blocks: int) -> Callable:
    """64 additive-coupling blocks over a 256 x 64 batch (two streams), scanned over stacked
    weights, in bfloat16; the reference is float32 `jax.grad`."""

    def program(wrap: Callable) -> tuple[Callable, tuple, Callable[[], Any]]:
        def net(x, W):
            def block(c, w):
                a, b = c
                a = a + jnp.tanh(b @ w[0]) @ w[1]
                b = b + jnp.tanh(a @ w[2]) @ w[3]
                return (a, b), None

            return lax.scan(block, x, W)[0]

        rng = np.random.default_rng(0)
        x = tuple(jnp.asarray(rng.standard_normal((256, 64)), jnp.bfloat16) for _ in range(2))
        W = jnp.asarray(0.1 * rng.standard_normal((blocks, 4, 64, 64)) / 8, jnp.bfloat16)

        def loss(W, net, x):
            a, b = net(x, W)
            return jnp.sum(a.astype(jnp.float32) ** 2) + jnp.sum(jnp.sin(b.astype(jnp.float32)))

        wrapped = wrap(net)
        x32 = tuple(a.astype(jnp.float32) for a in x)
        ref = lambda: jax.jit(jax.grad(loss), static_argnums=1)(W.astype(jnp.float32), net, x32)
        return lambda W: loss(W, wrapped, x), (W,), ref

    return program


def gru(steps: int) -> Callable:
    """A reversible GRU (MacKay et al. 2018) over `steps` steps, batch 32, two halves of 64
    units, inputs of 16, float32: each half's update ``z * h + (1 - z) * tanh(...)`` with a gate
    z in [0.5, 1] from the other half (a factor per element and step); d loss / d weights,
    the reference the same program in float64."""

    def program(wrap: Callable) -> tuple[Callable, tuple, Callable[[], Any]]:
        B, H, D = 32, 64, 16
        rng = np.random.default_rng(1)
        P = {k: 0.3 * rng.standard_normal((H + D, H)) for k in WEIGHTS}
        xs = rng.standard_normal((steps, B, D))
        net = reversible_gru

        def loss(P, net, xs):
            dt = xs.dtype
            h = (jnp.full((B, H), 0.1, dt), jnp.full((B, H), -0.1, dt))
            a, b = net(h, P, xs)
            return jnp.sum(jnp.sin(a)) + jnp.sum(b**2)

        wrapped = wrap(net)
        P32 = {k: jnp.asarray(v, jnp.float32) for k, v in P.items()}
        xs32 = jnp.asarray(xs, jnp.float32)
        P64 = {k: jnp.asarray(v, jnp.float64) for k, v in P.items()}
        ref = lambda: jax.jit(jax.grad(loss), static_argnums=1)(P64, net, jnp.asarray(xs))
        return lambda P: loss(P, wrapped, xs32), (P32,), ref

    return program


def cases(quick: bool) -> list[Case]:
    T = 2_000 if quick else 10_000
    return [
        Case("SGD momentum 0.9, float64", T, momentum_sgd(T, 0.9, "float64")),
        Case("SGD momentum 0.5, float64", T, momentum_sgd(T, 0.5, "float64")),
        Case("SGD momentum 0.9, float32", T, momentum_sgd(T, 0.9, "float32")),
        Case("SGD momentum 0.9, MLP (6 leaves)", 2_000, mlp_sgd(2_000)),
        Case("leapfrog, 10 masses, float32", T, leapfrog(T)),
        Case("RevNet 64 blocks, bfloat16", 64, revnet(64)),
        Case("reversible GRU, float32 gates", 200, gru(200)),
    ]


# ------------------------------------------------------------------ measuring


def rel_error(ref: Any, got: Any) -> float:
    """max over leaves of max|got − ref| / max|ref| (inf where not finite)."""
    out = 0.0
    for r, g in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        scale = max(float(np.max(np.abs(r))), np.finfo(np.float64).tiny)
        err = float(np.max(np.abs(g - r))) / scale if r.size else 0.0
        out = max(out, err if np.isfinite(err) else float("inf"))
    return out


def measure(case: Case, reps: int) -> dict:
    row: dict[str, Any] = {"case": case.name, "steps": case.steps}
    calls, grads, ref = {}, {}, None
    for method in METHODS:
        loss, args, reference = case.program(WRAP[method])
        ref = ref if ref is not None else jax.block_until_ready(reference())
        grad = jax.jit(jax.grad(loss))
        t0 = time.perf_counter()
        grads[method] = jax.block_until_ready(grad(*args))
        row.setdefault("first_call_s", {})[method] = time.perf_counter() - t0
        compiled = grad.lower(*args).compile()
        row.setdefault("memory_mb", {})[method] = (
            compiled.memory_analysis().temp_size_in_bytes / 1e6
        )
        calls[method] = lambda grad=grad, args=args: grad(*args)
    row["time_ms"] = {k: v * 1e3 for k, v in interleaved_medians(calls, reps=reps).items()}
    row["error"] = {m: rel_error(ref, grads[m]) for m in METHODS}
    t, m, f = row["time_ms"], row["memory_mb"], row["first_call_s"]
    row["ratios"] = {
        "time exact/jax.grad": t["exact"] / t["jax.grad"],
        "time exact/default": t["exact"] / t["default"],
        "memory exact/jax.grad": m["exact"] / max(m["jax.grad"], 1e-9),
        "memory exact/fully reversible": m["exact"] / max(m["fully reversible"], 1e-9),
        "first call exact/jax.grad": f["exact"] / f["jax.grad"],
    }
    return row


def table(rows: list[dict]) -> str:
    head = (
        "# Exact reversal: `jr.reversible(f, exact=True)`\n\n"
        "Gradients of each loop four ways: `jax.grad`, the fully reversible mode "
        '(`checkpoint_every=None, on_drift="ignore"`), `jr.reversible` with its defaults '
        "(checkpoints, drift repaired by recomputation) and exact reversal. Errors are "
        "relative to `jax.grad` in float64 (the RevNet's: float32). (The coupled scan of "
        "`defaults_cost.py` is left out: it is chaotic, and a 1e-15 relative change of its "
        "input moves `jax.grad`'s own gradient, about 5e66, by a factor 2e7, so no method can "
        "be compared with it.)\n\n"
        "| case | T | time ms: jax.grad / fully rev. / default / exact | exact ÷ jax.grad | "
        "memory MB: jax.grad / fully rev. / default / exact | exact ÷ jax.grad memory | "
        "first call s: jax.grad / default / exact | error: jax.grad / fully rev. / default "
        "/ exact |\n|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        t, m, f, e, q = r["time_ms"], r["memory_mb"], r["first_call_s"], r["error"], r["ratios"]
        lines.append(
            f"| {r['case']} | {r['steps']:,} | "
            + " / ".join(f"{t[k]:.1f}" for k in METHODS)
            + f" | {q['time exact/jax.grad']:.2f} | "
            + " / ".join(f"{m[k]:.3f}" for k in METHODS)
            + f" | {q['memory exact/jax.grad']:.4f} | "
            f"{f['jax.grad']:.2f} / {f['default']:.2f} / {f['exact']:.2f} | "
            + " / ".join(f"{e[k]:.1e}" for k in METHODS)
            + " |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    labels = [r["case"] for r in rows]
    x = np.arange(len(rows))
    width = 0.2
    for k, (key, title, scale) in enumerate(
        (
            ("time_ms", "time ÷ jax.grad's", "log"),
            ("memory_mb", "memory ÷ jax.grad's", "log"),
            ("error", "gradient error", "log"),
        )
    ):
        for i, method in enumerate(METHODS):
            if key == "error":
                vals = [max(r[key][method], 1e-17) for r in rows]
            else:
                vals = [r[key][method] / max(r[key]["jax.grad"], 1e-12) for r in rows]
            vals = [min(v, 1e3) for v in vals]
            ax[k].bar(x + (i - 1.5) * width, vals, width, label=method)
        ax[k].set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax[k].set(title=title, yscale=scale)
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 000 training steps")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    todo = cases(args.quick)
    rows = [measure(c, args.reps) for c in progress(todo, desc="exact_reversal", unit="case")]
    text = table(rows)
    print(text)
    name = "exact_reversal_quick" if args.quick else "exact_reversal"
    jpath, mpath = write_results(name, {"device": device_info(), "rows": rows}, text)
    plot(rows, jpath[: -len(".json")] + ".png")
    print(f"wrote {jpath}, {mpath}")


if __name__ == "__main__":
    main()
