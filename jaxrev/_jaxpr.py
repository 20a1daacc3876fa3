"""Shared jaxpr machinery: the value environment, the one forward evaluator, the Unknown marker,
liveness, call inlining, and the batched-select helpers every control-flow rule uses."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import (
    CALL_PRIMITIVES,
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    as_closed,
    bind_eqn,
    call_jaxpr,
    dce,
    has_user_frame,
    is_concrete,
    is_host_callback,
    is_key,
    is_symbolic_zero,
    new_var,
    not_mapped,
    prims,
    trace_to_closed,
    zeros_of,
)


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


def is_var(v: Any) -> bool:
    """A variable that holds a value (not a literal, not a dropped output)."""
    return isinstance(v, Var) and not isinstance(v, DropVar)


def real_outvars(eqn: JaxprEqn) -> list[Var]:
    return [v for v in eqn.outvars if not isinstance(v, DropVar)]


class Statics:
    """What is known of a jaxpr's values when it is traced, shared by an `Env` and its copies.

    `static(v)`: the value of `v` as a numpy array where it follows from literals and concrete
    consts alone (a mask, an index, a permutation), the same under `jit` and eagerly.
    `enum(v)`: in the body of a loop whose iterations the loop rule enumerated, `v`'s value at
    every iteration (a leading axis of `length`), where it follows from the loop counter and
    static values. Both are derived on demand and memoized; None where not known at trace time.
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
        self.length = length

    def static(self, v: Any) -> np.ndarray | None:
        return _numeric(self._static_value(v))

    def enum(self, v: Any) -> np.ndarray | None:
        return _numeric(self._enum_value(v))

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
        stack = [e]
        while stack:
            e = stack[-1]
            missing = [
                u
                for u in e.invars
                if is_var(u)
                and u not in self._static
                and u not in self._consts
                and u in self.producer
            ]
            if missing:
                stack.append(self.producer[missing[0]])
                continue
            stack.pop()
            ins = [self._static_value(u) for u in e.invars]
            outs = None
            if (
                all(x is not None for x in ins)
                and not getattr(e, "effects", None)
                and all(
                    np.prod(o.aval.shape, dtype=np.int64) <= self.MAX_SIZE
                    for o in e.outvars
                    if is_var(o)
                )
            ):
                with jax.ensure_compile_time_eval():
                    outs = [_host(o) for o in bind_eqn(e, ins)]
            for o, val in zip(e.outvars, outs or [None] * len(e.outvars)):
                if is_var(o):
                    self._static[o] = val
        return self._static.get(v)

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


class Env:
    """Values of a jaxpr's variables; a variable absent from it is not known yet. Values are
    fitted to their variable's aval on write, unless `fit` is off (a probe that evaluates
    elementwise equations on a few sample elements).

    `part` holds the variables known on some of their elements only (`elements.Part`), and
    `losses` why an equation's element rules could not give back some elements (a `Lossy`);
    `info` the trace-time knowledge of the jaxpr (`Statics`), shared by copies; `ctx` the walk
    context of the walk that fills it (`transforms/knowledge/context.py`: its settings, record,
    drift log), kept by copies (None for an env only evaluated forward)."""

    def __init__(self, fit: bool = True, info: Statics | None = None, ctx: Any = None) -> None:
        self.vals: dict[Var, Any] = {}
        self.part: dict[Var, Any] = {}
        self.losses: dict[Any, Any] = {}  # equation -> why some elements of its inputs are lost
        self.masks: dict[Any, Any] = {}  # regions made into arrays, shared by copies
        self.fit = fit
        self.info = info if info is not None else Statics()
        self.ctx = ctx

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
        self.part.pop(v, None)

    def state(self, v: Any) -> Any:
        """How much of `v` is known: True (all), a partial record, or None (nothing)."""
        if self.known(v):
            return True
        return self.part.get(v) if is_var(v) else None

    def copy(self) -> Env:
        e = Env(self.fit, self.info, self.ctx)
        e.vals = dict(self.vals)
        e.part = dict(self.part)
        e.losses = dict(self.losses)
        e.masks = self.masks
        return e


# --------------------------------------------------------------------------- the evaluator

EqnRule = Callable[[int, JaxprEqn, list], "list | None"]


