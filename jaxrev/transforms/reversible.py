"""Memory-free reverse mode: `reversible`, `memory_report`, and `check_reversible`.

`reversible(fun)` binds `reversible_p`, a primitive carrying `fun`'s jaxpr (modelled on JAX's
`remat_p`). Its JVP rule splits it, as linearization needs, into a known part that runs `fun`
forward and keeps only the outputs (plus whatever a lossy step forces it to keep, the
*residuals*), and a linear part `reversible_lin_p` whose transpose is the backward sweep: it walks
the equations last to first, rebuilds each equation's inputs from its outputs with the inverse
rules of `reverse`, and pulls the cotangent through it. A `scan` runs backwards as a `scan` whose
body inverts one iteration and then pulls the cotangent through it, so memory stays at the width
of the program, not its depth.

What a walk cannot rebuild (a relu's input, an overwritten carry, a `lax.cond`'s branch index, a
`lax.while_loop`'s trip count) is found once per jaxpr by a *planning* walk on abstract values,
and the forward run stores exactly those values (per iteration inside loops).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from functools import partial, wraps
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import (ClosedJaxpr, DropVar, JaxprEqn, Literal, Primitive, ShapedArray,
                            Var, bind_eqn, cond_branches, eval_closed, hoist_consts,
                            is_symbolic_zero, lower_fun, primitive_batchers,
                            primitive_jvps, primitive_transposes, prims, register_lowering,
                            scan_info, trace_to_closed, user_source)
from jaxrev._errors import ReversibilityError, not_invertible
from jaxrev._jaxpr import (Env, batch_front, fit_to_aval, inline_calls,
                            instantiate_tangents)
from jaxrev.transforms import control_flow as _cf
from jaxrev.transforms.custom import recompute_p, store_p
from jaxrev.transforms.reverse import (_check_structure, _invert_call, _normalize_argnums,
                                       _trace_program, propagate)

__all__ = ["reversible", "memory_report", "MemoryReport", "check_reversible",
           "ReversibilityReport", "reversible_p", "reversible_lin_p"]



reversible_p = Primitive("jaxrev_reversible")
reversible_p.multiple_results = True
reversible_lin_p = Primitive("jaxrev_reversible_lin")
reversible_lin_p.multiple_results = True


def _is_var(v: Any) -> bool:
    return isinstance(v, Var) and not isinstance(v, DropVar)


def _is_float(aval: Any) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype)


def _zero_ct(aval: Any) -> Any:
    if _is_float(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _acc(ctenv: dict, v: Any, ct: Any) -> None:
    if ct is None or not _is_var(v) or not _is_float(v.aval):
        return
    if getattr(ct, "dtype", None) == jax.dtypes.float0 or is_symbolic_zero(ct):
        return
    ct = jnp.asarray(ct, v.aval.dtype) if jnp.result_type(ct) != v.aval.dtype else ct
    ctenv[v] = ctenv[v] + ct if v in ctenv else ct


def _get_ct(ctenv: dict, v: Any) -> Any:
    return ctenv[v] if v in ctenv else _zero_ct(v.aval)


# --------------------------------------------------------------------------- plans

@dataclass(eq=False)
class _Plan:
    """What the backward walk of one jaxpr cannot rebuild, so the forward run stores it."""

    closed: ClosedJaxpr                                  # the jaxpr walked (calls inlined)
    store: list = field(default_factory=list)            # Vars stored once per run of it
    why: dict = field(default_factory=dict)              # Var -> equation that forced it
    loops: dict = field(default_factory=dict)            # eqn index -> _LoopPlan
    decisions: dict = field(default_factory=dict)        # missing Vars -> Vars stored for them
    labels: dict = field(default_factory=dict)           # Var -> what it is, for the report


@dataclass(eq=False)
class _LoopPlan:
    """Residuals of a loop or cond: "scan" (the body's, stacked per iteration), "while" (the trip
    count) or "cond" (every branch's, side by side; the branch not taken leaves zeros)."""

    kind: str
    body: _Plan | None
    length: int | None = None
    branches: list | None = None
    count_shape: tuple = ()   # a while loop's trip count: one per element of a vmapped loop


def _branch_slices(lp: _LoopPlan) -> list[tuple[int, int]]:
    out, k = [], 0
    for bp in lp.branches:
        n = len(_res_avals(bp))
        out.append((k, k + n))
        k += n
    return out


def _loop_avals(lp: _LoopPlan) -> list[jax.ShapeDtypeStruct]:
    if lp.kind == "while":
        return [jax.ShapeDtypeStruct(lp.count_shape, jnp.int32)]
    if lp.kind == "cond":
        return [a for bp in lp.branches for a in _res_avals(bp)]
    return [jax.ShapeDtypeStruct((lp.length, *a.shape), a.dtype) for a in _res_avals(lp.body)]


def _res_avals(P: _Plan) -> list[jax.ShapeDtypeStruct]:
    out = [_sds(v.aval) for v in P.store]
    for i in sorted(P.loops):
        out += _loop_avals(P.loops[i])
    return out


class _Res:
    """The residuals of one run of a plan's jaxpr. Without values it is the planning walk's:
    it records what is asked for and answers with placeholders."""

    def __init__(self, P: _Plan, values: Sequence[Any] | None = None) -> None:
        self.P = P
        self.planning = values is None
        if not self.planning:
            values = list(values)
            n = len(P.store)
            self.vals = dict(zip(P.store, values[:n]))
            self.loop_vals = {}
            k = n
            for i in sorted(P.loops):
                m = len(_loop_avals(P.loops[i]))
                self.loop_vals[i] = values[k:k + m]
                k += m

    def store(self, v: Var, eqn: JaxprEqn | None, label: str | None = None) -> Any:
        if self.planning:
            if v not in self.P.why:
                self.P.store.append(v)
                self.P.why[v] = eqn
                if label:
                    self.P.labels[v] = label
            return jnp.zeros(v.aval.shape, v.aval.dtype)
        if v not in self.vals:  # the planning walk and this one disagree: a jaxrev bug
            raise AssertionError(f"jaxrev internal error: no stored value for {v}")
        return self.vals[v]

    def loop(self, i: int, lp: _LoopPlan) -> list[Any]:
        if self.planning:
            self.P.loops[i] = lp
            return [jnp.zeros(a.shape, a.dtype) for a in _loop_avals(lp)]
        return self.loop_vals[i]


_PLANS: "OrderedDict[tuple, tuple[ClosedJaxpr, _Plan]]" = OrderedDict()
_MAX_PLANS = 512


def _seed_env(P: _Plan, known_in: Sequence[bool], ins: Sequence[Any],
              known_out: Sequence[bool], outs: Sequence[Any]) -> Env:
    J = P.closed.jaxpr
    env = Env()
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
            if _is_var(v):
                env.write(v, val)
    return env


def _plan_for(closed: ClosedJaxpr, known_in: tuple[bool, ...], known_out: tuple[bool, ...],
              goal_in: tuple[bool, ...]) -> _Plan:
    """Plan the backward walk of `closed` given which inputs and outputs it knows and which
    inputs it must rebuild (a loop body's carry); cached per jaxpr."""
    key = (id(closed), known_in, known_out, goal_in)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is closed:
        _PLANS.move_to_end(key)
        return hit[1]
    P = _Plan(inline_calls(closed))
    J = P.closed.jaxpr
    ins = [_sds(v.aval) for v, k in zip(J.invars, known_in) if k]
    outs = [_sds(v.aval) for v, k in zip(J.outvars, known_out) if k]
    goals = [v for v, g in zip(J.invars, goal_in) if g]

    def dry(ins, outs):
        env = _seed_env(P, known_in, ins, known_out, outs)
        _walk(P, env, None, set(), _Res(P), goals)
        return []

    jax.make_jaxpr(dry)(ins, outs)
    _PLANS[key] = (closed, P)
    if len(_PLANS) > _MAX_PLANS:
        _PLANS.popitem(last=False)
    return P


def _top_plan(jaxpr: ClosedJaxpr, state: tuple[bool, ...]) -> _Plan:
    n_out = len(jaxpr.jaxpr.outvars)
    return _plan_for(jaxpr, tuple(not s for s in state), (True,) * n_out,
                     (False,) * len(state))


# --------------------------------------------------------------------------- the backward walk

class _Window:
    """A stretch of a jaxpr's equations, for `propagate` (which reads `.eqns`, `.outvars`)."""

    __slots__ = ("eqns", "outvars")

    def __init__(self, eqns: Sequence[JaxprEqn]) -> None:
        self.eqns = list(eqns)
        self.outvars: list = []


def _activity(J: Any, active_in: set) -> set:
    act = set(active_in)
    for e in J.eqns:
        if any(_is_var(v) and v in act for v in e.invars):
            act.update(o for o in e.outvars if _is_var(o) and _is_float(o.aval))
    return act


def _rebuild(P: _Plan, i: int, hi: int, env: Env, goals: list, res: _Res) -> None:
    """Make `goals` known from `eqns[:hi]` (inverting the nearest equations first, widening the
    window as needed); what cannot be rebuilt is a residual, blamed on equation `i`."""
    eqns = P.closed.jaxpr.eqns
    n = 1
    while hi > 0:
        lo = max(0, hi - n)
        propagate(_Window(eqns[lo:hi]), env, goals, soft=True)
        if all(env.known(g) for g in goals) or lo == 0:
            break
        n *= 4
    blame = eqns[i] if 0 <= i < len(eqns) else None
    missing = tuple(g for g in goals if not env.known(g))
    if not missing:
        return
    if res.planning:
        chosen = _choose_store(eqns[:hi], env, list(missing))
    else:
        chosen = res.P.decisions[missing]
    for r in chosen:
        env.write(r, res.store(r, blame))
    if any(not env.known(g) for g in missing):
        propagate(_Window(eqns[:hi]), env, list(missing), soft=True)
    left = [g for g in missing if not env.known(g)]
    for g in left:
        env.write(g, res.store(g, blame))
    if res.planning:
        res.P.decisions[missing] = [*chosen, *left]


_MAX_STORE_CANDIDATES = 16


def _choose_store(eqns: Sequence[JaxprEqn], env: Env, missing: list) -> list:
    """What to store so that `missing` can be rebuilt, in the fewest bytes: a single value from
    which the rest follows (a loop body's overwritten carry, say), else the cheaper of the
    missing values themselves and the unknown inputs they are computed from."""
    roots, ancestors = _unknown_ancestry(eqns, env, missing)
    # values marked with jr.recompute are never candidates: their sources are stored instead
    no_store = {v for e in eqns if e.primitive is recompute_p for v in [*e.invars, *e.outvars]}
    cands = sorted((c for c in dict.fromkeys([*missing, *roots,
                                              *ancestors[:_MAX_STORE_CANDIDATES]])
                    if c not in no_store), key=lambda v: _nbytes([v]))
    best = missing if roots is None or _nbytes(missing) <= _nbytes(roots) else roots
    if roots is not None and any(m in no_store for m in missing):
        best = roots
    for c in cands:
        if _nbytes([c]) >= _nbytes(best):
            break
        trial = env.copy()
        trial.write(c, jnp.zeros(c.aval.shape, c.aval.dtype))
        propagate(_Window(eqns), trial, missing, soft=True)
        if all(trial.known(g) for g in missing):
            return [c]
    return list(best)
def _nbytes(vs: Sequence[Var]) -> int:
    return int(sum(np.prod(v.aval.shape, dtype=np.int64) * np.dtype(v.aval.dtype).itemsize
                   for v in vs))


def _unknown_ancestry(eqns: Sequence[JaxprEqn], env: Env, goals: Sequence[Var]
                      ) -> tuple[list | None, list]:
    """The unknown jaxpr inputs that `goals` are computed from (None if one of them depends
    on an unknown value produced outside `eqns`), and the unknown values in between, nearest
    first."""
    producer = {o: e for e in eqns for o in e.outvars if _is_var(o)}
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
            if _is_var(u) and not env.known(u) and u not in seen:
                seen.add(u)
                queue.append(u)
    return list(roots), between


def _vjp_eqn(e: JaxprEqn, env: Env, ctenv: dict | None, active: set) -> None:
    if ctenv is None:
        return
    cts = [ctenv.pop(o, None) if _is_var(o) else None for o in e.outvars]
    if all(c is None for c in cts):
        return
    act = [k for k, v in enumerate(e.invars) if _is_var(v) and v in active]
    if not act:
        return
    invals = [env.read(v) for v in e.invars]

    def f(*a):
        ins = list(invals)
        for k, x in zip(act, a):
            ins[k] = x
        return bind_eqn(e, ins)

    _, pull = jax.vjp(f, *[invals[k] for k in act])
    in_cts = pull([c if c is not None else _zero_ct(o.aval) for c, o in zip(cts, e.outvars)])
    for k, c in zip(act, in_cts):
        _acc(ctenv, e.invars[k], c)


def _differentiated_loop(e: JaxprEqn, ctenv: dict | None, active: set, res: _Res) -> bool:
    """Whether a loop computed from known inputs is swept backwards for its derivative. The
    planning walk says yes to any loop with float inputs (it cannot know which will be
    differentiated), so that the forward run stores what the sweep needs (a trip count)."""
    floats = [v for v in e.invars
              if _is_var(v) and jnp.issubdtype(v.aval.dtype, jnp.inexact)]
    if res.planning:
        return bool(floats)
    return ctenv is not None and any(v in active for v in floats) and any(
        _is_var(o) and o in ctenv for o in e.outvars)


def _walk(P: _Plan, env: Env, ctenv: dict | None, active_in: set, res: _Res,
          goals: Sequence[Var]) -> None:
    """Walk `P`'s jaxpr last equation first: rebuild each equation's inputs from its outputs,
    then (when `ctenv` is given) pull the cotangents of its outputs back to its inputs."""
    J = P.closed.jaxpr
    eqns = J.eqns
    active = _activity(J, active_in) if ctenv is not None else set()
    # values computed from known inputs alone (parameters, weights) are evaluated forward first
    pk = {v for v in J.invars if env.known(v)} | set(J.constvars)
    forward = set()
    for i, e in enumerate(eqns):
        if all(isinstance(v, Literal) or v in pk for v in e.invars):
            pk.update(o for o in e.outvars if _is_var(o))
            forward.add(i)
            if any(_is_var(o) and not env.known(o) for o in e.outvars):
                for o, val in zip(e.outvars, bind_eqn(e, [env.read(v) for v in e.invars])):
                    env.write(o, val)
    for e in eqns:  # values the user asked to keep (jr.store) are read, not rebuilt: the kept
        if e.primitive is not store_p:  # value replaces a rebuilt one (a loop carry),
            continue                    # resetting its drift
        o = e.outvars[0]
        if _is_var(o):
            env.vals[o] = fit_to_aval(res.store(o, e, "value kept by jr.store"), o.aval)
    for i in reversed(range(len(eqns))):
        e = eqns[i]
        sweep = _sweeps.get(e.primitive)
        if i not in forward:
            if sweep is not None:
                sweep(P, i, env, ctenv, active, res)
                continue
            unk = [v for v in e.invars if _is_var(v) and not env.known(v)]
            if unk:
                _rebuild(P, i, i + 1, env, unk, res)
        elif sweep is not None and _differentiated_loop(e, ctenv, active, res):
            # a loop over parameters alone is computed forward, but its derivative still runs
            # it backwards: a plain VJP would keep its tape (or refuse a while loop)
            sweep(P, i, env, ctenv, active, res)
            continue
        _vjp_eqn(e, env, ctenv, active)
    missing = [g for g in goals if not env.known(g)]
    if missing:
        _rebuild(P, len(eqns) - 1, len(eqns), env, missing, res)


# --------------------------------------------------------------------------- loops

def _known_or_rebuilt(P: _Plan, i: int, env: Env, vs: Sequence[Any], res: _Res) -> None:
    """Inputs a loop needs before it can run backwards (its constants): rebuilt from the
    equations before it, else stored."""
    unk = [v for v in vs if _is_var(v) and not env.known(v)]
    if unk:
        _rebuild(P, i, i, env, unk, res)


def _outs_known(P: _Plan, i: int, env: Env, outs: Sequence[Any], res: _Res) -> None:
    e = P.closed.jaxpr.eqns[i]
    for v in outs:
        if isinstance(v, DropVar):
            raise not_invertible(e, "the loop's final carry is discarded, so it cannot be run "
                                    "backwards", "Ways out: return the final carry.")
        if not env.known(v):  # a final carry the output does not use (a loop counter, say)
            env.write(v, res.store(v, e, "final loop carry that the output discards"))


class _BodyWalk:
    """One backward iteration of a loop body: rebuild the carry (and unknown `xs`) from the
    outputs, and pull the cotangents back. Shared by scan, while loops and conds."""

    def __init__(self, bp: _Plan, nc: int, ncar: int, xk: Sequence[bool], yk: Sequence[bool],
                 consts: Sequence[Any], act: Sequence[bool] | None,
                 yct: Sequence[bool]) -> None:
        self.bp, self.nc, self.ncar, self.xk, self.yk = bp, nc, ncar, list(xk), list(yk)
        self.consts, self.act, self.yct = list(consts), act, list(yct)
        J = bp.closed.jaxpr
        self.cin = J.invars[nc:nc + ncar]
        self.xin = J.invars[nc + ncar:]
        self.cout, self.yout = J.outvars[:ncar], J.outvars[ncar:]

    def __call__(self, c, c_ct, ys_t, ys_ct_t, xs_t, res_t):
        bp, nc, ncar = self.bp, self.nc, self.ncar
        J = bp.closed.jaxpr
        known_in = [True] * nc + [False] * ncar + self.xk
        known_out = [True] * ncar + self.yk
        env = _seed_env(bp, known_in, [*self.consts, *xs_t], known_out, [*c, *ys_t])
        ctenv = None
        active: set = set()
        if self.act is not None:
            ctenv = {}
            active = {v for v, a in zip(J.invars, self.act) if a}
            for v, g in zip(self.cout, c_ct):
                if g is not None:
                    _acc(ctenv, v, g)
            for v, g in zip([v for v, w in zip(self.yout, self.yct) if w], ys_ct_t):
                _acc(ctenv, v, g)
        goals = [*self.cin, *[v for v, k in zip(self.xin, self.xk) if not k]]
        _walk(bp, env, ctenv, active, _Res(bp, res_t), goals)
        c_prev = [env.read(v) for v in self.cin]
        x_rec = [env.read(v) for v, k in zip(self.xin, self.xk) if not k]
        if ctenv is None:
            return c_prev, None, x_rec, None, None
        a_c, a_car, a_x = (self.act[:nc], self.act[nc:nc + ncar], self.act[nc + ncar:])
        c_prev_ct = [_get_ct(ctenv, v) if a else None for v, a in zip(self.cin, a_car)]
        x_ct = [_get_ct(ctenv, v) for v, a in zip(self.xin, a_x) if a]
        k_ct = [_get_ct(ctenv, v) for v, a in zip(J.invars[:nc], a_c) if a]
        return c_prev, c_prev_ct, x_rec, x_ct, k_ct


def _loop_activity(ins: Sequence[Any], active: set, nc: int, ncar: int, body: ClosedJaxpr
                   ) -> list[bool]:
    """Which body inputs carry cotangents: constants and xs as outside; the carry wherever
    anything entering the loop is active (a loop mixes them)."""
    any_act = any(_is_var(v) and v in active for v in ins)
    out = []
    for k, (v, bv) in enumerate(zip(ins, body.jaxpr.invars)):
        if nc <= k < nc + ncar:
            out.append(any_act and _is_float(bv.aval))
        else:
            out.append(_is_var(v) and v in active)
    return out


def _loop_cts_in(ctenv, cout, body, nc, act):
    """The backward loop's starting cotangents: the final carry's (taken out of `ctenv`) and
    zeros for the active constants; (None, None) when no cotangents are pulled."""
    if ctenv is None:
        return None, None
    c_ct = [(_get_ct(ctenv, v) if a else None) for v, a in zip(cout, act[nc:nc + len(cout)])]
    for v in cout:
        ctenv.pop(v, None)
    k_ct = [_zero_ct(v.aval) for v, a in zip(body.jaxpr.invars[:nc], act[:nc]) if a]
    return c_ct, k_ct


def _loop_cts_out(env, ctenv, init, c_first, c_first_ct, consts, k_ct, act, nc):
    """Write what the backward loop rebuilt and pulled back: the starting carry, its
    cotangent, and the constants' accumulated cotangents."""
    for v, val in zip(init, c_first):
        if _is_var(v) and not env.known(v):  # a known start (a parameter) stays exact
            env.write(v, val)
    if ctenv is None:
        return
    for v, g in zip(init, c_first_ct):
        _acc(ctenv, v, g)
    for v, g in zip([v for v, a in zip(consts, act[:nc]) if a], k_ct):
        _acc(ctenv, v, g)


def _scan_sweep(P, i, env, ctenv, active, res):
    e = P.closed.jaxpr.eqns[i]
    nc, ncar, body, length, rev = scan_info(e.params)
    ins = e.invars
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]
    _known_or_rebuilt(P, i, env, consts, res)
    unk = [v for v in xs if _is_var(v) and not env.known(v)]
    if unk:  # xs computable forward from what is known; the rest the body rebuilds
        propagate(_Window(P.closed.jaxpr.eqns[:i]), env, unk, forward_only=True)
    xk = tuple(env.known(v) for v in xs)
    cout, ys = e.outvars[:ncar], e.outvars[ncar:]
    _outs_known(P, i, env, cout, res)
    yk = tuple(env.known(v) for v in ys)
    bp = _plan_for(body, (True,) * nc + (False,) * ncar + xk, (True,) * ncar + yk,
                   (False,) * nc + (True,) * ncar + tuple(not k for k in xk))
    lres = res.loop(i, _LoopPlan("scan", bp, length)) if _res_avals(bp) else []
    want = ctenv is not None
    act = _loop_activity(ins, active, nc, ncar, body) if want else None
    ys_ct = [ctenv.pop(v, None) if want and _is_var(v) else None for v in ys]
    yct = [c is not None for c in ys_ct]
    step = _BodyWalk(bp, nc, ncar, xk, yk, [env.read(v) for v in consts], act, yct)
    c0 = [env.read(v) for v in cout]
    c_ct0, k_ct0 = _loop_cts_in(ctenv, cout, body, nc, act)

    def bstep(carry, sl):
        c, c_ct, k_ct = carry
        ys_t, ys_ct_t, xs_t, res_t = sl
        c_prev, c_prev_ct, x_rec, x_ct, kc = step(c, c_ct, ys_t, ys_ct_t, xs_t, res_t)
        if want:
            k_ct = [a + b for a, b in zip(k_ct, kc)]
        return (c_prev, c_prev_ct, k_ct), (x_rec, x_ct)

    sl = ([env.read(v) for v, k in zip(ys, yk) if k], [c for c in ys_ct if c is not None],
          [env.read(v) for v, k in zip(xs, xk) if k], list(lres))
    (c_first, c_first_ct, k_ct), (x_rec, x_ct) = lax.scan(
        bstep, (c0, c_ct0, k_ct0), sl, length=length, reverse=not rev)
    _loop_cts_out(env, ctenv, init, c_first, c_first_ct, consts, k_ct, act, nc)
    for v, val in zip([v for v, k in zip(xs, xk) if not k], x_rec):
        env.write(v, val)
    if want:
        for v, g in zip([v for v, a in zip(xs, act[nc + ncar:]) if a], x_ct):
            _acc(ctenv, v, g)


