"""Every jaxrev rule of the branches, in one block each: `lax.cond` / `lax.switch` and
`jr.cond`'s primitive (NiLang's branch with a post condition; the public `jr.cond` that binds
it is in `transforms/control_flow.py`).

A plain `lax.cond` forgets which branch it took: `reverse` needs its index known (computed from
parameters), and `reversible` rebuilds it like any value or stores it (four bytes). `jr.cond`
keeps its post condition in the jaxpr (the primitive `jaxrev_cond`, lowered through
`lax.switch`), so the backward run picks the branch from the outputs. A batched index (under
`vmap`) runs every branch and keeps each element's own: `_jaxpr.switch_batched` does that for
every rule here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._batching import instantiate_tangents, move_batch, switch_batched, vmap_closed
from jaxrev._compat import (
    ClosedJaxpr,
    JaxprEqn,
    cond_branches,
    is_concrete,
    is_host_callback,
    literal,
    prims,
)
from jaxrev._env import Env, is_unknown
from jaxrev._evaluate import eval_closed
from jaxrev._graph import is_var, needed_vars
from jaxrev._prepare import prepare
from jaxrev._primitive import make_primitive
from jaxrev.transforms.propagation.walker import RuleContext, invert_jaxpr, static_hints
from jaxrev.transforms.registry import ChoiceRule, NeedMore, define
from jaxrev.transforms.sweep import drift
from jaxrev.transforms.sweep.backward import (
    LoopPlan,
    Plan,
    Residuals,
    acc,
    branch_slices,
    forward_with_residuals,
    get_ct,
    is_float,
    known_or_rebuilt,
    loop_avals,
    outs_known,
    plan_for,
    res_avals,
    seed_env,
    walk,
    zero_ct,
)

__all__ = ["cond_p"]


# --------------------------------------------------------------------------- shared rules


def _unread(branches: Sequence[ClosedJaxpr], ks: Sequence[int]) -> list[int]:
    """The operands among `ks` that some branch does not read: no branch can rebuild them."""
    needed = [needed_vars(b.jaxpr, b.jaxpr.outvars) for b in branches]
    return [k for k in ks if not all(b.jaxpr.invars[k] in n for b, n in zip(branches, needed))]


def _switch_inverse(
    index: Any,
    branches: Sequence[ClosedJaxpr],
    ins: Sequence[Any],
    outs: Sequence[Any],
    ctx: RuleContext,
) -> list[Any]:
    """Invert `switch(index, branches, *ins) == outs` for the unknown `ins` (`ctx`: the cond
    rule's context, whose walk the branches' walks inherit)."""
    unknown = [k for k, x in enumerate(ins) if is_unknown(x)]
    if is_concrete(index) and np.ndim(index) == 0:
        # (the branch taken is all there is: another may drop an operand, or raise)
        branches = [branches[min(max(int(index), 0), len(branches) - 1)]]
        index = np.int32(0)
    fails = [_never_returns(b) for b in branches]
    if all(fails):
        raise NeedMore("every branch of the cond raises")
    unused = _unread([b for b, f in zip(branches, fails) if not f], unknown)
    if unused:  # a branch drops it (JAX forwards a leaf a branch passes through around the cond)
        raise NeedMore(
            f"operands {unused} of the cond do not reach every branch's output: they "
            "must be known from elsewhere"
        )
    known_vals = [x for x in ins if not is_unknown(x)]
    # of several unknown operands, one a branch needs may come by another route (an operand
    # JAX forwarded around the cond, recovered later by a choice group): the walk tries again
    # (an unknown output never gets here: both callers ask for their outputs first)
    more = len(unknown) > 1
    off = len(ctx.eqn.invars) - len(ins)  # the branches' operands: the cond's last len(ins)
    hints = static_hints(len(ins), lambda k: ctx.static(off + k))

    def inv_branch(b, fails):
        def f(outs_, known_):
            if fails:  # the program raised there: nothing to recover (NaN, never a value)
                return [
                    jnp.full(ins[k].aval.shape, jnp.nan, ins[k].aval.dtype)
                    if jnp.issubdtype(ins[k].aval.dtype, jnp.inexact)
                    else jnp.zeros(ins[k].aval.shape, ins[k].aval.dtype)
                    for k in unknown
                ]
            it = iter(known_)
            ins_ = [x if is_unknown(x) else next(it) for x in ins]
            rec = invert_jaxpr(b, ins_, list(outs_), hints, ctx=ctx, more_may_follow=more)
            return [rec[k] for k in unknown]

        return f

    rec = switch_batched(
        index, [inv_branch(b, f) for b, f in zip(branches, fails)], list(outs), known_vals
    )
    res: list[Any] = [None] * len(ins)
    for k, r in zip(unknown, rec):
        res[k] = r
    return res


def _cond_sweep(P: Plan, i: int, env: Env, ctenv: dict | None, active: set, res: Residuals) -> None:
    """A cond runs backwards through the branch it took: `lax.cond`'s index is rebuilt like
    any value (a comparison cannot be inverted, so it is stored: four bytes); `jr.cond`'s
    comes from its post condition."""
    e = P.closed.jaxpr.eqns[i]
    ours = e.primitive is cond_p
    index, rest = e.invars[0], e.invars[1:]
    npc = e.params["post_nconsts"] if ours else 0
    pc, ops = rest[:npc], rest[npc:]
    known_or_rebuilt(P, i, env, pc, res)
    outs_known(P, i, env, e.outvars, res)
    if not env.known(index):
        if ours:
            took = eval_closed(
                e.params["post_jaxpr"],
                *[env.read(v) for v in pc],
                *[env.read(v) for v in e.outvars],
            )[0]
            env.write(index, lax.convert_element_type(took, jnp.int32))
        else:
            known_or_rebuilt(P, i, env, [index], res)
    branches = cond_branches(e.params)
    # an operand a branch does not read (a loop counter one branch uses) comes from the
    # equations before the cond (the counter's increment, inverted), else it is stored
    # a branch that raises (Equinox's `error_if`) never ran where the backward run arrives:
    # it needs nothing rebuilt or stored, and gives NaN
    fails = [_never_returns(b) for b in branches]
    unread = _unread(
        [b for b, f in zip(branches, fails) if not f],
        [k for k, v in enumerate(ops) if is_var(v) and not env.known(v)],
    )
    known_or_rebuilt(P, i, env, [ops[k] for k in unread], res)
    ok = tuple(env.known(v) for v in ops)
    nout = len(e.outvars)
    hints = static_hints(len(ops), lambda k: env.info.static(ops[k]))
    bps = [
        Plan(prepare(b), dial=P.dial)
        if f
        else plan_for(b, ok, (True,) * nout, tuple(not k for k in ok), hints, P.dial)
        for b, f in zip(branches, fails)
    ]
    lp = LoopPlan("cond", None, branches=bps)
    lres = res.loop(i, lp) if any(res_avals(bp) for bp in bps) else []
    spans = branch_slices(lp)
    want = ctenv is not None
    act = [is_var(v) and v in active for v in ops] if want else None
    outs = [env.read(v) for v in e.outvars]
    cts = [ctenv.pop(v, None) if want else None for v in e.outvars] if want else []
    cts = [c if c is not None else zero_ct(v.aval) for c, v in zip(cts, e.outvars)]
    known_ops = [env.read(v) for v, k in zip(ops, ok) if k]

    def branch_fn(bp, span, fails):
        def f(outs, cts, known_ops, lres):
            J = bp.closed.jaxpr
            benv = seed_env(bp, ok, known_ops, (True,) * nout, outs, env.ctx)
            bct = None
            bactive: set = set()
            if want:
                bct = {}
                bactive = {v for v, a in zip(J.invars, act) if a}
                for v, g in zip(J.outvars, cts):
                    if is_float(v.aval):
                        acc(bct, v, g)
            goals = [v for v, k in zip(J.invars, ok) if not k]
            with drift.scope(env.ctx.drift) as sc:
                if fails:
                    for v in goals:
                        benv.write(
                            v,
                            jnp.full(v.aval.shape, jnp.nan, v.aval.dtype)
                            if is_float(v.aval)
                            else jnp.zeros(v.aval.shape, v.aval.dtype),
                        )
                else:
                    walk(bp, benv, bct, bactive, Residuals(bp, lres[span[0] : span[1]]), goals)
            rec = [benv.read(v) for v in goals]
            g = [get_ct(bct, v) for v, a in zip(J.invars, act) if a] if want else []
            return rec, g, sc.worst() or drift.no_drift()

        return f

    fns = [branch_fn(bp, span, f) for bp, span, f in zip(bps, spans, fails)]
    idx = env.read(index)
    rec, g, w = switch_batched(idx, fns, outs, cts, known_ops, list(lres))
    if jnp.ndim(idx) == 0:  # a batched index runs every branch on every element: a branch's
        drift.note(env.ctx.drift, w)  # comparisons then mix elements that did not take it

    for v, val in zip([v for v, k in zip(ops, ok) if not k], rec):
        env.write(v, val)
    if want:
        for v, c in zip([v for v, a in zip(ops, act) if a], g):
            acc(ctenv, v, c)


def _cond_forward(e: JaxprEqn, lp: LoopPlan, ins: Sequence[Any]) -> tuple[list, list]:
    """Run the branch taken, returning every branch's residual slots (zeros where not taken)."""
    npc = e.params["post_nconsts"] if e.primitive is cond_p else 0
    index, ops = ins[0], ins[1 + npc :]
    avals = loop_avals(lp)

    def branch(b, span):
        def f(ops):
            outs, r = forward_with_residuals(lp.branches[b], ops)
            res = [jnp.zeros(a.shape, a.dtype) for a in avals]
            res[span[0] : span[1]] = r
            return outs, res

        return f

    fns = [branch(b, span) for b, span in enumerate(branch_slices(lp))]
    outs, res = switch_batched(index, fns, list(ops))
    return list(outs), list(res)


