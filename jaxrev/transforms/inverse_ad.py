"""Inverse accumulation AD: J⁻¹v (`inverse_jvp`) and vᵀJ⁻¹ (`inverse_vjp`); log|det J| is
`flows.slogdet_jacobian`.

A square program is a product of step Jacobians J = E_T … E_1, so J⁻¹ = E_1⁻¹ … E_T⁻¹: one
inverted step at a time, in reverse order for J⁻¹v and in program order for J⁻ᵀw (docs/design.md
§3.4). jaxrev already knows how to invert steps: `reverse`'s rules and its lumps. The three
strategies below use them, tried in this order:

- ``"reverse"``: the program itself is invertible. Then J⁻¹ is the Jacobian of the inverse
  program at the outputs: `inverse_jvp` is a JVP of `reverse(fun)`, which rebuilds the primal
  values backwards (no tape). `inverse_vjp` is the memory-free VJP of `reverse(fun)`: its
  backward sweep runs `fun`'s steps in program order and rebuilds as it goes.
- ``"linearize"``: the program is not invertible, but its tangent program is. This is the usual
  case, since a step's Jacobian is invertible far more often than the step. `jax.linearize`
  records the step partials (the tape), and `reverse` inverts the linear program equation by
  equation:
  - a multiplication by a partial becomes a division by it (the pivot);
  - an elementwise lump is solved per element;
  - a square linear lump is solved densely;
  - slices and concatenations are permutations;
  - a `scan` inverts one iteration at a time.
- ``"dense"``: one lump of size n. Materialise J with `jacfwd` and LU-solve it. Always correct;
  O(n) JVPs plus O(n³).

A pivot that is exactly zero raises `SingularJacobianError` naming the step and its source
line (on concrete values); ``on_error="nan"`` returns NaN instead, and ``on_error="warn"`` NaN
and a `FailureWarning`. Under `jit` the values are not known when the program is traced:
singular steps then give non-finite results, which ``on_error="raise"`` turns into an error
when the program runs (and "warn" into a warning). The walks of both transforms run in their
own name (their errors say `jaxrev.inverse_jvp` / `jaxrev.inverse_vjp`) and without Newton's
method.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxrev._dense as dense
from jaxrev._cache import cached_call
from jaxrev._compat import is_concrete, make_jaxpr, staged_constants
from jaxrev._errors import (
    NotInvertibleError,
    SingularJacobianError,
    fail,
    no_result_for_dtype,
    singular_jacobian,
)
from jaxrev._evaluate import eval_closed
from jaxrev._prepare import fold_constants, without_custom_vjp
from jaxrev._program import Filtered, eval_shape, normalize_argnums
from jaxrev.transforms.knowledge.checks import raise_where
from jaxrev.transforms.knowledge.context import Settings, resolve_on_error
from jaxrev.transforms.reverse import reverse_with
from jaxrev.transforms.reversible import reversible_with
from jaxrev.transforms.sweep.dial import Dial

__all__ = ["inverse_jvp", "inverse_vjp", "METHODS"]

METHODS = ("auto", "reverse", "linearize", "dense")


# --------------------------------------------------------------------------- plumbing


def _name(fun: Callable) -> str:
    return getattr(fun, "__name__", repr(fun))


def _primal_computation(
    fun: Callable, primals: Sequence[Any]
) -> tuple[Callable, Callable[[], Any]]:
    """`fun` with its `custom_vjp` functions replaced by their primal computations (at any
    depth): J⁻¹v and log|det J| differentiate forward, which a custom VJP cannot. `fun`
    itself where it has none (decided by one trace at `primals`). Also what makes the context
    the attempts run in (`_jaxpr.fold_constants` of that trace)."""

    def traced(*args):
        split = Filtered(args)
        closed, out_shape = make_jaxpr(lambda *leaves: fun(*split.rebuild(leaves)), *split.flat)
        return split.flat, closed, jax.tree_util.tree_structure(out_shape)

    _, closed, _ = traced(*primals)
    fold = functools.partial(fold_constants, closed.jaxpr)
    if without_custom_vjp(closed) is closed:
        return fun, fold

    @functools.wraps(fun)
    def primal_fun(*args):
        flat, closed, out_tree = traced(*args)
        return jax.tree_util.tree_unflatten(
            out_tree, eval_closed(without_custom_vjp(closed), *flat)
        )

    return primal_fun, fold


def _check_args(fun: Callable, primals: Any, method: str, who: str) -> None:
    if not isinstance(primals, (tuple, list)):
        raise TypeError(
            f"{who}: primals must be a tuple of {_name(fun)}'s arguments, got "
            f"{type(primals).__name__}"
        )
    if method not in METHODS:
        raise ValueError(f"{who}: method must be one of {METHODS}, got {method!r}")


Argnums = int | Sequence[int] | None


def _positions(argnums: Argnums, primals: Sequence[Any], fun: Callable) -> tuple[int, ...] | None:
    """The positions of the primals the Jacobian is taken in (None: all of them)."""
    return None if argnums is None else normalize_argnums(argnums, len(primals), fun)


def _at(fun: Callable, primals: Sequence[Any], nums: tuple[int, ...] | None) -> Callable:
    """`fun` as a function of the primals at `nums` alone, the others held at their values."""
    if nums is None:
        return fun

    @functools.wraps(fun)
    def sub(*chosen: Any) -> Any:
        args = list(primals)
        for a, x in zip(nums, chosen):
            args[a] = x
        return fun(*args)

    return sub


def _chosen(primals: Sequence[Any], nums: tuple[int, ...] | None) -> tuple:
    return tuple(primals) if nums is None else tuple(primals[a] for a in nums)


def _walks(who: str) -> Settings:
    """The settings of the transform's walks: its name for errors; no Newton's method (J⁻¹
    needs only the step Jacobians, which the "linearize" strategy inverts exactly); a failed
    run-time check inside them raises (a vanished pivot is what `on_error` is about)."""
    return Settings(who, newton=False)


class _Square:
    """`fun` of all its arguments, flattened: x (one vector) -> y (one vector), with the
    pytree bookkeeping to go back and forth."""

    def __init__(self, fun: Callable, primals: Sequence[Any], who: str) -> None:
        self.fun, self.who = fun, who
        self.primals = tuple(primals)
        # static leaves (an Equinox module's functions) are passed through, not inputs
        self.split = Filtered(self.primals)
        self.in_leaves = self.split.flat
        out_shape = eval_shape(fun, *self.primals)
        self.out_leaves_shape, self.out_tree = jax.tree_util.tree_flatten(out_shape)
        n_in = sum(int(np.size(x)) for x in self.in_leaves)
        n_out = sum(int(np.prod(o.shape, dtype=np.int64)) for o in self.out_leaves_shape)
        if n_in != n_out:
            raise ValueError(
                f"{who}: {_name(fun)} maps {n_in} input numbers to {n_out} outputs; its "
                "Jacobian must be square (every argument at argnums counts as an input; "
                "argnums=None: every argument)"
            )
        for k, x in enumerate(self.in_leaves):
            if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
                raise no_result_for_dtype(
                    who,
                    f"input leaf {k} of {_name(fun)}",
                    jnp.result_type(x),
                    "an integer or boolean state has no tangents, so there is no Jacobian "
                    "to invert (pass float or complex arrays)",
                )
        # same pytree structure, shapes and dtypes in and out: `reverse` can work on `fun` as
        # it is; otherwise it works on the flattened map
        in_struct = jax.tree_util.tree_structure(
            self.primals[0] if len(self.primals) == 1 else self.primals
        )
        self.same = in_struct == self.out_tree and all(
            tuple(np.shape(x)) == tuple(o.shape) and jnp.result_type(x) == o.dtype
            for x, o in zip(self.in_leaves, self.out_leaves_shape)
        )

    # the state passed to / returned by `reverse`
    def state_in(self, leaves):
        args = self.split.rebuild(list(leaves))
        return args[0] if len(args) == 1 else tuple(args)

    def args_of(self, state):
        return (state,) if len(self.primals) == 1 else tuple(state)

    def out_tree_of(self, leaves):
        return jax.tree_util.tree_unflatten(self.out_tree, list(leaves))

    def in_tree_of(self, leaves):
        return tuple(self.split.rebuild(list(leaves)))

    def tangents_of(self, leaves):
        """Tangents in the primals' structure: None at static leaves (as Equinox's)."""
        it = iter(leaves)
        return tuple(
            jax.tree_util.tree_unflatten(
                self.split.tree, [next(it) if m else None for m in self.split.mask]
            )
        )

    def ravel_in(self, leaves):
        return jnp.concatenate([jnp.ravel(x) for x in leaves]) if leaves else jnp.zeros(0)

    def unravel(self, vec, shapes_dtypes):
        out, k = [], 0
        for shape, dtype in shapes_dtypes:
            m = int(np.prod(shape, dtype=np.int64))
            out.append(jnp.reshape(vec[k : k + m], shape).astype(dtype))
            k += m
        return out

    @property
    def in_sd(self):
        return [(tuple(np.shape(x)), jnp.result_type(x)) for x in self.in_leaves]

    @property
    def out_sd(self):
        return [(tuple(o.shape), o.dtype) for o in self.out_leaves_shape]

    def flat_fun(self) -> Callable:
        """x_vec -> y_vec."""

        def f(v):
            args = self.in_tree_of(self.unravel(v, self.in_sd))
            outs = jax.tree_util.tree_leaves(self.fun(*args))
            return jnp.concatenate([jnp.ravel(o) for o in outs])

        return f

    def dense_jacobian(self):
        """J materialised by `jacfwd`: one lump of size n."""
        with staged_constants():  # the n x n identity basis must not become a constant
            return jax.jacfwd(self.flat_fun())(self.ravel_in(self.in_leaves))

    def state_fun(self, fun: Callable) -> Callable:
        """`fun` (of the original arguments) as a map of one state, for `reverse`."""
        if self.same:
            return lambda state: fun(*self.args_of(state))
        in_sd = self.in_sd

        def g(v):
            args = self.in_tree_of(self.unravel(v, in_sd))
            outs = jax.tree_util.tree_leaves(fun(*args))
            return jnp.concatenate([jnp.ravel(o) for o in outs])

        return g

    def to_state_out(self, out_leaves):
        """Output-side leaves as the state `reverse(state_fun)` takes."""
        if self.same:
            return self.state_in(out_leaves)
        return jnp.concatenate([jnp.ravel(o) for o in out_leaves])

    def from_state_in(self, state):
        """The state returned by `reverse(state_fun)` as input-side leaves."""
        if self.same:
            return jax.tree_util.tree_leaves(state)
        return self.unravel(state, self.in_sd)

    def from_state_out(self, state):
        """A state of `state_fun`'s output as output-side leaves."""
        if self.same:
            return jax.tree_util.tree_leaves(state)
        return self.unravel(state, self.out_sd)

    def to_state_in(self, in_leaves):
        if self.same:
            return self.state_in(in_leaves)
        return self.ravel_in(in_leaves)


