"""Element-level propagation (docs/design.md §3.5): values known on some of their elements.

Knowledge is per element, not per array. A variable known on part of its elements is held in
`Env.part` as a `Part`: an array right outside an unknown `Region`, plus windows known besides
(what a loop's ``x[i]`` read gives back). The walker calls `forward` and `backward` for every
equation next to such knowledge; they apply, in this order:

1. the primitive's own `element_rules` (`select_n` with a known predicate, `mul` by a factor
   with zeros, scatters, dynamic slices: `rules.indexing`);
2. for `ELEMENTWISE` primitives, the primitive itself forward and its inverse rule backward on
   the partly known arrays (each element depends on the same element only, so the result is
   known where every operand is);
3. for `STRUCTURAL` primitives (reshape, slices, concatenate, pad, gathers with static
   indices, ...), the positions each output element is copied from (an index map, computed once
   by running the primitive on the positions themselves), forward and backward.

Garbage stays where it is unknown: before an array enters a computation its unknown elements
are replaced by a harmless value (`FILL`), so no NaN or infinity is made there (which would
turn into a NaN derivative through the `select` that finally drops it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._cache import memo
from jaxrev._compat import (
    CALL_PRIMITIVES,
    DropVar,
    JaxprEqn,
    ShapedArray,
    Var,
    call_jaxpr,
    is_concrete,
    is_key,
    prims,
    scan_info,
)
from jaxrev._env import Env, Unknown, fit_to_aval, is_unknown
from jaxrev._evaluate import apply, apply_on_host
from jaxrev._graph import is_var, real_outvars
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.registry import (
    ELEMENTWISE,
    STRUCTURAL,
    ElementResult,
    Lossy,
    NeedMore,
    broadcasts_to,
    element_rules,
    elementwise_over,
    index_args,
    inverse_rules,
    is_kind,
)

__all__ = [
    "Part",
    "FILL",
    "forward",
    "backward",
    "learn",
    "learn_piece",
    "joins_known",
    "complete",
    "region_of",
    "value_of",
    "static_of",
    "is_partial",
    "WindowWrite",
    "written_window",
    "through_window",
    "windows_apart",
    "read_window",
    "not_case",
    "token",
    "per_element",
    "reached_per_element",
    "per_element_forward",
]

FILL = 0.5
"""What unknown elements hold when an array enters a computation: no inverse rule or primitive
of a one-to-one map makes a NaN or an infinity of it (log, arctanh, 1/x, logit, sqrt)."""

MAX_LEARN = 32
"""Updates of one variable's partial knowledge, at most, per walk, beyond one per element (a
guard, never reached by a program that makes progress: each update shrinks the unknown region;
an autoregressive map learns one element per update, D of them)."""


def _learn_cap(v: Any) -> int:
    return MAX_LEARN + int(np.prod(v.aval.shape, dtype=np.int64))


@dataclass
class Part:
    """A variable known outside `region`: `value` is right outside `base`, and `pieces` hold
    windows known besides (``(Win, values)``); `value` is None while only pieces are known."""

    value: Any
    base: R.Region
    pieces: tuple = ()
    region: R.Region = R.FULL
    clean: Any = None  # value with garbage replaced by FILL, made when first asked for
    learned: int = 0


# --------------------------------------------------------------------------- reading


def token(env: Env, v: Any) -> Any:
    """What is known of `v`, as something that changes whenever that does."""
    if env.known(v):
        return True
    p = env.part.get(v) if is_var(v) else None
    return None if p is None else id(p)


def is_partial(env: Env, v: Any) -> bool:
    """Whether `v` is known on some of its elements only."""
    return is_var(v) and v in env.part


def static_of(env: Env, v: Any) -> np.ndarray | None:
    return env.info.static(v)


def region_of(env: Env, v: Any) -> R.Region:
    """Where `v` is not known: EMPTY, FULL, or a region."""
    if env.known(v):
        return R.EMPTY
    p = env.part.get(v) if is_var(v) else None
    return R.FULL if p is None else p.region


def region_on(env: Env, v: Any, shape: tuple) -> R.Region:
    """`v`'s unknown region on an array of `shape` it is broadcast to (a scalar operand of an
    elementwise op: unknown anywhere is unknown everywhere; one broadcast over size-1 axes:
    its region carried through the broadcast, `reads_relation`)."""
    r = region_of(env, v)
    own = tuple(np.shape(v.aval))
    if own == tuple(shape) or r in (R.EMPTY, R.FULL):
        return r
    if len(own) != len(shape):
        return R.FULL
    # (broadcast over size-1 axes, a softmax's max per row: carried through the relation)
    rel = reads_relation("broadcast", own, tuple(shape))
    return R.FULL if rel is None else R.spread(r, rel, tuple(shape))


def reads_relation(
    kind: str, shape: tuple, out_shape: tuple, lead: tuple | None = None
) -> np.ndarray | None:
    """``(positions of out_shape, positions of shape)``, flattened: which elements of an array
    of `shape` each element of one of `out_shape` reads, for `kind` "broadcast" (over size-1
    axes) or "rows" (both shapes start with the axes `lead`, `out_shape` itself by default:
    each element reads the row of its leading index); None where that is larger than
    `regions.MAX_RELATION`."""
    n, m = int(np.prod(shape, dtype=np.int64)), int(np.prod(out_shape, dtype=np.int64))
    if n * m > R.MAX_RELATION:
        return None
    cache = memo("elements.reads_relation", 256)
    hit = cache.get((kind, shape, out_shape, lead))
    if hit is not None:
        return hit
    if kind == "broadcast":
        coords = np.indices(out_shape).reshape(len(out_shape), -1)
        src = np.stack([c if s > 1 else np.zeros_like(c) for c, s in zip(coords, shape)])
        into = np.ravel_multi_index(src, shape) if shape else np.zeros(m, np.int64)
        rel = np.zeros((m, n), bool)
        rel[np.arange(m), into] = True
    else:
        rows = int(np.prod(out_shape if lead is None else lead, dtype=np.int64))
        rel = np.kron(np.eye(rows, dtype=bool), np.ones((m // rows, n // rows), bool))
    rel.setflags(write=False)
    return cache.put((kind, shape, out_shape, lead), [], rel)


def _zeros(v: Any) -> Any:
    return jnp.zeros(v.aval.shape, v.aval.dtype)


def _assembled(env: Env, v: Var) -> Part:
    """`v`'s part with its pieces written into its value."""
    p = env.part[v]
    if not p.pieces and p.value is not None:
        return p
    val = p.value if p.value is not None else _zeros(v)
    for w, piece in p.pieces:
        val = _write_window(val, w, piece, env)
    q = Part(val, p.region, (), p.region, None, p.learned)
    env.part[v] = q
    return q


