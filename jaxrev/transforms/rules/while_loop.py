"""Every jaxrev rule of the while loops, in one block each: `lax.while_loop` and
`jr.while_loop`'s primitive (NiLang's loop with a post condition; the public `jr.while_loop`
that binds it is in `transforms/control_flow.py`).

A plain `lax.while_loop` forgets how many times it ran: where its condition reads counters
only (carries whose updates read nothing else, with known initial values), the trip count is
computed from them, and both `reverse` and `reversible` run it backwards from that; otherwise
`reverse` cannot, and `reversible`'s forward run counts its iterations. `jr.while_loop` keeps
its post condition in the jaxpr (the primitive `jaxrev_while`, lowered through
`lax.while_loop`), so the backward run decides from the outputs alone when to stop. Both are
swept backwards by one rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._batching import instantiate_tangents, move_batch, select_batched, vmap_closed, where
from jaxrev._compat import (
    JaxprEqn,
    any_over,
    prims,
    trace_to_closed,
    user_source,
    vary_to,
    vma_of,
    vma_union,
)
from jaxrev._env import Env, Unknown, is_unknown
from jaxrev._errors import not_invertible
from jaxrev._evaluate import eval_closed
from jaxrev._graph import bytes_of, is_var, needed_vars, restrict
from jaxrev._primitive import make_primitive
from jaxrev._program import avals_of
from jaxrev.transforms.knowledge.checks import raise_where
from jaxrev.transforms.propagation.walker import RuleContext, invert_jaxpr, static_hints
from jaxrev.transforms.registry import Lossy, NeedMore, define
from jaxrev.transforms.sweep import drift
from jaxrev.transforms.sweep.backward import (
    BodyWalk,
    LoopEnd,
    LoopPlan,
    Plan,
    Residuals,
    forward_with_residuals,
    known_or_rebuilt,
    loop_activity,
    loop_cts_in,
    loop_cts_out,
    n_checkpoints,
    outs_known,
    plan_for,
    res_avals,
    sds,
)
from jaxrev.transforms.sweep.dial import budget_dtype, segment_checks, weight
from jaxrev.transforms.sweep.segments import NO_SLICES

__all__ = ["while_p"]


# --------------------------------------------------------------------------- the backward sweep


def _while_sweep(
    P: Plan, i: int, env: Env, ctenv: dict | None, active: set, res: Residuals
) -> None:
    """`lax.while_loop` (the forward run stores its trip count) and `jr.while_loop` (its post
    condition says when to stop) both run backwards as a while loop over the inverted body."""
    e = P.closed.jaxpr.eqns[i]
    p = e.params
    ours = e.primitive is while_p
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    npc = p["post_nconsts"] if ours else 0
    ins = e.invars
    cc, bc, pc, init = (
        ins[:ncc],
        ins[ncc : ncc + nbc],
        ins[ncc + nbc : ncc + nbc + npc],
        ins[ncc + nbc + npc :],
    )
    known_or_rebuilt(P, i, env, [*cc, *bc, *pc], res)
    K = None if ours else counter_carries(p, [env.known(v) for v in init])
    if K is not None:
        # the trip count and the counters' final values follow from the counters: run them
        # forward, store nothing (not even a discarded counter)
        n, last = trip_count(
            p,
            [env.read(v) for v in cc],
            [env.read(v) for v in bc],
            {k: env.read(init[k]) for k in K},
        )
        for k, v in last.items():
            if is_var(e.outvars[k]) and not env.known(e.outvars[k]):
                env.write(e.outvars[k], v)
    outs_known(P, i, env, e.outvars, res)
    body = p["body_jaxpr"]
    ncar = len(init)
    bp = plan_for(
        body,
        (True,) * nbc + (False,) * ncar,
        (True,) * ncar,
        (False,) * nbc + (True,) * ncar,
        static_hints(nbc, lambda k: env.info.static(bc[k])),
        P.dial.inner(None if ours else P.dial.max_steps),
    )
    lp = None if ours else _stored_plan(P, e, bp)
    if res_avals(bp) and lp is None:
        v = bp.store[0] if bp.store else None
        blame = bp.why.get(v) or e
        raise not_invertible(
            blame,
            "a step in the body of a while loop loses information, and a while loop's "
            "iterations cannot be stored (its length is not known in advance)",
            "Ways out: pass `max_steps=N` to `jr.reversible` (the lost part is then stored per "
            "iteration, up to N), use `lax.scan` or a `fori_loop` with static bounds, whose "
            "iterations `reversible` can store, or make the step invertible.",
            who=env.ctx.who,
        )
    if lp is not None:
        _stored_sweep(P, i, env, ctenv, active, res, bp, lp)
        return
    want = ctenv is not None
    act = loop_activity([*bc, *init], active, nbc, ncar, body) if want else None
    bvals = [env.read(v) for v in bc]
    step = BodyWalk(bp, nbc, ncar, (), (), bvals, act, (), env.ctx)
    c0 = [env.read(v) for v in e.outvars]
    c_ct0, k_ct0 = loop_cts_in(ctenv, e.outvars, body, nbc, act)
    w0 = drift.no_drift()

    def bstep(go, c, c_ct, k_ct, w):
        return _masked_step(step, body, bvals, go, c, c_ct, k_ct, w, [])

    if ours:
        pvals = [env.read(v) for v in pc]

        def more(c):
            return eval_closed(p["post_jaxpr"], *pvals, *c)[0]

        c_first, c_first_ct, k_ct, w = lax.while_loop(
            lambda s: jnp.any(more(s[0])), lambda s: bstep(more(s[0]), *s), (c0, c_ct0, k_ct0, w0)
        )
    else:
        if K is None:
            count_shape = tuple(p["cond_jaxpr"].out_avals[0].shape)  # per element under vmap
            n = res.loop(i, LoopPlan("while", bp, count_shape=count_shape))[0]

        def back(s):
            k = s[0]
            return (k - (k > 0).astype(k.dtype), *bstep(k > 0, *s[1:]))

        _, c_first, c_first_ct, k_ct, w = lax.while_loop(
            lambda s: jnp.any(s[0] > 0), back, (n, c0, c_ct0, k_ct0, w0)
        )
    drift.note(env.ctx.drift, w)
    loop_cts_out(env, ctenv, LoopEnd(init, c_first, c_first_ct, bc, k_ct), act, nbc)


def _masked_step(
    step: BodyWalk,
    body: Any,
    bvals: Sequence[Any],
    go: Any,
    c: Sequence[Any],
    c_ct: Sequence[Any] | None,
    k_ct: Sequence[Any],
    w: tuple,
    res_t: Sequence[Any],
) -> tuple:
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
        c_in = [select_batched(go, a, b) for a, b in zip(c, ahead)]
        if c_ct is not None:
            c_ct_in = [
                None if g is None else select_batched(go, g, jnp.zeros_like(g)) for g in c_ct
            ]
    s = step(c_in, c_ct_in, [], [], [], res_t)
    if s.consts_ct is not None:
        k_ct = [a + b for a, b in zip(k_ct, s.consts_ct)]
    w = drift.combine(w, s.drift)
    if not batched:
        return s.carry, s.carry_ct, k_ct, w
    return (
        [select_batched(go, a, b) for a, b in zip(s.carry, c)],
        None
        if s.carry_ct is None
        else [None if a is None else select_batched(go, a, b) for a, b in zip(s.carry_ct, c_ct)],
        k_ct,
        w,
    )


def _stored_plan(P: Plan, e: JaxprEqn, bp: Plan) -> LoopPlan | None:
    """The plan of a `lax.while_loop` bounded by the dial's `max_steps`, when it stores
    anything: its body's residuals per iteration (a lossy body), checkpoints of its carry."""
    N = P.dial.max_steps
    if N is None:
        return None
    carry = tuple(sds(v.aval) for v in e.outvars)
    site = user_source(e)[2]
    K = P.dial.segment(N, bytes_of(carry), where=f" at {site}" if site else "")
    if not res_avals(bp) and K is None:
        return None
    return LoopPlan(
        "while",
        bp,
        every=K,
        carry=carry if K else (),
        max_steps=N,
        count_shape=tuple(e.params["cond_jaxpr"].out_avals[0].shape),
    )