def _nan_like(leaves):
    return [jnp.full(jnp.shape(x), jnp.nan, jnp.result_type(x)) for x in leaves]


def _guard(
    leaves: list, on_error: str, who: str, diagnose: Callable[[], Any] | None = None
) -> list:
    """With "raise" (or "warn"), a non-finite result is a vanished pivot. Concrete results are
    checked now (and `diagnose` re-runs the inversion on plain values, where its rules check
    their pivots and name the step); traced ones (under jit) when the program runs."""
    if on_error == "nan":
        return leaves
    if all(is_concrete(x) for x in leaves):
        if all(bool(np.all(np.isfinite(np.asarray(x)))) for x in leaves):
            return leaves
        if diagnose is not None:
            try:
                diagnose()
            except NotInvertibleError as e:
                if e.singular:
                    fail(on_error, singular_jacobian(e, who))
                    return leaves
        fail(
            on_error,
            SingularJacobianError(
                f"{who}: the result is not finite: a pivot of the Jacobian vanished (or "
                "overflowed); "
                "no single step could be named. Pass on_error='nan' to get NaN instead."
            ),
        )
        return leaves
    ok = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in leaves]))

    def error(ok):
        return (
            None
            if bool(ok)
            else SingularJacobianError(
                f"{who}: the result is not finite: a pivot of the Jacobian vanished (or "
                "overflowed) while the program ran. Run it without jit to name the step, or "
                "pass on_error='nan'."
            )
        )

    raise_where(on_error, error, ok, bad=~ok)
    return leaves


