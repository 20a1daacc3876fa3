"""Rules of the primitives that select, gather and scatter elements (docs/design.md §3.5).

These are where element-level knowledge comes from:

- `select_n` with a known predicate: each case is known where the predicate picks it (a static
  mask, or the predicate's values when the program runs), so ``where(mask, x, f(x))`` and
  diffrax's ``where(keep, new, old)`` invert one case at a time, each equation once;
- scatters (``x.at[i].add(v)``, ``.multiply``, ``.set``) and `dynamic_update_slice`: the
  operand is known from the output outside the written window, and the window's update (a
  set) from the output inside it. With the window disjoint from what the update reads (decided
  per loop iteration by `regions.relation`), ``x.at[i].add(g(x[i - 1]))`` inverts to
  ``x.at[i].add(-g(x[i - 1]))``, O(1) per iteration;
- `dynamic_slice` and gathers at one dynamic point read a window; backwards they give it back.

Gathers, slices, pads, concatenations, reshapes with static positions are `STRUCTURAL`: the
generic handling in `elements` (index maps) covers them, so they are only tagged here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import JaxprEqn, Literal, is_key, prims, user_source
from jaxrev._env import Env, is_unknown
from jaxrev._errors import NotInvertibleError
from jaxrev._evaluate import apply
from jaxrev._graph import is_var
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.checks import raise_where
from jaxrev.transforms.knowledge.elements import (
    is_case,
    is_partial,
    learn,
    learn_piece,
    not_case,
    per_element_forward,
    read_window,
    region_of,
    static_of,
    value_of,
)
from jaxrev.transforms.propagation.walker import RuleContext
from jaxrev.transforms.registry import (
    ELEMENTWISE,
    LINEAR,
    STRUCTURAL,
    ChoiceRule,
    ElementResult,
    ElementRule,
    Lossy,
    NeedMore,
    define,
)
from jaxrev.transforms.rules.arithmetic import check_nonzero

__all__ = ["written_region"]


def _zeros(v: Any) -> Any:
    return jnp.zeros(v.aval.shape, v.aval.dtype)


def _origin(v: Any) -> Any:
    """One coordinate of a window's corner: an int for a literal, else the variable."""
    if isinstance(v, Literal):
        return int(np.asarray(v.val))
    return (v, None)


def _mode(params: dict) -> str:
    mode = params.get("mode")
    return "drop" if "FILL_OR_DROP" in getattr(mode, "name", str(mode)) else "clamp"


# --------------------------------------------------------------------------- select_n


def _select_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    pred, *cases = eqn.invars
    (o,) = eqn.outvars
    if not env.known(pred):
        return None
    if env.known(o):
        return False
    shape, n = tuple(o.aval.shape), len(cases)
    region = R.EMPTY
    for k, c in enumerate(cases):
        region = R.union(
            region,
            R.intersect(is_case(env, pred, k, n, shape), region_of(env, c), env.info),
            env.info,
        )
    if region == R.FULL:
        return False
    vals = [
        _zeros(c) if region_of(env, c) == R.FULL else value_of(env, c, clean=True) for c in cases
    ]
    return learn(env, o, lax.select_n(env.read(pred), *vals), region)


def _select_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    pred, *cases = eqn.invars
    (o,) = eqn.outvars
    if not env.known(pred):
        return None  # a predicate computed from the state: the walker's consistency split
    ro = region_of(env, o)
    if ro == R.FULL:
        return False
    shape, n = tuple(o.aval.shape), len(cases)
    out = value_of(env, o)
    wrote = False
    for k, c in enumerate(cases):
        if is_var(c) and not env.known(c):
            wrote = (
                learn(env, c, out, R.union(ro, not_case(env, pred, k, n, shape), env.info)) or wrote
            )
    return wrote


def _select_n(out, pred, *cases, **_):
    # reached only while the predicate is unknown: element rules handle a known one
    raise NeedMore(
        "the select's predicate is not known",
        hint="Ways out: make the predicate a parameter (known before the select), "
        "or use `jr.cond` with a post condition.",
    )