# --------------------------------------------------------------------------- lax.cond


def _lax_cond_inverse(outs, index, *ins, ctx: RuleContext, **params):
    if is_unknown(index):
        raise NeedMore(
            "the branch taken depends on the unknown state",
            hint="Ways out: use `jr.cond(pred, true_fun, false_fun, *operands, "
            "post=...)`, whose post condition tells the backward run which "
            "branch ran.",
        )
    if any(is_unknown(o) for o in outs):
        raise NeedMore("some outputs of the branch are unknown")
    return [None] + _switch_inverse(index, cond_branches(params), ins, outs, ctx)


def _cond_count(eqn: JaxprEqn, known: Any) -> int:
    return 0 if known(eqn.invars[0]) else len(cond_branches(eqn.params))


def _cond_branch(eqn: JaxprEqn, k: int) -> JaxprEqn:
    """The cond with its index fixed to `k`: its inverse rule inverts that branch."""
    index = eqn.invars[0]
    return eqn.replace(
        invars=[literal(np.asarray(k, index.aval.dtype), index.aval), *eqn.invars[1:]]
    )


def _cond_fails(eqn: JaxprEqn, k: int) -> bool:
    """Whether branch `k` is a failure: its outputs come from host callbacks alone, reading
    none of its operands (Equinox's `error_if` / `branched_error_if`: the branch's callback
    raises, and its outputs are stand-ins of the right shape). The program never returns
    through it, so an output was made by another branch; consistency still checks, from the
    recovered operands, that the index picks the branch inverted."""
    return _never_returns(cond_branches(eqn.params)[k])


