"""The propagation walker: every jaxrev transform recovers unknown values with it.

Inversion is propagation over the jaxpr (docs/design.md §3.2): starting from the known outputs and
parameters, repeatedly (a) evaluate forward any equation whose inputs are all known and
(b) invert any equation whose outputs are known and whose unknown inputs a rule can recover.
Knowledge is per element (docs/design.md §3.5): next to values known on some of their elements, or
equations with element-level rules, `elements.forward` / `elements.backward` propagate what is
known of each element (a select's case where its known predicate picks it, the operand of a
scatter outside the written window, a gather's window). When nothing moves, group steps are
tried before giving up: a *linear lump* (equations invertible only together, solved in
`lumps`), and the nonlinear groups of `nonlinear` (exact linear elimination, then Newton's
method). Equations that compute the same value were merged before the walk
(`_jaxpr.prepare`), so a value known once is known everywhere.

A walk is an object (`Walk`), built from everything that steers it: its jaxpr (or a
`Window` of equations) and env, the rule tables it applies (`Rules`; `RULES`, the
registries'), the group steps it tries in order when nothing moves (`GROUP_STEPS`: lumps,
choices, elimination, Newton; each ``step(walk, pending) -> bool``, handed the walk itself and
so its recursion `Walk.subwalk`), its walk context (`knowledge.context.WalkContext`, carried
by the env as `env.ctx`, which the transform that created it sets in `seed`), and its options
(`allow`, `forward_only`, `on_invert`, `soft`, `cut`). It owns its worklist as named fields.
`reverse`, `reversible`'s planner and backward sweep, the loop and branch rules,
`check_reversible` and the inverse transforms all call `propagate` (the one entry point: it
builds a `Walk` and runs it), or `invert_jaxpr`, its entry point for a whole sub-jaxpr;
forward evaluation is `_jaxpr.evaluate`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxrev._compat import ClosedJaxpr, Jaxpr, JaxprEqn, Var
from jaxrev._env import Env, Statics, is_unknown
from jaxrev._errors import WAYS_OUT, NotInvertibleError, not_invertible
from jaxrev._evaluate import evaluate, fold_known
from jaxrev._graph import real_outvars, used_vars
from jaxrev._prepare import prepare
from jaxrev.transforms.knowledge import elements, records
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.context import WalkContext
from jaxrev.transforms.knowledge.elements import token
from jaxrev.transforms.propagation import choices, lumps, nonlinear
from jaxrev.transforms.registry import (
    STRUCTURAL,
    WALKS,
    Lossy,
    NeedMore,
    element_rules,
    elementwise_over,
    inverse_jvp_rules,
    inverse_rules,
    is_kind,
)

__all__ = [
    "Stuck",
    "Window",
    "Walk",
    "Rules",
    "RULES",
    "GroupStep",
    "GROUP_STEPS",
    "lump_group",
    "choice_group",
    "eliminate_group",
    "newton_group",
    "Hints",
    "RuleContext",
    "propagate",
    "linear_walk",
    "seed",
    "invert_jaxpr",
    "raise_stuck",
    "blame",
    "statics_for",
    "static_hints",
]


@dataclass
class Stuck:
    """An equation the walker could not invert, and why."""

    eqn: JaxprEqn
    reason: str
    inner: list[Stuck] = field(default_factory=list)
    hint: str | None = None
    no_rule: bool = False
    lossy: bool = False  # its rule said it destroys information (never part of a group)
    singular: bool = False  # it divides by an exact zero (a vanished pivot)
    subspace: bool = False  # it is linear and drops dimensions (`Lossy.subspace`)


class Window:
    """A stretch of a jaxpr's equations, for a walk (which reads `.eqns`, `.outvars`: a window
    has no outputs of its own). What steers a walk over it (`cut`, no group steps) are the
    walk's options."""

    __slots__ = ("eqns", "outvars")

    def __init__(self, eqns: Sequence[JaxprEqn]) -> None:
        self.eqns = list(eqns)
        self.outvars: list = []