def value_of(env: Env, v: Any, clean: bool = False) -> Any:
    """`v`'s value where known (garbage elsewhere, or `FILL` with `clean`); None if nothing of
    it is known."""
    if env.known(v):
        return env.read(v)
    if not is_var(v) or not is_partial(env, v):
        return None
    p = _assembled(env, v)
    if not clean or (env.ctx is not None and not env.ctx.settings.fill):
        return p.value
    if p.clean is None:
        fill = jnp.asarray(FILL if jnp.issubdtype(v.aval.dtype, jnp.inexact) else 1, v.aval.dtype)
        p.clean = jnp.where(
            R.materialize(p.region, tuple(v.aval.shape), env.read, env.masks), fill, p.value
        )
    return p.clean


# --------------------------------------------------------------------------- learning


def learn(env: Env, v: Any, value: Any, region: R.Region) -> bool:
    """`v` is known outside `region`, with these values there. Returns whether that is new."""
    if not is_var(v) or isinstance(v, DropVar) or env.known(v) or region == R.FULL:
        return False
    value = fit_to_aval(value, v.aval)
    if region == R.EMPTY:
        complete(env, v, value)
        return True
    p = env.part.get(v)
    st = env.info
    if p is None:
        if R.too_complex(region):
            return False
        env.part[v] = Part(value, region, (), region)
        return True
    if p.learned >= _learn_cap(v):
        return False
    new = R.intersect(p.region, region, st)
    if R.implies(p.region, new) or R.too_complex(new):
        return False
    if p.value is None:
        base, val = region, value
    else:
        base = R.intersect(p.base, region, st)
        val = _merge(env, v, p.value, p.base, value, region)
    if new == R.EMPTY:
        for w, piece in p.pieces:
            val = _write_window(val, w, piece, env)
        env.write(v, val)
        return True
    pieces = tuple(
        (w, x) for w, x in p.pieces if R.intersect(base, R.win_region(w, st), st) != R.EMPTY
    )
    env.part[v] = Part(val, base, pieces, new, None, p.learned + 1)
    return True


def complete(env: Env, v: Any, value: Any) -> None:
    """`v` is known everywhere, with `value`; where it was already known, the value it had is
    kept (it is exact there, and taking it keeps the inverse program invertible: a value
    computed forward and back again would tie the inverse's inputs together)."""
    p = env.part.get(v) if is_var(v) else None
    if p is None or R.has_windows(p.region):
        # (what windows leave known are copies of the output, which the new value holds too)
        env.write(v, value)
        return
    value = fit_to_aval(value, v.aval)
    if p.value is not None:
        value = _merge(env, v, p.value, p.base, value, R.EMPTY)
    for w, piece in p.pieces:
        value = _write_window(value, w, piece, env)
    env.write(v, value)


def learn_piece(env: Env, v: Any, w: R.Win, piece: Any) -> bool:
    """`v` is known on the window `w`, where it holds `piece` (the window's shape)."""
    if not is_var(v) or env.known(v):
        return False
    st = env.info
    p = env.part.get(v)
    piece = jnp.asarray(piece, v.aval.dtype).reshape(w.sizes)
    if p is None:
        rest = R.cowin_region(w, st)
        if rest == R.EMPTY:  # the window is the whole array (a full slice)
            env.write(v, piece)
        else:
            env.part[v] = Part(None, R.FULL, ((w, piece),), rest)
        return True
    if p.learned >= _learn_cap(v) or R.window_known(p.region, w, st):
        return False
    new = R.intersect(p.region, R.cowin_region(w, st), st)
    if new == R.EMPTY:
        pieces = (*p.pieces, (w, piece))
        val = _tiled(pieces, tuple(v.aval.shape)) if p.value is None else None
        if val is None:
            val = p.value if p.value is not None else _zeros(v)
            for w2, x in pieces:
                val = _write_window(val, w2, x, env)
        env.write(v, val)
        return True
    env.part[v] = Part(p.value, p.base, (*p.pieces, (w, piece)), new, None, p.learned + 1)
    return True


def _tiled(pieces: Sequence[tuple[R.Win, Any]], shape: tuple) -> Any:
    """Pieces at static corners that tile one axis, joined by `concatenate` (which keeps the
    operand's sharding, and is itself invertible); None otherwise."""
    if not all(isinstance(o, (int, np.integer)) for w, _ in pieces for o in w.origin):
        return None
    axis = None
    spans = {}
    for w, x in pieces:
        partial = [d for d in range(len(shape)) if (w.origin[d], w.sizes[d]) != (0, shape[d])]
        if len(partial) > 1 or (axis is not None and partial and partial[0] != axis):
            return None
        if partial:
            axis = partial[0]
        d = axis if axis is not None else 0
        spans.setdefault((int(w.origin[d]), int(w.origin[d]) + w.sizes[d]), x)
    if axis is None:
        return next(iter(spans.values()))
    pos, parts = 0, []
    for (a, b), x in sorted(spans.items()):
        if a != pos:
            return None
        parts.append(x)
        pos = b
    if pos != shape[axis]:
        return None
    return parts[0] if len(parts) == 1 else lax.concatenate(parts, axis)


