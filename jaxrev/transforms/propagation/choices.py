"""Groups whose decisions depend on the unknown state (docs/design.md §3.5): consistent branches.

``where(x > 0, x, 0.01 * x)`` cannot be inverted by propagation: the select's predicate is
computed from the `x` being recovered. It inverts by consistency instead: assume the select
takes case k everywhere, invert that (an ordinary program), recompute the predicate from the
candidate, and keep, per element, the candidate whose predicate picks its own case.

`choice_step` finds the smallest trailing group of stuck equations that holds such decisions
(equations with a `choice_rules` entry whose decision is not known: `select_n`, `max`, `min`,
`abs`, a `cond` on the state) and is square in its unknowns; then, for every combination of
branches (at most `MAX_COMBOS`), it replaces each choice by what its branch computes (a copy
of one case, `neg` for `abs`'s negative branch), propagates over the group alone (so nothing
outside it is walked again: tracing stays linear in the program), and runs the original group
forward from the candidate to see whether each choice takes the assumed branch. Per element
(for elementwise groups; as a whole for decisions on whole arrays, a `cond`'s index), exactly
one combination must be consistent, or several that agree:

- a combination that cannot be inverted (relu's zero case: the output no longer depends on the
  state) is refused when the program is traced, naming the choice;
- none consistent (the output is outside the map's range), or two that disagree (the map is not
  one-to-one there), is found when the program runs: raised eagerly, under `jit` a runtime
  error, or NaN with ``on_error="nan"`` (`checks.raise_where`, with the walk's `on_error`).

Derivatives differentiate the chosen candidate (the selection by consistency has none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import (
    JaxprEqn,
    Literal,
    Var,
    has_user_frame,
    is_concrete,
    is_host_callback,
    prims,
    staged_constants,
)
from jaxrev._env import Env
from jaxrev._errors import ReversibilityError, at_eqn, not_invertible
from jaxrev._evaluate import evaluate
from jaxrev._graph import is_var, mentions, real_outvars, size_of
from jaxrev.transforms.custom import custom_inverse
from jaxrev.transforms.knowledge import elements, records
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.checks import NEWTON_STARTS, raise_where
from jaxrev.transforms.knowledge.context import placeholders
from jaxrev.transforms.propagation.reach import decided_on, int_range, reachable
from jaxrev.transforms.registry import (
    choice_rules,
    elementwise_in,
)

__all__ = ["choice_step", "MAX_COMBOS"]

SubWalk = Callable[[Sequence[JaxprEqn], Env, Sequence[Var]], Any]
"""The walker's recursion, as group steps receive it: ``walk(eqns, env, goals)``."""

MAX_COMBOS = 64
"""Combinations of branches tried in one group, at most."""
MAX_GROUP_EQNS = 256
MAX_VALUES = 64
"""Values of an integer decided by the state (a spline's bin index) tried, at most."""
_AGREE_ULPS = 64
_LOST_ULPS = 4
_SAME_ULPS = 32
"""A candidate whose forward run gives the outputs back within this many ulps is a preimage
(the Newton step's own tolerance)."""


class _Choice:
    """One decision in a group: an equation with a `choice_rules` entry (`value` None), or an
    integer of a few values computed from the state (a spline's bin index: `value` its
    smallest value), whose every value is tried."""

    __slots__ = ("eqn", "n", "value")

    def __init__(self, eqn: JaxprEqn, n: int, value: int | None = None) -> None:
        self.eqn, self.n, self.value = eqn, n, value

    def holds(self, env_f: Env, k: int) -> Any:
        if self.value is not None:
            return env_f.read(real_outvars(self.eqn)[0]) == self.value + k
        e = self.eqn
        return choice_rules[e.primitive].holds(e, [env_f.read(v) for v in e.invars], k)

    def decides(self) -> list[Var]:
        """The variables an assumed value of this choice fixes (an integer's own output)."""
        return real_outvars(self.eqn) if self.value is not None else []

    @property
    def whole(self) -> bool:
        """A decision made once for whole arrays (a scalar predicate or branch index)."""
        e = self.eqn
        if self.value is not None:
            return real_outvars(e)[0].aval.shape == ()
        return (
            is_var(e.invars[0])
            and e.invars[0].aval.shape == ()
            and e.primitive in (prims.select_n, prims.cond)
        )


class _Piece(_Choice):
    """Every comparison of the state (or its clip by known bounds, a copy, a broadcast) with
    known thresholds in a group, decided together by the piece of the line the state lies in:
    distrax's spline picks its bin by a one-hot mask of ``x >= x_pos[:-1]`` and
    ``x < x_pos[1:]`` multiplied into its knot table, not by an index of a few values, so no
    branch of it can be enumerated. Between two consecutive thresholds every comparison keeps
    its value, so a point of the piece (its midpoint: `_search_point`) stands for all of it.
    Its assumed value is that point (NaN: no piece assumed); the comparisons then take their
    values at it, and what they decide (masks, masked sums, selects' predicates) is known."""

    __slots__ = ("comparisons", "chain", "u", "producer")

    def __init__(self, comparisons: list[JaxprEqn], chain: list[JaxprEqn], u: Var) -> None:
        super().__init__(comparisons[0], 1, 0)
        self.comparisons, self.chain, self.u = comparisons, chain, u
        # (the walk's producers, lazily: where a threshold is a slice of a known table, the
        # table is searched once, not each of its slices)
        self.producer: Callable[[], dict] = dict

    def decides(self) -> list[Var]:
        return [o for e in self.comparisons for o in real_outvars(e)]

    def decide(self, env: Env, at: Any) -> dict:
        """The comparisons' values where the state is `at` (the group's reads from `env`)."""
        made = {o for q in self.chain for o in real_outvars(q)}
        e = Env(info=env.info, ctx=env.ctx)
        for q in self.chain:
            for v in q.invars:
                if is_var(v) and v is not self.u and v not in made:
                    e.write(v, env.read(v))
        e.write(self.u, jnp.asarray(at, self.u.aval.dtype))
        evaluate(self.chain, e, partial=True)
        return {o: e.read(o) for o in self.decides()}

    def holds(self, env_f: Env, k: Any) -> Any:
        lead = len(self.u.aval.shape)
        ok = jnp.asarray(True)
        for o, want in self.decide(env_f, k).items():
            same = env_f.read(o) == want
            ok = ok & jnp.all(same, axis=tuple(range(lead, same.ndim)))
        return ok


_COMPARISONS = ("lt", "le", "gt", "ge")


def _piece(G: Sequence[JaxprEqn], env: Env) -> _Piece | None:
    """The group's comparisons of its one floating unknown input with known values, as one
    `_Piece`; None where there are none, or where a comparison reads another function of
    the state, or lays its elements out otherwise than the state (elements first)."""
    produced = {o for e in G for o in real_outvars(e)}
    ins = list(
        dict.fromkeys(
            v for e in G for v in e.invars if is_var(v) and not env.known(v) and v not in produced
        )
    )
    if len(ins) != 1 or not jnp.issubdtype(ins[0].aval.dtype, jnp.floating):
        return None
    u = ins[0]
    lead = tuple(u.aval.shape)
    passes, chain = {u}, []
    for q in G:
        outs = real_outvars(q)
        reads = [v for v in q.invars if is_var(v) and v in passes]
        if not reads or not all(not is_var(v) or v in passes or env.known(v) for v in q.invars):
            continue
        if q.primitive.name in _PASSES_U and len(outs) == 1:
            if jnp.issubdtype(outs[0].aval.dtype, jnp.floating):
                passes.add(outs[0])
                chain.append(q)
        elif q.primitive.name in _COMPARISONS and tuple(outs[0].aval.shape)[: len(lead)] == lead:
            chain.append(q)
    comparisons = [q for q in chain if q.primitive.name in _COMPARISONS]
    if not comparisons:
        return None
    # (only the moves the comparisons read: a clip that also feeds the outputs is a choice)
    need = {v for q in comparisons for v in q.invars if is_var(v)}
    kept = []
    for q in reversed(chain):
        if q in comparisons or any(o in need for o in real_outvars(q)):
            kept.append(q)
            need.update(v for v in q.invars if is_var(v))
    return _Piece(comparisons, kept[::-1], u)