def _diagnoser(used: str, sq: _Square, fun: Callable, y_leaves: list) -> Callable[[], Any] | None:
    """Re-running the inverse program on plain values checks every pivot it divides by (inside
    a JVP its rules see tracers and cannot); the "linearize" strategy already ran on values."""
    if used != "reverse":
        return None

    def diagnose():
        return reverse_with(sq.state_fun(fun), _walks(sq.who))(sq.to_state_out(y_leaves))

    return diagnose


def _try(
    methods: Sequence[str],
    attempt: Callable[[str], Any],
    who: str,
    on_error: str,
    nan_shape: Callable[[], Any],
    fold: Callable[[], Any],
):
    """Run `attempt(method)` for the first method that applies, in the context `fold()`. A
    vanished pivot ends the search (a singular Jacobian is singular whichever way it is
    inverted), once the step Jacobians themselves ("linearize") say so."""
    last: NotInvertibleError | None = None
    for m in methods:
        try:
            # values computed from constants alone (the indices of `x.at[1:]`) stay concrete
            # under jit, so lumps can see their sparsity (Newton's method is not used: the
            # attempts' walks have the settings of `_walks`)
            with fold():
                return attempt(m), m
        except NotInvertibleError as e:
            # "reverse" inverts the program's own steps, grouped as it finds them: a group it
            # finds singular may still be nonsingular as the tangent program groups it
            if e.singular and m == "reverse" and "linearize" in methods:
                last = e
                continue
            if e.singular:
                if on_error == "raise":
                    raise singular_jacobian(e, who) from None
                fail(on_error, singular_jacobian(e, who))
                return nan_shape(), m
            last = e
    assert last is not None
    raise last


