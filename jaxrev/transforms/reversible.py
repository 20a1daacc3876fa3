"""Memory-free reverse mode: `reversible` and its primitives.

`reversible(fun)` binds `reversible_p`, a primitive carrying `fun`'s jaxpr (modelled on JAX's
`remat_p`). Its JVP rule splits it, as linearization needs, into a known part that runs `fun`
forward and keeps only the outputs (plus whatever a lossy step forces it to keep, the
*residuals*), and a linear part `reversible_lin_p` whose transpose is the backward sweep
(`_sweep.walk`): it walks the equations last to first, rebuilds each equation's inputs from its
outputs with the inverse rules, and pulls the cotangent through it. Loops run backwards by their
`sweep_rules`, so memory stays at the width of the program, not its depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial, wraps
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from jaxrev._compat import (ClosedJaxpr, Primitive, ShapedArray, hoist_consts, is_symbolic_zero,
                            lower_fun, primitive_batchers, primitive_jvps, primitive_transposes,
                            register_lowering, trace_to_closed)
from jaxrev._jaxpr import Env, batch_front, eval_closed, instantiate_tangents
from jaxrev._program import check_sizes, check_structure, normalize_argnums, trace_program
from jaxrev.transforms._sweep import (Plan, Residuals, acc, forward_with_residuals, get_ct,
                                      res_avals, seed_env, top_plan, walk)

__all__ = ["reversible", "reversible_p", "reversible_lin_p", "bind_reversible", "Bound"]


reversible_p = Primitive("jaxrev_reversible")
reversible_p.multiple_results = True
reversible_lin_p = Primitive("jaxrev_reversible_lin")
reversible_lin_p.multiple_results = True


def _rev_impl(*args, jaxpr, state, store):
    if not store:
        return eval_closed(jaxpr, *args)
    outs, res = forward_with_residuals(top_plan(jaxpr, state), args)
    return [*outs, *res]


def _rev_abstract(*avals, jaxpr, state, store):
    outs = list(jaxpr.out_avals)
    if store:
        outs += [ShapedArray(a.shape, a.dtype) for a in res_avals(top_plan(jaxpr, state))]
    return outs


def _rev_jvp(primals, tangents, *, jaxpr, state, store):
    if store:  # forward mode of the run that also returns residuals: a plain JVP
        f = partial(_rev_impl, jaxpr=jaxpr, state=state, store=True)
        return jax.jvp(f, tuple(primals), instantiate_tangents(primals, tangents))
    nz = tuple(not is_symbolic_zero(t) for t in tangents)
    outs = reversible_p.bind(*primals, jaxpr=jaxpr, state=state, store=True)
    n = len(jaxpr.out_avals)
    ys, res = outs[:n], outs[n:]
    params = [p for p, s in zip(primals, state) if not s]
    tans = [t for t, z in zip(tangents, nz) if z]
    out_t = reversible_lin_p.bind(*ys, *res, *params, *tans, jaxpr=jaxpr, state=state, nz=nz,
                                  nres=len(res))
    return ys, out_t


def _vmapped(fun, args, dims):
    size, args, in_axes = batch_front(args, dims)
    outs = jax.vmap(fun, in_axes=in_axes, axis_size=size)(*args)
    return outs, [0] * len(outs)


def _rev_batch(args, dims, *, jaxpr, state, store):
    if store:  # the forward run of a linearization: its residuals keep the unbatched plan
        return _vmapped(partial(_rev_impl, jaxpr=jaxpr, state=state, store=True), args, dims)
    size, args, in_axes = batch_front(args, dims)
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in args]
    bj, consts, _ = trace_to_closed(
        jax.vmap(lambda *a: eval_closed(jaxpr, *a), in_axes=in_axes, axis_size=size), *avals)
    outs = reversible_p.bind(*consts, *args, jaxpr=bj, state=(False,) * len(consts) + state,
                             store=False)
    return outs, [0] * len(outs)


reversible_p.def_impl(_rev_impl)
reversible_p.def_abstract_eval(_rev_abstract)
register_lowering(reversible_p, lower_fun(_rev_impl, multiple_results=True))
primitive_jvps[reversible_p] = _rev_jvp
primitive_batchers[reversible_p] = _rev_batch


def _lin_split(args: Sequence[Any], jaxpr: ClosedJaxpr, state: Sequence[bool], nres: int
               ) -> tuple[Sequence[Any], Sequence[Any], Sequence[Any], Sequence[Any]]:
    """`reversible_lin_p`'s operands: (outputs, residuals, parameters, tangents)."""
    n = len(jaxpr.out_avals)
    npar = sum(not s for s in state)
    return (args[:n], args[n:n + nres], args[n + nres:n + nres + npar],
            args[n + nres + npar:])


def _top_env(P: Plan, state: Sequence[bool], params: Sequence[Any], ys: Sequence[Any]) -> Env:
    return seed_env(P, [not s for s in state], params, [True] * len(ys), ys)


