"""A checkpointed loop's runs in segments (docs/design.md §3.8).

The forward run stores the carry at the start of every segment of K iterations
(`segmented_forward`); the backward run rebuilds each segment from the stored start of the
next (`segmented`), so drift grows over K steps, not the loop. Each segment is swept by the
fused step (inversion and VJP at once, the fully reversible mode's) and its rebuilt start
checked against its checkpoint; under the repairing dial, a miss makes a second sweep that
recomputes every segment forward from its checkpoint (`body_redo`): a loop that does not
drift pays one sweep.

Both runs read each iteration's inputs (`xs`, residuals, the loop's outputs' cotangents) from
the loop's own arrays by iteration number, and write each iteration's outputs into arrays of
the loop's length carried through the segments (`Slices`): nothing of the loop's length is
reversed, split into segments or concatenated. Those arrays are often the size of the
parameters (a stack of transformer blocks scanned over its stacked weights), and each such copy
is scratch memory that grows with depth. The step is traced once (`_Traced`) and its jaxpr
evaluated in the one loop that runs every segment of both sweeps: the loop's body is walked
once, and XLA compiles one copy of it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._batching import any_in_batch, select_batched, where
from jaxrev._compat import (
    any_over,
    match_vma,
    sds,
    trace_to_closed,
    vary_to,
    vma_of,
    vma_union,
    zeros_of,
)
from jaxrev._evaluate import eval_closed
from jaxrev._program import avals_of
from jaxrev.transforms.sweep import sums
from jaxrev.transforms.sweep.drift import Budget, budget_dtype, combine, finite

__all__ = [
    "Slices",
    "NO_SLICES",
    "StepInputs",
    "BackCarry",
    "SweepState",
    "Tally",
    "Pulled",
    "ForwardState",
    "segmented",
    "segmented_forward",
    "body_redo",
]


def _tmap(f: Any, *trees: Any) -> Any:
    return jax.tree_util.tree_map(f, *trees)


class Slices:
    """A loop's per-iteration arrays read, and per-iteration outputs written, by iteration
    number `t` (0 is the iteration that runs first), at their position in the arrays (`rev`: a
    `scan(..., reverse=True)`, whose first iteration reads the last row)."""

    def __init__(self, xs: Any, length: int, rev: bool, start: Any = 0) -> None:
        self.xs, self.length, self.rev, self.start = xs, length, rev, start

    def at(self, start: Any) -> Slices:
        """The same arrays, iteration numbers counted from `start` (one segment's view)."""
        return Slices(self.xs, self.length, self.rev, start)

    def pos(self, t: Any) -> Any:
        """The row of iteration t."""
        t = self.start + t
        return self.length - 1 - t if self.rev else t

    def read(self, t: Any) -> Any:
        """Iteration t's row of the per-iteration arrays."""
        row = self.pos(t)
        return _tmap(lambda a: lax.dynamic_index_in_dim(a, row, keepdims=False), self.xs)

    def write(self, bufs: Any, t: Any, outs: Any) -> Any:
        """`bufs` with iteration t's row set to `outs`."""
        row = self.pos(t)

        def put(buf, out):
            return lax.dynamic_update_index_in_dim(buf, out.astype(buf.dtype), row, 0)

        return _tmap(put, bufs, outs)


class StepInputs(NamedTuple):
    """One iteration's row of a loop's per-iteration arrays, as the backward step reads them
    (a scan's, `rules.scan`; a while loop's are all empty)."""

    ys: list  # the known outputs `ys`
    ys_ct: list  # the cotangents of the outputs that have one
    xs: list  # the known inputs `xs`
    res: list  # the body's residuals


NO_SLICES = Slices(StepInputs([], [], [], []), 0, False)
"""A while loop's: its body reads no per-iteration arrays and writes none."""


class _Traced:
    """`fun(*args)` traced once to a jaxpr (outer tracers it closes over hoisted to operands)
    and evaluated at each call: its out avals are known before any loop runs it (the buffers),
    and the loop body it walks is walked once however many segments and branches run it."""

    def __init__(self, fun: Callable, *args: Any) -> None:
        leaves, self.in_tree = jax.tree_util.tree_flatten(args)
        flat = lambda *xs: fun(*jax.tree_util.tree_unflatten(self.in_tree, xs))
        self.closed, self.consts, self.out_tree = trace_to_closed(flat, *avals_of(leaves))

    def __call__(self, *args: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        outs = eval_closed(self.closed, *self.consts, *leaves)
        return jax.tree_util.tree_unflatten(self.out_tree, outs)

    def out_buffers(self, length: int, axes: frozenset = frozenset()) -> Any:
        """Zeros for `length` iterations of its second output, typed (vma) as it is and at
        least over the mesh axes `axes`."""
        tree = self.out_tree.children()[1]
        avals = self.closed.out_avals[len(self.closed.out_avals) - tree.num_leaves :]
        bufs = [vary_to(zeros_of(sds(a, (length, *a.shape))), axes) for a in avals]
        return jax.tree_util.tree_unflatten(tree, bufs)


class BackCarry(NamedTuple):
    """A loop's backward step's carry (`segmented`'s `bstep`, a loop rule's): a pytree."""

    carry: list  # the loop's carry, rebuilt
    carry_ct: list | None  # its cotangent (None entries: inactive carries)
    consts_ct: list | None  # the loop's constants' cotangents, accumulated
    worst: tuple  # the worst (ratio, site) of the comparisons inside the body


class Tally(NamedTuple):
    """What a segmented backward run repaired (counts, carried through its segment loop)."""

    repaired: Any  # segments recomputed forward from their checkpoints
    recomputed: Any  # the iterations they hold


class SweepState(NamedTuple):
    """`segmented`'s segment loop's carry (a pytree): the backward run at a segment boundary,
    and where the sweeps stand."""

    carry: list  # the carry at the boundary: the stored start of the segment swept last
    carry_ct: list | None  # its cotangent
    consts_ct: list | None  # the constants' cotangents this sweep pulled back (from zero)
    worst: tuple  # the worst (ratio, site) so far
    budget: Budget  # the gradient budget so far (`dial.grad_ratio`)
    bufs: Any  # the per-iteration outputs written so far (arrays of the loop's length)
    tally: Tally  # what was recomputed so far
    missed: Any  # whether a segment of the first sweep missed

    def back(self) -> BackCarry:
        return BackCarry(self.carry, self.carry_ct, self.consts_ct, self.worst)


class Pulled(NamedTuple):
    """What `body_redo`'s recomputation of a segment gives back: the cotangents at its start."""

    carry_ct: list  # the carry's
    consts_ct: list  # the constants', accumulated
    bufs: Any  # the output buffers, the segment's rows written (None: no buffers)


class ForwardState(NamedTuple):
    """`segmented_forward`'s segment loop's carry (a pytree)."""

    carry: list  # the loop's carry
    bufs: Any  # the per-iteration outputs written so far
    ckpts: list  # the checkpoints stored so far (one row per segment)


def segmented(
    bstep: Any,
    carry0: tuple,
    slices: Any,
    length: int,
    K: int,
    ckpts: Sequence[Any],
    rev: bool,
    check: Any = None,
    redo: Callable | None = None,
    compared: Sequence[bool] | None = None,
    in_place: bool = False,
) -> tuple[BackCarry, Any, Tally]:
    """`lax.scan(bstep, carry0, slices, reverse=not rev)` (a loop's backward run, whose carry is
    a `BackCarry` or a tuple of its fields) in segments of K iterations: each segment starts
    from the stored start of the next (`ckpts`, one per segment, in iteration order; the last
    segment from the loop's final carry), so drift grows over K steps, not the loop.
    `check(rebuilt, stored, rebuilt_ct, end, end_ct, n, budget) -> (ratio, site, budget)` (or
    None) compares a segment's rebuilt start with its checkpoint (`dial.segment_checks`).
    `redo` (None, or the repairing dial's `body_redo`) recomputes a segment forward from its
    checkpoint and pulls the cotangents back through it by the body's VJP.
    `compared` (None: all): the carries `check` compares (the others' values nothing reads:
    `_graph.unread_carries`; their checkpoint is the loop's start alone). `in_place`: the
    constants' cotangents are accumulated in place (they outweigh a segment's work); else
    each segment's share is summed from zero, then added (two levels of sums).

    Every segment is swept by `bstep` (the fused step) and checked at its start, with its
    exact cotangent. Under the repairing dial, after a miss (a ratio above 1, a non-finite
    cotangent, or constants' cotangents non-finite at the end) a second sweep under a `cond`
    recomputes every segment from its checkpoint. Each sweep is a `scan` over the full
    segments (the first sweep's shorter first one a loop of its own) with loops of known
    length, so that the backward run can itself be differentiated in reverse mode, and no
    `cond` around the constants' cotangents or the output buffers inside (XLA would copy them
    through it). A loop that does not drift pays one fused sweep and the checks. Returns the start's
    `BackCarry` (its carry: the first checkpoint), the per-iteration outputs and the `Tally`
    of what was recomputed."""
    # the first segment (in iteration order) has `rest` iterations, the `nseg` after it K
    rest, nseg = length % K, length // K
    first = 1 if rest else 0  # the checkpoint of the first full segment
    final = BackCarry(*carry0)
    # inside shard_map the drift, the budget and the miss flag vary over every mesh axis the
    # loop's values vary over: typed so from the start, and at every branch's end
    axes = vma_union(carry0, slices, ckpts)

    def decided(flag):
        """`flag` true everywhere it is true anywhere: on every device of the mesh (a
        tensor-parallel block's carry is replicated over "model" while its weights' cotangents
        are split over it, and the body's VJP sums them over "data": a collective every device
        must join with the same trip counts) and in every sample of a `vmap` (trip counts
        that differ per sample would make XLA select every carried buffer per iteration). A
        segment recomputed where it need not be gets its exact values: no harm."""
        return any_in_batch(any_over(flag, vma_of(flag)))

    zero = vary_to(jnp.zeros((), budget_dtype()), axes)
    false = vary_to(jnp.zeros((), bool), axes)
    # (an unread carry's rebuilt values nothing reads: swept from its stored start, not the
    # loop's final value, so that the backward run never reads that value, and the forward
    # run drops what computes it where the caller does not read it either: `jax.grad`'s
    # loss, an accumulator: `reversible._store_keep`)
    end = [
        ck[0] if compared and not compared[k] else jnp.asarray(a, ck.dtype)
        for k, (a, ck) in enumerate(zip(final.carry, ckpts))
    ]
    final = final._replace(carry=end, worst=vary_to(final.worst, axes))
    xs = Slices(slices, length, rev)
    traced = _Traced(bstep, final, xs.read(0))
    start = [ck[0] for ck in ckpts]

    def stored_at(row):
        """The checkpoint `row`: a segment's stored start (an unread carry's, stored once:
        its value at the loop's start, which nothing reads)."""
        return [
            ck[0] if compared and not compared[k] else lax.dynamic_index_in_dim(ck, row, 0, False)
            for k, ck in enumerate(ckpts)
        ]

    def fused(back, bufs, seg, n):
        """n (a count, or a traced one) iterations of the segment `seg` backwards by the
        fused step, from `back` (a `BackCarry`). A counted loop, not a scan over
        `arange(n)`: that array, read per iteration, makes the loop too large for XLA:CPU to
        compile it as one small call."""

        def iteration(i, loop_carry):
            carry, bufs = loop_carry
            k = n - 1 - i
            carry, out = traced(carry, seg.read(k))
            return BackCarry(*carry), seg.write(bufs, k, out)

        return lax.fori_loop(0, n, iteration, (back, bufs))

    def sweep_segment(state, repairing, seg, n, stored, live=None):
        """The segment `seg` of n iterations (a count known when traced), from `state` at its
        end: swept by the fused step and checked, or (`repairing`: the second sweep)
        recomputed from its checkpoint `stored`. `live` (repairing only; None: n): the
        iterations that are the segment's, the rest the next segment's, recomputed and
        pulled back through with nothing (the shorter first segment, in the full segments'
        loop). Returns the state at its start, whose carry is its checkpoint."""
        steps = n if live is None else live

        def pulled(part):
            if repairing:
                again = redo(stored, part.carry_ct, part.consts_ct, seg, n, part.bufs, live=live)
                return part._replace(
                    carry=stored,
                    carry_ct=again.carry_ct,
                    consts_ct=again.consts_ct,
                    bufs=again.bufs,
                )
            back, bufs = fused(part.back(), part.bufs, seg, n)
            return part._replace(
                carry=back.carry,
                carry_ct=back.carry_ct,
                consts_ct=back.consts_ct,
                worst=back.worst,
                bufs=bufs,
            )

        new = pulled(state) if in_place else _in_two_levels(state, pulled)
        rebuilt = new.carry  # (a recomputed segment's start is its checkpoint)
        new = new._replace(carry=stored, worst=vary_to(new.worst, axes))
        if check is None:
            return new
        checked = check(
            rebuilt, stored, new.carry_ct, state.carry, state.carry_ct, steps, state.budget
        )
        new = new._replace(
            worst=vary_to(combine(new.worst, (checked.ratio, checked.site)), axes),
            budget=vary_to(checked.budget, axes),
        )
        if redo is None:
            return new
        if repairing:
            tally = Tally(state.tally.repaired + 1, state.tally.recomputed + steps)
            return new._replace(tally=vary_to(_tmap(lambda a: a.astype(jnp.int32), tally), axes))
        missed = decided(~(checked.ratio <= 1.0) | ~finite(new.carry_ct))
        return new._replace(missed=state.missed | missed)

    def sweep(state, repairing):
        """Every segment from the loop's end: a `scan` over the full ones, then the shorter
        first one (loops of known length, so that the backward run can itself be
        differentiated in reverse mode: `jax.grad` of a `jax.grad`). The repair takes the
        shorter one in the same `scan`, as a full segment from the loop's start of which
        the first `rest` iterations are pulled back: as a loop of its own, its carries
        would be held apart from the full segments' (XLA does not share the two)."""
        if repairing and rest and nseg:

            def any_one(state, j):  # (j = 0: the shorter first segment)
                seg = xs.at(where(j == 0, 0, rest + (j - 1) * K))
                live = where(j == 0, rest, K)
                return sweep_segment(state, True, seg, K, stored_at(j), live), None

            return lax.scan(any_one, state, jnp.arange(nseg + 1), reverse=True)[0]
        if nseg:

            def one(state, j):
                seg, stored = xs.at(rest + j * K), stored_at(first + j)
                return sweep_segment(state, repairing, seg, K, stored), None

            state = lax.scan(one, state, jnp.arange(nseg), reverse=True)[0]
        if rest:
            state = sweep_segment(state, repairing, xs, rest, start)
        return state

    consts_zero = (
        None
        if final.consts_ct is None
        else [None if t is None else match_vma(jnp.zeros_like(t), t) for t in final.consts_ct]
    )
    initial = SweepState(
        end,
        final.carry_ct,
        consts_zero,
        final.worst,
        Budget(zero, zero),
        # typed as the outputs are: written under decisions the mesh agrees on, they vary
        # as each iteration's output does (a weight's cotangent: over "model", summed over
        # "data" by the body's VJP)
        traced.out_buffers(length),
        vary_to(Tally(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)), axes),
        decided(false),
    )
    # the first sweep holds no recomputation (a loop XLA:CPU compiles as one call where the
    # body is small); after a miss, or constants' cotangents that are not finite, the
    # second recomputes every segment from the loop's end
    state = sweep(initial, False)
    if redo is not None:
        again = decided(state.missed | ~finite(state.consts_ct or []))
        state = lax.cond(
            again, lambda: sweep(initial._replace(bufs=state.bufs), True), lambda: state
        )
    consts_ct = state.consts_ct
    if final.consts_ct is not None:
        summed = [None if t is None else t + c for t, c in zip(final.consts_ct, consts_ct)]
        consts_ct = vary_to(summed, vma_union(final.consts_ct))
    back = BackCarry(start, state.carry_ct, consts_ct, state.worst)
    return back, state.bufs, state.tally


def _in_two_levels(state: SweepState, segment: Callable) -> SweepState:
    """`segment(state)` with the constants' cotangents summed from zero over the segment and
    then added to those of `state`: a sum of T per-step terms in two levels of about K and
    T/K (float32 sums of 10^4 steps lose 2e-6 sequentially, 1e-8 in two levels, so the
    gradient's error is its per-step terms', not the accumulation's). Costs their size per
    segment: where they outweigh its work, they are accumulated in place instead."""
    total = state.consts_ct
    if not total:
        return segment(state)
    zeros = [None if t is None else match_vma(jnp.zeros_like(t), t) for t in total]
    new = segment(state._replace(consts_ct=zeros))
    summed = [None if t is None else t + c for t, c in zip(total, new.consts_ct)]
    return new._replace(consts_ct=vary_to(summed, vma_union(total)))


def segmented_forward(
    step: Any,
    init: Sequence[Any],
    xs: Any,
    length: int,
    K: int,
    rev: bool,
    unread: Sequence[bool] = (),
) -> tuple[list, Any, list]:
    """`lax.scan(step, init, xs, reverse=rev)` that also returns the carry at the start of
    every segment of K iterations, in iteration order (the layout `segmented` reads); a
    carry marked `unread` (`_graph.unread_carries`) only at the loop's start."""
    rest, nseg = length % K, length // K  # as in `segmented`
    carry = [jnp.asarray(a) for a in init]
    unread = tuple(unread) or (False,) * len(carry)
    slices = Slices(xs, length, rev)
    traced = _Traced(step, carry, slices.read(0))
    axes = vma_union(carry, xs)
    bufs = traced.out_buffers(length, axes)
    rows = nseg + (1 if rest else 0)
    ckpts = [
        vary_to(zeros_of(sds(a, (1 if u else rows, *jnp.shape(a)))), axes)
        for a, u in zip(carry, unread)
    ]
    ckpts = [ck.at[0].set(a) if u else ck for ck, a, u in zip(ckpts, carry, unread)]

    def run(carry, bufs, seg, n):
        # a counted loop, not a scan over `arange(n)`: that array, read per iteration, makes
        # the segment loop too large for XLA:CPU to compile it as one small call
        def iteration(k, loop_carry):
            carry, bufs = loop_carry
            carry, out = traced(carry, seg.read(k))
            return carry, seg.write(bufs, k, out)

        return lax.fori_loop(0, n, iteration, (carry, bufs))

    if rest:  # (a loop of its own: known trip counts keep the run differentiable in reverse)
        ckpts = [ck.at[0].set(a) for ck, a in zip(ckpts, carry)]
        carry, bufs = run(carry, bufs, slices, rest)
    state = ForwardState(carry, bufs, ckpts)
    first = 1 if rest else 0

    def outer(j, state):
        ckpts = [
            ck if u else lax.dynamic_update_index_in_dim(ck, a, first + j, 0)
            for ck, a, u in zip(state.ckpts, state.carry, unread)
        ]
        carry, bufs = run(state.carry, state.bufs, slices.at(rest + j * K), K)
        return ForwardState(carry, bufs, ckpts)

    state = lax.fori_loop(0, nseg, outer, state)
    return list(state.carry), state.bufs, state.ckpts


def body_redo(
    body: Any,
    nconsts: int,
    ncarry: int,
    consts: Sequence[Any],
    active: Sequence[bool],
    ys_ct_given: Sequence[bool],
    sub: int | None = None,
) -> Callable:
    """The repairing dial's recomputation of one segment of a loop (for `segmented`): run the
    body forward from the segment's stored start, keeping each iteration's carry (K carries at
    most), then pull the cotangents back by the body's VJP at those exact values, one
    iteration at a time. With `sub` (a length L that divides K: `Dial.levels`, where a
    `memory_budget` cannot hold K carries), in two levels: the forward run keeps the carry
    every L iterations (K/L of them), then each stretch of L, from the last, is run again
    from its start, its L carries kept and pulled back through: K/L + L carries, at the cost
    of one more forward run of the segment. Needs every `xs` known (a loop that rebuilds its
    `xs` is not recomputed). `body`'s inputs are `nconsts` constants, `ncarry` carries, then
    `xs`; `active`: which of them carry cotangents; `ys_ct_given`: which outputs `ys` have
    one."""
    consts_active = active[:nconsts]
    carry_active = active[nconsts : nconsts + ncarry]
    xs_active = active[nconsts + ncarry :]
    out_avals = body.out_avals
    floating = [jnp.issubdtype(a.dtype, jnp.inexact) for a in out_avals]

    def pick(vals, flags):
        return [v for v, f in zip(vals, flags) if f]

    def put(vals, flags, new):
        it = iter(new)
        return [next(it) if f else v for v, f in zip(vals, flags)]

    def redo(start, carry_ct, consts_ct, seg, n, bufs=None, stop=None, live=None):
        """`start`: the segment's stored start; `carry_ct`, `consts_ct`: the cotangents at its
        end; `seg`: the segment's `Slices` (`NO_SLICES`: a while loop's), whose outputs (the
        `xs` cotangents) go into `bufs`; `stop` (a while loop's last segment, shorter than K):
        iterations from `stop` on are not run; `live` (a scan's shorter first segment, run
        as a full one): iterations from `live` on run, as the loop runs them, but nothing is
        pulled back through them (they are the next segment's). Returns a `Pulled`."""
        limit = stop if live is None else live  # (iterations from it on pull nothing back)
        if sub is None or sub >= n:
            stacked = carries(start, seg, n, stop)
            return pull(stacked, carry_ct, consts_ct, seg, n, bufs, limit)
        stretches = n // sub  # (`sub` divides n: `Dial.levels`)
        marks = carries(start, seg, n, stop, every=sub)

        def stretch(i, pulled):
            s = stretches - 1 - i
            at = s * sub
            part = seg.at(seg.start + at)
            begin = [lax.dynamic_index_in_dim(m, s, 0, False) for m in marks]
            stacked = carries(begin, part, sub, None if stop is None else stop - at)
            lim = None if limit is None else limit - at
            return pull(stacked, pulled.carry_ct, pulled.consts_ct, part, sub, pulled.bufs, lim)

        init = Pulled(list(carry_ct), list(consts_ct), bufs)
        return lax.fori_loop(0, stretches, stretch, init)

    def pull(stacked, carry_ct, consts_ct, seg, n, bufs=None, stop=None):
        """The cotangents pulled back through the segment `seg` of n iterations by the body's
        VJP at `stacked` (each iteration's carry at its start, stacked: exact values, from a
        forward recomputation), from `carry_ct` and `consts_ct` at its end; its `xs`
        cotangents written into `bufs`. Returns a `Pulled`."""

        def back(i, pulled):
            j = n - 1 - i
            carry_j = [lax.dynamic_index_in_dim(a, j, 0, False) for a in stacked]
            row = StepInputs(*seg.read(j))
            live = None if stop is None else j < stop
            g_carry, g_consts, g_xs = pull_back(pulled, carry_j, row, live)
            if live is not None:
                # iterations past an element's count add nothing: their cotangents are
                # zeroed before the VJP (the constants' share sums over the batch) and
                # their carries' cotangents kept
                g_carry = [
                    None if a is None else select_batched(live, a, b)
                    for a, b in zip(g_carry, pulled.carry_ct)
                ]
            bufs = pulled.bufs
            if bufs is not None:
                outs = ([], list(g_xs))
                if live is not None:  # (a row past the segment is the next segment's)
                    kept = Slices(bufs, seg.length, seg.rev, seg.start).read(j)
                    outs = _tmap(
                        lambda a, b: select_batched(live, a.astype(b.dtype), b), outs, kept
                    )
                bufs = seg.write(bufs, j, outs)
            return Pulled(g_carry, g_consts, bufs)

        def pull_back(pulled, carry_j, row, live):
            """One iteration's VJP at its recomputed carry `carry_j`: the cotangents of the
            active carries, the constants (accumulated) and the active `xs`."""

            def floating_outs(carry_in, consts_in, xs_in):
                outs = eval_closed(
                    body,
                    *put(consts, consts_active, consts_in),
                    *put(carry_j, carry_active, carry_in),
                    *put(row.xs, xs_active, xs_in),
                )
                return pick(outs, floating)

            _, vjp = jax.vjp(
                floating_outs,
                pick(carry_j, carry_active),
                pick(consts, consts_active),
                pick(row.xs, xs_active),
            )
            given = iter(row.ys_ct)
            cts = []
            for o, aval in enumerate(out_avals):
                if o < ncarry:
                    ct = pulled.carry_ct[o]
                else:
                    ct = next(given) if ys_ct_given[o - ncarry] else None
                ct = zeros_of(aval) if ct is None else ct
                cts.append(ct if live is None else select_batched(live, ct, jnp.zeros_like(ct)))
            g_carry, g_consts, g_xs = sums.pulled_back(vjp, pick(cts, floating))
            g_carry = iter(g_carry)
            return (
                [next(g_carry) if a else None for a in carry_active],
                [a + b for a, b in zip(pulled.consts_ct, g_consts)],
                g_xs,
            )

        init = Pulled(list(carry_ct), list(consts_ct), bufs)
        return lax.fori_loop(0, n, back, init)

    def carries(start, seg, n, stop=None, every=1):
        """The segment's n carries (each iteration's at its start, stacked; with `every`,
        every `every`-th: n / every of them) recomputed forward from its stored start
        `start`; `stop` as for `redo`."""
        kept = n // every
        stacked = [match_vma(jnp.zeros((kept, *jnp.shape(a)), a.dtype), a) for a in start]

        def fwd(j, carry):
            xs_j = StepInputs(*seg.read(j)).xs
            new = list(eval_closed(body, *consts, *carry, *xs_j)[:ncarry])
            if stop is not None:  # per element under vmap
                new = [select_batched(j < stop, a, b) for a, b in zip(new, carry)]
            return new

        def keep(stacked, carry, r):
            return [lax.dynamic_update_index_in_dim(s, c, r, 0) for s, c in zip(stacked, carry)]

        if every == 1:

            def one(j, loop_carry):
                carry, stacked = loop_carry
                return fwd(j, carry), keep(stacked, carry, j)

            return lax.fori_loop(0, n, one, (list(start), stacked))[1]

        def stretch(r, loop_carry):  # (counted loops: the run stays differentiable)
            carry, stacked = loop_carry
            stacked = keep(stacked, carry, r)
            carry = lax.fori_loop(0, every, lambda k, c: fwd(r * every + k, c), carry)
            return carry, stacked

        # (the last stretch is not run: nothing after it is kept)
        carry, stacked = lax.fori_loop(0, kept - 1, stretch, (list(start), stacked))
        return keep(stacked, carry, kept - 1)

    return redo
