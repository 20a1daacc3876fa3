"""Nonlinear lumps (docs/design.md §3.6): groups of equations invertible only together, not affine.

The walker tries two steps once the linear lumps (`lumps.lump_step`) found nothing:

- `eliminate_step`, exact linear elimination. The stuck equations that are affine in the
  unknowns, once the outputs of the nonlinear ones count as extra unknowns, form a linear
  system M u = r that need not be square. Every unknown that the system determines (its unit
  vector lies in M's row space: a rank analysis on the structure, at trace time) is solved
  for with M's pseudo-inverse, and propagation goes on. McCallum et al.'s reversible Heun step
  ``z1 = 2y - z + dt f(z)``, ``y1 = y + dt/2 (f(z) + f(z1))`` inverts this way exactly: the
  system gives ``z = 2 y1 - z1 - dt f(z1)``, then ``f(z)`` is evaluated and ``y`` follows.
- `newton_step`, Newton's method on the smallest square group of smooth equations
  (``y = x + 0.5 tanh(x)``; the simultaneous update ``(x, y) -> (x + tanh(t y), y + sin(x))``):
  u with F(u) = y, each step solved per element (k x k blocks) when the group is elementwise,
  densely otherwise, from the best of a few cheap starting points (the known outputs first,
  as for residual maps ``x + g(x)``), with backtracking on the residual, inside a bounded
  `lax.while_loop`. The result is accepted only where the residual meets a tolerance of a few
  ulps of y; elsewhere `ReversibilityError` names the group's first line (or NaN with
  ``reverse(..., on_error="nan")``; under `jit` the check runs with the program). A
  Jacobian that vanishes at the solution raises `SingularJacobianError`. Derivatives of the
  recovered value come from the implicit function theorem (one linear solve), never from the
  iterations.

Inverses found by Newton's method are local: where the group's map is not one-to-one, the
preimage found is the one Newton reaches from its start. `check_reversible` (and `reversible`,
which rebuilds values its caller holds) confirm them. A single equation is never solved this
way: a primitive without an inverse rule of its own stays an error that names it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxrev._dense as dense
from jaxrev._cache import memo
from jaxrev._compat import (
    JaxprEqn,
    Var,
    has_user_frame,
    prims,
    scan_info,
    sds,
    staged_constants,
)
from jaxrev._env import Env
from jaxrev._errors import (
    JaxrevError,
    ReversibilityError,
    SingularJacobianError,
    at_element,
    at_eqn,
    not_invertible,
)
from jaxrev._graph import real_outvars, size_of
from jaxrev.transforms.knowledge import records
from jaxrev.transforms.knowledge.checks import NEWTON_STARTS, raise_where
from jaxrev.transforms.knowledge.context import Settings, WalkContext, placeholders
from jaxrev.transforms.propagation.lumps import Lump, affine_eqn, singular_on_stand_ins, stand_ins
from jaxrev.transforms.propagation.rational import quadratic_roots
from jaxrev.transforms.registry import SMOOTH, elementwise_in, is_kind

__all__ = ["LinearWalk", "eliminate_step", "newton_step", "torn_slogdet"]

MAX_GROUP_EQNS = 256
"""How many stuck equations a group may hold."""
MAX_UNKNOWNS = 2048
"""Unknown numbers in a dense Newton system; above it the step declines."""
MAX_ELIMINATED = 256
"""Unknown numbers in a dense elimination (its rank analysis is an SVD at trace time)."""
MAX_ITERATIONS = 50
MAX_HALVINGS = 30
_TOL_ULPS = 32
_SAMPLES = 4


def _candidates(
    eqns: Sequence[JaxprEqn], env: Env, pending: Sequence[int], blocked: set[int]
) -> tuple[list[int], list[int]]:
    """Pending equations with an unknown input, and those of them with a known output. An
    equation reading a value known on some elements only is left to element-level
    propagation (the elements it lacks were lost, or follow from elsewhere)."""
    cand = [
        i
        for i in pending
        if i not in blocked
        and any(not env.known(v) for v in eqns[i].invars)
        and not any(isinstance(v, Var) and v in env.part for v in eqns[i].invars)
    ]
    return cand, [i for i in cand if any(env.known(v) for v in real_outvars(eqns[i]))]


def _first_line(group: Sequence[JaxprEqn]) -> JaxprEqn:
    return next((e for e in group if has_user_frame(e)), group[0])


def _floats(vs: Sequence[Var]) -> bool:
    return all(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in vs)


# --------------------------------------------------------------------------- elimination


def eliminate_step(
    eqns: Sequence[JaxprEqn], env: Env, pending: Sequence[int], blocked: set[int]
) -> bool:
    """Solve the stuck equations' affine part for every unknown it determines."""
    cand, stuck = _candidates(eqns, env, pending, blocked)
    if not stuck:
        return False
    group = [eqns[i] for i in cand][-MAX_GROUP_EQNS:]
    first = cand[-MAX_GROUP_EQNS:][0]
    # where the known values the group reads come from, nearby: their stand-ins keep their
    # relations (the step's dt and dt / 2)
    sources = {
        o: e for e in eqns[max(0, first - 4 * MAX_GROUP_EQNS) : first] for o in real_outvars(e)
    }
    shapes = Counter(
        tuple(o.aval.shape) for i in stuck for o in real_outvars(eqns[i]) if env.known(o)
    )
    shape = shapes.most_common(1)[0][0]
    tried: list = []
    for blocks in (True, False):
        L, cut = _affine_part(group, env, shape if blocks else None, sources)
        # without a cut, the affine part is a linear lump, which `lumps` has tried already;
        # the dense pass adds nothing when its affine part is the elementwise one
        if L is None or not cut & set(L.inputs) or not _floats([*L.inputs, *L.outputs]):
            continue
        if L.eqns in tried:
            continue
        if blocks and any(tuple(v.aval.shape) != shape for v in [*L.inputs, *L.outputs]):
            continue
        if not blocks and size_of(v.aval for v in L.inputs) > MAX_ELIMINATED:
            continue
        tried.append(L.eqns)
        system = _System(L, blocks, shape)
        det, full_rows = _determined(system, env)
        if not det:
            continue
        for v, val in zip(
            [L.inputs[j] for j in det], _solve_determined(system, env, det, full_rows)
        ):
            env.write(v, val)
        records.unsupported(env, f"an exact linear elimination ({L.eqns[0].primitive})")
        return True
    return False


