"""Drift repaired by default (issue 29, docs/design.md §3.8): the programs the issue measured.

- Gradients as accurate as jax.grad's raise nothing by default (float64 and float32).
- The two silent wrong answers of the old check (a fixed-point iteration whose rebuilt
  iterates turn NaN, a state that expands then contracts) come back right by default, and
  `on_drift="raise"` names the loop's line.
- bfloat16 runs the check (its tolerance used NumPy's finfo, which has no bfloat16).
References: jax.grad in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from jax import lax
from programs.momentum import momentum_sgd

import jaxrev as jr
from tests.programs import marker_line

jax.config.update("jax_enable_x64", True)


def cast(t, dt):
    return jax.tree_util.tree_map(lambda a: jnp.asarray(a, dt), t)


# ---------------------------------------------------------------- the silent cases


def fixed_point(x, p):
    return lax.fori_loop(0, 20, lambda j, y: x + 0.1 * jnp.tanh(p * y), x)  # <FIXED-POINT>


def expand_contract(s, th):
    def up(i, s):
        x, y = s
        return x + 1e-3 * jnp.sin(y / 2 + th), 2 * y - th

    def down(i, s):
        x, y = s
        return x + 1e-3 * jnp.sin(y / 2 + th), y / 2 + th

    return lax.fori_loop(0, 54, down, lax.fori_loop(0, 54, up, s))  # <EXPAND-CONTRACT>


def fp_loss(f):
    return lambda x, p: jnp.sum(jnp.sin(f(x, p)))


def ec_loss(f):
    return lambda s, th: jnp.sum(f(s, th)[0] ** 2) + jnp.sum(jnp.cos(f(s, th)[1]))


@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_fixed_point_iteration_is_right_by_default(dtype):
    """Once the iteration converges to rounding its backward run turns NaN inside the loop
    (the rebuilt inputs were still right, so the old check passed): the default recomputes
    the segments whose cotangents came back non-finite."""
    x, p = cast(jnp.linspace(-1.0, 1.0, 16), dtype), cast(jnp.asarray(3.0), dtype)
    ref = jax.grad(fp_loss(fixed_point), (0, 1))(x, p)
    tol = 1e-12 if dtype == jnp.float64 else 1e-5
    for g in (
        jax.grad(fp_loss(jr.reversible(fixed_point)), (0, 1)),
        jax.jit(jax.grad(fp_loss(jr.reversible(fixed_point)), (0, 1))),
    ):
        got = g(x, p)
        assert all(np.all(np.isfinite(a)) for a in got)
        assert rel_error(got, ref) < tol


def test_fixed_point_strict_mode_names_the_loop():
    x, p = jnp.linspace(-1.0, 1.0, 16), jnp.asarray(3.0)
    g = jax.grad(fp_loss(jr.reversible(fixed_point, on_drift="raise")), (0, 1))
    with pytest.raises(jr.DriftError) as ei:
        g(x, p)
    assert f"test_drift_repair.py:{marker_line(__file__, 'FIXED-POINT')}" in str(ei.value)


def test_expand_contract_is_right_by_default():
    """A state that expands for 54 steps and contracts for 54: the drift is gone by the
    call's inputs; every segment's start is checked, and the gradient is jax.grad's."""
    s = (jnp.linspace(0.0, 1.0, 8), 0.3 + 1e-15 * jnp.linspace(-1.0, 1.0, 8))  # y near θ
    th = jnp.asarray(0.3)
    ref = jax.grad(ec_loss(expand_contract), (0, 1))(s, th)
    got = jax.jit(jax.grad(ec_loss(jr.reversible(expand_contract)), (0, 1)))(s, th)
    assert rel_error(got, ref) < 1e-10
    # the old behaviour, fully reversible: 0.85 % off
    full = jax.grad(
        ec_loss(jr.reversible(expand_contract, checkpoint_every=None, on_drift="ignore")), (0, 1)
    )(s, th)
    assert rel_error(full, ref) > 1e-6


