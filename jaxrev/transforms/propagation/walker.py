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

`reverse`, `reversible`'s planner and backward sweep, the loop and branch rules,
`check_reversible` and the inverse transforms all call `propagate` (or `invert_jaxpr`, its
entry point for a whole sub-jaxpr); forward evaluation is `_jaxpr.evaluate`. What steers a
walk besides its jaxpr and values is its context (`knowledge.context.WalkContext`), which the
env carries (`env.ctx`): the transform that created it sets it in `seed`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from jaxrev._compat import ClosedJaxpr, Jaxpr, JaxprEqn, Var
from jaxrev._env import Env, Statics, is_unknown
from jaxrev._errors import WAYS_OUT, NotInvertibleError, not_invertible
from jaxrev._evaluate import evaluate
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
    inverse_jvp_rules,
    inverse_rules,
    is_kind,
)

__all__ = [
    "Stuck",
    "Window",
    "Hints",
    "RuleContext",
    "propagate",
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


class Window:
    """A stretch of a jaxpr's equations, for `propagate` (which reads `.eqns`, `.outvars`).

    `cut`: equations before the stretch are left out, so a value the stretch reads may be
    fixed by equations it cannot see; a group step then refuses a group that is singular on
    random stand-ins (it would take such a value as free), and the window widens instead.
    `groups=False`: no group steps (single equations only)."""

    __slots__ = ("eqns", "outvars", "cut", "groups")

    def __init__(self, eqns: Sequence[JaxprEqn], cut: bool = False, groups: bool = True) -> None:
        self.eqns = list(eqns)
        self.outvars: list = []
        self.cut = cut
        self.groups = groups


@dataclass
class Hints:
    """What a loop or branch rule knows of a sub-jaxpr's inputs when it is traced: values
    `static` (numpy) per input position, and `enum`: per input position, its value at each of
    the loop's `length` iterations (a loop counter), for element-level reasoning."""

    static: dict[int, Any] = field(default_factory=dict)
    enum: dict[int, Any] = field(default_factory=dict)
    length: int | None = None

    def key(self) -> tuple:
        """A hashable summary (plans are cached on it)."""

        def k(d: dict) -> tuple:
            return tuple((i, a.shape, a.dtype.str, hash(a.tobytes())) for i, a in sorted(d.items()))

        return (k(self.static), k(self.enum), self.length)


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


_NO_LOSS = object()


def _call_rule(
    eqn: JaxprEqn, env: Env, rule: Callable, out: Any, ins: Sequence[Any], params: dict
) -> Any:
    """`rule(out, *ins, **params)`, with the walk's `ctx` for a `WALKS` rule."""
    if getattr(rule, WALKS, False):
        return rule(out, *ins, ctx=RuleContext(eqn, env), **params)
    return rule(out, *ins, **params)


# --------------------------------------------------------------------------- applying a rule


def _apply_rule(eqn: JaxprEqn, env: Env) -> list[Any] | None:
    env.ctx.count("rules")
    rule = inverse_rules[eqn.primitive]
    outs = [env.read_or_unknown(v) for v in eqn.outvars]
    ins = [env.read_or_unknown(v) for v in eqn.invars]
    out = outs if eqn.primitive.multiple_results else outs[0]
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
    if eqn.primitive in inverse_jvp_rules:
        rec = _with_inverse_jvp(eqn, env, out, ins, rec)
    return rec


def _with_inverse_jvp(eqn: JaxprEqn, env: Env, out: Any, ins: list, rec: list) -> list:
    """Give the recovered inputs the derivative the user's inverse-JVP rule states, instead of
    the derivative of the inverse rule's own code (`out` is a list for multiple results)."""
    ij = inverse_jvp_rules[eqn.primitive]
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
        rec2 = _call_rule(eqn, env, inverse_rules[eqn.primitive], out, filled(known_vals), params)
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


# --------------------------------------------------------------------------- propagation


def propagate(
    jaxpr: Jaxpr | Window,
    env: Env,
    goals: Sequence[Any] | None,
    *,
    allow: Callable[[JaxprEqn], bool] | None = None,
    forward_only: bool = False,
    on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
    soft: bool = False,
) -> list[Stuck]:
    """Fill `env` until every goal is known (or, with `goals=None`, as far as it goes).

    Returns [] on success, else the equations that blocked it. With `soft`, a step that loses
    information is one more blocked equation instead of an error (`reversible` stores what it
    loses and goes on). What steers the walk besides `jaxpr` and `env` is the walk context
    the env carries (`env.ctx`: its settings, record and drift log), which `seed` sets.

    A worklist: an equation is looked at again only when something known about one of its
    variables changed, so tracing stays linear in the program's length."""
    if not isinstance(env.ctx, WalkContext):
        raise TypeError(
            "propagate: the env carries no walk context (`seed(..., ctx=)` or `Env(ctx=)` sets it)"
        )
    eqns = jaxpr.eqns
    used = used_vars(jaxpr)
    near: dict[Var, list[int]] = {}  # variable -> the equations that read or write it
    for i, e in enumerate(eqns):
        for v in (*e.invars, *e.outvars):
            if isinstance(v, Var):
                near.setdefault(v, []).append(i)
    done = [False] * len(eqns)
    # two queues: an equation woken because one of its variables became known whole is looked
    # at first (`front`); one woken by a change of partial knowledge waits (`back`) until
    # nothing is left to complete. Spreading a value known on some elements through earlier
    # steps before the step that completes it has run would intersect the regions of
    # independent predicates, wave after wave (per-step masks: exponential in the steps).
    # Of those, one that can now run forward goes before one that would be inverted: an
    # output a group step already took over is then recomputed, not inverted again
    back = deque(range(len(eqns)))
    front: deque = deque()
    ready: deque = deque()
    queued = [True] * len(eqns)  # waiting in either queue
    in_front = [False] * len(eqns)
    stuck: dict[int, Stuck] = {}
    # what was known around an equation when its rule last failed: a rule (a loop's, say, which
    # traces its body) is only tried again once something about its equation has changed; the
    # same for its element-level rules, whose claim on it is remembered
    tried: dict[int, tuple] = {}
    etried: dict[int, tuple] = {}
    claimed: set[int] = set()

    def wake(vs: Sequence[Any], whole: set) -> None:
        for v in vs:
            for j in near.get(v, ()) if isinstance(v, Var) else ():
                if done[j]:
                    continue
                if v in whole and not in_front[j]:
                    in_front[j] = queued[j] = True
                    (ready if all(env.known(u) for u in eqns[j].invars) else front).append(j)
                elif not queued[j]:
                    queued[j] = True
                    back.append(j)

    while True:
        while ready or front or back:
            if goals is not None and all(env.known(g) for g in goals):
                return []
            if ready or front:
                i = (ready or front).popleft()
                in_front[i] = False
            else:
                i = back.popleft()
            if not queued[i]:
                continue  # looked at from the front queue since
            queued[i] = False
            if done[i]:
                continue
            eqn = eqns[i]
            if allow is not None and not allow(eqn):
                continue
            outs = real_outvars(eqn)
            before = tuple(token(env, v) for v in (*eqn.invars, *outs))
            _visit(
                i,
                eqn,
                env,
                used,
                forward_only,
                soft,
                on_invert,
                stuck,
                tried,
                etried,
                claimed,
                before,
            )
            if all(env.known(v) for v in eqn.invars) and all(env.known(v) for v in outs):
                done[i] = True
                stuck.pop(i, None)
            after = tuple(token(env, v) for v in (*eqn.invars, *outs))
            if after != before:
                changed = [v for v, x, y in zip((*eqn.invars, *outs), before, after) if x != y]
                wake(
                    changed,
                    {
                        v
                        for v, y in zip((*eqn.invars, *outs), after)
                        if y is True and isinstance(v, Var)
                    },
                )
        if goals is not None and all(env.known(g) for g in goals):
            return []
        pending = [i for i in range(len(eqns)) if not done[i]]
        if forward_only or not getattr(jaxpr, "groups", True):
            return list(stuck.values())
        # group steps see only the allowed equations
        gp = pending if allow is None else [i for i in pending if allow(eqns[i])]
        lossy = {i for i, s in stuck.items() if s.lossy}
        cut = getattr(jaxpr, "cut", False)
        if (
            lumps.lump_step(eqns, env, [i for i in gp if i not in lossy], cut)
            or choices.choice_step(eqns, env, gp, soft, _subwalk)
            or nonlinear.eliminate_step(eqns, env, gp, lossy)
            or nonlinear.newton_step(eqns, env, gp, lossy, cut)
        ):
            # a group step may write anywhere: look at everything again, what can run forward
            # first (the values the group took over are recomputed, not inverted again)
            for j in gp:
                if done[j]:
                    continue
                if all(env.known(u) for u in eqns[j].invars):
                    if not in_front[j]:
                        in_front[j] = queued[j] = True
                        ready.append(j)
                elif not queued[j]:
                    queued[j] = True
                    back.append(j)
            continue
        return [s for i, s in sorted(stuck.items())] or [
            Stuck(eqns[i], "its result does not reach the output")
            for i in pending
            if any(not env.known(v) for v in eqns[i].invars)
        ][:1]


def _subwalk(eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var]) -> list[Stuck]:
    """The recursion handed to group steps: a soft walk over a group's equations alone."""
    return propagate(Window(eqns), env, goals, soft=True)


