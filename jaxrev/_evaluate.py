"""The one forward evaluator: every transform runs known equations through `evaluate`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import jax
import numpy as np

import jaxrev._host as host
from jaxrev._compat import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    bind_eqn,
    compiled_eqns,
    folding_constants,
    is_concrete,
    is_host_callback,
)
from jaxrev._env import MIN_FOLDED, Env
from jaxrev._graph import mentions, real_outvars

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


def apply_on_host(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """`apply` for an equation that moves elements, run on host (numpy) arrays of positions
    (what the element-level and log-det walks compute when traced: which operand element
    each output element copies): numpy for the moves it knows, exactly as XLA computes
    them, and JAX otherwise (a gather). Through JAX, each new primitive, shape and params
    was compiled as an XLA program of its own when the walk traced, about 20 ms each, ten of
    them in a spline flow's first call."""
    out = host.moves(eqn, invals)
    if out is not None:
        return [out]
    with jax.ensure_compile_time_eval():
        return [np.asarray(x) for x in apply(eqn, invals)]


def eval_closed(closed: ClosedJaxpr, *args: Any, rule: EqnRule | None = None) -> list[Any]:
    """Evaluate a closed jaxpr on values or tracers (`rule` as for `evaluate`)."""
    env = Env()
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        env.write(v, c)
    for v, a in zip(closed.jaxpr.invars, args):
        env.write(v, a)
    evaluate(closed.jaxpr.eqns, env, rule=rule)
    return [env.read(v) for v in closed.jaxpr.outvars]


def fold_known(
    eqns: Sequence[JaxprEqn], env: Env, keep: Sequence[Any], used: set | None = None
) -> set:
    """Where JAX folds constants (`jax.ensure_compile_time_eval`, as the walks that read
    masks and indices from the values they are traced with do), run the equations of `eqns`
    computable from the concrete values `env` knows (and literals) as one compiled program,
    writing into `env` the outputs that `keep` (a program's outputs) holds or that equations
    not run read; `used` as for `evaluate`. Returns the equations run: their other outputs
    are left unwritten (asking XLA for every intermediate tripled its compile time), so a
    walk must not look at them again.

    Evaluated one by one, each operation on constants was compiled as an XLA program of its
    own, tens of them per flow layer traced. Equations with effects or host callbacks are left
    to the walk, as are fewer than `MIN_FOLDED` of them."""
    if not folding_constants():
        return set()
    picked: list[JaxprEqn] = []
    reads: dict = {}
    made: set = set()
    for e in eqns:
        outs = real_outvars(e)
        if not outs or all(env.known(o) for o in outs):
            continue
        if used is not None and not any(o in used for o in outs):
            continue
        ins = [v for v in e.invars if not isinstance(v, Literal) and v not in made]
        if not all(env.known(v) and is_concrete(env.read(v)) for v in ins):
            continue
        if e.effects or _calls_host(e):  # (after the cheap test: this one reads sub-jaxprs)
            continue
        for v in ins:
            reads.setdefault(v, None)
        picked.append(e)
        made.update(outs)
    if len(picked) < MIN_FOLDED:
        return set()
    chosen = set(picked)
    wanted = {v for v in keep if not isinstance(v, Literal)}
    wanted.update(
        v for e in eqns if e not in chosen for v in e.invars if not isinstance(v, Literal)
    )
    ins = tuple(reads)
    outs = tuple(o for e in picked for o in real_outvars(e) if o in wanted)
    vals = compiled_eqns(tuple(picked), ins, outs)(*[env.read(v) for v in ins])
    for o, x in zip(outs, vals):
        env.write(o, x)
    return chosen


def _calls_host(e: JaxprEqn) -> bool:
    return is_host_callback(e.primitive) or mentions(SimpleNamespace(eqns=[e]), is_host_callback)
