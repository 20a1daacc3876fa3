"""Memory-free reverse mode: `reversible` and its primitives.

`reversible(fun)` binds `reversible_p`, a primitive carrying `fun`'s jaxpr (modelled on JAX's
`remat_p`). Its JVP rule splits it, as linearization needs, into a known part
`reversible_store_p` that runs `fun` forward and keeps only the outputs (plus whatever a lossy
step forces it to keep, the *residuals*), and a linear part `reversible_lin_p` whose transpose is
the backward sweep
(`sweep.backward.walk`): it walks the equations last to first, rebuilds each equation's inputs from
its
outputs with the inverse rules, and pulls the cotangent through it. Loops run backwards by their
`sweep_rules`, so memory stays at the width of the program, not its depth.
"""

from __future__ import annotations

import hashlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial, wraps
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._batching import batch_front, instantiate_tangents
from jaxrev._cache import call_key, compiled, is_eager, memo
from jaxrev._compat import (
    ClosedJaxpr,
    dce_outputs,
    drop_unused_outputs,
    hoist_consts,
    is_key,
    is_symbolic_zero,
    shaped,
    trace_to_closed,
    zeros_of,
)
from jaxrev._env import Env
from jaxrev._errors import PerformanceWarning
from jaxrev._evaluate import eval_closed
from jaxrev._primitive import make_primitive
from jaxrev._program import (
    Filtered,
    avals_of,
    check_sizes,
    check_structure,
    normalize_argnums,
    trace_program,
)
from jaxrev.transforms.knowledge.context import Settings, WalkContext, resolve_on_error
from jaxrev.transforms.sweep import drift
from jaxrev.transforms.sweep.backward import (
    Plan,
    Residuals,
    acc,
    forward_with_residuals,
    get_ct,
    res_avals,
    seed_env,
    top_plan,
    walk,
)
from jaxrev.transforms.sweep.dial import Dial
from jaxrev.transforms.sweep.drift import RepairReport
from jaxrev.transforms.sweep.exact import Exact, has_loops, run_exact

__all__ = [
    "reversible",
    "reversible_with",
    "reversible_p",
    "reversible_store_p",
    "reversible_lin_p",
    "bind_reversible",
    "Bound",
    "rebuild",
]


# --------------------------------------------------------------------------- reversible_p


def _rev_impl(*args, jaxpr, state, dial):
    return compiled(("run", jaxpr), partial(eval_closed, jaxpr), *args)


def _rev_abstract(*avals, jaxpr, state, dial):
    return list(jaxpr.out_avals)


def _forward(primals, jaxpr, state, dial):
    """The known part of the split: the forward run, and what the linear part
    `reversible_lin_p` reads besides the tangents (outputs, residuals, parameters and, where
    drift is checked, the true state the caller holds); with the residuals' count."""
    outs = reversible_store_p.bind(*primals, jaxpr=jaxpr, state=state, dial=dial, keep=None)
    n_out = len(jaxpr.out_avals)
    outputs, res = outs[:n_out], outs[n_out:]
    params = [x for x, s in zip(primals, state) if not s]
    true_state = [x for x, s in zip(primals, state) if s] if dial.checks else []
    return outputs, [*outputs, *res, *params, *true_state], len(res)


def _rev_jvp(primals, tangents, *, jaxpr, state, dial):
    nz = tuple(not is_symbolic_zero(t) for t in tangents)
    outputs, known, nres = _forward(primals, jaxpr, state, dial)
    nonzero = [t for t, z in zip(tangents, nz) if z]
    out_t = reversible_lin_p.bind(
        *known, *nonzero, jaxpr=jaxpr, state=state, nz=nz, nres=nres, dial=dial
    )
    return outputs, out_t


def _rev_linearize(nonzeros, *primals, jaxpr, state, dial):
    """The JVP rule's split, given to JAX's linearization directly (so an eager `grad` does
    not trace the JVP rule on every call): the forward run now, and the linear part
    `reversible_lin_p` on the tangents."""
    nz = tuple(
        bool(z) and jnp.issubdtype(a.dtype, jnp.inexact) for z, a in zip(nonzeros, jaxpr.in_avals)
    )
    outputs, known, nres = _forward(primals, jaxpr, state, dial)

    def tangent_fun(residuals, *tangents):
        nonzero = [t for t, z in zip(tangents, nz) if z]
        return reversible_lin_p.bind(
            *residuals, *nonzero, jaxpr=jaxpr, state=state, nz=nz, nres=nres, dial=dial
        )

    return outputs, [True] * len(outputs), known, tangent_fun