def _select_count(eqn: JaxprEqn, known: Any) -> int:
    return 0 if known(eqn.invars[0]) else len(eqn.invars) - 1


def _select_branch(eqn: JaxprEqn, k: int) -> Any:
    return eqn.invars[1 + k]


def _select_holds(eqn: JaxprEqn, ins: list, k: int) -> Any:
    return jnp.asarray(ins[0]).astype(jnp.int32) == k


# not LINEAR: a lump holding a select would be singular wherever the predicate picks another
# case than its unknown operand; the element rules above solve it a case at a time instead
define(
    prims.select_n,
    inverse=_select_n,
    element=ElementRule(_select_forward, _select_backward),
    choice=ChoiceRule(_select_count, _select_branch, _select_holds),
    kind=(ELEMENTWISE,),
)


# --------------------------------------------------------------------------- scatters


def _scatter_window(eqn: JaxprEqn) -> R.Win | None:
    """The box a scatter at one point writes (None: several points, or batching dims)."""
    x, idx, u = eqn.invars[:3]
    dn = eqn.params["dimension_numbers"]
    if getattr(dn, "operand_batching_dims", ()) or not idx.aval.shape:
        return None
    if int(np.prod(idx.aval.shape[:-1], dtype=np.int64)) != 1:
        return None
    sizes, j = [], 0
    for d in range(len(x.aval.shape)):
        if d in dn.inserted_window_dims:
            sizes.append(1)
        else:
            sizes.append(u.aval.shape[dn.update_window_dims[j]])
            j += 1
    origin: list[Any] = [0] * len(x.aval.shape)
    for pos, d in enumerate(dn.scatter_dims_to_operand_dims):
        if isinstance(idx, Literal):
            origin[d] = int(np.asarray(idx.val).reshape(-1)[pos])
        else:
            origin[d] = (idx, pos)
    return R.Win(tuple(origin), tuple(sizes), tuple(x.aval.shape), _mode(eqn.params), eqn)


def _scatter_targets(eqn: JaxprEqn, env: Env) -> tuple[R.Region, R.Win | None] | None:
    """Where the scatter writes: a window (one point) or a static mask (static indices)."""
    w = _scatter_window(eqn)
    if w is not None:
        return R.win_region(w, env.info), w
    s = static_of(env, eqn.invars[1])
    if s is None:
        return None
    x, _, u = eqn.invars[:3]
    with jax.ensure_compile_time_eval():
        hit = prims.scatter.bind(
            np.zeros(x.aval.shape, bool), s, np.ones(u.aval.shape, bool), **_set_params(eqn.params)
        )
    return R.mask_region(np.asarray(hit)), None


def _set_params(params: dict) -> dict:
    return {**params, "update_jaxpr": None, "update_consts": ()}


def _written_twice(eqn: JaxprEqn, env: Env) -> bool:
    """Whether a set-scatter may write one position twice (so that an update is lost)."""
    if _scatter_window(eqn) is not None:
        return False
    s = static_of(env, eqn.invars[1])
    if s is None:
        return not eqn.params.get("unique_indices", False)
    x, _, u = eqn.invars[:3]
    with jax.ensure_compile_time_eval():
        counts = lax.scatter_add(
            np.zeros(x.aval.shape, np.int32),
            s,
            np.ones(u.aval.shape, np.int32),
            eqn.params["dimension_numbers"],
            mode=eqn.params.get("mode"),
        )
    return bool(np.any(np.asarray(counts) > 1))


