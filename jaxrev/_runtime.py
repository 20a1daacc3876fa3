"""jaxrev's errors raised where a compiled program runs, as the documented type.

A run-time check (`transforms.knowledge.checks.check_p`) fails inside a compiled program by
raising from a host callback. XLA turns that exception into a `jax.errors.JaxRuntimeError`
("INTERNAL: CpuCallback error calling callback: Traceback ..."), which no ``except
jr.DriftError`` catches, and JAX offers no hook between XLA and the caller of a `jax.jit`
function. So, as Equinox does for `eqx.filter_jit`:

* the callback stashes the real error under a fresh token (`raise_at_run_time`) and raises a
  copy of it whose message ends with the token: the `JaxRuntimeError` carries the token, which
  names exactly one stashed error (the stash is guarded by a lock and holds at most
  `STASH_SIZE` errors: an error nobody converts is dropped, oldest first);
* what sits on the call path turns a `JaxRuntimeError` that carries a token back into the
  stashed error (`runtime_error`): `jit` (`jr.jit`) around its call, `raise_runtime_errors`
  (`jr.raise_runtime_errors()`) around any block of code, and jaxrev's own compiled eager
  calls (`_cache`).

JAX logs a failed callback ("jax.debug.callback failed") with the callback's traceback; for a
jaxrev check the log is cut to one line, and dropped while a converter is active.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import re
import secrets
import threading
import types
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import jax

from jaxrev._compat import DEBUG_CALLBACK_LOGGER, drop_failed_runtime_tokens
from jaxrev._errors import JaxrevError

__all__ = [
    "jit",
    "checked_jit",
    "raise_runtime_errors",
    "raise_at_run_time",
    "runtime_error",
    "note_check",
    "checks_noted",
    "block",
    "STASH_SIZE",
]

STASH_SIZE = 64
"""How many errors raised at run time are kept for a converter to re-raise."""

_TOKEN = re.compile(r"jaxrev-check-[0-9a-f]{16}")
_HINT = (
    "raised by a jaxrev check inside a compiled call; `jr.jit` or `with "
    "jr.raise_runtime_errors():` around the call re-raises it as the error above"
)


class _Stash:
    """The errors raised at run time that no converter has taken yet, by token."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.lock = threading.Lock()
        self.errors: OrderedDict[str, BaseException] = OrderedDict()

    def put(self, err: BaseException) -> str:
        token = f"jaxrev-check-{secrets.token_hex(8)}"
        with self.lock:
            self.errors[token] = err
            while len(self.errors) > self.size:
                self.errors.popitem(last=False)
        return token

    def pop(self, token: str) -> BaseException | None:
        with self.lock:
            return self.errors.pop(token, None)


_STASH = _Stash(STASH_SIZE)


def raise_at_run_time(err: BaseException) -> NoReturn:
    """Raise `err` from a host callback of a compiled program: stash it under a fresh token
    and raise a copy of it whose message ends with the token (the copy is what XLA wraps in
    its runtime error; a converter re-raises `err` itself)."""
    err = err.with_traceback(None)  # no frames (and their arrays) kept alive
    token = _STASH.put(err)
    raise _carrier(err, token)


def _carrier(err: BaseException, token: str) -> BaseException:
    """A copy of `err`, of its type (a caller that meets the copy itself, where JAX runs the
    callback in Python rather than in XLA, still catches it as that type), with the token
    at the end of its message."""
    text = f"{err}\n[{token}: {_HINT}]"
    try:
        dup = copy.copy(err)
        dup.args = (text,)
    except Exception:  # an exception type that cannot be rebuilt from its args
        dup = JaxrevError(text)
    dup.jaxrev_token = token
    return dup


def runtime_error(e: BaseException) -> BaseException | None:
    """The stashed jaxrev error that `e` (a `JaxRuntimeError`, or the raised copy itself)
    carries, taken out of the stash; None where `e` carries none."""
    token = getattr(e, "jaxrev_token", None)
    if token is None:
        try:
            found = _TOKEN.search(str(e))
        except Exception:
            return None
        token = found and found.group(0)
    if not token:
        return None
    drop_failed_runtime_tokens()  # else JAX's effects barrier (and exit) re-raises it
    return _STASH.pop(token)


