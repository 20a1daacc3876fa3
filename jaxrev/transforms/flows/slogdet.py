"""Log-determinants for normalizing flows: `slogdet_jacobian`, `forward_and_slogdet`,
`inverse_and_slogdet`, `register_logdet` (docs/design.md §1 flows, §3.7).

Each runs the program once (forward, or backwards by `reverse`'s walker) and sums the
log-determinants of the steps the inversion is made of (`logdet`): a coupling layer costs about
one pass, not n JVPs and an LU. Where the record of the inversion cannot give the
log-determinant (a step with no structure and no rule, a permutation whose sign cannot be
followed when the sign is asked for), the "dense" strategy materialises J; `logdet_strategy`
says which strategy a function gets and why.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxrev._dense as dense
from jaxrev._cache import cached_call, memo
from jaxrev._compat import Primitive, is_concrete, staged_constants, user_source
from jaxrev._env import Env, Unknown
from jaxrev._errors import (
    JaxrevError,
    NotInvertibleError,
    PerformanceWarning,
    SingularJacobianError,
    at_eqn,
    fail,
    no_result_for_dtype,
    singular_jacobian,
)
from jaxrev._evaluate import eval_closed, evaluate
from jaxrev._graph import first_eqn
from jaxrev._prepare import fold_constants, prepare, without_custom_vjp
from jaxrev._program import (
    Filtered,
    check_sizes,
    fun_name,
    normalize_argnums,
    trace_on_outputs,
    trace_program,
    traced_leaves,
)
from jaxrev.transforms.knowledge import records
from jaxrev.transforms.knowledge.checks import check_at_run_time
from jaxrev.transforms.knowledge.context import Settings, WalkContext, resolve_on_error
from jaxrev.transforms.logdet import (
    LogdetContext,
    env_reader,
    evaluate_plan,
    plan,
    run_forward,
)
from jaxrev.transforms.propagation.walker import propagate, raise_stuck, seed
from jaxrev.transforms.registry import Unsupported, check_rule, define
from jaxrev.transforms.reverse import reverse_with, state_args

__all__ = [
    "slogdet_jacobian",
    "forward_and_slogdet",
    "inverse_and_slogdet",
    "register_logdet",
    "logdet_strategy",
    "METHODS",
]

METHODS = ("auto", "sweep", "dense")


@dataclass
class _Traced:
    """A function traced over its flat arguments, prepared for walking."""

    closed: Any  # the prepared closed jaxpr (custom_vjp calls: their primal computation)
    raw: Any  # the jaxpr as traced (custom_vjp calls kept)
    flat: list  # flat argument values
    state_pos: list[int]
    out_tree: Any
    state_tree: Any
    dtype: Any
    who: str  # the transform, for its walks' errors
    call: Any = None  # (fun, Filtered args): the user's function, for the dense Jacobian


def _trace(
    fun: Callable, args: Sequence[Any], argnums: tuple[int, ...], who: str, on_outputs: bool = False
) -> _Traced:
    """`fun` traced and prepared (`on_outputs`: on its outputs in the state positions, to
    learn the state's structure: `trace_on_outputs`)."""
    prog = (
        trace_on_outputs(fun, args, argnums, who)
        if on_outputs
        else trace_program(fun, args, argnums)
    )
    closed = prepare(without_custom_vjp(prog.closed))
    state = [prog.flat[i] for i in prog.state_pos]
    outs = jax.tree_util.tree_leaves(prog.out_shape)
    check_sizes(fun, state, outs, who=who)
    for k, x in enumerate(state):
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise no_result_for_dtype(
                who,
                f"state leaf {k} of {fun_name(fun)}",
                jnp.result_type(x),
                "log-determinants are taken of maps of real floating-point states (an "
                "integer or boolean state has no Jacobian; for a complex state pass its real "
                "and imaginary parts as one real array)",
            )
    st = args[argnums[0]] if len(argnums) == 1 else tuple(args[a] for a in argnums)
    dtype = jnp.result_type(*state) if state else jnp.float32
    return _Traced(
        closed,
        prog.closed,
        list(prog.flat),
        prog.state_pos,
        jax.tree_util.tree_structure(prog.out_shape),
        jax.tree_util.tree_structure(st),
        dtype,
        who,
        (fun, Filtered(tuple(args))),
    )


def _user_state_fun(t: _Traced) -> Callable:
    """The user's function of the state's flat leaves, the parameters held at their values."""
    fun, split = t.call

    def of_state(*leaves: Any) -> list:
        flat = list(t.flat)
        for i, x in zip(t.state_pos, leaves):
            flat[i] = x
        return jax.tree_util.tree_leaves(fun(*split.rebuild(flat)))

    return of_state


def _differentiable(t: _Traced) -> Any:
    """The program as forward mode differentiates it: `custom_vjp` calls replaced by their
    primal computation, `custom_jvp` calls kept, so their rules give the derivative (flowjax's
    numerical inverse: a bisection whose own derivative is zero, differentiated implicitly)."""
    return without_custom_vjp(t.raw)


def _state_fun(t: _Traced, closed: Any = None) -> tuple[Callable, list]:
    """The traced program (`t.closed` unless `closed` is given) as a function of its state's
    flat leaves, the parameters held at their values; and the state's leaves."""
    closed = t.closed if closed is None else closed

    def of_state(*leaves: Any) -> list:
        flat = list(t.flat)
        for i, x in zip(t.state_pos, leaves):
            flat[i] = x
        return eval_closed(closed, *flat)

    return of_state, [t.flat[i] for i in t.state_pos]


def _walk(
    t: _Traced,
    ys: Sequence[Any],
    on_error: str = "raise",
    logdets: bool = False,
    values: bool = True,
) -> tuple[records.Recorder, Env]:
    """Recover the state from the outputs `ys`, recording every step (in a walk context of
    the transform's own: its name and `on_error`). With `logdets`, a loop's inverse rule takes
    the loop's log-det in the inverse loop itself (`Recorder.logdets`), so that it is not run
    forward again for it. Without `values`, a planning walk (`Settings.values`)."""
    jaxpr = t.closed.jaxpr
    ins = list(t.flat)
    for i in t.state_pos:
        ins[i] = Unknown(jaxpr.invars[i].aval)
    # (what it emits only runs: nothing walks it again)
    ctx = WalkContext(Settings(t.who, on_error, reinverted=False, values=values))
    jaxpr, env, _ = seed(t.closed, ins, ys, prepared=True, ctx=ctx)
    goals = [jaxpr.invars[i] for i in t.state_pos]
    rec = records.Recorder(env, jaxpr, None, range(len(jaxpr.outvars)), t.state_pos)
    if logdets:
        rec.logdets = {}
    ctx.recorder = rec
    stuck = propagate(jaxpr, env, goals)
    if any(not env.known(g) for g in goals):
        raise_stuck(stuck, "", t.who)
    return rec, env


def _plan_abstract(t: _Traced):
    """The plan of the inversion, from a walk on stand-ins (no run-time cost)."""
    box: list = []
    out_avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in t.closed.jaxpr.outvars]

    def go(ys):
        # values computed from constants alone (indices, masks) stay concrete, as in the
        # inverse transforms: lumps see their structure on them
        # (only the steps are read: the solves write stand-ins, `Settings.values`)
        with jax.ensure_compile_time_eval():
            box.append(_walk(t, ys, values=False)[0])
        return 0

    jax.eval_shape(go, out_avals)
    rec = box[0]
    return plan(rec, rec.seeded, rec.goals)