def _vmapped(fun, args, dims):
    size, args, in_axes = batch_front(args, dims)
    outs = jax.vmap(fun, in_axes=in_axes, axis_size=size)(*args)
    return outs, [0] * len(outs)


def _rev_batch(args, dims, *, jaxpr, state, dial):
    size, args, in_axes = batch_front(args, dims)
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in args]
    batched, consts, _ = trace_to_closed(
        jax.vmap(lambda *a: eval_closed(jaxpr, *a), in_axes=in_axes, axis_size=size), *avals
    )
    outs = reversible_p.bind(
        *consts, *args, jaxpr=batched, state=(False,) * len(consts) + state, dial=dial
    )
    return outs, [0] * len(outs)


reversible_p = make_primitive(
    "jaxrev_reversible",
    multiple_results=True,
    impl=_rev_impl,
    abstract=_rev_abstract,
    jvp=_rev_jvp,
    batch=_rev_batch,
    linearize=_rev_linearize,
)
"""``reversible_p(*operands, jaxpr, state, dial)``: `jaxpr`'s outputs; its derivatives are
split into `reversible_store_p` (the forward run) and `reversible_lin_p` (the linear part)."""


# --------------------------------------------------------------------------- reversible_store_p


def _store_impl(*args, jaxpr, state, dial, keep):
    return compiled(
        ("store", jaxpr, state, dial, keep), partial(_store_run, jaxpr, state, dial, keep), *args
    )


def _store_run(jaxpr, state, dial, keep, *args):
    plan = top_plan(jaxpr, state, dial)

    def run(*args):
        outs, res = forward_with_residuals(plan, args)
        return [*outs, *res]

    if keep is None:
        return run(*args)
    # (traced, then without what the outputs kept do not need: JAX's rules drop a loop's
    # carry that none of them reads from the loop and from the loops it nests, where XLA
    # drops it from one loop only)
    closed, consts, _ = trace_to_closed(run, *avals_of(args))
    return eval_closed(dce_outputs(closed, keep), *consts, *args)


def _store_abstract(*avals, jaxpr, state, dial, keep):
    avals = [*jaxpr.out_avals, *(shaped(a) for a in res_avals(top_plan(jaxpr, state, dial)))]
    return avals if keep is None else [a for a, k in zip(avals, keep) if k]


def _store_keep(params: dict, used: tuple) -> dict:
    """The store's parameters for the outputs `used` of those it returns: `jax.grad` reads
    no output of the forward run but the residuals, and what computes only the others (an
    accumulator carried to the loss) is not run."""
    kept = iter(used)
    keep = params["keep"] or (True,) * len(used)
    return {**params, "keep": tuple(next(kept) if k else False for k in keep)}


def _store_jvp(primals, tangents, **params):
    # forward mode of the run that also returns residuals: a plain JVP (JAX's linearization
    # of it traces this with partial evaluation)
    return jax.jvp(
        partial(_store_impl, **params), tuple(primals), instantiate_tangents(primals, tangents)
    )


def _store_batch(args, dims, **params):
    # the forward run of a batched linearization: its residuals keep the unbatched plan
    return _vmapped(partial(_store_impl, **params), args, dims)


reversible_store_p = make_primitive(
    "jaxrev_reversible_store",
    multiple_results=True,
    impl=_store_impl,
    abstract=_store_abstract,
    jvp=_store_jvp,
    batch=_store_batch,
)
"""``reversible_store_p(*operands, jaxpr, state, dial, keep)``: `reversible_p`'s forward run
that also returns the residuals its backward sweep reads (outputs, then residuals); `keep`
(None: all) the ones it returns, set by JAX's dead-code elimination."""
drop_unused_outputs(reversible_store_p, _store_keep)


