"""What every transform does with a user's function before walking it: normalise `argnums`,
trace the function over its flattened arguments, and check that it maps its state to the
state's structure."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import ClosedJaxpr, make_jaxpr

__all__ = ["avals_of", "fun_name", "normalize_argnums", "Program", "trace_program",
           "check_structure", "check_sizes"]


def avals_of(xs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    """Shape-dtype stand-ins for tracing, one per value (a `ShapeDtypeStruct` stands for
    itself)."""
    return [x if isinstance(x, jax.ShapeDtypeStruct)
            else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in xs]


def fun_name(fun: Any) -> str:
    return getattr(fun, "__name__", repr(fun))


def normalize_argnums(argnums: int | Sequence[int], nargs: int,
                      fun: Callable | None = None) -> tuple[int, ...]:
    """`argnums` as a tuple of distinct non-negative positions; a clear error otherwise."""
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    name = fun_name(fun) if fun is not None else "the function"
    out = []
    for a in nums:
        if not isinstance(a, (int, np.integer)) or not -nargs <= a < nargs:
            raise ValueError(f"argnums {argnums!r} out of range: {name} was called with "
                             f"{nargs} positional arguments")
        out.append(int(a) % nargs)
    if len(set(out)) != len(out):
        raise ValueError(f"argnums {argnums!r} repeats an argument of {name}")
    return tuple(out)


@dataclass
class Program:
    """A user's function traced over its flattened arguments."""

    closed: ClosedJaxpr          # the jaxpr, one input per flat leaf
    flat: list[Any]              # the flat argument values
    state_ids: list[list[int]]   # per state argument, the flat positions of its leaves
    out_shape: Any               # the output's pytree of ShapeDtypeStructs

    @property
    def state_pos(self) -> list[int]:
        """The flat positions of the state's leaves, in the state's leaf order."""
        return [i for ids in self.state_ids for i in ids]


def trace_program(fun: Callable, args: Sequence[Any], argnums: tuple[int, ...]) -> Program:
    """Trace `fun(*args)` with one jaxpr input per flat leaf."""
    flat, in_tree = jax.tree_util.tree_flatten(tuple(args))

    def flat_fun(*leaves):
        return fun(*jax.tree_util.tree_unflatten(in_tree, list(leaves)))

    closed, out_shape = make_jaxpr(flat_fun, *avals_of(flat))
    marks = jax.tree_util.tree_unflatten(in_tree, list(range(len(flat))))
    state_ids = [jax.tree_util.tree_leaves(marks[a]) for a in argnums]
    return Program(closed, list(flat), state_ids, out_shape)


def check_structure(fun: Callable, args: Sequence[Any], argnums: tuple[int, ...],
                    out_shape: Any, who: str = "jaxrev.reverse") -> Any:
    """Check that `fun`'s output has the state's pytree structure, shapes and dtypes; returns
    the state's tree definition."""
    state = args[argnums[0]] if len(argnums) == 1 else tuple(args[a] for a in argnums)
    s_leaves, s_tree = jax.tree_util.tree_flatten(state)
    o_leaves, o_tree = jax.tree_util.tree_flatten(out_shape)
    name = fun_name(fun)
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


def check_sizes(fun: Callable, state_leaves: Sequence[Any], out_leaves: Sequence[Any],
                who: str = "jaxrev.reverse") -> None:
    """A bijection that changes structure or shapes must keep the number of elements of each
    dtype: raise `ValueError` naming `fun` otherwise."""
    def count(leaves):
        out: dict = {}
        for x in leaves:
            dt = np.dtype(x.dtype if hasattr(x, "dtype") else jnp.result_type(x))
            out[dt] = out.get(dt, 0) + int(np.prod(np.shape(x) if not hasattr(x, "shape")
                                                    else x.shape, dtype=np.int64))
        return out
    s, o = count(state_leaves), count(out_leaves)
    if s != o:
        show = lambda c: ", ".join(f"{n} {dt.name}" for dt, n in c.items())  # noqa: E731
        raise ValueError(f"{who}: {fun_name(fun)} maps a state of {show(s)} elements to an "
                         f"output of {show(o)}: a bijection keeps the number of elements of "
                         "each dtype")