def _updates_from_output(eqn: JaxprEqn, env: Env, w: R.Win | None) -> Any:
    """A set-scatter's updates read back off its output (their positions must be known)."""
    o = eqn.outvars[0]
    u = eqn.invars[2]
    if w is not None:
        if w.mode == "drop" and not _always_fits(w, env):
            return None
        piece = read_window(env, o, w)
        return None if piece is None else jnp.reshape(piece, u.aval.shape)
    if region_of(env, o) != R.EMPTY:
        return None
    # static indices written once each: gather the updates back where they went
    dn = eqn.params["dimension_numbers"]
    gdn = lax.GatherDimensionNumbers(
        offset_dims=dn.update_window_dims,
        collapsed_slice_dims=dn.inserted_window_dims,
        start_index_map=dn.scatter_dims_to_operand_dims,
        operand_batching_dims=dn.operand_batching_dims,
        start_indices_batching_dims=dn.scatter_indices_batching_dims,
    )
    sizes = _window_sizes(eqn)
    return lax.gather(env.read(o), env.read(eqn.invars[1]), gdn, sizes, mode=eqn.params.get("mode"))


def _window_sizes(eqn: JaxprEqn) -> tuple[int, ...]:
    x, _, u = eqn.invars[:3]
    dn = eqn.params["dimension_numbers"]
    sizes, j = [], 0
    for d in range(len(x.aval.shape)):
        if d in dn.inserted_window_dims or d in dn.operand_batching_dims:
            sizes.append(1)
        else:
            sizes.append(u.aval.shape[dn.update_window_dims[j]])
            j += 1
    return tuple(sizes)


def _always_fits(w: R.Win, env: Env) -> bool:
    st = R._starts(w, env.info)  # noqa: SLF001 (one concept: the window's corner per iteration)
    return st is not None and bool(np.all(st[1]))


def _scatter_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    x, idx, u = eqn.invars[:3]
    o = eqn.outvars[0]
    p = eqn.primitive
    if not env.known(idx):
        return None
    t = _scatter_targets(eqn, env)
    if t is None:
        return None
    written, w = t
    ro = region_of(env, o)
    if ro == R.FULL:
        return False
    wrote = False
    if not env.known(x):
        if env.known(u) and p is not prims.scatter:
            # the opposite update of the same elements (repeated indices included)
            uv = env.read(u)
            if p is prims.scatter_mul:
                check_nonzero(uv, "the known factor of the scatter-multiply")
                inv_u = 1 / uv
            else:
                inv_u = -uv
            undo = apply(eqn, [value_of(env, o, clean=True), env.read(idx), inv_u])[0]
            wrote = learn(env, x, undo, ro) or wrote
        else:
            wrote = learn(env, x, value_of(env, o), R.union(ro, written, env.info)) or wrote
    if p is prims.scatter and is_var(u) and not env.known(u):
        if _written_twice(eqn, env):
            raise Lossy(
                "the scatter may write one position twice (its indices may repeat), so "
                "an overwritten update is lost",
                "Ways out: write each position once (unique indices, "
                "`unique_indices=True`), or keep the overwritten values in the state.",
            )
        got = _updates_from_output(eqn, env, w)
        if got is not None:
            env.write(u, got)
            wrote = True
    return wrote


def _scatter_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    x, idx, u = eqn.invars[:3]
    o = eqn.outvars[0]
    if (
        env.known(o)
        or not env.known(idx)
        or not (is_partial(env, x) or is_partial(env, u) or env.known(x) or env.known(u))
    ):
        return None
    t = _scatter_targets(eqn, env)
    if t is None:
        return None
    written, w = t
    rx, ru = region_of(env, x), region_of(env, u)
    placed = R.EMPTY if ru == R.EMPTY else written
    if eqn.primitive is prims.scatter:
        outside = R.cowin_region(w, env.info) if w is not None else _complement(written)
        region = R.union(R.intersect(rx, outside, env.info), placed, env.info)
    else:
        region = R.union(rx, placed, env.info)
    if region == R.FULL:
        return False
    xv = _zeros(x) if rx == R.FULL else value_of(env, x, clean=True)
    uv = _zeros(u) if ru == R.FULL else value_of(env, u, clean=True)
    return learn(env, o, apply(eqn, [xv, env.read(idx), uv])[0], region)