def _choices(G: Sequence[JaxprEqn], env: Env, pieces: bool = False) -> list[_Choice]:
    """The group's undecided choices: integers of a few values that the state decides, and the
    equations with choice rules whose decision is not known and that do not only feed those.
    With `pieces`, and no such integer, the comparisons of the state with known thresholds
    are one more choice (`_Piece`); empty where there are none."""
    producer = {o: e for e in G for o in real_outvars(e)}
    # a select's predicate or a cond's index is enumerated by the select or the cond itself
    decisions = {
        e.invars[0]
        for e in G
        if e.primitive in (prims.select_n, prims.cond) and is_var(e.invars[0])
    }
    # an integer of the outputs' shape, or a scalar (a branch index for whole arrays): a
    # search by comparing with every knot counts booleans of the knots' shape first, and
    # those are not the bin index
    shapes = {tuple(o.aval.shape) for e in G for o in real_outvars(e) if env.known(o)}

    def index_like(v: Any) -> bool:
        return (
            jnp.issubdtype(v.aval.dtype, jnp.integer)
            and (tuple(v.aval.shape) in shapes or v.aval.shape == ())
            and v not in decisions
        )

    values: list[_Choice] = []
    for e in G:
        outs = real_outvars(e)
        if len(outs) != 1 or not index_like(outs[0]):
            continue
        r = int_range(outs[0], producer, env, {})
        if not _few(r) or r[1] <= r[0]:
            continue
        # the first such integer on its path: its integer inputs are not of a few values
        if any(
            is_var(v) and v in producer and index_like(v) and _few(int_range(v, producer, env, {}))
            for v in e.invars
        ):
            continue
        values.append(_Choice(e, int(r[1] - r[0] + 1), int(r[0])))
    if pieces:
        piece = None if values else _piece(G, env)
        if piece is None:
            return []
        values.append(piece)
    # what only feeds the integers is decided with them (the clip of a bin index); what also
    # feeds the outputs otherwise is a choice of its own (a spline's clip of `x`, which the
    # bin search reads too)
    mine = {q for c in values for q in (c.comparisons if isinstance(c, _Piece) else [c.eqn])}
    outs = [v for e in G for v in real_outvars(e) if env.known(v)]
    feeds = _ancestors(list(mine), producer) - set(_live([e for e in G if e not in mine], outs))
    # what the assumed integers decide with the known values is no choice (the index
    # normalization of `jnp.take` at an assumed bin)
    det = _determined(G, values, env)
    # (a select whose predicate a piece decides stays a choice where its cases are not
    # decided too, a spline's linear tails: each branch walk then inverts one case, and
    # consistency asks the candidate for its predicate)
    counted = det if not pieces else _determined(G, values[:-1], env)
    out = list(values)
    for e in G:
        rule = choice_rules.get(e.primitive)
        if rule is None or e in feeds or e in mine:
            continue
        if pieces and all(o in det for o in real_outvars(e)):
            continue
        n = rule.count(e, lambda v: env.known(v) or v in counted)
        if n > 1:
            out.append(_Choice(e, n))
    return out


def _determined(G: Sequence[JaxprEqn], values: Sequence[_Choice], env: Env) -> set:
    """Variables of the group computed from known values and the assumed integers alone."""
    det = {o for c in values for o in c.decides()}
    for e in G:
        if all(env.known(v) or v in det for v in e.invars):
            det.update(real_outvars(e))
    return det


def _few(r: tuple | None) -> bool:
    return (
        r is not None
        and bool(np.isfinite(r[0]) and np.isfinite(r[1]))
        and r[1] - r[0] + 1 <= MAX_VALUES
    )


def _ancestors(eqns: Sequence[JaxprEqn], producer: dict) -> set:
    """The equations (of the group) that the given ones read, transitively."""
    out: set = set()
    stack = [v for e in eqns for v in e.invars if is_var(v)]
    while stack:
        e = producer.get(stack.pop())
        if e is not None and e not in out:
            out.add(e)
            stack.extend(v for v in e.invars if is_var(v))
    return out


def choice_step(
    eqns: Sequence[JaxprEqn], env: Env, pending: Sequence[int], soft: bool, walk: SubWalk
) -> bool:
    """Invert the smallest trailing square group holding state-dependent decisions. With
    `soft` (`reversible`'s walks), a group with a branch that loses the state is left alone
    (the sweep stores what it loses) instead of raising. `walk(eqns, env, goals)` is the
    walker's recursion (a soft propagation over `eqns`), handed in by the walker."""
    # the walk's own unknowns (what no equation of it makes): a branch that loses the state
    # on an interval of these is surely taken, and refused when traced (`_lossy`)
    every = _Lazy(lambda: {o: e for e in eqns for o in real_outvars(e)})
    state = _Lazy(
        lambda: (
            frozenset(v for e in eqns for v in e.invars if is_var(v))
            - {o for e in eqns for o in e.outvars},
            every(),
        )
    )
    # (what the walk's equations read: a value known on some elements by running the group
    # forward that nothing reads, a loop's dead carry, is no output to solve for)
    read = _Lazy(lambda: {v for e in eqns for v in e.invars if is_var(v)})
    cand = [i for i in pending if any(not env.known(v) for v in eqns[i].invars)]
    stuck = [i for i in cand if any(env.known(v) for v in real_outvars(eqns[i]))]
    if stuck and _group_ending_at(eqns, env, cand, max(stuck), soft, walk, state, every, read):
        return True
    # then the groups ending at outputs known on some elements only, solved there
    # (`_partly_known`): the spline of flowjax's inverse loop, whose one known output element
    # the step's `dynamic_slice` reads (a group ending at that read holds the slice, which
    # gives nothing of the rest)
    partial = [i for i in cand if any(elements.is_partial(env, v) for v in eqns[i].outvars)]
    if not partial or (stuck and max(partial) >= max(stuck)):
        return False
    top = max(partial)
    below = [i for i in cand if i <= top]
    return _group_ending_at(eqns, env, below, top, soft, walk, state, every, read)


def _group_ending_at(
    eqns: Sequence[JaxprEqn],
    env: Env,
    cand: list[int],
    top: int,
    soft: bool,
    walk: SubWalk,
    state: _Lazy,
    every: _Lazy,
    read: _Lazy,
) -> bool:
    """`choice_step` on the groups of the candidates `cand` (the pending equations with an
    input not known) that end at equation `top`, the smallest first (`read`: what the walk's
    equations read): whether one was solved."""
    for t in sorted((i for i in cand if i <= top), reverse=True)[:MAX_GROUP_EQNS]:
        G = [eqns[i] for i in cand if i >= t]
        if not any(e.primitive in choice_rules or _int_out(e) for e in G):
            continue
        produced = {v for e in G for v in real_outvars(e)}
        inputs = list(
            dict.fromkeys(
                v
                for e in G
                for v in e.invars
                if is_var(v) and not env.known(v) and v not in produced
            )
        )
        outputs = [v for e in G for v in real_outvars(e) if env.known(v)]
        solving, partly = env, None
        if inputs and size_of(v.aval for v in inputs) != size_of(v.aval for v in outputs):
            # (some of what the group reads, or of its outputs, is known on some elements
            # only: the knots of a spline a masked network computes from the state, known on
            # the rows of the elements already recovered)
            partly = _partly_known(G, inputs, env, read())
            if partly is None:
                continue
            inputs, outputs, solving = partly.state, partly.outputs, partly.env
        if not inputs or size_of(v.aval for v in inputs) != size_of(v.aval for v in outputs):
            continue
        shape = tuple(outputs[0].aval.shape)
        # (the comparisons of the state taken as one piece decision only where the choices
        # alone leave a group that is not elementwise: distrax's one-hot bins)
        for pieces in (False, True):
            ch = _choices(G, solving, pieces)
            if ch and _decomposes(G, ch, inputs, outputs, solving, shape):
                break
        else:
            continue
        for c in ch:
            if isinstance(c, _Piece):
                c.producer = every
        per_element = _decomposes(G, ch, inputs, outputs, solving, shape, whole=False)
        if partly is not None and not (
            per_element and elements.per_element(G, {*inputs, *partly.reads}, shape)
        ):
            # (elements solved apart must not depend on one another, nor on the reads' rows
            # of other elements: a sum over the elements of a table known on some rows)
            continue
        combos = _combos(G, ch, outputs, solving)
        if combos is None:
            continue
        # (inputs known before on elements decided when the program runs, a loop's carry but
        # the window its step writes: the record says so, and the log-det's plan takes the
        # group's pivots on the rest only, or not at all: `logdet._plan_some_elements`)
        before = [(v, elements.region_of(env, v)) for v in inputs]
        if partly is None and any(
            r != R.FULL and R.static_mask(r, tuple(v.aval.shape)) is None for v, r in before
        ):
            recovered = [(v, r, R.EMPTY) for v, r in before]
        else:
            recovered = []
        try:
            done = _split(
                G,
                ch,
                combos,
                inputs,
                outputs,
                solving,
                shape if per_element else None,
                walk,
                None if soft else state,
                None if partly is None else partly.active,
                recovered,
            )
        except _Lost as e:
            if soft:
                return False
            raise e.error from None
        if not done or partly is None:
            return done
        # (learned on the elements whose reads and outputs are known; the others wait)
        changes = []
        for v in inputs:
            was = elements.region_of(env, v)
            new = R.intersect(was, partly.unknown, env.info)
            # (the solved values on the elements solved and newly known, the known ones kept
            # elsewhere: a region with windows is completed by its value whole)
            val = solving.read(v)
            if was != R.FULL:
                take = partly.active & _as_mask(was, tuple(v.aval.shape), env)
                val = jnp.where(take, val, elements.value_of(env, v))
            if elements.learn(env, v, val, new):
                changes.append((v, was, elements.region_of(env, v)))
        if changes:
            # (the record says which elements this pass recovered, for the log-det's plan: a
            # window at a loop counter in flowjax's inverse loop, one element per step)
            records.group_step(
                env, "choice", G, partly.state, partly.outputs, elementwise=True, recovered=changes
            )
        return bool(changes)
    return False


