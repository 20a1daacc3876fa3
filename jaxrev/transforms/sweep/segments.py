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
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._batching import select_batched, where
from jaxrev._compat import match_vma, sds, trace_to_closed, vary_to, vma_union, zeros_of
from jaxrev._evaluate import eval_closed
from jaxrev._program import avals_of
from jaxrev.transforms.sweep.drift import budget_dtype, combine, finite

__all__ = ["Slices", "segmented", "segmented_forward", "body_redo", "PROBE_EVERY"]

PROBE_EVERY = 4
"""After a segment missed, the next ones are recomputed at once (the inversion's work would be
thrown away), and inversion is tried again every PROBE_EVERY segments."""


def _tmap(f: Any, *t: Any) -> Any:
    return jax.tree_util.tree_map(f, *t)


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
        t = self.start + t
        return self.length - 1 - t if self.rev else t

    def read(self, t: Any) -> Any:
        p = self.pos(t)
        return _tmap(lambda a: lax.dynamic_index_in_dim(a, p, keepdims=False), self.xs)

    def read_from(self, bufs: Any, t: Any) -> Any:
        """Iteration t's row of output buffers."""
        p = self.pos(t)
        return _tmap(lambda b: lax.dynamic_index_in_dim(b, p, keepdims=False), bufs)

    def write(self, bufs: Any, t: Any, outs: Any) -> Any:
        p = self.pos(t)
        return _tmap(
            lambda b, o: lax.dynamic_update_index_in_dim(b, o.astype(b.dtype), p, 0), bufs, outs
        )


NO_SLICES = Slices(([], [], [], []), 0, False)
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

    def out_buffers(self, length: int, U: frozenset = frozenset()) -> Any:
        """Zeros for `length` iterations of its second output, typed (vma) as it is and at
        least over U."""
        tree = self.out_tree.children()[1]
        avals = self.closed.out_avals[len(self.closed.out_avals) - tree.num_leaves :]
        bufs = [vary_to(zeros_of(sds(a, (length, *a.shape))), U) for a in avals]
        return jax.tree_util.tree_unflatten(tree, bufs)


