"""Batching helpers of the control-flow rules: tangents instantiated, batch axes moved to the front,
selects and switches whose predicate or index is batched, a closed jaxpr vmapped, a flag made
one for the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import (
    ClosedJaxpr,
    is_key,
    is_symbolic_zero,
    not_mapped,
    trace_to_closed,
)
from jaxrev._evaluate import eval_closed
from jaxrev._primitive import make_primitive


def instantiate_tangents(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, ...]:
    """Tangents as arrays, for JVP rules that run `jax.jvp` on an impl: symbolic zeros (or None)
    become zeros, float0 ones for integer primals."""
    out = []
    for p, t in zip(primals, tangents):
        if t is None or is_symbolic_zero(t):
            dt = jnp.result_type(p)
            t = (
                jnp.zeros(jnp.shape(p), dt)
                if jnp.issubdtype(dt, jnp.inexact)
                else np.zeros(jnp.shape(p), jax.dtypes.float0)
            )
        out.append(t)
    return tuple(out)


def batch_front(args: Sequence[Any], dims: Sequence[Any]) -> tuple[int, list, list]:
    """For a batching rule: (batch size, operands with their batch axis first, vmap in_axes)."""
    size = next(jnp.shape(x)[d] for x, d in zip(args, dims) if d is not not_mapped)
    args = [jnp.moveaxis(x, d, 0) if d is not not_mapped else x for x, d in zip(args, dims)]
    return size, args, [0 if d is not not_mapped else None for d in dims]


# --------------------------------------------------------------------------- batched selects


def where(pred: Any, a: Any, b: Any) -> Any:
    """`jnp.where` as one `select_n`. jaxrev's own selects do not go through `jnp.where`:
    JAX (0.12) caches that function's traced jaxpr per argument shapes, with the traceback of
    its first caller, and a user's `jnp.where` of the same shapes would then be blamed on the
    line where jaxrev first traced one."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if not is_key(a):  # a key array has no `astype` (two keys have one dtype anyway)
        dt = jnp.result_type(a, b)
        a, b = a.astype(dt), b.astype(dt)
    shape = jnp.broadcast_shapes(jnp.shape(pred), a.shape, b.shape)
    return jax.lax.select(
        jnp.broadcast_to(jnp.asarray(pred, bool), shape),
        jnp.broadcast_to(a, shape),
        jnp.broadcast_to(b, shape),
    )


def select_batched(pred: Any, new: Any, old: Any) -> Any:
    """Per-batch-element select; `pred` has the leading (batch) shape of the operands."""
    p = jnp.reshape(pred, jnp.shape(pred) + (1,) * (jnp.ndim(new) - jnp.ndim(pred)))
    return where(p, new, old)


def switch_batched(index: Any, fns: Sequence[Callable[..., Any]], *args: Any) -> Any:
    """`lax.switch(index, fns, *args)`, also for a batched index (a vmapped `jr.cond` or a
    branch index stored per element): then every branch runs and element b of each output
    leaf comes from branch `index[b]`. The index is clipped, as `lax.switch` does."""
    index = jnp.clip(index, 0, len(fns) - 1)
    if jnp.ndim(index) == 0:
        return jax.lax.switch(index, list(fns), *args)
    per = [f(*args) for f in fns]
    leaves = [jax.tree_util.tree_leaves(p) for p in per]
    out = []
    for k in range(len(leaves[0])):
        r = leaves[0][k]
        for b in range(1, len(fns)):
            r = select_batched(index == b, leaves[b][k], r)
        out.append(r)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(per[0]), out)


def vmap_closed(closed: ClosedJaxpr, in_axes: Sequence[Any], args: Sequence[Any]) -> ClosedJaxpr:
    """`closed` vmapped over `in_axes` (for the batching rules of primitives carrying jaxprs)."""
    fn = jax.vmap(lambda *a: eval_closed(closed, *a), in_axes=tuple(in_axes))
    new, consts, _ = trace_to_closed(
        fn, *[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in args]
    )
    assert not consts
    return new


def move_batch(x: Any, d: Any, size: int, force: bool) -> tuple[Any, Any]:
    """An operand with its batch axis first; an unbatched one is broadcast when `force`."""
    if d is None:
        if not force:
            return x, None
        return jnp.broadcast_to(x, (size,) + jnp.shape(x)), 0
    return jnp.moveaxis(x, d, 0), 0


def _any_in_batch_batch(args: Sequence[Any], dims: Sequence[Any]) -> tuple[Any, Any]:
    (flag,), (axis,) = args, dims
    return any_in_batch(jnp.any(flag, axis=axis)), not_mapped


def _any_in_batch_jvp(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
    (flag,) = primals
    return any_in_batch_p.bind(flag), np.zeros(jnp.shape(flag), jax.dtypes.float0)


any_in_batch_p = make_primitive(
    "jaxrev_any_in_batch",
    impl=lambda flag: flag,
    abstract=lambda aval: aval,
    lowering=lambda flag: flag,
    jvp=_any_in_batch_jvp,
    batch=_any_in_batch_batch,
)
"""``any_in_batch_p(flag)``: `flag`, except under `vmap`, where it is true for every sample
where it is true for any (the batch axis reduced by `any`): a decision of control flow that
every sample takes together."""


def any_in_batch(flag: Any) -> Any:
    """`flag` (a boolean array), true for the whole batch where any sample's is, under any
    number of `vmap`s; itself outside one. A loop whose trip count or stopping test is
    decided so runs as one loop for the batch: where it differs per sample, `vmap` runs the
    longest and selects every carried value per iteration."""
    return any_in_batch_p.bind(jnp.asarray(flag, bool))
