"""Any invertible function as a flowjax bijection: `Bijection(fun, shape)` is a flowjax
`AbstractBijection` whose inverse and log-determinants jaxrev computes from `fun` alone.

An optional module (it imports flowjax). Drop it into a flowjax `Transformed` distribution or
a `Chain` as any flowjax bijection; flowjax's `fit_to_data` trains the arrays `fun` holds
(an Equinox module's weights), since `fun` is a field of the module. The other direction,
`jr.reverse` / `jr.inverse_and_slogdet` of a function that calls a flowjax bijection's
`transform`, needs nothing from here (`tests/test_library_flows.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from flowjax.bijections import AbstractBijection

from jaxrev.transforms.flows.slogdet import forward_and_slogdet, inverse_and_slogdet

__all__ = ["Bijection"]


def _call(x: Any, fun: Callable, condition: Any) -> Any:
    return fun(x) if condition is None else fun(x, condition)


# made once, so that their traces are cached across calls (the function travels as an argument)
_FORWARD = forward_and_slogdet(_call)
_INVERSE = inverse_and_slogdet(_call)


class Bijection(AbstractBijection):
    """`fun` as a flowjax bijection, for `Transformed` distributions and `fit_to_data`.

    `transform_and_log_det` is `jr.forward_and_slogdet(fun)`, `inverse_and_log_det` is
    `jr.inverse_and_slogdet(fun)` (flowjax's conventions: the inverse's log-det is that of the
    inverse map).

    **Arguments:**

    - `fun`: the invertible function: ``fun(x)``, or ``fun(x, condition)`` with `cond_shape`
      given (an Equinox module, or any function).
    - `shape`: the shape of the arrays it maps.
    - `cond_shape`: the shape of the condition (None: unconditional).

    **Returns:**

    The bijection (a flowjax `AbstractBijection`).

    **Example:**

        >>> import jax.numpy as jnp
        >>> from jaxrev.flowjax import Bijection
        >>> b = Bijection(lambda x: x + jnp.tanh(x[::-1]) * jnp.array([1.0, 0.0]), shape=(2,))
        >>> y, ld = b.transform_and_log_det(jnp.array([0.5, -1.0]))
        >>> x, ldi = b.inverse_and_log_det(y)
        >>> [round(float(v), 6) for v in x], round(float(ld + ldi), 6)
        ([0.5, -1.0], 0.0)
    """

    fun: Callable
    shape: tuple[int, ...]
    cond_shape: tuple[int, ...] | None = None

    def transform_and_log_det(self, x: Any, condition: Any = None) -> tuple[Any, Any]:
        y, ld = _FORWARD(x, self.fun, condition)
        return y, jnp.asarray(ld)

    def inverse_and_log_det(self, y: Any, condition: Any = None) -> tuple[Any, Any]:
        x, ld = _INVERSE(y, self.fun, condition)
        return x, jnp.asarray(ld)