def _complement(r: R.Region) -> R.Region:
    (c,) = tuple(r) if len(r) == 1 else (None,)
    if c is None or len(c) != 1 or not isinstance(next(iter(c)), R.Mask):
        return R.FULL
    return R.mask_region(~next(iter(c)).array)


def _scatter_inverse(out, operand, indices, updates, **params):
    # reached with an operand and updates both unknown at several dynamic points
    if is_unknown(updates) and not params.get("unique_indices", False):
        raise Lossy(
            "the scatter writes at indices known only when the program runs and that "
            "may repeat, so an overwritten element may be lost",
            "Ways out: index with a loop counter (a single point per step), pass "
            "unique_indices=True to `.at[...]` where they never repeat, or keep the "
            "overwritten values in the state.",
        )
    raise NeedMore("the scatter's indices or updates are not known yet")


for _p in (prims.scatter, prims.scatter_add, prims.scatter_mul):
    define(
        _p,
        inverse=_scatter_inverse,
        element=ElementRule(_scatter_forward, _scatter_backward),
        kind=(LINEAR,),
    )


def written_region(eqn: JaxprEqn, env: Env) -> R.Region | None:
    """Where a scatter (of any kind) or a `dynamic_update_slice` writes into its operand, as a
    region decided at each iteration of the enclosing loop (a window at a loop counter, or a
    static mask); None for another equation, or where that is not known when traced."""
    if eqn.primitive is prims.dynamic_update_slice:
        return R.win_region(_dus_window(eqn), env.info)
    if eqn.primitive in (prims.scatter, prims.scatter_add, prims.scatter_mul):
        t = _scatter_targets(eqn, env)
        return None if t is None else t[0]
    return None


# --------------------------------------------------------------------------- dynamic slices


def _ds_window(eqn: JaxprEqn) -> R.Win:
    x = eqn.invars[0]
    nd = len(x.aval.shape)
    return R.Win(
        tuple(_origin(v) for v in eqn.invars[1 : 1 + nd]),
        tuple(eqn.params["slice_sizes"]),
        tuple(x.aval.shape),
        "clamp",
    )


def _ds_forward(eqn: JaxprEqn, env: Env) -> bool | ElementResult | None:
    x, *starts = eqn.invars
    o = eqn.outvars[0]
    if env.known(o) or not is_partial(env, x) or not all(env.known(s) for s in starts):
        return None
    w = _ds_window(eqn)
    piece = read_window(env, x, w)
    if piece is None:
        # (static starts: the structural handling may still know some of it)
        return ElementResult(None, _undecided(env, x, w, eqn))
    env.write(o, piece)
    return True


def _undecided(env: Env, x: Any, w: R.Win, read: JaxprEqn) -> dict:
    """A read that may overlap a write: what the write loses, whose inversion it blocks (the
    write's equation mapped to its `Lossy` reason)."""
    _, _, at = user_source(read)
    losses = {}
    for wrote in R.undecided(region_of(env, x), w, env.info):
        if wrote.source is not None:
            losses[wrote.source] = Lossy(
                f"could not prove that the index it writes differs from the index read by "
                f"`{read.primitive.name}` at {at or 'a line of library code'} (its update reads "
                "the element it overwrites at some iteration, or the indices are not known "
                "when the program is traced)",
                "Ways out: index with the loop counter and constants (x.at[i] and x[i - 1] "
                "in a fori_loop with static bounds), or keep the overwritten element in the "
                "state.",
            )
    return losses


def _ds_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    x, *starts = eqn.invars
    o = eqn.outvars[0]
    if env.known(x) or not env.known(o) or not all(env.known(s) for s in starts):
        return None
    return learn_piece(env, x, _ds_window(eqn), env.read(o))