def _visit(
    i: int,
    eqn: JaxprEqn,
    env: Env,
    used: set,
    forward_only: bool,
    soft: bool,
    on_invert: Callable | None,
    stuck: dict[int, Stuck],
    tried: dict,
    etried: dict,
    claimed: set[int],
    seen: tuple,
) -> None:
    """One look at equation `i`: evaluate it, or propagate what is known of some elements
    around it, or apply its inverse rule."""
    if all(env.known(v) for v in eqn.invars):
        evaluate((eqn,), env, used=used)
        return
    outs = real_outvars(eqn)
    before = _unknown_regions(eqn, env) if records.active(env) is not None else None
    if etried.get(i) != seen:
        etried[i] = seen
        claimed.discard(i)
        if _near_elements(eqn, env) and _element_step(
            eqn, env, forward_only, soft, stuck, claimed, i
        ):
            if before is not None:
                before = _note(eqn, env, before)
            stuck.pop(i, None)
            if on_invert is not None:
                on_invert(eqn, [v for v in eqn.invars if env.known(v)])
        if all(env.known(v) for v in eqn.invars):
            return
    if forward_only or not any(env.known(v) for v in outs):
        return
    if i in claimed:
        loss = env.losses.get(eqn, _NO_LOSS)
        if i not in stuck and loss is not None:  # None: its output came forward
            stuck[i] = (
                Stuck(
                    eqn,
                    "only some elements of its inputs follow from its output "
                    "(the others are overwritten or selected away)",
                )
                if loss is _NO_LOSS
                else Stuck(eqn, loss.reason, hint=loss.hint, lossy=True, singular=loss.singular)
            )
        return
    if eqn.primitive not in inverse_rules:
        stuck[i] = Stuck(eqn, "there is no inverse rule for it", no_rule=True)
        return
    seen = tuple(token(env, v) for v in (*eqn.invars, *outs))
    if i in stuck and tried.get(i) == seen:
        return
    tried[i] = seen
    try:
        rec = _apply_rule(eqn, env)
    except NeedMore as e:
        stuck[i] = Stuck(eqn, e.reason, e.inner, e.hint)
        return
    except Lossy as e:
        # what this step loses may still be known by another route (a value computed forward
        # from elements a `where` kept): an error only if the walk ends without it
        stuck[i] = Stuck(eqn, e.reason, hint=e.hint, lossy=True, singular=e.singular)
        return
    except NotInvertibleError as e:
        if not soft:
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
        if on_invert is not None:
            on_invert(eqn, wrote)
    elif i not in stuck:
        stuck[i] = Stuck(
            eqn,
            "its unknown inputs cannot be recovered from what is known "
            "(more than one of them is unknown)",
        )


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


