"""Reports on `reversible` and `reverse`: what `reversible` stores (`memory_report`) and how
far a round trip drifts (`check_reversible`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxrev._compat import JaxprEqn, Var, hoist_consts, is_key, prims, user_source
from jaxrev._env import Env
from jaxrev._errors import NotInvertibleError, ReversibilityError
from jaxrev._graph import is_var
from jaxrev._program import normalize_argnums, trace_program, traced_leaves
from jaxrev.transforms.knowledge.context import Settings, WalkContext
from jaxrev.transforms.propagation.walker import propagate
from jaxrev.transforms.reverse import invert_call
from jaxrev.transforms.reversible import bind_reversible, rebuild
from jaxrev.transforms.sweep.backward import Plan, n_checkpoints, top_plan
from jaxrev.transforms.sweep.dial import Dial
from jaxrev.transforms.sweep.drift import leaf_drift
from jaxrev.transforms.sweep.exact import Exact, outside_loops, stored

__all__ = ["memory_report", "MemoryReport", "check_reversible", "ReversibilityReport"]


class MemoryReport:
    """What `reversible` stores, listed with bytes and the source line that forces each value
    (`memory_report` makes it; `str(report)` is a table).

    **Arguments:**

    - `entries`: a list of dicts: `what`, `shape`, `dtype`, `bytes` (per store), `count` (how
      many times it is stored: the iterations of the loops around it), `where` (the user's
      file:line and the primitive that needs it), `made` (the step that computes the value,
      where it has one).
    - `name`: the function's name.

    `total_bytes` (a property) sums bytes × count.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> from jax import lax
        >>> relu_steps = lambda x: lax.fori_loop(0, 3, lambda i, x: jnp.maximum(x, 0.0) + 1.0, x)
        >>> rep = jr.memory_report(relu_steps, jnp.ones(4, jnp.float32), checkpoint_every=None)
        >>> rep.total_bytes   # 4 floats x 3 (the default also lists its checkpoints)
        48
    """

    def __init__(self, entries: list[dict], name: str) -> None:
        self.entries = entries
        self.name = name

    @property
    def total_bytes(self) -> int:
        return int(sum(entry["bytes"] * entry["count"] for entry in self.entries))

    def __str__(self) -> str:
        if not self.entries:
            return f"reversible({self.name}) stores nothing beyond its inputs and outputs."
        lines = [f"reversible({self.name}) stores {self.total_bytes} bytes:"]
        for entry in self.entries:
            unit = "checkpoint" if entry["what"].startswith("checkpoint") else "iteration"
            per = (
                f"{entry['bytes']} B per {unit} x {entry['count']}"
                if entry["count"] != 1
                else f"{entry['bytes']} B per call"
            )
            made = entry.get("made") or ""
            made = (
                f"; {made}"
                if made.startswith("an input")
                else (f"; computed by {made}" if made else "")
            )
            lines.append(
                f"  {entry['what']} {entry['dtype']}{list(entry['shape'])}: {per}  "
                f"(needed by {entry['where']}{made})"
            )
        return "\n".join(lines)

    __repr__ = __str__


def _describe(eqn: JaxprEqn | None) -> str:
    if eqn is None:
        return "value not used by the output"
    _, _, summary = user_source(eqn)
    return f"`{eqn.primitive.name}` at {summary}"


def _report_entries(plan: Plan, count: int, out: list[dict]) -> None:
    """Append to `out` what `plan` stores, each `count` times (the loops around it), then its
    loops' residuals and checkpoints."""
    eqns = plan.closed.jaxpr.eqns
    producer = {}  # variable -> the equation that computes it
    for eqn in eqns:
        producer.update((o, eqn) for o in eqn.outvars if is_var(o))
    for v in plan.store:
        nbytes = int(np.prod(v.aval.shape, dtype=np.int64)) * v.aval.dtype.itemsize
        why = plan.why.get(v)
        what = plan.labels.get(v) or (
            "branch index of a cond"
            if why is not None and why.primitive is prims.cond
            else "value a lossy step cannot rebuild"
        )
        out.append(
            dict(
                what=what,
                shape=tuple(v.aval.shape),
                dtype=str(v.aval.dtype),
                bytes=nbytes,
                count=count,
                where=_describe(why),
                made=(
                    _describe(producer[v])
                    if v in producer
                    else "an input of the function or loop body"
                ),
            )
        )
    for i in sorted(plan.loops):
        loop_plan = plan.loops[i]
        if loop_plan.kind == "while":
            size = int(np.prod(loop_plan.count_shape, dtype=np.int64))
            out.append(
                dict(
                    what="trip count of a while loop",
                    shape=loop_plan.count_shape,
                    dtype="int32",
                    bytes=4 * size,
                    count=count,
                    where=_describe(eqns[i]),
                    made=_describe(eqns[i]),
                )
            )
            if loop_plan.max_steps is not None:
                _report_entries(loop_plan.body, count * loop_plan.max_steps, out)
        elif loop_plan.kind == "cond":
            for branch in loop_plan.branches:
                _report_entries(branch, count, out)
        else:
            _report_entries(loop_plan.body, count * loop_plan.length, out)
        unread = loop_plan.unread or (False,) * len(loop_plan.carry)
        for aval, once in zip(loop_plan.carry, unread):  # the dial's checkpoints
            out.append(
                dict(
                    what=(
                        "start of an accumulator the backward run does not read"
                        if once
                        else f"checkpoint of the loop carry (every {loop_plan.every} iterations)"
                    ),
                    shape=tuple(aval.shape),
                    dtype=str(aval.dtype),
                    bytes=int(np.prod(aval.shape, dtype=np.int64)) * aval.dtype.itemsize,
                    count=count * (1 if once else n_checkpoints(loop_plan)),
                    where=_describe(eqns[i]),
                    made=_describe(eqns[i]),
                )
            )