def _merge(env: Env, v: Var, old: Any, old_base: R.Region, new: Any, new_region: R.Region) -> Any:
    """One array right wherever `old` (outside `old_base`) or `new` (outside `new_region`) is,
    written in the cheapest form: a window copied across when one of them is wrong (or right)
    on one window only, else an elementwise select."""
    shape = tuple(v.aval.shape)
    one = _single_atom(old_base)
    if isinstance(one, R.Win):  # old is wrong on one window: copy new's window into it
        return _write_window(old, one, _read_window_value(new, one, env), env)
    if isinstance(one, R.CoWin):  # old is right on one window only
        return _write_window(new, one.win, _read_window_value(old, one.win, env), env)
    two = _single_atom(new_region)
    if isinstance(two, R.Win):
        return _write_window(new, two, _read_window_value(old, two, env), env)
    if isinstance(two, R.CoWin):
        return _write_window(old, two.win, _read_window_value(new, two.win, env), env)
    mask = R.materialize(old_base, shape, env.read, env.masks)
    select = lambda m, a, b: [jnp.where(m, a, b)]  # noqa: E731
    (out,) = through_window(select, [mask, new, old], shape, env) or select(mask, new, old)
    return out


def _single_atom(r: R.Region) -> Any:
    if len(r) == 1:
        (c,) = tuple(r)
        if len(c) == 1:
            return next(iter(c))
    return None


# --------------------------------------------------------------------------- windows


def _starts(w: R.Win, env: Env) -> list[Any]:
    out = []
    for o in w.origin:
        if isinstance(o, (int, np.integer)):
            out.append(np.asarray(int(o), np.int32))
        else:
            var, k = o
            val = env.read(var)
            if k is not None:
                val = np.reshape(val, (-1,))[k] if is_concrete(val) else jnp.reshape(val, (-1,))[k]
            out.append(val)
    # one index dtype for all (lax.dynamic_slice requires it): a traced start in int64
    # (x64: diffrax's step counter) beside the int32 ones written for static origins
    dtype = jnp.result_type(*out) if out else jnp.int32
    if all(is_concrete(x) for x in out):
        return [np.asarray(x, dtype) for x in out]
    return [jnp.asarray(x, dtype) for x in out]


def _in_bounds(w: R.Win, starts: Sequence[Any]) -> Any:
    ok = np.asarray(True) if all(is_concrete(s) for s in starts) else jnp.asarray(True)
    for s, z, n in zip(starts, w.sizes, w.shape):
        ok = ok & (s >= 0) & (s + z <= n)
    return ok


class WindowWrite(NamedTuple):
    """A window the walk wrote into an array (`_write_window`): `value` is `base` with `piece`
    on the window `w` (its corner `starts`), where `in_bounds` (None: a clamped window, always
    written)."""

    value: Any
    base: Any
    w: R.Win
    starts: list
    piece: Any
    in_bounds: Any


def written_window(env: Env, val: Any) -> WindowWrite | None:
    """How the walk made `val`, where it wrote a window into an array (`_write_window`)."""
    wrote = env.windows.get(id(val))
    return wrote if wrote is not None and wrote.value is val else None


def _read_window_value(val: Any, w: R.Win, env: Env) -> Any:
    wrote = written_window(env, val)
    if wrote is not None and _same_positions(wrote.w, w, env):
        # the window just written: its piece, not a slice of the array it went into (under a
        # `vmap` over a loop's steps, that array is a copy per step: `rules.scan._at_once`)
        if wrote.in_bounds is None:
            return wrote.piece
        return jnp.where(wrote.in_bounds, wrote.piece, _read_window_value(wrote.base, w, env))
    starts = _starts(w, env)
    if _plain(val) and all(is_concrete(x) for x in starts):
        # (known when traced, under a walk that folds constants: numpy's slice, not an XLA
        # program compiled for each new shape while tracing)
        return jnp.asarray(np.asarray(val)[_box(starts, w.sizes, np.shape(val))])
    return lax.dynamic_slice(val, _corner(starts), w.sizes, allow_negative_indices=False)


def _plain(x: Any) -> bool:
    """Whether `x` is known when traced and numpy holds it as it is (not a PRNG key, not
    weakly typed: numpy would drop what JAX's promotion reads)."""
    return is_concrete(x) and not is_key(x) and not getattr(x, "weak_type", False)


def _corner(starts: Sequence[Any]) -> list[Any]:
    """Starts for `lax.dynamic_slice` and its update (with ``allow_negative_indices=False``),
    which then place a window as the primitive does, clamped: those known when traced as
    Python ints (at least 0), normalized in Python rather than by operations compiled while
    tracing."""
    return [max(int(np.asarray(x)), 0) if is_concrete(x) else x for x in starts]


def _box(starts: Sequence[Any], sizes: Sequence[int], shape: Sequence[int]) -> tuple:
    """The slices of a window at concrete `starts`, placed as the `dynamic_slice` primitive
    places them: clamped so that the window fits (a negative index was counted from the end
    by `lax.dynamic_slice` in the user's program, before the primitive)."""
    return tuple(
        slice(c, c + z)
        for c, z in (
            (min(max(int(np.asarray(s)), 0), max(n - z, 0)), z)
            for s, z, n in zip(starts, sizes, shape)
        )
    )


