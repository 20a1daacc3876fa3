"""Log-determinants of a RealNVP-style flow: jaxrev against distrax, an analytic log-det and
dense `slogdet` of `jacfwd`.

Workload: 4 affine coupling layers on vectors of size n, written as a plain JAX function
``flow(x, params)`` of ONE sample x of shape (n,), the way distrax users write it: layer k has
a fixed boolean mask m_k (a checkerboard on the sqrt(n) x sqrt(n) image for layers 0 and 1,
halves for layers 2 and 3, flipped between consecutive layers), a conditioner MLP (one hidden
layer of width HIDDEN, tanh) of ``x * m`` giving a shift t and a log-scale s = tanh(...), and
``y = jnp.where(m, x, x * exp(s) + t)``. Methods, all jit-compiled, on a batch of B samples:

- jaxrev: ``jax.vmap(jr.forward_and_slogdet(flow), in_axes=(0, None))`` and
  ``jax.vmap(jr.inverse_and_slogdet(flow), in_axes=(0, None))``; also ``jr.Bijector(flow)``'s
  ``forward_and_log_det`` / ``inverse_and_log_det`` (the same, through the distrax protocol);
- distrax: the same flow as a ``distrax.Chain`` of ``distrax.MaskedCoupling(mask, conditioner,
  bijector=lambda p: distrax.ScalarAffine(shift=p[0], log_scale=p[1]))`` layers, its
  ``forward_and_log_det`` / ``inverse_and_log_det`` on the batch (checked first to give the
  plain function's y and log-det);
- analytic: the log-det written by hand (the sum of s over the unmasked elements, accumulated
  in the forward pass) and its inverse, vmapped;
- dense: ``jnp.linalg.slogdet(jax.jacfwd(flow)(x, params))`` vmapped (forward direction only;
  for n <= DENSE_MAX_N at every batch, and at larger n only for batch <= DENSE_MAX_BATCH, since
  its Jacobian is B n^2 floats and it costs n JVPs per sample).

Measurements: time is the median of interleaved runs (float32, JAX's default), memory is XLA's
planned scratch memory (`temp_bytes`) divided by the batch size. Accuracy is checked in float64
in a separate process (``JAX_ENABLE_X64=1``): the log-dets' max abs error against dense slogdet
of jacfwd (and against the analytic value), the inverse's round-trip error, distrax against the
plain function. `jr.logdet_strategy` is recorded for every n and must be "sweep".
Writes results/flows.{json,md,png} (flows_quick.* with --quick).

    OPENBLAS_NUM_THREADS=1 python benchmarks/flows.py            # full run (a few minutes)
    OPENBLAS_NUM_THREADS=1 python benchmarks/flows.py --quick    # n = 64, 196, batch 8, 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# XLA:CPU on one thread too: ratios against peers are not distorted by threads spinning
# on a busy machine (set XLA_FLAGS to change it)
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    optional,
    progress,  # noqa: E402
    pyplot,
    temp_bytes,
    write_results,
)

import jaxrev as jr  # noqa: E402

distrax = optional("distrax")

LAYERS = 4
DENSE_MAX_N = 64  # dense jacfwd + slogdet at every batch up to this n
DENSE_MAX_BATCH = 8  # and above it only for batches up to this
NAN = "jaxrev nan"  # jr.*_and_slogdet(flow, on_error="nan"): no singular-pivot check
FWD = ("jaxrev", NAN, "jr.Bijector", "distrax", "analytic", "dense")
INV = ("jaxrev", NAN, "jr.Bijector", "distrax", "analytic")
RATIOS = [f"{d} {k} / distrax" for d in ("fwd", "inv") for k in ("jaxrev", NAN)]


def hidden(n: int) -> int:
    return 64 if n <= 64 else 128


# ----------------------------------------------------------------------------- the flow


def masks(n: int) -> list[np.ndarray]:
    """Boolean masks (True: the element passes through unchanged and conditions the rest)."""
    i = np.arange(n)
    side = round(np.sqrt(n))
    check = ((i // side + i % side) % 2 == 0) if side * side == n else (i % 2 == 0)
    half = i < n // 2
    return [check, ~check, half, ~half][:LAYERS]


def init_params(n: int, dtype, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    h = hidden(n)
    ps = []
    for _ in range(LAYERS):
        ps.append(
            {
                "W1": rng.standard_normal((n, h)) / np.sqrt(n / 2),
                "b1": 0.1 * rng.standard_normal(h),
                "W2": rng.standard_normal((h, 2 * n)) / np.sqrt(h),
                "b2": 0.1 * rng.standard_normal(2 * n),
            }
        )
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dtype), ps)


def make_flow(n: int):
    ms = [jnp.asarray(m) for m in masks(n)]

    def conditioner(xm, p):
        h = jnp.tanh(xm @ p["W1"] + p["b1"])
        o = h @ p["W2"] + p["b2"]
        return o[..., :n], jnp.tanh(o[..., n:])  # shift t, log-scale s

    def flow(x, params):
        """One sample x: (n,) -> (n,)."""
        for m, p in zip(ms, params):
            t, s = conditioner(x * m, p)
            x = jnp.where(m, x, x * jnp.exp(s) + t)
        return x

    def analytic_fwd(x, params):
        ld = jnp.zeros((), x.dtype)
        for m, p in zip(ms, params):
            t, s = conditioner(x * m, p)
            x = jnp.where(m, x, x * jnp.exp(s) + t)
            ld = ld + jnp.sum(jnp.where(m, 0.0, s))
        return x, ld

    def analytic_inv(y, params):
        ld = jnp.zeros((), y.dtype)
        for m, p in reversed(list(zip(ms, params))):
            t, s = conditioner(y * m, p)  # masked elements are unchanged
            y = jnp.where(m, y, (y - t) * jnp.exp(-s))
            ld = ld - jnp.sum(jnp.where(m, 0.0, s))
        return y, ld

    def distrax_chain(params):
        layers = []
        for m, p in zip(masks(n), params):
            layers.append(
                distrax.MaskedCoupling(
                    mask=m,
                    conditioner=lambda xm, p=p: conditioner(xm, p),
                    bijector=lambda q: distrax.ScalarAffine(shift=q[0], log_scale=q[1]),
                    event_ndims=1,
                )
            )
        return distrax.Chain(layers[::-1])  # Chain applies its last one first

    return flow, analytic_fwd, analytic_inv, distrax_chain


def methods(n: int, batch: int, dense: bool = False) -> tuple[dict, dict]:
    """The jitted forward and inverse methods, each ``f(xb or yb, params) -> (out, logdet)``
    (dense: the dense reference at any size)."""
    flow, afwd, ainv, chain = make_flow(n)
    bij = jr.Bijector(flow)
    fwd = {
        "jaxrev": jax.jit(jax.vmap(jr.forward_and_slogdet(flow), in_axes=(0, None))),
        NAN: jax.jit(jax.vmap(jr.forward_and_slogdet(flow, on_error="nan"), in_axes=(0, None))),
        "jr.Bijector": jax.jit(bij.forward_and_log_det),
        "analytic": jax.jit(jax.vmap(afwd, in_axes=(0, None))),
    }
    inv = {
        "jaxrev": jax.jit(jax.vmap(jr.inverse_and_slogdet(flow), in_axes=(0, None))),
        NAN: jax.jit(jax.vmap(jr.inverse_and_slogdet(flow, on_error="nan"), in_axes=(0, None))),
        "jr.Bijector": jax.jit(bij.inverse_and_log_det),
        "analytic": jax.jit(jax.vmap(ainv, in_axes=(0, None))),
    }
    if distrax is not None:
        fwd["distrax"] = jax.jit(lambda xb, ps: chain(ps).forward_and_log_det(xb))
        inv["distrax"] = jax.jit(lambda yb, ps: chain(ps).inverse_and_log_det(yb))
    if dense or n <= DENSE_MAX_N or batch <= DENSE_MAX_BATCH:
        fwd["dense"] = jax.jit(
            jax.vmap(
                lambda x, ps: (flow(x, ps), jnp.linalg.slogdet(jax.jacfwd(flow)(x, ps))[1]),
                in_axes=(0, None),
            )
        )
    return fwd, inv


def samples(n: int, batch: int, dtype, seed: int = 1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, n)), dtype)


# ----------------------------------------------------------------------------- accuracy


def accuracy(ns: list[int], batch: int) -> dict:
    """Run under JAX_ENABLE_X64=1: float64 errors of every method (a separate process)."""
    assert jax.config.jax_enable_x64, "the accuracy pass runs in float64"
    out = {}
    for n in ns:
        ps = init_params(n, jnp.float64)
        xb = samples(n, batch, jnp.float64)
        fwd, inv = methods(n, batch, dense=True)  # the reference, at every n here
        res = {k: f(xb, ps) for k, f in fwd.items()}
        yb, ref = res["dense"]
        ana = res["analytic"][1]
        row = {
            "n": n,
            "batch": batch,
            "dtype": "float64",
            "logdet_scale": float(jnp.max(jnp.abs(ref))),
            "analytic_vs_dense": float(jnp.max(jnp.abs(ana - ref))),
            "fwd_vs_dense": {},
            "fwd_vs_analytic": {},
            "y_err": {},
            "inv_vs_dense": {},
            "inv_vs_analytic": {},
            "x_err": {},
        }
        for k, (y, ld) in res.items():
            row["fwd_vs_dense"][k] = float(jnp.max(jnp.abs(ld - ref)))
            row["fwd_vs_analytic"][k] = float(jnp.max(jnp.abs(ld - ana)))
            row["y_err"][k] = float(jnp.max(jnp.abs(y - yb)))
        for k, f in inv.items():
            x, ld = f(yb, ps)  # the inverse's log-det is minus the forward's at x
            row["inv_vs_dense"][k] = float(jnp.max(jnp.abs(ld + ref)))
            row["inv_vs_analytic"][k] = float(jnp.max(jnp.abs(ld + ana)))
            row["x_err"][k] = float(jnp.max(jnp.abs(x - xb)))
        if "distrax" in fwd:
            d = max(
                row["fwd_vs_analytic"]["distrax"],
                row["y_err"]["distrax"],
                row["inv_vs_analytic"]["distrax"],
                row["x_err"]["distrax"],
            )
            assert d < 1e-10, f"distrax and the plain flow disagree at n={n}: {d:.2e}"
        out[n] = row
    return out


def accuracy_subprocess(ns: list[int], batch: int) -> dict:
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--accuracy-only",
        "--ns",
        ",".join(map(str, ns)),
        "--batch",
        str(batch),
    ]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if p.returncode != 0:
        raise RuntimeError(f"the float64 accuracy pass failed:\n{p.stderr[-4000:]}")
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


# ----------------------------------------------------------------------------- timing


def program_stats(f, *args) -> dict:
    """Size of the jitted program: jaxpr equations (and host callbacks among them), and the
    compiled HLO's fusions, host custom-calls and transcendental ops."""
    inner = jax.make_jaxpr(f)(*args).jaxpr
    while len(inner.eqns) == 1 and "jaxpr" in inner.eqns[0].params:  # the jit wrapper
        inner = inner.eqns[0].params["jaxpr"].jaxpr
    hlo = f.lower(*args).compile().as_text()
    body = [ln for ln in hlo.splitlines() if " = " in ln]

    def count(op):
        return sum(f" {op}(" in ln for ln in body)

    return {
        "jaxpr_eqns": len(inner.eqns),
        "debug_callbacks": sum(
            e.primitive.name in ("debug_callback", "pure_callback") for e in inner.eqns
        ),
        "hlo_fusions": count("fusion"),
        "hlo_custom_calls": count("custom-call"),
        "hlo_exp": count("exponential"),
        "hlo_log": count("log"),
        "hlo_select": count("select"),
    }


