"""Sets of element positions (docs/design.md §3.5): where a partly known value is not known yet.

A value may be known on part of its elements. The walker keeps, for such a value, an array
that is right outside a `Region` (the positions still unknown) and garbage inside it. A region
is a union of conjunctions of atoms:

- `Mask`: a static set of positions (a mask known when the program is traced);
- `Pred`: where a known integer or boolean array takes one of some values (a `select_n`'s
  predicate known only when the program runs: diffrax's ``where(keep, new, old)``);
- `Win`: a box of positions whose corner is an index computed by the program (the element a
  loop's ``x.at[i].add(...)`` writes, a `dynamic_update_slice` window), and `CoWin`, its
  complement;
- `Spread`: the positions that read a window's positions through a relation known when traced
  (the outputs of a product by a matrix with zeros, a masked autoregressive layer, whose input
  is unknown in a window: the element a loop's step overwrites);
- `PerIteration`: a static set of positions at each iteration of the enclosing loop (the
  elements a loop's later iterations overwrite, when `rules.scan` asks whether its iterations
  can be undone all at once from the loop's final carry).

Deciding whether a conjunction is empty is what makes partial knowledge useful: ``p`` and
``not p`` cover everything; a read window disjoint from the written one is known. Windows are
compared by `relation`, on their corners' values at every iteration of the enclosing loop
(`Statics.enum`, exact) or, where those are not known at trace time, not at all (the
relation is then unknown, and the region stays as large as it was: regions only ever
over-approximate what is unknown, which is always safe).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import is_concrete

__all__ = [
    "Mask",
    "Pred",
    "Win",
    "CoWin",
    "Spread",
    "PerIteration",
    "Region",
    "EMPTY",
    "FULL",
    "mask_region",
    "pred_region",
    "win_region",
    "cowin_region",
    "union",
    "intersect",
    "implies",
    "pullback",
    "spread",
    "materialize",
    "relation",
    "has_windows",
    "window_known",
    "static_mask",
    "undecided",
    "IndexMap",
    "iteration_masks",
    "window_starts",
    "window_between",
]


# --------------------------------------------------------------------------- atoms


@dataclass(frozen=True)
class Mask:
    """A static set of positions."""

    bits: bytes
    shape: tuple

    @staticmethod
    def of(m: np.ndarray) -> Mask:
        m = np.asarray(m, bool)
        return Mask(np.packbits(m.ravel()).tobytes(), tuple(m.shape))

    @functools.cached_property
    def array(self) -> np.ndarray:
        """The positions as a boolean array, unpacked once per atom (a spread's relation is
        read at every simplification) and read-only, since every reader shares it."""
        n = int(np.prod(self.shape, dtype=np.int64))
        bits = np.unpackbits(np.frombuffer(self.bits, np.uint8), count=n)
        out = bits.astype(bool).reshape(self.shape)
        out.setflags(write=False)
        return out


class IndexMap:
    """Positions of one array read off another: ``out.flat[k] = src.flat[index[k]]``; where
    ``index[k] < 0`` the element comes from elsewhere, and counts as `fill`. Maps compose
    (`then`), so a region pulled back through many steps holds one; equal maps are equal
    (compared by content), so ``p`` and ``not p`` pulled back the same way still merge."""

    __slots__ = ("index", "shape", "_key", "_kind")

    def __init__(self, index: np.ndarray, shape: tuple, fill: bool | None = None) -> None:
        index = np.asarray(index, np.int64)
        if fill is not None:  # -1: False, -2: True
            index = np.where(index >= 0, index, -2 if fill else -1)
        self.index = index
        self.shape = tuple(shape)
        self._key = None
        self._kind: str | None = None

    def key(self) -> tuple:
        if self._key is None:
            self._key = (self.shape, hashlib.blake2b(self.index.tobytes(), digest_size=16).digest())
        return self._key

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, IndexMap) and (other is self or self.key() == other.key())

    def then(self, after: IndexMap) -> IndexMap:
        """This map followed by `after` (which reads this map's output)."""
        idx = after.index
        return IndexMap(np.where(idx >= 0, self.index[np.maximum(idx, 0)], idx), after.shape)

    def _form(self) -> str:
        """ "identity" (the source itself), "constant" (one source element everywhere), else
        "gather": most predicates are read whole or broadcast from a scalar, and a mask made
        when the program runs should then cost no gather."""
        if self._kind is None:
            idx = self.index
            self._kind = (
                "constant"
                if idx.size and idx[0] >= 0 and np.all(idx == idx[0])
                else "identity"
                if np.array_equal(idx, np.arange(idx.size))
                else "gather"
            )
        return self._kind

    def apply(self, m: Any) -> Any:
        """Pull a mask (numpy or jax) of the source back to the output's positions."""
        idx = self.index
        flat = m.reshape(-1)
        form = self._form()
        if form == "identity" and flat.shape[0] == idx.size:
            return flat.reshape(self.shape)
        if form == "constant" and not isinstance(m, np.ndarray):
            return jnp.broadcast_to(flat[int(idx[0])], self.shape)
        if isinstance(m, np.ndarray):
            out = np.where(idx >= 0, flat[np.maximum(idx, 0)], idx == -2)
            return out.reshape(self.shape)
        taken = take_static(flat, np.maximum(idx, 0))
        if (idx >= 0).all():
            return taken.reshape(self.shape)
        return jnp.where(idx >= 0, taken, idx == -2).reshape(self.shape)

    def take(self, x: Any) -> Any:
        """The elements of `x` (the source) at the map's positions (any element where the
        map has none), shaped as the output."""
        flat = jnp.reshape(x, (-1,))
        if self._form() == "identity" and flat.shape[0] == self.index.size:
            return jnp.reshape(x, self.shape)
        return take_static(flat, np.maximum(self.index, 0)).reshape(self.shape)


def take_static(flat: Any, idx: np.ndarray) -> Any:
    """``flat[idx]`` for in-bounds indices known when tracing: a slice, else one gather
    (jnp's indexing normalizes the indices with eager operations, dispatched one by one)."""
    idx = np.asarray(idx, np.int64).reshape(-1)
    n = idx.size
    if n and (n == 1 or bool(np.all(np.diff(idx) == 1))):
        return lax.slice(flat, (int(idx[0]),), (int(idx[0]) + n,))
    dnums = lax.GatherDimensionNumbers(
        offset_dims=(), collapsed_slice_dims=(0,), start_index_map=(0,)
    )
    return lax.gather(
        flat,
        idx.astype(np.int32).reshape(-1, 1),
        dnums,
        slice_sizes=(1,),
        mode=lax.GatherScatterMode.PROMISE_IN_BOUNDS,
    )


@dataclass(frozen=True)
class Pred:
    """Positions where the known array `var` (of shape `shape0`) takes a value in `cases`, out
    of `range(n)`, read through `maps`: one `IndexMap` from the region's positions (`shape`) to
    `var`'s elements (`pred_region` makes it; `pullback` composes it)."""

    var: Any
    cases: frozenset
    n: int
    shape0: tuple
    maps: tuple = ()

    @property
    def key(self) -> tuple:
        return (self.var, self.n, self.shape0, self.maps)

    @property
    def shape(self) -> tuple:
        return self.maps[-1].shape if self.maps else self.shape0


@dataclass(frozen=True)
class Win:
    """A box of positions: per dimension, `origin` (an int, or ``(var, k)``: element k of the
    integer array `var`, or the scalar `var` itself for k None) and `sizes`, in an array of
    `shape`. ``mode="clamp"``: the corner is clamped so that the box fits (`dynamic_slice`);
    ``"drop"``: a box that does not fit is no position at all (a scatter's FILL_OR_DROP)."""

    origin: tuple
    sizes: tuple
    shape: tuple
    mode: str
    source: Any = field(default=None, compare=False, hash=False)  # the equation writing it


@dataclass(frozen=True)
class CoWin:
    """Every position but a window's."""

    win: Win


@dataclass(frozen=True)
class Spread:
    """Positions p (of an array of `shape`) with ``rel[p, q]`` for some position q of the
    window `win` (on another array, flattened): what a product by a matrix whose zeros are
    known when traced makes of a window (a masked autoregressive network's outputs that read
    the element a loop's step overwrites). Decided, as windows are, at every iteration of the
    enclosing loop (`Statics.enum`); `spread` makes it."""

    win: Win
    rel: Mask  # (positions of `shape`, flattened) x (positions of the window's array)
    shape: tuple


@dataclass(frozen=True)
class PerIteration:
    """Positions (of an array of `shape`) that depend on the iteration of the enclosing loop, all
    known when traced: ``table.array[t]`` at iteration t (`Mask` of shape (iterations, *shape)).
    Only a dry run's regions hold one (`rules.scan`'s check that each iteration's results read
    nothing a later iteration overwrites): no value is computed under it."""

    table: Mask

    @property
    def shape(self) -> tuple:
        return self.table.shape[1:]

    @property
    def length(self) -> int:
        return self.table.shape[0]

    def rows(self) -> np.ndarray:
        """The table as (iterations, positions), flattened."""
        return self.table.array.reshape(self.length, -1)


Atom = Any
Conj = frozenset
Region = frozenset
EMPTY: Region = frozenset()
FULL: Region = frozenset({frozenset()})


def mask_region(m: np.ndarray) -> Region:
    m = np.asarray(m, bool)
    if not m.any():
        return EMPTY
    if m.all():
        return FULL
    return frozenset({frozenset({Mask.of(m)})})


def pred_region(var: Any, cases: Iterable[int], n: int, shape: tuple) -> Region:
    """Where the known array `var` (broadcast to `shape`) takes a value in `cases`. The atom is
    canonical: it holds one map from the region's positions to `var`'s own elements (the
    broadcast folded in), so the same predicate pulled back through permutations that undo
    each other (a reversal applied twice), or a scalar predicate through any permutation, is
    the same atom, and ``p`` and ``not p`` cancel (docs/design.md §3.5: a predicate known when
    the program runs never splits a walk)."""
    cases = frozenset(int(c) for c in cases if 0 <= int(c) < n)
    if not cases:
        return EMPTY
    if len(cases) == n:
        return FULL
    vshape = tuple(var.aval.shape)
    size = int(np.prod(vshape, dtype=np.int64))
    src = np.broadcast_to(np.arange(size, dtype=np.int64).reshape(vshape), tuple(shape))
    im = IndexMap(np.ascontiguousarray(src).reshape(-1), tuple(shape))
    return frozenset({frozenset({Pred(var, cases, n, vshape, (im,))})})


def _box(w: Win) -> np.ndarray | None:
    """A window at a static corner, as a static mask (exact reasoning: masks intersect and
    cover exactly)."""
    if not all(isinstance(o, (int, np.integer)) for o in w.origin):
        return None
    m = np.zeros(w.shape, bool)
    idx = []
    for o, z, n in zip(w.origin, w.sizes, w.shape):
        o = int(o)
        if w.mode == "clamp":
            o = min(max(o, 0), max(n - z, 0))
        elif o < 0 or o + z > n:
            return m
        idx.append(slice(o, o + z))
    m[tuple(idx)] = True
    return m


def resolve(w: Win, statics: Any) -> Win:
    """`w` with the corners known at trace time (a variable with a static value: an index
    computed from `iota` and literals) written as ints, so that it becomes a static box."""
    if statics is None or all(isinstance(o, (int, np.integer)) for o in w.origin):
        return w
    origin = []
    for o in w.origin:
        c = _corner(o, statics) if not isinstance(o, (int, np.integer)) else ("static", o)
        if c is None or c[0] != "static":
            return w
        origin.append(c[1])
    return replace(w, origin=tuple(origin))


def win_region(w: Win, statics: Any = None) -> Region:
    box = _box(resolve(w, statics))
    return mask_region(box) if box is not None else frozenset({frozenset({w})})


def cowin_region(w: Win, statics: Any = None) -> Region:
    box = _box(resolve(w, statics))
    return mask_region(~box) if box is not None else frozenset({frozenset({CoWin(w)})})


def has_windows(r: Region) -> bool:
    return any(isinstance(a, (Win, CoWin)) for c in r for a in c)


# --------------------------------------------------------------------------- window relations


def _corner(o: Any, statics: Any) -> tuple[str, Any] | None:
    """One coordinate of a window's corner: ("static", int), ("enum", values per iteration),
    or None where it is not known at trace time."""
    if isinstance(o, (int, np.integer)):
        return "static", int(o)
    var, k = o
    s = statics.static(var) if statics is not None else None
    if s is not None:
        s = np.asarray(s)
        return "static", int(s if k is None else s.reshape(-1)[k])
    e = statics.enum(var) if statics is not None else None
    if e is not None:
        e = np.asarray(e)
        return "enum", (e if k is None else e.reshape(e.shape[0], -1)[:, k]).astype(np.int64)
    return None


def _starts(w: Win, statics: Any) -> tuple[list[Any], Any] | None:
    """Per dimension the box's start (int or array over iterations) after the mode's clamping,
    and where the box exists (bool, or array over iterations)."""
    starts, valid = [], True
    for o, z, n in zip(w.origin, w.sizes, w.shape):
        c = _corner(o, statics)
        if c is None:
            return None
        s, fits = _placed(c[1], z, n, w.mode, np.clip)
        valid = valid & fits
        starts.append(s)
    return starts, valid


def _placed(corner: Any, size: int, n: int, mode: str, clip: Callable) -> tuple[Any, Any]:
    """A window's start along one dimension of `n` positions, as its mode places it (`clip`:
    numpy's when traced, jnp's when the program runs), and whether it is there at all."""
    if mode == "clamp":
        return clip(corner, 0, max(n - size, 0)), True
    return corner, (corner >= 0) & (corner + size <= n)


def relation(a: Win, b: Win, statics: Any) -> str | None:
    """ "same" (the same positions at every iteration), "disjoint" (none in common at any
    iteration), or None (not decided)."""
    if a == b:
        return "same"
    if a.shape != b.shape:
        return None
    sa, sb = _starts(a, statics), _starts(b, statics)
    if sa is None or sb is None:
        return None
    (xa, va), (xb, vb) = sa, sb
    same = np.asarray(True)
    apart = np.asarray(False)
    for s1, z1, s2, z2 in zip(xa, a.sizes, xb, b.sizes):
        same = same & (np.asarray(s1) == s2) & (z1 == z2)
        apart = apart | (np.asarray(s1) + z1 <= s2) | (np.asarray(s2) + z2 <= s1)
    va, vb = np.asarray(va), np.asarray(vb)
    if np.all((~va & ~vb) | (va & vb & same)):
        return "same"
    if np.all(~va | ~vb | apart):
        return "disjoint"
    return None


def _window_meets_mask(w: Win, m: np.ndarray, statics: Any) -> bool | None:
    """Whether the window covers any position of the static mask at some iteration."""
    st = _starts(w, statics)
    if st is None:
        return None
    starts, valid = st
    T = max([np.size(s) for s in starts] + [np.size(valid)])
    starts = [np.broadcast_to(np.asarray(s), (T,)) if np.ndim(s) else np.full(T, s) for s in starts]
    valid = np.broadcast_to(np.asarray(valid), (T,))
    if T > 1_000_000:
        return None
    # (a dropped box's corner may lie outside: placed anywhere inside, it is not counted)
    starts = [np.clip(s, 0, max(n - z, 0)) for s, z, n in zip(starts, w.sizes, m.shape)]
    # a summed-area table answers "any mask position in this box" in O(1) per iteration
    sat = np.pad(np.asarray(m, np.int64), [(1, 0)] * m.ndim)
    for d in range(m.ndim):
        sat = np.cumsum(sat, axis=d)
    total = np.zeros(T, np.int64)
    for corner in np.ndindex(*([2] * m.ndim)):
        idx = tuple(s + (z if c else 0) for s, z, c in zip(starts, w.sizes, corner))
        sign = (-1) ** (m.ndim - sum(corner))
        total += sign * sat[idx]
    return bool(np.any(valid & (total > 0)))


_MAX_ENUMERATED = 1 << 25
"""Iterations x positions beyond which a region is not decided by enumerating its masks."""

MAX_RELATION = 1 << 24
"""Positions x window positions beyond which no `Spread` is built (its relation is made when
tracing, and kept as a constant of the program): the region is then every position."""


def _iteration_masks(a: Any, shape: tuple, statics: Any) -> np.ndarray | None:
    """The atom's positions at every iteration, (T or 1, positions) flattened; None where
    they are not known at trace time (a run-time predicate: it can only make a conjunction
    smaller, so deciding emptiness without it is safe)."""
    size = int(np.prod(shape, dtype=np.int64))
    if isinstance(a, Mask):
        return a.array.reshape(1, -1) if a.shape == tuple(shape) else None
    if isinstance(a, PerIteration):
        return a.rows() if a.shape == tuple(shape) else None
    if isinstance(a, CoWin):
        inside = _iteration_masks(a.win, shape, statics)
        return None if inside is None else ~inside
    if isinstance(a, Win):
        st = _starts(a, statics)
        if st is None or a.shape != tuple(shape):
            return None
        starts, valid = st
        T = max([np.size(x) for x in starts] + [np.size(valid)])
        if T == 0 or T * size > _MAX_ENUMERATED:
            return None
        out = np.ones((T,) + tuple(shape), bool)
        for d, (x, z, n) in enumerate(zip(starts, a.sizes, a.shape)):
            x = np.broadcast_to(np.asarray(x, np.int64).reshape(-1), (T,))
            pos = np.arange(n)
            here = (pos[None, :] >= x[:, None]) & (pos[None, :] < x[:, None] + z)
            view = [T] + [1] * len(shape)
            view[d + 1] = n
            out &= here.reshape(view)
        fits = np.broadcast_to(np.asarray(valid).reshape(-1), (T,))
        out &= fits.reshape((T,) + (1,) * len(shape))
        return out.reshape(T, size)
    if isinstance(a, Spread):
        if a.shape != tuple(shape):
            return None
        box = _iteration_masks(a.win, a.win.shape, statics)
        rel = a.rel.array
        if box is None or box.shape[0] * size > _MAX_ENUMERATED:
            return None
        if np.all(box.sum(axis=1) <= 1):  # one position per iteration: a column of rel
            return rel[:, box.argmax(axis=1)].T & box.any(axis=1)[:, None]
        return (box.astype(np.float32) @ rel.T.astype(np.float32)) > 0
    return None


def _enumerated_empty(c: Conj, statics: Any) -> bool:
    """Whether the conjunction's atoms known at every iteration have no position in common at
    any iteration."""
    shapes = [a.shape for a in c if isinstance(a, (Mask, Win, Spread, PerIteration))]
    if not shapes:
        return False
    both = None
    for a in c:
        m = _iteration_masks(a, shapes[0], statics)
        if m is None:
            continue
        rows = (both.shape[0], m.shape[0]) if both is not None else (1, 1)
        if rows[0] != rows[1] and 1 not in rows:
            return False  # (loops of different lengths: not comparable)
        both = m if both is None else both & m
    return both is not None and not both.any()


def spread(r: Region, rel: np.ndarray, shape: tuple) -> Region:
    """The positions of an array of `shape` that read a position of `r` through the static
    relation `rel` (positions of `shape` x positions of `r`'s array, flattened): the unknown
    outputs of a product by a matrix with zeros known when traced. A conjunction of static
    masks gives a static mask; one with windows (or spread windows) the `Spread` of one of
    them (each is a superset of what reads the conjunction's positions); atoms that cannot be
    carried through (run-time predicates, complements of windows, the other windows) are
    dropped, which only makes the region larger (safe: regions over-approximate)."""
    rel = np.asarray(rel, bool)
    out = []
    for c in r:
        keep = np.ones(rel.shape[1], bool)
        for a in c:
            if isinstance(a, Mask):
                keep &= a.array.reshape(-1)
        through = rel & keep[None, :]
        staged = [a for a in c if isinstance(a, PerIteration)]
        if staged:  # (static at every iteration: preferred to a window's spread, made at run time)
            rows = staged[0].rows()
            for a in staged[1:]:
                rows = rows & a.rows()
            if rows.shape[0] * rel.shape[0] > _MAX_ENUMERATED:
                return FULL
            hit = (rows.astype(np.float32) @ through.T.astype(np.float32)) > 0
            if hit.any():
                out.append(frozenset({PerIteration(Mask.of(hit.reshape((-1, *shape))))}))
            continue
        carriers = [a for a in c if isinstance(a, (Win, Spread))]
        if not carriers:
            out.append(frozenset({Mask.of(through.any(axis=1).reshape(shape))}))
            continue
        spreads = []
        for a in carriers:
            size = rel.shape[0] * (a.rel.array.shape[1] if isinstance(a, Spread) else rel.shape[1])
            if size > MAX_RELATION:
                return FULL
            if isinstance(a, Spread):
                spread_rel = (through.astype(np.float32) @ a.rel.array.astype(np.float32)) > 0
                spreads.append(Spread(a.win, Mask.of(spread_rel), tuple(shape)))
            else:
                spreads.append(Spread(a, Mask.of(through), tuple(shape)))
        # one of them (each is a superset; all of them would be more masks to make when the
        # program runs), chosen by the relation's size and bits, not by the conjunction's order
        # (its atoms' hashes, which vary between runs): the widest, since a narrower one lets
        # the walk learn a few elements early, each a pass of the network more in the inverse
        # program (measured on flowjax's MAF inverse loop, which both invert)
        best = max(spreads, key=lambda a: (int(a.rel.array.sum()), a.rel.bits))
        if best.rel.array.any():
            out.append(frozenset({best}))
    return _simplify(out, None)


# --------------------------------------------------------------------------- conjunctions


def _simplify_conj(c: Conj, statics: Any) -> Conj | None:
    """A conjunction with its atoms merged; None when it is provably empty."""
    masks = [a for a in c if isinstance(a, Mask)]
    preds: dict[tuple, Pred] = {}
    wins = [a for a in c if isinstance(a, Win)]
    cowins = [a for a in c if isinstance(a, CoWin)]
    out: set = set()
    if masks:
        m = masks[0].array
        for a in masks[1:]:
            m = m & a.array
        if not m.any():
            return None
        if not m.all():
            out.add(Mask.of(m))
    for a in c:
        if isinstance(a, Pred):
            p = preds.get(a.key)
            cases = a.cases if p is None else p.cases & a.cases
            if not cases:
                return None
            preds[a.key] = Pred(a.var, cases, a.n, a.shape0, a.maps)
    out.update(p for p in preds.values() if len(p.cases) < p.n)
    for i, w in enumerate(wins):
        for v in wins[i + 1 :]:
            if relation(w, v, statics) == "disjoint":
                return None
    kept_wins = []
    for w in wins:
        if not any(relation(w, v, statics) == "same" for v in kept_wins):
            kept_wins.append(w)
    out.update(kept_wins)
    for cw in cowins:
        rels = [relation(w, cw.win, statics) for w in kept_wins]
        if "same" in rels:
            return None
        if rels and "disjoint" in rels:
            continue  # the window is inside the complement already
        out.add(cw)
    mask_atoms = [a for a in out if isinstance(a, Mask)]
    if mask_atoms:
        m = mask_atoms[0].array
        for w in kept_wins:
            meets = _window_meets_mask(w, m, statics)
            if meets is False:
                return None
    staged = [a for a in c if isinstance(a, PerIteration)]
    if staged:
        rows = staged[0].rows()
        for a in staged[1:]:
            if a.length != rows.shape[0]:
                return frozenset(c)  # (loops of different lengths: kept as they are)
            rows = rows & a.rows()
        if not rows.any():
            return None
        out.add(PerIteration(Mask.of(rows.reshape((-1, *staged[0].shape)))))
    spreads = [a for a in c if isinstance(a, Spread)]
    if spreads:
        if any(not a.rel.array.any() for a in spreads):
            return None
        out.update(spreads)
    if (spreads and statics is not None) or staged:
        if _enumerated_empty(frozenset(out), statics):
            return None
    return frozenset(out)


def _merge_pair(a: Conj, b: Conj) -> Conj | None:
    """(A and x) or (A and y) as one conjunction A and (x or y), where that is one atom."""
    da, db = a - b, b - a
    if len(da) != 1 or len(db) != 1:
        return None
    (x,), (y,) = tuple(da), tuple(db)
    rest = a & b
    if isinstance(x, Pred) and isinstance(y, Pred) and x.key == y.key:
        cases = x.cases | y.cases
        if len(cases) == x.n:
            return rest
        return rest | {Pred(x.var, cases, x.n, x.shape0, x.maps)}
    if isinstance(x, Mask) and isinstance(y, Mask) and x.shape == y.shape:
        m = x.array | y.array
        return rest if m.all() else rest | {Mask.of(m)}
    if (
        isinstance(x, PerIteration)
        and isinstance(y, PerIteration)
        and x.table.shape == y.table.shape
    ):
        m = x.table.array | y.table.array
        return rest if m.all() else rest | {PerIteration(Mask.of(m))}
    if isinstance(x, Win) and isinstance(y, CoWin) and y.win == x:
        return rest
    if isinstance(y, Win) and isinstance(x, CoWin) and x.win == y:
        return rest
    return None


def _reduce_by(c: Conj, by: Conj) -> Conj | None:
    """`c` less an atom `by` makes redundant ((R and x) or (R and y and T) is (R and x) or
    (R and T) where x or y is everything), or None: else steps masked by the same predicates
    grow a conjunction per step."""
    preds = [x for x in by if isinstance(x, Pred)]
    if not preds or len(by) > len(c):
        return None
    for x in preds:
        rest = by - {x}
        if not rest <= c:
            continue
        for y in c:
            if (
                isinstance(y, Pred)
                and y.key == x.key
                and y is not x
                and len(x.cases | y.cases) == x.n
            ):
                return c - {y}
    return None


def _simplify(r: Iterable[Conj], statics: Any) -> Region:
    conjs = []
    for c in r:
        s = _simplify_conj(frozenset(c), statics)
        if s is None:
            continue
        if not s:
            return FULL
        conjs.append(s)
    changed = True
    while changed and len(conjs) > 1:
        changed = False
        # absorption: a conjunction implied by a weaker one adds nothing
        conjs.sort(key=len)
        kept: list = []
        for c in conjs:
            if not any(k <= c for k in kept):
                kept.append(c)
        changed = len(kept) != len(conjs)
        conjs = kept
        for i in range(len(conjs)):
            for j in range(len(conjs)):
                r2 = _reduce_by(conjs[i], conjs[j]) if i != j else None
                if r2 is not None:
                    if not r2:
                        return FULL
                    conjs[i] = r2
                    changed = True
        for i in range(len(conjs)):
            for j in range(i + 1, len(conjs)):
                m = _merge_pair(conjs[i], conjs[j])
                if m is not None:
                    s = _simplify_conj(m, statics)
                    rest = [c for k, c in enumerate(conjs) if k not in (i, j)]
                    if s is not None and not s:
                        return FULL
                    conjs = rest + ([s] if s is not None else [])
                    changed = True
                    break
            if changed:
                break
    return frozenset(conjs)


def union(a: Region, b: Region, statics: Any = None) -> Region:
    if a == EMPTY or b == FULL:
        return b
    if b == EMPTY or a == FULL:
        return a
    return _simplify(a | b, statics)


def intersect(a: Region, b: Region, statics: Any = None) -> Region:
    if a == EMPTY or b == EMPTY:
        return EMPTY
    if a == FULL:
        return b
    if b == FULL:
        return a
    return _simplify([ca | cb for ca in a for cb in b], statics)


MAX_PREDICATES, MAX_CONJUNCTIONS = 3, 16
"""Run-time predicates and conjunctions one region may hold (docs/design.md §3.5). A masked
step completes with its own predicate and its complement; a region mixing several steps'
predicates comes from knowledge spread across steps first, and grows with every step."""


def too_complex(r: Region) -> bool:
    """Whether `r` exceeds the bound that keeps tracing linear: the walk does not record it."""
    return r not in (EMPTY, FULL) and (
        len(r) > MAX_CONJUNCTIONS
        or len({id(a.var) for c in r for a in c if isinstance(a, Pred)}) > MAX_PREDICATES
    )


def implies(a: Region, b: Region) -> bool:
    """Whether `a` is inside `b`, as far as the atoms show (every conjunction of `a` has one
    of `b` whose atoms it contains)."""
    return all(any(cb <= ca for cb in b) for ca in a)


def pullback(r: Region, m: IndexMap) -> Region:
    """The region on the output of `m` (positions whose source position is in `r`; the map's
    fill where the element comes from elsewhere). A window becomes a `Spread` of it; the
    complement of one does not survive it: a conjunction with one becomes every position
    (still an over-approximation of the unknown)."""
    if r == EMPTY:
        return mask_region((m.index == -2).reshape(m.shape))
    out = []
    for c in r:
        if any(isinstance(a, CoWin) for a in c):
            return FULL
        conjs: list[set] = [set()]
        for a in c:
            if isinstance(a, Win):  # a window read through the map: a spread of it
                size = int(np.prod(a.shape, dtype=np.int64))
                if size * m.index.size > MAX_RELATION:
                    return FULL
                a = Spread(a, Mask.of(np.eye(size, dtype=bool)), a.shape)
            if isinstance(a, Mask):
                for cj in conjs:
                    cj.add(Mask.of(m.apply(a.array)))
            elif isinstance(a, PerIteration):
                idx = m.index
                rows = np.where(idx >= 0, a.rows()[:, np.maximum(idx, 0)], idx == -2)
                for cj in conjs:
                    cj.add(PerIteration(Mask.of(rows.reshape((a.length, *m.shape)))))
            elif isinstance(a, Spread):
                if (m.index == -2).any():
                    return FULL
                rows = a.rel.array[np.maximum(m.index, 0)] & (m.index >= 0)[:, None]
                for cj in conjs:
                    cj.add(Spread(a.win, Mask.of(rows), m.shape))
            else:
                conjs = [
                    cj | alt
                    for cj in conjs
                    for alt in _pred_pulled(a, a.maps[0].then(m) if a.maps else m)
                ]
        if not c:
            conjs[0].add(Mask.of(np.where(m.index >= 0, True, m.index == -2).reshape(m.shape)))
        out.extend(frozenset(cj) for cj in conjs)
    return _simplify(out, None)


def _pred_pulled(a: Pred, im: IndexMap) -> list[set]:
    """`a` read through `im`, canonical: a predicate on every position (reading element 0
    where `im` has none, a static mask saying where it speaks), or the fill's positions. A
    scalar predicate cut and joined again (a roll) stays one atom, and cancels its complement."""
    idx = im.index
    if not (idx < 0).any():
        return [{Pred(a.var, a.cases, a.n, a.shape0, (im,))}]
    total = Pred(a.var, a.cases, a.n, a.shape0, (IndexMap(np.maximum(idx, 0), im.shape),))
    alts = []
    if (idx >= 0).any():
        read = (idx >= 0).reshape(im.shape)
        alts.append({total} if read.all() else {total, Mask.of(read)})
    inside = (idx == -2).reshape(im.shape)
    if inside.any():
        alts.append({Mask.of(inside)})
    return alts or [{Mask.of(np.zeros(im.shape, bool))}]


# --------------------------------------------------------------------------- run-time masks


def window_starts(w: Win, read: Callable[[Any], Any], xp: Any = jnp) -> tuple[list[Any], Any]:
    """The window's corner when the program runs (`read` gives a variable's value), clamped
    as its mode says, and whether it is a position at all (True, or a boolean scalar for a
    "drop" window that may not fit). `xp`: numpy where every value read is known when traced
    (`materialize`)."""
    starts, fits = [], True
    for o, z, n in zip(w.origin, w.sizes, w.shape):
        if isinstance(o, (int, np.integer)):
            s = np.asarray(int(o), np.int32)
        else:
            var, k = o
            v = read(var)
            s = (v if k is None else xp.reshape(v, (-1,))[k]).astype(xp.int32)
        # (a start known when traced placed by numpy, not by operations compiled meanwhile)
        s, there = _placed(s, z, n, w.mode, np.clip if is_concrete(s) else xp.clip)
        fits = fits & there
        starts.append(s)
    return starts, fits


def window_between(before: Region, after: Region, statics: Any) -> Win | None:
    """The one window that is `before` but not `after` (a loop step's recovered element:
    unknown before the step, the window and what reads it; after it, what reads it), where
    the atoms show that (one conjunction of `before` is a window disjoint from `after` at
    every iteration, and `after` holds the others), or, where `before` names one window,
    their positions at every iteration of the enclosing loop do (a window within a spread: a
    conditional flow's network reads its state joined to the condition). None otherwise."""
    wins = [c for c in before if len(c) == 1 and isinstance(next(iter(c)), Win)]
    if len(wins) == 1:
        w = next(iter(wins[0]))
        if implies(frozenset(c for c in before if c != wins[0]), after) and (
            intersect(win_region(w, statics), after, statics) == EMPTY
        ):
            return w
    named = {a for c in before for a in c if isinstance(a, Win)}
    length = getattr(statics, "length", None)
    enumerable = (Mask, Win, CoWin, Spread, PerIteration)
    if len(named) != 1 or not length:
        return None
    if not all(isinstance(a, enumerable) for c in (*before, *after) for a in c):
        return None
    (w,) = named
    shape = tuple(w.shape)
    if length * int(np.prod(shape, dtype=np.int64)) > _MAX_ENUMERATED:
        return None
    inside = _iteration_masks(w, shape, statics)
    if inside is None or inside.shape[0] != length:
        return None
    b, a = (iteration_masks(r, shape, length, statics) for r in (before, after))
    return w if np.array_equal((b & ~a).reshape(length, -1), inside) else None


def _window_mask(w: Win, read: Callable[[Any], Any], xp: Any = jnp) -> Any:
    starts, fits = window_starts(w, read, xp)
    inside = (np if is_concrete(fits) else xp).broadcast_to(fits, w.shape)
    positions = np.indices(w.shape, np.int32)  # (constants, staged only where they meet a start)
    for d, (s, z) in enumerate(zip(starts, w.sizes)):
        inside = inside & (positions[d] >= s) & (positions[d] < s + z)
    return inside


def _spread_mask(a: Spread, read: Callable[[Any], Any], xp: Any = jnp) -> Any:
    box = xp.reshape(_window_mask(a.win, read, xp), (-1,))
    rel = a.rel.array
    if int(np.prod(a.win.sizes, dtype=np.int64)) == 1:
        # one position: the relation's column there (a window that does not fit: none)
        if xp is np:
            col = rel[:, int(np.argmax(box))]
        else:
            col = lax.dynamic_index_in_dim(jnp.asarray(rel), jnp.argmax(box), 1, keepdims=False)
        return xp.reshape(col & xp.any(box), a.shape)
    hits = xp.asarray(rel, xp.float32) @ box.astype(xp.float32)
    return xp.reshape(hits > 0, a.shape)


def _pred_mask(a: Pred, read: Callable[[Any], Any]) -> Any:
    v = read(a.var)
    v = v.astype(jnp.int32) if v.dtype == jnp.bool_ else v
    hit = None
    for c in sorted(a.cases):
        h = v == c
        hit = h if hit is None else hit | h
    m = jnp.broadcast_to(hit, a.shape0)
    for im in a.maps:
        m = im.apply(m)
    return m


def materialize(
    r: Region, shape: tuple, read: Callable[[Any], Any], cache: dict | None = None
) -> Any:
    """The region as a boolean array when the program runs (`read` gives a variable's value;
    `cache` keeps the arrays made for a walk, which every copy of its env shares)."""
    if cache is not None:
        key = (r, tuple(shape))
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = materialize(r, shape, read)
        return hit
    if r == EMPTY:
        return np.zeros(shape, bool)
    if r == FULL:
        return np.ones(shape, bool)
    out = None
    for c in r:
        m = None
        for a in c:
            am = _atom_mask(a, read)
            m = am if m is None else m & am
        m = np.ones(shape, bool) if m is None else _broadcast(m, shape)
        out = m if out is None else out | m
    return out


def _broadcast(m: Any, shape: tuple) -> Any:
    return np.broadcast_to(m, shape) if isinstance(m, np.ndarray) else jnp.broadcast_to(m, shape)


class _Traced(Exception):
    """An atom's mask reads a value known only when the program runs."""


def _atom_mask(a: Any, read: Callable[[Any], Any]) -> Any:
    """One atom of a region as a boolean array: numpy where every value it reads is known
    when traced (under a walk that folds constants, each jnp operation of a new shape was an
    XLA program compiled while tracing), else staged into the program."""
    if isinstance(a, Mask):
        return a.array
    if isinstance(a, PerIteration):
        # no iteration is current outside the dry run that made it: every position some
        # iteration names (an over-approximation of the unknown, always safe)
        return a.table.array.any(axis=0)
    if isinstance(a, Pred):
        return _pred_mask(a, read)

    def concrete(var: Any) -> Any:
        v = read(var)
        if not is_concrete(v):
            raise _Traced
        return np.asarray(v)

    try:
        return _box_mask(a, concrete, np)
    except _Traced:
        return _box_mask(a, read, jnp)


def _box_mask(a: Any, read: Callable[[Any], Any], xp: Any) -> Any:
    """A `Win`'s, `Spread`'s or `CoWin`'s mask, with `xp`'s operations."""
    if isinstance(a, Win):
        return _window_mask(a, read, xp)
    if isinstance(a, Spread):
        return _spread_mask(a, read, xp)
    return ~_window_mask(a.win, read, xp)


def iteration_masks(r: Region, shape: tuple, length: int, statics: Any) -> np.ndarray:
    """The region's positions at each of `length` iterations of the enclosing loop, as a
    (length, *shape) boolean array: each conjunction's atoms known at every iteration
    intersected, an atom that is not (a run-time predicate) taken as every position (an
    over-approximation)."""
    size = int(np.prod(shape, dtype=np.int64))
    out = np.zeros((length, size), bool)
    for c in r:
        m = np.ones((length, size), bool)
        for a in c:
            am = _iteration_masks(a, tuple(shape), statics)
            if am is not None and am.shape[0] in (1, length):
                m &= am
        out |= m
    return out.reshape((length, *shape))


def static_mask(r: Region, shape: tuple) -> np.ndarray | None:
    """The region as a numpy mask where it is made of static masks only, else None."""
    out = np.zeros(shape, bool)
    for c in r:
        m = np.ones(shape, bool)
        for a in c:
            if not isinstance(a, Mask):
                return None
            m = m & a.array
        out = out | m
    return out


def undecided(r: Region, w: Win, statics: Any) -> list[Win]:
    """The windows of `r` whose relation to `w` could not be decided."""
    return [a for c in r for a in c if isinstance(a, Win) and relation(a, w, statics) is None]


def window_known(r: Region, w: Win, statics: Any) -> bool:
    """Whether every position of the window `w` is outside the unknown region `r`."""
    return intersect(r, win_region(w, statics), statics) == EMPTY
