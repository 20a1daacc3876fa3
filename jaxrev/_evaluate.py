"""The one forward evaluator: every transform runs known equations through `evaluate`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from jaxrev._compat import (
    ClosedJaxpr,
    JaxprEqn,
    bind_eqn,
)
from jaxrev._env import Env
from jaxrev._graph import real_outvars

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


def eval_closed(closed: ClosedJaxpr, *args: Any, rule: EqnRule | None = None) -> list[Any]:
    """Evaluate a closed jaxpr on values or tracers (`rule` as for `evaluate`)."""
    env = Env()
    for v, c in zip(closed.jaxpr.constvars, closed.consts):
        env.write(v, c)
    for v, a in zip(closed.jaxpr.invars, args):
        env.write(v, a)
    evaluate(closed.jaxpr.eqns, env, rule=rule)
    return [env.read(v) for v in closed.jaxpr.outvars]