def _forward(t: _Traced, pl: Any = None) -> tuple[list, Env, dict]:
    """The program run forward on its arguments: its outputs, the env of its values, and the
    log-dets of `pl`'s rule steps taken on the way (by their equation's id). A loop whose
    log-det rule runs it forward anyway (`LogdetResult.outs`) is run once, by that rule, not
    once for its outputs and again for its log-det (the library flows: a `Scan` of layers)."""
    jaxpr = t.closed.jaxpr
    env = Env()
    for v, c in zip(jaxpr.constvars, t.closed.consts):
        env.write(v, c)
    for v, x in zip(jaxpr.invars, t.flat):
        env.write(v, x)
    if pl is None:
        evaluate(jaxpr.eqns, env)
        done: dict = {}
    else:
        done = run_forward(pl, jaxpr.eqns, env)
    return [env.read(v) for v in jaxpr.outvars], env, done


# what JAX raises where forward mode cannot pass a primitive (a callback has no JVP rule)
_NO_FORWARD_MODE = (TypeError, NotImplementedError, ValueError)


@dataclass
class _Swept:
    """What a sweep gave: the outputs (None from the linearized sweep), the sign (None where
    the sweep does not follow it, `unsigned` saying why), log|det|, the per-step log-dets
    (`evaluate_plan`'s `per_step`) and the strategy."""

    ys: list | None
    sign: Any
    logabs: Any
    steps: list
    how: str
    unsigned: str | None