@dataclass
class Hints:
    """What a loop or branch rule knows of a sub-jaxpr's inputs when it is traced: values
    `static` (numpy) per input position, and `enum`: per input position, its value at each of
    the loop's `length` iterations (a loop counter), for element-level reasoning; `support`:
    per input position whose value is not known, where it may be nonzero (`Statics.support`)."""

    static: dict[int, Any] = field(default_factory=dict)
    enum: dict[int, Any] = field(default_factory=dict)
    length: int | None = None
    support: dict[int, Any] = field(default_factory=dict)

    def key(self) -> tuple:
        """A hashable summary (plans are cached on it)."""

        def k(d: dict) -> tuple:
            return tuple((i, a.shape, a.dtype.str, hash(a.tobytes())) for i, a in sorted(d.items()))

        return (k(self.static), k(self.enum), self.length, k(self.support))


def static_hints(n: int, static_of: Callable[[int], Any]) -> Hints | None:
    """Hints for a sub-jaxpr whose first `n` inputs have the static values `static_of(k)`
    (None where not known at trace time): a mask a loop body or a branch selects with."""
    hints = Hints()
    for k in range(n):
        v = static_of(k)
        if v is not None:
            hints.static[k] = v
    return hints if hints.static else None


def statics_for(jaxpr: Jaxpr, consts: Sequence[Any], hints: Hints | None) -> Statics:
    if hints is None:
        return Statics(jaxpr, consts)
    return Statics(
        jaxpr,
        consts,
        {jaxpr.invars[k]: v for k, v in hints.static.items()},
        {jaxpr.invars[k]: v for k, v in hints.enum.items()},
        hints.length,
        {jaxpr.invars[k]: v for k, v in hints.support.items()},
    )


class RuleContext:
    """What a `WALKS` inverse rule receives as `ctx`: its equation, the env of the walk that
    applies it, and that walk's context (`walk`). A loop's rule hands what the walker knows of
    the operands at trace time (`static`) on to its body as `Hints`, and walks its body with
    `invert_jaxpr(..., ctx=ctx)`."""

    def __init__(self, eqn: JaxprEqn, env: Env) -> None:
        self.eqn, self.env = eqn, env

    @property
    def walk(self) -> WalkContext:
        return self.env.ctx

    def static(self, k: int) -> Any:
        return self.env.info.static(self.eqn.invars[k])

    def support(self, k: int) -> Any:
        return self.env.info.support(self.eqn.invars[k])


@dataclass(frozen=True, eq=False)
class Rules:
    """The rule tables a walk looks up: `inverse` (primitive -> inverse rule), `inverse_jvp`
    (primitive -> the derivative of what its inverse rule recovers, `register_inverse_jvp`)
    and `element` (primitive -> element-level rules; the walk asks only whether a primitive
    has some, `knowledge.elements` applies the registry's). `RULES`: the registries' tables,
    which every transform walks with."""

    inverse: Mapping[Any, Callable]
    inverse_jvp: Mapping[Any, Callable]
    element: Mapping[Any, Any]


RULES = Rules(inverse_rules, inverse_jvp_rules, element_rules)

_NO_LOSS = object()


def _call_rule(
    eqn: JaxprEqn, env: Env, rule: Callable, out: Any, ins: Sequence[Any], params: dict
) -> Any:
    """`rule(out, *ins, **params)`, with the walk's `ctx` for a `WALKS` rule."""
    if getattr(rule, WALKS, False):
        return rule(out, *ins, ctx=RuleContext(eqn, env), **params)
    return rule(out, *ins, **params)


# --------------------------------------------------------------------------- applying a rule


def _apply_rule(eqn: JaxprEqn, env: Env, rules: Rules) -> list[Any] | None:
    env.ctx.count("rules")
    rule = rules.inverse[eqn.primitive]
    outs = [env.read_or_unknown(v) for v in eqn.outvars]
    ins = [env.read_or_unknown(v) for v in eqn.invars]
    out = outs if eqn.primitive.multiple_results else outs[0]
    rec = None
    shape = tuple(eqn.outvars[0].aval.shape) if len(outs) == 1 else None
    if shape is not None and elementwise_over(eqn, shape) and elements.windows_apart(env):
        # (on a window written into an array and on the array apart: `through_window`)
        rec = elements.through_window(
            lambda o, *xs: _call_rule(eqn, env, rule, o, xs, eqn.params), [out, *ins], shape, env
        )
    if rec is None:
        rec = _call_rule(eqn, env, rule, out, ins, eqn.params)
    if rec is None:
        return None
    if not isinstance(rec, (list, tuple)) or len(rec) != len(ins):
        name = getattr(rule, "__qualname__", repr(rule))
        raise TypeError(
            f"inverse rule {name} for `{eqn.primitive.name}` must return a list or tuple with one "
            f"entry per input ({len(ins)}: the recovered value or None), got {rec!r:.200}"
        )
    rec = list(rec)
    if eqn.primitive in rules.inverse_jvp:
        rec = _with_inverse_jvp(eqn, env, rules, out, ins, rec)
    return rec