def test_expand_contract_strict_mode_names_the_loop():
    """on_drift="raise": the contracting loop's segments are compared with their checkpoints
    (with one segment per loop, its start with the expanding loop's end, where the old check
    compared nothing: its gradient is 37 % off), and the error is caught as `jr.DriftError`
    under `jr.jit`. With "auto" checkpoints (segments of 8) the gradient is jax.grad's to
    2e-15 and nothing is raised: that was a false alarm at GRAD_SLACK = 1. (y starts within
    1e-15 of the expansion's fixed point θ: further out, y reaches 2^54 and the gradient
    itself reads rounding, jax.grad's as much as this one.)"""
    s = (jnp.linspace(0.0, 1.0, 8), 0.3 + 1e-15 * jnp.linspace(-1.0, 1.0, 8))  # y near θ
    th = jnp.asarray(0.3)
    strict = lambda every: jax.grad(  # noqa: E731
        ec_loss(jr.reversible(expand_contract, on_drift="raise", checkpoint_every=every)), (0, 1)
    )
    line = f"test_drift_repair.py:{marker_line(__file__, 'EXPAND-CONTRACT')}"
    for call in (strict(54), jr.jit(strict(54))):
        with pytest.raises(jr.DriftError) as ei:
            call(s, th)
        assert line in str(ei.value)
    ref = jax.grad(ec_loss(expand_contract), (0, 1))(s, th)
    assert rel_error(strict("auto")(s, th), ref) < 1e-13


def test_fixed_point_strict_mode_under_jit():
    x, p = jnp.linspace(-1.0, 1.0, 16), jnp.asarray(3.0)
    g = jr.jit(jax.grad(fp_loss(jr.reversible(fixed_point, on_drift="raise")), (0, 1)))
    with pytest.raises(jr.DriftError) as ei:
        g(x, p)
    assert f"test_drift_repair.py:{marker_line(__file__, 'FIXED-POINT')}" in str(ei.value)


# ---------------------------------------------------------------- no false alarms


def coupled(T):
    def f(c, th):
        def body(i, c):
            x, y = c
            x = x + jnp.tanh(th[0] * y)
            return x, y + jnp.sin(th[1] * x)

        return lax.fori_loop(0, T, body, c)

    return f


def c_loss(f):
    return lambda c, th: jnp.sum(f(c, th)[0] ** 2) + jnp.sum(f(c, th)[1])


def test_headline_family_default_raises_nothing():
    """The coupled scan at the headline's theta (its gradient itself sensitive: drift is
    harmless there and nothing is recomputed) and a chaotic start (drift is not: repaired)."""
    th = jnp.array([0.9, 1.1])
    for c in [
        (jnp.linspace(0.0, 1.0, 64), jnp.linspace(1.0, 2.0, 64)),
        (
            jax.random.normal(jax.random.PRNGKey(0), (64,)),
            jax.random.normal(jax.random.PRNGKey(1), (64,)),
        ),
    ]:
        ref = jax.grad(c_loss(coupled(1000)), (0, 1))(c, th)
        got = jax.jit(jax.grad(c_loss(jr.reversible(coupled(1000))), (0, 1)))(c, th)
        sens = rel_error(
            jax.grad(c_loss(coupled(1000)), (0, 1))(c, th.at[0].set(jnp.nextafter(th[0], 2.0))), ref
        )
        assert rel_error(got, ref) <= 10 * max(sens, 1e-15), (rel_error(got, ref), sens)


def test_float32_default_as_accurate_as_jax_grad():
    """A float32 200-step coupled scan: the default's error against float64 jax.grad is
    within 2x float32 jax.grad's own."""
    c = (jnp.linspace(0.0, 1.0, 32), jnp.linspace(1.0, 2.0, 32))
    th = jnp.array([0.9, 1.1])
    ref = jax.grad(c_loss(coupled(200)), (0, 1))(c, th)
    c32, th32 = cast(c, jnp.float32), cast(th, jnp.float32)
    e_jax = rel_error(jax.grad(c_loss(coupled(200)), (0, 1))(c32, th32), ref)
    got = jax.jit(jax.grad(c_loss(jr.reversible(coupled(200))), (0, 1)))(c32, th32)
    assert rel_error(got, ref) <= 2 * e_jax + 1e-6


