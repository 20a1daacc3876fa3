"""`jr.reverse`: run a traced JAX program backwards (NiLang's `~f`).

Inversion is propagation over the jaxpr (DESIGN.md §3.2): starting from the known outputs and
parameters, repeatedly (a) evaluate forward any equation whose inputs are all known and (b) invert
any equation whose outputs are known and whose unknown inputs a rule can recover. When neither
applies, three group steps are tried before giving up: rebuilding a variable from slices that
together cover it, solving a *linear lump* (equations invertible only together), and splitting a
`select_n` with a known predicate into one propagation per case.

Inverse rules follow JAX's transpose convention: ``rule(out, *invals, **params)`` where `out` is
the output value (a list for multiple-result primitives), an input not yet known is passed as an
`Unknown` (carrying its aval), and the rule returns one entry per input: the recovered value or
None. A rule raises `Lossy` when the step destroys information (the interpreter turns it into a
`NotInvertibleError` naming the primitive and the user's line) and `NeedMore` (or returns only
Nones) when it may succeed once more inputs are known.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._compat import (ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal,
                            Primitive, Var, as_closed, bind_eqn, cond_branches, eval_closed,
                            is_concrete, prims, scan_info, staged_constants, trace_to_closed)
from jaxrev._errors import NotInvertibleError, WAYS_OUT, not_invertible
from jaxrev._jaxpr import (Env, Unknown, consumers, forward_known, inline_calls, is_unknown,
                           size_of, used_vars)
from jaxrev.transforms import control_flow as _cf

__all__ = ["reverse", "register_inverse", "inverse_rules", "join_rules", "Lossy", "NeedMore",
           "invert_jaxpr"]

inverse_rules: dict[Primitive, Callable[..., Sequence[Any]]] = {}
"""Inverse rule per primitive: ``rule(out, *invals, **params) -> recovered invals``."""

join_rules: dict[Primitive, Callable[..., Any]] = {}
"""Rules that rebuild one variable from several equations reading it:
``rule(aval, [(params, out_value), ...]) -> value or None``."""


class Lossy(Exception):
    """Raised by an inverse rule when its equation destroys information."""

    def __init__(self, reason: str, hint: str | None = None, singular: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hint = hint
        self.singular = singular


class NeedMore(Exception):
    """Raised by an inverse rule that may succeed once more of its inputs are known."""

    def __init__(self, reason: str, inner: list["_Stuck"] | None = None, hint: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.inner = inner or []
        self.hint = hint


@dataclass
class _Stuck:
    eqn: JaxprEqn
    reason: str
    inner: list["_Stuck"] = field(default_factory=list)
    hint: str | None = None
    no_rule: bool = False


# --------------------------------------------------------------------------- the interpreter

_MAX_LUMP_EQNS = 256


def _real_outvars(eqn: JaxprEqn) -> list[Var]:
    return [v for v in eqn.outvars if not isinstance(v, DropVar)]


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
    if eqn.primitive in inverse_jvp_rules and not eqn.primitive.multiple_results:
        rec = _with_inverse_jvp(eqn, out, ins, rec)
    return rec


def _with_inverse_jvp(eqn: JaxprEqn, out: Any, ins: list, rec: list) -> list:
    """Give the recovered inputs the derivative the user's inverse-JVP rule states, instead of
    the derivative of the inverse rule's own code."""
    ij = inverse_jvp_rules[eqn.primitive]
    params = eqn.params
    got = [k for k, r in enumerate(rec) if r is not None and is_unknown(ins[k])]
    known = [k for k, x in enumerate(ins) if not is_unknown(x)]

    @jax.custom_jvp
    def recovered(out, known_vals):
        return [rec_fn(out, known_vals)[k] for k in got]

    def rec_fn(out, known_vals):
        full = list(ins)
        for k, v in zip(known, known_vals):
            full[k] = v
        return inverse_rules[eqn.primitive](out, *full, **params)

    @recovered.defjvp
    def _jvp(primals, tangents):
        out, known_vals = primals
        d_out, d_known = tangents
        xs = recovered(out, known_vals)
        full = list(ins)
        for k, v in zip(known, known_vals):
            full[k] = v
        for k, v in zip(got, xs):
            full[k] = v
        # the known inputs' part of the output tangent, by the primitive's own JVP
        def with_known(*kv):
            f2 = list(full)
            for k, v in zip(known, kv):
                f2[k] = v
            return eqn.primitive.bind(*f2, **params)
        _, from_known = jax.jvp(with_known, tuple(known_vals), tuple(d_known))
        t = ij(d_out - from_known, out, *full, **params)
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


inverse_jvp_rules: dict[Primitive, Callable[..., Sequence[Any]]] = {}
"""Inverse-JVP rule per primitive: ``rule(out_tangent, out, *invals, **params) -> in tangents``
(the tangent of each input recovered by the inverse rule, None elsewhere)."""