def _sweep_forward(t: _Traced, how: str) -> _Swept:
    pl = _plan_abstract(t)
    ys, env, done = _forward(t, pl)
    env.info = pl.info
    steps: list = []
    sign, logabs = evaluate_plan(pl, env.read, t.dtype, per_step=steps, done=done)
    return _Swept(ys, None if pl.perm_sign is None else sign, logabs, steps, how, pl.unsigned)


def _linearized(t: _Traced) -> _Swept:
    """The sweep over `t`'s tangent program at its values ("sweep (linearized)": a program
    that `reverse` cannot invert, such as a triangular nonlinear recurrence, may have an
    invertible Jacobian whose steps the walker inverts). The partials are its constants;
    custom_vjp calls are linearized through their primal computation, as the sweep sees
    them."""
    of_state, state = _state_fun(t, _differentiable(t))
    try:
        # values computed from constants alone (a scatter's indices) stay concrete under jit
        with fold_constants(t.closed.jaxpr):
            _, lin = jax.linearize(of_state, *state)
    except _NO_FORWARD_MODE as e:
        raise Unsupported(f"forward mode cannot differentiate the program: {e}") from None
    zeros = [jnp.zeros_like(x) for x in state]
    sw = _sweep_forward(_trace(lin, zeros, tuple(range(len(zeros))), t.who), "sweep (linearized)")
    sw.ys = None
    return sw


def _sweep(t: _Traced) -> _Swept:
    """log|det| (and the sign, where it is followed) from the sweep that inverts the program
    ("sweep"), else from the sweep that inverts its tangent program ("sweep (linearized)").
    Raises `Unsupported` or `NotInvertibleError` where neither applies (a singular step found
    at trace time: its `NotInvertibleError`, at once)."""
    try:
        return _sweep_forward(t, "sweep")
    except (Unsupported, NotInvertibleError) as e:
        if isinstance(e, NotInvertibleError) and e.singular:
            raise
        first = e
    try:
        return _linearized(t)
    except (Unsupported, NotInvertibleError) as e:
        if isinstance(e, NotInvertibleError) and e.singular:
            raise
        raise first from None


def _sign_elsewhere(t: _Traced, sw: _Swept, dense_fallback: bool = True) -> tuple[Any, str]:
    """The sign of det J where the sweep `sw` gives log|det| only (a permutation decided at
    run time, a `deflogdet` rule with no sign): from the linearized sweep where it follows
    it, else from the dense Jacobian (None without `dense_fallback`). log|det| stays the sweep's, so
    the user's rules hold; only the sign is the true Jacobian's."""
    if sw.how == "sweep":
        try:
            lin = _linearized(t)
            if lin.sign is not None:
                return lin.sign, "the linearized sweep"
        except (Unsupported, NotInvertibleError):
            pass  # (a singular tangent step: the dense Jacobian's sign is then 0)
    if not dense_fallback:
        return None, "the dense Jacobian"
    return _dense(t, f"its sign only: {sw.unsigned}")[0], "the dense Jacobian"


_ASKED = "method='dense' was asked for"

DENSE_WARN_SIZE = 64
"""State size from which taking the dense Jacobian (n forward passes and an n x n LU, against
the sweep's one or two passes) warns (`PerformanceWarning`), once per function, size and
reason (`memo("slogdet.dense_warned")`)."""


def _warn_dense(t: _Traced, why: str) -> None:
    n = sum(int(np.size(t.flat[i])) for i in t.state_pos)
    name = fun_name(t.call[0]) if t.call is not None else "the function"
    key = (t.who, name, n, why)
    warned = memo("slogdet.dense_warned")
    if n < DENSE_WARN_SIZE or warned.get(key):
        return
    warned.put(key, [], True)
    warnings.warn(
        f"{t.who}: the log-determinant of {name} is taken from its dense Jacobian of {n} "
        f"unknowns ({n} forward passes and an {n} x {n} LU per call, about {max(n // 2, 1)}x "
        f"the inversion sweep's cost): {why}. `jr.logdet_strategy` says the same; "
        "method='sweep' makes it an error.",
        PerformanceWarning,
        stacklevel=4,
    )