def _affine_part(
    group: Sequence[JaxprEqn], env: Env, shape: tuple[int, ...] | None, sources: dict | None = None
) -> tuple[Lump | None, set]:
    """The equations affine in the unknowns (elementwise of `shape`, when given), and the
    outputs of the others (cut: they become unknowns of the affine part)."""
    lin, cut = [], set()
    for e in group:
        act = [isinstance(v, Var) and not env.known(v) for v in e.invars]
        if any(act) and affine_eqn(e, act) and (shape is None or elementwise_in(e, shape)):
            lin.append(e)
        else:
            cut.update(real_outvars(e))
    if not lin:
        return None, cut
    produced = {v for e in lin for v in real_outvars(e)}
    inputs = list(
        dict.fromkeys(
            v
            for e in lin
            for v in e.invars
            if isinstance(v, Var) and not env.known(v) and v not in produced
        )
    )
    outputs = [v for e in lin for v in real_outvars(e) if env.known(v)]
    if not inputs or not outputs:
        return None, cut
    return Lump(lin, inputs, outputs, sources), cut


def _determined(system: _System, env: Env) -> tuple[list[int], bool]:
    """Which unknowns the system determines, from M's structure on stand-in values: unknown j
    is determined where its unit vector lies in M's row space (in every element); and whether
    M's rows are independent there. Memoized per group: the walks of one jaxpr meet the same
    stuck group again and again."""
    L = system.lump
    key = (tuple(L.eqns), tuple(L.inputs), tuple(L.outputs), system.blocks)
    cache = memo("nonlinear.determined", 4096)
    hit = cache.get(key)
    if hit is None:
        hit = cache.put(key, [], _rank_analysis(system, env))
    return hit


def _rank_analysis(system: _System, env: Env) -> tuple[list[int], bool]:
    probe = stand_ins(system.lump, env)
    if probe is None:
        return [], False
    reads = [probe.read(v) for v in system.lump.reads]
    try:
        with jax.ensure_compile_time_eval():
            M = np.asarray(system.probe_matrix(reads))
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return [], False
    if not np.all(np.isfinite(M)):
        return [], False
    # each unknown's column scaled to 1 first: whether e_j lies in the row space does not
    # change, but the tests below become independent of the unknowns' scales (a system
    # y / h² - e = r with h² = 1e-6 made y's share of the null space (h²)² = 1e-12, and y
    # "determined" by one equation in two unknowns: a silently wrong inverse of Bratu's map)
    size = np.max(np.abs(M), axis=-2, keepdims=True)
    M = M / np.where(size > 0, size, 1.0)
    # null space of each block: right singular vectors with negligible singular values
    _, s, vt = dense.numpy_svd(M, full_matrices=True)
    k = M.shape[-1]
    smax = s.max(axis=-1, keepdims=True) if s.size else np.zeros(M.shape[:-2] + (1,))
    rank = (s > 1e-10 * smax).sum(-1)
    null = np.arange(k) >= rank[..., None]  # (..., k) rows of vt
    weight = np.einsum("...ij,...i->...j", vt**2, null.astype(M.dtype))
    det_comp = np.all(weight.reshape(-1, k) < 1e-12, axis=0) if weight.size else np.zeros(k, bool)
    full_rows = bool(np.all(rank == M.shape[-2]))
    return system.whole_unknowns(det_comp), full_rows


def _small_inv(A: Any) -> Any:
    """Inverses of a batch of m x m matrices; closed forms for m <= 2, which are elementwise
    arithmetic (a batched LAPACK call per loop iteration costs more than the step)."""
    m = A.shape[-1]
    if m == 1:
        return 1.0 / A
    if m == 2:
        a, b, c, d = A[..., 0, 0], A[..., 0, 1], A[..., 1, 0], A[..., 1, 1]
        det = a * d - b * c
        return (
            jnp.stack([jnp.stack([d, -b], -1), jnp.stack([-c, a], -1)], -2) / det[..., None, None]
        )
    return dense.inv(A)


def _solve_determined(
    system: _System, env: Env, det: list[int], full_rows: bool = False
) -> list[Any]:
    reads = [env.read(v) for v in system.lump.reads]
    M = system.matrix(reads)
    r = system.pack_out([env.read(o) for o in system.lump.outputs]) - system.F(
        system.zeros(), reads
    )
    MT = jnp.swapaxes(M, -1, -2)
    # independent rows: M⁺ = Mᵀ (M Mᵀ)⁻¹, an m x m inverse instead of an SVD per call
    P = MT @ _small_inv(M @ MT) if full_rows else jnp.linalg.pinv(M)
    u = jnp.einsum("...ij,...j->...i", P, r)
    rows = system.component_rows(det)
    # the rank found on stand-ins must hold for the actual values
    PM = jnp.einsum("...ij,...jk->...ik", P[..., rows, :], M)
    err = jnp.max(jnp.abs(PM - jnp.eye(M.shape[-1], dtype=M.dtype)[rows]))
    first = _first_line(system.lump.eqns)

    def error(err):
        if np.all(np.asarray(err) < 1e-6):
            return None
        return not_invertible(
            first,
            "it belongs to a group of equations whose affine part "
            "determines some unknowns only for other values of the known "
            "ones: here its matrix loses rank",
            singular=True,
            who=who,
        )

    who = env.ctx.who
    raise_where(env.ctx.on_error, error, err, bad=~(err < 1e-6))
    u = jnp.where(err < 1e-6, u, jnp.nan)
    vals = system.unpack(u)
    return [vals[j] for j in det]


