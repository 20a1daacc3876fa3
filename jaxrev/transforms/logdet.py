"""log|det J| and its sign from the inversion sweep (docs/design.md §3.7).

Inverting a program recovers its inputs from its outputs one step at a time: an equation's
inverse or element rule recovers some elements U of its inputs from elements O of its output,
a group step (a lump, a state-dependent choice, a Newton group) recovers its unknown inputs
from its known outputs. Seen as a change of variables, each step replaces the "slots" O of the
current n independent values by U, so (docs/design.md §3.4)

    det J⁻¹ = sign(σ) · ∏ det(∂U/∂O) = sign(σ) / ∏ det(∂O/∂U),

where σ is where the inputs' elements end up among the outputs' slots. The record of the walk
(`records`) says which step recovered what; this module turns it into a `Plan` at trace time
(which slots each step takes over: positional for elementwise steps, the index map for steps
that move elements, flat order otherwise) and evaluates each step's det(∂O/∂U) on the values:

- a step positional in the recovered operand (elementwise primitives, a select's case, a
  scatter's operand): the diagonal, from one JVP, summed over the recovered elements only;
- a step that only moves elements (reshape, transpose, slices, concatenate, gather): 1, its
  permutation counted in σ;
- a primitive with a `logdet_rules` entry (loops, `dot_general` by a known square matrix,
  `cumsum`, `custom_inverse`, the user's `register_logdet`);
- a group: k×k blocks per element when it is elementwise (a JVP per unknown), else its dense
  Jacobian (at most `DENSE_STEP` unknowns).

Anything else is `Unsupported`: the caller then materialises J (the "dense" strategy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxrev._dense as dense
from jaxrev._compat import DropVar, JaxprEqn, Var, is_concrete, prims, scan_info
from jaxrev._env import Env
from jaxrev._evaluate import apply, apply_on_host, evaluate
from jaxrev._graph import real_outvars, size_of
from jaxrev.transforms.knowledge import elements, records
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.propagation.lumps import slogdet_of
from jaxrev.transforms.propagation.nonlinear import torn_slogdet
from jaxrev.transforms.propagation.walker import linear_walk
from jaxrev.transforms.registry import (
    DENSE_STEP,
    ELEMENTWISE,
    STRUCTURAL,
    LogdetContext,
    LogdetResult,
    Unsupported,
    elementwise_in,
    index_args,
    is_kind,
    logdet_rules,
)

__all__ = [
    "Unsupported",
    "Plan",
    "plan",
    "evaluate_plan",
    "rule_step",
    "env_reader",
    "rule_steps",
    "run_forward",
    "LogdetResult",
    "LogdetContext",
    "DENSE_STEP",
    "UNSIGNED_RULE",
    "UNSIGNED_PERM",
]

"""Largest step (recovered elements) whose Jacobian is materialised when it has no structure."""

# operands in which these primitives are positional: output element p depends on the
# operand's element p only (a select's cases, a scatter's or dynamic update's operand)
_POSITIONAL = MappingProxyType(
    {
        p: ks
        for p, ks in (
            (prims.select_n, "cases"),
            (prims.scatter_add, (0,)),
            (prims.scatter_mul, (0,)),
            (prims.scatter, (0,)),
            (prims.dynamic_update_slice, (0,)),
        )
        if p is not None
    }
)
# inputs that these primitives copy into their output (an update's elements)
_COPIES = MappingProxyType(
    {
        p: ks
        for p, ks in ((prims.scatter, (2,)), (prims.dynamic_update_slice, (1,)))
        if p is not None
    }
)


def _inexact(v: Any) -> bool:
    return isinstance(v, Var) and jnp.issubdtype(v.aval.dtype, jnp.inexact)


def _shape(v: Any) -> tuple:
    return tuple(v.aval.shape)


@dataclass
class _PStep:
    """A step of the plan: how to evaluate it (`how`) and what it needs."""

    how: str  # "positional" | "structural" | "rule" | "blocks" | "dense"
    step: records.Step
    parts: list = field(default_factory=list)  # positional: (input index, region or None)
    child: Plan | None = None


@dataclass
class Plan:
    """A walk's record made into the steps to evaluate, with the sign of σ (None where the
    slots could not be followed at trace time, `unsigned` saying why), whether σ is the
    identity pairing of goals and seeded outputs (a loop body's), and the walk's trace-time
    knowledge (`info`)."""

    steps: list[_PStep]
    perm_sign: int | None
    identity: bool
    info: Any
    recorder: records.Recorder
    unsigned: str | None = None


UNSIGNED_RULE = "a `deflogdet` rule returns no sign"
UNSIGNED_PERM = "the sign of a permutation the program applies is not followed"


OPAQUE = -2
"""The slot of an element recovered by a step whose element map is not known at trace time."""


class _Slots:
    """Which output slot each known element of each variable holds (-1: none, a value computed
    forward from others)."""

    def __init__(self) -> None:
        self.of: dict[Var, np.ndarray] = {}
        self.exact = True
        self.pairs: set = set()  # (recovered, output) taken over at run-time elements
        # how many recorded steps recovered elements of each variable, and those that took
        # all of an output's slots at elements decided when the program runs, some of whose
        # elements were left to other steps (`claim`)
        self.steps_of: dict[Var, int] = {}
        self.claimed: set = set()
        self.claimed_from: set = set()  # the outputs such steps took slots of
        self.sign = 1  # the iterated permutations of loop bodies
        self.unsigned = False  # a step whose rule gives log|det| only
        # a loop body's plan for one iteration: indices the body reads from the loop's
        # static `xs` (flowjax's permutation between stacked layers) take that iteration's
        # values (`Statics.enum`)
        self.iteration: int | None = None

    def get(self, v: Var) -> np.ndarray:
        s = self.of.get(v)
        if s is None:
            s = self.of[v] = np.full(_shape(v), -1, np.int64)
        return s

    def take(self, u: Var, u_mask: np.ndarray | None, from_slots: np.ndarray) -> None:
        """`u`'s elements (where `u_mask`) take `from_slots` (same shape as `u`)."""
        s = self.get(u)
        if u_mask is None:
            u_mask = np.ones(s.shape, bool)
        if np.any(from_slots[u_mask] < 0) or np.any(s[u_mask] >= 0):
            self.exact = False
        s[u_mask] = from_slots[u_mask]

    def claim(self, v: Var, o: Var, after: Any) -> None:
        """`v`'s elements recovered by a step at elements decided when the program runs come
        from `o`'s position for position: `v` takes `o`'s slots where it has none yet, on
        the promise that other steps recover its elements still unknown `after` it (the
        complementary steps agree). A recovery the record misses would break that promise
        silently, its pivots never taken: a goal claimed so must be recovered by another step
        too (`owed`, checked at the plan's end; an intermediate value's other elements may be
        known forward, or never needed)."""
        if after != R.EMPTY:
            self.claimed.add(v)
        self.claimed_from.add(o)
        if (v, o) in self.pairs:
            return
        self.pairs.add((v, o))
        s_v, s_o = self.get(v), self.get(o)
        if np.any(s_v >= 0):
            self.exact = False
        self.of[v] = np.where(s_v < 0, s_o, s_v)
        self.of[o] = np.full(_shape(o), -1, np.int64)

    def follow(self, vs: Sequence[Var]) -> None:
        """A step recovers some elements of each of `vs`."""
        for v in vs:
            self.steps_of[v] = self.steps_of.get(v, 0) + 1

    def owed(self) -> list[Var]:
        """The claimed variables no other step recovered."""
        return [v for v in self.claimed if self.steps_of.get(v, 0) < 2]

    def pass_on(self, o: Var, u: Var, mask: np.ndarray | None) -> None:
        """`u` takes output `o`'s slots position for position where `mask` (None: all), and
        `o` holds none there any more."""
        self.take(u, mask, self.consume(o, mask))
        self.of[o] = np.where(np.ones(_shape(o), bool) if mask is None else mask, -1, self.get(o))

    def consume(self, o: Var, mask: np.ndarray | None) -> np.ndarray:
        s = self.get(o).copy()
        if mask is not None:
            s = np.where(mask, s, -1)
        return s


def _static_mask(r: Any, shape: tuple) -> np.ndarray | None | bool:
    """A region as a numpy mask; True for the whole array; False if only known at run time."""
    if r == R.FULL:
        return True
    if r == R.EMPTY:
        return np.zeros(shape, bool)
    m = R.static_mask(r, shape)
    return False if m is None else np.asarray(m, bool)


def _new_mask(before: Any, after: Any, shape: tuple) -> np.ndarray | None | bool:
    """The elements known after a step and not before: None for all, False if known only at
    run time."""
    b, a = _static_mask(before, shape), _static_mask(after, shape)
    if b is False or a is False:
        return False
    if b is True and isinstance(a, np.ndarray) and not a.any():
        return None
    bm = np.ones(shape, bool) if b is True else b
    am = np.ones(shape, bool) if a is True else a
    return bm & ~am


def _unit_pivot(eqn: JaxprEqn, k: int) -> int | None:
    """The pivot of a positional step when it is the same constant for every element (an
    addend, a select's case, a scatter's or an update's operand: 1; a negation: -1)."""
    p = eqn.primitive
    if p in (
        prims.add,
        prims.add_any,
        prims.select_n,
        prims.copy,
        prims.scatter_add,
        prims.scatter,
        prims.dynamic_update_slice,
        prims.reduce_precision,
    ):
        return 1
    if p is prims.sub:
        return 1 if k == 0 else -1
    if p is prims.neg:
        return -1
    if p is prims.convert_element_type and jnp.issubdtype(eqn.invars[k].aval.dtype, jnp.floating):
        return 1
    return None


def _positional_in(eqn: JaxprEqn, k: int) -> bool:
    outs = real_outvars(eqn)
    if len(outs) != 1 or _shape(eqn.invars[k]) != _shape(outs[0]):
        return False
    ks = _POSITIONAL.get(eqn.primitive)
    if ks == "cases":
        return k >= 1
    if ks is not None:
        return k in ks
    return is_kind(eqn.primitive, ELEMENTWISE)


def plan(
    rec: records.Recorder,
    seeded: Sequence[Var],
    goals: Sequence[Var],
    pair: bool = True,
    iteration: int | None = None,
) -> Plan:
    """The plan of a walk's record: `seeded` the outputs it started from (their slots in
    order), `goals` the inputs it recovered. With `pair`, the identity check pairs goal k with
    seeded k (a loop body: carry in with carry out, x with y). `iteration`: a loop body's plan
    at that iteration (its permutation's sign there)."""
    if rec.unsupported:
        raise Unsupported(rec.unsupported[0])
    slots = _Slots()
    slots.iteration = iteration
    off = 0
    for v in seeded:
        if _inexact(v):
            n = size_of([v.aval])
            slots.of[v] = np.arange(off, off + n).reshape(_shape(v))
            off += n
    steps = []
    for st in rec.steps:
        steps.append(_plan_step(st, rec, slots))
    gs = [g for g in goals if _inexact(g)]
    final = np.concatenate([slots.get(g).ravel() for g in gs]) if gs else np.zeros(0, np.int64)
    n = len(final)
    if n != off:
        raise Unsupported(f"the state has {n} numbers and the output {off}")
    if set(slots.owed()) & set(gs):
        raise Unsupported(
            "elements recovered at run time are not all recovered by a step the plan follows"
        )
    perm_sign: int | None = None
    identity = False
    if slots.exact:
        if sorted(final.tolist()) != list(range(n)):
            raise Unsupported("the steps do not recover each output element once")
        perm_sign = None if slots.unsigned else _perm_sign(final) * slots.sign
        identity = pair and bool(np.all(final == np.arange(n)))
    elif np.any((final < 0) & (final != OPAQUE)):
        raise Unsupported("an element of the state was not recovered by a step it can follow")
    why = None if perm_sign is not None else UNSIGNED_RULE if slots.unsigned else UNSIGNED_PERM
    return Plan(steps, perm_sign, identity, rec.env.info if rec.env is not None else None, rec, why)


def _perm_sign(p: np.ndarray) -> int:
    seen = np.zeros(len(p), bool)
    sign = 1
    for i in range(len(p)):
        if seen[i]:
            continue
        j, length = i, 0
        while not seen[j]:
            seen[j] = True
            j = int(p[j])
            length += 1
        if length % 2 == 0:
            sign = -sign
    return sign


def _plan_step(st: records.Step, rec: records.Recorder, slots: _Slots) -> _PStep:
    if st.kind != "eqn":
        return _plan_group(st, slots)
    (eqn,) = st.eqns
    got = [(eqn.invars.index(v), v, b, a) for v, b, a in st.recovered if _inexact(v)]
    if not got:  # an integer recovered (a loop counter): no Jacobian
        return _PStep("none", st)
    slots.follow([v for _, v, _, _ in got])
    outs = [o for o in real_outvars(eqn) if _inexact(o)]
    p = eqn.primitive
    if p in logdet_rules:
        known = getattr(logdet_rules[p], "sign_known", None)
        if known is not None and not known(eqn):
            slots.unsigned = True
        if any(_new_mask(b, a, _shape(v)) is not None for _, v, b, a in got):
            raise Unsupported(f"`{p}` recovered only some elements of an input")
        child = rec.children.get(id(eqn))
        cplan = None
        us, os = [v for _, v, _, _ in got], outs
        if child is not None:
            cplan = plan(child, child.seeded, child.goals)
            # the sub-jaxpr's outputs and inputs are the equation's, position for position
            us = [eqn.invars[i] for i in child.goal_pos if _inexact(eqn.invars[i])]
            os = [eqn.outvars[i] for i in child.seeded_pos if _inexact(eqn.outvars[i])]
            if set(us) != {v for _, v, _, _ in got}:
                raise Unsupported(f"`{p}` recovered other inputs than its sub-jaxpr's walk")
            if cplan.unsigned == UNSIGNED_RULE:
                slots.unsigned = True
            elif cplan.perm_sign is None:
                per = _per_iteration_sign(child)
                if per is None:
                    slots.exact = False
                else:
                    slots.sign *= per
            elif cplan.perm_sign < 0:
                # σ of the loop is the product of each iteration's: the body's, `length` times
                reps = _iterations(eqn)
                if reps is None:
                    slots.exact = False
                else:
                    slots.sign *= (-1) ** reps
        _flat_slots(us, os, slots)
        return _PStep("rule", st, [(k, None) for k, _, _, _ in got], cplan)
    how = [
        "pos"
        if _positional_in(eqn, k)
        else "copy"
        if is_kind(p, STRUCTURAL) or k in _COPIES.get(p, ())
        else None
        for k, _, _, _ in got
    ]
    if None not in how:
        parts = []
        for (k, v, b, a), h in zip(got, how):
            if h == "copy":
                continue
            (o,) = outs
            m = _new_mask(b, a, _shape(v))
            if m is False:
                # elements decided when the program runs (a window at a loop counter): all of
                # `v` that this step recovers comes from `o` position for position (a
                # select's other case, at the complementary elements, from the same `o`)
                parts.append((k, (b, a)))
                slots.claim(v, o, a)
                continue
            live = _live(o, m, slots)
            if not live.any():
                continue
            slots.pass_on(o, v, live)
            parts.append((k, None if live.all() else live))
        copies = [g for g, h in zip(got, how) if h == "copy"]
        if copies:
            _structural_slots(eqn, copies, rec, slots)
        return _PStep("positional" if parts else "structural", st, parts)
    if any(_new_mask(b, a, _shape(v)) is not None for _, v, b, a in got):
        raise Unsupported(
            f"`{p}` recovered only some elements of an input, and has no log-determinant rule"
        )
    if size_of(v.aval for _, v, _, _ in got) > DENSE_STEP:
        raise Unsupported(f"`{p}` has no log-determinant rule (jr.register_logdet)")
    _flat_slots([v for _, v, _, _ in got], outs, slots)
    return _PStep("dense", st, [(k, None) for k, _, _, _ in got])


MAX_SIGNED_ITERATIONS = 256
"""Iterations of a loop whose body's permutation is planned one by one, at most."""


def _per_iteration_sign(child: records.Recorder) -> int | None:
    """σ's sign of a loop whose body permutes by static values that differ per iteration (a
    permutation between flowjax's stacked layers): the product of the body's plan at every
    iteration; None where an iteration's is not known either."""
    info = child.env.info if child.env is not None else None
    length = getattr(info, "length", None)
    if not length or length > MAX_SIGNED_ITERATIONS:
        return None
    sign = 1
    for i in range(length):
        try:
            p = plan(child, child.seeded, child.goals, iteration=i)
        except Unsupported:
            return None
        if p.perm_sign is None:
            return None
        sign *= p.perm_sign
    return sign


def _iterations(eqn: JaxprEqn) -> int | None:
    """How many times a loop runs its body, when known at trace time."""
    return scan_info(eqn.params).length if eqn.primitive is prims.scan else None


def _flat_slots(us: Sequence[Var], os: Sequence[Var], slots: _Slots) -> None:
    """The recovered `us` take the slots of `os` in flat order."""
    src = np.concatenate([slots.get(o).ravel() for o in os]) if os else np.zeros(0, np.int64)
    if len(src) != size_of(u.aval for u in us):
        raise Unsupported("a step recovers a different number of elements than it consumes")
    k = 0
    for u in us:
        n = size_of([u.aval])
        slots.take(u, None, src[k : k + n].reshape(_shape(u)))
        k += n
    for o in os:
        slots.of[o] = np.full(_shape(o), -1, np.int64)


def _is_index(p: Any, k: int, n: int) -> bool:
    for i in index_args.get(p, ()):
        if (k in range(n)[i]) if isinstance(i, slice) else k == i:
            return True
    return False


def _structural_slots(eqn: JaxprEqn, got: list, rec: records.Recorder, slots: _Slots) -> None:
    """Run the step on element ids to see which output element each recovered one was copied
    to; the recovered elements take those slots, which are then consumed."""
    info = rec.env.info
    n = len(eqn.invars)
    ids: list = []
    off = 1
    ins = []
    for k, v in enumerate(eqn.invars):
        if (
            _is_index(eqn.primitive, k, n)
            or not isinstance(v, Var)
            or not jnp.issubdtype(v.aval.dtype, jnp.inexact)
        ):
            val = info.static(v)
            if val is None and slots.iteration is not None:
                en = info.enum(v)
                val = None if en is None else en[slots.iteration]
            if val is None:
                # indices known only when the program runs (a swap at a loop counter): the
                # step moves elements (log|det| 0) but where to is not followed
                _opaque(got, eqn, slots)
                return
            ins.append(val)
            ids.append(None)
            continue
        size = size_of([v.aval])
        a = np.arange(off, off + size, dtype=np.int64).reshape(_shape(v))
        ins.append(a.astype(np.int32))
        ids.append(a)
        off += size
    try:
        res = apply_on_host(eqn, ins)
    except Exception:  # a primitive that will not run on integers
        _opaque(got, eqn, slots)
        return
    src = np.full(off, -1, np.int64)
    where: dict[int, tuple] = {}
    for j, (o, r) in enumerate(zip(eqn.outvars, res)):
        if not _inexact(o):
            continue
        flat, sl = r.ravel(), slots.get(o).ravel()
        hit = np.nonzero(flat > 0)[0]
        src[flat[hit]] = sl[hit]
        for q in hit:
            where[int(flat[q])] = (o, int(q))
    for k, v, b, a in got:
        m = _new_mask(b, a, _shape(v))
        if m is False:
            _opaque([(k, v, b, a)], eqn, slots)
            continue
        mask = np.ones(_shape(v), bool) if m is None else m
        slots.take(v, m, src[ids[k]])
        for i in ids[k][mask].ravel():
            o, q = where.get(int(i), (None, None))
            if o is not None:
                slots.of[o].flat[q] = -1


def _opaque(got: list, eqn: JaxprEqn, slots: _Slots) -> None:
    """The recovered elements of a step whose element map is decided when the program runs:
    known to be recovered, their slots not followed (the sign is then not known)."""
    slots.exact = False
    for _, u, _, _ in got:
        s = slots.get(u)
        slots.of[u] = np.where(s < 0, OPAQUE, s)
    for o in real_outvars(eqn):
        if _inexact(o):
            slots.of[o] = np.full(_shape(o), -1, np.int64)


def _plan_group(st: records.Step, slots: _Slots) -> _PStep:
    us = [u for u in st.inputs if _inexact(u)]
    os = [o for o in st.outputs if _inexact(o)]
    slots.follow(us)
    if st.recovered:
        return _plan_some_elements(st, us, os, slots)
    shapes = {_shape(v) for v in [*us, *os]}
    if (
        len(shapes) == 1
        and len(us) == len(os)
        and (
            st.elementwise
            or all(
                elementwise_in(e, next(iter(shapes)))
                or not any(_inexact(o) for o in real_outvars(e))
                or e.primitive in _POSITIONAL
                or e.primitive is prims.gather
                for e in st.eqns
            )
        )
    ):
        # (elements of its inputs recovered before, by earlier passes of the same group on
        # some elements: its step is the rest, element by element)
        rest = [(slots.get(u) == -1) & (slots.get(o) != -1) for u, o in zip(us, os)]
        m = rest[0]
        if m.any() and not m.all() and all(np.array_equal(r, m) for r in rest):
            for u, o in zip(us, os):
                slots.pass_on(o, u, m)
            return _PStep("blocks", st, [m])
        for u, o in zip(us, os):
            slots.pass_on(o, u, None)
        return _PStep("blocks", st)
    # the group solves all of its inputs from all of its outputs, but elements of its inputs
    # known before (a scatter's operand outside its window) were recovered elsewhere, from
    # outputs consumed then: its step is the rest (rows: outputs still holding a slot;
    # columns: inputs without one)
    cols = np.concatenate([(slots.get(u) == -1).ravel() for u in us])
    rows = np.concatenate([(slots.get(o) != -1).ravel() for o in os])
    if cols.sum() != rows.sum():
        raise Unsupported(
            f"a {st.kind} group recovers {int(cols.sum())} elements from "
            f"{int(rows.sum())} (at `{st.eqns[0].primitive}`)"
        )
    if cols.all() and rows.all():
        _flat_slots(us, os, slots)
        return _PStep("dense", st)
    src = np.concatenate([slots.get(o).ravel() for o in os])[rows]
    k = 0
    for u in us:
        n = size_of([u.aval])
        c = cols[k : k + n].reshape(_shape(u))
        full = np.full(_shape(u), -1, np.int64)
        full[c] = src[int(cols[:k].sum()) : int(cols[:k].sum()) + int(c.sum())]
        slots.take(u, c, full)
        k += n
    for o in os:
        slots.of[o] = np.full(_shape(o), -1, np.int64)
    return _PStep("dense", st, [(rows, cols)])


def _live(o: Var, m: np.ndarray | None, slots: _Slots) -> np.ndarray:
    """The elements of `m` (None: all) where output `o` still holds a slot. Elsewhere an
    element recovered from `o` follows from elements recovered before (a scale inside a
    choice group that has just recovered the state there, found again by its product's
    element rule) and takes no pivot: counted again, its pivot would be the group's twice."""
    s = slots.get(o)
    return (s != -1) if m is None else m & (s != -1)


def _count(m: np.ndarray | None, v: Var) -> int:
    return size_of([v.aval]) if m is None else int(np.sum(m))


def _plan_some_elements(
    st: records.Step, us: Sequence[Var], os: Sequence[Var], slots: _Slots
) -> _PStep:
    """An elementwise group solved on some elements only (`records.Step.recovered`: an
    autoregressive spline's bins where its knots are known): input k on those elements takes
    the slots of output k there, and its pivots are taken there (`_PStep.parts`: one mask,
    static or a pair of regions decided when the program runs, for every input)."""
    what = f"a {st.kind} group at `{st.eqns[0].primitive}`"
    got = {v: (b, a) for v, b, a in st.recovered}
    if (
        not st.elementwise
        or len(us) != len(os)
        or len({_shape(v) for v in [*us, *os]}) != 1
        or set(got) != set(us)
        or len(set(got.values())) != 1
    ):
        raise Unsupported(f"{what} recovers some elements of its inputs, not one element map")
    b, a = got[us[0]]
    m = _new_mask(b, a, _shape(us[0]))
    # (an element step may have recovered a value inside the group from the same output
    # elements first, its pivot taken: the group's map from the state to the output would
    # count that pivot again; such a record is not followed)
    if m is False and any(o in slots.claimed_from for o in os):
        raise Unsupported(f"{what}, on elements decided when the program runs, shares them")
    if m is not False and not all(_live(o, m, slots).sum() == _count(m, o) for o in os):
        raise Unsupported(f"{what} recovers elements whose outputs a step consumed before")
    for u, o in zip(us, os):
        if m is False:
            slots.claim(u, o, a)
            continue
        slots.pass_on(o, u, m)
    return _PStep("blocks", st, [(b, a) if m is False else m])


# --------------------------------------------------------------------------- evaluation


def _try_read(read: Callable, v: Any, zeros: bool = False) -> Any:
    if isinstance(v, DropVar):
        return None
    try:
        return read(v)
    except KeyError:
        return jnp.zeros(v.aval.shape, v.aval.dtype) if zeros else None


def _acc(sign: Any, logabs: Any, d: Any, mask: Any = None) -> tuple[Any, Any]:
    """Fold the pivots `d` (where `mask`) into (sign, log|det|)."""
    la = jnp.log(jnp.abs(d))
    sg = jnp.sign(d)
    if mask is not None:
        la = jnp.where(mask, la, 0)
        sg = jnp.where(mask, sg, 1)
    return sign * jnp.prod(sg), logabs + jnp.sum(la)


def evaluate_plan(
    pl: Plan,
    read: Callable[[Any], Any],
    dtype: Any,
    permutation: bool = True,
    per_step: list | None = None,
    done: dict | None = None,
) -> tuple[Any, Any]:
    """(sign, log|det ∂outputs/∂inputs|) of the walk's program at the values `read` gives.
    (`sign` includes σ's when the plan knows it and `permutation` asks for it; `per_step`
    collects (equation, its log|det|, whether it is a group's first) for naming a singular
    step; `done`: the `LogdetResult`s of rule steps already taken, by their equation's id.)"""
    sign = jnp.asarray(pl.perm_sign if permutation and pl.perm_sign is not None else 1, dtype)
    logabs = jnp.zeros((), dtype)
    merged = _merged_parts(pl.steps)
    for ps in pl.steps:
        before = logabs
        sign, logabs = _eval_step(ps, read, sign, logabs, pl, done, merged.get(id(ps), ()))
        if per_step is not None and ps.how not in ("none", "structural"):
            per_step.append((ps.step.eqns[0], logabs - before, ps.step.kind != "eqn"))
    return sign, logabs


@dataclass
class _Pivots:
    """The pivots a positional step takes: those of its equation's operand `operand`, on the
    elements `masks` (static masks and run-time region pairs, or-ed; None: every element)."""

    operand: int
    masks: list | None


def _merged_parts(steps: Sequence[_PStep]) -> dict[int, list[_Pivots]]:
    """The positional steps' pivots merged by equation and operand: an autoregressive map's
    inverse recovers one element per step through the same equation (numpyro's IAF: D steps
    of ``x * exp(s) + m``), and each step's pivots are the same JVP at the same values, so
    the pivots are taken once, where the equation's first step is, over the union of the
    steps' masks (disjoint: each step's are the elements it recovered first). So are the
    passes of a group solved on some elements each (an autoregressive spline's, one pass per
    element: D element blocks of D elements each, else), by its equations, inputs and
    outputs. Returns, by step id, the pivots it takes (none where an earlier step of its
    equation takes them)."""
    first: dict[tuple, _Pivots] = {}
    out: dict[int, list[_Pivots]] = {}
    for ps in steps:
        st = ps.step
        if ps.how == "blocks" and ps.parts:
            key: Any = (tuple(map(id, st.eqns)), tuple(st.inputs), tuple(st.outputs))
            parts = [(-1, m) for m in ps.parts]
        elif ps.how == "positional":
            key, parts = id(st.eqns[0]), ps.parts
        else:
            continue
        mine = out.setdefault(id(ps), [])
        for k, m in parts:
            taken = first.get((key, k))
            if taken is None:
                first[(key, k)] = piv = _Pivots(k, None if m is None else [m])
                mine.append(piv)
            elif taken.masks is not None:
                if m is None:
                    taken.masks = None
                else:
                    taken.masks.append(m)
    return out


def env_reader(env: Any) -> Callable[[Any], Any]:
    """Values of a walk's env, for `evaluate_plan`; a value known on some elements only reads
    as a benign filler elsewhere (the steps that read it only use the known elements)."""

    def read(v: Any) -> Any:
        if env.known(v):
            return env.read(v)
        val = elements.value_of(env, v, clean=True)
        if val is None:
            raise KeyError(v)
        return val

    return read


def rule_step(ps: _PStep, read: Callable) -> LogdetResult:
    """A plan step taken by its primitive's `logdet_rules` entry (`ps.how == "rule"`: a loop,
    a product by a known matrix) at the values `read` gives, as a `LogdetResult` (its outputs
    too, where the rule computed them)."""
    (eqn,) = ps.step.eqns
    rec = [any(k == j for j, _ in ps.parts) for k in range(len(eqn.invars))]
    got = logdet_rules[eqn.primitive](LogdetContext(eqn, read, rec, ps.child))
    return got if isinstance(got, LogdetResult) else LogdetResult(*got)


def rule_steps(pl: Plan) -> dict:
    """The plan's steps taken by a `logdet_rules` entry that may give the equation's outputs
    (`LogdetResult.outs`; the rule's `gives_outputs` attribute: it reads no output), by their
    equation's id: a forward run takes those steps in the program's order."""
    return {
        id(ps.step.eqns[0]): ps
        for ps in pl.steps
        if ps.how == "rule"
        and getattr(logdet_rules[ps.step.eqns[0].primitive], "gives_outputs", False)
    }


def run_forward(pl: Plan, eqns: Sequence[JaxprEqn], env: Env) -> dict:
    """`eqns` evaluated in `env` in order. An equation that `pl` takes by its primitive's
    rule, where that rule also gives the equation's outputs (`rule_steps`: a loop of layers,
    whose rule runs it forward anyway), is not evaluated: its outputs are the rule's, so the
    loop runs once, for its outputs and its log-det. Returns the rule steps' results by
    equation id (`evaluate_plan`'s `done`). Used by `forward_and_slogdet`'s forward run and by
    the scan's log-det rule on its body (a loop inside each layer)."""
    by_rule = rule_steps(pl)
    done: dict = {}
    for eqn in eqns:
        ps = by_rule.get(id(eqn))
        if ps is not None:
            got = rule_step(ps, env.read)
            done[id(eqn)] = got
            if got.outs is not None:
                for o, val in zip(eqn.outvars, got.outs):
                    env.write(o, val)
                continue
        evaluate([eqn], env)
    return done


def _union_mask(masks: list | None, shape: tuple, read: Callable) -> Any:
    """The elements of merged pivots (`_Pivots.masks`): None for all, else the or of the
    static masks and run-time regions (a window at a loop counter: the elements
    recovered after `before` and not after `after`)."""
    if masks is None:
        return None
    static = [np.asarray(m) for m in masks if not isinstance(m, tuple)]
    mask = np.logical_or.reduce(static) if static else None
    if mask is not None and mask.all():
        return None
    out = None if mask is None else jnp.asarray(mask)
    for m in masks:
        if isinstance(m, tuple):  # known at run time
            got = R.materialize(m[0], shape, read) & ~R.materialize(m[1], shape, read)
            out = got if out is None else out | got
    return out


def _window_pivots(
    eqn: JaxprEqn, k: int, ins: Sequence[Any], piv: _Pivots, read: Callable, statics: Any
) -> tuple[Any, Any] | None:
    """(pivots, where they count) of an elementwise step whose recovered elements are one
    window at a loop counter (a loop's step writes one element), on that window alone: not
    the whole operand's pivots masked (one log per element per step, D² for an autoregressive
    loop of D steps). None otherwise."""
    if not is_kind(eqn.primitive, ELEMENTWISE) or not piv.masks or len(piv.masks) != 1:
        return None
    (m,) = piv.masks
    if not isinstance(m, tuple):
        return None
    w = R.window_between(m[0], m[1], statics)
    shape = _shape(eqn.outvars[0])
    if w is None or tuple(w.shape) != shape or ins[k] is None:
        return None
    starts, fits = R.window_starts(w, read)
    parts = []
    for x in ins:
        if x is None:
            return None
        if tuple(jnp.shape(x)) == shape:
            # (starts as `window_starts` placed them: clamped, never counted from the end)
            parts.append(jax.lax.dynamic_slice(x, starts, w.sizes, allow_negative_indices=False))
        elif not jnp.shape(x):
            parts.append(x)
        else:
            return None

    def f(x):
        a = list(parts)
        a[k] = x
        return apply(eqn, a)[0]

    _, d = jax.jvp(f, (parts[k],), (jnp.ones_like(parts[k]),))
    return d, None if fits is True else jnp.broadcast_to(fits, d.shape)


def _eval_step(
    ps: _PStep,
    read: Callable,
    sign: Any,
    logabs: Any,
    pl: Plan,
    done: dict | None = None,
    pivots: Sequence[_Pivots] = (),
) -> tuple[Any, Any]:
    st = ps.step
    if ps.how in ("none", "structural"):
        return sign, logabs
    if ps.how == "positional":
        (eqn,) = st.eqns
        if not pivots:  # taken by an earlier step of the same equation (`_merged_parts`)
            return sign, logabs
        # (an operand never known, a select's case it never picks, is not read where the
        # recovered one's pivots are)
        ins = [_try_read(read, v, zeros=True) for v in eqn.invars]
        for piv in pivots:
            k = piv.operand
            unit = _unit_pivot(eqn, k)
            if unit == 1:  # volume-preserving: nothing to compute
                continue
            on_window = _window_pivots(eqn, k, ins, piv, read, pl.info)
            if on_window is not None:
                sign, logabs = _acc(sign, logabs, *on_window)
                continue
            mask = _union_mask(piv.masks, _shape(eqn.invars[k]), read)
            if unit == -1:  # each recovered element flips the sign
                count = size_of([eqn.invars[k].aval]) if mask is None else jnp.sum(mask)
                sign = sign * (1 - 2 * (count % 2))
                continue

            def f(x, k=k):
                a = list(ins)
                a[k] = x
                return apply(eqn, a)[0]

            x = ins[k]
            _, d = jax.jvp(f, (x,), (jnp.ones_like(x),))
            sign, logabs = _acc(sign, logabs, d, mask)
        return sign, logabs
    if ps.how == "rule":
        (eqn,) = st.eqns
        got = done.get(id(eqn)) if done is not None else None
        if got is None:
            got = rule_step(ps, read)
        return sign * got.sign, logabs + got.logabs
    if st.tear is not None and not ps.parts:
        return _torn_step(st, read, sign, logabs, pl)
    if ps.how == "blocks" and ps.parts and not pivots:
        # (a group solved on some elements, whose pivots an earlier pass of it takes:
        # `_merged_parts`)
        return sign, logabs
    # groups and dense single steps: F maps the recovered inputs to the consumed outputs
    if st.kind == "eqn":
        (eqn,) = st.eqns
        us = [eqn.invars[k] for k, _ in ps.parts]
        os = [o for o in real_outvars(eqn) if _inexact(o)]
        eqns = list(st.eqns)
    else:
        us = [u for u in st.inputs if _inexact(u)]
        os = [o for o in st.outputs if _inexact(o)]
        eqns = list(st.eqns)
    F = _group_map(eqns, us, os, read, pl.info)
    xs = [read(u) for u in us]
    if ps.how == "blocks":
        # (a group solved on some elements: its pivots there)
        mask = _union_mask(pivots[0].masks, _shape(us[0]), read) if ps.parts else None
        cols = []
        for j in range(len(us)):
            t = [jnp.ones_like(x) if i == j else jnp.zeros_like(x) for i, x in enumerate(xs)]
            cols.append(jnp.stack(jax.jvp(F, (xs,), (t,))[1], axis=-1))
        B = jnp.stack(cols, axis=-1)  # [..., out i, in j]
        if len(us) == 1:
            return _acc(sign, logabs, B[..., 0, 0], mask)
        s, la = dense.slogdet(B)
        if mask is not None:
            s, la = jnp.where(mask, s, 1), jnp.where(mask, la, 0)
        return sign * jnp.prod(s), logabs + jnp.sum(la)
    sizes = [size_of([u.aval]) for u in us]
    x0 = jnp.concatenate([jnp.ravel(x) for x in xs])
    rows, cols = ps.parts[0] if st.kind != "eqn" and ps.parts else (None, None)
    ci = None if cols is None else np.nonzero(cols)[0]
    ri = None if rows is None else np.nonzero(rows)[0]

    def restricted(G, base=x0):
        def flat(v):
            full = v if ci is None else jnp.asarray(base).at[ci].set(v)
            parts, k = [], 0
            for u, n in zip(us, sizes):
                parts.append(full[k : k + n].reshape(_shape(u)))
                k += n
            out = jnp.concatenate([jnp.ravel(o) for o in G(parts)])
            return out if ri is None else out[ri]

        return flat

    v0 = x0 if ci is None else x0[ci]
    probe = None
    if st.kind == "lump":  # affine: its band is found on stand-ins at trace time
        probe = _stand_in_map(eqns, us, os, read, pl.info)
        probe = None if probe is None else restricted(probe, np.zeros(x0.shape, x0.dtype))
    s, la = slogdet_of(
        restricted(F), v0, probe, DENSE_STEP, f"a {st.kind} group at `{st.eqns[0].primitive}`"
    )
    return sign * s, logabs + la


def _torn_step(
    st: records.Step, read: Callable, sign: Any, logabs: Any, pl: Plan
) -> tuple[Any, Any]:
    """A torn Newton group's log|det|: its affine part's on the unknowns (the cut values
    held; structured, as a lump's: a planar layer's is the identity) plus its cut's
    (`nonlinear.torn_slogdet`, m x m for m cut numbers)."""
    tear = st.tear
    us = list(st.inputs)
    os = list(st.outputs)
    xs = [read(u) for u in us]
    sizes = [size_of([u.aval]) for u in us]
    x0 = jnp.concatenate([jnp.ravel(x) for x in xs])

    def flat(G):
        def f(v):
            parts = jnp.split(v, np.cumsum(sizes)[:-1]) if len(sizes) > 1 else [v]
            return jnp.concatenate(
                [jnp.ravel(o) for o in G([p.reshape(_shape(u)) for p, u in zip(parts, us)])]
            )

        return f

    # the cut values, from the recovered inputs (an inverse walk need not have computed
    # them), held while the affine part's matrix is taken
    held = dict(zip(tear.cut, _group_map(st.eqns, us, list(tear.cut), read, pl.info)(xs)))

    def read_held(v: Any) -> Any:
        return held[v] if v in held else read(v)

    what = f"the affine part of a Newton group at `{st.eqns[0].primitive}`"
    affine = flat(_group_map(tear.affine, us, os, read_held, pl.info))
    probe = _stand_in_map(tear.affine, us, os, read_held, pl.info)
    try:  # (structure first, whatever the size: a dense n x n factorization is what
        # tearing saves)
        s_a, la_a = slogdet_of(affine, x0, None if probe is None else flat(probe), 0, what)
    except Unsupported:
        s_a, la_a = slogdet_of(affine, x0, None, DENSE_STEP, what)
    s_c, la_c = torn_slogdet(tear, st.eqns, us, os, read_held, pl.info, linear_walk)
    return sign * s_a * s_c, logabs + la_a + la_c


def _stand_in_map(
    eqns: Sequence[JaxprEqn], us: Sequence[Var], os: Sequence[Var], read: Callable, info: Any
) -> Callable | None:
    """`_group_map` on concrete stand-ins (random floats where a value is traced), for its
    structure; None if an integer or boolean it reads is only known at run time."""
    rng = np.random.default_rng(0)

    def stand_in(v: Any) -> Any:
        val = read(v)
        if is_concrete(val):
            return np.asarray(val)
        if jnp.issubdtype(v.aval.dtype, jnp.inexact):
            return rng.standard_normal(v.aval.shape).astype(v.aval.dtype) + 1.5
        s = info.static(v) if info is not None else None
        if s is None:
            raise KeyError(v)
        return s

    try:
        return _group_map(eqns, us, os, stand_in, info)
    except KeyError:
        return None


def _group_map(
    eqns: Sequence[JaxprEqn], us: Sequence[Var], os: Sequence[Var], read: Callable, info: Any
) -> Callable:
    """The group's outputs `os` as a function of its inputs `us`, the rest held at their
    values."""
    produced = {o for e in eqns for o in real_outvars(e)}
    reads = list(
        dict.fromkeys(
            v
            for e in eqns
            for v in e.invars
            if isinstance(v, Var) and v not in produced and v not in us
        )
    )
    vals = [read(v) for v in reads]

    def F(xs):
        env = Env(info=info)
        for v, x in zip(reads, vals):
            env.write(v, x)
        for v, x in zip(us, xs):
            env.write(v, x)
        evaluate(eqns, env, partial=True)
        return [env.read(o) for o in os]

    return F