define(
    prims.dynamic_slice,
    element=ElementRule(_ds_forward, _ds_backward),
    kind=(LINEAR, STRUCTURAL),
    index=(slice(1, None),),
)


def _dus_window(eqn: JaxprEqn) -> R.Win:
    x, u = eqn.invars[:2]
    nd = len(x.aval.shape)
    return R.Win(
        tuple(_origin(v) for v in eqn.invars[2 : 2 + nd]),
        tuple(u.aval.shape),
        tuple(x.aval.shape),
        "clamp",
        eqn,
    )


def _dus_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    x, u, *starts = eqn.invars
    o = eqn.outvars[0]
    if not all(env.known(s) for s in starts):
        return None
    ro = region_of(env, o)
    if ro == R.FULL:
        return False
    w = _dus_window(eqn)
    wrote = False
    if is_var(x) and not env.known(x):
        wrote = learn(env, x, value_of(env, o), R.union(ro, R.win_region(w, env.info), env.info))
    if is_var(u) and not env.known(u):
        piece = read_window(env, o, w)
        if piece is not None:
            env.write(u, piece)
            wrote = True
    return wrote


def _dus_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    x, u, *starts = eqn.invars
    o = eqn.outvars[0]
    if env.known(o) or not all(env.known(s) for s in starts):
        return None
    rx, ru = region_of(env, x), region_of(env, u)
    if rx == R.FULL or (not is_partial(env, x) and not is_partial(env, u)):
        return None
    w = _dus_window(eqn)
    region = R.union(
        R.intersect(rx, R.cowin_region(w, env.info), env.info),
        R.EMPTY if ru == R.EMPTY else R.win_region(w, env.info),
        env.info,
    )
    if region == R.FULL:
        return False
    uv = _zeros(u) if ru == R.FULL else value_of(env, u, clean=True)
    # (the primitive's own starts: clamped, never counted from the end again)
    corner = [env.read(s) for s in starts]
    out = lax.dynamic_update_slice(
        value_of(env, x, clean=True), uv, corner, allow_negative_indices=False
    )
    return learn(env, o, out, region)


define(
    prims.dynamic_update_slice,
    element=ElementRule(_dus_forward, _dus_backward),
    kind=(LINEAR, STRUCTURAL),
    index=(slice(2, None),),
)


# --------------------------------------------------------------------------- gathers


def _gather_window(eqn: JaxprEqn) -> R.Win | None:
    """The box a gather at one dynamic point reads, where its output is that box reshaped."""
    x, idx = eqn.invars
    dn = eqn.params["dimension_numbers"]
    if getattr(dn, "operand_batching_dims", ()) or not idx.aval.shape or isinstance(idx, Literal):
        return None
    if int(np.prod(idx.aval.shape[:-1], dtype=np.int64)) != 1:
        return None
    if list(dn.offset_dims) != sorted(dn.offset_dims):
        return None
    origin: list[Any] = [0] * len(x.aval.shape)
    for pos, d in enumerate(dn.start_index_map):
        origin[d] = (idx, pos)
    return R.Win(
        tuple(origin), tuple(eqn.params["slice_sizes"]), tuple(x.aval.shape), _mode(eqn.params)
    )


def _gather_forward(eqn: JaxprEqn, env: Env) -> bool | ElementResult | None:
    x, idx = eqn.invars
    o = eqn.outvars[0]
    if not env.known(o) and is_var(idx) and is_partial(env, idx):
        # (an index known on some elements: a spline's bin, taken element by element)
        return per_element_forward(eqn, env)
    if env.known(o) or not is_partial(env, x) or not env.known(idx):
        return None
    w = _gather_window(eqn)
    if w is None:
        return None
    if not R.window_known(region_of(env, x), w, env.info):
        return ElementResult(None, _undecided(env, x, w, eqn))
    env.write(o, apply(eqn, [value_of(env, x), env.read(idx)])[0])
    return True


