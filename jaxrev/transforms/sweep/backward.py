"""`reversible`'s backward sweep and its plans: the walk shared by the top-level program, loop
bodies and branches.

The sweep walks a jaxpr's equations last to first: it rebuilds each equation's inputs from its
outputs with the walker (`propagate`, over the inverse rules) and pulls the cotangent through
the equation. An equation whose inverse is a program of its own (a loop, a branch) is swept by
its rule in `sweep_rules`. What cannot be rebuilt (a relu's input, an overwritten carry, a
`lax.cond`'s branch index, a `lax.while_loop`'s trip count) is found once per jaxpr by a
*planning* sweep on abstract values (a `Plan`), and the forward run (`forward_with_residuals`,
with the loops' `forward_rules`) stores exactly those values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._cache import memo
from jaxrev._compat import (
    ClosedJaxpr,
    DropVar,
    JaxprEqn,
    Var,
    bind_eqn,
    is_symbolic_zero,
    zeros_of,
)
from jaxrev._compat import (
    sds as _sds,
)
from jaxrev._env import Env, fit_to_aval
from jaxrev._errors import not_invertible
from jaxrev._graph import is_float, is_var
from jaxrev._prepare import prepare
from jaxrev.transforms.custom import recompute_p, store_p
from jaxrev.transforms.knowledge.context import WalkContext
from jaxrev.transforms.propagation.walker import Hints, Stuck, Window, blame, propagate, statics_for
from jaxrev.transforms.registry import forward_rules, sweep_rules
from jaxrev.transforms.sweep import drift, sums
from jaxrev.transforms.sweep.dial import Dial
from jaxrev.transforms.sweep.params import ParamOnly, tie_of

__all__ = [
    "Plan",
    "LoopPlan",
    "Residuals",
    "plan_for",
    "top_plan",
    "res_avals",
    "loop_avals",
    "branch_slices",
    "seed_env",
    "walk",
    "known_or_rebuilt",
    "outs_known",
    "BodyWalk",
    "BodyStep",
    "LoopEnd",
    "loop_activity",
    "loop_cts_in",
    "loop_cts_out",
    "forward_with_residuals",
    "n_checkpoints",
    "DEFAULT_DIAL",
    "acc",
    "get_ct",
    "zero_ct",
    "is_float",
    "sds",
]


DEFAULT_DIAL = Dial()


def sds(aval: Any) -> jax.ShapeDtypeStruct:
    """A stand-in for tracing a value of `aval`, typed as it is (inside `shard_map`, its vma)."""
    return _sds(aval)


def zero_ct(aval: Any) -> Any:
    if is_float(aval):
        return zeros_of(aval)
    return np.zeros(aval.shape, jax.dtypes.float0)


def acc(ctenv: dict, v: Any, ct: Any) -> None:
    """Add `ct` to the cotangent of `v` (float variables only)."""
    if ct is None or not is_var(v) or not is_float(v.aval):
        return
    if getattr(ct, "dtype", None) == jax.dtypes.float0 or is_symbolic_zero(ct):
        return
    ct = jnp.asarray(ct, v.aval.dtype) if jnp.result_type(ct) != v.aval.dtype else ct
    # (large ones one at a time: XLA:CPU fuses a chain of sums into one holding every term;
    # how many terms each sum has had is kept under a key no variable is)
    terms = ctenv.setdefault(_TERMS, {})
    terms[v] = terms.get(v, 0) + 1
    ctenv[v] = sums.add(ctenv[v], ct, terms[v]) if v in ctenv else ct


_TERMS = object()
"""The key of a cotangent environment's term counts (`acc`)."""


def get_ct(ctenv: dict, v: Any) -> Any:
    return ctenv[v] if v in ctenv else zero_ct(v.aval)


# --------------------------------------------------------------------------- plans


