"""jaxrev's Newton steps inside Optimistix: root finders, least-squares solvers and a
minimiser that Optimistix users call as they call Optimistix's own
(``optx.root_find(fn, jaxrev.optimistix.Newton(rtol, atol), y0)``).

An optional module (it imports Optimistix and Lineax).

- `Newton`, `GaussNewton`, `LevenbergMarquardt`: Optimistix's solvers of those names, with
  `jaxrev.lineax.InverseAccumulation` as their linear solver: the Newton and Gauss-Newton
  systems are solved by inverting the Jacobian's program step by step (banded, small
  blocks, dense lumps), never materialising it. Everything else (tolerances, the Cauchy
  termination, line searches and trust regions, `throw`, `has_aux`, `options`) is
  Optimistix's.
- `NewtonMinimiser`: an Optimistix minimiser taking exact Newton steps ``(H + λI)⁻¹g`` by
  `jr.optim.newton_direction` in a Levenberg-Marquardt trust region (as `jr.optim.minimize`
  does), where Optimistix's minimisers are quasi-Newton or first order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optimistix as optx
from jax.flatten_util import ravel_pytree

from jaxrev.lineax import InverseAccumulation
from jaxrev.optim import newton_direction

__all__ = ["Newton", "GaussNewton", "LevenbergMarquardt", "NewtonMinimiser"]


def Newton(rtol: float, atol: float, **kwargs: Any) -> optx.Newton:
    """`optx.Newton` (root finding) with Newton steps ``J⁻¹F`` by inverse accumulation.

    **Arguments:**

    - `rtol`, `atol`: Optimistix's tolerances.
    - `**kwargs`: `optx.Newton`'s other arguments (`norm`, `kappa`, `cauchy_termination`).

    **Returns:**

    An `optx.Newton` whose `linear_solver` is `jaxrev.lineax.InverseAccumulation()`.

    **Example:**

        >>> import jax.numpy as jnp, optimistix as optx, jaxrev.optimistix as jro
        >>> sol = optx.root_find(lambda y, c: y**3 - c, jro.Newton(1e-8, 1e-8),
        ...                      jnp.ones(2), jnp.array([8.0, 27.0]))
        >>> [round(float(v), 6) for v in sol.value]
        [2.0, 3.0]
    """
    return optx.Newton(rtol, atol, linear_solver=InverseAccumulation(), **kwargs)


def GaussNewton(rtol: float, atol: float, **kwargs: Any) -> optx.GaussNewton:
    """`optx.GaussNewton` (least squares) with its steps by inverse accumulation: ``J⁻¹r``
    for a square Jacobian, the normal equations ``JᵀJ d = Jᵀr`` (inverted on their own
    program, so a banded ``JᵀJ`` is solved in its band) for a tall one.

    **Arguments:**

    - `rtol`, `atol`: Optimistix's tolerances.
    - `**kwargs`: `optx.GaussNewton`'s other arguments (`norm`, `verbose`).

    **Returns:**

    An `optx.GaussNewton` whose `linear_solver` is `jaxrev.lineax.InverseAccumulation()`.

    **Example:**

        >>> import jax.numpy as jnp, optimistix as optx, jaxrev.optimistix as jro
        >>> residual = lambda y, args: jnp.array([y[0] - 1.0, 10 * (y[1] - y[0] ** 2), y[1] - 1])
        >>> sol = optx.least_squares(residual, jro.GaussNewton(1e-8, 1e-8), jnp.zeros(2))
        >>> [round(float(v), 6) for v in sol.value]
        [1.0, 1.0]
    """
    return optx.GaussNewton(rtol, atol, linear_solver=InverseAccumulation(), **kwargs)


def LevenbergMarquardt(rtol: float, atol: float, **kwargs: Any) -> optx.LevenbergMarquardt:
    """`optx.LevenbergMarquardt` (least squares) with its damped steps ``(JᵀJ + λI)⁻¹Jᵀr``
    by inverse accumulation on the normal equations of its ``[J; √λ I]`` system.

    **Arguments:**

    - `rtol`, `atol`: Optimistix's tolerances.
    - `**kwargs`: `optx.LevenbergMarquardt`'s other arguments (`norm`, `verbose`).

    **Returns:**

    An `optx.LevenbergMarquardt` whose `linear_solver` is
    `jaxrev.lineax.InverseAccumulation()`.

    **Example:**

        >>> import jax.numpy as jnp, optimistix as optx, jaxrev.optimistix as jro
        >>> residual = lambda y, args: jnp.array([y[0] - 1.0, 10 * (y[1] - y[0] ** 2)])
        >>> sol = optx.least_squares(residual, jro.LevenbergMarquardt(1e-8, 1e-8),
        ...                          jnp.array([-1.2, 1.0]))
        >>> [round(float(v), 6) for v in sol.value]
        [1.0, 1.0]
    """
    return optx.LevenbergMarquardt(rtol, atol, linear_solver=InverseAccumulation(), **kwargs)


class _MinimiserState(eqx.Module):
    """`NewtonMinimiser`'s state between steps, at the last accepted point."""

    f: jax.Array  # the objective there
    grad: jax.Array  # its gradient, flattened
    aux: Any  # fun's aux output there
    damping: jax.Array  # the trust region's λ
    terminate: jax.Array
    result: optx.RESULTS


