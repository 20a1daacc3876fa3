"""The default backward sweep (docs/design.md §3.8): one fused sweep for a loop that does not
drift and a second only after a miss; accumulators stored once and never compared; run-time
checks that leave JAX's fast dispatch path on; decisions of control flow taken by the whole
batch under `vmap`."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from programs.momentum import momentum_sgd

import jaxrev as jr
from jaxrev._batching import any_in_batch
from jaxrev._compat import scan_info
from jaxrev._graph import unread_carries


def _body_unread(step, carry, xs=None, length=4):
    """`unread_carries` of the scan body `step` traced with `carry` (and `xs`)."""
    closed = jax.make_jaxpr(lambda c: lax.scan(step, c, xs, length=length))(carry)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    info = scan_info(eqn.params)
    return unread_carries(info.body.jaxpr, info.nconsts, info.ncarry)


def test_unread_carries_are_the_accumulators():
    def step(c, _):
        a, acc, picked, scaled, read, count = c
        a = a + 0.1 * jnp.sin(a) + 0.01 * read
        acc = acc + a**2  # an accumulator
        picked = jnp.where(a > 0, picked - a, picked)  # the cases of a select
        scaled = 0.9 * scaled + a  # a product reads its value (for the other factor's VJP)
        read = read + a  # read by `a`
        count = count + 1  # not floating: never compared anyway
        return (a, acc, picked, scaled, read, count), None

    zero = jnp.zeros(3)
    carry = (zero + 0.5, zero, zero, zero, zero, jnp.zeros(3, jnp.int32))
    assert _body_unread(step, carry) == [False, True, True, False, False, False]


def test_a_carry_emitted_or_cast_to_integers_is_read():
    def emitted(c, _):
        x, acc = c
        return (x + 1.0, acc + x), acc  # `acc` is an output of every iteration

    def floored(c, _):
        x, acc = c
        return (x + acc.astype(jnp.int32).astype(x.dtype), acc + x), None

    def widened(c, _):
        x, acc = c
        return (x + 1.0, (acc.astype(jnp.float32) + x).astype(acc.dtype)), None

    carry = (jnp.ones(2), jnp.zeros(2))
    assert _body_unread(emitted, carry) == [False, False]
    assert _body_unread(floored, carry) == [False, False]
    assert _body_unread(widened, (jnp.ones(2), jnp.zeros(2, jnp.bfloat16))) == [False, True]


def _leapfrog_with_energy(steps, width):
    """A 2-mass leapfrog whose carry also accumulates a `width`-wide record of q."""
    basis = jnp.linspace(0.0, 1.0, width)

    def run(state, k):
        def step(c, _):
            q, p, acc = c
            p = p - 0.005 * k * jnp.sin(q)
            q = q + 0.01 * p
            p = p - 0.005 * k * jnp.sin(q)
            return (q, p, acc + q[0] * basis), None

        return lax.scan(step, state, None, length=steps)[0]

    return run


def _loss(run):
    def loss(q0, k, width):
        q, p, acc = run((q0, jnp.zeros(2), jnp.ones(width)), k)
        return jnp.sum(q**2) + jnp.sum(p**2) + 1e-3 * jnp.sum(acc)

    return loss


def test_accumulator_is_stored_once_and_gradient_is_jax_grads():
    steps, width = 10_000, 4096
    run = _leapfrog_with_energy(steps, width)
    q0, k = jnp.array([0.3, -0.2]), jnp.asarray(1.2)
    ref = jax.grad(lambda q, k: _loss(run)(q, k, width), argnums=(0, 1))(q0, k)
    default = jr.reversible(run)
    got_fn = jax.jit(jax.grad(lambda q, k: _loss(default)(q, k, width), argnums=(0, 1)))
    got = got_fn(q0, k)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=1e-9, atol=1e-12)
    # K = 100: the accumulator's 100 checkpoints would be 3.3 MB; stored once, 33 kB
    temp = got_fn.lower(q0, k).compile().memory_analysis().temp_size_in_bytes
    assert temp < 1_000_000, temp


def _forward_loop(fun, *args):
    """The first while loop of `jit(fun)`'s lowered program (after JAX's dead-code
    elimination): the forward run, its carried types on the line."""
    text = jax.jit(fun).lower(*args).as_text()
    return next(line for line in text.splitlines() if "stablehlo.while" in line)


def test_the_forward_run_drops_an_accumulator_only_the_loss_reads():
    """`jax.grad` reads no output of the forward run but its residuals: an accumulator that
    only the loss reads (the value of a sparse dot product, an energy) is not computed at
    all (JAX's dead-code elimination through the checkpointing loop and the segment loops it
    nests, which XLA does not do); `value_and_grad` reads the loss, and computes it."""

    def run(state):
        def step(c, w):
            x, acc = c
            x = x + 0.01 * jnp.tanh(x) * w
            return (x, acc + x[:7] ** 2), None

        return lax.scan(step, state, jnp.linspace(0.5, 1.5, 400))[0]

    default = jr.reversible(run)

    def loss(x, run=default):
        # (the accumulator's type, 7 float64s, is found in the loops' signatures)
        return jnp.sum(run((x, jnp.zeros(7)))[1])

    x = jnp.linspace(-1.0, 1.0, 16)
    np.testing.assert_allclose(jax.grad(loss)(x), jax.grad(partial(loss, run=run))(x), rtol=1e-12)
    # (the forward run carries x and its checkpoints, 20 x 16; with the loss, the 7 more)
    assert "tensor<20x16xf64>" in _forward_loop(jax.grad(loss), x)
    assert "tensor<7xf64>" not in _forward_loop(jax.grad(loss), x)
    assert "tensor<7xf64>" in _forward_loop(jax.value_and_grad(loss), x)


def test_a_default_call_has_no_effect():
    """The drift check sits in every default call; an effect would turn off JAX's C++
    dispatch of the user's whole `jit` function (about 0.5 ms of Python per call)."""
    run = _leapfrog_with_energy(200, 4)
    loss = lambda q, k: _loss(jr.reversible(run))(q, k, 4)  # noqa: E731
    closed = jax.make_jaxpr(jax.grad(loss, argnums=1))(jnp.array([0.3, -0.2]), 1.2)
    assert not closed.effects
    assert "jaxrev_check" in str(closed)  # and the check is there, kept by DCE


