"""The propagation walker: every jaxrev transform recovers unknown values with it.

Inversion is propagation over the jaxpr (DESIGN.md §3.2): starting from the known outputs and
parameters, repeatedly (a) evaluate forward any equation whose inputs are all known and
(b) invert any equation whose outputs are known and whose unknown inputs a rule can recover.
When neither applies, group steps are tried before giving up: a variable rebuilt from slices
that together cover it (`join`), a `select_n` with a known predicate split into one propagation
per case, a *linear lump* (equations invertible only together, solved in `lumps`), and the
nonlinear groups of `nonlinear` (exact linear elimination, then Newton's method). Equations
that compute the same value were merged before the walk (`_jaxpr.prepare`), so a value known
once is known everywhere.

`reverse`, `reversible`'s planner and backward sweep, the loop and branch rules,
`check_reversible` and the inverse transforms all call `propagate` (or `invert_jaxpr`, its
entry point for a whole sub-jaxpr); forward evaluation is `_jaxpr.evaluate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._compat import ClosedJaxpr, Jaxpr, JaxprEqn, Var, prims
from jaxrev._errors import NotInvertibleError, WAYS_OUT, not_invertible
from jaxrev._jaxpr import (Env, consumers, evaluate, is_unknown, prepare,
                           real_outvars, used_vars)
from jaxrev.transforms import lumps, nonlinear
from jaxrev.transforms.registry import (Lossy, NeedMore, elementwise_in, inverse_jvp_rules,
                                        inverse_rules, join_rules)

__all__ = ["Stuck", "Window", "propagate", "seed", "invert_jaxpr", "raise_stuck", "blame"]


@dataclass
class Stuck:
    """An equation the walker could not invert, and why."""

    eqn: JaxprEqn
    reason: str
    inner: list["Stuck"] = field(default_factory=list)
    hint: str | None = None
    no_rule: bool = False
    lossy: bool = False      # its rule said it destroys information (never part of a group)


class Window:
    """A stretch of a jaxpr's equations, for `propagate` (which reads `.eqns`, `.outvars`)."""

    __slots__ = ("eqns", "outvars")

    def __init__(self, eqns: Sequence[JaxprEqn]) -> None:
        self.eqns = list(eqns)
        self.outvars: list = []


# --------------------------------------------------------------------------- applying a rule

def _apply_rule(eqn: JaxprEqn, env: Env) -> list[Any] | None:
    rule = inverse_rules[eqn.primitive]
    outs = [env.read_or_unknown(v) for v in eqn.outvars]
    ins = [env.read_or_unknown(v) for v in eqn.invars]
    out = outs if eqn.primitive.multiple_results else outs[0]
    try:
        rec = rule(out, *ins, **eqn.params)
    except Lossy as e:
        raise not_invertible(eqn, e.reason, e.hint, singular=e.singular) from None
    if rec is None:
        return None
    if not isinstance(rec, (list, tuple)) or len(rec) != len(ins):
        name = getattr(rule, "__qualname__", repr(rule))
        raise TypeError(
            f"inverse rule {name} for `{eqn.primitive.name}` must return a list or tuple with one "
            f"entry per input ({len(ins)}: the recovered value or None), got {rec!r:.200}")
    rec = list(rec)
    if eqn.primitive in inverse_jvp_rules:
        rec = _with_inverse_jvp(eqn, out, ins, rec)
    return rec


def _with_inverse_jvp(eqn: JaxprEqn, out: Any, ins: list, rec: list) -> list:
    """Give the recovered inputs the derivative the user's inverse-JVP rule states, instead of
    the derivative of the inverse rule's own code (`out` is a list for multiple results)."""
    ij = inverse_jvp_rules[eqn.primitive]
    params = eqn.params
    got = [k for k, r in enumerate(rec) if r is not None and is_unknown(ins[k])]
    known = [k for k, x in enumerate(ins) if not is_unknown(x)]

    def filled(known_vals, recovered=()):
        full = list(ins)
        for k, v in zip(known, known_vals):
            full[k] = v
        for k, v in zip(got, recovered):
            full[k] = v
        return full

    @jax.custom_jvp
    def recovered(out, known_vals):
        rec2 = inverse_rules[eqn.primitive](out, *filled(known_vals), **params)
        return [rec2[k] for k in got]

    @recovered.defjvp
    def _jvp(primals, tangents):
        out, known_vals = primals
        d_out, d_known = tangents
        xs = recovered(out, known_vals)
        full = filled(known_vals, xs)
        if known:  # the known inputs' part of the output tangent, by the primitive's own JVP
            def with_known(*kv):
                return eqn.primitive.bind(*filled(kv, xs), **params)
            _, from_known = jax.jvp(with_known, tuple(known_vals), tuple(d_known))
            d_out = jax.tree_util.tree_map(lambda a, b: a - b, d_out, from_known)
        t = ij(d_out, out, *full, **params)
        name = getattr(ij, "__qualname__", repr(ij))
        if not isinstance(t, (list, tuple)) or len(t) != len(ins):
            raise TypeError(f"inverse-JVP rule {name} for `{eqn.primitive.name}` must return a "
                            f"list or tuple with one tangent (or None) per input ({len(ins)}), "
                            f"got {t!r:.200}")
        return xs, [t[k] for k in got]

    vals = recovered(out, [ins[k] for k in known])
    for k, v in zip(got, vals):
        rec[k] = v
    return rec


