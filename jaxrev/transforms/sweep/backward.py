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
from jaxrev._graph import is_var
from jaxrev._prepare import prepare
from jaxrev.transforms.custom import recompute_p, store_p
from jaxrev.transforms.knowledge.context import WalkContext
from jaxrev.transforms.propagation.walker import Hints, Stuck, Window, blame, propagate, statics_for
from jaxrev.transforms.registry import forward_rules, sweep_rules
from jaxrev.transforms.sweep import drift
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


def is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


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
    ctenv[v] = ctenv[v] + ct if v in ctenv else ct


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
    max_steps: int | None = None  # a while loop's bound: its buffers' length


def n_checkpoints(lp: LoopPlan) -> int:
    n = lp.length if lp.kind == "scan" else lp.max_steps
    return 0 if lp.every is None else -(-n // lp.every)


def branch_slices(lp: LoopPlan) -> list[tuple[int, int]]:
    out, k = [], 0
    for bp in lp.branches:
        n = len(res_avals(bp))
        out.append((k, k + n))
        k += n
    return out


def loop_avals(lp: LoopPlan) -> list[jax.ShapeDtypeStruct]:
    """A loop's residuals: (a while loop's trip count), the body's per iteration, then the
    checkpoints."""
    if lp.kind == "cond":
        return [a for bp in lp.branches for a in res_avals(bp)]
    ck = [_sds(a, (n_checkpoints(lp), *a.shape)) for a in lp.carry]
    if lp.kind == "while":
        n = [jax.ShapeDtypeStruct(lp.count_shape, jnp.int32)]
        if lp.max_steps is None:
            return n
        return n + [_sds(a, (lp.max_steps, *a.shape)) for a in res_avals(lp.body)] + ck
    return [_sds(a, (lp.length, *a.shape)) for a in res_avals(lp.body)] + ck


def res_avals(P: Plan) -> list[jax.ShapeDtypeStruct]:
    out = [sds(v.aval) for v in P.store]
    for i in sorted(P.loops):
        out += loop_avals(P.loops[i])
    return out


class Residuals:
    """The residuals of one run of a plan's jaxpr. Without values it is the planning walk's:
    it records what is asked for and answers with placeholders."""

    def __init__(self, P: Plan, values: Sequence[Any] | None = None) -> None:
        self.P = P
        self.planning = values is None
        if not self.planning:
            values = list(values)
            n = len(P.store)
            self.vals = dict(zip(P.store, values[:n]))
            self.loop_vals = {}
            k = n
            for i in sorted(P.loops):
                m = len(loop_avals(P.loops[i]))
                self.loop_vals[i] = values[k : k + m]
                k += m

    def store(self, v: Var, eqn: JaxprEqn | None, label: str | None = None) -> Any:
        if self.planning:
            if v not in self.P.why:
                self.P.store.append(v)
                self.P.why[v] = eqn
                if label:
                    self.P.labels[v] = label
            return zeros_of(v.aval)
        if v not in self.vals:  # the planning walk and this one disagree: a jaxrev bug
            raise AssertionError(f"jaxrev internal error: no stored value for {v}")
        return self.vals[v]

    def loop(self, i: int, lp: LoopPlan) -> list[Any]:
        if self.planning:
            self.P.loops[i] = lp
            return [zeros_of(a) for a in loop_avals(lp)]
        return self.loop_vals[i]


_MAX_PLANS = 512


def seed_env(
    P: Plan,
    known_in: Sequence[bool],
    ins: Sequence[Any],
    known_out: Sequence[bool],
    outs: Sequence[Any],
    ctx: WalkContext,
) -> Env:
    """An env holding `P`'s consts, its known inputs and its known outputs, for a walk with
    context `ctx`."""
    J = P.closed.jaxpr
    env = Env(info=statics_for(J, P.closed.consts, P.hints), ctx=ctx)
    for v, c in zip(J.constvars, P.closed.consts):
        env.write(v, c)
    it = iter(ins)
    for v, k in zip(J.invars, known_in):
        if k:
            env.write(v, next(it))
    it = iter(outs)
    for v, k in zip(J.outvars, known_out):
        if k:
            val = next(it)
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
    P = Plan(prepare(closed), hints=hints, dial=dial)
    J = P.closed.jaxpr
    P.params = ParamOnly(J, known_in)
    ins = [sds(v.aval) for v, k in zip(J.invars, known_in) if k]
    outs = [sds(v.aval) for v, k in zip(J.outvars, known_out) if k]
    goals = [v for v, g in zip(J.invars, goal_in) if g]

    def dry(ins, outs):
        # a context of its own, with no drift log: the planning walk (on placeholders, traced
        # apart) may run while a backward run is live (a `reversible` call inside another's
        # loop), and nothing of it may reach that run's log
        env = seed_env(P, known_in, ins, known_out, outs, WalkContext(dial.walk))
        walk(P, env, None, set(), Residuals(P), goals)
        return []

    jax.make_jaxpr(dry)(ins, outs)
    plans.put(key, [], (closed, P))
    return P


def top_plan(jaxpr: ClosedJaxpr, state: tuple[bool, ...], dial: Dial = DEFAULT_DIAL) -> Plan:
    """The plan of a `reversible` call: parameters and outputs known, the state rebuilt."""
    n_out = len(jaxpr.jaxpr.outvars)
    return plan_for(
        jaxpr, tuple(not s for s in state), (True,) * n_out, (False,) * len(state), dial=dial
    )


# --------------------------------------------------------------------------- the backward walk


def _activity(J: Any, active_in: set) -> set:
    act = set(active_in)
    for e in J.eqns:
        if any(is_var(v) and v in act for v in e.invars):
            act.update(o for o in e.outvars if is_var(o) and is_float(o.aval))
    return act


def _rebuild(P: Plan, i: int, hi: int, env: Env, goals: list, res: Residuals) -> None:
    """Make `goals` known from `eqns[:hi]` (inverting the nearest equations first, widening the
    window as needed); what cannot be rebuilt is a residual, blamed on equation `i`."""
    eqns = P.closed.jaxpr.eqns
    n = 1
    stuck: list[Stuck] = []
    # parameter-only values are computed forward (`ParamOnly.need`), tied to this step
    tie = tie_of(
        [env.read(o) for o in eqns[i].outvars if is_var(o) and env.known(o)]
        if 0 <= i < len(eqns)
        else []
    )
    P.params.need(env, goals, tie)
    # single steps first, over ever wider windows: a group seen through a narrow window may
    # read values that equations before it compute from known ones (a Runge–Kutta stage from
    # the step's known end), and solving for those as unknowns would be wrong
    for groups in (False, True):
        n = 1
        while hi > 0:
            lo = max(0, hi - n)
            P.params.window(env, eqns[lo:hi], tie)
            stuck = propagate(Window(eqns[lo:hi]), env, goals, soft=True, cut=lo > 0, groups=groups)
            if all(env.known(g) for g in goals) or lo == 0:
                break
            n *= 4
        if all(env.known(g) for g in goals):
            break
    culprit = eqns[i] if 0 <= i < len(eqns) else None
    missing = tuple(g for g in goals if not env.known(g))
    if not missing:
        return
    # a primitive without an inverse rule is not a lossy step: say which rule is missing
    s = blame(stuck)
    label = (
        f"value stored: no inverse rule for `{s.eqn.primitive.name}`"
        if s is not None and s.no_rule
        else None
    )
    if res.planning:
        chosen = _choose_store(eqns[:hi], env, list(missing), P.params)
    else:
        chosen = res.P.decisions[missing]
    for r in chosen:
        env.write(r, res.store(r, culprit, label))
    if any(not env.known(g) for g in missing):
        propagate(Window(eqns[:hi]), env, list(missing), soft=True)
    left = [g for g in missing if not env.known(g)]
    for g in left:
        env.write(g, res.store(g, culprit, label))
    if res.planning:
        res.P.decisions[missing] = [*chosen, *left]


_MAX_STORE_CANDIDATES = 16


def _choose_store(eqns: Sequence[JaxprEqn], env: Env, missing: list, po: ParamOnly) -> list:
    """What to store so that `missing` can be rebuilt, in the fewest bytes: a single value from
    which the rest follows (a loop body's overwritten carry, say), else the cheaper of the
    missing values themselves and the unknown inputs they are computed from."""
    roots, ancestors = _unknown_ancestry(eqns, env, missing)
    # values marked with jr.recompute are never candidates: their sources are stored instead;
    # nor are parameter-only values, which are recomputed
    no_store = {v for e in eqns if e.primitive is recompute_p for v in [*e.invars, *e.outvars]}
    no_store |= po.made.keys()
    cands = sorted(
        (
            c
            for c in dict.fromkeys([*missing, *roots, *ancestors[:_MAX_STORE_CANDIDATES]])
            if c not in no_store
        ),
        key=lambda v: _nbytes([v]),
    )
    best = missing if roots is None or _nbytes(missing) <= _nbytes(roots) else roots
    if roots is not None and any(m in no_store for m in missing):
        best = roots
    for c in cands:
        if _nbytes([c]) >= _nbytes(best):
            break
        trial = env.copy()
        trial.write(c, zeros_of(c.aval))
        propagate(Window(eqns), trial, missing, soft=True)
        if all(trial.known(g) for g in missing):
            return [c]
    return list(best)


def _nbytes(vs: Sequence[Var]) -> int:
    return int(sum(np.prod(v.aval.shape, dtype=np.int64) * v.aval.dtype.itemsize for v in vs))


def _unknown_ancestry(
    eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var]
) -> tuple[list | None, list]:
    """The unknown jaxpr inputs that `goals` are computed from, and the unknown values in
    between, nearest first."""
    producer = {o: e for e in eqns for o in e.outvars if is_var(o)}
    roots: dict = {}
    between: list = []
    seen: set = set(goals)
    queue = list(goals)
    while queue:
        v = queue.pop(0)
        e = producer.get(v)
        if e is None:
            roots[v] = None
            continue
        if v not in goals:
            between.append(v)
        for u in e.invars:
            if is_var(u) and not env.known(u) and u not in seen:
                seen.add(u)
                queue.append(u)
    return list(roots), between