def _dense(t: _Traced, why: str = _ASKED) -> tuple[Any, Any]:
    """slogdet of the Jacobian of the flattened output with respect to the flattened state:
    the last resort (warned of past `DENSE_WARN_SIZE` unknowns, unless asked for: `why`).
    Forward mode through the primal computation of custom_vjp calls (the sweep's view of them)
    and the rules of custom_jvp calls; reverse mode through the user's VJP rules where forward
    mode is not available (a callback with no JVP rule)."""
    if why != _ASKED:
        _warn_dense(t, why)
    state = [t.flat[i] for i in t.state_pos]

    def flat(g: Callable) -> Callable:
        def f(vec):
            parts, k = [], 0
            for x in state:
                n = int(np.size(x))
                parts.append(jnp.reshape(vec[k : k + n], jnp.shape(x)).astype(jnp.result_type(x)))
                k += n
            return jnp.concatenate([jnp.ravel(o) for o in g(*parts)])

        return f

    x0 = jnp.concatenate([jnp.ravel(x) for x in state])
    with staged_constants():  # the n x n identity basis must not become a constant
        try:
            # the user's function itself first: its custom_jvp rules as JAX applies them (JAX
            # 0.12 re-binding flowjax's implicit JVP from a jaxpr gives a zero Jacobian)
            J = jax.jacfwd(flat(_user_state_fun(t)))(x0)
        except _NO_FORWARD_MODE:
            J = None
        try:
            if J is None:
                J = jax.jacfwd(flat(_state_fun(t, _differentiable(t))[0]))(x0)
        except _NO_FORWARD_MODE as e:  # (JAX's UnexpectedTracerError is a TypeError)
            # (where reverse mode fails too, its error says why, with forward mode's as cause)
            try:
                J = jax.jacrev(flat(_state_fun(t, t.raw)[0]))(x0)
            except _LEAK as e2:
                raise _not_differentiable(t, why) from e2
            except Exception as e2:
                raise e2 from e
        return dense.slogdet(J)


_LEAK = jax.errors.UnexpectedTracerError


def _not_differentiable(t: _Traced, why: str) -> JaxrevError:
    """The dense Jacobian's error where JAX cannot differentiate the program either (`jax.grad`
    and `jax.jacfwd` of the user's function fail the same way): a custom_jvp rule that closes
    over a value traced inside a loop (an iteration's index) leaks it when re-traced. Not a
    `NotInvertibleError`: the program inverts; its derivative is what no one can take."""
    # the rule inside a loop's body first (where an iteration's value can leak), then any
    is_rule = lambda p: p.name == "custom_jvp_call"  # noqa: E731
    in_loops = [
        first_eqn(b.jaxpr if hasattr(b, "jaxpr") else b, is_rule)
        for e in t.raw.jaxpr.eqns
        if e.primitive.name in ("scan", "while")
        for p in e.params.values()
        for b in (p if isinstance(p, (tuple, list)) else (p,))
        if hasattr(b, "eqns") or hasattr(getattr(b, "jaxpr", None), "eqns")
    ]
    rule = next((r for r in in_loops if r is not None), None) or first_eqn(t.raw.jaxpr, is_rule)
    where = "" if rule is None else f" at `{rule.primitive.name}` at {user_source(rule)[2]}"
    return JaxrevError(
        f"{t.who}: the log-determinant needs the dense Jacobian ({why}), and JAX cannot "
        f"differentiate the program{where}.\nJAX's own jax.grad and jax.jacfwd of it fail the "
        "same way: a custom_jvp function that closes over a value traced inside a loop (pass "
        "that value as an argument instead)."
    )


