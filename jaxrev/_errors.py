"""Error classes and the helpers that make every message name the primitive and the user's line."""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from jaxrev._compat import current_call_site, user_source


class JaxrevError(Exception):
    """Base class of every error jaxrev raises on purpose.

    **Arguments:**

    - `message`: the error's text (jaxrev's messages name the transform, the primitive and the
      user's line).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> try:
        ...     jr.reverse(lambda x: x * 0.0)(jnp.ones(2))
        ... except jr.JaxrevError as e:
        ...     print(type(e).__name__)
        NotInvertibleError
    """


class NotInvertibleError(JaxrevError):
    """A program loses information, so `jr.reverse` cannot run it backwards.

    **Arguments:**

    - `message`: the error's text.
    - `primitive`, `file`, `line`: the step's primitive name and the user's source line, when
      known (None otherwise); also its attributes.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> try:
        ...     jr.reverse(lambda x: jnp.maximum(x, 0.0))(jnp.ones(2))   # relu loses x < 0
        ... except jr.NotInvertibleError as e:
        ...     print(e.primitive)
        max
    """

    def __init__(
        self,
        message: str,
        primitive: str | None = None,
        file: str | None = None,
        line: int | None = None,
        singular: bool = False,
    ) -> None:
        super().__init__(message)
        self.primitive = primitive
        self.file = file
        self.line = line
        self.singular = singular  # the step divides by an exact zero (a vanished pivot)


class _AtStep(JaxrevError):
    """An error about one step of the user's program: `primitive`, `file`, `line` (None where
    no single step could be named)."""

    def __init__(
        self,
        message: str,
        primitive: str | None = None,
        file: str | None = None,
        line: int | None = None,
    ) -> None:
        super().__init__(message)
        self.primitive = primitive
        self.file = file
        self.line = line


class ReversibilityError(_AtStep):
    """A rebuilt value missed its mark: a round trip `reverse(f)(f(x))` drifted from `x` beyond
    the tolerance asked for, or a group of equations solved numerically (Newton's method) did
    not reach its tolerance.

    **Arguments:**

    - `message`: the error's text.
    - `primitive`, `file`, `line`: the step, where one is named (else None); also its
      attributes.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> x = jnp.array([0.1, 0.5, 1.0], jnp.float32)
        >>> try:   # float32 rounding is far above the asked tolerance
        ...     jr.check_reversible(lambda x: 3.0 * x + 1.0, x, rtol=1e-12)
        ... except jr.ReversibilityError:
        ...     print("round trip missed")
        round trip missed
    """


class DriftError(ReversibilityError):
    """A value `reversible`'s backward run rebuilt missed its true counterpart (the inputs of the
    call, or a stored checkpoint) by more than the tolerance (docs/design.md §3.8).

    **Arguments:**

    - `message`: the error's text.
    - `file`: the loop's or the call's user line, where one is known.
    - `drift`: the measured relative drift.
    - `tolerance`: the relative drift tolerated.

    All three are also its attributes.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> from jax import lax
        >>> halve = lambda y: lax.fori_loop(0, 60, lambda i, y: 0.5 * y + 0.1, y)  # x2 backwards
        >>> try:
        ...     strict = jr.reversible(halve, on_drift="raise", checkpoint_every=None)
        ...     jax.grad(lambda y: strict(y).sum())(jnp.ones(2))
        ... except jr.DriftError as e:
        ...     print(e.drift > e.tolerance)
        True
    """

    def __init__(
        self,
        message: str,
        file: str | None = None,
        drift: float | None = None,
        tolerance: float | None = None,
    ) -> None:
        super().__init__(message, file=file)
        self.drift = drift
        self.tolerance = tolerance