# --------------------------------------------------------------------------- reversible_lin_p


class LinOperands(NamedTuple):
    """`reversible_lin_p`'s operands, by what they are (`_lin_split`)."""

    outputs: Sequence[Any]  # the call's outputs
    residuals: Sequence[Any]  # what the forward run stored (`res_avals` order)
    params: Sequence[Any]  # the inputs that are not state
    true_state: Sequence[Any]  # the state as the caller holds it (empty: no drift checks)
    tangents: Sequence[Any]  # the nonzero tangents (the linear part's own operands)


def _lin_split(
    args: Sequence[Any], jaxpr: ClosedJaxpr, state: Sequence[bool], nres: int, dial: Dial
) -> LinOperands:
    """`reversible_lin_p`'s operands, split by what they are."""
    n_out = len(jaxpr.out_avals)
    n_params = sum(not s for s in state)
    n_state = sum(state) if dial.checks else 0
    params_end = n_out + nres + n_params
    state_end = params_end + n_state
    return LinOperands(
        args[:n_out],
        args[n_out : n_out + nres],
        args[n_out + nres : params_end],
        args[params_end:state_end],
        args[state_end:],
    )


def _top_env(
    plan: Plan, state: Sequence[bool], params: Sequence[Any], outputs: Sequence[Any]
) -> Env:
    """The env of a call's backward walk, whose context the call's dial gives (a drift log is
    added by the walk that checks)."""
    known_in = [not s for s in state]
    ctx = WalkContext(plan.dial.walk)
    return seed_env(plan, known_in, params, [True] * len(outputs), outputs, ctx)


def _checked_walk(
    plan: Plan,
    env: Env,
    ctenv: dict | None,
    active: set,
    res: Sequence[Any],
    state: Sequence[bool],
    true_state: Sequence[Any],
    read: Callable[[], list],
) -> list:
    """The backward walk of a `reversible` call, its rebuilt state compared with the true one
    (and every checkpointed segment with its checkpoint): then `read()` (the cotangents), as
    the dial says."""
    dial = plan.dial
    jaxpr = plan.closed.jaxpr
    loops = (
        drift.describe_loops(jaxpr.eqns, lambda e: e.primitive.name in _LOOPS)
        if dial.checks
        else ""
    )
    log = drift.log_for(dial, dial.name, loops)
    env.ctx = env.ctx.replace(drift=log, rebuilds=True)
    walk(plan, env, ctenv, active, Residuals(plan, res), [])
    cts = read()
    if log is None:
        return cts
    state_vars = [v for v, s in zip(jaxpr.invars, state) if s]
    steps = _steps(jaxpr, dial)
    at = drift.site(
        log,
        "the state rebuilt by the backward run (the inputs of the call)",
        None,
        drift.values_tol(dial, [v.aval.dtype for v in state_vars], steps),
        inputs=True,
    )
    # (a state of no elements has nothing to rebuild: the walk may leave it unknown)
    rebuilt = [
        env.read(v) if env.known(v) or math.prod(v.aval.shape) else zeros_of(v.aval)
        for v in state_vars
    ]
    drift.note(log, (drift.ratio(dial, rebuilt, true_state, steps), at))
    drift.send_report(log)
    return log.finish(log.worst(), cts)


def _steps(jaxpr: Any, dial: Dial) -> int:
    """How many equations the call's inputs are rebuilt over: a scan without checkpoints
    counts its iterations (its first checkpoint is its true start)."""
    steps = 0
    for eqn in jaxpr.eqns:
        length = eqn.params.get("length", 0) if eqn.primitive.name == "scan" else 0
        steps += length if length and not dial.checkpoints(length) else 1
    return steps


_LOOPS = ("scan", "while", "jaxrev_while")


def _lin_impl(*args, jaxpr, state, nz, nres, dial):
    """J·t at the point whose outputs and residuals are given: rebuild the inputs, then JVP."""
    ops = _lin_split(args, jaxpr, state, nres, dial)
    plan = top_plan(jaxpr, state, dial)
    env = _top_env(plan, state, ops.params, ops.outputs)
    _checked_walk(plan, env, None, set(), ops.residuals, state, ops.true_state, list)
    inputs = [env.read(v) if env.known(v) else zeros_of(v.aval) for v in plan.closed.jaxpr.invars]
    given = iter(ops.tangents)
    tangents = [next(given) if z else None for z in nz]
    _, out_t = jax.jvp(
        lambda *a: eval_closed(jaxpr, *a), tuple(inputs), instantiate_tangents(inputs, tangents)
    )
    return list(out_t)


