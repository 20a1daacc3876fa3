"""A checkpointed loop's runs in segments (docs/design.md §3.8).

The forward run stores the carry at the start of every segment of K iterations
(`segmented_forward`); the backward run rebuilds each segment from the stored start of the
next (`segmented`), so drift grows over K steps, not the loop, and, under the repairing dial, a
segment that missed is recomputed forward from its checkpoint (`body_redo`).

Both runs read each iteration's inputs (`xs`, residuals, the loop's outputs' cotangents) from
the loop's own arrays by iteration number, and write each iteration's outputs into arrays of
the loop's length carried through the segments (`Slices`): nothing of the loop's length is
reversed, split into segments or concatenated. Those arrays are often the size of the
parameters (a stack of transformer blocks scanned over its stacked weights), and each such copy
is scratch memory that grows with depth. The step is traced once (`_Traced`) and its jaxpr
evaluated in every segment and branch: the loop's body is walked once, not once per use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._batching import select_batched, where
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
from jaxrev.transforms.sweep.drift import Budget, budget_dtype, combine, finite, no_drift

__all__ = [
    "Slices",
    "NO_SLICES",
    "StepInputs",
    "BackCarry",
    "SegmentState",
    "Tally",
    "Pulled",
    "ForwardState",
    "Recompute",
    "segmented",
    "segmented_forward",
    "body_redo",
    "PROBE_EVERY",
]

PROBE_EVERY = 4
"""After a segment missed, the next ones are recomputed at once (the inversion's work would be
thrown away), and inversion is tried again every PROBE_EVERY segments."""


AFTER_SLACK = 16.0
"""The repair decides whether to recompute a segment before its start's cotangent is known,
from the cotangent at its end (`segmented`'s `two_pass`); checked again with the cotangent at
its start, a segment kept misses only where its drift moves the gradient more than
AFTER_SLACK times what rounding does."""


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

    def read_from(self, bufs: Any, t: Any) -> Any:
        """Iteration t's row of output buffers."""
        row = self.pos(t)
        return _tmap(lambda buf: lax.dynamic_index_in_dim(buf, row, keepdims=False), bufs)

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

    def zero_out(self) -> Any:
        """Zeros of its second output (one iteration's), typed as it is."""
        tree = self.out_tree.children()[1]
        avals = self.closed.out_avals[len(self.closed.out_avals) - tree.num_leaves :]
        return jax.tree_util.tree_unflatten(tree, [zeros_of(a) for a in avals])

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


class SegmentState(NamedTuple):
    """The backward run's state at a segment boundary (the segment loop's carry: a pytree):
    what `segmented` hands from one segment to the one before it."""

    carry: list  # the carry at the boundary: the stored start of the segment swept last
    carry_ct: list | None  # its cotangent
    consts_ct: list | None  # the constants' cotangents accumulated so far
    worst: tuple  # the worst (ratio, site) so far
    budget: Budget  # the gradient budget so far (`dial.grad_ratio`)
    missed: Any  # whether the segment swept last missed (the next one is recomputed at once)
    bufs: Any  # the per-iteration outputs written so far (arrays of the loop's length)
    growth: Any = None  # how much the carry's cotangent grew over the segment swept last
    tally: Tally | None = None  # what was repaired so far

    def back(self) -> BackCarry:
        return BackCarry(self.carry, self.carry_ct, self.consts_ct, self.worst)


class Pulled(NamedTuple):
    """What `body_redo`'s recomputation of a segment gives back: the cotangents at its start."""

    carry_ct: list  # the carry's
    consts_ct: list  # the constants', accumulated
    bufs: Any  # the output buffers, the segment's rows written (None: no buffers)


class Recompute(NamedTuple):
    """The repairing dial's recomputations of a loop's segment (`body_redo`)."""

    redo: Callable  # (start, carry_ct, consts_ct, seg, n, bufs, stop, on) -> Pulled
    carries: Callable  # (start, seg, n) -> the segment's carries, recomputed forward
    pull: Callable  # (carries, carry_ct, consts_ct, seg, n, bufs) -> Pulled, by the VJP
    out_row: Callable  # (row) -> zeros of what `pull` writes into the buffers per iteration

    def __call__(self, *args: Any, **kwargs: Any) -> Pulled:
        return self.redo(*args, **kwargs)


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
    redo: Recompute | None = None,
    invert: Callable | None = None,
    compared: Sequence[bool] | None = None,
    in_place: bool = False,
) -> tuple[BackCarry, Any]:
    """`lax.scan(bstep, carry0, slices, reverse=not rev)` (a loop's backward run, whose carry is
    a `BackCarry` or a tuple of its fields) in segments of K iterations: each segment starts
    from the stored start of the next (`ckpts`, one per segment, in iteration order; the last
    segment from the loop's final carry), so drift grows over K steps, not the loop.
    `check(rebuilt, stored, rebuilt_ct, end, end_ct, n, budget) -> (ratio, site, budget)` (or
    None) compares a segment's rebuilt start with its checkpoint (`dial.segment_checks`);
    `redo(start, carry_ct, consts_ct, seg, n, bufs)` (None, or the repairing dial's:
    `body_redo`) recomputes forward from its checkpoint a segment that missed, or whose
    cotangents came back non-finite (a NaN rebuilt inside the segment), writes its outputs
    into `bufs` through `seg` (the segment's `Slices`) and returns a `Pulled`.
    `invert(carry, row) -> (carry before, worst)` (with `redo`: the body's backward step
    without cotangents) lets the repairing dial decide before any cotangent is pulled
    (`two_pass`): the constants' cotangents, often the size of the parameters, are then
    accumulated in place, never kept twice for a segment that might be redone.
    `compared` (None: all): the carries `check` compares, whose rebuilt values must also be
    finite (the others' values nothing reads: `_graph.unread_carries`). `in_place`: the
    constants' cotangents are accumulated in place in the first sweep (they outweigh a
    segment's work: a share summed from zero per segment would cost their size per segment);
    else each segment's share is summed from zero and then added (two levels of sums).

    The sweep pays for drift only where it happens: every segment is first swept by the
    fused step (the fully reversible mode's: inversion and VJP at once) and checked at its
    start (`_swept`); only if one misses (or the cotangents come back non-finite), under the
    repairing dial, is the loop swept again from its end by the repairing machinery
    (`careful`), the segments the first sweep verified kept as they were.
    Returns the start's `BackCarry` (its carry: the first checkpoint), the per-iteration
    outputs and the `Tally` of what was repaired."""
    # the first segment (in iteration order) has `rest` iterations, the `nseg` after it K
    rest, nseg = length % K, length // K
    primal_step = invert  # (`one_segment` defines its own `invert`)
    final = BackCarry(*carry0)
    # inside shard_map the drift, the budget and the miss flag vary over every mesh axis the
    # loop's values vary over: typed so from the start, and at every branch's end
    axes = vma_union(carry0, slices, ckpts)
    # ... but whether a segment is inverted or recomputed is decided by every device
    # together: a tensor-parallel block's carry is replicated over "model" while its weights
    # (and their cotangents) are split over it, and the body's VJP sums the weights'
    # cotangents over "data" (a collective each device must join, in the same branch). A
    # segment any device misses is recomputed on all (exact values, so no harm), and the
    # decision, invariant over the mesh, keeps the type of whatever it selects

    def agreed(flag):
        """`flag` true on every device of the mesh where it is true on any."""
        return any_over(flag, vma_of(flag))

    zero = vary_to(jnp.zeros((), budget_dtype()), axes)
    false = vary_to(jnp.zeros((), bool), axes)
    end = [jnp.asarray(a, ck.dtype) for a, ck in zip(final.carry, ckpts)]
    final = final._replace(carry=end, worst=vary_to(final.worst, axes))
    xs = Slices(slices, length, rev)
    traced = _Traced(bstep, final, xs.read(0))

    def step(carry, row):
        carry, out = traced(carry, row)
        return BackCarry(*carry), out

    def skip(carry, row):
        return carry, traced.zero_out()

    def run(carry, bufs, seg, n, probe=None):
        """n iterations of the segment `seg`, backwards, by inversion, from `carry` (a
        `BackCarry`); where `probe` is false the iterations are skipped (their outputs are
        zeros: the recomputation overwrites them). The buffers are carried by the loop, never
        through a `cond`, where XLA would copy them."""

        def iteration(loop_carry, k):
            carry, bufs = loop_carry
            row = seg.read(k)
            if probe is None:
                carry, out = step(carry, row)
            else:
                carry, out = lax.cond(probe, step, skip, carry, row)
            return (carry, seg.write(bufs, k, out)), None

        return lax.scan(iteration, (carry, bufs), jnp.arange(n), reverse=True)[0]

    def check_start(rebuilt, rebuilt_ct, stored, state, n):
        """The segment's check: its start as rebuilt against `stored`, its end at `state`."""
        return check(rebuilt, stored, rebuilt_ct, state.carry, state.carry_ct, n, state.budget)

    def seg_back(state, seg, stored, n, probe, trusted):
        probe = agreed(probe | trusted)
        if primal_step is not None:
            # the two-pass repair accumulates the constants' cotangents in place: they are
            # large there (a table read a little at a time), and touched a little per step
            new = one_segment(state, seg, stored, n, probe, trusted)
        else:
            new = _in_two_levels(
                state, lambda part: one_segment(part, seg, stored, n, probe, trusted)
            )
        # a segment that comes back missed was recomputed (a miss, or right after one)
        tally = Tally(
            state.tally.repaired + new.missed.astype(jnp.int32),
            state.tally.recomputed + jnp.where(new.missed, n, 0).astype(jnp.int32),
        )
        growth = state.growth if new.growth is None else new.growth
        return new._replace(growth=growth, tally=vary_to(tally, axes))

    def one_segment(state, seg, stored, n, probe, trusted):
        """One segment of n iterations backwards from `state` (at its end), under the
        repairing dial: inverted and checked (`probe`), or, right after a miss, recomputed at
        once; where `trusted` (the first sweep verified it) kept whatever its check says.
        Returns the state at its start, whose carry is `stored`, its checkpoint."""
        if primal_step is not None:
            return two_pass(state, seg, stored, n, probe, trusted)
        if jax.tree_util.tree_leaves(state.bufs):
            return gated(state, seg, stored, n, probe, trusted)

        # no per-iteration outputs: nothing large goes through the conds, which skip the
        # work not needed (a loop of small bodies pays for no per-iteration gating)
        def invert():
            back, bufs = run(state.back(), state.bufs, seg, n)
            checked = check_start(back.carry, back.carry_ct, stored, state, n)
            bad = agreed(~(checked.ratio <= 1.0) | ~finite([*back.carry_ct, *back.consts_ct]))
            bad = bad & ~trusted
            pulled = lax.cond(
                bad,
                lambda: redo(stored, state.carry_ct, state.consts_ct, seg, n, bufs),
                lambda: Pulled(back.carry_ct, back.consts_ct, bufs),
            )
            worst = tuple(where(bad, a, b) for a, b in zip(state.worst, back.worst))
            return settled(state, stored, pulled, bad, worst, checked.ratio, checked)

        def recompute():
            pulled = redo(stored, state.carry_ct, state.consts_ct, seg, n, state.bufs)
            counted = check_start(stored, pulled.carry_ct, stored, state, n).budget
            return SegmentState(
                stored,
                pulled.carry_ct,
                pulled.consts_ct,
                state.worst,
                vary_to(Budget(counted.rounding, state.budget.drift), axes),
                vary_to(jnp.ones((), bool), axes),
                pulled.bufs,
            )

        return lax.cond(probe, invert, recompute)

    def two_pass(state, seg, stored, n, probe, trusted):
        """`seg_back` under the repairing dial with `invert`: the segment's carries rebuilt
        by inversion alone (no cotangents), kept; its start checked against `stored`, with
        the cotangent at its end, grown as the last segment's grew, standing for the one at
        its start (not known yet); the carries recomputed forward from `stored` where that
        misses; then the cotangents pulled back once, by the body's VJP at those carries,
        into the constants' cotangents in place. The check is made again with the
        cotangent at the start: a segment kept that this exact check rejects is a miss
        the drift log reports."""
        none = vary_to(no_drift(), axes)

        def like_stored(carries):
            """Carries typed (vma) as the checkpoints are: what the body's VJP expects."""
            return [match_vma(c, a) for c, a in zip(carries, stored)]

        def inverted():
            def iteration(loop_carry, k):
                carry, worst = loop_carry
                before, inside = primal_step(carry, seg.read(k))
                before = [jnp.asarray(b, a.dtype) for b, a in zip(before, carry)]
                return (before, vary_to(combine(worst, inside), axes)), before

            (start, inner), stacked = lax.scan(
                iteration, (list(state.carry), none), jnp.arange(n), reverse=True
            )
            grown = [
                None if ct is None else ct * state.growth.astype(jnp.result_type(ct))
                for ct in state.carry_ct
            ]
            pre = check_start(start, grown, stored, state, n)
            # a value the inversion made non-finite inside the segment, where its start is
            # finite, is a miss however its start compares
            watched = [
                (a, b)
                for k, (a, b) in enumerate(zip(stacked, stored))
                if not compared or compared[k]
            ]
            bad = agreed(
                ~(pre.ratio <= 1.0)
                | (~finite([a for a, _ in watched]) & finite([b for _, b in watched]))
            )
            return like_stored(stacked), like_stored(start), inner, bad & ~trusted

        def skipped():
            stacked = [jnp.zeros((n, *jnp.shape(a)), a.dtype) for a in stored]
            stacked, start = like_stored(stacked), list(stored)
            return stacked, start, none, jnp.ones((), bool)

        stacked, start, inner, bad = lax.cond(probe, inverted, skipped)
        stacked = lax.cond(bad, lambda: like_stored(redo.carries(stored, seg, n)), lambda: stacked)
        pulled = redo.pull(stacked, state.carry_ct, state.consts_ct, seg, n, state.bufs)
        kept = [where(bad, b, a) for a, b in zip(start, stored)]
        checked = check_start(kept, pulled.carry_ct, stored, state, n)
        worst = tuple(where(bad, a, b) for a, b in zip(state.worst, combine(state.worst, inner)))
        # the decision was the estimate's; the exact ratio of a segment kept is a miss only
        # beyond AFTER_SLACK (the gradient off by more than that many roundings' worth), and
        # counts in the budget, so that the next segments are recomputed sooner
        after = where(checked.ratio > AFTER_SLACK, checked.ratio, jnp.minimum(checked.ratio, 1.0))
        growth = _growth(state.carry_ct, pulled.carry_ct, state.growth)
        return settled(state, stored, pulled, bad, worst, after, checked, vary_to(growth, axes))

    def settled(state, stored, pulled, bad, worst, ratio, checked, growth=None):
        """The state at a segment's start, its cotangents `pulled`: kept (its `ratio` and
        drift counted) or, where `bad`, repaired (neither counted)."""
        worst = combine(worst, (where(bad, 0.0, ratio), checked.site))
        budget = Budget(
            checked.budget.rounding, where(bad, state.budget.drift, checked.budget.drift)
        )
        return SegmentState(
            stored,
            pulled.carry_ct,
            pulled.consts_ct,
            vary_to(worst, axes),
            vary_to(budget, axes),
            vary_to(bad, axes),
            pulled.bufs,
            growth,
        )

    def gated(state, seg, stored, n, probe, trusted):
        """`seg_back` for a loop with per-iteration outputs: inversion and recomputation
        each run over the segment, each iteration doing its work or not, so that the output
        arrays are never operands of a `cond`."""
        back, bufs = run(state.back(), state.bufs, seg, n, probe)
        checked = check_start(back.carry, back.carry_ct, stored, state, n)
        bad = agreed(~probe | ~(checked.ratio <= 1.0) | ~finite([*back.carry_ct, *back.consts_ct]))
        bad = bad & ~trusted
        pulled = redo(stored, state.carry_ct, state.consts_ct, seg, n, bufs, on=bad)
        carry_ct = [
            None if a is None else where(bad, a, b) for a, b in zip(pulled.carry_ct, back.carry_ct)
        ]
        consts_ct = [where(bad, a, b) for a, b in zip(pulled.consts_ct, back.consts_ct)]
        # the budget counts every segment (a recomputed one's boundary values are the true
        # ones); a repaired segment adds no drift
        counted = check_start(stored, carry_ct, stored, state, n).budget
        budget = Budget(
            where(probe, checked.budget.rounding, counted.rounding),
            where(bad, state.budget.drift, checked.budget.drift),
        )
        worst = tuple(where(bad, a, b) for a, b in zip(state.worst, back.worst))
        worst = combine(worst, (where(bad, 0.0, checked.ratio), checked.site))
        return SegmentState(
            stored,
            carry_ct,
            consts_ct,
            vary_to(worst, axes),
            vary_to(budget, axes),
            vary_to(bad, axes),
            pulled.bufs,
        )

    def fused(carry, bufs, seg, n):
        """n (a count, or a traced one) iterations of the segment `seg` backwards by the
        fused step, from `carry` (a `BackCarry`)."""

        def iteration(i, loop_carry):
            carry, bufs = loop_carry
            k = n - 1 - i
            carry, out = step(carry, seg.read(k))
            return carry, seg.write(bufs, k, out)

        return lax.fori_loop(0, n, iteration, (carry, bufs))

    def swept_segment(state, seg, stored, n, length):
        """One segment of `length` iterations (n of them run: 0 skips it) by the fused
        step, its rebuilt start compared with `stored`: a miss (under the repairing dial)
        marks the state `missed`."""

        def sweep(part):
            back, bufs = fused(part.back(), part.bufs, seg, n)
            return part._replace(
                carry=back.carry,
                carry_ct=back.carry_ct,
                consts_ct=back.consts_ct,
                worst=back.worst,
                bufs=bufs,
            )

        swept = sweep(state) if in_place else _in_two_levels(state, sweep)
        new = swept._replace(carry=stored, worst=vary_to(swept.worst, axes), missed=false)
        if check is None:
            return new
        checked = check_start(swept.carry, swept.carry_ct, stored, state, length)
        missed = false
        if redo is not None:
            missed = agreed(~(checked.ratio <= 1.0) | ~finite(swept.carry_ct))
        return new._replace(
            worst=vary_to(combine(swept.worst, (checked.ratio, checked.site)), axes),
            budget=vary_to(checked.budget, axes),
            missed=vary_to(missed, axes),
        )

    def _swept(state):
        """Every segment swept by the fused step and checked, from the loop's end, until one
        misses (under the repairing dial). Returns the state and the index of the segment
        that missed (-1: the shorter first one; `nseg`: the constants' cotangents came back
        non-finite, no segment verified)."""
        j = jnp.asarray(nseg - 1)
        if nseg:

            def more(carry):
                j, state = carry
                return (j >= 0) & ~agreed(state.missed)

            def one(carry):
                j, state = carry
                stored = stored_at(first + j)
                return j - 1, swept_segment(state, xs.at(rest + j * K), stored, K, K)

            if redo is None:  # nothing stops the sweep: a loop of known length
                state, _ = lax.scan(
                    lambda state, j: (one((j, state))[1], None),
                    state,
                    jnp.arange(nseg),
                    reverse=True,
                )
                j = jnp.asarray(-1)
            else:
                j, state = lax.while_loop(more, one, (j, state))
        if rest:
            ran = where(agreed(state.missed), 0, rest) if redo is not None else rest
            before = agreed(state.missed)  # (invariant over the mesh: it picks an index)
            state = swept_segment(state, xs, start, ran, rest)
            state = state._replace(missed=before | state.missed)
            j = where(before, j, j - 1)
        verified = j + 1  # the segment that missed (or -1 past the last)
        if redo is not None and state.consts_ct:
            bad = agreed(~finite(state.consts_ct))
            verified = where(bad, nseg, verified)
            state = state._replace(missed=vary_to(state.missed | bad, axes))
        return state, verified

    state = SegmentState(
        end,
        final.carry_ct,
        final.consts_ct,
        final.worst,
        Budget(zero, zero),
        false,
        # typed as the outputs are: written under decisions the mesh agrees on, they vary
        # as each iteration's output does (a weight's cotangent: over "model", summed over
        # "data" by the body's VJP)
        traced.out_buffers(length),
        vary_to(jnp.ones((), budget_dtype()), axes),
        vary_to(Tally(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32)), axes),
    )
    first = 1 if rest else 0  # the checkpoint of the first full segment
    start = [ck[0] for ck in ckpts]

    def stored_at(row):
        """The checkpoint `row`: a segment's stored start (an unread carry's, stored once:
        its value at the loop's start, which nothing reads)."""
        return [
            ck[0] if compared and not compared[k] else lax.dynamic_index_in_dim(ck, row, 0, False)
            for k, ck in enumerate(ckpts)
        ]

    def careful(state, verified):
        """The repairing sweep from the loop's end: each segment inverted and checked, or
        recomputed from its checkpoint; the segments above index `verified` (the first
        sweep's, which checked them with their exact cotangents) are kept as inverted."""
        if nseg:

            def outer(state, j):
                # a segment ends where the next one's stored start is: carried, not copied
                stored = stored_at(first + j)
                probe = ~state.missed | (j % PROBE_EVERY == 0)
                seg = xs.at(rest + j * K)
                return seg_back(state, seg, stored, K, probe, j > verified), None

            state, _ = lax.scan(outer, state, jnp.arange(nseg), reverse=True)
        if rest:
            state = seg_back(state, xs, start, rest, ~state.missed, verified < -1)
        return state

    swept, verified = _swept(state)
    if redo is not None:
        # a miss: swept again from the end, the first sweep's per-iteration outputs
        # overwritten in place (its verified segments' again, by the same inversion)
        state = lax.cond(
            swept.missed,
            lambda: careful(state._replace(bufs=swept.bufs), verified),
            lambda: swept,
        )
    else:
        state = swept
    return state.back()._replace(carry=start), state.bufs, state.tally