def _methods(method: str) -> tuple[str, ...]:
    return ("reverse", "linearize", "dense") if method == "auto" else (method,)


# --------------------------------------------------------------------------- dense fallback


def _dense_solve(J: Any, b: Any, transpose: bool, on_error: str, who: str) -> Any:
    lu, piv = dense.lu_factor(J)
    diag = jnp.diagonal(lu)
    if is_concrete(diag) and bool(jnp.any(diag == 0)):
        k = int(jnp.argmax(diag == 0))
        fail(
            on_error,
            SingularJacobianError(
                f"{who}: the Jacobian is singular (dense fallback: pivot {k} of its LU "
                "factorization vanished; no single step could be named because no step-by-step "
                "inversion applied)"
            ),
        )
        return jnp.full_like(b, jnp.nan)
    return dense.lu_solve((lu, piv), b, trans=1 if transpose else 0)


# --------------------------------------------------------------------------- inverse_jvp


def inverse_jvp(
    fun: Callable,
    primals: Sequence[Any],
    out_tangent: Any,
    *,
    argnums: Argnums = None,
    method: str = "auto",
    on_error: str | None = None,
) -> tuple[Any, Any]:
    """Solve ``J @ in_tangents == out_tangent`` step by step (J⁻¹v without forming J).

    `J` is the Jacobian of `fun` at `primals` with respect to the primals at `argnums` (the
    others held fixed). It must be square. The solve inverts `fun`'s own steps (see the module
    docs for the strategies); no dense J is formed unless `method="dense"`, or "auto" finds no
    other way.

    **Arguments:**

    - `fun`: the function, of the positional arguments `primals`; returns a pytree of arrays.
    - `primals`: a tuple (or list) of `fun`'s arguments, pytrees of floating-point arrays, as
      for `jax.jvp`.
    - `out_tangent`: a pytree of `fun`'s output structure: the right-hand side v.
    - `argnums`: the positions of the primals the Jacobian is taken in: None (the default,
      `jax.jvp`'s convention) all of them, an int one, a tuple several.
    - `method`: "auto" (tries "reverse", then "linearize", then "dense"), "reverse",
      "linearize" or "dense".
    - `on_error`: what a singular Jacobian does: "raise" (the default; a
      `SingularJacobianError` naming the step, under `jit` when the program runs), "nan"
      (NaN tangents), "warn" (NaN and a `jr.FailureWarning`).

    **Returns:**

    ``(fun(*primals), in_tangents)``: `in_tangents` solves ``J @ in_tangents == out_tangent``.
    It is a tuple matching `primals` (argnums None), the tangent of the one argument (an int
    argnums), or a tuple with one entry per position (a tuple argnums).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jnp.cumsum(jnp.exp(x))
        >>> y, (t,) = jr.inverse_jvp(f, (jnp.zeros(3),), jnp.ones(3))
        >>> t.tolist()  # J = lower-triangular ones times diag(exp(0))
        [1.0, 0.0, 0.0]
        >>> g = lambda x, s: x * jnp.exp(s)
        >>> _, t = jr.inverse_jvp(g, (jnp.ones(2), jnp.zeros(2)), jnp.ones(2), argnums=1)
        >>> t.tolist()  # J in s = diag(x * exp(s)), x held fixed
        [1.0, 1.0]
    """
    who = "jaxrev.inverse_jvp"
    on_error = resolve_on_error(who, on_error)
    _check_args(fun, primals, method, who)
    nums = _positions(argnums, primals, fun)
    single = isinstance(argnums, int)
    # eager calls are compiled from the second on, keyed like jax.jit's (`_cache`)
    return cached_call(
        (who, method, on_error, nums, single),
        fun,
        partial(_inverse_jvp_at, fun, method, on_error, nums, single),
        (tuple(primals), out_tangent),
    )