# --------------------------------------------------------------------------- propagation

def propagate(jaxpr: Jaxpr | Window, env: Env, goals: Sequence[Any] | None, *,
              allow: Callable[[JaxprEqn], bool] | None = None,
              forward_only: bool = False,
              on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
              soft: bool = False) -> list[Stuck]:
    """Fill `env` until every goal is known (or, with `goals=None`, as far as it goes).

    Returns [] on success, else the equations that blocked it. With `soft`, a step that loses
    information is one more blocked equation instead of an error (`reversible` stores what it
    loses and goes on)."""
    eqns = jaxpr.eqns
    used = used_vars(jaxpr)
    pending = list(range(len(eqns)))
    stuck: dict[int, Stuck] = {}
    # what was known around an equation when its rule last failed: a rule (a loop's, say, which
    # traces its body) is only tried again once something about its equation has changed
    tried: dict[int, tuple[bool, ...]] = {}
    while True:
        if goals is not None and all(env.known(g) for g in goals):
            return []
        progress = False
        still = []
        for i in pending:
            eqn = eqns[i]
            if allow is not None and not allow(eqn):
                still.append(i)
                continue
            if all(env.known(v) for v in eqn.invars):
                progress = evaluate((eqn,), env, used=used) or progress
                stuck.pop(i, None)
                continue
            still.append(i)
            if forward_only or not any(env.known(v) for v in real_outvars(eqn)):
                continue
            if eqn.primitive not in inverse_rules:
                stuck[i] = Stuck(eqn, "there is no inverse rule for it", no_rule=True)
                continue
            seen = tuple(env.known(v) for v in (*eqn.invars, *eqn.outvars))
            if i in stuck and tried.get(i) == seen:
                continue
            tried[i] = seen
            try:
                rec = _apply_rule(eqn, env)
            except NeedMore as e:
                stuck[i] = Stuck(eqn, e.reason, e.inner, e.hint)
                continue
            except NotInvertibleError as e:
                if not soft:
                    raise
                stuck[i] = Stuck(eqn, str(e), lossy=True)
                continue
            wrote = []
            for v, r in zip(eqn.invars, rec or ()):
                if r is not None and isinstance(v, Var) and not env.known(v):
                    env.write(v, r)
                    wrote.append(v)
            if wrote:
                progress = True
                stuck.pop(i, None)
                if on_invert is not None:
                    on_invert(eqn, wrote)
            elif i not in stuck:
                stuck[i] = Stuck(eqn, "its unknown inputs cannot be recovered from what is known "
                                      "(more than one of them is unknown)")
        pending = still
        if progress:
            continue
        if forward_only:
            return list(stuck.values())
        # group steps see only the allowed equations (a case split nests propagations, each
        # restricted further, so they cannot recurse into each other)
        gp = pending if allow is None else [i for i in pending if allow(eqns[i])]
        lossy = {i for i, s in stuck.items() if s.lossy}
        if (_join_step(jaxpr, env, used)
                or _case_split_step(jaxpr, env, gp, allow)
                or lumps.lump_step(eqns, env, gp)
                or nonlinear.eliminate_step(eqns, env, gp, lossy)
                or nonlinear.newton_step(eqns, env, gp, lossy)):
            continue
        return [s for i, s in sorted(stuck.items())] or [
            Stuck(eqns[i], "its result does not reach the output") for i in pending
            if any(not env.known(v) for v in eqns[i].invars)][:1]


def blame(stuck: list[Stuck]) -> Stuck | None:
    """The equation to name in an error: the innermost one, preferring one without a rule."""
    if not stuck:
        return None
    flat: list[Stuck] = []

    def walk(s: Stuck) -> None:
        if s.inner:
            for t in s.inner:
                walk(t)
        else:
            flat.append(s)

    for s in stuck:
        walk(s)
    for s in flat:
        if s.no_rule:
            return s
    return flat[0] if flat else stuck[0]