def _lin_abstract(*avals, jaxpr, state, nz, nres, dial):
    return [a.to_tangent_aval() for a in jaxpr.out_avals]


def _lin_transpose(cts, *args, jaxpr, state, nz, nres, dial):
    ops = _lin_split(args, jaxpr, state, nres, dial)
    zero = tuple(is_symbolic_zero(ct) for ct in cts)
    given = [ct for ct, z in zip(cts, zero) if not z]
    in_cts = compiled(
        ("transpose", jaxpr, state, nz, nres, dial, zero),
        partial(_backward, jaxpr, state, nz, nres, dial, zero),
        given,
        [*ops.outputs, *ops.residuals, *ops.params, *ops.true_state],
    )
    return [None] * (len(args) - len(ops.tangents)) + list(in_cts)


def _backward(jaxpr, state, nz, nres, dial, zero, given, known):
    """The backward sweep: the cotangents of the active inputs from the outputs' (`given`,
    where not `zero`) and the primal operands `known` (outputs, residuals, parameters, true
    state)."""
    ops = _lin_split(known, jaxpr, state, nres, dial)
    plan = top_plan(jaxpr, state, dial)
    invars, outvars = plan.closed.jaxpr.invars, plan.closed.jaxpr.outvars
    env = _top_env(plan, state, ops.params, ops.outputs)
    ctenv: dict = {}
    given_cts = iter(given)
    for v, z in zip(outvars, zero):
        if not z:
            acc(ctenv, v, next(given_cts))
    active = {v for v, z in zip(invars, nz) if z}
    return _checked_walk(
        plan,
        env,
        ctenv,
        active,
        ops.residuals,
        state,
        ops.true_state,
        lambda: [get_ct(ctenv, v) for v, z in zip(invars, nz) if z],
    )


def _lin_jvp(primals, tangents, **params):
    return jax.jvp(
        partial(_lin_impl, **params), tuple(primals), instantiate_tangents(primals, tangents)
    )


def _lin_batch(args, dims, **params):
    return _vmapped(partial(_lin_impl, **params), args, dims)


reversible_lin_p = make_primitive(
    "jaxrev_reversible_lin",
    multiple_results=True,
    impl=_lin_impl,
    abstract=_lin_abstract,
    jvp=_lin_jvp,
    transpose=_lin_transpose,
    batch=_lin_batch,
)
"""``reversible_lin_p(*known, *tangents, jaxpr, state, nz, nres, dial)``: the linear part of
`reversible_p`'s split (J·t); its transpose is the backward sweep."""


# --------------------------------------------------------------------------- public API


@dataclass
class Bound:
    """A function's program as `reversible_p` binds it."""

    jaxpr: ClosedJaxpr  # consts hoisted to leading inputs
    state: tuple[bool, ...]  # per input: part of the state (rebuilt) or a parameter
    operands: list[Any]  # the values bound: hoisted consts, then the flat arguments
    out_tree: Any  # the output's tree definition


# traces kept for eager calls; a trace holding more than _MAX_CONST_BYTES of constants is not
# kept (a loop whose function closes over new weights every step would pin each step's)
_TRACES = 64
_MAX_CONST_BYTES = 1 << 22


def _fingerprint(fun: Callable, closed: ClosedJaxpr, state: tuple, out_tree: Any) -> tuple | None:
    """What makes two traces of `fun` the same program: its text and its constants' values
    (so a closure or attribute that changed, even in place, gives a new program), with the
    function (whose source lines the equations carry); None where a constant is too large
    to compare cheaply."""
    digest = hashlib.sha1()
    held = sum(getattr(c, "nbytes", 0) or np.asarray(c).nbytes for c in closed.consts)
    if held > _MAX_CONST_BYTES:
        return None
    for const in closed.consts:
        # numpy cannot hold a PRNG key: its bits identify it, its dtype the implementation
        bits = np.asarray(jax.random.key_data(const) if is_key(const) else const)
        digest.update(str((bits.shape, getattr(const, "dtype", bits.dtype))).encode())
        digest.update(np.ascontiguousarray(bits).tobytes())
    return (
        fun,
        str(closed.jaxpr),
        tuple(v.aval for v in closed.jaxpr.invars),
        digest.hexdigest(),
        state,
        out_tree,
    )


