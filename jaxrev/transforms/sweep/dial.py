"""`reversible`'s time-space dial (docs/design.md §3.8).

`Dial` holds one call's settings: how often a loop's carry is stored (K per loop, from
`checkpoint_every` or `memory_budget`), what a drift does (`on_drift`), its tolerance, and
`max_steps` for lossy while loops. A checkpointed loop runs backwards in segments
(`segmented`): the forward run stores the carry every K iterations (`segmented_forward`), and
each segment is rebuilt from the stored start of the next, so drift grows over K steps, not the
whole loop; under on_drift="repair" (the default) a segment whose rebuilt start would move the
gradient more than rounding does (`grad_ratio`) is recomputed forward from its checkpoint
(`body_redo`). The bookkeeping of the comparisons is `drift`'s.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import vary_to, vma_union, zeros_of
from jaxrev._jaxpr import eval_closed, mentions, select_batched, where
from jaxrev.transforms.knowledge.context import Settings
from jaxrev.transforms.sweep.drift import combine, finite, ratio, site, values_tol

__all__ = ["ON_DRIFT", "Dial", "grad_ratio", "weight", "budget_dtype", "recomputable",
           "segmented", "segmented_forward", "body_redo", "segment_checks"]


ON_DRIFT = ("repair", "raise", "nan", "warn", "ignore")

@dataclass(frozen=True)
class Dial:
    """The settings of one `reversible` call (a primitive param: hashable).

    `every`: None (fully reversible), K (a checkpoint every K iterations; 1 is plain storage)
    or "auto" (checkpoints every K from `budget`, else every ⌈√T⌉ iterations of a top-level
    loop; none under on_drift="ignore", the fully reversible mode); `budget`: bytes of
    checkpoints each loop may keep (picks K); `on_drift`: "repair" (a segment whose rebuilt
    start misses its checkpoint, or whose cotangents come back non-finite, is recomputed
    forward from it), "raise", "warn", "nan", "ignore"; `rtol` (default: `tol`); `max_steps`:
    the bound that lets a `while_loop` be checkpointed or store a lossy body per iteration;
    `walk`: the settings of its forward, planning and backward walks (the transform's name for
    errors, `on_error` for failures inside rebuilt values).

    The dataclass's defaults are the strict, fully reversible dial that the inverse
    transforms use inside; `reversible`'s public defaults are "auto" and "repair"."""

    every: int | str | None = None
    budget: int | None = None
    on_drift: str = "raise"
    rtol: float | None = None
    max_steps: int | None = None
    name: str = "fun"         # the user's function, for messages
    walk: Settings = Settings("jaxrev.reversible")   # its walks' settings (on_error, ...)

    def __post_init__(self) -> None:
        if self.on_drift not in ON_DRIFT:
            raise ValueError(f"on_drift must be one of {ON_DRIFT}, got {self.on_drift!r}")
        e = self.every
        if not (e is None or e == "auto" or (isinstance(e, int) and e >= 1)):
            raise ValueError(f"checkpoint_every must be None, a positive int or 'auto', got {e!r}")
        if self.budget is not None and self.budget <= 0:
            raise ValueError(f"memory_budget must be a positive number of bytes, got "
                             f"{self.budget!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {self.max_steps!r}")

    @property
    def repair(self) -> bool:
        return self.on_drift == "repair"

    @property
    def checks(self) -> bool:
        return self.on_drift != "ignore"

    def segment(self, length: int, carry_bytes: int) -> int | None:
        """K for a loop of `length` iterations whose carry takes `carry_bytes`; None: the loop
        is fully reversible (no checkpoints)."""
        if length <= 0:
            return None
        if isinstance(self.every, int):
            return min(self.every, length)
        if self.budget is not None:
            slots = max(1, int(self.budget // max(carry_bytes, 1)))
            if not self.repair:
                return max(1, math.ceil(length / slots))
            # a repair stores a segment's K carries besides the ⌈T/K⌉ checkpoints
            for K in range(1, math.isqrt(length) + 2):   # ⌈T/K⌉ + K is least near √T
                if math.ceil(length / K) + K <= slots:
                    return K
            return max(1, math.ceil(length / max(1, slots // 2)))
        if self.every == "auto" and self.on_drift != "ignore":
            return max(1, math.ceil(math.sqrt(length)))
        return None

    def inner(self, iterations: int | None) -> "Dial":
        """The dial of a loop body that runs `iterations` times and whose residuals (an inner
        loop's checkpoints among them) are stored per iteration: the budget is shared, and
        "auto" places no checkpoints there (they would be stored once per outer iteration:
        the outer loop's segments check and repair what the inner loop rebuilds)."""
        if self.budget is None:
            return dataclasses.replace(self, every=None) if self.every == "auto" else self
        if not iterations:
            return self
        return dataclasses.replace(self, budget=max(1, self.budget // iterations))

    def tol(self, dtype: Any, steps: int = 1) -> float:
        """The relative drift tolerated where no cotangent measures what it does to the
        gradient (the call's rebuilt inputs, rebuilt over `steps` equations;
        `check_reversible`): `rtol`, else √eps of the dtype (a miss means the rebuilt values
        have lost half their digits), or, where that is less, the `steps` roundoffs the
        forward run may itself commit over them (bfloat16 and float16 programs of many
        steps), up to 1/2 (a value off by half its size has lost even its leading bit)."""
        if self.rtol is not None:
            return float(self.rtol)
        eps = float(jnp.finfo(dtype).eps)
        return max(math.sqrt(eps), min(steps * eps / 2, 0.5))


def _tmap(f: Any, *t: Any) -> Any:
    return jax.tree_util.tree_map(f, *t)


def recomputable(closed: Any) -> bool:
    """Whether "auto" can recompute a segment of a loop with this body: JAX's VJP of the body,
    which a `while_loop` inside refuses (that loop then stays checkpointed and checked)."""
    return not mentions(closed.jaxpr, lambda p: p.name in ("while", "jaxrev_while"))


GRAD_SLACK = 1.0
"""How far the drift of the segments kept may move the gradient, in units of what the forward
run's own rounding moves it by (`grad_ratio`)."""

PROBE_EVERY = 4
"""After a segment missed, the next ones are recomputed at once (the inversion's work would be
thrown away), and inversion is tried again every PROBE_EVERY segments."""


def budget_dtype() -> Any:
    return jnp.result_type(float)   # float64 under x64: the budget spans many magnitudes


def weight(cts: Sequence[Any], vals: Sequence[Any]) -> Any:
    """Σ over floating leaves of u·‖c̄‖₁·‖x‖∞: what one roundoff of each value moves the loss
    by, at most (u: the leaf's unit roundoff)."""
    out = jnp.zeros((), budget_dtype())
    for g, v in zip(cts, vals):
        if g is None or not jnp.issubdtype(jnp.result_type(v), jnp.inexact):
            continue
        u = float(jnp.finfo(jnp.result_type(v)).eps) / 2
        out = out + u * (jnp.sum(jnp.abs(g)).astype(out.dtype)
                         * jnp.max(jnp.abs(v), initial=0).astype(out.dtype))
    return out


def grad_ratio(c: Sequence[Any], ck: Sequence[Any], c_ct: Sequence[Any], c_end: Sequence[Any],
               c_ct_end: Sequence[Any], n: int, BE: tuple[Any, Any], accumulate: bool = True
               ) -> tuple[Any, tuple[Any, Any]]:
    """What a segment's drift does to the gradient, against what rounding alone does to
    jax.grad's (docs/design.md §3.8). The drift δ of its rebuilt start moves what the
    backward run computes there by about ‖c̄‖₁‖δ‖∞ (c̄: the carry's cotangent there); the
    drift grows along the segment towards its start, so the segment's share is about n/2
    times that. jax.grad's forward run rounds every value it stores, each by u‖x‖∞ at least,
    which moves it by B = Σ_t u‖c̄_t‖₁‖x_t‖∞ over the iterations swept (sampled at segment
    boundaries; a while loop sums it per iteration itself: `accumulate=False`). The shares of
    the segments kept add up in the parameters' gradients: `BE = (B, E)`, E their sum.
    Returns ((E + share) / (GRAD_SLACK·B), (B, E + share)): a ratio above 1, or not finite, is
    a miss (a repaired segment keeps the old E)."""
    B, E = BE
    dt = budget_dtype()
    if accumulate:
        p_start = weight(c_ct, ck)
        p_end = weight(c_ct_end, c_end)
        B = B + 0.5 * n * (where(jnp.isfinite(p_start), p_start, p_end) + p_end)
    err = jnp.zeros((), dt)
    for g, a, b in zip(c_ct, c, ck):
        if g is None or not jnp.issubdtype(jnp.result_type(b), jnp.inexact):
            continue
        a = jnp.asarray(a, jnp.result_type(b))
        same = (a == b) | (jnp.isnan(a) & jnp.isnan(b))    # an infinity the program holds
        d = jnp.max(where(same, 0.0, jnp.abs(a - b)), initial=0).astype(dt)
        d = where(jnp.isnan(d), jnp.inf, d)
        err = err + where(d > 0, jnp.sum(jnp.abs(g)).astype(dt) * d, 0.0)
    err = err * max(n, 2) / 2
    r = (E + err) / (GRAD_SLACK * where(B > 0, B, jnp.finfo(dt).tiny))
    return where(jnp.isnan(r), jnp.inf, r).astype(jnp.float32), (B, E + err)


def segmented(bstep: Any, carry0: tuple, slices: Any, length: int, K: int,
              ckpts: Sequence[Any], rev: bool, check: Any = None, redo: Any = None
              ) -> tuple[tuple, Any]:
    """`lax.scan(bstep, carry0, slices, reverse=not rev)` (a loop's backward run, whose carry is
    ``(c, c_ct, k_ct, worst)``) in segments of K iterations: each segment starts from the
    stored start of the next (`ckpts`, one per segment, in iteration order; the last segment
    from the loop's final carry), so drift grows over K steps, not the loop. `check(c_rebuilt,
    c_stored, c_ct, c_end, c_ct_end, n, BE) -> (ratio, site, BE)` (or None) compares a
    segment's rebuilt start with its checkpoint (`grad_ratio`);
    `redo(c_start, c_ct_end, k_ct_end, seg_slices, n)` (None, or the repairing dial's)
    recomputes forward from its checkpoint a segment that missed, or whose cotangents came
    back non-finite (a NaN rebuilt inside the segment), and returns ``(c_ct, k_ct, outs)``.
    Returns the start's carry (its checkpoint) and the per-iteration outputs."""
    if rev:   # iteration order: position order reversed
        slices = _tmap(lambda a: a[::-1], slices)
    r, nseg = length % K, length // K
    c_final, c_ct, k_ct, w = carry0
    # inside shard_map the drift, the budget and the miss flag vary over every mesh axis the
    # loop's values vary over: typed so from the start, and at every branch's end
    U = vma_union(carry0, slices, ckpts)
    w = vary_to(w, U)
    zero = vary_to(jnp.zeros((), budget_dtype()), U)

    def seg_back(c_end, c_ct, k_ct, w, BE, sl, ck_start, n, probe):
        """One segment backwards: inverted and checked (`probe`), or, right after a miss,
        recomputed at once. Returns its cotangents, worst, budget and whether it missed."""
        def invert():
            (c_s, c_ct_s, k_ct_s, w_s), outs = jax.lax.scan(
                bstep, (c_end, c_ct, k_ct, w), sl, length=n, reverse=True)
            rho, at, BE2 = check(c_s, ck_start, c_ct_s, c_end, c_ct, n, BE)
            if redo is None:
                return (c_ct_s, k_ct_s, vary_to(combine(w_s, (rho, at)), U), vary_to(BE2, U),
                        outs, vary_to(jnp.zeros((), bool), U))
            bad = ~(rho <= 1.0) | ~finite([*c_ct_s, *k_ct_s])
            c_ct_s, k_ct_s, outs = jax.lax.cond(
                bad, lambda: redo(ck_start, c_ct, k_ct, sl, n),
                lambda: (c_ct_s, k_ct_s, outs))
            w_s = tuple(where(bad, a, b) for a, b in zip(w, w_s))
            BE2 = (BE2[0], where(bad, BE[1], BE2[1]))   # a repaired segment adds no drift
            return (c_ct_s, k_ct_s, vary_to(combine(w_s, (where(bad, 0.0, rho), at)), U),
                    vary_to(BE2, U), outs, vary_to(bad, U))

        if check is None:
            (_, c_ct_s, k_ct_s, w_s), outs = jax.lax.scan(
                bstep, (c_end, c_ct, k_ct, w), sl, length=n, reverse=True)
            return c_ct_s, k_ct_s, vary_to(w_s, U), BE, outs, vary_to(jnp.zeros((), bool), U)
        if redo is None:
            return invert()

        def recompute():
            c_ct_s, k_ct_s, outs = redo(ck_start, c_ct, k_ct, sl, n)
            # the budget still counts the segment (its boundary values are the true ones)
            _, BE2 = check(ck_start, ck_start, c_ct_s, c_end, c_ct, n, BE)[1:]
            return (c_ct_s, k_ct_s, w, vary_to((BE2[0], BE[1]), U), outs,
                    vary_to(jnp.ones((), bool), U))

        return jax.lax.cond(probe, invert, recompute)

    BE = (zero, zero)
    missed = vary_to(jnp.zeros((), bool), U)
    outs_full = None
    c_end = [jnp.asarray(f, c.dtype) for f, c in zip(c_final, ckpts)]
    if nseg:
        ck_full = [c[1 if r else 0:] for c in ckpts]
        full = _tmap(lambda a: a[r:].reshape((nseg, K) + a.shape[1:]), slices)

        def outer(carry, blk):
            # a segment ends where the next one's stored start is: carried, not copied
            c_end, c_ct, k_ct, w, BE, missed = carry
            sl, ck_start, j = blk
            probe = ~missed | (j % PROBE_EVERY == 0)
            c_ct, k_ct, w, BE, outs, missed = seg_back(c_end, c_ct, k_ct, w, BE, sl, ck_start,
                                                       K, probe)
            return (list(ck_start), c_ct, k_ct, w, BE, missed), outs

        (c_end, c_ct, k_ct, w, BE, missed), outs_full = jax.lax.scan(
            outer, (c_end, c_ct, k_ct, w, BE, missed), (full, ck_full, jnp.arange(nseg)),
            reverse=True)
        outs_full = _tmap(lambda a: a.reshape((nseg * K,) + a.shape[2:]), outs_full)
    if r:
        head = _tmap(lambda a: a[:r], slices)
        c_ct, k_ct, w, _, outs_head, _ = seg_back(c_end, c_ct, k_ct, w, BE, head,
                                                  [c[0] for c in ckpts], r, ~missed)
        outs = outs_head if outs_full is None else _tmap(
            lambda a, b: jnp.concatenate([a, b]), outs_head, outs_full)
    else:
        outs = outs_full
    if rev:
        outs = _tmap(lambda a: a[::-1], outs)
    return ([c[0] for c in ckpts], c_ct, k_ct, w), outs


def segmented_forward(step: Any, init: Sequence[Any], xs: Any, length: int, K: int, rev: bool
                      ) -> tuple[list, Any, list]:
    """`lax.scan(step, init, xs, reverse=rev)` that also returns the carry at the start of
    every segment of K iterations, in iteration order (the layout `segmented` reads)."""
    if rev:
        xs = _tmap(lambda a: a[::-1], xs)
    r, nseg = length % K, length // K
    c = [jnp.asarray(a) for a in init]
    cks, outs = [], []
    if r:
        cks.append([jnp.asarray(a)[None] for a in c])
        c, o = jax.lax.scan(step, c, _tmap(lambda a: a[:r], xs), length=r)
        outs.append(o)
    if nseg:
        def outer(c, x):
            c2, o = jax.lax.scan(step, c, x, length=K)
            return c2, (list(c), o)

        full = _tmap(lambda a: a[r:].reshape((nseg, K) + a.shape[1:]), xs)
        c, (ck, o) = jax.lax.scan(outer, c, full, length=nseg)
        cks.append(ck)
        outs.append(_tmap(lambda a: a.reshape((nseg * K,) + a.shape[2:]), o))
    ck = [jnp.concatenate(parts) for parts in zip(*cks)]
    o = outs[0] if len(outs) == 1 else _tmap(lambda a, b: jnp.concatenate([a, b]), *outs)
    if rev:
        o = _tmap(lambda a: a[::-1], o)
    return list(c), o, ck


def body_redo(body: Any, nc: int, ncar: int, consts: Sequence[Any], act: Sequence[bool],
              yct: Sequence[bool]) -> Any:
    """The "auto" dial's recomputation of one segment of a loop (for `segmented`): run the body
    forward from the segment's stored start, keeping each iteration's carry (K carries at
    most), then pull the cotangents back by the body's VJP at those exact values. Needs every
    `xs` known (a loop that rebuilds its `xs` is not recomputed)."""
    a_c, a_car, a_x = act[:nc], act[nc:nc + ncar], act[nc + ncar:]
    out_avals = body.out_avals
    fl = [jnp.issubdtype(a.dtype, jnp.inexact) for a in out_avals]

    def pick(vals, flags):
        return [v for v, f in zip(vals, flags) if f]

    def put(vals, flags, new):
        it = iter(new)
        return [next(it) if f else v for v, f in zip(vals, flags)]

    def redo(c0, c_ct_end, k_ct, sl, n, m=None):
        """`m` (a while loop's last segment, shorter than K): iterations from m on are not
        run."""
        _, ys_ct_t, xs_t, _ = sl

        def fwd(c, sx):
            j, x = sx
            new = list(eval_closed(body, *consts, *c, *x)[:ncar])
            if m is not None:   # per element under vmap
                new = [select_batched(j < m, a, b) for a, b in zip(new, c)]
            return new, list(c)

        _, cs = jax.lax.scan(fwd, list(c0), (jnp.arange(n), list(xs_t)), length=n)

        def back(carry, s):
            c_ct, k_ct = carry
            j, c_t, x_t, yc_t = s
            if m is None:
                return _back(c_ct, k_ct, c_t, x_t, yc_t, None)
            # iterations past an element's count add nothing: their cotangents are zeroed
            # before the VJP (the constants' share sums over the batch) and their carries'
            # cotangents kept
            on = j < m
            (g_c, k2), _ = _back(c_ct, k_ct, c_t, x_t, yc_t, on)
            g_c = [None if a is None else select_batched(on, a, b) for a, b in zip(g_c, c_ct)]
            return (g_c, k2), ([], [])

        def _back(c_ct, k_ct, c_t, x_t, yc_t, on):

            def g(ca, ka, xa):
                outs = eval_closed(body, *put(consts, a_c, ka), *put(c_t, a_car, ca),
                                   *put(x_t, a_x, xa))
                return pick(outs, fl)

            _, pull = jax.vjp(g, pick(c_t, a_car), pick(consts, a_c), pick(x_t, a_x))
            it = iter(yc_t)
            cts = []
            for j, a in enumerate(out_avals):
                g_j = (c_ct[j] if j < ncar else (next(it) if yct[j - ncar] else None))
                g_j = zeros_of(a) if g_j is None else g_j
                cts.append(g_j if on is None else select_batched(on, g_j, jnp.zeros_like(g_j)))
            gc, gk, gx = pull(pick(cts, fl))
            gc = iter(gc)
            return (([next(gc) if a else None for a in a_car],
                     [a + b for a, b in zip(k_ct, gk)]), ([], list(gx)))

        (c_ct, k_ct), outs = jax.lax.scan(back, (list(c_ct_end), list(k_ct)),
                                          (jnp.arange(n), cs, list(xs_t), list(ys_ct_t)),
                                          length=n, reverse=True)
        return c_ct, k_ct, outs

    return redo


def segment_checks(dial: Dial, log: Any, eqn: Any, carry: Sequence[Any], body: Any, nc: int,
                   ncar: int, consts: Sequence[Any], act: Sequence[bool] | None,
                   yct: Sequence[bool], can_redo: bool, planning: bool) -> tuple[Any, Any]:
    """A checkpointed loop's comparison `check(c, ck, c_ct, c_end, c_ct_end, n, BE) ->
    (ratio, site, BE)` of each segment's rebuilt start with its checkpoint (`grad_ratio`), and
    (the repairing dial, where `can_redo` and the body allows it) `body_redo`'s recomputation
    of a segment that missed; (None, None) where nothing is checked (the planning walk,
    on_drift="ignore"). `log`: the backward run's drift log (its walk context's)."""
    if planning or not dial.checks:
        return None, None
    redo = None
    if dial.repair and can_redo and act is not None and recomputable(body):
        redo = body_redo(body, nc, ncar, consts, act, yct)
    # a segment that cannot be recomputed is held to the relative tolerance, as the call's
    # inputs are: what a repair would fix is not what must raise
    fixed = dial.rtol is not None or (dial.repair and redo is None)
    at = site(log, "the rebuilt start of a checkpointed segment of the loop", eqn,
              values_tol(dial, [a.dtype for a in carry]), gradient=not fixed)
    at_ = jnp.asarray(at, jnp.int32)

    def check(c, ck, c_ct, c_end, c_ct_end, n, BE, accumulate=True):
        """(ratio, site, BE) of a segment of n iterations: its rebuilt start `c` against its
        checkpoint `ck` (`grad_ratio`). Without cotangents (`check_reversible`'s rebuild) or
        with a relative tolerance: the relative drift against it."""
        if fixed or not c_ct or all(g is None for g in c_ct):
            return ratio(dial, c, ck), at_, BE
        r, BE = grad_ratio(c, ck, c_ct, c_end, c_ct_end, n, BE, accumulate)
        return r, at_, BE

    return check, redo
