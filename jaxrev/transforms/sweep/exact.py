"""Exact reversal of loops (docs/design.md §3.8, "Exact reversal"): `jr.reversible(f, exact=True)`.

A `scan`'s float carries are held in fixed point (int64, int32 for 16-bit floats; a scale per
carry chosen from its start's magnitude and `Exact.headroom_bits`) while the loop runs
forward, and every update of a carry is applied exactly: additions and subtractions of any
value the body computes (read by the body as the float that the fixed point stands for,
rounded once to the carry's grid),
negations, and multiplications or divisions by factors, which keep the bits they destroy in an
information buffer (`jaxrev._bits`). The backward run undoes each iteration bit for bit from
the final carry, so the rebuilt trajectory is the forward one exactly, whatever the loop's
reversed dynamics do to rounding (SGD with momentum 0.9 divides by 0.9 every step backwards),
and nothing of the loop's length is stored but the buffer's bits. Each iteration's cotangents
are then the VJP of the fixed-point iteration at the values its undo rebuilt
(`_on_grid_iteration`).

What the body may do to a carry (its *chain*: the equations from the carry's old value to its
new one, each with one chain operand): ``add``, ``sub``, ``neg``, ``mul`` and ``div`` by a value
that does not read the carry (its *side* value), copies. Everything else that computes a carry's
new value is refused, naming the primitive and the user's line. Integer carries (a
`fori_loop`'s counter) may be updated by additions and subtractions of integers; others must
pass through unchanged.

The plan (`plan_loop`) is found once per body when traced: the chains, the side equations,
the values that depend on the loop's constants alone (computed once, outside the loop) and the
order in which the backward step undoes the chains (a side value needs the values it reads).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._bits import (
    LOW,
    WORD,
    Alphabet,
    alphabet,
    dyadic,
    empty,
    float_parts,
    mul_exact,
    power_alphabet,
    power_of_two,
    rational,
    x64,
)
from jaxrev._compat import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    call_jaxpr,
    prims,
    saved_residuals,
    scan_info,
)
from jaxrev._env import Env
from jaxrev._errors import ReversibilityError, at_eqn, not_invertible
from jaxrev._evaluate import eval_closed, evaluate
from jaxrev._prepare import prepare
from jaxrev.transforms.knowledge.checks import raise_where
from jaxrev.transforms.sweep import sums

__all__ = ["Exact", "LoopPlan", "plan_loop", "exact_scan", "run_exact", "stored"]

WHO = "reversible(exact=True)"
LIMIT = 1 << 62  # the fixed-point values' bound: |value| < 2**62 keeps sums exact in int64


@dataclass(frozen=True)
class Exact:
    """Settings of exact reversal, `jr.reversible(f, exact=jr.Exact(...))` (``exact=True`` is
    ``jr.Exact()``).

    **Arguments:**

    - `headroom_bits`: how far a carry may grow beyond its start's magnitude (at least 1): a
      carry whose start is at most 2**E in magnitude (E >= 0) is held with 62 - headroom - E
      fractional bits (30 - headroom - E for bfloat16 and float16 carries, held in int32) and
      may reach 2**(E + headroom). 10 (the default) allows growth by 1024
      and gives float64's resolution to carries within [-1, 1]. A carry that leaves its range
      raises a `jr.ReversibilityError` naming the loop and the carry.
    - `bits_per_step`: the information buffer's room per multiplication or division of a carry
      per iteration, in bits per element (a factor g < 1 destroys log2(1/g) of them: 0.15 for
      0.9, 1 for 0.5). 2 (the default) holds factors down to about 0.3; a buffer that fills
      up raises a `jr.ReversibilityError` saying how many bits it needed.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> from jax import lax
        >>> def decay(v, g):
        ...     return lax.fori_loop(0, 100, lambda i, v: 0.9 * v + g, v)
        >>> exact = jr.reversible(decay, exact=jr.Exact(bits_per_step=1.0))
        >>> dg = jax.grad(lambda g: exact(jnp.ones(3), g).sum())(1.0)  # 3 (1 - 0.9**100) / 0.1
        >>> bool(jnp.allclose(dg, 30 * (1 - 0.9**100)))
        True
    """

    headroom_bits: int = 10
    bits_per_step: float = 2.0

    def __post_init__(self) -> None:
        if not (1 <= int(self.headroom_bits) <= 40):
            raise ValueError(f"Exact(headroom_bits={self.headroom_bits!r}): pick 1 to 40")
        if not (0 < float(self.bits_per_step) <= 64):
            raise ValueError(f"Exact(bits_per_step={self.bits_per_step!r}): pick (0, 64]")


# ------------------------------------------------------------------ the plan


class Phase(NamedTuple):
    """A stretch of one iteration's run: equations (forward) or items of the undo order
    (backward) in order, then the multiplications that wait for nothing else, done together:
    one pop and one push on the loop's buffer for all of them, whatever the number of carries
    they multiply (the parameter leaves of a model under SGD with momentum)."""

    items: list
    batch: list


class ChainStep(NamedTuple):
    """One equation on a carry's chain: ``out = kind(chain, side)``; `slot`: the carry (by its
    output position) whose grid and buffer it uses."""

    eqn: JaxprEqn
    kind: str  # "add", "sub" (chain - side), "rsub" (side - chain), "neg", "mul", "div", "copy"
    chain: Var
    side: Any  # a Var or Literal; None for "neg" and "copy"
    slot: int

    @property
    def out(self) -> Var:
        return self.eqn.outvars[0]

    @property
    def lossy(self) -> bool:
        return self.kind in ("mul", "div")


@dataclass
class LoopPlan:
    """How one `scan` body runs in fixed point and backwards (found once, `plan_loop`)."""

    body: ClosedJaxpr  # prepared: what the fixed-point run evaluates and its VJP differentiates
    nconsts: int
    ncarry: int
    origin: list[int]  # per carry output slot, the carry input slot its chain starts from
    steps: dict[JaxprEqn, ChainStep]  # the chain equations
    chain_slot: dict[Var, int]  # every chain variable and the slot whose grid it is on
    invariant: list[JaxprEqn]  # side equations of the constants alone (run once, outside)
    undo: list[tuple[str, Any]]  # the backward step: ("side", eqn) or ("undo", ChainStep)
    lossy: list[int] = field(default_factory=list)  # per slot, lossy steps per iteration
    forward_phases: list[Phase] = field(default_factory=list)
    backward_phases: list[Phase] = field(default_factory=list)
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # a lossy slot's buffer rows

    @property
    def carry_in(self) -> list[Var]:
        return self.body.jaxpr.invars[self.nconsts : self.nconsts + self.ncarry]

    @property
    def carry_out(self) -> list[Any]:
        return self.body.jaxpr.outvars[: self.ncarry]


def _forms(eqn: JaxprEqn) -> list[tuple[int, str]]:
    """The (chain operand position, kind) an equation can be a chain step in."""
    p = eqn.primitive
    if p is prims.add or p is prims.add_any:
        return [(0, "add"), (1, "add")]
    if p is prims.sub:
        return [(0, "sub"), (1, "rsub")]
    if p is prims.mul:
        return [(0, "mul"), (1, "mul")]
    if p is prims.div:
        return [(0, "div")]
    if p is prims.neg:
        return [(0, "neg")]
    if p is prims.copy or getattr(p, "name", "") == "copy_p":
        return [(0, "copy")]
    if p is prims.convert_element_type and eqn.invars[0].aval.dtype == eqn.outvars[0].aval.dtype:
        return [(0, "copy")]
    return []


def _is_float(v: Any) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.floating)


def _is_int(v: Any) -> bool:
    return jnp.issubdtype(v.aval.dtype, jnp.integer)


def plan_loop(scan_eqn: JaxprEqn, body: ClosedJaxpr, nconsts: int, ncarry: int) -> LoopPlan:
    """The plan of a `scan` body, or a `NotInvertibleError` naming the equation that computes
    a carry in a way exact reversal cannot undo."""
    body = prepare(body)
    jaxpr = body.jaxpr
    carry_in = jaxpr.invars[nconsts : nconsts + ncarry]
    carry_out = jaxpr.outvars[:ncarry]
    slot_of_in = {v: i for i, v in enumerate(carry_in)}
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}

    reach_memo: dict[Var, frozenset] = {}

    def reach(v: Any) -> frozenset:
        """The carry slots a pure chain leads back to from `v`."""
        if not isinstance(v, Var):
            return frozenset()
        if v in slot_of_in:
            return frozenset({slot_of_in[v]})
        if v not in reach_memo:
            reach_memo[v] = frozenset()  # (no cycles in a jaxpr; a guard all the same)
            e = producer.get(v)
            got: frozenset = frozenset()
            if e is not None:
                for pos, _ in _forms(e):
                    got |= reach(e.invars[pos])
            reach_memo[v] = got
        return reach_memo[v]

    steps: dict[JaxprEqn, ChainStep] = {}
    chain_slot: dict[Var, int] = {}
    origin: list[int] = []
    for j, v in enumerate(carry_out):
        dtype_ok = _is_float(v) or _is_int(v)
        while True:
            if isinstance(v, Var) and v in slot_of_in:
                origin.append(slot_of_in[v])
                if v in chain_slot:
                    raise _copied(scan_eqn, j)
                chain_slot[v] = j
                break
            e = producer.get(v) if isinstance(v, Var) else None
            if e is None:
                raise _not_from_carry(scan_eqn, j)
            choices = [(pos, kind) for pos, kind in _forms(e) if reach(e.invars[pos])]
            choices.sort(key=lambda pk: j not in reach(e.invars[pk[0]]))
            if not choices or not dtype_ok:
                culprit = _blame(e, producer, slot_of_in) if dtype_ok else e
                raise not_invertible(
                    culprit,
                    f"exact reversal rebuilds a loop's carry only through additions, "
                    f"subtractions, negations, copies and multiplications or divisions by "
                    f"factors, and carry {j} of the loop is computed by "
                    f"`{culprit.primitive.name}`",
                    hint=_HINT,
                    who=WHO,
                )
            pos, kind = choices[0]
            if kind in ("mul", "div") and not _is_float(v):
                raise not_invertible(
                    e,
                    f"carry {j} is an integer multiplied or divided inside the loop",
                    hint=_HINT,
                    who=WHO,
                )
            if v in chain_slot:
                raise _copied(scan_eqn, j)
            chain_slot[v] = j
            side = None if kind in ("neg", "copy") else e.invars[1 - pos]
            steps[e] = ChainStep(e, kind, e.invars[pos], side, j)
            v = e.invars[pos]
    if sorted(origin) != list(range(ncarry)):
        raise _not_from_carry(scan_eqn, next(j for j in range(ncarry) if j not in origin))
    for j, v in enumerate(carry_out):
        if not (_is_float(v) or _is_int(v)) and (v is not carry_in[j]):
            raise _not_from_carry(scan_eqn, j)

    # values of the constants alone: computed once, outside the loop. Not those of literals
    # alone (an iota, a mask of the shapes): free to compute where they are read, they would
    # be held through the whole loop (a causal mask broadcast to the batch and the heads)
    outer = set(jaxpr.invars[:nconsts]) | set(jaxpr.constvars)
    invariant: list[JaxprEqn] = []
    for e in jaxpr.eqns:
        if e in steps or e.effects:
            continue
        read = [a for a in e.invars if not isinstance(a, Literal)]
        if read and all(a in outer for a in read):
            invariant.append(e)
            outer.update(e.outvars)

    undo = _undo_order(scan_eqn, jaxpr, nconsts, ncarry, steps, outer)
    lossy = [sum(1 for s in steps.values() if s.slot == j and s.lossy) for j in range(ncarry)]
    rows, start = {}, 0
    for j, v in enumerate(carry_out):
        if lossy[j]:
            n = int(np.prod(v.aval.shape, dtype=int))
            rows[j] = np.arange(start, start + n)
            start += n
    invariant_set = set(invariant)
    forward = [("side", e) for e in jaxpr.eqns if e not in invariant_set]
    forward = [("undo", steps[e]) if e in steps else ("side", e) for _, e in forward]
    return LoopPlan(
        body,
        nconsts,
        ncarry,
        origin,
        steps,
        chain_slot,
        invariant,
        undo,
        lossy,
        _phases(forward, lambda st: [st.eqn.outvars[0]], lambda st: list(st.eqn.invars)),
        _phases(undo, lambda st: [st.chain], lambda st: [st.out, st.side]),
        rows,
    )


def _phases(items: list[tuple[str, Any]], made: Any, read: Any) -> list[Phase]:
    """`items` (("side", eqn) or ("undo", ChainStep), in an order that computes each value
    before it is read) cut into phases: a value's level is the number of multiplications it
    waits for; a multiplication whose inputs are at level L runs in phase L's batch."""
    level: dict[Var, int] = {}
    phases: dict[int, Phase] = {}

    def lvl(vs: list) -> int:
        return max((level.get(v, 0) for v in vs if isinstance(v, Var)), default=0)

    for kind, item in items:
        if kind == "side":
            at = lvl(list(item.invars))
            phases.setdefault(at, Phase([], [])).items.append((kind, item))
            level.update((o, at) for o in item.outvars)
            continue
        at = lvl(read(item))
        phase = phases.setdefault(at, Phase([], []))
        if item.lossy:
            phase.batch.append(item)
            at += 1
        else:
            phase.items.append((kind, item))
        level.update((o, at) for o in made(item))
    return [phases[k] for k in sorted(phases)]


