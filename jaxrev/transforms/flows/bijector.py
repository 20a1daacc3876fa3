"""`jr.Bijector`: any invertible function in distrax's bijector protocol (docs/design.md §1 flows).

`forward` is the function, `inverse` is `reverse(fun)`, and the log-determinants come from the
inversion sweep (`flows`), one pass each. distrax is not imported: the class has the methods
and attributes distrax's `Bijector` has, so code written against that protocol (and
`jr.Chain`, distrax's `Chain`) uses it as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import is_concrete, tracing
from jaxrev._program import fun_name
from jaxrev.transforms.flows.slogdet import forward_and_slogdet, inverse_and_slogdet
from jaxrev.transforms.knowledge.context import Settings, resolve_on_error
from jaxrev.transforms.reverse import reverse_with

__all__ = ["Bijector", "Chain"]


class Bijector:
    """`fun` as a bijector with distrax's protocol: ``forward``, ``inverse``,
    ``forward_and_log_det``, ``inverse_and_log_det``, ``forward_log_det_jacobian``,
    ``inverse_log_det_jacobian``.

    `fun` maps one event (an array of `event_ndims` dimensions) to one event; the methods take
    arrays with leading batch dimensions too (`fun` is vmapped over them) and return
    log-determinants of the batch's shape. Extra positional arguments of the methods are passed
    on to `fun` (parameters): ``b.forward(x, params)`` calls ``fun(x, params)``, and with
    ``argnums=1`` ``fun(params, x)``.

    **Arguments:**

    - `fun`: the invertible function of one event (and parameters).
    - `event_ndims`: the number of dimensions of one event (default 1).
    - `argnums`: the position of the event among `fun`'s arguments (an int, default 0).
    - `method`, `on_error`: those of `forward_and_slogdet` / `inverse_and_slogdet` (a vanished
      pivot raises `SingularJacobianError`; under `jit` the forward methods return -inf, the
      inverse ones raise when the program runs).
    - `name`: the bijector's name (default: `fun`'s).

    **Returns:**

    The bijector; its methods return the transformed batch, its log-determinants (one per
    event), or both as a pair (the ``*_and_log_det`` methods).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> b = jr.Bijector(lambda x, s: x * jnp.exp(s))
        >>> y, logdet = b.forward_and_log_det(jnp.ones((3, 2)), jnp.array([0.5, 1.0]))
        >>> logdet.shape, round(float(logdet[0]), 6)
        ((3,), 1.5)
    """

    def __init__(
        self,
        fun: Callable,
        event_ndims: int = 1,
        *,
        argnums: int = 0,
        method: str = "auto",
        on_error: str | None = None,
        name: str | None = None,
    ) -> None:
        if not isinstance(event_ndims, int) or event_ndims < 0:
            raise ValueError(
                f"jaxrev.Bijector: event_ndims must be a non-negative int, got {event_ndims!r}"
            )
        if not isinstance(argnums, int) or argnums < 0:
            raise ValueError(
                f"jaxrev.Bijector: argnums must be a non-negative int, got {argnums!r}"
            )
        self.fun, self.argnums = fun, argnums
        self.event_ndims_in = self.event_ndims_out = event_ndims
        self.name = name or fun_name(fun)
        self.is_constant_jacobian = False
        self.is_constant_log_det = False
        on_error = resolve_on_error("jaxrev.Bijector", on_error)
        self._on_error = on_error
        self._inv = reverse_with(fun, Settings("jaxrev.Bijector", on_error), argnums)
        self._fwd_ld = forward_and_slogdet(fun, argnums, method=method, on_error=on_error)
        self._inv_ld = inverse_and_slogdet(fun, argnums, method=method, on_error=on_error)
        # a batch called eagerly runs vmapped, where values are traced: it runs without
        # checks, and a failed sample is then run alone, on values, to raise (or warn) naming
        # the step (docs/flows.md: on concrete values every entry point raises)
        self._fwd_ld_nan = forward_and_slogdet(fun, argnums, method=method, on_error="nan")
        self._inv_ld_nan = inverse_and_slogdet(fun, argnums, method=method, on_error="nan")

    def _batched(self, g: Callable, x: Any, params: Sequence[Any]) -> Any:
        leaves = jax.tree_util.tree_leaves(x)
        nb = jnp.ndim(leaves[0]) - self.event_ndims_in
        if nb < 0:
            raise ValueError(
                f"jaxrev.Bijector({self.name}): an input of {jnp.ndim(leaves[0])} "
                f"dimensions has fewer than event_ndims={self.event_ndims_in}"
            )
        a = self.argnums
        if a > len(params):
            raise ValueError(
                f"jaxrev.Bijector({self.name}): argnums={a} but only "
                f"{len(params)} parameters were passed"
            )

        def h(x, *ps):
            return g(*ps[:a], x, *ps[a:])

        for _ in range(nb):
            h = jax.vmap(h, in_axes=(0, *([None] * len(params))))
        return h(x, *params)

    def _checked(
        self, g: Callable, unchecked: Callable, x: Any, params: Sequence[Any]
    ) -> tuple[Any, Any]:
        """`g` batched; called eagerly on a batch, the first sample with a non-finite result
        runs again alone, on values, so that its error names the step."""
        leaves = jax.tree_util.tree_leaves((x, params))
        nb = jnp.ndim(jax.tree_util.tree_leaves(x)[0]) - self.event_ndims_in
        # (under a transform, `fun` may close over traced values even where every argument is
        # concrete: the usual `jit(grad(loss))(params)` of a flow whose parameters it closes
        # over; then the checks are staged, not run here)
        traced = tracing() or not all(is_concrete(v) for v in leaves)
        if nb <= 0 or self._on_error == "nan" or traced:
            return self._batched(g, x, params)
        out, ld = self._batched(unchecked, x, params)
        bad = ~jnp.isfinite(ld)
        for o in jax.tree_util.tree_leaves(out):
            bad = bad | ~jnp.all(jnp.isfinite(o), axis=tuple(range(nb, jnp.ndim(o))))
        if bool(jnp.any(bad)):
            at = np.unravel_index(int(jnp.argmax(bad.ravel())), bad.shape)
            sample = jax.tree_util.tree_map(lambda v: v[at], x)
            a = self.argnums
            g(*params[:a], sample, *params[a:])
        return out, ld

    def forward(self, x: Any, *params: Any) -> Any:
        return self._batched(self.fun, x, params)

    def inverse(self, y: Any, *params: Any) -> Any:
        return self._batched(self._inv, y, params)

    def forward_and_log_det(self, x: Any, *params: Any) -> tuple[Any, Any]:
        return self._checked(self._fwd_ld, self._fwd_ld_nan, x, params)

    def inverse_and_log_det(self, y: Any, *params: Any) -> tuple[Any, Any]:
        return self._checked(self._inv_ld, self._inv_ld_nan, y, params)

    def forward_log_det_jacobian(self, x: Any, *params: Any) -> Any:
        return self.forward_and_log_det(x, *params)[1]

    def inverse_log_det_jacobian(self, y: Any, *params: Any) -> Any:
        return self.inverse_and_log_det(y, *params)[1]

    def __repr__(self) -> str:
        return f"jaxrev.Bijector({self.name}, event_ndims={self.event_ndims_in})"


class Chain(Bijector):
    """Bijectors composed as distrax's `Chain`: ``Chain([f, g]).forward(x) == f(g(x))`` (the last
    one applies first).

    Log-determinants add up; each bijector's come from its own sweep.

    **Arguments:**

    - `bijectors`: a sequence of `jr.Bijector`s (or `Chain`s), applied last first.

    **Returns:**

    The composed bijector, with `Bijector`'s methods.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> c = jr.Chain([jr.Bijector(lambda x: x * 2.0), jr.Bijector(lambda x: x + 1.0)])
        >>> y, logdet = c.forward_and_log_det(jnp.zeros(2))
        >>> y.tolist(), round(float(logdet), 6)
        ([2.0, 2.0], 1.386294)
    """

    def __init__(self, bijectors: Sequence[Bijector]) -> None:
        self.bijectors = list(bijectors)
        if not self.bijectors:
            raise ValueError("jaxrev.Chain needs at least one bijector")
        nd = {b.event_ndims_in for b in self.bijectors}
        if len(nd) != 1:
            raise ValueError(f"jaxrev.Chain: the bijectors' event_ndims differ: {sorted(nd)}")
        self.event_ndims_in = self.event_ndims_out = nd.pop()
        self.name = "Chain(" + ", ".join(b.name for b in self.bijectors) + ")"
        self.is_constant_jacobian = self.is_constant_log_det = False

    def forward(self, x: Any, *params: Any) -> Any:
        for b in reversed(self.bijectors):
            x = b.forward(x, *params)
        return x

    def inverse(self, y: Any, *params: Any) -> Any:
        for b in self.bijectors:
            y = b.inverse(y, *params)
        return y

    def forward_and_log_det(self, x: Any, *params: Any) -> tuple[Any, Any]:
        total = 0.0
        for b in reversed(self.bijectors):
            x, ld = b.forward_and_log_det(x, *params)
            total = total + ld
        return x, total

    def inverse_and_log_det(self, y: Any, *params: Any) -> tuple[Any, Any]:
        total = 0.0
        for b in self.bijectors:
            y, ld = b.inverse_and_log_det(y, *params)
            total = total + ld
        return y, total