def segmented(
    bstep: Any,
    carry0: tuple,
    slices: Any,
    length: int,
    K: int,
    ckpts: Sequence[Any],
    rev: bool,
    check: Any = None,
    redo: Any = None,
) -> tuple[tuple, Any]:
    """`lax.scan(bstep, carry0, slices, reverse=not rev)` (a loop's backward run, whose carry is
    ``(c, c_ct, k_ct, worst)``) in segments of K iterations: each segment starts from the
    stored start of the next (`ckpts`, one per segment, in iteration order; the last segment
    from the loop's final carry), so drift grows over K steps, not the loop. `check(c_rebuilt,
    c_stored, c_ct, c_end, c_ct_end, n, BE) -> (ratio, site, BE)` (or None) compares a
    segment's rebuilt start with its checkpoint (`dial.grad_ratio`);
    `redo(c_start, c_ct_end, k_ct_end, seg, n, bufs)` (None, or the repairing dial's:
    `body_redo`) recomputes forward from its checkpoint a segment that missed, or whose
    cotangents came back non-finite (a NaN rebuilt inside the segment), writes its outputs
    into `bufs` through `seg` (the segment's `Slices`) and returns ``(c_ct, k_ct, bufs)``.
    Returns the start's carry (its checkpoint) and the per-iteration outputs."""
    r, nseg = length % K, length // K
    c_final, c_ct, k_ct, w = carry0
    # inside shard_map the drift, the budget and the miss flag vary over every mesh axis the
    # loop's values vary over: typed so from the start, and at every branch's end
    U = vma_union(carry0, slices, ckpts)
    w = vary_to(w, U)
    zero = vary_to(jnp.zeros((), budget_dtype()), U)
    false = vary_to(jnp.zeros((), bool), U)
    c_end = [jnp.asarray(f, c.dtype) for f, c in zip(c_final, ckpts)]
    xs = Slices(slices, length, rev)
    step = _Traced(bstep, (c_end, c_ct, k_ct, w), xs.read(0))
    bufs = step.out_buffers(length, U)

    def run(carry, bufs, seg, n, probe=None):
        """n iterations of the segment `seg`, backwards, by inversion; where `probe` is false
        the iterations are skipped (their outputs are zeros: the recomputation overwrites
        them). The buffers are carried by the loop, never through a `cond`, where XLA would
        copy them."""

        def it(s, k):
            carry, bufs = s
            sl = seg.read(k)
            if probe is None:
                carry, o = step(carry, sl)
            else:
                carry, o = lax.cond(probe, step, lambda c, _: (c, step.zero_out()), carry, sl)
            return (carry, seg.write(bufs, k, o)), None

        return lax.scan(it, (carry, bufs), jnp.arange(n), reverse=True)[0]

    def seg_back(c_end, c_ct, k_ct, w, BE, bufs, seg, ck_start, n, probe):
        """One segment backwards: inverted and checked (`probe`), or, right after a miss,
        recomputed at once. Returns its cotangents, worst, budget, outputs and whether it
        missed."""
        if check is None:
            (_, c_ct_s, k_ct_s, w_s), bufs = run((c_end, c_ct, k_ct, w), bufs, seg, n)
            return c_ct_s, k_ct_s, vary_to(w_s, U), BE, bufs, false
        if redo is None:
            (c_s, c_ct_s, k_ct_s, w_s), bufs = run((c_end, c_ct, k_ct, w), bufs, seg, n)
            rho, at, BE2 = check(c_s, ck_start, c_ct_s, c_end, c_ct, n, BE)
            return (
                c_ct_s,
                k_ct_s,
                vary_to(combine(w_s, (rho, at)), U),
                vary_to(BE2, U),
                bufs,
                false,
            )
        if jax.tree_util.tree_leaves(bufs):
            return gated(c_end, c_ct, k_ct, w, BE, bufs, seg, ck_start, n, probe)

        # no per-iteration outputs: nothing large goes through the conds, which skip the
        # work not needed (a loop of small bodies pays for no per-iteration gating)
        def invert():
            (c_s, c_ct_i, k_ct_i, w_s), out = run((c_end, c_ct, k_ct, w), bufs, seg, n)
            rho, at, BE_i = check(c_s, ck_start, c_ct_i, c_end, c_ct, n, BE)
            bad = ~(rho <= 1.0) | ~finite([*c_ct_i, *k_ct_i])
            c_ct_s, k_ct_s, out = lax.cond(
                bad, lambda: redo(ck_start, c_ct, k_ct, seg, n, out), lambda: (c_ct_i, k_ct_i, out)
            )
            w_s = combine(
                tuple(where(bad, a, b) for a, b in zip(w, w_s)), (where(bad, 0.0, rho), at)
            )
            return (
                c_ct_s,
                k_ct_s,
                vary_to(w_s, U),
                vary_to((BE_i[0], where(bad, BE[1], BE_i[1])), U),
                out,
                vary_to(bad, U),
            )

        def recompute():
            c_ct_s, k_ct_s, out = redo(ck_start, c_ct, k_ct, seg, n, bufs)
            BE_r = check(ck_start, ck_start, c_ct_s, c_end, c_ct, n, BE)[2]
            return (
                c_ct_s,
                k_ct_s,
                w,
                vary_to((BE_r[0], BE[1]), U),
                out,
                vary_to(jnp.ones((), bool), U),
            )

        return lax.cond(probe, invert, recompute)

    def gated(c_end, c_ct, k_ct, w, BE, bufs, seg, ck_start, n, probe):
        """`seg_back` for a loop with per-iteration outputs: inversion and recomputation
        each run over the segment, each iteration doing its work or not, so that the output
        arrays are never operands of a `cond`."""
        (c_s, c_ct_i, k_ct_i, w_s), bufs = run((c_end, c_ct, k_ct, w), bufs, seg, n, probe)
        rho, at, BE_i = check(c_s, ck_start, c_ct_i, c_end, c_ct, n, BE)
        bad = ~probe | ~(rho <= 1.0) | ~finite([*c_ct_i, *k_ct_i])
        c_ct_r, k_ct_r, bufs = redo(ck_start, c_ct, k_ct, seg, n, bufs, on=bad)
        c_ct_s = [None if a is None else where(bad, a, b) for a, b in zip(c_ct_r, c_ct_i)]
        k_ct_s = [where(bad, a, b) for a, b in zip(k_ct_r, k_ct_i)]
        # the budget counts every segment (a recomputed one's boundary values are the true
        # ones); a repaired segment adds no drift
        BE_r = check(ck_start, ck_start, c_ct_s, c_end, c_ct, n, BE)[2]
        B = where(probe, BE_i[0], BE_r[0])
        E = where(bad, BE[1], BE_i[1])
        w_s = tuple(where(bad, a, b) for a, b in zip(w, w_s))
        w_s = combine(w_s, (where(bad, 0.0, rho), at))
        return c_ct_s, k_ct_s, vary_to(w_s, U), vary_to((B, E), U), bufs, vary_to(bad, U)

    BE = (zero, zero)
    missed = false
    first = 1 if r else 0  # the checkpoint of the first full segment
    if nseg:

        def outer(carry, j):
            # a segment ends where the next one's stored start is: carried, not copied
            c_end, c_ct, k_ct, w, BE, missed, bufs = carry
            ck_start = [lax.dynamic_index_in_dim(c, first + j, keepdims=False) for c in ckpts]
            probe = ~missed | (j % PROBE_EVERY == 0)
            c_ct, k_ct, w, BE, bufs, missed = seg_back(
                c_end, c_ct, k_ct, w, BE, bufs, xs.at(r + j * K), ck_start, K, probe
            )
            return (ck_start, c_ct, k_ct, w, BE, missed, bufs), None

        (c_end, c_ct, k_ct, w, BE, missed, bufs), _ = lax.scan(
            outer, (c_end, c_ct, k_ct, w, BE, missed, bufs), jnp.arange(nseg), reverse=True
        )
    if r:
        c_ct, k_ct, w, _, bufs, _ = seg_back(
            c_end, c_ct, k_ct, w, BE, bufs, xs, [c[0] for c in ckpts], r, ~missed
        )
    return ([c[0] for c in ckpts], c_ct, k_ct, w), bufs


