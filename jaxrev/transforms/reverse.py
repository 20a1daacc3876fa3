"""`jr.reverse`: run a traced JAX program backwards (NiLang's `~f`).

The program is traced once; the walker (`walker.propagate`) then recovers the state from the
outputs with the inverse rules of `registry.inverse_rules` (those of `rules`, the loop and
branch rule modules, and the user's), in a walk context made from the call's own settings
(`knowledge.context`). A rule raises `Lossy` where its step destroys information, which
becomes a `NotInvertibleError` naming the primitive and the user's line.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._cache import cached_call
from jaxrev._compat import Jaxpr, JaxprEqn, Var, is_concrete
from jaxrev._env import Env, Unknown
from jaxrev._program import (
    check_sizes,
    check_structure,
    fun_name,
    normalize_argnums,
    trace_on_outputs,
    trace_program,
)
from jaxrev.transforms.custom import custom_inverse
from jaxrev.transforms.knowledge.context import Settings, WalkContext, resolve_on_error
from jaxrev.transforms.propagation.walker import propagate, raise_stuck, seed

# the names rule authors use, importable from here as the docs say
from jaxrev.transforms.registry import (
    Lossy,
    NeedMore,
    element_rules,  # noqa: F401
    inverse_jvp_rules,
    inverse_rules,
    register_inverse,
    register_inverse_jvp,
)

__all__ = [
    "reverse",
    "reverse_with",
    "invert_call",
    "Inverted",
    "state_args",
    "register_inverse",
    "register_inverse_jvp",
    "inverse_rules",
    "inverse_jvp_rules",
    "element_rules",
    "Lossy",
    "NeedMore",
]


@dataclass
class Inverted:
    """The result of inverting one call: the state, and the walker's jaxpr and values."""

    state: Any
    jaxpr: Jaxpr
    env: Env


def invert_call(
    fun: Callable,
    args: Sequence[Any],
    argnums: int | Sequence[int],
    on_invert: Callable[[JaxprEqn, list[Var]], None] | None = None,
    settings: Settings = Settings(),
    state: Any = None,
) -> Inverted:
    """Recover the state of `fun` from its outputs: held in the state positions of `args`
    (`state` None: the outputs have the state's structure), or, with `state` (the state's
    structure, shapes and dtypes), as one argument in the first state position. The walk's
    context is made here, from `settings` (the calling transform's)."""
    if state is None:
        hint = getattr(fun, "_jaxrev_inverse_of", None)
        if hint is not None and isinstance(argnums, int):
            state = _state_of_inverse(hint, args, argnums)
    if state is None:
        argnums = normalize_argnums(argnums, len(args), fun)
        prog = trace_on_outputs(fun, args, argnums, settings.who)
        s_tree = check_structure(fun, args, argnums, prog.out_shape, who=settings.who)
        ys = [prog.flat[i] for i in prog.state_pos]  # the state positions hold the outputs
    else:
        fun_args, argnums, y = state_args(fun, args, argnums, state)
        prog = trace_program(fun, fun_args, argnums)
        s_tree = jax.tree_util.tree_structure(
            fun_args[argnums[0]] if len(argnums) == 1 else tuple(fun_args[a] for a in argnums)
        )
        ys = jax.tree_util.tree_leaves(y)
        want = jax.tree_util.tree_leaves(prog.out_shape)
        check_sizes(fun, [prog.flat[i] for i in prog.state_pos], want)
        if jax.tree_util.tree_structure(y) != jax.tree_util.tree_structure(prog.out_shape) or any(
            tuple(jnp.shape(a)) != tuple(b.shape) for a, b in zip(ys, want)
        ):
            raise ValueError(
                f"jaxrev.reverse: the inverse of {fun_name(fun)} takes {fun_name(fun)}'s output "
                f"in the state position ({jax.tree_util.tree_structure(prog.out_shape)} with "
                f"shapes {[tuple(b.shape) for b in want]}), got "
                f"{jax.tree_util.tree_structure(y)} with shapes "
                f"{[tuple(jnp.shape(a)) for a in ys]}"
            )
    state_pos = prog.state_pos
    ins = list(prog.flat)
    for i in state_pos:
        ins[i] = Unknown(prog.closed.jaxpr.invars[i].aval)
    jaxpr, env, _ = seed(prog.closed, ins, ys, ctx=WalkContext(settings))
    goals = [jaxpr.invars[i] for i in state_pos]  # in the state's leaf order
    stuck = propagate(jaxpr, env, goals, on_invert=on_invert)
    missing = [k for k, g in enumerate(goals) if not env.known(g)]
    if missing:
        raise_stuck(stuck, f"state leaf {missing[0]} of {len(goals)}", settings.who)
    vals = [env.read(g) for g in goals]
    return Inverted(jax.tree_util.tree_unflatten(s_tree, vals), jaxpr, env)