class _Active:
    """How many converters are running, in any thread (the failed callback is logged on
    whichever thread ran it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0

    def enter(self) -> None:
        with self.lock:
            self.depth += 1

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1


_ACTIVE = _Active()


class _ShortLog(logging.Filter):
    """JAX's log of a failed host callback, for a jaxrev check: dropped while a converter is
    active (it re-raises the error), else cut to one line without the host traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        token = getattr(exc, "jaxrev_token", None)
        if token is None:
            return True
        if _ACTIVE.depth:
            return False
        first = str(exc).split("\n", 1)[0]
        record.msg = "jax.debug.callback failed: %s: %s [%s]"
        record.args = (type(exc).__name__, first, token)
        record.exc_info = None
        record.exc_text = None
        return True


logging.getLogger(DEBUG_CALLBACK_LOGGER).addFilter(_ShortLog())


class _Noted(threading.local):
    """How many checks this thread staged or lowered (traces and lowerings of a call run on
    the calling thread): a call that saw the count move compiled a program holding one."""

    n = 0


_NOTED = _Noted()


def note_check() -> None:
    """Called where a run-time check is staged into a program or lowered."""
    _NOTED.n += 1


def checks_noted() -> int:
    """This thread's count of checks staged or lowered so far."""
    return _NOTED.n


def block(out: Any) -> None:
    """Wait until the computation that produced `out` (concrete arrays) has run, so that a
    check failing in it raises here: its array leaves, or JAX's effects barrier where it has
    none. Nothing while tracing (`out` holds tracers)."""
    leaves = jax.tree_util.tree_leaves(out)
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return
    arrays = [x for x in leaves if isinstance(x, jax.Array)]
    if arrays:
        jax.block_until_ready(arrays)
    else:
        jax.effects_barrier()


@contextlib.contextmanager
def raise_runtime_errors() -> Iterator[None]:
    """Re-raise a jaxrev check that fails inside a compiled call as its documented error.

    Around any code that runs compiled programs (`jax.jit`, `eqx.filter_jit`, AOT-compiled
    calls, a wrapper of your own), a `jax.errors.JaxRuntimeError` raised by a failed jaxrev
    check (``INTERNAL: CpuCallback error calling callback: ...``) becomes the `jr.JaxrevError`
    the check raised (`jr.DriftError`, `jr.SingularJacobianError`, ...), message first; the
    runtime error stays reachable as its `__context__`. Other errors pass through unchanged.

    A failure an accelerator reports only when the result is read is caught where it is read
    inside the block: end the block with `jax.block_until_ready(result)` (`jr.jit` and
    `eqx.filter_jit` wait for their results themselves).

    **Arguments:**

    None.

    **Returns:**

    A context manager, also usable as a decorator: `eqx.filter_jit` passes a jaxrev check's
    runtime error through as it is (it converts Equinox's own errors only), so
    ``jr.raise_runtime_errors()(eqx.filter_jit(f))`` raises jaxrev's.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> step = jax.jit(lambda y: jr.inverse_jvp(lambda x: x * x, (y,), jnp.ones(2))[1])
        >>> try:
        ...     with jr.raise_runtime_errors():
        ...         jax.block_until_ready(step(jnp.array([0.0, 1.0])))   # 2x vanishes at 0
        ... except jr.SingularJacobianError as e:
        ...     print(str(e).split(":")[0])
        jaxrev.inverse_jvp
    """
    _ACTIVE.enter()
    try:
        yield
    except Exception as e:
        err = runtime_error(e)
        if err is None:
            raise
        raise err from None
    finally:
        _ACTIVE.exit()