def bind_reversible(fun: Callable, args: Sequence[Any], argnums: int | Sequence[int]) -> Bound:
    """Trace `fun` for `reversible_p`: its jaxpr, which inputs are state, the operands.

    Eager calls (an eager `grad` or `vmap` included) are cached: a call whose key
    (`_cache.call_key`: the function and what it reads, the arguments' avals and static
    leaves) was seen reuses that trace without tracing again; a trace that gives the same
    program as an earlier one (same function, text and constants) reuses that one's jaxpr.
    Either way what is keyed on the jaxpr (plans, compiled calls) is reused."""
    nums = normalize_argnums(argnums, len(args), fun)
    eager_call = is_eager(args)
    ck = call_key(fun, tuple(args)) if eager_call else None  # (key, what it holds)
    if ck is not None:
        hit = memo("reversible.calls", _TRACES).get((nums, ck[0]))
        if hit is not None:
            flat = Filtered(tuple(args)).flat
            return Bound(
                hit.jaxpr,
                hit.state,
                [x if isinstance(x, jax.Array) else jnp.asarray(x) for x in flat],
                hit.out_tree,
            )
    prog = trace_program(fun, args, nums)
    out_tree = jax.tree_util.tree_structure(prog.out_shape)
    try:
        check_structure(fun, args, nums, prog.out_shape, who="jaxrev.reversible")
    except ValueError:  # a bijection that changes structure keeps the element counts
        check_sizes(
            fun,
            [prog.flat[i] for i in prog.state_pos],
            jax.tree_util.tree_leaves(prog.out_shape),
            who="jaxrev.reversible",
        )
    state_pos = set(prog.state_pos)
    closed, consts = hoist_consts(prog.closed)
    state = (False,) * len(consts) + tuple(i in state_pos for i in range(len(prog.flat)))
    operands = [*consts, *[jnp.asarray(x) for x in prog.flat]]
    # a staged call (under jit) is traced once anyway, and hashing its constants' bytes
    # would be work on every trace for nothing
    key = _fingerprint(fun, closed, state, out_tree) if eager_call and not consts else None
    if key is not None:
        traces = memo("reversible.traces", _TRACES)
        closed = traces.get(key) or traces.put(key, [], closed)
        if ck is not None:
            memo("reversible.calls", _TRACES).put(
                (nums, ck[0]), ck[1], Bound(closed, state, [], out_tree)
            )
    return Bound(closed, state, operands, out_tree)


def rebuild(
    fun: Callable, args: Sequence[Any], argnums: int | Sequence[int], dial: Dial
) -> tuple[list[Any], list[tuple[str, float]]]:
    """Run `reversible(fun)`'s forward run and its backward walk, without cotangents: the
    state's leaves as the backward run rebuilds them, and each comparison the dial makes
    (a checkpointed loop's worst segment, the rebuilt inputs) with its measured drift. Eager
    (for `check_reversible`)."""
    bound = bind_reversible(fun, args, argnums)
    plan = top_plan(bound.jaxpr, bound.state, dial)
    outs, res = forward_with_residuals(plan, bound.operands)
    params = [x for x, s in zip(bound.operands, bound.state) if not s]
    env = _top_env(plan, bound.state, params, outs)
    sites: list[tuple[str, float]] = []
    log = drift.log_for(dial, dial.name)
    env.ctx = env.ctx.replace(drift=log, rebuilds=True)
    walk(plan, env, None, set(), Residuals(plan, res), [])
    if log is not None:
        for ratio, index in log.scopes[0]:
            if int(index) < 0:  # a loop with no comparison inside
                continue
            site = log.sites[int(index)]
            where = f" at {site.where}" if site.where else ""
            sites.append((f"{site.what}{where}", float(ratio) * site.tol))
    invars = plan.closed.jaxpr.invars
    return [env.read(v) for v, s in zip(invars, bound.state) if s], sites