def _vjp_eqn(e: JaxprEqn, env: Env, ctenv: dict | None, active: set) -> None:
    if ctenv is None:
        return
    cts = [ctenv.pop(o, None) if is_var(o) else None for o in e.outvars]
    if all(c is None for c in cts):
        return
    act = [k for k, v in enumerate(e.invars) if is_var(v) and v in active]
    if not act:
        return
    invals = [env.read(v) for v in e.invars]

    def f(*a):
        ins = list(invals)
        for k, x in zip(act, a):
            ins[k] = x
        return bind_eqn(e, ins)

    _, pull = jax.vjp(f, *[invals[k] for k in act])
    in_cts = pull([c if c is not None else zero_ct(o.aval) for c, o in zip(cts, e.outvars)])
    for k, c in zip(act, in_cts):
        acc(ctenv, e.invars[k], c)


def _differentiated_loop(e: JaxprEqn, ctenv: dict | None, active: set, res: Residuals) -> bool:
    """Whether a loop computed from known inputs is swept backwards for its derivative. The
    planning walk says yes to any loop with float inputs (it cannot know which will be
    differentiated), so that the forward run stores what the sweep needs (a trip count)."""
    floats = [v for v in e.invars if is_var(v) and jnp.issubdtype(v.aval.dtype, jnp.inexact)]
    if res.planning:
        return bool(floats)
    return (
        ctenv is not None
        and any(v in active for v in floats)
        and any(is_var(o) and o in ctenv for o in e.outvars)
    )


