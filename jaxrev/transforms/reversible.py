"""Reversibility checks: `check_reversible` measures the round-trip drift of `reverse`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxrev._compat import Var, user_source
from jaxrev._errors import ReversibilityError
from jaxrev._jaxpr import Env
from jaxrev.transforms.reverse import _invert_call, _normalize_argnums, propagate

__all__ = ["check_reversible", "ReversibilityReport"]


@dataclass
class ReversibilityReport:
    """Round-trip error of `reverse(fun)(fun(x))` against `x`.

    `max_error` is the largest relative (max-norm) error over the state leaves; `leaf_errors`
    lists them all; `worst` names the equation and source line whose inversion added the most
    error (None when the round trip is exact).
    """

    max_error: float
    leaf_errors: list[float]
    worst: str | None
    steps: list[tuple[float, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"round-trip relative error: {self.max_error:.3e} "
                 f"(per state leaf: {', '.join(f'{e:.2e}' for e in self.leaf_errors)})"]
        if self.worst is not None:
            lines.append(f"error grows most at: {self.worst}")
        for err, where in self.steps[:5]:
            lines.append(f"  {err:.2e} added by {where}")
        return "\n".join(lines)


def _rel_err(a: Any, b: Any) -> float:
    a = np.asarray(a, dtype=np.complex128 if np.iscomplexobj(a) else np.float64)
    b = np.asarray(b, dtype=a.dtype)
    if a.size == 0:
        return 0.0
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        return float("inf")
    scale = max(float(np.max(np.abs(b))), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(a - b))) / scale


def check_reversible(fun: Callable, *args: Any, argnums: int | Sequence[int] = 0,
                     rtol: float | None = None) -> ReversibilityReport:
    """Run `fun` forward and `reverse(fun)` backward on `args` and report the drift.

    Raises `ReversibilityError` when `rtol` is given and the relative error exceeds it. Runs
    eagerly (values are compared equation by equation to find where the error grows).

    Example:
        >>> import jax.numpy as jnp, jaxrev as jr
        >>> rep = jr.check_reversible(lambda x: jnp.exp(x) * 3.0, jnp.linspace(0.0, 1.0, 5))
        >>> rep.max_error < 1e-6
        True
    """
    nums = _normalize_argnums(argnums, len(args), fun)
    y = fun(*args)
    outs = (y,) if len(nums) == 1 else tuple(y)
    inv_args = list(args)
    for a, o in zip(nums, outs):
        inv_args[a] = o
    events: list[tuple[Any, list[Var]]] = []
    state, jaxpr, inv_env = _invert_call(fun, tuple(inv_args), nums,
                                         on_invert=lambda e, vs: events.append((e, vs)))
    x_true = args[nums[0]] if len(nums) == 1 else tuple(args[a] for a in nums)
    leaf_errors = [_rel_err(a, b) for a, b in zip(jax.tree_util.tree_leaves(state),
                                                  jax.tree_util.tree_leaves(x_true))]
    # forward values of every variable, to see where the backward run drifts
    fwd = Env()
    flat_args = jax.tree_util.tree_leaves(tuple(args))
    for v, x in zip(jaxpr.invars, flat_args):
        fwd.write(v, x)
    inv_consts = {v: inv_env.read(v) for v in jaxpr.constvars}
    for v, c in inv_consts.items():
        fwd.write(v, c)
    propagate(jaxpr, fwd, list(v for v in jaxpr.outvars if isinstance(v, Var)),
              forward_only=True)
    steps = []
    for eqn, wrote in events:
        err_in = max((_rel_err(inv_env.read(v), fwd.read(v)) for v in wrote if fwd.known(v)),
                     default=0.0)
        err_out = max((_rel_err(inv_env.read(v), fwd.read(v)) for v in eqn.outvars
                       if isinstance(v, Var) and inv_env.known(v) and fwd.known(v)), default=0.0)
        _, _, summary = user_source(eqn)
        steps.append((err_in - err_out, f"`{eqn.primitive.name}` at {summary}"))
    steps = sorted((s for s in steps if s[0] > 0), key=lambda s: -s[0])
    worst = steps[0][1] if steps and steps[0][0] > 0 else None
    rep = ReversibilityReport(max(leaf_errors, default=0.0), leaf_errors, worst, steps)
    if rtol is not None and rep.max_error > rtol:
        raise ReversibilityError(f"round trip exceeds rtol={rtol:g}\n{rep}")
    return rep