def _same_positions(written: R.Win, read: R.Win, env: Env) -> bool:
    """Whether reading the window `read` (a `dynamic_slice`, clamped whatever its mode) reads
    the positions a write of `written` wrote, where it wrote: the same corner (the same
    values, clamped alike), or the same positions at every iteration as each mode places
    them, where neither box is dropped for not fitting (`regions.relation`: a read that fits
    is not moved by the clamp)."""
    if (written.origin, written.sizes, written.shape) == (read.origin, read.sizes, read.shape):
        return True
    return written.sizes == read.sizes and R.relation(written, read, env.info) == "same"


def _write_window(val: Any, w: R.Win, piece: Any, env: Env) -> Any:
    starts = _starts(w, env)
    in_bounds = None
    if _plain(val) and _plain(piece) and all(is_concrete(x) for x in starts):
        # (known when traced: numpy's update, as `_read_window_value` reads)
        piece = np.reshape(np.asarray(piece), w.sizes).astype(np.asarray(val).dtype)
        new = np.array(val)
        fits = w.mode == "clamp" or bool(_in_bounds(w, [np.asarray(x) for x in starts]))
        if fits:
            new[_box(starts, w.sizes, new.shape)] = piece
        new, piece = jnp.asarray(new), jnp.asarray(piece)
        env.windows[id(new)] = WindowWrite(new, val, w, starts, piece, None if fits else False)
        return new
    piece = jnp.reshape(piece, w.sizes).astype(val.dtype)
    new = lax.dynamic_update_slice(val, piece, _corner(starts), allow_negative_indices=False)
    if w.mode != "clamp":
        # a box that does not fit is no position at all: nothing is written
        in_bounds = _in_bounds(w, starts)
        new = jnp.where(in_bounds, new, val)
    env.windows[id(new)] = WindowWrite(new, val, w, starts, piece, in_bounds)
    return new


def read_window(env: Env, v: Any, w: R.Win) -> Any:
    """`v`'s values on the window `w` (its shape), or None where they are not all known."""
    if env.known(v):
        return _read_window_value(env.read(v), w, env)
    p = env.part.get(v) if is_var(v) else None
    if p is None:
        return None
    st = env.info
    for w2, piece in p.pieces:
        if R.relation(w, w2, st) == "same":
            return piece
    if p.value is not None and R.window_known(p.base, w, st):
        return _read_window_value(p.value, w, env)
    if R.window_known(p.region, w, st):
        return _read_window_value(_assembled(env, v).value, w, env)
    return None


# --------------------------------------------------------------------------- regions


def not_case(env: Env, pred: Any, k: int, n: int, shape: tuple) -> R.Region:
    """Where the known predicate `pred` (of `n` values, broadcast to `shape`) is not `k`."""
    s = static_of(env, pred)
    if s is not None:
        return R.mask_region(np.broadcast_to(np.asarray(s).astype(np.int64) != k, shape))
    return R.pred_region(pred, [c for c in range(n) if c != k], n, shape)


def is_case(env: Env, pred: Any, k: int, n: int, shape: tuple) -> R.Region:
    s = static_of(env, pred)
    if s is not None:
        return R.mask_region(np.broadcast_to(np.asarray(s).astype(np.int64) == k, shape))
    return R.pred_region(pred, [k], n, shape)


# --------------------------------------------------------------------------- entry points


def _noted(result: Any, env: Env) -> bool | None:
    """An element rule's answer; the losses an `ElementResult` reports go into the walk's
    knowledge (`env.losses`), which the walker reads when it ends stuck."""
    if isinstance(result, ElementResult):
        env.losses.update(result.losses)
        return result.learned
    return result


def forward(eqn: JaxprEqn, env: Env) -> bool:
    """Outputs known on some elements, from inputs known on some (or all)."""
    rule = element_rules.get(eqn.primitive)
    if rule is not None and rule.forward is not None:
        r = _noted(rule.forward(eqn, env), env)
        if r is not None:
            return r
    partial_in = any(is_var(v) and is_partial(env, v) for v in eqn.invars)
    if is_kind(eqn.primitive, STRUCTURAL) and (partial_in or joins_known(eqn, env)):
        return _structural_forward(eqn, env)
    if not partial_in:
        return False
    outs = real_outvars(eqn)
    if len(outs) == 1 and elementwise_over(eqn, tuple(outs[0].aval.shape)):
        return _elementwise_forward(eqn, env)
    return False


def joins_known(eqn: JaxprEqn, env: Env) -> bool:
    """Whether `eqn` concatenates known operands with unknown ones (a condition concatenated
    to the state): its output is known on the known operands' elements. (Only
    `concatenate`: a pad's known padding value, marked known on the pad's zeros, sent the
    extended Rosenbrock gradient's interleaved pads to a singular group.)"""
    if eqn.primitive is not prims.concatenate:
        return False
    ins = [v for v in eqn.invars if is_var(v)]
    return any(env.known(v) for v in ins) and not all(env.known(v) for v in ins)


def backward(eqn: JaxprEqn, env: Env) -> bool | None:
    """Inputs (some of their elements) from outputs known on some (or all) elements. None:
    declined, the ordinary inverse rule is the one to try."""
    rule = element_rules.get(eqn.primitive)
    if rule is not None and rule.backward is not None:
        r = _noted(rule.backward(eqn, env), env)
        if r is not None:
            return r
    outs = real_outvars(eqn)
    partial_out = any(is_partial(env, v) for v in outs)
    if is_kind(eqn.primitive, STRUCTURAL):
        static_idx = bool(_index_args(eqn)) and _statics_of_index_args(eqn, env) is not None
        if partial_out or eqn.primitive not in inverse_rules or static_idx:
            return _structural_backward(eqn, env)
        return None
    if len(outs) == 1 and elementwise_over(eqn, tuple(outs[0].aval.shape)):
        return _elementwise_backward(eqn, env)
    return None


# --------------------------------------------------------------------------- along axes


