"""Custom rules: `custom_inverse` (to `reverse` what `custom_vjp` is to `grad`).

`@jr.custom_inverse` marks a function whose inverse the user supplies with `.definverse`. The
function binds `custom_inverse_p`, a primitive carrying both jaxprs:

- evaluated, differentiated (`jvp`, `grad`), batched or compiled, it is the function itself;
- `reverse`, `reversible` and the inverse transforms invert it by evaluating the inverse, so
  the inverse Jacobian of `f` is the Jacobian of `inv_fun`.

This is how a step with no closed-form inverse, such as a monotone function inverted by Newton
iterations, joins an invertible program.

This module is low in the layers (docs/architecture.md) because the group solvers emit
`custom_inverse` steps; it holds the primitives of the other custom rules too (`hook_p`,
`store_p`, `recompute_p`) with their jaxrev rules. The user-facing functions that bind them
(`jr.hook`, `jr.store`, `jr.recompute`), and `jr.nestlevel` and `jr.forward_mode`, are in
`transforms/custom_rules.py`, which also re-exports `custom_inverse`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxrev._dense as dense
from jaxrev._batching import batch_front, instantiate_tangents
from jaxrev._compat import Primitive, is_symbolic_zero, trace_to_closed
from jaxrev._env import is_unknown
from jaxrev._evaluate import eval_closed
from jaxrev._primitive import make_primitive
from jaxrev._program import avals_of, check_structure, normalize_argnums
from jaxrev._runtime import checked_jit
from jaxrev.transforms.registry import DENSE_STEP, LogdetContext, NeedMore, Unsupported, define

__all__ = [
    "custom_inverse",
    "custom_inverse_p",
    "hook_p",
    "store_p",
    "recompute_p",
]


class custom_inverse:
    """Give a function an inverse of your own, used by every jaxrev transform (to `reverse` what
    `jax.custom_vjp` is to `grad`).

    `fun` itself stays an ordinary JAX function: `jit`, `vmap`, `grad` and `jvp` see `fun`;
    `reverse`, `reversible` and the inverse transforms evaluate the inverse instead, so the
    inverse Jacobian of `fun` is the Jacobian of `inv_fun`. Register the inverse with
    ``.definverse(inv_fun)`` and, optionally, its log-determinant with
    ``.deflogdet(logdet_fun)``; both return their argument, so they work as decorators.

    **Arguments:**

    - `fun`: the function; `fun(*args)` returns the structure, shapes and dtypes of its state
      `args[argnums]` (as for `reverse`).
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments.
    - `differentiate`: how `jvp` and `grad` differentiate `fun`: "fun" (default), through
      its own equations; "inverse", through `inv_fun` by the implicit function theorem (the
      outputs' tangent solves ``J dy = dx - (d inv_fun / d params) dparams``, with `J` the
      inverse's Jacobian in the state, dense per sample of a `vmap`): for a root-finder,
      whose own derivative is wrong (a bisection's is zero) or costly. Real floating
      states only; a value being differentiated that `fun` closes over (rather than takes
      as an argument) is refused there.

    `inv_fun` (given to `.definverse`) has `fun`'s signature with the outputs in the state
    positions: ``inv_fun(fun(x, theta), theta) == x``.

    **Returns:**

    A callable with `fun`'s signature and outputs (it raises `TypeError` until an inverse is
    registered).

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> @jr.custom_inverse
        ... def f(x):
        ...     return x + 0.5 * jnp.sin(x)  # monotone; no closed-form inverse
        >>> @f.definverse
        ... def f_inv(y):
        ...     newton = lambda i, x: x - (x + 0.5 * jnp.sin(x) - y) / (1 + 0.5 * jnp.cos(x))
        ...     return jax.lax.fori_loop(0, 30, newton, y)
        >>> x = jnp.array([0.3, -1.0])
        >>> bool(jnp.allclose(jr.reverse(f)(f(x)), x))
        True
    """

    def __init__(
        self, fun: Callable, argnums: int | Sequence[int] = 0, *, differentiate: str = "fun"
    ) -> None:
        if differentiate not in ("fun", "inverse"):
            raise ValueError(
                f"jaxrev.custom_inverse: differentiate must be 'fun' or 'inverse', got "
                f"{differentiate!r}"
            )
        functools.update_wrapper(self, fun)
        self.fun = fun
        self.argnums = argnums
        self.differentiate = differentiate
        self.inv_fun: Callable | None = None
        self.logdet_fun: Callable | None = None
        self.logdet_of_inverse = False

    def deflogdet(self, logdet_fun: Callable, *, of_inverse: bool = False) -> Callable:
        """Register `logdet_fun(*args)`: log|det| of `fun`'s Jacobian with respect to its state
        at `args` (or ``(sign, log|det|)``), used by every log-determinant entry point
        (`slogdet_jacobian`, `forward_and_slogdet`, `inverse_and_slogdet`, `Bijector`)
        instead of a dense Jacobian. Returns it (usable as a decorator).

        With ``of_inverse=True``, `logdet_fun` takes `inv_fun`'s arguments (the outputs in the
        state positions) and gives log|det| of the inverse's Jacobian there; `fun`'s is its
        negative (the same sign). That is the cheap one where `fun` is the costly direction
        (a root-finder whose inverse is the map it solves: flowjax's `NumericalInverse`).

        Example:
            >>> import jax.numpy as jnp, jaxrev as jr
            >>> @jr.custom_inverse
            ... def f(x):
            ...     return x ** 3 + x
            >>> _ = f.definverse(lambda y: jnp.cbrt(y))   # (a wrong inverse does not matter here)
            >>> _ = f.deflogdet(lambda x: jnp.sum(jnp.log(3 * x ** 2 + 1)))
            >>> y, logdet = jr.forward_and_slogdet(f)(jnp.ones(2))
            >>> round(float(logdet), 6)
            2.772589
        """
        if not callable(logdet_fun):
            raise TypeError(f"deflogdet of {self.__name__} expects a callable, got {logdet_fun!r}")
        self.logdet_fun = logdet_fun
        self.logdet_of_inverse = bool(of_inverse)
        return logdet_fun

    def definverse(self, inv_fun: Callable) -> Callable:
        """Register `inv_fun` as the inverse; returns it (usable as a decorator)."""
        if not callable(inv_fun):
            raise TypeError(f"definverse of {self.__name__} expects a callable, got {inv_fun!r}")
        self.inv_fun = inv_fun
        return inv_fun

    def __get__(self, obj, objtype=None):  # methods: bind like a function
        return self if obj is None else functools.partial(self, obj)

    def __call__(self, *args: Any) -> Any:
        name = getattr(self.fun, "__name__", "fun")
        if self.inv_fun is None:
            raise TypeError(
                f"custom_inverse function {name} has no inverse: call "
                f"{name}.definverse(inv_fun) first"
            )
        nums = normalize_argnums(self.argnums, len(args), self.fun)
        flat, in_tree = jax.tree_util.tree_flatten(tuple(args))
        flat = [jnp.asarray(x) for x in flat]
        marks = jax.tree_util.tree_unflatten(in_tree, list(range(len(flat))))
        state_pos = [i for a in nums for i in jax.tree_util.tree_leaves(marks[a])]

        def flat_of(fn):
            return lambda *leaves: jax.tree_util.tree_leaves(
                fn(*jax.tree_util.tree_unflatten(in_tree, list(leaves)))
            )

        # the primitive's jaxprs return the state's leaves in the order they have among the
        # arguments (`state`'s flags); `fun` and `inv_fun` return them in `argnums`' order
        order = sorted(range(len(state_pos)), key=state_pos.__getitem__)

        def flat_order(out: list) -> list:
            return [out[k] for k in order] if len(out) == len(order) else out

        trees: list = []

        def fun_flat(*leaves):  # traced once: its output's structure is kept on the way
            out, tree = jax.tree_util.tree_flatten(
                self.fun(*jax.tree_util.tree_unflatten(in_tree, list(leaves)))
            )
            trees.append(tree)
            return flat_order(out)

        fj, fconsts, _ = trace_to_closed(fun_flat, *avals_of(flat))
        out_avals = list(fj.out_avals)
        if len(out_avals) == len(order):
            out_avals = [out_avals[order.index(k)] for k in range(len(order))]
        out_shape = jax.tree_util.tree_unflatten(
            trees[0], [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
        )
        s_tree = check_structure(self.fun, args, nums, out_shape, who="jaxrev.custom_inverse")
        inv_name = getattr(self.inv_fun, "__name__", "inv_fun")
        inv_flat = flat_of(self.inv_fun)
        try:
            ij, iconsts, _ = trace_to_closed(
                lambda *leaves: flat_order(inv_flat(*leaves)), *avals_of(flat)
            )
        except TypeError as e:
            if "positional argument" not in str(e) and "argument" not in str(e):
                raise
            raise TypeError(
                f"jaxrev.custom_inverse: the inverse {inv_name} of {name} must take {name}'s "
                f"arguments ({len(args)} of them, the outputs in the state positions): {e}"
            ) from None
        inv_out = ij.out_avals
        want = [fj.in_avals[len(fconsts) + i] for i in sorted(state_pos)]
        if len(inv_out) != len(want) or any(
            tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype for a, b in zip(inv_out, want)
        ):
            raise ValueError(
                f"jaxrev.custom_inverse: the inverse {inv_name} of {name} must return the "
                f"state's leaves ({[w.str_short() for w in want]}), got "
                f"{[a.str_short() for a in inv_out]}"
            )
        logdet = None
        if self.logdet_fun is not None:
            shape = jax.eval_shape(self.logdet_fun, *args)
            logdet = _Logdet(
                self.logdet_fun,
                in_tree,
                isinstance(shape, (tuple, list)),
                of_inverse=self.logdet_of_inverse,
            )
        outs = custom_inverse_p.bind(
            *fconsts,
            *iconsts,
            *flat,
            fun_jaxpr=fj,
            inv_jaxpr=ij,
            n_fconsts=len(fconsts),
            n_iconsts=len(iconsts),
            state=tuple(i in state_pos for i in range(len(flat))),
            logdet=logdet,
            implicit=0 if self.differentiate == "inverse" else None,
        )
        return jax.tree_util.tree_unflatten(
            s_tree, [outs[order.index(k)] for k in range(len(order))]
        )


class _Logdet:
    """A `deflogdet` rule as the primitive's (hashable) param, called on the flat arguments
    (`of_inverse`: the inverse's rule, called with the outputs in the state positions; the
    caller negates it); each batching level (`levels`, innermost first) vmaps it and sums
    over the batch."""

    def __init__(
        self,
        fn: Callable,
        in_tree: Any,
        signed: bool,
        levels: tuple = (),
        of_inverse: bool = False,
    ) -> None:
        self.fn, self.in_tree, self.signed, self.levels = fn, in_tree, signed, levels
        self.of_inverse = of_inverse

    def __call__(self, *leaves: Any) -> tuple[Any, Any]:
        if self.levels:
            inner = _Logdet(self.fn, self.in_tree, self.signed, self.levels[:-1], self.of_inverse)
            s, la = jax.vmap(inner, in_axes=self.levels[-1])(*leaves)
            return jnp.prod(s), jnp.sum(la)
        out = self.fn(*jax.tree_util.tree_unflatten(self.in_tree, list(leaves)))
        if self.signed:
            return jnp.asarray(out[0]), jnp.asarray(out[1])
        return jnp.ones_like(out), jnp.asarray(out)

    def batched(self, axes: Sequence[Any]) -> _Logdet:
        return _Logdet(
            self.fn, self.in_tree, self.signed, (*self.levels, tuple(axes)), self.of_inverse
        )

    def _key(self) -> tuple:
        return (self.fn, self.in_tree, self.signed, self.levels, self.of_inverse)

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Logdet) and self._key() == other._key()


def _split(args, n_fconsts, n_iconsts):
    return (
        args[:n_fconsts],
        args[n_fconsts : n_fconsts + n_iconsts],
        args[n_fconsts + n_iconsts :],
    )


def _impl(*args, fun_jaxpr, inv_jaxpr, n_fconsts, n_iconsts, state, logdet=None, implicit=None):
    fc, _, xs = _split(args, n_fconsts, n_iconsts)
    return eval_closed(fun_jaxpr, *fc, *xs)


def _jvp(primals, tangents, **params):
    if params["implicit"] is None:
        return jax.jvp(
            functools.partial(_impl, **params),
            tuple(primals),
            instantiate_tangents(primals, tangents),
        )
    return _implicit_jvp(primals, tangents, params)


def _implicit_jvp(primals, tangents, params: dict):
    """`differentiate="inverse"`: the outputs `y` of ``y = fun(x, p)`` differentiated through
    ``inv(y, p) = x``: ``J dy = dx - (d inv / d p) dp``, `J` the inverse's Jacobian in `y`,
    one dense block per sample of the `implicit` leading batch axes (`vmap` keeps samples
    apart: n tangents of the inverse, n the state's size per sample, whatever the batch)."""
    n_fconsts, n_iconsts, state = params["n_fconsts"], params["n_iconsts"], params["state"]
    inv_jaxpr, implicit = params["inv_jaxpr"], params["implicit"]
    if any(not is_symbolic_zero(t) for t in tangents[:n_fconsts]):
        raise TypeError(
            "jaxrev.custom_inverse(differentiate='inverse'): the function closes over a value "
            "being differentiated; pass it as an argument (to the function and its inverse)"
        )
    ys = custom_inverse_p.bind(*primals, **params)
    if not all(jnp.issubdtype(jnp.result_type(y), jnp.floating) for y in ys):
        # (an integer has no derivative to solve for; a complex state would need the
        # inverse's Jacobian over real and imaginary parts apart, where it is not
        # holomorphic: conj, abs, real, imag)
        raise TypeError(
            "jaxrev.custom_inverse(differentiate='inverse'): the state has an integer or a "
            "complex leaf; the implicit derivative takes real floating states only: "
            "differentiate='fun' instead"
        )
    tangents = instantiate_tangents(primals, tangents)
    _, ic, xs = _split(list(primals), n_fconsts, n_iconsts)
    _, dic, dxs = _split(list(tangents), n_fconsts, n_iconsts)

    def inverse(outs, ic, params):
        it, pt = iter(outs), iter(params)
        return eval_closed(inv_jaxpr, *ic, *[next(it) if s else next(pt) for s in state])

    own = [x for x, s in zip(xs, state) if not s]
    d_own = [d for d, s in zip(dxs, state) if not s]
    d_state = [d for d, s in zip(dxs, state) if s]
    # what moving the parameters (and the inverse's constants) does to the recovered state
    _, moved = jax.jvp(lambda ic, own: inverse(ys, ic, own), (list(ic), own), (list(dic), d_own))
    lead = tuple(jnp.shape(ys[0])[:implicit])
    per = [int(np.prod(jnp.shape(y)[implicit:], dtype=int)) for y in ys]
    n = sum(per)

    def flat(vs):  # (*batch, n): the state per sample, its leaves side by side
        return jnp.concatenate([jnp.reshape(v, lead + (k,)) for v, k in zip(vs, per)], axis=-1)

    def unflat(v):
        out, at = [], 0
        for y, k in zip(ys, per):
            out.append(jnp.reshape(v[..., at : at + k], jnp.shape(y)).astype(y.dtype))
            at += k
        return out

    def column(e):  # the inverse's Jacobian times the basis vector `e`, in every sample
        _, t = jax.jvp(
            lambda outs: inverse(outs, ic, own),
            (list(ys),),
            (unflat(jnp.broadcast_to(e, lead + (n,))),),
        )
        return flat(t)

    dtype = jnp.result_type(*ys)
    J = jnp.moveaxis(jax.vmap(column)(jnp.eye(n, dtype=dtype)), 0, -1)
    rhs = flat(d_state) - flat(moved)
    # (solved in float32 at least: XLA has no LU in bfloat16 or float16)
    wide = jnp.promote_types(dtype, jnp.float32)
    return ys, unflat(jnp.linalg.solve(J.astype(wide), rhs.astype(wide)[..., None])[..., 0])


def _batch(
    args, dims, *, fun_jaxpr, inv_jaxpr, n_fconsts, n_iconsts, state, logdet=None, implicit=None
):
    size, args, axes = batch_front(args, dims)
    fc, ic, xs = _split(args, n_fconsts, n_iconsts)
    fa, ia, xa = _split(axes, n_fconsts, n_iconsts)
    # the state is batched on both sides; parameters keep their own batching
    xs = [
        jnp.broadcast_to(x, (size,) + jnp.shape(x)) if s and a is None else x
        for x, a, s in zip(xs, xa, state)
    ]
    xa = [0 if s else a for a, s in zip(xa, state)]

    def vm(closed, c, ca):
        fn = jax.vmap(lambda *a: eval_closed(closed, *a), in_axes=(*ca, *xa), axis_size=size)
        new, consts, _ = trace_to_closed(fn, *avals_of([*c, *xs]))
        return new, consts

    fj, fk = vm(fun_jaxpr, fc, fa)
    ij, ik = vm(inv_jaxpr, ic, ia)
    # vmap's own constants (hoisted by trace_to_closed) lead each jaxpr's inputs
    out = custom_inverse_p.bind(
        *fk,
        *fc,
        *ik,
        *ic,
        *xs,
        fun_jaxpr=fj,
        inv_jaxpr=ij,
        n_fconsts=len(fk) + len(fc),
        n_iconsts=len(ik) + len(ic),
        state=state,
        logdet=None if logdet is None else logdet.batched(xa),
        implicit=None if implicit is None else implicit + 1,
    )
    return out, [0] * len(out)


@functools.lru_cache(maxsize=256)
def _compiled(fun_jaxpr: Any) -> Callable:
    return checked_jit(functools.partial(eval_closed, fun_jaxpr))


def _eager_impl(
    *args, fun_jaxpr, inv_jaxpr, n_fconsts, n_iconsts, state, logdet=None, implicit=None
):
    # called eagerly, the function runs as one compiled program, not equation by equation
    # (a choice group's Newton loops would each be compiled on their own)
    fc, _, xs = _split(args, n_fconsts, n_iconsts)
    return _compiled(fun_jaxpr)(*fc, *xs)


# evaluated eagerly as one compiled program; lowered (under `jit`) as the function itself
custom_inverse_p = make_primitive(
    "jaxrev_custom_inverse",
    multiple_results=True,
    impl=_eager_impl,
    abstract=lambda *avals, fun_jaxpr, **_: list(fun_jaxpr.out_avals),
    lowering=_impl,
    jvp=_jvp,
    batch=_batch,
)


def _inverse_rule(
    outs, *ins, fun_jaxpr, inv_jaxpr, n_fconsts, n_iconsts, state, logdet=None, implicit=None
):
    fc, ic, xs = _split(list(ins), n_fconsts, n_iconsts)
    if any(is_unknown(c) for c in [*fc, *ic]) or any(
        is_unknown(x) for x, s in zip(xs, state) if not s
    ):
        raise NeedMore("the inverse's parameters are not known yet")
    if any(is_unknown(o) for o in outs):
        raise NeedMore("the outputs are not known yet")
    it = iter(outs)
    args = [next(it) if s else x for x, s in zip(xs, state)]
    rec = eval_closed(inv_jaxpr, *ic, *args)
    it = iter(rec)
    return [None] * (n_fconsts + n_iconsts) + [next(it) if s else None for s in state]


def _logdet_rule(ctx: LogdetContext) -> tuple[Any, Any]:
    """The user's `deflogdet` (at the inputs, or the inverse's at the outputs, negated), else
    `fun`'s Jacobian with respect to the state, dense (at most `DENSE_STEP` numbers)."""
    p = ctx.eqn.params
    _, _, xs = _split(ctx.invals, p["n_fconsts"], p["n_iconsts"])
    fc = ctx.invals[: p["n_fconsts"]]
    rule = p["logdet"]
    if rule is not None and rule.of_inverse:
        # the inverse's rule at the outputs (computed here where the sweep has not yet)
        outs = ctx.outvals
        if any(o is None for o in outs):
            outs = eval_closed(p["fun_jaxpr"], *fc, *xs)
        it = iter(outs)
        s, la = rule(*[next(it) if st else x for x, st in zip(xs, p["state"])])
        return jnp.asarray(s, ctx.dtype), -jnp.asarray(la, ctx.dtype)
    if rule is not None:
        s, la = rule(*xs)
        return jnp.asarray(s, ctx.dtype), jnp.asarray(la, ctx.dtype)
    state = [x for x, s in zip(xs, p["state"]) if s]
    if sum(int(np.size(x)) for x in state) > DENSE_STEP:
        raise Unsupported("a custom_inverse function with no log-determinant rule (.deflogdet)")

    def f(vec):
        k, args = 0, []
        for x, s in zip(xs, p["state"]):
            if s:
                n = int(np.size(x))
                args.append(jnp.reshape(vec[k : k + n], jnp.shape(x)))
                k += n
            else:
                args.append(x)
        return jnp.concatenate([jnp.ravel(o) for o in eval_closed(p["fun_jaxpr"], *fc, *args)])

    return dense.slogdet(jax.jacfwd(f)(jnp.concatenate([jnp.ravel(x) for x in state])))


_logdet_rule.sign_known = lambda eqn: (
    eqn.params["logdet"] is None  # type: ignore[attr-defined]
    or eqn.params["logdet"].signed
)

define(custom_inverse_p, inverse=_inverse_rule, logdet=_logdet_rule)


# --------------------------------------------------------------------------- hook's primitive


def _hook_transpose(cts, *xs, fn, tree):
    cts = [
        jnp.zeros(x.aval.shape, x.aval.dtype) if is_symbolic_zero(c) else c for c, x in zip(cts, xs)
    ]
    g = jax.tree_util.tree_unflatten(tree, cts)
    out = fn(g)
    name = getattr(fn, "__name__", repr(fn))
    leaves, out_tree = jax.tree_util.tree_flatten(out)
    if out_tree != tree or any(jnp.shape(a) != jnp.shape(b) for a, b in zip(leaves, cts)):
        raise ValueError(
            f"jr.hook: {name} must return a cotangent with the structure and "
            f"shapes of its input ({tree}), got {out_tree}"
        )
    return [jnp.asarray(o, jnp.result_type(c)) for o, c in zip(leaves, cts)]


def _hook_jvp(primals, tangents, *, fn, tree):
    return (
        hook_p.bind(*primals, fn=fn, tree=tree),
        hook_p.bind(*instantiate_tangents(primals, tangents), fn=fn, tree=tree),
    )


hook_p = make_primitive(
    "jaxrev_hook",
    multiple_results=True,
    impl=lambda *xs, fn, tree: list(xs),
    abstract=lambda *avals, fn, tree: list(avals),
    jvp=_hook_jvp,
    transpose=_hook_transpose,
    batch=lambda args, dims, *, fn, tree: (hook_p.bind(*args, fn=fn, tree=tree), list(dims)),
)
# the walker asks with some outputs still unknown (a key that the hook passes along, computed
# only once the state is): those inputs are not recovered yet
define(hook_p, inverse=lambda outs, *xs, fn, tree: [None if is_unknown(o) else o for o in outs])


# ----------------------------------------------------------------------- store / recompute marks


def _identity_primitive(name: str) -> Primitive:
    """An identity that marks a value in the jaxpr (and keeps marking it under JVP and vmap)."""
    p = make_primitive(
        name,
        impl=lambda x: x,
        abstract=lambda a: a,
        jvp=lambda primals, tangents: (p.bind(primals[0]), tangents[0]),
        transpose=lambda ct, x: [ct],
        batch=lambda args, dims: (p.bind(args[0]), dims[0]),
    )
    define(p, inverse=lambda out, x: [out])
    return p


store_p = _identity_primitive("jaxrev_store")
recompute_p = _identity_primitive("jaxrev_recompute")
