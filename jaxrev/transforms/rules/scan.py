"""Every jaxrev rule of `scan` (and so of `fori_loop` with static bounds), in one block.

- inverse (`reverse`): the reverse loop over the inverted body;
- sweep (`reversible`'s backward pass): the reverse loop whose body first inverts one iteration
  on the carry, then pulls the cotangent back through it;
- forward (`reversible`'s forward run): the loop, stacking per iteration what the body's plan
  says it cannot rebuild.

Batching is JAX's own: `scan` stays a `scan` under `vmap`, and these rules see the batched loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrev._cache import compiled
from jaxrev._compat import (
    JaxprEqn,
    Literal,
    ScanParams,
    Var,
    is_concrete,
    prims,
    scan_info,
    user_source,
)
from jaxrev._env import Env, Statics, Unknown, is_unknown
from jaxrev._errors import NotInvertibleError
from jaxrev._evaluate import evaluate
from jaxrev._graph import (
    bytes_of,
    forward_known,
    is_var,
    needed_vars,
    size_of,
    unread_carries,
    work_of,
)
from jaxrev._prepare import prepare
from jaxrev.transforms.custom import custom_inverse
from jaxrev.transforms.knowledge import records
from jaxrev.transforms.knowledge import regions as R
from jaxrev.transforms.knowledge.elements import learn, per_element_forward, region_of
from jaxrev.transforms.logdet import (
    LogdetContext,
    LogdetResult,
    env_reader,
    evaluate_plan,
    run_forward,
)
from jaxrev.transforms.logdet import plan as logdet_plan
from jaxrev.transforms.propagation.walker import (
    Hints,
    RuleContext,
    Window,
    invert_jaxpr,
    propagate,
    seed,
    statics_for,
)
from jaxrev.transforms.registry import ElementRule, NeedMore, Unsupported, define
from jaxrev.transforms.rules.indexing import written_region
from jaxrev.transforms.sweep import drift
from jaxrev.transforms.sweep.backward import (
    BodyWalk,
    LoopEnd,
    LoopPlan,
    Plan,
    Residuals,
    acc,
    forward_with_residuals,
    known_or_rebuilt,
    loop_activity,
    loop_cts_in,
    loop_cts_out,
    outs_known,
    plan_for,
    res_avals,
    sds,
)
from jaxrev.transforms.sweep.dial import segment_checks
from jaxrev.transforms.sweep.segments import segmented, segmented_forward

__all__: list[str] = []


# --------------------------------------------------------------------------- inverse


def _scan_inverse(outs, *ins, ctx: RuleContext, **params):
    sp = scan_info(params)
    nc, ncar, body, length, rev = sp.nconsts, sp.ncarry, sp.body, sp.length, sp.reverse
    consts, init, xs = ins[:nc], list(ins[nc : nc + ncar]), list(ins[nc + ncar :])
    carry_out, ys = outs[:ncar], outs[ncar:]
    if any(is_unknown(c) for c in consts):
        raise NeedMore("the loop's constants are not known yet")
    bj = body.jaxpr
    xs_known = [not is_unknown(x) for x in xs]
    K = _forward_carries(bj, nc, [not is_unknown(c) for c in init], xs_known)
    # a carry the body also emits per iteration, with a known start, is known at every
    # iteration: its input is the previous iteration's output (a chain over slots)
    emits = _emitted_carries(bj, ncar, length, ys)
    emitted = {}
    waiting = False  # such a carry whose start is not known yet
    for i, j in emits.items():
        if K[i]:
            continue
        if is_unknown(init[i]):
            waiting = True
            continue
        y = ys[j]
        first = jnp.expand_dims(jnp.asarray(init[i], y.dtype), 0)
        emitted[i] = jnp.concatenate([y[1:], first]) if rev else jnp.concatenate([first, y[:-1]])
    unk = [i for i in range(ncar) if not K[i] and i not in emitted]
    # an unknown final carry that is also emitted is the last emitted value
    carry_out = [
        ys[emits[i]][0 if rev else -1] if is_unknown(c) and i in emits else c
        for i, c in enumerate(carry_out)
    ]
    if any(is_unknown(carry_out[i]) for i in unk):
        raise NeedMore("the loop's final carry is not known")
    fwd_idx = [i for i in range(ncar) if K[i]]
    known_idx = sorted([*fwd_idx, *emitted])
    xk = [x for x in xs if not is_unknown(x)]

    def body_ins(
        kin_t: Sequence[Any], kidx: Sequence[int], xs_t: Sequence[Any], cs: Sequence[Any]
    ) -> list:
        return _body_inputs(sp, cs, xs_known, kidx, kin_t, xs_t)

    kin_of: dict[int, Any] = dict(emitted)
    if fwd_idx:
        _, kin_fwd = _run_forward_carries(sp, consts, init, xs, fwd_idx)
        kin_of.update(zip(fwd_idx, kin_fwd))
    kin = [kin_of[i] for i in known_idx]
    hints = loop_hints(sp, ctx.static, ctx.support)
    ys_known_idx = [j for j, y in enumerate(ys) if not is_unknown(y)]

    # where the walk's log-det is asked for (`inverse_and_slogdet`), each iteration's is taken
    # in the inverse loop, from the body walk's record and values, rather than by running
    # the loop forward again from what it recovers (`_scan_logdet`)
    parent = records.active(ctx.env)
    logdets = parent.logdets if parent is not None else None
    floats = [jnp.result_type(y) for y in [*carry_out, *ys] if not is_unknown(y)]
    floats = [d for d in floats if jnp.issubdtype(d, jnp.inexact)]
    ld_dtype = jnp.result_type(*floats) if floats else jnp.float32

    def ibody(c_unk, sl, settings=None, cs=consts, windows=None):
        kin_t, ys_t, xs_t = sl
        outs_t = [Unknown(v.aval) for v in bj.outvars]
        for i, c in zip(unk, c_unk):
            outs_t[i] = c
        for j, y in zip(ys_known_idx, ys_t):
            outs_t[ncar + j] = y
        rec = invert_jaxpr(
            body,
            body_ins(kin_t, known_idx, xs_t, cs),
            outs_t,
            hints,
            ctx=ctx,
            settings=settings,
            windows=windows,
        )
        c_prev = [rec[nc + i] for i in unk]
        x_rec = [rec[nc + ncar + j] for j, kn in enumerate(xs_known) if not kn]
        return c_prev, (x_rec, _iteration_logdet(parent, logdets, ctx.eqn, ld_dtype))

    final = [carry_out[i] for i in unk]
    per_t = (kin, [ys[j] for j in ys_known_idx], xk)

    # where the inverse program may be reversed again (`reverse`'s), a loop undone at once is
    # emitted as a `custom_inverse` step whose inverse is the loop itself (its unknown xs and
    # its log-det are then not asked for: the log-det transforms' programs only run)
    again = ctx.walk.settings.reinverted
    writers = None
    if not ctx.walk.settings.rebuilds and (not again or (all(xs_known) and logdets is None)):
        writers = _undone_at_once(sp, consts, unk, known_idx, xs_known, hints, ctx)
    try:
        if writers is None:
            c0, (xs_rec, per_iteration) = lax.scan(
                ibody, final, per_t, length=length, reverse=not rev
            )
        else:
            ws = [writers[i] for i in unk]

            def undo(last: list, known: tuple) -> list:
                cs, per, _ = known
                at_once = _at_once(ibody, last, per, ws, length, cs)
                return list(at_once[0])

            def redo(first: list, known: tuple) -> list:
                cs, per, init_known = known
                carries, it_first, it_known = [], iter(first), iter(init_known)
                for i in range(ncar):
                    carries.append(next(it_first) if i in unk else next(it_known))
                outs = ctx.eqn.primitive.bind(*cs, *carries, *per[2], **ctx.eqn.params)
                return [outs[i] for i in unk]

            known = (list(consts), per_t, [c for i, c in enumerate(init) if i not in unk])
            leaves = jax.tree_util.tree_leaves((final, known))
            if again and not all(is_concrete(x) for x in leaves):
                step = custom_inverse(undo)
                step.definverse(redo)
                c0, xs_rec, per_iteration = step(final, known), [], None
            else:
                c0, (xs_rec, per_iteration) = _at_once(
                    ibody, final, per_t, ws, length, consts, ctx.walk.settings.values
                )
    except NotInvertibleError:
        if waiting:  # may work once the chain's start is known
            raise NeedMore("the start of a carry that the loop also emits is not known yet")
        raise
    if per_iteration is not None:
        signs, lds = per_iteration
        logdets[id(ctx.eqn)] = LogdetResult(jnp.prod(signs), jnp.sum(lds))
    elif logdets is not None:
        logdets.pop(id(ctx.eqn), None)
    res: list[Any] = [None] * len(ins)
    for i, c in zip(unk, c0):
        res[nc + i] = c
    it = iter(xs_rec)
    for j, kn in enumerate(xs_known):
        if not kn:
            res[nc + ncar + j] = next(it)
    return res


AT_ONCE_WORK = 8
"""How much more than the size of its unknown carries a loop's body must compute (`work_of`)
for its steps to be undone at once: the steps' `vmap` and the windows written back into the
final carry (`_owned_windows`; or, where a step's carry is not the final one with windows
written, a copy of the carries per step) pay where the steps share a costly computation (a
masked network), not where a step is a few scalar operations (NiLang's
``x[i] += tanh(x[i - 1])``, whose steps undone one by one cost O(1) each)."""


def _undone_at_once(
    sp: ScanParams,
    consts: Sequence[Any],
    unk: Sequence[int],
    known_idx: Sequence[int],
    xs_known: Sequence[bool],
    hints: Hints | None,
    ctx: RuleContext,
) -> dict[int, np.ndarray] | None:
    """Whether the loop's iterations can all be undone at once, each from the loop's final
    carry rather than from the carry the iterations after it left (masked autoregressive
    inverses: flowjax's MAF loop writes element `rank` from a network whose masks hide the
    elements later iterations write): where each unknown carry is written, in each iteration,
    only by scatters and dynamic updates at positions known when traced, no position by two
    iterations, and where what an iteration writes and emits reads nothing a later iteration
    writes. Decided by a dry run of the body forward on element-level knowledge (under
    `eval_shape`: nothing of it is emitted): each unknown carry known but for the positions
    later iterations write (a `PerIteration` region); the outputs must then be known but
    there. Returns, per unknown carry, the iteration writing each position (-1: none), or
    None."""
    T, nc, ncar = sp.length, sp.nconsts, sp.ncarry
    if T < 2 or not unk or hints is None or hints.length != T:
        return None
    closed = prepare(sp.body)
    bj = closed.jaxpr
    carried = sum(size_of([bj.invars[nc + i].aval]) for i in unk)
    if carried * T > Statics.MAX_SIZE or work_of(bj) < AT_ONCE_WORK * carried:
        return None
    writes = {}
    shown = Env(info=statics_for(bj, closed.consts, hints))
    for i in unk:
        w = _per_iteration_writes(bj, shown, nc + i, i, T)
        if w is None or (w.sum(axis=0) > 1).any():
            return None
        writes[i] = w
    found: dict[int, np.ndarray] = {}

    def dry() -> None:
        # (numpy: under a walk that folds constants, each `jnp.zeros` of a new shape was an
        # XLA program compiled while tracing)
        stand_ins = [np.zeros(v.aval.shape, v.aval.dtype) for v in bj.invars]
        ins = list(consts) + stand_ins[nc:]
        for i in unk:
            ins[nc + i] = Unknown(bj.invars[nc + i].aval)
        jaxpr, env, _ = seed(
            closed,
            ins,
            [Unknown(v.aval) for v in bj.outvars],
            hints,
            prepared=True,
            ctx=ctx.walk.replace(recorder=None),
        )
        later = {}
        for i, w in writes.items():
            # what the iterations that run after iteration t write
            none = np.zeros_like(w[:1])
            if sp.reverse:
                after = np.concatenate([none, np.cumsum(w, axis=0)[:-1] > 0])
            else:
                after = np.concatenate([(np.cumsum(w[::-1], axis=0)[::-1] > 0)[1:], none])
            later[i] = after
            v = jaxpr.invars[nc + i]
            if after.any():
                learn(
                    env,
                    v,
                    stand_ins[nc + i],
                    frozenset({frozenset({R.PerIteration(R.Mask.of(after))})}),
                )
            else:
                env.write(v, stand_ins[nc + i])
        propagate(jaxpr, env, None, forward_only=True)
        for i in unk:
            o = jaxpr.outvars[i]
            shape = tuple(o.aval.shape)
            unknown = R.iteration_masks(region_of(env, o), shape, T, env.info)
            if (unknown & ~later[i]).any():
                return
        for o in jaxpr.outvars[ncar:]:
            if region_of(env, o) != R.EMPTY:
                return
        for i, w in writes.items():
            writer = np.where(w.any(axis=0), np.argmax(w, axis=0), -1)
            found[i] = writer

    try:
        jax.eval_shape(dry)
    except Exception:  # noqa: BLE001 (whatever stops the dry run: the loop is undone one by one)
        return None
    return found if len(found) == len(unk) else None


def _per_iteration_writes(jaxpr: Any, env: Env, k: int, i: int, T: int) -> np.ndarray | None:
    """The positions of carry `i` (the body's input `k`) that each iteration may change, as a
    (T, *shape) boolean array: its output is its input written by a chain of scatters and
    dynamic updates whose positions are known when traced; None otherwise."""
    v, x = jaxpr.outvars[i], jaxpr.invars[k]
    shape = tuple(x.aval.shape)
    out = np.zeros((T, *shape), bool)
    producer = env.info.producer
    while v is not x:
        e = producer.get(v) if is_var(v) else None
        r = None if e is None else written_region(e, env)
        if r is None or tuple(e.invars[0].aval.shape) != shape:
            return None
        out |= R.iteration_masks(r, shape, T, env.info)
        v = e.invars[0]
    return out


def _at_once(
    ibody: Callable,
    final: list,
    per_t: tuple,
    writers: Sequence[np.ndarray],
    length: int,
    consts: Sequence[Any],
    values: bool = True,
) -> tuple:
    """The loop undone all at once (`_undone_at_once`): every iteration's body inverted from
    the final carry, under `vmap` over the iterations, and each position of the first carry
    taken from the iteration that writes it (the final carry's where none does). `ibody(carry,
    per-iteration values, settings, consts, windows)` inverts one iteration.

    The body's walk computes with the final carry's values where it knows nothing, rather
    than `elements.FILL` (`Settings.fill`): so what the iterations compute from the carry
    alone is the same at every iteration, and computed once (a masked network: the loop then
    costs what one pass of it costs). Those values are the loop's own, of the kind its
    iterations compute with where they do know the carry (the elements earlier iterations
    wrote), and reach a known result only through the zeros that hide them (a masked weight,
    a select's other case), which keep them out exactly where they are finite; a non-finite
    input makes every result non-finite, as the loop itself does.

    Where an iteration's carry is the final carry with windows written into it (by the
    walk: `elements.written_window`), the iteration hands back those windows alone, written
    into the final carry once at the end (`_owned_windows`): a copy of the carry per
    iteration is D x D values a sample for an autoregressive map of D elements, where its
    network's pass is D x width."""
    layouts: list = []  # per carry: its windows (`Win`s), or None (the whole carry)

    def every_iteration(final: list, per_t: tuple, consts: Sequence[Any]) -> tuple:
        def one(sl: Any) -> tuple:
            windows: dict = {}
            c_prev, rest = ibody(final, sl, {"fill": False}, consts, windows)
            outs = []
            layouts.clear()
            for c, f in zip(c_prev, final):
                chain = _window_chain(c, f, windows)
                layouts.append(None if chain is None else [e.w for e in chain])
                outs.append(
                    c if chain is None else [(e.starts, e.piece, e.in_bounds) for e in chain]
                )
            return outs, rest

        return jax.vmap(one, axis_size=length)(per_t)

    if not values:  # (a planning walk: its values are stand-ins nothing reads)
        _, (xs_rec, per_iteration) = every_iteration(final, per_t, consts)
        return list(final), (xs_rec, per_iteration)
    # (on concrete values, one compiled call: run eagerly, the vmapped walk compiled each of
    # its operations apart, hundreds of XLA compilations on a masked network's loop)
    stacked, (xs_rec, per_iteration) = compiled(
        None, every_iteration, list(final), per_t, list(consts)
    )
    c0 = []
    for c, st, writer, layout in zip(final, stacked, writers, layouts):
        if layout is None:
            taken = jnp.take_along_axis(st, np.maximum(writer, 0)[None], axis=0)[0]
            c0.append(jnp.where(writer >= 0, taken, c))
            continue
        for (starts, piece, in_bounds), w in zip(st, layout):
            c = _owned_windows(c, w, starts, piece, in_bounds, writer, length)
        c0.append(c)
    return c0, (xs_rec, per_iteration)


def _window_chain(value: Any, base: Any, windows: dict) -> list | None:
    """The windows (`elements.WindowWrite`s, first written first) that make `value` of `base`,
    or None where it is not `base` with windows written into it."""
    chain = []
    while value is not base:
        wrote = windows.get(id(value))
        if wrote is None or wrote.value is not value:
            return None
        chain.append(wrote)
        value = wrote.base
    return chain[::-1]


def _owned_windows(
    carry: Any,
    w: Any,
    starts: Sequence[Any],
    piece: Any,
    in_bounds: Any,
    writer: np.ndarray,
    length: int,
) -> Any:
    """`carry` with each iteration's window `w` (its corner `starts`, its values `piece`, over
    the iterations on the leading axis) written where that iteration is the one that writes
    the position (`writer`: the iteration writing each position, -1 none), as the carries
    stacked over the iterations are picked (`_at_once`); where the window was dropped for not
    fitting (`in_bounds` false), nothing. The positions go in one scatter, those of another
    iteration dropped: each is kept by one iteration at most."""
    shape, sizes = tuple(w.shape), tuple(w.sizes)
    # (a window is placed as the `dynamic_update_slice` primitive places it: its corner
    # clamped so that the window fits)
    corner = [
        jnp.clip(jnp.reshape(s, (length,)), 0, max(n - z, 0))
        for s, n, z in zip(starts, shape, sizes)
    ]
    offsets = np.indices(sizes).reshape(len(sizes), -1)
    pos = [c[:, None] + o[None, :] for c, o in zip(corner, offsets)]  # (iterations, elements)
    owned = jnp.asarray(writer)[tuple(pos)] == np.arange(length)[:, None]
    if in_bounds is not None:
        owned = owned & jnp.reshape(in_bounds, (length, 1))
    idx = tuple(jnp.where(owned, p, n).reshape(-1) for p, n in zip(pos, shape))
    vals = jnp.reshape(piece, (-1,)).astype(carry.dtype)
    return jnp.asarray(carry).at[idx].set(vals, mode="drop")


def _iteration_logdet(parent: Any, logdets: dict | None, eqn: Any, dtype: Any) -> Any:
    """One iteration's (sign, log|det|) of a loop inverted in a recorded walk that asks for
    log-dets (`logdets` not None), from the record its body's walk just filed under `eqn`
    and that walk's values; None where not asked or where the record has no plan (the
    log-det is then `_scan_logdet`'s, by a forward run)."""
    if logdets is None:
        return None
    child = parent.children.get(id(eqn))
    if child is None:
        return None
    try:
        body_plan = logdet_plan(child, child.seeded, child.goals)
        return evaluate_plan(
            body_plan, env_reader(child.env), dtype, permutation=False, done=child.logdets
        )
    except (Unsupported, KeyError):
        return None


def _forward_carries(
    bj: Any,
    nc: int,
    init_known: Sequence[bool],
    xs_known: Sequence[bool],
    consts_known: Sequence[bool] | None = None,
) -> list[bool]:
    """Which carries are computable forward from known values at every iteration (the loop
    counter of a fori_loop): a fixed point, since a carry may need another."""
    K = list(init_known)
    ck = [True] * nc if consts_known is None else list(consts_known)
    while True:
        fk = forward_known(bj, ck + K + list(xs_known))
        newK = [k and fk[i] for i, k in enumerate(K)]
        if newK == K:
            return K
        K = newK


def _body_inputs(
    sp: ScanParams,
    consts: Sequence[Any],
    xs_known: Sequence[bool],
    kidx: Sequence[int],
    kin_t: Sequence[Any],
    xs_t: Sequence[Any],
) -> list:
    """The body's inputs at one iteration: the consts, the known carries `kidx` (values
    `kin_t`), the known xs (`xs_t`), and `Unknown` elsewhere."""
    nc, ncar = sp.nconsts, sp.ncarry
    ins_t = list(consts) + [Unknown(v.aval) for v in sp.body.jaxpr.invars[nc:]]
    for i, c in zip(kidx, kin_t):
        ins_t[nc + i] = c
    it = iter(xs_t)
    for j, kn in enumerate(xs_known):
        if kn:
            ins_t[nc + ncar + j] = next(it)
    return ins_t


def _run_forward_carries(
    sp: ScanParams,
    consts: Sequence[Any],
    init: Sequence[Any],
    xs: Sequence[Any],
    idx: Sequence[int],
) -> tuple[list, list]:
    """Run the carries `idx` (all computable from known values) through the loop: their final
    values and their value at the start of every iteration. Unknown xs are `Unknown`."""
    body = sp.body
    bj = body.jaxpr
    xs_known = [not is_unknown(x) for x in xs]

    def kbody(ck, xs_t):
        ins_t = _body_inputs(sp, consts, xs_known, idx, ck, xs_t)
        jaxpr, env, _ = seed(body, ins_t, [Unknown(v.aval) for v in bj.outvars], ctx=None)
        # only what the carries need: the loop's other constants (weights) stay out of it
        need = needed_vars(jaxpr, [jaxpr.outvars[i] for i in idx])
        evaluate(jaxpr.eqns, env, partial=True, used=need)
        return [env.read(jaxpr.outvars[i]) for i in idx], list(ck)

    final, per_iteration = lax.scan(
        kbody,
        [init[i] for i in idx],
        [x for x in xs if not is_unknown(x)],
        length=sp.length,
        reverse=sp.reverse,
    )
    return list(final), list(per_iteration)


def loop_hints(
    sp: ScanParams, static_of: Callable[[int], Any], support_of: Callable[[int], Any]
) -> Hints | None:
    """What the loop's body knows when it is traced (`static_of(k)`: the static value of the
    scan's operand k, or None; `support_of(k)`: where it may be nonzero, or None): its static
    constants, the zeros of the others (a masked weight of a layer, in flowjax's scan over
    stacked layers), and the value at every iteration of the carries computed from static
    values alone (a `fori_loop`'s counter) and of static `xs`. Element-level reasoning decides
    with them whether ``x[i - 1]`` and ``x.at[i]`` meet."""
    nc, ncar, T = sp.nconsts, sp.ncarry, sp.length
    bj = sp.body.jaxpr
    nx = len(bj.invars) - nc - ncar
    st = [static_of(k) for k in range(nc + ncar + nx)]
    hints = Hints(length=T)
    for k in range(nc):
        if st[k] is not None:
            hints.static[k] = st[k]
        else:
            support = support_of(k)
            if support is not None and not np.all(support):
                hints.support[k] = support
    for j in range(nx):
        if st[nc + ncar + j] is not None:
            hints.enum[nc + ncar + j] = st[nc + ncar + j]
    K = _forward_carries(
        bj,
        nc,
        [s is not None for s in st[nc : nc + ncar]],
        [s is not None for s in st[nc + ncar :]],
        [s is not None for s in st[:nc]],
    )
    idx = [
        i
        for i in range(ncar)
        if K[i] and T * max(1, size_of([bj.invars[nc + i].aval])) <= Statics.MAX_SIZE
    ]
    if idx and T > 0:

        def op(k: int) -> Any:
            return st[k] if st[k] is not None else Unknown(bj.invars[k].aval)

        try:
            with jax.ensure_compile_time_eval():
                _, per = _run_forward_carries(
                    sp,
                    [op(k) for k in range(nc)],
                    [op(nc + i) for i in range(ncar)],
                    [op(nc + ncar + j) for j in range(nx)],
                    idx,
                )
            for i, val in zip(idx, per):
                hints.enum[nc + i] = np.asarray(val)
        except (
            KeyError,
            jax.errors.ConcretizationTypeError,
            jax.errors.TracerArrayConversionError,
        ):
            pass  # a carry computed from values known only when the program runs
    return hints if hints.static or hints.enum or hints.support else None


def _emitted_carries(bj: Any, ncar: int, length: int, ys: Sequence[Any]) -> dict[int, int]:
    """Carry i -> output j for carries the body also emits per iteration (a body returning
    ``(x, x)``) whose per-iteration outputs are known."""
    out: dict[int, int] = {}
    if length == 0:
        return out
    for i in range(ncar):
        if not isinstance(bj.outvars[i], Var):
            continue
        for j, y in enumerate(ys):
            if not is_unknown(y) and bj.outvars[ncar + j] is bj.outvars[i]:
                out[i] = j
                break
    return out


# --------------------------------------------------------------------------- sweep


def _scan_sweep(P: Plan, i: int, env: Env, ctenv: dict | None, active: set, res: Residuals) -> None:
    e = P.closed.jaxpr.eqns[i]
    sp = scan_info(e.params)
    nc, ncar, body, length, rev = sp.nconsts, sp.ncarry, sp.body, sp.length, sp.reverse
    ins = e.invars
    consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]
    # constants the equations before the loop do not give back may follow from the loop's own
    # outputs (a loop of fixed-point iterations solved by Newton's method as a group)
    known_or_rebuilt(P, i, env, consts, res, through=True)
    unk = [v for v in xs if is_var(v) and not env.known(v)]
    if unk:  # xs computable forward from what is known; the rest the body rebuilds
        propagate(Window(P.closed.jaxpr.eqns[:i]), env, unk, forward_only=True)
    xk = tuple(env.known(v) for v in xs)
    cout, ys = e.outvars[:ncar], e.outvars[ncar:]
    _discarded_counters(sp, env, consts, init, xs, cout)
    outs_known(P, i, env, cout, res)
    yk = tuple(env.known(v) for v in ys)
    hints = loop_hints(sp, lambda k: env.info.static(ins[k]), lambda k: env.info.support(ins[k]))
    bp = plan_for(
        body,
        (True,) * nc + (False,) * ncar + xk,
        (True,) * ncar + yk,
        (False,) * nc + (True,) * ncar + tuple(not k for k in xk),
        hints,
        P.dial.inner(length),
    )
    carry = tuple(sds(v.aval) for v in cout)
    carry_bytes = bytes_of(carry)
    site = user_source(e)[2]
    where = f" at {site}" if site else ""  # (named by a budget that cannot be met)
    K = P.dial.segment(length, carry_bytes, where=where)
    # where the constants' cotangents outweigh a quarter of a segment's work, they are
    # accumulated in place (a share summed from zero per segment would cost their size per
    # segment), and the segments made long enough for their fixed cost (`dial.SEGMENT_WORK`)
    work = max(1, work_of(body.jaxpr))
    floating = [v.aval for v in consts if jnp.issubdtype(v.aval.dtype, jnp.inexact)]
    large_consts = K is not None and 4 * size_of(floating) >= K * work
    if large_consts:
        K = P.dial.segment(length, carry_bytes, work, where)
    # an accumulator's value is read by nothing the backward run computes: it is stored once
    # (its start), its drift moves no gradient and goes unchecked, and XLA drops what
    # computes it
    unread = tuple(unread_carries(bp.closed.jaxpr, nc, ncar, bp.store)) if K else ()
    lp = LoopPlan("scan", bp, length, every=K, carry=carry if K else (), unread=unread)
    lres = res.loop(i, lp) if res_avals(bp) or K else []
    nb = len(res_avals(bp))
    lres, ckpts = list(lres[:nb]), list(lres[nb:])
    want = ctenv is not None
    act = loop_activity(ins, active, nc, ncar, body) if want else None
    ys_ct = [ctenv.pop(v, None) if want and is_var(v) else None for v in ys]
    yct = [c is not None for c in ys_ct]
    step = BodyWalk(bp, nc, ncar, xk, yk, [env.read(v) for v in consts], act, yct, env.ctx)
    c0 = [env.read(v) for v in cout]
    c_ct0, k_ct0 = loop_cts_in(ctenv, cout, body, nc, act)

    def bstep(carry, sl):
        c, c_ct, k_ct, w = carry
        ys_t, ys_ct_t, xs_t, res_t = sl
        s = step(c, c_ct, ys_t, ys_ct_t, xs_t, res_t)
        if want:
            k_ct = [a + b for a, b in zip(k_ct, s.consts_ct)]
        return (s.carry, s.carry_ct, k_ct, drift.combine(w, s.drift)), (s.xs, s.xs_ct)

    sl = (
        [env.read(v) for v, k in zip(ys, yk) if k],
        [c for c in ys_ct if c is not None],
        [env.read(v) for v, k in zip(xs, xk) if k],
        list(lres),
    )
    w0 = drift.no_drift()
    if K is None:
        (c_first, c_first_ct, k_ct, w), (x_rec, x_ct) = lax.scan(
            bstep, (c0, c_ct0, k_ct0, w0), sl, length=length, reverse=not rev
        )
    else:
        compared = [not u for u in unread]
        # the body as the walks see it (calls inlined: a custom_jvp closing over the loop's
        # counter is not re-entered under the repair's VJP)
        check, redo = segment_checks(
            P.dial,
            env.ctx.drift,
            e,
            carry,
            bp.closed,
            nc,
            ncar,
            [env.read(v) for v in consts],
            act,
            yct,
            all(xk),
            res.planning,
            compared,
            P.dial.sub_segment(length, K, carry_bytes),
        )
        (c_first, c_first_ct, k_ct, w), (x_rec, x_ct), tally = segmented(
            bstep,
            (c0, c_ct0, k_ct0, w0),
            sl,
            length,
            K,
            ckpts,
            rev,
            check,
            redo,
            compared,
            in_place=large_consts,
        )
        drift.tally(env.ctx.drift, e, length, K, *tally)
    drift.note(env.ctx.drift, w)
    loop_cts_out(env, ctenv, LoopEnd(init, c_first, c_first_ct, consts, k_ct), act, nc)
    for v, val in zip([v for v, k in zip(xs, xk) if not k], x_rec):
        env.write(v, val)
    if want:
        for v, g in zip([v for v, a in zip(xs, act[nc + ncar :]) if a], x_ct):
            acc(ctenv, v, g)


def _discarded_counters(
    sp: ScanParams,
    env: Env,
    consts: Sequence[Any],
    init: Sequence[Any],
    xs: Sequence[Any],
    cout: Sequence[Any],
) -> None:
    """Final carries the output discards but known values compute (a fori_loop's counter):
    run forward instead of stored."""
    missing = [i for i, v in enumerate(cout) if is_var(v) and not env.known(v)]
    if not missing or not all(env.known(v) for v in consts):
        return
    vals = [env.read(v) if env.known(v) else Unknown(v.aval) for v in [*init, *xs]]
    init_v, xs_v = vals[: sp.ncarry], vals[sp.ncarry :]
    K = _forward_carries(
        sp.body.jaxpr,
        sp.nconsts,
        [not is_unknown(c) for c in init_v],
        [not is_unknown(x) for x in xs_v],
    )
    idx = [i for i in range(sp.ncarry) if K[i]]
    if not any(K[i] for i in missing):
        return
    final, _ = _run_forward_carries(sp, [env.read(v) for v in consts], init_v, xs_v, idx)
    for i, val in zip(idx, final):
        if i in missing:
            env.write(cout[i], val)


# --------------------------------------------------------------------------- forward


def _scan_forward(e: JaxprEqn, lp: LoopPlan, ins: Sequence[Any]) -> tuple[list, list]:
    sp = scan_info(e.params)
    nc, ncar = sp.nconsts, sp.ncarry
    consts, init, xs = ins[:nc], ins[nc : nc + ncar], ins[nc + ncar :]

    def f(c, x):
        outs, r = forward_with_residuals(lp.body, [*consts, *c, *x])
        return outs[:ncar], (outs[ncar:], r)

    if lp.every is not None:
        c, (ys, r), ck = segmented_forward(
            f, init, list(xs), sp.length, lp.every, sp.reverse, lp.unread
        )
        return [*c, *ys], [*r, *ck]
    c, (ys, r) = lax.scan(f, list(init), list(xs), length=sp.length, reverse=sp.reverse)
    return [*c, *ys], list(r)


def _scan_logdet(ctx: LogdetContext) -> LogdetResult:
    """Σ over iterations of the body's log-determinant, from a forward run of the loop over
    the recovered inputs (the body's record says how each iteration inverts); the run's
    outputs come back with it (`LogdetResult.outs`), where the walked body has the loop's
    outputs, so that `forward_and_slogdet` runs the loop once."""
    pl = ctx.child
    if pl is None:
        raise Unsupported("the loop's body was not inverted by a walk the record holds")
    sp = scan_info(ctx.eqn.params)
    nc, ncar = sp.nconsts, sp.ncarry
    jaxpr = pl.recorder.jaxpr
    benv0 = pl.recorder.env
    bconsts = [benv0.read(v) for v in jaxpr.constvars]
    if not all(is_concrete(c) for c in bconsts):
        raise Unsupported("the loop body's constants are not known when it is traced")
    consts = ctx.invals[:nc]
    init = ctx.invals[nc : nc + ncar]
    xs = ctx.invals[nc + ncar :]
    dtype = ctx.dtype

    def body(carry, x_t):
        c, sign, la = carry
        env = Env(info=statics_for(jaxpr, bconsts, pl.recorder.hints))
        for v, a in zip(jaxpr.constvars, bconsts):
            env.write(v, a)
        for v, a in zip(jaxpr.invars, [*consts, *c, *x_t]):
            env.write(v, a)
        # (a loop inside, the layer's own loop in a scan of layers, runs once: its outputs
        # come from its log-det rule)
        done = run_forward(pl, jaxpr.eqns, env)
        s, ld = evaluate_plan(pl, env.read, dtype, permutation=False, done=done)
        c2 = [
            env.read(v) if not isinstance(v, Literal) else jnp.asarray(v.val)
            for v in jaxpr.outvars[:ncar]
        ]
        c2 = [jnp.asarray(a, o.dtype) for a, o in zip(c2, c)]
        ys = [env.read(v) for v in jaxpr.outvars[ncar:]] if whole else []
        return (c2, sign * s, la + ld), ys

    # (the walked body's outputs are the loop's: its ys come back with its final carry)
    body_avals = [(tuple(v.aval.shape), v.aval.dtype) for v in jaxpr.outvars]
    loop_avals = [(tuple(a.shape), a.dtype) for a in ctx.eqn.params["jaxpr"].out_avals]
    whole = body_avals == loop_avals
    (final, sign, la), ys = lax.scan(
        body,
        (list(init), jnp.ones((), dtype), jnp.zeros((), dtype)),
        list(xs),
        length=sp.length,
        reverse=sp.reverse,
    )
    return LogdetResult(sign, la, [*final, *ys] if whole else None)


_scan_logdet.gives_outputs = True  # (it reads no output of the loop: `logdet.rule_steps`)


define(
    prims.scan,
    inverse=_scan_inverse,
    sweep=_scan_sweep,
    forward=_scan_forward,
    logdet=_scan_logdet,
    # (a loop that computes element by element, on operands known on some elements)
    element=ElementRule(per_element_forward),
    walks=True,
)