def _while_sweep(P, i, env, ctenv, active, res):
    """`lax.while_loop` (the forward run stores its trip count) and `jr.while_loop` (its post
    condition says when to stop) both run backwards as a while loop over the inverted body."""
    e = P.closed.jaxpr.eqns[i]
    p = e.params
    ours = e.primitive is _cf.while_p
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    npc = p["post_nconsts"] if ours else 0
    ins = e.invars
    cc, bc, pc, init = (ins[:ncc], ins[ncc:ncc + nbc], ins[ncc + nbc:ncc + nbc + npc],
                        ins[ncc + nbc + npc:])
    _known_or_rebuilt(P, i, env, [*cc, *bc, *pc], res)
    _outs_known(P, i, env, e.outvars, res)
    body = p["body_jaxpr"]
    ncar = len(init)
    bp = _plan_for(body, (True,) * nbc + (False,) * ncar, (True,) * ncar,
                   (False,) * nbc + (True,) * ncar)
    if _res_avals(bp):
        v = bp.store[0] if bp.store else None
        blame = bp.why.get(v) or e
        raise not_invertible(
            blame, "a step in the body of a while loop loses information, and a while loop's "
                   "iterations cannot be stored (its length is not known in advance)",
            "Ways out: use `lax.scan` or a `fori_loop` with static bounds, whose iterations "
            "`reversible` can store, or make the step invertible.")
    want = ctenv is not None
    act = _loop_activity([*bc, *init], active, nbc, ncar, body) if want else None
    bvals = [env.read(v) for v in bc]
    step = _BodyWalk(bp, nbc, ncar, (), (), bvals, act, ())
    c0 = [env.read(v) for v in e.outvars]
    c_ct0, k_ct0 = _loop_cts_in(ctenv, e.outvars, body, nbc, act)

    def bstep(go, c, c_ct, k_ct):
        """One backward iteration where `go` holds (a scalar, or one flag per element of a
        vmapped loop: finished elements keep their values and add no cotangent)."""
        batched = jnp.ndim(go) > 0
        c_in, c_ct_in = c, c_ct
        if batched:
            # finished elements are back at their start, where the inverted step may be
            # undefined (k = 0 in x / k): they step back from one forward step instead, a
            # point the loop itself computes, with a zero cotangent, so that 0 · inf never
            # reaches the constants' cotangents
            ahead = eval_closed(body, *bvals, *c)
            c_in = [_cf._select(go, a, b) for a, b in zip(c, ahead)]
            if c_ct is not None:
                c_ct_in = [None if g is None else _cf._select(go, g, jnp.zeros_like(g))
                           for g in c_ct]
        c_prev, c_prev_ct, _, _, kc = step(c_in, c_ct_in, [], [], [], [])
        if want:
            k_ct = [a + b for a, b in zip(k_ct, kc)]
        if not batched:
            return c_prev, c_prev_ct, k_ct
        return ([_cf._select(go, a, b) for a, b in zip(c_prev, c)],
                None if c_prev_ct is None else
                [None if a is None else _cf._select(go, a, b) for a, b in zip(c_prev_ct, c_ct)],
                k_ct)

    if ours:
        pvals = [env.read(v) for v in pc]

        def more(c):
            return eval_closed(p["post_jaxpr"], *pvals, *c)[0]

        c_first, c_first_ct, k_ct = lax.while_loop(
            lambda s: jnp.any(more(s[0])), lambda s: bstep(more(s[0]), *s), (c0, c_ct0, k_ct0))
    else:
        count_shape = tuple(p["cond_jaxpr"].out_avals[0].shape)  # per element under vmap
        n = res.loop(i, _LoopPlan("while", bp, count_shape=count_shape))[0]

        def back(s):
            k = s[0]
            return (k - (k > 0).astype(k.dtype), *bstep(k > 0, *s[1:]))

        _, c_first, c_first_ct, k_ct = lax.while_loop(lambda s: jnp.any(s[0] > 0), back,
                                                       (n, c0, c_ct0, k_ct0))
    _loop_cts_out(env, ctenv, init, c_first, c_first_ct, bc, k_ct, act, nbc)