def _singular_check(
    logabs: Any,
    who: str,
    on_error: str,
    per_step: Sequence[tuple[Any, Any, bool]] = (),
    at_run_time: bool = True,
    dense: str | None = None,
) -> Any:
    """A vanished pivot gives log|det| = -inf: with "raise", an error naming the step, eagerly
    at once, and (`at_run_time`) under jit when the program runs ("warn": a warning).
    `dense`: why the dense Jacobian was taken (no step to name)."""
    if on_error == "nan":
        return logabs

    def error(bad: Any) -> SingularJacobianError:
        hit = [(e, group) for (e, _, group), b in zip(per_step, bad) if b]
        if hit:
            e, group = hit[0]
            return at_eqn(
                SingularJacobianError,
                e,
                "the Jacobian is singular (a pivot vanished)",
                "Pass on_error='nan' to get -inf instead.",
                who=who,
                group=group,
            )
        if dense is not None:
            return SingularJacobianError(
                f"{who}: the Jacobian is singular (its dense Jacobian, taken because "
                f"{dense}, has determinant 0): no single step can be named without a "
                "step-by-step inversion; pass on_error='nan' to get -inf instead"
            )
        return SingularJacobianError(
            f"{who}: the Jacobian is singular (log|det| = -inf) and no single step could be "
            "named; pass on_error='nan' to get -inf instead"
        )

    flags = [jnp.isneginf(la) for _, la, _ in per_step]
    if is_concrete(logabs) and all(is_concrete(f) for f in flags):
        if bool(jnp.any(jnp.isneginf(logabs))):
            fail(on_error, error([bool(f) for f in flags]))
        return logabs
    if not at_run_time:
        return logabs
    # one host call per batch under vmap, none when no pivot vanished
    check_at_run_time(
        lambda bad: fail(on_error, error([bool(b) for b in np.atleast_1d(bad)])),
        jnp.stack(flags) if flags else jnp.zeros(0, bool),
        bad=jnp.isneginf(logabs),
    )
    return logabs


def _try_sweep(
    run: Callable[[], Any],
    method: str,
    on_error: str,
    who: str,
    dense_if_not_invertible: bool = True,
) -> tuple[Any, str]:
    """`run()`, the sweep, and ""; or None and why, where "auto" falls back to the dense
    Jacobian (a step the sweep cannot describe; a program it cannot invert, when the caller
    can do without its inverse). A vanished pivot found while inverting raises, naming the
    step."""
    try:
        return run(), ""
    except Unsupported as e:
        if method == "sweep":
            raise NotInvertibleError(
                f"{who}: the inversion sweep cannot give the log-determinant: {e}"
            ) from None
        return None, f"the sweep cannot give the log-determinant ({e})"
    except NotInvertibleError as e:
        if e.singular and on_error == "raise":
            raise singular_jacobian(e, who) from None
        if method == "sweep" or not (e.singular or dense_if_not_invertible):
            raise
        return None, str(e).splitlines()[0]


def _nan_where_nan(logdet: Any, *points: Any) -> Any:
    """`logdet` made NaN where a point's float leaves hold a NaN: a log-determinant at a NaN
    point is NaN, as `jnp.linalg.slogdet` of the Jacobian there is, also for a map (an affine
    one) whose pivots do not read the point."""
    nan = jnp.zeros((), bool)
    for leaf in jax.tree_util.tree_leaves(points):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            nan = nan | jnp.any(jnp.isnan(leaf))
    return jnp.where(nan, jnp.nan, logdet).astype(jnp.result_type(logdet))


def _check_method(method: str, who: str) -> None:
    if method not in METHODS:
        raise ValueError(f"{who}: method must be one of {METHODS}, got {method!r}")


def slogdet_jacobian(
    fun: Callable,
    *primals: Any,
    argnums: int | Sequence[int] = 0,
    method: str = "auto",
    on_error: str | None = None,
) -> tuple[Any, Any]:
    """``(sign, log|det J|)`` of `fun`'s Jacobian with respect to the arguments at `argnums` (the
    state), the others held fixed.

    The log-determinant is summed over the steps that invert `fun` (pivots of elementwise steps,
    lumps, loop iterations; permutations give the sign). `method="dense"` materialises J
    instead, and "auto" does so only where the sweep cannot describe a step (`logdet_strategy`
    says which).

    **Arguments:**

    - `fun`: the function; it maps the state to as many numbers.
    - `*primals`: `fun`'s positional arguments, where J is taken.
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments.
    - `method`: "auto" (the default), "sweep" or "dense".
    - `on_error`: what a singular Jacobian does on concrete values: "raise" (the default, a
      `SingularJacobianError` naming the step whose pivot vanished), "nan" (the exact answer,
      sign 0 and -inf, without an error) or "warn" (that answer and a `jr.FailureWarning`).
      Under `jit` the exact answer comes back (as from `jnp.linalg.slogdet`; no host check is
      compiled in).

    **Returns:**

    ``(sign, logabsdet)``, two scalars: the sign of det J (0 when singular) and log|det J|.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x, w: jnp.cumsum(x * jnp.exp(w))
        >>> sign, logdet = jr.slogdet_jacobian(f, jnp.ones(3), jnp.array([0.5, 1.0, 1.5]))
        >>> float(sign), round(float(logdet), 6)
        (1.0, 3.0)
    """
    who = "jaxrev.slogdet_jacobian"
    on_error = resolve_on_error(who, on_error)
    _check_method(method, who)
    nums = normalize_argnums(argnums, len(primals), fun)

    def impl(*primals: Any) -> tuple[Any, Any]:
        sign, logabs = _slogdet_jacobian(fun, primals, nums, method, on_error, who)
        state = [primals[a] for a in nums]
        return _nan_where_nan(sign, state), _nan_where_nan(logabs, state)

    # an eager call runs compiled, keyed like jax.jit's (`_cache`)
    return cached_call((who, nums, method, on_error), fun, impl, primals)