def _with_inverse_jvp(
    eqn: JaxprEqn, env: Env, rules: Rules, out: Any, ins: list, rec: list
) -> list:
    """Give the recovered inputs the derivative the user's inverse-JVP rule states, instead of
    the derivative of the inverse rule's own code (`out` is a list for multiple results)."""
    ij = rules.inverse_jvp[eqn.primitive]
    params = eqn.params
    got = [k for k, r in enumerate(rec) if r is not None and is_unknown(ins[k])]
    known = [k for k, x in enumerate(ins) if not is_unknown(x)]

    def filled(known_vals, recovered=()):
        full = list(ins)
        for k, v in zip(known, known_vals):
            full[k] = v
        for k, v in zip(got, recovered):
            full[k] = v
        return full

    @jax.custom_jvp
    def recovered(out, known_vals):
        rec2 = _call_rule(eqn, env, rules.inverse[eqn.primitive], out, filled(known_vals), params)
        return [rec2[k] for k in got]

    @recovered.defjvp
    def _jvp(primals, tangents):
        out, known_vals = primals
        d_out, d_known = tangents
        xs = recovered(out, known_vals)
        full = filled(known_vals, xs)
        if known:  # the known inputs' part of the output tangent, by the primitive's own JVP

            def with_known(*kv):
                return eqn.primitive.bind(*filled(kv, xs), **params)

            _, from_known = jax.jvp(with_known, tuple(known_vals), tuple(d_known))
            d_out = jax.tree_util.tree_map(lambda a, b: a - b, d_out, from_known)
        t = ij(d_out, out, *full, **params)
        name = getattr(ij, "__qualname__", repr(ij))
        if not isinstance(t, (list, tuple)) or len(t) != len(ins):
            raise TypeError(
                f"inverse-JVP rule {name} for `{eqn.primitive.name}` must return a "
                f"list or tuple with one tangent (or None) per input ({len(ins)}), "
                f"got {t!r:.200}"
            )
        return xs, [t[k] for k in got]

    vals = recovered(out, [ins[k] for k in known])
    for k, v in zip(got, vals):
        rec[k] = v
    return rec


# --------------------------------------------------------------------------- group steps

GroupStep = Callable[["Walk", list[int]], bool]
"""A group step, ``step(walk, pending) -> bool``: tried when no single equation moves, on the
walk's unfinished (and allowed) equations `pending` (indices into `walk.eqns`); it says whether
it wrote into `walk.env` (then the walk looks at every pending equation again)."""


def lump_group(walk: Walk, pending: list[int]) -> bool:
    """Linear lumps (`lumps.lump_step`), of the equations not known to lose information but
    for linear ones that drop dimensions (`real`), which a lump holds where it is regular."""
    dropping = {i for i in walk.lossy if walk.stuck[i].subspace}
    return lumps.lump_step(
        walk.eqns,
        walk.env,
        [i for i in pending if i not in walk.lossy or i in dropping],
        walk.cut,
        frozenset(walk.eqns[i] for i in dropping),
    )


def choice_group(walk: Walk, pending: list[int]) -> bool:
    """Groups whose decisions the state computes (`choices.choice_step`); each branch is
    walked by `walk.subwalk`."""
    return choices.choice_step(walk.eqns, walk.env, pending, walk.soft, walk.subwalk)


def eliminate_group(walk: Walk, pending: list[int]) -> bool:
    """Exact linear elimination of a nonlinear group's affine part (`nonlinear`)."""
    return nonlinear.eliminate_step(walk.eqns, walk.env, pending, walk.lossy)


def newton_group(walk: Walk, pending: list[int]) -> bool:
    """Newton's method on the smallest square group of smooth equations (`nonlinear`; a
    group torn at a few nonlinear values has its affine part walked by `walk.linear_walk`)."""
    return nonlinear.newton_step(
        walk.eqns, walk.env, pending, walk.lossy, walk.cut, walk.linear_walk
    )


