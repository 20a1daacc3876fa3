"""`apply_gate`: a k-qubit gate, optionally controlled, applied to a 2ⁿ state vector.

The state is viewed as an n-axis tensor of shape (2, …, 2), qubit 0 being the most significant
bit of the index (``state[i]`` with ``i = Σ_q bit_q 2^(n−1−q)``). A gate on `locs` contracts
its matrix with those axes; a control restricts the update to the slice where the control
qubits hold `ctrl_vals`. No 2ⁿ × 2ⁿ matrix is ever formed: the cost is O(2ⁿ 2ᵏ).

`apply_gate_p` is a JAX primitive with abstract evaluation, an XLA lowering (the same on CPU
and GPU), JVP in the state and the matrix, transpose in either, batching over states and over
matrices, an inverse rule (the adjoint for unitary gates, else the inverse matrix) and an
inverse-JVP rule. So `jr.reversible` differentiates circuits with memory independent of their
depth: the adjoint method of PennyLane and Yao, derived rather than hand-written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxrev._dense as dense
from jaxrev._compat import ShapedArray, is_symbolic_zero, is_undefined_primal, not_mapped
from jaxrev._env import Unknown
from jaxrev._primitive import make_primitive
from jaxrev.primitives.rotations import all_batched
from jaxrev.transforms.registry import Lossy, define

__all__ = ["apply_gate", "apply_gate_p"]


def apply_gate(
    state: Any,
    matrix: Any,
    locs: Sequence[int] | int,
    ctrl_locs: Sequence[int] | int = (),
    ctrl_vals: Sequence[int] | int = (),
    *,
    unitary: bool = True,
) -> jax.Array:
    """Apply the 2ᵏ × 2ᵏ `matrix` to qubits `locs` of `state`, where the qubits `ctrl_locs` hold
    `ctrl_vals`, as one invertible step.

    **Arguments:**

    - `state`: the state vector, of shape ``(..., 2ⁿ)``.
    - `matrix`: the gate, of shape ``(..., 2ᵏ, 2ᵏ)``; it may carry the same leading batch axes
      as `state`.
    - `locs`: the k qubits it acts on (an int or a sequence).
    - `ctrl_locs`: the control qubits (default none).
    - `ctrl_vals`: the values the controls must hold (default all 1).
    - `unitary`: True (the default) tells `reverse` to undo the gate with the adjoint (exact);
      with False it solves with the matrix instead.

    **Returns:**

    The new state, of `state`'s shape and the common dtype (complex64 or complex128 for quantum
    states).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> H = jnp.array([[1, 1], [1, -1]], jnp.complex64) / jnp.sqrt(2)
        >>> X = jnp.array([[0, 1], [1, 0]], jnp.complex64)
        >>> psi = jnp.zeros(4, jnp.complex64).at[0].set(1)       # |00>
        >>> psi = jr.apply_gate(psi, H, 0)                         # (|00> + |10>)/√2
        >>> psi = jr.apply_gate(psi, X, 1, ctrl_locs=0)            # CNOT: a Bell state
        >>> [round(float(abs(a) ** 2), 3) for a in psi]
        [0.5, 0.0, 0.0, 0.5]
    """
    locs = _as_tuple(locs)
    ctrl_locs = _as_tuple(ctrl_locs)
    ctrl_vals = _as_tuple(ctrl_vals) if ctrl_vals != () else (1,) * len(ctrl_locs)
    state, matrix = jnp.asarray(state), jnp.asarray(matrix)
    dtype = jnp.result_type(state, matrix)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(dtype, jnp.float32)
    state, matrix = state.astype(dtype), matrix.astype(dtype)
    _check(state.shape, matrix.shape, locs, ctrl_locs, ctrl_vals)
    return apply_gate_p.bind(
        state,
        matrix,
        locs=locs,
        ctrl_locs=ctrl_locs,
        ctrl_vals=ctrl_vals,
        rest=True,
        unitary=bool(unitary),
    )


def _as_tuple(x) -> tuple[int, ...]:
    if isinstance(x, (int, np.integer)):
        return (int(x),)
    return tuple(int(v) for v in x)


def _n_qubits(dim: int) -> int:
    n = int(dim).bit_length() - 1
    if dim < 1 or 1 << n != dim:
        raise ValueError(f"jr.apply_gate: the state's last axis must have length 2**n, got {dim}")
    return n


def _check(
    sshape: tuple,
    mshape: tuple,
    locs: Sequence[int],
    ctrl_locs: Sequence[int],
    ctrl_vals: Sequence[int],
) -> None:
    who = "jr.apply_gate"
    if len(sshape) < 1:
        raise ValueError(f"{who}: the state must be a vector of length 2**n, got a scalar")
    n = _n_qubits(sshape[-1])
    k = len(locs)
    if k == 0:
        raise ValueError(f"{who}: locs must name at least one qubit")
    every = locs + ctrl_locs
    if len(set(every)) != len(every):
        raise ValueError(f"{who}: locs {locs} and ctrl_locs {ctrl_locs} must be distinct qubits")
    if any(not 0 <= q < n for q in every):
        raise ValueError(
            f"{who}: qubits must lie in 0..{n - 1} for a {n}-qubit state, got "
            f"locs {locs}, ctrl_locs {ctrl_locs}"
        )
    if len(ctrl_vals) != len(ctrl_locs) or any(v not in (0, 1) for v in ctrl_vals):
        raise ValueError(
            f"{who}: ctrl_vals must be one 0 or 1 per control qubit, got "
            f"{ctrl_vals} for ctrl_locs {ctrl_locs}"
        )
    if len(mshape) < 2 or mshape[-2:] != (2**k, 2**k):
        raise ValueError(
            f"{who}: a gate on {k} qubit(s) needs a {2**k}x{2**k} matrix, got shape {mshape}"
        )
    mb = mshape[:-2]
    if mb and mb != tuple(sshape[:-1]):
        raise ValueError(
            f"{who}: the matrix's batch axes {mb} must match the state's {tuple(sshape[:-1])}"
        )


# --------------------------------------------------------------------------- the contraction


def _views(
    state: Any, locs: Sequence[int], ctrl_locs: Sequence[int], ctrl_vals: Sequence[int]
) -> Any:
    """The state as (batch..., 2, ..., 2), the index of the controlled slice, and the axes of
    `locs` inside that slice (controls are indexed away)."""
    nb = state.ndim - 1
    n = _n_qubits(state.shape[-1])
    psi = state.reshape(state.shape[:-1] + (2,) * n)
    ctrl = dict(zip(ctrl_locs, ctrl_vals))
    idx = (slice(None),) * nb + tuple(ctrl.get(q, slice(None)) for q in range(n))
    kept = [q for q in range(n) if q not in ctrl]
    axes = [nb + kept.index(q) for q in locs]
    return psi, idx, axes, nb


_SMALL_GATE = 2
"""Gates on at most this many qubits are applied as 4ᵏ fused multiply-adds of state slices:
on CPU that is several times faster than a `dot_general` with a 2ᵏ x 2ᵏ matrix, which XLA
turns into a transpose, a small matmul and a transpose back."""


def _contract(sub: Any, matrix: Any, axes: Sequence[int], nb: int) -> Any:
    """out[.., a, ..] = Σ_b M[a, b] sub[.., b, ..] over the qubit axes `axes`."""
    k = len(axes)
    if k <= _SMALL_GATE:
        return _contract_slices(sub, matrix, axes, nb)
    m = matrix.reshape(matrix.shape[:-2] + (2,) * (2 * k))
    sub_idx = list(range(sub.ndim))
    out_idx = list(sub_idx)
    new = list(range(sub.ndim, sub.ndim + k))
    for j, ax in enumerate(axes):
        out_idx[ax] = new[j]
    batch = sub_idx[:nb] if matrix.ndim > 2 else []
    m_idx = batch + new + [sub_idx[ax] for ax in axes]
    return jnp.einsum(m, m_idx, sub, sub_idx, out_idx)


def _slice_at(x, axes, bits):
    idx = [slice(None)] * x.ndim
    for ax, b in zip(axes, bits):
        idx[ax] = b
    return x[tuple(idx)]


def _bits(i: int, k: int) -> tuple[int, ...]:
    return tuple((i >> (k - 1 - j)) & 1 for j in range(k))


def _contract_slices(sub: Any, matrix: Any, axes: Sequence[int], nb: int) -> Any:
    k = len(axes)
    K = 2**k
    slices = [_slice_at(sub, axes, _bits(b, k)) for b in range(K)]
    rest = slices[0].ndim - nb

    def entry(a, b):  # M[.., a, b], broadcast over the slice's qubit axes
        e = matrix[..., a, b]
        return e.reshape(e.shape + (1,) * rest) if matrix.ndim > 2 else e

    outs = {_bits(a, k): sum(entry(a, b) * slices[b] for b in range(K)) for a in range(K)}
    # put the k axes back where they were: stack the highest axis first, each at its position
    # among the axes still missing
    order = sorted(range(k), key=lambda j: axes[j])
    for depth in reversed(range(k)):
        j = order[depth]
        pos = axes[j] - depth
        merged = {}
        for key in {kk[:j] + kk[j + 1 :] for kk in outs}:
            parts = [outs[key[:j] + (v,) + key[j:]] for v in (0, 1)]
            merged[key] = jnp.stack(parts, axis=pos)
        outs = merged
        # the remaining keys index the other loc axes, in `locs` order without j
        axes = [a for t, a in enumerate(axes) if t != j]
        order = sorted(range(len(axes)), key=lambda t: axes[t])
    return outs[()]


def _impl(state, matrix, *, locs, ctrl_locs, ctrl_vals, rest, unitary):
    state, matrix = jnp.asarray(state), jnp.asarray(matrix)
    psi, idx, axes, nb = _views(state, locs, ctrl_locs, ctrl_vals)
    if not ctrl_locs:
        return _contract(psi, matrix, axes, nb).reshape(state.shape)
    new = _contract(psi[idx], matrix, axes, nb)
    base = psi if rest else jnp.zeros_like(psi)
    return base.at[idx].set(new).reshape(state.shape)


def _matrix_cotangent(
    state: Any,
    ct: Any,
    matrix_aval: Any,
    locs: Sequence[int],
    ctrl_locs: Sequence[int],
    ctrl_vals: Sequence[int],
) -> Any:
    """Transpose of M ↦ apply(state, M) (restricted to the controlled slice):
    ct_M[a, b] = Σ ct[.., a, ..] state[.., b, ..]."""
    psi, idx, axes, nb = _views(state, locs, ctrl_locs, ctrl_vals)
    cpsi = ct.reshape(psi.shape)
    if ctrl_locs:
        psi, cpsi = psi[idx], cpsi[idx]
    k = len(axes)
    if k <= _SMALL_GATE:  # 4ᵏ fused products and sums, as in `_contract_slices`
        K = 2**k
        red = tuple(range(nb if len(matrix_aval.shape) > 2 else 0, psi.ndim - k))
        cs = [_slice_at(cpsi, axes, _bits(a, k)) for a in range(K)]
        ss = [_slice_at(psi, axes, _bits(b, k)) for b in range(K)]
        g = jnp.stack(
            [jnp.stack([jnp.sum(cs[a] * ss[b], axis=red) for b in range(K)], -1) for a in range(K)],
            -2,
        )
        return g.reshape(matrix_aval.shape).astype(matrix_aval.dtype)
    s_idx = list(range(psi.ndim))
    c_idx = list(s_idx)
    a_new = list(range(psi.ndim, psi.ndim + k))
    for j, ax in enumerate(axes):
        c_idx[ax] = a_new[j]
    batch = s_idx[:nb] if len(matrix_aval.shape) > 2 else []
    out_idx = batch + a_new + [s_idx[ax] for ax in axes]
    g = jnp.einsum(cpsi, c_idx, psi, s_idx, out_idx)
    return g.reshape(matrix_aval.shape).astype(matrix_aval.dtype)


# --------------------------------------------------------------------------- rules


def _abstract(state, matrix, *, locs, ctrl_locs, ctrl_vals, rest, unitary):
    _check(state.shape, matrix.shape, locs, ctrl_locs, ctrl_vals)
    if state.dtype != matrix.dtype:
        raise TypeError(
            f"jr.apply_gate: state and matrix dtypes differ ({state.dtype}, {matrix.dtype})"
        )
    return ShapedArray(state.shape, state.dtype)


def _jvp(primals, tangents, **params):
    state, matrix = primals
    ds, dm = tangents
    out = apply_gate_p.bind(state, matrix, **params)
    t = None
    if not is_symbolic_zero(ds):
        t = apply_gate_p.bind(ds, matrix, **params)
    if not is_symbolic_zero(dm):
        # the matrix's part acts on the controlled slice only
        tm = apply_gate_p.bind(state, dm, **{**params, "rest": False})
        t = tm if t is None else t + tm
    return out, (jnp.zeros_like(out) if t is None else t)


def _transpose(ct, state, matrix, **params):
    if is_symbolic_zero(ct):
        return [None, None]
    if is_undefined_primal(state) and is_undefined_primal(matrix):
        raise NotImplementedError("jr.apply_gate is bilinear, not linear, in (state, matrix)")
    if is_undefined_primal(state):
        # the transpose (not the adjoint) of the gate's operator: the transposed matrix
        return [apply_gate_p.bind(ct, jnp.swapaxes(matrix, -1, -2), **params), None]
    if params["rest"] and params["ctrl_locs"]:
        raise NotImplementedError(
            "jr.apply_gate with controls is affine, not linear, in the matrix"
        )
    return [
        None,
        _matrix_cotangent(
            state, ct, matrix.aval, params["locs"], params["ctrl_locs"], params["ctrl_vals"]
        ),
    ]


def _batch(args, dims, **params):
    ds, dm = dims
    if dm is not_mapped and jnp.ndim(args[1]) == 2:
        # one matrix for every state: the state's batch axis is one more leading axis
        return apply_gate_p.bind(jnp.moveaxis(args[0], ds, 0), args[1], **params), 0
    state, matrix = all_batched(args, dims)
    # per example the matrix has no batch axes or the state's: give it the state's
    missing = (state.ndim - 1) - (matrix.ndim - 2)
    if missing:
        matrix = matrix.reshape(matrix.shape[:1] + (1,) * missing + matrix.shape[1:])
        matrix = jnp.broadcast_to(matrix, state.shape[:-1] + matrix.shape[-2:])
    return apply_gate_p.bind(state, matrix, **params), 0


def _inverse_matrix(matrix, unitary):
    return jnp.conj(jnp.swapaxes(matrix, -1, -2)) if unitary else dense.inv(matrix)


def _inverse(out, state, matrix, *, locs, ctrl_locs, ctrl_vals, rest, unitary):
    if isinstance(matrix, Unknown):
        raise Lossy("the gate matrix is unknown (only the state can be recovered)")
    if not rest:
        raise Lossy(
            "this is the part of a controlled gate's derivative that zeroes the "
            "uncontrolled amplitudes"
        )
    params = dict(locs=locs, ctrl_locs=ctrl_locs, ctrl_vals=ctrl_vals, rest=rest, unitary=unitary)
    return [apply_gate_p.bind(out, _inverse_matrix(matrix, unitary), **params), None]


def _inverse_jvp(t_out, out, state, matrix, **params):
    return [apply_gate_p.bind(t_out, _inverse_matrix(matrix, params["unitary"]), **params), None]


# JAX's rules (the lowering is `_impl`'s, the same on CPU and GPU), then jaxrev's
apply_gate_p = make_primitive(
    "jaxrev_apply_gate",
    impl=_impl,
    abstract=_abstract,
    jvp=_jvp,
    transpose=_transpose,
    batch=_batch,
)
define(apply_gate_p, inverse=_inverse, inverse_jvp=_inverse_jvp)
