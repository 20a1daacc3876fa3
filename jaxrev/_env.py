"""The value environment of a walk: the `Unknown` marker, what is known of a jaxpr's values when
it is traced (`Statics`), and `Env`, the values (and the values known on some elements) of one
walk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxrev._host as host
from jaxrev._compat import (
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn,
    compiled_eqns,
    is_concrete,
    is_key,
    zeros_of,
)
from jaxrev._graph import is_var

# What a walk knows beyond whole values is typed by modules above this one (which import it),
# so the env names those types by alias; the aliases say what each annotation holds.
PartValue = Any  # a `knowledge.elements.Part`: a value known on some of its elements
ElementRegion = Any  # a `knowledge.regions.Region`: a set of element positions
LossReason = Any  # a `registry.Lossy`: why element rules could not give elements back
WalkSettings = Any  # a `knowledge.context.WalkContext`: what steers the walk


MIN_FOLDED = 3
"""Operations on constants from which they are evaluated as one compiled program
(`compiled_eqns`), not one by one."""


class Unknown:
    """Stands for an input an inverse rule must recover; carries the input's abstract value."""

    __slots__ = ("aval",)

    def __init__(self, aval: Any) -> None:
        self.aval = aval

    @property
    def shape(self) -> tuple[int, ...]:
        return self.aval.shape

    @property
    def dtype(self) -> Any:
        return self.aval.dtype

    def __repr__(self) -> str:
        return f"Unknown({self.aval.str_short()})"


def is_unknown(x: Any) -> bool:
    return isinstance(x, Unknown)


def _on_host(args: Sequence[Any]) -> bool:
    """Whether `args` are host arrays of plain dtypes (a PRNG key array is not)."""
    return all(isinstance(a, (np.ndarray, np.generic)) and a.dtype.kind in "biuf" for a in args)


def _iterations_first(args: Sequence[Any], axes: Sequence[Any], e: Any) -> list:
    """`args` laid out for numpy's broadcasting over every iteration at once: each operand
    ``(T or 1, 1..., *its own shape)``, its own shape aligned at the right of the output's
    (an operand given at every iteration has T first; a per-iteration scalar would
    otherwise meet the output's last axis)."""
    rank = len(e.outvars[0].aval.shape)
    out = []
    for a, ax in zip(args, axes):
        own = a.shape[1:] if ax == 0 else a.shape
        lead = a.shape[:1] if ax == 0 else (1,)
        out.append(np.reshape(a, lead + (1,) * (rank - len(own)) + tuple(own)))
    return out


