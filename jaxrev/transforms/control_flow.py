"""Reversible control flow: `jr.while_loop` and `jr.cond` with NiLang's post conditions.

A plain `lax.while_loop` forgets how many times it ran and a plain `lax.cond` forgets which branch
it took, so `jr.reverse` cannot run them backwards. These two keep the post condition in the jaxpr
as primitives of their own (`jaxrev_while`, `jaxrev_cond`), lowered through `lax.while_loop` /
`lax.switch`, so the backward run can decide from the outputs alone.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxrev._compat import (ClosedJaxpr, Primitive, eval_closed, lower_fun, not_mapped,
                            primitive_batchers, primitive_jvps, register_lowering,
                            trace_to_closed)
from jaxrev._jaxpr import instantiate_tangents

__all__ = ["while_loop", "cond", "while_p", "cond_p"]


def _avals(xs: Sequence[Any]) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in xs]


def _select(pred: Any, new: Any, old: Any) -> Any:
    """Per-batch-element select; `pred` has the leading (batch) shape of the operands."""
    p = jnp.reshape(pred, jnp.shape(pred) + (1,) * (jnp.ndim(new) - jnp.ndim(pred)))
    return jnp.where(p, new, old)


# ----------------------------------------------------------------------------- while

while_p = Primitive("jaxrev_while")
while_p.multiple_results = True


def _while_split(args, cond_nconsts, body_nconsts, post_nconsts):
    a, b, c = cond_nconsts, cond_nconsts + body_nconsts, cond_nconsts + body_nconsts + post_nconsts
    return args[:a], args[a:b], args[b:c], args[c:]


def _while_impl(*args, cond_jaxpr, body_jaxpr, post_jaxpr, cond_nconsts, body_nconsts,
                post_nconsts):
    cc, bc, _, init = _while_split(args, cond_nconsts, body_nconsts, post_nconsts)

    def pred(c):
        return eval_closed(cond_jaxpr, *cc, *c)[0]

    def body(c):
        new = eval_closed(body_jaxpr, *bc, *c)
        p = pred(c)
        if jnp.ndim(p) == 0:
            return tuple(new)
        # batched predicate (after vmap): finished elements keep their value
        return tuple(_select(p, n, o) for n, o in zip(new, c))

    return list(lax.while_loop(lambda c: jnp.any(pred(c)), body, tuple(init)))


while_p.def_impl(_while_impl)
while_p.def_abstract_eval(
    lambda *avals, cond_nconsts, body_nconsts, post_nconsts, **_:
    list(avals[cond_nconsts + body_nconsts + post_nconsts:]))
register_lowering(while_p, lower_fun(_while_impl, multiple_results=True))


def _while_jvp(primals, tangents, **params):
    return jax.jvp(partial(_while_impl, **params), tuple(primals),
                   instantiate_tangents(primals, tangents))


primitive_jvps[while_p] = _while_jvp


def _vmap_closed(closed: ClosedJaxpr, in_axes: Sequence[Any], args: Sequence[Any]) -> ClosedJaxpr:
    fn = jax.vmap(lambda *a: eval_closed(closed, *a), in_axes=tuple(in_axes))
    new, consts, _ = trace_to_closed(fn, *_avals(args))
    assert not consts
    return new


def _move_batch(x: Any, d: Any, size: int, force: bool) -> tuple[Any, Any]:
    if d is not_mapped or d is None:
        if not force:
            return x, None
        return jnp.broadcast_to(x, (size,) + jnp.shape(x)), 0
    return jnp.moveaxis(x, d, 0), 0


def _while_batch(args, dims, *, cond_jaxpr, body_jaxpr, post_jaxpr, cond_nconsts,
                 body_nconsts, post_nconsts):
    size = next(jnp.shape(a)[d] for a, d in zip(args, dims) if d is not not_mapped and d is not None)
    n_consts = cond_nconsts + body_nconsts + post_nconsts
    moved = [_move_batch(a, d, size, force=i >= n_consts) for i, (a, d) in enumerate(zip(args, dims))]
    vals = [m[0] for m in moved]
    axes = [m[1] for m in moved]
    cc, bc, pc, carry = _while_split(vals, cond_nconsts, body_nconsts, post_nconsts)
    ca, ba, pa, cara = _while_split(axes, cond_nconsts, body_nconsts, post_nconsts)
    new = dict(
        cond_jaxpr=_vmap_closed(cond_jaxpr, ca + cara, cc + carry),
        body_jaxpr=_vmap_closed(body_jaxpr, ba + cara, bc + carry),
        post_jaxpr=_vmap_closed(post_jaxpr, pa + cara, pc + carry),
        cond_nconsts=cond_nconsts, body_nconsts=body_nconsts, post_nconsts=post_nconsts)
    out = while_p.bind(*vals, **new)
    return out, [0] * len(out)


primitive_batchers[while_p] = _while_batch


def _trace_with_consts(fun: Callable, args: Sequence[Any]) -> tuple[ClosedJaxpr, list[Any], Any]:
    return trace_to_closed(fun, *_avals(args))


def while_loop(cond_fun: Callable[[Any], Any], body_fun: Callable[[Any], Any], init_val: Any,
               post_fun: Callable[[Any], Any]) -> Any:
    """A `lax.while_loop` that `jr.reverse` can run backwards without a forward run.

    `post_fun(val)` must be false on `init_val` and true after every iteration (NiLang's post
    condition); the backward loop runs while it holds.

    Example:
        >>> import jaxrev as jr, jax.numpy as jnp
        >>> f = lambda x: jr.while_loop(lambda c: c[1] < 100.0, lambda c: (c[0] + 1, c[1] * 2.0),
        ...                             (0, x), lambda c: c[0] > 0)[1]
    """
    leaves, tree = jax.tree_util.tree_flatten(init_val)

    def flat(fn):
        return lambda *c: fn(jax.tree_util.tree_unflatten(tree, list(c)))

    def flat_body(*c):
        out = body_fun(jax.tree_util.tree_unflatten(tree, list(c)))
        out_leaves, out_tree = jax.tree_util.tree_flatten(out)
        if out_tree != tree:
            raise TypeError(f"jr.while_loop: body_fun must return the structure of init_val "
                            f"({tree}), got {out_tree}")
        return out_leaves

    cj, cc, _ = _trace_with_consts(flat(cond_fun), leaves)
    bj, bc, _ = _trace_with_consts(flat_body, leaves)
    pj, pc, _ = _trace_with_consts(flat(post_fun), leaves)
    for name, j in (("cond_fun", cj), ("post_fun", pj)):
        (aval,) = j.out_avals
        if aval.shape != () or aval.dtype != jnp.bool_:
            raise TypeError(f"jr.while_loop: {name} must return a boolean scalar, got {aval}")
    # weak-typed Python scalars in init_val must not change dtype through the loop
    leaves = [lax.convert_element_type(x, a.dtype) for x, a in zip(leaves, bj.out_avals)]
    out = while_p.bind(*cc, *bc, *pc, *leaves, cond_jaxpr=cj, body_jaxpr=bj, post_jaxpr=pj,
                       cond_nconsts=len(cc), body_nconsts=len(bc), post_nconsts=len(pc))
    return jax.tree_util.tree_unflatten(tree, out)


# ----------------------------------------------------------------------------- cond

cond_p = Primitive("jaxrev_cond")
cond_p.multiple_results = True


def _cond_impl(index, *args, branches, post_jaxpr, post_nconsts):
    ops = args[post_nconsts:]
    if jnp.ndim(index) == 0:
        idx = jnp.clip(index, 0, len(branches) - 1)
        return list(lax.switch(idx, [partial(eval_closed, b) for b in branches], *ops))
    # batched index (after vmap): every branch runs, each element keeps its own
    outs = [eval_closed(b, *ops) for b in branches]
    idx = jnp.clip(index, 0, len(branches) - 1)
    return [_select_cases(idx, [o[k] for o in outs]) for k in range(len(outs[0]))]


def _select_cases(idx: Any, cases: Sequence[Any]) -> Any:
    """Element b of the result is element b of `cases[idx[b]]` (idx has the leading shape)."""
    r = cases[0]
    for b in range(1, len(cases)):
        r = _select(idx == b, cases[b], r)
    return r


cond_p.def_impl(_cond_impl)
cond_p.def_abstract_eval(lambda index, *avals, branches, **_: list(branches[0].out_avals))
register_lowering(cond_p, lower_fun(_cond_impl, multiple_results=True))


def _cond_jvp(primals, tangents, **params):
    index, *ops = primals
    return jax.jvp(lambda *o: _cond_impl(index, *o, **params), tuple(ops),
                   instantiate_tangents(ops, tangents[1:]))


primitive_jvps[cond_p] = _cond_jvp


def _cond_batch(args, dims, *, branches, post_jaxpr, post_nconsts):
    size = next(jnp.shape(a)[d] for a, d in zip(args, dims) if d is not not_mapped and d is not None)
    index_batched = dims[0] is not not_mapped and dims[0] is not None
    moved = [_move_batch(a, d, size, force=index_batched and i > post_nconsts)
             for i, (a, d) in enumerate(zip(args, dims))]
    vals = [m[0] for m in moved]
    axes = [m[1] for m in moved]
    ops, op_axes = vals[1 + post_nconsts:], axes[1 + post_nconsts:]
    pc, pa = vals[1:1 + post_nconsts], axes[1:1 + post_nconsts]
    new_branches = tuple(_vmap_closed(b, op_axes, ops) for b in branches)
    out_avals = new_branches[0].out_avals
    post = _vmap_closed(post_jaxpr, pa + [0] * len(out_avals),
                        pc + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals])
    out = cond_p.bind(vals[0], *pc, *ops, branches=new_branches, post_jaxpr=post,
                      post_nconsts=post_nconsts)
    return out, [0] * len(out)


primitive_batchers[cond_p] = _cond_batch


def cond(pred: Any, true_fun: Callable, false_fun: Callable, *operands: Any,
         post: Callable[..., Any]) -> Any:
    """A `lax.cond` that `jr.reverse` can run backwards: `post(out)` is true exactly when
    `true_fun` ran (NiLang's post condition), so the backward run picks the branch from the output.

    Example:
        >>> import jaxrev as jr, jax.numpy as jnp
        >>> f = lambda x: jr.cond(x[0] > 0, lambda v: v * 2.0, lambda v: v - 10.0, x,
        ...                       post=lambda v: v[0] > 0)
    """
    leaves, tree = jax.tree_util.tree_flatten(operands)

    def branch(fn):
        def flat(*ls):
            out = fn(*jax.tree_util.tree_unflatten(tree, list(ls)))
            return jax.tree_util.tree_flatten(out)[0]
        return flat

    fj, fc, ftree = _trace_with_consts(branch(false_fun), leaves)
    tj, tc, ttree = _trace_with_consts(branch(true_fun), leaves)
    if ftree != ttree or [a.strip_weak_type() for a in fj.out_avals] != [
            a.strip_weak_type() for a in tj.out_avals]:
        raise TypeError("jr.cond: true_fun and false_fun must return the same structure, "
                        f"shapes and dtypes; got {tj.out_avals} and {fj.out_avals}")
    out_tree = jax.eval_shape(lambda *o: true_fun(*o), *operands)
    out_tree = jax.tree_util.tree_structure(out_tree)
    out_avals = _avals([jax.ShapeDtypeStruct(a.shape, a.dtype) for a in tj.out_avals])

    def post_flat(*ls):
        return post(jax.tree_util.tree_unflatten(out_tree, list(ls)))

    pj, pc, _ = _trace_with_consts(post_flat, out_avals)
    (paval,) = pj.out_avals
    if paval.shape != () or paval.dtype != jnp.bool_:
        raise TypeError(f"jr.cond: post must return a boolean scalar, got {paval}")
    nf, nt = len(fc), len(tc)

    # both branches take [false consts, true consts, operands]
    def widen(j: ClosedJaxpr, skip_before: int, skip_after: int, nconsts: int) -> ClosedJaxpr:
        def f(*a):
            consts = a[skip_before:skip_before + nconsts]
            return eval_closed(j, *consts, *a[nf + nt:])
        new, extra, _ = trace_to_closed(f, *_avals([*fc, *tc, *leaves]))
        assert not extra
        return new

    branches = (widen(fj, 0, nt, nf), widen(tj, nf, 0, nt))
    index = lax.convert_element_type(pred, jnp.int32)
    out = cond_p.bind(index, *pc, *fc, *tc, *leaves, branches=branches, post_jaxpr=pj,
                      post_nconsts=len(pc))
    return jax.tree_util.tree_unflatten(out_tree, out)