def _element_step(
    eqn: JaxprEqn,
    env: Env,
    forward_only: bool,
    soft: bool,
    stuck: dict[int, Stuck],
    claimed: set[int],
    i: int,
) -> bool:
    """Element-level propagation around `eqn`; whether it learned something. Its element
    rules may claim the equation (then its ordinary inverse rule is not tried)."""
    env.ctx.count("elements")
    learned = elements.forward(eqn, env)
    if forward_only:
        return learned
    try:
        claim = elements.backward(eqn, env)
    except Lossy as e:  # an error only if the walk ends without what it loses
        stuck[i] = Stuck(eqn, e.reason, hint=e.hint, lossy=True, singular=e.singular)
        claim = False
    if claim is not None:
        claimed.add(i)
    return bool(claim) or learned


def _near_elements(eqn: JaxprEqn, env: Env) -> bool:
    """Whether element-level rules may say something about `eqn`: it has some of them, or a
    partly known operand or result, or it is a structural step with no inverse rule."""
    p = eqn.primitive
    if p in element_rules:
        return True
    if env.part and any(isinstance(v, Var) and v in env.part for v in (*eqn.invars, *eqn.outvars)):
        return True
    return (
        is_kind(p, STRUCTURAL)
        and p not in inverse_rules
        and any(env.known(v) for v in real_outvars(eqn))
    )


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
) -> list[Any]:
    """Recover the `Unknown` entries of `ins` from the known `outs` (`Unknown` where not known);
    None for the inputs that were known. Raises `NotInvertibleError` where it cannot. `ctx`:
    the rule context of the loop's or branch's rule that walks its body (the walk inherits its
    walk's context; where that walk is recorded, it is recorded as the equation's child)."""
    jaxpr, env, goals = seed(closed, ins, outs, hints, ctx=None)
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
    stuck = propagate(jaxpr, env, goals)
    attach()
    missing = [
        i for i, (v, x) in enumerate(zip(jaxpr.invars, ins)) if is_unknown(x) and not env.known(v)
    ]
    if missing:
        raise_stuck(stuck, f"input(s) {missing}" if blame(stuck) is None else "", ctx.walk.who)
    return [env.read(v) if is_unknown(x) else None for v, x in zip(jaxpr.invars, ins)]