def _affine_coefficients(L: Lump, sample: Sequence[Any], n: int) -> Any | None:
    """The blocks ``(n, m, k)`` of an elementwise affine group on `n` sample elements, by
    carrying each value's coefficients (on the k unknowns) through the equations in numpy:
    exact, and free of eager dispatch. None where a primitive is not one handled here."""
    k = len(L.inputs)
    coef: dict[Var, Any] = {v: np.eye(k)[j] * np.ones((n, 1)) for j, v in enumerate(L.inputs)}
    vals: dict[Var, Any] = dict(zip(L.reads, sample))

    def known(v):
        return np.asarray(v.val if not isinstance(v, Var) else vals[v], np.float64)

    for e in L.eqns:
        p, ins = e.primitive, e.invars
        act = [isinstance(v, Var) and v in coef for v in ins]
        c = [coef[v] if a else None for v, a in zip(ins, act)]
        if p in (prims.add, prims.add_any, prims.sub):
            sign = -1.0 if p is prims.sub else 1.0
            out = (c[0] if act[0] else 0.0) + sign * (c[1] if act[1] else 0.0)
        elif p in (prims.neg, prims.convert_element_type, prims.copy):
            out = -c[0] if p is prims.neg else c[0]
        elif p is prims.mul:
            j = 0 if act[0] else 1
            out = c[j] * np.reshape(known(ins[1 - j]), (-1, 1))
        elif p is prims.div and act[0] and not act[1]:
            out = c[0] / np.reshape(known(ins[1]), (-1, 1))
        elif p is prims.select_n and not act[0]:
            pred = np.broadcast_to(np.reshape(known(ins[0]), (-1,)), (n,)).astype(int)
            cases = [c[i + 1] if act[i + 1] else np.zeros((n, k)) for i in range(len(ins) - 1)]
            out = np.stack(cases)[pred, np.arange(n)]
        else:
            return None
        coef[e.outvars[0]] = np.broadcast_to(out, (n, k))
    return np.stack([coef[o] for o in L.outputs], 1)


# --------------------------------------------------------------------------- Newton


def newton_step(
    eqns: Sequence[JaxprEqn],
    env: Env,
    pending: Sequence[int],
    blocked: set[int],
    cut: bool = False,
    linear: LinearWalk | None = None,
) -> bool:
    """Solve the smallest trailing square group of two or more smooth equations by Newton
    (where equations before `eqns` are `cut` off, not one singular on stand-ins); a dense
    group that `linear` solves for its unknowns once a few of its nonlinear values are given
    is torn there (`_tear`), and Newton runs on those values alone."""
    cand, stuck = _candidates(eqns, env, pending, blocked)
    if not stuck or not env.ctx.newton:
        return False
    top = max(stuck)
    for n_tried, t in enumerate(sorted((i for i in cand if i <= top), reverse=True)):
        if n_tried >= MAX_GROUP_EQNS:
            break
        idx = [i for i in cand if i >= t]
        if len(idx) < 2 and eqns[idx[0]].primitive is not prims.scan:
            continue  # one primitive without an inverse rule of its own stays an error
        group = _toward_known([eqns[i] for i in idx], env)
        produced = {v for e in group for v in real_outvars(e)}
        inputs = list(
            dict.fromkeys(
                v
                for e in group
                for v in e.invars
                if isinstance(v, Var) and not env.known(v) and v not in produced
            )
        )
        outputs = [v for e in group for v in real_outvars(e) if env.known(v)]
        if len(group) < 2 and group[0].primitive is not prims.scan:
            continue
        if not inputs or size_of(v.aval for v in inputs) != size_of(v.aval for v in outputs):
            continue
        if not _floats([*inputs, *outputs]) or not all(_smooth(e, env) for e in group):
            continue
        L = Lump(group, inputs, outputs)
        shapes = {tuple(v.aval.shape) for v in [*inputs, *outputs]}
        blocks = (
            len(shapes) == 1
            and len(inputs) == len(outputs)
            and all(elementwise_in(e, next(iter(shapes))) for e in group)
        )
        if not blocks and size_of(v.aval for v in inputs) > MAX_UNKNOWNS:
            continue
        # a Jacobian singular on stand-ins: an input the group takes as free may be fixed
        # by equations the window cuts off
        if cut and singular_on_stand_ins(L, env, nonlinear=True):
            continue
        system = _System(L, blocks, next(iter(shapes)) if blocks else ())
        torn = None if blocks else _tear(L, env, linear)
        for v, val in zip(inputs, _newton(system, env, torn)):
            env.write(v, val)
        tear = None if torn is None else torn.tear
        records.group_step(env, "newton", group, inputs, outputs, tear=tear)
        return True
    return False


def _toward_known(group: list[JaxprEqn], env: Env) -> list[JaxprEqn]:
    """The equations of `group` that lead to its known outputs: what the unknowns feed only
    elsewhere (a block neural autoregressive layer's log-Jacobian, computed beside its
    output from the same values, through maxima and stop-gradients) is no equation Newton
    solves, and is evaluated once the unknowns are found."""
    need = {v for e in group for v in real_outvars(e) if env.known(v)}
    kept = []
    for e in reversed(group):
        if any(o in need for o in real_outvars(e)):
            kept.append(e)
            need.update(v for v in e.invars if isinstance(v, Var))
    return kept[::-1] or group


