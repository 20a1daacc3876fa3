"""diffrax solves differentiated by running the solver backwards: `ReversibleAdjoint`, and
`Reversible`, which makes any explicit Runge–Kutta solver algebraically reversible.

An optional module (it imports diffrax). `diffeqsolve(..., adjoint=jr.diffrax.ReversibleAdjoint())`
runs the step loop under `jr.reversible`: the backward pass rebuilds every step's state by
inverting the solver's step (`Reversible(solver)`'s coupled steps, or
`diffrax.ReversibleHeun`'s, both algebraic bijections of their state), so memory does not
grow with the number of steps and the gradient is the discretise-then-optimise gradient
(`DirectAdjoint`'s), not an adjoint ODE's approximation of it (`BacksolveAdjoint`'s).

The loop is jaxrev's own, not diffrax's: the times come from the step counter (as
`ConstantStepSize` and `StepTo` compute them, so the steps equal diffrax's bit for bit) or,
for an adaptive controller, from the accepted steps of a first, non-differentiated diffrax
solve (one scalar a step); a value saved at `SaveAt(ts=...)` is one more step from the step it
falls in, interpolated with the solver's interpolation and added into a zero buffer (which the
backward pass subtracts). Nothing is stored per step; per save time, one trip count.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import diffrax
import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax

from jaxrev._program import derived_leaves
from jaxrev.transforms.reversible import reversible

__all__ = ["ReversibleAdjoint", "Reversible"]

# int32 step counts, so 31 halvings find any step
_SEARCH_ROUNDS = 32


class ReversibleAdjoint(diffrax.AbstractAdjoint):
    """Backpropagate through `diffeqsolve` by running the solver backwards (`jr.reversible`).

    Solvers: `Reversible(s)` for an explicit Runge–Kutta solver s, or `diffrax.ReversibleHeun`;
    an explicit Runge–Kutta solver as it is (its step loses information) and implicit, split or
    SDE-only solvers are refused with a `ValueError` saying what is accepted. Controllers:
    `ConstantStepSize`, `StepTo`, and adaptive ones (`PIDController`: the accepted steps are
    found by a first solve that is not differentiated, as diffrax's controller stops gradients
    through its step sizes too, and kept, one scalar a step; needs a finite `max_steps`).
    `SaveAt` with `t0`, `t1`, `ts` and `subs` (not `steps` or `dense`); no events.

    **Arguments:**

    The fields are `jr.reversible`'s:

    - `checkpoint_every`: None (the default): nothing is stored per step (memory flat in the
      number of steps and in `max_steps`); the rebuilt start of the solve is checked against
      y0. "auto" keeps ⌈√max_steps⌉ checkpoints of the state so that a drifting segment is
      recomputed forward (repaired) instead, for solves saved at t1 (a solve saved at `ts`
      stays checked, not repaired). An int K: a checkpoint every K steps.
    - `memory_budget`: bytes of checkpoints the solve may keep (picks K).
    - `on_drift`: what a miss does: "repair" (the default), "raise" (a `jr.DriftError`, never a
      silently wrong gradient), "warn", "nan", "ignore".
    - `drift_rtol`: a relative drift tolerance instead of the default measures.

    **Returns:**

    The adjoint, for `diffeqsolve(..., adjoint=ReversibleAdjoint())`.

    **Example:**

        >>> import diffrax, jax, jax.numpy as jnp, jaxrev as jr
        >>> from jaxrev.diffrax import ReversibleAdjoint
        >>> def loss(th):
        ...     term = diffrax.ODETerm(lambda t, y, th: -th * y)
        ...     sol = diffrax.diffeqsolve(term, diffrax.ReversibleHeun(), 0.0, 1.0, 0.01,
        ...                               jnp.ones(3), args=th, adjoint=ReversibleAdjoint())
        ...     return sol.ys[-1].sum()
        >>> g = jax.grad(loss)(0.5)
        >>> bool(jnp.abs(g + 3 * jnp.exp(-0.5)) < 1e-3)
        True
    """

    checkpoint_every: int | str | None = eqx.field(static=True, default=None)
    memory_budget: int | None = eqx.field(static=True, default=None)
    on_drift: str = eqx.field(static=True, default="repair")
    drift_rtol: float | None = eqx.field(static=True, default=None)

    def loop(
        self,
        *,
        args,
        terms,
        solver,
        stepsize_controller,
        event,
        saveat,
        t0,
        t1,
        dt0,
        max_steps,
        throw,
        init_state,
        passed_solver_state,
        passed_controller_state,
        progress_meter,
    ) -> Any:
        del throw, passed_solver_state, passed_controller_state, progress_meter
        _check_supported(event, saveat, solver)
        if isinstance(stepsize_controller, (diffrax.ConstantStepSize, diffrax.StepTo)):
            grid, failed = _Grid.make(stepsize_controller, init_state, t0, t1), None
        else:
            grid, failed = _Grid.accepted(
                terms, solver, stepsize_controller, t0, t1, dt0, init_state.y, args, max_steps
            )
        n_run = grid.n if max_steps is None else jnp.minimum(grid.n, max_steps)

        subs = jtu.tree_leaves(saveat.subs, is_leaf=_is_sub)
        states = jtu.tree_leaves(init_state.save_state, is_leaf=_is_save_state)
        save_ts = [jnp.asarray(s.ts) for s in subs if s.ts is not None]
        if save_ts:
            s_all = jnp.concatenate(save_ts).astype(jnp.result_type(t0))
        else:
            s_all = jnp.zeros((0,), jnp.result_type(t0))
        where = jax.vmap(lambda s: grid.step_of(s))(s_all)
        order = jnp.argsort(where, stable=True)

        y0, ss0 = init_state.y, init_state.solver_state
        full0 = (jnp.zeros((), jnp.int32), y0, ss0)
        carry = _Carry(_body(terms, args, solver, grid), full0)
        kept0 = eqx.error_if(
            carry.pack(full0),
            _off_manifold(carry, full0),
            "ReversibleAdjoint: the solver's initial state is not what its "
            "step computes from the rest of the state, so the step cannot "
            "be inverted from it",
        )
        buf0 = jtu.tree_map(
            lambda y: jnp.zeros((s_all.shape[0],) + jnp.shape(y), jnp.result_type(y)), y0
        )
        solve = partial(_run, template=jax.eval_shape(lambda: full0))
        solve.__name__ = "ReversibleAdjoint"  # (what jaxrev's messages call the solve)
        run = reversible(
            solve,
            checkpoint_every=self.checkpoint_every,
            memory_budget=self.memory_budget,
            on_drift=self.on_drift,
            drift_rtol=self.drift_rtol,
            max_steps=max_steps,
        )
        params = (terms, args, solver, grid, n_run, where[order], s_all[order], order)
        kept1, buf = run((kept0, buf0), params)
        _, y1, ss1 = carry.unpack(kept1)

        saved, start = [], 0
        for sub in subs:
            pieces_t, pieces_y = [], []
            if sub.t0:
                pieces_t.append(jnp.reshape(t0, (1,)))
                pieces_y.append(_lead(sub.fn(t0, y0, args)))
            if sub.ts is not None:
                k = len(sub.ts)
                ts = s_all[start : start + k]
                ys = jtu.tree_map(lambda b: b[start : start + k], buf)
                pieces_t.append(ts)
                pieces_y.append(jax.vmap(lambda t, y: sub.fn(t, y, args))(ts, ys))
                start += k
            if sub.t1:
                pieces_t.append(jnp.reshape(grid.time(n_run), (1,)))
                pieces_y.append(_lead(sub.fn(grid.time(n_run), y1, args)))
            saved.append((pieces_t, pieces_y))

        new_states = [
            _filled(st, ts, ys, 0 if sub.ts is None else len(sub.ts))
            for st, sub, (ts, ys) in zip(states, subs, saved)
        ]
        save_state = jtu.tree_unflatten(
            jtu.tree_structure(init_state.save_state, is_leaf=_is_save_state), new_states
        )
        result = diffrax.RESULTS.where(
            n_run < grid.n, diffrax.RESULTS.max_steps_reached, diffrax.RESULTS.successful
        )
        if failed is not None:
            result = diffrax.RESULTS.where(failed == diffrax.RESULTS.successful, result, failed)
        count = jnp.asarray(n_run, jnp.result_type(init_state.num_steps))
        t_end = grid.time(n_run)
        final = eqx.tree_at(
            lambda s: (
                s.y,
                s.solver_state,
                s.tprev,
                s.tnext,
                s.num_steps,
                s.num_accepted_steps,
                s.save_state,
                s.result,
            ),
            init_state,
            (y1, ss1, t_end, t_end, count, count, save_state, result),
            is_leaf=lambda x: x is None,
        )
        return final, {}


_EXPLICIT_RK = (diffrax.AbstractERK, diffrax.Euler)
_ACCEPTED = (
    "Euler, Heun, Midpoint, Ralston, Bosh3, Tsit5, Dopri5, Dopri8 or another diffrax.AbstractERK"
)


class Reversible(diffrax.AbstractAdaptiveSolver):
    """An explicit Runge–Kutta solver made algebraically reversible (McCallum & Foster 2024,
    "Efficient, accurate and stable gradients for neural ODEs").

    The solve carries two approximations of the solution, y (returned) and z (the solver
    state). With Φ(t0, t1, u) the base solver's step from u over [t0, t1] and λ = `coupling`:

        y1 = λ (y0 − z0) + Φ(t0, t1, z0)
        z1 = y1 + z0 − Φ(t1, t0, y1)

    Each line adds to one value a function of the other, so the step is a bijection of (y, z)
    whose inverse needs two base steps and no solve; `jr.reversible` finds that inverse in the
    step's own program (no rule is registered: the couplings are inverted like any additive
    coupling, at the cost a hand-written inverse would have, and the stages the inverse
    evaluates are the ones the step's VJP reads), and `ReversibleAdjoint` runs the solve
    backwards with it. The order is the base solver's. Each base step is taken as after a jump
    (its first-same-as-last stage is evaluated, not read from a state), so the solver state is
    z alone: a pure function of the step's inputs, which the backward run can rebuild (Tsit5's
    and Dopri5's cached stage would otherwise be state that no step computes from y and z). The
    error estimate and the interpolation are those of the base step from z0.

    **Arguments:**

    - `solver`: an explicit Runge–Kutta solver (`Euler`, `Heun`, `Midpoint`, `Ralston`,
      `Bosh3`, `Tsit5`, `Dopri5`, `Dopri8`, any `diffrax.AbstractERK`); implicit solvers,
      `SemiImplicitEuler` and SDE-only solvers are refused.
    - `coupling`: λ, with ``0 < coupling <= 1`` (default 0.999).

    **Returns:**

    A diffrax solver, of the base solver's order.

    **Example:**

        >>> import diffrax, jax.numpy as jnp
        >>> from jaxrev.diffrax import Reversible
        >>> term = diffrax.ODETerm(lambda t, y, args: -y)
        >>> sol = diffrax.diffeqsolve(term, Reversible(diffrax.Tsit5()), 0.0, 1.0, 0.05,
        ...                           jnp.ones(2))
        >>> bool(jnp.allclose(sol.ys[-1], jnp.exp(-1.0), rtol=1e-6))
        True
    """

    solver: diffrax.AbstractSolver
    coupling: float = eqx.field(static=True, default=0.999)

    def __check_init__(self) -> None:
        if not isinstance(self.solver, _EXPLICIT_RK) or isinstance(
            self.solver, diffrax.AbstractImplicitSolver
        ):
            raise ValueError(
                f"jaxrev.diffrax.Reversible needs an explicit Runge–Kutta solver ({_ACCEPTED}), "
                f"not {type(self.solver).__name__}: its step is made reversible by coupling "
                f"two explicit steps, which an implicit, split or SDE-only solver does not "
                f"give."
            )
        if not 0 < self.coupling <= 1:
            raise ValueError(
                f"jaxrev.diffrax.Reversible: coupling must be in (0, 1], got {self.coupling!r}"
            )

    @property
    def term_structure(self):  # type: ignore[override]
        return self.solver.term_structure

    @property
    def interpolation_cls(self):  # type: ignore[override]
        return self.solver.interpolation_cls

    @property
    def term_compatible_contr_kwargs(self):  # type: ignore[override]
        return self.solver.term_compatible_contr_kwargs

    def order(self, terms: Any) -> Any:
        return self.solver.order(terms)

    def strong_order(self, terms: Any) -> Any:
        return self.solver.strong_order(terms)

    def error_order(self, terms: Any) -> Any:
        return self.solver.error_order(terms)

    def init(self, terms: Any, t0: Any, t1: Any, y0: Any, args: Any) -> Any:
        return y0  # z0 = y0

    def _base(self, terms: Any, t0: Any, t1: Any, u: Any, args: Any, full: bool = True) -> tuple:
        """The base solver's step from u over [t0, t1]: (u1, error, dense info, result);
        without `full`, u1 alone (the error and dense information are None)."""
        if not isinstance(self.solver, diffrax.AbstractERK):  # Euler
            state = self.solver.init(terms, t0, t1, u, args)
            u1, err, dense, _, result = self.solver.step(terms, t0, t1, u, args, state, True)
            return u1, err, dense, result
        return _erk_step(self.solver.tableau, terms, t0, t1, u, args, full)

    def step(
        self,
        terms: Any,
        t0: Any,
        t1: Any,
        y0: Any,
        args: Any,
        solver_state: Any,
        made_jump: Any,
        full: bool = True,
    ) -> tuple:
        """diffrax's step; without `full` (`ReversibleAdjoint`'s loop, which reads neither
        the error estimate nor the dense information) those are None, and a
        first-same-as-last stage only they read is not evaluated."""
        z0 = solver_state
        phi_z, y_error, dense, r1 = self._base(terms, t0, t1, z0, args, full)
        y1 = jtu.tree_map(lambda y, z, p: self.coupling * (y - z) + p, y0, z0, phi_z)
        phi_y, _, _, r2 = self._base(terms, t1, t0, y1, args, full=False)
        z1 = jtu.tree_map(lambda y, z, p: y + z - p, y1, z0, phi_y)
        return (
            y1,
            y_error,
            dense,
            z1,
            diffrax.RESULTS.where(r1 == diffrax.RESULTS.successful, r2, r1),
        )

    def func(self, terms: Any, t0: Any, y0: Any, args: Any) -> Any:
        return self.solver.func(terms, t0, y0, args)


def _erk_step(
    tab: Any, terms: Any, t0: Any, t1: Any, u: Any, args: Any, full: bool = True
) -> tuple:
    """One step of an explicit Runge–Kutta method from its Butcher tableau, its stages
    unrolled: diffrax's own step runs them in an Equinox while loop (whose VJP only its custom
    rule gives) and, for first-same-as-last methods, reads its first stage from a state; here
    every stage is computed from (t0, t1, u), so the step is a plain function the backward run
    rebuilds and differentiates stage by stage. The stages, the solution, the error estimate
    and the dense information (``y0, y1, k``) are diffrax's. Without `full`, the solution
    alone: a first-same-as-last stage that only the error estimate reads is not evaluated."""
    control = terms.contr(t0, t1)
    dtype = jnp.result_type(*jtu.tree_leaves(u))
    ks: list = []
    stages = tab.num_stages
    if not full and tab.b_sol[-1] == 0:
        stages -= 1
    for i in range(stages):
        if i == 0:
            ui, ti = u, t0
        else:
            a_row = jnp.asarray(tab.a_lower[i - 1], dtype)
            ui = jtu.tree_map(lambda x, *k: x + sum(a_row[j] * k[j] for j in range(i)), u, *ks)
            ti = t0 + tab.c[i - 1] * (t1 - t0)
        ks.append(terms.vf_prod(ti, ui, args, control))
    b_sol = jnp.asarray(tab.b_sol, dtype)
    b_err = jnp.asarray(tab.b_error, dtype)
    u1 = jtu.tree_map(lambda x, *k: x + sum(b_sol[j] * k[j] for j in range(len(k))), u, *ks)
    if not full:
        return u1, None, None, diffrax.RESULTS.successful
    err = jtu.tree_map(lambda *k: sum(b_err[j] * k[j] for j in range(len(k))), *ks)
    k_stack = jtu.tree_map(lambda *k: jnp.stack(k), *ks)
    return u1, err, dict(y0=u, y1=u1, k=k_stack), diffrax.RESULTS.successful


def _nothing(t: Any, y: Any, args: Any) -> Any:
    return jnp.zeros((0,), jnp.result_type(t))


def _is_sub(x: Any) -> bool:
    return isinstance(x, diffrax.SubSaveAt)


def _is_save_state(x: Any) -> bool:
    return hasattr(x, "saveat_ts_index") and hasattr(x, "save_index")


def _lead(tree: Any) -> Any:
    return jtu.tree_map(lambda x: jnp.expand_dims(jnp.asarray(x), 0), tree)


def _filled(state: Any, ts: list, ys: list, n_ts: int) -> Any:
    """`state` (diffrax's SaveState) with its buffers holding what was saved, in diffrax's
    order (t0, then the `n_ts` times of `ts`, then t1)."""
    if not ts:
        return state
    ts_all = jnp.concatenate(ts).astype(state.ts.dtype)
    ys_all = jtu.tree_map(lambda *leaves: jnp.concatenate(leaves), *ys)
    ys_all = jtu.tree_map(
        lambda new, old: new.astype(old.dtype).reshape(old.shape), ys_all, state.ys
    )
    n = ts_all.shape[0]
    return eqx.tree_at(
        lambda s: (s.ts, s.ys, s.save_index, s.saveat_ts_index),
        state,
        (
            ts_all,
            ys_all,
            jnp.asarray(n, jnp.result_type(state.save_index)),
            jnp.asarray(n_ts, jnp.result_type(state.saveat_ts_index)),
        ),
    )


def _check_supported(event: Any, saveat: Any, solver: Any) -> None:
    base = solver.solver if isinstance(solver, Reversible) else solver
    if isinstance(solver, (diffrax.AbstractImplicitSolver, diffrax.SemiImplicitEuler)) or (
        not isinstance(base, (*_EXPLICIT_RK, diffrax.ReversibleHeun))
        and isinstance(base, diffrax.AbstractSolver)
        and type(base).__module__.startswith("diffrax.")
    ):
        raise ValueError(
            f"ReversibleAdjoint cannot run {type(solver).__name__} backwards: it needs a solver "
            f"whose step is a bijection, `Reversible(s)` for an explicit Runge–Kutta solver s "
            f"({_ACCEPTED}) or `diffrax.ReversibleHeun`. Implicit, split and SDE-only solvers "
            f"are not accepted."
        )
    if isinstance(solver, _EXPLICIT_RK):
        raise ValueError(
            f"ReversibleAdjoint cannot run {type(solver).__name__} backwards: its step loses "
            f"information (two starting points can reach the same end). Wrap it: "
            f"`jaxrev.diffrax.Reversible({type(solver).__name__}())` makes any explicit "
            f"Runge–Kutta solver algebraically reversible with the same order."
        )
    if event is not None:
        raise ValueError(
            "ReversibleAdjoint does not support events: the step at which an "
            "event stops the solve is not known before it runs."
        )
    if saveat.dense:
        raise ValueError(
            "ReversibleAdjoint does not support SaveAt(dense=True): it would "
            "store every step's interpolation, which is what it avoids."
        )
    for sub in jtu.tree_leaves(saveat.subs, is_leaf=_is_sub):
        if sub.steps:
            raise ValueError(
                "ReversibleAdjoint does not support SaveAt(steps=True): saving "
                "every step is the memory it avoids; save at `ts` instead."
            )


class _Grid(eqx.Module):
    """The step times of a `ConstantStepSize` or `StepTo` solve as a function of the step
    counter, computed as diffrax's controllers compute them, so they equal diffrax's steps."""

    n: Any
    t0: Any
    t1: Any
    first: Any
    frac: Any
    ts: Any
    clip_floor: Any

    @classmethod
    def make(cls, controller: Any, init_state: Any, t0: Any, t1: Any) -> _Grid:
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        if isinstance(controller, diffrax.StepTo):
            ts = jnp.asarray(controller.ts)
            return cls(ts.shape[0] - 1, t0, t1, None, None, ts, None)
        _, num_steps, t0_sim, t1_sim = init_state.controller_state
        num_steps = eqx.error_if(num_steps, num_steps < 0, "ReversibleAdjoint needs a finite t1.")
        floor = lax.stop_gradient(t1)
        for _ in range(100):
            floor = jnp.nextafter(floor, jnp.asarray(-jnp.inf, floor.dtype))
        return cls(num_steps, t0, t1, init_state.tnext, (t0_sim, t1_sim), None, floor)

    @classmethod
    def accepted(
        cls,
        terms: Any,
        solver: Any,
        controller: Any,
        t0: Any,
        t1: Any,
        dt0: Any,
        y0: Any,
        args: Any,
        max_steps: int | None,
    ) -> tuple:
        """The steps an adaptive controller accepts, found by a solve of diffrax's own whose
        value is not differentiated (the controller's step sizes carry no gradient in
        diffrax either, but for t0 and t1, which the steps are rebuilt from here); one scalar
        per step, and the solve's result."""
        if max_steps is None:
            raise ValueError(
                "ReversibleAdjoint with an adaptive step-size controller needs a "
                "finite max_steps: the accepted step sizes are kept, a scalar "
                "each."
            )

        def sg(tree: Any) -> Any:
            return jtu.tree_map(lambda x: lax.stop_gradient(x) if eqx.is_array(x) else x, tree)

        sol = diffrax.diffeqsolve(
            terms,
            solver,
            sg(t0),
            sg(t1),
            None if dt0 is None else sg(dt0),
            sg(y0),
            sg(args),
            saveat=diffrax.SaveAt(steps=True, fn=_nothing),
            stepsize_controller=controller,
            max_steps=max_steps,
            throw=False,
            adjoint=diffrax.RecursiveCheckpointAdjoint(checkpoints=1),
        )
        n = jnp.asarray(sol.stats["num_accepted_steps"], jnp.int32)
        t0, t1 = jnp.asarray(t0), jnp.asarray(t1)
        ts = jnp.concatenate([jnp.reshape(sg(t0), (1,)), sol.ts.astype(t0.dtype)])
        # t0 and t1 as traced (the last accepted step ends at t1 when the solve got there):
        # their gradients are diffrax's (every step time moves with t0; the last one is t1)
        ts = ts + (t0 - sg(t0))  # the same values, bit for bit
        ts = ts.at[n].set(jnp.where(ts[n] == sg(t1), t1, ts[n]))
        # past the last step, zero-length steps at its end rather than diffrax's inf padding:
        # a checkpointed loop's segments past the end are traced (and masked) with these
        ts = jnp.where(jnp.arange(ts.shape[0]) > n, ts[n], ts)
        return cls(n, t0, t1, None, None, ts, None), sol.result

    def time(self, k: Any) -> Any:
        if self.ts is not None:
            return self.ts[k]
        t0_sim, t1_sim = self.frac
        dtype = jnp.result_type(t0_sim, t1_sim)
        t = t0_sim + (t1_sim - t0_sim) * (jnp.astype(k, dtype) / jnp.astype(self.n, dtype))
        t = jnp.where(k == self.n, t1_sim, t)
        t = jnp.where(t > self.clip_floor, self.t1, t)
        t = jnp.where(k == 1, self.first, t)
        return jnp.minimum(jnp.where(k == 0, self.t0, t), self.t1).astype(self.t0.dtype)

    def step_of(self, s: Any) -> Any:
        """The first step k whose end reaches `s`: diffrax saves `s` while taking it."""

        def halve(_, lohi):
            lo, hi = lohi
            mid = (lo + hi) // 2
            up = self.time(mid + 1) >= s
            return jnp.where(up, lo, mid + 1), jnp.where(up, mid, hi)

        zero = jnp.zeros((), jnp.int32)
        top = jnp.maximum(jnp.asarray(self.n, jnp.int32) - 1, 0)
        return lax.fori_loop(0, _SEARCH_ROUNDS, halve, (zero, top))[0]


def _body(terms: Any, args: Any, solver: Any, grid: _Grid) -> Any:
    """One step of the solve on the carry (step counter, y, solver state)."""

    def body(c):
        k, y, ss = c
        kw = {"full": False} if isinstance(solver, Reversible) else {}
        y, _, _, ss, _ = solver.step(
            terms, grid.time(k), grid.time(k + 1), y, args, ss, False, **kw
        )
        return k + 1, y, ss

    return body


class _Carry:
    """The carry the loop keeps: the leaves of (counter, y, solver state) that the step does
    not compute from the others (`derived_leaves`: `ReversibleHeun`'s ``f(t, yhat)``). Keeping
    a derived leaf would make the step lose the value it overwrites."""

    def __init__(self, body: Any, full: Any):
        leaves, self.tree = jtu.tree_flatten(full)
        self.avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in leaves]
        self.derived, self.fill = derived_leaves(body, full)
        self.keep = [i for i in range(len(leaves)) if i not in self.derived]

    def pack(self, full: Any) -> list:
        leaves = jtu.tree_leaves(full)
        return [leaves[i] for i in self.keep]

    def unpack(self, kept: list) -> Any:
        leaves = [jnp.zeros(a.shape, a.dtype) for a in self.avals]
        for i, v in zip(self.keep, kept):
            leaves[i] = v
        return jtu.tree_unflatten(self.tree, self.fill(leaves))


