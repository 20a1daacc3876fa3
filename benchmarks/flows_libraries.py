"""Library flows taken as they are (issue 32): jaxrev's log-dets and inverses of flowjax's and
numpyro's (and distrax's) forward maps against the libraries' own `transform_and_log_det` /
`inverse_and_log_det` (flowjax, distrax) and `inv` / `log_abs_det_jacobian` (numpyro).

Setup (the issue's): dimension 8, batch 256 (vmapped), float32, everything under `jit`, the
defaults a user gets. Flows:

- flowjax `coupling_flow` with rational-quadratic splines (knots 8, and 32 as a hard variant;
  interval 4) and with affine couplings, `masked_autoregressive_flow` with affine
  transformers and with spline ones (in flowjax's default layout its `transform` is the
  element loop, whose step solves the spline on one element), `planar_flow` (flowjax has
  no inverse for its tanh layers: its own forward map is timed in that column), and
  `block_neural_autoregressive_flow`, each built with flowjax's defaults (`invert=True`: the
  flow's `transform` is the bijection's inverse, which is what jaxrev is handed) and with
  `invert=False`;
- numpyro's `ComposeTransform` of affine-coupling-free transforms users chain:
  `AffineTransform`, `LowerCholeskyAffine`, a `PermuteTransform` and the (clipped)
  `SigmoidTransform`, and `InverseAutoregressiveTransform` over an `AutoregressiveNN`;
- distrax's `SplitCoupling` layers with `RationalQuadraticSpline` bijectors, chained (its bin
  found by a one-hot mask over bins; where distrax is installed), against its own
  `forward_and_log_det` / `inverse_and_log_det`.

Time is one jitted call on the batch (interleaved medians, one thread); the first call's
seconds (tracing, jaxrev's walk and XLA's compilation) are reported beside it. Errors are
relative to the library's answer (float32). Targets: forward + log-det ≤ 1.5× the library's,
inverse + log-det ≤ 2× the library's own inverse. Writes results/flows_libraries.{json,md,png}.

    python benchmarks/flows_libraries.py [--quick]
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (
    RESULTS,
    device_info,
    interleaved_medians,
    progress,
    pyplot,  # noqa: E402
    write_results,
)

import jaxrev as jr  # noqa: E402

D, BATCH = 8, 256
FWD_TARGET, INV_TARGET = 1.5, 2.0


def flowjax_flows(layers: int) -> dict:
    import flowjax.bijections as fb
    import flowjax.flows as ff
    from flowjax.distributions import Normal

    key, base = jax.random.key(0), Normal(jnp.zeros(D))

    def perturbed(bij, seed=1):
        # flowjax initialises couplings to the identity: move every float parameter (as a
        # little training would; larger moves make float32 splines ill-conditioned, for the
        # library's inverse as for jaxrev's)
        leaves, tree = jax.tree_util.tree_flatten(bij)
        ks = jax.random.split(jax.random.key(seed), len(leaves))
        return jax.tree_util.tree_unflatten(
            tree,
            [
                leaf + 0.05 * jax.random.normal(k, leaf.shape, leaf.dtype)
                if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)
                else leaf
                for leaf, k in zip(leaves, ks)
            ],
        )

    spline = fb.RationalQuadraticSpline(knots=8, interval=4)
    constructors = {
        "coupling_flow (spline)": lambda **kw: ff.coupling_flow(
            key, base_dist=base, transformer=spline, flow_layers=layers, **kw
        ),
        # (the hard variant: 32 bins, 34 thresholds a searched bin evaluates the map at)
        "coupling_flow (spline, 32 knots)": lambda **kw: ff.coupling_flow(
            key,
            base_dist=base,
            transformer=fb.RationalQuadraticSpline(knots=32, interval=4),
            flow_layers=layers,
            **kw,
        ),
        "coupling_flow (affine)": lambda **kw: ff.coupling_flow(
            key, base_dist=base, flow_layers=layers, **kw
        ),
        "masked_autoregressive_flow (affine)": lambda **kw: ff.masked_autoregressive_flow(
            key, base_dist=base, flow_layers=layers, **kw
        ),
        # (a hard variant: knots from a masked network, the spline of element i on the knots
        # the elements before it make; its inverse solves one element more per pass)
        "masked_autoregressive_flow (spline)": lambda **kw: ff.masked_autoregressive_flow(
            key, base_dist=base, transformer=spline, flow_layers=layers, **kw
        ),
        "planar_flow (tanh)": lambda **kw: ff.planar_flow(
            key, base_dist=base, flow_layers=layers, **kw
        ),
        "block_neural_autoregressive_flow": lambda **kw: ff.block_neural_autoregressive_flow(
            key, base_dist=base, flow_layers=1, **kw
        ),
    }
    # flowjax's defaults (`invert=True`: the flow's `transform` is the bijection's inverse,
    # so that sampling is cheap) first, then the `invert=False` layout
    flows = {}
    for layout, kw in (("default", {}), ("invert=False", {"invert": False})):
        for name, make in constructors.items():
            bij = perturbed(make(**kw).bijection)
            try:
                jax.eval_shape(bij.transform_and_log_det, jnp.zeros(bij.shape))
            except NotImplementedError:
                # (flowjax's planar flow with tanh layers, built inverted: its `transform` is
                # the planar inverse, which flowjax does not implement; only the density
                # direction exists, which is the `invert=False` row's map)
                SKIPPED.append(f"flowjax {name}, {layout}")
                continue
            flows[f"flowjax {name}, {layout}"] = bij
    return flows


SKIPPED: list[str] = []
"""Flows whose forward map the library does not implement (nothing to hand jaxrev)."""


def numpyro_flows() -> dict:
    from numpyro.distributions import transforms as T
    from numpyro.distributions.flows import InverseAutoregressiveTransform
    from numpyro.nn import AutoregressiveNN

    k = jax.random.split(jax.random.key(2), 4)
    L = jnp.tril(0.3 * jax.random.normal(k[0], (D, D)), -1) + jnp.diag(
        jnp.exp(0.2 * jax.random.normal(k[1], (D,)))
    )
    init, apply = AutoregressiveNN(D, [max(32, 2 * D)], permutation=jnp.arange(D))
    _, params = init(k[2], (D,))
    params = jax.tree_util.tree_map(lambda p: p + 0.1 * jax.random.normal(k[3], p.shape), params)
    arn = lambda x: apply(params, x)  # noqa: E731
    return {
        "numpyro chain (affine, lower-Cholesky, permute, sigmoid)": T.ComposeTransform(
            [
                T.AffineTransform(0.5, 1.7),
                T.LowerCholeskyAffine(jnp.zeros(D), L),
                T.PermuteTransform(jnp.arange(D)[::-1]),
                T.SigmoidTransform(),
            ]
        ),
        "numpyro InverseAutoregressiveTransform": InverseAutoregressiveTransform(arn),
    }


def distrax_flows(layers: int) -> dict:
    """distrax's spline coupling flow as its users write one: `SplitCoupling` layers
    (alternating halves) whose bijector is a `RationalQuadraticSpline` (8 bins on [-4, 4],
    distrax's default unconstrained boundary slopes) and whose conditioner is a small MLP,
    chained; distrax finds each bin by a one-hot mask over bins, not a search. Empty where
    distrax is not installed."""
    try:
        import distrax
    except ImportError:
        return {}
    bins, hidden, half = 8, 32, D // 2
    keys = jax.random.split(jax.random.key(3), 2 * layers)

    def layer(i: int):
        w1 = 0.3 * jax.random.normal(keys[2 * i], (half, hidden))
        w2 = 0.05 * jax.random.normal(keys[2 * i + 1], (hidden, half * (3 * bins + 1)))

        def conditioner(x):
            h = jnp.tanh(x @ w1.astype(x.dtype))
            return (h @ w2.astype(x.dtype)).reshape(x.shape[:-1] + (half, 3 * bins + 1))

        return distrax.SplitCoupling(
            split_index=half,
            event_ndims=1,
            conditioner=conditioner,
            bijector=lambda p: distrax.RationalQuadraticSpline(p, range_min=-4.0, range_max=4.0),
            swap=bool(i % 2),
        )

    return {"distrax SplitCoupling (spline)": distrax.Chain([layer(i) for i in range(layers)])}


def _library_fns(kind: str, bij):
    """(forward+log-det, inverse+log-det or None) of the library, on one sample."""
    if kind == "distrax":
        return bij.forward_and_log_det, bij.inverse_and_log_det
    if kind == "flowjax":
        fwd = bij.transform_and_log_det
        try:
            bij.inverse_and_log_det(jnp.zeros(bij.shape))
            inv = bij.inverse_and_log_det
        except NotImplementedError:
            inv = None
        return fwd, inv

    def fwd(x):
        y = bij(x)
        return y, jnp.sum(bij.log_abs_det_jacobian(x, y))

    def inv(y):
        try:
            x = bij.inv(y)
        except NotImplementedError:
            raise
        return x, -jnp.sum(bij.log_abs_det_jacobian(x, y))

    try:
        jax.eval_shape(bij.inv, jnp.zeros(D))
    except NotImplementedError:
        inv = None
    return fwd, inv


def measure(name: str, kind: str, bij, reps: int) -> dict:
    f = {  # (the forward map alone, as each library names it)
        "flowjax": lambda x: bij.transform(x),
        "distrax": lambda x: bij.forward(x),
    }.get(kind, lambda x: bij(x))
    lib_f, lib_i = _library_fns(kind, bij)
    x = 0.8 * jax.random.normal(jax.random.key(7), (BATCH, D))
    y, _ = jax.vmap(lib_f)(x)
    calls = {
        "library forward": jax.jit(jax.vmap(lib_f)),
        "jaxrev forward": jax.jit(jax.vmap(jr.forward_and_slogdet(f))),
    }
    args = {"library forward": x, "jaxrev forward": x}
    if lib_i is not None:
        calls["library inverse"] = jax.jit(jax.vmap(lib_i))
        args["library inverse"] = y
    calls["jaxrev inverse"] = jax.jit(jax.vmap(jr.inverse_and_slogdet(f)))
    args["jaxrev inverse"] = y
    row: dict = {"flow": name}
    out: dict = {}
    for k, c in calls.items():
        t0 = time.perf_counter()
        try:
            out[k] = jax.block_until_ready(c(args[k]))
            row[f"{k} first s"] = time.perf_counter() - t0
        except jr.JaxrevError as e:
            row[f"{k} refused"] = str(e).splitlines()[0][:200]
    timed = {k: (lambda c=c, a=args[k]: c(a)) for k, c in calls.items() if k in out}
    t = interleaved_medians(timed, reps=reps)
    row.update({f"{k} s": v for k, v in t.items()})

    def err(a, b):
        return float(
            max(
                jnp.max(jnp.abs(p - q)) / jnp.maximum(jnp.max(jnp.abs(p)), 1e-30)
                for p, q in zip(a, b)
            )
        )

    if "jaxrev forward" in out:
        row["forward err"] = err(out["library forward"], out["jaxrev forward"])
        row["forward ratio"] = t["jaxrev forward"] / t["library forward"]
    # inverses against the input that made y (float32: both the library's inverse and
    # jaxrev's carry the map's conditioning), and the log-det against the library's forward
    ref = (x, -out["library forward"][1])
    if "jaxrev inverse" in out:
        row["inverse err"] = err(ref, out["jaxrev inverse"])
        if "library inverse" in out:
            row["library inverse err"] = err(ref, out["library inverse"])
            row["inverse ratio"] = t["jaxrev inverse"] / t["library inverse"]
        else:  # no library inverse: timed against the library's forward
            row["inverse ratio (vs library forward)"] = t["jaxrev inverse"] / t["library forward"]
    return row


def table(rows: list[dict]) -> str:
    def fmt(v, spec=".2f"):
        return "—" if v is None else format(v, spec)

    lines = [
        "| flow | library fwd ms | jaxrev fwd ms | fwd ratio | fwd err | library inv ms | "
        "jaxrev inv ms | inv ratio | inv err (jaxrev / library) | "
        "first call s (jaxrev fwd / inv; library fwd / inv) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        inv_ratio = r.get("inverse ratio", r.get("inverse ratio (vs library forward)"))
        lib_inv = r.get("library inverse s")
        jr_inv = r.get("jaxrev inverse s")
        lines.append(
            f"| {r['flow']} | {fmt(1e3 * r['library forward s'])} | "
            f"{fmt(None if 'jaxrev forward s' not in r else 1e3 * r['jaxrev forward s'])}"
            f"{' (refused)' if 'jaxrev forward refused' in r else ''} | "
            f"{fmt(r.get('forward ratio'))} | "
            f"{fmt(r.get('forward err'), '.1e')} | "
            f"{fmt(None if lib_inv is None else 1e3 * lib_inv)}"
            f"{'' if lib_inv is not None else ' (none)'} | "
            f"{fmt(None if jr_inv is None else 1e3 * jr_inv)}"
            f"{' (refused)' if 'jaxrev inverse refused' in r else ''} | "
            f"{fmt(inv_ratio)}{'*' if 'inverse ratio (vs library forward)' in r else ''} | "
            f"{fmt(r.get('inverse err'), '.1e')} / {fmt(r.get('library inverse err'), '.1e')} | "
            f"{fmt(r.get('jaxrev forward first s'), '.1f')} / "
            f"{fmt(r.get('jaxrev inverse first s'), '.1f')}; "
            f"{fmt(r.get('library forward first s'), '.1f')} / "
            f"{fmt(r.get('library inverse first s'), '.1f')} |"
        )
    lines.append("")
    lines.append(
        f"Dimension {D}, batch {BATCH} (vmapped), float32, jitted, one thread; "
        "medians of interleaved calls. Targets: forward ≤ "
        f"{FWD_TARGET}×, inverse ≤ {INV_TARGET}× the library's. * no library "
        "inverse: jaxrev's inverse against the library's forward. Errors: the forward's against "
        "the library's; the inverses' (value and log-det) against the input that made "
        "y, relative to its largest entry."
    )
    for name in SKIPPED:
        lines.append(
            f"- {name}: not measured: the library's own `transform` raises "
            "NotImplementedError (only the density direction exists: the `invert=False` "
            "row's map)"
        )
    for r in rows:
        for way in ("forward", "inverse"):
            if f"jaxrev {way} refused" in r:
                lines.append(f"- {r['flow']}: {way} refused: {r[f'jaxrev {way} refused']}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [
        r["flow"].replace("flowjax ", "").replace("numpyro ", "np: ").replace("distrax ", "dx: ")
        for r in rows
    ]
    fw = [r.get("forward ratio", np.nan) for r in rows]
    iv = [r.get("inverse ratio", r.get("inverse ratio (vs library forward)", np.nan)) for r in rows]
    xs = np.arange(len(rows))
    ax.bar(xs - 0.2, fw, 0.4, label="forward + log-det")
    ax.bar(xs + 0.2, iv, 0.4, label="inverse + log-det")
    ax.axhline(FWD_TARGET, ls="--", c="C0", lw=0.8)
    ax.axhline(INV_TARGET, ls="--", c="C1", lw=0.8)
    ax.set_xticks(xs, names, rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("jaxrev time / library time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dim", type=int, default=D, help="the flows' dimension (default 8)")
    ap.add_argument("--only", default="", help="only the flows whose name holds this text")
    a = ap.parse_args()
    globals()["D"] = a.dim
    layers, reps = (2, 3) if a.quick else (4, 15)
    cases = [(n, "flowjax", b) for n, b in flowjax_flows(layers).items()]
    cases += [(n, "numpyro", b) for n, b in numpyro_flows().items()]
    cases += [(n, "distrax", b) for n, b in distrax_flows(layers).items()]
    cases = [c for c in cases if a.only in c[0]]
    # (the process's own first costs, JAX's and jaxrev's, paid once here: the first row's
    # first calls measured them otherwise)
    warm = jnp.linspace(-0.5, 0.5, D)
    jax.jit(jax.vmap(jr.inverse_and_slogdet(lambda x: 2.0 * x + jnp.sinh(x))))(warm[None])
    rows = []
    for name, kind, bij in progress(cases, desc="flows"):
        rows.append(measure(name, kind, bij, reps))
    name = (
        "flows_libraries"
        + (f"_d{a.dim}" if a.dim != 8 else "")
        + ("_some" if a.only else "")  # (a part of the table does not replace the whole)
        + ("_quick" if a.quick else "")
    )
    md = table(rows)
    write_results(name, {"rows": rows, "layers": layers, "device": device_info()}, md)
    plot(rows, os.path.join(RESULTS, name + ".png"))
    print(md)


if __name__ == "__main__":
    main()