def _smooth(e: JaxprEqn, env: Env) -> bool:
    """Whether Newton may differentiate through `e` (given which inputs are unknown)."""
    act = [isinstance(v, Var) and not env.known(v) for v in e.invars]
    if any(a and not jnp.issubdtype(v.aval.dtype, jnp.inexact) for a, v in zip(act, e.invars)):
        return False
    p = e.primitive
    if p is prims.scan:  # a loop inside the group (fixed-point iterations): smooth if its body is
        body = scan_info(e.params).body.jaxpr
        return all(is_kind(q.primitive, SMOOTH) for q in body.eqns)
    if not is_kind(p, SMOOTH):
        return False
    if p is prims.select_n:
        return not act[0]
    if p is prims.convert_element_type:
        return jnp.issubdtype(e.params["new_dtype"], jnp.inexact)
    return True


def _newton(system: _System, env: Env, torn: _Torn | None = None) -> list[Any]:
    if not env.ctx.values:  # (a planning walk: the preimage's shape only)
        return placeholders(system.lump.inputs)
    # (run-time work, staged even where the walk folds constants: an operation on
    # constants alone, a start's index, would be compiled and run on its own while traced)
    with staged_constants():
        return _solve_group(system, env, torn)


def _solve_group(system: _System, env: Env, torn: _Torn | None) -> list[Any]:
    """`_newton`'s work: the group's inputs from its outputs, by the exact roots of a
    quadratic piece (polished) or damped Newton, checked against the outputs."""
    ctx = env.ctx
    L = system.lump
    reads = [env.read(v) for v in L.reads]
    yp = system.pack_out([env.read(o) for o in L.outputs])
    tol = _tolerance(system, yp)
    if torn is not None:
        ctx.used_newton()
        xs, J = _torn_recover(torn, [env.read(o) for o in L.outputs], reads, ctx.newton_start)
        u = jnp.concatenate([jnp.ravel(jnp.asarray(x, system.dtype)) for x in xs])
    else:
        # a ratio of quadratics in one unknown (a spline's piece): its two roots, each a
        # start (`choices` keeps the one in the piece's bin), polished by one Newton step
        roots = (
            quadratic_roots(L.eqns, L.inputs[0], L.outputs[0], L.reads, reads, yp[..., 0])
            if system.blocks and len(L.inputs) == 1 and len(L.outputs) == 1
            else None
        )
        if roots is None:
            ctx.used_newton()
        else:
            ctx.used_roots()
        u = _recover(system, yp, reads, ctx.newton_start, roots)
        J = system.jacobian(u, reads)
    # the answer is checked where it is used: F(u) must give the known outputs back
    rn = system.norm(yp - system.F(u, reads))
    ok = jnp.isfinite(rn) & (rn <= tol)
    # (a torn group's Jacobian is singular where its cut's is: the affine part's matrix
    # is not, or its walk would not have given the inputs back)
    _, logdet = dense.slogdet(J)
    singular = ok & ~jnp.isfinite(logdet)
    good = ok & ~singular
    u = jnp.where(system.broadcast(good), u, jnp.nan)
    _check(L, ok, singular, rn, tol, ~jnp.isfinite(system.norm(yp)), ctx)
    return system.unpack(u)


def _tolerance(system: _System, yp: Any) -> Any:
    """A few ulps of the known outputs (per element for blocks)."""
    fi = jnp.finfo(yp.dtype)
    return lax.stop_gradient(_TOL_ULPS * fi.eps * jnp.maximum(system.norm(yp), fi.tiny))


def _recover(system: _System, yp: Any, reads: list, only: Any, roots: tuple | None = None) -> Any:
    """u with F(u) = yp by damped Newton (from start `only`, the walk's `newton_start`), or
    from the exact `roots` polished; its derivative by the implicit function theorem."""

    # (the start and the roots are arguments, not closed over: under a choice's vmap over its
    # bins they are batched, and a derivative taken later must not find them leaked)
    @jax.custom_jvp
    def recover(yp, reads, only, roots):
        if roots is not None:
            return _polish(system, yp, reads, only, roots)
        return _iterate(system, yp, reads, only)

    @recover.defjvp
    def _ift(primals, tangents):
        yp, reads, only, roots = primals
        dyp, dreads, _, _ = tangents
        u = recover(yp, reads, only, roots)
        _, dF = jax.jvp(lambda rd: system.F(u, rd), (reads,), (dreads,))
        return u, system.solve(system.jacobian(u, reads), dyp - dF)

    return recover(yp, reads, only, roots)


