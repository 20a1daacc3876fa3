"""ADBench's bundle adjustment residuals and their sparse Jacobian, with JAX and `jr.reversible`.

Run with `python examples/bundle_adjustment.py` (add `--all` for all 20 instances). This is the
bundle adjustment benchmark of ADBench (Srajer et al. 2018) that the NiLang paper reproduces in
its Table 6. Each of p observations projects a 3-D point X through a camera (angle-axis rotation
r, centre c, focal length f, principal point x0, radial distortion k1, k2), exactly as ADBench's
reference `computeReprojError` does:

    Xcam = rodrigues(r, X - c);  u = Xcam[:2] / Xcam[2];  u *= 1 + k1 |u|^2 + k2 |u|^4
    reprojection residual = w (f u + x0 - feature)   (2 rows),   weight residual = 1 - w^2

The Jacobian is sparse, (2p + p) x (11n + 3m + p): each observation contributes a 2 x 15 block
(its camera's 11 parameters, its point's 3 and its weight) and one entry -2w for its weight
residual. The blocks are computed three ways, vectorised over the observations:

- `jax.vmap(jax.jacfwd(residual))` and `jax.vmap(jax.jacrev(residual))`;
- two VJPs (one per residual row) of `jr.reversible(lambda acc, cam, X, w, feat: acc +
  residual(cam, X, w, feat))` at acc = 0: the state is the 2-vector accumulator, and the backward
  sweep recovers it by subtracting the residual, recomputed from the inputs, instead of keeping
  the forward intermediates. This is NiLang's formulation: the Jacobian of a 15-input, 2-output
  function by reverse mode through a reversible program. The function is straight-line code
  with no loop whose intermediates could pile up, so XLA's scratch memory is about jacrev's (it
  is dominated by the p blocks themselves); what differs is how the backward pass gets its values.

It checks that the three agree to 1e-10, assembles the sparse matrix, and prints the objective
time, the three Jacobian times, XLA's temporary memory and the number of non-zeros.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax

# The Jacobians are compared to 1e-10 relative: float64.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from adbench_io import N_CAM_PARAMS, ba_files, ba_size, data_dir, read_ba  # noqa: E402
from jax import lax  # noqa: E402

import jaxrev as jr  # noqa: E402

# Observations per vectorised chunk. Up to this many, one vmap over all of them; beyond it,
# lax.map over chunks of vmaps, so that XLA's scratch memory stays bounded on the largest
# instances (ba19's 9.1 million observations would need about 16 GB for jacfwd in one vmap).
CHUNK = 1 << 20
DEFAULT_INSTANCES = (1, 2, 10)
BLOCK_COLS = N_CAM_PARAMS + 3 + 1


# ------------------------------------------------------------------ ADBench's residuals


def rodrigues_rotate_point(rot: jax.Array, pt: jax.Array) -> jax.Array:
    """Rotate pt by the angle-axis vector rot (ADBench: the first-order formula at angle 0)."""
    sqtheta = jnp.sum(rot * rot)
    nonzero = sqtheta != 0
    # Both branches are evaluated; the safe sqrt keeps the unused one free of NaN derivatives.
    theta = jnp.sqrt(jnp.where(nonzero, sqtheta, 1.0))
    w = rot / theta
    costheta, sintheta = jnp.cos(theta), jnp.sin(theta)
    tmp = jnp.dot(w, pt) * (1.0 - costheta)
    rotated = pt * costheta + jnp.cross(w, pt) * sintheta + w * tmp
    return jnp.where(nonzero, rotated, pt + jnp.cross(rot, pt))


def radial_distort(rad_params: jax.Array, proj: jax.Array) -> jax.Array:
    rsq = jnp.sum(proj * proj)
    return proj * (1.0 + rad_params[0] * rsq + rad_params[1] * rsq * rsq)


def project(cam: jax.Array, x: jax.Array) -> jax.Array:
    """ADBench's camera layout: rotation 0:3, centre 3:6, focal 6, principal point 7:9,
    radial distortion 9:11."""
    xcam = rodrigues_rotate_point(cam[0:3], x - cam[3:6])
    proj = radial_distort(cam[9:11], xcam[:2] / xcam[2])
    return proj * cam[6] + cam[7:9]


def reprojection_error(cam: jax.Array, x: jax.Array, w: jax.Array, feat: jax.Array) -> jax.Array:
    return w * (project(cam, x) - feat)


def weight_error(w: jax.Array) -> jax.Array:
    return 1.0 - w * w


def per_observation(fn: Callable) -> Callable:
    """fn(cam, X, w, feat) for every observation: f(cams, X, w, feats, obs) -> stacked results."""

    def mapped(cams, X, w, feats, obs):
        def one(o):
            ob, wi, feat = o
            return fn(cams[ob[0]], X[ob[1]], wi, feat)

        if obs.shape[0] <= CHUNK:  # (read when traced)
            return jax.vmap(one)((obs, w, feats))
        return lax.map(one, (obs, w, feats), batch_size=CHUNK)

    return mapped


def residuals(
    cams: jax.Array, X: jax.Array, w: jax.Array, feats: jax.Array, obs: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """All residuals: reprojection (p, 2) and weight (p,)."""
    return per_observation(reprojection_error)(cams, X, w, feats, obs), weight_error(w)


# ------------------------------------------------------------------ Jacobian blocks


def _block(dcam: jax.Array, dx: jax.Array, dw: jax.Array) -> jax.Array:
    """Derivatives with respect to (camera, point, weight) as one (2, 15) block."""
    return jnp.concatenate([dcam, dx, dw[:, None]], axis=1)


def jax_block(jac: Callable) -> Callable:
    """One observation's (2 x 15 block, weight-residual derivative) by jax.jacfwd / jacrev."""

    def block(
        cam: jax.Array, x: jax.Array, w: jax.Array, feat: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        return (
            _block(*jac(reprojection_error, argnums=(0, 1, 2))(cam, x, w, feat)),
            jax.grad(weight_error)(w),
        )

    return block


def accumulate_reprojection(
    acc: jax.Array, cam: jax.Array, x: jax.Array, w: jax.Array, feat: jax.Array
) -> jax.Array:
    """acc + residual: the accumulator is the state, undone by subtracting the residual."""
    return acc + reprojection_error(cam, x, w, feat)


def accumulate_weight(acc: jax.Array, w: jax.Array) -> jax.Array:
    return acc + weight_error(w)


def reversible_block(
    cam: jax.Array, x: jax.Array, w: jax.Array, feat: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The block as two VJPs of the reversible accumulation at acc = 0, one per residual row."""
    rev = jr.reversible(accumulate_reprojection)
    zero = jnp.zeros(2, cam.dtype)
    _, pullback = jax.vjp(lambda c, p, ww: rev(zero, c, p, ww, feat), cam, x, w)
    rows = jax.vmap(pullback)(jnp.eye(2, dtype=cam.dtype))
    dw = jax.grad(jr.reversible(accumulate_weight), argnums=1)(jnp.zeros((), w.dtype), w)
    return _block(*rows), dw


jacobian_jacfwd = per_observation(jax_block(jax.jacfwd))
jacobian_jacrev = per_observation(jax_block(jax.jacrev))
jacobian_reversible = per_observation(reversible_block)


def sparse_jacobian(
    blocks: np.ndarray, dw: np.ndarray, obs: np.ndarray, n: int, m: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    """The (2p + p) x (11n + 3m + p) Jacobian in coordinate form (rows, cols, vals, shape), laid
    out as ADBench's BASparseMat: reprojection rows 2i, 2i+1, then weight rows 2p + i; camera
    columns first, then points, then weights."""
    p = obs.shape[0]
    # int32 indices: the largest instance has 16.5 million columns; halves the assembly's memory
    i = np.arange(p, dtype=np.int32)
    obs = obs.astype(np.int32)
    cols = np.concatenate(
        [
            N_CAM_PARAMS * obs[:, :1] + np.arange(N_CAM_PARAMS, dtype=np.int32),
            N_CAM_PARAMS * n + 3 * obs[:, 1:] + np.arange(3, dtype=np.int32),
            (N_CAM_PARAMS * n + 3 * m + i)[:, None],
        ],
        axis=1,
    )  # (p, 15)
    rows = np.repeat(np.stack([2 * i, 2 * i + 1], axis=1), BLOCK_COLS, axis=1)  # (p, 30)
    return (
        np.concatenate([rows.ravel(), 2 * p + i]),
        np.concatenate([np.tile(cols, 2).ravel(), N_CAM_PARAMS * n + 3 * m + i]),
        np.concatenate([np.asarray(blocks).ravel(), np.asarray(dw)]),
        (3 * p, N_CAM_PARAMS * n + 3 * m + p),
    )


# ------------------------------------------------------------------ benchmark interface


def _resolve(size: str | Path | int) -> Path:
    if isinstance(size, int):
        matches = [f for f in ba_files() if f.name.startswith(f"ba{size}_")]
        if not matches:
            raise FileNotFoundError(f"no BA instance ba{size} in {data_dir() / 'ba'}")
        return matches[0]
    path = Path(size)
    return path if path.exists() else data_dir() / "ba" / path.name


def problem(size: str | Path | int) -> dict:
    """One BA instance for a benchmark: {"label", "args", "objective", "jaxrev", "jax",
    "jax_jacfwd", "measurements"}. `size` is a file name or an instance number (1 to 20). The
    callables take `*args` = (cams, X, w, feats, obs) and are jittable: "objective" gives all
    residuals, the others the Jacobian's blocks ((p, 2, 15), (p,)); "jax" is vmap(jacrev),
    "jax_jacfwd" vmap(jacfwd)."""
    path = _resolve(size)
    ba = read_ba(path)
    n, m, p = ba_size(path)
    return {
        "label": f"{path.stem} ({n} cameras, {m} points, {p} observations)",
        "args": tuple(jnp.asarray(ba[k]) for k in ("cams", "X", "w", "feats", "obs")),
        "objective": residuals,
        "jaxrev": jacobian_reversible,
        "jax": jacobian_jacrev,
        "jax_jacfwd": jacobian_jacfwd,
        "measurements": p,
    }


def sizes(quick: bool) -> list[str]:
    """File names of the instances to benchmark: a few, or all 20 (fewest observations first)."""
    files = ba_files()
    if quick:
        files = [
            f for f in files if int(re.match(r"ba(\d+)_", f.name).group(1)) in DEFAULT_INSTANCES
        ]
    return [f.name for f in files]


# ------------------------------------------------------------------ the run


def compiled(f: Callable, *args, reps: int = 3) -> tuple[object, float, int]:
    """Result, best time of the first call after compiling and `reps` more, and XLA's temporary
    memory in bytes."""
    c = jax.jit(f).lower(*args).compile()
    times = []
    for _ in range(1 + reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(c(*args))
        times.append(time.perf_counter() - t0)
    return out, min(times), int(c.memory_analysis().temp_size_in_bytes)


def rel_error(a, b) -> float:
    """max |a - b| / max |b| over all leaves."""
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def run(size: str) -> None:
    prob = problem(size)
    args = prob["args"]
    name = Path(size).stem.split("_")[0]
    p = prob["measurements"]
    reps = 3 if p < 300_000 else 0  # a large instance: its first run only, to save time
    print(f"\n{prob['label']}")
    (reproj, werr), t_obj, _ = compiled(prob["objective"], *args, reps=reps)
    fwd, t_fwd, m_fwd = compiled(prob["jax_jacfwd"], *args, reps=reps)
    rev, t_rev, m_rev = compiled(prob["jax"], *args, reps=reps)
    jrev, t_jrev, m_jrev = compiled(prob["jaxrev"], *args, reps=reps)
    err = max(rel_error(jrev, fwd), rel_error(rev, fwd))
    n, m = args[0].shape[0], args[1].shape[0]
    rows, cols, vals, shape = sparse_jacobian(*jrev, np.asarray(args[4]), n, m)
    print(
        f"  {name} objective time: {t_obj * 1e3:.2f} ms "
        f"(first residuals {float(reproj[0, 0]):.6f} {float(reproj[0, 1]):.6f} "
        f"{float(werr[0]):.6f})"
    )
    print(
        f"  {name} Jacobian time: jacfwd {t_fwd * 1e3:.2f} ms, jacrev {t_rev * 1e3:.2f} ms, "
        f"jr.reversible {t_jrev * 1e3:.2f} ms"
    )
    print(
        f"  {name} Jacobian temp memory: jacfwd {m_fwd} B, jacrev {m_rev} B, "
        f"jr.reversible {m_jrev} B"
    )
    print(f"  {name} Jacobian {shape[0]} x {shape[1]}, nnz: {vals.size} (31 per observation)")
    print(f"  {name} Jacobian blocks, max relative difference between the three: {err:.2e}")
    assert err < 1e-10, err
    assert vals.size == 31 * p and rows.max() < shape[0] and cols.max() < shape[1]
    assert np.array_equal(np.asarray(jrev[1]), -2 * np.asarray(args[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="all 20 instances (minutes, GBs)")
    t0 = time.perf_counter()
    print("ADBench bundle adjustment: objective and sparse Jacobian")
    for size in sizes(quick=not parser.parse_args().all):
        run(size)
    print(f"\nbundle_adjustment finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