def run_config(n: int, batch: int, reps: int) -> dict:
    ps = init_params(n, jnp.float32)
    flow = make_flow(n)[0]
    xb = samples(n, batch, jnp.float32)
    fwd, inv = methods(n, batch)
    # float32 agreement of everything with the analytic flow before timing
    yb, ana = fwd["analytic"](xb, ps)
    scale = max(1.0, float(jnp.max(jnp.abs(ana))))
    agree = {}
    for k, f in fwd.items():
        y, ld = f(xb, ps)
        agree["fwd " + k] = max(
            float(jnp.max(jnp.abs(y - yb))), float(jnp.max(jnp.abs(ld - ana))) / scale
        )
    for k, f in inv.items():
        x, ld = f(yb, ps)
        agree["inv " + k] = max(
            float(jnp.max(jnp.abs(x - xb))), float(jnp.max(jnp.abs(ld + ana))) / scale
        )
    if "distrax" in fwd:
        for d in ("fwd distrax", "inv distrax"):
            assert agree[d] < 1e-5, f"{d} disagrees with the plain flow at n={n}: {agree[d]:.2e}"
    calls = {f"fwd {k}": (lambda f=f: f(xb, ps)) for k, f in fwd.items()}
    calls.update({f"inv {k}": (lambda f=f: f(yb, ps)) for k, f in inv.items()})
    mem = {f"fwd {k}": temp_bytes(f, xb, ps) for k, f in fwd.items()}
    mem.update({f"inv {k}": temp_bytes(f, yb, ps) for k, f in inv.items()})
    times = interleaved_medians(calls, reps=reps)
    stats = {
        f"{d} {k}": program_stats(fs[k], a, ps)
        for d, fs, a in (("fwd", fwd, xb), ("inv", inv, yb))
        for k in ("jaxrev", NAN, "analytic")
    }
    return {
        "n": n,
        "batch": batch,
        "hidden": hidden(n),
        "strategy": jr.logdet_strategy(flow, xb[0], ps),
        "times": times,
        "temp_bytes": mem,
        "temp_bytes_per_sample": {k: v / batch for k, v in mem.items()},
        "f32_agreement": agree,
        "program_stats": stats,
    }