def state_args(
    fun: Callable, args: Sequence[Any], argnums: int | Sequence[int], state: Any
) -> tuple[list, tuple[int, ...], Any]:
    """`fun`'s arguments (the state as shape-dtype stand-ins) and its output, from the
    inverse's arguments: `fun`'s with the output in the first state position and the other
    state positions left out."""
    p = 1 if isinstance(argnums, int) else len(argnums)
    nums = normalize_argnums(argnums, len(args) + p - 1, fun)
    parts = [state] if isinstance(argnums, int) else list(state)
    if len(parts) != p:
        raise ValueError(
            f"jaxrev.reverse: state must hold one entry per state argument "
            f"(argnums={argnums!r}), got {len(parts)}"
        )
    it = iter(args)
    fun_args: list[Any] = []
    y = None
    for q in range(len(args) + p - 1):
        if q in nums:
            fun_args.append(
                jax.tree_util.tree_map(
                    lambda s: jax.ShapeDtypeStruct(
                        jnp.shape(s) if not hasattr(s, "shape") else s.shape,
                        s.dtype if hasattr(s, "dtype") else jnp.result_type(s),
                    ),
                    parts[nums.index(q)],
                )
            )
            if q == nums[0]:
                y = next(it)
        else:
            fun_args.append(next(it))
    return fun_args, nums, y


def _state_of_inverse(hint: tuple, args: Sequence[Any], argnums: int) -> Any:
    """The state of `reverse(f, state=...)` (its single state argument: `f`'s output) is the
    structure of `f`'s output on `f`'s state, which the call's state position holds."""
    fun, f_argnums, f_state = hint
    if f_state is None:
        return None
    p = 1 if isinstance(f_argnums, int) else len(f_argnums)
    x = args[argnums]
    xs = [x] if isinstance(f_argnums, int) else list(x)
    nums = normalize_argnums(f_argnums, len(args) + p - 1, fun)
    it = iter([a for k, a in enumerate(args) if k != argnums])
    fun_args = [xs[nums.index(q)] if q in nums else next(it) for q in range(len(args) + p - 1)]
    return jax.eval_shape(fun, *fun_args)


def reverse(
    fun: Callable,
    argnums: int | Sequence[int] = 0,
    *,
    on_error: str | None = None,
    state: Any = None,
) -> Callable:
    """Return the inverse of `fun` in the arguments at `argnums` (the state).

    `fun(*args)` returns a pytree with the state's structure, shapes and dtypes; the other
    arguments are read-only parameters. The program is traced once and run backwards step by
    step (NiLang's ``~f``). Where a step loses information, `NotInvertibleError` is raised when
    traced, naming the primitive and the source line.

    Groups of equations that are invertible only together and not affine are solved by Newton's
    method (a local inverse, docs/design.md §3.6). Where it misses its tolerance, or no branch
    of a state-dependent choice is consistent, `on_error` decides what happens.

    **Arguments:**

    - `fun`: the function to invert, of positional arguments; traceable by JAX.
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments; the
      others are parameters, passed to the inverse as they are.
    - `on_error`: "raise" (the default: a `jr.ReversibilityError` naming the line; under `jit`
      when the program runs), "nan" (NaN where the inverse failed) or "warn" (NaN and a
      `jr.FailureWarning`; under `jit` when the program runs).
    - `state`: for a `fun` that changes structure or shapes (a reshape, two state arrays
      concatenated into one, one split into several; it must keep the number of elements of
      each dtype): the state's structure and shapes, as arrays or `jax.ShapeDtypeStruct`s (the
      state argument for an int `argnums`, the tuple of them for a tuple). None (the default):
      `fun`'s output has the state's structure.

    **Returns:**

    The inverse, a function with `fun`'s signature and `fun`'s outputs in the state positions:
    ``reverse(f)(f(x, theta), theta) == x``; it returns the state (a tuple of the state
    arguments for a tuple `argnums`). With `state`, the inverse takes `fun`'s whole output as
    one argument in the first state position (the other state positions are left out) and
    returns the state in its own structure. The inverse can be jitted, vmapped, differentiated
    and inverted again (``reverse(reverse(f))`` is `f`).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x, w: jnp.cumsum(x * w) + 1.0
        >>> x, w = jnp.arange(3.0), jnp.array([1.0, 2.0, 4.0])
        >>> jr.reverse(f)(f(x, w), w).tolist()
        [0.0, 1.0, 2.0]
        >>> g = lambda a, b: jnp.concatenate([a, b * 2.0])   # two arrays into one
        >>> a, b = jnp.ones(2), jnp.arange(3.0)
        >>> jr.reverse(g, (0, 1), state=(a, b))(g(a, b))[1].tolist()
        [0.0, 1.0, 2.0]
    """
    who = "jaxrev.reverse"
    on_error = resolve_on_error(who, on_error)
    return reverse_with(fun, Settings(who, on_error), argnums, state, closed=True)


