"""What every transform does with a user's function before walking it: normalise `argnums`,
trace the function over its flattened arguments, and check that it maps its state to the
state's structure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import ClosedJaxpr, Var, is_key, make_jaxpr, sds
from jaxrev._env import Env
from jaxrev._errors import JaxrevError
from jaxrev._evaluate import evaluate
from jaxrev._prepare import prepare

__all__ = [
    "avals_of",
    "fun_name",
    "normalize_argnums",
    "Program",
    "trace_program",
    "check_structure",
    "check_sizes",
    "is_traced",
    "traced_mask",
    "traced_leaves",
    "Filtered",
    "ravel_filtered",
    "eval_shape",
    "derived_leaves",
    "trace_on_outputs",
]


_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_NUMBERS = _ARRAYS + (bool, int, float, complex)


def is_traced(x: Any) -> bool:
    """Whether jaxrev traces a pytree leaf where it stands on its own or in a plain container
    (a tuple, list or dict): arrays (and their stand-ins), NumPy and Python numbers. Anything
    else (an Equinox module's activation function, a string, a Flax module's settings) is
    static: passed through as it is, like Equinox's filters do. Inside a module (any other
    pytree class) a Python number is static too (`traced_mask`)."""
    return isinstance(x, _NUMBERS)


def _is_module(node: Any) -> bool:
    """A pytree node that is neither a leaf nor a plain container: an Equinox module, a
    Flax struct, a registered class."""
    if node is None or isinstance(node, (tuple, list, dict)):
        return False
    return not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(node))


def traced_mask(tree: Any) -> tuple[list[Any], Any, list[bool]]:
    """`tree`'s leaves, its structure, and which leaves jaxrev traces: arrays everywhere,
    Python numbers only outside modules. A module's Python ints, floats and bools are its
    settings (a flowjax bijection's `shape`, an exponent, a flag), static as under
    `eqx.filter_jit`; a Python float passed as an argument, or in a tuple of parameters,
    is traced as `jax.jit` traces it.

    Example:
        >>> import equinox as eqx, jax.numpy as jnp
        >>> class Scale(eqx.Module):
        ...     w: jnp.ndarray
        ...     power: int = 2
        >>> traced_mask((1.0, Scale(jnp.ones(2))))[2]
        [True, True, False]
    """
    top, tree_def = jax.tree_util.tree_flatten(tree, is_leaf=_is_module)
    leaves, mask = [], []
    for t in top:
        if _is_module(t):
            inner = jax.tree_util.tree_leaves(t)
            leaves.extend(inner)
            mask.extend(isinstance(x, _ARRAYS) for x in inner)
        else:
            leaves.append(t)
            mask.append(is_traced(t))
    return leaves, jax.tree_util.tree_structure(tree), mask


def traced_leaves(tree: Any) -> list[Any]:
    """`tree`'s leaves that jaxrev traces, in order."""
    leaves, _, mask = traced_mask(tree)
    return [x for x, m in zip(leaves, mask) if m]


class Filtered:
    """A pytree split into the leaves jaxrev traces and the static rest.

    `flat` holds the traced leaves; `rebuild(flat)` puts new traced leaves back among the
    static ones; `positions(tree_part)` gives, for a sub-tree's traced leaves, their indices
    in `flat`."""

    def __init__(self, tree: Any) -> None:
        self.leaves, self.tree, self.mask = traced_mask(tree)
        self.flat = [x for x, m in zip(self.leaves, self.mask) if m]
        idx, k = [], 0
        for m in self.mask:
            idx.append(k if m else None)
            k += m
        self.index = jax.tree_util.tree_unflatten(self.tree, idx)

    def rebuild(self, flat: Sequence[Any]) -> Any:
        it = iter(flat)
        return jax.tree_util.tree_unflatten(
            self.tree, [next(it) if m else x for x, m in zip(self.leaves, self.mask)]
        )


def avals_of(xs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """Shape-dtype stand-ins for tracing, one per value (a `ShapeDtypeStruct` stands for
    itself); a value inside `shard_map` keeps the mesh axes it varies over (its vma)."""
    return [
        x
        if isinstance(x, jax.ShapeDtypeStruct)
        else sds(x)
        if isinstance(x, jax.Array)
        else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
        for x in xs
    ]


def fun_name(fun: Any) -> str:
    """`fun`'s name; a callable object's class name (a numpyro transform, a flowjax
    bijection's method holder)."""
    name = getattr(fun, "__name__", None)
    return name if isinstance(name, str) else type(fun).__name__


def normalize_argnums(
    argnums: int | Sequence[int], nargs: int, fun: Callable | None = None
) -> tuple[int, ...]:
    """`argnums` as a tuple of distinct non-negative positions; a clear error otherwise."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    name = fun_name(fun) if fun is not None else "the function"
    out = []
    for a in nums:
        if not isinstance(a, (int, np.integer)) or not -nargs <= a < nargs:
            raise ValueError(
                f"argnums {argnums!r} out of range: {name} was called with "
                f"{nargs} positional arguments"
            )
        out.append(int(a) % nargs)
    if len(set(out)) != len(out):
        raise ValueError(f"argnums {argnums!r} repeats an argument of {name}")
    return tuple(out)


@dataclass
class Program:
    """A user's function traced over its flattened arguments."""

    closed: ClosedJaxpr  # the jaxpr, one input per flat leaf
    flat: list[Any]  # the flat argument values
    state_ids: list[list[int]]  # per state argument, the flat positions of its leaves
    out_shape: Any  # the output's pytree of ShapeDtypeStructs

    @property
    def state_pos(self) -> list[int]:
        """The flat positions of the state's leaves, in the state's leaf order."""
        return [i for ids in self.state_ids for i in ids]


def eval_shape(fun: Callable, *args: Any) -> Any:
    """`jax.eval_shape(fun, *args)` where `args` may hold static leaves (functions)."""
    split = Filtered(tuple(args))
    return jax.eval_shape(lambda *flat: fun(*split.rebuild(flat)), *avals_of(split.flat))


def ravel_filtered(tree: Any) -> tuple[Any, Callable[[Any], Any]]:
    """`jax.flatten_util.ravel_pytree` of the leaves jaxrev traces; `unravel` puts the static
    leaves back (an Equinox module with its activation functions)."""
    from jax.flatten_util import ravel_pytree

    split = Filtered(tree)
    v, unravel = ravel_pytree(split.flat)
    return v, lambda u: split.rebuild(unravel(u))


def trace_program(fun: Callable, args: Sequence[Any], argnums: tuple[int, ...]) -> Program:
    """Trace `fun(*args)` with one jaxpr input per traced leaf (`is_traced`); the static
    leaves (functions, strings) are passed to `fun` as they are."""
    split = Filtered(tuple(args))

    def flat_fun(*leaves):
        return fun(*split.rebuild(leaves))

    closed, out_shape = make_jaxpr(flat_fun, *avals_of(split.flat))
    state_ids = [jax.tree_util.tree_leaves(split.index[a]) for a in argnums]
    return Program(closed, list(split.flat), state_ids, out_shape)


def trace_on_outputs(
    fun: Callable, args: Sequence[Any], argnums: tuple[int, ...], who: str
) -> Program:
    """`trace_program` for an inverse that learns its state's structure from `fun`'s output
    (the state positions of `args` hold it). A `fun` that changes structure or shapes fails
    on it, in its own code (numpyro's `ReshapeTransform`: "cannot reshape"): that is turned
    into a `ValueError` naming `fun` and saying to pass the state's structure (`state=`)."""
    try:
        return trace_program(fun, args, argnums)
    except JaxrevError:
        raise
    except Exception as e:
        name = fun_name(fun)
        raise ValueError(
            f"{who}: the inverse traces {name} on its output (held in the state positions) to "
            f"learn the state's structure, and that call failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}). Where {name} changes the state's "
            "structure or shapes (a reshape, an unpacking), pass the state's structure and "
            "shapes as `state=` (arrays or `jax.ShapeDtypeStruct`s): the inverse then takes "
            "the output as it is"
        ) from e


_STATE_HINT = (
    " (a bijection that changes structure or shapes: pass the state's structure as `state=`)"
)


def check_structure(
    fun: Callable,
    args: Sequence[Any],
    argnums: tuple[int, ...],
    out_shape: Any,
    who: str = "jaxrev.reverse",
) -> Any:
    """Check that `fun`'s output has the state's pytree structure, shapes and dtypes; returns
    the state's tree definition."""
    state = args[argnums[0]] if len(argnums) == 1 else tuple(args[a] for a in argnums)
    s_leaves, s_tree = jax.tree_util.tree_flatten(state)
    o_leaves, o_tree = jax.tree_util.tree_flatten(out_shape)
    name = fun_name(fun)
    if s_tree != o_tree:
        raise ValueError(
            f"{who}: {name} must return the structure of its state "
            f"(argnums={argnums}): expected {s_tree}, got {o_tree}{_STATE_HINT}"
        )
    for i, (s, o) in enumerate(zip(s_leaves, o_leaves)):
        if tuple(jnp.shape(s)) != tuple(o.shape) or jnp.result_type(s) != o.dtype:
            raise ValueError(
                f"{who}: {name}'s output leaf {i} is {o.dtype}{list(o.shape)} but the "
                f"state leaf is {jnp.result_type(s)}{list(jnp.shape(s))}; the output must have "
                f"the state's shapes and dtypes{_STATE_HINT}"
            )
    return s_tree


def check_sizes(
    fun: Callable,
    state_leaves: Sequence[Any],
    out_leaves: Sequence[Any],
    who: str = "jaxrev.reverse",
) -> None:
    """A bijection that changes structure or shapes must keep the number of elements of each
    dtype: raise `ValueError` naming `fun` otherwise."""

    def count(leaves):
        out: dict = {}
        for x in leaves:
            dt = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
            dt = dt if is_key(dt) else np.dtype(dt)  # numpy has no PRNG key dtype
            out[dt] = out.get(dt, 0) + int(
                np.prod(np.shape(x) if not hasattr(x, "shape") else x.shape, dtype=np.int64)
            )
        return out

    s, o = count(state_leaves), count(out_leaves)
    if s != o:
        show = lambda c: ", ".join(f"{n} {dt.name}" for dt, n in c.items())  # noqa: E731
        raise ValueError(
            f"{who}: {fun_name(fun)} maps a state of {show(s)} elements to an "
            f"output of {show(o)}: a bijection keeps the number of elements of "
            "each dtype"
        )


def derived_leaves(
    step: Callable, carry: Any
) -> tuple[list[int], Callable[[Sequence[Any]], list[Any]]]:
    """The leaves of a loop body's carry that the body computes from its other output leaves
    alone, and a function that computes them from the other leaves of a carry.

    A loop need not carry such a leaf: it is a function of the rest, so carrying it only
    makes the step lose information (the value it overwrites). diffrax's `ReversibleHeun`
    carries ``(yhat, f(t, yhat))`` to save a vector-field evaluation; its step inverts only
    once ``f(t, yhat)`` is seen as what it is. A leaf whose computation reads another derived
    leaf is kept, so the rest can be computed in one pass.

    Returns (indices of the derived leaves of `jax.tree_util.tree_leaves(carry)`, `fill`):
    ``fill(leaves)`` returns the leaves with the derived ones recomputed from the others.
    """
    leaves, tree = jax.tree_util.tree_flatten(carry)
    closed, _ = make_jaxpr(
        lambda *xs: jax.tree_util.tree_leaves(step(jax.tree_util.tree_unflatten(tree, xs))), *leaves
    )
    # merged duplicates: the counter's `k + 1` read by the time and the one carried are one
    closed = prepare(closed)
    j = closed.jaxpr
    outs, ins = j.outvars, set(j.invars)
    made = {o: e for e in j.eqns for o in e.outvars}
    slices: dict[int, tuple[list, dict]] = {}
    for k, o in enumerate(outs):
        if not isinstance(o, Var) or o in ins:
            continue
        boundary = {}
        for s, v in enumerate(outs):
            if s != k and isinstance(v, Var) and v is not o:
                boundary.setdefault(v, s)
        eqns, reads, todo, seen, ok = [], {}, [o], set(), True
        while todo and ok:
            v = todo.pop()
            if not isinstance(v, Var) or v in seen:
                continue
            seen.add(v)
            if v in boundary:
                reads[v] = boundary[v]
            elif v in ins:
                ok = False
            elif v in made:
                e = made[v]
                if e not in eqns:
                    if e.effects:
                        ok = False
                    eqns.append(e)
                    todo.extend(e.invars)
        # an equation of the slice that also makes a value read across the boundary would
        # overwrite the carry's value with the body's own
        ok = ok and not any(o in reads for e in eqns for o in e.outvars)
        if ok:
            order = {id(e): n for n, e in enumerate(j.eqns)}
            slices[k] = (sorted(eqns, key=lambda e: order[id(e)]), reads)
    derived = set(slices)
    while any(set(slices[k][1].values()) & derived for k in derived):
        derived = {k for k in derived if not set(slices[k][1].values()) & derived}

    def fill(xs: Sequence[Any]) -> list[Any]:
        xs = list(xs)
        for k in sorted(derived):
            eqns, reads = slices[k]
            env = Env()
            for v, c in zip(j.constvars, closed.consts):
                env.write(v, c)
            for v, s in reads.items():
                env.write(v, xs[s])
            evaluate(eqns, env)
            xs[k] = env.read(outs[k])
        return xs

    return sorted(derived), fill