def _e(v):
    return "n/a" if v is None else f"{v:.1e}"


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small sizes, a smoke test")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--accuracy-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ns", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=8, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.accuracy_only:
        print(json.dumps(accuracy([int(s) for s in args.ns.split(",")], args.batch)))
        return
    q = args.quick
    ns = [64, 196] if q else [64, 784]
    batches = [8, 64] if q else [8, 256]
    reps = args.reps or (5 if q else 15)
    if distrax is None:
        print("distrax is not installed (pip install distrax): no distrax columns")

    configs = [(n, b) for n in ns for b in batches]
    bar = progress(range(len(configs) + 1), desc="flows (accuracy, then n x batch)")
    rows, acc = [], None
    for i in bar:
        if i == 0:
            acc = accuracy_subprocess(ns, 8)
        else:
            rows.append(run_config(*configs[i - 1], reps=reps))
    for r in rows:
        assert r["strategy"] == "sweep", f"n={r['n']}: strategy {r['strategy']!r}"
    skipped = [
        f"n={n}, batch={b}" for n, b in configs if not (n <= DENSE_MAX_N or b <= DENSE_MAX_BATCH)
    ]
    data = {
        "device": device_info(),
        "layers": LAYERS,
        "dtype_timing": "float32",
        "reps": reps,
        "rows": rows,
        "accuracy_float64": {str(k): v for k, v in acc.items()},
        "dense_skipped": skipped,
    }
    table = make_table(data)
    suffix = "_quick" if q else ""
    write_results("flows" + suffix, data, table)
    plot(data, os.path.join(RESULTS, f"flows{suffix}.png"))
    print(table)