def _iterate(
    system: _System, yp: Any, reads: list, only: Any, tol_of: Callable | None = None
) -> Any:
    """u with F(u) = yp by damped Newton from the best start (or start `only`); `tol_of(u0)`:
    the residual's tolerance (default: a few ulps of yp), past which steps go on only while
    they halve the residual. Steps are damped only far from the root; an element whose
    residual is below √eps of its start's stops once a full step no longer halves it (the
    rounding floor), its answer left to the caller's check."""
    F = lambda u: system.F(u, reads)  # noqa: E731
    resid = _residual(system, yp, reads)
    if only is None:
        u0 = _best_start(system, yp, reads, resid)
        r0 = resid(u0)
    else:  # one start (`choices` tries each, vmapped, where several preimages may exist):
        # -1 the best of all, else one of a few
        starts = _starts(system, yp, reads)
        rs = jnp.stack([resid(s) for s in starts])
        reads_ = system.read_guesses(reads, 3)
        alt = ([jnp.full_like(yp, 0.5)] + reads_ + [jnp.zeros_like(yp)])[:NEWTON_STARTS]
        alt += [alt[-1]] * (NEWTON_STARTS - len(alt))
        every = jnp.stack([_pick(jnp.stack(starts), jnp.argmin(rs, axis=0)), *alt])
        u0 = every[jnp.asarray(only) + 1]
        r0 = resid(u0)

    tol = _tolerance(system, yp) if tol_of is None else tol_of(u0)
    eps = jnp.finfo(yp.dtype).eps

    def cond(s):
        _, rn, it, active = s
        return (it < MAX_ITERATIONS) & jnp.any(active)

    def body(s):
        u, rn, it, active = s
        du = system.solve(system.jacobian(u, reads), yp - F(u))
        du = jnp.where(jnp.isfinite(du), du, 0.0)

        # the step is damped only far from the root: above the tolerance, and above √eps of
        # the start's residual, where Newton's full step halves the residual or meets the
        # rounding floor (below: a full step is taken if it lowers the residual, and the
        # element stops if not: no shorter step does better at the floor, and halving it
        # thirty times held a whole vmapped batch for each element that got there)
        near = rn <= jnp.sqrt(eps) * r0
        damp = active & (rn > tol) & ~near

        def bt_cond(b):
            lam, rt, h = b
            return (h < MAX_HALVINGS) & jnp.any(damp & ~(rt < rn))

        def bt_body(b):
            lam, rt, h = b
            lam = jnp.where((rt < rn) | ~damp, lam, lam / 2)
            return lam, resid(u + system.broadcast(lam) * du), h + 1

        lam0 = jnp.ones_like(rn)
        lam, rt, _ = lax.while_loop(
            bt_cond, bt_body, (lam0, resid(u + system.broadcast(lam0) * du), 0)
        )
        better = active & (rt < rn)
        u = jnp.where(system.broadcast(better), u + system.broadcast(lam) * du, u)
        halved = rt <= 0.5 * rn
        rn = jnp.where(better, rt, rn)
        # Newton's full step at least halves the residual near a root (quadratically at a
        # simple one; by (1 - 1/m)^m <= 1/e at one of multiplicity m): a full step that
        # does not, far below where the element started, is rounding, and the element stops
        # (the group's own check then judges it: a torn group's cut, whose tolerance, ulps
        # of c, is below the floor where c is small, crept on by ulps for many iterations)
        stalled = near & ~halved
        # past the tolerance, steps go on while they still halve the residual (one or two
        # at Newton's quadratic rate: the backward run should not add more rounding than
        # the forward run did), not while it wanders by an ulp at the rounding floor
        going = better & ~stalled & (rn > 0) & ((rn > tol) | halved)
        return u, rn, it + 1, going

    u, *_ = lax.while_loop(cond, body, (u0, r0, 0, r0 > 0))
    return u


def _residual(system: _System, yp: Any, reads: list) -> Any:
    """u -> ‖F(u) − yp‖ per element (inf where not finite)."""

    def resid(u):
        r = system.norm(yp - system.F(u, reads))
        return jnp.where(jnp.isfinite(r), r, jnp.inf)

    return resid


def _starts(system: _System, yp: Any, reads: list) -> list[Any]:
    """A few starting points: the outputs themselves (a residual map x + g(x) starts next to
    its answer), the values the group reads (a spline piece reads the knots around its
    answer), then constants."""
    guess = system.guess(yp)
    consts = [jnp.full_like(yp, c) for c in (0.0, 0.5, 1.0, -1.0)]
    return ([] if guess is None else [guess]) + system.read_guesses(reads, 3) + consts


def _best_start(system: _System, yp: Any, reads: list, resid: Any) -> Any:
    """The best of `_starts`, per element."""
    starts = _starts(system, yp, reads)
    rs = jnp.stack([resid(s) for s in starts])
    return _pick(jnp.stack(starts), jnp.argmin(rs, axis=0))


def _polish(system: _System, yp: Any, reads: list, only: Any, roots: tuple) -> Any:
    """The root `only` (0 or 1, as `choices` asks; None: the one Newton's method would reach)
    after one Newton step, kept where it lowers the residual."""
    resid = _residual(system, yp, reads)

    def once(u0):
        du = system.solve(system.jacobian(u0, reads), yp - system.F(u0, reads))
        u1 = u0 + jnp.where(jnp.isfinite(du), du, 0.0)
        return jnp.where(system.broadcast(resid(u1) < resid(u0)), u1, u0)

    r = [x[..., None].astype(yp.dtype) for x in roots]
    if only is not None:  # (no other start is evaluated: each root is its own candidate)
        return once(jnp.stack(r)[jnp.clip(jnp.asarray(only), 0, 1)])
    # both roots may solve it (the map is not one-to-one on the reals): as Newton's method
    # would, keep the one nearer the best of its usual starts; but a root that does not
    # solve it (the conjugate branch a radical's squared equation adds) only where neither does
    near = _best_start(system, yp, reads, resid)
    u0, u1 = once(r[0]), once(r[1])
    r0, r1 = resid(u0), resid(u1)
    tol = _tolerance(system, yp)
    good0, good1 = r0 <= tol, r1 <= tol
    nearer1 = system.norm(u1 - near) < system.norm(u0 - near)
    second = (good1 & (~good0 | nearer1)) | (~good0 & ~good1 & (r1 < r0))
    return jnp.where(system.broadcast(second), u1, u0)


def _pick(stacked: Any, best: Any) -> Any:
    """Per batch element, the start with the smallest residual."""
    idx = jnp.expand_dims(best, (0, best.ndim + 1))
    return jnp.take_along_axis(stacked, jnp.broadcast_to(idx, (1,) + stacked.shape[1:]), axis=0)[0]