class SingularJacobianError(_AtStep):
    """A step's pivot vanished while inverting a Jacobian (`inverse_jvp`, `inverse_vjp`, the
    log-determinant transforms).

    **Arguments:**

    - `message`: the error's text.
    - `primitive`, `file`, `line`: the step (None when the dense fallback found it); also its
      attributes.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> try:   # the Jacobian of x * x is 2x, singular at 0
        ...     jr.inverse_jvp(lambda x: x * x, (jnp.zeros(1),), jnp.ones(1))
        ... except jr.SingularJacobianError:
        ...     print("singular")
        singular
    """


class DtypeError(JaxrevError, TypeError):
    """An input of a dtype for which the transform's result does not exist: the tangents of
    an integer or boolean state (`inverse_jvp`, `inverse_vjp`), the log-determinant of a
    complex, integer or boolean state (the log-determinant transforms, `Bijector`), a
    complex start for `optim.minimize` (integer and boolean starts are converted to float).
    Also a `TypeError`, as JAX's own dtype refusals are.

    **Arguments:**

    - `message`: the error's text (the transform, the input's dtype, why, and the user's
      call).

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> try:
        ...     jr.inverse_jvp(lambda x: x + 1, (jnp.arange(3),), jnp.arange(3))
        ... except jr.DtypeError:
        ...     print("no tangents")
        no tangents
    """