def raise_stuck(stuck: list[Stuck], what: str) -> None:
    s = blame(stuck)
    if s is None:
        raise NotInvertibleError(
            f"jaxrev.reverse cannot recover {what}: the program's output does not depend on it "
            f"(the value is discarded or overwritten).\n{WAYS_OUT}")
    raise not_invertible(s.eqn, s.reason if not what else f"{s.reason} (recovering {what})",
                         s.hint)


def seed(closed: ClosedJaxpr, ins: Sequence[Any], outs: Sequence[Any]
         ) -> tuple[Jaxpr, Env, list[Var]]:
    """Inline `closed`'s calls and fill a fresh env with its consts and the known entries of
    `ins` and `outs` (`Unknown` elsewhere). Returns (jaxpr, env, goals): the goals are the
    inputs passed as `Unknown`."""
    closed = prepare(closed)
    jaxpr = closed.jaxpr
    env = Env()
    for v, c in zip(jaxpr.constvars, closed.consts):
        env.write(v, c)
    for v, x in zip(jaxpr.invars, ins):
        if not is_unknown(x):
            env.write(v, x)
    for v, y in zip(jaxpr.outvars, outs):
        if not is_unknown(y) and isinstance(v, Var):
            env.write(v, y)
    return jaxpr, env, [v for v, x in zip(jaxpr.invars, ins) if is_unknown(x)]


def invert_jaxpr(closed: ClosedJaxpr, ins: Sequence[Any], outs: Sequence[Any]) -> list[Any]:
    """Recover the `Unknown` entries of `ins` from the known `outs` (`Unknown` where not known);
    None for the inputs that were known. Raises `NotInvertibleError` where it cannot."""
    jaxpr, env, goals = seed(closed, ins, outs)
    stuck = propagate(jaxpr, env, goals)
    missing = [i for i, (v, x) in enumerate(zip(jaxpr.invars, ins))
               if is_unknown(x) and not env.known(v)]
    if missing:
        raise_stuck(stuck, f"input(s) {missing}" if blame(stuck) is None else "")
    return [env.read(v) if is_unknown(x) else None for v, x in zip(jaxpr.invars, ins)]


# --------------------------------------------------------------------------- group steps

def _join_step(jaxpr: Jaxpr | Window, env: Env, used: set) -> bool:
    """Rebuild an unknown variable from several known pieces read off it (slices)."""
    eqns = jaxpr.eqns
    cons = consumers(jaxpr)
    for v in list(used):
        if env.known(v) or not isinstance(v, Var):
            continue
        pieces: dict[Any, list] = {}
        for i in cons.get(v, ()):
            eqn = eqns[i]
            if eqn.primitive not in join_rules or eqn.invars[0] is not v:
                continue
            if all(env.known(o) for o in real_outvars(eqn)) and real_outvars(eqn):
                pieces.setdefault(eqn.primitive, []).append(
                    (eqn.params, env.read(eqn.outvars[0])))
        for prim, ps in pieces.items():
            val = join_rules[prim](v.aval, ps)
            if val is not None:
                env.write(v, val)
                return True
    return False


def _case_split_step(jaxpr: Jaxpr | Window, env: Env, pending: Sequence[int],
                     allow: Callable[[JaxprEqn], bool] | None) -> bool:
    """`out = select_n(p, c0, c1, ...)` with `p` known: propagate once per case assuming
    `c_k == out`, restricted to elementwise equations of `out`'s shape, and merge the values
    recovered in every case with `select_n(p, ...)`. Exact, because along elementwise paths each
    element only ever depends on the same element of `out`."""
    for i in pending:
        eqn = jaxpr.eqns[i]
        if eqn.primitive is not prims.select_n or not env.known(eqn.outvars[0]):
            continue
        pred, *cases = eqn.invars
        if not env.known(pred) or all(env.known(c) for c in cases):
            continue
        shape = tuple(eqn.outvars[0].aval.shape)
        if tuple(pred.aval.shape) not in (shape, ()):
            continue
        out = env.read(eqn.outvars[0])
        branches = []
        for c in cases:
            e = env.copy()
            if isinstance(c, Var):
                e.write(c, out)
            propagate(jaxpr, e, None, allow=lambda q: (q is not eqn and elementwise_in(q, shape)
                                                       and (allow is None or allow(q))))
            branches.append(e)
        p = env.read(pred)
        merged = False
        for v in branches[0].vals:
            if env.known(v) or tuple(v.aval.shape) != shape:
                continue
            if all(v in b.vals for b in branches):
                env.write(v, lax.select_n(jnp.broadcast_to(p, shape),
                                          *[b.vals[v] for b in branches]))
                merged = True
        if merged:
            return True
    return False