class _Jitted:
    """What `jit` returns: `jax.jit`'s function, whose calls re-raise jaxrev's run-time
    errors as their own type; every other attribute is `jax.jit`'s."""

    def __init__(self, fun: Callable, jit_kwargs: dict, convert: bool = True) -> None:
        # a function of our own, so that JAX's caches (keyed on the function) trace and
        # lower it afresh for this object, and its checks are seen
        @functools.wraps(fun)
        def traced(*args: Any, **kwargs: Any) -> Any:
            return fun(*args, **kwargs)

        functools.update_wrapper(self, fun, updated=())
        self._jitted = jax.jit(traced, **jit_kwargs)
        self._checks = False  # whether a program of this function holds a check
        self._convert = convert

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _ACTIVE.enter()
        seen = _NOTED.n
        try:
            out = self._jitted(*args, **kwargs)
            if self._checks or _NOTED.n != seen:
                self._checks = True
                block(out)
            return out
        except Exception as e:
            err = runtime_error(e) if self._convert else None
            if err is None:
                raise
            raise err from None
        finally:
            _ACTIVE.exit()
            if _NOTED.n != seen:
                self._checks = True

    def _noting(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def run(*args: Any, **kwargs: Any) -> Any:
            seen = _NOTED.n
            try:
                return method(*args, **kwargs)
            finally:
                if _NOTED.n != seen:
                    self._checks = True

        return run

    def __getattr__(self, name: str) -> Any:
        jitted = self.__dict__.get("_jitted")
        if jitted is None:
            raise AttributeError(name)
        attr = getattr(jitted, name)
        # `lower` and `trace` may trace (and lower) the program the calls will reuse
        return self._noting(attr) if name in ("lower", "trace", "eval_shape") else attr

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<jaxrev.jit of {getattr(self, '__wrapped__', None)!r}>"


def jit(fun: Callable | None = None, /, **jit_kwargs: Any) -> Any:
    """`jax.jit`, whose calls raise a failed jaxrev check as its documented error.

    A jaxrev check failing where the program runs (a drift past `reversible`'s tolerance, a
    vanished pivot, a Newton group that missed its tolerance) raises `jr.DriftError`,
    `jr.SingularJacobianError`, `jr.ReversibilityError`, ... with jaxrev's message first,
    naming your line, instead of `jax.errors.JaxRuntimeError: INTERNAL: ...` (which stays
    reachable as `__context__`).

    The error must be raised inside the call, so a call of a function whose compiled program
    holds a jaxrev check waits for its result (`jax.block_until_ready`) before returning: such
    calls give up asynchronous dispatch. Whether a program holds a check is seen when JAX traces
    or lowers it; from then on every call of this function waits. A function that never
    compiled a check costs what `jax.jit`'s call costs (one Python call more). Errors raised
    where JAX transforms the function from outside (the backward pass of
    ``jax.grad(jr.jit(f))`` runs after the call returned) are not converted: put `jr.jit`
    outermost, or wrap the code in `jr.raise_runtime_errors()`.

    **Arguments:**

    - `fun`: the function to compile; without it, `jit` returns a decorator.
    - `**jit_kwargs`: `jax.jit`'s keyword arguments (`static_argnums`, `donate_argnums`,
      `in_shardings`, ...), passed through.

    **Returns:**

    A function that behaves as `jax.jit`'s (its `lower`, `trace`, `eval_shape`, `clear_cache`
    are `jax.jit`'s), but for the errors above.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> halve = jr.reversible(lambda y: jax.lax.fori_loop(0, 60, lambda i, y: 0.5 * y + 0.1, y),
        ...                       on_drift="raise", checkpoint_every=None)
        >>> grad = jr.jit(jax.grad(lambda y: halve(y).sum()))
        >>> try:
        ...     grad(jnp.ones(2))        # run backwards, each step doubles the rounding
        ... except jr.DriftError as e:
        ...     print(str(e).split(":")[0])
        jaxrev.reversible(<lambda>)
    """
    if fun is None:
        return functools.partial(jit, **jit_kwargs)
    return _Jitted(fun, jit_kwargs)


def checked_jit(fun: Callable, *, convert: bool = True, **jit_kwargs: Any) -> Callable:
    """`jit` for jaxrev's own compiled eager calls: ``convert=False`` leaves a failed check as
    JAX's runtime error (the caller re-runs the call eagerly, taking the stashed error out
    with `runtime_error`), but still waits for the result where the program holds a check."""
    return _Jitted(fun, jit_kwargs, convert)