def register_inverse_jvp(primitive: Primitive, rule: Callable[..., Sequence[Any]]) -> None:
    """State the derivative of `primitive`'s inverse, for `inverse_jvp` and for derivatives
    taken through `reverse`.

    `rule(out_tangent, out, *invals, **params)` receives the output's tangent (with the known
    inputs' part already taken out), the output, and every input (the recovered ones filled in);
    it returns one entry per input: the tangent of each input its inverse rule recovers (solving
    ``J_x t = out_tangent``), None elsewhere. Without it, derivatives go through the inverse
    rule's own code, which is right whenever that code is differentiable.

    Example:
        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> from jax.extend.core import Primitive
        >>> cube_p = Primitive("cube"); _ = cube_p.def_impl(lambda x: x ** 3)
        >>> _ = cube_p.def_abstract_eval(lambda a: a)
        >>> # an inverse computed where JAX cannot differentiate it (stop_gradient stands in)
        >>> jr.register_inverse(cube_p, lambda out, x: [jax.lax.stop_gradient(jnp.cbrt(out))])
        >>> jr.register_inverse_jvp(cube_p, lambda t, out, x: [t / (3 * x ** 2)])
        >>> round(float(jax.jvp(jr.reverse(cube_p.bind), (8.0,), (1.0,))[1]), 6)  # 1/12
        0.083333
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(f"register_inverse_jvp expects a jax.extend.core.Primitive, got "
                        f"{primitive!r}")
    if not callable(rule):
        raise TypeError(f"register_inverse_jvp expects a callable rule, got {rule!r}")
    inverse_jvp_rules[primitive] = rule


def register_inverse(primitive: Primitive, rule: Callable[..., Sequence[Any]]) -> None:
    """Make `reverse` able to invert `primitive`.

    `rule(out, *invals, **params)` receives the equation's output (a list for a primitive with
    multiple results), its inputs with the unknown ones passed as `Unknown` objects (which carry
    `.aval`, `.shape`, `.dtype`), and its params; it returns one entry per input: the recovered
    value, or None where it recovers nothing. Raise `jaxrev.transforms.reverse.Lossy(reason)`
    where the step destroys information.

    Example:
        >>> import jax.numpy as jnp, jaxrev as jr
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double"); _ = double_p.def_impl(lambda x: 2 * x)
        >>> _ = double_p.def_abstract_eval(lambda a: a)
        >>> jr.register_inverse(double_p, lambda out, x: [out / 2])
        >>> jr.reverse(lambda x: double_p.bind(x))(jnp.ones(2)).tolist()
        [0.5, 0.5]
    """
    if not isinstance(primitive, Primitive):
        raise TypeError(f"register_inverse expects a jax.extend.core.Primitive, got {primitive!r}")
    if not callable(rule):
        raise TypeError(f"register_inverse expects a callable rule, got {rule!r}")
    inverse_rules[primitive] = rule


def propagate(jaxpr: Jaxpr, env: Env, goals: Sequence[Any] | None, *,
              allow: Callable[[JaxprEqn], bool] | None = None,
              forward_only: bool = False,
              on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
              soft: bool = False) -> list[_Stuck]:
    """Fill `env` until every goal is known (or, with `goals=None`, as far as it goes).

    Returns [] on success, else the equations that blocked it. With `soft`, a step that loses
    information is one more blocked equation instead of an error (`reversible` stores what it
    loses and goes on)."""
    eqns = jaxpr.eqns
    used = used_vars(jaxpr)
    pending = list(range(len(eqns)))
    stuck: dict[int, _Stuck] = {}
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
                need = [v for v in _real_outvars(eqn) if not env.known(v) and v in used]
                if need:
                    outs = bind_eqn(eqn, [env.read(v) for v in eqn.invars])
                    for v, o in zip(eqn.outvars, outs):
                        env.write(v, o)
                    progress = True
                stuck.pop(i, None)
                continue
            still.append(i)
            if forward_only or not any(env.known(v) for v in _real_outvars(eqn)):
                continue
            if eqn.primitive not in inverse_rules:
                stuck[i] = _Stuck(eqn, "there is no inverse rule for it", no_rule=True)
                continue
            seen = tuple(env.known(v) for v in (*eqn.invars, *eqn.outvars))
            if i in stuck and tried.get(i) == seen:
                continue
            tried[i] = seen
            try:
                rec = _apply_rule(eqn, env)
            except NeedMore as e:
                stuck[i] = _Stuck(eqn, e.reason, e.inner, e.hint)
                continue
            except NotInvertibleError as e:
                if not soft:
                    raise
                stuck[i] = _Stuck(eqn, str(e))
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
                stuck[i] = _Stuck(eqn, "its unknown inputs cannot be recovered from what is known "
                                       "(more than one of them is unknown)")
        pending = still
        if progress:
            continue
        if forward_only:
            return list(stuck.values())
        # group steps see only the allowed equations (a case split nests propagations, each
        # restricted further, so they cannot recurse into each other)
        gp = pending if allow is None else [i for i in pending if allow(eqns[i])]
        if (_twin_step(jaxpr, env, gp) or _join_step(jaxpr, env, gp, used)
                or _case_split_step(jaxpr, env, gp, used, allow)
                or _lump_step(jaxpr, env, gp, used)):
            continue
        return [s for i, s in sorted(stuck.items())] or [
            _Stuck(eqns[i], "its result does not reach the output") for i in pending
            if any(not env.known(v) for v in eqns[i].invars)][:1]


def _blame(stuck: list[_Stuck]) -> _Stuck | None:
    """The equation to name in an error: the innermost one, preferring one without a rule."""
    if not stuck:
        return None
    flat: list[_Stuck] = []

    def walk(s: _Stuck) -> None:
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


def _raise_stuck(stuck: list[_Stuck], what: str) -> None:
    s = _blame(stuck)
    if s is None:
        raise NotInvertibleError(
            f"jaxrev.reverse cannot recover {what}: the program's output does not depend on it "
            f"(the value is discarded or overwritten).\n{WAYS_OUT}")
    raise not_invertible(s.eqn, s.reason if not what else f"{s.reason} (recovering {what})",
                         s.hint)


def _seed(closed: ClosedJaxpr, ins: Sequence[Any], outs: Sequence[Any]):
    """Inline `closed`'s calls and fill a fresh env with its consts and the known entries of
    `ins` and `outs` (`Unknown` elsewhere). Returns (jaxpr, env, goals): the goals are the
    inputs passed as `Unknown`."""
    closed = inline_calls(closed)
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
    jaxpr, env, goals = _seed(closed, ins, outs)
    stuck = propagate(jaxpr, env, goals)
    missing = [i for i, (v, x) in enumerate(zip(jaxpr.invars, ins))
               if is_unknown(x) and not env.known(v)]
    if missing:
        _raise_stuck(stuck, f"input(s) {missing}" if _blame(stuck) is None else "")
    return [env.read(v) if is_unknown(x) else None for v, x in zip(jaxpr.invars, ins)]


# --------------------------------------------------------------------------- group steps

@functools.lru_cache(maxsize=65536)  # equations hash by identity; called on every stuck sweep
def _signature(eqn: JaxprEqn) -> tuple | None:
    """What makes two equations compute the same value (None: not comparable)."""
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
    ins = []
    for v in eqn.invars:
        if isinstance(v, Literal):
            val = np.asarray(v.val)
            ins.append(("lit", str(val.dtype), val.tobytes(), val.shape))
        else:
            ins.append(v)
    return (eqn.primitive, tuple(ins), tuple(params))


def _twin_step(jaxpr, env, pending) -> bool:
    """An equation identical to one whose outputs are known has those outputs (JAX does not
    deduplicate: `x[:1]` and `x[0]` slice `x` twice)."""
    eqns = jaxpr.eqns
    done: dict[tuple, JaxprEqn] = {}
    for e in eqns:
        if all(env.known(o) for o in _real_outvars(e)) and _real_outvars(e):
            sig = _signature(e)
            if sig is not None:
                done.setdefault(sig, e)
    if not done:
        return False
    progress = False
    for i in pending:
        e = eqns[i]
        outs = _real_outvars(e)
        if not outs or all(env.known(o) for o in outs):
            continue
        sig = _signature(e)
        twin = done.get(sig) if sig is not None else None
        if twin is None or twin is e:
            continue
        for o, t in zip(e.outvars, twin.outvars):
            if isinstance(o, Var) and not isinstance(o, DropVar) and not env.known(o) \
                    and isinstance(t, Var) and env.known(t):
                env.write(o, env.read(t))
                progress = True
    return progress


def _join_step(jaxpr, env, pending, used) -> bool:
    """Rebuild an unknown variable from several known pieces read off it (slices)."""
    eqns = jaxpr.eqns
    cons = consumers(jaxpr)
    for v in list(used):
        if env.known(v) or not isinstance(v, Var):
            continue
        pieces: dict[Primitive, list] = {}
        for i in cons.get(v, ()):
            eqn = eqns[i]
            rule = join_rules.get(eqn.primitive)
            if rule is None or eqn.invars[0] is not v:
                continue
            if all(env.known(o) for o in _real_outvars(eqn)) and _real_outvars(eqn):
                pieces.setdefault(eqn.primitive, []).append(
                    (eqn.params, env.read(eqn.outvars[0])))
        for prim, ps in pieces.items():
            val = join_rules[prim](v.aval, ps)
            if val is not None:
                env.write(v, val)
                return True
    return False


_ELEMENTWISE: set[Primitive] = set()


def _elementwise_in(eqn: JaxprEqn, shape: tuple[int, ...]) -> bool:
    return (eqn.primitive in _ELEMENTWISE
            and all(tuple(o.aval.shape) == shape for o in _real_outvars(eqn))
            and all(tuple(v.aval.shape) in (shape, ()) for v in eqn.invars))


def _case_split_step(jaxpr, env, pending, used, allow=None) -> bool:
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
            propagate(jaxpr, e, None, allow=lambda q: (q is not eqn and _elementwise_in(q, shape)
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


_LINEAR: set[Primitive] = set()
_BILINEAR: set[Primitive] = set()


def _is_affine(eqns: Sequence[JaxprEqn], active: set[Var]) -> bool:
    """Whether the lump's outputs are affine in the `active` variables."""
    active = set(active)
    for eqn in eqns:
        act = [isinstance(v, Var) and v in active for v in eqn.invars]
        if not any(act):
            continue
        p = eqn.primitive
        if p in _LINEAR:
            if p is prims.select_n and act[0]:
                return False
            if any(a and not jnp.issubdtype(v.aval.dtype, jnp.inexact)
                   for a, v in zip(act, eqn.invars)):
                return False  # an unknown index or integer operand
            if p is prims.convert_element_type and not jnp.issubdtype(
                    eqn.params["new_dtype"], jnp.inexact):
                return False
        elif p in _BILINEAR:
            if sum(act) > 1:
                return False
        elif p is prims.div:
            if act[1]:
                return False
        else:
            return False
        active.update(_real_outvars(eqn))
    return True