def _hashable(argnums: int | Sequence[int]) -> int | tuple[int, ...]:
    return argnums if isinstance(argnums, int) else tuple(argnums)


def _slogdet_jacobian(
    fun: Callable,
    primals: Sequence[Any],
    nums: tuple[int, ...],
    method: str,
    on_error: str,
    who: str,
) -> tuple[Any, Any]:
    t = _trace(fun, primals, nums, who)
    why = _ASKED
    if method != "dense":

        def run():
            sw = _sweep(t)
            logabs = _singular_check(sw.logabs, who, on_error, sw.steps, at_run_time=False)
            if sw.sign is not None:
                return sw.sign, logabs
            # log|det| stays the sweep's (a deflogdet rule's, where one is given)
            sign = _sign_elsewhere(t, sw)[0]
            return jnp.where(jnp.isneginf(logabs), 0, sign).astype(sign.dtype), logabs

        got, why = _try_sweep(run, method, on_error, who)
        if got is not None:
            return got
    sign, logabs = _dense(t, why)
    return sign, _singular_check(logabs, who, on_error, at_run_time=False, dense=why)


def logdet_strategy(fun: Callable, *primals: Any, argnums: int | Sequence[int] = 0) -> str:
    """Which strategy `slogdet_jacobian` (and the flow transforms) use for `fun` at `primals`,
    and why.

    **Arguments:**

    - `fun`: the function, as for `slogdet_jacobian`.
    - `*primals`: its positional arguments.
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments.

    **Returns:**

    A string: "sweep", "sweep (linearized)" (the sweep over its tangent program), either with
    "(log|det| only: <why>; the sign from <where>)" where the sweep does not follow the sign,
    or "dense: <the step the sweep cannot describe>".

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> jr.logdet_strategy(lambda x: 2.0 * x, jnp.ones(3))
        'sweep'
    """
    nums = normalize_argnums(argnums, len(primals), fun)
    t = _trace(fun, primals, nums, "jaxrev.logdet_strategy")
    try:
        sw = _sweep(t)
    except (Unsupported, NotInvertibleError) as e:
        return f"dense: {str(e).splitlines()[0]}"
    if sw.sign is not None:
        return sw.how
    _, where = _sign_elsewhere(t, sw, dense_fallback=False)
    return f"{sw.how} (log|det| only: {sw.unsigned}; the sign from {where})"


def _state_value(t: _Traced, leaves: Sequence[Any], nums: tuple[int, ...]) -> Any:
    return jax.tree_util.tree_unflatten(t.state_tree, list(leaves))