def _stored_sweep(
    P: Plan,
    i: int,
    env: Env,
    ctenv: dict | None,
    active: set,
    res: Residuals,
    bp: Plan,
    lp: LoopPlan,
) -> None:
    """A bounded `lax.while_loop` run backwards from what its forward run stored: the trip
    count, the body's residuals per iteration, and (the dial) a checkpoint of the carry every
    K iterations, which replaces the rebuilt carry at each segment's start once compared with
    it (on_drift="repair": a segment that missed is recomputed from its checkpoint)."""
    e = P.closed.jaxpr.eqns[i]
    p = e.params
    nbc = p["body_nconsts"]
    bc = e.invars[p["cond_nconsts"] : p["cond_nconsts"] + nbc]
    body = p["body_jaxpr"]
    ncar = len(e.outvars)
    vals = res.loop(i, lp)
    nb = len(res_avals(bp))
    n, bufs, ck = vals[0], list(vals[1 : 1 + nb]), list(vals[1 + nb :])
    want = ctenv is not None
    act = (
        loop_activity([*bc, *e.invars[p["cond_nconsts"] + nbc :]], active, nbc, ncar, body)
        if want
        else None
    )
    bvals = [env.read(v) for v in bc]
    step = BodyWalk(bp, nbc, ncar, (), (), bvals, act, (), env.ctx)
    c0 = [env.read(v) for v in e.outvars]
    c_ct0, k_ct0 = loop_cts_in(ctenv, e.outvars, body, nbc, act)
    K = lp.every
    check, redo = (
        segment_checks(
            P.dial,
            env.ctx.drift,
            e,
            lp.carry,
            bp.closed,
            nbc,
            ncar,
            bvals,
            act,
            (),
            True,
            res.planning,
            sub=P.dial.sub_segment(lp.max_steps, K, bytes_of(lp.carry)),
        )
        if K is not None
        else (None, None)
    )

    def back(s):
        k, c, c_ct, k_ct, w, snap, B, tally = (
            s.count,
            s.carry,
            s.carry_ct,
            s.consts_ct,
            s.worst,
            s.snap,
            s.budget,
            s.tally,
        )
        t = k - 1
        c2, c_ct2, k_ct2, w = _masked_step(
            step,
            body,
            bvals,
            t < n,
            c,
            c_ct,
            k_ct,
            w,
            [lax.dynamic_index_in_dim(b, t, keepdims=False) for b in bufs],
        )
        if K is not None:
            start = t % K == 0
            ck_j = [lax.dynamic_index_in_dim(b, t // K, keepdims=False) for b in ck]
            if check is not None:
                # the budget, summed per iteration here
                w_t = weight(c_ct2 or [], c2)
                B = (B[0] + where((t < jnp.max(n)) & jnp.isfinite(w_t), w_t, 0.0), B[1])
                rho, at, B2 = check(
                    c2, ck_j, c_ct2 or [None] * len(c2), c2, c_ct2, K, B, accumulate=False
                )
                keep = ~start  # the drift's share counts at a segment's start, if kept
                if redo is not None:
                    bad = start & (~(rho <= 1.0) | ~drift.finite([*c_ct2, *k_ct2]))
                    # (inside shard_map: a repair every device of the mesh joins, as the
                    # segments' of a scan: `segments.segmented`'s `decided`)
                    bad = any_over(bad, vma_of(bad))
                    keep = keep | bad
                B = (B[0], where(keep, B[1], B2[1]))
                if redo is not None:
                    m = jnp.clip(n - t, 0, K)  # per element under vmap
                    c_ct2, k_ct2 = lax.cond(
                        bad,
                        lambda: redo(ck_j, snap[0], snap[1], NO_SLICES, K, None, m)[:2],
                        lambda: (c_ct2, k_ct2),
                    )
                    rho = where(bad, 0.0, rho)
                    # (per element under vmap: a segment any element recomputed, its most)
                    tally = (
                        tally[0] + jnp.any(bad).astype(jnp.int32),
                        tally[1] + jnp.max(where(bad, m, 0)).astype(jnp.int32),
                    )
                w = drift.combine(w, (where(start, rho, 0.0), at))
            c2 = [where(start, a, b) for a, b in zip(ck_j, c2)]
            if redo is not None:
                snap = jax.tree_util.tree_map(lambda a, b: where(start, a, b), (c_ct2, k_ct2), snap)
        return WhileBack(k - 1, c2, c_ct2, k_ct2, w, snap, B, tally)

    # inside shard_map the bookkeeping varies over every mesh axis the loop's values do:
    # typed so from the start (the while loop's carry keeps its types)
    axes = vma_union(c0, c_ct0, k_ct0, bvals, n, bufs, ck)
    w0 = vary_to(drift.no_drift(), axes)
    snap0 = (c_ct0, k_ct0) if redo is not None else ()
    B0 = vary_to((jnp.zeros((), budget_dtype()), jnp.zeros((), budget_dtype())), axes)
    tally0 = vary_to((jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)), axes)
    end = lax.while_loop(
        lambda s: s.count > 0,
        back,
        WhileBack(jnp.max(n), c0, c_ct0, k_ct0, w0, snap0, B0, tally0),
    )
    c_first, c_first_ct, k_ct, w = end.carry, end.carry_ct, end.consts_ct, end.worst
    drift.note(env.ctx.drift, w)
    if K is not None:  # (its length: the bound, `max_steps`)
        drift.tally(env.ctx.drift, e, lp.max_steps, K, *end.tally)
    init = e.invars[p["cond_nconsts"] + nbc :]
    loop_cts_out(env, ctenv, LoopEnd(init, c_first, c_first_ct, bc, k_ct), act, nbc)


class WhileBack(NamedTuple):
    """The backward run of a bounded while loop: its `lax.while_loop`'s carry (a pytree)."""

    count: Any  # iterations left to sweep
    carry: list  # the loop's carry, rebuilt
    carry_ct: list | None  # its cotangent
    consts_ct: list | None  # the constants' cotangents, accumulated
    worst: tuple  # the worst (ratio, site) so far
    snap: tuple  # (carry_ct, consts_ct) at the last segment's end: a repair restarts there
    budget: tuple  # the gradient budget (rounding, drift), summed per iteration
    tally: tuple  # (segments recomputed, the iterations they hold) so far


# --------------------------------------------------------------------------- lax.while_loop


def counter_carries(p: dict, known: Sequence[bool]) -> list[int] | None:
    """The carries that run forward from their initial values alone (`known`: which are known):
    those whose updates read only such carries and constants (counters, their bounds). When
    the condition reads only these, they give the trip count; None otherwise (and where the
    condition is per element: a vmapped loop)."""
    cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    if cj.out_avals[0].shape:
        return None
    bin_, bout = bj.jaxpr.invars[nbc:], bj.jaxpr.outvars
    reads = [{j for j, v in enumerate(bin_) if v in needed_vars(bj.jaxpr, [o])} for o in bout]
    K = {k for k, ok in enumerate(known) if ok}
    while True:
        keep = {k for k in K if reads[k] <= K}
        if keep == K:
            break
        K = keep
    need = needed_vars(cj.jaxpr, cj.jaxpr.outvars)
    if not K or any(v in need for k, v in enumerate(cj.jaxpr.invars[ncc:]) if k not in K):
        return None
    return sorted(K)


def trip_count(
    p: dict, cc: Sequence[Any], bc: Sequence[Any], init: dict[int, Any]
) -> tuple[Any, dict[int, Any]]:
    """How many times the loop runs, and the counters' final values, from the counter carries'
    initial values `init` alone (the other carries do not reach its condition: zeros)."""
    bj = p["body_jaxpr"]
    K = sorted(init)
    body = restrict(bj, K)
    avals = [v.aval for v in bj.jaxpr.invars[p["body_nconsts"] :]]

    def full(cK):
        c = [jnp.zeros(a.shape, a.dtype) for a in avals]
        for k, x in zip(K, cK):
            c[k] = x
        return c

    def step(s):
        return s[0] + 1, eval_closed(body, *bc, *full(s[1]))

    n, last = lax.while_loop(
        lambda s: eval_closed(p["cond_jaxpr"], *cc, *full(s[1]))[0],
        step,
        (jnp.zeros((), jnp.int32), [init[k] for k in K]),
    )
    return n, dict(zip(K, last))


def _lax_while_inverse(
    outs, *ins, ctx: RuleContext, cond_jaxpr, body_jaxpr, cond_nconsts, body_nconsts
):
    """Runs backwards when its counters give the trip count (`lax.fori_loop` with bounds known
    only when the program runs, a counted `while_loop`): the inverted body, that many times."""
    p = dict(
        cond_jaxpr=cond_jaxpr,
        body_jaxpr=body_jaxpr,
        cond_nconsts=cond_nconsts,
        body_nconsts=body_nconsts,
    )
    n = cond_nconsts + body_nconsts
    cc, bc, init = ins[:cond_nconsts], ins[cond_nconsts:n], ins[n:]
    K = counter_carries(p, [not is_unknown(x) for x in init])
    if K is None:
        raise Lossy(
            "a plain `lax.while_loop` whose condition reads the state does not record "
            "how many times it ran",
            "Ways out: use `jr.while_loop(cond_fun, body_fun, init_val, post_fun)`, whose "
            "post condition lets the backward run count the iterations, or a loop whose "
            "trip count follows from a counter.",
        )
    if any(is_unknown(c) for c in (*cc, *bc)) or any(
        is_unknown(o) for k, o in enumerate(outs) if k not in K
    ):
        raise NeedMore("the loop's constants or final values are not known yet")
    count, last = trip_count(p, cc, bc, {k: init[k] for k in K})
    outs = [last[k] if is_unknown(o) else o for k, o in enumerate(outs)]  # a discarded counter
    hints = static_hints(body_nconsts, lambda k: ctx.static(cond_nconsts + k))
    unknown = [Unknown(v.aval) for v in body_jaxpr.jaxpr.invars[body_nconsts:]]

    def back(_, c):
        return invert_jaxpr(body_jaxpr, [*bc, *unknown], list(c), hints, ctx=ctx)[body_nconsts:]

    first = lax.fori_loop(0, count, back, list(outs))
    return [None] * n + [None if not is_unknown(x) else f for x, f in zip(init, first)]


def _lax_while_forward(e: JaxprEqn, lp: LoopPlan, ins: Sequence[Any]) -> tuple[list, list]:
    """The loop, counting its iterations. A vmapped `lax.while_loop` has one predicate per
    element (JAX masks finished elements when lowering it): each element keeps its own count.
    Bounded by the dial's `max_steps`, it also stores its body's residuals per iteration and
    its carry every K iterations."""
    p = e.params
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    cc, bc, init = ins[:ncc], ins[ncc : ncc + nbc], ins[ncc + nbc :]

    def pred(c):
        return eval_closed(p["cond_jaxpr"], *cc, *c)[0]

    if lp.max_steps is not None:
        return _bounded_forward(e, lp, pred, bc, init)

    def body(s):
        n, c = s
        go = pred(c)
        new = eval_closed(p["body_jaxpr"], *bc, *c)
        if jnp.ndim(go) == 0:
            return n + 1, new
        return n + go.astype(jnp.int32), [select_batched(go, a, b) for a, b in zip(new, c)]

    n0 = jnp.zeros(tuple(p["cond_jaxpr"].out_avals[0].shape), jnp.int32)
    n, c = lax.while_loop(lambda s: jnp.any(pred(s[1])), body, (n0, list(init)))
    return list(c), [n]


def _bounded_forward(
    e: JaxprEqn, lp: LoopPlan, pred: Callable, bc: Sequence[Any], init: Sequence[Any]
) -> tuple[list, list]:
    N, K = lp.max_steps, lp.every
    # (inside shard_map: typed to vary as the values written into them do)
    axes = vma_union(init, bc)
    bufs = vary_to([jnp.zeros((N, *a.shape), a.dtype) for a in res_avals(lp.body)], axes)
    ck = vary_to([jnp.zeros((n_checkpoints(lp), *a.shape), a.dtype) for a in lp.carry], axes)

    def body(s):
        k, n, c, bufs, ck = s
        if K is not None:
            j = k // K
            ck = [
                b.at[j].set(where(k % K == 0, jnp.asarray(x, b.dtype), b[j])) for b, x in zip(ck, c)
            ]
        go = pred(c)
        outs, r = forward_with_residuals(lp.body, [*bc, *c])
        if jnp.ndim(go):  # under vmap: finished elements keep their values
            outs = [select_batched(go, a, b) for a, b in zip(outs, c)]
        return k + 1, n + go.astype(jnp.int32), outs, [b.at[k].set(x) for b, x in zip(bufs, r)], ck

    n0 = vary_to(jnp.zeros(lp.count_shape, jnp.int32), axes)
    k, n, c, bufs, ck = lax.while_loop(
        lambda s: (s[0] < N) & jnp.any(pred(s[2])),
        body,
        (jnp.zeros((), jnp.int32), n0, [jnp.asarray(x) for x in init], bufs, ck),
    )
    over = jnp.any(pred(c))
    # the loop stopped at its bound: no NaN would tell, so this raises under "nan" too (the
    # forward run of `reversible`: its dial holds the call's settings)
    st = lp.body.dial.walk
    raise_where(
        st.on_error,
        lambda o: (
            None
            if not o
            else not_invertible(
                e,
                f"the loop ran past max_steps={N} (its stored iterations)",
                "Ways out: raise `max_steps` in `jr.reversible`.",
                who=st.who,
            )
        ),
        over,
        bad=over,
        always=True,
    )
    return list(c), [n, *bufs, *ck]


define(
    prims.while_,
    inverse=_lax_while_inverse,
    sweep=_while_sweep,
    forward=_lax_while_forward,
    walks=True,
)


# ----------------------------------------------------------------------- jr.while_loop's primitive


def _while_split(
    args: Sequence[Any], cond_nconsts: int, body_nconsts: int, post_nconsts: int
) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any], Sequence[Any]]:
    """A `jaxrev_while`'s operands: (cond consts, body consts, post consts, carry)."""
    a, b, c = cond_nconsts, cond_nconsts + body_nconsts, cond_nconsts + body_nconsts + post_nconsts
    return args[:a], args[a:b], args[b:c], args[c:]