def _check(L: Lump, ok: Any, singular: Any, rn: Any, tol: Any, given_bad: Any, ctx: Any) -> None:
    """Raise where the group was not solved (eagerly, or when the program runs), as the
    walk's context says, naming the first element that failed (the group's elements are the
    state's, per element, for an elementwise group); a known output that is NaN or inf
    (`given_bad`) is named as the cause, not the solver."""
    first = _first_line(L.eqns)
    who = ctx.who
    if ctx.settings.rebuilds:
        # reversible's backward run rebuilds what the forward run computed: a NaN or an
        # infinity given here is the program's own value (jax.grad's gradient is NaN there
        # too), not a failure; its preimage is NaN, and the drift check compares that with
        # the true value (no drift where the forward run held a NaN as well)
        ok = ok | given_bad
        if ctx.drift is not None and ctx.drift.dial.repair:
            # under the repairing dial a failed solve (a singular Jacobian where the forward
            # run sits on a superattracting fixed point) is drift like any other: its NaN
            # reaches the segment's check, which recomputes the segment from its checkpoint,
            # or the call's inputs' check, which names the loop
            return

    def error(ok, singular, rn, tol, given_bad):
        ok, singular, given_bad = np.asarray(ok), np.asarray(singular), np.asarray(given_bad)
        if np.any(given_bad & ~ok):
            return at_eqn(
                ReversibilityError,
                first,
                "the outputs given to a group of equations solved by Newton's method are not "
                f"finite (NaN or inf){at_element(given_bad & ~ok)}: the input is, not the solve",
                "Ways out: check the input, or pass on_error='nan' to get NaN there.",
                who=who,
            )
        if np.any(singular):
            return at_eqn(
                SingularJacobianError,
                first,
                "the Jacobian of a group of equations solved by Newton's method "
                f"vanishes at the solution{at_element(singular)}",
                "Ways out: the map is not invertible there; keep what it loses in the "
                "state, or pass on_error='nan' (NaN on the singular elements alone).",
                who=who,
            )
        if not np.all(ok):
            worst = float(np.max(np.where(ok, 0.0, np.asarray(rn))))
            return at_eqn(
                ReversibilityError,
                first,
                "Newton's method found no preimage for a group of equations "
                f"invertible only together{at_element(~ok)} (residual {worst:.3g} > "
                f"tolerance {float(np.max(tol)):.3g})",
                "Ways out: the outputs may have no preimage (outside the map's "
                "range), or Newton's start is too far from it: give the group an "
                "inverse with `jr.custom_inverse`, or pass on_error='nan'.",
                who=who,
            )
        return None

    raise_where(
        ctx.on_error,
        error,
        ok,
        singular,
        rn,
        tol,
        given_bad,
        bad=jnp.any(singular) | ~jnp.all(ok),
    )


# --------------------------------------------------------------------------- packing


class _System:
    """A group as a map of one array: ``(*S, k)`` for k unknown arrays of shape S solved per
    element (`blocks`), ``(n,)`` for all unknowns flattened (dense)."""

    def __init__(self, lump: Lump, blocks: bool, shape: tuple[int, ...]) -> None:
        self.lump, self.blocks, self.shape = lump, blocks, tuple(shape)
        self.dtype = jnp.result_type(*[v.aval.dtype for v in [*lump.inputs, *lump.outputs]])
        self.in_sizes = [int(np.prod(v.aval.shape, dtype=np.int64)) for v in lump.inputs]
        self.out_sizes = [int(np.prod(v.aval.shape, dtype=np.int64)) for v in lump.outputs]

    def _pack(self, vals: Sequence[Any]) -> Any:
        if self.blocks:
            return jnp.stack([jnp.asarray(x, self.dtype) for x in vals], -1)
        return jnp.concatenate([jnp.ravel(jnp.asarray(x, self.dtype)) for x in vals])

    def pack_out(self, vals: Sequence[Any]) -> Any:
        return self._pack(vals)

    def unpack(self, u: Any) -> list[Any]:
        ins = self.lump.inputs
        if self.blocks:
            return [u[..., j].astype(v.aval.dtype) for j, v in enumerate(ins)]
        offs = np.cumsum([0] + self.in_sizes)
        return [
            jnp.reshape(u[offs[m] : offs[m + 1]], v.aval.shape).astype(v.aval.dtype)
            for m, v in enumerate(ins)
        ]

    def zeros(self) -> Any:
        if self.blocks:
            return np.zeros(self.shape + (len(self.lump.inputs),), self.dtype)
        return np.zeros(sum(self.in_sizes), self.dtype)

    def F(self, u: Any, reads: Sequence[Any]) -> Any:
        return self._pack(self.lump.apply(self.unpack(u), reads))

    def matrix(self, reads: Sequence[Any]) -> Any:
        """The Jacobian of F (constant for an affine part): ``(*S, m, k)`` or ``(m, n)``."""
        return self.jacobian(self.zeros(), reads)

    def _basis(self, u: Any) -> Any:
        """Unit vectors, one per unknown, on every element at once (elements are
        independent): ``(k, *u.shape)``."""
        k = u.shape[-1]
        # (numpy: where JAX folds constants, each jnp operation here compiled a program)
        return np.broadcast_to(
            np.eye(k, dtype=u.dtype).reshape((k,) + (1,) * (u.ndim - 1) + (k,)), (k,) + u.shape
        )

    def jacobian(self, u: Any, reads: Sequence[Any]) -> Any:
        cols = jax.vmap(lambda e: jax.jvp(lambda v: self.F(v, reads), (u,), (e,))[1])(
            self._basis(u)
        )
        return jnp.moveaxis(cols, 0, -1)  # (..., m, k): column j is dF/du_j

    def probe_matrix(self, reads: Sequence[Any]) -> Any:
        """The matrix of an affine F from its values at the unit vectors, evaluated eagerly
        on stand-ins at trace time. Blocks are probed on a few sample elements (the
        equations are elementwise), whose shape recurs, so eager dispatch compiles once."""
        if not self.blocks:
            u0 = self.zeros()

            # (one program: op by op, each operation on the stand-ins compiled one)
            @jax.jit
            def probe(reads: Sequence[Any]) -> Any:
                cols = jax.vmap(lambda e: self.F(e, reads))(self._basis(u0)) - self.F(u0, reads)
                return jnp.moveaxis(cols, 0, -1)

            return probe(list(reads))
        n = min(_SAMPLES, int(np.prod(self.shape, dtype=np.int64)))
        sample = [
            np.reshape(np.asarray(r), -1)[:n] if np.shape(r) == self.shape else np.asarray(r)
            for r in reads
        ]
        M = _affine_coefficients(self.lump, sample, n)
        if M is not None:
            return M
        k = len(self.lump.inputs)
        units = np.eye(k)[:, None, :] * np.ones((1, n, 1))
        ins = [v.aval.dtype for v in self.lump.inputs]

        def F(u):
            outs = self.lump.apply(
                [u[:, j].astype(d) for j, d in enumerate(ins)], sample, fit=False
            )
            return np.stack([np.asarray(o, np.float64) for o in outs], -1)

        f0 = F(np.zeros((n, k)))
        return np.stack([F(units[j]) - f0 for j in range(k)], -1)  # (n, m, k)

    def solve(self, J: Any, r: Any) -> Any:
        return dense.solve(J, r[..., None])[..., 0]

    def norm(self, r: Any) -> Any:
        """Max-norm per element (blocks) or over everything (dense)."""
        return jnp.max(jnp.abs(r), axis=-1)

    def broadcast(self, per: Any) -> Any:
        return per[..., None]

    def guess(self, yp: Any) -> Any | None:
        """The outputs as a starting point, where they line up with the inputs."""
        ins, outs = self.lump.inputs, self.lump.outputs
        if len(ins) == len(outs) and all(
            tuple(a.aval.shape) == tuple(b.aval.shape) for a, b in zip(ins, outs)
        ):
            return yp
        return None

    def read_guesses(self, reads: Sequence[Any], most: int = 4) -> list[Any]:
        """Values the group reads, of the unknowns' shape, as starting points (elementwise
        groups: every unknown of an element starts at the same read value)."""
        if not self.blocks:
            return []
        k = len(self.lump.inputs)
        out = []
        for v, r in zip(self.lump.reads, reads):
            if tuple(v.aval.shape) == self.shape and jnp.issubdtype(v.aval.dtype, jnp.inexact):
                out.append(
                    jnp.broadcast_to(jnp.asarray(r, self.dtype)[..., None], self.shape + (k,))
                )
        return out[:most]

    def whole_unknowns(self, det_comp: Any) -> list[int]:
        """Indices of unknowns all of whose components are determined."""
        if self.blocks:
            return [j for j in range(len(self.lump.inputs)) if det_comp[j]]
        offs = np.cumsum([0] + self.in_sizes)
        return [
            m
            for m in range(len(self.in_sizes))
            if self.in_sizes[m] and bool(np.all(det_comp[offs[m] : offs[m + 1]]))
        ]

    def component_rows(self, det: list[int]) -> Any:
        if self.blocks:
            return np.asarray(det)
        offs = np.cumsum([0] + self.in_sizes)
        return np.concatenate([np.arange(offs[m], offs[m + 1]) for m in det])


