"""What a jaxpr's structure says: which variables hold values, which are used or needed, which
equations read a variable, what is known forward, and whether a primitive occurs at any depth."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxrev._compat import (
    ClosedJaxpr,
    DropVar,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
)


def is_var(v: Any) -> bool:
    """A variable that holds a value (not a literal, not a dropped output)."""
    return isinstance(v, Var) and not isinstance(v, DropVar)


def real_outvars(eqn: JaxprEqn) -> list[Var]:
    return [v for v in eqn.outvars if not isinstance(v, DropVar)]


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


def bytes_of(avals: Iterable[Any]) -> int:
    """The bytes `avals` take (a loop's carry, as the dial's `memory_budget` counts it)."""
    return int(sum(int(np.prod(a.shape, dtype=np.int64)) * a.dtype.itemsize for a in avals))


def mentions(
    jaxpr: Jaxpr, match: Callable[[Any], bool], opaque: Callable[[Any], bool] | None = None
) -> bool:
    """Whether a primitive for which `match` holds occurs in `jaxpr` or any of its
    sub-jaxprs (but those of equations for which `opaque` holds)."""
    return first_eqn(jaxpr, match, opaque) is not None


def first_eqn(
    jaxpr: Jaxpr, match: Callable[[Any], bool], opaque: Callable[[Any], bool] | None = None
) -> JaxprEqn | None:
    """The first equation of `jaxpr` or its sub-jaxprs (depth first) whose primitive `match`
    holds for; None if none. The sub-jaxprs of an equation for which `opaque` holds (it is
    given the equation) are not searched."""
    for e in jaxpr.eqns:
        if match(e.primitive):
            return e
        if opaque is not None and opaque(e):
            continue
        for p in e.params.values():
            for b in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(b, (ClosedJaxpr, Jaxpr)):
                    found = first_eqn(b.jaxpr if isinstance(b, ClosedJaxpr) else b, match, opaque)
                    if found is not None:
                        return found
    return None


def work_of(jaxpr: Jaxpr) -> int:
    """A trace-time measure of what one evaluation of `jaxpr` computes: the elements its
    equations write, with a sub-jaxpr's counted once per evaluation of its equation (a
    scan's body `length` times) and a matrix product's by its multiply-adds per output."""
    total = 0
    for e in jaxpr.eqns:
        out = size_of(v.aval for v in e.outvars if hasattr(v.aval, "shape"))
        if e.primitive.name == "dot_general":
            (lhs_contract, _), _ = e.params["dimension_numbers"]
            lhs = e.invars[0].aval.shape
            out *= max(1, int(np.prod([lhs[d] for d in lhs_contract], dtype=np.int64)))
        total += out
        times = int(e.params.get("length", 1)) if e.primitive.name == "scan" else 1
        for p in e.params.values():
            for b in p if isinstance(p, (tuple, list)) else (p,):
                if isinstance(b, (ClosedJaxpr, Jaxpr)):
                    total += times * work_of(b.jaxpr if isinstance(b, ClosedJaxpr) else b)
    return total


_VALUE_FREE = frozenset(
    {"add", "add_any", "sub", "neg", "copy", "copy_p", "convert_element_type", "select_n"}
)
"""Equations whose derivative does not read the value of an operand that flows through them
(`unread_carries`): sums, differences, negations, copies, conversions between floating
types, and the cases (not the predicate) of a select."""


def _value_free_reach(
    jaxpr: Jaxpr, sources: Sequence[int], reached: set | None = None
) -> set[int] | None:
    """The outputs of `jaxpr` its inputs `sources` reach through `_VALUE_FREE` equations
    only (calls such as `jnp.where`'s `jit` followed inside); None where some other equation
    reads them. `reached` (given) collects the variables reached."""
    reached = set() if reached is None else reached
    reached.update(jaxpr.invars[k] for k in sources)
    for eqn in jaxpr.eqns:
        hit = [k for k, v in enumerate(eqn.invars) if isinstance(v, Var) and v in reached]
        if not hit:
            continue
        name = eqn.primitive.name
        inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
        if name in ("pjit", "jit", "closed_call") and inner is not None:
            inner = inner.jaxpr if isinstance(inner, ClosedJaxpr) else inner
            outs = _value_free_reach(inner, hit)
            if outs is None:
                return None
            reached.update(eqn.outvars[k] for k in outs)
            continue
        ok = name in _VALUE_FREE
        if name == "select_n":
            ok = 0 not in hit
        elif name == "convert_element_type":
            ok = all(is_float(v.aval) for v in eqn.outvars)
        if not ok:
            return None
        reached.update(eqn.outvars)
    return {k for k, v in enumerate(jaxpr.outvars) if isinstance(v, Var) and v in reached}


def unread_carries(
    jaxpr: Jaxpr, nconsts: int, ncarry: int, stored: Sequence[Any] = ()
) -> list[bool]:
    """Per carry of a loop body (inputs: `nconsts` constants, `ncarry` carries, then `xs`;
    outputs: the carries, then `ys`), whether its value is read by nothing but its own next
    value, through `_VALUE_FREE` equations: an accumulator ``acc + f(x)``. The backward run
    never needs such a carry's value (no other value is computed from it, no VJP reads it):
    its rebuilt value need not be checked against a checkpoint, and XLA drops what computes
    it. Only floating carries are considered (the others are never compared). `stored`: the
    variables the body's backward walk reads from storage (`Plan.store`): a carry any of them
    is computed from is read (the walk may take a term of its sum as the difference of its
    stored input and its output)."""
    out = []
    stored = set(stored)
    for i in range(ncarry):
        if not is_float(jaxpr.invars[nconsts + i].aval):
            out.append(False)
            continue
        reached: set = set()
        reach = _value_free_reach(jaxpr, [nconsts + i], reached)
        out.append(reach is not None and reach <= {i} and not (reached & stored))
    return out


def is_float(aval: Any) -> bool:
    """Whether `aval` holds floating (or complex) values."""
    return jnp.issubdtype(aval.dtype, jnp.inexact)