def forward_and_slogdet(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    method: str = "auto",
    on_error: str | None = None,
) -> Callable:
    """Transform `fun` into a function returning ``(fun(*args), log|det J|)`` from one forward
    pass (distrax's ``forward_and_log_det``).

    J is the Jacobian of `fun` with respect to the arguments at `argnums`. The log-determinant
    is summed over the steps of `fun`'s inversion sweep, planned when traced and evaluated on
    the forward run's values (see `slogdet_jacobian`).

    **Arguments:**

    - `fun`: the function; it maps the state to as many numbers.
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments.
    - `method`: as for `slogdet_jacobian` ("auto", "sweep", "dense").
    - `on_error`: as for `slogdet_jacobian`: a vanished pivot raises `SingularJacobianError`
      naming the step on concrete values ("raise"), or gives -inf ("nan", "warn" with a
      warning); under `jit` log|det| = -inf, the exact answer, comes back.

    **Returns:**

    A function of `fun`'s arguments returning ``(y, logabsdet)``: `y` is ``fun(*args)`` and
    `logabsdet` the scalar log|det J|.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x, s: x * jnp.exp(s)
        >>> y, logdet = jr.forward_and_slogdet(f)(jnp.ones(2), jnp.array([0.5, 1.0]))
        >>> round(float(logdet), 6)
        1.5
    """
    who = "jaxrev.forward_and_slogdet"
    on_error = resolve_on_error(who, on_error)
    _check_method(method, who)

    def impl(*args: Any) -> tuple[Any, Any]:
        nums = normalize_argnums(argnums, len(args), fun)
        y, logabs = _forward_and_slogdet(fun, args, nums, method, on_error, who)
        return y, _nan_where_nan(logabs, [args[a] for a in nums], y)

    settings = (who, _hashable(argnums), method, on_error)

    @functools.wraps(fun)
    def fwd(*args: Any) -> tuple[Any, Any]:
        # eager calls run compiled, keyed like jax.jit's (`_cache`)
        return cached_call(settings, fun, impl, args)

    return fwd


def _forward_and_slogdet(
    fun: Callable, args: Sequence[Any], nums: tuple[int, ...], method: str, on_error: str, who: str
) -> tuple[Any, Any]:
    t = _trace(fun, args, nums, who)
    why = _ASKED
    if method != "dense":

        def run():
            sw = _sweep(t)
            y = fun(*args) if sw.ys is None else jax.tree_util.tree_unflatten(t.out_tree, sw.ys)
            return y, _singular_check(sw.logabs, who, on_error, sw.steps, at_run_time=False)

        got, why = _try_sweep(run, method, on_error, who)
        if got is not None:
            return got
    _, logabs = _dense(t, why)
    return fun(*args), _singular_check(logabs, who, on_error, at_run_time=False, dense=why)


def inverse_and_slogdet(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    method: str = "auto",
    on_error: str | None = None,
    state: Any = None,
) -> Callable:
    """Transform `fun` into a function returning ``(reverse(fun)(*args), log|det|)`` from one
    backward pass (distrax's ``inverse_and_log_det``).

    The log-determinant is that of the inverse's Jacobian: minus `fun`'s at the recovered state.

    **Arguments:**

    - `fun`: the function to invert (as for `reverse`).
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments.
    - `method`: as for `slogdet_jacobian` ("auto", "sweep", "dense").
    - `on_error`: a vanished pivot (no inverse) raises `SingularJacobianError` naming the step,
      under `jit` when the program runs (a host check, 0.15-0.6 ms a call on CPU) ("raise", the
      default); "nan" drops the check and returns the non-finite values; "warn" warns instead.
    - `state`: for a `fun` that changes structure or shapes (a reshape, an unpacking into a
      dict), the state's structure and shapes, as for `reverse`: the function then takes
      `fun`'s whole output in the first state position.

    **Returns:**

    A function with `fun`'s signature, `fun`'s output in the state positions, returning
    ``(x, logabsdet)``: `x` the recovered state and `logabsdet` the scalar log|det| of the
    inverse's Jacobian.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x, s: x * jnp.exp(s)
        >>> x, logdet = jr.inverse_and_slogdet(f)(jnp.ones(2), jnp.array([0.5, 1.0]))
        >>> round(float(logdet), 6)
        -1.5
    """
    who = "jaxrev.inverse_and_slogdet"
    on_error = resolve_on_error(who, on_error)
    _check_method(method, who)

    def impl(*args: Any) -> tuple[Any, Any]:
        x, logdet = _inverse_and_slogdet(fun, args, argnums, method, on_error, state, who)
        given = [args[a] for a in normalize_argnums(argnums, len(args), fun)]
        # (and at a preimage not found: under on_error="nan" a step that could not be undone
        # leaves NaN in `x`, and the log-det's terms there are not the map's)
        return x, _nan_where_nan(logdet, given, x)

    settings = (who, _hashable(argnums), method, on_error)

    @functools.wraps(fun)
    def inv(*args: Any) -> tuple[Any, Any]:
        # eager calls run compiled, keyed like jax.jit's (`_cache`); `state` is keyed with
        # the function (it may be a pytree of shapes)
        return cached_call(settings, (fun, state), impl, args)

    return inv


