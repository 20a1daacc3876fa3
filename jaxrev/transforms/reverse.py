"""`jr.reverse`: run a traced JAX program backwards (NiLang's `~f`).

The program is traced once; the walker (`_walker.propagate`) then recovers the state from the
outputs with the inverse rules of `registry.inverse_rules` (those of `rules`, the loop and
branch rule modules, and the user's). A rule raises `Lossy` where its step destroys
information, which becomes a `NotInvertibleError` naming the primitive and the user's line.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from jaxrev._compat import Jaxpr, JaxprEqn, Var
from jaxrev._jaxpr import Env, Unknown
from jaxrev._program import check_structure, normalize_argnums, trace_program
from jaxrev.transforms._walker import propagate, raise_stuck, seed
from jaxrev.transforms.nonlinear import ON_FAILURE, settings
# the names rule authors use, importable from here as the docs say
from jaxrev.transforms.registry import (Lossy, NeedMore, inverse_jvp_rules,  # noqa: F401
                                        inverse_rules, join_rules, register_inverse,
                                        register_inverse_jvp)

__all__ = ["reverse", "invert_call", "Inverted", "register_inverse", "register_inverse_jvp",
           "inverse_rules", "inverse_jvp_rules", "join_rules", "Lossy", "NeedMore"]


@dataclass
class Inverted:
    """The result of inverting one call: the state, and the walker's jaxpr and values."""

    state: Any
    jaxpr: Jaxpr
    env: Env


def invert_call(fun: Callable, args: Sequence[Any], argnums: int | Sequence[int],
                on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
                on_failure: str = "raise") -> Inverted:
    """Recover the state of `fun(*args)` from the outputs held in the state positions."""
    argnums = normalize_argnums(argnums, len(args), fun)
    prog = trace_program(fun, args, argnums)
    s_tree = check_structure(fun, args, argnums, prog.out_shape)
    state_pos = prog.state_pos
    ins = list(prog.flat)
    for i in state_pos:
        ins[i] = Unknown(prog.closed.jaxpr.invars[i].aval)
    ys = [prog.flat[i] for i in state_pos]  # the state positions hold the outputs
    jaxpr, env, _ = seed(prog.closed, ins, ys)
    goals = [jaxpr.invars[i] for i in state_pos]  # in the state's leaf order
    with settings(on_failure=on_failure):
        stuck = propagate(jaxpr, env, goals, on_invert=on_invert)
    missing = [k for k, g in enumerate(goals) if not env.known(g)]
    if missing:
        raise_stuck(stuck, f"state leaf {missing[0]} of {len(goals)}")
    vals = [env.read(g) for g in goals]
    return Inverted(jax.tree_util.tree_unflatten(s_tree, vals), jaxpr, env)


def reverse(fun: Callable, argnums: int | Sequence[int] = 0, *,
            on_failure: str = "raise") -> Callable:
    """Return the inverse of `fun` in the arguments at `argnums` (the state).

    `fun(*args)` must return the state's pytree structure, shapes and dtypes; the other
    arguments are read-only parameters. The inverse has `fun`'s signature with the outputs in the
    state positions: ``reverse(f)(f(x, theta), theta) == x``. Raises `NotInvertibleError` at
    trace time, naming the primitive and source line, where the program loses information.
    Groups of equations invertible only together and not affine are solved by Newton's method
    (a local inverse, DESIGN.md §3.6); where it misses its tolerance, `on_failure="raise"`
    raises `ReversibilityError` naming the group's line (under `jit`, when the program runs)
    and `on_failure="nan"` returns NaN there.

    Example:
        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x, w: jnp.cumsum(x * w) + 1.0
        >>> x, w = jnp.arange(3.0), jnp.array([1.0, 2.0, 4.0])
        >>> jr.reverse(f)(f(x, w), w).tolist()
        [0.0, 1.0, 2.0]
    """

    if on_failure not in ON_FAILURE:
        raise ValueError(f"jaxrev.reverse: on_failure must be one of {ON_FAILURE}, got "
                         f"{on_failure!r}")

    @functools.wraps(fun)
    def inv(*args: Any) -> Any:
        return invert_call(fun, args, argnums, on_failure=on_failure).state

    inv.__name__ = f"reverse({getattr(fun, '__name__', 'fun')})"
    return inv