def segmented_forward(
    step: Any, init: Sequence[Any], xs: Any, length: int, K: int, rev: bool
) -> tuple[list, Any, list]:
    """`lax.scan(step, init, xs, reverse=rev)` that also returns the carry at the start of
    every segment of K iterations, in iteration order (the layout `segmented` reads)."""
    r, nseg = length % K, length // K
    c = [jnp.asarray(a) for a in init]
    sl = Slices(xs, length, rev)
    f = _Traced(step, c, sl.read(0))
    U = vma_union(c, xs)
    bufs = f.out_buffers(length, U)
    cks = [vary_to(zeros_of(sds(a, (nseg + (1 if r else 0), *jnp.shape(a)))), U) for a in c]

    def run(c, bufs, seg, n):
        def it(s, k):
            c, bufs = s
            c, o = f(c, seg.read(k))
            return (c, seg.write(bufs, k, o)), None

        return lax.scan(it, (c, bufs), jnp.arange(n))[0]

    if r:
        cks = [b.at[0].set(a) for b, a in zip(cks, c)]
        c, bufs = run(c, bufs, sl, r)
    if nseg:
        first = 1 if r else 0

        def outer(s, j):
            c, bufs, cks = s
            cks = [lax.dynamic_update_index_in_dim(b, a, first + j, 0) for b, a in zip(cks, c)]
            c, bufs = run(c, bufs, sl.at(r + j * K), K)
            return (c, bufs, cks), None

        (c, bufs, cks), _ = lax.scan(outer, (c, bufs, cks), jnp.arange(nseg))
    return list(c), bufs, cks