def _inverse_and_slogdet(
    fun: Callable,
    args: Sequence[Any],
    argnums: int | Sequence[int],
    method: str,
    on_error: str,
    state: Any,
    who: str,
) -> tuple[Any, Any]:
    if state is None:
        nums = normalize_argnums(argnums, len(args), fun)
        ys_tree = [args[a] for a in nums]
        stand = list(args)  # the state's stand-ins: the output has the state's structure
        for a in nums:
            stand[a] = jax.tree_util.tree_map(
                lambda y: jax.ShapeDtypeStruct(jnp.shape(y), jnp.result_type(y)), args[a]
            )
    else:
        stand, nums, y = state_args(fun, args, argnums, state)
        ys_tree = [y]
    why = _ASKED
    if method != "dense":

        def run():
            t = _trace(fun, stand, nums, who, on_outputs=state is None)
            if state is None:
                t.flat = traced_leaves(tuple(args))
            rec, env = _walk(t, jax.tree_util.tree_leaves(ys_tree), on_error, logdets=True)
            pl = plan(rec, rec.seeded, rec.goals)
            steps: list = []
            _, logabs = evaluate_plan(
                pl, env_reader(env), t.dtype, per_step=steps, done=rec.logdets
            )
            xs = [env.read(rec.jaxpr.invars[i]) for i in t.state_pos]
            return (_state_value(t, xs, nums), -_singular_check(logabs, who, on_error, steps))

        # (a program the walker cannot invert has no inverse to return: that raises)
        got, why = _try_sweep(run, method, on_error, who, dense_if_not_invertible=False)
        if got is not None:
            return got
    try:
        x = reverse_with(fun, Settings(who, on_error), argnums, state=state)(*args)
    except NotInvertibleError as e:
        if not e.singular or on_error == "raise":
            raise
        # a pivot that vanished when the walk was traced: no inverse, the exact answer
        # (log|det| of the inverse's Jacobian = +inf), and under "warn" a warning
        fail(on_error, singular_jacobian(e, who))
        nan = jax.tree_util.tree_map(
            lambda y: jnp.full(jnp.shape(y), jnp.nan, jnp.result_type(y)), ys_tree
        )
        x = nan[0] if len(nums) == 1 else tuple(nan)
        return x, jnp.asarray(jnp.inf, jnp.result_type(*jax.tree_util.tree_leaves(nan)))
    a = list(stand)
    xl = [x] if len(nums) == 1 else list(x)
    for i, s in zip(nums, xl):
        a[i] = s
    _, logabs = _dense(_trace(fun, a, nums, who), why)
    return x, -_singular_check(logabs, who, on_error, dense=why)


def register_logdet(primitive: Primitive, rule: Callable[..., tuple[Any, Any]]) -> None:
    """State the log-determinant of a primitive's steps, for the log-determinant sweep
    (`slogdet_jacobian`, the flow transforms, `Bijector`).

    **Arguments:**

    - `primitive`: the primitive (with an inverse rule, `register_inverse`).
    - `rule`: ``rule(recovered, outs, *invals, **params) -> (sign, log|det|)``. `recovered`
      says which inputs the inverse rule recovers (a tuple of bools, one per input); `outs` the
      equation's outputs and `invals` its inputs; the result is the sign and log|det| of the
      Jacobian of its (floating-point) outputs with respect to those inputs, both flattened in
      order.

    **Returns:**

    None; the rule is registered for every later trace.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double2"); _ = double_p.def_impl(lambda x: 2 * x)
        >>> _ = double_p.def_abstract_eval(lambda a: a)
        >>> jr.register_inverse(double_p, lambda out, x: [out / 2])
        >>> jr.register_logdet(double_p, lambda rec, out, x: (1.0, x.size * jnp.log(2.0)))
        >>> round(float(jr.slogdet_jacobian(double_p.bind, jnp.ones(3))[1]), 6)
        2.079442
    """
    check_rule("register_logdet", primitive, rule)

    def wrapped(ctx: LogdetContext) -> tuple[Any, Any]:
        outs = ctx.outvals if ctx.eqn.primitive.multiple_results else ctx.outvals[0]
        s, la = rule(tuple(ctx.recovered), outs, *ctx.invals, **ctx.eqn.params)
        return jnp.asarray(s), jnp.asarray(la)

    define(primitive, logdet=wrapped)