GROUP_STEPS: tuple[GroupStep, ...] = (lump_group, choice_group, eliminate_group, newton_group)
"""The group steps every transform walks with, in the order they are tried."""


# --------------------------------------------------------------------------- the walk


# where an equation waits ahead of `partial` (`Walk.ahead`): nowhere (0), in `whole`, in `ready`
_WHOLE, _READY = 1, 2


class Walk:
    """One walk: fill `env` from what it knows over `jaxpr`'s equations (a `Jaxpr` or a
    `Window`), with the inverse rules of `rules` and, when no single equation moves, the group
    steps `steps`, tried in order (the first that writes something wins; `()`: none, the walk
    then ends with its stuck equations in the order they stuck). `run(goals)` walks.

    `ctx` is the walk context (default: the env's, `env.ctx`; one given here is set on the
    env, which rules and group steps read it from). The options: `allow(eqn)`, whether the walk
    may look at an equation at all; `forward_only` (evaluate and propagate elements forward,
    never invert); `on_invert(eqn, vars)`, told of every inversion; `soft` (a step that loses
    information is one more stuck equation instead of an error); `cut` (equations before
    `eqns` are left out, so a value they read may be fixed by equations the walk cannot see:
    group steps then refuse a group singular on random stand-ins).

    The worklist: an equation is looked at again only when something known about one of its
    variables changed (`touching` says which equations read or write a variable), so tracing
    stays linear in the program's length. Three queues: `ready` and `whole` hold equations
    woken because one of their variables became known whole (`ready` those that can now run
    forward: an output a group step took over is then recomputed, not inverted again), and are
    looked at before `partial`, those woken by a change of partial knowledge. Spreading a value
    known on some elements through earlier steps before the step that completes it has run
    would intersect the regions of independent predicates, wave after wave (per-step masks:
    exponential in the steps). `queued[i]`: waiting in a queue, `ahead[i]`: in `ready`
    (`_READY`) or `whole` (`_WHOLE`), an equation in `whole` moving to `ready` once its inputs
    are all known; `done[i]`: every variable known. `stuck` maps equations to why they are stuck,
    `lossy` (per round of group steps) those whose rule said they lose information;
    `rule_tried` / `elements_tried` what was known around an equation when its inverse rule /
    its element rules were last tried (a rule, say a loop's, which traces its body, is tried
    again only once something about its equation changed), and `claimed` the equations whose
    element rules claimed them (their inverse rule is not tried)."""

    __slots__ = (
        "jaxpr",
        "eqns",
        "env",
        "ctx",
        "rules",
        "steps",
        "allow",
        "forward_only",
        "on_invert",
        "soft",
        "cut",
        "used",
        "touching",
        "done",
        "ready",
        "whole",
        "partial",
        "queued",
        "ahead",
        "stuck",
        "lossy",
        "rule_tried",
        "elements_tried",
        "claimed",
    )

    def __init__(
        self,
        jaxpr: Jaxpr | Window,
        env: Env,
        *,
        rules: Rules = RULES,
        steps: Sequence[GroupStep] = GROUP_STEPS,
        ctx: WalkContext | None = None,
        allow: Callable[[JaxprEqn], bool] | None = None,
        forward_only: bool = False,
        on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
        soft: bool = False,
        cut: bool = False,
    ) -> None:
        if ctx is not None:
            env.ctx = ctx
        if not isinstance(env.ctx, WalkContext):
            raise TypeError(
                "propagate: the env carries no walk context (`seed(..., ctx=)` or `Env(ctx=)` "
                "sets it)"
            )
        self.jaxpr, self.env, self.ctx = jaxpr, env, env.ctx
        self.rules, self.steps = rules, tuple(steps)
        self.allow, self.forward_only, self.on_invert = allow, forward_only, on_invert
        self.soft, self.cut = soft, cut
        self.eqns: Sequence[JaxprEqn] = jaxpr.eqns
        n = len(self.eqns)
        self.used: set[Var] = used_vars(jaxpr)
        # what constants compute, at once (one compiled program, not one per operation; a
        # window of a group walk, whose values the walk around it reads, goes one by one)
        folded = (
            set()
            if isinstance(jaxpr, Window)
            else fold_known(self.eqns, env, jaxpr.outvars, self.used)
        )
        self.touching: dict[Var, list[int]] = {}
        for i, e in enumerate(self.eqns):
            for v in (*e.invars, *e.outvars):
                if isinstance(v, Var):
                    self.touching.setdefault(v, []).append(i)
        self.done = [e in folded for e in self.eqns]
        # what runs forward from the seeds first: an equation left in `partial` behind one
        # whose inputs became known whole (a loop reading weights computed from constants)
        # was inverted before those weights were computed, and took them as unknowns
        runs = [all(env.known(v) for v in e.invars) for e in self.eqns]
        self.ready: deque[int] = deque(i for i in range(n) if runs[i])
        self.whole: deque[int] = deque()
        self.partial: deque[int] = deque(i for i in range(n) if not runs[i])
        self.queued = [True] * n
        self.ahead = [_READY if r else 0 for r in runs]
        self.stuck: dict[int, Stuck] = {}
        self.lossy: set[int] = set()
        self.rule_tried: dict[int, tuple] = {}
        self.elements_tried: dict[int, tuple] = {}
        self.claimed: set[int] = set()

    def run(self, goals: Sequence[Any] | None) -> list[Stuck]:
        """Walk until every goal is known (or, with `goals=None`, as far as it goes): [] on
        success, else the equations that blocked it."""
        env, eqns = self.env, self.eqns
        while True:
            while self.ready or self.whole or self.partial:
                if goals is not None and all(env.known(g) for g in goals):
                    return []
                i = self._next()
                if i is not None:
                    self._look(i)
            if goals is not None and all(env.known(g) for g in goals):
                return []
            pending = [i for i in range(len(eqns)) if not self.done[i]]
            if self.forward_only or not self.steps:
                return list(self.stuck.values())
            # group steps see only the allowed equations
            allow = self.allow
            gp = pending if allow is None else [i for i in pending if allow(eqns[i])]
            self.lossy = {i for i, s in self.stuck.items() if s.lossy}
            if any(step(self, gp) for step in self.steps):
                self._wake_all(gp)
                continue
            return [s for i, s in sorted(self.stuck.items())] or [
                Stuck(eqns[i], "its result does not reach the output")
                for i in pending
                if any(not env.known(v) for v in eqns[i].invars)
            ][:1]

    def linear_walk(self, eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var]) -> list[Stuck]:
        """`linear_walk` with this walk's rules (`nonlinear.LinearWalk`)."""
        return linear_walk(eqns, env, goals, self.rules)

    def subwalk(self, eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var]) -> list[Stuck]:
        """The recursion handed to group steps: a soft walk over `eqns` alone (with this walk's
        rules and group steps, and `env`'s context)."""
        return Walk(Window(eqns), env, rules=self.rules, steps=self.steps, soft=True).run(goals)

    # ----------------------------------------------------------------------- the worklist

    def _next(self) -> int | None:
        """The next equation to look at (None: the one taken needs no look)."""
        if self.ready or self.whole:
            i = (self.ready or self.whole).popleft()
            self.ahead[i] = 0
        else:
            i = self.partial.popleft()
        if not self.queued[i]:
            return None  # looked at from a queue ahead since
        self.queued[i] = False
        if self.done[i]:
            return None
        return i

    def _look(self, i: int) -> None:
        """Look at equation `i` and wake the equations around what that changed."""
        env, eqn = self.env, self.eqns[i]
        if self.allow is not None and not self.allow(eqn):
            return
        vs = (*eqn.invars, *real_outvars(eqn))
        before = tuple(token(env, v) for v in vs)
        self._visit(i, eqn, before)
        if all(env.known(v) for v in vs):
            self.done[i] = True
            self.stuck.pop(i, None)
        after = tuple(token(env, v) for v in vs)
        if after != before:
            self._wake(
                [v for v, x, y in zip(vs, before, after) if x != y],
                {v for v, y in zip(vs, after) if y is True and isinstance(v, Var)},
            )

    def _wake(self, vs: Sequence[Any], whole: set) -> None:
        """Queue the equations around the variables `vs` whose knowledge changed (`whole`:
        those now known whole)."""
        for v in vs:
            for j in self.touching.get(v, ()) if isinstance(v, Var) else ():
                if self.done[j]:
                    continue
                if v in whole and self._queue_ahead(j):
                    continue
                if not self.queued[j]:
                    self.queued[j] = True
                    self.partial.append(j)

    def _queue_ahead(self, j: int) -> bool:
        """Queue equation `j` ahead of `partial`: in `ready` if its inputs are all known now
        (also when it already waits in `whole`, which `ready` goes before: a step whose
        last input became known while it waited there, behind a loop woken by its known
        outputs, would otherwise run only after that loop was inverted and took the value
        this step computes for unknown), else in `whole`. False: it waits there already."""
        runs = all(self.env.known(u) for u in self.eqns[j].invars)
        place = _READY if runs else _WHOLE
        if self.ahead[j] >= place:
            return False
        self.ahead[j], self.queued[j] = place, True
        (self.ready if runs else self.whole).append(j)
        return True

    def _wake_all(self, pending: Sequence[int]) -> None:
        """After a group step (which may write anywhere): look at every pending equation
        again, what can run forward first (the values the group took over are recomputed, not
        inverted again)."""
        env, eqns = self.env, self.eqns
        for j in pending:
            if self.done[j]:
                continue
            if all(env.known(u) for u in eqns[j].invars):
                self._queue_ahead(j)
            elif not self.queued[j]:
                self.queued[j] = True
                self.partial.append(j)

    # ----------------------------------------------------------------------- one equation

    def _visit(self, i: int, eqn: JaxprEqn, seen: tuple) -> None:
        """One look at equation `i`: evaluate it, or propagate what is known of some elements
        around it, or apply its inverse rule (`seen`: what was known around it before)."""
        env, stuck = self.env, self.stuck
        if all(env.known(v) for v in eqn.invars):
            evaluate((eqn,), env, used=self.used)
            return
        outs = real_outvars(eqn)
        before = _unknown_regions(eqn, env) if records.active(env) is not None else None
        if self.elements_tried.get(i) != seen:
            self.elements_tried[i] = seen
            self.claimed.discard(i)
            if self._near_elements(eqn) and self._element_step(i, eqn):
                if before is not None:
                    before = _note(eqn, env, before)
                stuck.pop(i, None)
                if self.on_invert is not None:
                    self.on_invert(eqn, [v for v in eqn.invars if env.known(v)])
            if all(env.known(v) for v in eqn.invars):
                return
        if self.forward_only or not any(env.known(v) for v in outs):
            return
        if i in self.claimed:
            loss = env.losses.get(eqn, _NO_LOSS)
            if i not in stuck and loss is not None:  # None: its output came forward
                stuck[i] = (
                    Stuck(
                        eqn,
                        "only some elements of its inputs follow from its output "
                        "(the others are overwritten or selected away)",
                    )
                    if loss is _NO_LOSS
                    else Stuck(
                        eqn,
                        loss.reason,
                        hint=loss.hint,
                        lossy=True,
                        singular=loss.singular,
                        subspace=loss.subspace,
                    )
                )
            return
        if eqn.primitive not in self.rules.inverse:
            stuck[i] = Stuck(eqn, "there is no inverse rule for it", no_rule=True)
            return
        seen = tuple(token(env, v) for v in (*eqn.invars, *outs))
        if i in stuck and self.rule_tried.get(i) == seen:
            return
        self.rule_tried[i] = seen
        try:
            rec = _apply_rule(eqn, env, self.rules)
        except NeedMore as e:
            stuck[i] = Stuck(eqn, e.reason, e.inner, e.hint)
            return
        except Lossy as e:
            # what this step loses may still be known by another route (a value computed
            # forward from elements a `where` kept): an error only if the walk ends without it
            stuck[i] = Stuck(
                eqn, e.reason, hint=e.hint, lossy=True, singular=e.singular, subspace=e.subspace
            )
            return
        except NotInvertibleError as e:
            if not self.soft:
                raise
            stuck[i] = Stuck(eqn, str(e), lossy=True)
            return
        wrote = []
        for v, r in zip(eqn.invars, rec or ()):
            if r is not None and isinstance(v, Var) and not env.known(v):
                elements.complete(env, v, r)
                wrote.append(v)
        if before is not None:
            _note(eqn, env, before)
        if wrote:
            stuck.pop(i, None)
            if self.on_invert is not None:
                self.on_invert(eqn, wrote)
        elif i not in stuck:
            stuck[i] = Stuck(
                eqn,
                "its unknown inputs cannot be recovered from what is known "
                "(more than one of them is unknown)",
            )

    def _element_step(self, i: int, eqn: JaxprEqn) -> bool:
        """Element-level propagation around `eqn`; whether it learned something. Its element
        rules may claim the equation (then its ordinary inverse rule is not tried)."""
        env = self.env
        env.ctx.count("elements")
        learned = elements.forward(eqn, env)
        if self.forward_only:
            return learned
        try:
            claim = elements.backward(eqn, env)
        except Lossy as e:  # an error only if the walk ends without what it loses
            self.stuck[i] = Stuck(
                eqn, e.reason, hint=e.hint, lossy=True, singular=e.singular, subspace=e.subspace
            )
            claim = False
        if claim is not None:
            self.claimed.add(i)
        return bool(claim) or learned

    def _near_elements(self, eqn: JaxprEqn) -> bool:
        """Whether element-level rules may say something about `eqn`: it has some of them, or
        a partly known operand or result, or it is a structural step with no inverse rule, or
        one that joins known operands with unknown ones (a condition concatenated to the state:
        the known elements of its output open a masked network's first outputs)."""
        env, p = self.env, eqn.primitive
        if p in self.rules.element:
            return True
        if env.part and any(
            isinstance(v, Var) and v in env.part for v in (*eqn.invars, *eqn.outvars)
        ):
            return True
        if not is_kind(p, STRUCTURAL):
            return False
        if p not in self.rules.inverse and any(env.known(v) for v in real_outvars(eqn)):
            return True
        return elements.joins_known(eqn, env)


