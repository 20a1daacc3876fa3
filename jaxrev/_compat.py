"""The only module that touches JAX internals; version shims live here.

jaxrev targets JAX 0.10.2 (Python 3.11) and the newest JAX (Python 3.12). Everything that
differs between them (primitive names, `scan` parameters, where call-like primitives keep their
sub-jaxprs) is resolved here, so the interpreters read one vocabulary.
"""

from __future__ import annotations

import contextlib as _contextlib
import contextvars as _contextvars
import functools
import os as _os
import sys as _sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy  # noqa: F401  (zeros_of)
from jax._src import ad_checkpoint as _ad_checkpoint
from jax._src import ad_util as _ad_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import custom_derivatives as _cd
from jax._src import source_info_util as _siu
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import control_flow as _cf
from jax._src.lax import lax as _lax
from jax._src.lax import slicing as _slicing
from jax._src.lax import special as _special
from jax.extend import core as jex_core

# jaxrev's own frames are library frames: errors must point at the user's line, not ours
_siu.register_exclusion(_os.path.dirname(_os.path.abspath(__file__)) + _os.sep)

JAX_VERSION = tuple(int(p) for p in jax.__version__.split(".")[:3])

Primitive = jex_core.Primitive
Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
JaxprEqn = jex_core.JaxprEqn
Literal = jex_core.Literal
Var = jex_core.Var
DropVar = jex_core.DropVar
Tracer = _core.Tracer

primitive_jvps = _ad.primitive_jvps
primitive_transposes = _ad.primitive_transposes
# a primitive's own linearization, which spares an eager `grad` tracing its JVP rule with
# partial evaluation on every call (absent from JAX versions without the linearize trace)
_linearizations = getattr(_ad, "primitive_linearizations", None)
_fallback_linearize = getattr(_ad, "fallback_linearize_rule", None)


def _structured_residuals() -> bool:
    """Whether linearization rules return structured residuals (JAX >= 0.12: a 5-tuple, and
    the tangent function takes their binders)."""
    import inspect

    try:
        return "structured_res" in inspect.getsource(_ad.LinearizeTrace.process_primitive)
    except (OSError, TypeError, AttributeError):
        return False


def register_linearization(
    prim: Primitive, rule: Callable, fallback_when: Callable | None = None
) -> None:
    """Give `prim` its own linearization: ``rule(nonzeros, *primals, **params)`` returns
    ``(primals_out, nonzeros_out, residuals, tangent_fun)`` with ``tangent_fun(residuals,
    *tangents)``; where ``fallback_when(**params)`` holds, JAX's (its JVP rule traced with
    partial evaluation) is used. A no-op on a JAX without linearization rules."""
    if _linearizations is None:
        return
    structured = _structured_residuals()

    def lin(is_vjp, nonzeros, *primals, **params):
        if fallback_when is not None and fallback_when(**params):
            return _fallback_linearize(prim, is_vjp, nonzeros, *primals, **params)
        outs, nzs, res, fn = rule(nonzeros, *primals, **params)
        if structured:
            return outs, nzs, res, None, lambda r, _s, *t: fn(r, *t)
        return outs, nzs, res, fn

    _linearizations[prim] = lin


primitive_batchers = _batching.primitive_batchers


def registered_rules(prim: Primitive) -> frozenset[str]:
    """Which JAX rules `prim` has, read from JAX's own tables (names as `_primitive.RULES`):
    what a test compares with what the factory says it registered."""
    lowered = prim in _mlir._lowerings or any(
        prim in table for table in _mlir._platform_specific_lowerings.values()
    )
    have = {
        "impl": "impl" in vars(prim),
        "abstract": "abstract_eval" in vars(prim),
        "lowering": lowered,
        "jvp": prim in primitive_jvps,
        "transpose": prim in primitive_transposes,
        # `primitive_batchers` is a write-only proxy of the table batching reads
        "batch": prim in getattr(_batching, "fancy_primitive_batchers", primitive_batchers),
        "linearize": _linearizations is not None and prim in _linearizations,
    }
    return frozenset(k for k, v in have.items() if v)