@dataclass(eq=False)
class Plan:
    """What the backward walk of one jaxpr cannot rebuild, so the forward run stores it."""

    closed: ClosedJaxpr  # the jaxpr walked (calls inlined)
    store: list = field(default_factory=list)  # Vars stored once per run of it
    why: dict = field(default_factory=dict)  # Var -> equation that forced it
    loops: dict = field(default_factory=dict)  # eqn index -> LoopPlan
    decisions: dict = field(default_factory=dict)  # missing Vars -> Vars stored for them
    labels: dict = field(default_factory=dict)  # Var -> what it is, for the report
    hints: Any = None  # what its inputs are at trace time
    dial: Dial = DEFAULT_DIAL  # the reversible call's settings
    params: Any = None  # its parameter-only values


@dataclass(eq=False)
class LoopPlan:
    """Residuals of a loop or cond: "scan" (the body's, stacked per iteration), "while" (the trip
    count) or "cond" (every branch's, side by side; the branch not taken leaves zeros)."""

    kind: str
    body: Plan | None
    length: int | None = None
    branches: list | None = None
    count_shape: tuple = ()  # a while loop's trip count: one per element of a vmapped loop
    every: int | None = None  # a checkpoint of the carry every `every` iterations (the dial)
    carry: tuple = ()  # the carry's avals, when checkpointed
    unread: tuple = ()  # per carry: read by nothing the backward run computes (stored once)
    max_steps: int | None = None  # a while loop's bound: its buffers' length


