"""ADBench's Gaussian mixture model objective and its gradient, with `jax.grad` and `jr.reversible`.

Run with `python examples/gmm.py` (add `--all` for every 10k-point input with D <= 32). This is
the GMM benchmark of ADBench (Srajer et al. 2018) that the NiLang paper reproduces in its Table 5:
the log-likelihood of n = 10000 points under a K-component Gaussian mixture in D dimensions, each
component's precision given by its inverse Cholesky factor Q_k (log-diagonal q_k, strictly lower
part l_k), plus a log-Wishart prior on the Q_k:

    -nD/2 log 2pi + sum_i logsumexp_k(alpha_k + sum(q_k) - |Q_k (x_i - mu_k)|^2 / 2)
    - n logsumexp(alpha)
    + sum_k [gamma^2/2 (|exp(q_k)|^2 + |l_k|^2) - m sum(q_k)] - K C(gamma, m, D),

computed exactly as ADBench's reference implementation does (`gmm_objective` in its C++ code), on
ADBench's own input files. The gradient with respect to (alpha, mu, icf) is taken two ways:

- `jax.grad` of a vectorised implementation (every point against every component at once);
- `jax.grad` through `jr.reversible` of a `lax.scan` over the points that adds each block's
  log-sum-exp terms to an accumulator. The accumulator is the scan's only carry, and
  `acc + term(x, theta)` is undone by subtracting the term again, so the backward sweep keeps no
  per-point values: its memory depends on the block size, not on n. The prior and the constants
  are added outside the reversible part.

It checks that the two gradients agree to 1e-10 relative and against central finite differences,
and prints the objective, the times and XLA's temporary memory of both gradients.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax

# The reversible gradient is checked against jax.grad to 1e-10 relative: float64 is needed.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from adbench_io import data_dir, gmm_files, gmm_size, read_gmm  # noqa: E402
from jax import lax  # noqa: E402

import jaxrev as jr  # noqa: E402

# Points per scan iteration of the reversible version. One point per iteration leaves each
# iteration a few tiny (K x D) operations, so loop and dispatch overhead dominate (measured once
# on a busy 2-core CPU at D = 10, K = 10: 50 ms per gradient, against 7 ms with blocks of 100 and
# 21 ms for jax.grad of the vectorised version). A block of 100 points makes each iteration one
# batched product that stays in cache; 1000 was slower again (11 ms) at 10x the memory. The
# backward sweep's memory grows with the block, not with n.
BLOCK = 100
DEFAULT_SIZES = [(2, 5), (2, 10), (10, 5), (10, 10)]


# ------------------------------------------------------------------ the objective


def logsumexp(x: jax.Array, axis: int = -1) -> jax.Array:
    """ADBench's log-sum-exp: log(sum(exp(x - max))) + max. The max's own derivative cancels
    out of the result, so it is held constant (jax.grad would otherwise route the cancelling
    terms through the argmax)."""
    mx = lax.stop_gradient(jnp.max(x, axis=axis, keepdims=True))
    return jnp.log(jnp.sum(jnp.exp(x - mx), axis=axis)) + jnp.squeeze(mx, axis)


def lower_indices(d: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each entry of l_k: ADBench stores the strictly lower triangle column by
    column (Qtimesx: for i < d, for j > i: out[j] += l[idx++] * x[i])."""
    rows, cols = zip(*[(j, i) for i in range(d) for j in range(i + 1, d)]) if d > 1 else ((), ())
    return np.array(rows, dtype=int), np.array(cols, dtype=int)


def precision_factors(icf: jax.Array, d: int) -> jax.Array:
    """Q_k (K, D, D): diagonal exp(q_k), strictly lower part l_k, zeros above."""
    rows, cols = lower_indices(d)
    lower = jnp.zeros((icf.shape[0], d, d), icf.dtype).at[:, rows, cols].set(icf[:, d:])
    return lower + jax.vmap(jnp.diag)(jnp.exp(icf[:, :d]))


def main_terms(x: jax.Array, alphas: jax.Array, means: jax.Array, icf: jax.Array) -> jax.Array:
    """alpha_k + sum(q_k) - |Q_k (x_i - mu_k)|^2 / 2 for the points x (b, D): shape (K, b)."""
    d = x.shape[-1]
    # Components first: Q_k (x_i - mu_k) is then one (b x D) @ (D x D) product per component,
    # a batched GEMM. (Points first, `kij,bkj->bki`, made jax.grad 2-6x slower on CPU.)
    xc = x[None, :, :] - means[:, None, :]  # (K, b, D)
    qxc = jnp.einsum("kbj,kij->kbi", xc, precision_factors(icf, d))  # Q_k (x_i - mu_k)
    return (alphas + jnp.sum(icf[:, :d], axis=1))[:, None] - 0.5 * jnp.sum(qxc**2, axis=-1)