def along_axes_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    """A reduction over axes (`reduce_max`, `argmax`, ...) or a cumulative operation along one
    (`cumsum`, ...) of a partly known operand: each output element is known where every
    operand element it reads is (a softmax's max over a spline's bins, known on the rows a
    masked network has computed: the rows of the knots it makes). The value is computed on
    the operand with `FILL` where unknown. None: declined (a relation too large to build)."""
    (x,) = eqn.invars
    (o,) = eqn.outvars
    if not is_var(x) or not is_partial(env, x) or env.known(o):
        return None
    reads = _reads_along(eqn)
    if reads is None:
        return None
    region = R.spread(region_of(env, x), reads, tuple(o.aval.shape))
    if region == R.FULL:
        return False
    return learn(env, o, apply(eqn, [value_of(env, x, clean=True)])[0], region)


def _reads_along(eqn: JaxprEqn) -> np.ndarray | None:
    """``(outputs, operand elements)``, flattened: which operand elements each output element
    of a reduction (`axes`) or a cumulative operation (`axis`, `reverse`) reads; None where
    that relation is larger than `regions.MAX_RELATION`."""
    shape = tuple(eqn.invars[0].aval.shape)
    out_shape = tuple(eqn.outvars[0].aval.shape)
    n, m = int(np.prod(shape, dtype=np.int64)), int(np.prod(out_shape, dtype=np.int64))
    if n * m > R.MAX_RELATION:
        return None
    key = (eqn.primitive.name, shape, tuple(sorted(eqn.params.items(), key=str)))
    cache = memo("elements.reads_along", 256)
    hit = cache.get(key)
    if hit is not None:
        return hit
    coords = np.indices(shape).reshape(len(shape), -1)
    if "axes" in eqn.params:  # (a reduction: the output keeps the other axes)
        kept = [d for d in range(len(shape)) if d not in eqn.params["axes"]]
        into = np.ravel_multi_index(coords[kept], out_shape) if kept else np.zeros(n, np.int64)
        rel = np.zeros((m, n), bool)
        rel[into, np.arange(n)] = True
    else:  # (cumulative along `axis`: the elements up to each, or from it with `reverse`)
        a = eqn.params["axis"]
        others = [d for d in range(len(shape)) if d != a]
        same = np.all(coords[others][:, :, None] == coords[others][:, None, :], axis=0)
        before = coords[a][None, :] <= coords[a][:, None]
        if eqn.params.get("reverse", False):
            before = coords[a][None, :] >= coords[a][:, None]
        rel = same & before
    rel.setflags(write=False)  # (shared by every caller through the cache)
    return cache.put(key, [], rel)


# --------------------------------------------------------------------------- elementwise


def _elementwise_forward(eqn: JaxprEqn, env: Env) -> bool:
    if not all(env.known(v) or is_partial(env, v) for v in eqn.invars):
        return False
    (o,) = real_outvars(eqn)
    if env.known(o):
        return False
    region = R.EMPTY
    for v in eqn.invars:
        region = R.union(region, region_on(env, v, o.aval.shape), env.info)
    if region == R.FULL:
        return False
    ins = [value_of(env, v, clean=True) for v in eqn.invars]
    shape = tuple(o.aval.shape)
    through = windows_apart(env) and through_window(lambda *xs: apply(eqn, xs), ins, shape, env)
    (out,) = through or apply(eqn, ins)
    return learn(env, o, out, region)


def windows_apart(env: Env) -> bool:
    """Whether an equation (applied forward, or its inverse rule) may run on an array with a
    window written into it as on the array and on the window apart (`through_window`): only
    in a walk that computes with the loop's own values where it knows nothing
    (`Settings.fill` off: the steps undone at once, `rules.scan._at_once`). Elsewhere the
    array's old values under the window, which the value does not hold (zeros under a window
    assembled from pieces), could fail a rule's run-time check (an exact integer quotient)
    where the value passes, or be a point where the equation's derivative is infinite
    (``log`` of 0), which the window's zero cotangent turns into NaN. A select computes
    nothing of its operands: it goes through windows in every walk."""
    return env.ctx is not None and not env.ctx.settings.fill


def through_window(fn: Callable, vals: Sequence[Any], shape: tuple, env: Env) -> list | None:
    """``fn(*vals)``, elementwise over its operands of `shape` (the others scalars or
    `Unknown`), where some of those are one window the walk wrote into an array
    (`_write_window`): `fn` of the arrays written into, with the window written by `fn` of
    the windows' values (the same elements). Under a `vmap` over a loop's steps undone at
    once (`rules.scan._at_once`), the array written into is the loop's final carry, the same
    at every step: `fn` runs on it once and on each step's window, not on a copy of the
    carry per step. None where no operand is such a window, two are different ones, or an
    operand is broadcast over some axes (then `fn(*vals)` is the caller's to run)."""
    writes = [
        written_window(env, v) if tuple(np.shape(v)) == shape and not is_unknown(v) else None
        for v in vals
    ]
    w = next((wr.w for wr in writes if wr is not None), None)
    if w is None or any(wr is not None and wr.w != w for wr in writes):
        return None
    if any(np.shape(v.aval if is_unknown(v) else v) not in ((), shape) for v in vals):
        return None  # (an operand broadcast over some axes: not one element per element)
    if any(is_unknown(v) and tuple(v.aval.shape) != shape for v in vals):
        return None  # (an unknown scalar broadcast over the output: not element by element)
    bases, pieces = [], []
    for v, wr in zip(vals, writes):
        if is_unknown(v):
            bases.append(v)
            pieces.append(Unknown(ShapedArray(tuple(w.sizes), v.aval.dtype)))
        elif tuple(np.shape(v)) == shape:
            bases.append(v if wr is None else wr.base)
            pieces.append(_read_window_value(v, w, env))
        else:  # (a scalar, broadcast over the output)
            bases.append(v)
            pieces.append(v)
    outs_base = fn(*bases)
    outs_piece = None if outs_base is None else fn(*pieces)
    if outs_piece is None:
        return None
    return [
        None if b is None else _write_window(b, w, p, env) for b, p in zip(outs_base, outs_piece)
    ]