def memory_report(
    fun: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    checkpoint_every: int | str | None = "auto",
    memory_budget: int | None = None,
    max_steps: int | None = None,
    on_drift: str = "repair",
    exact: bool | Exact = False,
) -> MemoryReport:
    """List what `reversible(fun, argnums, ...)` stores for its gradient, beyond inputs and
    outputs: values lossy steps cannot rebuild, and the time-space dial's checkpoints (with
    `exact`: each loop's final carries in fixed point and its information buffer).

    A repair's scratch (one segment's carries) is not listed.

    **Arguments:**

    - `fun`: the function, as for `reversible`.
    - `*args`: its positional arguments (arrays or `jax.ShapeDtypeStruct`s of them).
    - `argnums`, `checkpoint_every`, `memory_budget`, `max_steps`, `on_drift`, `exact`:
      `reversible`'s keywords, with its defaults.

    **Returns:**

    A `MemoryReport`: one entry per stored value, with its bytes and the source line that
    forces it.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> f = lambda x: jax.lax.fori_loop(0, 10, lambda i, x: jax.nn.relu(x) + 1.0, x)
        >>> rep = jr.memory_report(f, jnp.ones(4), checkpoint_every=None)
        >>> [(e["count"], e["where"].split()[0]) for e in rep.entries]  # how often, what step
        [(10, '`max`')]
    """
    if exact is not False:
        spec = exact if isinstance(exact, Exact) else Exact()
        prog = trace_program(fun, args, normalize_argnums(argnums, len(args), fun))
        closed, lifted = hoist_consts(prog.closed)
        leaves = [
            *lifted,
            *(jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in prog.flat),
        ]
        entries = stored(prog.closed, spec, _describe) + outside_loops(closed, leaves, spec)
        return MemoryReport(entries, getattr(fun, "__name__", "fun"))
    bound = bind_reversible(fun, args, argnums)
    plan = top_plan(
        bound.jaxpr,
        bound.state,
        Dial(
            checkpoint_every,
            memory_budget,
            on_drift,
            max_steps=max_steps,
            name=getattr(fun, "__name__", "fun"),
            walk=Settings("jaxrev.memory_report"),
        ),
    )
    entries: list[dict] = []
    _report_entries(plan, 1, entries)
    return MemoryReport(entries, getattr(fun, "__name__", "fun"))