def linear_walk(
    eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var], rules: Rules = RULES
) -> list[Stuck]:
    """A soft walk over `eqns` alone, with `rules` and the linear lumps as its only group
    step: what solves a torn Newton group's affine part for its unknowns once its cut values
    are given (`nonlinear.LinearWalk`), in the group's solve and in its log-det's plan."""
    return Walk(Window(eqns), env, rules=rules, steps=(lump_group,), soft=True).run(goals)


def propagate(
    jaxpr: Jaxpr | Window,
    env: Env,
    goals: Sequence[Any] | None,
    *,
    rules: Rules = RULES,
    steps: Sequence[GroupStep] = GROUP_STEPS,
    allow: Callable[[JaxprEqn], bool] | None = None,
    forward_only: bool = False,
    on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
    soft: bool = False,
    cut: bool = False,
    groups: bool = True,
) -> list[Stuck]:
    """Fill `env` until every goal is known (or, with `goals=None`, as far as it goes): the
    one entry point, a `Walk` built from these options and run (`groups=False`: no group
    steps, single equations only; the rest are the `Walk`'s).

    Returns [] on success, else the equations that blocked it. What steers the walk besides
    `jaxpr`, `env` and the options is the walk context the env carries (`env.ctx`: its
    settings, record and drift log), which `seed` sets."""
    return Walk(
        jaxpr,
        env,
        rules=rules,
        steps=steps if groups else (),
        allow=allow,
        forward_only=forward_only,
        on_invert=on_invert,
        soft=soft,
        cut=cut,
    ).run(goals)


