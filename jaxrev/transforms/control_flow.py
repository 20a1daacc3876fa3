"""`jr.cond` and `jr.while_loop`: control flow that `jr.reverse` runs backwards from its
outputs alone (NiLang's branch and loop with post conditions).

Each traces its functions and binds one jaxrev primitive carrying the post condition in the
jaxpr: `cond_p` (`rules/cond.py`, lowered through `lax.switch`) and `while_p`
(`rules/while_loop.py`, lowered through `lax.while_loop`), where every rule of those
primitives lives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._compat import ClosedJaxpr, trace_to_closed
from jaxrev._evaluate import eval_closed
from jaxrev._program import avals_of
from jaxrev.transforms.rules.cond import cond_p
from jaxrev.transforms.rules.while_loop import while_p

__all__ = ["cond", "while_loop"]


def cond(
    pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any, post: Callable[..., Any]
) -> Any:
    """A `lax.cond` that `jr.reverse` can run backwards from its outputs alone.

    `post(out)` must be true exactly when `true_fun` ran (NiLang's post condition): the
    backward run picks the branch from the output. A plain `lax.cond` forgets which branch it
    took, so `reverse` needs its predicate known from the parameters.

    **Arguments:**

    - `pred`: a boolean scalar: which branch runs.
    - `true_fun`, `false_fun`: functions of `*operands`, returning the same structure, shapes
      and dtypes.
    - `*operands`: the branches' arguments (pytrees).
    - `post`: a function of the output returning a boolean scalar, true exactly when
      `true_fun` ran (keyword-only).

    **Returns:**

    The output of the branch that ran.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jr.cond(x[0] > 0, lambda v: v * 2.0, lambda v: v - 10.0, x,
        ...                       post=lambda v: v[0] > 0)
        >>> x = jnp.array([-1.0, 3.0])
        >>> f(x).tolist(), jr.reverse(f)(f(x)).tolist()
        ([-11.0, -7.0], [-1.0, 3.0])
    """
    leaves, tree = jax.tree_util.tree_flatten(operands)

    def branch(fn):
        def flat(*ls):
            out = fn(*jax.tree_util.tree_unflatten(tree, list(ls)))
            return jax.tree_util.tree_flatten(out)[0]

        return flat

    fj, fc, ftree = trace_to_closed(branch(false_fun), *avals_of(leaves))
    tj, tc, ttree = trace_to_closed(branch(true_fun), *avals_of(leaves))
    if ftree != ttree or [a.strip_weak_type() for a in fj.out_avals] != [
        a.strip_weak_type() for a in tj.out_avals
    ]:
        raise TypeError(
            "jr.cond: true_fun and false_fun must return the same structure, "
            f"shapes and dtypes; got {tj.out_avals} and {fj.out_avals}"
        )
    out_tree = jax.tree_util.tree_structure(jax.eval_shape(lambda *o: true_fun(*o), *operands))
    out_avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in tj.out_avals]

    def post_flat(*ls):
        return post(jax.tree_util.tree_unflatten(out_tree, list(ls)))

    pj, pc, _ = trace_to_closed(post_flat, *out_avals)
    (paval,) = pj.out_avals
    if paval.shape != () or paval.dtype != jnp.bool_:
        raise TypeError(f"jr.cond: post must return a boolean scalar, got {paval}")
    nf, nt = len(fc), len(tc)

    # both branches take [false consts, true consts, operands]
    def widen(j: ClosedJaxpr, skip_before: int, nconsts: int) -> ClosedJaxpr:
        def f(*a):
            consts = a[skip_before : skip_before + nconsts]
            return eval_closed(j, *consts, *a[nf + nt :])

        new, extra, _ = trace_to_closed(f, *avals_of([*fc, *tc, *leaves]))
        assert not extra
        return new

    branches = (widen(fj, 0, nf), widen(tj, nf, nt))
    index = lax.convert_element_type(pred, jnp.int32)
    out = cond_p.bind(
        index, *pc, *fc, *tc, *leaves, branches=branches, post_jaxpr=pj, post_nconsts=len(pc)
    )
    return jax.tree_util.tree_unflatten(out_tree, out)


def while_loop(
    cond_fun: Callable[[Any], Any],
    body_fun: Callable[[Any], Any],
    init_val: Any,
    post_fun: Callable[[Any], Any],
) -> Any:
    """A `lax.while_loop` that `jr.reverse` can run backwards without a forward run.

    `post_fun(val)` must be false on `init_val` and true after every iteration (NiLang's post
    condition): the backward loop runs the inverted body while it holds. A plain
    `lax.while_loop` forgets how many times it ran.

    **Arguments:**

    - `cond_fun`: the loop's condition, a function of the carry returning a boolean scalar.
    - `body_fun`: one iteration, returning a carry of `init_val`'s structure.
    - `init_val`: the initial carry (a pytree).
    - `post_fun`: a function of the carry returning a boolean scalar: false on `init_val`,
      true after every iteration.

    **Returns:**

    The final carry, as `lax.while_loop`'s.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda c: jr.while_loop(lambda c: c[1] < 100.0, lambda c: (c[0] + 1, c[1] * 2.0),
        ...                             c, lambda c: c[0] > 0)
        >>> n, y = f((jnp.int32(0), jnp.float32(3.0)))
        >>> int(n), float(y), float(jr.reverse(f)((n, y))[1])
        (6, 192.0, 3.0)
    """
    leaves, tree = jax.tree_util.tree_flatten(init_val)

    def flat(fn):
        return lambda *c: fn(jax.tree_util.tree_unflatten(tree, list(c)))

    def flat_body(*c):
        out = body_fun(jax.tree_util.tree_unflatten(tree, list(c)))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        if out_tree != tree:
            raise TypeError(
                f"jr.while_loop: body_fun must return the structure of init_val "
                f"({tree}), got {out_tree}"
            )
        return out_leaves

    cj, cc, _ = trace_to_closed(flat(cond_fun), *avals_of(leaves))
    bj, bc, _ = trace_to_closed(flat_body, *avals_of(leaves))
    pj, pc, _ = trace_to_closed(flat(post_fun), *avals_of(leaves))
    for name, j in (("cond_fun", cj), ("post_fun", pj)):
        (aval,) = j.out_avals
        if aval.shape != () or aval.dtype != jnp.bool_:
            raise TypeError(f"jr.while_loop: {name} must return a boolean scalar, got {aval}")
    # weak-typed Python scalars in init_val must not change dtype through the loop
    leaves = [lax.convert_element_type(x, a.dtype) for x, a in zip(leaves, bj.out_avals)]
    out = while_p.bind(
        *cc,
        *bc,
        *pc,
        *leaves,
        cond_jaxpr=cj,
        body_jaxpr=bj,
        post_jaxpr=pj,
        cond_nconsts=len(cc),
        body_nconsts=len(bc),
        post_nconsts=len(pc),
    )
    return jax.tree_util.tree_unflatten(tree, out)
