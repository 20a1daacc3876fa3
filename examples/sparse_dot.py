"""Gradients of a sparse-sparse dot product with respect to both matrices' non-zeros.

Run with `python examples/sparse_dot.py`. This is the NiLang paper's sparse benchmark
(sections 4.1 and 5.1, Table 2): trace(A^T B) = sum_ij A_ij B_ij for two random 1000 x 1000
matrices with 5% non-zeros, stored as `jax.experimental.sparse.BCOO` with sorted, unique indices.
The gradient with respect to A's stored values is B's value at the same position (0 where B has
none), and the other way round. A dense rule would not keep that sparsity.

The objective is written three ways:
- `merge_dot`: the paper's algorithm, as in Julia's SparseArrays and NiLang. Two pointers walk
  the sorted index lists of A and B. The one behind moves on; on equal positions the product is
  added to the accumulator and both move. It is a `lax.scan` over the nnz(A) + nnz(B) merge
  steps, with the state (ia, ib, acc). Adding a product is undone by subtracting it. A pointer
  move cannot be undone: from the new pointers alone one cannot tell which of them moved. That
  one branch decision is what the step loses, so it is kept with `jr.store`, 1 byte per step.
  This is NiLang's `branch_keeper`. `jr.reversible` rebuilds everything else by running the
  merge backwards.
- `pairs_dot`: the structure is fixed, so the merge can be done once, ahead of time, in NumPy
  (`match_pairs`). That is the symbolic phase of a sparse library. The numeric loop then only
  adds a[ia[t]] * b[ib[t]] over the matched pairs, and `jr.reversible` stores nothing.
- `vector_dot`: plain vectorised JAX for `jax.grad`. It matches positions with `searchsorted`,
  then gathers and sums.

`jax.experimental.sparse.bcoo_multiply_sparse` also computes A * B. At this size it would need
tens of gigabytes of temporary memory: its matching compares every non-zero of A with every
non-zero of B. The script prints XLA's figure for it, compiled but not run.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax

# Gradients are checked for exact equality with B's values: use float64 like the paper.
jax.config.update("jax_enable_x64", True)

import _timing  # noqa: E402  (beside this script)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import sparse  # noqa: E402

import jaxrev as jr  # noqa: E402

N, DENSITY = 1000, 0.05


# ------------------------------------------------------------------ data


def random_bcoo(rng: np.random.Generator, n: int, density: float = DENSITY) -> sparse.BCOO:
    """An n x n matrix with round(density n^2) normal non-zeros at distinct random positions,
    stored in row-major (CSR) order."""
    lin = np.sort(rng.choice(n * n, size=round(density * n * n), replace=False))
    idx = np.stack([lin // n, lin % n], axis=1).astype(np.int32)
    return sparse.BCOO(
        (jnp.asarray(rng.standard_normal(lin.size)), jnp.asarray(idx)),
        shape=(n, n),
        indices_sorted=True,
        unique_indices=True,
    )


def linear_index(m: sparse.BCOO) -> jnp.ndarray:
    """row * n + col of each stored entry: increasing, since the indices are sorted."""
    n = m.shape[1]
    assert m.shape[0] * n < 2**31, "int32 positions"
    return (m.indices[:, 0] * n + m.indices[:, 1]).astype(jnp.int32)


def match_pairs(a_lin, b_lin) -> tuple[np.ndarray, np.ndarray]:
    """The merge done once in NumPy: indices (ia, ib) of the positions A and B share."""
    _, ia, ib = np.intersect1d(
        np.asarray(a_lin), np.asarray(b_lin), assume_unique=True, return_indices=True
    )
    return ia.astype(np.int32), ib.astype(np.int32)


# ------------------------------------------------------------------ three objectives


def merge_dot(state, a_data, a_lin, b_data, b_lin):
    """One merge of the sorted position lists (the paper's `dot`): `state = (ia, ib, acc)` in,
    the state after nnz(A) + nnz(B) steps out, acc increased by trace(A^T B). Start at
    (0, 0, acc). Reversible in the state, with the matrices as parameters."""
    # A past-the-end position larger than any real one, with value 0: once a list runs out,
    # its pointer sits there (clipped reads) and only the other one moves.
    end = jnp.iinfo(jnp.int32).max
    a_e, b_e = jnp.append(a_data, 0.0), jnp.append(b_data, 0.0)
    al_e, bl_e = jnp.append(a_lin, end), jnp.append(b_lin, end)

    def step(carry, _):
        ia, ib, acc = carry
        ra, rb = al_e.at[ia].get(mode="clip"), bl_e.at[ib].get(mode="clip")
        # the branch: +1 A is behind, -1 B is behind, 0 same position. Keep it (1 byte): the
        # new pointers do not say which of them moved.
        d = jr.store((ra < rb).astype(jnp.int8) - (rb < ra).astype(jnp.int8))
        prod = a_e.at[ia].get(mode="clip") * b_e.at[ib].get(mode="clip")
        acc = acc + jnp.where(d == 0, prod, 0.0)  # undone by subtracting
        ia = ia + (d >= 0).astype(ia.dtype)  # undone knowing d
        ib = ib + (d <= 0).astype(ib.dtype)
        return (ia, ib, acc), None

    return lax.scan(step, state, None, length=a_data.shape[0] + b_data.shape[0])[0]


def merge_value(a_data, a_lin, b_data, b_lin):
    """trace(A^T B) by one merge (no differentiation machinery)."""
    zero = jnp.zeros((), jnp.int32)
    return merge_dot((zero, zero, jnp.zeros((), a_data.dtype)), a_data, a_lin, b_data, b_lin)[2]


def merge_value_reversible(a_data, a_lin, b_data, b_lin):
    """The same, through `jr.reversible`: its gradient runs the merge backwards."""
    zero = jnp.zeros((), jnp.int32)
    state = (zero, zero, jnp.zeros((), a_data.dtype))
    return jr.reversible(merge_dot)(state, a_data, a_lin, b_data, b_lin)[2]


def pairs_dot(acc, a_data, b_data, ia, ib):
    """acc + sum_t a[ia[t]] b[ib[t]] over the matched pairs: an accumulation loop."""
    if ia.shape[0] == 0:  # nothing in common (and an empty index array cannot be read)
        return acc

    def step(t, acc):
        return acc + a_data[ia[t]] * b_data[ib[t]]

    return lax.fori_loop(0, ia.shape[0], step, acc)


def pairs_value_reversible(a_data, b_data, ia, ib):
    return jr.reversible(pairs_dot)(jnp.zeros((), a_data.dtype), a_data, b_data, ia, ib)


def vector_dot(a_data, a_lin, b_data, b_lin):
    """trace(A^T B) vectorised: find each A position in B's sorted list, sum the hits."""
    pos = jnp.clip(jnp.searchsorted(b_lin, a_lin), 0, b_lin.shape[0] - 1)
    hit = b_lin[pos] == a_lin
    return jnp.sum(jnp.where(hit, a_data * b_data[pos], 0.0))


# d/d(a_data, b_data) of each
grad_merge_reversible = jax.jit(jax.grad(merge_value_reversible, argnums=(0, 2)))
grad_merge_plain = jax.jit(jax.grad(merge_value, argnums=(0, 2)))
grad_pairs_reversible = jax.jit(jax.grad(pairs_value_reversible, argnums=(0, 1)))
grad_vector = jax.jit(jax.grad(vector_dot, argnums=(0, 2)))


def problem(size: int = N) -> dict:
    """The benchmark workload: two random size x size matrices at 5% density. `args` are
    (A.data, A positions, B.data, B positions); the gradients are with respect to both data
    arrays. "jaxrev" runs the paper's merge backwards, "jax" differentiates the vectorised form."""
    rng = np.random.default_rng(0)
    A, B = random_bcoo(rng, size), random_bcoo(rng, size)
    return {
        "label": f"sparse dot trace(A^T B), {size}x{size} at density {DENSITY}",
        "args": (A.data, linear_index(A), B.data, linear_index(B)),
        "objective": merge_value,
        "jaxrev": grad_merge_reversible,
        "jax": grad_vector,
    }


# ------------------------------------------------------------------ the demo


def seconds_per_call(f: Callable, *args, number: int = 10, repeat: int = 5) -> float:
    """Best of `repeat` timings of `number` calls (after a warm-up call that compiles)."""
    return _timing.seconds_per_call(f, *args, number=number, repeat=repeat)


def temp_bytes(f: Callable, *args) -> int:
    """XLA's temporary-buffer size for jit(f) on these arguments (compiled, not run)."""
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


def main() -> None:
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    A, B = random_bcoo(rng, N), random_bcoo(rng, N)
    a, al, b, bl = A.data, linear_index(A), B.data, linear_index(B)
    ia, ib = match_pairs(al, bl)
    print(
        f"A, B: {N} x {N}, density {DENSITY}: {A.nse} and {B.nse} non-zeros, "
        f"{ia.size} positions in common"
    )

    # ---- the value, four ways
    Ad, Bd = A.todense(), B.todense()
    dense = float(jnp.sum(Ad * Bd))
    print(f"trace(A^T B) = {dense:.15f} (dense)")
    values = [
        ("merge loop", jax.jit(merge_value)(a, al, b, bl)),
        ("merge loop, jr.reversible", jax.jit(merge_value_reversible)(a, al, b, bl)),
        ("matched-pairs loop, jr.reversible", jax.jit(pairs_value_reversible)(a, b, ia, ib)),
        ("vectorised", jax.jit(vector_dot)(a, al, b, bl)),
    ]
    for label, v in values:
        err = abs(float(v) - dense) / abs(dense)
        print(f"  value by {label} vs dense, relative error: {err:.1e}")
        assert err < 1e-12, (label, err)

    # ---- gradients: d/dA.data is B at A's positions (0 where B has none), and vice versa
    want_a = Bd[A.indices[:, 0], A.indices[:, 1]]
    want_b = Ad[B.indices[:, 0], B.indices[:, 1]]
    grads = [
        ("jr.reversible of the merge", grad_merge_reversible(a, al, b, bl)),
        ("jax.grad of the merge", grad_merge_plain(a, al, b, bl)),
        ("jr.reversible of the matched-pairs loop", grad_pairs_reversible(a, b, ia, ib)),
        ("jax.grad of the vectorised form", grad_vector(a, al, b, bl)),
    ]
    print(f"\ngradients ({int(jnp.sum(want_a != 0))} of A's {A.nse} entries have a partner in B):")
    for label, (ga, gb) in grads:
        err = max(float(jnp.max(jnp.abs(ga - want_a))), float(jnp.max(jnp.abs(gb - want_b))))
        print(f"  {label}: max abs error vs B at A's non-zeros (and A at B's): {err:.1e}")
        assert err == 0.0, (label, err)  # each entry is one product: exact
    for label, (ga, gb) in grads[1:]:
        ra, rb = grads[0][1]
        same = bool(jnp.array_equal(ga, ra) and jnp.array_equal(gb, rb))
        print(f"  reversible merge gradient equal to {label}: {same}")
        assert same

    # ---- memory: the merge's branch decisions are all reversible stores
    state0 = (jnp.int32(0), jnp.int32(0), jnp.float64(0.0))
    # what inversion stores (the default also lists its √T checkpoints of the carry)
    report = jr.memory_report(merge_dot, state0, a, al, b, bl, checkpoint_every=None)
    print(
        f"\njr.reversible of the merge stores {report.total_bytes} bytes "
        f"({report.total_bytes / (A.nse + B.nse):g} per merge step: the branch decision)"
    )
    pairs_report = jr.memory_report(
        pairs_dot, jnp.float64(0.0), a, b, ia, ib, checkpoint_every=None
    )
    print(f"jr.reversible of the matched-pairs loop stores {pairs_report.total_bytes} bytes")
    m_rev = temp_bytes(grad_merge_reversible, a, al, b, bl)
    m_ref = temp_bytes(grad_merge_plain, a, al, b, bl)
    print(f"merge gradient temp memory: reversible {m_rev} B, jax.grad {m_ref} B")
    m_bcoo = temp_bytes(lambda A, B: sparse.bcoo_multiply_sparse(A, B).data.sum(), A, B)
    print(f"bcoo_multiply_sparse(A, B) temp memory (compiled, not run): {m_bcoo / 1e9:.1f} GB")

    # ---- timings
    print("\ntimings (CPU, jit, warm, best of 5), seconds:")
    rows = [
        ("objective, merge loop", jax.jit(merge_value), (a, al, b, bl)),
        (
            "objective, matched-pairs loop",
            jax.jit(lambda a, b, ia, ib: pairs_dot(0.0, a, b, ia, ib)),
            (a, b, ia, ib),
        ),
        ("objective, vectorised", jax.jit(vector_dot), (a, al, b, bl)),
        ("gradient, jr.reversible of the merge", grad_merge_reversible, (a, al, b, bl)),
        ("gradient, jax.grad of the merge", grad_merge_plain, (a, al, b, bl)),
        ("gradient, jr.reversible of matched pairs", grad_pairs_reversible, (a, b, ia, ib)),
        ("gradient, jax.grad of the vectorised form", grad_vector, (a, al, b, bl)),
    ]
    for label, f, args in rows:
        print(f"  {label:42s} {seconds_per_call(f, *args):.3e}")
    print(
        "  (NiLang paper, Table 2, Xeon Gold 6230: Julia dot 3.493e-04, NiLang objective "
        "4.675e-04, NiLang backward 5.821e-04)"
    )
    print(f"sparse_dot finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