def reversible(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    checkpoint_every: int | str | None = "auto",
    memory_budget: int | None = None,
    on_drift: str = "repair",
    drift_rtol: float | None = None,
    max_steps: int | None = None,
    on_error: str = "raise",
    report: Callable[[RepairReport], Any] | None = None,
    exact: bool | Exact = False,
) -> Callable:
    """`fun` with a reverse-mode derivative that rebuilds intermediates by running backwards.

    Gradients with respect to every argument (state and parameters) rebuild each step's inputs
    from its outputs instead of storing them, so memory grows with a loop's length only through
    its checkpoints (about 2√T carries per loop by default, none in the fully reversible mode,
    `checkpoint_every=None`); steps that lose information store just what they lose (see
    `memory_report`). Composes with `jit`, `vmap`, `grad`, `jvp` and `hessian`.

    Drift is repaired by default (docs/design.md §3.8): a top-level loop's carry is stored every
    ⌈√T⌉ of its T iterations, the backward run rebuilds each segment from the next one's stored
    start, and a segment whose rebuilt start misses its checkpoint (or whose cotangents come
    back non-finite) is recomputed forward from it, at the cost of one more forward run of that
    segment and its K carries; the rebuilt inputs of the call are compared with the true ones.

    **Arguments:**

    - `fun`: the function. `fun(*args)` returns the structure, shapes and dtypes of the state
      `args[argnums]` (as for `reverse`), or, for a bijection that changes structure or shapes,
      as many elements of each dtype.
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments; the
      others are parameters (gradients are taken with respect to them too).
    - `checkpoint_every`: "auto" (the default: ⌈√T⌉, or a length within a quarter of it that
      divides T, or as `memory_budget` allows; none under `on_drift="ignore"`), K (a
      checkpoint every K iterations; 1 is plain storage) or None (fully reversible: no
      checkpoints).
    - `memory_budget`: bytes of checkpoints each loop may keep (picks K per loop).
    - `on_drift`: what a miss does. A segment misses where its drift moves the gradient more
      than the forward run's own rounding does (the cotangents measure it), the call's inputs
      where they miss by more than √eps of their dtype. "repair" (the default; a miss that no
      checkpoint can repair raises), "raise" (a `jr.DriftError` naming the loop and the
      measured drift; under `jit` when the program runs, `jr.jit` turns it into that type),
      "warn" (a `jr.DriftWarning`), "nan" (the gradient is NaN), "ignore" (no check, and no
      checkpoints unless asked: the fully reversible mode).
    - `drift_rtol`: a relative tolerance for both checks instead of the default measures.
    - `max_steps`: a bound on every `while_loop`'s trip count, which lets `reversible`
      checkpoint it, or store a body that loses information once per iteration.
    - `on_error`: what a failure inside a rebuilt value does (a group solved by Newton's method
      that misses its tolerance, a state-dependent choice with no consistent branch), as for
      `reverse`: "raise" (the default), "nan" or "warn" (NaN and a `jr.FailureWarning`).
    - `report`: a callable handed a `jr.RepairReport` each time the backward run runs
      (eagerly, or when the compiled program runs): per checkpointed loop, its segments,
      how many were repaired and the iterations recomputed, so that what the default cost
      is visible. None (the default) stages nothing.
    - `exact`: True or a `jr.Exact` (settings): exact reversal (docs/design.md §3.8). Each
      top-level `scan` / `fori_loop` runs its float carries in fixed point, updates them
      exactly (additions of anything the body computes; multiplications by factors, whose
      lost bits go to a small information buffer) and is undone bit for bit, so a loop that
      drifts when run backwards (SGD with momentum) needs no checkpoints and no repair. The
      values are those of the fixed-point run (within its resolution, about float64's for
      carries within [-1, 1], of `fun`'s); reverse mode only (`grad`, `vjp`, under `jit` and
      `vmap`); code outside the loops is differentiated by JAX, which stores what it needs
      there (`memory_report(..., exact=True)` lists it; a function with no loop warns once,
      `PerformanceWarning`). Bodies that update a carry otherwise are refused, naming the
      primitive and line. The other settings but `on_error` do not apply.

    **Returns:**

    A function with `fun`'s signature and values, whose reverse-mode derivatives run `fun`
    backwards.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> def step(xy, th):
        ...     x, y = xy
        ...     x = x + jnp.tanh(th * y)
        ...     return x, y + jnp.sin(x)
        >>> loop = lambda xy, th: jax.lax.fori_loop(0, 100, lambda i, s: step(s, th), xy)
        >>> f = jr.reversible(loop)
        >>> g = jax.grad(lambda th: f((jnp.ones(3), jnp.zeros(3)), th)[1].sum())(0.5)
        >>> bool(jnp.isfinite(g))
        True
    """
    if exact is not False:
        if checkpoint_every != "auto" or memory_budget is not None or report is not None:
            raise ValueError(
                "jaxrev.reversible(exact=...) keeps no checkpoints and repairs nothing: "
                "checkpoint_every, memory_budget and report do not apply"
            )
        spec = exact if isinstance(exact, Exact) else Exact()
        return _exact_reversible(
            fun, argnums, spec, resolve_on_error("jaxrev.reversible", on_error)
        )
    dial = Dial(
        checkpoint_every,
        memory_budget,
        on_drift,
        drift_rtol,
        max_steps,
        getattr(fun, "__name__", "fun"),
        Settings("jaxrev.reversible", resolve_on_error("jaxrev.reversible", on_error)),
        report,
    )
    return reversible_with(fun, argnums, dial)


