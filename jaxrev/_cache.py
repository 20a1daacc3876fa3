"""Eager calls cached like `jax.jit`'s.

A transform called on concrete values (or under an eager `grad` / `vmap`) would otherwise
trace the user's function, walk it and run the result operation by operation on every call.
Here such a call is keyed on the function, the argument structure, the traced leaves' avals and
the static leaves, as `jax.jit` keys its calls, and runs as one compiled call, traced once.

`jax.jit` assumes the function reads nothing but its arguments; an eager call of a jaxrev
transform promises no such thing, so the key also holds what the function can read besides
its arguments (`function_key`): its code, its closure cells, its defaults, the globals its
code names, a bound method's object, recursively. A value is keyed by identity where it
cannot change (a JAX array, a module, a class), by value where it can (a NumPy array's bytes,
an object's attributes); where it cannot be keyed cheaply (a tracer, a large NumPy array, a
deep object) there is no key and the call runs as it would without the cache. So a changed
closure, attribute or array (even one changed in place) gives a new key, never a stale
answer. A module's attributes are keyed by the module's identity (monkeypatching a library
function between calls is not seen, as it is not by `jax.jit`).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import types
from collections import OrderedDict
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import is_concrete, is_staged
from jaxrev._program import Filtered, is_traced

__all__ = ["function_key", "call_key", "compiled", "cached_call", "is_eager"]

_MAX_ENTRIES = 256
_MAX_NODES = 400        # values visited per key: past it, no key
_MAX_DEPTH = 8
_MAX_BYTES = 1 << 16    # NumPy arrays hashed by value up to this size


class _NoKey(Exception):
    pass


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, np.dtype, type(Ellipsis))


class _Keyer:
    """Builds a hashable key for values a function may read; `keep` holds the objects keyed
    by identity, so that their ids are not reused while the key lives."""

    def __init__(self) -> None:
        self.keep: list[Any] = []
        self.nodes = 0
        self.seen: dict[int, int] = {}

    def ident(self, v: Any) -> tuple:
        self.keep.append(v)
        return ("id", id(v))

    def key(self, v: Any, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES or depth > _MAX_DEPTH:
            raise _NoKey
        if isinstance(v, _IMMUTABLE):
            return (type(v), v)
        if isinstance(v, jax.core.Tracer):
            raise _NoKey
        if isinstance(v, jax.Array):
            return self.ident(v)
        if isinstance(v, np.ndarray):
            if v.nbytes > _MAX_BYTES or v.dtype == object:
                raise _NoKey
            return ("np", v.shape, v.dtype.str,
                    hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest())
        if isinstance(v, np.generic):
            return ("npg", v.dtype.str, v.item())
        if isinstance(v, (types.ModuleType, type, types.BuiltinFunctionType, np.ufunc)):
            return self.ident(v)
        if id(v) in self.seen:      # a cycle, or a value shared by two paths
            return ("seen", self.seen[id(v)])
        self.seen[id(v)] = len(self.seen)
        if isinstance(v, (tuple, list)):
            return (type(v), tuple(self.key(x, depth + 1) for x in v))
        if isinstance(v, dict):
            return (type(v), tuple((self.key(k, depth + 1), self.key(x, depth + 1))
                                   for k, x in v.items()))
        if isinstance(v, types.FunctionType):
            if _library(v) and not v.__closure__:
                return self.ident(v)
            return self.function(v, depth)
        if isinstance(v, types.MethodType):
            return ("method", self.key(v.__func__, depth + 1), self.key(v.__self__, depth + 1))
        if isinstance(v, functools.partial):
            return ("partial", self.key(v.func, depth + 1), self.key(v.args, depth + 1),
                    self.key(v.keywords, depth + 1))
        if _library(v):
            return self.ident(v)
        attrs = _attributes(v)
        if attrs is None:          # a C object with no state of its own
            return self.ident(v)
        return (self.ident(type(v)), self.key(attrs, depth + 1))

    def function(self, fn: types.FunctionType, depth: int) -> tuple:
        cells = tuple(self.key(c.cell_contents, depth + 1) if _filled(c) else ("empty",)
                      for c in fn.__closure__ or ())
        glob = fn.__globals__
        names = tuple((n, self.key(glob[n], depth + 1)) for n in _global_names(fn.__code__)
                      if n in glob)
        return ("fn", self.ident(fn.__code__), cells, self.key(fn.__defaults__, depth + 1),
                self.key(fn.__kwdefaults__, depth + 1), names)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


_LIBRARIES = frozenset({"jax", "jaxlib", "numpy", "jaxrev", "equinox", "flax", "diffrax",
                        "optax", "lineax", "optimistix", "scipy", "functools", "math",
                        "builtins"})


def _library(v: Any) -> bool:
    """A function or callable of a library (`jnp.tanh`, `jax.nn.relu`): keyed by identity,
    as its module is; a user's function is keyed by what it reads."""
    mod = getattr(v, "__module__", None)
    return isinstance(mod, str) and mod.split(".", 1)[0] in _LIBRARIES


def _attributes(v: Any) -> dict | None:
    """An object's state: its `__dict__` and slots; None where it has neither."""
    d = getattr(v, "__dict__", None)
    slots = [s for c in type(v).__mro__ for s in getattr(c, "__slots__", ())
             if isinstance(s, str) and s not in ("__dict__", "__weakref__")]
    if d is None and not slots:
        return None
    out = dict(d) if isinstance(d, dict) else {}
    for s in slots:
        if hasattr(v, s):
            out[s] = getattr(v, s)
    return out


@functools.lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object (and the code of functions defined in it) may look up as
    globals."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names.update(_global_names(c))
    return tuple(sorted(names))