def _gather_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    x, idx = eqn.invars
    o = eqn.outvars[0]
    if env.known(x) or not env.known(o) or not env.known(idx):
        return None
    w = _gather_window(eqn)
    if w is None:
        return None
    if w.mode == "drop" and not _always_fits(w, env):
        return False
    return learn_piece(env, x, w, env.read(o))


def _gather(
    out, operand, indices, *, ctx: RuleContext, dimension_numbers, slice_sizes, mode, **params
):
    """A gather of whole elements at indices known only when the program runs: invertible
    when they are a permutation, which is checked when the program runs."""
    if not is_unknown(operand) or is_unknown(indices):
        raise NeedMore("the gather's indices are not known yet")
    dn = dimension_numbers
    if any(s != 1 for s in slice_sizes) or getattr(dn, "operand_batching_dims", ()):
        raise Lossy(
            "a gather of windows at indices known only when the program runs may skip "
            "elements of its operand"
        )
    sdn = lax.ScatterDimensionNumbers(
        update_window_dims=dn.offset_dims,
        inserted_window_dims=dn.collapsed_slice_dims,
        scatter_dims_to_operand_dims=dn.start_index_map,
        operand_batching_dims=(),
        scatter_indices_batching_dims=(),
    )
    shape = operand.aval.shape
    counts = lax.scatter_add(
        jnp.zeros(shape, jnp.int32), indices, jnp.ones(out.shape, jnp.int32), sdn, mode="drop"
    )
    x = lax.scatter(
        jnp.zeros(shape, out.dtype), indices, out, sdn, mode="drop", unique_indices=True
    )
    perm = jnp.all(counts == 1)
    # not a permutation: some element of the operand is read never or twice, and lost
    who = ctx.walk.who
    raise_where(
        ctx.walk.on_error,
        lambda ok: (
            None
            if ok
            else NotInvertibleError(
                f"{who}: a gather's indices (known only when the program runs) are not a "
                "permutation of its operand's elements, so some element is lost"
            )
        ),
        perm,
        bad=~perm,
    )
    # a PRNG key has no NaN: where the check lets it through, the scattered keys stand
    return [x if is_key(x) else jnp.where(perm, x, jnp.nan), None]


define(
    prims.gather,
    inverse=_gather,
    element=ElementRule(_gather_forward, _gather_backward),
    kind=(LINEAR, STRUCTURAL),
    index=(1,),
    walks=True,
)


# --------------------------------------------------------------------------- slices


def _slice_window(eqn: JaxprEqn) -> R.Win | None:
    strides = eqn.params.get("strides") or ()
    if any(st != 1 for st in strides):
        return None
    start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
    return R.Win(
        tuple(int(a) for a in start),
        tuple(int(b - a) for a, b in zip(start, limit)),
        tuple(eqn.invars[0].aval.shape),
        "clamp",
    )


def _slice_forward(eqn: JaxprEqn, env: Env) -> bool | None:
    (x,) = eqn.invars
    o = eqn.outvars[0]
    w = _slice_window(eqn)
    if w is None or env.known(o) or not is_partial(env, x):
        return None
    piece = read_window(env, x, w)
    if piece is None:
        return None  # partly known there: the generic structural handling
    env.write(o, piece)
    return True


def _slice_backward(eqn: JaxprEqn, env: Env) -> bool | None:
    """A slice with unit strides gives back a window of its operand; slices that tile it are
    joined by `concatenate` (see `elements.learn_piece`)."""
    (x,) = eqn.invars
    o = eqn.outvars[0]
    w = _slice_window(eqn)
    if w is None or env.known(x) or not env.known(o):
        return None
    return learn_piece(env, x, w, env.read(o))


define(prims.slice, element=ElementRule(_slice_forward, _slice_backward), kind=(LINEAR, STRUCTURAL))


# --------------------------------------------------------------------------- moved positions
# Everything else that moves elements is handled by the generic index maps of `elements`.

define(prims.pad, kind=(LINEAR, STRUCTURAL))