def _blame(eqn: JaxprEqn, producer: dict, carries: dict) -> JaxprEqn:
    """The equation that breaks a carry's chain below `eqn`: down the operands that read a
    carry, through the chain's own kinds of equations, to the first of another kind."""
    memo: dict[Var, bool] = {}

    def reads(v: Any) -> bool:  # whether v depends on a carry at all
        if not isinstance(v, Var):
            return False
        if v in carries:
            return True
        if v not in memo:
            memo[v] = False
            e = producer.get(v)
            memo[v] = e is not None and any(reads(a) for a in e.invars)
        return memo[v]

    while _forms(eqn):
        nxt = next((producer.get(a) for a in eqn.invars if reads(a) and a not in carries), None)
        if nxt is None:
            break
        eqn = nxt
    return eqn


_HINT = (
    "Ways out: write the update as `carry + f(other values)` or `factor * carry + f(...)` "
    "(the additive couplings of reversible networks, leapfrog, SGD with momentum), or use "
    "`jr.reversible` without `exact`, which inverts any invertible body and repairs drift by "
    "recomputation."
)


def _copied(scan_eqn: JaxprEqn, j: int) -> Exception:
    return not_invertible(
        scan_eqn,
        f"carry {j}'s new value shares its chain with another carry's (a value copied into two "
        "carries keeps one of them only)",
        hint=_HINT,
        who=WHO,
    )