def _never_returns(branch: ClosedJaxpr) -> bool:
    """A branch whose outputs come from host callbacks alone, reading none of its operands
    (see `_cond_fails`)."""
    b = branch.jaxpr
    if not any(is_host_callback(e.primitive) for e in b.eqns):
        return False
    return not (needed_vars(b, b.outvars) & set(b.invars))


def _cond_holds(eqn: JaxprEqn, ins: list, k: int) -> Any:
    n = len(cond_branches(eqn.params))
    return jnp.clip(jnp.asarray(ins[0]), 0, n - 1) == k


# a cond whose index the state computes inverts by consistency (`choices`), one branch at a time
define(
    prims.cond,
    inverse=_lax_cond_inverse,
    sweep=_cond_sweep,
    forward=_cond_forward,
    choice=ChoiceRule(_cond_count, _cond_branch, _cond_holds, _cond_fails),
    walks=True,
)


# ----------------------------------------------------------------------- jr.cond's primitive


def _cond_impl(index, *args, branches, post_jaxpr, post_nconsts):
    return list(
        switch_batched(index, [partial(eval_closed, b) for b in branches], *args[post_nconsts:])
    )


def _cond_jvp(primals, tangents, **params):
    index, *ops = primals
    return jax.jvp(
        lambda *o: _cond_impl(index, *o, **params),
        tuple(ops),
        instantiate_tangents(ops, tangents[1:]),
    )


def _cond_batch(args, dims, *, branches, post_jaxpr, post_nconsts):
    size = next(jnp.shape(a)[d] for a, d in zip(args, dims) if d is not None)
    index_batched = dims[0] is not None
    moved = [
        move_batch(a, d, size, force=index_batched and i > post_nconsts)
        for i, (a, d) in enumerate(zip(args, dims))
    ]
    vals = [m[0] for m in moved]
    axes = [m[1] for m in moved]
    ops, op_axes = vals[1 + post_nconsts :], axes[1 + post_nconsts :]
    pc, pa = vals[1 : 1 + post_nconsts], axes[1 : 1 + post_nconsts]
    new_branches = tuple(vmap_closed(b, op_axes, ops) for b in branches)
    out_avals = new_branches[0].out_avals
    post = vmap_closed(
        post_jaxpr,
        pa + [0] * len(out_avals),
        pc + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals],
    )
    out = cond_p.bind(
        vals[0], *pc, *ops, branches=new_branches, post_jaxpr=post, post_nconsts=post_nconsts
    )
    return out, [0] * len(out)


def _cond_inverse(outs, index, *ins, ctx: RuleContext, branches, post_jaxpr, post_nconsts):
    pc, ops = ins[:post_nconsts], ins[post_nconsts:]
    if any(is_unknown(c) for c in pc) or any(is_unknown(o) for o in outs):
        raise NeedMore("the post condition's constants or the outputs are not known yet")
    if is_unknown(index):
        took_true = eval_closed(post_jaxpr, *pc, *outs)[0]
        index = lax.convert_element_type(took_true, jnp.int32)
    return [None] + [None] * post_nconsts + _switch_inverse(index, branches, ops, outs, ctx)


cond_p = make_primitive(
    "jaxrev_cond",
    multiple_results=True,
    impl=_cond_impl,
    abstract=lambda index, *avals, branches, **_: list(branches[0].out_avals),
    jvp=_cond_jvp,
    batch=_cond_batch,
)
define(cond_p, inverse=_cond_inverse, sweep=_cond_sweep, forward=_cond_forward, walks=True)