def _ct_tie(ctenv: dict | None, e: JaxprEqn) -> Any:
    return tie_of([ctenv.get(o) for o in e.outvars if is_var(o)] if ctenv is not None else [])


def walk(
    P: Plan, env: Env, ctenv: dict | None, active_in: set, res: Residuals, goals: Sequence[Var]
) -> None:
    """Walk `P`'s jaxpr last equation first: rebuild each equation's inputs from its outputs,
    then (when `ctenv` is given) pull the cotangents of its outputs back to its inputs."""
    J = P.closed.jaxpr
    eqns = J.eqns
    active = _activity(J, active_in) if ctenv is not None else set()
    # values computed from known inputs alone (parameters, weights) are parameter-only: never
    # stored, computed forward from the parameters at each step that reads them (params.py)
    po = P.params
    forward = po.eqns
    for e in eqns:  # values the user asked to keep (jr.store) are read, not rebuilt: the kept
        if e.primitive is not store_p:  # value replaces a rebuilt one (a loop carry),
            continue  # resetting its drift
        o = e.outvars[0]
        if is_var(o):
            env.vals[o] = fit_to_aval(res.store(o, e, "value kept by jr.store"), o.aval)
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        sweep = sweep_rules.get(e.primitive)
        if i not in forward:
            po.need(
                env,
                e.invars,
                tie_of([env.read(o) for o in e.outvars if is_var(o) and env.known(o)]),
            )
            if sweep is not None:
                if not any(is_var(o) and is_float(o.aval) for o in e.outvars):
                    # no cotangent flows through it (a bin search): where its outputs are
                    # needed they are rebuilt, by running it forward once its inputs are
                    continue
                sweep(P, i, env, ctenv, active, res)
                continue
            unk = [v for v in e.invars if is_var(v) and not env.known(v)]
            if unk:
                _rebuild(P, i, i + 1, env, unk, res)
        elif sweep is not None and _differentiated_loop(e, ctenv, active, res):
            # a loop over parameters alone is computed forward, but its derivative still runs
            # it backwards: a plain VJP would keep its tape (or refuse a while loop)
            po.need(env, [*e.invars, *e.outvars], _ct_tie(ctenv, e))
            sweep(P, i, env, ctenv, active, res)
            continue
        elif ctenv is not None and any(is_var(o) and o in ctenv for o in e.outvars):
            po.need(env, e.invars, _ct_tie(ctenv, e))
        _vjp_eqn(e, env, ctenv, active)
    missing = [g for g in goals if not env.known(g)]
    if missing:
        _rebuild(P, len(eqns) - 1, len(eqns), env, missing, res)


