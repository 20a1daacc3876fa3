"""Newton-step optimizers and root finding on inverse accumulation (docs/design.md §1, §3.4).

A Newton step solves ``H d = g``. `H` is the Jacobian of the gradient, so ``d = H⁻¹g`` is
`inverse_vjp` (or `inverse_jvp`, `H` being symmetric) over ``jax.grad(f)``: the gradient
program's steps are inverted one at a time, and its lumps are solved with the structure their
sparsity admits (a chained Rosenbrock's tridiagonal Hessian by banded elimination, O(n)). The
Hessian is never materialised unless it is dense anyway.

- `scale_by_newton` / `newton`: Optax transformations (Newton direction, optional Levenberg
  damping ``(H + λI)⁻¹g``), composable with `optax.chain` and Optax's line searches;
- `minimize`: Newton with a backtracking (Armijo) line search, or a Levenberg-Marquardt trust
  region that handles indefinite and singular Hessians; jittable, one `lax.while_loop`;
- `root`: Newton's method on ``F(x) = 0`` with ``J⁻¹F`` from `inverse_jvp` of `F` itself and a
  backtracking line search on ``‖F‖²``; Optimistix's `rtol` / `atol`.

Called eagerly, `minimize` and `root` run as one compiled call per function, argument shapes
and settings, cached like `jax.jit`'s: a repeated call does not trace again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.flatten_util import ravel_pytree

import jaxrev._dense as dense
from jaxrev._cache import cached_call, call_key, memo
from jaxrev._compat import is_concrete, tracing
from jaxrev._errors import NotConvergedError, NotInvertibleError, called_at, no_result_for_dtype
from jaxrev._program import Filtered, ravel_filtered, traced_leaves
from jaxrev._runtime import checked_jit
from jaxrev.transforms.inverse_ad import inverse_jvp, inverse_vjp
from jaxrev.transforms.knowledge.checks import check_at_run_time

__all__ = [
    "scale_by_newton",
    "newton",
    "minimize",
    "root",
    "Info",
    "STATUS",
    "newton_direction",
    "default_tolerance",
    "Status",
    "jacobian_solve",
    "least_squares",
    "gauss_newton_direction",
]

STATUS = ("converged", "max_iterations", "stalled", "non_finite")
"""What `Info.status` counts: 0 converged (to `minimize`'s `tol`, to `root`'s `rtol` / `atol`);
1 stopped at `maxiter`; 2 no step could make progress any more (a line search or trust region
shrank to nothing) short of the tolerance; 3 the objective or its derivatives stopped being
finite."""


class Status(enum.IntEnum):
    """`Info.status`'s values by name, for comparisons that work under `jit` and `vmap`
    (``info.status == Status.converged`` is an array), as Optimistix's `RESULTS`.

    **Members:** `converged` (0), `max_iterations` (1), `stalled` (2), `non_finite` (3), in
    the order of `STATUS`.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> solve = jax.jit(lambda x0: jr.optim.root(lambda x: x**3 - 8.0, x0)[1])
        >>> bool(solve(jnp.array(1.0)).status == jr.optim.Status.converged)
        True
    """

    converged = 0
    max_iterations = 1
    stalled = 2
    non_finite = 3


class Info(NamedTuple):
    """What `minimize` and `root` return beside the solution (arrays, so jit can return them).

    **Arguments:**

    - `iterations`: the iterations taken.
    - `residual`: the gradient's (or F's) largest absolute entry at the solution.
    - `value`: the objective there (`root`: ``‖F‖²/2``).
    - `status`: an index into `jaxrev.optim.STATUS`; `info.message` is its name.
    - `aux`: with ``has_aux=True``, what `fun` returned beside its value, at the solution
      (None otherwise).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> x, info = jr.optim.root(lambda x: x ** 3 - 8.0, jnp.array([1.0]))
        >>> round(float(x[0]), 6), jr.optim.STATUS[int(info.status)]
        (2.0, 'converged')
    """

    iterations: jax.Array
    residual: jax.Array
    value: jax.Array
    status: jax.Array
    aux: Any = None

    @property
    def message(self) -> str:
        """The status's name (outside `jit`: a traced status has no value to name; compare
        ``info.status == jr.optim.Status.converged`` there)."""
        if not is_concrete(self.status):
            raise TypeError(
                "jaxrev.optim.Info.message: the status is traced (under jit or vmap) and has "
                "no name yet; compare info.status == jr.optim.Status.converged (an array), "
                "or return info and read .message outside"
            )
        if jnp.ndim(self.status):
            raise TypeError(
                "jaxrev.optim.Info.message: the status is a batch of "
                f"{jnp.shape(self.status)} (vmap); index one sample first"
            )
        return STATUS[int(self.status)]


def _tree_axpy(a, x, y):
    return jax.tree_util.tree_map(lambda u, v: a * u + v, x, y)


def newton_direction(
    value_fn: Callable[[Any], Any],
    params: Any,
    grad: Any | None = None,
    *,
    damping: Any = 0.0,
    method: str = "auto",
    autodiff_mode: str = "bwd",
) -> Any:
    """``(H + damping·I)⁻¹ grad`` for the Hessian `H` of `value_fn` at `params`, by inverse
    accumulation over ``jax.grad(value_fn)``.

    **Arguments:**

    - `value_fn`: a scalar function of one pytree.
    - `params`: where H is taken (a pytree).
    - `grad`: the right-hand side, in `params`' structure (default: the gradient at `params`).
    - `damping`: added to the Hessian's diagonal (default 0).
    - `method`: "auto" (the default: the dense Hessian, factored, where it is mostly
      filled; else the gradient's tangent program at `params` inverted step by step, its
      lumps solved with their structure; else the dense Hessian), or a strategy of
      `jr.inverse_vjp` ("reverse", "linearize", "dense").
    - `autodiff_mode`: how the gradient is taken, as Optimistix's option: "bwd" (the
      default, `jax.grad`) or "fwd" (`jax.jacfwd`: one JVP per unknown, for objectives that
      reverse mode cannot run, such as a `lax.while_loop` with dynamic bounds, diffrax's
      `ForwardMode`); the Hessian is then the forward gradient's Jacobian, inverted step by
      step where its program allows, else formed by JVPs and factored.

    **Returns:**

    The direction, in `params`' structure. A singular system gives NaN (the caller decides
    what to do).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jnp.sum(x ** 4) + jnp.sum(x ** 2)
        >>> d = jr.optim.newton_direction(f, jnp.array([1.0, 2.0]))  # (4x³+2x) / (12x²+2)
        >>> [round(float(v), 4) for v in d]
        [0.4286, 0.72]
    """
    # eager calls are compiled from the second on, keyed like jax.jit's (`_cache`); a Python
    # zero `damping` is part of the key (it skips the damping term), other values are traced
    static = damping if _is_zero(damping) else None
    _check_autodiff_mode("jaxrev.optim.newton_direction", autodiff_mode)
    return cached_call(
        ("newton_direction", method, static, autodiff_mode),
        value_fn,
        partial(_newton_direction, value_fn, method, static, autodiff_mode),
        (params, grad, None if static is not None else damping),
    )


def _check_autodiff_mode(who: str, autodiff_mode: str) -> None:
    if autodiff_mode not in ("bwd", "fwd"):
        raise ValueError(f"{who}: autodiff_mode must be 'bwd' or 'fwd', got {autodiff_mode!r}")


def _gradient(value_fn: Callable[[Any], Any], autodiff_mode: str) -> Callable[[Any], Any]:
    """The gradient of a scalar `value_fn`: by `jax.grad`, or by `jax.jacfwd` (one JVP per
    unknown) where reverse mode cannot run."""
    return jax.grad(value_fn) if autodiff_mode == "bwd" else jax.jacfwd(value_fn)


def _newton_direction(
    value_fn: Callable[[Any], Any],
    method: str,
    static: Any,
    autodiff_mode: str,
    params: Any,
    grad: Any,
    damping: Any,
) -> Any:
    damping = static if static is not None else damping
    g_fn = _gradient(value_fn, autodiff_mode)

    def damped(p):
        g = g_fn(p)
        return g if _is_zero(damping) else _tree_axpy(damping, p, g)

    if grad is None:
        grad = g_fn(params)
    if method == "dense" or (method == "auto" and _dense_hessian(g_fn, params)):
        return _dense_direction(g_fn, params, grad, damping)
    if autodiff_mode == "fwd":
        # H is symmetric, so H⁻¹grad is also an inverse JVP, which (unlike inverse_vjp's
        # transposed sweep) needs no reverse mode of the program
        try:
            m = "linearize" if method == "auto" else method
            return inverse_jvp(damped, (params,), grad, method=m, on_error="nan")[1][0]
        except NotInvertibleError:
            if method != "auto":
                raise
            return _dense_direction(g_fn, params, grad, damping)
    if method != "auto":
        _, ivjp = inverse_vjp(damped, params, method=method, on_error="nan")
        # H is symmetric: the output cotangent w with Hᵀw = grad is H⁻¹grad
        return ivjp((grad,))
    # "auto": the gradient's tangent program at `params`, inverted step by step. The point
    # is known, so inverse_vjp's memory-free "reverse" (rebuilding it by running the
    # gradient program backwards, nonlinear solves included) only costs: on the extended
    # Rosenbrock at n = 1 000 it took 0.45 ms and a 5 s first call against 0.28 ms and 1.3 s
    try:
        _, ivjp = inverse_vjp(damped, params, method="linearize", on_error="nan")
        return ivjp((grad,))
    except NotInvertibleError:
        return _dense_direction(g_fn, params, grad, damping)


DENSE_MAX = 2048
"""Above this many parameters the Hessian is never formed densely by "auto"."""


def _dense_hessian(g_fn: Callable[[Any], Any], params: Any) -> bool:
    """Whether the Hessian is mostly filled (a dense problem: logistic regression, a small
    network), decided when traced from a few of its columns at a stand-in point (the
    sparsity pattern, not the values: a NaN counts as filled). Inverse accumulation only pays
    off on structure; a dense Hessian is formed and factored directly. False where it cannot
    be decided when traced (the objective closes over values known only at run time)."""
    v, unravel = ravel_filtered(params)
    n = int(v.size)
    if n < 8 or n > DENSE_MAX:
        return False
    dtype = v.dtype
    stand = np.asarray(0.1 + 0.3 * np.arange(n) / n, dtype=dtype)
    cols = np.unique(np.linspace(0, n - 1, 4).astype(int))
    try:
        with jax.ensure_compile_time_eval():
            flat_g = lambda u: ravel_pytree(traced_leaves(g_fn(unravel(u))))[0]  # noqa: E731
            _, lin = jax.linearize(flat_g, jnp.asarray(stand))
            basis = np.zeros((cols.size, n), dtype)
            basis[np.arange(cols.size), cols] = 1.0
            H = np.asarray(jax.vmap(lin)(jnp.asarray(basis)))
    except (
        jax.errors.ConcretizationTypeError,
        jax.errors.TracerArrayConversionError,
        jax.errors.TracerBoolConversionError,
    ):
        return False
    filled = (H != 0) | ~np.isfinite(H)
    return bool(filled.sum(axis=1).min() >= n // 2)


def _dense_direction(g_fn: Callable[[Any], Any], params: Any, grad: Any, damping: Any) -> Any:
    """``(H + damping·I)⁻¹ grad`` with H formed by one vmapped batch of Hessian-vector
    products (the gradient linearized once) and factored by Cholesky; LU where H is not
    positive definite; NaN where it is singular."""
    v, unravel = ravel_filtered(params)
    gv = ravel_pytree(traced_leaves(grad))[0].astype(v.dtype)
    n = v.size

    def flat_g(u):
        return ravel_pytree(traced_leaves(g_fn(unravel(u))))[0]

    _, lin = jax.linearize(flat_g, v)
    H = jax.vmap(lin)(jnp.eye(n, dtype=v.dtype))
    H = 0.5 * (H + H.T) + damping * jnp.eye(n, dtype=v.dtype)
    L = dense.cholesky(H)
    d = lax.cond(
        jnp.all(jnp.isfinite(L)),
        lambda: dense.cho_solve((L, True), gv),
        lambda: dense.solve(H, gv),
    )
    return unravel(d)


def gauss_newton_direction(
    residual_fn: Callable[[Any], Any],
    params: Any,
    grad: Any | None = None,
    *,
    damping: Any = 0.0,
    autodiff_mode: str = "bwd",
) -> Any:
    """``(JᵀJ + damping·I)⁻¹ grad`` for the Jacobian `J` of `residual_fn` at `params`: the
    Gauss-Newton (damped: Levenberg-Marquardt) direction of ``½‖r‖²``, by inverse
    accumulation over the normal map ``v ↦ Jᵀ(J v) + damping·v``.

    The residual's structure is kept: `JᵀJ` is never formed unless its program's groups
    are dense (a chained Rosenbrock's residuals give a tridiagonal one, solved in its band),
    and the second-order terms ``Σ rᵢ ∇²rᵢ`` of the full Hessian are never computed.

    **Arguments:**

    - `residual_fn`: the residuals r, a function of one pytree returning a pytree of arrays
      (any number of them: m ≥ n for a nonsingular `JᵀJ`).
    - `params`: where J is taken.
    - `grad`: the right-hand side, in `params`' structure (default: ``Jᵀr``, the gradient of
      ``½‖r‖²``).
    - `damping`: added to `JᵀJ`'s diagonal (default 0).
    - `autodiff_mode`: "bwd" (the default: `Jᵀ` by transposing J's linear program) or
      "fwd" (J formed by JVPs, one per unknown, and the normal system factored densely: for
      residuals reverse mode cannot run).

    **Returns:**

    The direction, in `params`' structure; NaN where the system is singular.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> r = lambda x: jnp.array([x[0] - 1.0, 2.0 * (x[1] - x[0]), x[1]])
        >>> d = jr.optim.gauss_newton_direction(r, jnp.zeros(2))  # the least-squares step
        >>> [round(float(v), 4) for v in d]
        [-0.5556, -0.4444]
    """
    _check_autodiff_mode("jaxrev.optim.gauss_newton_direction", autodiff_mode)
    v, unravel = ravel_filtered(params)

    def r_flat(u):
        return ravel_pytree(traced_leaves(residual_fn(unravel(u))))[0].astype(u.dtype)

    g = None if grad is None else ravel_pytree(traced_leaves(grad))[0].astype(v.dtype)
    return unravel(_gauss_newton_direction(r_flat, v, g, damping, autodiff_mode))


def _gauss_newton_direction(
    r_flat: Callable[[Any], Any], v: Any, g: Any, damping: Any, autodiff_mode: str
) -> Any:
    """`gauss_newton_direction` on flat vectors."""
    if autodiff_mode == "fwd":
        r, J = r_flat(v), jax.jacfwd(r_flat)(v)
        g = J.T @ r if g is None else g
        normal = J.T @ J + damping * jnp.eye(v.size, dtype=v.dtype)
        return dense.solve(normal, g)
    r, lin = jax.linearize(r_flat, v)
    lin_t = jax.linear_transpose(lin, v)
    g = lin_t(r)[0] if g is None else g

    def normal(u):
        out = lin_t(lin(u))[0]
        return out if _is_zero(damping) else out + damping * u

    # a linear map: inverted on its own program, at any point (zero)
    _, (d,) = inverse_jvp(normal, (jnp.zeros_like(v),), g, on_error="nan")
    return d


def _is_zero(x) -> bool:
    return isinstance(x, (int, float)) and x == 0


# --------------------------------------------------------------------------- optax


class ScaleByNewtonState(NamedTuple):
    """`scale_by_newton` keeps no state besides a step count."""

    count: jax.Array


def scale_by_newton(
    damping: float = 0.0, *, method: str = "auto"
) -> optax.GradientTransformationExtraArgs:
    """An Optax transformation turning the incoming updates `g` into the Newton direction
    ``(H + damping·I)⁻¹ g``, `H` the Hessian of `value_fn` at `params`.

    `value_fn` is a keyword-only extra argument of `update` (``opt.update(g, state, params,
    value_fn=f)``). Chain it with a (negative) scale, or use `newton`; Optax's line searches go
    after it.

    **Arguments:**

    - `damping`: added to the Hessian's diagonal (default 0).
    - `method`: the strategy of `jr.inverse_vjp` ("auto", "reverse", "linearize", "dense").

    **Returns:**

    An `optax.GradientTransformationExtraArgs`.

    **Example:**

        >>> import jax, jax.numpy as jnp, optax, jaxrev as jr
        >>> f = lambda x: jnp.sum((x - 3.0) ** 2)
        >>> opt = optax.chain(jr.optim.scale_by_newton(), optax.scale(-1.0))
        >>> x = jnp.zeros(2); state = opt.init(x)
        >>> u, state = opt.update(jax.grad(f)(x), state, x, value_fn=f)
        >>> optax.apply_updates(x, u).tolist()
        [3.0, 3.0]
    """
    if damping < 0:
        raise ValueError(f"scale_by_newton: damping must be >= 0, got {damping}")

    def init_fn(params):
        del params
        return ScaleByNewtonState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, value_fn=None, **extra_args):
        del extra_args
        if value_fn is None:
            raise ValueError(
                "scale_by_newton: update() needs the objective as a keyword argument, "
                "update(grads, state, params, value_fn=f): the Newton direction is computed "
                "from the Hessian of value_fn at params"
            )
        if params is None:
            raise ValueError(
                "scale_by_newton: update() needs params (the Hessian is taken "
                "there): update(grads, state, params, value_fn=f)"
            )
        d = newton_direction(value_fn, params, updates, damping=damping, method=method)
        return d, ScaleByNewtonState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def newton(
    learning_rate: float = 1.0, damping: float = 0.0
) -> optax.GradientTransformationExtraArgs:
    """Newton's method as an Optax optimizer: ``x ← x − learning_rate (H + damping·I)⁻¹ g``.

    Its `update` takes the objective as the keyword-only extra argument `value_fn`.

    **Arguments:**

    - `learning_rate`: the step's scale (default 1).
    - `damping`: added to the Hessian's diagonal (default 0).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` (`scale_by_newton` chained with the scale).

    **Example:**

        >>> import jax, jax.numpy as jnp, optax, jaxrev as jr
        >>> f = lambda x: jnp.sum(jnp.cosh(x))
        >>> opt = jr.optim.newton(); x = jnp.array([0.5, -0.2]); s = opt.init(x)
        >>> for _ in range(6):
        ...     u, s = opt.update(jax.grad(f)(x), s, x, value_fn=f)
        ...     x = optax.apply_updates(x, u)
        >>> float(jnp.max(jnp.abs(x))) < 1e-12
        True
    """
    return optax.chain(scale_by_newton(damping), optax.scale(-learning_rate))


# --------------------------------------------------------------------------- minimize


def _finite(*xs) -> jax.Array:
    return jnp.all(jnp.asarray([jnp.all(jnp.isfinite(x)) for x in xs]))


def _inf_norm(v) -> jax.Array:
    return jnp.max(jnp.abs(v)) if v.size else jnp.zeros([], v.dtype)


def _status(finite, converged, out_of_iterations) -> jax.Array:
    """An index into STATUS, or -1 to go on."""
    i = lambda c: jnp.asarray(c, jnp.int32)  # noqa: E731
    return jnp.where(
        ~finite, i(3), jnp.where(converged, i(0), jnp.where(out_of_iterations, i(1), i(-1)))
    )


def _reported(who: str, info: Info, throw: bool) -> Info:
    """`info`, after a check (with `throw`) that raises `NotConvergedError` where its status
    is not "converged": eagerly at once, in a compiled program when it runs."""
    if throw:
        check_at_run_time(
            _not_converged(who),
            info.status,
            info.iterations,
            info.residual,
            bad=info.status != 0,  # (under vmap: the first sample that did not converge)
        )
    return info


def _not_converged(who: str) -> Callable[..., NotConvergedError | None]:
    def error(status: Any, iterations: Any, residual: Any) -> NotConvergedError | None:
        name = STATUS[int(status)]
        if name == "converged":
            return None
        why = {
            "max_iterations": "it ran out of iterations (raise maxiter)",
            "stalled": "no step could reduce the objective any more, short of the tolerance "
            "(a singular or ill-conditioned Jacobian, a local minimum of the residual, or a "
            "tolerance below what the dtype can reach)",
            "non_finite": "the objective or its derivatives stopped being finite",
        }[name]
        return NotConvergedError(
            f"{who}{called_at()}: {name} after {int(iterations)} iterations with residual "
            f"{float(residual):.3g}: {why}. Pass throw=False to get the status in info.",
            status=name,
        )

    return error


def _check_common(who, tol, maxiter):
    if tol is not None and not tol > 0:
        raise ValueError(f"{who}: tol must be > 0, got {tol}")
    if maxiter is not None:
        _check_maxiter(who, maxiter)


def _check_maxiter(who, maxiter):
    if not isinstance(maxiter, int) or maxiter < 0:
        raise ValueError(f"{who}: maxiter must be a non-negative int, got {maxiter!r}")


def _eager_compiled(settings: tuple, fun: Callable, impl: Callable[..., Any], args: tuple) -> Any:
    """``impl(*args)``, a solve of `fun`. Called eagerly (concrete arguments, nothing
    tracing), it runs as one compiled call cached on `settings` and on `call_key(fun, args)`
    (the arguments' structure, avals and static leaves, and what `fun` reads besides its
    arguments), so a repeated call traces nothing. Unlike `cached_call` it compiles on the
    first call: a `lax.while_loop` run eagerly is traced and compiled by JAX anyway, so a
    call made once loses nothing; and it re-runs nothing eagerly, since a solve's checks give
    NaN (a rejected step, a status), never an error (a jaxrev check failing inside `fun`
    raises its own error: the call is a `checked_jit` function). Other calls run `impl` as
    it is."""
    if tracing() or not all(is_concrete(x) for x in jax.tree_util.tree_leaves(args)):
        return impl(*args)
    ck = call_key(fun, args)
    if ck is None:
        return impl(*args)
    key = (settings, ck[0])
    cache = memo("optim.solves")
    hit = cache.get(key)
    if hit is None:
        split = Filtered(tuple(args))
        out_split: list = []

        def flat_impl(*flat):
            out = Filtered((impl(*split.rebuild(flat)),))
            out_split[:] = [out]
            return out.flat

        hit = cache.put(key, ck[1], (checked_jit(flat_impl), out_split))
    jitted, out_split = hit
    flat_out = jitted(*Filtered(tuple(args)).flat)
    return out_split[0].rebuild(flat_out)[0]


def _backtrack(
    merit: Callable[[Any], Any], x: Any, d: Any, m0: Any, slope: Any, max_halvings: int = 40
) -> Any:
    """Largest t in 1, 1/2, 1/4, ... with ``merit(x - t d) <= m0 - 1e-4 t slope``; returns
    (t, merit there, found)."""

    def cond(c):
        t, m, k = c
        ok = jnp.isfinite(m) & (m <= m0 - 1e-4 * t * slope)
        return ~ok & (k < max_halvings)

    def body(c):
        t, _, k = c
        t = t / 2
        return t, merit(x - t * d), k + 1

    t0 = jnp.ones([], x.dtype)
    t, m, k = lax.while_loop(cond, body, (t0, merit(x - d), jnp.zeros([], jnp.int32)))
    found = jnp.isfinite(m) & (m <= m0 - 1e-4 * t * slope)
    return t, m, found


class _State(NamedTuple):
    x: jax.Array
    f: jax.Array
    g: jax.Array
    lam: jax.Array
    k: jax.Array
    status: jax.Array  # -1 while running


class _Objective(NamedTuple):
    """A user's `fun` as the solvers call it: with `args` or not, with an aux output or not."""

    fun: Callable[..., Any]
    takes_args: bool  # fun(x, args), Optimistix's convention; else fun(x)
    has_aux: bool  # fun returns (value, aux)

    def _call(self, x: Any, args: Any) -> Any:
        return self.fun(x, args) if self.takes_args else self.fun(x)

    def value(self, x: Any, args: Any) -> Any:
        out = self._call(x, args)
        return out[0] if self.has_aux else out

    def aux(self, x: Any, args: Any) -> Any:
        """The aux output at `x` (None without `has_aux`): evaluated once, at the solution."""
        return self._call(x, args)[1] if self.has_aux else None


def minimize(
    fun: Callable[[Any], Any],
    x0: Any,
    *,
    method: str = "trust-region",
    tol: float | None = None,
    maxiter: int | None = None,
    throw: bool = True,
    args: Any = None,
    has_aux: bool = False,
    autodiff_mode: str = "bwd",
) -> tuple[Any, Info]:
    """Minimize a scalar `fun` from `x0` with Newton steps by inverse accumulation.

    Jittable and vmappable (one `lax.while_loop`); an eager call is compiled, and a repeated
    one (same `fun`, shapes, dtypes and settings) reuses it.

    **Arguments:**

    - `fun`: the objective, a scalar function of one pytree of float arrays.
    - `x0`: the starting point (a pytree of real arrays; integer and boolean leaves are taken
      as JAX's default float, as Optimistix takes them; a complex one raises `jr.DtypeError`).
    - `method`: ``"trust-region"`` (the default): Levenberg-Marquardt's trust region: the step
      ``−(H + λI)⁻¹g`` is accepted or not by comparing the decrease with the quadratic model's,
      and λ shrinks or grows accordingly, so indefinite and singular Hessians are handled.
      ``"newton"``: the Newton direction with a backtracking (Armijo) line search; where the
      Hessian is not positive definite along it, the gradient direction instead.
    - `tol`: stop when the gradient's largest entry is at most this (default: 1e-8 in
      float64, ``eps ** (2/3)`` of a lower precision, `default_tolerance`).
    - `maxiter`: the most iterations (default: ``max(100, 4 n)`` for n unknowns: Newton's
      method moves a chained Rosenbrock valley by about one coordinate a step, so its
      minimum from 0 at n = 1 000 takes 1 474 Newton or 2 219 trust-region steps).
    - `throw`: with True (the default, as Optimistix's), a solve that stops short of the
      tolerance raises `jr.NotConvergedError` naming the solver, the status and the user's
      call (eagerly at once; under `jit` when the program runs, which `jr.jit` re-raises as
      itself); with False it returns, its status in `info`.
    - `args`: passed to `fun` as ``fun(x, args)`` when not None (Optimistix's convention:
      parameters that vary between calls without a new trace, as traced inputs of the solve);
      ``fun(x)`` otherwise.
    - `has_aux`: `fun` returns ``(value, aux)``; `aux` at the solution is ``info.aux``.
    - `autodiff_mode`: "bwd" (the default: gradients by `jax.grad`) or "fwd" (by
      `jax.jacfwd`, as Optimistix's option of that name: for objectives reverse mode cannot
      differentiate, such as a diffrax solve with ``adjoint=diffrax.ForwardMode()``; its cost
      grows with the number of unknowns).

    **Returns:**

    ``(x, info)``: the minimizer, in `x0`'s structure, and an `Info`.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> rosen = lambda x: (1 - x[0]) ** 2 + 100 * (x[1] - x[0] ** 2) ** 2
        >>> x, info = jr.optim.minimize(rosen, jnp.array([-1.2, 1.0]))
        >>> [round(float(v), 4) for v in x], info.message
        ([1.0, 1.0], 'converged')
    """
    return _solve_minimum(
        "newton", fun, x0, method, tol, maxiter, throw, args, has_aux, autodiff_mode
    )


def least_squares(
    fun: Callable[[Any], Any],
    x0: Any,
    *,
    method: str = "trust-region",
    tol: float | None = None,
    maxiter: int | None = None,
    throw: bool = True,
    args: Any = None,
    has_aux: bool = False,
    autodiff_mode: str = "bwd",
) -> tuple[Any, Info]:
    """Minimize ``½‖fun(x)‖²`` over x, `fun` returning residuals, by Gauss-Newton steps
    ``(JᵀJ + λI)⁻¹Jᵀr`` (`gauss_newton_direction`): the residual's structure is kept (a
    user writing ½‖r‖² for `minimize` gets steps from its full Hessian, second-order terms
    included, and loses Gauss-Newton's behaviour on small-residual problems).

    Jittable and vmappable (one `lax.while_loop`); an eager call is compiled, and a repeated
    one reuses it.

    **Arguments:**

    - `fun`: the residuals, a function of one pytree returning a pytree of arrays (m ≥ n
      numbers in all).
    - `x0`: the starting point (a pytree of real arrays; integer and boolean leaves are taken
      as JAX's default float).
    - `method`: ``"trust-region"`` (the default): Levenberg-Marquardt, λ adapted by the
      agreement of the actual and predicted decreases (as `minimize`'s trust region);
      ``"newton"``: undamped Gauss-Newton steps with a backtracking (Armijo) line search.
    - `tol`: stop when the gradient ``Jᵀr``'s largest entry is at most this (default: 1e-8
      in float64, ``eps ** (2/3)`` of a lower precision).
    - `maxiter`: the most iterations (default ``max(100, 4 n)``).
    - `throw`: with True (the default), a solve short of the tolerance raises
      `jr.NotConvergedError`; with False its status is in `info`.
    - `args`: passed to `fun` as ``fun(x, args)`` when not None; ``fun(x)`` otherwise.
    - `has_aux`: `fun` returns ``(residuals, aux)``; `aux` at the solution is ``info.aux``.
    - `autodiff_mode`: "bwd" (the default) or "fwd" (J by JVPs, the normal system factored
      densely: for residuals reverse mode cannot run).

    **Returns:**

    ``(x, info)``: the minimizer, in `x0`'s structure, and an `Info` (``info.value`` is
    ``½‖r‖²``, ``info.residual`` the gradient's largest entry).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> r = lambda x: jnp.array([1 - x[0], 10 * (x[1] - x[0] ** 2)])
        >>> x, info = jr.optim.least_squares(r, jnp.array([-1.2, 1.0]))
        >>> [round(float(v), 4) for v in x], info.message
        ([1.0, 1.0], 'converged')
    """
    return _solve_minimum(
        "gauss-newton", fun, x0, method, tol, maxiter, throw, args, has_aux, autodiff_mode
    )


def _solve_minimum(
    model: str,
    fun: Callable,
    x0: Any,
    method: str,
    tol: float | None,
    maxiter: int | None,
    throw: bool,
    args: Any,
    has_aux: bool,
    autodiff_mode: str,
) -> tuple[Any, Info]:
    """`minimize` (`model` "newton") and `least_squares` ("gauss-newton"): the arguments
    checked, then one compiled `_minimize` per setting (an eager call reuses it)."""
    who = "jaxrev.optim.minimize" if model == "newton" else "jaxrev.optim.least_squares"
    if method not in ("newton", "trust-region"):
        raise ValueError(f"{who}: method must be 'newton' or 'trust-region', got {method!r}")
    _check_common(who, tol, maxiter)
    _check_autodiff_mode(who, autodiff_mode)
    return _eager_compiled(
        (who, method, tol, maxiter, bool(throw), args is None, bool(has_aux), autodiff_mode),
        fun,
        partial(
            _minimize,
            _Objective(fun, args is not None, bool(has_aux)),
            method,
            tol,
            maxiter,
            bool(throw),
            autodiff_mode,
            model=model,
        ),
        (x0, args),
    )


def _inexact_start(x0: Any) -> Any:
    """`x0` with its integer and boolean leaves as JAX's default floating dtype, as
    Optimistix takes a start (`jnp.arange(3)` is a start like any other)."""
    split = Filtered(x0)
    floating = jnp.result_type(float)
    return split.rebuild(
        [
            x if jnp.issubdtype(jnp.result_type(x), jnp.inexact) else jnp.asarray(x, floating)
            for x in split.flat
        ]
    )


def _minimize(
    objective: _Objective,
    method: str,
    tol: float | None,
    maxiter: int | None,
    throw: bool,
    autodiff_mode: str,
    x0: Any,
    args: Any,
    model: str = "newton",
) -> tuple[Any, Info]:
    """`minimize` (`model` "newton": `fun` is the objective, steps from its Hessian) and
    `least_squares` (`model` "gauss-newton": `fun` gives residuals r, the objective is
    ``½‖r‖²`` and the steps come from ``JᵀJ``); one loop for both."""
    who = "jaxrev.optim.minimize" if model == "newton" else "jaxrev.optim.least_squares"
    v0, unravel = ravel_filtered(_inexact_start(x0))
    if not jnp.issubdtype(v0.dtype, jnp.floating):
        raise no_result_for_dtype(
            who, "x0", v0.dtype, "it takes real arguments (a complex x has no order)"
        )
    tol = default_tolerance(v0.dtype, MINIMIZE_TOL) if tol is None else tol
    maxiter = max(100, 4 * v0.size) if maxiter is None else maxiter

    def residuals(v):
        out = objective.value(unravel(v), args)
        return ravel_pytree(traced_leaves(out))[0].astype(v.dtype)

    def f(v):
        if model == "gauss-newton":
            r = residuals(v)
            return 0.5 * jnp.vdot(r, r)
        out = objective.value(unravel(v), args)
        if jnp.shape(out) != ():
            raise TypeError(f"{who}: fun must return a scalar, got shape {jnp.shape(out)}")
        return jnp.asarray(out, v.dtype)

    if autodiff_mode == "bwd":
        value_and_grad = jax.value_and_grad(f)
    else:
        value_and_grad = lambda v: (f(v), jax.jacfwd(f)(v))  # noqa: E731
    if model == "newton":
        direction = partial(newton_direction, f, autodiff_mode=autodiff_mode)
    else:

        def direction(x, g, damping=0.0):
            return _gauss_newton_direction(residuals, x, g, damping, autodiff_mode)

    try:
        f0, g0 = value_and_grad(v0)
    except ValueError as e:
        if autodiff_mode == "bwd" and "Reverse-mode differentiation does not work" in str(e):
            raise ValueError(
                f"{who}{called_at()}: fun cannot be differentiated in reverse mode ({e}). "
                'Pass autodiff_mode="fwd" to take its gradient and Hessian by JVPs.'
            ) from e
        raise
    dtype = v0.dtype

    def running(s: _State):
        return s.status < 0

    def finish(s: _State, x: Any, fx: Any, gx: Any, lam: Any, k: Any) -> Any:
        """Status after an iteration: converged, non-finite, out of iterations, or running."""
        return _State(
            x, fx, gx, lam, k, _status(_finite(fx, gx), _inf_norm(gx) <= tol, k >= maxiter)
        )

    def newton_step(s: _State) -> _State:
        d = direction(s.x, s.g)
        slope = jnp.vdot(s.g, d)
        # not a descent direction (indefinite H) or singular: take the gradient instead
        bad = ~_finite(d) | (slope <= 0)
        d = jnp.where(bad, s.g, d)
        slope = jnp.where(bad, jnp.vdot(s.g, s.g), slope)
        t, fn, found = _backtrack(f, s.x, d, s.f, slope)
        x = jnp.where(found, s.x - t * d, s.x)
        fx, gx = value_and_grad(x)
        nxt = finish(s, x, fx, gx, s.lam, s.k + 1)
        return nxt._replace(status=jnp.where(found | (nxt.status == 0), nxt.status, jnp.int32(2)))

    def trust_step(s: _State) -> _State:
        p = -direction(s.x, s.g, damping=s.lam)
        # the model's decrease −(gᵀp + ½pᵀHp); since (H + λI)p = −g, pᵀHp = −gᵀp − λpᵀp,
        # so no Hessian-vector product is needed (Moré's form for Levenberg-Marquardt)
        pred = 0.5 * (s.lam * jnp.vdot(p, p) - jnp.vdot(s.g, p))
        ok = _finite(p, pred) & (pred > 0)
        x_try = jnp.where(ok, s.x + p, s.x)
        f_try, g_try = value_and_grad(x_try)
        rho = jnp.where(ok, (s.f - f_try) / jnp.where(ok, pred, 1.0), -jnp.inf)
        rho = jnp.where(jnp.isfinite(f_try), rho, -jnp.inf)
        accept = rho > 1e-4
        # λ floor on growth: a multiple of the gradient's size, so λ means something on any
        # problem's scale; shrink fast on very good steps (quadratic convergence returns)
        grow = jnp.maximum(4.0 * s.lam, 1e-3 * jnp.maximum(_inf_norm(s.g), 1e-12))
        lam = jnp.where(rho > 0.75, s.lam / 4.0, jnp.where(rho < 0.25, grow, s.lam))
        x = jnp.where(accept, x_try, s.x)
        fx = jnp.where(accept, f_try, s.f)
        gx = jnp.where(accept, g_try, s.g)
        nxt = finish(s, x, fx, gx, lam, s.k + 1)
        # a rejected step below rounding: λ has grown past any use, nothing changes any more
        eps = jnp.finfo(dtype).eps
        stalled = ~accept & ok & (_inf_norm(p) <= 4 * eps * (1.0 + _inf_norm(s.x)))
        return nxt._replace(status=jnp.where(stalled & (nxt.status < 0), jnp.int32(2), nxt.status))

    step = newton_step if method == "newton" else trust_step
    s0 = finish(None, v0, f0, g0, jnp.zeros([], dtype), jnp.zeros([], jnp.int32))
    s = lax.while_loop(running, step, s0)
    x = unravel(s.x)
    info = Info(s.k, _inf_norm(s.g), s.f, s.status, objective.aux(x, args))
    return x, _reported(who, info, throw)


# --------------------------------------------------------------------------- root


RTOL = 1e-10
"""`root`'s default relative tolerance on the Newton step in float64 (in a lower precision:
``eps ** (2/3)`` of the dtype, 2.4e-5 in float32, 0.039 in bfloat16)."""
ATOL = 1e-10
"""`root`'s default absolute tolerance on the Newton step and on F in float64 (scaled with
the dtype as `RTOL`)."""


MINIMIZE_TOL = 1e-8
"""`minimize`'s default tolerance on the gradient's largest entry in float64 (scaled with the
dtype as `RTOL`)."""


def default_tolerance(dtype: Any, float64_value: float) -> float:
    """A tolerance that a solve in `dtype` can meet: `float64_value` in float64, and
    ``eps ** (2/3)`` of a lower precision's epsilon when that is larger (a float32 residual
    cannot fall below about 1e-7 of its terms, so 1e-10 is never met there).

    **Example:**

        >>> import jax.numpy as jnp
        >>> round(default_tolerance(jnp.float32, 1e-10), 7)
        2.42e-05
    """
    eps = float(jnp.finfo(jnp.dtype(dtype)).eps)
    return max(float64_value, eps ** (2 / 3))


def root(
    fun: Callable[[Any], Any],
    x0: Any,
    *,
    rtol: float | None = None,
    atol: float | None = None,
    maxiter: int = 50,
    throw: bool = True,
    args: Any = None,
    has_aux: bool = False,
) -> tuple[Any, Info]:
    """Solve ``fun(x) = 0`` (a square system) by Newton's method.

    The step ``d = J⁻¹F(x)`` comes from `inverse_jvp` of `fun` itself, and a backtracking line
    search on ``‖F‖²`` keeps it from diverging. Jittable and vmappable (one `lax.while_loop`);
    an eager call is compiled, and a repeated one (same `fun`, shapes, dtypes and settings)
    reuses it.

    **Arguments:**

    - `fun`: F, a function of one pytree of float arrays returning as many numbers.
    - `x0`: the starting point (a pytree of float or complex arrays; integer and boolean
      leaves are taken as JAX's default float, as Optimistix takes them).
    - `rtol`, `atol`: tolerances as Optimistix's root finders take them. x has converged when
      the Newton step d (x's distance to the root, to first order) is within ``atol +
      rtol·|x|`` everywhere *and* either ``|F(x)| <= atol`` everywhere (Optimistix's Cauchy
      rule: F is compared with 0, so `rtol` does not apply to it) or the steps contract so
      that the remaining error, estimated as ``θ/(1 − θ)·|d|`` with θ the ratio of the last
      two steps' sizes (Hairer and Wanner's estimate), is within the same bound: a
      discretised operator's F of order 1/h² stops decreasing at its rounding, far above
      `atol`, while a double root's F falls below `atol` long before x is near it (θ = 1/2
      there, so the estimate is the true remaining distance). Defaults: 1e-10 in float64,
      ``eps ** (2/3)`` of a lower precision (`default_tolerance`).
    - `maxiter`: the most iterations (default 50).
    - `throw`: with True (the default, as Optimistix's), a solve that stops short of the
      tolerance raises `jr.NotConvergedError` naming the solver, the status and the user's
      call (eagerly at once; under `jit` when the program runs, which `jr.jit` re-raises as
      itself); with False it returns, its status in `info`.
    - `args`: passed to `fun` as ``fun(x, args)`` when not None (Optimistix's convention:
      parameters that vary between calls without a new trace, as traced inputs of the solve);
      ``fun(x)`` otherwise.
    - `has_aux`: `fun` returns ``(value, aux)``; `aux` at the solution is ``info.aux``.

    **Returns:**

    ``(x, info)``: the root, in `x0`'s structure, and an `Info` with ``info.value =
    ‖F(x)‖²/2``. "stalled" means no step could reduce ‖F‖ while the Newton step was still
    larger than the tolerance.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> x, info = jr.optim.root(lambda x: x ** 3 - jnp.array([8.0, 27.0]), jnp.ones(2))
        >>> [round(float(v), 4) for v in x], info.message
        ([2.0, 3.0], 'converged')
    """
    who = "jaxrev.optim.root"
    if not ((rtol is None or rtol >= 0) and (atol is None or atol >= 0)):
        raise ValueError(f"{who}: rtol and atol must be >= 0, got rtol={rtol}, atol={atol}")
    _check_maxiter(who, maxiter)
    settings = (rtol, atol, maxiter, bool(throw))
    objective = _Objective(fun, args is not None, bool(has_aux))
    return _eager_compiled(
        (who, *settings, args is None, bool(has_aux)),
        fun,
        partial(_root, objective, *settings),
        (x0, args),
    )


def _root(
    objective: _Objective,
    rtol: float | None,
    atol: float | None,
    maxiter: int,
    throw: bool,
    x0: Any,
    args: Any,
) -> tuple[Any, Info]:
    who = "jaxrev.optim.root"
    x0 = _inexact_start(x0)
    v0, unravel = ravel_filtered(x0)
    out_shape = jax.eval_shape(objective.value, x0, args)
    n_out = sum(int(o.size) for o in jax.tree_util.tree_leaves(out_shape))
    if n_out != v0.size:
        raise ValueError(
            f"{who}: fun maps {v0.size} numbers to {n_out}; root needs a square system"
        )

    def F(v):
        return ravel_pytree(objective.value(unravel(v), args))[0].astype(v.dtype)

    real = jnp.finfo(v0.dtype).dtype  # (a complex system's tolerances are real)
    rtol = default_tolerance(real, RTOL) if rtol is None else rtol
    atol = default_tolerance(real, ATOL) if atol is None else atol

    def merit(v):
        r = F(v)
        return 0.5 * jnp.real(jnp.vdot(r, r))

    def small(r):
        return _inf_norm(r) <= atol

    def step(c: _RootState) -> _RootState:
        # J d = F(x): the full Newton step is x - d
        d = jacobian_solve(F, c.x, c.r)
        m0 = 0.5 * jnp.real(jnp.vdot(c.r, c.r))
        # along -d the merit's slope is -‖F‖² (Jd = F), so Armijo's test uses 2 m0
        t, _, found = _backtrack(merit, c.x, d, m0, 2 * m0)
        # where ‖F‖ is at its rounding (F of order 1/h² in float32) Armijo's test cannot see
        # a decrease, and the backtracking creeps: the full step is taken when Deuflhard's
        # natural monotonicity test holds, the simplified step J(x)⁻¹F(x - d) at most half
        # the Newton step (x - d is then nearer the root in the Newton step's own measure)
        full = lax.cond(
            found & (t == 1),
            lambda: jnp.asarray(False),
            lambda: _natural_decrease(F, c.x, d),
        )
        t = jnp.where(full, jnp.ones_like(t), t)
        found = (found | full) & _finite(d)
        x = jnp.where(found, c.x - t * d, c.x)
        r = F(x)
        # the Newton step estimates x's distance to the root, relative to the tolerance;
        # its ratio to the last step's is the contraction rate θ
        size = _inf_norm(jnp.abs(d) / (atol + rtol * jnp.abs(x))).astype(real)
        size = jnp.where(_finite(d), size, jnp.inf)
        rate = size / c.step_size
        # (no rate from one step: a root of multiplicity m is approached at θ = 1 - 1/m)
        estimate = jnp.where((rate < 1) & (c.k > 0), size * rate / (1 - rate), jnp.inf)
        converged = (size <= 1) & (small(r) | (estimate <= 1))
        status = _status(_finite(r), converged, c.k + 1 >= maxiter)
        status = jnp.where(found | (status == 0), status, jnp.int32(2))
        return _RootState(x, r, c.k + 1, size, status)

    r0 = F(v0)
    k0 = jnp.zeros([], jnp.int32)
    # converged at the start only at an exact root: a small F alone says nothing of x
    s0 = _status(_finite(r0), jnp.all(r0 == 0), k0 >= maxiter)
    no_step = jnp.asarray(jnp.inf, real)
    c = lax.while_loop(lambda c: c.status < 0, step, _RootState(v0, r0, k0, no_step, s0))
    x = unravel(c.x)
    value = 0.5 * jnp.real(jnp.vdot(c.r, c.r))
    info = Info(c.k, _inf_norm(c.r), value, c.status, objective.aux(x, args))
    return x, _reported(who, info, throw)


def jacobian_solve(fun: Callable[[Any], Any], x: Any, b: Any, transposed: bool = False) -> Any:
    """``J⁻¹b`` (``J⁻ᵀb`` when `transposed`) for the Jacobian J of `fun` at the known point
    `x`, as `root` solves its Newton steps.

    J's tangent program at `x` is inverted step by step (`jr.inverse_jvp`'s "linearize"),
    else J is formed densely and factored. Not `jr.inverse_jvp`'s "auto", which first inverts
    `fun` itself, rebuilding `x` from ``fun(x)``: memory-free, but a nonlinear group there
    can lose rank at values where J does not, and its run-time check then raised for a
    nonsingular J (Optimistix's implicit-midpoint step of Robertson's equations).

    **Arguments:**

    - `fun`: a square function of one pytree.
    - `x`: where J is taken.
    - `b`: the right-hand side, in `fun`'s output structure (`x`'s when `transposed`).
    - `transposed`: solve with Jᵀ instead.

    **Returns:**

    The solution, in `x`'s structure (`fun`'s output's when `transposed`); NaN where J is
    singular.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jnp.cumsum(x ** 2)
        >>> jr.optim.jacobian_solve(f, jnp.array([1.0, 2.0]), jnp.array([2.0, 6.0])).tolist()
        [1.0, 1.0]
    """
    for method in ("linearize", "dense"):
        try:
            if transposed:
                return inverse_vjp(fun, x, method=method, on_error="nan")[1]((b,))
            return inverse_jvp(fun, (x,), b, method=method, on_error="nan")[1][0]
        except NotInvertibleError:
            if method == "dense":
                raise
    raise AssertionError("unreachable")


def _natural_decrease(F: Callable[[Any], Any], x: Any, d: Any) -> jax.Array:
    """Whether the full Newton step -d from x passes Deuflhard's natural monotonicity test:
    ``‖J(x)⁻¹F(x - d)‖ <= ‖d‖ / 2`` (NLEQ-ERR's, with the Jacobian at x)."""
    d_bar = jacobian_solve(F, x, F(x - d))
    return _finite(d, d_bar) & (_inf_norm(d_bar) <= 0.5 * _inf_norm(d))


class _RootState(NamedTuple):
    """`root`'s loop carry."""

    x: jax.Array
    r: jax.Array  # F(x)
    k: jax.Array  # iterations taken
    step_size: jax.Array  # the last Newton step's size relative to the tolerance (inf: none)
    status: jax.Array  # -1 while running