def n_checkpoints(loop_plan: LoopPlan) -> int:
    """How many checkpoints of its carry a loop stores: one per segment of `every` iterations."""
    steps = loop_plan.length if loop_plan.kind == "scan" else loop_plan.max_steps
    return 0 if loop_plan.every is None else -(-steps // loop_plan.every)


def branch_slices(loop_plan: LoopPlan) -> list[tuple[int, int]]:
    """Where each branch's residuals lie among a cond's: (start, stop) per branch."""
    out, start = [], 0
    for branch in loop_plan.branches:
        stop = start + len(res_avals(branch))
        out.append((start, stop))
        start = stop
    return out


def loop_avals(loop_plan: LoopPlan) -> list[jax.ShapeDtypeStruct]:
    """A loop's residuals: (a while loop's trip count), the body's per iteration, then the
    checkpoints."""
    if loop_plan.kind == "cond":
        out = []
        for branch in loop_plan.branches:
            out += res_avals(branch)
        return out
    # an unread carry (`_graph.unread_carries`) keeps only its value at the loop's start
    unread = loop_plan.unread or (False,) * len(loop_plan.carry)
    ckpts = [
        _sds(a, (1 if u else n_checkpoints(loop_plan), *a.shape))
        for a, u in zip(loop_plan.carry, unread)
    ]
    body = res_avals(loop_plan.body)
    if loop_plan.kind == "while":
        count = [jax.ShapeDtypeStruct(loop_plan.count_shape, jnp.int32)]
        if loop_plan.max_steps is None:
            return count
        return count + [_sds(a, (loop_plan.max_steps, *a.shape)) for a in body] + ckpts
    return [_sds(a, (loop_plan.length, *a.shape)) for a in body] + ckpts


def res_avals(plan: Plan) -> list[jax.ShapeDtypeStruct]:
    """The residuals of one run of `plan`'s jaxpr: its stored values, then its loops'."""
    out = [sds(v.aval) for v in plan.store]
    for i in sorted(plan.loops):
        out += loop_avals(plan.loops[i])
    return out


class Residuals:
    """The residuals of one run of a plan's jaxpr. Without values it is the planning walk's:
    it records what is asked for and answers with placeholders."""

    def __init__(self, plan: Plan, values: Sequence[Any] | None = None) -> None:
        self.plan = plan
        self.planning = values is None
        if not self.planning:
            values = list(values)
            start = len(plan.store)
            self.vals = dict(zip(plan.store, values[:start]))
            self.loop_vals = {}
            for i in sorted(plan.loops):
                stop = start + len(loop_avals(plan.loops[i]))
                self.loop_vals[i] = values[start:stop]
                start = stop

    def store(self, v: Var, eqn: JaxprEqn | None, label: str | None = None) -> Any:
        if self.planning:
            if v not in self.plan.why:
                self.plan.store.append(v)
                self.plan.why[v] = eqn
                if label:
                    self.plan.labels[v] = label
            return zeros_of(v.aval)
        if v not in self.vals:  # the planning walk and this one disagree: a jaxrev bug
            raise AssertionError(f"jaxrev internal error: no stored value for {v}")
        return self.vals[v]

    def loop(self, i: int, loop_plan: LoopPlan) -> list[Any]:
        """The residuals of equation i's loop (the planning walk: records its plan)."""
        if self.planning:
            self.plan.loops[i] = loop_plan
            return [zeros_of(a) for a in loop_avals(loop_plan)]
        return self.loop_vals[i]


_MAX_PLANS = 512


def seed_env(
    plan: Plan,
    known_in: Sequence[bool],
    ins: Sequence[Any],
    known_out: Sequence[bool],
    outs: Sequence[Any],
    ctx: WalkContext,
) -> Env:
    """An env holding `plan`'s consts, its known inputs and its known outputs, for a walk with
    context `ctx`."""
    jaxpr = plan.closed.jaxpr
    env = Env(info=statics_for(jaxpr, plan.closed.consts, plan.hints), ctx=ctx)
    for v, const in zip(jaxpr.constvars, plan.closed.consts):
        env.write(v, const)
    given = iter(ins)
    for v, known in zip(jaxpr.invars, known_in):
        if known:
            env.write(v, next(given))
    given = iter(outs)
    for v, known in zip(jaxpr.outvars, known_out):
        if known:
            val = next(given)
            if is_var(v):
                env.write(v, val)
    return env


def plan_for(
    closed: ClosedJaxpr,
    known_in: tuple[bool, ...],
    known_out: tuple[bool, ...],
    goal_in: tuple[bool, ...],
    hints: Hints | None = None,
    dial: Dial = DEFAULT_DIAL,
) -> Plan:
    """Plan the backward walk of `closed` given which inputs and outputs it knows and which
    inputs it must rebuild (a loop body's carry), and what its inputs are at trace time
    (`hints`: a loop counter at every iteration), under the call's `dial`; cached per jaxpr."""
    key = (id(closed), known_in, known_out, goal_in, hints.key() if hints else None, dial)
    plans = memo("sweep.plans", _MAX_PLANS)
    hit = plans.get(key)
    if hit is not None and hit[0] is closed:
        return hit[1]
    plan = Plan(prepare(closed), hints=hints, dial=dial)
    jaxpr = plan.closed.jaxpr
    plan.params = ParamOnly(jaxpr, known_in)
    ins = [sds(v.aval) for v, known in zip(jaxpr.invars, known_in) if known]
    outs = [sds(v.aval) for v, known in zip(jaxpr.outvars, known_out) if known]
    goals = [v for v, goal in zip(jaxpr.invars, goal_in) if goal]

    def dry(ins, outs):
        # a context of its own, with no drift log: the planning walk (on placeholders, traced
        # apart) may run while a backward run is live (a `reversible` call inside another's
        # loop), and nothing of it may reach that run's log
        env = seed_env(plan, known_in, ins, known_out, outs, WalkContext(dial.walk))
        walk(plan, env, None, set(), Residuals(plan), goals)
        return []

    jax.make_jaxpr(dry)(ins, outs)
    plans.put(key, [], (closed, plan))
    return plan


def top_plan(jaxpr: ClosedJaxpr, state: tuple[bool, ...], dial: Dial = DEFAULT_DIAL) -> Plan:
    """The plan of a `reversible` call: parameters and outputs known, the state rebuilt."""
    n_out = len(jaxpr.jaxpr.outvars)
    return plan_for(
        jaxpr, tuple(not s for s in state), (True,) * n_out, (False,) * len(state), dial=dial
    )


# --------------------------------------------------------------------------- the backward walk


def _activity(jaxpr: Any, active_in: set) -> set:
    """The variables a cotangent reaches: the float outputs of equations that read an active
    variable, from `active_in`."""
    active = set(active_in)
    for eqn in jaxpr.eqns:
        if any(is_var(v) and v in active for v in eqn.invars):
            active.update(o for o in eqn.outvars if is_var(o) and is_float(o.aval))
    return active


def _rebuild(plan: Plan, i: int, hi: int, env: Env, goals: list, res: Residuals) -> None:
    """Make `goals` known from `eqns[:hi]` (inverting the nearest equations first, widening the
    window as needed); what cannot be rebuilt is a residual, blamed on equation `i`."""
    eqns = plan.closed.jaxpr.eqns
    stuck: list[Stuck] = []
    # parameter-only values are computed forward (`ParamOnly.need`), tied to this step
    tie = tie_of(
        [env.read(o) for o in eqns[i].outvars if is_var(o) and env.known(o)]
        if 0 <= i < len(eqns)
        else []
    )
    plan.params.need(env, goals, tie)
    # single steps first, over ever wider windows: a group seen through a narrow window may
    # read values that equations before it compute from known ones (a Runge–Kutta stage from
    # the step's known end), and solving for those as unknowns would be wrong
    for groups in (False, True):
        width = 1
        while hi > 0:
            lo = max(0, hi - width)
            plan.params.window(env, eqns[lo:hi], tie)
            stuck = propagate(Window(eqns[lo:hi]), env, goals, soft=True, cut=lo > 0, groups=groups)
            if all(env.known(g) for g in goals) or lo == 0:
                break
            width *= 4
        if all(env.known(g) for g in goals):
            break
    culprit = eqns[i] if 0 <= i < len(eqns) else None
    missing = tuple(g for g in goals if not env.known(g))
    if not missing:
        return
    # a primitive without an inverse rule is not a lossy step: say which rule is missing
    blamed = blame(stuck)
    label = (
        f"value stored: no inverse rule for `{blamed.eqn.primitive.name}`"
        if blamed is not None and blamed.no_rule
        else None
    )
    if res.planning:
        chosen = _choose_store(eqns[:hi], env, list(missing), plan.params)
    else:
        chosen = res.plan.decisions[missing]
    for v in chosen:
        env.write(v, res.store(v, culprit, label))
    if any(not env.known(g) for g in missing):
        propagate(Window(eqns[:hi]), env, list(missing), soft=True)
    left = [g for g in missing if not env.known(g)]
    for g in left:
        env.write(g, res.store(g, culprit, label))
    if res.planning:
        res.plan.decisions[missing] = [*chosen, *left]


_MAX_STORE_CANDIDATES = 16


def _choose_store(eqns: Sequence[JaxprEqn], env: Env, missing: list, params: ParamOnly) -> list:
    """What to store so that `missing` can be rebuilt, in the fewest bytes: a single value from
    which the rest follows (a loop body's overwritten carry, say), else the cheaper of the
    missing values themselves and the unknown inputs they are computed from."""
    roots, ancestors = _unknown_ancestry(eqns, env, missing)
    # values marked with jr.recompute are never candidates: their sources are stored instead;
    # nor are parameter-only values, which are recomputed
    no_store = set(params.made.keys())
    for eqn in eqns:
        if eqn.primitive is recompute_p:
            no_store.update([*eqn.invars, *eqn.outvars])
    candidates = sorted(
        (
            v
            for v in dict.fromkeys([*missing, *roots, *ancestors[:_MAX_STORE_CANDIDATES]])
            if v not in no_store
        ),
        key=lambda v: _nbytes([v]),
    )
    best = missing if roots is None or _nbytes(missing) <= _nbytes(roots) else roots
    if roots is not None and any(m in no_store for m in missing):
        best = roots
    for candidate in candidates:
        if _nbytes([candidate]) >= _nbytes(best):
            break
        trial = env.copy()
        trial.write(candidate, zeros_of(candidate.aval))
        propagate(Window(eqns), trial, missing, soft=True)
        if all(trial.known(g) for g in missing):
            return [candidate]
    return list(best)


def _nbytes(vs: Sequence[Var]) -> int:
    return int(sum(np.prod(v.aval.shape, dtype=np.int64) * v.aval.dtype.itemsize for v in vs))


def _producers(eqns: Sequence[JaxprEqn]) -> dict:
    """Each output variable of `eqns` -> the equation that computes it."""
    producer = {}
    for eqn in eqns:
        producer.update((o, eqn) for o in eqn.outvars if is_var(o))
    return producer


def _unknown_ancestry(
    eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var]
) -> tuple[list | None, list]:
    """The unknown jaxpr inputs that `goals` are computed from, and the unknown values in
    between, nearest first."""
    producer = _producers(eqns)
    roots: dict = {}
    between: list = []
    seen: set = set(goals)
    queue = list(goals)
    while queue:
        v = queue.pop(0)
        eqn = producer.get(v)
        if eqn is None:
            roots[v] = None
            continue
        if v not in goals:
            between.append(v)
        for u in eqn.invars:
            if is_var(u) and not env.known(u) and u not in seen:
                seen.add(u)
                queue.append(u)
    return list(roots), between