# --------------------------------------------------------------------------- loop helpers


def known_or_rebuilt(
    P: Plan, i: int, env: Env, vs: Sequence[Any], res: Residuals, through: bool = False
) -> None:
    """Inputs a loop needs before it can run backwards (its constants): rebuilt from the
    equations before it (and, `through`, from the loop's own outputs), else stored."""
    unk = [v for v in vs if is_var(v) and not env.known(v)]
    if unk:
        _rebuild(P, i, i + 1 if through else i, env, unk, res)


def outs_known(P: Plan, i: int, env: Env, outs: Sequence[Any], res: Residuals) -> None:
    """A loop's final values, where the output does not use them: stored."""
    e = P.closed.jaxpr.eqns[i]
    for v in outs:
        if isinstance(v, DropVar):
            raise not_invertible(
                e,
                "the loop's final carry is discarded, so it cannot be run backwards",
                "Ways out: return the final carry.",
                who=env.ctx.who,
            )
        if not env.known(v):  # a final carry the output does not use (a loop counter, say)
            env.write(v, res.store(v, e, "final loop carry that the output discards"))


@dataclass
class BodyStep:
    """What one backward iteration of a loop body gives back."""

    carry: list  # the carry before the iteration, rebuilt
    carry_ct: list | None  # its cotangent (None entries for inactive carries)
    xs: list  # the iteration's unknown `xs`, rebuilt
    xs_ct: list | None  # the cotangents of the active `xs`
    consts_ct: list | None  # this iteration's share of the active constants' cotangents
    drift: tuple  # the worst (ratio, site) of the loops inside the body


class BodyWalk:
    """One backward iteration of a loop body: rebuild the carry (and unknown `xs`) from the
    outputs, and pull the cotangents back. Shared by scan, while loops and conds."""

    def __init__(
        self,
        bp: Plan,
        nc: int,
        ncar: int,
        xk: Sequence[bool],
        yk: Sequence[bool],
        consts: Sequence[Any],
        act: Sequence[bool] | None,
        yct: Sequence[bool],
        ctx: WalkContext,
    ) -> None:
        self.ctx = ctx  # the loop's walk's: its drift log collects the body's comparisons
        self.bp, self.nc, self.ncar, self.xk, self.yk = bp, nc, ncar, list(xk), list(yk)
        self.consts, self.act, self.yct = list(consts), act, list(yct)
        J = bp.closed.jaxpr
        self.cin = J.invars[nc : nc + ncar]
        self.xin = J.invars[nc + ncar :]
        self.cout, self.yout = J.outvars[:ncar], J.outvars[ncar:]

    def __call__(
        self,
        c: Sequence[Any],
        c_ct: Sequence[Any] | None,
        ys_t: Sequence[Any],
        ys_ct_t: Sequence[Any],
        xs_t: Sequence[Any],
        res_t: Sequence[Any],
    ) -> BodyStep:
        bp, nc, ncar = self.bp, self.nc, self.ncar
        J = bp.closed.jaxpr
        known_in = [True] * nc + [False] * ncar + self.xk
        known_out = [True] * ncar + self.yk
        env = seed_env(bp, known_in, [*self.consts, *xs_t], known_out, [*c, *ys_t], self.ctx)
        ctenv = None
        active: set = set()
        if self.act is not None:
            ctenv = {}
            active = {v for v, a in zip(J.invars, self.act) if a}
            for v, g in zip(self.cout, c_ct):
                if g is not None:
                    acc(ctenv, v, g)
            for v, g in zip([v for v, w in zip(self.yout, self.yct) if w], ys_ct_t):
                acc(ctenv, v, g)
        goals = [*self.cin, *[v for v, k in zip(self.xin, self.xk) if not k]]
        with drift.scope(self.ctx.drift) as sc:
            walk(bp, env, ctenv, active, Residuals(bp, res_t), goals)
        c_prev = [env.read(v) for v in self.cin]
        x_rec = [env.read(v) for v, k in zip(self.xin, self.xk) if not k]
        if ctenv is None:
            return BodyStep(c_prev, None, x_rec, None, None, sc.worst())
        a_c, a_car, a_x = (self.act[:nc], self.act[nc : nc + ncar], self.act[nc + ncar :])
        return BodyStep(
            c_prev,
            [get_ct(ctenv, v) if a else None for v, a in zip(self.cin, a_car)],
            x_rec,
            [get_ct(ctenv, v) for v, a in zip(self.xin, a_x) if a],
            [get_ct(ctenv, v) for v, a in zip(J.invars[:nc], a_c) if a],
            sc.worst(),
        )