def _cond_sweep(P, i, env, ctenv, active, res):
    """A `cond` runs backwards through the branch it took: `lax.cond`'s index is rebuilt like
    any value (a comparison cannot be inverted, so it is stored: four bytes); `jr.cond`'s
    comes from its post condition."""
    e = P.closed.jaxpr.eqns[i]
    ours = e.primitive is _cf.cond_p
    index, rest = e.invars[0], e.invars[1:]
    npc = e.params["post_nconsts"] if ours else 0
    pc, ops = rest[:npc], rest[npc:]
    _known_or_rebuilt(P, i, env, pc, res)
    _outs_known(P, i, env, e.outvars, res)
    if not env.known(index):
        if ours:
            took = eval_closed(e.params["post_jaxpr"], *[env.read(v) for v in pc],
                               *[env.read(v) for v in e.outvars])[0]
            env.write(index, lax.convert_element_type(took, jnp.int32))
        else:
            _known_or_rebuilt(P, i, env, [index], res)
    branches = cond_branches(e.params)
    ok = tuple(env.known(v) for v in ops)
    nout = len(e.outvars)
    bps = [_plan_for(b, ok, (True,) * nout, tuple(not k for k in ok)) for b in branches]
    lp = _LoopPlan("cond", None, branches=bps)
    lres = res.loop(i, lp) if any(_res_avals(bp) for bp in bps) else []
    spans = _branch_slices(lp)
    want = ctenv is not None
    act = ([_is_var(v) and v in active for v in ops] if want else None)
    outs = [env.read(v) for v in e.outvars]
    cts = [ctenv.pop(v, None) if want else None for v in e.outvars] if want else []
    cts = [c if c is not None else _zero_ct(v.aval) for c, v in zip(cts, e.outvars)]
    known_ops = [env.read(v) for v, k in zip(ops, ok) if k]

    def branch_fn(bp, span):
        def f(outs, cts, known_ops, lres):
            J = bp.closed.jaxpr
            benv = _seed_env(bp, ok, known_ops, (True,) * nout, outs)
            bct = None
            bactive: set = set()
            if want:
                bct = {}
                bactive = {v for v, a in zip(J.invars, act) if a}
                for v, g in zip(J.outvars, cts):
                    if _is_float(v.aval):
                        _acc(bct, v, g)
            goals = [v for v, k in zip(J.invars, ok) if not k]
            _walk(bp, benv, bct, bactive, _Res(bp, lres[span[0]:span[1]]), goals)
            rec = [benv.read(v) for v in goals]
            g = [_get_ct(bct, v) for v, a in zip(J.invars, act) if a] if want else []
            return rec, g
        return f

    idx = jnp.clip(env.read(index), 0, len(branches) - 1)
    fns = [branch_fn(bp, span) for bp, span in zip(bps, spans)]
    if jnp.ndim(idx) == 0:
        rec, g = lax.switch(idx, fns, outs, cts, known_ops, list(lres))
    else:  # a batched index (vmap of jr.cond): every branch, then each element's own
        per = [f(outs, cts, known_ops, list(lres)) for f in fns]
        rec = [_cf._select_cases(idx, [q[0][k] for q in per]) for k in range(len(per[0][0]))]
        g = [_cf._select_cases(idx, [q[1][k] for q in per]) for k in range(len(per[0][1]))]
    for v, val in zip([v for v, k in zip(ops, ok) if not k], rec):
        env.write(v, val)
    if want:
        for v, c in zip([v for v, a in zip(ops, act) if a], g):
            _acc(ctenv, v, c)