def _vjp_eqn(eqn: JaxprEqn, env: Env, ctenv: dict | None, active: set) -> None:
    """Pull the cotangents of `eqn`'s outputs (taken out of `ctenv`) back to its active
    inputs, by JAX's VJP of the equation at its inputs' values."""
    if ctenv is None:
        return
    cts = [ctenv.pop(o, None) if is_var(o) else None for o in eqn.outvars]
    if all(ct is None for ct in cts):
        return
    positions = [k for k, v in enumerate(eqn.invars) if is_var(v) and v in active]
    if not positions:
        return
    invals = [env.read(v) for v in eqn.invars]

    def bind_at(*active_vals):
        ins = list(invals)
        for k, x in zip(positions, active_vals):
            ins[k] = x
        return bind_eqn(eqn, ins)

    _, pull = jax.vjp(bind_at, *[invals[k] for k in positions])
    out_cts = [ct if ct is not None else zero_ct(o.aval) for ct, o in zip(cts, eqn.outvars)]
    for k, ct in zip(positions, pull(out_cts)):
        acc(ctenv, eqn.invars[k], ct)


def _differentiated_loop(eqn: JaxprEqn, ctenv: dict | None, active: set, res: Residuals) -> bool:
    """Whether a loop computed from known inputs is swept backwards for its derivative. The
    planning walk says yes to any loop with float inputs (it cannot know which will be
    differentiated), so that the forward run stores what the sweep needs (a trip count)."""
    floats = [v for v in eqn.invars if is_var(v) and jnp.issubdtype(v.aval.dtype, jnp.inexact)]
    if res.planning:
        return bool(floats)
    return (
        ctenv is not None
        and any(v in active for v in floats)
        and any(is_var(o) and o in ctenv for o in eqn.outvars)
    )