def anharmonic_chain(steps, dt=0.01):
    """A leapfrog of 10 masses with quartic springs; its spring constant a parameter."""

    def run(qp, k):
        def force(q):
            zero = jnp.zeros(1, q.dtype)
            d = jnp.diff(jnp.concatenate([zero, q, zero]))
            return jnp.diff(k * d + 0.5 * d**3)

        def step(c, _):
            q, p = c
            p = p + 0.5 * dt * force(q)
            q = q + dt * p
            return (q, p + 0.5 * dt * force(q)), None

        return lax.scan(step, qp, None, length=steps)[0]

    return run


def chain_loss(f):
    return lambda qp, k: sum(jnp.sum(v**2) for v in f(qp, k))


def test_float32_long_leapfrog_as_accurate_as_jax_grad():
    """Issue 43 item 6: a 10^4-step float32 leapfrog, the gradient in its spring constant
    against float64 jax.grad. The constant's cotangent is a sum of 10^4 per-step terms:
    summed sequentially in float32 it loses 2e-6 (jax.grad's error here, 3.5e-6), and the
    default summed it across its segments the same way (8.2e-6, 2.3x). Each segment's share
    is now summed from zero and added to the total (4.8e-6, 1.35x)."""
    f = anharmonic_chain(10_000)
    qp = (jnp.asarray(np.random.default_rng(0).normal(size=10) * 0.5), jnp.zeros(10))
    k = jnp.asarray(1.3)
    ref = jax.grad(chain_loss(f), 1)(qp, k)
    qp32, k32 = cast(qp, jnp.float32), k.astype(jnp.float32)
    e_jax = rel_error(jax.jit(jax.grad(chain_loss(f), 1))(qp32, k32), ref)
    got = jax.jit(jax.grad(chain_loss(jr.reversible(f, argnums=0)), 1))(qp32, k32)
    assert rel_error(got, ref) <= 2 * e_jax, (rel_error(got, ref), e_jax)


def test_constants_cotangent_summed_in_two_levels():
    """x += c * w over 10^4 float32 steps, w = 1 + 2^-12: dc = 10^4 w. Summed term by term,
    the total passes 4096, where float32's spacing is 2^-11 and each addition rounds w's
    2^-12 away (a loss of about 1.5e-4, as the fully reversible sweep's one pass sums it);
    the default sums each segment's share from zero (about 100, where w's bits fit) and then
    the shares, exactly here."""
    w = jnp.full(10_000, 1 + 2.0**-12, jnp.float32)

    def f(x, c):
        return lax.scan(lambda x, w_t: (x + c * w_t, None), x, w)[0]

    x, c = jnp.ones(1, jnp.float32), jnp.float32(0.25)
    want = 10_000 * (1 + 2.0**-12)
    loss = lambda f: lambda x, c: jnp.sum(f(x, c))
    one_pass = jr.reversible(f, argnums=0, checkpoint_every=None, on_drift="ignore")
    e_one_pass = abs(float(jax.grad(loss(one_pass), 1)(x, c)) - want) / want
    e_default = abs(float(jax.grad(loss(jr.reversible(f, argnums=0)), 1)(x, c)) - want) / want
    assert e_one_pass > 1e-5 and e_default < 1e-7, (e_one_pass, e_default)