_sweeps: dict[Primitive, Callable[..., None]] = {prims.scan: _scan_sweep,
                                                 prims.while_: _while_sweep,
                                                 _cf.while_p: _while_sweep,
                                                 prims.cond: _cond_sweep,
                                                 _cf.cond_p: _cond_sweep}
"""Backward-walk rules for equations whose inverse is a program of its own (loops, conds):
``rule(plan, eqn_index, env, ctenv, active, residuals)``."""


# --------------------------------------------------------------------------- forward with residuals

def _forward(P: _Plan, args: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """Run `P`'s jaxpr forward; also return its residuals (in `_res_avals(P)` order)."""
    J = P.closed.jaxpr
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(J.constvars, P.closed.consts):
        env[v] = c
    for v, a in zip(J.invars, args):
        env[v] = a
    lres = {}
    for i, e in enumerate(J.eqns):
        ins = [read(v) for v in e.invars]
        lp = P.loops.get(i)
        if lp is None:
            outs = bind_eqn(e, ins)
        elif lp.kind == "scan":
            outs, lres[i] = _forward_scan(e, lp, ins)
        elif lp.kind == "cond":
            outs, lres[i] = _forward_cond(e, lp, ins)
        else:
            outs, lres[i] = _forward_while(e, ins)
        for o, val in zip(e.outvars, outs):
            if _is_var(o):
                env[o] = val
    res = [read(v) for v in P.store]
    for i in sorted(P.loops):
        res += lres[i]
    return [read(v) for v in J.outvars], res


def _forward_scan(e: JaxprEqn, lp: _LoopPlan, ins: Sequence[Any]):
    nc, ncar, _, length, rev = scan_info(e.params)
    consts, init, xs = ins[:nc], ins[nc:nc + ncar], ins[nc + ncar:]

    def f(c, x):
        outs, r = _forward(lp.body, [*consts, *c, *x])
        return outs[:ncar], (outs[ncar:], r)

    c, (ys, r) = lax.scan(f, list(init), list(xs), length=length, reverse=rev)
    return [*c, *ys], list(r)


def _forward_cond(e: JaxprEqn, lp: _LoopPlan, ins: Sequence[Any]):
    npc = e.params["post_nconsts"] if e.primitive is _cf.cond_p else 0
    index, ops = ins[0], ins[1 + npc:]
    avals = _loop_avals(lp)

    def branch(b, span):
        def f(ops):
            outs, r = _forward(lp.branches[b], ops)
            res = [jnp.zeros(a.shape, a.dtype) for a in avals]
            res[span[0]:span[1]] = r
            return outs, res
        return f

    fns = [branch(b, span) for b, span in enumerate(_branch_slices(lp))]
    index = jnp.clip(index, 0, len(fns) - 1)
    if jnp.ndim(index) == 0:
        outs, res = lax.switch(index, fns, list(ops))
        return list(outs), list(res)
    per = [f(list(ops)) for f in fns]  # a batched index (a vmapped jr.cond)
    pick = lambda k, j: _cf._select_cases(index, [q[k][j] for q in per])  # noqa: E731
    return ([pick(0, j) for j in range(len(per[0][0]))],
            [pick(1, j) for j in range(len(per[0][1]))])


def _forward_while(e: JaxprEqn, ins: Sequence[Any]):
    """The loop, counting its iterations. A vmapped `lax.while_loop` has one predicate per
    element (JAX masks finished elements when lowering it): each element keeps its own count."""
    p = e.params
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, init = ins[:ncc], ins[ncc:ncc + nbc], ins[ncc + nbc:]

    def pred(c):
        return eval_closed(p["cond_jaxpr"], *cc, *c)[0]

    def body(s):
        n, c = s
        go = pred(c)
        new = eval_closed(p["body_jaxpr"], *bc, *c)
        if jnp.ndim(go) == 0:
            return n + 1, new
        return n + go.astype(jnp.int32), [_cf._select(go, a, b) for a, b in zip(new, c)]

    n0 = jnp.zeros(tuple(p["cond_jaxpr"].out_avals[0].shape), jnp.int32)
    n, c = lax.while_loop(lambda s: jnp.any(pred(s[1])), body, (n0, list(init)))
    return list(c), [n]


# --------------------------------------------------------------------------- the primitives

def _rev_impl(*args, jaxpr, state, store):
    if not store:
        return eval_closed(jaxpr, *args)
    outs, res = _forward(_top_plan(jaxpr, state), args)
    return [*outs, *res]


def _rev_abstract(*avals, jaxpr, state, store):
    outs = list(jaxpr.out_avals)
    if store:
        outs += [ShapedArray(a.shape, a.dtype) for a in _res_avals(_top_plan(jaxpr, state))]
    return outs


def _rev_jvp(primals, tangents, *, jaxpr, state, store):
    if store:  # forward mode of the run that also returns residuals: a plain JVP
        f = partial(_rev_impl, jaxpr=jaxpr, state=state, store=True)
        return jax.jvp(f, tuple(primals), instantiate_tangents(primals, tangents))
    nz = tuple(not is_symbolic_zero(t) for t in tangents)
    outs = reversible_p.bind(*primals, jaxpr=jaxpr, state=state, store=True)
    n = len(jaxpr.out_avals)
    ys, res = outs[:n], outs[n:]
    params = [p for p, s in zip(primals, state) if not s]
    tans = [t for t, z in zip(tangents, nz) if z]
    out_t = reversible_lin_p.bind(*ys, *res, *params, *tans, jaxpr=jaxpr, state=state, nz=nz,
                                  nres=len(res))
    return ys, out_t


def _vmapped(fun, args, dims):
    size, args, in_axes = batch_front(args, dims)
    outs = jax.vmap(fun, in_axes=in_axes, axis_size=size)(*args)
    return outs, [0] * len(outs)


def _rev_batch(args, dims, *, jaxpr, state, store):
    if store:  # the forward run of a linearization: its residuals keep the unbatched plan
        return _vmapped(partial(_rev_impl, jaxpr=jaxpr, state=state, store=True), args, dims)
    size, args, in_axes = batch_front(args, dims)
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in args]
    bj, consts, _ = trace_to_closed(
        jax.vmap(lambda *a: eval_closed(jaxpr, *a), in_axes=in_axes, axis_size=size), *avals)
    outs = reversible_p.bind(*consts, *args, jaxpr=bj, state=(False,) * len(consts) + state,
                             store=False)
    return outs, [0] * len(outs)