def _while_impl(
    *args, cond_jaxpr, body_jaxpr, post_jaxpr, cond_nconsts, body_nconsts, post_nconsts
):
    cc, bc, _, init = _while_split(args, cond_nconsts, body_nconsts, post_nconsts)

    def pred(c):
        return eval_closed(cond_jaxpr, *cc, *c)[0]

    def body(c):
        new = eval_closed(body_jaxpr, *bc, *c)
        p = pred(c)
        if jnp.ndim(p) == 0:
            return tuple(new)
        # batched predicate (after vmap): finished elements keep their value
        return tuple(select_batched(p, n, o) for n, o in zip(new, c))

    return list(lax.while_loop(lambda c: jnp.any(pred(c)), body, tuple(init)))


def _while_abstract(*avals, cond_nconsts, body_nconsts, post_nconsts, **_):
    return list(avals[cond_nconsts + body_nconsts + post_nconsts :])


def _while_jvp(primals, tangents, **params):
    return jax.jvp(
        partial(_while_impl, **params), tuple(primals), instantiate_tangents(primals, tangents)
    )


def _while_batch(
    args, dims, *, cond_jaxpr, body_jaxpr, post_jaxpr, cond_nconsts, body_nconsts, post_nconsts
):
    size = next(jnp.shape(a)[d] for a, d in zip(args, dims) if d is not None)
    n_consts = cond_nconsts + body_nconsts + post_nconsts
    moved = [
        move_batch(a, d, size, force=i >= n_consts) for i, (a, d) in enumerate(zip(args, dims))
    ]
    vals = [m[0] for m in moved]
    axes = [m[1] for m in moved]
    cc, bc, pc, carry = _while_split(vals, cond_nconsts, body_nconsts, post_nconsts)
    ca, ba, pa, cara = _while_split(axes, cond_nconsts, body_nconsts, post_nconsts)
    new = dict(
        cond_jaxpr=vmap_closed(cond_jaxpr, ca + cara, cc + carry),
        body_jaxpr=vmap_closed(body_jaxpr, ba + cara, bc + carry),
        post_jaxpr=vmap_closed(post_jaxpr, pa + cara, pc + carry),
        cond_nconsts=cond_nconsts,
        body_nconsts=body_nconsts,
        post_nconsts=post_nconsts,
    )
    out = while_p.bind(*vals, **new)
    return out, [0] * len(out)


