"""Shared jaxpr machinery: the value environment, literals, the Unknown marker, liveness."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import (CALL_PRIMITIVES, ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal,
                            Var, call_jaxpr)


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


class Env:
    """Values of a jaxpr's variables; a variable absent from it is not known yet."""

    def __init__(self) -> None:
        self.vals: dict[Var, Any] = {}

    def known(self, v: Any) -> bool:
        return isinstance(v, Literal) or v in self.vals

    def read(self, v: Any) -> Any:
        if isinstance(v, Literal):
            return v.val
        return self.vals[v]

    def read_or_unknown(self, v: Any) -> Any:
        return self.read(v) if self.known(v) else Unknown(v.aval)

    def write(self, v: Any, val: Any) -> None:
        if isinstance(v, (Literal, DropVar)) or v in self.vals:
            return
        self.vals[v] = fit_to_aval(val, v.aval)

    def copy(self) -> "Env":
        e = Env()
        e.vals = dict(self.vals)
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
        idx = tuple([0] * lead + [slice(None) if s == vs else slice(0, 1)
                                  for s, vs in zip(shape, vshape[lead:])])
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


def inline_calls(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Flatten call-like equations (`jit`, `custom_jvp_call`, ...) into one jaxpr.

    Inversion works across call boundaries this way: a linear lump or a `select_n` case split
    may span code inside and outside `jnp.where`'s or `jnp.cumsum`'s inner `jit`. Inner equations
    with no user frame of their own take the source line of the call that contains them.
    """
    if not any(e.primitive in CALL_PRIMITIVES for e in closed.jaxpr.eqns):
        return closed
    from jaxrev._compat import has_user_frame, new_var
    jaxpr = closed.jaxpr
    consts = list(closed.consts)
    constvars = list(jaxpr.constvars)
    sub: dict[Var, Any] = {}

    def s(a: Any) -> Any:
        return sub.get(a, a) if isinstance(a, Var) else a

    eqns: list[JaxprEqn] = []

    def inline(eqn: JaxprEqn, outer_src: Any) -> None:
        src = eqn.source_info if outer_src is None or has_user_frame(eqn) else outer_src
        if eqn.primitive not in CALL_PRIMITIVES:
            # fresh output variables: the same inner jaxpr may be inlined more than once
            outs = []
            for o in eqn.outvars:
                if isinstance(o, DropVar):
                    outs.append(o)
                else:
                    sub[o] = nv = new_var(o.aval)
                    outs.append(nv)
            eqns.append(eqn.replace(invars=[s(v) for v in eqn.invars], outvars=outs,
                                    source_info=src))
            return
        inner = call_jaxpr(eqn.params)
        ij = inner.jaxpr
        for v, c in zip(ij.constvars, inner.consts):
            sub[v] = nv = new_var(v.aval)
            constvars.append(nv)
            consts.append(c)
        outer_in = [s(a) for a in eqn.invars]
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
    return ClosedJaxpr(new, consts)


def instantiate_tangents(primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, ...]:
    """Tangents as arrays, for JVP rules that run `jax.jvp` on an impl: symbolic zeros (or None)
    become zeros, float0 ones for integer primals."""
    from jaxrev._compat import is_symbolic_zero
    out = []
    for p, t in zip(primals, tangents):
        if t is None or is_symbolic_zero(t):
            dt = jnp.result_type(p)
            t = (jnp.zeros(jnp.shape(p), dt) if jnp.issubdtype(dt, jnp.inexact)
                 else np.zeros(jnp.shape(p), jax.dtypes.float0))
        out.append(t)
    return tuple(out)


def batch_front(args: Sequence[Any], dims: Sequence[Any]) -> tuple[int, list, list]:
    """For a batching rule: (batch size, operands with their batch axis first, vmap in_axes)."""
    from jaxrev._compat import not_mapped
    size = next(jnp.shape(x)[d] for x, d in zip(args, dims) if d is not not_mapped)
    args = [jnp.moveaxis(x, d, 0) if d is not not_mapped else x for x, d in zip(args, dims)]
    return size, args, [0 if d is not not_mapped else None for d in dims]