def _ct_tie(ctenv: dict | None, eqn: JaxprEqn) -> Any:
    """A tie (`params.tie_of`) from the cotangents of `eqn`'s outputs."""
    return tie_of([ctenv.get(o) for o in eqn.outvars if is_var(o)] if ctenv is not None else [])


def walk(
    plan: Plan, env: Env, ctenv: dict | None, active_in: set, res: Residuals, goals: Sequence[Var]
) -> None:
    """Walk `plan`'s jaxpr last equation first: rebuild each equation's inputs from its outputs,
    then (when `ctenv` is given) pull the cotangents of its outputs back to its inputs."""
    jaxpr = plan.closed.jaxpr
    eqns = jaxpr.eqns
    active = _activity(jaxpr, active_in) if ctenv is not None else set()
    # values computed from known inputs alone (parameters, weights) are parameter-only: never
    # stored, computed forward from the parameters at each step that reads them (params.py)
    params = plan.params
    forward = params.eqns
    for eqn in eqns:  # values the user asked to keep (jr.store) are read, not rebuilt: the
        if eqn.primitive is not store_p:  # kept value replaces a rebuilt one (a loop carry),
            continue  # resetting its drift
        out = eqn.outvars[0]
        if is_var(out):
            env.vals[out] = fit_to_aval(res.store(out, eqn, "value kept by jr.store"), out.aval)
    for i in reversed(range(len(eqns))):
        eqn = eqns[i]
        sweep = sweep_rules.get(eqn.primitive)
        if i not in forward:
            params.need(
                env,
                eqn.invars,
                tie_of([env.read(o) for o in eqn.outvars if is_var(o) and env.known(o)]),
            )
            if sweep is not None:
                if not any(is_var(o) and is_float(o.aval) for o in eqn.outvars):
                    # no cotangent flows through it (a bin search): where its outputs are
                    # needed they are rebuilt, by running it forward once its inputs are
                    continue
                sweep(plan, i, env, ctenv, active, res)
                continue
            unknown = [v for v in eqn.invars if is_var(v) and not env.known(v)]
            if unknown:
                _rebuild(plan, i, i + 1, env, unknown, res)
        elif sweep is not None and _differentiated_loop(eqn, ctenv, active, res):
            # a loop over parameters alone is computed forward, but its derivative still runs
            # it backwards: a plain VJP would keep its tape (or refuse a while loop)
            params.need(env, [*eqn.invars, *eqn.outvars], _ct_tie(ctenv, eqn))
            sweep(plan, i, env, ctenv, active, res)
            continue
        elif ctenv is not None and any(is_var(o) and o in ctenv for o in eqn.outvars):
            params.need(env, eqn.invars, _ct_tie(ctenv, eqn))
        _vjp_eqn(eqn, env, ctenv, active)
    missing = [g for g in goals if not env.known(g)]
    if missing:
        _rebuild(plan, len(eqns) - 1, len(eqns), env, missing, res)