@dataclass
class ReversibilityReport:
    """Round-trip error of `reverse(fun)(fun(x))` against `x` (`check_reversible` makes it).

    **Arguments:**

    - `max_error`: the largest relative error over the state leaves (normwise, per leaf:
      max|x̃ − x| / (max|x| + atol); a leaf that is all zeros is measured absolutely).
    - `leaf_errors`: the error of every leaf.
    - `worst`: the equation and source line whose inversion added the most error (None when
      the round trip is exact, or measured by `reversible`'s backward run).
    - `steps`: ``(added error, step and source line)`` for each step whose inversion added
      error, the largest first.
    - `segments`: for `reversible`'s run (a plain `while_loop`, or a `checkpoint_every`),
      ``(loop, drift)``: each checkpointed loop's worst segment drift.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> jr.check_reversible(lambda x: 3.0 * x + 1.0, jnp.array([0.5, 2.0])).max_error
        0.0
    """

    max_error: float
    leaf_errors: list[float]
    worst: str | None
    steps: list[tuple[float, str]] = field(default_factory=list)
    segments: list[tuple[str, float]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [
            f"round-trip relative error: {self.max_error:.3e} "
            f"(per state leaf: {', '.join(f'{e:.2e}' for e in self.leaf_errors)})"
        ]
        if self.worst is not None:
            lines.append(f"error grows most at: {self.worst}")
        for err, where in self.steps[:5]:
            lines.append(f"  {err:.2e} added by {where}")
        for what, drift in self.segments:
            lines.append(f"  drift {drift:.2e}: {what}")
        return "\n".join(lines)


_WHO = Settings("jaxrev.check_reversible")


def _rel_err(rebuilt: Any, true: Any, atol: float = 0.0) -> float:
    if is_key(true):  # a PRNG key has no arithmetic: its bits are rebuilt exactly, or not
        rebuilt, true = jax.random.key_data(rebuilt), jax.random.key_data(true)
    return float(leaf_drift(rebuilt, true, atol))


def check_reversible(
    fun: Callable,
    *args: Any,
    argnums: int | Sequence[int] = 0,
    rtol: float | None = None,
    atol: float = 0.0,
    checkpoint_every: int | None = None,
    max_steps: int | None = None,
) -> ReversibilityReport:
    """Run `fun` forward and `reverse(fun)` backward on `args` and report the drift.

    Runs eagerly (values are compared equation by equation to find where the error grows). A
    plain `while_loop` that `reverse` cannot count, or a `checkpoint_every` (with `max_steps`
    for while loops), is measured on `reversible`'s own backward run, which records the trip
    count and reports each checkpointed loop's worst segment drift.

    **Arguments:**

    - `fun`: the function, as for `reverse`.
    - `*args`: its positional arguments (concrete arrays).
    - `argnums`: the position (an int) or positions (a tuple) of the state arguments.
    - `rtol`: when given, a relative error above it raises `ReversibilityError`.
    - `atol`: added to the state's magnitude in the relative error (default 0).
    - `checkpoint_every`, `max_steps`: `reversible`'s, to measure its backward run.

    **Returns:**

    A `ReversibilityReport`.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> rep = jr.check_reversible(lambda x: jnp.exp(x) * 3.0, jnp.linspace(0.0, 1.0, 5))
        >>> rep.max_error < 1e-6
        True
    """
    nums = normalize_argnums(argnums, len(args), fun)
    x_true = args[nums[0]] if len(nums) == 1 else tuple(args[a] for a in nums)
    name = getattr(fun, "__name__", "fun")
    if checkpoint_every is not None or max_steps is not None:
        report = _by_reversible(
            fun,
            args,
            nums,
            x_true,
            atol,
            Dial(checkpoint_every, max_steps=max_steps, on_drift="nan", name=name, walk=_WHO),
        )
    else:
        try:
            report = _by_reverse(fun, args, nums, x_true, atol)
        except NotInvertibleError as err:
            if err.primitive != "while":
                raise
            report = _by_reversible(
                fun, args, nums, x_true, atol, Dial(on_drift="nan", name=name, walk=_WHO)
            )
    if rtol is not None and report.max_error > rtol:
        raise ReversibilityError(f"round trip exceeds rtol={rtol:g}\n{report}")
    return report


def _by_reversible(
    fun: Callable, args: Sequence[Any], nums: Sequence[int], x_true: Any, atol: float, dial: Dial
) -> ReversibilityReport:
    leaves, sites = rebuild(fun, args, nums, dial)
    true_leaves = jax.tree_util.tree_leaves(x_true)
    leaf_errors = [_rel_err(a, b, atol) for a, b in zip(leaves, true_leaves)]
    return ReversibilityReport(
        max(leaf_errors, default=0.0),
        leaf_errors,
        None,
        [],
        [s for s in sites if not s[0].startswith("the state")],
    )


def _by_reverse(
    fun: Callable, args: Sequence[Any], nums: Sequence[int], x_true: Any, atol: float
) -> ReversibilityReport:
    result = fun(*args)
    outs = (result,) if len(nums) == 1 else tuple(result)
    inv_args = list(args)
    for argnum, out in zip(nums, outs):
        inv_args[argnum] = out
    events: list[tuple[Any, list[Var]]] = []
    inv = invert_call(
        fun, tuple(inv_args), nums, on_invert=lambda e, vs: events.append((e, vs)), settings=_WHO
    )
    state, jaxpr, inv_env = inv.state, inv.jaxpr, inv.env
    leaf_errors = [
        _rel_err(a, b, atol)
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(x_true))
    ]
    # forward values of every variable, to see where the backward run drifts
    fwd = Env(ctx=WalkContext(_WHO))
    flat_args = traced_leaves(tuple(args))
    for v, x in zip(jaxpr.invars, flat_args):
        fwd.write(v, x)
    inv_consts = {v: inv_env.read(v) for v in jaxpr.constvars}
    for v, const in inv_consts.items():
        fwd.write(v, const)
    propagate(jaxpr, fwd, list(v for v in jaxpr.outvars if isinstance(v, Var)), forward_only=True)
    steps = []
    for eqn, wrote in events:
        err_in = max(
            (_rel_err(inv_env.read(v), fwd.read(v), atol) for v in wrote if fwd.known(v)),
            default=0.0,
        )
        err_out = max(
            (
                _rel_err(inv_env.read(v), fwd.read(v), atol)
                for v in eqn.outvars
                if isinstance(v, Var) and inv_env.known(v) and fwd.known(v)
            ),
            default=0.0,
        )
        _, _, summary = user_source(eqn)
        steps.append((err_in - err_out, f"`{eqn.primitive.name}` at {summary}"))
    steps = sorted((s for s in steps if s[0] > 0), key=lambda s: -s[0])
    worst = steps[0][1] if steps and steps[0][0] > 0 else None
    return ReversibilityReport(max(leaf_errors, default=0.0), leaf_errors, worst, steps)