reversible_p.def_impl(_rev_impl)
reversible_p.def_abstract_eval(_rev_abstract)
register_lowering(reversible_p, lower_fun(_rev_impl, multiple_results=True))
primitive_jvps[reversible_p] = _rev_jvp
primitive_batchers[reversible_p] = _rev_batch


def _lin_split(args, jaxpr, state, nres):
    n = len(jaxpr.out_avals)
    npar = sum(not s for s in state)
    return (args[:n], args[n:n + nres], args[n + nres:n + nres + npar],
            args[n + nres + npar:])


def _top_env(P: _Plan, state, params, ys) -> Env:
    return _seed_env(P, [not s for s in state], params, [True] * len(ys), ys)


def _lin_impl(*args, jaxpr, state, nz, nres):
    """J·t at the point whose outputs and residuals are given: rebuild the inputs, then JVP."""
    ys, res, params, tans = _lin_split(args, jaxpr, state, nres)
    P = _top_plan(jaxpr, state)
    env = _top_env(P, state, params, ys)
    _walk(P, env, None, set(), _Res(P, res), [])
    J = P.closed.jaxpr
    xs = [env.read(v) if env.known(v) else jnp.zeros(v.aval.shape, v.aval.dtype)
          for v in J.invars]
    it = iter(tans)
    ts = [next(it) if z else None for z in nz]
    _, out_t = jax.jvp(lambda *a: eval_closed(jaxpr, *a), tuple(xs), instantiate_tangents(xs, ts))
    return list(out_t)