not_mapped = None  # batching marks an unbatched operand with None
register_lowering = _mlir.register_lowering
lower_fun = _mlir.lower_fun
from jax._src import debugging as _debugging  # noqa: E402

DEBUG_CALLBACK_LOGGER = _debugging.__name__  # the logger of a failed `jax.debug.callback`
from jax._src import dispatch as _dispatch  # noqa: E402


def drop_failed_runtime_tokens() -> None:
    """Forget the runtime tokens of computations that failed. JAX keeps the token of the last
    effectful computation per device (and per ordered effect) to wait on in
    `jax.effects_barrier()` and at exit; a computation whose host callback raised leaves a
    token that raises again on every wait (on an accelerator, where the call returned before
    the failure). Called once the failure's error was raised to the caller."""
    tokens = getattr(_dispatch, "runtime_tokens", None)
    for table in (
        getattr(tokens, "output_runtime_tokens", None),
        getattr(tokens, "current_tokens", None),
    ):
        if not isinstance(table, dict):
            continue
        for key, token in list(table.items()):
            try:
                token.block_until_ready()
            except Exception:
                table.pop(key, None)


debug_effect = _debugging.debug_effect  # what keeps an effect-only check from being removed


def _prim(
    *names: str, modules: Sequence[Any] = (_lax, _slicing, _cf, _special)
) -> Primitive | None:
    for mod in modules:
        for name in names:
            p = getattr(mod, name, None)
            if isinstance(p, _core.Primitive):
                return p
    return None


class _Prims:
    """Primitive objects by a stable name (a missing one is None on this JAX version)."""

    def __init__(self) -> None:
        for name in (
            "add sub mul div neg exp exp2 log log1p expm1 tanh atanh sinh asinh "
            "logistic integer_pow pow sqrt rsqrt cbrt square convert_element_type "
            "reshape transpose rev concatenate broadcast_in_dim select_n dot_general "
            "squeeze copy real imag complex conj max min reduce_sum round split pad "
            "abs sign floor ceil sin cos tan exp2 reduce_precision erf erf_inv "
            "eq ne lt le gt ge and or not xor is_finite "
            "optimization_barrier stack reduce_or rem shift_left shift_right_arithmetic "
            "shift_right_logical reduce_max reduce_min reduce_prod reduce_and argmax argmin"
        ).split():
            setattr(self, name, _prim(name + "_p"))
        self.slice = _prim("slice_p")
        self.scatter_add = _prim("scatter_add_p")
        self.scatter = _prim("scatter_p")
        self.scatter_mul = _prim("scatter_mul_p")
        self.dynamic_slice = _prim("dynamic_slice_p")
        self.dynamic_update_slice = _prim("dynamic_update_slice_p")
        self.gather = _prim("gather_p")
        self.cumsum = _prim("cumsum_p")
        self.cumprod = _prim("cumprod_p")
        from jax._src.lax import fft as _fft

        self.fft = _prim("fft_p", modules=(_fft,))
        self.scan = _prim("scan_p")
        self.while_ = _prim("while_p")
        self.cond = _prim("cond_p")
        from jax._src.lax import convolution as _conv

        self.conv = _prim("conv_general_dilated_p", modules=(_conv,))
        from jax._src import pjit as _pjit

        self.jit = getattr(_pjit, "jit_p", None) or getattr(_pjit, "pjit_p", None)
        self.custom_jvp_call = getattr(_cd, "custom_jvp_call_p", None)
        self.custom_vjp_call = getattr(_cd, "custom_vjp_call_p", None) or getattr(
            _cd, "custom_vjp_call_jaxpr_p", None
        )
        # `closed_call` was renamed `eval_jaxpr` in JAX 0.12.
        self.closed_call = getattr(_core, "closed_call_p", None) or getattr(
            _core, "eval_jaxpr_p", None
        )
        try:
            from jax._src.lax.control_flow import loops as _loops

            self.cumsum = self.cumsum or getattr(_loops, "cumsum_p", None)
            self.cumprod = self.cumprod or getattr(_loops, "cumprod_p", None)
            self.cumlogsumexp = getattr(_loops, "cumlogsumexp_p", None)
            self.cummax = getattr(_loops, "cummax_p", None)
            self.cummin = getattr(_loops, "cummin_p", None)
        except ImportError:  # pragma: no cover
            pass
        try:
            from jax._src import pjit as _pjit2

            self.sharding_constraint = getattr(_pjit2, "sharding_constraint_p", None)
        except ImportError:  # pragma: no cover
            self.sharding_constraint = None
        try:
            from jax._src.lax.control_flow import solves as _solves

            self.linear_solve = getattr(_solves, "linear_solve_p", None)
        except ImportError:  # pragma: no cover
            self.linear_solve = None
        from jax._src.lax import linalg as _linalg

        self.triangular_solve = getattr(_linalg, "triangular_solve_p", None)
        from jax._src import dispatch as _dispatch

        self.device_put = getattr(_dispatch, "device_put_p", None)
        from jax._src import callback as _callback

        self.pure_callback = getattr(_callback, "pure_callback_p", None)
        self.io_callback = getattr(_callback, "io_callback_p", None)


