"""What `jr.reversible`'s defaults cost, against its fully reversible mode and `jax.grad`.

Each family is a loop differentiated three ways in one process. The figures reported are
`jr.reversible(f)`'s with the defaults a user gets (drift checked per segment, a segment that
misses recomputed: the "default" columns and every ratio); the two peers are `jax.grad` of the
plain program and the opt-in fully reversible mode, `jr.reversible(f, checkpoint_every=None,
on_drift="ignore")` (no checkpoints, nothing checked: what the default's repair costs is
measured against it, it is not a setting users get by default). Loops that do not drift:
- the NiLang sparse-dot merge (`examples/sparse_dot.py`): a scan of scalar bodies, 10^4-10^6
  steps, the branch kept with `jr.store`;
- a leapfrog chain of 4 masses with quartic springs (symplectic, float64), 10^4 and 10^5 steps;
- a stack of additive-coupling MLP blocks scanned over stacked weights (2 x 128 x 64 float64
  streams), 48 blocks.
Loops that drift (the fully reversible gradient is wrong there; the default must equal
`jax.grad`'s):
- SGD with momentum 0.9 (`examples/hypergradients.py`, optax), hypergradients through 2 000 steps;
- the coupled scan ``x += tanh(0.9 y); y += sin(1.1 x)`` on a 2 x 20 000 state, 1 000 steps.

Reported per family and length: run time (median of interleaved calls, one XLA thread), XLA's
planned scratch memory (`compile().memory_analysis()`), the first call's time (trace, compile
and run: each method is a new function), the gradient's relative error against `jax.grad`'s,
and what the default repaired (`jr.reversible(..., report=)`: segments recomputed of all, and
the share of the loop's iterations they hold, the extra forward work).
Writes results/defaults_cost.{json,md,png}.

    python benchmarks/defaults_cost.py          # every family and length (about 1-4 minutes)
    python benchmarks/defaults_cost.py --quick  # the shortest length of each family
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
from jax import lax  # noqa: E402

jax.config.update("jax_enable_x64", True)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import hypergradients as hg  # noqa: E402
import sparse_dot as sd  # noqa: E402
from _common import (  # noqa: E402
    device_info,
    interleaved_medians,
    progress,
    pyplot,
    write_results,
)

import jaxrev as jr  # noqa: E402

METHODS = ("jax.grad", "fully reversible", "default")
WRAP: dict[str, Callable[[Callable], Callable]] = {
    "jax.grad": lambda f: f,
    "fully reversible": lambda f: jr.reversible(f, checkpoint_every=None, on_drift="ignore"),
    "default": jr.reversible,
}


@dataclass(frozen=True)
class Family:
    """A loop `program(wrap, size) -> (loss, args)`: `loss(*args)` a scalar whose loop is
    `wrap(f)`; the gradient is taken with respect to every argument in `grad_args`."""

    name: str
    drifts: bool  # whether its fully reversible gradient drifts (the default must repair)
    sizes: tuple[int, ...]  # loop lengths
    program: Callable[[Callable, int], tuple[Callable, tuple]]
    grad_args: tuple[int, ...]


# ------------------------------------------------------------------ the families


def sparse_dot(wrap: Callable, steps: int) -> tuple[Callable, tuple]:
    n = int(round(np.sqrt(steps / 2 / sd.DENSITY)))
    rng = np.random.default_rng(0)
    A, B = sd.random_bcoo(rng, n), sd.random_bcoo(rng, n)
    merge = wrap(sd.merge_dot)

    def loss(a, al, b, bl):
        zero = jnp.zeros((), jnp.int32)
        return merge((zero, zero, jnp.zeros((), a.dtype)), a, al, b, bl)[2]

    return loss, (A.data, sd.linear_index(A), B.data, sd.linear_index(B))


def leapfrog(wrap: Callable, steps: int) -> tuple[Callable, tuple]:
    dt = 0.01

    def force(q, k):  # a chain of 4 unit masses, fixed ends, springs k x + x^3
        ext = jnp.concatenate([jnp.zeros(1), q, jnp.zeros(1)])
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

    integrate = wrap(run)

    def loss(q0, p0, k):
        q, p = integrate((q0, p0), k)
        return jnp.sum(q**2) + 0.5 * jnp.sum(p**2)

    return loss, (jnp.array([0.3, -0.1, 0.2, 0.05]), jnp.zeros(4), jnp.asarray(1.5))


def coupling_stack(wrap: Callable, blocks: int) -> tuple[Callable, tuple]:
    width, hidden, batch = 64, 64, 128
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    scale = 0.5 / np.sqrt(width)
    W = {
        "f1": scale * jax.random.normal(keys[0], (blocks, width, hidden)),
        "f2": scale * jax.random.normal(keys[1], (blocks, hidden, width)),
        "g1": scale * jax.random.normal(keys[2], (blocks, width, hidden)),
        "g2": scale * jax.random.normal(keys[3], (blocks, hidden, width)),
    }
    x = jax.random.normal(keys[4], (2, batch, width))

    def net(x, W):
        def block(c, w):
            x1, x2 = c
            x1 = x1 + jnp.tanh(x2 @ w["f1"]) @ w["f2"]
            x2 = x2 + jnp.tanh(x1 @ w["g1"]) @ w["g2"]
            return (x1, x2), None

        return lax.scan(block, (x[0], x[1]), W)[0]

    stack = wrap(net)

    def loss(x, W):
        x1, x2 = stack(x, W)
        return jnp.mean(x1**2) + jnp.mean(jnp.sin(x2))

    return loss, (x, W)


def momentum_sgd(wrap: Callable, steps: int) -> tuple[Callable, tuple]:
    data = hg.make_data(jnp.float64)
    train = wrap(hg.trainer(steps))
    val = hg.validation(train, data)
    return val, ((jnp.asarray(0.1), jnp.asarray(0.9)),)


def coupled_scan(wrap: Callable, steps: int) -> tuple[Callable, tuple]:
    def run(c, th):
        def step(c, _):
            x, y = c
            x = x + jnp.tanh(th[0] * y)
            return (x, y + jnp.sin(th[1] * x)), None

        return lax.scan(step, c, None, length=steps)[0]

    loop = wrap(run)

    def loss(c, th):
        x, y = loop(c, th)
        return jnp.sum(x**2) + jnp.sum(y)

    rng = np.random.default_rng(0)
    c = (jnp.asarray(rng.standard_normal(20_000)), jnp.asarray(rng.standard_normal(20_000)))
    return loss, (c, jnp.array([0.9, 1.1]))


FAMILIES = (
    Family("sparse-dot merge", False, (10_000, 100_000, 1_000_000), sparse_dot, (0, 2)),
    Family("leapfrog chain", False, (10_000, 100_000), leapfrog, (0, 1, 2)),
    Family("coupling stack", False, (48,), coupling_stack, (0, 1)),
    Family("momentum SGD 0.9", True, (2_000,), momentum_sgd, (0,)),
    Family("coupled scan", True, (1_000,), coupled_scan, (0, 1)),
)


# ------------------------------------------------------------------ measuring


def rel_error(ref: Any, got: Any) -> float:
    """max over leaves of max|got − ref| / max|ref|."""
    out = 0.0
    for r, g in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(got)):
        r, g = np.asarray(r, np.float64), np.asarray(g, np.float64)
        scale = max(float(np.max(np.abs(r))), np.finfo(np.float64).tiny)
        err = float(np.max(np.abs(g - r))) / scale if r.size else 0.0
        out = max(out, err if np.isfinite(err) else float("inf"))
    return out


def measure(family: Family, size: int, reps: int) -> dict:
    """One family at one length: every method's time, memory, first call and error."""
    row: dict[str, Any] = {"family": family.name, "size": size, "drifts": family.drifts}
    calls, grads = {}, {}
    for method in METHODS:
        loss, args = family.program(WRAP[method], size)
        grad = jax.jit(jax.grad(loss, argnums=family.grad_args))
        t0 = time.perf_counter()
        grads[method] = jax.block_until_ready(grad(*args))
        first = time.perf_counter() - t0
        compiled = grad.lower(*args).compile()
        row.setdefault("memory_mb", {})[method] = (
            compiled.memory_analysis().temp_size_in_bytes / 1e6
        )
        row.setdefault("first_call_s", {})[method] = first
        # timed as users call it: the jitted function (JAX's C++ dispatch), not the
        # `Compiled` object, whose Python call path adds tokens to every call of a program
        # that holds a host callback (the default's drift check: 0.24 against 0.20 ms here)
        calls[method] = lambda grad=grad, args=args: grad(*args)
    # sub-millisecond calls get more interleaved rounds (a median of 7 calls of 0.2 ms moves
    # by a third between runs on a shared machine): about 0.3 s of calls per method at least
    t0 = time.perf_counter()
    jax.block_until_ready(calls["default"]())
    once = time.perf_counter() - t0
    rounds = max(reps, min(400, int(0.3 / max(once, 1e-5))))
    row["time_ms"] = {k: v * 1e3 for k, v in interleaved_medians(calls, reps=rounds).items()}
    row["error"] = {m: rel_error(grads["jax.grad"], grads[m]) for m in METHODS[1:]}
    # what the default repaired, as its report says (a separate call: `report` stages a
    # host callback the timed calls do not have)
    seen: list = []
    loss, args = family.program(lambda f: jr.reversible(f, report=seen.append), size)
    jax.block_until_ready(jax.jit(jax.grad(loss, argnums=family.grad_args))(*args))
    loops = seen[-1].loops if seen else ()
    row["repaired"] = {
        "segments": sum(loop.segments for loop in loops),
        "repaired": sum(int(loop.repaired) for loop in loops),
        "recomputed share": sum(int(loop.recomputed) for loop in loops)
        / max(1, sum(loop.iterations for loop in loops)),
    }
    t, m, f = row["time_ms"], row["memory_mb"], row["first_call_s"]
    row["ratios"] = {
        "time default/fully reversible": t["default"] / t["fully reversible"],
        "time default/jax.grad": t["default"] / t["jax.grad"],
        "memory default/fully reversible": m["default"] / max(m["fully reversible"], 1e-9),
        "memory default/jax.grad": m["default"] / max(m["jax.grad"], 1e-9),
        "first call default/jax.grad": f["default"] / f["jax.grad"],
    }
    return row


