"""Any invertible function as a numpyro transform: `Transform(fun)` is a numpyro `Transform`
whose inverse (`.inv`) and `log_abs_det_jacobian` jaxrev computes from `fun` alone.

An optional module (it imports numpyro). Use it in `dist.TransformedDistribution(base,
Transform(fun))`, or wherever numpyro takes a transform. The other direction, `jr.reverse` /
`jr.inverse_and_slogdet` of a numpyro transform itself (a callable), needs nothing from here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numpyro.distributions import constraints
from numpyro.distributions import transforms as _nt

from jaxrev.transforms.flows.bijector import Bijector

__all__ = ["Transform"]


class Transform(_nt.Transform):
    """`fun` as a numpyro transform; batches of events are vmapped.

    `log_abs_det_jacobian(x, y)` is the log-det of one event's map (numpyro's convention for
    transforms of vectors), from jaxrev's sweep; the inverse is `jr.reverse(fun)`.

    **Arguments:**

    - `fun`: the invertible function of one event of `event_ndims` dimensions, to one of the
      same shape.
    - `event_ndims`: the number of dimensions of one event (default 1).

    **Returns:**

    The transform (a numpyro `Transform`).

    **Example:**

        >>> import jax.numpy as jnp
        >>> from jaxrev.numpyro import Transform
        >>> t = Transform(lambda x: x * jnp.exp(jnp.array([0.5, -1.0])) + jnp.tanh(x[::-1]))
        >>> x = jnp.array([[1.0, 2.0], [0.5, -0.5]])
        >>> y = t(x)
        >>> bool(jnp.allclose(t.inv(y), x)), t.log_abs_det_jacobian(x, y).shape
        (True, (2,))
    """

    def __init__(self, fun: Callable, event_ndims: int = 1) -> None:
        self.fun, self.event_ndims = fun, event_ndims
        self._bijector = Bijector(fun, event_ndims)

    @property
    def domain(self) -> Any:
        if self.event_ndims:
            return constraints.independent(constraints.real, self.event_ndims)
        return constraints.real

    @property
    def codomain(self) -> Any:
        return self.domain

    def __call__(self, x: Any) -> Any:
        return self._bijector.forward(x)

    def _inverse(self, y: Any) -> Any:
        return self._bijector.inverse(y)

    def log_abs_det_jacobian(self, x: Any, y: Any, intermediates: Any = None) -> Any:
        if x is None:
            raise ValueError("jaxrev.numpyro.Transform: log_abs_det_jacobian needs x (the input)")
        return self._bijector.forward_and_log_det(x)[1]

    def tree_flatten(self) -> tuple:
        return (), (
            (),
            {"fun": self.fun, "event_ndims": self.event_ndims, "_bijector": self._bijector},
        )