def _not_from_carry(scan_eqn: JaxprEqn, j: int) -> Exception:
    return not_invertible(
        scan_eqn,
        f"carry {j}'s new value is not its old value (or another carry's) updated, so the old "
        "value is lost",
        hint=_HINT,
        who=WHO,
    )


def _undo_order(
    scan_eqn: JaxprEqn,
    jaxpr: Any,
    nconsts: int,
    ncarry: int,
    steps: dict[JaxprEqn, ChainStep],
    outer: set,
) -> list[tuple[str, Any]]:
    """The backward step's order: each chain step undone once its output and side value are
    known, each side equation run once its inputs are; only the side equations some undo step
    needs are kept."""
    known = set(outer) | set(jaxpr.invars[nconsts + ncarry :])
    known.update(v for v in jaxpr.outvars[:ncarry] if isinstance(v, Var))
    pending_side = [e for e in jaxpr.eqns if e not in steps and not (set(e.outvars) <= known)]
    pending_undo = sorted(
        steps.values(), key=lambda s: -list(jaxpr.eqns).index(s.eqn)
    )  # latest first
    order: list[tuple[str, Any]] = []
    progress = True
    while progress and pending_undo:
        progress = False
        for s in list(pending_undo):
            side_known = not isinstance(s.side, Var) or s.side in known
            if s.out in known and side_known:
                order.append(("undo", s))
                known.add(s.chain)
                pending_undo.remove(s)
                progress = True
        for e in list(pending_side):
            if all(not isinstance(a, Var) or a in known for a in e.invars):
                order.append(("side", e))
                known.update(e.outvars)
                pending_side.remove(e)
                progress = True
    if pending_undo:
        s = pending_undo[0]
        raise not_invertible(
            s.eqn,
            f"the value this step adds to or multiplies carry {s.slot} by reads that carry's old "
            "value (an update `x + f(x)` cannot be undone exactly)",
            hint=_HINT,
            who=WHO,
        )
    # keep only the side equations an undo step reads
    need = {s.side for kind, s in order if kind == "undo" and isinstance(s.side, Var)}
    kept: list[tuple[str, Any]] = []
    for kind, item in reversed(order):
        if kind == "side":
            if not any(o in need for o in item.outvars):
                continue
            need.update(a for a in item.invars if isinstance(a, Var))
        kept.append((kind, item))
    return kept[::-1]


# ------------------------------------------------------------------ fixed point


def _int_type(dtype: Any) -> tuple[Any, int]:
    """The integers a float carry of `dtype` is held in, and their bound: int32 below 2**30
    for 16-bit floats (8 or 11 significant bits: 20 fractional bits are already finer, and
    the carry takes the fully reversible mode's memory), int64 below 2**62 otherwise."""
    if jnp.dtype(dtype).itemsize <= 2:
        return jnp.int32, 1 << 30
    return jnp.int64, LIMIT