def _lump_step(jaxpr, env, pending, used) -> bool:
    """Solve the smallest trailing group of stuck equations that is square and affine."""
    eqns = jaxpr.eqns
    cand = [i for i in pending if any(not env.known(v) for v in eqns[i].invars)]
    stuck = [i for i in cand if any(env.known(v) for v in _real_outvars(eqns[i]))]
    if not stuck:
        return False
    top = max(stuck)
    tried = 0
    for t in sorted((i for i in cand if i <= top), reverse=True):
        tried += 1
        if tried > _MAX_LUMP_EQNS:
            break
        lump = [i for i in cand if i >= t]
        produced = {v for i in lump for v in _real_outvars(eqns[i])}
        inputs: list[Var] = []
        for i in lump:
            for v in eqns[i].invars:
                if isinstance(v, Var) and not env.known(v) and v not in produced and v not in inputs:
                    inputs.append(v)
        outputs = [v for i in lump for v in _real_outvars(eqns[i]) if env.known(v)]
        if not inputs or size_of(v.aval for v in inputs) != size_of(v.aval for v in outputs):
            continue
        lump_eqns = [eqns[i] for i in lump]
        if not _is_affine(lump_eqns, set(inputs)):
            continue
        _solve_lump(lump_eqns, env, inputs, outputs)
        return True
    return False


def _solve_lump(lump_eqns, env, inputs, outputs) -> None:
    def F(*xs, known=env.read):
        local: dict[Var, Any] = dict(zip(inputs, xs))

        def read(v):
            if isinstance(v, Literal):
                return v.val
            return local[v] if v in local else known(v)

        for eqn in lump_eqns:
            for v, o in zip(eqn.outvars, bind_eqn(eqn, [read(v) for v in eqn.invars])):
                local[v] = o
        return [local[o] for o in outputs]

    shapes = {tuple(v.aval.shape) for v in [*inputs, *outputs]}
    dtype = jnp.result_type(*[v.aval.dtype for v in [*inputs, *outputs]])
    ys = [jnp.asarray(env.read(o), dtype) for o in outputs]
    elementwise = len(shapes) == 1 and len(inputs) == len(outputs) and all(
        _elementwise_in(e, next(iter(shapes))) for e in lump_eqns)
    if elementwise:
        # one small k x k system per element: k JVPs give every block at once
        shape = next(iter(shapes))
        k = len(inputs)
        zeros = [jnp.zeros(shape, v.aval.dtype) for v in inputs]
        f0 = [jnp.asarray(f, dtype) for f in F(*zeros)]
        cols = []
        for j in range(k):
            tang = [jnp.ones(shape, v.aval.dtype) if m == j else jnp.zeros(shape, v.aval.dtype)
                    for m, v in enumerate(inputs)]
            _, d = jax.jvp(F, zeros, tang)
            cols.append(jnp.stack([jnp.asarray(x, dtype) for x in d], -1))
        # A depends on known values only; applying inv(A) by elementwise mul/add keeps the
        # result an elementwise linear lump again, so reverse(reverse(f)) works
        Ainv = jnp.linalg.inv(jnp.stack(cols, -1))
        rs = [y - f for y, f in zip(ys, f0)]
        sols = []
        for m in range(k):
            u = Ainv[..., m, 0] * rs[0]
            for j in range(1, k):
                u = u + Ainv[..., m, j] * rs[j]
            sols.append(u)
    else:
        sizes = [int(np.prod(v.aval.shape, dtype=np.int64)) for v in inputs]
        offs = np.cumsum([0] + sizes)

        def Fflat(u):
            xs = [jnp.reshape(u[offs[m]:offs[m + 1]], v.aval.shape).astype(v.aval.dtype)
                  for m, v in enumerate(inputs)]
            return jnp.concatenate([jnp.ravel(jnp.asarray(f, dtype)) for f in F(*xs)])

        u0 = jnp.zeros(int(offs[-1]), dtype)
        r = jnp.concatenate([jnp.ravel(y) for y in ys]) - Fflat(u0)
        u = _structured_lump_solve(F, inputs, lump_eqns, env, offs, dtype, r)
        if u is None:  # one dense lump: n JVPs and an LU
            with staged_constants():  # else the n x n identity basis is folded into constants
                J = jax.jacfwd(Fflat, holomorphic=jnp.issubdtype(dtype, jnp.complexfloating))(
                    u0) if jnp.issubdtype(dtype, jnp.complexfloating) else jax.jacfwd(Fflat)(u0)
                u = jnp.linalg.solve(J, r)
        sols = [jnp.reshape(u[offs[m]:offs[m + 1]], v.aval.shape) for m, v in enumerate(inputs)]
    if all(is_concrete(s) for s in sols) and not all(bool(jnp.all(jnp.isfinite(s))) for s in sols):
        # blame a reduction if there is one: it is where the information goes
        culprit = next((e for e in lump_eqns if e.primitive is prims.reduce_sum), lump_eqns[-1])
        raise not_invertible(culprit, "it belongs to a group of equations that are invertible "
                             "only together, and together they form a singular linear map",
                             singular=True)
    for v, s in zip(inputs, sols):
        env.write(v, s)


