"""Eager calls cached like `jax.jit`'s.

A transform called on concrete values (or under an eager `grad` / `vmap`) would otherwise
trace the user's function, walk it and run the result operation by operation on every call.
Here such a call is keyed on the function, the argument structure, the traced leaves' avals and
the static leaves, as `jax.jit` keys its calls, and runs as one compiled call, traced once.

`jax.jit` assumes the function reads nothing but its arguments; an eager call of a jaxrev
transform promises no such thing, so the key also holds what the function can read besides
its arguments (`function_key`): its code, its closure cells, its defaults, the globals its
code names, a bound method's object, an object's attributes and its class's, recursively. A
value is keyed by identity where it cannot change (a JAX array, a module, a library's
function or class), by value where it can (a NumPy array's bytes, an object's attributes, a
set's elements); where it cannot be keyed cheaply (a tracer, a NumPy array over 64 KB, a
random generator, an extension object whose state is hidden, a deep object) there is no key
and the call runs as it would without the cache. So a changed closure, attribute or array
(even one changed in place) gives a new key, never a stale answer. A module's attributes
are keyed by the module's identity: monkeypatching a library function between calls is not
seen, nor is NumPy's global random state (as with `jax.jit`). Objects a key names by
identity are held by weak reference: an entry whose object died is dropped, and entries
do not keep arrays alive.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import logging
import sys
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import is_concrete, is_staged, tracing
from jaxrev._errors import JaxrevError
from jaxrev._program import Filtered, traced_mask
from jaxrev._runtime import checked_jit, raise_runtime_errors, runtime_error

__all__ = [
    "function_key",
    "call_key",
    "compiled",
    "cached_call",
    "is_eager",
    "alive",
    "Cache",
    "memo",
]

_MAX_ENTRIES = 256
_MAX_NODES = 4000  # values visited per key: past it, no key
_MAX_DEPTH = 32  # (a flowjax flow nests its modules about 10 deep)
_MAX_BYTES = 1 << 16  # NumPy arrays hashed by value up to this size


class _NoKey(Exception):
    pass


_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, np.dtype, type(Ellipsis))


class _Keyer:
    """Builds a hashable key for values a function may read. `keep` holds what the key names
    by identity: weak references where the object allows them (an entry whose object died is
    stale: `alive`), the object itself otherwise; `seen` holds every object visited, so that
    no id is reused by another object while the key is built."""

    def __init__(self) -> None:
        self.keep: list[Any] = []
        self.nodes = 0
        self.seen: dict[int, tuple[int, Any]] = {}

    def ident(self, v: Any) -> tuple:
        try:
            self.keep.append(weakref.ref(v))
        except TypeError:  # code objects, builtins: small and long-lived
            self.keep.append(v)
        return ("id", id(v))

    def key(self, v: Any, depth: int = 0) -> Any:
        self.nodes += 1
        if self.nodes > _MAX_NODES or depth > _MAX_DEPTH:
            raise _NoKey
        if isinstance(v, _IMMUTABLE):
            return (type(v), v)
        if isinstance(v, (jax.core.Tracer, np.random.Generator, np.random.RandomState)):
            raise _NoKey  # a value known only when run; a state each draw changes
        if isinstance(v, jax.Array):
            return self.ident(v)
        if isinstance(v, np.ndarray):
            if v.nbytes > _MAX_BYTES or v.dtype == object:
                raise _NoKey
            return (
                "np",
                v.shape,
                v.dtype.str,
                hashlib.sha1(np.ascontiguousarray(v).tobytes()).hexdigest(),
            )
        if isinstance(v, np.generic):
            return ("npg", v.dtype.str, v.item())
        if isinstance(v, (bytearray, memoryview)):
            return ("bytes", bytes(v))
        if isinstance(v, (types.ModuleType, types.BuiltinFunctionType, np.ufunc)):
            return self.ident(v)
        if id(v) in self.seen:  # a cycle, or a value shared by two paths
            return ("seen", self.seen[id(v)][0])
        self.seen[id(v)] = (len(self.seen), v)
        if isinstance(v, type):
            return self.cls(v, depth)
        if isinstance(v, (tuple, list, collections.deque)):
            return (type(v), tuple(self.key(x, depth + 1) for x in v))
        if isinstance(v, (set, frozenset)):
            return (type(v), tuple(sorted((self.key(x, depth + 1) for x in v), key=repr)))
        if isinstance(v, dict):
            return (type(v), self.items(v, depth))
        if isinstance(v, types.FunctionType):
            if _library(v) and not v.__closure__:
                return self.ident(v)
            return self.function(v, depth)
        if isinstance(v, types.MethodType):
            return ("method", self.key(v.__func__, depth + 1), self.key(v.__self__, depth + 1))
        if isinstance(v, functools.partial):
            return (
                "partial",
                self.key(v.func, depth + 1),
                self.key(v.args, depth + 1),
                self.key(v.keywords, depth + 1),
            )
        if _library(v) and hasattr(v, "__qualname__"):
            return self.ident(v)  # a library's function (`jnp.tanh`, `jax.nn.relu`)
        attrs = _attributes(v)
        if attrs is None:
            if _library(v):  # a library's object with no state of its own
                return self.ident(v)
            raise _NoKey  # an extension type whose state cannot be seen
        return (self.key(type(v), depth + 1), self.items(attrs, depth))

    def items(self, d: dict, depth: int) -> tuple:
        return tuple((self.key(k, depth + 1), self.key(x, depth + 1)) for k, x in d.items())

    def cls(self, c: type, depth: int) -> tuple:
        """A class: a library's by identity; a user's also by its attributes (a class-level
        setting changed between calls) and its bases'."""
        if _library(c) or c.__module__ == "builtins":
            return self.ident(c)
        own = {}
        for k, x in vars(c).items():
            if (k.startswith("__") and k.endswith("__")) or isinstance(x, _SLOTS):
                continue
            if k == "_abc_impl":  # an ABC's registry (a subclass cache), not the user's state
                continue
            if isinstance(x, property):
                x = (x.fget, x.fset)
            elif isinstance(x, (staticmethod, classmethod)):
                x = x.__func__
            own[k] = x
        return (
            "cls",
            self.ident(c),
            self.items(own, depth),
            tuple(self.key(b, depth + 1) for b in c.__bases__),
        )

    def function(self, fn: types.FunctionType, depth: int) -> tuple:
        cells = tuple(
            self.key(c.cell_contents, depth + 1) if _filled(c) else ("empty",)
            for c in fn.__closure__ or ()
        )
        glob = fn.__globals__
        names = tuple(
            (n, self.key(glob[n], depth + 1)) for n in _global_names(fn.__code__) if n in glob
        )
        return (
            "fn",
            self.ident(fn.__code__),
            cells,
            self.key(fn.__defaults__, depth + 1),
            self.key(fn.__kwdefaults__, depth + 1),
            names,
        )