def _scale_bits(x: Any, headroom: int) -> Any:
    """Fractional bits of a float carry starting at `x`: log2(bound) - headroom - E, 2**E
    bounding |x| (E >= 0)."""
    with x64():
        bound = _int_type(x.dtype)[1].bit_length() - 1
        m = jnp.max(jnp.abs(x)).astype(jnp.float64) if x.size else jnp.float64(0)
        _, e = float_parts(jnp.where(jnp.isfinite(m), m, 0.0))  # m < 2**(e + 1)
        return (bound - headroom - jnp.maximum(e + 1, 0)).astype(jnp.int32)


class Grid(NamedTuple):
    """A float carry's fixed-point grid: `bits` fractional bits; `up` = 2**bits and `down` =
    2**-bits as float64 (exact), so that moving on and off the grid is one multiplication;
    the integers it is held in (`_int_type`) and their bound."""

    bits: Any
    up: Any
    down: Any
    dtype: Any
    limit: int


def _grid(bits: Any, dtype: Any) -> Grid:
    with x64():
        ints, limit = _int_type(dtype)
        return Grid(bits, power_of_two(bits), power_of_two(-bits), ints, limit)


def _to_fixed(x: Any, g: Grid) -> tuple[Any, Any]:
    """round(x * 2**bits) on the grid's integers, and where it is out of range (or not
    finite)."""
    with x64():
        y = x.astype(jnp.float64) * g.up
        bad = ~(jnp.abs(y) < g.limit)
        return jnp.where(bad, 0, jnp.round(y)).astype(g.dtype), bad


def _view(c: Any, g: Grid, dtype: Any) -> Any:
    """The float the fixed-point value `c` stands for."""
    with x64():
        return (c.astype(jnp.float64) * g.down).astype(dtype)


class _Flags(NamedTuple):
    """Per carry slot: left the fixed-point range; a factor that cannot be held."""

    range: Any
    factor: Any


class Factor(NamedTuple):
    """A factor as ``sign * num / den``, with the alphabets of num and den (for the coder),
    and where it could be held (`rational`)."""

    sign: Any
    num: Alphabet
    den: Alphabet
    ok: Any

    @classmethod
    def of(cls, g: Any, per_step: bool = False) -> Factor:
        """The factor `g`: the closest fraction (`rational`), or, for a factor computed anew
        each step (`per_step`: a gate) in a 16- or 32-bit float, n / 2**k (`dyadic`: as
        fine as the float, and a few operations where the continued fraction takes 64
        rounds of divisions per element; a 64 x 32 gate over 200 steps took 13 s)."""
        fast = per_step and jnp.dtype(jnp.result_type(g)).itemsize <= 4
        r = dyadic(g) if fast else rational(g)
        den = alphabet(r.den) if r.den_log2 is None else power_alphabet(r.den_log2)
        return cls(r.sign, alphabet(r.num), den, r.ok)


def _cat(parts: list[Alphabet]) -> Alphabet:
    """One alphabet for the elements of `parts` (a power of two only if all are)."""
    log2 = [p.log2 for p in parts]
    joint = None if any(k is None for k in log2) else jnp.concatenate(log2)
    return Alphabet(*(jnp.concatenate(fields) for fields in zip(*(p[:3] for p in parts))), joint)


class _Fixed:
    """One iteration's fixed-point arithmetic: the carries' grids (per slot; None for an
    integer carry), the rationals of invariant factors, and the loop's buffer rows."""

    def __init__(self, plan: LoopPlan, scales: list[Any], factors: dict[Any, Any]) -> None:
        self.plan = plan
        self.scales = scales
        self.factors = factors  # rationals of invariant factors, by variable

    def side_fixed(self, s: ChainStep, val: Any, c: Any, flags: _Flags) -> tuple[Any, _Flags]:
        """The side value on slot's grid (an integer carry's: as it is)."""
        if not _is_float(s.out):
            return jnp.asarray(val).astype(c.dtype), flags
        q, bad = _to_fixed(jnp.asarray(val), self.scales[s.slot])
        return q, flags._replace(range=_upd(flags.range, s.slot, bad))

    def factor(self, s: ChainStep, val: Any, flags: _Flags) -> tuple[Factor, _Flags]:
        """A step's factor: an invariant one's found (and checked) once, before the loop."""
        f = self.factors.get(s.side) if isinstance(s.side, Var) else None
        if f is not None:
            return f, flags
        f = Factor.of(val, per_step=True)
        return f, flags._replace(factor=_upd(flags.factor, s.slot, ~f.ok))

    def apply(self, s: ChainStep, c: Any, val: Any, flags: _Flags) -> tuple[Any, _Flags]:
        """One step that loses nothing, forward: the step's output on the grid."""
        with x64():
            if s.kind == "copy":
                return c, flags
            if s.kind == "neg":
                return -c, flags
            q, flags = self.side_fixed(s, val, c, flags)
            out = {"add": c + q, "sub": c - q, "rsub": q - c}[s.kind]
            return out, self._range(s, out, flags)

    def undo(self, s: ChainStep, out: Any, val: Any, flags: _Flags) -> tuple[Any, _Flags]:
        """One step that loses nothing, backward: its chain operand from its output."""
        with x64():
            if s.kind == "copy":
                return out, flags
            if s.kind == "neg":
                return -out, flags
            q, flags = self.side_fixed(s, val, out, flags)
            return {"add": out - q, "sub": out + q, "rsub": q - out}[s.kind], flags

    def _range(self, s: ChainStep, out: Any, flags: _Flags) -> _Flags:
        if not _is_float(s.out):
            return flags
        limit = self.scales[s.slot].limit
        return flags._replace(range=_upd(flags.range, s.slot, jnp.abs(out) >= limit))

    def multiply(self, batch: list, cs: list, vals: list, buf: Any, flags: _Flags, back: bool):
        """The multiplications (and divisions) of a phase at once: ``c * factor`` forward, or
        their chain operands from their outputs where `back`, by one `mul_exact` on the
        buffer rows of their carries."""
        with x64():
            ns, ds, signs = [], [], []
            for s, c, val in zip(batch, cs, vals):
                f, flags = self.factor(s, val, flags)
                n, d = (f.num, f.den) if s.kind == "mul" else (f.den, f.num)
                if back:
                    n, d = d, n
                ns.append(n.broadcast(c.shape))
                ds.append(d.broadcast(c.shape))
                signs.append(jnp.broadcast_to(f.sign, c.shape).reshape(-1))
            sign = jnp.concatenate(signs)
            flat = jnp.concatenate([c.reshape(-1).astype(jnp.int64) for c in cs])
            rows = np.concatenate([self.plan.rows[s.slot] for s in batch])
            buf, out = mul_exact(buf, flat * sign if back else flat, _cat(ns), _cat(ds), rows)
            out = out if back else out * sign
            outs, at = [], 0
            for s, c in zip(batch, cs):
                o = out[at : at + c.size].reshape(c.shape)
                at += c.size
                if not back:
                    flags = self._range(s, o, flags)  # (before an int32 carry is narrowed)
                outs.append(o.astype(c.dtype))
            return outs, buf, flags

    def view(self, v: Var, c: Any) -> Any:
        """The value chain variable `v` holds, as the body reads it."""
        if not _is_float(v):
            return c
        return _view(c, self.scales[self.plan.chain_slot[v]], v.aval.dtype)