# --------------------------------------------------------------------------- loop helpers


def known_or_rebuilt(
    plan: Plan, i: int, env: Env, vs: Sequence[Any], res: Residuals, through: bool = False
) -> None:
    """Inputs a loop needs before it can run backwards (its constants): rebuilt from the
    equations before it (and, `through`, from the loop's own outputs), else stored."""
    unknown = [v for v in vs if is_var(v) and not env.known(v)]
    if unknown:
        _rebuild(plan, i, i + 1 if through else i, env, unknown, res)


def outs_known(plan: Plan, i: int, env: Env, outs: Sequence[Any], res: Residuals) -> None:
    """A loop's final values, where the output does not use them: stored."""
    eqn = plan.closed.jaxpr.eqns[i]
    for v in outs:
        if isinstance(v, DropVar):
            raise not_invertible(
                eqn,
                "the loop's final carry is discarded, so it cannot be run backwards",
                "Ways out: return the final carry.",
                who=env.ctx.who,
            )
        if not env.known(v):  # a final carry the output does not use (a loop counter, say)
            env.write(v, res.store(v, eqn, "final loop carry that the output discards"))


@dataclass
class BodyStep:
    """What one backward iteration of a loop body gives back."""

    carry: list  # the carry before the iteration, rebuilt
    carry_ct: list | None  # its cotangent (None entries for inactive carries)
    xs: list  # the iteration's unknown `xs`, rebuilt
    xs_ct: list | None  # the cotangents of the active `xs`
    consts_ct: list | None  # this iteration's share of the active constants' cotangents
    drift: tuple | None  # the worst (ratio, site) of the loops inside the body (None: none)