def _unknown_regions(eqn: JaxprEqn, env: Env) -> list:
    """Where each input of `eqn` is unknown (a region; EMPTY when known)."""
    out = []
    for v in eqn.invars:
        st = env.state(v) if isinstance(v, Var) else True
        out.append(R.EMPTY if st is True else R.FULL if st is None else st.region)
    return out


def _note(eqn: JaxprEqn, env: Env, before: list) -> list:
    """Record the elements of `eqn`'s inputs that became known since `before` (for
    log-determinants); returns the regions now."""
    after = _unknown_regions(eqn, env)
    records.eqn_step(
        env,
        eqn,
        [(v, b, a) for v, b, a in zip(eqn.invars, before, after) if b != a and b != R.EMPTY],
    )
    return after


def _innermost(stuck: list[Stuck]) -> list[Stuck]:
    flat: list[Stuck] = []

    def walk(s: Stuck) -> None:
        if s.inner:
            for t in s.inner:
                walk(t)
        else:
            flat.append(s)

    for s in stuck:
        walk(s)
    return flat


def blame(stuck: list[Stuck]) -> Stuck | None:
    """The equation to name in an error: the innermost one, preferring one without a rule."""
    if not stuck:
        return None
    flat = _innermost(stuck)
    for s in flat:
        if s.no_rule:
            return s
    # of the steps that lose elements, the one nearest the output: walking back from it, that
    # is where the information went first
    lossy = [s for s in flat if s.lossy]
    if lossy:
        return lossy[-1]
    return flat[0] if flat else stuck[0]