def _upd(xs: tuple, i: int, flag: Any) -> tuple:
    """Flags `xs` with slot i's flag or-ed with any of `flag`. One boolean per slot, reduced
    each step: elementwise flags would be a carry as large as the loop's own (a byte per
    element beside a bfloat16 carry's two), in the forward and the backward scan."""
    return tuple(x | jnp.any(flag) if k == i else x for k, x in enumerate(xs))


# ------------------------------------------------------------------ one iteration


def _env(plan: LoopPlan, consts: Sequence[Any], hoisted: dict, xs_t: Sequence[Any]) -> Env:
    jaxpr = plan.body.jaxpr
    env = Env()
    for v, c in zip(jaxpr.constvars, plan.body.consts):
        env.write(v, c)
    for v, c in zip(jaxpr.invars[: plan.nconsts], consts):
        env.write(v, c)
    for v, c in hoisted.items():
        env.write(v, c)
    for v, x in zip(jaxpr.invars[plan.nconsts + plan.ncarry :], xs_t):
        env.write(v, x)
    return env


def _side(env: Env, s: ChainStep) -> Any:
    return None if s.side is None else env.read(s.side)


def forward_iteration(fx: _Fixed, consts, hoisted, ints, buf, flags, xs_t):  # noqa: ANN001, ANN201
    """One iteration in fixed point: (carries on their grids, buffer, flags, ys)."""
    plan = fx.plan
    env = _env(plan, consts, hoisted, xs_t)
    held = _start(fx, env, plan.carry_in, ints)
    buf, flags = _run_phases(fx, env, held, plan.forward_phases, buf, flags, back=False)
    ys = [env.read(v) for v in plan.body.jaxpr.outvars[plan.ncarry :]]
    return [held[v] for v in plan.carry_out], buf, flags, ys


def backward_iteration(fx: _Fixed, consts, hoisted, ints, buf, flags, xs_t):  # noqa: ANN001, ANN201
    """One iteration undone: the carries before it, bit for bit, the buffer, the flags, and
    every chain value of the iteration on its grid (by variable: `_on_grid_iteration`)."""
    plan = fx.plan
    env = _env(plan, consts, hoisted, xs_t)
    held = _start(fx, env, plan.carry_out, ints)
    buf, flags = _run_phases(fx, env, held, plan.backward_phases, buf, flags, back=True)
    return [held[v] for v in plan.carry_in], buf, flags, held


def _start(fx: _Fixed, env: Env, carries: Sequence[Var], ints: Sequence[Any]) -> dict:
    """The chain values known first (the carries on their grids), their views in `env`."""
    held: dict[Var, Any] = {}
    for v, c in zip(carries, ints):
        held[v] = c
        env.write(v, fx.view(v, c))
    return held


def _run_phases(
    fx: _Fixed, env: Env, held: dict, phases: list, buf: Any, flags: _Flags, back: bool
):  # noqa: ANN202
    """Run one iteration's `phases` forward (each chain step's output from its chain operand)
    or backward (`back`: each chain operand from its output), writing each chain value into
    `held` (on its grid) and its float view into `env`."""

    def known(v: Var, value: Any) -> None:
        held[v] = value
        env.write(v, fx.view(v, value))

    for phase in phases:
        for kind, item in phase.items:
            if kind == "side":
                evaluate([item], env)
                continue
            src, dst = (item.out, item.chain) if back else (item.chain, item.out)
            step = fx.undo if back else fx.apply
            value, flags = step(item, held[src], _side(env, item), flags)
            known(dst, value)
        if phase.batch:
            src = [held[s.out if back else s.chain] for s in phase.batch]
            vals = [_side(env, s) for s in phase.batch]
            got, buf, flags = fx.multiply(phase.batch, src, vals, buf, flags, back=back)
            for s, value in zip(phase.batch, got):
                known(s.chain if back else s.out, value)
    return buf, flags


# ------------------------------------------------------------------ the loop


class _Residuals(NamedTuple):
    """What the backward run of one loop keeps: its operands, the final carries on their
    grids, and the buffers."""

    consts: tuple
    init: tuple
    xs: tuple
    ints: tuple
    buf: tuple