def _structured_lump_solve(F, inputs, lump_eqns, env, offs, dtype, r):
    """Solve a lump whose matrix is banded (see `lumps`); None if it is not."""
    from jaxrev.transforms import lumps
    n = int(offs[-1])
    if n < lumps.MIN_STRUCTURED_SIZE or jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    produced = {v for e in lump_eqns for v in _real_outvars(e)}
    stand_in: dict[Var, Any] = {}
    rng = np.random.default_rng(0)
    for e in lump_eqns:
        for v in e.invars:
            if not isinstance(v, Var) or v in inputs or v in produced or v in stand_in:
                continue
            val = env.read(v)
            if is_concrete(val):
                stand_in[v] = np.asarray(val)
            elif jnp.issubdtype(v.aval.dtype, jnp.inexact):
                stand_in[v] = rng.standard_normal(v.aval.shape).astype(v.aval.dtype) + 1.5
            else:
                return None  # a run-time index or predicate may change the pattern

    def flat(u, known):
        xs = [jnp.reshape(u[offs[m]:offs[m + 1]], v.aval.shape).astype(v.aval.dtype)
              for m, v in enumerate(inputs)]
        return jnp.concatenate([jnp.ravel(jnp.asarray(f, dtype)) for f in F(*xs, known=known)])

    band = lumps.probe_band(lambda u: flat(u, stand_in.__getitem__), n, dtype)
    if band is None:
        return None
    lo, up = band
    if lo + up > max(8, n // 16):
        return None
    G = lambda u: flat(u, env.read)  # noqa: E731
    if lo and up:
        u, pivots, _ = lumps.banded_solve(G, n, lo, up, r, dtype)
        what = "banded system (solved with partial pivoting)"
    else:
        u, pivots = lumps.banded_triangular_solve(G, n, lo or up, up == 0, r, dtype)
        what = "triangular system"
    if is_concrete(pivots) and bool(jnp.any(pivots == 0)):
        k = int(jnp.argmax(pivots == 0))
        raise not_invertible(lump_eqns[-1], "it belongs to a group of equations that are "
                             f"invertible only together, and their {what} has a zero pivot "
                             f"(row {k})", singular=True)
    return u


# --------------------------------------------------------------------------- reverse()

def _normalize_argnums(argnums: int | Sequence[int], nargs: int,
                       fun: Callable | None = None) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    name = getattr(fun, "__name__", repr(fun)) if fun is not None else "the function"
    out = []
    for a in nums:
        if not isinstance(a, (int, np.integer)) or not -nargs <= a < nargs:
            raise ValueError(f"argnums {argnums!r} out of range: {name} was called with "
                             f"{nargs} positional arguments")
        out.append(int(a) % nargs)
    if len(set(out)) != len(out):
        raise ValueError(f"argnums {argnums!r} repeats an argument of {name}")
    return tuple(out)


def _trace_program(fun: Callable, args: Sequence[Any], argnums: tuple[int, ...]):
    """Trace `fun` with the state at `argnums`; returns closed jaxpr, flat info and state tree."""
    flat, in_tree = jax.tree_util.tree_flatten(tuple(args))
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in flat]

    def flat_fun(*leaves):
        a = jax.tree_util.tree_unflatten(in_tree, list(leaves))
        return fun(*a)

    closed, out_shape = jax.make_jaxpr(flat_fun, return_shape=True)(*avals)
    # which flat leaves belong to the state
    marks = jax.tree_util.tree_unflatten(in_tree, list(range(len(flat))))
    state_leaf_ids = [jax.tree_util.tree_leaves(marks[a]) for a in argnums]
    return closed, flat, state_leaf_ids, out_shape


def _check_structure(fun, args, argnums, out_shape, who: str = "jaxrev.reverse") -> Any:
    state = args[argnums[0]] if len(argnums) == 1 else tuple(args[a] for a in argnums)
    s_leaves, s_tree = jax.tree_util.tree_flatten(state)
    o_leaves, o_tree = jax.tree_util.tree_flatten(out_shape)
    name = getattr(fun, "__name__", repr(fun))
    if s_tree != o_tree:
        raise ValueError(f"{who}: {name} must return the structure of its state "
                         f"(argnums={argnums}): expected {s_tree}, got {o_tree}")
    for i, (s, o) in enumerate(zip(s_leaves, o_leaves)):
        if tuple(jnp.shape(s)) != tuple(o.shape) or jnp.result_type(s) != o.dtype:
            raise ValueError(
                f"{who}: {name}'s output leaf {i} is {o.dtype}{list(o.shape)} but the "
                f"state leaf is {jnp.result_type(s)}{list(jnp.shape(s))}; the output must have "
                "the state's shapes and dtypes")
    return s_tree