class NewtonMinimiser(optx.AbstractMinimiser):
    """Exact Newton steps in a Levenberg-Marquardt trust region, as an Optimistix minimiser.

    Each step solves ``(H + λI) p = −g`` by `jr.optim.newton_direction` (inverse
    accumulation over the gradient program: a chained Rosenbrock's tridiagonal Hessian in
    its band), accepts it if the objective falls by at least 1e-4 of the quadratic model's
    predicted decrease, and shrinks or grows λ by the agreement. It terminates by
    Optimistix's Cauchy rule (the step and the change of the objective within ``atol +
    rtol·|·|`` in `norm`) on an accepted step that is a Newton step to within its damping
    (``λ‖p‖ ≤ ‖g‖ / 2``, so its size measures the distance to the stationary point: a step
    shortened by a large λ never reads as converged).

    Supports Optimistix's `options={"autodiff_mode": "fwd"}` for objectives that reverse
    mode cannot differentiate.

    **Arguments:**

    - `rtol`, `atol`: Optimistix's tolerances.
    - `norm`: the norm of the Cauchy rule (None, the default: `optx.max_norm`).

    **Returns** (from `optx.minimise`): an `optx.Solution`; its result is
    `RESULTS.nonlinear_divergence` where no step can make progress any more (the trust
    region shrank below rounding), `RESULTS.nonfinite` where the objective stopped being
    finite.

    **Example:**

        >>> import jax.numpy as jnp, optimistix as optx, jaxrev.optimistix as jro
        >>> rosen = lambda y, args: (1 - y[0]) ** 2 + 100 * (y[1] - y[0] ** 2) ** 2
        >>> sol = optx.minimise(rosen, jro.NewtonMinimiser(1e-10, 1e-10), jnp.array([-1.2, 1.0]))
        >>> [round(float(v), 6) for v in sol.value]
        [1.0, 1.0]
    """

    rtol: float
    atol: float
    norm: Callable[[Any], jax.Array] | None = None  # None: optx.max_norm

    def init(self, fn, y, args, options, f_struct, aux_struct, tags) -> _MinimiserState:
        del f_struct, aux_struct, tags
        v, unravel = ravel_pytree(y)
        (f, aux), g = _value_aux_and_grad(fn, unravel, args, options, v)
        finite = jnp.isfinite(f) & jnp.all(jnp.isfinite(g))
        return _MinimiserState(
            f=f,
            grad=g,
            aux=aux,
            damping=jnp.zeros([], v.dtype),
            terminate=~finite,
            result=optx.RESULTS.where(finite, optx.RESULTS.successful, optx.RESULTS.nonfinite),
        )

    def step(self, fn, y, args, options, state: _MinimiserState, tags):
        del tags
        v, unravel = ravel_pytree(y)
        mode = options.get("autodiff_mode", "bwd")
        lam, g = state.damping, state.grad

        def value(u):
            return fn(unravel(u), args)[0]

        p = -newton_direction(value, v, g, damping=lam, autodiff_mode=mode)
        # the model's decrease −(gᵀp + ½pᵀHp), with pᵀHp = −gᵀp − λpᵀp (Moré)
        pred = 0.5 * (lam * jnp.vdot(p, p) - jnp.vdot(g, p))
        ok = jnp.all(jnp.isfinite(p)) & jnp.isfinite(pred) & (pred > 0)
        v_try = jnp.where(ok, v + p, v)
        (f_try, aux_try), g_try = _value_aux_and_grad(fn, unravel, args, options, v_try)
        finite = jnp.isfinite(f_try) & jnp.all(jnp.isfinite(g_try))
        rho = jnp.where(ok & finite, (state.f - f_try) / jnp.where(ok, pred, 1.0), -jnp.inf)
        accept = rho > 1e-4
        g_size = jnp.max(jnp.abs(g)) if g.size else jnp.zeros([], g.dtype)
        grow = jnp.maximum(4.0 * lam, 1e-3 * jnp.maximum(g_size, 1e-12))
        new_lam = jnp.where(rho > 0.75, lam / 4.0, jnp.where(rho < 0.25, grow, lam))
        v_new = jnp.where(accept, v_try, v)
        f_new = jnp.where(accept, f_try, state.f)
        g_new = jnp.where(accept, g_try, g)
        aux = jax.tree.map(lambda a, b: jnp.where(accept, a, b), aux_try, state.aux)
        newton_like = lam * jnp.max(jnp.abs(p)) <= 0.5 * g_size
        cauchy = self._small(v_new - v, v_new) & self._small(f_new - state.f, f_new)
        # (an exactly zero gradient is a stationary point: its step is zero, no decrease)
        converged = (accept & newton_like & cauchy) | (g_size == 0)
        # a rejected step below rounding: λ has grown past any use
        eps = jnp.finfo(v.dtype).eps
        tiny = jnp.max(jnp.abs(p)) <= 4 * eps * (1.0 + jnp.max(jnp.abs(v)))
        stalled = ~accept & ~converged & jnp.all(jnp.isfinite(p)) & tiny
        result = optx.RESULTS.where(
            ~finite & ~ok,
            optx.RESULTS.nonfinite,
            optx.RESULTS.where(stalled, optx.RESULTS.nonlinear_divergence, optx.RESULTS.successful),
        )
        new_state = _MinimiserState(
            f=f_new,
            grad=g_new,
            aux=aux,
            damping=new_lam,
            terminate=converged | stalled | (~finite & ~ok),
            result=result,
        )
        return unravel(v_new), new_state, aux

    def _small(self, diff: jax.Array, at: jax.Array) -> jax.Array:
        """Optimistix's Cauchy test on one quantity: ``|diff| < atol + rtol·|at|`` in
        `norm`."""
        norm = optx.max_norm if self.norm is None else self.norm
        return norm(jnp.abs(diff) / (self.atol + self.rtol * jnp.abs(at))) < 1

    def terminate(self, fn, y, args, options, state: _MinimiserState, tags):
        del fn, y, args, options, tags
        return state.terminate, state.result

    def postprocess(self, fn, y, aux, args, options, state, tags, result):
        del fn, args, options, state, tags, result
        return y, aux, {}


def _value_aux_and_grad(fn, unravel, args, options, v):
    """``((f, aux), ∇f)`` at the flat point `v`, the gradient in Optimistix's
    `autodiff_mode` ("bwd": `jax.grad`; "fwd": `jax.jacfwd`)."""

    def value(u):
        return fn(unravel(u), args)

    if options.get("autodiff_mode", "bwd") == "bwd":
        return jax.value_and_grad(value, has_aux=True)(v)
    f, aux = value(v)
    return (f, aux), jax.jacfwd(lambda u: value(u)[0])(v)