def _off_manifold(carry: _Carry, full: Any) -> Any:
    """Whether a derived leaf of the initial carry differs from what the step would compute
    from the rest (beyond √eps): the loop would then start from another state."""
    leaves = jtu.tree_leaves(full)
    rebuilt = jtu.tree_leaves(carry.unpack(carry.pack(full)))
    bad = jnp.zeros((), bool)
    for i in carry.derived:
        a, b = rebuilt[i], leaves[i]
        tol = (
            jnp.sqrt(jnp.finfo(jnp.result_type(b)).eps)
            if jnp.issubdtype(jnp.result_type(b), jnp.inexact)
            else 0
        )
        bad = bad | (
            jnp.max(jnp.abs(a - b), initial=0) > tol * (jnp.max(jnp.abs(b), initial=0) + 1e-30)
        )
    return bad


def _run(state: Any, params: Any, template: Any) -> Any:
    """The solve: step to each save time's step, add its interpolated value into the buffer,
    then step to the end. Every operation on the state inverts, so nothing is stored."""
    terms, args, solver, grid, n_run, where, s, order = params
    body = _body(terms, args, solver, grid)
    carry = _Carry(body, template)

    def advance(kept, stop):
        return lax.while_loop(
            lambda c: c[0] < stop, lambda c: carry.pack(body(carry.unpack(c))), kept
        )

    def save(c, x):
        kept, buf = c
        m, t, slot = x
        kept = advance(kept, jnp.minimum(m, n_run))
        k, y, ss = carry.unpack(kept)
        _, _, dense, _, _ = solver.step(terms, grid.time(k), grid.time(k + 1), y, args, ss, False)
        value = solver.interpolation_cls(t0=grid.time(k), t1=grid.time(k + 1), **dense).evaluate(t)
        buf = jtu.tree_map(lambda b, v: b.at[slot].add(v.astype(b.dtype)), buf, value)
        return (kept, buf), None

    kept, buf = state
    if s.shape[0]:
        (kept, buf), _ = lax.scan(save, (kept, buf), (where, s, order))
    return advance(kept, n_run), buf