def _elementwise_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    """Each operand not fully known, from the output and the other operands, where those are
    known (elementwise: element k of the operand from element k of the rest)."""
    (o,) = real_outvars(eqn)
    targets = [k for k, v in enumerate(eqn.invars) if not env.known(v)]
    if not targets or eqn.primitive not in inverse_rules:
        return None
    if not (env.known(o) or is_partial(env, o)):
        return None
    if len(targets) == 1 and env.known(o) and not any(is_partial(env, v) for v in eqn.invars):
        return None  # everything needed is known: the ordinary inverse rule
    wrote = False
    involved = False
    for k in targets:
        if tuple(eqn.invars[k].aval.shape) != tuple(o.aval.shape):
            continue  # a scalar broadcast over the output: not element by element
        others = [v for j, v in enumerate(eqn.invars) if j != k]
        if not all(env.known(v) or is_partial(env, v) for v in others):
            continue
        involved = True
        on_window = _window_backward(eqn, env, k)
        if on_window is not None:
            wrote = on_window or wrote
            continue
        region = region_of(env, o)
        for v in others:
            region = R.union(region, region_on(env, v, o.aval.shape), env.info)
        if region == R.FULL or R.implies(region_of(env, eqn.invars[k]), region):
            continue
        ins = [
            Unknown(v.aval) if j == k else value_of(env, v, clean=True)
            for j, v in enumerate(eqn.invars)
        ]
        rule = inverse_rules[eqn.primitive]
        try:
            args = [value_of(env, o, clean=True), *ins]
            shape = tuple(o.aval.shape)
            rec = None
            if windows_apart(env):
                rec = through_window(lambda *xs: rule(*xs, **eqn.params), args, shape, env)
            rec = rule(*args, **eqn.params) if rec is None else rec
        except (NeedMore, Lossy):
            continue
        if rec is not None and rec[k] is not None:
            wrote = learn(env, eqn.invars[k], rec[k], region) or wrote
    return wrote if involved else None


def _window_backward(eqn: JaxprEqn, env: Env, k: int) -> bool | None:
    """Operand `k` on the one window where the output is known (a piece over no base value),
    from the other operands there: a loop's step writes one element, which is then recovered
    alone, not on arrays of the whole carry's size (what the steps of a loop undone at once
    would each make, under their `vmap`). None where the output is known otherwise, or an
    operand is not known on the window (then the whole arrays are inverted)."""
    o = eqn.outvars[0]
    p = env.part.get(o) if is_var(o) else None
    if p is None or p.value is not None or len(p.pieces) != 1:
        return None
    w, piece = p.pieces[0]
    target = eqn.invars[k]
    if R.window_known(region_of(env, target), w, env.info):
        return False
    ins: list[Any] = []
    for j, v in enumerate(eqn.invars):
        shape = tuple(v.aval.shape)
        if j == k:
            x = Unknown(ShapedArray(tuple(w.sizes), v.aval.dtype))
        elif shape == tuple(o.aval.shape):
            x = read_window(env, v, w)
        elif not shape and env.known(v):  # a scalar broadcast over the output
            x = jnp.broadcast_to(env.read(v), tuple(w.sizes))
        else:
            x = None
        if x is None:
            return None
        ins.append(x)
    try:
        rec = inverse_rules[eqn.primitive](piece, *ins, **eqn.params)
    except (NeedMore, Lossy):
        return None
    if rec is None or rec[k] is None:
        return None
    return learn_piece(env, target, w, rec[k])


# --------------------------------------------------------------------------- structural


def _index_args(eqn: JaxprEqn) -> list[int]:
    """The positions of `eqn`'s index operands (`index_args` holds ints and slices)."""
    n = len(eqn.invars)
    out: list[int] = []
    for k in index_args.get(eqn.primitive, ()):
        out.extend(range(n)[k] if isinstance(k, slice) else [k])
    return out


def _data_args(eqn: JaxprEqn) -> list[int]:
    idx = _index_args(eqn)
    return [k for k in range(len(eqn.invars)) if k not in idx]


def _statics_of_index_args(eqn: JaxprEqn, env: Env) -> tuple | None:
    out = []
    for k in _index_args(eqn):
        s = static_of(env, eqn.invars[k])
        if s is None:
            return None
        out.append((k, np.asarray(s)))
    return tuple(out)


def index_maps(eqn: JaxprEqn, env: Env) -> tuple[list, list] | None:
    """Per output and data operand: which operand position each output element copies
    (`IndexMap`, fill False), and per operand element one output position that copies it
    (fill True: an element no output copies is not known from them). None where an index
    operand is not static or the arrays are too large."""
    statics = _statics_of_index_args(eqn, env)
    if statics is None:
        return None
    key = tuple((k, s.dtype.str, s.shape, s.tobytes()) for k, s in statics)
    return _index_maps(eqn, key, statics)


_MAX_MAP = 1 << 22