@dataclass(frozen=True)
class _Loop:
    """A `scan` equation and everything its exact runs need besides its operands."""

    eqn: JaxprEqn
    plan: LoopPlan
    spec: Exact
    length: int
    reverse: bool
    on_error: str

    def scales(self, init: Sequence[Any]) -> list[Grid | None]:
        """Per slot, its grid: fractional bits from the start's magnitude, the same along each
        cycle of carries the body permutes (None: an integer carry)."""
        plan = self.plan
        own = [
            _scale_bits(x, self.spec.headroom_bits) if _is_float(v) else None
            for v, x in zip(plan.carry_in, init)
        ]
        out: list[Any] = list(own)
        seen: set[int] = set()
        for j in range(plan.ncarry):
            if j in seen or own[j] is None:
                continue
            cycle, k = [], j
            while k not in cycle:
                cycle.append(k)
                k = plan.origin[k]
            f = own[cycle[0]]
            for k in cycle[1:]:
                f = jnp.minimum(f, own[k])
            for k in cycle:
                out[k] = _grid(f, plan.carry_in[k].aval.dtype)
            seen.update(cycle)
        return out

    @property
    def capacity(self) -> int:
        """Words per element of the loop's buffer: `bits_per_step` per multiplication of a
        carry per iteration, for the carry multiplied most often, and two words of slack."""
        most = max(self.plan.lossy, default=0)
        bits = self.length * most * float(self.spec.bits_per_step) + 64
        return int(math.ceil(bits / WORD)) + 2

    def setup(self, consts, init):  # noqa: ANN001, ANN201
        """The grids, the start on them, the hoisted values and factors, empty buffers."""
        plan = self.plan
        scales = self.scales(init)
        ints, bad = [], []
        for v, x, f in zip(plan.carry_in, init, scales):
            if f is None:
                ints.append(x)
                bad.append(jnp.zeros((), bool))
            else:
                q, b = _to_fixed(x, f)
                ints.append(q)
                bad.append(jnp.any(b))
        env = _env(plan, consts, {}, [])
        evaluate(plan.invariant, env)
        hoisted = {o: env.read(o) for e in plan.invariant for o in e.outvars}
        factors = {}
        factor_bad = [jnp.zeros(b.shape, bool) for b in bad]
        for s in plan.steps.values():
            if s.lossy and isinstance(s.side, Var) and s.side in hoisted:
                r = factors[s.side] = Factor.of(hoisted[s.side])
                factor_bad[s.slot] = factor_bad[s.slot] | jnp.any(~r.ok)
        fx = _Fixed(plan, scales, factors)
        rows = sum(len(r) for r in plan.rows.values())
        buf = empty(rows, self.capacity) if plan.rows else None
        flags = _Flags(tuple(bad), tuple(factor_bad))
        return fx, ints, hoisted, buf, flags

    def forward(self, consts, init, xs, *, residuals: bool):  # noqa: ANN001, ANN201
        plan = self.plan
        fx, ints, hoisted, buf, flags = self.setup(consts, init)

        def step(carry, x_t):  # noqa: ANN001, ANN202
            ints, buf, flags = carry
            ints, buf, flags, ys = forward_iteration(fx, consts, hoisted, ints, buf, flags, x_t)
            return (ints, buf, flags), ys

        (ints, buf, flags), ys = lax.scan(
            step, (ints, buf, flags), list(xs), length=self.length, reverse=self.reverse
        )
        self._check_forward(flags, buf if residuals else None)
        outs = [fx.view(v, c) for v, c in zip(plan.carry_out, ints)]
        res = _Residuals(tuple(consts), tuple(init), tuple(xs), tuple(ints), buf)
        return (*outs, *ys), res

    def backward(self, res: _Residuals, cts: Sequence[Any]):  # noqa: ANN201
        plan = self.plan
        consts, init, xs = list(res.consts), list(res.init), list(res.xs)
        fx, start, hoisted, _, flags = self.setup(consts, init)
        flags = _Flags(*(tuple(jnp.zeros_like(f) for f in fs) for fs in flags))
        ct_carry0 = [ct if _is_float(v) else None for v, ct in zip(plan.carry_out, cts)]
        ct_ys = list(cts[plan.ncarry :])  # (those of integer outputs are float0)
        float_const = [_is_float_val(c) for c in consts]
        float_xs = [_is_float_val(x) for x in xs]
        ys_float = [_is_float(v) for v in plan.body.jaxpr.outvars[plan.ncarry :]]
        carry_float = [_is_float(v) for v in plan.carry_in]

        def step(carry, inp):  # noqa: ANN001, ANN202
            ints, buf, flags, ct_carry, ct_consts = carry
            x_t, ct_y = inp
            ints, buf, flags, held = backward_iteration(fx, consts, hoisted, ints, buf, flags, x_t)
            on_grid = {v: fx.view(v, c) for v, c in held.items()}  # (the carries' too)
            views = [on_grid[v] for v in plan.carry_in]
            fc = [c for c, f in zip(consts, float_const) if f]
            fcar = [c for c, f in zip(views, carry_float) if f]
            fxs = [x for x, f in zip(x_t, float_xs) if f]

            def iteration(fc, fcar, fxs):  # noqa: ANN001, ANN202
                args = [*_merge(consts, fc, float_const), *_merge(views, fcar, carry_float)]
                outs = _on_grid_iteration(plan, on_grid, [*args, *_merge(x_t, fxs, float_xs)])
                carry_out = [o for o, f in zip(outs[: plan.ncarry], carry_float) if f]
                return carry_out, [o for o, f in zip(outs[plan.ncarry :], ys_float) if f]

            _, vjp = jax.vjp(iteration, fc, fcar, fxs)
            ct_out = [c for c, f in zip(ct_carry, carry_float) if f]
            # (a weight's terms added apart: `sums`, as the other backward runs add them)
            g_c, g_car, g_xs = sums.pulled_back(vjp, (ct_out, list(ct_y)))
            ct_carry = _merge([None] * plan.ncarry, g_car, carry_float)
            ct_consts = [a + b for a, b in zip(ct_consts, g_c)]
            return (ints, buf, flags, ct_carry, ct_consts), g_xs

        zeros_c = [jnp.zeros_like(c) for c, f in zip(consts, float_const) if f]
        ct_carry = [
            jnp.asarray(c, v.aval.dtype) if f else None
            for c, v, f in zip(ct_carry0, plan.carry_out, carry_float)
        ]
        ct_ys_f = [c for c, f in zip(ct_ys, ys_float) if f]
        (ints, buf, flags, ct_carry, ct_consts), g_xs = lax.scan(
            step,
            (list(res.ints), res.buf, flags, ct_carry, zeros_c),
            (xs, ct_ys_f),
            length=self.length,
            reverse=not self.reverse,
        )
        self._check_rebuilt(ints, start, buf)
        ct_consts_all = _merge([None] * len(consts), ct_consts, float_const)
        ct_xs_all = _merge([None] * len(xs), g_xs, float_xs)
        return tuple(ct_consts_all), tuple(ct_carry), tuple(ct_xs_all)

    # -------------------------------------------------------------- checks

    def _check_forward(self, flags: _Flags, buf: Any) -> None:
        range_flags = jnp.stack([jnp.any(f) for f in flags.range])
        factor_flags = jnp.stack([jnp.any(f) for f in flags.factor])
        raise_where(
            self.on_error,
            self._range_error,
            range_flags,
            factor_flags,
            bad=jnp.any(range_flags) | jnp.any(factor_flags),
            always=True,
        )
        if buf is None:
            return
        peaks = jnp.stack([jnp.max(buf.peak[rows]) for rows in self.plan.rows.values()])
        raise_where(
            self.on_error,
            self._buffer_error,
            peaks,
            bad=jnp.any(peaks > self.capacity),
            always=True,
        )

    def _range_error(self, range_flags: Any, factor_flags: Any) -> Exception | None:
        if range_flags.any():
            j = int(np.argmax(range_flags))
            return at_eqn(
                ReversibilityError,
                self.eqn,
                f"carry {j} of the loop left its fixed-point range (2**{self.spec.headroom_bits}"
                " times its start's magnitude, at least 1), or a value added to it is not "
                "finite",
                "Ways out: more headroom, `jr.reversible(f, exact=jr.Exact(headroom_bits=...))`"
                " (each bit of headroom is one bit of resolution less), or a carry that starts "
                "at its working magnitude.",
                who=WHO,
                group=False,
            )
        if factor_flags.any():
            j = int(np.argmax(factor_flags))
            return at_eqn(
                ReversibilityError,
                self.eqn,
                f"carry {j} of the loop is multiplied or divided by a factor that exact reversal "
                "cannot hold (zero, not finite, or beyond [2**-8, 2**8] in magnitude)",
                "Ways out: `jr.reversible` without `exact`.",
                who=WHO,
                group=False,
            )
        return None

    def _buffer_error(self, peaks: Any) -> Exception | None:
        for j, b in zip(self.plan.rows, peaks):
            if int(b) > self.capacity:
                need = int(b) * WORD / (self.length * self.plan.lossy[j])
                return at_eqn(
                    ReversibilityError,
                    self.eqn,
                    f"carry {j}'s information buffer needed about {need:.1f} bits per "
                    f"multiplication per step, beyond the {self.spec.bits_per_step} it was "
                    "given",
                    "Way out: `jr.reversible(f, exact=jr.Exact(bits_per_step="
                    f"{math.ceil(need) + 1}))`.",
                    who=WHO,
                    group=False,
                )
        return None

    def _check_rebuilt(self, ints: Sequence[Any], start: Sequence[Any], buf: Any) -> None:
        with x64():
            miss = [jnp.any(a != b) for a, b in zip(ints, start)]
            if buf is not None:
                miss.append(jnp.any((buf.top != 0) | (buf.state != LOW)))
        flags = jnp.stack(miss)
        raise_where(self.on_error, self._rebuilt_error, flags, bad=jnp.any(flags), always=True)

    def _rebuilt_error(self, flags: Any) -> Exception | None:
        if not flags.any():
            return None
        return at_eqn(
            ReversibilityError,
            self.eqn,
            "the loop's start rebuilt by exact reversal differs from the true one: a value the "
            "body computes came out differently when the loop ran backwards",
            "This is a bug in jaxrev or a body that is not deterministic (a random draw with "
            "a key outside the carry, a host callback); please report it.",
            who=WHO,
            group=False,
        )