def _in_two_levels(state: SegmentState, segment: Callable) -> SegmentState:
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


def _growth(end_ct: Sequence[Any], start_ct: Sequence[Any], last: Any) -> Any:
    """‖c̄ at a segment's start‖₁ / ‖c̄ at its end‖₁, at least 1 (`last` where the end's is
    zero or either is not finite): the factor by which the next segment's check scales the
    cotangent at its end, which stands for the one at its start."""
    end = jnp.zeros((), last.dtype)
    start = jnp.zeros((), last.dtype)
    for a, b in zip(end_ct, start_ct):
        if a is None or b is None or not jnp.issubdtype(jnp.result_type(a), jnp.inexact):
            continue
        end = end + jnp.sum(jnp.abs(a)).astype(last.dtype)
        start = start + jnp.sum(jnp.abs(b)).astype(last.dtype)
    ratio = start / where(end > 0, end, 1.0)
    return where((end > 0) & jnp.isfinite(ratio), jnp.maximum(ratio, 1.0), last)


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

    if rest:
        ckpts = [ck.at[0].set(a) for ck, a in zip(ckpts, carry)]
        carry, bufs = run(carry, bufs, slices, rest)
    state = ForwardState(carry, bufs, ckpts)
    if nseg:
        first = 1 if rest else 0

        def outer(state, j):
            ckpts = [
                ck if u else lax.dynamic_update_index_in_dim(ck, a, first + j, 0)
                for ck, a, u in zip(state.ckpts, state.carry, unread)
            ]
            carry, bufs = run(state.carry, state.bufs, slices.at(rest + j * K), K)
            return ForwardState(carry, bufs, ckpts), None

        state, _ = lax.scan(outer, state, jnp.arange(nseg))
    return list(state.carry), state.bufs, state.ckpts