def _index_maps(eqn: JaxprEqn, key: tuple, statics: tuple) -> tuple[list, list] | None:
    maps = memo("elements.index_maps", 4096)
    hit = maps.get((id(eqn), key))
    if hit is not None and hit[0] is eqn:
        return hit[1]
    data = _data_args(eqn)
    sizes = [int(np.prod(eqn.invars[k].aval.shape, dtype=np.int64)) for k in data]
    total = sum(sizes)
    if total >= 2**31 or any(
        np.prod(o.aval.shape, dtype=np.int64) > _MAX_MAP for o in eqn.outvars if is_var(o)
    ):
        return None
    args: list[Any] = [None] * len(eqn.invars)
    offsets = np.cumsum([0] + sizes)
    for k, off, n in zip(data, offsets, sizes):
        args[k] = (np.arange(n, dtype=np.int32) + off).reshape(eqn.invars[k].aval.shape)
    for k, s in statics:
        args[k] = s
    try:
        outs = [np.asarray(o).astype(np.int64) for o in apply_on_host(eqn, args)]
    except Exception:  # a primitive that does not take integers: no structural knowledge
        return None
    fwd, inv = [], []
    for o in outs:
        row, irow = [], []
        for k, off, n in zip(data, offsets, sizes):
            flat = o.reshape(-1)
            inside = (flat >= off) & (flat < off + n)
            m = np.where(inside, flat - off, -1)
            row.append(R.IndexMap(m, tuple(o.shape), False))
            back = np.full(n, -1, np.int64)
            ks = np.nonzero(inside)[0]
            back[m[ks][::-1]] = ks[::-1]  # the first output position that copies each one
            irow.append(R.IndexMap(back, tuple(eqn.invars[k].aval.shape), True))
        fwd.append(row)
        inv.append(irow)
    maps.put((id(eqn), key), [], (eqn, (fwd, inv)))  # (the eqn kept: its id stays its)
    return fwd, inv


def _structural_forward(eqn: JaxprEqn, env: Env) -> bool:
    maps = index_maps(eqn, env)
    if maps is None:
        return False
    fwd, _ = maps
    data = _data_args(eqn)
    if any(is_partial(env, eqn.invars[k]) and env.part[eqn.invars[k]].value is None for k in data):
        return False  # known by windows only: read by window (assembling them costs O(n))
    vals = list(env.read(v) if env.known(v) else None for v in eqn.invars)
    regions = {}
    for k in data:
        v = eqn.invars[k]
        regions[k] = region_of(env, v)
        vals[k] = value_of(env, v) if regions[k] != R.FULL else _zeros(v)
    for k in _index_args(eqn):
        if vals[k] is None:
            return False
    outs = apply(eqn, vals)
    wrote = False
    for o, val, row in zip(eqn.outvars, outs, fwd):
        if not is_var(o) or env.known(o):
            continue
        region = R.EMPTY
        for k, m in zip(data, row):
            region = R.union(region, R.pullback(regions[k], m), env.info)
        wrote = learn(env, o, val, region) or wrote
    return wrote


def _structural_backward(eqn: JaxprEqn, env: Env) -> bool:
    if not all(env.known(eqn.invars[k]) for k in _index_args(eqn)):
        return False
    maps = index_maps(eqn, env)
    if maps is None:
        return False
    fwd, inv = maps
    data = _data_args(eqn)
    wrote = False
    for j, k in enumerate(data):
        v = eqn.invars[k]
        if not is_var(v) or env.known(v):
            continue
        for o, frow, irow in zip(eqn.outvars, fwd, inv):
            ro = region_of(env, o) if is_var(o) else R.FULL
            if (
                ro == R.FULL
                or 0 in o.aval.shape
                or (is_partial(env, o) and env.part[o].value is None)
            ):
                continue  # (known by windows only: they are read by window, not assembled)
            im = _known_readers(frow[j], ro, tuple(v.aval.shape)) or irow[j]
            got = im.take(value_of(env, o))
            wrote = learn(env, v, got, R.pullback(ro, im)) or wrote
            if env.known(v):
                break
    return wrote


def _known_readers(m: R.IndexMap, ro: R.Region, shape: tuple) -> R.IndexMap | None:
    """Per operand element, an output position that copies it and is known, where what is
    known of the output is static (a gather may read one element at known and at garbage
    positions); None otherwise (the first position that copies it, whichever)."""
    unknown = R.static_mask(ro, m.shape)
    if unknown is None:
        return None
    idx = m.index
    ks = np.nonzero((idx >= 0) & ~unknown.reshape(-1))[0]
    back = np.full(int(np.prod(shape, dtype=np.int64)), -1, np.int64)
    back[idx[ks][::-1]] = ks[::-1]
    return R.IndexMap(back, shape, True)


# --------------------------------------------------------------------------- element by element

_ALSO_ELEMENTWISE = frozenset({"clamp", "le_to", "lt_to", "atan2", "nextafter", "erfc"})
"""Elementwise primitives without an inverse rule of that kind (a total-order comparison that
`searchsorted` writes, a clip), for `per_element` alone."""
_REARRANGES = frozenset({"reshape", "squeeze", "expand_dims", "copy"})
_REDUCES = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "reduce_and",
        "reduce_or",
        "argmax",
        "argmin",
    }
)


def per_element(eqns: Sequence[JaxprEqn], dep: set, shape: tuple) -> bool:
    """Whether `eqns` compute, element by element of `shape` (the leading axes), what they
    compute from `dep` (values laid out so, the group's unknowns): element i of every such
    value from element i of its operands alone, and known values (a table of knots) read
    whole. Then candidates checked each on its own (a choice group's branches) stay right
    when picked element by element, with no check of the picked ones together. Elementwise
    operations, moves of the trailing axes, reductions over them, a gather per element
    (``take_along_axis`` of a spline's knots at its bin index), and loops and calls whose
    bodies are so (`searchsorted`'s bisection): anything else answers False."""
    return reached_per_element(eqns, dep, shape) is not None


def reached_per_element(eqns: Sequence[JaxprEqn], dep: set, shape: tuple) -> set | None:
    """What `eqns` compute from `dep`, where they compute it element by element of `shape`
    (`per_element`); None where they may not."""
    dep = set(dep)
    for e in eqns:
        if not any(is_var(v) and v in dep for v in e.invars):
            continue
        outs = _per_element_outs(e, dep, shape)
        if outs is None:
            return None
        dep.update(outs)
    return dep