def _on_grid_iteration(plan: LoopPlan, on_grid: dict, args: Sequence[Any]) -> list[Any]:
    """One iteration of the body in floats, as the fixed-point run computes it: each chain
    value is the float view of its value on the grid (`on_grid`, from the undo), so every
    side value is evaluated at the same arguments as in the undo (XLA merges the two, and
    no value is computed twice per backward step), while its derivative is the chain
    equation's (rounding onto the grid differentiated as the identity). Differentiated by
    `jax.vjp`, it gives the fixed-point program's derivative at the rebuilt carries."""

    def rule(_: int, eqn: JaxprEqn, invals: list) -> list | None:
        if eqn not in plan.steps or not _is_float(eqn.outvars[0]):
            return None
        return [_valued(_float_op(plan.steps[eqn].kind, *invals), on_grid[eqn.outvars[0]])]

    return eval_closed(plan.body, *args, rule=rule)


def _float_op(kind: str, *operands: Any) -> Any:
    """A chain equation's float operation (its `ChainStep.kind`) on its operands in order."""
    if kind == "add":
        return lax.add(*operands)
    if kind in ("sub", "rsub"):  # (rsub: side - chain, the operands in the equation's order)
        return lax.sub(*operands)
    if kind == "mul":
        return lax.mul(*operands)
    if kind == "div":
        return lax.div(*operands)
    if kind == "neg":
        return lax.neg(*operands)
    return operands[0]  # a copy


@jax.custom_jvp
def _valued(computed: Any, value: Any) -> Any:
    """`value`, differentiated as `computed`."""
    return value


@_valued.defjvp
def _valued_jvp(primals, tangents):  # noqa: ANN001, ANN202
    return primals[1], tangents[0]