def body_redo(
    body: Any,
    nconsts: int,
    ncarry: int,
    consts: Sequence[Any],
    active: Sequence[bool],
    ys_ct_given: Sequence[bool],
) -> Recompute:
    """The repairing dial's recomputation of one segment of a loop (for `segmented`): run the
    body forward from the segment's stored start, keeping each iteration's carry (K carries at
    most), then pull the cotangents back by the body's VJP at those exact values, one
    iteration at a time. Needs every `xs` known (a loop that rebuilds its `xs` is not
    recomputed). `body`'s inputs are `nconsts` constants, `ncarry` carries, then `xs`;
    `active`: which of them carry cotangents; `ys_ct_given`: which outputs `ys` have one."""
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

    def redo(start, carry_ct, consts_ct, seg, n, bufs=None, stop=None, on=None):
        """`start`: the segment's stored start; `carry_ct`, `consts_ct`: the cotangents at its
        end; `seg`: the segment's `Slices` (`NO_SLICES`: a while loop's), whose outputs (the
        `xs` cotangents) go into `bufs`; `stop` (a while loop's last segment, shorter than K):
        iterations from `stop` on are not run; `on`: whether to recompute at all (else the
        cotangents come back as given and `bufs` unchanged), decided per iteration so that
        `bufs` never goes through a `cond`. Returns a `Pulled`."""

        def no_carries():
            return [match_vma(jnp.zeros((n, *jnp.shape(a)), jnp.result_type(a)), a) for a in start]

        if on is None:
            stacked = carries(start, seg, n, stop)
        else:
            stacked = lax.cond(on, lambda: carries(start, seg, n, stop), no_carries)
        return pull(stacked, carry_ct, consts_ct, seg, n, bufs, stop, on)

    def pull(stacked, carry_ct, consts_ct, seg, n, bufs=None, stop=None, on=None):
        """The cotangents pulled back through the segment `seg` of n iterations by the body's
        VJP at `stacked` (each iteration's carry at its start, stacked: exact values, from a
        forward recomputation or an inversion found to be right), from `carry_ct` and
        `consts_ct` at its end; its `xs` cotangents written into `bufs`. Returns a
        `Pulled`."""

        def back(pulled, scanned):
            j, carry_j = scanned
            row = StepInputs(*seg.read(j))
            live = None if stop is None else j < stop

            def pull_one():
                g_carry, g_consts, g_xs = pull_back(pulled, carry_j, row, live)
                if live is not None:
                    # iterations past an element's count add nothing: their cotangents are
                    # zeroed before the VJP (the constants' share sums over the batch) and
                    # their carries' cotangents kept
                    g_carry = [
                        None if a is None else select_batched(live, a, b)
                        for a, b in zip(g_carry, pulled.carry_ct)
                    ]
                return g_carry, g_consts, g_xs

            def keep():
                zeros = [match_vma(jnp.zeros_like(x), x) for x in pick(row.xs, xs_active)]
                return list(pulled.carry_ct), list(pulled.consts_ct), zeros

            g_carry, g_consts, g_xs = pull_one() if on is None else lax.cond(on, pull_one, keep)
            bufs = pulled.bufs
            if bufs is not None:
                outs = ([], list(g_xs))
                if on is not None:
                    outs = _tmap(lambda new, old: where(on, new, old), outs, seg.read_from(bufs, j))
                bufs = seg.write(bufs, j, outs)
            return Pulled(g_carry, g_consts, bufs), None

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
            g_carry, g_consts, g_xs = vjp(pick(cts, floating))
            g_carry = iter(g_carry)
            return (
                [next(g_carry) if a else None for a in carry_active],
                [a + b for a, b in zip(pulled.consts_ct, g_consts)],
                g_xs,
            )

        init = Pulled(list(carry_ct), list(consts_ct), bufs)
        pulled, _ = lax.scan(back, init, (jnp.arange(n), stacked), length=n, reverse=True)
        return pulled

    def carries(start, seg, n, stop=None):
        """The segment's n carries (each iteration's at its start, stacked) recomputed
        forward from its stored start `start`; `stop` as for `redo`."""

        def fwd(carry, j):
            xs_j = StepInputs(*seg.read(j)).xs
            new = list(eval_closed(body, *consts, *carry, *xs_j)[:ncarry])
            if stop is not None:  # per element under vmap
                new = [select_batched(j < stop, a, b) for a, b in zip(new, carry)]
            return new, list(carry)

        return lax.scan(fwd, list(start), jnp.arange(n), length=n)[1]

    def out_row(row):
        xs = pick(StepInputs(*row).xs, xs_active)
        return [], [match_vma(jnp.zeros_like(x), x) for x in xs]

    return Recompute(redo, carries, pull, out_row)