def _invert_call(fun, args, argnums, on_invert=None, forward_env=None):
    """Core of `reverse`: returns (state values, jaxpr, env)."""
    argnums = _normalize_argnums(argnums, len(args), fun)
    closed, flat, state_ids, out_shape = _trace_program(fun, args, argnums)
    s_tree = _check_structure(fun, args, argnums, out_shape)
    state_pos = [i for ids in state_ids for i in ids]
    ins = list(flat)
    for i in state_pos:
        ins[i] = Unknown(closed.jaxpr.invars[i].aval)
    ys = [flat[i] for i in state_pos]  # the state positions hold the outputs
    jaxpr, env, _ = _seed(closed, ins, ys)
    goals = [jaxpr.invars[i] for i in state_pos]  # in the state's leaf order
    stuck = propagate(jaxpr, env, goals, on_invert=on_invert)
    missing = [k for k, g in enumerate(goals) if not env.known(g)]
    if missing:
        _raise_stuck(stuck, f"state leaf {missing[0]} of {len(goals)}")
    vals = [env.read(g) for g in goals]
    return jax.tree_util.tree_unflatten(s_tree, vals), jaxpr, env


def reverse(fun: Callable, argnums: int | Sequence[int] = 0) -> Callable:
    """Return the inverse of `fun` in the arguments at `argnums` (the state).

    `fun(*args)` must return the state's pytree structure, shapes and dtypes; the other
    arguments are read-only parameters. The inverse has `fun`'s signature with the outputs in the
    state positions: ``reverse(f)(f(x, theta), theta) == x``. Raises `NotInvertibleError` at
    trace time, naming the primitive and source line, where the program loses information.

    Example:
        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x, w: jnp.cumsum(x * w) + 1.0
        >>> x, w = jnp.arange(3.0), jnp.array([1.0, 2.0, 4.0])
        >>> jr.reverse(f)(f(x, w), w).tolist()
        [0.0, 1.0, 2.0]
    """

    @functools.wraps(fun)
    def inv(*args: Any) -> Any:
        state, _, _ = _invert_call(fun, args, argnums)
        return state

    inv.__name__ = f"reverse({getattr(fun, '__name__', 'fun')})"
    return inv


# --------------------------------------------------------------------------- rules

def _r(*ps: Primitive | None):
    def deco(rule):
        for p in ps:
            if p is not None:
                inverse_rules[p] = rule
        return rule
    return deco


def _check_nonzero(v: Any, what: str) -> None:
    if is_concrete(v) and np.any(np.asarray(v) == 0):
        raise Lossy(f"{what} is zero, which destroys the value", singular=True)