_SLOTS = (types.MemberDescriptorType, types.GetSetDescriptorType)


def alive(keep: list) -> bool:
    """Whether every object a key names by identity still lives (so its id is still its)."""
    return all(r() is not None for r in keep if isinstance(r, weakref.ref))


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


_LIBRARIES = frozenset(
    {
        "jax",
        "jaxlib",
        "numpy",
        "jaxrev",
        "equinox",
        "flax",
        "diffrax",
        "optax",
        "lineax",
        "optimistix",
        "scipy",
        "functools",
        "math",
        "builtins",
    }
)


def _library(v: Any) -> bool:
    """Whether `v` (a function, class or object) is defined by a library: its functions and
    classes are keyed by identity, as its modules are; its objects (an `eqx.nn.Lambda`, a
    diffrax term, an nnx module) by their attributes, which may hold the user's code. A
    library is one of `_LIBRARIES` or a package installed in site-packages (flowjax,
    paramax, numpyro: keyed by their attributes, their classes' methods and the globals
    those name ran past `_MAX_NODES`, so an eager call on a flowjax flow had no key)."""
    mod = getattr(v, "__module__", None)
    return isinstance(mod, str) and _installed(mod.split(".", 1)[0])


@functools.lru_cache(maxsize=1024)
def _installed(root: str) -> bool:
    if root in _LIBRARIES:
        return True
    path = getattr(sys.modules.get(root), "__file__", None) or ""
    return any(part in ("site-packages", "dist-packages") for part in Path(path).parts)