@dataclass(eq=False)
class BodyWalk:
    """One backward iteration of a loop body: rebuild the carry (and unknown `xs`) from the
    outputs, and pull the cotangents back. Shared by scan, while loops and conds. The body's
    inputs are `nconsts` constants, `ncarry` carries, then `xs`; its outputs the carries, then
    `ys`."""

    plan: Plan  # the body's plan
    nconsts: int
    ncarry: int
    xs_known: Sequence[bool]  # which `xs` are known (the others are rebuilt)
    ys_known: Sequence[bool]  # which `ys` are known
    consts: Sequence[Any]  # the constants' values
    active: Sequence[bool] | None  # which inputs carry cotangents (None: none are pulled)
    ys_ct_given: Sequence[bool]  # which `ys` come with a cotangent
    ctx: WalkContext  # the loop's walk's: its drift log collects the body's comparisons
    carry_in: list = field(init=False)  # the body's carry inputs (variables)
    xs_in: list = field(init=False)  # its `xs` inputs
    carry_out: list = field(init=False)  # its carry outputs
    ys_out: list = field(init=False)  # its `ys` outputs

    def __post_init__(self) -> None:
        self.xs_known, self.ys_known = list(self.xs_known), list(self.ys_known)
        self.consts, self.ys_ct_given = list(self.consts), list(self.ys_ct_given)
        jaxpr = self.plan.closed.jaxpr
        self.carry_in = jaxpr.invars[self.nconsts : self.nconsts + self.ncarry]
        self.xs_in = jaxpr.invars[self.nconsts + self.ncarry :]
        self.carry_out, self.ys_out = jaxpr.outvars[: self.ncarry], jaxpr.outvars[self.ncarry :]

    def __call__(
        self,
        carry: Sequence[Any],
        carry_ct: Sequence[Any] | None,
        ys: Sequence[Any],
        ys_ct: Sequence[Any],
        xs: Sequence[Any],
        res: Sequence[Any],
    ) -> BodyStep:
        """The iteration whose outputs are `carry` (with its cotangent `carry_ct`) and the
        known `ys` (the cotangents `ys_ct` of those that have one), its known inputs `xs`,
        its residuals `res`."""
        plan, nconsts, ncarry = self.plan, self.nconsts, self.ncarry
        jaxpr = plan.closed.jaxpr
        known_in = [True] * nconsts + [False] * ncarry + self.xs_known
        known_out = [True] * ncarry + self.ys_known
        env = seed_env(plan, known_in, [*self.consts, *xs], known_out, [*carry, *ys], self.ctx)
        ctenv = None
        active: set = set()
        if self.active is not None:
            ctenv = {}
            active = {v for v, a in zip(jaxpr.invars, self.active) if a}
            for v, ct in zip(self.carry_out, carry_ct):
                if ct is not None:
                    acc(ctenv, v, ct)
            ys_with_ct = [v for v, given in zip(self.ys_out, self.ys_ct_given) if given]
            for v, ct in zip(ys_with_ct, ys_ct):
                acc(ctenv, v, ct)
        xs_unknown = [v for v, k in zip(self.xs_in, self.xs_known) if not k]
        goals = [*self.carry_in, *xs_unknown]
        with drift.scope(self.ctx.drift) as inside:
            walk(plan, env, ctenv, active, Residuals(plan, res), goals)
        carry_before = [env.read(v) for v in self.carry_in]
        xs_rebuilt = [env.read(v) for v in xs_unknown]
        if ctenv is None:
            return BodyStep(carry_before, None, xs_rebuilt, None, None, inside.worst())
        consts_active = self.active[:nconsts]
        carry_active = self.active[nconsts : nconsts + ncarry]
        xs_active = self.active[nconsts + ncarry :]
        return BodyStep(
            carry_before,
            [get_ct(ctenv, v) if a else None for v, a in zip(self.carry_in, carry_active)],
            xs_rebuilt,
            [get_ct(ctenv, v) for v, a in zip(self.xs_in, xs_active) if a],
            [get_ct(ctenv, v) for v, a in zip(jaxpr.invars[:nconsts], consts_active) if a],
            inside.worst(),
        )


