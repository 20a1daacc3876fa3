"""numpy forms of primitives, for what the walks compute from constants when they trace.

The element-level and log-det walks run the program's moves (slices, pads, concatenations)
on arrays of positions, and `Statics` runs a loop's integer bookkeeping at every iteration
(`Statics.enum`). Through JAX, each new primitive, shape and params is compiled as an XLA
program of its own, about 20 ms each: ten of them in a spline flow's first call. These
compute the same values on the host, exactly (moves copy; integer and boolean arithmetic
wraps and compares as XLA's does), and decline (None) what they do not know: the caller
then runs JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxrev._compat import JaxprEqn

__all__ = ["moves", "elementwise"]


def _pad(x: np.ndarray, value: Any, *, padding_config: Sequence, **_: Any) -> np.ndarray:
    for axis, (lo, hi, interior) in enumerate(padding_config):
        n = x.shape[axis]
        if interior and n:
            spread = np.full(
                x.shape[:axis] + ((n - 1) * (interior + 1) + 1,) + x.shape[axis + 1 :],
                value,
                x.dtype,
            )
            spread[(slice(None),) * axis + (slice(None, None, interior + 1),)] = x
            x = spread
        widths = [(0, 0)] * x.ndim
        widths[axis] = (max(lo, 0), max(hi, 0))
        x = np.pad(x, widths, constant_values=value)
        stop = x.shape[axis] - max(-hi, 0)
        x = x[(slice(None),) * axis + (slice(max(-lo, 0), stop),)]
    return x


def _starts(x: np.ndarray, starts: Sequence[Any], sizes: Sequence[int]) -> tuple:
    # (XLA clamps a dynamic slice's start so that the window fits)
    return tuple(
        slice(int(np.clip(int(s), 0, n - k)), int(np.clip(int(s), 0, n - k)) + k)
        for s, n, k in zip(starts, x.shape, sizes)
    )


def _dynamic_update(x: np.ndarray, u: np.ndarray, *starts: Any) -> np.ndarray:
    out = np.array(x)
    out[_starts(x, starts, u.shape)] = u
    return out


def _broadcast(x: np.ndarray, *, shape: Sequence[int], broadcast_dimensions, **_: Any) -> Any:
    lifted = np.ones(len(shape), np.int64)
    lifted[list(broadcast_dimensions)] = x.shape
    return np.broadcast_to(x.reshape(tuple(lifted)), tuple(shape))


def _select(which: np.ndarray, *cases: np.ndarray) -> np.ndarray:
    """`select_n` as XLA lowers it: a boolean picks case 1 where true; an integer halves the
    cases by ``which < mid`` (so an index past the end takes the last case, a negative one
    the first), with no limit on the number of cases."""
    if np.asarray(which).dtype == bool:
        return np.where(which, cases[1], cases[0])

    def pick(offset: int, part: Sequence[np.ndarray]) -> np.ndarray:
        if len(part) == 1:
            return np.asarray(part[0])
        mid = len(part) // 2
        return np.where(
            which < offset + mid, pick(offset, part[:mid]), pick(offset + mid, part[mid:])
        )

    return pick(0, cases)


_ON_HOST: dict[str, Callable[..., Any]] = {
    "slice": lambda x, *, start_indices, limit_indices, strides=None, **_: x[
        tuple(
            slice(a, b, c) for a, b, c in zip(start_indices, limit_indices, strides or [1] * x.ndim)
        )
    ],
    "concatenate": lambda *xs, dimension, **_: np.concatenate(xs, axis=dimension),
    "pad": _pad,
    "reshape": lambda x, *, new_sizes, dimensions=None, **_: (
        np.reshape(x, tuple(new_sizes)) if dimensions is None else None
    ),
    "broadcast_in_dim": lambda x, *dyn, **p: None if dyn else _broadcast(x, **p),
    "transpose": lambda x, *, permutation, **_: np.transpose(x, permutation),
    "squeeze": lambda x, *, dimensions, **_: np.squeeze(x, axis=tuple(dimensions)),
    "rev": lambda x, *, dimensions, **_: np.flip(x, axis=tuple(dimensions)),
    "copy": lambda x, **_: np.array(x),
    "copy_p": lambda x, **_: np.array(x),
    "select_n": _select,
    "dynamic_slice": lambda x, *starts, slice_sizes, **_: x[_starts(x, starts, slice_sizes)],
    "dynamic_update_slice": lambda x, u, *starts, **_: _dynamic_update(x, u, *starts),
}
"""numpy forms of the primitives that move elements (`moves`)."""


_DATA = {"pad": 2, "dynamic_slice": 1, "dynamic_update_slice": 2}
"""How many leading operands are data (the rest: indices), where not all are."""


def _numpy(xs: Sequence[Any]) -> bool:
    return all(isinstance(x, (np.ndarray, np.generic)) for x in xs)


def moves(eqn: JaxprEqn, invals: Sequence[Any]) -> np.ndarray | None:
    """The output of `eqn`, a primitive that moves elements, on host arrays (positions), in
    their dtype (the equation's own is the program's, often a float); None where this
    module does not know it."""
    name = eqn.primitive.name
    rule = _ON_HOST.get(name)
    if rule is None or not _numpy(invals) or len(eqn.outvars) != 1:
        return None
    # (operands of different dtypes, a float padding value beside integer positions: JAX
    # refuses them, and the caller's fallback says so; numpy would cast one silently)
    data = invals[1:] if name == "select_n" else invals[: _DATA.get(name, len(invals))]
    if len({np.asarray(x).dtype for x in data}) > 1:
        return None
    out = rule(*invals, **eqn.params)
    if out is None:
        return None
    out = np.asarray(out)
    if out.shape != tuple(eqn.outvars[0].aval.shape):
        return None
    return out.astype(np.asarray(data[0]).dtype)


_ELEMENTWISE: dict[str, Callable[..., Any]] = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "neg": np.negative,
    "max": np.maximum,
    "min": np.minimum,
    "abs": np.abs,
    "sign": np.sign,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
    "and": np.bitwise_and,
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "not": np.invert,
    "clamp": lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi),
    "select_n": _select,
    "convert_element_type": lambda x: x,  # (cast to the output's dtype below)
}
"""Elementwise integer and boolean primitives (no division: XLA's truncates, numpy floors)."""


def elementwise(eqn: JaxprEqn, invals: Sequence[Any]) -> np.ndarray | None:
    """The output of an elementwise integer or boolean `eqn` on host arrays, operands of one
    shape or with a leading axis more (every iteration of a loop at once: `Statics.enum`),
    broadcast as numpy does; None where this module does not know it (a float, a division)."""
    rule = _ELEMENTWISE.get(eqn.primitive.name)
    if rule is None or not _numpy(invals) or len(eqn.outvars) != 1:
        return None
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    kinds = [np.asarray(x).dtype.kind for x in invals] + [out_dtype.kind]
    if any(k not in "biu" for k in kinds):
        return None
    with np.errstate(over="ignore"):  # (integers wrap, as XLA's do)
        return np.asarray(rule(*invals)).astype(out_dtype)