def function_key(fun: Any) -> tuple[Any, list[Any]] | None:
    """A hashable key for what `fun` computes beyond its arguments, and the objects the key
    names by identity (to keep alive with it); None where there is no cheap key.

    Example:
        >>> import jax.numpy as jnp
        >>> w = 2.0
        >>> k1 = function_key(lambda x: w * x)[0]
        >>> w = 3.0
        >>> k1 == function_key(lambda x: w * x)[0]
        False
    """
    k = _Keyer()
    try:
        return k.key(fun), k.keep
    except (_NoKey, TypeError, RecursionError):
        return None


def _aval(x: Any) -> tuple:
    a = getattr(x, "aval", None)
    if a is not None:
        return (a.shape, a.dtype, getattr(a, "weak_type", False))
    if isinstance(x, (np.ndarray, np.generic)):
        return (x.shape, x.dtype, False)
    return (type(x),)          # a Python number: weakly typed


def call_key(fun: Any, args: tuple) -> tuple[Any, list[Any]] | None:
    """The key of a call ``fun(*args)``: `function_key`, the arguments' structure, their
    traced leaves' avals and their static leaves' keys; None where there is none."""
    fk = function_key(fun)
    if fk is None:
        return None
    leaves, tree = jax.tree_util.tree_flatten(args)
    k = _Keyer()
    try:
        parts = tuple(_aval(x) if is_traced(x) else k.key(x) for x in leaves)
    except (_NoKey, TypeError, RecursionError):
        return None
    return (fk[0], tree, parts), fk[1] + k.keep


def is_eager(args: Any) -> bool:
    """Whether a call on `args` runs eagerly: no leaf is being staged into a jaxpr."""
    return not any(is_staged(x) for x in jax.tree_util.tree_leaves(args))


class _Quiet(logging.Filter):
    """Drops JAX's log of a failed host check while `compiled` runs a call it will re-run
    eagerly for the check's own error."""

    depth = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return self.depth == 0


_QUIET = _Quiet()
logging.getLogger("jax._src.debugging").addFilter(_QUIET)

_COMPILED: "OrderedDict[Any, Any]" = OrderedDict()


def _entry(key: Any, make: Callable[[], Any]) -> Any:
    hit = _COMPILED.get(key)
    if hit is None:
        hit = _COMPILED[key] = make()
        if len(_COMPILED) > _MAX_ENTRIES:
            _COMPILED.popitem(last=False)
    else:
        _COMPILED.move_to_end(key)
    return hit


def compiled(key: Any, fn: Callable, *args: Any, keep: Any = None) -> Any:
    """`fn(*args)` on array arguments as one compiled call cached on `key` (`keep` is held
    with it). A run-time check that fails inside is re-run as `fn(*args)`, so that it raises
    its own error eagerly. Arguments being staged (under `jit`) run `fn` as it is."""
    if not all(is_concrete(x) for x in jax.tree_util.tree_leaves(args)):
        return fn(*args)
    jitted = _entry(key, lambda: (keep, jax.jit(fn)))[1]
    _QUIET.depth += 1
    try:
        return jitted(*args)
    except jax.errors.JaxRuntimeError:
        pass
    finally:
        _QUIET.depth -= 1
    return fn(*args)


def cached_call(who: Any, fun: Any, impl: Callable[..., Any], args: tuple) -> Any:
    """``impl(*args)``: a transform of `fun` applied to `args` (whose leaves may be static).

    A call on concrete values whose key (`who`, the transform and its settings, and
    `call_key(fun, args)`) was seen before runs as one compiled call, traced once per key;
    the first call runs `impl` as it is (a call made once would pay a compilation for
    nothing). Calls on tracers (under `jit`, `grad`, `vmap`), and calls without a key, run
    `impl` as it is. A compiled call whose run-time
    check fails, or whose result is not finite, is re-run as `impl(*args)`: eagerly the rules
    see the values, and raise naming the step where a pivot vanished (a division by a zero
    factor that, traced, would give an infinity).

    Example:
        >>> import jax.numpy as jnp
        >>> double = lambda x: 2 * x
        >>> [cached_call("double", double, double, (jnp.ones(2),)).tolist() for _ in "ab"]
        [[2.0, 2.0], [2.0, 2.0]]
    """
    # concrete arguments only: under an eager `grad` or `vmap` the compiled call's finiteness
    # could not be read without forcing its tracers
    if not all(is_concrete(x) for x in jax.tree_util.tree_leaves(args)):
        return impl(*args)
    ck = call_key(fun, args)
    if ck is None:
        return impl(*args)
    key, keep = ck
    if (who, key) not in _SEEN:
        _SEEN[(who, key)] = keep
        if len(_SEEN) > _MAX_ENTRIES:
            _SEEN.popitem(last=False)
        return impl(*args)
    split = Filtered(tuple(args))

    def make():
        out_split: list = []

        def flat_impl(*flat):
            out = Filtered((impl(*split.rebuild(flat)),))
            out_split[:] = [out]
            return out.flat, _all_finite(out.flat)
        return keep, jax.jit(flat_impl), out_split

    _, jitted, out_split = _entry((who, key), make)
    _QUIET.depth += 1
    try:
        outs, finite = jitted(*split.flat)
    except jax.errors.JaxRuntimeError:
        return impl(*args)
    finally:
        _QUIET.depth -= 1
    if not bool(finite):
        return impl(*args)
    return out_split[0].rebuild(outs)[0]


def _all_finite(leaves: list) -> Any:
    ok = jnp.asarray(True)
    for x in leaves:
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok


_SEEN: "OrderedDict[Any, Any]" = OrderedDict()
