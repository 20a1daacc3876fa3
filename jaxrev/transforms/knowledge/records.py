"""What a walk recovered, step by step: the record log-determinants are summed over (docs/design.md
§3.7).

While a walk's context holds a `Recorder` (`WalkContext.recorder`), the walker notes every step that
recovers unknown values in the
env it was given: one equation's inverse or element rule (which inputs, and which of their
elements, were new), a group step (a lump, a choice, a Newton group: the group's equations, its
unknown inputs and its known outputs), and, for a loop or branch rule that inverts a sub-jaxpr,
a child record of that walk. The record holds no values, only variables and regions, so a
record made on one run (abstract, or inside a loop's trace) is evaluated on another run's env.
Walks on other envs (a choice's candidate branches, probes) are not recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jaxrev._compat import JaxprEqn, Var

__all__ = ["Step", "Tear", "Recorder", "active", "eqn_step", "group_step", "unsupported", "child"]


@dataclass(frozen=True)
class Tear:
    """How a Newton group was torn: `cut`, the outputs of its nonlinear equations that its
    `affine` equations read; given them, the affine equations determine the group's unknown
    inputs from its known outputs, so Newton's method runs on `cut` alone."""

    affine: tuple[JaxprEqn, ...]
    cut: tuple[Var, ...]


@dataclass
class Step:
    """One recovery: `kind` "eqn" (`recovered`: (var, unknown region before, after) of the
    equation's inputs) or a group kind ("lump", "choice", "newton": `inputs` recovered from
    `outputs` through `eqns`; a Newton group solved on a few values of its own: its `tear`).
    `elementwise`: the group maps each element of its inputs to the same element of its
    outputs, whatever its equations look like (a choice whose bin is searched over a table, but
    whose pieces are computed element by element): its Jacobian is block diagonal by element.
    A group solved on some elements only (an autoregressive spline's, on the elements whose
    knots are known: `choices._partly_known`), or whose inputs were known before on elements
    decided when the program runs (a loop's carry but its step's window), says which in
    `recovered`, as an equation's step does: each input's unknown region before and after
    it."""

    kind: str
    eqns: tuple[JaxprEqn, ...]
    recovered: list[tuple[Var, Any, Any]] = field(default_factory=list)
    inputs: list[Var] = field(default_factory=list)
    outputs: list[Var] = field(default_factory=list)
    tear: Tear | None = None
    elementwise: bool = False


class Recorder:
    """The steps of one walk over `jaxpr` (in `env`), and the records of the sub-jaxpr walks
    of its loops and branches, by equation."""

    def __init__(
        self,
        env: Any = None,
        jaxpr: Any = None,
        hints: Any = None,
        seeded: Sequence[int] = (),
        goals: Sequence[int] = (),
    ) -> None:
        self.env, self.jaxpr, self.hints = env, jaxpr, hints
        # the positions of the outputs the walk started from and of the inputs it recovered
        self.seeded_pos, self.goal_pos = list(seeded), list(goals)
        self.steps: list[Step] = []
        self.children: dict[int, Recorder] = {}  # id(eqn) -> the last walk of its sub-jaxpr
        # id(eqn) -> a loop's log-det, taken by its inverse rule in the same loop (None: this
        # walk's log-det is not asked for; `inverse_and_slogdet` asks)
        self.logdets: dict[int, Any] | None = None
        self.unsupported: list[str] = []

    @property
    def seeded(self) -> list:
        return [self.jaxpr.outvars[i] for i in self.seeded_pos]

    @property
    def goals(self) -> list:
        return [self.jaxpr.invars[i] for i in self.goal_pos]

    def mine(self, env: Any) -> bool:
        return env is self.env


def active(env: Any) -> Recorder | None:
    """The recorder of the walk over `env`, if its context records that walk."""
    ctx = getattr(env, "ctx", None)
    rec = ctx.recorder if ctx is not None else None
    return rec if rec is not None and rec.mine(env) else None


def eqn_step(env: Any, eqn: JaxprEqn, changes: Sequence[tuple[Var, Any, Any]]) -> None:
    rec = active(env)
    if rec is not None and changes:
        rec.steps.append(Step("eqn", (eqn,), list(changes)))


def group_step(
    env: Any,
    kind: str,
    eqns: Sequence[JaxprEqn],
    inputs: Sequence[Var],
    outputs: Sequence[Var],
    tear: Tear | None = None,
    elementwise: bool = False,
    recovered: Sequence[tuple[Var, Any, Any]] = (),
) -> None:
    rec = active(env)
    if rec is not None:
        rec.steps.append(
            Step(
                kind,
                tuple(eqns),
                recovered=list(recovered),
                inputs=list(inputs),
                outputs=list(outputs),
                tear=tear,
                elementwise=elementwise,
            )
        )


def unsupported(env: Any, why: str) -> None:
    """A step the record cannot describe (its log-determinant then comes from elsewhere)."""
    rec = active(env)
    if rec is not None:
        rec.unsupported.append(why)


def child(
    parent_env: Any,
    eqn: JaxprEqn | None,
    env: Any,
    jaxpr: Any,
    hints: Any,
    seeded: Sequence[int],
    goals: Sequence[int],
) -> tuple[Any, Callable[[], None]]:
    """The context of the walk over a sub-jaxpr (`env`, `jaxpr`) that the rule of `eqn` runs
    in the walk over `parent_env`, and what to call once that walk succeeded: where the
    parent walk is recorded, the child walk gets a record of its own, filed under `eqn`."""
    ctx = parent_env.ctx
    parent = active(parent_env)
    if parent is None or eqn is None:
        return ctx.replace(recorder=None), _nothing
    rec = Recorder(env, jaxpr, hints, seeded, goals)
    if parent.logdets is not None:
        # a loop inside the sub-jaxpr (the element loop inside each of flowjax's stacked
        # layers) takes its log-det in its own inverse loop too
        rec.logdets = {}

    def attach() -> None:
        parent.children[id(eqn)] = rec

    return ctx.replace(recorder=rec), attach


def _nothing() -> None:
    return None
