"""Values computed from parameters alone, recomputed where the backward walk needs them.

A jaxpr's *parameter-only* values are those computed from its parameters (its inputs known
to the backward walk: a `reversible` call's read-only arguments, a loop body's constants and
known `xs`, the jaxpr's consts) and literals alone: a float32 kernel cast to float64 or
bfloat16 in each block, a weight's transpose, a broadcast bias, any computation of them. The
backward walk never stores them and never rebuilds them backwards: they are computed forward
from the parameters (`ParamOnly.need`) at the step of the backward run that reads them, once
per block or per loop iteration.

Written once in the jaxpr, such a value would be computed once by XLA: the backward run's
`convert(w)` is the same expression as the forward run's, so XLA merges them (CSE) and keeps
the forward run's value alive until the backward run reads it: a buffer per block, as if it
were stored. So the parameters a recomputation reads first pass through `fresh_p` with a
value of the backward run at that step (the *tie*): an identity that XLA can neither merge
with the forward run's reading of the parameters nor compute before the tie (an optimization
barrier, which XLA:GPU keeps; XLA:CPU removes barriers before CSE, so also a shift of the
parameters' bits by a run-time zero, derived from the tie, that XLA cannot prove zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._compat import JaxprEqn, Literal, is_key, is_symbolic_zero
from jaxrev._env import Env
from jaxrev._evaluate import evaluate
from jaxrev._graph import is_var
from jaxrev._primitive import make_primitive
from jaxrev.transforms.registry import define

__all__ = ["fresh_p", "fresh", "ParamOnly"]


# --------------------------------------------------------------------------- fresh_p


def _run_time_zero(tie: Any, dtype: Any) -> Any:
    """A scalar of `dtype` that is 0 on every run, computed from one element of `tie` in a
    way XLA does not fold: (t != t) is 1 only for a NaN, and shifted right by one it is 0."""
    first = tie[(0,) * jnp.ndim(tie)]
    if jnp.iscomplexobj(first):
        first = jnp.real(first)
    first = first.astype(jnp.float32)
    return lax.shift_right_logical(
        lax.convert_element_type(first != first, dtype), lax.convert_element_type(1, dtype)
    )


def _opaque(x: Any, tie: Any) -> Any:
    """`x`, its bits shifted right by a run-time zero."""
    if jnp.iscomplexobj(x):
        return lax.complex(_opaque(jnp.real(x), tie), _opaque(jnp.imag(x), tie))
    if x.dtype == jnp.bool_:
        return x ^ (_run_time_zero(tie, jnp.uint8) != 0)
    unsigned = jnp.dtype(f"uint{8 * x.dtype.itemsize}")
    bits = x if x.dtype == unsigned else lax.bitcast_convert_type(x, unsigned)
    bits = lax.shift_right_logical(bits, _run_time_zero(tie, unsigned))
    return bits if x.dtype == unsigned else lax.bitcast_convert_type(bits, x.dtype)


def _fresh_lowering(*args: Any, n: int) -> list:
    *xs, tie = lax.optimization_barrier(args)
    return [_opaque(x, tie) for x in xs[:n]]


def _fresh_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, n: int) -> tuple:
    # the tangents are recomputations too (forward mode over the backward run)
    outs = fresh_p.bind(*primals, n=n)
    live = [
        k
        for k in range(n)
        if not is_symbolic_zero(tangents[k]) and jnp.result_type(tangents[k]) != jax.dtypes.float0
    ]
    out_tangents = list(tangents[:n])
    if live:
        live_tangents = [tangents[k] for k in live]
        fresh_tangents = fresh_p.bind(*live_tangents, primals[n], n=len(live))
        for k, tangent in zip(live, fresh_tangents):
            out_tangents[k] = tangent
    return outs, out_tangents


def _fresh_transpose(cts: Sequence[Any], *args: Any, n: int) -> list:
    return [None if is_symbolic_zero(c) else c for c in cts] + [None]


def _fresh_batch(args: Sequence[Any], dims: Sequence[Any], *, n: int) -> tuple:
    return fresh_p.bind(*args, n=n), list(dims[:n])


fresh_p = make_primitive(
    "jaxrev_fresh",
    multiple_results=True,
    impl=lambda *args, n: list(args[:n]),
    abstract=lambda *avals, n: list(avals[:n]),
    lowering=_fresh_lowering,
    jvp=_fresh_jvp,
    transpose=_fresh_transpose,
    batch=_fresh_batch,
)
"""``fresh_p(*xs, tie, n)``: `xs` unchanged (n of them), in a form XLA neither merges with
another computation of `xs` nor computes before `tie`."""

define(fresh_p, inverse=lambda outs, *ins, n: [*outs, None])


# Values of at most this many elements are not passed through `fresh_p`: kept alive they cost
# a few bytes each, while each tie costs XLA a handful of instructions at every use (on a
# diffrax solve, whose tableau coefficients and step sizes are scalars: 43 000 of its
# gradient's optimized HLO instructions with every value tied, 30 000 without the small ones).
SMALL = 16


def fresh(xs: Sequence[Any], tie: Any) -> list:
    """`xs` through `fresh_p` with `tie` (PRNG keys by their bits); unchanged without a tie,
    and values of at most `SMALL` elements unchanged."""
    out = list(xs)
    if tie is None:
        return out
    big = [k for k, x in enumerate(xs) if jnp.size(x) > SMALL]
    if not big:
        return out
    keys = {k: is_key(xs[k]) for k in big}
    plain = [jax.random.key_data(xs[k]) if keys[k] else xs[k] for k in big]
    for k, val in zip(big, fresh_p.bind(*plain, tie, n=len(plain))):
        out[k] = jax.random.wrap_key_data(val, impl=jax.random.key_impl(xs[k])) if keys[k] else val
    return out


def tie_of(vals: Sequence[Any]) -> Any:
    """A value to tie recomputations to: the first array among `vals` that has elements and
    arithmetic (None if there is none)."""
    for x in vals:
        if x is None or is_symbolic_zero(x) or is_key(x):
            continue
        dtype = getattr(x, "dtype", None)
        if dtype is not None and dtype != jax.dtypes.float0 and jnp.size(x) > 0:
            return x
    return None


# --------------------------------------------------------------------------- parameter-only values


class ParamOnly:
    """The parameter-only values of a jaxpr whose inputs `known` are the parameters (with its
    consts): which equations compute them (`eqns`, by index); `need` and `window` compute
    them where the backward walk reads them, `run` where the forward run does."""

    def __init__(self, jaxpr: Any, known: Sequence[bool]) -> None:
        self.jaxpr = jaxpr
        # the parameters: the known inputs and the consts
        self.roots = {v for v, k in zip(jaxpr.invars, known) if k} | set(jaxpr.constvars)
        self.made: dict = {}  # parameter-only variable -> the index of its equation
        self.eqns: set = set()
        for i, eqn in enumerate(jaxpr.eqns):
            if all(isinstance(v, Literal) or v in self.roots or v in self.made for v in eqn.invars):
                self.eqns.add(i)
                self.made.update((o, i) for o in eqn.outvars if is_var(o))

    def need(self, env: Env, vs: Sequence[Any], tie: Any) -> None:
        """Make the parameter-only values among `vs` known in `env`: computed forward (with
        the parameter-only values they are computed from) from the parameters, passed
        through `fresh` with `tie`."""
        made, eqns = self.made, self.jaxpr.eqns
        todo: set = set()
        stack = [v for v in vs if is_var(v) and v in made and not env.known(v)]
        while stack:
            i = made[stack.pop()]
            if i in todo:
                continue
            todo.add(i)
            stack.extend(u for u in eqns[i].invars if is_var(u) and u in made and not env.known(u))
        if not todo:
            return
        chain = [eqns[i] for i in sorted(todo)]
        outs = set(_vars_of(chain, outs=True))
        # what the chain reads from outside it, once each, in order
        reads = list(dict.fromkeys(u for u in _vars_of(chain) if is_var(u) and u not in outs))
        roots = [u for u in reads if u in self.roots]
        scratch = Env(info=env.info, ctx=env.ctx)
        for u, val in zip(roots, fresh([env.read(u) for u in roots], tie)):
            scratch.write(u, val)
        for u in reads:
            scratch.write(u, env.read(u))  # parameter-only values computed before
        evaluate(chain, scratch)
        for o in outs:
            if is_var(o) and o in scratch.vals:
                env.write(o, scratch.read(o))

    def window(self, env: Env, eqns: Sequence[JaxprEqn], tie: Any) -> None:
        """`need` every parameter-only value that `eqns` (a walk's window) read or compute,
        so that the walk never computes one itself from the bare parameters."""
        self.need(env, [*_vars_of(eqns), *_vars_of(eqns, outs=True)], tie)

    def run(self, env: Env, rule: Any = None, keep: Any = ()) -> None:
        """Run the jaxpr forward in `env` (its inputs known) as `evaluate` does (`rule` as
        there), except that a parameter-only value is computed where an equation reads it,
        tied to that equation's other inputs, and not at all where none does (XLA computes
        values of parameters alone first, so every block's cast would be alive at once).
        Equations with effects, and those in `keep`, run in place."""
        for i, eqn in enumerate(self.jaxpr.eqns):
            if i in self.eqns and i not in keep and not eqn.effects:
                continue
            # tied to the equation's inputs that are not parameter-only
            others = [v for v in eqn.invars if is_var(v) and v not in self.made]
            self.need(env, eqn.invars, tie_of([env.read(v) for v in others if v not in self.roots]))
            evaluate(
                (eqn,),
                env,
                rule=None if rule is None else (lambda _, e, ins, i=i: rule(i, e, ins)),
            )


def _vars_of(eqns: Sequence[JaxprEqn], outs: bool = False) -> list:
    """The input (or, `outs`, output) variables and literals of `eqns`, in order."""
    out: list = []
    for eqn in eqns:
        out += eqn.outvars if outs else eqn.invars
    return out