def raise_stuck(stuck: list[Stuck], what: str, who: str) -> None:
    """Raise the error of a walk that ended with `stuck` before recovering `what`, in the
    name of the transform `who` (its walk context's)."""
    s = blame(stuck)
    if s is None:
        raise NotInvertibleError(
            f"{who} cannot recover {what}: the program's output does not depend on it "
            f"(the value is discarded or overwritten).\n{WAYS_OUT}"
        )
    # a step that loses information makes the Jacobian singular only if nothing else stopped
    # the walk: behind another obstacle (a loop that cannot run backwards), what it loses may
    # be known from elsewhere
    singular = s.singular and all(t.singular for t in _innermost(stuck))
    raise not_invertible(
        s.eqn,
        s.reason if not what else f"{s.reason} (recovering {what})",
        s.hint,
        singular=singular,
        who=who,
    )


def seed(
    closed: ClosedJaxpr,
    ins: Sequence[Any],
    outs: Sequence[Any],
    hints: Hints | None = None,
    prepared: bool = False,
    *,
    ctx: WalkContext | None,
) -> tuple[Jaxpr, Env, list[Var]]:
    """Inline `closed`'s calls and fill a fresh env with its consts and the known entries of
    `ins` and `outs` (`Unknown` elsewhere), for a walk with context `ctx` (None: the env is
    only evaluated forward). Returns (jaxpr, env, goals): the goals are the inputs passed as
    `Unknown`. `hints` say which inputs are static or, in a loop body, known at every
    iteration when the program is traced."""
    if not prepared:
        closed = prepare(closed)
    jaxpr = closed.jaxpr
    env = Env(info=statics_for(jaxpr, closed.consts, hints), ctx=ctx)
    for v, c in zip(jaxpr.constvars, closed.consts):
        env.write(v, c)
    for v, x in zip(jaxpr.invars, ins):
        if not is_unknown(x):
            env.write(v, x)
    for v, y in zip(jaxpr.outvars, outs):
        if not is_unknown(y) and isinstance(v, Var):
            env.write(v, y)
    return jaxpr, env, [v for v, x in zip(jaxpr.invars, ins) if is_unknown(x)]