# --------------------------------------------------------------------------- tearing

LinearWalk = Callable[[Sequence[JaxprEqn], Env, Sequence[Var]], Any]
"""``linear(eqns, env, goals)``: a soft walk over `eqns` alone with the linear steps only
(`walker.Walk.linear_walk`), which recovers a torn group's unknowns from its cut values; no
Newton inside Newton."""


def _tear(L: Lump, env: Env, linear: LinearWalk | None) -> _Torn | None:
    """The group torn at the outputs of its nonlinear equations that its affine ones read,
    where those are fewer numbers than its unknowns and, given them, the affine equations
    give every unknown back (a planar layer ``y = x + u tanh(w.x + b)``: one number, the
    tanh, instead of x's D); None otherwise. Memoized per group, like `_determined`."""
    if linear is None:
        return None
    aff, cut = _affine_part(L.eqns, env, None)
    if aff is None or set(aff.outputs) != set(L.outputs):
        return None  # (an output of a nonlinear equation is one more equation on the cut)
    tear_cut = [v for v in aff.inputs if v in cut]
    if not tear_cut or not _floats(tear_cut):
        return None
    if size_of(v.aval for v in tear_cut) >= size_of(v.aval for v in L.inputs):
        return None
    key = (tuple(L.eqns), tuple(L.inputs), tuple(L.outputs), tuple(tear_cut))
    cache = memo("nonlinear.tear", 4096)
    tear = cache.get(key)
    if tear is None:
        tear = cache.put(key, [], _tear_if_linear(L, aff, tear_cut, env, linear))
    return None if tear is False else _Torn(tear, L, env.info, env.ctx, linear)


def _tear_if_linear(
    L: Lump, aff: Lump, tear_cut: list[Var], env: Env, linear: LinearWalk
) -> records.Tear | bool:
    """The tear, where the linear walk over the affine equations, with the cut values given,
    gives every unknown back (tried on abstract values); False where it does not."""
    tear = records.Tear(tuple(aff.eqns), tuple(tear_cut))
    torn = _Torn(tear, L, env.info, env.ctx, linear)
    found = []

    def trial(cut_vals, out_vals, read_vals):
        found.append(torn.inputs(cut_vals, out_vals, read_vals) is not None)
        return 0

    try:
        jax.eval_shape(
            trial,
            [sds(v.aval) for v in tear_cut],
            [sds(v.aval) for v in L.outputs],
            [sds(v.aval) for v in L.reads],
        )
    except JaxrevError:
        return False
    return tear if found and found[0] else False


class _Torn:
    """A Newton group `lump` (unknown inputs from known outputs) torn at `tear.cut`: the
    affine equations give the inputs from the cut values (`inputs`), the group run forward
    gives the cut values from the inputs (`cut_of`); Newton's method solves
    ``c - cut_of(inputs(c)) = 0`` (`_TornSystem`) in the cut's few numbers."""

    def __init__(
        self, tear: records.Tear, lump: Lump, info: Any, ctx: Any, linear: LinearWalk
    ) -> None:
        self.tear, self.lump, self.info, self.linear = tear, lump, info, linear
        # the walks of the affine part are not recorded (the group's step is)
        self.ctx = ctx.replace(recorder=None) if ctx is not None else None
        self.forward = Lump(lump.eqns, lump.inputs, list(tear.cut))

    def inputs(
        self, cut_vals: Sequence[Any], out_vals: Sequence[Any], read_vals: Sequence[Any]
    ) -> list[Any] | None:
        walk_env = Env(info=self.info, ctx=self.ctx)
        for vs, xs in ((self.lump.reads, read_vals), (self.lump.outputs, out_vals)):
            for v, x in zip(vs, xs):
                walk_env.write(v, x)
        for v, c in zip(self.tear.cut, cut_vals):
            walk_env.write(v, c)
        self.linear(self.tear.affine, walk_env, self.lump.inputs)
        if not all(walk_env.known(v) for v in self.lump.inputs):
            return None
        return [walk_env.read(v) for v in self.lump.inputs]

    def cut_of(self, xs: Sequence[Any], read_vals: Sequence[Any]) -> list[Any]:
        return self.forward.apply(xs, read_vals)


