"""Any invertible function as a flowjax bijection: `Bijection(fun, shape)` is a flowjax
`AbstractBijection` whose inverse and log-determinants jaxrev computes from `fun` alone.

An optional module (it imports flowjax). Drop it into a flowjax `Transformed` distribution or
a `Chain` as any flowjax bijection; flowjax's `fit_to_data` trains the arrays `fun` holds
(an Equinox module's weights), since `fun` is a field of the module. The other direction,
`jr.reverse` / `jr.inverse_and_slogdet` of a function that calls a flowjax bijection's
`transform`, needs nothing from the user (`tests/test_library_flows.py`).

One flowjax map is a loop jaxrev cannot run backwards from its equations: a
`NumericalInverse` (the inverse of a block neural autoregressive flow, which flowjax's
defaults make the flow's `transform`) finds ``x`` with ``bijection.transform(x) = y`` by
bisection. Its inverse is the map it solves. While jaxrev traces a user's function
(`numerical_inverses_marked`, entered by every trace once flowjax is imported), flowjax's
`NumericalInverse.inverse_and_log_det` runs its root-finder as a `jr.custom_inverse` whose
inverse is that map and whose log-determinant is the map's, negated, at the root
(``deflogdet(..., of_inverse=True)``): the values are flowjax's own, and in every thread
that is not tracing, flowjax's own method runs. A function `jax.jit` traced before, outside
jaxrev, keeps its unmarked program in JAX's cache: jaxrev refuses it (at Equinox's `cond` in
the bisection), as it did before. The step's derivatives are taken through the map it solves
(``custom_inverse(..., differentiate="inverse")``: the implicit function theorem, as
flowjax's own implicit JVP does), never through the bisection's equations: where JAX traces
the solve to "high" primitives (JAX 0.12.1 does, for flowjax 19), which jaxrev lowers, the
lowering drops flowjax's implicit JVP, and the bisection's own derivative is zero.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import flowjax.bijections as flowjax_bijections
import jax.numpy as jnp
from flowjax.bijections import AbstractBijection

from jaxrev.transforms.custom import custom_inverse
from jaxrev.transforms.flows.slogdet import forward_and_slogdet, inverse_and_slogdet

__all__ = ["Bijection", "numerical_inverses_marked"]


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


# --------------------------------------------------------------------------- NumericalInverse

_NumericalInverse = getattr(flowjax_bijections, "NumericalInverse", None)
"""flowjax's `NumericalInverse` (None in a flowjax without it: nothing is marked)."""

_mark = threading.local()  # `depth`: this thread's jaxrev traces, nested
_install = threading.Lock()
_installed: list = []  # [flowjax's method while marked, traces of every thread]


def _marked_inverse_and_log_det(self: Any, y: Any, condition: Any = None) -> tuple[Any, Any]:
    """`NumericalInverse.inverse_and_log_det` while jaxrev traces (in this thread): flowjax's
    root-finder as a `custom_inverse` whose inverse is the bijection it solves (its arrays
    are arguments, so that the step is one program whatever traces them); elsewhere the
    method it replaced."""
    own = _installed[0] if _installed else _NumericalInverse.inverse_and_log_det
    if not getattr(_mark, "depth", 0):
        return own(self, y, condition)
    y = jnp.asarray(y)
    if not jnp.issubdtype(y.dtype, jnp.inexact):  # (as flowjax casts its inputs)
        y = y.astype(jnp.result_type(float))
    arrays, static = eqx.partition(self, eqx.is_array)

    def solve(y: Any, arrays: Any, condition: Any) -> Any:
        return own(eqx.combine(arrays, static), y, condition)[0]

    def forward(x: Any, arrays: Any, condition: Any) -> Any:
        return eqx.combine(arrays, static).bijection.transform(x, condition)

    def forward_log_det(x: Any, arrays: Any, condition: Any) -> Any:
        return eqx.combine(arrays, static).bijection.transform_and_log_det(x, condition)[1]

    # (differentiated through the map it solves: on JAX >= 0.12 the solve's jaxpr, lowered,
    # has lost flowjax's implicit JVP, and the bisection's own derivative is zero)
    step = custom_inverse(solve, differentiate="inverse")
    step.definverse(forward)
    step.deflogdet(forward_log_det, of_inverse=True)
    x = step(y, arrays, condition)
    _, log_det = self.bijection.transform_and_log_det(x, condition)
    return x, -log_det


@contextlib.contextmanager
def numerical_inverses_marked() -> Iterator[None]:
    """While inside (in this thread), flowjax's `NumericalInverse` bijections trace as
    `jr.custom_inverse` steps inverted by the map they solve (see the module). Reentrant;
    every trace jaxrev makes enters it once flowjax is imported (`jaxrev._compat.on_trace`),
    so users do nothing. The class holds jaxrev's method while any thread is inside, which
    calls the method it replaced in the threads that are not; the outermost exit puts that
    method back.

    **Returns:**

    A context manager.

    **Example:**

        >>> from flowjax.bijections import NumericalInverse
        >>> from jaxrev.flowjax import numerical_inverses_marked
        >>> with numerical_inverses_marked():
        ...     inside = NumericalInverse.inverse_and_log_det.__module__
        >>> inside, NumericalInverse.inverse_and_log_det.__module__.split(".")[0]
        ('jaxrev.flowjax', 'flowjax')
    """
    if _NumericalInverse is None:
        yield
        return
    with _install:
        if not _installed:
            _installed[:] = [_NumericalInverse.inverse_and_log_det, 0]
            _NumericalInverse.inverse_and_log_det = _marked_inverse_and_log_det
        _installed[1] += 1
    _mark.depth = getattr(_mark, "depth", 0) + 1
    try:
        yield
    finally:
        _mark.depth -= 1
        with _install:
            _installed[1] -= 1
            if not _installed[1]:
                _NumericalInverse.inverse_and_log_det = _installed[0]
                _installed.clear()