class Statics:
    """What is known of a jaxpr's values when it is traced, shared by an `Env` and its copies.

    `static(v)`: the value of `v` as a numpy array where it follows from literals and concrete
    consts alone (a mask, an index, a permutation), the same under `jit` and eagerly.
    `enum(v)`: in the body of a loop whose iterations the loop rule enumerated, `v`'s value at
    every iteration (a leading axis of `length`), where it follows from the loop counter and
    static values. Both are derived on demand and memoized; None where not known at trace time.
    `support(v)`: where `v` may be nonzero (a boolean array), where that is known at trace
    time though `v` is not: a masked weight inside a loop over stacked layers, handed to a
    nested loop's body (`support_in`), whose value differs from one outer iteration to the
    next but whose zeros do not.
    """

    MAX_SIZE = 1 << 20
    """Largest array (elements, times iterations for `enum`) derived at trace time."""

    def __init__(
        self,
        jaxpr: Jaxpr | None = None,
        consts: Sequence[Any] = (),
        static_in: dict | None = None,
        enum_in: dict | None = None,
        length: int | None = None,
        support_in: dict | None = None,
    ) -> None:
        self.producer: dict[Var, JaxprEqn] = {}
        if jaxpr is not None:
            for e in jaxpr.eqns:
                for o in e.outvars:
                    if is_var(o):
                        self.producer[o] = e
        self._consts = (
            {v: c for v, c in zip(jaxpr.constvars, consts) if is_concrete(c)}
            if jaxpr is not None
            else {}
        )
        self._static: dict[Var, Any] = dict(static_in or {})
        self._enum: dict[Var, Any] = dict(enum_in or {})
        self._support: dict[Var, Any] = dict(support_in or {})
        self._read_by: dict | None = None
        self.length = length

    def static(self, v: Any) -> np.ndarray | None:
        return _numeric(self._static_value(v))

    def enum(self, v: Any) -> np.ndarray | None:
        return _numeric(self._enum_value(v))

    def support(self, v: Any) -> np.ndarray | None:
        s = self.static(v)
        if s is not None:
            return np.broadcast_to(np.asarray(s) != 0, tuple(v.aval.shape))
        en = self.enum(v)
        if en is not None:
            return np.any(np.asarray(en) != 0, axis=0)
        if not is_var(v):
            return None
        if v not in self._support:
            self._support[v] = None  # (guards re-entry)
            self._support[v] = self._derived_support(v)
        return self._support[v]

    def _derived_support(self, v: Var) -> np.ndarray | None:
        """The zeros a weight masked by a static mask has, whatever its values: a select
        by a static predicate (``where(mask, w, 0)``, how flowjax and paramax mask a layer), a
        product by a static factor, and moves of such a value. (A product's zero may be NaN
        where the other factor is infinite: only a rule that computes with the value itself,
        as `dot_general`'s does, may rely on it.)"""
        e = self.producer.get(v)
        if e is None or getattr(e, "effects", None):
            return None
        name = e.primitive.name
        shape = tuple(v.aval.shape)

        def of(u: Any) -> np.ndarray:  # unknown zeros: anything may be nonzero
            sup = self.support(u)
            full = np.ones(tuple(u.aval.shape), bool)
            return full if sup is None else np.broadcast_to(sup, full.shape)

        if name == "select_n":
            which = self.static(e.invars[0])
            if which is None and len(e.invars) == 3 and self.support(e.invars[0]) is not None:
                # a predicate whose zeros alone are known (a mask handed to a nested loop):
                # case 0 where it is surely 0, either case elsewhere
                maybe = np.broadcast_to(self.support(e.invars[0]), shape)
                return np.broadcast_to(of(e.invars[1]), shape) | (
                    maybe & np.broadcast_to(of(e.invars[2]), shape)
                )
            if which is None:
                return None
            which = np.broadcast_to(np.asarray(which).astype(np.int64), shape)
            out = np.zeros(shape, bool)
            for i, case in enumerate(e.invars[1:]):
                out |= (which == i) & np.broadcast_to(of(case), shape)
            return out
        if name == "mul":
            return np.broadcast_to(of(e.invars[0]), shape) & np.broadcast_to(of(e.invars[1]), shape)
        if name in ("convert_element_type", "copy", "copy_p"):
            return of(e.invars[0])
        if name == "transpose":
            return np.transpose(of(e.invars[0]), e.params["permutation"])
        if name == "reshape" and e.params.get("dimensions") is None:
            return of(e.invars[0]).reshape(shape)
        return None

    def _static_value(self, v: Any) -> Any:
        if isinstance(v, Literal):
            return _host(v.val)
        if not is_var(v):
            return None
        if v in self._static:
            return self._static[v]
        if v in self._consts:
            c = self._consts[v]
            val = _host(c) if np.size(c) <= self.MAX_SIZE else None
            self._static[v] = val
            return val
        e = self.producer.get(v)
        if e is None or getattr(e, "effects", None):
            self._static[v] = None
            return None
        # depth first over the producers, without recursion (chains of constants can be long)
        stack, order, ordered = [e], [], set()
        while stack:
            e = stack[-1]
            missing = [
                u
                for u in e.invars
                if is_var(u)
                and u not in self._static
                and u not in self._consts
                and u in self.producer
                and self.producer[u] not in ordered
            ]
            if missing:
                stack.append(self.producer[missing[0]])
                continue
            stack.pop()
            if e not in ordered:
                ordered.add(e)
                order.append(e)
        self._evaluate_statics(order, v)
        return self._static.get(v)

    def _evaluate_statics(self, order: Sequence[JaxprEqn], want: Var) -> None:
        """The static values of the outputs of `order` (producers before their readers) whose
        inputs are all static, None for the rest: at once, one compiled program (op by op,
        each operation on constants was an XLA program of its own, 50 of a flowjax flow's
        first trace), which gives `want` and what equations outside it read (an intermediate
        asked for later is derived again)."""
        made: dict = {}  # (ordered: the outputs in the order their equations run)
        group: list = []
        for e in order:
            if (
                not getattr(e, "effects", None)
                and all(
                    (is_var(u) and u in made) or self._static_value(u) is not None for u in e.invars
                )
                and all(
                    np.prod(o.aval.shape, dtype=np.int64) <= self.MAX_SIZE
                    for o in e.outvars
                    if is_var(o)
                )
            ):
                group.append(e)
                made.update((o, None) for o in e.outvars if is_var(o))
            else:
                for o in e.outvars:
                    if is_var(o):
                        self._static[o] = None
        if len(group) < MIN_FOLDED:  # (one by one: each operation's program is cached)
            for e in group:
                with jax.ensure_compile_time_eval():
                    outs = bind_eqn(e, [self._static_value(u) for u in e.invars])
                for o, val in zip(e.outvars, outs):
                    if is_var(o):
                        self._static[o] = _host(val)
            return
        ins = tuple(
            dict.fromkeys(u for e in group for u in e.invars if is_var(u) and u not in made)
        )
        chosen = set(group)
        readers = self._readers()
        outs = tuple(
            o for o in made if o is want or any(r not in chosen for r in readers.get(o, ()))
        )
        with jax.ensure_compile_time_eval():
            vals = compiled_eqns(tuple(group), ins, outs)(*[self._static[u] for u in ins])
        for o, val in zip(outs, vals):
            self._static[o] = _host(val)

    def _readers(self) -> dict:
        """The equations reading each variable (built once, on first need)."""
        if self._read_by is None:
            self._read_by = {}
            for e in dict.fromkeys(self.producer.values()):
                for u in e.invars:
                    if is_var(u):
                        self._read_by.setdefault(u, []).append(e)
        return self._read_by

    def _enum_value(self, v: Any) -> Any:
        if self.length is None or not is_var(v):
            return None
        if v in self._enum:
            return self._enum[v]
        self._enum[v] = None  # a cycle cannot happen in a jaxpr; this guards re-entry
        e = self.producer.get(v)
        if e is None or getattr(e, "effects", None):
            return None
        T = self.length
        if any(
            T * np.prod(o.aval.shape, dtype=np.int64) > self.MAX_SIZE
            for o in e.outvars
            if is_var(o)
        ):
            return None
        args, axes = [], []
        for u in e.invars:
            s = self._static_value(u)
            if s is not None:
                args.append(s)
                axes.append(None)
                continue
            en = self._enum_value(u)
            if en is None:
                return None
            args.append(en)
            axes.append(0)
        if all(a is None for a in axes):
            return None
        # (integer bookkeeping on the host: through JAX, each primitive compiled on its own)
        done = host.elementwise(e, _iterations_first(args, axes, e)) if _on_host(args) else None
        if done is not None and done.shape == (T, *e.outvars[0].aval.shape):
            outs = [done]
        else:
            with jax.ensure_compile_time_eval():
                outs = jax.vmap(lambda *a: bind_eqn(e, a), in_axes=tuple(axes))(*args)
        for o, val in zip(e.outvars, outs):
            if is_var(o):
                self._enum[o] = _host(val)
        return self._enum[v]