def loop_activity(
    ins: Sequence[Any], active: set, nc: int, ncar: int, body: ClosedJaxpr
) -> list[bool]:
    """Which body inputs carry cotangents: constants and xs as outside; the carry wherever
    anything entering the loop is active (a loop mixes them)."""
    any_act = any(is_var(v) and v in active for v in ins)
    out = []
    for k, (v, bv) in enumerate(zip(ins, body.jaxpr.invars)):
        if nc <= k < nc + ncar:
            out.append(any_act and is_float(bv.aval))
        else:
            out.append(is_var(v) and v in active)
    return out


def loop_cts_in(
    ctenv: dict | None, cout: Sequence[Any], body: ClosedJaxpr, nc: int, act: Sequence[bool] | None
) -> tuple[list | None, list | None]:
    """The backward loop's starting cotangents: the final carry's (taken out of `ctenv`) and
    zeros for the active constants; (None, None) when no cotangents are pulled."""
    if ctenv is None:
        return None, None
    c_ct = [(get_ct(ctenv, v) if a else None) for v, a in zip(cout, act[nc : nc + len(cout)])]
    for v in cout:
        ctenv.pop(v, None)
    k_ct = [zero_ct(v.aval) for v, a in zip(body.jaxpr.invars[:nc], act[:nc]) if a]
    return c_ct, k_ct


@dataclass
class LoopEnd:
    """What a backward loop rebuilt and pulled back, to write at the loop's inputs."""

    init: Sequence[Any]  # the loop's carry inputs (variables)
    carry: Sequence[Any]  # their rebuilt values
    carry_ct: Sequence[Any] | None
    consts: Sequence[Any]  # the loop's constants (variables)
    consts_ct: Sequence[Any] | None


def loop_cts_out(
    env: Env, ctenv: dict | None, end: LoopEnd, act: Sequence[bool] | None, nc: int
) -> None:
    """Write what the backward loop rebuilt and pulled back: the starting carry, its
    cotangent, and the constants' accumulated cotangents."""
    for v, val in zip(end.init, end.carry):
        if is_var(v) and not env.known(v):  # a known start (a parameter) stays exact
            env.write(v, val)
    if ctenv is None:
        return
    for v, g in zip(end.init, end.carry_ct):
        acc(ctenv, v, g)
    for v, g in zip([v for v, a in zip(end.consts, act[:nc]) if a], end.consts_ct):
        acc(ctenv, v, g)


# --------------------------------------------------------------------------- forward run


def forward_with_residuals(P: Plan, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Run `P`'s jaxpr forward; also return its residuals (in `res_avals(P)` order). Loops
    and branches with residuals of their own run by their `forward_rules`; parameter-only
    values are computed where they are read (`ParamOnly.run`)."""
    J = P.closed.jaxpr
    env = Env()
    for v, c in zip(J.constvars, P.closed.consts):
        env.write(v, c)
    for v, a in zip(J.invars, args):
        env.write(v, a)
    lres: dict[int, list] = {}

    def rule(i: int, e: JaxprEqn, ins: list) -> list | None:
        lp = P.loops.get(i)
        if lp is None:
            return None
        outs, lres[i] = forward_rules[e.primitive](e, lp, ins)
        return outs

    P.params.run(env, rule, keep=P.loops.keys())
    P.params.need(env, [*J.outvars, *P.store], None)
    res = [env.read(v) for v in P.store]
    for i in sorted(P.loops):
        res += lres[i]
    return [env.read(v) for v in J.outvars], res