def _while_inverse(
    outs,
    *ins,
    ctx: RuleContext,
    cond_jaxpr,
    body_jaxpr,
    post_jaxpr,
    cond_nconsts,
    body_nconsts,
    post_nconsts,
):
    """The backward loop is the same primitive with the roles of the conditions swapped: it
    runs the inverted body while the post condition holds."""
    n = cond_nconsts + body_nconsts + post_nconsts
    consts = ins[:n]
    if any(is_unknown(c) for c in consts) or any(is_unknown(o) for o in outs):
        raise NeedMore("the loop's constants or final values are not known yet")
    cc, bc, pc = (
        consts[:cond_nconsts],
        consts[cond_nconsts : cond_nconsts + body_nconsts],
        consts[cond_nconsts + body_nconsts :],
    )
    ncar = len(outs)

    off = cond_nconsts
    hints = static_hints(body_nconsts, lambda k: ctx.static(off + k))

    def inv_body(*a):
        b, c = a[:body_nconsts], a[body_nconsts:]
        rec = invert_jaxpr(
            body_jaxpr,
            [*b, *[Unknown(v.aval) for v in body_jaxpr.jaxpr.invars[body_nconsts:]]],
            list(c),
            hints,
            ctx=ctx,
        )
        return rec[body_nconsts:]

    ij, ic, _ = trace_to_closed(inv_body, *avals_of([*bc, *outs]))
    back = while_p.bind(
        *pc,
        *ic,
        *bc,
        *cc,
        *outs,
        cond_jaxpr=post_jaxpr,
        body_jaxpr=ij,
        post_jaxpr=cond_jaxpr,
        cond_nconsts=post_nconsts,
        body_nconsts=len(ic) + body_nconsts,
        post_nconsts=cond_nconsts,
    )
    return [None] * n + list(back[:ncar])


while_p = make_primitive(
    "jaxrev_while",
    multiple_results=True,
    impl=_while_impl,
    abstract=_while_abstract,
    jvp=_while_jvp,
    batch=_while_batch,
)
define(while_p, inverse=_while_inverse, sweep=_while_sweep, walks=True)