prims = _Prims()
prims.pvary = getattr(_core, "pvary_p", None)  # shard_map's cast to "varying" (no data)


def is_any_reduction(p: Any) -> bool:
    """Whether primitive `p` is "any element holds" over a boolean array: `jnp.any`'s
    `reduce_or`, or Equinox's `unvmap_any` (the flag of its `error_if`; known by name, as
    Equinox is optional)."""
    return p is not None and (p is prims.reduce_or or getattr(p, "name", None) == "unvmap_any")


def is_host_callback(p: Any) -> bool:
    """Whether primitive `p` calls the host (`jax.pure_callback`, `io_callback`)."""
    return p is not None and p in (prims.pure_callback, prims.io_callback)


# Call-like primitives and the parameter that holds their sub-jaxpr. One table for every
# interpreter (docs/design.md §3.1); loops and branches have their own rules.
prims.remat = getattr(_ad_checkpoint, "remat_p", None)
prims.add_any = getattr(_ad_util, "add_jaxvals_p", None)  # the sum JAX's tangent programs use
prims.stop_gradient = getattr(_ad_util, "stop_gradient_p", None)

_CALL_PARAM_NAMES = ("jaxpr", "call_jaxpr", "fun_jaxpr")
# `jax.checkpoint` (remat) is a call too: rebuilding by inversion makes its recomputation moot
CALL_PRIMITIVES = {
    p
    for p in (
        prims.jit,
        prims.custom_jvp_call,
        prims.custom_vjp_call,
        prims.closed_call,
        prims.remat,
    )
    if p is not None
}


def call_jaxpr(params: dict) -> ClosedJaxpr:
    """The sub-jaxpr of a call-like equation (from its params), as a ClosedJaxpr."""
    for name in _CALL_PARAM_NAMES:
        if name in params:
            return as_closed(params[name])
    raise KeyError("no sub-jaxpr among the params of a call-like equation")


def as_closed(j: Any) -> ClosedJaxpr:
    if isinstance(j, ClosedJaxpr):
        return j
    return ClosedJaxpr(j, ())


@dataclass(frozen=True)
class ScanParams:
    """A `scan`'s params in one vocabulary: operands are ``consts, carry, xs``."""

    nconsts: int
    ncarry: int
    body: ClosedJaxpr
    length: int
    reverse: bool


def scan_info(p: dict) -> ScanParams:
    """A `scan`'s params on any JAX version."""
    if "num_consts" in p:
        nc, ncar = p["num_consts"], p["num_carry"]
    else:  # JAX >= 0.12 describes the operands by a flat tree
        nc, ncar, _ = (len(t) for t in p["ft_in"].unpack())
    return ScanParams(nc, ncar, as_closed(p["jaxpr"]), p["length"], p["reverse"])


def cond_branches(p: dict) -> list[ClosedJaxpr]:
    return [as_closed(b) for b in p["branches"]]


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Evaluate one equation on values (or tracers), keeping the user's source info."""
    if eqn.primitive is prims.pvary and all(is_concrete(x) for x in invals):
        # a constant made to vary over mesh axes (`0.5 * x` inside shard_map): folded where
        # it is known, outside shard_map's trace, where only its value means anything
        return list(invals)
    invals = _vary_constants(eqn, invals)
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