@pytest.mark.parametrize("beta", [0.5, 0.1])
def test_momentum_hypergradient_default(beta):
    """SGD with momentum run backwards divides by the momentum each step (drift inf before):
    the default repairs every segment and returns jax.grad's hypergradient."""

    sgd = momentum_sgd(200)
    train = lambda wv, hp: sgd(wv, hp, beta)  # noqa: E731
    wv = (jnp.linspace(-1.0, 1.0, 8), jnp.zeros(8))
    L = lambda f: lambda hp: jnp.sum(f(wv, hp)[0] ** 2)  # noqa: E731
    ref = jax.grad(L(train))(0.05)
    got = jax.jit(jax.grad(L(jr.reversible(train))))(0.05)
    assert abs(got - ref) <= 1e-10 * abs(ref)


# ---------------------------------------------------------------- what a call repaired


def test_report_says_what_each_call_repaired():
    """`report=` (issue 43 item 5): momentum SGD at 0.5 drifts (every segment after the
    first miss is recomputed), the leapfrog chain does not (nothing recomputed); the report
    comes eagerly, under jit when the program runs (once per run) and under vmap (a count per
    sample), and the gradient is the same as without it."""
    seen = []
    wv = (jnp.linspace(-1.0, 1.0, 8), jnp.zeros(8))
    sgd = momentum_sgd(400)

    def train(wv, hp):  # (the report names the loop's function)
        return sgd(wv, hp, 0.5)

    L = lambda f: lambda hp: jnp.sum(f(wv, hp)[0] ** 2)  # noqa: E731
    plain = jax.grad(L(jr.reversible(train)))(0.05)
    reported = jr.reversible(train, report=seen.append)
    got = jax.grad(L(reported))(0.05)
    assert float(got) == float(plain) and len(seen) == 1
    (loop,) = seen[0].loops
    assert seen[0].function == "train" and "programs/momentum.py" in loop.where
    assert (loop.iterations, loop.segment_length, loop.segments) == (400, 20, 20)
    assert 10 <= int(loop.repaired) <= 20 and int(loop.recomputed) == 20 * int(loop.repaired)
    jitted = jax.jit(jax.grad(L(reported)))
    for _ in range(2):
        jax.block_until_ready(jitted(0.05))
    assert len(seen) == 3 and int(seen[-1].loops[0].repaired) == int(loop.repaired)
    batched = jax.vmap(jax.grad(L(reported)))(jnp.array([0.05, 0.02]))
    assert bool(jnp.all(jnp.isfinite(batched))) and len(seen) >= 4

    chain = anharmonic_chain(2000)
    qp = (jnp.linspace(-0.3, 0.3, 10), jnp.zeros(10))
    clean = jr.reversible(chain, argnums=0, report=seen.append)
    jax.grad(chain_loss(clean), 1)(qp, jnp.asarray(1.3))
    assert int(seen[-1].loops[0].repaired) == 0 and int(seen[-1].loops[0].recomputed) == 0


def test_report_refuses_what_it_cannot_report():
    with pytest.raises(TypeError, match="report must be a callable"):
        jr.reversible(lambda x: x, report="stats")
    with pytest.raises(ValueError, match="on_drift='ignore' checks and repairs nothing"):
        jr.reversible(lambda x: x, report=print, on_drift="ignore")


# ---------------------------------------------------------------- bfloat16


def test_bfloat16_runs_the_check():
    """A bfloat16 loop: the check runs (it raised inside NumPy's finfo before) and the
    gradient is as close to the float32 reference as bfloat16 jax.grad's."""

    def f(c, w):
        def body(i, c):
            x, y = c
            x = x + jnp.tanh(w.astype(x.dtype) * y)
            return x, y + jnp.sin(x)

        return lax.fori_loop(0, 16, body, c)

    c = (jnp.linspace(0.0, 1.0, 8), jnp.linspace(1.0, 2.0, 8))
    w = jnp.float32(0.5)
    L = lambda f: lambda c, w: jnp.sum(f(c, w)[0].astype(jnp.float32))  # noqa: E731
    ref = jax.grad(L(f), 1)(cast(c, jnp.float32), w)
    cb = cast(c, jnp.bfloat16)
    e_jax = abs(float(jax.grad(L(f), 1)(cb, w)) - float(ref))
    got = jax.jit(jax.grad(L(jr.reversible(f)), 1))(cb, w)
    assert got.dtype == jnp.float32
    assert abs(float(got) - float(ref)) <= 2 * e_jax + 0.02 * abs(float(ref))