def _inverse_jvp_at(
    fun: Callable,
    method: str,
    on_error: str,
    nums: tuple[int, ...] | None,
    single: bool,
    primals: tuple,
    out_tangent: Any,
) -> tuple[Any, Any]:
    """`_inverse_jvp` in the primals at `nums` (None: all), the others held fixed."""
    y, t = _inverse_jvp(
        _at(fun, primals, nums), method, on_error, _chosen(primals, nums), out_tangent
    )
    return y, (t[0] if single else t)


def _inverse_jvp(
    fun: Callable, method: str, on_error: str, primals: tuple, out_tangent: Any
) -> tuple[Any, tuple]:
    who = "jaxrev.inverse_jvp"
    fun, fold = _primal_computation(fun, primals)
    sq = _Square(fun, primals, who)
    out_leaves = jax.tree_util.tree_leaves(out_tangent)
    if jax.tree_util.tree_structure(out_tangent) != sq.out_tree:
        raise ValueError(
            f"{who}: out_tangent must have the structure of {_name(fun)}'s output "
            f"({sq.out_tree}), got {jax.tree_util.tree_structure(out_tangent)}"
        )
    y = fun(*primals)
    y_leaves = jax.tree_util.tree_leaves(y)

    def attempt(m):
        if m == "reverse":
            inv = reverse_with(sq.state_fun(fun), _walks(who))
            _, t = jax.jvp(inv, (sq.to_state_out(y_leaves),), (sq.to_state_out(out_leaves),))
            return sq.from_state_in(t)
        if m == "linearize":
            _, lin = jax.linearize(fun, *primals)
            t = reverse_with(sq.state_fun(lin), _walks(who))(sq.to_state_out(out_leaves))
            return sq.from_state_in(t)
        b = jnp.concatenate([jnp.ravel(o) for o in out_leaves])
        return sq.unravel(_dense_solve(sq.dense_jacobian(), b, False, on_error, who), sq.in_sd)

    leaves, used = _try(
        _methods(method), attempt, who, on_error, lambda: _nan_like(sq.in_leaves), fold
    )

    leaves = _guard(leaves, on_error, who, _diagnoser(used, sq, fun, y_leaves))
    return y, sq.tangents_of(leaves)


# --------------------------------------------------------------------------- inverse_vjp


def inverse_vjp(
    fun: Callable,
    *primals: Any,
    argnums: Argnums = None,
    method: str = "auto",
    on_error: str | None = None,
) -> tuple[Any, Callable]:
    """The inverse of `jax.vjp`'s pullback: returns ``(fun(*primals), ivjp_fn)``, where
    ``ivjp_fn(in_cotangents)`` is the output cotangent `w` with ``vjp_fn(w) ==
    in_cotangents``, that is ``J⁻ᵀ in_cotangents``.

    `J` is the Jacobian of `fun` at `primals` with respect to the primals at `argnums` (the
    others held fixed); it must be square. With method "reverse" (tried first by "auto") no
    tape is kept: the sweep runs `fun`'s steps in program order, rebuilding values as it goes.

    **Arguments:**

    - `fun`: the function of `primals`; returns a pytree of arrays.
    - `*primals`: `fun`'s positional arguments, pytrees of floating-point arrays, as for
      `jax.vjp`.
    - `argnums`: the positions of the primals the Jacobian is taken in: None (the default)
      all of them, an int one, a tuple several.
    - `method`: as for `inverse_jvp`.
    - `on_error`: as for `inverse_jvp` ("raise", "nan", "warn").

    **Returns:**

    ``(y, ivjp_fn)``: `y` is ``fun(*primals)``; `ivjp_fn` takes the input cotangents (a tuple
    matching `primals` for argnums None, the one argument's cotangent for an int, a tuple
    with one entry per position for a tuple) and returns `w`, of `y`'s structure.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jnp.cumsum(x) * 2.0
        >>> x = jnp.arange(3.0)
        >>> y, ivjp = jr.inverse_vjp(f, x)
        >>> w = ivjp((jnp.ones(3),))
        >>> jax.vjp(f, x)[1](w)[0].tolist()
        [1.0, 1.0, 1.0]
    """
    who = "jaxrev.inverse_vjp"
    on_error = resolve_on_error(who, on_error)
    _check_args(fun, primals, method, who)
    primals = tuple(primals)
    nums = _positions(argnums, primals, fun)
    single = isinstance(argnums, int)

    def primal(*args):
        # the Jacobian is square: checked when traced, not per hit
        _Square(_at(fun, args, nums), _chosen(args, nums), who)
        return fun(*args)

    y = cached_call(("primal", nums), fun, primal, primals)
    n = len(_chosen(primals, nums))

    def ivjp_fn(in_cotangents):
        if single:
            in_cotangents = (in_cotangents,)
        elif not isinstance(in_cotangents, (tuple, list)) or len(in_cotangents) != n:
            raise ValueError(
                f"{who}: in_cotangents must be a tuple with one entry per primal at argnums "
                f"({n}), got {type(in_cotangents).__name__}"
            )
        return cached_call(
            (who, method, on_error, nums),
            fun,
            partial(_inverse_vjp_at, fun, method, on_error, nums),
            (primals, y, tuple(in_cotangents)),
        )

    return y, ivjp_fn