def _as_one_step(walk: Callable, fun: Callable, args: tuple, argnums: Any) -> Any:
    """``walk(*args)`` bound as one `custom_inverse` step whose inverse is `fun`, over the
    array leaves of `args` (the others, an activation function in an Equinox module, are
    closed over); None where the state holds a leaf that is no array."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    dyn = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]
    marks = jax.tree_util.tree_unflatten(tree, list(range(len(leaves))))
    nums = normalize_argnums(argnums, len(args), fun)
    in_state = [i for a in nums for i in jax.tree_util.tree_leaves(marks[a])]
    if not in_state or any(i not in dyn for i in in_state):
        return None

    def rebuild(vals: Sequence[Any]) -> tuple:
        full = list(leaves)
        for i, v in zip(dyn, vals):
            full[i] = v
        return jax.tree_util.tree_unflatten(tree, full)

    def flat(g: Callable) -> Callable:
        def h(*vals: Any) -> Any:
            out = tuple(jax.tree_util.tree_leaves(g(*rebuild(vals))))
            return out[0] if len(in_state) == 1 else out

        return h

    pos = [dyn.index(i) for i in in_state]
    step = custom_inverse(flat(walk), pos[0] if len(pos) == 1 else pos)
    step.definverse(flat(fun))
    got = step(*[leaves[i] for i in dyn])
    got = [got] if len(in_state) == 1 else list(got)
    s_tree = jax.tree_util.tree_structure(
        args[nums[0]] if len(nums) == 1 else tuple(args[a] for a in nums)
    )
    return jax.tree_util.tree_unflatten(s_tree, got)


def reverse_with(
    fun: Callable,
    settings: Settings,
    argnums: int | Sequence[int] = 0,
    state: Any = None,
    closed: bool = False,
) -> Callable:
    """`reverse(fun)` whose walks have the caller's `settings` (the inverse transforms run
    theirs in their own name and without Newton's method). `closed`: traced, the inverse is
    one `custom_inverse` step whose inverse is `fun` (what `reverse` hands to users, who may
    invert it again; the transforms that only evaluate or differentiate it skip the wrap)."""
    nums_key = argnums if isinstance(argnums, int) else tuple(argnums)

    def walk(*args: Any) -> Any:
        return invert_call(fun, args, argnums, settings=settings, state=state).state

    def impl(*args: Any) -> Any:
        leaves = jax.tree_util.tree_leaves(args)
        if closed and state is None and not all(is_concrete(x) for x in leaves):
            # traced, the inverse is one step whose own inverse is `fun`: what the walk emits
            # (element masks, a consistent-case choice, Newton's method) need not be invertible
            # by jaxrev in turn, and reverse(reverse(fun)) is then `fun` itself
            # (docs/design.md §3.5). Eagerly the walk runs on values (its errors name the step)
            out = _as_one_step(walk, fun, args, argnums)
            if out is not None:
                return out
        return walk(*args)

    @functools.wraps(fun)
    def inv(*args: Any) -> Any:
        # eager calls are compiled from the second on, keyed like jax.jit's (`_cache`)
        return cached_call(("reverse", nums_key, settings, closed), (fun, state), impl, args)

    inv.__name__ = f"reverse({getattr(fun, '__name__', 'fun')})"
    # reverse(inv) needs inv's state (fun's output) when fun changes structure
    inv._jaxrev_inverse_of = (fun, argnums, state)  # type: ignore[attr-defined]
    return inv