def log_gamma_distrib(a: float, p: int) -> float:
    """The multivariate log-gamma function log Gamma_p(a), as ADBench writes it."""
    return 0.25 * p * (p - 1) * math.log(math.pi) + sum(
        math.lgamma(a + 0.5 * (1 - j)) for j in range(1, p + 1)
    )


def log_wishart_prior(icf: jax.Array, gamma: float, m: int) -> jax.Array:
    """ADBench's log_wishart_prior: sum_k [gamma^2/2 |Q_k|_F^2 - m sum(q_k)] - K C."""
    k, d = icf.shape[0], _dim(icf)
    n = d + m + 1
    c = n * d * (math.log(gamma) - 0.5 * math.log(2)) - log_gamma_distrib(0.5 * n, d)
    q, ltri = icf[:, :d], icf[:, d:]
    frobenius = jnp.sum(jnp.exp(q) ** 2, axis=1) + jnp.sum(ltri**2, axis=1)
    return jnp.sum(0.5 * gamma * gamma * frobenius - m * jnp.sum(q, axis=1)) - k * c


def _dim(icf: jax.Array) -> int:
    # icf has D(D+1)/2 columns
    return int(round((math.sqrt(8 * icf.shape[1] + 1) - 1) / 2))


def outer_terms(alphas: jax.Array, icf: jax.Array, n: int, gamma: float, m: int) -> jax.Array:
    """Everything but the sum over points: the constant, -n logsumexp(alpha) and the prior."""
    d = _dim(icf)
    constant = -n * d * 0.5 * math.log(2 * math.pi)
    return constant - n * logsumexp(alphas) + log_wishart_prior(icf, gamma, m)


def make_objective(gamma: float, m: int) -> Callable[..., jax.Array]:
    """The vectorised objective f(alphas, means, icf, x): all points against all components."""

    def objective(alphas, means, icf, x):
        slse = jnp.sum(logsumexp(main_terms(x, alphas, means, icf), axis=0))
        return slse + outer_terms(alphas, icf, x.shape[0], gamma, m)

    return objective


# ------------------------------------------------------------------ the reversible version


def sum_over_points(
    acc: jax.Array, blocks: jax.Array, alphas: jax.Array, means: jax.Array, icf: jax.Array
) -> jax.Array:
    """acc + sum_i logsumexp_k(main term), as a scan over blocks (nb, BLOCK, D) of points. The
    accumulator is the state: each iteration adds to it, so the backward sweep undoes an
    iteration by subtracting, from values it has (the block and the parameters)."""

    def body(acc, xb):
        return acc + jnp.sum(logsumexp(main_terms(xb, alphas, means, icf), axis=0)), None

    return lax.scan(body, acc, blocks)[0]


def make_reversible_objective(gamma: float, m: int) -> Callable[..., jax.Array]:
    """The same objective with the sum over points inside `jr.reversible`."""
    rev_sum = jr.reversible(sum_over_points)

    def objective(alphas, means, icf, x):
        n, d = x.shape
        whole = n - n % BLOCK
        slse = rev_sum(jnp.zeros((), x.dtype), x[:whole].reshape(-1, BLOCK, d), alphas, means, icf)
        if whole < n:  # a last partial block (not in ADBench's inputs, whose n is 1k or 10k)
            rest = main_terms(x[whole:], alphas, means, icf)
            slse = slse + jnp.sum(logsumexp(rest, axis=0))
        return slse + outer_terms(alphas, icf, n, gamma, m)

    return objective


# ------------------------------------------------------------------ benchmark interface


def _resolve(size: str | Path | tuple[int, int]) -> Path:
    if isinstance(size, tuple):
        return data_dir() / "gmm" / "10k" / f"gmm_d{size[0]}_K{size[1]}.txt"
    path = Path(size)
    if path.exists():
        return path
    for subset in ("10k", "1k"):
        if (data_dir() / "gmm" / subset / path.name).exists():
            return data_dir() / "gmm" / subset / path.name
    raise FileNotFoundError(f"no GMM input {size!r} in {data_dir() / 'gmm'}")


def problem(size: str | Path | tuple[int, int]) -> dict:
    """One GMM instance for a benchmark: {"label", "args", "objective", "jaxrev", "jax",
    "parameters"}. `size` is a (D, K) pair (a 10k-point input) or a file name. The callables
    take `*args` = (alphas, means, icf, x) and are jittable; "jaxrev" and "jax" return the
    gradient (d alphas, d means, d icf)."""
    path = _resolve(size)
    g = read_gmm(path)
    k, d = g["means"].shape
    args = tuple(jnp.asarray(g[key]) for key in ("alphas", "means", "icf", "x"))
    objective = make_objective(g["gamma"], g["m"])
    rev_objective = make_reversible_objective(g["gamma"], g["m"])
    return {
        "label": f"{path.parent.name}/{path.stem} (D={d}, K={k}, n={g['x'].shape[0]})",
        "args": args,
        "objective": objective,
        "jaxrev": jax.grad(rev_objective, argnums=(0, 1, 2)),
        "jax": jax.grad(objective, argnums=(0, 1, 2)),
        "parameters": k + k * d + k * d * (d + 1) // 2,
    }


