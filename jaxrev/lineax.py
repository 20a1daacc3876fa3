"""Inverse accumulation as a Lineax linear solver: `InverseAccumulation()` solves
``A x = b`` by inverting the program of the operator's matrix-vector product step by step
(`jr.inverse_jvp`; `jr.inverse_vjp` for ``Aᵀ``), its lumps solved with the structure they
admit (banded, small blocks, dense), so `A` is never materialised unless it is dense anyway.

An optional module (it imports Lineax). Pass the solver wherever Lineax or Optimistix takes
a `linear_solver`: ``lx.linear_solve(op, b, InverseAccumulation())``, or
``optx.Newton(rtol, atol, linear_solver=InverseAccumulation())`` (`jaxrev.optimistix` makes
Optimistix's solvers with it).

- A `lx.JacobianLinearOperator(fn, x, args)` is solved on `fn`'s tangent program at `x`, as
  `jr.optim.root` solves its Newton steps (`jr.optim.jacobian_solve`).
- Any other operator (`FunctionLinearOperator` from `jax.linearize`, a `MatrixLinearOperator`,
  sums, compositions, tagged operators) is solved on its `mv`, a linear program.
- A non-square operator is solved in the least-squares sense by the normal equations
  (``AᵀA x = Aᵀb`` when tall, ``x = Aᵀy`` with ``AAᵀy = b`` when wide), as `lx.Normal` does:
  the Levenberg-Marquardt systems ``[J; √λ I]`` of `optx.LevenbergMarquardt` are of this
  kind, and their normal matrix ``JᵀJ + λI`` is well conditioned by construction.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import lineax as lx

from jaxrev.optim import jacobian_solve
from jaxrev.transforms.inverse_ad import inverse_jvp, inverse_vjp

__all__ = ["InverseAccumulation"]


class _State(eqx.Module):
    """The operator to solve with (nothing is factored ahead: each right-hand side walks the
    operator's program), and whether its transpose is meant."""

    operator: lx.AbstractLinearOperator
    transposed: bool = eqx.field(static=True)


class InverseAccumulation(lx.AbstractLinearSolver):
    """A Lineax solver for nonsingular square operators (and full-rank rectangular ones, by
    the normal equations) by inverse accumulation: the operator's program is inverted step
    by step, never materialised unless dense.

    **Arguments:**

    - `method`: "auto" (the default: a Jacobian operator's tangent program at its point,
      else dense; another operator's linear program as `jr.inverse_jvp`'s "auto" takes it),
      or a strategy of `jr.inverse_jvp` ("reverse", "linearize", "dense").

    **Returns** (from `lx.linear_solve`): the solution; `lx.RESULTS.singular` where the
    system is singular (the solution is NaN there, and Lineax raises with ``throw=True``).

    **Example:**

        >>> import jax.numpy as jnp, lineax as lx
        >>> from jaxrev.lineax import InverseAccumulation
        >>> f = lambda x, args: jnp.cumsum(jnp.exp(x))
        >>> op = lx.JacobianLinearOperator(f, jnp.zeros(3))
        >>> lx.linear_solve(op, jnp.ones(3), InverseAccumulation()).value.tolist()
        [1.0, 0.0, 0.0]
    """

    method: str = eqx.field(static=True, default="auto")

    def init(self, operator: lx.AbstractLinearOperator, options: dict[str, Any]) -> _State:
        del options
        return _State(operator, False)

    def compute(
        self, state: _State, vector: Any, options: dict[str, Any]
    ) -> tuple[Any, Any, dict[str, Any]]:
        del options
        op, transposed = state.operator, state.transposed
        rows, columns = op.out_size(), op.in_size()
        if transposed:
            rows, columns = columns, rows
        if rows == columns:
            x = _solve(op, vector, transposed, self.method)
        else:
            a = op.transpose() if transposed else op
            a_t = lx.conj(a.transpose())
            if rows > columns:  # tall: AᴴA x = Aᴴb
                normal = lx.FunctionLinearOperator(lambda v: a_t.mv(a.mv(v)), a.in_structure())
                x = _solve(normal, a_t.mv(vector), False, self.method)
            else:  # wide: the least-norm x = Aᴴy, AAᴴy = b
                normal = lx.FunctionLinearOperator(lambda v: a.mv(a_t.mv(v)), a.out_structure())
                x = a_t.mv(_solve(normal, vector, False, self.method))
        finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(v)) for v in jax.tree.leaves(x)]))
        result = lx.RESULTS.where(finite, lx.RESULTS.successful, lx.RESULTS.singular)
        return x, result, {}

    def transpose(self, state: _State, options: dict[str, Any]) -> tuple[_State, dict]:
        return _State(state.operator, not state.transposed), options

    def conj(self, state: _State, options: dict[str, Any]) -> tuple[_State, dict]:
        return _State(lx.conj(state.operator), state.transposed), options

    def assume_full_rank(self) -> bool:
        return True


def _unwrapped(op: lx.AbstractLinearOperator) -> lx.AbstractLinearOperator:
    """`op` without the tags Lineax and Optimistix wrap operators in (symmetric, positive
    semidefinite): inverse accumulation does not need them."""
    while isinstance(op, lx.TaggedLinearOperator):
        op = op.operator
    return op


def _solve(op: lx.AbstractLinearOperator, b: Any, transposed: bool, method: str) -> Any:
    """``A⁻¹b`` (``A⁻ᵀb`` when `transposed`) for a square operator, NaN where singular."""
    op = _unwrapped(op)
    if isinstance(op, lx.JacobianLinearOperator):
        args = op.args
        fn = lambda x: op.fn(x, args)  # noqa: E731
        if method == "auto":  # the point is known: its tangent program, else dense
            return jacobian_solve(fn, op.x, b, transposed)
        x = op.x
    else:  # a linear map: its Jacobian anywhere, at zero say, is the operator
        fn = op.mv
        x = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), op.in_structure())
    if transposed:
        _, solve_transposed = inverse_vjp(fn, x, method=method, on_error="nan")
        return solve_transposed((b,))
    _, (t,) = inverse_jvp(fn, (x,), b, method=method, on_error="nan")
    return t