def _add(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        return [out - y, None]
    if is_unknown(y) and not is_unknown(x):
        return [None, out - x]
    return None


inverse_rules[prims.add] = _add
if prims.add_any is not None:
    inverse_rules[prims.add_any] = _add


def _sub(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        return [out + y, None]
    if is_unknown(y) and not is_unknown(x):
        return [None, x - out]
    return None


inverse_rules[prims.sub] = _sub


def _mul(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        _check_nonzero(y, "the known factor")
        return [out / y, None]
    if is_unknown(y) and not is_unknown(x):
        _check_nonzero(x, "the known factor")
        return [None, out / x]
    return None


inverse_rules[prims.mul] = _mul


def _div(out, x, y, **_):
    if is_unknown(x) and not is_unknown(y):
        _check_nonzero(y, "the known divisor")
        return [out * y, None]
    if is_unknown(y) and not is_unknown(x):
        _check_nonzero(x, "the known numerator")
        return [None, x / out]
    return None


inverse_rules[prims.div] = _div


def _unary(inverse: Callable[[Any], Any]):
    def rule(out, x, **_):
        return [inverse(out)]
    return rule


for _p, _inv in [(prims.neg, lambda y: -y), (prims.exp, jnp.log), (prims.log, jnp.exp),
                 (prims.exp2, jnp.log2), (prims.log1p, jnp.expm1), (prims.expm1, jnp.log1p),
                 (prims.tanh, jnp.arctanh), (prims.atanh, jnp.tanh), (prims.sinh, jnp.arcsinh),
                 (prims.asinh, jnp.sinh), (prims.logistic, lambda y: jnp.log(y) - jnp.log1p(-y)),
                 (prims.sqrt, lambda y: y * y), (prims.rsqrt, lambda y: 1 / (y * y)),
                 (prims.cbrt, lambda y: y * y * y), (prims.conj, jnp.conj),
                 (prims.copy, lambda y: y)]:
    if _p is not None:
        inverse_rules[_p] = _unary(_inv)


@_r(prims.integer_pow)
def _integer_pow(out, x, *, y, **_):
    if y == 1:
        return [out]
    if y == -1:
        return [1 / out]
    if y == 3 and not jnp.issubdtype(out.dtype, jnp.complexfloating):
        return [lax.cbrt(out)]  # one primitive, so that the inverse is invertible again
    if y % 2 == 0:
        raise Lossy(f"x**{y} loses the sign of x",
                    "Ways out: keep the sign in the state, or use an odd power.")
    if jnp.issubdtype(out.dtype, jnp.complexfloating):
        raise Lossy(f"x**{y} has {abs(y)} complex roots")
    r = jnp.abs(out) ** (1.0 / y)
    return [jnp.sign(out) * r]


@_r(prims.pow)
def _pow(out, x, p, **_):
    if is_unknown(x) and not is_unknown(p):
        _check_nonzero(p, "the known exponent")
        return [out ** (1.0 / p), None]
    if is_unknown(p) and not is_unknown(x):
        return [None, jnp.log(out) / jnp.log(x)]
    return None


@_r(prims.convert_element_type)
def _convert(out, x, *, new_dtype, **_):
    old = x.aval.dtype
    if old == new_dtype or np.can_cast(old, new_dtype, "safe"):
        return [lax.convert_element_type(out, old)]
    raise Lossy(f"converting {np.dtype(old).name} to {np.dtype(new_dtype).name} loses "
                "precision (only widening conversions are invertible)")


@_r(prims.reshape, prims.squeeze)
def _reshape(out, x, *rest, **_):
    return [jnp.reshape(out, x.aval.shape)] + [None] * len(rest)


@_r(prims.transpose)
def _transpose(out, x, *, permutation, **_):
    return [jnp.transpose(out, np.argsort(permutation))]


@_r(prims.rev)
def _rev(out, x, *, dimensions, **_):
    return [lax.rev(out, dimensions)]


@_r(prims.concatenate)
def _concatenate(out, *xs, dimension, **_):
    res, start = [], 0
    for x in xs:
        n = x.aval.shape[dimension]
        res.append(lax.slice_in_dim(out, start, start + n, axis=dimension) if is_unknown(x)
                   else None)
        start += n
    return res


@_r(prims.stack)
def _stack(out, *xs, axis, **_):
    return [lax.index_in_dim(out, k, axis, keepdims=False) if is_unknown(x) else None
            for k, x in enumerate(xs)]


@_r(prims.split)
def _split(outs, x, *, axis, **_):
    if any(is_unknown(o) for o in outs):
        raise NeedMore("some pieces of the split are unknown")
    return [jnp.concatenate(outs, axis=axis)]


@_r(prims.broadcast_in_dim)
def _broadcast_in_dim(out, x, *dyn, shape, broadcast_dimensions, **_):
    # broadcasting is injective: read the operand back from one copy (a left inverse)
    idx = []
    for d in range(len(shape)):
        if d in broadcast_dimensions:
            k = broadcast_dimensions.index(d)
            idx.append(slice(None) if x.aval.shape[k] == shape[d] else slice(0, 1))
        else:
            idx.append(0)
    return [jnp.reshape(out[tuple(idx)], x.aval.shape)] + [None] * len(dyn)


@_r(prims.cumsum)
def _cumsum(out, x, *, axis, reverse, **_):
    n = out.shape[axis]
    if reverse:
        shifted = lax.pad(lax.slice_in_dim(out, 1, n, axis=axis), jnp.zeros((), out.dtype),
                          [(0, 1 if d == axis else 0, 0) for d in range(out.ndim)])
    else:
        shifted = lax.pad(lax.slice_in_dim(out, 0, n - 1, axis=axis), jnp.zeros((), out.dtype),
                          [(1 if d == axis else 0, 0, 0) for d in range(out.ndim)])
    return [out - shifted]


@_r(prims.real)
def _real(out, x, **_):
    raise Lossy("the real part drops the imaginary part")


@_r(prims.complex)
def _complex(out, re, im, **_):
    return [jnp.real(out) if is_unknown(re) else None, jnp.imag(out) if is_unknown(im) else None]


@_r(prims.dot_general)
def _dot_general(out, lhs, rhs, *, dimension_numbers, **_):
    (lc, rc), (lb, rb) = dimension_numbers
    if is_unknown(lhs) == is_unknown(rhs):
        return None
    x_is_lhs = is_unknown(lhs)
    x, w = (lhs, rhs) if x_is_lhs else (rhs, lhs)
    xc, wc = (lc, rc) if x_is_lhs else (rc, lc)
    xb, wb = (lb, rb) if x_is_lhs else (rb, lb)
    w_free = [d for d in range(w.ndim) if d not in wc and d not in wb]
    if len(xc) != 1 or len(w_free) != 1 or w.shape[wc[0]] != w.shape[w_free[0]]:
        raise Lossy("multiplying by a matrix is invertible only for a known square matrix "
                    f"contracted on one dimension (got operand shape {tuple(w.shape)})")
    x_free = [d for d in range(x.aval.ndim) if d not in xc and d not in xb]
    n = w.shape[wc[0]]
    # canonical forms: W as (B..., n_contract, n_free); Y as (B..., F, n_free) or (B..., n_free, F)
    Wc = jnp.transpose(w, list(wb) + [wc[0], w_free[0]])
    fshape = [x.aval.shape[d] for d in x_free]
    nf = int(np.prod(fshape, dtype=np.int64))
    bshape = [x.aval.shape[d] for d in xb]
    if x_is_lhs:  # out = (B..., x_free..., w_free)
        Y = jnp.reshape(out, bshape + [nf, n])
        # Y = X @ Wc  =>  X^T = solve(Wc^T, Y^T)
        X = jnp.swapaxes(jnp.linalg.solve(jnp.swapaxes(Wc, -1, -2), jnp.swapaxes(Y, -1, -2)), -1, -2)
        X = jnp.reshape(X, bshape + fshape + [n])
        order = list(xb) + x_free + [xc[0]]
    else:  # out = (B..., w_free, x_free...)
        Y = jnp.reshape(out, bshape + [n, nf])
        # Y = Wc^T @ X
        X = jnp.linalg.solve(jnp.swapaxes(Wc, -1, -2), Y)
        X = jnp.reshape(X, bshape + [n] + fshape)
        order = list(xb) + [xc[0]] + x_free
    X = jnp.transpose(X, np.argsort(order))
    if is_concrete(X) and not bool(jnp.all(jnp.isfinite(X))):
        raise Lossy("the known matrix is singular", singular=True)
    return [X, None] if x_is_lhs else [None, X]


@_r(prims.select_n)
def _select_n(out, pred, *cases, **_):
    # the single-equation case: every case but one known, and the predicate known to pick it
    # everywhere; the general case is the interpreter's case split (`_case_split_step`)
    unknown = [k for k, c in enumerate(cases) if is_unknown(c)]
    if is_unknown(pred) or len(unknown) != 1 or not is_concrete(pred):
        raise NeedMore("the select's predicate or its cases are not known",
                       hint="Ways out: make the predicate a parameter (known before the "
                            "select), or use `jr.cond` with a post condition.")
    k = unknown[0]
    sel = np.asarray(pred).astype(np.int32)
    if np.all(sel == k):
        return [None] + [out if j == k else None for j in range(len(cases))]
    raise Lossy("the select discards the unknown operand where the predicate picks another case")


@_r(prims.scatter_add)
def _scatter_add(out, operand, indices, updates, **params):
    if is_unknown(operand) and not is_unknown(indices) and not is_unknown(updates):
        return [prims.scatter_add.bind(out, indices, -updates, **params), None, None]
    return None


@_r(prims.linear_solve)
def _linear_solve(outs, *ins, const_lengths, jaxprs, **_):
    # x = A^{-1} b  inverts to  b = A x, with the matvec the solve carries
    n = sum(const_lengths)
    mv = ins[:const_lengths[0]]
    if any(is_unknown(c) for c in mv) or any(is_unknown(o) for o in outs):
        raise NeedMore("the solve's matrix or its solution is not known yet")
    b = eval_closed(as_closed(jaxprs[0]), *mv, *outs)
    return [None] * n + [bi if is_unknown(x) else None for bi, x in zip(b, ins[n:])]


@_r(prims.optimization_barrier)
def _identity_multi(outs, *xs, **_):
    return [o if is_unknown(x) and not is_unknown(o) else None for o, x in zip(outs, xs)]


@_r(prims.sharding_constraint)
def _identity(out, x, **_):
    return [out]


if prims.device_put is not None:
    inverse_rules[prims.device_put] = (_identity_multi if prims.device_put.multiple_results
                                       else _identity)


@_r(prims.scan)
def _scan(outs, *ins, **params):
    nc, ncar, body, length, rev = scan_info(params)
    consts, init, xs = ins[:nc], list(ins[nc:nc + ncar]), list(ins[nc + ncar:])
    carry_out, ys = outs[:ncar], outs[ncar:]
    if any(is_unknown(c) for c in consts):
        raise NeedMore("the loop's constants are not known yet")
    bj = body.jaxpr
    xs_known = [not is_unknown(x) for x in xs]
    # carry components computable forward from known values (the loop counter of a fori_loop)
    K = [not is_unknown(c) for c in init]
    while True:
        fk = forward_known(bj, [True] * nc + K + xs_known)
        newK = [k and fk[i] for i, k in enumerate(K)]
        if newK == K:
            break
        K = newK
    # a carry the body also emits per iteration, with a known start, is known at every
    # iteration: its input is the previous iteration's output (a chain over slots)
    emits = _emitted_carries(bj, ncar, length, ys)
    emitted = {}
    waiting = False  # such a carry whose start is not known yet
    for i, j in emits.items():
        if K[i]:
            continue
        if is_unknown(init[i]):
            waiting = True
            continue
        y = ys[j]
        first = jnp.expand_dims(jnp.asarray(init[i], y.dtype), 0)
        emitted[i] = jnp.concatenate([y[1:], first]) if rev else jnp.concatenate([first, y[:-1]])
    unk = [i for i in range(ncar) if not K[i] and i not in emitted]
    # an unknown final carry that is also emitted is the last emitted value
    carry_out = [ys[emits[i]][0 if rev else -1] if is_unknown(c) and i in emits else c
                 for i, c in enumerate(carry_out)]
    if any(is_unknown(carry_out[i]) for i in unk):
        raise NeedMore("the loop's final carry is not known")
    fwd_idx = [i for i in range(ncar) if K[i]]
    known_idx = sorted([*fwd_idx, *emitted])
    xk = [x for x in xs if not is_unknown(x)]
    kin_of: dict[int, Any] = dict(emitted)
    if fwd_idx:
        known_idx_fwd = fwd_idx
        def kbody(ck, xs_t):
            ins_t = list(consts) + [Unknown(v.aval) for v in bj.invars[nc:]]
            for i, c in zip(known_idx_fwd, ck):
                ins_t[nc + i] = c
            it = iter(xs_t)
            for j, kn in enumerate(xs_known):
                if kn:
                    ins_t[nc + ncar + j] = next(it)
            jaxpr, env, _ = _seed(body, ins_t, [Unknown(v.aval) for v in bj.outvars])
            goals = [jaxpr.outvars[i] for i in known_idx_fwd]
            propagate(jaxpr, env, goals, forward_only=True)
            return [env.read(g) for g in goals], list(ck)

        _, kin_fwd = lax.scan(kbody, [init[i] for i in fwd_idx], xk, length=length,
                              reverse=rev)
        kin_of.update(zip(fwd_idx, kin_fwd))
    kin = [kin_of[i] for i in known_idx]
    ys_known_idx = [j for j, y in enumerate(ys) if not is_unknown(y)]

    def ibody(c_unk, sl):
        kin_t, ys_t, xs_t = sl
        ins_t = list(consts) + [Unknown(bj.invars[nc + i].aval) for i in range(ncar)] + \
            [Unknown(v.aval) for v in bj.invars[nc + ncar:]]
        for i, c in zip(known_idx, kin_t):
            ins_t[nc + i] = c
        it = iter(xs_t)
        for j, kn in enumerate(xs_known):
            if kn:
                ins_t[nc + ncar + j] = next(it)
        outs_t = [Unknown(v.aval) for v in bj.outvars]
        for i, c in zip(unk, c_unk):
            outs_t[i] = c
        for j, y in zip(ys_known_idx, ys_t):
            outs_t[ncar + j] = y
        rec = invert_jaxpr(body, ins_t, outs_t)
        c_prev = [rec[nc + i] for i in unk]
        x_rec = [rec[nc + ncar + j] for j, kn in enumerate(xs_known) if not kn]
        return c_prev, x_rec

    try:
        c0, xs_rec = lax.scan(ibody, [carry_out[i] for i in unk],
                              (kin, [ys[j] for j in ys_known_idx], xk), length=length,
                              reverse=not rev)
    except NotInvertibleError:
        if waiting:  # may work once the chain's start is known
            raise NeedMore("the start of a carry that the loop also emits is not known yet")
        raise
    res: list[Any] = [None] * len(ins)
    for i, c in zip(unk, c0):
        res[nc + i] = c
    it = iter(xs_rec)
    for j, kn in enumerate(xs_known):
        if not kn:
            res[nc + ncar + j] = next(it)
    return res


def _emitted_carries(bj, ncar, length, ys) -> dict[int, int]:
    """Carry i -> output j for carries the body also emits per iteration (a body returning
    ``(x, x)``) whose per-iteration outputs are known."""
    out: dict[int, int] = {}
    if length == 0:
        return out
    for i in range(ncar):
        if not isinstance(bj.outvars[i], Var):
            continue
        for j, y in enumerate(ys):
            if not is_unknown(y) and bj.outvars[ncar + j] is bj.outvars[i]:
                out[i] = j
                break
    return out


def _switch_inverse(index, branches, ins, outs):
    """Invert `switch(index, branches, *ins) == outs` for the unknown `ins`."""
    unknown = [k for k, x in enumerate(ins) if is_unknown(x)]
    known_vals = [x for x in ins if not is_unknown(x)]

    def inv_branch(b):
        def f(outs_, known_):
            it = iter(known_)
            ins_ = [x if is_unknown(x) else next(it) for x in ins]
            rec = invert_jaxpr(b, ins_, list(outs_))
            return [rec[k] for k in unknown]
        return f

    index = jnp.clip(index, 0, len(branches) - 1)
    if jnp.ndim(index) == 0:
        rec = lax.switch(index, [inv_branch(b) for b in branches], list(outs), known_vals)
    else:  # a batched index (vmap of a jaxrev cond): invert every branch, keep each element's own
        per = [inv_branch(b)(list(outs), known_vals) for b in branches]
        rec = [_cf._select_cases(index, [p[k] for p in per]) for k in range(len(unknown))]
    res: list[Any] = [None] * len(ins)
    for k, r in zip(unknown, rec):
        res[k] = r
    return res


@_r(prims.cond)
def _cond(outs, index, *ins, **params):
    if is_unknown(index):
        raise NeedMore("the branch taken depends on the unknown state",
                       hint="Ways out: use `jr.cond(pred, true_fun, false_fun, *operands, "
                            "post=...)`, whose post condition tells the backward run which "
                            "branch ran.")
    if any(is_unknown(o) for o in outs):
        raise NeedMore("some outputs of the branch are unknown")
    return [None] + _switch_inverse(index, cond_branches(params), ins, outs)


@_r(prims.while_)
def _while(outs, *ins, **params):
    raise Lossy("a plain `lax.while_loop` does not record how many times it ran",
                "Ways out: use `jr.while_loop(cond_fun, body_fun, init_val, post_fun)`, whose "
                "post condition lets the backward run count the iterations, or a `fori_loop` "
                "with static bounds.")


@_r(_cf.while_p)
def _jaxrev_while(outs, *ins, cond_jaxpr, body_jaxpr, post_jaxpr, cond_nconsts, body_nconsts,
                  post_nconsts):
    n = cond_nconsts + body_nconsts + post_nconsts
    consts = ins[:n]
    if any(is_unknown(c) for c in consts) or any(is_unknown(o) for o in outs):
        raise NeedMore("the loop's constants or final values are not known yet")
    cc, bc, pc = (consts[:cond_nconsts], consts[cond_nconsts:cond_nconsts + body_nconsts],
                  consts[cond_nconsts + body_nconsts:])
    ncar = len(outs)

    def inv_body(*a):
        b, c = a[:body_nconsts], a[body_nconsts:]
        rec = invert_jaxpr(body_jaxpr, [*b, *[Unknown(v.aval) for v in
                                                  body_jaxpr.jaxpr.invars[body_nconsts:]]], list(c))
        return rec[body_nconsts:]

    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in [*bc, *outs]]
    ij, ic, _ = trace_to_closed(inv_body, *avals)
    back = _cf.while_p.bind(*pc, *ic, *bc, *cc, *outs, cond_jaxpr=post_jaxpr, body_jaxpr=ij,
                            post_jaxpr=cond_jaxpr, cond_nconsts=post_nconsts,
                            body_nconsts=len(ic) + body_nconsts, post_nconsts=cond_nconsts)
    return [None] * n + list(back[:ncar])


@_r(_cf.cond_p)
def _jaxrev_cond(outs, index, *ins, branches, post_jaxpr, post_nconsts):
    pc, ops = ins[:post_nconsts], ins[post_nconsts:]
    if any(is_unknown(c) for c in pc) or any(is_unknown(o) for o in outs):
        raise NeedMore("the post condition's constants or the outputs are not known yet")
    if is_unknown(index):
        took_true = eval_closed(post_jaxpr, *pc, *outs)[0]
        index = lax.convert_element_type(took_true, jnp.int32)
    return [None] + [None] * post_nconsts + _switch_inverse(index, branches, ops, outs)


# --------------------------------------------------------------------------- join rules

def _join_slices(aval, pieces):
    shape = tuple(aval.shape)
    joined = _concat_slices(shape, pieces)
    if joined is not None:
        return joined
    covered = np.zeros(shape, bool)
    for params, _ in pieces:
        covered[_slice_index(params)] = True
    if not covered.all():
        return None
    x = jnp.zeros(shape, aval.dtype)
    for params, val in pieces:
        x = x.at[_slice_index(params)].set(val)
    return x


def _concat_slices(shape, pieces):
    """Pieces that tile one axis with unit strides join back by `concatenate`, which keeps
    the operand's sharding and is itself invertible (so `reverse(reverse(f))` works)."""
    spans = {}
    axis = None
    for params, val in pieces:
        if any(st != 1 for st in (params.get("strides") or ())):
            return None
        st, lim = params["start_indices"], params["limit_indices"]
        partial = [d for d in range(len(shape)) if (st[d], lim[d]) != (0, shape[d])]
        if len(partial) > 1 or (axis is not None and partial and partial[0] != axis):
            return None
        if partial:
            axis = partial[0]
        d = axis if axis is not None else 0
        spans.setdefault((st[d], lim[d]), val)
    if axis is None:
        return next(iter(spans.values()))
    pos, parts = 0, []
    for (a, b), val in sorted(spans.items()):
        if a != pos:
            return None  # overlapping or gapped pieces: the general path handles them
        parts.append(val)
        pos = b
    if pos != shape[axis]:
        return None
    return parts[0] if len(parts) == 1 else lax.concatenate(parts, axis)


def _slice_index(params):
    strides = params.get("strides") or (1,) * len(params["start_indices"])
    return tuple(slice(s, l, st) for s, l, st in
                 zip(params["start_indices"], params["limit_indices"], strides))


join_rules[prims.slice] = _join_slices


# --------------------------------------------------------------------------- classification

for _p in (prims.add, prims.sub, prims.mul, prims.div, prims.neg, prims.exp, prims.exp2,
           prims.log, prims.log1p, prims.expm1, prims.tanh, prims.atanh, prims.sinh, prims.asinh,
           prims.logistic, prims.integer_pow, prims.pow, prims.sqrt, prims.rsqrt, prims.cbrt,
           prims.convert_element_type, prims.select_n, prims.copy, prims.max, prims.min,
           prims.abs, prims.sign, prims.sin, prims.cos, prims.tan, prims.square, prims.conj,
           prims.floor, prims.ceil, prims.round, prims.add_any):
    if _p is not None:
        _ELEMENTWISE.add(_p)

for _p in (prims.add, prims.sub, prims.neg, prims.reshape, prims.squeeze, prims.transpose,
           prims.rev, prims.slice, prims.concatenate, prims.broadcast_in_dim, prims.reduce_sum,
           prims.cumsum, prims.copy, prims.convert_element_type, prims.select_n, prims.pad,
           prims.split, prims.stack, prims.scatter_add, prims.gather, prims.dynamic_slice,
           prims.dynamic_update_slice, prims.add_any, prims.imag, prims.real, prims.complex,
           prims.conj):
    if _p is not None:
        _LINEAR.add(_p)

for _p in (prims.mul, prims.dot_general):
    _BILINEAR.add(_p)