def _lin_abstract(*avals, jaxpr, state, nz, nres):
    return [a.to_tangent_aval() for a in jaxpr.out_avals]


def _lin_transpose(cts, *args, jaxpr, state, nz, nres):
    ys, res, params, tans = _lin_split(args, jaxpr, state, nres)
    P = _top_plan(jaxpr, state)
    J = P.closed.jaxpr
    env = _top_env(P, state, params, ys)
    ctenv: dict = {}
    for v, c in zip(J.outvars, cts):
        if not is_symbolic_zero(c):
            _acc(ctenv, v, c)
    active = {v for v, z in zip(J.invars, nz) if z}
    _walk(P, env, ctenv, active, _Res(P, res), [])
    in_cts = [_get_ct(ctenv, v) for v, z in zip(J.invars, nz) if z]
    return [None] * (len(args) - len(tans)) + in_cts


def _lin_jvp(primals, tangents, **params):
    return jax.jvp(partial(_lin_impl, **params), tuple(primals), instantiate_tangents(primals, tangents))


def _lin_batch(args, dims, **params):
    return _vmapped(partial(_lin_impl, **params), args, dims)


reversible_lin_p.def_impl(_lin_impl)
reversible_lin_p.def_abstract_eval(_lin_abstract)
register_lowering(reversible_lin_p, lower_fun(_lin_impl, multiple_results=True))
primitive_transposes[reversible_lin_p] = _lin_transpose
primitive_jvps[reversible_lin_p] = _lin_jvp
primitive_batchers[reversible_lin_p] = _lin_batch


