"""The walk context: everything that steers a walk besides its jaxpr and its values.

A transform creates one at its entry, from its own arguments (`Settings`: who it is, for
errors; `on_error`; whether Newton's method may be used), and hands it down: the walker's
`Env` carries it (`env.ctx`, kept by `Env.copy`), and inverse rules that walk sub-programs
receive it in their `RuleContext`. Nothing that steers a walk is global, so what a walk does
never depends on what ran before it, and a transform called inside another's rule (a
`custom_inverse` whose inverse calls `jr.reverse`) sees only its own settings.

A derived context (`replace`) is what a group step hands a walk of its own: a choice's branch
walk (NaN instead of errors, one Newton start), a loop body's walk (its child record). Counts
of Newton's use go up its chain of parents, never to siblings; statistics go to the
observers of `jaxrev._stats` that were active when the transform created its context.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from dataclasses import replace as _replace
from typing import Any

import jax.numpy as jnp

from jaxrev._compat import staged_constants
from jaxrev._stats import observers

__all__ = ["ON_ERROR", "Settings", "WalkContext", "placeholders", "resolve_on_error"]

ON_ERROR = ("raise", "nan", "warn")
"""What a failure a transform cannot rule out when it traces does: "raise" (eagerly an error
at once, under `jit` when the program runs), "nan" (NaN where it failed, no error), "warn"
(NaN and a warning: eagerly `warnings.warn`, under `jit` when the program runs)."""


@dataclass(frozen=True)
class Settings:
    """What a transform asks of its walks (hashable: part of cache keys, and of `reversible`'s
    dial, a primitive param). `who`: the transform's public name, which its errors say;
    `on_error` (`ON_ERROR`); `newton`: whether Newton's method is used at all (the inverse
    transforms need only Jacobians, which linear lumps give exactly); `rebuilds`: the walk
    rebuilds values a forward run computed (`reversible`'s backward walk), so a NaN or an
    infinity given to it is the program's own value, not a failure to report; `reinverted`:
    the program the walk emits may be walked again (`reverse`'s: ``reverse(reverse(f))``),
    so a choice group's solve is emitted as a `custom_inverse` step whose inverse is the
    group run forward; a walk whose program only runs (the log-det transforms', `reversible`'s
    backward) emits the solve's operations themselves, traced once (not traced into a
    `custom_inverse`, then again by each `vmap` around it); `values`: False in a planning
    walk, whose values no one reads (`slogdet`'s plan of the forward log-det, walked on
    stand-ins under `eval_shape`): a group's solve still walks what decides whether it
    inverts, but writes a traced stand-in of the preimage's shape instead of computing it
    (no search, no candidates checked, no Newton iterations traced); `fill`: unknown elements
    are replaced by `elements.FILL` before they enter a computation (False in the walk of a
    loop's iterations undone all at once, whose unknown elements hold the loop's final values,
    the same at every iteration, so that what the iterations compute from them is computed
    once; `rules.scan._at_once` says why those values are safe there)."""

    who: str = "jaxrev.reverse"
    on_error: str = "raise"
    newton: bool = True
    rebuilds: bool = False
    reinverted: bool = True
    values: bool = True
    fill: bool = True

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(
                f"{self.who}: on_error must be one of {ON_ERROR}, got {self.on_error!r}"
            )

    def replace(self, **changes: Any) -> Settings:
        return _replace(self, **changes)


_KEEP: Any = object()


class WalkContext:
    """One walk's context: its `settings`, `newton_start` (None: Newton starts, per element,
    from the candidate start with the smallest residual; k: from start k only, which a choice's
    branch walk asks for where the map has several preimages), the `recorder` of a walk whose
    steps are recorded (`records`), the `drift` log of `reversible`'s backward run (`drift.Log`,
    None elsewhere, and in a planning walk), and its counters."""

    __slots__ = (
        "settings",
        "newton_start",
        "recorder",
        "drift",
        "_parent",
        "_newton",
        "_roots",
        "_observers",
    )

    def __init__(
        self,
        settings: Settings = Settings(),
        *,
        recorder: Any = None,
        drift: Any = None,
        newton_start: Any = None,
    ) -> None:
        self.settings = settings
        self.newton_start = newton_start
        self.recorder = recorder
        self.drift = drift
        self._parent: WalkContext | None = None
        self._newton = 0
        self._roots = 0
        self._observers: tuple[Counter, ...] = observers()

    @property
    def who(self) -> str:
        return self.settings.who

    @property
    def on_error(self) -> str:
        return self.settings.on_error

    @property
    def newton(self) -> bool:
        return self.settings.newton

    @property
    def reinverted(self) -> bool:
        return self.settings.reinverted

    @property
    def values(self) -> bool:
        return self.settings.values

    def replace(
        self,
        *,
        recorder: Any = _KEEP,
        drift: Any = _KEEP,
        newton_start: Any = _KEEP,
        **settings: Any,
    ) -> WalkContext:
        """A derived context (the rest as here) for a walk this one starts; its counters start
        at zero."""
        new = WalkContext(
            self.settings.replace(**settings) if settings else self.settings,
            recorder=self.recorder if recorder is _KEEP else recorder,
            drift=self.drift if drift is _KEEP else drift,
            newton_start=self.newton_start if newton_start is _KEEP else newton_start,
        )
        new._parent = self
        new._observers = self._observers
        return new

    def count(self, what: str) -> None:
        """One more `what` (statistics, for the observers)."""
        for c in self._observers:
            c[what] += 1

    def _counted(self, slot: str) -> None:
        """One more in this walk's counter `slot` and in every walk that started it."""
        ctx: WalkContext | None = self
        while ctx is not None:
            setattr(ctx, slot, getattr(ctx, slot) + 1)
            ctx = ctx._parent

    def used_newton(self) -> None:
        """Newton's method solved a group in this walk (or a walk it started)."""
        self._counted("_newton")
        self.count("newton")

    @property
    def newton_uses(self) -> int:
        """How many groups Newton's method solved in this walk and the walks it started."""
        return self._newton

    def used_roots(self) -> None:
        """A group was solved by the roots of a quadratic (`rational`): two candidates, one
        per root (a walk's `newton_start` 0 or 1 picks)."""
        self._counted("_roots")
        self.count("roots")

    @property
    def root_uses(self) -> int:
        return self._roots


def resolve_on_error(who: str, on_error: str | None) -> str:
    """`on_error` checked against `ON_ERROR` (None: "raise")."""
    on_error = "raise" if on_error is None else on_error
    if on_error not in ON_ERROR:
        raise ValueError(f"{who}: on_error must be one of {ON_ERROR}, got {on_error!r}")
    return on_error


def placeholders(variables: Any) -> list[Any]:
    """What a planning walk's solve writes for `variables` (`Settings.values` False): zeros of
    their shapes and dtypes, traced (staged even where the walk folds constants), so that no
    later step takes them for known constants."""
    with staged_constants():
        return [jnp.zeros(v.aval.shape, v.aval.dtype) for v in variables]
