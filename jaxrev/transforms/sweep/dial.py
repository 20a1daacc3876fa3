"""`reversible`'s time-space dial (docs/design.md §3.8).

`Dial` holds one call's settings: how often a loop's carry is stored (K per loop, from
`checkpoint_every` or `memory_budget`), what a drift does (`on_drift`), its tolerance, and
`max_steps` for lossy while loops. A checkpointed loop runs backwards in segments
(`segments.segmented`): the forward run stores the carry every K iterations, and each segment
is rebuilt from the stored start of the next, so drift grows over K steps, not the whole loop;
under on_drift="repair" (the default) a segment whose rebuilt start would move the gradient
more than rounding does (`grad_ratio`) is recomputed forward from its checkpoint
(`segments.body_redo`). The bookkeeping of the comparisons is `drift`'s.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxrev._batching import where
from jaxrev._compat import prims
from jaxrev._errors import PerformanceWarning
from jaxrev._graph import mentions
from jaxrev.transforms.custom import custom_inverse_p
from jaxrev.transforms.knowledge.context import Settings
from jaxrev.transforms.sweep.drift import Budget, budget_dtype, ratio, site, values_tol
from jaxrev.transforms.sweep.segments import body_redo

__all__ = [
    "ON_DRIFT",
    "Dial",
    "SegmentEnds",
    "SegmentCheck",
    "grad_ratio",
    "weight",
    "budget_dtype",
    "recomputable",
    "segment_checks",
]


ON_DRIFT = ("repair", "raise", "nan", "warn", "ignore")


SEGMENT_WORK = 20_000
"""A checkpointed segment's fixed cost in elements computed (`Dial.segment`): measured on a
2-core CPU, a segment's loops, branches and check take about 4 µs, what about 700 iterations
of a 30-scalar body take (`benchmarks/defaults_cost.py`, the sparse-dot merge); "auto" makes
a segment whose constants' cotangents are accumulated in place (they outweigh its work) at
least that many iterations long, so that the fixed cost stays a small share."""


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
    errors, `on_error` for failures inside rebuilt values); `report`: None, or a callable
    handed a `drift.RepairReport` each time the backward run runs (what it repaired).

    The dataclass's defaults are the strict, fully reversible dial that the inverse
    transforms use inside; `reversible`'s public defaults are "auto" and "repair"."""

    every: int | str | None = None
    budget: int | None = None
    on_drift: str = "raise"
    rtol: float | None = None
    max_steps: int | None = None
    name: str = "fun"  # the user's function, for messages
    walk: Settings = Settings("jaxrev.reversible")  # its walks' settings (on_error, ...)
    report: Any = None  # called with each backward run's `RepairReport`

    def __post_init__(self) -> None:
        if self.on_drift not in ON_DRIFT:
            raise ValueError(f"on_drift must be one of {ON_DRIFT}, got {self.on_drift!r}")
        every = self.every
        if not (every is None or every == "auto" or (isinstance(every, int) and every >= 1)):
            raise ValueError(
                f"checkpoint_every must be None, a positive int or 'auto', got {every!r}"
            )
        if self.budget is not None and self.budget <= 0:
            raise ValueError(
                f"memory_budget must be a positive number of bytes, got {self.budget!r}"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be a positive int, got {self.max_steps!r}")
        if self.report is not None and not callable(self.report):
            raise TypeError(f"report must be a callable or None, got {self.report!r}")
        if self.report is not None and self.on_drift == "ignore":
            raise ValueError(
                "report: on_drift='ignore' checks and repairs nothing, so there is nothing "
                "to report; use another on_drift"
            )

    @property
    def repair(self) -> bool:
        return self.on_drift == "repair"

    @property
    def checks(self) -> bool:
        return self.on_drift != "ignore"

    def segment(
        self, length: int, carry_bytes: int, step_work: int | None = None, where: str = ""
    ) -> int | None:
        """K for a loop of `length` iterations whose carry takes `carry_bytes`; None: the loop
        is fully reversible (no checkpoints). "auto" takes ⌈√T⌉ (or, where one lies within a
        quarter of it, a length that divides T: `_dividing`); given `step_work`, the
        elements its body computes an iteration (`_graph.work_of`: a loop whose constants'
        cotangents are accumulated in place, `rules.scan`), at least enough iterations that
        a segment's fixed cost (its loops and check: `SEGMENT_WORK`) stays a small share of
        theirs, up to 4⌈√T⌉, so that a segment's carries stay few beside the loop's length
        (under the repairing dial only: a miss is recomputed there, where elsewhere the
        drift of a longer segment would raise). Under `memory_budget`, `levels`' K (`where`:
        " at <the loop's line>", for its warning)."""
        if length <= 0:
            return None
        if isinstance(self.every, int):
            return min(self.every, length)
        if self.budget is not None:
            return self.levels(length, carry_bytes, where)[0]
        if self.every == "auto" and self.on_drift != "ignore":
            K = math.ceil(math.sqrt(length))
            if step_work and self.repair:  # (elsewhere a longer segment raises sooner)
                # at most 4√T: a segment's carries stay few against the loop's length
                K = max(K, min(4 * K, math.ceil(SEGMENT_WORK / step_work)))
            return _dividing(length, max(1, min(K, length)))
        return None

    def checkpoints(self, length: int) -> bool:
        """Whether a loop of `length` iterations is checkpointed (`segment` gives a K)."""
        if length <= 0:
            return False
        auto = self.every == "auto" and self.on_drift != "ignore"
        return isinstance(self.every, int) or self.budget is not None or auto

    def levels(self, length: int, carry_bytes: int, where: str = "") -> tuple[int, int | None]:
        """(K, L) under `memory_budget`: segments of K iterations, and the stretch L by which
        the repairing dial recomputes a segment in two levels (`segments.body_redo`), None
        where it keeps the segment's K carries. The budget holds ⌊budget / carry_bytes⌋
        carries; a dial that does not repair stores ⌈T/slots⌉-long segments. The repairing
        dial takes the most checkpoints that leave room for one segment's K carries (or a
        length within a quarter of it that divides T and fits: no shorter first segment);
        where none fits (⌈T/K⌉ + K is at least about 2√T), K = L² recomputed in two levels,
        ⌈T/K⌉ + 2L carries (about 3·T^(1/3) at least), the least L that fits; where nothing
        fits, the least of either layout (one level where T is short), and a
        `PerformanceWarning` naming the loop (`where`)."""
        slots = max(1, int(self.budget // max(carry_bytes, 1)))
        if not self.repair:
            return max(1, math.ceil(length / slots)), None
        # the most checkpoints that leave room for a repair (a segment's carries)
        K = next(
            (K for K in range(1, min(slots, length) + 1) if _repair_slots(length, K) <= slots),
            None,
        )
        if K is not None:  # (or a length within a quarter that divides T and fits too)
            return next(
                (
                    d
                    for d in range(K, min(K + K // 4, length) + 1)
                    if length % d == 0 and _repair_slots(length, d) <= slots
                ),
                K,
            ), None
        # two levels: segments of L² iterations, each recomputed L at a time
        squares = range(2, math.isqrt(length) + 1)
        L = next((L for L in squares if _two_level_slots(length, L) <= slots), None)
        if L is not None:
            return L * L, L
        # the least of either layout (one level, a length dividing T first, where T is short)
        one = min(
            range(1, min(length, 2 * math.isqrt(length) + 2) + 1),
            key=lambda K: (_repair_slots(length, K), length % K != 0, K),
        )
        L = min(squares, key=lambda L: _two_level_slots(length, L), default=None)
        two = L is not None and _two_level_slots(length, L) < _repair_slots(length, one)
        least = _two_level_slots(length, L) if two else _repair_slots(length, one)
        how = "recomputed in two levels" if two else "recomputed at once"
        warnings.warn(
            f"jaxrev.reversible({self.name}): memory_budget={self.budget} bytes holds "
            f"{slots} carries of {carry_bytes} bytes for the loop{where}, whose "
            f"{length} iterations checkpointed with repairs need at least {least} (the "
            f"checkpoints and a segment's carries, {how}): it takes those, "
            f"{least * carry_bytes} bytes. Ways out: a larger budget, on_drift='raise' (the "
            "checkpoints alone, no repair), or checkpoint_every=None (fully reversible).",
            PerformanceWarning,
            stacklevel=2,
        )
        return (L * L, L) if two else (one, None)

    def sub_segment(self, length: int, K: int | None, carry_bytes: int) -> int | None:
        """The stretch L by which a repair recomputes a segment of K iterations in two levels
        (`levels`), or None (one level: its K carries kept)."""
        if K is None or self.budget is None or not self.repair:
            return None
        with warnings.catch_warnings():  # (`segment` warned already)
            warnings.simplefilter("ignore", PerformanceWarning)
            K_budget, L = self.levels(length, carry_bytes)
        return L if K_budget == K else None

    def inner(self, iterations: int | None) -> Dial:
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


def _repair_slots(length: int, K: int) -> int:
    """The carries a loop of `length` iterations holds under the repairing dial with segments
    of K: ⌈T/K⌉ checkpoints and a recomputed segment's K carries (the shorter first segment
    is recomputed in the same loop: `segments.segmented`)."""
    return math.ceil(length / K) + K


def _two_level_slots(length: int, L: int) -> int:
    """The carries of segments of L² iterations each recomputed in two levels: ⌈T/L²⌉
    checkpoints, the L starts of a segment's stretches, one stretch's L carries."""
    return math.ceil(length / (L * L)) + 2 * L


def _dividing(length: int, K: int) -> int:
    """K, or the nearest segment length within a quarter of it that divides `length`: a loop
    whose length K divides has no shorter first segment, which its forward run and its first
    backward sweep (`segments.segmented`) emit as a second copy of their segment loops,
    which XLA compiles again. The checkpoints and a segment's carries, ⌈T/K⌉ + K, change by
    at most a quarter."""
    if length % K == 0:
        return K
    for d in range(1, max(1, K // 4) + 1):
        for cand in (K + d, K - d):
            if 1 <= cand <= length and length % cand == 0:
                return cand
    return K


def recomputable(closed: Any) -> bool:
    """Whether "auto" can recompute a segment of a loop with this body: JAX's VJP of the body,
    which a `while_loop` inside refuses (that loop then stays checkpointed and checked), but
    one inside a `custom_jvp` or `custom_vjp` call, whose rule differentiates it instead (a
    root-finder differentiated implicitly: flowjax's bisection, as `jax.grad` passes it), or
    inside a `custom_inverse` differentiated through its inverse (jaxrev's mark of that
    bisection), whose inverse is then what must hold no loop."""

    def looping(p: Any) -> bool:
        return p.name in ("while", "jaxrev_while")

    def opaque(e: Any) -> bool:
        if e.primitive in (prims.custom_jvp_call, prims.custom_vjp_call):
            return True
        return (
            e.primitive is custom_inverse_p
            and e.params["implicit"] is not None
            and not mentions(e.params["inv_jaxpr"].jaxpr, looping, opaque)
        )

    return not mentions(closed.jaxpr, looping, opaque)


GRAD_SLACK = 4.0
"""How far the drift of the segments kept may move the gradient, in units of B, what the
forward run's rounding moves it by (`grad_ratio`). B counts one roundoff per stored carry,
where jax.grad's forward run commits one per operation of the body on the carry's path: B is
a lower bound on jax.grad's own rounding, and at 1 segments whose drift does not change the
gradient were recomputed (`benchmarks/defaults_cost.py`: a 10^5-step leapfrog, 175 of 316
segments, error against jax.grad 1.3e-12 repaired and 1.1e-12 kept; 48 coupling blocks, 4
of 7, 7.9e-16 and 8.8e-16; `on_drift="raise"` then raised on a gradient right to 2e-15).
At 4 those pass; the drifting loops are repaired as before (momentum SGD to 7.6e-14, the
coupled scan every segment)."""


class SegmentEnds(NamedTuple):
    """One segment of a checkpointed loop as its drift check sees it (`grad_ratio`): its
    start, rebuilt and stored, and its end, with the carry's cotangents at both."""

    rebuilt: Sequence[Any]  # the carry at its start, as the backward run rebuilt it
    stored: Sequence[Any]  # the carry at its start, as the forward run stored it
    rebuilt_ct: Sequence[Any]  # the carry's cotangent at its start (None: inactive)
    end: Sequence[Any]  # the carry at its end (the next segment's start)
    end_ct: Sequence[Any]  # the carry's cotangent at its end
    length: int  # its iterations


class SegmentCheck(NamedTuple):
    """What a segment's check gives back (`segment_checks`)."""

    ratio: Any  # drift / tolerance (above 1, or not finite: a miss)
    site: Any  # the comparison's index in the drift log
    budget: Budget  # the budget, the segment counted


def _finite_abs(x: Any) -> Any:
    """|x| where finite, 0 elsewhere: a NaN or an infinity the program holds makes jax.grad's
    gradient NaN there whatever rounding does, so it weighs nothing in the budget."""
    return where(jnp.isfinite(x), jnp.abs(x), 0)


def weight(cts: Sequence[Any], vals: Sequence[Any]) -> Any:
    """Σ over floating leaves of u·‖c̄‖₁·‖x‖∞ (finite elements): what one roundoff of each
    value moves the loss by, at most (u: the leaf's unit roundoff)."""
    out = jnp.zeros((), budget_dtype())
    for ct, val in zip(cts, vals):
        if ct is None or not jnp.issubdtype(jnp.result_type(val), jnp.inexact):
            continue
        unit_roundoff = float(jnp.finfo(jnp.result_type(val)).eps) / 2
        ct_norm = jnp.sum(_finite_abs(ct)).astype(out.dtype)
        val_norm = jnp.max(_finite_abs(val), initial=0).astype(out.dtype)
        out = out + unit_roundoff * (ct_norm * val_norm)
    return out


def grad_ratio(
    ends: SegmentEnds,
    budget: Budget,
    accumulate: bool = True,
    compared: Sequence[bool] | None = None,
) -> tuple[Any, Budget]:
    """What a segment's drift does to the gradient, against what rounding alone does to
    jax.grad's (docs/design.md §3.8). The drift δ of its rebuilt start moves what the
    backward run computes there by about ‖c̄‖₁‖δ‖∞ (c̄: the carry's cotangent there); the
    drift grows along the segment towards its start, so the segment's share is about n/2
    times that (n: `ends.length`). jax.grad's forward run rounds every value it stores, each
    by u‖x‖∞ at least, which moves it by B = Σ_t u‖c̄_t‖₁‖x_t‖∞ over the iterations swept
    (sampled at segment boundaries; a while loop sums it per iteration itself:
    `accumulate=False`). The shares of the segments kept add up in the parameters' gradients:
    E (`budget.drift`) is their sum, B `budget.rounding`.
    Returns ((E + share) / (GRAD_SLACK·B), Budget(B, E + share)): a ratio above 1, or not
    finite, is a miss (a repaired segment keeps the old E). `compared` (None: all): the
    carries whose drift counts; the others (accumulators, whose value nothing reads) count in
    B only, at their stored magnitude."""
    rounding, drift = budget
    dtype = budget_dtype()
    n = ends.length
    if accumulate:
        at_start = weight(ends.rebuilt_ct, ends.stored)
        at_end = weight(ends.end_ct, ends.end)
        at_start = where(jnp.isfinite(at_start), at_start, at_end)
        rounding = rounding + 0.5 * jnp.asarray(n, dtype) * (at_start + at_end)
    share = jnp.zeros((), dtype)
    counted = compared or [True] * len(ends.stored)
    for ct, rebuilt, stored, c in zip(ends.rebuilt_ct, ends.rebuilt, ends.stored, counted):
        if not c or ct is None or not jnp.issubdtype(jnp.result_type(stored), jnp.inexact):
            continue
        rebuilt = jnp.asarray(rebuilt, jnp.result_type(stored))
        # an infinity the program holds, rebuilt as that infinity, does not drift
        same = (rebuilt == stored) | (jnp.isnan(rebuilt) & jnp.isnan(stored))
        miss = jnp.max(where(same, 0.0, jnp.abs(rebuilt - stored)), initial=0).astype(dtype)
        miss = where(jnp.isnan(miss), jnp.inf, miss)
        share = share + where(miss > 0, jnp.sum(_finite_abs(ct)).astype(dtype) * miss, 0.0)
    share = share * jnp.maximum(jnp.asarray(n, dtype), 2) / 2  # (n: traced or not)
    scale = GRAD_SLACK * where(rounding > 0, rounding, jnp.finfo(dtype).tiny)
    drift_ratio = (drift + share) / scale
    drift_ratio = where(jnp.isnan(drift_ratio), jnp.inf, drift_ratio).astype(jnp.float32)
    return drift_ratio, Budget(rounding, drift + share)


def segment_checks(
    dial: Dial,
    log: Any,
    eqn: Any,
    carry: Sequence[Any],
    body: Any,
    nconsts: int,
    ncarry: int,
    consts: Sequence[Any],
    active: Sequence[bool] | None,
    ys_ct_given: Sequence[bool],
    can_redo: bool,
    planning: bool,
    compared: Sequence[bool] | None = None,
    sub: int | None = None,
) -> tuple[Any, Any]:
    """A checkpointed loop's comparison `check(rebuilt, stored, rebuilt_ct, end, end_ct,
    length, budget) -> SegmentCheck` of each segment's rebuilt start with its checkpoint
    (`grad_ratio`; the arguments are `SegmentEnds`' fields, then a `Budget` or a pair), and
    (the repairing dial, where `can_redo` and the body allows it) `body_redo`'s recomputation
    of a segment that missed; (None, None) where nothing is checked (the planning walk,
    on_drift="ignore"). `log`: the backward run's drift log (its walk context's); `body`'s
    inputs are `nconsts` constants, `ncarry` carries, then `xs`; `active`: which carry
    cotangents, `ys_ct_given`: which of its outputs `ys` come with a cotangent; `compared`
    (None: all): which carries are compared, the others being read by nothing the backward
    run computes (`_graph.unread_carries`: an accumulator's drift moves no gradient); `sub`:
    the stretch of a two-level recomputation (`Dial.levels`), or None."""
    if planning or not dial.checks:
        return None, None

    def kept(values: Sequence[Any] | None) -> Any:
        if values is None or compared is None:
            return values
        return [v for v, c in zip(values, compared) if c]

    redo = None
    if dial.repair and can_redo and active is not None and recomputable(body):
        redo = body_redo(body, nconsts, ncarry, consts, active, ys_ct_given, sub)
    # a segment that cannot be recomputed is held to the relative tolerance, as the call's
    # inputs are: what a repair would fix is not what must raise
    fixed = dial.rtol is not None or (dial.repair and redo is None)
    at = site(
        log,
        "the rebuilt start of a checkpointed segment of the loop",
        eqn,
        values_tol(dial, [a.dtype for a in kept(carry)]),
        gradient=not fixed,
    )
    site_index = jnp.asarray(at, jnp.int32)

    def check(rebuilt, stored, rebuilt_ct, end, end_ct, length, budget, accumulate=True):
        """The `SegmentCheck` of a segment of `length` iterations: its rebuilt start against
        its checkpoint `stored` (`grad_ratio`). Without cotangents (`check_reversible`'s
        rebuild) or with a relative tolerance: the relative drift against it."""
        budget = Budget(*budget)
        if fixed or not rebuilt_ct or all(ct is None for ct in kept(rebuilt_ct)):
            return SegmentCheck(ratio(dial, kept(rebuilt), kept(stored)), site_index, budget)
        # (an unread carry's rounding still counts in B, at its stored magnitude)
        ends = SegmentEnds(rebuilt, stored, rebuilt_ct, end, end_ct, length)
        drift_ratio, budget = grad_ratio(ends, budget, accumulate, compared)
        return SegmentCheck(drift_ratio, site_index, budget)

    return check, redo