def loop_activity(
    ins: Sequence[Any], active: set, nconsts: int, ncarry: int, body: ClosedJaxpr
) -> list[bool]:
    """Which body inputs carry cotangents: constants and xs as outside; the carry wherever
    anything entering the loop is active (a loop mixes them)."""
    any_active = any(is_var(v) and v in active for v in ins)
    out = []
    for k, (v, body_v) in enumerate(zip(ins, body.jaxpr.invars)):
        if nconsts <= k < nconsts + ncarry:
            out.append(any_active and is_float(body_v.aval))
        else:
            out.append(is_var(v) and v in active)
    return out


def loop_cts_in(
    ctenv: dict | None,
    carry_out: Sequence[Any],
    body: ClosedJaxpr,
    nconsts: int,
    active: Sequence[bool] | None,
) -> tuple[list | None, list | None]:
    """The backward loop's starting cotangents: the final carry's (`carry_out`: the loop's
    carry outputs, their cotangents taken out of `ctenv`) and zeros for the active constants;
    (None, None) when no cotangents are pulled. `active`: `loop_activity`'s."""
    if ctenv is None:
        return None, None
    carry_active = active[nconsts : nconsts + len(carry_out)]
    carry_ct = [(get_ct(ctenv, v) if a else None) for v, a in zip(carry_out, carry_active)]
    for v in carry_out:
        ctenv.pop(v, None)
    consts_in = body.jaxpr.invars[:nconsts]
    consts_ct = [zero_ct(v.aval) for v, a in zip(consts_in, active[:nconsts]) if a]
    return carry_ct, consts_ct


@dataclass
class LoopEnd:
    """What a backward loop rebuilt and pulled back, to write at the loop's inputs."""

    init: Sequence[Any]  # the loop's carry inputs (variables)
    carry: Sequence[Any]  # their rebuilt values
    carry_ct: Sequence[Any] | None
    consts: Sequence[Any]  # the loop's constants (variables)
    consts_ct: Sequence[Any] | None


def loop_cts_out(
    env: Env, ctenv: dict | None, end: LoopEnd, active: Sequence[bool] | None, nconsts: int
) -> None:
    """Write what the backward loop rebuilt and pulled back: the starting carry, its
    cotangent, and the constants' accumulated cotangents."""
    for v, val in zip(end.init, end.carry):
        if is_var(v) and not env.known(v):  # a known start (a parameter) stays exact
            env.write(v, val)
    if ctenv is None:
        return
    for v, ct in zip(end.init, end.carry_ct):
        acc(ctenv, v, ct)
    active_consts = [v for v, a in zip(end.consts, active[:nconsts]) if a]
    for v, ct in zip(active_consts, end.consts_ct):
        acc(ctenv, v, ct)


# --------------------------------------------------------------------------- forward run


def forward_with_residuals(plan: Plan, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Run `plan`'s jaxpr forward; also return its residuals (in `res_avals(plan)` order). Loops
    and branches with residuals of their own run by their `forward_rules`; parameter-only
    values are computed where they are read (`ParamOnly.run`)."""
    jaxpr = plan.closed.jaxpr
    env = Env()
    for v, c in zip(jaxpr.constvars, plan.closed.consts):
        env.write(v, c)
    for v, a in zip(jaxpr.invars, args):
        env.write(v, a)
    loop_res: dict[int, list] = {}  # equation index -> its loop's residuals

    def rule(i: int, eqn: JaxprEqn, ins: list) -> list | None:
        loop_plan = plan.loops.get(i)
        if loop_plan is None:
            return None
        outs, loop_res[i] = forward_rules[eqn.primitive](eqn, loop_plan, ins)
        return outs

    plan.params.run(env, rule, keep=plan.loops.keys())
    plan.params.need(env, [*jaxpr.outvars, *plan.store], None)
    res = [env.read(v) for v in plan.store]
    for i in sorted(plan.loops):
        res += loop_res[i]
    return [env.read(v) for v in jaxpr.outvars], res