def test_hypergradients_example_runs(capsys):
    """examples/hypergradients.py at 300 steps: the default's and exact reversal's
    hypergradients are jax.grad's."""
    import importlib.util
    import os
    import re

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hypergradients.py"
    )
    spec = importlib.util.spec_from_file_location("hypergradients", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--steps", "300", "--dtype", "float64", "--momentum", "0.5"])
    out = capsys.readouterr().out
    for name in ("jr.reversible", "exact=True"):
        errs = [float(e) for e in re.findall(rf"{name} .*error vs float64 jax.grad (\S+)", out)]
        assert errs and errs[0] < 1e-10, out


@pytest.mark.slow
def test_unrolled_bfloat16_revnet_inputs_tolerance():
    """64 unrolled bfloat16 coupling blocks (float32 master weights): nothing to repair from,
    so the rebuilt inputs are held to √eps or the roundoffs of the program's steps, at most
    1/2. Branch gain 0.75: drift 0.29, gradient 1.9x jax.grad's error against the float32
    model: no error. Gain 1.0: drift 2.75, 3.1x: DriftError."""
    import tests.test_mixed_precision as tm

    f16, f32 = tm._revnet(jnp.bfloat16), tm._revnet(jnp.float32)
    x16, x32 = tm._streams(jnp.bfloat16), tm._streams(jnp.float32)

    def weights(gain):
        return [[w * (gain / tm.GAIN) for w in blk] for blk in tm._master_weights(64)]

    e_grad, e_rev = tm._accuracy(f16, f32, weights(0.75), x16, x32)
    assert e_rev <= 2 * e_grad + tm.BF16_SLACK
    g = jr.jit(jax.grad(tm._loss(jr.reversible(f16)), argnums=(0, 1)))
    with pytest.raises(jr.DriftError):
        g(weights(1.0), x16)


@pytest.mark.parametrize("reverse", [False, True])
def test_checkpointed_scan_over_stacked_weights_copies_nothing_of_their_size(reverse):
    """A default (checkpointed, repairing) scan over a stack of weights reads each block's
    slice and writes its gradient in place: scratch does not grow by copies of the stack
    (reversed, split into segments, concatenated, or passed through the repair's cond). The
    lengths, primes, leave a first segment shorter than the rest (23 % 5, 71 % 9)."""

    def stack(c, W):
        return lax.scan(lambda c, w: (c + jnp.tanh(c @ w), None), c, W, reverse=reverse)[0]

    def scratch(T):
        W = 0.01 * jnp.ones((T, 64, 64))
        c = jnp.ones((4, 64))
        g = jax.grad(lambda c, W: jnp.sum(jr.reversible(stack)(c, W) ** 2), argnums=(0, 1))
        return jax.jit(g).lower(c, W).compile().memory_analysis().temp_size_in_bytes

    block = 64 * 64 * 8
    # before: 270 KB more at T=64 than at T=16; a copy of the 50 extra blocks is 1.6 MB
    assert scratch(71) - scratch(23) < 0.1 * 48 * block
    W = 0.3 * jnp.asarray(np.random.default_rng(0).standard_normal((23, 8, 8))) / 8
    c = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8)))
    L = lambda f: lambda c, W: jnp.sum(jnp.sin(f(c, W)))
    assert (
        rel_error(
            jax.grad(L(stack), argnums=(0, 1))(c, W),
            jax.grad(L(jr.reversible(stack)), argnums=(0, 1))(c, W),
        )
        < 1e-10
    )