def invert_jaxpr(
    closed: ClosedJaxpr,
    ins: Sequence[Any],
    outs: Sequence[Any],
    hints: Hints | None = None,
    *,
    ctx: RuleContext,
    more_may_follow: bool = False,
    settings: dict | None = None,
    windows: dict | None = None,
) -> list[Any]:
    """Recover the `Unknown` entries of `ins` from the known `outs` (`Unknown` where not known);
    None for the inputs that were known. Raises `NotInvertibleError` where it cannot, or
    `NeedMore` (naming where the body's walk stopped) if `more_may_follow`: the caller's walk
    may still learn some unknown `ins` or `outs` by another route. `ctx`: the rule context of
    the loop's or branch's rule that walks its body (the walk inherits its walk's context;
    where that walk is recorded, it is recorded as the equation's child); `settings`: changes
    to its context's `Settings` (the walks it starts inherit them); `windows`: a dict the walk
    notes the windows it writes into arrays in (`elements.written_window` reads it)."""
    jaxpr, env, goals = seed(closed, ins, outs, hints, ctx=None)
    if windows is not None:
        env.windows = windows
    env.ctx, attach = records.child(
        ctx.env,
        ctx.eqn,
        env,
        jaxpr,
        hints,
        [
            i
            for i, (v, y) in enumerate(zip(jaxpr.outvars, outs))
            if not is_unknown(y) and isinstance(v, Var)
        ],
        [i for i, x in enumerate(ins) if is_unknown(x)],
    )
    if settings:
        env.ctx = env.ctx.replace(**settings)
    stuck = propagate(jaxpr, env, goals)
    attach()
    missing = [
        i for i, (v, x) in enumerate(zip(jaxpr.invars, ins)) if is_unknown(x) and not env.known(v)
    ]
    if missing:
        if more_may_follow:
            raise NeedMore("its body cannot be inverted from what is known so far", stuck)
        raise_stuck(stuck, f"input(s) {missing}" if blame(stuck) is None else "", ctx.walk.who)
    return [env.read(v) if is_unknown(x) else None for v, x in zip(jaxpr.invars, ins)]