SHORT_LOOP_TRIPS = 16
"""The most trips of a loop that jaxrev's re-emitted programs unroll (`_short_loop`)."""
SHORT_LOOP_WORK = 256
"""The most equations, trips times the body's (nested ones counted), of a loop unrolled."""


def _short_loop(params: dict) -> bool:
    """Whether a `scan` with these parameters is emitted unrolled: a few trips of a small body
    (`jnp.searchsorted`'s bisection: 4 trips of 20 equations for 10 knots). XLA:CPU runs a
    loop's trip as thunks of its own, several microseconds each whatever the body does, and
    fuses nothing across trips; a spline inverse evaluates the bisection at a dozen points
    per element (4 of 10 trips unrolled took 225 us where the loop took 580 us, batch 256).
    Unrolling changes no value: the same operations in the same order. Marked when the user's
    program is traced (`make_jaxpr`), so every walk and every re-emission sees it; loops that
    jaxrev's own rules emit (a loop run backwards) keep their trips."""
    length = params.get("length", SHORT_LOOP_TRIPS + 1)
    if params.get("unroll", 1) not in (1, False) or not 1 < length <= SHORT_LOOP_TRIPS:
        return False
    return length * _count_eqns(params["jaxpr"].jaxpr, SHORT_LOOP_WORK // length) <= SHORT_LOOP_WORK


def _unroll_short_loops(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` with its short loops (`_short_loop`), at any depth, marked to be unrolled
    (`jaxpr` itself where it has none)."""
    eqns, changed = [], False
    for e in jaxpr.eqns:
        params = {k: _unroll_in_param(v) for k, v in e.params.items()}
        if e.primitive is prims.scan and _short_loop(params):
            params["unroll"] = params["length"]  # (an int: the primitive reads True as 1)
        if any(params[k] is not v for k, v in e.params.items()):
            e, changed = e.replace(params=params), True
        eqns.append(e)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _unroll_in_param(v: Any) -> Any:
    if isinstance(v, ClosedJaxpr):
        inner = _unroll_short_loops(v.jaxpr)
        return v if inner is v.jaxpr else ClosedJaxpr(inner, v.consts)
    if isinstance(v, Jaxpr):
        return _unroll_short_loops(v)
    if isinstance(v, tuple) and any(isinstance(x, (Jaxpr, ClosedJaxpr)) for x in v):
        new = tuple(_unroll_in_param(x) for x in v)
        return v if all(a is b for a, b in zip(new, v)) else new
    return v


def _count_eqns(jaxpr: Any, limit: int) -> int:
    """The equations of `jaxpr` as emitted, nested ones counted (a loop's body times the trips
    it unrolls: nested short loops multiply), or a number above `limit` once past it."""
    total = 0
    for e in jaxpr.eqns:
        total += 1
        copies = 1
        if e.primitive is prims.scan:
            unroll = e.params.get("unroll", 1)
            copies = (
                e.params["length"]
                if unroll is True
                else max(1, min(int(unroll), e.params["length"]))
            )
        for sub in _core.jaxprs_in_params(e.params):
            total += copies * _count_eqns(sub, (limit - total) // copies)
        if total > limit:
            break
    return total


@functools.lru_cache(maxsize=64)
def compiled_eqns(eqns: tuple, ins: tuple, outs: tuple) -> Callable:
    """`eqns` (in order) as one jitted function of the variables `ins`, returning the
    variables `outs`: what jaxrev evaluates from constants at once (one XLA program instead
    of one per operation), kept for the same equations again (a walk of the same program)."""

    def run(*vals: Any) -> list[Any]:
        env = dict(zip(ins, vals))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        # (staged, all of it: this is the compiled program; folding inside it would run an
        # operation on literals alone, a cast, as an XLA program of its own)
        with _config.eager_constant_folding(False):
            for e in eqns:
                for o, x in zip(e.outvars, bind_eqn(e, [read(v) for v in e.invars])):
                    if not isinstance(o, DropVar):
                        env[o] = x
        return [env[o] for o in outs]

    return jax.jit(run)


def _vary_constants(eqn: JaxprEqn, invals: Sequence[Any]) -> Sequence[Any]:
    """Inside shard_map, each operand typed to vary over the mesh axes the equation's own
    operand varies over, where it varies over fewer: a constant the walk folded (its `pvary`
    in the jaxpr folded with it), or a value computed from one, is cast as JAX casts it when
    the user's code is traced. Values folded eagerly (no tracer) stay untyped."""
    if not any(isinstance(x, _core.Tracer) for x in invals):
        return invals
    out = list(invals)
    for i, (v, x) in enumerate(zip(eqn.invars, invals)):
        axes = vma_of(v.aval)
        if axes:
            out[i] = _vary(x, axes)
    return out


def user_source(eqn: JaxprEqn) -> tuple[str | None, int | None, str]:
    """(file, line, summary) of the user's code that produced `eqn`.

    An equation of a library function passed to a transform as it is (`jr.reverse(jnp.sin)`)
    has no user frame in its traceback (JAX keeps only the frames below the traced function):
    its site is then the user's call of the transform (`call_site`), said as such."""
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is not None:
        return frame.file_name, frame.start_line, _siu.summarize(eqn.source_info)
    site = current_call_site()
    if site is None:
        return None, None, ""
    file, line, function = site
    return file, line, f"{file}:{line} ({function}, in the library code it calls)"


_CALL_SITE: _contextvars.ContextVar = _contextvars.ContextVar("jaxrev_call_site", default=None)
"""The call site that `user_source` names while a run-time check builds its error on the host
(where the Python stack is the callback's, not the user's): set by `at_call_site`."""


def call_site() -> tuple[str, int, str] | None:
    """(file, line, function) of the innermost frame of the user's code on the Python stack
    now (JAX's, jaxrev's and the standard library's frames skipped): where the user called the
    transform, eagerly or while `jit` traces it. None where there is none."""
    frame = _sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if _siu.is_user_filename(code.co_filename):
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None


def current_call_site() -> tuple[str, int, str] | None:
    """The user's call site: the one `at_call_site` set (on the host, where a run-time check
    builds its error), else the innermost user frame on the stack now."""
    return _CALL_SITE.get() or call_site()


@_contextlib.contextmanager
def at_call_site(site: tuple[str, int, str] | None):
    """Within it, `user_source` names `site` for equations with no user frame."""
    token = _CALL_SITE.set(site)
    try:
        yield
    finally:
        _CALL_SITE.reset(token)


_TRACE_MARKS: list[Callable[[], Any]] = []


def on_trace(marks: Callable[[], Any]) -> None:
    """Register `marks`, called for a context manager that every trace of `make_jaxpr`
    enters: how a library's code is seen by jaxrev while jaxrev traces it (flowjax's
    root-finders as `custom_inverse` steps: `jaxrev.flowjax`), and only then.

    **Arguments:** `marks`, a callable of no arguments returning a context manager.

    **Returns:** None. (`jaxrev/__init__.py` registers the optional libraries' marks.)"""
    _TRACE_MARKS.append(marks)


@_contextlib.contextmanager
def _trace_marks() -> Iterator[None]:
    with _contextlib.ExitStack() as stack:
        for marks in _TRACE_MARKS:
            stack.enter_context(marks())
        yield


def make_jaxpr(fun: Callable, *args: Any) -> tuple[ClosedJaxpr, Any]:
    """`jax.make_jaxpr(fun, return_shape=True)(*args)` in low-level primitives only.

    JAX >= 0.12 writes some library functions (`jnp.searchsorted`) as "high" primitives that
    only lower when staged out; jaxrev reads and re-emits equations, so it lowers them first,
    to the primitives its rules know (and a `custom_inverse` holding one could not be staged).

    The user's code is traced as `jax.make_jaxpr` traces it outside any transform, even where
    a walk folds constants (`jax.ensure_compile_time_eval`): there JAX would run a host
    callback whose operands are constants while tracing the branch that holds it (Equinox's
    `error_if` raises on good inputs). What is computed from constants alone stays known to
    the walks all the same (`_jaxpr.Statics`).
    """
    with _config.eager_constant_folding(False), _trace_marks():
        closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*args)
    if getattr(closed.jaxpr, "is_high", False):
        lo = _pe.lower_jaxpr2(closed.jaxpr)
        closed = ClosedJaxpr(lo, lo.consts)
    return ClosedJaxpr(_unroll_short_loops(closed.jaxpr), closed.consts), out_shape


def saved_residuals(fun: Callable, *args: Any) -> list[tuple[Any, str]]:
    """What JAX's reverse mode stores to differentiate `fun` at `args` (arrays or
    `jax.ShapeDtypeStruct`s): (aval, description) per value, the description "from the
    argument ..." or "output of PRIMITIVE from FILE:LINE (FUNCTION)"."""
    return list(_ad_checkpoint.saved_residuals(fun, *args))


def dce(jaxpr: Jaxpr) -> Jaxpr:
    """`jaxpr` without the equations none of its outputs needs, by JAX's own rules (a `scan`'s
    carry that no output needs, flowjax's log-det accumulator behind `transform`, is dropped
    from the loop); every input is kept, and effectful equations (checks) stay."""
    return _pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def dce_outputs(closed: ClosedJaxpr, used: Sequence[bool]) -> ClosedJaxpr:
    """`closed` returning only its `used` outputs, without what none of them needs (JAX's own
    rules: a loop's carry that no output needs leaves the loop, and the loops it nests);
    every input is kept."""
    jaxpr = _pe.dce_jaxpr(closed.jaxpr, list(used), instantiate=True)[0]
    return ClosedJaxpr(jaxpr, closed.consts)


def drop_unused_outputs(p: Any, params_for: Callable[[dict, tuple], dict | None]) -> None:
    """Make JAX's dead-code elimination drop the outputs of `p`'s equations that nothing reads:
    `params_for(params, used)` gives the equation's parameters for the outputs `used` (its
    abstract evaluation and its implementation then return only those), or None to keep the
    equation as it is. Every input stays used."""

    def rule(*args: Any) -> tuple[list[bool], Any]:
        # (as in `keep_in_dce`: the used outputs first, the equation last)
        used, eqn = tuple(args[0]), args[-1]
        params = None if all(used) or not any(used) else params_for(dict(eqn.params), used)
        if params is None:
            return [True] * len(eqn.invars), eqn
        outvars = [v for v, u in zip(eqn.outvars, used) if u]
        return [True] * len(eqn.invars), eqn.replace(outvars=outvars, params=params)

    _pe.dce_rules[p] = rule


def keep_in_dce(p: Any) -> None:
    """Make JAX's dead-code elimination keep every equation of primitive `p`, though it has no
    effect and no output anything reads: a run-time check (`knowledge.checks.check_p`) whose
    lowering calls the host. An effect would do the same, but any effect in a jitted program
    turns off JAX's fast dispatch path (about half a millisecond of Python per call)."""
    # (the rule's arguments end with the equation: JAX 0.10 passes the used outputs before
    # it, newer JAX the live inputs too)
    _pe.dce_rules[p] = lambda *args: ([True] * len(args[-1].invars), args[-1])


def trace_to_closed(fun: Callable, *args: Any) -> tuple[ClosedJaxpr, list[Any], Any]:
    """Trace `fun` to a ClosedJaxpr whose closed-over tracers are leading inputs (see
    `hoist_consts`: concrete consts stay consts).

    Returns (closed_jaxpr, hoisted consts, out_tree). The hoisted consts are tracers of an
    outer trace, which is why they are passed as explicit operands instead of being baked into
    the jaxpr.
    """
    closed, out_shape = make_jaxpr(fun, *args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    new, consts = hoist_consts(closed)
    return new, consts, out_tree


def is_concrete(x: Any) -> bool:
    return not isinstance(x, _core.Tracer)


def is_key(x: Any) -> bool:
    """Whether `x` (a value, an aval or a dtype) has an extended dtype: a PRNG key, new-style
    (`jax.random.key`) or inside a traced `jax.random.PRNGKey`. numpy cannot hold one, it has
    no arithmetic, and its tangents and cotangents are float0."""
    dt = getattr(x, "dtype", x)
    try:
        return jax.dtypes.issubdtype(dt, jax.dtypes.extended)
    except TypeError:  # not a dtype at all (a Python scalar's type, None)
        return False


def tracing() -> bool:
    """Whether a transformation is tracing now (`jit`, `grad`, `vmap`, ...): values computed
    now may be tracers even where every argument is concrete."""
    return not isinstance(_core.trace_ctx.trace, _core.EvalTrace)


def is_staged(x: Any) -> bool:
    """Whether `x` is being staged into a jaxpr (under `jit`, `make_jaxpr`, `scan`), as
    opposed to a concrete value or a tracer of an eager `grad` / `vmap` (whose traces sit on
    top of the eager one)."""
    if not isinstance(x, _core.Tracer):
        return False
    trace = x._trace
    while trace is not None:
        if isinstance(trace, _pe.DynamicJaxprTrace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def new_var(aval: Any) -> Var:
    return Var(aval)


def literal(val: Any, aval: Any) -> Literal:
    return Literal(val, aval)


def has_user_frame(eqn: JaxprEqn) -> bool:
    return _siu.user_frame(eqn.source_info.traceback) is not None


Zero = _ad_util.Zero
UndefinedPrimal = _ad.UndefinedPrimal


def is_undefined_primal(x: Any) -> bool:
    return isinstance(x, _ad.UndefinedPrimal)


def is_symbolic_zero(x: Any) -> bool:
    return isinstance(x, _ad_util.Zero)


def hoist_consts(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[Any]]:
    """Move a ClosedJaxpr's consts that are tracers (of an outer trace, which gradients must
    flow to) to leading inputs, so they can be passed as operands. Concrete consts stay consts:
    they are known when the program is traced (a mask, an index), which element-level
    inversion relies on."""
    jaxpr = closed.jaxpr
    keep = [is_concrete(c) for c in closed.consts]
    if all(keep):
        return closed, []
    lifted = [v for v, k in zip(jaxpr.constvars, keep) if not k]
    arg_names = jaxpr.debug_info.arg_names
    if arg_names is not None:
        arg_names = ("",) * len(lifted) + (*arg_names,)
    new = jaxpr.replace(
        constvars=[v for v, k in zip(jaxpr.constvars, keep) if k],
        invars=[*lifted, *jaxpr.invars],
        debug_info=jaxpr.debug_info._replace(arg_names=arg_names),
    )
    return (
        ClosedJaxpr(new, [c for c, k in zip(closed.consts, keep) if k]),
        [c for c, k in zip(closed.consts, keep) if not k],
    )


ShapedArray = _core.ShapedArray


def differentiation_depth() -> int:
    """How many JVP / linearize traces enclose the code being traced right now."""
    kinds = tuple(
        k
        for k in (getattr(_ad, "JVPTrace", None), getattr(_ad, "LinearizeTrace", None))
        if k is not None
    )
    t = _core.trace_ctx.trace
    depth = 0
    seen = 0
    while t is not None and seen < 1000:
        if isinstance(t, kinds):
            depth += 1
        t = getattr(t, "parent_trace", None)
        seen += 1
    return depth


def folding_constants() -> bool:
    """Whether operations on constants are evaluated when traced (inside
    `jax.ensure_compile_time_eval`), not staged into the program."""
    return bool(_config.eager_constant_folding.value)


def staged_constants():
    """The opposite of `jax.ensure_compile_time_eval` inside it: operations on constants are
    staged into the program again, so a large intermediate (an identity basis pushed through a
    lump) is computed when the program runs instead of becoming an embedded constant."""
    return _config.eager_constant_folding(False)


# --------------------------------------------------------------------------- shard_map's vma
# Inside `jax.shard_map(..., check_vma=True)` every aval says over which manual mesh axes its
# value varies (`aval.mat.varying`; `aval.vma` on other JAX versions). A value jaxrev makes
# from an aval (a zero, a placeholder, a stand-in for tracing) must carry that set, or a
# primitive that mixes it with the value it stands for refuses the operands.


def vma_of(x: Any) -> frozenset:
    """The manual mesh axes over which `x` (a value, tracer or aval) varies; empty outside
    `shard_map` or with `check_vma=False`."""
    aval = _aval(x)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:
        return frozenset(getattr(mat, "varying", ()) or ())
    return frozenset(getattr(aval, "vma", ()) or ())


def _aval(x: Any) -> Any:
    if isinstance(x, (_core.AbstractValue, jax.ShapeDtypeStruct)):
        return x
    try:
        return _core.typeof(x)
    except (TypeError, AttributeError):
        return None


def sds(x: Any, shape: Sequence[int] | None = None) -> jax.ShapeDtypeStruct:
    """A `ShapeDtypeStruct` for an aval (or a value) that keeps its vma: a trace on it types
    its values as the originals are typed (and JAX inserts its `pvary`s). `shape`: another
    shape of the same type (a stack of such values)."""
    aval = _aval(x)
    shape, dtype = tuple(aval.shape if shape is None else shape), aval.dtype
    if not vma_of(aval):
        return jax.ShapeDtypeStruct(shape, dtype)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None:  # the type names its mesh axes: it goes with the aval's mesh
        sharding = (
            aval.sharding
            if shape == tuple(aval.shape)
            else (jax.sharding.NamedSharding(aval.sharding.mesh, jax.sharding.PartitionSpec()))
        )
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, manual_axis_type=mat)
    return jax.ShapeDtypeStruct(shape, dtype, vma=vma_of(aval))  # JAX 0.7 to 0.9


def shaped(aval: Any) -> Any:
    """`ShapedArray(aval.shape, aval.dtype)` keeping `aval`'s vma (an abstract-eval rule's
    output aval for a value made like `aval`)."""
    mat = getattr(aval, "manual_axis_type", None)
    if mat is not None and vma_of(aval):
        return _core.ShapedArray(
            tuple(aval.shape), aval.dtype, sharding=aval.sharding, manual_axis_type=mat
        )
    if vma_of(aval):
        return _core.ShapedArray(tuple(aval.shape), aval.dtype, vma=vma_of(aval))
    return _core.ShapedArray(tuple(aval.shape), aval.dtype)


def match_vma(x: Any, aval: Any) -> Any:
    """`x` cast to vary over the axes `aval` varies over (`lax.pcast(..., to="varying")`,
    a no-op cast), where it varies over fewer; `x` itself otherwise."""
    return _vary(x, vma_of(aval))


def _vary(x: Any, axes: frozenset) -> Any:
    missing = axes - vma_of(x) if axes else None
    if not missing:
        return x
    return jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying")


def zeros_of(aval: Any) -> Any:
    """Zeros of `aval`'s shape and dtype, typed as `aval` is (its vma)."""
    return match_vma(jax.numpy.zeros(aval.shape, aval.dtype), aval)


def vma_union(*trees: Any) -> frozenset:
    """The mesh axes over which any leaf of `trees` varies (None leaves skipped)."""
    out: frozenset = frozenset()
    for t in trees:
        for leaf in jax.tree_util.tree_leaves(t):
            out = out | vma_of(leaf)
    return out


def any_over(flag: Any, axes: frozenset) -> Any:
    """`flag` (a boolean) made true on every device of the mesh `axes` where it is true on
    any (`lax.pmax`), and so no longer varying over them: a decision all the devices that
    hold one replicated value must take together. `flag` itself where `axes` is empty."""
    if not axes:
        return flag
    names = tuple(sorted(axes, key=str))
    return jax.lax.pmax(jax.numpy.asarray(flag, jax.numpy.int32), names) > 0


def vary_to(tree: Any, axes: frozenset) -> Any:
    """Every leaf of `tree` cast to vary over `axes` (at least): the loop-carried bookkeeping
    of a backward run (its drift, its budget) typed alike in every iteration and branch."""
    return jax.tree_util.tree_map(lambda x: _vary(x, axes), tree) if axes else tree