# ----------------------------------------------------------------------------- output


def make_table(d: dict) -> str:
    rows = d["rows"]
    cols = [f"fwd {k}" for k in FWD] + [f"inv {k}" for k in INV]
    cols = [c for c in cols if any(c in r["times"] for r in rows)]
    has_dx = any("fwd distrax" in r["times"] for r in rows)
    out = [
        f"# Normalizing-flow log-determinants ({d['device']['backend']}, JAX {d['device']['jax']})",
        "",
        f"RealNVP-style flow, {d['layers']} masked affine coupling layers (tanh MLP "
        "conditioner, hidden 64 at n = 64, 128 above), float32, jit-compiled, batch "
        f"vmapped. Median of {d['reps']} interleaved runs.",
        "",
        "## Time (ms) and jaxrev / distrax",
        "",
        "| n | batch | strategy | "
        + " | ".join(cols)
        + (" | " + " | ".join(RATIOS) + " |" if has_dx else " |"),
        "|---" * (len(cols) + 3 + len(RATIOS) * has_dx) + "|",
    ]
    for r in rows:
        t = r["times"]
        cells = [f"{t[c] * 1e3:.3f}" if c in t else "skipped" for c in cols]
        line = f"| {r['n']} | {r['batch']} | {r['strategy']} | " + " | ".join(cells)
        if has_dx:
            line += "".join(
                f" | {t[f'{d} {k}'] / t[f'{d} distrax']:.2f}"
                for d in ("fwd", "inv")
                for k in ("jaxrev", NAN)
            )
        out.append(line + " |")
    out += [
        "",
        "## XLA temp memory per sample (bytes; `temp_size_in_bytes` / batch)",
        "",
        "| n | batch | " + " | ".join(cols) + " |",
        "|---" * (len(cols) + 2) + "|",
    ]
    for r in rows:
        m = r["temp_bytes_per_sample"]
        out.append(
            f"| {r['n']} | {r['batch']} | "
            + " | ".join(f"{m[c]:.0f}" if c in m else "skipped" for c in cols)
            + " |"
        )
    out += [
        "",
        "## Program size (jaxpr equations, host callbacks; compiled HLO fusions, host "
        "custom-calls, exp, log, select)",
        "",
        "`jaxrev` checks for a singular pivot with one host callback per call, also under "
        "`vmap` (on_error='raise', the default). `jaxrev nan` (on_error='nan') has no "
        "check.",
        "",
        "| n | batch | program | jaxpr eqns | callbacks | HLO fusions | "
        "custom-calls | exp | log | select |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for k, st in r["program_stats"].items():
            out.append(
                f"| {r['n']} | {r['batch']} | {k} | {st['jaxpr_eqns']} | "
                f"{st['debug_callbacks']} | {st['hlo_fusions']} | "
                f"{st['hlo_custom_calls']} | {st['hlo_exp']} | {st['hlo_log']} | "
                f"{st['hlo_select']} |"
            )
    out += [
        "",
        "## Accuracy (float64, batch 8): max abs error of the log-det",
        "",
        "Forward log-det against dense slogdet(jacfwd) and against the analytic sum of s; "
        "inverse log-det against minus those; round trip = max |inverse(y) - x|.",
        "",
        "| n | max abs logdet | method | fwd vs dense | fwd vs analytic | inv vs dense "
        "| inv vs analytic | round trip |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, a in d["accuracy_float64"].items():
        for k in a["fwd_vs_dense"]:
            if k == "dense":
                continue
            inv_d = a["inv_vs_dense"].get(k)
            inv_a = a["inv_vs_analytic"].get(k)
            xe = a["x_err"].get(k)
            out.append(
                f"| {n} | {a['logdet_scale']:.1f} | {k} | {_e(a['fwd_vs_dense'][k])} | "
                f"{_e(a['fwd_vs_analytic'][k])} | {_e(inv_d)} | {_e(inv_a)} | {_e(xe)} |"
            )
    out += [
        "",
        "float32 agreement with the analytic flow before timing (max of |dy| and "
        "|d logdet| / max(1, |logdet|)): "
        + "; ".join(
            f"n={r['n']} B={r['batch']}: {max(r['f32_agreement'].values()):.1e}" for r in rows
        ),
    ]
    if d["dense_skipped"]:
        out += [
            "",
            "Dense jacfwd + slogdet skipped at "
            + ", ".join(d["dense_skipped"])
            + f" (B n^2 Jacobian entries and n JVPs per sample; run for n <= {DENSE_MAX_N}"
            f" or batch <= {DENSE_MAX_BATCH}).",
        ]
    return "\n".join(out) + "\n"


def plot(d: dict, path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = d["rows"]
    cols = [
        c
        for c in [f"fwd {k}" for k in FWD] + [f"inv {k}" for k in INV]
        if any(c in r["times"] for r in rows)
    ]
    fig, ax = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(cols)
    xs = np.arange(len(rows))
    for j, c in enumerate(cols):
        ax[0].bar(xs + j * width, [r["times"].get(c, np.nan) * 1e3 for r in rows], width, label=c)
        ax[1].bar(
            xs + j * width,
            [r["temp_bytes_per_sample"].get(c, np.nan) for r in rows],
            width,
            label=c,
        )
    labels = [f"n={r['n']}\nB={r['batch']}" for r in rows]
    for a, yl, title in (
        (ax[0], "ms", "time (median)"),
        (ax[1], "bytes per sample", "XLA temp memory / batch"),
    ):
        a.set_xticks(xs + 0.4 - width / 2)
        a.set_xticklabels(labels, fontsize=8)
        a.set_yscale("log")
        a.set_ylabel(yl)
        a.set_title(title)
    ax[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