# --------------------------------------------------------------------------- public API

def _bind_reversible(fun: Callable, args: Sequence[Any], argnums: int | Sequence[int]):
    nums = _normalize_argnums(argnums, len(args), fun)
    closed, flat, state_ids, out_shape = _trace_program(fun, args, nums)
    s_tree = _check_structure(fun, args, nums, out_shape, who="jaxrev.reversible")
    state_pos = {i for ids in state_ids for i in ids}
    j, consts = hoist_consts(closed)
    state = (False,) * len(consts) + tuple(i in state_pos for i in range(len(flat)))
    operands = [*consts, *[jnp.asarray(x) for x in flat]]
    return j, state, operands, s_tree


def reversible(fun: Callable, argnums: int | Sequence[int] = 0) -> Callable:
    """`fun` with a reverse-mode derivative that rebuilds intermediates by running backwards.

    `fun(*args)` must return the structure, shapes and dtypes of the state `args[argnums]`
    (as for `reverse`). Gradients with respect to every argument (state and parameters) rebuild
    each step's inputs from its outputs instead of storing them, so memory does not grow with
    loop iterations or unrolled blocks; steps that lose information store just what they lose
    (see `memory_report`). Composes with `jit`, `vmap`, `grad`, `jvp` and `hessian`.

    Example:
        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> def step(xy, th):
        ...     x, y = xy
        ...     x = x + jnp.tanh(th * y)
        ...     return x, y + jnp.sin(x)
        >>> loop = lambda xy, th: jax.lax.fori_loop(0, 100, lambda i, s: step(s, th), xy)
        >>> f = jr.reversible(loop)
        >>> g = jax.grad(lambda th: f((jnp.ones(3), jnp.zeros(3)), th)[1].sum())(0.5)
        >>> bool(jnp.isfinite(g))
        True
    """

    @wraps(fun)
    def wrapped(*args: Any) -> Any:
        j, state, operands, s_tree = _bind_reversible(fun, args, argnums)
        outs = reversible_p.bind(*operands, jaxpr=j, state=state, store=False)
        return jax.tree_util.tree_unflatten(s_tree, outs)

    wrapped.__name__ = f"reversible({getattr(fun, '__name__', 'fun')})"
    return wrapped


# --------------------------------------------------------------------------- memory_report

class MemoryReport:
    """What `reversible` stores, listed with bytes and the source line that forces each value.

    `entries` is a list of dicts: `what`, `shape`, `dtype`, `bytes` (per store), `count` (how many
    times it is stored: the iterations of the loops around it), `where` (the user's file:line and
    the primitive that needs it), `made` (the step that computes the value, where it has one).
    `total_bytes` sums bytes × count.
    """

    def __init__(self, entries: list[dict], name: str) -> None:
        self.entries = entries
        self.name = name

    @property
    def total_bytes(self) -> int:
        return int(sum(e["bytes"] * e["count"] for e in self.entries))

    def __str__(self) -> str:
        if not self.entries:
            return f"reversible({self.name}) stores nothing beyond its inputs and outputs."
        lines = [f"reversible({self.name}) stores {self.total_bytes} bytes:"]
        for e in self.entries:
            per = (f"{e['bytes']} B per iteration x {e['count']}" if e["count"] != 1
                   else f"{e['bytes']} B per call")
            made = e.get("made") or ""
            made = f"; {made}" if made.startswith("an input") else (
                f"; computed by {made}" if made else "")
            lines.append(f"  {e['what']} {e['dtype']}{list(e['shape'])}: {per}  "
                         f"(needed by {e['where']}{made})")
        return "\n".join(lines)

    __repr__ = __str__