class _PartlyKnown(NamedTuple):
    """A group whose reads or outputs are known on some elements only (`_partly_known`): its
    `state` (the unknowns it maps to its `outputs`, all of one shape), its `reads` (known on
    some elements, laid out per element), where it cannot be solved (`unknown`: a region of
    that shape, where a read's row or an output is not known), the elements it is solved on
    (`active`, a mask of that shape, static or made when the program runs: the others'
    values are not to be read, nor checked), and `env`, a copy of the walk's with the reads
    and outputs written whole (`FILL` where unknown)."""

    state: list[Var]
    reads: list[Var]
    outputs: list[Var]
    unknown: Any
    active: Any
    env: Env


def _as_mask(r: Any, shape: tuple, env: Env) -> Any:
    """A region as a boolean array: numpy where it is static, else made when the program runs."""
    static = R.static_mask(r, shape)
    return static if static is not None else R.materialize(r, shape, env.read, env.masks)


def _partly_known(
    G: Sequence[JaxprEqn], inputs: Sequence[Var], env: Env, read: set
) -> _PartlyKnown | None:
    """The group as one solved element by element on the elements where its reads (laid out
    per element: the outputs' shape leading) and its outputs are known, where its unknowns
    (`inputs`: what it reads and does not make, not known whole) are the state (the outputs'
    shape) and reads known on some elements: a masked network's knots, known on the rows of the
    elements already recovered. Its outputs are those known and those known on some elements
    that nothing in the group reads. The elements solved may be decided when the program runs
    (flowjax's MAF inverse loop with spline transformers: the one element `rank` a step
    writes, a window at a loop counter): `active` is then made when it runs. None where the
    group is not so, or where it would learn nothing."""
    read_in_g = {v for e in G for v in e.invars if is_var(v)}
    outs = [
        v
        for e in G
        for v in real_outvars(e)
        if v not in read_in_g and (env.known(v) or (elements.is_partial(env, v) and v in read))
    ]
    if not outs:
        return None
    shape = tuple(outs[0].aval.shape)
    if not shape or any(tuple(o.aval.shape) != shape for o in outs):
        return None
    state = [v for v in inputs if tuple(v.aval.shape) == shape]
    reads = [v for v in inputs if tuple(v.aval.shape) != shape]
    if not state or not all(elements.is_partial(env, v) for v in reads):
        return None
    unknown = R.EMPTY
    for v in reads:
        vs = tuple(v.aval.shape)
        rows = elements.reads_relation("rows", vs, shape) if vs[: len(shape)] == shape else None
        if rows is None:
            return None
        unknown = R.union(unknown, R.spread(elements.region_of(env, v), rows, shape), env.info)
    for v in outs:
        unknown = R.union(unknown, elements.region_of(env, v), env.info)
    if unknown == R.FULL or all(
        R.implies(
            elements.region_of(env, v),
            R.intersect(elements.region_of(env, v), unknown, env.info),
        )
        for v in state
    ):
        return None  # (nothing to learn yet)
    active = ~_as_mask(unknown, shape, env)
    solving = env.copy()
    for v in [*reads, *outs]:
        if not env.known(v):
            solving.write(v, elements.value_of(env, v, clean=True))
    return _PartlyKnown(state, reads, outs, unknown, active, solving)


def _decomposes(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple,
    whole: bool = True,
) -> bool:
    """Whether the group, its choices assumed, leaves per element an elementwise program to
    invert (or, with `whole`, decides every choice once for whole arrays). What decides the
    branch (a bin search) may be anything: the merged candidate is checked against every
    decision again."""
    values = [c for c in ch if c.value is not None]
    det = _determined(G, values, env)
    # (a piece's comparisons read moves of the state, `x[:, None] >= knots`, that feed
    # nothing else: what only feeds decided values is not inverted either)
    piece = any(isinstance(c, _Piece) for c in ch)

    def decided(e: JaxprEqn) -> bool:
        return all(o in det for o in real_outvars(e))

    # (what only decides a select's or a cond's case, an argmax over a `jnp.select`'s
    # conditions, is not inverted: each branch replaces the choice by one case)
    core = [
        e
        for e in _live(
            [e for e in G if not any(c.eqn is e for c in values) and not (piece and decided(e))],
            outputs,
            decided={c.eqn for c in ch if c.value is None},
        )
        if not decided(e)
    ]
    per_element = all(tuple(v.aval.shape) == shape for v in [*inputs, *outputs]) and all(
        elementwise_in(e, shape) or _pointwise_gather(e, shape) for e in core
    )
    return per_element or (whole and all(c.whole for c in ch))


def _combos(
    G: Sequence[JaxprEqn], ch: list[_Choice], outputs: Sequence[Var], env: Env
) -> list[dict] | None:
    """The combinations ``{eqn: (choice, branch)}`` to try (None: more than `MAX_COMBOS`).
    Choices are split from the outputs backwards and only while still live: a select's case
    leaves its other case's computations dead, so the choices under a case are tried under it
    alone (a spline's bins under the in-bounds case: linear in the bins, not a product), and
    a prefix whose branches cannot hold together (`reach.reachable`) is dropped."""
    producer = {o: e for e in G for o in real_outvars(e)}
    by_eqn = {c.eqn: c for c in ch}
    order = [e for e in reversed(G) if e in by_eqn]
    out: list[dict] = []

    def grow(combo: dict) -> bool:
        window = _branch_window(G, combo, env.copy())
        if window is None:  # (`_solve` reports it)
            out.append(combo)
            return len(out) <= MAX_COMBOS
        undecided = {e for e in order if e not in combo and by_eqn[e].value is None}
        live = set(map(id, _live(window, outputs, decided=undecided)))
        nxt = next(
            (
                e
                for e in order
                if e not in combo
                and any(id(q) in live for q in getattr(by_eqn[e], "comparisons", [e]))
            ),
            None,
        )
        if nxt is None:
            out.append(combo)
            return len(out) <= MAX_COMBOS
        c = by_eqn[nxt]
        for k in range(c.n):
            more = {**combo, nxt: (c, k)}
            if _fails(c, k) or not reachable(more, producer, env):
                continue  # that branch never returns, or contradicts the others
            if not grow(more):
                return False
        return True

    return out if grow({}) else None