def _inverse_vjp_at(
    fun: Callable,
    method: str,
    on_error: str,
    nums: tuple[int, ...] | None,
    primals: tuple,
    y: Any,
    in_cotangents: tuple,
) -> Any:
    """`_inverse_vjp` in the primals at `nums` (None: all), the others held fixed."""
    return _inverse_vjp(
        _at(fun, primals, nums), method, on_error, _chosen(primals, nums), y, in_cotangents
    )


def _inverse_vjp(
    fun: Callable, method: str, on_error: str, primals: tuple, y: Any, in_cotangents: tuple
) -> Any:
    """J⁻ᵀ in_cotangents at `primals`, where `fun` gave `y` (computed once, by the caller)."""
    who = "jaxrev.inverse_vjp"
    fun, fold = _primal_computation(fun, primals)
    sq = _Square(fun, primals, who)
    y_leaves = jax.tree_util.tree_leaves(y)
    c_leaves = jax.tree_util.tree_leaves(in_cotangents)

    def attempt(m):
        if m == "reverse":
            back = reverse_with(sq.state_fun(fun), _walks(who))
            inv = reversible_with(back, 0, Dial(name=back.__name__, walk=_walks(who)))
            _, pull = jax.vjp(inv, sq.to_state_out(y_leaves))
            (w,) = pull(sq.to_state_in(c_leaves))
            return sq.from_state_out(w)
        if m == "linearize":
            _, lin = jax.linearize(fun, *primals)
            lin_t = jax.linear_transpose(lin, *primals)
            # lin_t: output cotangent -> tuple of input cotangents; invert it
            t_state = _TransposedState(sq, lin_t)
            w = reverse_with(t_state, _walks(who))(sq.to_state_in(c_leaves))
            return sq.from_state_out(w)
        c = sq.ravel_in(c_leaves)
        return sq.unravel(_dense_solve(sq.dense_jacobian(), c, True, on_error, who), sq.out_sd)

    leaves, used = _try(_methods(method), attempt, who, on_error, lambda: _nan_like(y_leaves), fold)

    leaves = _guard(leaves, on_error, who, _diagnoser(used, sq, fun, y_leaves))
    return sq.out_tree_of(leaves)


class _TransposedState:
    """The transposed linear map as a function of one output-side state, returning the
    input-side state: what `reverse` inverts for the "linearize" inverse VJP."""

    def __init__(self, sq: _Square, lin_t: Callable) -> None:
        self.sq, self.lin_t = sq, lin_t
        self.__name__ = "transpose_of_jvp"

    def __call__(self, w_state):
        sq = self.sq
        try:
            cts = self.lin_t(sq.out_tree_of(sq.from_state_out(w_state)))
        except ValueError as e:  # JAX transposes no while loop: another strategy must do
            raise NotInvertibleError(
                f"jax.linear_transpose cannot transpose the function's "
                f"linearization: {str(e).splitlines()[0]}"
            ) from None
        return sq.to_state_in(jax.tree_util.tree_leaves(tuple(cts)))