def sizes(quick: bool) -> list[tuple[int, int]]:
    """(D, K) of the inputs to benchmark: a few small ones, or every 10k-point input, D <= 32."""
    if quick:
        return list(DEFAULT_SIZES)
    return [gmm_size(f) for f in gmm_files("10k") if gmm_size(f)[0] <= 32]


# ------------------------------------------------------------------ the run


def compiled(f: Callable, *args) -> tuple[object, float, int, Callable]:
    """Result, best time of three runs after compiling, XLA's temporary memory in bytes, and
    the compiled function."""
    c = jax.jit(f).lower(*args).compile()
    out = jax.block_until_ready(c(*args))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(c(*args))
        times.append(time.perf_counter() - t0)
    return out, min(times), int(c.memory_analysis().temp_size_in_bytes), c


def rel_error(a, b) -> float:
    """max |a - b| / max |b| over all leaves."""
    a, b = (np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def finite_difference_error(
    objective: Callable, args: tuple, grad: tuple, h: float = 1e-5
) -> float:
    """Largest error of a few gradient entries against central differences of the (compiled)
    objective, relative to the largest gradient entry of the same array."""
    worst = 0.0
    d = args[1].shape[1]
    # first logit, a mean coordinate, a log-diagonal entry and (D > 1) a lower-triangle entry
    coords = [(0, (0,)), (1, (0, d - 1)), (2, (0, 0)), (2, (args[2].shape[0] - 1, d - 1))]
    if d > 1:
        coords.append((2, (0, args[2].shape[1] - 1)))
    for arg, idx in coords:
        plus, minus = list(args), list(args)
        plus[arg] = args[arg].at[idx].add(h)
        minus[arg] = args[arg].at[idx].add(-h)
        fd = (float(objective(*plus)) - float(objective(*minus))) / (2 * h)
        worst = max(worst, abs(fd - float(grad[arg][idx])) / float(jnp.max(jnp.abs(grad[arg]))))
    return worst


def temp_memory(size: str | Path | tuple[int, int]) -> tuple[int, int]:
    """XLA's temporary memory of the (jax.grad, jr.reversible) gradients, compiled, not run."""
    prob = problem(size)
    return tuple(
        int(jax.jit(prob[key]).lower(*prob["args"]).compile().memory_analysis().temp_size_in_bytes)
        for key in ("jax", "jaxrev")
    )


def run(size: tuple[int, int]) -> tuple[int, int]:
    """Objective, both gradients, their checks; returns the two gradients' temp memory."""
    prob = problem(size)
    args = prob["args"]
    name = f"D={size[0]} K={size[1]}"
    print(f"\n{prob['label']}: {prob['parameters']} parameters")
    value, t_obj, _, objective = compiled(prob["objective"], *args)
    g_ref, t_ref, m_ref, _ = compiled(prob["jax"], *args)
    g_rev, t_rev, m_rev, _ = compiled(prob["jaxrev"], *args)
    err = rel_error(g_rev, g_ref)
    fd_err = finite_difference_error(objective, args, g_ref)
    print(f"  {name} objective: {float(value):.10e} ({t_obj * 1e3:.2f} ms)")
    print(
        f"  {name} gradient time: jax.grad {t_ref * 1e3:.2f} ms, jr.reversible {t_rev * 1e3:.2f} ms"
    )
    print(f"  {name} gradient temp memory: jax.grad {m_ref} B, jr.reversible {m_rev} B")
    print(f"  {name} gradient vs jax.grad, relative error: {err:.2e}")
    print(f"  {name} jax.grad vs central differences, relative error: {fd_err:.2e}")
    assert err < 1e-10, err
    assert fd_err < 1e-6, fd_err
    return m_ref, m_rev


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--all",
        action="store_true",
        help="every 10k-point input with D <= 32 (minutes, and GBs for jax.grad)",
    )
    t0 = time.perf_counter()
    todo = sizes(quick=not parser.parse_args().all)
    print(f"ADBench GMM, 10k points; reversible scan over blocks of {BLOCK} points")
    memory = {size: run(size) for size in todo}

    # The same D and K with 1000 points instead of 10000 (ADBench's 1k inputs): jax.grad's
    # memory follows n, the reversible gradient's does not (its default checkpoints, every
    # ⌈√T⌉ blocks, are a few parameter-sized carries).
    d, k = 10, 10
    small = temp_memory(data_dir() / "gmm" / "1k" / f"gmm_d{d}_K{k}.txt")
    large = memory.get((d, k)) or temp_memory((d, k))
    print(
        f"\nD={d} K={k} gradient temp memory, n = 1000 -> 10000: jax.grad {small[0]} -> "
        f"{large[0]} B, jr.reversible {small[1]} -> {large[1]} B"
    )
    assert large[1] < 2 * small[1] and large[0] > 5 * small[0]
    print(f"\ngmm finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