def table(rows: list[dict]) -> str:
    head = (
        "# What `jr.reversible`'s defaults cost\n\n"
        'Every figure in the "default" columns and every ratio is `jr.reversible(f)` as a '
        "user gets it (drift checked per segment, a segment that misses recomputed). The "
        'fully reversible mode (`checkpoint_every=None, on_drift="ignore"`: nothing stored, '
        "nothing checked) is opt-in and a peer here, as `jax.grad` is: what the default's "
        "checks and repairs cost is measured against it.\n\n"
        "| family | T | time ms: jax.grad / fully rev. / default | default ÷ fully rev. | "
        "default ÷ jax.grad | memory MB: jax.grad / fully rev. / default | "
        "first call s: jax.grad / default | error vs jax.grad: fully rev. / default | "
        "default's repairs: segments (iterations recomputed) |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        t, m, f, e, q = r["time_ms"], r["memory_mb"], r["first_call_s"], r["error"], r["ratios"]
        fixed = r["repaired"]
        lines.append(
            f"| {r['family']}{' (drifts)' if r['drifts'] else ''} | {r['size']:,} | "
            f"{t['jax.grad']:.2f} / {t['fully reversible']:.2f} / {t['default']:.2f} | "
            f"{q['time default/fully reversible']:.2f} | {q['time default/jax.grad']:.2f} | "
            f"{m['jax.grad']:.3f} / {m['fully reversible']:.3f} / {m['default']:.3f} | "
            f"{f['jax.grad']:.2f} / {f['default']:.2f} | "
            f"{e['fully reversible']:.1e} / {e['default']:.1e} | "
            f"{fixed['repaired']} of {fixed['segments']} ({100 * fixed['recomputed share']:.0f}%) |"
        )
    return head + "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['family']}\nT={r['size']:,}" for r in rows]
    x = np.arange(len(rows))
    for k, (key, title) in enumerate(
        (("time default/fully reversible", "time"), ("memory default/fully reversible", "memory"))
    ):
        ax[k].bar(x, [r["ratios"][key] for r in rows], color="tab:blue", label="÷ fully rev.")
        jkey = key.replace("fully reversible", "jax.grad")
        ax[k].plot(x, [r["ratios"][jkey] for r in rows], "ko", label="÷ jax.grad")
        ax[k].axhline(1.0, color="gray", lw=0.8)
        ax[k].set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
        ax[k].set(title=f"default's {title}", yscale="log")
        ax[k].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the shortest length of each family")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    cases = [(f, s) for f in FAMILIES for s in (f.sizes[:1] if args.quick else f.sizes)]
    rows = [measure(f, s, args.reps) for f, s in progress(cases, desc="defaults_cost", unit="case")]
    text = table(rows)
    print(text)
    data = {"device": device_info(), "rows": rows}
    jpath, mpath = write_results("defaults_cost", data, text)
    plot(rows, jpath[: -len(".json")] + ".png")
    print(f"wrote {jpath}, {mpath}")


if __name__ == "__main__":
    main()