def _per_element_outs(e: JaxprEqn, dep: set, shape: tuple) -> list | None:
    """The outputs of `e` that depend on `dep`, where `e` computes them element by element
    of `shape` (`per_element`); None where it may not."""
    k = len(shape)
    name = e.primitive.name
    outs = real_outvars(e)

    def lead(v: Any) -> bool:
        return tuple(v.aval.shape[:k]) == shape

    mine = [v for v in e.invars if is_var(v) and v in dep]
    if not all(lead(v) for v in mine):
        return None
    if name == "scan":
        return _per_element_loop(e, dep, shape)
    if e.primitive in CALL_PRIMITIVES:
        sub = call_jaxpr(e.params).jaxpr
        inner = {s for s, v in zip(sub.invars, e.invars) if is_var(v) and v in dep}
        got = reached_per_element(sub.eqns, inner, shape)
        if got is None:
            return None
        mine_out = [o for o, s in zip(e.outvars, sub.outvars) if is_var(s) and s in got]
        return mine_out if all(lead(o) for o in mine_out) else None
    if not all(lead(o) for o in outs):
        return None
    out_shape = tuple(outs[0].aval.shape) if outs else shape
    if is_kind(e.primitive, ELEMENTWISE) or name in _ALSO_ELEMENTWISE:
        # (operands may broadcast over size-1 axes: the unknowns' only inside an element,
        # their leading axes being the elements')
        ok = all(broadcasts_to(tuple(v.aval.shape), out_shape) for v in e.invars)
        return outs if ok else None
    if name == "broadcast_in_dim":
        return outs if tuple(e.params["broadcast_dimensions"][:k]) == tuple(range(k)) else None
    if name in _REARRANGES:
        # (the leading axes kept on both sides: a row-major move inside each element)
        if e.params.get("dimensions") is not None and name == "reshape":
            return None  # (a reshape that transposes first)
        if name == "squeeze" and any(a < k for a in e.params["dimensions"]):
            return None
        return outs
    if name in _REDUCES:
        return outs if all(a >= k for a in e.params["axes"]) else None
    if name == "slice":  # (its leading axes whole on both sides: a slice inside each element,
        return outs  # a one-hot spline's masked sums taken apart)
    if name == "gather":
        d = e.params["dimension_numbers"]
        if any(a < k for a in d.offset_dims):
            return None
        if is_var(e.invars[0]) and e.invars[0] in dep:  # (a table per element, paired)
            pairs = (
                tuple(getattr(d, "operand_batching_dims", ())[:k]),
                tuple(getattr(d, "start_indices_batching_dims", ())[:k]),
            )
            if pairs != (tuple(range(k)), tuple(range(k))):
                return None
        return outs if len(e.invars[1].aval.shape) > k else None
    return None


def _per_element_loop(e: JaxprEqn, dep: set, shape: tuple) -> list | None:
    """A `scan` whose body computes element by element (`per_element`): the unknowns reach
    its constants and carries only (laid out per element), never the stacked inputs or
    outputs; the carries they reach found by iterating the body to a fixed point."""
    info = scan_info(e.params)
    body = info.body.jaxpr
    n = len(e.invars)
    nx = n - info.nconsts - info.ncarry
    reached = [is_var(v) and v in dep for v in e.invars]
    if any(reached[n - nx :]):
        return None
    for _ in range(info.ncarry + 1):
        made = reached_per_element(body.eqns, {b for b, r in zip(body.invars, reached) if r}, shape)
        if made is None:
            return None
        outs_reached = [is_var(o) and o in made for o in body.outvars]
        carry_in = reached[info.nconsts : info.nconsts + info.ncarry]
        new = [a or b for a, b in zip(carry_in, outs_reached[: info.ncarry])]
        if new == carry_in:
            break
        reached[info.nconsts : info.nconsts + info.ncarry] = new
    else:
        return None
    if any(outs_reached[info.ncarry :]):
        return None
    return [o for o, r in zip(e.outvars[: info.ncarry], new) if r and is_var(o)]


def per_element_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    """A loop (or call) computing element by element of its operands' leading axes
    (`per_element`: `jnp.searchsorted`'s bisection of each row of a spline's knots) on
    operands known on some elements: each output element is known where its row of every
    operand is (the dry run of steps undone at once, whose carry is known but where later steps
    write; a spline's bin there). The value is computed on the operands with `FILL` where
    unknown. None: declined (an operand not known anywhere, or not element by element)."""
    unknown = [v for v in eqn.invars if is_var(v) and not env.known(v)]
    if not unknown or not all(is_partial(env, v) for v in unknown):
        return None
    outs = real_outvars(eqn)
    if not outs or all(env.known(o) for o in outs):
        return None
    lead = _common_lead([tuple(v.aval.shape) for v in [*unknown, *outs]])
    if not lead:
        return None
    reached = reached_per_element([eqn], set(unknown), lead)
    if reached is None:
        return None
    regions = {}
    for o in outs:
        region = R.EMPTY
        if o in reached:
            for v in unknown:
                rows = reads_relation("rows", tuple(v.aval.shape), tuple(o.aval.shape), lead)
                if rows is None:
                    return None
                region = R.union(
                    region, R.spread(region_of(env, v), rows, tuple(o.aval.shape)), env.info
                )
        regions[o] = region
    vals = apply(eqn, [value_of(env, v, clean=True) for v in eqn.invars])
    learned = False
    for o, val in zip(eqn.outvars, vals):
        if o in regions and regions[o] != R.FULL:
            learned = learn(env, o, val, regions[o]) or learned
    return learned


def _common_lead(shapes: Sequence[tuple]) -> tuple:
    """The leading axes every shape starts with."""
    lead = shapes[0]
    for s in shapes[1:]:
        k = 0
        while k < min(len(lead), len(s)) and lead[k] == s[k]:
            k += 1
        lead = lead[:k]
    return tuple(lead)
