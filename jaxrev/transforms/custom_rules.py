"""The custom rules users write: `jr.custom_inverse` (re-exported from `custom.py`, where the
group solvers use it too), `jr.hook`, `jr.nestlevel`, `jr.forward_mode`, `jr.store` and
`jr.recompute`.

The primitives `hook`, `store` and `recompute` bind, and their rules, are in `custom.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import differentiation_depth
from jaxrev.transforms.custom import custom_inverse, hook_p, recompute_p, store_p

__all__ = ["custom_inverse", "hook", "nestlevel", "forward_mode", "store", "recompute"]


# --------------------------------------------------------------------------- hook, nestlevel


def hook(fn: Callable[[Any], Any], x: Any) -> Any:
    """Identity on `x`; in the backward pass, `fn` is applied to `x`'s cotangent.

    For clipping, rescaling or inspecting gradients where they flow. Forward mode (`jvp`)
    passes tangents through unchanged; `reverse` passes values through.

    **Arguments:**

    - `fn`: takes and returns a cotangent with `x`'s structure and shapes.
    - `x`: a pytree of arrays.

    **Returns:**

    `x`, unchanged.

    **Example:**

        >>> import jax, jaxrev as jr
        >>> float(jax.grad(lambda x: jr.hook(lambda g: -g, x) ** 2)(3.0))
        -6.0
    """
    if not callable(fn):
        raise TypeError(f"jr.hook expects a callable as its first argument, got {fn!r}")
    leaves, tree = jax.tree_util.tree_flatten(x)
    out = hook_p.bind(*[jnp.asarray(v) for v in leaves], fn=fn, tree=tree)
    return jax.tree_util.tree_unflatten(tree, out)


def nestlevel() -> int:
    """The order of differentiation the calling code is traced under.

    Read at trace time, so a function staged out by `jit` on its own (`grad(jit(f))`) sees the
    level at which `jit` traced it.

    **Arguments:**

    None.

    **Returns:**

    An int: 0 when not differentiated, 1 inside `grad`, 2 inside `grad(grad(...))` or
    `hessian`.

    **Example:**

        >>> import jax, jaxrev as jr
        >>> def f(x):
        ...     print("level", jr.nestlevel())
        ...     return x ** 3
        >>> _ = f(1.0)
        level 0
        >>> _ = jax.grad(jax.grad(f))(1.0)
        level 2
    """
    return differentiation_depth()


# --------------------------------------------------------------------------- forward_mode


def forward_mode(fun: Callable) -> Callable:
    """`fun` whose Jacobian is computed in forward mode during the primal run and applied in the
    backward pass (Zygote's `forwarddiff`).

    For functions with few inputs: one JVP per input number instead of a stored tape; the
    backward pass does not evaluate `fun` again.

    **Arguments:**

    - `fun`: a function of float arrays (pytrees of them).

    **Returns:**

    A function with `fun`'s signature and values, whose derivatives (`jvp`, `grad`) come from
    that Jacobian.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> f = jr.forward_mode(lambda x: jnp.sin(x) * x[::-1])
        >>> g = jax.grad(lambda x: jnp.sum(f(x)))(jnp.array([0.5, 1.0]))
        >>> g.shape
        (2,)
    """
    name = getattr(fun, "__name__", "fun")

    @functools.wraps(fun)
    def wrapped(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        for x in leaves:
            if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
                raise TypeError(
                    f"jr.forward_mode({name}): every input must be a float array "
                    f"(got {jnp.result_type(x)})"
                )
        shapes = [jnp.shape(x) for x in leaves]
        dtypes = [jnp.result_type(x) for x in leaves]
        offs = np.cumsum([0] + [int(np.prod(s, dtype=np.int64)) for s in shapes])

        def f_flat(*ls):
            return fun(*jax.tree_util.tree_unflatten(tree, list(ls)))

        def split(vec):
            return [
                jnp.reshape(vec[offs[k] : offs[k + 1]], s).astype(d)
                for k, (s, d) in enumerate(zip(shapes, dtypes))
            ]

        @jax.custom_jvp
        def g(*ls):
            return f_flat(*ls)

        @g.defjvp
        def g_jvp(primals, tangents):
            # the whole Jacobian by one JVP per input number, in the primal run; the tangent
            # map is a contraction with it, which reverse mode transposes without calling fun
            basis = jnp.eye(int(offs[-1]), dtype=jnp.result_type(*dtypes))
            y, jac = jax.vmap(
                lambda e: jax.jvp(f_flat, primals, tuple(split(e))), out_axes=(None, 0)
            )(basis)
            t = jnp.concatenate(
                [jnp.ravel(jnp.asarray(v, jnp.result_type(*dtypes))) for v in tangents]
            )
            return y, jax.tree_util.tree_map(lambda j: jnp.tensordot(t, j, axes=1), jac)

        return g(*leaves)

    return wrapped


# --------------------------------------------------------------------------- store / recompute


def store(x: Any) -> Any:
    """Mark `x` to be kept by `reversible`'s forward run (Slang's ``[PreferCheckpoint]``).

    The backward sweep then reads the kept value instead of rebuilding it, which resets the
    rounding drift at that point (and costs its bytes, per iteration inside a loop; see
    `memory_report`). An identity everywhere else.

    **Arguments:**

    - `x`: a pytree of arrays.

    **Returns:**

    `x`, unchanged (marked in the traced program).

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jax.lax.fori_loop(0, 10, lambda i, x: jr.store(x * 1.5) + 1.0, x)
        >>> [e["what"] for e in jr.memory_report(f, jnp.ones(3)).entries][0]
        'value kept by jr.store'
    """
    return jax.tree_util.tree_map(store_p.bind, x)


def recompute(x: Any) -> Any:
    """Mark `x` never to be stored by `reversible` (Slang's ``[PreferRecompute]``).

    Where a lossy step needs it, `reversible` stores the values it is computed from instead and
    recomputes it. An identity everywhere else.

    **Arguments:**

    - `x`: a pytree of arrays.

    **Returns:**

    `x`, unchanged (marked in the traced program).

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> step = lambda x: jnp.maximum(jr.recompute(x * 2.0), 0.0) + jnp.sin(x)
        >>> f = lambda x: jax.lax.fori_loop(0, 4, lambda i, x: step(x), x)
        >>> jr.memory_report(f, jnp.ones(3)).total_bytes > 0
        True
    """
    return jax.tree_util.tree_map(recompute_p.bind, x)