def body_redo(
    body: Any, nc: int, ncar: int, consts: Sequence[Any], act: Sequence[bool], yct: Sequence[bool]
) -> Any:
    """The repairing dial's recomputation of one segment of a loop (for `segmented`): run the
    body forward from the segment's stored start, keeping each iteration's carry (K carries at
    most), then pull the cotangents back by the body's VJP at those exact values, one
    iteration at a time. Needs every `xs` known (a loop that rebuilds its `xs` is not
    recomputed)."""
    a_c, a_car, a_x = act[:nc], act[nc : nc + ncar], act[nc + ncar :]
    out_avals = body.out_avals
    fl = [jnp.issubdtype(a.dtype, jnp.inexact) for a in out_avals]

    def pick(vals, flags):
        return [v for v, f in zip(vals, flags) if f]

    def put(vals, flags, new):
        it = iter(new)
        return [next(it) if f else v for v, f in zip(vals, flags)]

    def redo(c0, c_ct_end, k_ct, seg, n, bufs=None, m=None, on=None):
        """`seg`: the segment's `Slices` (`NO_SLICES`: a while loop's), whose outputs (the
        `xs` cotangents) go into `bufs`; `m` (a while loop's last segment, shorter than K):
        iterations from m on are not run; `on`: whether to recompute at all (else the
        cotangents come back as given and `bufs` unchanged), decided per iteration so that
        `bufs` never goes through a `cond`."""

        def fwd(c, j):
            x = seg.read(j)[2]
            new = list(eval_closed(body, *consts, *c, *x)[:ncar])
            if m is not None:  # per element under vmap
                new = [select_batched(j < m, a, b) for a, b in zip(new, c)]
            return new, list(c)

        def forward():
            return lax.scan(fwd, list(c0), jnp.arange(n), length=n)[1]

        cs = (
            forward()
            if on is None
            else lax.cond(
                on,
                forward,
                lambda: [
                    match_vma(jnp.zeros((n, *jnp.shape(a)), jnp.result_type(a)), a) for a in c0
                ],
            )
        )

        def back(carry, s):
            c_ct, k_ct, bufs = carry
            j, c_t = s
            _, ys_ct_t, x_t, _ = seg.read(j)
            live = None if m is None else j < m

            def pull():
                g_c, k2, gx = _back(c_ct, k_ct, c_t, x_t, ys_ct_t, live)
                if live is not None:
                    # iterations past an element's count add nothing: their cotangents are
                    # zeroed before the VJP (the constants' share sums over the batch) and
                    # their carries' cotangents kept
                    g_c = [
                        None if a is None else select_batched(live, a, b) for a, b in zip(g_c, c_ct)
                    ]
                return g_c, k2, gx

            if on is None:
                g_c, k2, gx = pull()
            else:
                g_c, k2, gx = lax.cond(
                    on,
                    pull,
                    lambda: (
                        list(c_ct),
                        list(k_ct),
                        [match_vma(jnp.zeros_like(x), x) for x in pick(x_t, a_x)],
                    ),
                )
            if bufs is not None:
                outs = ([], list(gx))
                if on is not None:
                    outs = _tmap(lambda new, old: where(on, new, old), outs, seg.read_from(bufs, j))
                bufs = seg.write(bufs, j, outs)
            return (g_c, k2, bufs), None

        def _back(c_ct, k_ct, c_t, x_t, yc_t, on):

            def g(ca, ka, xa):
                outs = eval_closed(
                    body, *put(consts, a_c, ka), *put(c_t, a_car, ca), *put(x_t, a_x, xa)
                )
                return pick(outs, fl)

            _, pull = jax.vjp(g, pick(c_t, a_car), pick(consts, a_c), pick(x_t, a_x))
            it = iter(yc_t)
            cts = []
            for j, a in enumerate(out_avals):
                g_j = c_ct[j] if j < ncar else (next(it) if yct[j - ncar] else None)
                g_j = zeros_of(a) if g_j is None else g_j
                cts.append(g_j if on is None else select_batched(on, g_j, jnp.zeros_like(g_j)))
            gc, gk, gx = pull(pick(cts, fl))
            gc = iter(gc)
            return ([next(gc) if a else None for a in a_car], [a + b for a, b in zip(k_ct, gk)], gx)

        (c_ct, k_ct, bufs), _ = lax.scan(
            back, (list(c_ct_end), list(k_ct), bufs), (jnp.arange(n), cs), length=n, reverse=True
        )
        return c_ct, k_ct, bufs

    return redo