# A PRNG key made from a literal seed is known at trace time, and so is a mask or noise drawn
# from it. numpy cannot hold the key: it stays a JAX array, which `static` and `enum` never
# hand out (no rule reads a key as a mask or an index)
def _host(x: Any) -> Any:
    return x if is_key(x) else np.asarray(x)


def _numeric(x: Any) -> Any:
    return None if is_key(x) else x


class ElementKnowledge:
    """What a walk knows short of whole values: `part`, the variables known on some of their
    elements only (`elements.Part`), and `losses`, why an equation's element rules could not
    give back some elements of its inputs (a `Lossy`; None: its output came forward after
    all). An env's copy copies it."""

    __slots__ = ("part", "losses")

    def __init__(
        self,
        part: dict[Var, PartValue] | None = None,
        losses: dict[JaxprEqn, LossReason | None] | None = None,
    ) -> None:
        self.part: dict[Var, PartValue] = {} if part is None else part
        self.losses: dict[JaxprEqn, LossReason | None] = {} if losses is None else losses

    def copy(self) -> ElementKnowledge:
        return ElementKnowledge(dict(self.part), dict(self.losses))


class Env:
    """Values of a jaxpr's variables; a variable absent from it is not known yet. Values are
    fitted to their variable's aval on write, unless `fit` is off (a probe that evaluates
    elementwise equations on a few sample elements).

    `vals` holds the values known whole (arrays, or tracers of them); `knowledge` what is known
    short of that (`ElementKnowledge`: `part`, the variables known on some of their elements,
    and `losses`, which the env also offers as `env.part` and `env.losses`); `masks` the
    regions made into boolean arrays, shared by copies; `info` the trace-time knowledge of the
    jaxpr (`Statics`), shared by copies; `ctx` the walk context of the walk that fills it
    (`transforms/knowledge/context.py`: its settings, record, drift log), kept by copies (None
    for an env only evaluated forward)."""

    __slots__ = ("vals", "knowledge", "masks", "windows", "fit", "info", "ctx")

    def __init__(
        self, fit: bool = True, info: Statics | None = None, ctx: WalkSettings | None = None
    ) -> None:
        self.vals: dict[Var, Any] = {}
        self.knowledge = ElementKnowledge()
        self.masks: dict[tuple[ElementRegion, tuple[int, ...]], Any] = {}
        # the windows the walk wrote into arrays (`elements._write_window`), by the id of the
        # array written: a read of the same window is the piece written (shared by copies)
        self.windows: dict[int, Any] = {}
        self.fit = fit
        self.info: Statics = info if info is not None else Statics()
        self.ctx: WalkSettings | None = ctx

    @property
    def part(self) -> dict[Var, PartValue]:
        """The variables known on some of their elements only (`knowledge.part`)."""
        return self.knowledge.part

    @property
    def losses(self) -> dict[JaxprEqn, LossReason | None]:
        """Why an equation's element rules lose some elements of its inputs
        (`knowledge.losses`)."""
        return self.knowledge.losses

    def known(self, v: Any) -> bool:
        if isinstance(v, Literal) or v in self.vals:
            return True
        if (
            isinstance(v, Var) and not isinstance(v, DropVar) and 0 in getattr(v.aval, "shape", ())
        ):  # an empty array holds nothing to recover
            self.vals[v] = zeros_of(v.aval)
            return True
        return False

    def read(self, v: Any) -> Any:
        if isinstance(v, Literal):
            return v.val
        return self.vals[v]

    def read_or_unknown(self, v: Any) -> Any:
        return self.read(v) if self.known(v) else Unknown(v.aval)

    def write(self, v: Any, val: Any) -> None:
        if isinstance(v, (Literal, DropVar)) or v in self.vals:
            return
        self.vals[v] = fit_to_aval(val, v.aval) if self.fit else val
        self.knowledge.part.pop(v, None)

    def state(self, v: Any) -> PartValue | bool | None:
        """How much of `v` is known: True (all), a partial record, or None (nothing)."""
        if self.known(v):
            return True
        return self.knowledge.part.get(v) if is_var(v) else None

    def copy(self) -> Env:
        e = Env(self.fit, self.info, self.ctx)
        e.vals = dict(self.vals)
        e.knowledge = self.knowledge.copy()
        e.masks = self.masks
        e.windows = self.windows
        return e


def fit_to_aval(val: Any, aval: Any) -> Any:
    """Cast a recovered value to the variable's dtype and, where a rule recovered a value of a
    broadcast operand on the broadcast shape, pick the operand back out (a left inverse)."""
    shape = tuple(aval.shape)
    vshape = tuple(np.shape(val))
    if vshape != shape:
        if len(vshape) < len(shape) or not _broadcastable(shape, vshape):
            raise ValueError(f"jaxrev internal error: value of shape {vshape} for {aval}")
        lead = len(vshape) - len(shape)
        idx = tuple(
            [0] * lead
            + [slice(None) if s == vs else slice(0, 1) for s, vs in zip(shape, vshape[lead:])]
        )
        val = jnp.reshape(val[idx], shape)
    if jnp.result_type(val) != aval.dtype:
        val = jax.lax.convert_element_type(val, aval.dtype)
    return val


def _broadcastable(small: Sequence[int], big: Sequence[int]) -> bool:
    small = tuple(small)[::-1]
    big = tuple(big)[::-1]
    return all(s == b or s == 1 for s, b in zip(small, big))