def _attributes(v: Any) -> dict | None:
    """An object's state: its `__dict__` and slots; None where it has neither."""
    d = getattr(v, "__dict__", None)
    slots = [
        s
        for c in type(v).__mro__
        for s in getattr(c, "__slots__", ())
        if isinstance(s, str) and s not in ("__dict__", "__weakref__")
    ]
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
        >>> def scaled(w):
        ...     return lambda x: w * x
        >>> function_key(scaled(2.0))[0] == function_key(scaled(2.0))[0]
        True
        >>> function_key(scaled(2.0))[0] == function_key(scaled(3.0))[0]
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
    return (type(x),)  # a Python number: weakly typed


def call_key(fun: Any, args: tuple) -> tuple[Any, list[Any]] | None:
    """The key of a call ``fun(*args)``: `function_key`, the arguments' structure, their
    traced leaves' avals and their static leaves' keys; None where there is none."""
    fk = function_key(fun)
    if fk is None:
        return None
    leaves, tree, mask = traced_mask(args)
    k = _Keyer()
    try:
        parts = tuple(_aval(x) if m else k.key(x) for x, m in zip(leaves, mask))
    except (_NoKey, TypeError, RecursionError):
        return None
    return (fk[0], tree, parts), fk[1] + k.keep


def is_eager(args: Any) -> bool:
    """Whether a call on `args` runs eagerly: no leaf is being staged into a jaxpr."""
    return not any(is_staged(x) for x in jax.tree_util.tree_leaves(args))


class _Quiet(logging.Filter):
    """Drops JAX's log of a failed host check while a compiled call runs that will be re-run
    eagerly for the check's own error."""

    depth = 0

    def filter(self, record: logging.LogRecord) -> bool:
        return self.depth == 0


_QUIET = _Quiet()
logging.getLogger("jax._src.debugging").addFilter(_QUIET)


class Cache:
    """A least-recently-used map whose entries hold the `keep` list of their key: an entry one
    of whose objects died is dropped (its id may now be another object's)."""

    def __init__(self, size: int = _MAX_ENTRIES) -> None:
        self.size = size
        self.entries: OrderedDict[Any, tuple[list, Any]] = OrderedDict()

    def get(self, key: Any) -> Any:
        hit = self.entries.get(key)
        if hit is None:
            return None
        if not alive(hit[0]):
            del self.entries[key]
            return None
        self.entries.move_to_end(key)
        return hit[1]

    def drop(self, key: Any) -> None:
        self.entries.pop(key, None)

    def put(self, key: Any, keep: list, value: Any) -> Any:
        self.entries[key] = (keep, value)
        if len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return value


_COMPILED = Cache()
_SEEN = Cache()
_EAGER_ONLY = Cache()  # keys whose traced call raised: run eagerly
_MEMOS: dict[str, Cache] = {}


def memo(name: str, size: int = _MAX_ENTRIES) -> Cache:
    """The process-wide cache called `name` (created with `size` entries on first use). The
    transforms keep no state of their own: what they memoize (traces, plans) lives here,
    keyed on everything that decides the result, so no walk depends on what ran before it."""
    cache = _MEMOS.get(name)
    if cache is None:
        cache = _MEMOS[name] = Cache(size)
    return cache


def _run_quietly(jitted: Callable, *args: Any, block: bool = False) -> tuple[bool, Any]:
    """``(True, jitted(*args))``, or ``(False, None)`` where a run-time check failed inside
    (JAX's log of the failure is dropped, and the check's error taken out of the stash of
    `_runtime`: the caller re-runs the call for its own error). `jitted` (a `_runtime.checked_jit`
    function) waits for its result where its program holds a check, so that a failure an
    accelerator reports late is caught here too; `block` waits for every result."""
    _QUIET.depth += 1
    try:
        out = jitted(*args)
        return True, jax.block_until_ready(out) if block else out
    except Exception as e:
        # (a failed host callback comes as JAX's `JaxRuntimeError`, or a `ValueError` on
        # some JAX versions and platforms: either carries the check's token)
        if runtime_error(e) is None:  # the stashed error, not raised: the eager re-run raises it
            raise
        return False, None
    finally:
        _QUIET.depth -= 1