def _exact_reversible(
    fun: Callable, argnums: int | Sequence[int], spec: Exact, on_error: str
) -> Callable:
    """`reversible(fun, exact=spec)`: `fun` traced, its loops run by exact reversal."""

    @wraps(fun)
    def wrapped(*args: Any) -> Any:
        nums = normalize_argnums(argnums, len(args), fun)
        prog = trace_program(fun, args, nums)
        closed, lifted = hoist_consts(prog.closed)
        if not has_loops(closed):
            _warn_no_loops(fun)
        outs = run_exact(closed, [*lifted, *prog.flat], spec, on_error)
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(prog.out_shape), outs)

    wrapped.__name__ = f"reversible({getattr(fun, '__name__', 'fun')}, exact=True)"
    return wrapped


def _warn_no_loops(fun: Callable) -> None:
    """Exact reversal runs loops; a function without one is differentiated by JAX as it is
    (right, at `jax.grad`'s memory): said once per function."""
    name = getattr(fun, "__name__", "fun")
    key = (name, getattr(fun, "__code__", None))
    warned = memo("exact.no_loops_warned")
    if warned.get(key):
        return
    warned.put(key, [], True)
    warnings.warn(
        f"jaxrev.reversible({name}, exact=True): {name} has no loop at its top level "
        "(`lax.scan`, `fori_loop` with static bounds; also inside `jit`). Exact reversal runs "
        "loops, so JAX's reverse mode differentiates it as `jax.grad` does, storing its "
        "intermediates (`jr.memory_report(..., exact=True)` lists them). Ways out: write the "
        "repeated blocks as a `lax.scan` over their stacked parameters "
        "(examples/reversible_transformer.py), or `jr.reversible` without `exact`, which "
        "runs straight code backwards too.",
        PerformanceWarning,
        stacklevel=3,
    )


def reversible_with(fun: Callable, argnums: int | Sequence[int], dial: Dial) -> Callable:
    """`reversible(fun)` under a dial of the caller's (the settings of its walks among them:
    `inverse_vjp` runs its walks in its own name and without Newton's method)."""

    @wraps(fun)
    def wrapped(*args: Any) -> Any:
        bound = bind_reversible(fun, args, argnums)
        outs = reversible_p.bind(*bound.operands, jaxpr=bound.jaxpr, state=bound.state, dial=dial)
        return jax.tree_util.tree_unflatten(bound.out_tree, outs)

    wrapped.__name__ = f"reversible({getattr(fun, '__name__', 'fun')})"
    return wrapped