class _TornSystem:
    """A torn group as the map of its cut values ``F(c) = c - cut_of(inputs(c))`` (flat),
    with the known outputs and the values read bound; solved for F(c) = 0 by `_iterate`."""

    blocks = False

    def __init__(self, torn: _Torn, out_vals: Sequence[Any], read_vals: Sequence[Any]) -> None:
        self.torn, self.out_vals, self.read_vals = torn, list(out_vals), list(read_vals)
        cut = torn.tear.cut
        self.dtype = jnp.result_type(*[v.aval.dtype for v in cut])
        self.sizes = [size_of([v.aval]) for v in cut]

    def pack(self, vals: Sequence[Any]) -> Any:
        return jnp.concatenate([jnp.ravel(jnp.asarray(x, self.dtype)) for x in vals])

    def unpack(self, c: Any) -> list[Any]:
        offs = np.cumsum([0] + self.sizes)
        return [
            jnp.reshape(c[offs[m] : offs[m + 1]], v.aval.shape).astype(v.aval.dtype)
            for m, v in enumerate(self.torn.tear.cut)
        ]

    def inputs(self, c: Any) -> list[Any]:
        xs = self.torn.inputs(self.unpack(c), self.out_vals, self.read_vals)
        assert xs is not None  # (the tear was made where the affine walk gives them)
        return xs

    def F(self, c: Any, reads: Sequence[Any] = ()) -> Any:
        return c - self.pack(self.torn.cut_of(self.inputs(c), self.read_vals))

    def jacobian(self, c: Any, reads: Sequence[Any] = ()) -> Any:
        basis = np.eye(c.shape[-1], dtype=c.dtype)
        cols = jax.vmap(lambda e: jax.jvp(self.F, (c,), (e,))[1])(basis)
        return jnp.moveaxis(cols, 0, -1)

    solve = _System.solve
    norm = _System.norm
    broadcast = _System.broadcast

    def guess(self, target: Any) -> Any | None:
        """The cut values at the group's own start: its outputs, where they line up with
        its inputs (a residual map ``x + g(x)`` starts next to its answer)."""
        lump = self.torn.lump
        if len(lump.inputs) != len(lump.outputs) or any(
            tuple(a.aval.shape) != tuple(b.aval.shape) for a, b in zip(lump.inputs, lump.outputs)
        ):
            return None
        return self.pack(self.torn.cut_of(self.out_vals, self.read_vals))

    def read_guesses(self, reads: Sequence[Any], most: int = 4) -> list[Any]:
        return []


def _torn_recover(
    torn: _Torn, out_vals: list[Any], read_vals: list[Any], only: Any
) -> tuple[list[Any], Any]:
    """The torn group's unknown inputs, and its cut's Jacobian at the solution (whose
    determinant, times the affine part's, is the group's). The cut values come from Newton's
    method; their derivative from the implicit function theorem on the cut's equations
    alone (a solve of the cut's size); the inputs' from the affine walk."""

    @jax.custom_jvp
    def cut_values(out_vals, read_vals, only):
        system = _TornSystem(torn, out_vals, read_vals)
        target = jnp.zeros(sum(system.sizes), system.dtype)
        # (the cut's equations c - cut(x(c)) = 0 hold to a few ulps of c)
        return _iterate(system, target, [], only, lambda c: _tolerance(system, c))

    @cut_values.defjvp
    def _ift(primals, tangents):
        out_vals, read_vals, only = primals
        d_out, d_read, _ = tangents
        c = cut_values(out_vals, read_vals, only)
        _, dF = jax.jvp(
            lambda o, r: _TornSystem(torn, o, r).F(c), (out_vals, read_vals), (d_out, d_read)
        )
        J = _TornSystem(torn, out_vals, read_vals).jacobian(c)
        return c, _System.solve(None, J, -dF)

    c = cut_values(out_vals, read_vals, only)
    system = _TornSystem(torn, out_vals, read_vals)
    return system.inputs(c), lax.stop_gradient(system.jacobian(c))


def torn_slogdet(
    tear: records.Tear,
    eqns: Sequence[JaxprEqn],
    inputs: Sequence[Var],
    outputs: Sequence[Var],
    read: Callable[[Var], Any],
    info: Any,
    linear: LinearWalk,
) -> tuple[Any, Any]:
    """(sign, log|det|) of a torn group's cut Jacobian ``I + K A⁻¹ B`` at the values `read`
    gives (A: the affine part's matrix on the unknowns, B: on the cut, K: the cut's
    derivative by the unknowns). Times det A, it is the group's (the matrix determinant
    lemma: det(A + B K) = det A det(I + K A⁻¹ B)), an m x m determinant for m cut numbers
    instead of the group's n x n."""
    lump = Lump(list(eqns), list(inputs), list(outputs))
    ctx = WalkContext(Settings(on_error="nan"))
    torn = _Torn(tear, lump, info, ctx, linear)
    system = _TornSystem(torn, [read(o) for o in outputs], [read(v) for v in lump.reads])
    c = system.pack([read(v) for v in tear.cut])
    return dense.slogdet(system.jacobian(c))