def compiled(key: Any, fn: Callable, *args: Any) -> Any:
    """`fn(*args)` on concrete arrays as one compiled call cached on `key` (which holds what
    it names). A run-time check that fails inside is re-run as `fn(*args)`, so that it raises
    its own error eagerly (and the call waits for its result where its program holds a
    check: the error never reaches the caller later as JAX's runtime error). Traced
    arguments (under `jit`) run `fn` as it is. Without a `key` (None), compiled for this call
    alone: `fn` closes over values that no key could name (a loop body's walk, compiled in
    place of running it operation by operation, each operation compiled apart)."""
    if tracing() or not all(is_concrete(x) for x in jax.tree_util.tree_leaves(args)):
        return fn(*args)
    if key is None:
        jitted = checked_jit(fn, convert=False)
    else:
        jitted = _COMPILED.get(key) or _COMPILED.put(key, [], checked_jit(fn, convert=False))
    ok, out = _run_quietly(jitted, *args)
    return out if ok else _eager(fn, *args)


def _eager(fn: Callable, *args: Any) -> Any:
    """`fn(*args)` eagerly (a first call, or a compiled call that failed a check): a check
    outside any loop raises its own error at once; one inside a loop still runs compiled
    (JAX compiles loops even eagerly), and its runtime error is converted to the check's
    documented error, never left as JAX's `JaxRuntimeError`."""
    with raise_runtime_errors():
        return fn(*args)


def cached_call(who: Any, fun: Any, impl: Callable[..., Any], args: tuple) -> Any:
    """``impl(*args)``: a transform of `fun` applied to `args` (whose leaves may be static).

    An eager call (no transformation tracing, concrete arguments) whose key (`who`, the
    transform and its settings, and `call_key(fun, args)`) was seen before runs as one
    compiled call, traced once per key; the first call runs `impl` as it is. (Compiled from
    the first call, a spline flow's inverse would take a third of its first call's time, run
    operation by operation it compiles each operation apart; but a loop that calls the
    transform with new weights each time, as training does, would then compile on every call
    and keep every step's weights alive in its compiled entry.) Other calls, and calls
    without a key, run `impl` as it is. A compiled call whose run-time check fails, or whose
    result is not finite, is re-run as `impl(*args)`: eagerly the rules see the values, and
    raise naming the step where a pivot vanished (a division by a zero factor that, traced,
    would give an infinity). A key whose traced call raises a jaxrev error runs eagerly from
    then on: on values its walk may go where a traced walk cannot (a branch taken on a known
    predicate), and where it cannot either, the eager run raises its own error.

    Example:
        >>> import jax.numpy as jnp
        >>> double = lambda x: 2 * x
        >>> [cached_call("double", double, double, (jnp.ones(2),)).tolist() for _ in "ab"]
        [[2.0, 2.0], [2.0, 2.0]]
    """
    if tracing() or not all(is_concrete(x) for x in jax.tree_util.tree_leaves(args)):
        return impl(*args)
    ck = call_key(fun, args)
    if ck is None:
        return _eager(impl, *args)
    key, keep = (who, ck[0]), ck[1]
    if _EAGER_ONLY.get(key) is not None:
        return _eager(impl, *args)
    if _SEEN.get(key) is None:
        _SEEN.put(key, keep, True)
        return _eager(impl, *args)
    split = Filtered(tuple(args))
    hit = _COMPILED.get(key)
    if hit is None:
        out_split: list = []

        def flat_impl(*flat):
            out = Filtered((impl(*split.rebuild(flat)),))
            out_split[:] = [out]
            return out.flat, _all_finite(out.flat)

        hit = _COMPILED.put(key, keep, (checked_jit(flat_impl, convert=False), out_split))
    jitted, out_split = hit
    try:
        ok, res = _run_quietly(jitted, *split.flat, block=True)
    except JaxrevError:
        _COMPILED.drop(key)
        _EAGER_ONLY.put(key, keep, True)
        return _eager(impl, *args)
    if not ok or not bool(res[1]):
        return _eager(impl, *args)
    return out_split[0].rebuild(res[0])[0]


def _all_finite(leaves: list) -> Any:
    ok = jnp.asarray(True)
    for x in leaves:
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            ok = ok & jnp.all(jnp.isfinite(x))
    return ok