def _lin_impl(*args, jaxpr, state, nz, nres):
    """J·t at the point whose outputs and residuals are given: rebuild the inputs, then JVP."""
    ys, res, params, tans = _lin_split(args, jaxpr, state, nres)
    P = top_plan(jaxpr, state)
    env = _top_env(P, state, params, ys)
    walk(P, env, None, set(), Residuals(P, res), [])
    J = P.closed.jaxpr
    xs = [env.read(v) if env.known(v) else jnp.zeros(v.aval.shape, v.aval.dtype)
          for v in J.invars]
    it = iter(tans)
    ts = [next(it) if z else None for z in nz]
    _, out_t = jax.jvp(lambda *a: eval_closed(jaxpr, *a), tuple(xs), instantiate_tangents(xs, ts))
    return list(out_t)


def _lin_abstract(*avals, jaxpr, state, nz, nres):
    return [a.to_tangent_aval() for a in jaxpr.out_avals]


def _lin_transpose(cts, *args, jaxpr, state, nz, nres):
    ys, res, params, tans = _lin_split(args, jaxpr, state, nres)
    P = top_plan(jaxpr, state)
    J = P.closed.jaxpr
    env = _top_env(P, state, params, ys)
    ctenv: dict = {}
    for v, c in zip(J.outvars, cts):
        if not is_symbolic_zero(c):
            acc(ctenv, v, c)
    active = {v for v, z in zip(J.invars, nz) if z}
    walk(P, env, ctenv, active, Residuals(P, res), [])
    in_cts = [get_ct(ctenv, v) for v, z in zip(J.invars, nz) if z]
    return [None] * (len(args) - len(tans)) + in_cts


def _lin_jvp(primals, tangents, **params):
    return jax.jvp(partial(_lin_impl, **params), tuple(primals), instantiate_tangents(primals, tangents))


def _lin_batch(args, dims, **params):
    return _vmapped(partial(_lin_impl, **params), args, dims)


reversible_lin_p.def_impl(_lin_impl)
reversible_lin_p.def_abstract_eval(_lin_abstract)
register_lowering(reversible_lin_p, lower_fun(_lin_impl, multiple_results=True))
primitive_transposes[reversible_lin_p] = _lin_transpose
primitive_jvps[reversible_lin_p] = _lin_jvp
primitive_batchers[reversible_lin_p] = _lin_batch


# --------------------------------------------------------------------------- public API

@dataclass
class Bound:
    """A function's program as `reversible_p` binds it."""

    jaxpr: ClosedJaxpr          # consts hoisted to leading inputs
    state: tuple[bool, ...]     # per input: part of the state (rebuilt) or a parameter
    operands: list[Any]         # the values bound: hoisted consts, then the flat arguments
    out_tree: Any               # the output's tree definition


def bind_reversible(fun: Callable, args: Sequence[Any], argnums: int | Sequence[int]) -> Bound:
    """Trace `fun` for `reversible_p`: its jaxpr, which inputs are state, the operands."""
    nums = normalize_argnums(argnums, len(args), fun)
    prog = trace_program(fun, args, nums)
    out_tree = jax.tree_util.tree_structure(prog.out_shape)
    try:
        check_structure(fun, args, nums, prog.out_shape, who="jaxrev.reversible")
    except ValueError:   # a bijection that changes structure keeps the element counts
        check_sizes(fun, [prog.flat[i] for i in prog.state_pos],
                    jax.tree_util.tree_leaves(prog.out_shape), who="jaxrev.reversible")
    state_pos = set(prog.state_pos)
    j, consts = hoist_consts(prog.closed)
    state = (False,) * len(consts) + tuple(i in state_pos for i in range(len(prog.flat)))
    operands = [*consts, *[jnp.asarray(x) for x in prog.flat]]
    return Bound(j, state, operands, out_tree)


def reversible(fun: Callable, argnums: int | Sequence[int] = 0) -> Callable:
    """`fun` with a reverse-mode derivative that rebuilds intermediates by running backwards.

    `fun(*args)` returns the structure, shapes and dtypes of the state `args[argnums]` (as
    for `reverse`), or, for a bijection that changes structure or shapes, as many elements of
    each dtype. Gradients with respect to every argument (state and parameters) rebuild
    each step's inputs from its outputs instead of storing them, so memory does not grow with
    loop iterations or unrolled blocks; steps that lose information store just what they lose
    (see `memory_report`). Composes with `jit`, `vmap`, `grad`, `jvp` and `hessian`.

    Example:
        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> def step(xy, th):
        ...     x, y = xy
        ...     x = x + jnp.tanh(th * y)
        ...     return x, y + jnp.sin(x)
        >>> loop = lambda xy, th: jax.lax.fori_loop(0, 100, lambda i, s: step(s, th), xy)
        >>> f = jr.reversible(loop)
        >>> g = jax.grad(lambda th: f((jnp.ones(3), jnp.zeros(3)), th)[1].sum())(0.5)
        >>> bool(jnp.isfinite(g))
        True
    """

    @wraps(fun)
    def wrapped(*args: Any) -> Any:
        b = bind_reversible(fun, args, argnums)
        outs = reversible_p.bind(*b.operands, jaxpr=b.jaxpr, state=b.state, store=False)
        return jax.tree_util.tree_unflatten(b.out_tree, outs)

    wrapped.__name__ = f"reversible({getattr(fun, '__name__', 'fun')})"
    return wrapped