def test_any_in_batch():
    flags = jnp.array([[False, True], [False, False]])
    assert bool(any_in_batch(jnp.asarray(False))) is False
    once = jax.vmap(any_in_batch)(flags[0])
    assert once.tolist() == [True, True]
    twice = jax.vmap(jax.vmap(any_in_batch))(flags)
    assert twice.tolist() == [[True, True], [True, True]]
    assert jax.vmap(any_in_batch)(flags[1]).tolist() == [False, False]


@pytest.mark.parametrize("batch", ["mixed", "clean"])
def test_vmap_over_a_sample_that_drifts_and_one_that_does_not(batch):
    """Momentum 0.9 drifts (run backwards, v is divided by 0.9 a step), momentum 1 does not:
    under vmap the batch recomputes together, each sample's gradient is jax.grad's."""

    train = momentum_sgd(400)
    wv = (jnp.linspace(-1.0, 1.0, 8), jnp.zeros(8))

    def loss(f):
        return lambda hp, beta: jnp.sum(f(wv, hp, beta)[0] ** 2)

    betas = jnp.array([0.9, 1.0]) if batch == "mixed" else jnp.array([1.0, 1.0])
    hps = jnp.array([0.05, 0.01])
    ref = jax.vmap(jax.grad(loss(train)))(hps, betas)
    got = jax.jit(jax.vmap(jax.grad(loss(jr.reversible(train)))))(hps, betas)
    np.testing.assert_allclose(got, ref, rtol=1e-9)


@pytest.mark.parametrize("steps", [401, 400])
def test_a_miss_repairs_a_loop_with_a_shorter_first_segment(steps):
    """401 steps (prime: K = 21, a first segment of 2 iterations) and 400 (K = 20): the
    second sweep recomputes the segments, eager = jit = jax.grad."""
    seen = []

    def train(wv, hp):
        def body(i, s):
            w, v = s
            v = 0.9 * v + jnp.tanh(w) + 0.1 * w
            return w - hp * v, v

        return lax.fori_loop(0, steps, body, wv)

    wv = (jnp.linspace(-1.0, 1.0, 8), jnp.zeros(8))
    loss = lambda f: lambda hp: jnp.sum(f(wv, hp)[0] ** 2)  # noqa: E731
    ref = jax.grad(loss(train))(0.05)
    rev = jr.reversible(train, report=seen.append)
    eager = jax.grad(loss(rev))(0.05)
    jitted = jax.jit(jax.grad(loss(rev)))(0.05)
    np.testing.assert_allclose([eager, jitted], [ref, ref], rtol=1e-10)
    (loop,) = seen[-1].loops
    assert loop.segment_length == (21 if steps == 401 else 20)
    assert 0 < int(loop.repaired) <= loop.segments


def test_a_sum_whose_term_the_walk_takes_from_it_is_read():
    """`acc + sin(x) w` over `xs` the loop must rebuild (they are the state's): the walk takes
    sin(x) w as acc_out - acc_in, from acc's stored input, so acc is read (its checkpoints are
    a segment's true starts). Before: stored once, the gradient 32.9 instead of 108.8."""

    def f(state, w):
        a0, xs = state

        def body(c, x):
            acc, q = c
            acc = acc + jnp.sin(x) * w
            q = q + 0.5 * jnp.cos(q) + 0.1 * w
            return (acc, q), q

        (acc, q), ys = lax.scan(body, (a0, jnp.asarray(0.2)), xs)
        return acc, ys

    def loss(g):
        return lambda s, w: (lambda o: o[0] ** 2 + jnp.sum(o[1]))(g(s, w))

    s, w = (jnp.asarray(0.1), jnp.linspace(0.1, 2.0, 12)), jnp.asarray(0.7)
    ref = jax.grad(loss(f), 1)(s, w)
    for every in ("auto", 6, 1):
        got = jax.grad(loss(jr.reversible(f, checkpoint_every=every)), 1)(s, w)
        np.testing.assert_allclose(got, ref, rtol=1e-10)