def _is_float_val(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _merge(base: Sequence[Any], sub: Sequence[Any], mask: Sequence[bool]) -> list[Any]:
    """`base` with the positions where `mask` holds taken from `sub`, in order."""
    it = iter(sub)
    return [next(it) if m else b for b, m in zip(base, mask)]


def exact_scan(loop: _Loop, consts: Sequence[Any], init: Sequence[Any], xs: Sequence[Any]):  # noqa: ANN201
    """The loop's outputs (final carries, then ys), run in fixed point, with a reverse-mode
    derivative that undoes it iteration by iteration."""

    @jax.custom_vjp
    def run(consts, init, xs):  # noqa: ANN001, ANN202
        return loop.forward(consts, init, xs, residuals=False)[0]

    def fwd(consts, init, xs):  # noqa: ANN001, ANN202
        return loop.forward(consts, init, xs, residuals=True)

    def bwd(res, cts):  # noqa: ANN001, ANN202
        return loop.backward(res, cts)

    run.defvjp(fwd, bwd)
    return list(run(tuple(consts), tuple(init), tuple(xs)))


# ------------------------------------------------------------------ the call


def run_exact(
    closed: ClosedJaxpr,
    args: Sequence[Any],
    spec: Exact,
    on_error: str,
    run_loop: Callable[..., list] | None = None,
) -> list:
    """Evaluate a program with each top-level `scan` (inside calls too) run exactly: the rest
    is left to JAX, whose reverse mode stores what it needs outside the loops. `run_loop(loop,
    consts, init, xs)` runs a loop (`exact_scan` unless given)."""
    run_loop = exact_scan if run_loop is None else run_loop
    env = Env()
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        env.write(v, c)
    for v, a in zip(closed.jaxpr.invars, args):
        env.write(v, a)

    def rule(_: int, eqn: JaxprEqn, invals: list) -> list | None:
        p = eqn.primitive
        if p is prims.scan:
            info = scan_info(eqn.params)
            plan = plan_loop(eqn, info.body, info.nconsts, info.ncarry)
            loop = _Loop(eqn, plan, spec, info.length, info.reverse, on_error)
            c, rest = invals[: info.nconsts], invals[info.nconsts :]
            return run_loop(loop, c, rest[: info.ncarry], rest[info.ncarry :])
        if p in (prims.jit, prims.closed_call):
            sub = call_jaxpr(eqn.params)
            return run_exact(sub, invals, spec, on_error, run_loop)
        if p is prims.while_:
            raise not_invertible(
                eqn,
                "exact reversal runs loops of known length (`lax.scan`, `fori_loop` with static "
                "bounds); a `while_loop` stops on a condition",
                hint=_HINT,
                who=WHO,
            )
        return None

    evaluate(closed.jaxpr.eqns, env, rule=rule)
    return [env.read(v) for v in closed.jaxpr.outvars]


def has_loops(closed: ClosedJaxpr) -> bool:
    """Whether `closed` has a loop for exact reversal (at its top level, or inside a `jit`
    call there; a `while_loop`, which it refuses by name, counts)."""
    return any(
        eqn.primitive in (prims.scan, prims.while_)
        or (eqn.primitive in (prims.jit, prims.closed_call) and has_loops(call_jaxpr(eqn.params)))
        for eqn in closed.jaxpr.eqns
    )


def _opaque_loop(loop: _Loop, consts: Sequence[Any], init: Sequence[Any], xs: Sequence[Any]):  # noqa: ANN202
    """A loop's outputs as shapes only, differentiable but keeping nothing: what JAX stores
    around it is then what the code outside the loops makes it store."""

    @jax.custom_vjp
    def run(consts, init, xs):  # noqa: ANN001, ANN202
        return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in loop.eqn.outvars]

    run.defvjp(lambda *a: (run(*a), None), lambda _, cts: None)
    return list(run(tuple(consts), tuple(init), tuple(xs)))


def outside_loops(closed: ClosedJaxpr, args: Sequence[Any], spec: Exact) -> list[dict]:
    """What JAX's reverse mode stores for the code of `closed` outside its exact loops (an
    unrolled network, a loss after a loop), as `memory_report` entries; the arguments and
    what the loops keep are not listed."""
    saved = saved_residuals(lambda *a: run_exact(closed, a, spec, "raise", _opaque_loop), *args)
    out = []
    for aval, why in saved:
        if why.startswith("from the argument"):
            continue
        dtype = jnp.dtype(aval.dtype)
        out.append(
            dict(
                what="value outside the loops, stored by JAX's reverse mode",
                shape=tuple(aval.shape),
                dtype=str(dtype),
                bytes=dtype.itemsize * int(np.prod(aval.shape, dtype=int)),
                count=1,
                where=why,
                made="",
            )
        )
    return out


def stored(closed: ClosedJaxpr, spec: Exact, describe: Any) -> list[dict]:
    """What exact reversal keeps for the backward run of each top-level loop of `closed`, as
    `memory_report` entries: the final carries on their grids (int64) and the information
    buffer (`describe(eqn)` names the loop)."""
    out: list[dict] = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive in (prims.jit, prims.closed_call):
            out += stored(call_jaxpr(eqn.params), spec, describe)
            continue
        if eqn.primitive is not prims.scan:
            continue
        info = scan_info(eqn.params)
        plan = plan_loop(eqn, info.body, info.nconsts, info.ncarry)
        loop = _Loop(eqn, plan, spec, info.length, info.reverse, "raise")
        for j, v in enumerate(plan.carry_out):
            shape = tuple(v.aval.shape)
            size = int(np.prod(shape, dtype=int))
            held = _is_float(v)
            dtype = jnp.dtype(_int_type(v.aval.dtype)[0] if held else v.aval.dtype)
            out.append(
                dict(
                    what=f"carry {j} at the loop's end" + (", in fixed point" if held else ""),
                    shape=shape,
                    dtype=str(dtype),
                    bytes=dtype.itemsize * size,
                    count=1,
                    where=describe(eqn),
                    made=describe(eqn),
                )
            )
        rows = sum(len(r) for r in plan.rows.values())
        if rows:
            words = rows * (loop.capacity + 1)
            out.append(
                dict(
                    what=(
                        f"information buffer: {spec.bits_per_step} bits per multiplication per "
                        f"element per step, {loop.capacity} words of {WORD} bits per element"
                    ),
                    shape=(rows, loop.capacity + 1),
                    dtype="uint32",
                    bytes=4 * words + 16 * rows,  # the words; the state, top and peak
                    count=1,
                    where=describe(eqn),
                    made=describe(eqn),
                )
            )
    return out