class _Lazy:
    """A value computed when first asked for."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make, self.value, self.done = make, None, False

    def __call__(self) -> Any:
        if not self.done:
            self.value, self.done = self.make(), True
        return self.value


def _int_out(e: JaxprEqn) -> bool:
    outs = real_outvars(e)
    return len(outs) == 1 and jnp.issubdtype(outs[0].aval.dtype, jnp.integer)


def _pointwise_gather(e: JaxprEqn, shape: tuple) -> bool:
    """A gather from a table known in full, one element per element of `shape` (`jnp.take`
    of a spline's knots at its bin index): pointwise in the index."""
    if e.primitive is not prims.gather:
        return False
    idx = e.invars[1]
    outs = real_outvars(e)
    return (
        len(outs) == 1
        and tuple(outs[0].aval.shape) == shape
        and tuple(idx.aval.shape[: len(shape)]) == shape
        and int(np.prod(idx.aval.shape[len(shape) :], dtype=np.int64)) == 1
    )


class _Lost(Exception):
    """A combination of branches that cannot be inverted (raised out of the traced solve)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _branch_window(G: Sequence[JaxprEqn], combo: dict, env_c: Env) -> list[JaxprEqn] | None:
    """The group with each choice replaced by what its assumed branch computes (a piece's
    comparisons by their values at its assumed point; an integer placeholder, as `_combos`
    assumes while it finds the combinations' structure: any point)."""
    decided: dict = {}
    for choice, k in combo.values():
        if isinstance(choice, _Piece):
            at = jnp.zeros(choice.u.aval.shape, choice.u.aval.dtype) if isinstance(k, int) else k
            decided.update(choice.decide(env_c, at))
    window = []
    for e in G:
        if decided and any(o in decided for o in real_outvars(e)):
            for o in real_outvars(e):
                env_c.write(o, decided[o])
            continue
        c = combo.get(e)
        if c is None:
            window.append(e)
            continue
        choice, k = c
        (o,) = real_outvars(e)
        if choice.value is not None:  # the integer's value, assumed
            # (a value assumed for all, on the host: a walk folding constants would compile
            # a program for it)
            full = np.full if isinstance(k, int) else jnp.full
            env_c.write(o, full(o.aval.shape, choice.value + k, o.aval.dtype))
            continue
        r = choice_rules[e.primitive].branch(e, k)
        if isinstance(r, JaxprEqn):
            window.append(r)
            continue
        if isinstance(r, Literal) or env_c.known(r):
            env_c.write(o, jnp.broadcast_to(env_c.read(r), o.aval.shape))
        elif tuple(r.aval.shape) == tuple(o.aval.shape) and prims.copy is not None:
            window.append(e.replace(primitive=prims.copy, invars=[r], params={}))
        else:
            return None
    return window


def _live(
    window: list[JaxprEqn], targets: Sequence[Var], decided: set | frozenset = frozenset()
) -> list[JaxprEqn]:
    """The equations of the window that lead to the group's known outputs (a choice replaced
    by one of its cases leaves the others' computations, the predicate's among them, dead).
    The selects and conds in `decided` are followed through their cases only."""
    keep = [False] * len(window)
    need: set = set(targets)
    for i in reversed(range(len(window))):
        e = window[i]
        outs = real_outvars(e)
        if any(o in need for o in outs):
            keep[i] = True
            ins = (
                e.invars[1:]
                if e in decided and e.primitive in (prims.select_n, prims.cond)
                else e.invars
            )
            need.update(v for v in ins if is_var(v))
    return [e for e, k in zip(window, keep) if k]


def _split(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    combos: list[dict],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    walk: SubWalk,
    state: Any,
    active: np.ndarray | None = None,
    recovered: Sequence[tuple[Var, Any, Any]] = (),
) -> bool:
    """Invert the group branch by branch and write the consistent candidate (`active`: the
    elements it is solved on, a mask static or made when the program runs, where its reads
    are known; checks elsewhere are dropped, and the values there are not to be read;
    `recovered`: what its record says it
    recovered, where not its inputs whole). Where the walk's program may be walked
    again (`WalkContext.reinverted`), the inverse is emitted as one
    `custom_inverse` step whose own inverse is the group run forward, so that it can be
    inverted again (``reverse(reverse(f))``)."""
    produced = {o for e in G for o in real_outvars(e)}
    reads = list(
        dict.fromkeys(
            v for e in G for v in e.invars if is_var(v) and env.known(v) and v not in produced
        )
    )

    def fresh(vars_vals: Sequence[tuple[Sequence[Var], Sequence[Any]]]) -> Env:
        e = Env(info=env.info, ctx=env.ctx)  # the creating walk's context, even when
        # `solve` is traced later (the custom_inverse below, inverted again)
        for vs, xs in vars_vals:
            for v, x in zip(vs, xs):
                e.write(v, x)
        return e

    def solve(ys: Sequence[Any], rs: Sequence[Any]) -> tuple | None:
        xs = _solve(
            G,
            ch,
            combos,
            inputs,
            outputs,
            fresh([(reads, rs), (outputs, ys)]),
            shape,
            walk,
            state,
            active,
        )
        return None if xs is None else tuple(xs)

    def forward(xs: Sequence[Any], rs: Sequence[Any]) -> tuple:
        e = fresh([(reads, rs), (inputs, xs)])
        evaluate(G, e, partial=True)
        return tuple(e.read(o) for o in outputs)

    ys = tuple(env.read(o) for o in outputs)
    rs = tuple(env.read(v) for v in reads)
    same = [(tuple(a.aval.shape), a.aval.dtype) for a in outputs] == [
        (tuple(a.aval.shape), a.aval.dtype) for a in inputs
    ]
    if same and env.ctx.reinverted and not all(is_concrete(x) for x in [*ys, *rs]):
        step = custom_inverse(solve)
        step.definverse(forward)
        xs = step(ys, rs)
    else:  # (eagerly, on values: its checks raise at once, naming the choice)
        xs = solve(ys, rs)
    if xs is None:
        return False
    for v, x in zip(inputs, xs):
        env.write(v, x)
    # (decided per element, computed per element: the log-det takes its Jacobian's diagonal
    # blocks, not the dense matrix a search's table would otherwise call for)
    records.group_step(
        env, "choice", G, inputs, outputs, elementwise=shape is not None, recovered=recovered
    )
    return True


def _solve(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    combos: list[dict],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    walk: SubWalk,
    state: Any,
    active: np.ndarray | None = None,
) -> list[Any] | None:
    # candidates stacked on a leading axis, one block per family of combinations; `masks`:
    # per block, where its candidates may be taken beyond consistency (None: everywhere)
    chunks: list[list[Any]] = [[] for _ in inputs]
    masks: list[Any] = []
    tried: list[tuple] = []
    lost: list = []
    searched: list = []  # (the bin indices searched, to name)
    producer = {o: e for e in G for o in real_outvars(e)}

    def combo_int(combo: dict) -> JaxprEqn:
        return next(e for e, (c, _) in combo.items() if c.value is not None)

    def branch(combo: dict, start: Any, bctx: Any) -> tuple:
        return _branch(G, combo, inputs, outputs, env, shape, start, walk, bctx, producer, state)

    def starts_for(bctx: Any) -> Any:
        # a branch solved by Newton's method may have several preimages (a spline piece
        # continued past its bin): Newton runs from every start at once (vmapped), each
        # start's preimage is a candidate, and consistency picks; one solved by a
        # quadratic's roots, both roots; one that needed neither, one candidate
        if bctx.newton_uses:
            return jnp.arange(-1, NEWTON_STARTS)
        return jnp.arange(0, 2) if bctx.root_uses else None

    def add(family: list[dict], starts: Any, mask: Any = None, walked: bool = False) -> None:
        if env.ctx.values:
            _batched(family, starts, branch, env, chunks)
        elif not walked:  # (a planning walk: the family's program walked once, no candidates)
            branch(family[0], -1, env.ctx.replace(on_error="nan"))
        masks.append(mask)
        for combo in family:
            tried.extend([_ks(combo, ch)] * (1 if starts is None else len(starts)))

    def single(combo: dict, mask: Any = None, knot: Any = None) -> None:
        # (the branch walk's own context: whether Newton's method ran, or a quadratic's roots
        # were taken, is asked of it alone; NaN instead of errors)
        bctx = env.ctx.replace(on_error="nan")
        vals, amb = branch(combo, -1, bctx)
        if amb is not None:  # a branch that loses the state, met only where it runs
            # (inside a piece, a clip of the bin's ratio saturates only at the piece's end:
            # an output that is the map's value there, at one knot, is no ambiguity)
            lost.append((_lossy_branch(combo, env)[0], amb if knot is None else amb & ~knot))
            return
        starts = starts_for(bctx)
        if starts is not None and env.ctx.values:
            add([combo], starts, mask)
            return
        for chunk, x in zip(chunks, vals):
            chunk.append(x[None])
        masks.append(mask)
        tried.append(_ks(combo, ch))

    # a piece decision is searched once for all its families (the search runs the group
    # itself, whatever the other choices assume)
    piece = next((c for c in ch if isinstance(c, _Piece)), None)
    point = _Lazy(
        lambda: (
            _search_point(G, set(piece.chain), inputs, outputs, env, shape, piece.producer())
            if piece is not None
            else None
        )
    )
    for family in _families(combos):
        if any(_branch_window(G, combo, env.copy()) is None for combo in family):
            return None
        if piece is not None and piece.eqn in family[0]:
            if point() is None:
                return None  # (no search: the comparisons cannot be enumerated)
            found = point()
            if not searched:
                searched.append((piece.eqn, ~found.monotone))
            for combo in family:
                single({**combo, piece.eqn: (piece, found.at)}, found.monotone, found.knot)
            continue
        if len(family) == 1:
            single(family[0])
            continue
        # the combinations of one family (a spline's bins: the values of its bin index) are
        # one program in those values: traced once, abstractly, to see what it needs, then
        # vmapped over them
        bctx = env.ctx.replace(on_error="nan")
        first = family[0]
        amb = jax.eval_shape(lambda first=first, bctx=bctx: branch(first, -1, bctx)[1])
        if amb is not None:  # (each on its own: `lost` needs its combination's choice)
            for combo in family:
                single(combo)
            continue
        # a bin index of a monotone piecewise map (a spline's) is searched, not enumerated
        found = _searched(G, family, inputs, outputs, env, shape, producer)
        if found is not None:
            combo, monotone = found
            add([combo], starts_for(bctx), monotone)
            searched.append((combo_int(combo), ~monotone))
            continue
        add(family, starts_for(bctx), walked=True)  # (walked above, abstractly)
    if not tried:
        return None
    if not env.ctx.values:  # (a planning walk: the preimage's shape only)
        return placeholders(inputs)
    with staged_constants():
        got = _Gathered(chunks, masks, tried, lost, searched)
        return _pick(G, ch, inputs, outputs, env, shape, got, active)


class _Gathered(NamedTuple):
    """What `_solve`'s branch walks gathered: `chunks`, per input, one block of candidates
    per branch walk; `masks`, per block, where it may be taken (None: everywhere); `tried`,
    per candidate, the branches it assumed; `lost`, ``(choice, where)`` of branches that lose
    the state; `searched`, ``(bin index, where not shown monotone)``."""

    chunks: list[list[Any]]
    masks: list[Any]
    tried: list[tuple]
    lost: list
    searched: list


def _pick(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    got: _Gathered,
    active: np.ndarray | None = None,
) -> list[Any]:
    """The candidates `_solve` gathered (`got`), checked and merged into the preimage.

    Run-time work only, staged into the program even where the walk folds constants: each
    operation on constants alone (a block's assumed branch broadcast, a candidate index)
    would otherwise be compiled and run on its own while the walk traces, tens of XLA
    programs in a flow's first call."""
    chunks, masks, tried = got.chunks, got.masks, got.tried
    cands = [jnp.concatenate(c, axis=0) for c in chunks]
    # every candidate checked at once: the group run forward from each (one program for
    # all, vmapped over them), its choices asked whether they take the assumed branches
    sizes = [c.shape[0] for c in chunks[0]]
    ok = _consistent(G, ch, inputs, outputs, env, shape, cands, tried, sizes)
    if any(m is not None for m in masks):
        ok = ok & jnp.concatenate(
            [
                jnp.broadcast_to(True if m is None else m, (n,) + ok.shape[1:])
                for n, m in zip(sizes, masks)
            ]
        )
    out, idx = _merge(ch, inputs, cands, ok, got.lost, env.ctx, got.searched, active)
    if shape is not None and not elements.per_element(G, set(inputs), shape):
        _recheck(G, ch, inputs, outputs, env, out, idx, tried)
    return out


def _holds(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    xs: Sequence[Any],
    ks: Sequence[Any],
) -> Any:
    """Where the group, run forward from `xs` (a value per input), takes at every choice the
    branch `ks` assumes (one per choice, per element or whole; below 0 for a choice its
    combination left dead: any branch), or gives the outputs back to a few ulps whichever
    branches it took (`_reproduces`), and `xs` are finite: per element of `shape`, or as a
    whole where `shape` is None."""
    env_f, pure = _forward_env(G, env)
    for v, x in zip(inputs, xs):
        env_f.write(v, x)
    evaluate(G, env_f, partial=True)
    ok = jnp.asarray(True)
    for c, k in zip(ch, ks):
        held = jnp.isnan(k) if isinstance(c, _Piece) else k < 0
        if c.value is not None:
            held = held | c.holds(env_f, k)
        else:
            for b in range(c.n):
                held = held | ((k == b) & c.holds(env_f, b))
        ok = ok & held
    if pure:
        ok = ok | _reproduces(env_f, env, outputs, shape)
    for x in xs:
        fin = jnp.isfinite(x)
        ok = ok & (fin if shape is not None else jnp.all(fin))
    return ok if shape is None else jnp.broadcast_to(ok, shape)


def _assumed(tried: list[tuple], j: int, shape: tuple, dtype: Any = jnp.int32) -> Any:
    """The branch each candidate assumed at choice `j`, ``(candidates, *shape)`` (a searched
    bin index assumes one per element; -1 where its combination left the choice dead; a
    piece's point, of the state's `dtype`, NaN there)."""
    return jnp.stack([jnp.broadcast_to(jnp.asarray(t[j], dtype), shape) for t in tried])


def _assumed_all(ch: list[_Choice], tried: list[tuple], shape: tuple) -> list[Any]:
    return [
        _assumed(tried, j, shape, c.u.aval.dtype if isinstance(c, _Piece) else jnp.int32)
        for j, c in enumerate(ch)
    ]


def _consistent(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    cands: list[Any],
    tried: list[tuple],
    sizes: Sequence[int],
) -> Any:
    """`_holds` of every candidate (`cands`: per input, stacked on a leading axis; `tried`:
    per candidate, the branch it assumed at each choice; `sizes`: the blocks, one per branch
    walk): ``(candidates, *shape)``. The group runs forward once for all, vmapped over the
    candidates; a group holding a check (Equinox's `error_if`, a host callback) runs once per
    block, as its branch walks ran."""
    ks = _assumed_all(ch, tried, shape if shape is not None else ())

    def one(xs: Sequence[Any], kk: Sequence[Any]) -> Any:
        return _holds(G, ch, inputs, outputs, env, shape, xs, kk)

    if _forward_env(G, env)[1]:
        return jax.vmap(one)(cands, ks)
    # (a block of candidates vmapped, as its branch walk was; a lone candidate unbatched)
    oks, at = [], 0
    for n in sizes:
        xs, kk = [c[at : at + n] for c in cands], [k[at : at + n] for k in ks]
        oks.append(
            jax.vmap(one)(xs, kk) if n > 1 else one([x[0] for x in xs], [k[0] for k in kk])[None]
        )
        at += n
    return jnp.concatenate(oks, axis=0)


MIN_SEARCHED = 3
"""Values of a bin index from which its family of combinations is searched, not enumerated."""
MAX_THRESHOLDS = 64
"""Thresholds (bin edges) per element a search evaluates the map at, at most."""

_PASSES_U = (
    "max",
    "min",
    "clamp",
    "copy",
    "convert_element_type",
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
)
"""What the bin index may compute from the unknown before comparing it: clips by known
bounds, copies and casts, and moves (``x[..., None] >= knots``, a search by comparing all)."""


def _searched(
    G: Sequence[JaxprEqn],
    family: list[dict],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    producer: dict,
) -> tuple[dict, Any] | None:
    """A family of one bin index's values (a spline's bins) as one combination, its value
    per element found by one search (`_search_point`), as hand-written spline inverses find
    it: the index's value at the point of the piece that holds the output is the one
    assumed. Returns the combination and where the map is shown monotone (elsewhere the
    walk's `on_error` applies, naming the index); None where the family is not of that
    kind (then it is enumerated)."""
    first = family[0]
    varying = [e for e, (c, _) in first.items() if c.value is not None]
    if len(family) < MIN_SEARCHED or len(varying) != 1:
        return None
    e_int = varying[0]
    choice = first[e_int][0]
    index = _ancestors([e_int], producer) | {e_int}
    found = _search_point(G, index, inputs, outputs, env, shape)
    if found is None:
        return None
    mid, monotone = found.at, found.monotone
    (o,) = real_outvars(e_int)
    e = _before(G, env)
    e.write(inputs[0], mid)
    # (the index alone: the equations it is computed by)
    evaluate(G, e, partial=True, used={o for q in index for o in real_outvars(q)})
    k = jnp.clip(e.read(o).astype(jnp.int32) - choice.value, 0, choice.n - 1)
    combo = dict(first)
    combo[e_int] = (choice, k)
    return combo, monotone


def _search_point(
    G: Sequence[JaxprEqn],
    decision: set,
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    sources: dict | None = None,
) -> _Point | None:
    """Per element, a point of the piece of a monotone piecewise map that holds the output:
    the map is evaluated at the thresholds the `decision` equations (a bin index's
    computation, a piece's comparisons) compare the unknown with (the knots, and a clip's
    bounds, known values), and the output's place among those values gives the piece; its
    midpoint is returned, with where the map is shown monotone (its values at the
    thresholds in order, its slopes there of one sign: a rational-quadratic, quadratic or
    linear spline's pieces are then monotone, so the preimage found is the only one). None
    where the decision is not of that kind.

    The decision must compare the unknown itself, or its clip by known bounds, with known
    tables: a threshold in another space (``searchsorted(t, 2 u + 1)``) would place pieces
    wrongly."""
    if (
        shape is None
        or len(inputs) != 1
        or len(outputs) != 1
        or not jnp.issubdtype(inputs[0].aval.dtype, jnp.floating)
        or tuple(inputs[0].aval.shape) != shape
    ):
        return None
    u = inputs[0]
    with staged_constants():  # (run-time work: see `_pick`)
        return _search(G, decision, u, outputs, env, shape, sources)


def _search(
    G: Sequence[JaxprEqn],
    decision: set,
    u: Var,
    outputs: list[Var],
    env: Env,
    shape: tuple,
    sources: dict | None,
) -> _Point | None:
    found = _thresholds(G, decision, u, env, shape, sources)
    if found is None:
        return None
    if not env.ctx.values:  # (a planning walk: a stand-in point, its value unread)
        (at,) = placeholders([u])
        return _Point(at, jnp.ones(shape, bool), jnp.zeros(shape, bool))
    pts, tables = found
    y = env.read(outputs[0])

    def run(x: Any) -> Any:
        e = _before(G, env)
        e.write(u, x)
        evaluate(G, e, partial=True)
        return e.read(outputs[0])

    pts = lax.stop_gradient(pts)
    # the map and its derivative at every threshold (thresholds on the leading axis, kept
    # there: moved last, each step of the search ran on transposed copies)
    at, slope = jax.vmap(lambda x: jax.jvp(run, (x,), (jnp.ones_like(x),)))(pts)
    up, monotone = _monotone(pts, at, slope, tables)
    # the piece holding y: between the last threshold on y's near side and the first past it
    near = jnp.where(up, at <= y, at >= y)
    lo = jnp.max(jnp.where(near, pts, -jnp.inf), axis=0)
    hi = jnp.min(jnp.where(near, jnp.inf, pts), axis=0)
    reach = 1 + jnp.max(pts, axis=0) - jnp.min(pts, axis=0)
    mid = jnp.where(jnp.isinf(lo), hi - reach, jnp.where(jnp.isinf(hi), lo + reach, (lo + hi) / 2))
    # (where y is the map's value at one threshold and no other: the piece's end, a knot)
    hit = at == y
    knot = jnp.any(hit, axis=0) & (
        jnp.max(jnp.where(hit, pts, -jnp.inf), axis=0)
        == jnp.min(jnp.where(hit, pts, jnp.inf), axis=0)
    )
    return _Point(mid.astype(u.aval.dtype), monotone, knot)


class _Point(NamedTuple):
    """A search's answer, per element: `at`, a point of the piece that holds the output; where
    the map is shown `monotone`; where the output is the map's value at one `knot` (an end
    of the piece, and no other threshold's)."""

    at: Any
    monotone: Any
    knot: Any


def _thresholds(
    G: Sequence[JaxprEqn], eqns: set, u: Var, env: Env, shape: tuple, sources: dict | None = None
) -> Any | None:
    """The known floating values a decision's equations `eqns` (a bin index's computation, a
    piece's comparisons) compare the unknown `u` with, ``(m, *shape)`` (thresholds first,
    per element), and the groups they come in (`_Columns`); None where it computes from `u`
    through anything but clips by known bounds, copies, casts and moves (`_PASSES_U`), reads
    a known value laid out otherwise, or reads no such value.

    `sources` (a piece's: the walk's producers) says the values are read element for element
    with `u` (comparisons), never as a table shared by all, and where some are slices of one
    table along its last axis (``x_pos[..., :-1]``, ``x_pos[..., 1:]``, ``x_pos[..., 0]``),
    each column they hold is a threshold once (distrax's one-hot bins compare with four
    slices of one knot table: 9 thresholds, not 18)."""
    aligned = sources is not None
    passes = {u}  # u, or u clipped by known bounds
    for q in G:
        if q in eqns and q.primitive.name in _PASSES_U:
            outs = real_outvars(q)
            if (
                len(outs) == 1
                and jnp.issubdtype(outs[0].aval.dtype, jnp.floating)
                and any(is_var(v) and v in passes for v in q.invars)
                and all(not is_var(v) or v in passes or env.known(v) for v in q.invars)
            ):
                passes.add(outs[0])
    cols: list = []
    kinds: list[str] = []  # per column group: "one", "table" (searched: sorted), "loose"

    def add(val: Any) -> bool:
        vs = tuple(jnp.shape(val))
        if vs == ():
            cols.append(jnp.broadcast_to(val, (1,) + shape))
            kinds.append("one")
        elif vs == shape:
            cols.append(jnp.asarray(val)[None])
            kinds.append("one")
            if len(vs) == 1 and not aligned:
                # (or a table shared by every element, read by a search's loop: both, to be
                # sure; a piece's comparisons are elementwise)
                cols.append(jnp.broadcast_to(jnp.asarray(val)[:, None], vs + shape))
                kinds.append("loose")
        elif len(vs) <= len(shape) and _broadcasts(vs, shape):
            cols.append(jnp.broadcast_to(val, shape)[None])
            kinds.append("one")
        elif (
            vs[:-1] == shape
            or len(vs) == 1
            or (len(vs) == len(shape) + 1 and _broadcasts(vs[:-1], shape))
        ):
            table = jnp.moveaxis(jnp.broadcast_to(val, shape + vs[-1:]), -1, 0)
            # (a table padded with infinities, as searches over open-ended bins are written:
            # those ends stand for its finite ends, which keeps it in order)
            fin = jnp.isfinite(table)
            ends = (
                jnp.min(jnp.where(fin, table, jnp.inf), axis=0),
                jnp.max(jnp.where(fin, table, -jnp.inf), axis=0),
            )
            cols.append(jnp.where(fin, table, jnp.where(table > 0, ends[1], ends[0])))
            kinds.append("table")
        else:  # (a known value not laid out per element: its thresholds unknown)
            return False
        return True

    # (slices of one known table, by its column ranges: {table: [(start, stop, slice)]})
    sliced: dict = {}
    reads_u = False
    for q in G:
        if q not in eqns:
            continue
        for v in q.invars:
            floating = jnp.issubdtype(v.aval.dtype, jnp.floating)
            if is_var(v) and not env.known(v):
                if floating and v not in passes:
                    return None  # the index reads another function of u
                reads_u = reads_u or v in passes
                continue
            if not floating:
                continue
            part = _slice_of(v, sources, shape) if aligned and is_var(v) else None
            if part is not None:
                sliced.setdefault(part[0], []).append((*part[1:], v))
                continue
            val = v.val if isinstance(v, Literal) else env.read(v)
            if isinstance(v, Literal) and not np.all(np.isfinite(np.asarray(val))):
                continue  # (a NaN that a search's normalization writes: no threshold)
            if not add(val):
                return None
    for parts in sliced.values():
        # every column any slice holds, once, in the table's order (sorted if it is)
        column = {}
        for a, b, v in parts:
            val = env.read(v)
            for c in range(a, b):
                column.setdefault(c, val if b - a == 1 and val.shape == shape else val[..., c - a])
        if not add(jnp.stack([column[c] for c in sorted(column)], axis=-1)):
            return None
    if not reads_u or not cols or sum(c.shape[0] for c in cols) > MAX_THRESHOLDS:
        # (a decision that never compares the unknown, an argmax of known values: no
        # threshold of it; its family is enumerated)
        return None
    dt = u.aval.dtype
    pts = jnp.concatenate([c.astype(dt) for c in cols], axis=0)
    # (a non-finite known value is no threshold: 0 instead, one more piece boundary)
    pts = jnp.where(jnp.isfinite(pts), pts, jnp.zeros((), dt))
    ends = np.cumsum([c.shape[0] for c in cols])
    return pts, [_Columns(int(e - c.shape[0]), int(e), k) for c, e, k in zip(cols, ends, kinds)]


def _slice_of(v: Var, producer: dict, shape: tuple) -> tuple[Var, int, int] | None:
    """``(table, start, stop)`` where `v` is columns ``[start, stop)`` of a table of shape
    ``(*shape, m)`` along its last axis (``t[..., a:b]``; ``t[..., i]``, a slice then a
    squeeze, is ``[i, i + 1)``), else None."""
    e = producer.get(v)
    if e is not None and e.primitive.name == "squeeze":
        src = e.invars[0]
        if tuple(e.params.get("dimensions", ())) != (src.aval.ndim - 1,) or not is_var(src):
            return None
        e = producer.get(src)
    if e is None or e.primitive.name != "slice" or not is_var(e.invars[0]):
        return None
    src = e.invars[0]
    strides = e.params.get("strides")
    starts, limits = e.params["start_indices"], e.params["limit_indices"]
    if (
        tuple(src.aval.shape[:-1]) != shape
        or (strides is not None and any(st != 1 for st in strides))
        or any(a != 0 or b != n for a, b, n in zip(starts[:-1], limits[:-1], shape))
    ):
        return None
    return src, int(starts[-1]), int(limits[-1])


def _broadcasts(vs: tuple, shape: tuple) -> bool:
    """Whether a value of shape `vs` broadcasts to `shape` (aligned at the right)."""
    return len(vs) <= len(shape) and all(a in (1, b) for a, b in zip(vs[::-1], shape[::-1]))


class _Columns(NamedTuple):
    """A group of thresholds, ``[start, stop)`` on their leading axis, read from one known
    value: "one" (a scalar, or a value per element), a "table" a search reads (expected in
    order), or a "loose" row of values in no known order."""

    start: int
    stop: int
    kind: str


def _monotone(pts: Any, at: Any, slope: Any, groups: Sequence[_Columns]) -> tuple[Any, Any]:
    """Whether the map is rising (by its outermost thresholds), and where it is shown monotone:
    its values `at` the thresholds `pts` in their order (every pair of thresholds, up to
    rounding), its `slope`s there of the rising or falling sign, which makes a
    rational-quadratic, quadratic or linear spline's pieces monotone between them.

    Every pair is compared across groups and inside a loose group; a searched table (in
    order, or in reverse order: checked, else not shown) is walked once with the running
    maximum of the values before each threshold, so that a spline's m knots cost m
    comparisons, not m² (the pairs were a sixth of a flowjax spline inverse's time)."""
    # (the values at the lowest and the highest threshold, the first of ties: a knot equal
    # to a clip's bound may come out a few ulps apart)
    first = jnp.arange(pts.shape[0]).reshape((-1,) + (1,) * (pts.ndim - 1))
    m = pts.shape[0]
    lowest = jnp.min(jnp.where(pts == jnp.min(pts, axis=0), first, m), axis=0)
    highest = jnp.min(jnp.where(pts == jnp.max(pts, axis=0), first, m), axis=0)
    up = jnp.sum(jnp.where(first == highest, at, 0), 0) >= jnp.sum(
        jnp.where(first == lowest, at, 0), 0
    )
    # (out of order by more than rounding, per element: a knot a few ulps from a clip's
    # bound may come out either side of it; NaN is no evidence either way)
    eps = jnp.finfo(at.dtype).eps
    fuzz = _AGREE_ULPS * eps * jnp.maximum(jnp.max(jnp.abs(at), axis=0), 1.0)
    # (thresholds apart by more than rounding whose values are equal: a flat stretch, where
    # the map is not one-to-one, a spline's bin of zero height)
    apart = _AGREE_ULPS * jnp.finfo(pts.dtype).eps * jnp.maximum(jnp.max(jnp.abs(pts), 0), 1.0)
    rising = jnp.where(up, at, -at)  # (falling maps compared as rising)

    def cols(g: _Columns) -> tuple[Any, Any]:
        return pts[g.start : g.stop], rising[g.start : g.stop]

    def pairs_out_of_order(a: _Columns, b: _Columns) -> Any:
        (pa, ra), (pb, rb) = cols(a), cols(b)
        lower = pa[:, None] < pb[None, :]
        higher = pb[None, :] < pa[:, None]
        wrong = (lower & (rb[None, :] < ra[:, None] - fuzz)) | (
            higher & (ra[:, None] < rb[None, :] - fuzz)
        )
        flat = (jnp.abs(pa[:, None] - pb[None, :]) > apart) & (ra[:, None] == rb[None, :])
        return jnp.any(wrong | flat, axis=(0, 1))

    bad = jnp.zeros(up.shape, bool)
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            bad = bad | pairs_out_of_order(a, b)
        if a.stop - a.start < 2:
            continue
        if a.kind == "loose":
            bad = bad | pairs_out_of_order(a, a)
        else:
            bad = bad | ~_table_in_order(*cols(a), fuzz, apart)
    tilt = jnp.where(up, slope, -slope)
    steep = _AGREE_ULPS * eps * jnp.max(jnp.abs(jnp.where(jnp.isnan(tilt), 0, tilt)), 0)
    # (a map undefined at a threshold, 0/0 at a flat bin's knot, shows nothing there)
    bad = bad | jnp.any(jnp.isnan(at), axis=0)
    return up, ~bad & ~jnp.any(tilt < -steep, axis=0)


def _table_in_order(p: Any, r: Any, fuzz: Any, apart: Any) -> Any:
    """Where a table's thresholds `p` (leading axis) are sorted, either way, and the rising
    values `r` at them never fall, by more than `fuzz`, below a value at a lower threshold,
    nor stay equal from one threshold to the next one more than `apart` away (a flat
    stretch): one walk along the table in its order, keeping the largest value so far (equal
    thresholds have equal values, the map run on the same input; NaN is no evidence).
    Unrolled: a running maximum by `lax.cummax` is 3-6x slower on XLA:CPU."""

    def walk(ps: Any, rows: Any) -> Any:
        upto, fine = rows[0], jnp.ones(rows.shape[1:], bool)
        for i in range(1, rows.shape[0]):
            row = rows[i]
            flat = (row == rows[i - 1]) & (jnp.abs(ps[i] - ps[i - 1]) > apart)
            fine = fine & ~(row < upto - fuzz) & ~flat
            upto = jnp.fmax(upto, row)
        return fine

    rises = jnp.all(p[1:] >= p[:-1], axis=0)
    falls = jnp.all(p[1:] <= p[:-1], axis=0)
    return (rises & walk(p, r)) | (falls & walk(p[::-1], r[::-1]))


def _families(combos: list[dict]) -> list[list[dict]]:
    """The combinations grouped by everything but the values assumed of integers (a spline's
    bin index): a family's windows are one program in those values."""
    fams: dict = {}
    for combo in combos:
        key = tuple((id(e), k if c.value is None else None) for e, (c, k) in combo.items())
        fams.setdefault(key, []).append(combo)
    return list(fams.values())


def _ks(combo: dict, ch: list[_Choice]) -> tuple:
    return tuple(
        combo[c.eqn][1] if c.eqn in combo else (jnp.nan if isinstance(c, _Piece) else -1)
        for c in ch
    )


def _batched(family: list[dict], starts: Any, branch: Callable, env: Env, chunks: list) -> None:
    """The family's candidates, the branch walk traced once and vmapped over the integers'
    assumed values (and Newton's starts or the roots, `starts`)."""
    first = family[0]
    varying = [e for e, (c, _) in first.items() if c.value is not None]
    table = [
        jnp.stack(
            [
                jnp.asarray(
                    combo[e][1],
                    first[e][0].u.aval.dtype if isinstance(first[e][0], _Piece) else jnp.int32,
                )
                for combo in family
            ]
        )
        for e in varying
    ]

    def one(row: Any, start: Any) -> tuple:
        combo = dict(first)
        for j, e in enumerate(varying):
            combo[e] = (first[e][0], row[j])
        return branch(combo, start, env.ctx.replace(on_error="nan"))[0]

    n = len(family)  # (a family of no integer: its rows are empty)
    if starts is None:
        vals = jax.vmap(lambda row: one(row, -1), axis_size=n)(table)
    else:
        vals = jax.vmap(lambda row: jax.vmap(lambda s: one(row, s))(starts), axis_size=n)(table)
        vals = [x.reshape((-1,) + x.shape[2:]) for x in vals]
    for chunk, x in zip(chunks, vals):
        chunk.append(x)


def _fails(c: _Choice, k: int) -> bool:
    """Whether branch `k` of choice `c` never returns (`ChoiceRule.fails`)."""
    rule = choice_rules.get(c.eqn.primitive) if c.value is None else None
    return rule is not None and rule.fails is not None and rule.fails(c.eqn, k)


def _branch(
    G: Sequence[JaxprEqn],
    combo: dict,
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    shape: tuple | None,
    start: Any,
    walk: SubWalk,
    bctx: Any,
    producer: dict,
    state: Any,
) -> tuple[list[Any], Any]:
    """One combination of branches: the candidate it inverts to (Newton's method starting
    from start `start`, -1 for the best of all) and None (whether the group takes those
    branches from it is asked of all candidates at once: `_consistent`); or, for a
    combination whose output does not depend on the state (a clip's saturated branch after a
    spline), NaN and where the output is the one it makes (`_lossy`).
    `bctx`: the branch walk's context (NaN instead of errors), derived from the group's."""
    env_c = env.copy()
    window = _live(_branch_window(G, combo, env_c), outputs)
    env_c.ctx = bctx.replace(newton_start=start)
    stuck = walk(window, env_c, inputs)
    if not all(env_c.known(v) for v in inputs):
        amb = (
            None
            if state is None
            else _lossy(G, combo, inputs, outputs, env, producer, shape, state())
        )
        if amb is not None:
            nans = [jnp.full(v.aval.shape, jnp.nan, v.aval.dtype) for v in inputs]
            return nans, amb
        e, k = _lossy_branch(combo, env)
        inner = _lossy_step(stuck, combo) if e is None else None
        if inner is not None:  # the branch is fine, a step inside it loses information
            raise _Lost(not_invertible(inner.eqn, inner.reason, inner.hint, who=env.ctx.who))
        if e is None:  # (no choice left live: name the group's first)
            e, k = next(
                ((d, kk) for d, (_, kk) in combo.items()),
                (next((q for q in G if q.primitive in choice_rules), G[0]), 0),
            )
        raise _Lost(not_invertible(e, _LOST_REASON.format(k=k), _LOST_HINT, who=env.ctx.who))
    return [env_c.read(v) for v in inputs], None


def _before(G: Sequence[JaxprEqn], env: Env) -> Env:
    """An env holding what the group reads from outside it, none of its own values: the
    group run forward in it recomputes its outputs (a copy of `env` holds them known, and
    `evaluate` would keep them)."""
    made = {o for q in G for o in real_outvars(q)}
    out = Env(info=env.info, ctx=env.ctx)
    for q in G:
        for v in q.invars:
            if is_var(v) and v not in made and env.known(v):
                out.write(v, env.read(v))
    return out


def _forward_env(G: Sequence[JaxprEqn], env: Env) -> tuple[Env, bool]:
    """The env to run the group forward from a candidate in, and whether its outputs are
    recomputed there: they are where the group has no effects (`_before`); a group holding a
    check (Equinox's `error_if`, a host callback) keeps its outputs known instead (a copy of
    `env`), so that a candidate the check would refuse never runs it."""
    if any(q.effects for q in G) or mentions(SimpleNamespace(eqns=G), is_host_callback):
        return env.copy(), False
    return _before(G, env), True


def _reproduces(
    env_f: Env, env: Env, outputs: list[Var], shape: tuple | None, ulps: int = _SAME_ULPS
) -> Any:
    """Where the group, run forward from a candidate (`env_f`), gives the known outputs back
    to a few ulps, whichever branches it took: a candidate on a bin's edge (an input on a
    spline's knot) is found by the bin on one side and rounds into the other, and it is a
    preimage all the same (before, no branch was consistent with it)."""
    same = jnp.asarray(True)
    for o in outputs:
        y, got = env.read(o), env_f.read(o)
        if jnp.issubdtype(jnp.result_type(y), jnp.inexact):
            fi = jnp.finfo(jnp.result_type(y))
            s = jnp.abs(got - y) <= ulps * fi.eps * jnp.maximum(jnp.abs(y), fi.tiny)
        else:
            s = got == y
        same = same & (s if shape is not None else jnp.all(s))
    return same


_LOST_REASON = (
    "where the program takes branch {k} of it, the state cannot be recovered from "
    "the output (that branch does not depend on it, like relu's zero)"
)
_LOST_HINT = (
    "Ways out: make every branch invertible (leaky relu instead of relu), or keep what "
    "the branch loses in the state."
)


def _lossy(
    G: Sequence[JaxprEqn],
    combo: dict,
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    producer: dict,
    shape: tuple | None,
    state: tuple,
) -> Any:
    """For a combination that cannot be inverted: where the output is the one it makes, if the
    state is not known to take it. A branch taken on an interval of the walk's state itself
    (relu's zero) is refused when traced (None); one taken on an intermediate value (a clip
    after a spline, saturated only where the spline leaves its interval, which it never does;
    numpyro's sigmoid clipped to [tiny, 1 - eps]) may never run: it is refused where it could
    have made the output, when the program runs. None too where the combination's output
    still depends on the state."""
    e, k = _lossy_branch(combo, env)
    own, every = state  # (the walk's unknowns, the producers of the whole walk)
    if e is None or decided_on(e, k, {**every, **producer}, env, own, combo):
        return None
    env_q = _before(G, env)  # what is known before the group, no output
    window = _branch_window(G, combo, env_q)
    if window is None:
        return None
    evaluate(window, env_q, partial=True)
    if not all(env_q.known(o) for o in outputs):
        return None
    # (within a few ulps: the forward run and this one may round steps after the clip
    # differently)
    amb = _reproduces(env_q, env, outputs, shape, _LOST_ULPS)
    return amb if shape is None else jnp.broadcast_to(amb, shape)


def _recheck(
    G: Sequence[JaxprEqn],
    ch: list[_Choice],
    inputs: list[Var],
    outputs: list[Var],
    env: Env,
    out: list[Any],
    idx: Any,
    tried: list[tuple],
) -> None:
    """Where a decision is not computed element by element (a search over a table), the
    candidates picked per element are checked together: from them, does every choice take the
    branch its element assumed?"""
    # (combinations, *elements): the value each candidate assumed (a searched bin index
    # assumes one per element), then the one of the candidate each element picked
    ks = [jnp.take_along_axis(k, idx[None], axis=0)[0] for k in _assumed_all(ch, tried, idx.shape)]
    ok = _holds(G, ch, inputs, outputs, env, idx.shape, out, ks)
    first = next((c.eqn for c in ch if has_user_frame(c.eqn)), ch[0].eqn)
    together = jnp.all(
        ok
        | jnp.any(
            jnp.stack(
                [jnp.isnan(x) for x in out if jnp.issubdtype(x.dtype, jnp.inexact)]
                or [jnp.zeros(idx.shape, bool)]
            ),
            axis=0,
        )
    )
    who = env.ctx.who
    raise_where(
        env.ctx.on_error,
        lambda ok: (
            None
            if np.all(ok)
            else at_eqn(
                ReversibilityError,
                first,
                "the branches chosen element by element are not consistent "
                "together (a decision depends on several elements)",
                "Ways out: compute each element's decision from that element only, or pass "
                "on_error='nan'.",
                who=who,
            )
        ),
        together,
        bad=~together,
    )


def _lossy_branch(combo: dict, env: Env) -> tuple[JaxprEqn | None, int]:
    """The choice to name for a combination that cannot be inverted: one whose branch is a
    value that does not depend on the state (relu's zero); (None, 0) where there is none."""
    for c, k in combo.values():
        if c.value is not None:
            continue
        r = choice_rules[c.eqn.primitive].branch(c.eqn, k)
        if not isinstance(r, JaxprEqn) and (isinstance(r, Literal) or env.known(r)):
            return c.eqn, k
    return None, 0


def _lossy_step(stuck: Any, combo: dict) -> Any:
    """Among a branch walk's stuck steps, one (not a choice) whose rule said it destroys
    information (`x ** 2.0` behind Equinox's `error_if`): the step to name."""
    mine = set(combo)
    todo = list(stuck or ())
    while todo:
        s = todo.pop(0)
        if s.lossy and s.eqn not in mine:
            return s
        todo.extend(s.inner)
    return None


def _merge(
    ch: list[_Choice],
    inputs: list[Var],
    cands: list[Any],
    ok: Any,
    lost: list,
    ctx: Any,
    searched: Sequence[JaxprEqn] = (),
    active: np.ndarray | None = None,
) -> tuple[list[Any], Any]:
    """Per element (or as a whole), the first consistent candidate (`cands`: per input, the
    candidates stacked on a leading axis; `ok`: where each is consistent); checks that one is
    consistent, that the consistent ones agree, and that no branch that loses the state could
    have made the output (`lost`: ``(choice, where)``); what a failure does: `ctx.on_error`.
    `searched`: ``(bin index, where)`` for the bin indices searched (`_searched`), where
    the map was not shown monotone (named there)."""
    who = ctx.who
    idx = jnp.argmax(ok, axis=0).astype(jnp.int32)
    anyok = jnp.any(ok, axis=0)
    which = jnp.arange(ok.shape[0], dtype=jnp.int32).reshape((-1,) + (1,) * idx.ndim)
    others = ok & (which != idx)
    picked = []
    apart = jnp.zeros(idx.shape, bool)
    for c in cands:
        p = (
            c[idx]
            if idx.ndim == 0
            else jnp.take_along_axis(c, jnp.broadcast_to(idx, c.shape[1:])[None], axis=0)[0]
        )
        picked.append(p)
        eps = jnp.finfo(c.dtype).eps if jnp.issubdtype(c.dtype, jnp.inexact) else 0
        # (floored at 1: a candidate near 0 computed through values of order 1, a knot
        # of the bin, carries their rounding, not its own)
        tol = _AGREE_ULPS * eps * jnp.maximum(jnp.maximum(jnp.abs(p), jnp.abs(c)), 1.0)
        far = jnp.abs(c - p) > tol
        if idx.ndim == 0:
            far = jnp.any(far.reshape(far.shape[0], -1), axis=1)
        apart = apart | jnp.any(others & far, axis=0)
    first = next((c.eqn for c in ch if has_user_frame(c.eqn)), ch[0].eqn)
    gone = jnp.zeros(idx.shape, bool)
    for _, where in lost:
        gone = gone | where

    rough = jnp.zeros(idx.shape, bool)
    for _, where in searched:
        rough = rough | where
    if active is not None:  # (elements whose reads are not known yet: nothing to check)
        anyok, apart, gone, rough = anyok | ~active, apart & active, gone & active, rough & active

    def error(anyok, apart, gone, rough):
        if np.any(rough):
            return at_eqn(
                ReversibilityError,
                searched[0][0],
                "this decision (a bin index, or comparisons of the state with knots) is "
                "searched (the map evaluated at the thresholds it compares the state with, "
                "its knots), but the map is not monotone there (its values or its slopes at "
                "the knots), so the preimage found might not be the only one",
                "Ways out: make the pieces monotone (a spline's knots increasing, its "
                "derivatives positive), or pass on_error='nan'.",
                who=who,
            )
        if np.any(gone):
            return not_invertible(
                lost[0][0],
                "the output is one that a branch of it makes "
                "whatever the state (a saturated clip): the state cannot be "
                "recovered there",
                "Ways out: the forward map was flat there (its input at or "
                "past the clip's bound); keep inputs inside the range, or "
                "pass on_error='nan'.",
                who=who,
            )
        if not np.all(anyok) and searched:
            return at_eqn(
                ReversibilityError,
                searched[0][0],
                "no piece of the map holds the output: this decision (a bin index, or "
                "comparisons of the state with knots) is searched (the map evaluated at the "
                "thresholds it compares the state with, its knots), and the output is "
                "outside the map's range, or the map is not monotone there",
                "Ways out: check the input; make the pieces monotone (a spline's knots "
                "increasing, its derivatives positive); or pass on_error='nan'.",
                who=who,
            )
        if not np.all(anyok):
            return at_eqn(
                ReversibilityError,
                first,
                "no branch of the choices in this group (a select or a max whose "
                "decision depends on the state) is consistent with the output",
                "Ways out: the output is outside the map's range; check the input, "
                "or pass on_error='nan'.",
                who=who,
            )
        if np.any(apart):
            hint = (
                "Ways out: use `jr.cond(pred, true_fun, false_fun, *operands, post=...)`, "
                "whose post condition tells the backward run which branch ran, or pass "
                "on_error='nan'."
                if first.primitive is prims.cond
                else "Ways out: make the map one-to-one (strictly monotone pieces that meet "
                "where the decision switches), or pass on_error='nan'."
            )
            return not_invertible(
                first,
                "two different branches of it are consistent with "
                "the output, so the map is not one-to-one there",
                hint,
                who=who,
            )
        return None

    raise_where(
        ctx.on_error,
        error,
        anyok,
        apart,
        gone,
        rough,
        bad=~jnp.all(anyok) | jnp.any(apart) | jnp.any(gone) | jnp.any(rough),
    )
    good = anyok & ~apart & ~gone & ~rough
    out = []
    for p in picked:
        bad = jnp.broadcast_to(~good, jnp.shape(p)) if good.ndim else ~good
        out.append(
            jnp.where(bad, jnp.nan, p) if jnp.issubdtype(jnp.result_type(p), jnp.inexact) else p
        )
    return out, idx