class NotConvergedError(JaxrevError):
    """An optimizer (`jr.optim.root`, `jr.optim.minimize`) stopped short of its tolerance:
    out of iterations, stalled (no step could make progress) or at a non-finite value.
    Raised with ``throw=True`` (the default, as Optimistix's), eagerly at once and under
    `jr.jit` when the program runs; ``throw=False`` returns the status instead.

    **Arguments:**

    - `message`: the error's text (the solver, the status, the iterations and the residual,
      the user's call).
    - `status`: the status's name (``"max_iterations"``, ``"stalled"``, ``"non_finite"``);
      also an attribute.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> try:
        ...     jr.optim.root(lambda x: x**2 + 1.0, jnp.array(0.5))
        ... except jr.NotConvergedError as e:
        ...     print(e.status)
        stalled
    """

    def __init__(self, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.status = status


def no_result_for_dtype(who: str, what: str, dtype: Any, why: str) -> DtypeError:
    """The error for `what` (an input, described) of `dtype`, for which `who`'s result does
    not exist because `why`; naming the user's call of the transform."""
    return DtypeError(f"{who}{called_at()}: {what} is {np.dtype(dtype).name}: {why}")


def called_at() -> str:
    """' (called at file:line, in function)': the user's call of a transform, for a message
    about the call as a whole (no equation to name); '' where there is none."""
    site = current_call_site()
    return f" (called at {site[0]}:{site[1]}, in {site[2]})" if site else ""


class FailureWarning(UserWarning):
    """A failure the caller asked to be warned of (``on_error="warn"``): the result is NaN where
    it happened.

    **Arguments:**

    - `message`: the warning's text (that of the error ``on_error="raise"`` would raise).

    **Example:**

        >>> import warnings, jax.numpy as jnp, jaxrev as jr
        >>> step = lambda x: jnp.where(x > 0, x + 1.0, x - 1.0)   # nothing maps to 0
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     x = jr.reverse(step, on_error="warn")(jnp.array([2.0, 0.0]))
        >>> x.tolist(), [type(w.message).__name__ for w in caught]
        ([1.0, nan], ['FailureWarning'])
    """


class PerformanceWarning(UserWarning):
    """A result that is right but costs far more than the usual way would: the log-determinant
    (or only its sign) of a large state taken from its dense Jacobian, where the inversion
    sweep could not give it. Warned once per function, size and reason.

    **Arguments:**

    - `message`: what is slow, how much, why, and the way out.

    **Example:**

        >>> import warnings, jaxrev as jr
        >>> with warnings.catch_warnings():  # a dense fall-back as an error, in this block
        ...     warnings.simplefilter("error", jr.PerformanceWarning)
        ...     issubclass(jr.PerformanceWarning, UserWarning)
        True
    """


WAYS_OUT = (
    "Ways out: keep the information the step drops as part of the state (or compute the step "
    "from parameters only), or register an inverse rule for the primitive with "
    "`jr.register_inverse(primitive, rule)`."
)


def at_eqn(
    cls: type, eqn: Any, what: str, hint: str, *, who: str, group: bool = True
) -> JaxrevError:
    """An error of class `cls` (`ReversibilityError`, `SingularJacobianError`) about `eqn`,
    naming its primitive and the user's line: "<who>: <what>; the group starts with `p` at
    <line>\n<hint>", or (not `group`: a single step) "<who>: <what> at `p` at <line>\n<hint>"
    (`who`: the transform's public name, from its walk context)."""
    file, line, summary = user_source(eqn)
    summary = summary or "an equation with no user source line"
    name = eqn.primitive.name
    where = "; the group starts with" if group else " at"
    return cls(
        f"{who}: {what}{where} `{name}` at {summary}\n{hint}", primitive=name, file=file, line=line
    )


_SAMPLE: contextvars.ContextVar = contextvars.ContextVar("jaxrev_vmap_sample", default=None)
"""The index of the vmapped sample whose flags a run-time check's error is built from (set by
`in_sample` around the error builder): `at_element` names it beside the element."""


@contextlib.contextmanager
def in_sample(index: tuple[int, ...] | None) -> Iterator[None]:
    """Within it, `at_element` says the flags are those of sample `index` of a `vmap` batch
    (None: not batched)."""
    token = _SAMPLE.set(index)
    try:
        yield
    finally:
        _SAMPLE.reset(token)


def at_element(flags: Any) -> str:
    """' at element (i, j)': the first set flag of a per-element check, for its message ('' for
    a scalar check or none set); under `vmap`, also the sample: ' at element (j,) of sample
    (i,) of the vmapped batch'."""
    flags = np.asarray(flags)
    sample = _SAMPLE.get()
    of_sample = "" if sample is None else f" of sample {sample} of the vmapped batch"
    if not flags.any():
        return ""
    if flags.ndim == 0:
        return f" at sample {sample} of the vmapped batch" if sample is not None else ""
    return f" at element {tuple(int(i) for i in np.argwhere(flags)[0])}{of_sample}"


def not_invertible(
    eqn: Any, reason: str, hint: str | None = None, singular: bool = False, *, who: str
) -> NotInvertibleError:
    """Build the error for equation `eqn`, naming its primitive and the user's source line:
    "<who> cannot invert `p` at <line>: <reason>" (`who`: the transform's public name)."""
    file, line, summary = user_source(eqn)
    if not summary:
        summary = "an equation with no user source line (library or jaxrev-generated code)"
    name = eqn.primitive.name
    msg = f"{who} cannot invert `{name}` at {summary}: {reason}\n{hint or WAYS_OUT}"
    err = NotInvertibleError(msg, primitive=name, file=file, line=line, singular=singular)
    err.parts = (name, summary, reason, hint or WAYS_OUT)
    return err


def singular_jacobian(err: NotInvertibleError, who: str) -> SingularJacobianError:
    """The `SingularJacobianError` of a transform (`who`) that inverts a Jacobian, from the
    error of the step whose pivot vanished: "<who>: the Jacobian is singular at `p` at
    <line>: <reason>"."""
    parts = getattr(err, "parts", None)
    if parts is None:
        msg = f"{who}: the Jacobian is singular: {err}"
    else:
        name, summary, reason, hint = parts
        msg = f"{who}: the Jacobian is singular at `{name}` at {summary}: {reason}\n{hint}"
    return SingularJacobianError(msg, primitive=err.primitive, file=err.file, line=err.line)


def fail(on_error: str, err: Exception, category: type[Warning] | None = None) -> None:
    """What a failure found on concrete values does under `on_error`: "raise" raises `err`,
    "warn" warns with its message (the caller returns NaN), "nan" nothing."""
    if on_error == "raise":
        raise err
    if on_error == "warn":
        warnings.warn(str(err), category or FailureWarning, stacklevel=3)