@pytest.mark.parametrize(
    "length, K",
    [(48, 8), (2000, 50), (1000, 25), (47, 7), (10_000, 100)],
)
def test_auto_segments_divide_the_loop_where_a_length_near_the_root_does(length, K):
    """ "auto" takes a segment length within a quarter of its choice that divides the loop
    (48 blocks: 8, not ⌈√48⌉ = 7), so the runs have no shorter first segment, a second copy
    of their segment loops; a prime length keeps ⌈√T⌉. Checked through the report of a call."""
    reports = []

    def loop(x):
        return lax.fori_loop(0, length, lambda i, x: x + 1e-3 * jnp.sin(x), x)

    jax.grad(lambda x: jnp.sum(jr.reversible(loop, report=reports.append)(x)))(jnp.ones(3))
    (repair,) = reports[0].loops
    assert (repair.iterations, repair.segment_length) == (length, K)
    assert repair.segments == -(-length // K)


def test_a_while_loop_inside_a_custom_jvp_leaves_a_body_recomputable():
    """A segment is recomputed through JAX's VJP of the body, which a bare `while_loop`
    refuses but one inside a `custom_jvp` (a root-finder differentiated implicitly, as
    flowjax's bisection is) passes: only the bare one keeps its loop from recomputation."""
    from jaxrev.transforms.sweep.dial import recomputable

    @jax.custom_jvp
    def cbrt(y):
        step = lambda z: z - (z**3 - y) / (3 * z**2)  # noqa: E731
        return lax.while_loop(lambda z: jnp.abs(z**3 - y) > 1e-12, step, jnp.maximum(y, 1.0))

    @cbrt.defjvp
    def _(primals, tangents):
        z = cbrt(primals[0])
        return z, tangents[0] / (3 * z**2)

    implicit = jax.make_jaxpr(lambda c: cbrt(c) + 1.0)(2.0)
    bare = jax.make_jaxpr(lambda c: lax.while_loop(lambda z: z < 3.0, lambda z: z + 1.0, c))(1.0)
    assert recomputable(implicit) and not recomputable(bare)
    assert float(jax.grad(cbrt)(8.0)) == pytest.approx(1 / 12)


def coupled_with_inputs(T, n):
    """The coupled scan ``x += tanh(0.9 y + w_t); y += sin(1.1 x)`` (it drifts) over T
    per-iteration inputs w_t of n elements: the function and its arguments (c, ws, th)."""

    def f(c, ws, th):
        def body(c, w):
            x = c[0] + jnp.tanh(th[0] * c[1] + w)
            return (x, c[1] + jnp.sin(th[1] * x)), None

        return lax.scan(body, c, ws)[0]

    c = (jnp.linspace(0.0, 1.0, n), jnp.linspace(1.0, 2.0, n))
    ws = 0.01 * jnp.sin(jnp.arange(T * n, dtype=jnp.float64)).reshape(T, n)
    return f, (c, ws, jnp.array([0.9, 1.1]))


def test_the_shorter_first_segment_is_repaired_in_the_full_segments_loop():
    """With K not dividing T the first segment is shorter (T mod K iterations); a repair
    recomputes it in the full segments' loop (as a full segment from the loop's start, its
    first T mod K iterations pulled back), so its carries are not held apart from theirs:
    at T = 400, K = 30 holds 14 checkpoints and 30 carries, fewer than K = 40's 10 and 40
    (with the shorter segment's 10 apart, more). Every segment is recomputed (the coupled
    scan drifts), each iteration once, and the gradients, the per-iteration inputs' included,
    are jax.grad's."""
    T = 400
    f, (c, ws, th) = coupled_with_inputs(T, 256)

    def loss(fn):
        return lambda c, ws, th: jnp.sum(fn(c, ws, th)[0] ** 2)

    ref = jax.jit(jax.grad(loss(f), (0, 1, 2)))(c, ws, th)

    def temp(K):
        g = jax.jit(jax.grad(loss(jr.reversible(f, checkpoint_every=K)), (0, 1, 2)))
        return g.lower(c, ws, th).compile().memory_analysis().temp_size_in_bytes

    seen = []
    g = jax.jit(
        jax.grad(loss(jr.reversible(f, checkpoint_every=30, report=seen.append)), (0, 1, 2))
    )
    assert rel_error(g(c, ws, th), ref) < 1e-10
    (loop,) = seen[-1].loops
    assert (int(loop.repaired), int(loop.recomputed), loop.segments) == (14, T, 14)
    assert temp(30) < temp(40)


def test_a_budget_below_one_segments_carries_recomputes_in_two_levels():
    """`memory_budget` too small for the checkpoints and one segment's carries (⌈T/K⌉ + K,
    21 carries at least for T = 103): segments of L² = 16 iterations, each recomputed 4 at
    a time from 4 marks (⌈103/16⌉ + 4 + 4 = 15 carries), the shorter first one (7
    iterations) among them. The coupled scan drifts, so every segment is recomputed, each
    iteration once; the gradients, its per-iteration inputs' included, are jax.grad's, under
    jit, eagerly, second order and vmapped; a bounded while loop recomputes alike."""
    T, n = 103, 16
    budget = 16 * 2 * n * 8  # 16 carries of 2 x 16 float64
    f, (c, ws, th) = coupled_with_inputs(T, n)

    def loss(fn):
        return lambda c, ws, th: jnp.sum(fn(c, ws, th)[0] ** 2) + jnp.sum(jnp.cos(fn(c, ws, th)[1]))

    ref = jax.grad(loss(f), (0, 1, 2))(c, ws, th)
    seen = []
    rev = jr.reversible(f, memory_budget=budget, report=seen.append)
    for g in (jax.jit(jax.grad(loss(rev), (0, 1, 2))), jax.grad(loss(rev), (0, 1, 2))):
        assert rel_error(g(c, ws, th), ref) < 1e-10
        (lp,) = seen[-1].loops
        assert (lp.segments, int(lp.repaired), int(lp.recomputed)) == (7, 7, T)
    plain = jr.reversible(f, memory_budget=budget)

    def second(fn):
        return jax.grad(lambda th: jnp.sum(jax.grad(loss(fn), 2)(c, ws, th) ** 2))(th)

    assert rel_error(jax.jit(lambda: second(plain))(), second(f)) < 1e-8
    ths = jnp.stack([th, 0.5 * th])
    got = jax.jit(jax.vmap(lambda t: jax.grad(loss(plain), 2)(c, ws, t)))(ths)
    assert rel_error(got, jax.vmap(lambda t: jax.grad(loss(f), 2)(c, ws, t))(ths)) < 1e-10

    def w(c, th, bounded=True):
        def body(s):
            i, (x, y) = s
            x = x + jnp.tanh(th[0] * y)
            return i + 1, (x, y + jnp.sin(th[1] * x))

        if not bounded:  # (the reference: jax.grad of a while loop is refused)
            return lax.fori_loop(0, T, lambda i, s: body(s), (0, c))[1]
        return lax.while_loop(lambda s: s[0] < T, body, (0, c))[1]

    def wloss(fn):
        return lambda c, th: jnp.sum(fn(c, th)[0] ** 2)

    # (16 carries of the counter and 2 x 16 float64: 128 steps in segments of 16, by 4)
    wrev = jr.reversible(w, memory_budget=16 * 264, max_steps=128, report=seen.append)
    wref = jax.grad(wloss(lambda c, th: w(c, th, False)), (0, 1))(c, th)
    assert rel_error(jax.jit(jax.grad(wloss(wrev), (0, 1)))(c, th), wref) < 1e-10
    # (the while loop's repairs reported: segments of its bound, each repaired on its own)
    (lp,) = seen[-1].loops
    assert (lp.iterations, lp.segment_length, lp.segments) == (128, 16, 8)
    assert int(lp.repaired) >= 1 and 0 < int(lp.recomputed) <= 16 * int(lp.repaired)