def evaluate(
    eqns: Sequence[JaxprEqn],
    env: Env,
    *,
    partial: bool = False,
    used: set | None = None,
    rule: EqnRule | None = None,
) -> bool:
    """Run `eqns` forward in order, writing their outputs into `env`: the one evaluator every
    jaxrev interpreter uses.

    With `partial`, equations with an unknown input are skipped (what is computable from what
    is known); with `used`, an equation runs only for unknown outputs in it (so equations run
    only for their effects are skipped); `rule(index, eqn, invals)`
    may evaluate an equation itself (returning its outputs) or decline with None. Returns
    whether anything was written.
    """
    wrote = False
    for i, e in enumerate(eqns):
        outs = real_outvars(e)
        if used is not None:  # only for values someone reads (no effects-only equations)
            if not any(o in used and not env.known(o) for o in outs):
                continue
        elif outs and all(env.known(o) for o in outs):
            continue
        if partial and not all(env.known(v) for v in e.invars):
            continue
        ins = [env.read(v) for v in e.invars]
        vals = rule(i, e, ins) if rule is not None else None
        for v, o in zip(e.outvars, bind_eqn(e, ins) if vals is None else vals):
            env.write(v, o)
        wrote = wrote or bool(outs)
    return wrote


def apply(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """One equation on the given input values (element-level rules run an equation on partly
    known arrays, or on positions, through this): the evaluator's single-equation form."""
    return bind_eqn(eqn, invals)


def eval_closed(closed: ClosedJaxpr, *args: Any) -> list[Any]:
    """Evaluate a closed jaxpr on values or tracers."""
    env = Env()
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        env.write(v, c)
    for v, a in zip(closed.jaxpr.invars, args):
        env.write(v, a)
    evaluate(closed.jaxpr.eqns, env)
    return [env.read(v) for v in closed.jaxpr.outvars]


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


def used_vars(jaxpr: Jaxpr) -> set[Var]:
    """Variables that some equation or the output reads (liveness at the level of a jaxpr)."""
    used: set[Var] = set()
    for eqn in jaxpr.eqns:
        used.update(v for v in eqn.invars if isinstance(v, Var))
    used.update(v for v in jaxpr.outvars if isinstance(v, Var))
    return used


def needed_vars(jaxpr: Jaxpr, outs: Sequence[Any]) -> set[Var]:
    """The variables that `outs` are computed from (and `outs` themselves)."""
    need = {v for v in outs if isinstance(v, Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(o in need for o in eqn.outvars):
            need.update(v for v in eqn.invars if isinstance(v, Var))
    return need


def restrict(closed: ClosedJaxpr, outs: Sequence[int]) -> ClosedJaxpr:
    """`closed` computing only its outputs `outs` (same inputs): the equations they need."""
    j = closed.jaxpr
    keep = [j.outvars[k] for k in outs]
    need = needed_vars(j, keep)
    eqns = [e for e in j.eqns if any(o in need for o in e.outvars)]
    return ClosedJaxpr(j.replace(eqns=eqns, outvars=keep), closed.consts)


def consumers(jaxpr: Jaxpr) -> dict[Var, list[int]]:
    out: dict[Var, list[int]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, Var):
                out.setdefault(v, []).append(i)
    return out


def forward_known(jaxpr: Jaxpr, known_in: Sequence[bool]) -> list[bool]:
    """Which outputs are computable from the inputs marked known, by forward evaluation only."""
    known = {v for v, k in zip(jaxpr.invars, known_in) if k}
    known.update(jaxpr.constvars)
    for eqn in jaxpr.eqns:
        if all(isinstance(v, Literal) or v in known for v in eqn.invars):
            known.update(eqn.outvars)
    return [isinstance(v, Literal) or v in known for v in jaxpr.outvars]


def size_of(avals: Iterable[Any]) -> int:
    return int(sum(int(np.prod(a.shape, dtype=np.int64)) for a in avals))


def prepare(closed: ClosedJaxpr) -> ClosedJaxpr:
    """The jaxpr every walk sees: call-like equations (`jit`, `custom_jvp_call`, ...) inlined,
    equations that compute the same value merged, and what no output needs dropped (`dce`).

    Inversion works across call boundaries this way: a linear lump or a `select_n` case split
    may span code inside and outside `jnp.where`'s or `jnp.cumsum`'s inner `jit`. Inner equations
    with no user frame of their own take the source line of the call that contains them. JAX
    does not merge duplicates (`f(z)` written twice, `x[:1]` and `x[0]`): merged, a value known
    once is known everywhere, and a nonlinear group sees `f(z)` as one unknown, not two. A
    loop's carry that no output reads (a log-det accumulated beside the state but not
    returned) is dead: carried, it would make the loop's final carry unknown to `reverse`.
    """
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    constvars = list(jaxpr.constvars)
    sub: dict[Var, Any] = {}

    def s(a: Any) -> Any:
        return sub.get(a, a) if isinstance(a, Var) else a

    eqns: list[JaxprEqn] = []
    seen: dict[tuple, JaxprEqn] = {}

    def inline(eqn: JaxprEqn, outer_src: Any) -> None:
        src = eqn.source_info if outer_src is None or has_user_frame(eqn) else outer_src
        taken = _taken_branch(eqn, s)
        if taken is not None:
            inner, operands = taken
        elif eqn.primitive not in CALL_PRIMITIVES:
            invars = [s(v) for v in eqn.invars]
            sig = _signature(eqn, invars)
            first = seen.get(sig) if sig is not None else None
            if first is not None:
                for o, f in zip(eqn.outvars, first.outvars):
                    if not isinstance(o, DropVar) and not isinstance(f, DropVar):
                        sub[o] = f
                if all(
                    isinstance(o, DropVar) or not isinstance(f, DropVar)
                    for o, f in zip(eqn.outvars, first.outvars)
                ):
                    return
            # fresh output variables: the same inner jaxpr may be inlined more than once
            outs = []
            for o in eqn.outvars:
                if isinstance(o, DropVar):
                    outs.append(o)
                else:
                    sub[o] = nv = new_var(o.aval)
                    outs.append(nv)
            new = eqn.replace(invars=invars, outvars=outs, source_info=src)
            eqns.append(new)
            if sig is not None and first is None:
                seen[sig] = new
            return
        else:
            inner, operands = call_jaxpr(eqn.params), eqn.invars
        ij = inner.jaxpr
        for v, c in zip(ij.constvars, inner.consts):
            sub[v] = nv = new_var(v.aval)
            constvars.append(nv)
            consts.append(c)
        outer_in = [s(a) for a in operands]
        for v, a in zip(ij.invars, outer_in):
            sub[v] = a
        for ie in ij.eqns:
            inline(ie, src)
        inner_out = [s(io) for io in ij.outvars]
        for o, io in zip(eqn.outvars, inner_out):
            if not isinstance(o, DropVar):
                sub[o] = io

    for eqn in jaxpr.eqns:
        inline(eqn, None)
    new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[s(v) for v in jaxpr.outvars])
    return ClosedJaxpr(dce(new), consts)


def _taken_branch(eqn: JaxprEqn, s: Callable) -> tuple[ClosedJaxpr, list] | None:
    """A `cond` whose index is a literal (diffrax's `made_jump=False`, a Python bool passed to
    `lax.cond`) is its taken branch: inlined, its other branches never run, so they need no
    inverse and store nothing."""
    if eqn.primitive is not prims.cond:
        return None
    index = s(eqn.invars[0])
    if not isinstance(index, Literal):
        return None
    branches = eqn.params["branches"]
    k = min(max(int(np.asarray(index.val)), 0), len(branches) - 1)
    return as_closed(branches[k]), list(eqn.invars[1:])


@functools.lru_cache(maxsize=65536)
def _param_key(eqn: JaxprEqn) -> tuple | None:
    """The hashable params of an equation (None: not comparable, e.g. a sub-jaxpr)."""
    if getattr(eqn, "effects", None):
        return None
    params = []
    for k, v in sorted(eqn.params.items()):
        if isinstance(v, (Jaxpr, ClosedJaxpr)):
            return None
        try:
            hash(v)
        except TypeError:
            return None
        params.append((k, v))
    return (eqn.primitive, tuple(params))


def _signature(eqn: JaxprEqn, invars: Sequence[Any]) -> tuple | None:
    """What makes two equations compute the same value (None: not comparable)."""
    key = _param_key(eqn)
    if key is None:
        return None
    ins = []
    for v in invars:
        if isinstance(v, Literal):
            val = np.asarray(v.val)
            ins.append(("lit", str(val.dtype), val.tobytes(), val.shape))
        else:
            ins.append(v)
    return (key, tuple(ins))


def instantiate_tangents(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, ...]:
    """Tangents as arrays, for JVP rules that run `jax.jvp` on an impl: symbolic zeros (or None)
    become zeros, float0 ones for integer primals."""
    out = []
    for p, t in zip(primals, tangents):
        if t is None or is_symbolic_zero(t):
            dt = jnp.result_type(p)
            t = (
                jnp.zeros(jnp.shape(p), dt)
                if jnp.issubdtype(dt, jnp.inexact)
                else np.zeros(jnp.shape(p), jax.dtypes.float0)
            )
        out.append(t)
    return tuple(out)


def batch_front(args: Sequence[Any], dims: Sequence[Any]) -> tuple[int, list, list]:
    """For a batching rule: (batch size, operands with their batch axis first, vmap in_axes)."""
    size = next(jnp.shape(x)[d] for x, d in zip(args, dims) if d is not not_mapped)
    args = [jnp.moveaxis(x, d, 0) if d is not not_mapped else x for x, d in zip(args, dims)]
    return size, args, [0 if d is not not_mapped else None for d in dims]


# --------------------------------------------------------------------------- batched selects


def where(pred: Any, a: Any, b: Any) -> Any:
    """`jnp.where` as one `select_n`. jaxrev's own selects do not go through `jnp.where`:
    JAX (0.12) caches that function's traced jaxpr per argument shapes, with the traceback of
    its first caller, and a user's `jnp.where` of the same shapes would then be blamed on the
    line where jaxrev first traced one."""
    a, b = jnp.asarray(a), jnp.asarray(b)
    if not is_key(a):  # a key array has no `astype` (two keys have one dtype anyway)
        dt = jnp.result_type(a, b)
        a, b = a.astype(dt), b.astype(dt)
    shape = jnp.broadcast_shapes(jnp.shape(pred), a.shape, b.shape)
    return jax.lax.select(
        jnp.broadcast_to(jnp.asarray(pred, bool), shape),
        jnp.broadcast_to(a, shape),
        jnp.broadcast_to(b, shape),
    )


def select_batched(pred: Any, new: Any, old: Any) -> Any:
    """Per-batch-element select; `pred` has the leading (batch) shape of the operands."""
    p = jnp.reshape(pred, jnp.shape(pred) + (1,) * (jnp.ndim(new) - jnp.ndim(pred)))
    return where(p, new, old)


def switch_batched(index: Any, fns: Sequence[Callable[..., Any]], *args: Any) -> Any:
    """`lax.switch(index, fns, *args)`, also for a batched index (a vmapped `jr.cond` or a
    branch index stored per element): then every branch runs and element b of each output
    leaf comes from branch `index[b]`. The index is clipped, as `lax.switch` does."""
    index = jnp.clip(index, 0, len(fns) - 1)
    if jnp.ndim(index) == 0:
        return jax.lax.switch(index, list(fns), *args)
    per = [f(*args) for f in fns]
    leaves = [jax.tree_util.tree_leaves(p) for p in per]
    out = []
    for k in range(len(leaves[0])):
        r = leaves[0][k]
        for b in range(1, len(fns)):
            r = select_batched(index == b, leaves[b][k], r)
        out.append(r)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(per[0]), out)


def vmap_closed(closed: ClosedJaxpr, in_axes: Sequence[Any], args: Sequence[Any]) -> ClosedJaxpr:
    """`closed` vmapped over `in_axes` (for the batching rules of primitives carrying jaxprs)."""
    fn = jax.vmap(lambda *a: eval_closed(closed, *a), in_axes=tuple(in_axes))
    new, consts, _ = trace_to_closed(
        fn, *[jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in args]
    )
    assert not consts
    return new


def move_batch(x: Any, d: Any, size: int, force: bool) -> tuple[Any, Any]:
    """An operand with its batch axis first; an unbatched one is broadcast when `force`."""
    if d is None:
        if not force:
            return x, None
        return jnp.broadcast_to(x, (size,) + jnp.shape(x)), 0
    return jnp.moveaxis(x, d, 0), 0


def without_custom_vjp(closed: ClosedJaxpr) -> ClosedJaxpr:
    """`closed` with every `custom_vjp` call, at any depth (loop and branch bodies included),
    replaced by its primal computation; `closed` itself where it has none.

    Forward-mode AD cannot pass a `custom_vjp` function, and J⁻¹v and log-determinants are
    forward-mode quantities: they differentiate the function's own computation, not the
    user's VJP (which is only a way to compute a VJP of that same computation).
    """
    if not mentions(closed.jaxpr, _is_custom_vjp):
        return closed
    jaxpr = closed.jaxpr
    consts, constvars = list(closed.consts), list(jaxpr.constvars)
    sub: dict[Var, Any] = {}
    eqns: list[JaxprEqn] = []

    def s(a: Any) -> Any:
        return sub.get(a, a) if isinstance(a, Var) else a

    def emit(eqn: JaxprEqn, inlined: bool) -> None:
        # a custom_jvp rule over a custom_vjp function would JVP it: that one goes too
        if eqn.primitive is prims.custom_vjp_call or (
            eqn.primitive is prims.custom_jvp_call
            and mentions(call_jaxpr(eqn.params).jaxpr, _is_custom_vjp)
        ):
            inner = without_custom_vjp(call_jaxpr(eqn.params))
            for v, c in zip(inner.jaxpr.constvars, inner.consts):
                sub[v] = nv = new_var(v.aval)
                constvars.append(nv)
                consts.append(c)
            for v, a in zip(inner.jaxpr.invars, eqn.invars):
                sub[v] = s(a)
            for ie in inner.jaxpr.eqns:
                emit(ie, True)
            for o, io in zip(eqn.outvars, inner.jaxpr.outvars):
                if is_var(o):
                    sub[o] = s(io)
            return
        outs = eqn.outvars
        if inlined:  # the same inner jaxpr may be inlined twice: fresh output variables
            outs = [o if isinstance(o, DropVar) else new_var(o.aval) for o in eqn.outvars]
            for o, n in zip(eqn.outvars, outs):
                if is_var(o):
                    sub[o] = n
        params = {k: _rewrite_param(p) for k, p in eqn.params.items()}
        eqns.append(eqn.replace(invars=[s(v) for v in eqn.invars], outvars=outs, params=params))

    for eqn in jaxpr.eqns:
        emit(eqn, False)
    new = jaxpr.replace(constvars=constvars, eqns=eqns, outvars=[s(v) for v in jaxpr.outvars])
    return ClosedJaxpr(dce(new), consts)


def _rewrite_param(p: Any) -> Any:
    if isinstance(p, ClosedJaxpr):
        return without_custom_vjp(p)
    if isinstance(p, Jaxpr):  # an open sub-jaxpr can take no new constants
        new = without_custom_vjp(ClosedJaxpr(p, ()))
        return new.jaxpr if not new.consts else p
    if isinstance(p, tuple) and p and all(isinstance(b, (ClosedJaxpr, Jaxpr)) for b in p):
        return tuple(_rewrite_param(b) for b in p)
    return p


def _is_custom_vjp(p: Any) -> bool:
    return p is prims.custom_vjp_call


def fold_constants(jaxpr: Jaxpr) -> Any:
    """The context in which jaxrev differentiates or walks `jaxpr` where what is computed
    from constants alone should stay concrete under `jit` (a scatter's indices, which lumps
    read for sparsity): `jax.ensure_compile_time_eval()`, except in a program that calls the
    host, where JAX would run a callback on constants while tracing the branch that holds it
    (Equinox's `error_if` raises on good inputs: flowjax's bisection)."""
    if mentions(jaxpr, is_host_callback):
        return contextlib.nullcontext()
    return jax.ensure_compile_time_eval()


def mentions(jaxpr: Jaxpr, match: Callable[[Any], bool]) -> bool:
    """Whether a primitive for which `match` holds occurs in `jaxpr` or any of its
    sub-jaxprs."""
    for e in jaxpr.eqns:
        if match(e.primitive):
            return True
        for p in e.params.values():
            for b in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(b, (ClosedJaxpr, Jaxpr)) and mentions(
                    b.jaxpr if isinstance(b, ClosedJaxpr) else b, match
                ):
                    return True
    return False