def _describe(eqn: JaxprEqn | None) -> str:
    if eqn is None:
        return "value not used by the output"
    _, _, summary = user_source(eqn)
    return f"`{eqn.primitive.name}` at {summary}"


def _report_entries(P: _Plan, count: int, out: list[dict]) -> None:
    producer = {o: e for e in P.closed.jaxpr.eqns for o in e.outvars if _is_var(o)}
    for v in P.store:
        nbytes = int(np.prod(v.aval.shape, dtype=np.int64)) * np.dtype(v.aval.dtype).itemsize
        why = P.why.get(v)
        what = P.labels.get(v) or (
            "branch index of a cond" if why is not None and why.primitive is prims.cond
            else "value a lossy step cannot rebuild")
        out.append(dict(what=what, shape=tuple(v.aval.shape),
                        dtype=str(v.aval.dtype), bytes=nbytes, count=count,
                        where=_describe(P.why.get(v)),
                        made=(_describe(producer[v]) if v in producer
                              else "an input of the function or loop body")))
    eqns = P.closed.jaxpr.eqns
    for i in sorted(P.loops):
        lp = P.loops[i]
        if lp.kind == "while":
            size = int(np.prod(lp.count_shape, dtype=np.int64))
            out.append(dict(what="trip count of a while loop", shape=lp.count_shape,
                            dtype="int32", bytes=4 * size, count=count,
                            where=_describe(eqns[i]), made=_describe(eqns[i])))
        elif lp.kind == "cond":
            for bp in lp.branches:
                _report_entries(bp, count, out)
        else:
            _report_entries(lp.body, count * lp.length, out)


def memory_report(fun: Callable, *args: Any, argnums: int | Sequence[int] = 0) -> MemoryReport:
    """List what `reversible(fun, argnums)` stores for its gradient, beyond inputs and outputs.

    Example:
        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jax.lax.fori_loop(0, 10, lambda i, x: jax.nn.relu(x) + 1.0, x)
        >>> rep = jr.memory_report(f, jnp.ones(4))
        >>> [(e["count"], e["where"].split()[0]) for e in rep.entries]  # how often, what step
        [(1, '`scan`'), (10, '`max`')]
    """
    j, state, operands, _ = _bind_reversible(fun, args, argnums)
    P = _top_plan(j, state)
    entries: list[dict] = []
    _report_entries(P, 1, entries)
    return MemoryReport(entries, getattr(fun, "__name__", "fun"))


# =========================================================================== check_reversible

@dataclass
class ReversibilityReport:
    """Round-trip error of `reverse(fun)(fun(x))` against `x`.

    `max_error` is the largest relative (max-norm) error over the state leaves; `leaf_errors`
    lists them all; `worst` names the equation and source line whose inversion added the most
    error (None when the round trip is exact).
    """

    max_error: float
    leaf_errors: list[float]
    worst: str | None
    steps: list[tuple[float, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"round-trip relative error: {self.max_error:.3e} "
                 f"(per state leaf: {', '.join(f'{e:.2e}' for e in self.leaf_errors)})"]
        if self.worst is not None:
            lines.append(f"error grows most at: {self.worst}")
        for err, where in self.steps[:5]:
            lines.append(f"  {err:.2e} added by {where}")
        return "\n".join(lines)


def _rel_err(a: Any, b: Any) -> float:
    a = np.asarray(a, dtype=np.complex128 if np.iscomplexobj(a) else np.float64)
    b = np.asarray(b, dtype=a.dtype)
    if a.size == 0:
        return 0.0
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    scale = max(float(np.max(np.abs(b))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(a - b))) / scale


def check_reversible(fun: Callable, *args: Any, argnums: int | Sequence[int] = 0,
                     rtol: float | None = None) -> ReversibilityReport:
    """Run `fun` forward and `reverse(fun)` backward on `args` and report the drift.

    Raises `ReversibilityError` when `rtol` is given and the relative error exceeds it. Runs
    eagerly (values are compared equation by equation to find where the error grows).

    Example:
        >>> import jax.numpy as jnp, jaxrev as jr
        >>> rep = jr.check_reversible(lambda x: jnp.exp(x) * 3.0, jnp.linspace(0.0, 1.0, 5))
        >>> rep.max_error < 1e-6
        True
    """
    nums = _normalize_argnums(argnums, len(args), fun)
    y = fun(*args)
    outs = (y,) if len(nums) == 1 else tuple(y)
    inv_args = list(args)
    for a, o in zip(nums, outs):
        inv_args[a] = o
    events: list[tuple[Any, list[Var]]] = []
    state, jaxpr, inv_env = _invert_call(fun, tuple(inv_args), nums,
                                         on_invert=lambda e, vs: events.append((e, vs)))
    x_true = args[nums[0]] if len(nums) == 1 else tuple(args[a] for a in nums)
    leaf_errors = [_rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(state),
                                                  jax.tree_util.tree_leaves(x_true))]
    # forward values of every variable, to see where the backward run drifts
    fwd = Env()
    flat_args = jax.tree_util.tree_leaves(tuple(args))
    for v, x in zip(jaxpr.invars, flat_args):
        fwd.write(v, x)
    inv_consts = {v: inv_env.read(v) for v in jaxpr.constvars}
    for v, c in inv_consts.items():
        fwd.write(v, c)
    propagate(jaxpr, fwd, list(v for v in jaxpr.outvars if isinstance(v, Var)),
              forward_only=True)
    steps = []
    for eqn, wrote in events:
        err_in = max((_rel_err(inv_env.read(v), fwd.read(v)) for v in wrote if fwd.known(v)),
                     default=0.0)
        err_out = max((_rel_err(inv_env.read(v), fwd.read(v)) for v in eqn.outvars
                       if isinstance(v, Var) and inv_env.known(v) and fwd.known(v)), default=0.0)
        _, _, summary = user_source(eqn)
        steps.append((err_in - err_out, f"`{eqn.primitive.name}` at {summary}"))
    steps = sorted((s for s in steps if s[0] > 0), key=lambda s: -s[0])
    worst = steps[0][1] if steps and steps[0][0] > 0 else None
    rep = ReversibilityReport(max(leaf_errors, default=0.0), leaf_errors, worst, steps)
    if rtol is not None and rep.max_error > rtol:
        raise ReversibilityError(f"round trip exceeds rtol={rtol:g}\n{rep}")
    return rep
