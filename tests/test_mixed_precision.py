"""Values computed from parameters alone under `jr.reversible` (issue 29, docs/design.md §1
"Scale"): a float32 kernel cast to float64 or bfloat16 in each block, a weight's transpose, a
broadcast bias, any computation of them, are recomputed from the parameters in the backward
run, never stored per block or per loop iteration. So the scratch memory of `jit(grad)` is flat
in depth for Flax models with float32 parameters and float64 inputs, for bfloat16 RevNets with
float32 master weights, and for Equinox layers stacked and run by `lax.scan`; and the gradients
are as accurate as `jax.grad`'s.

Memory is XLA's buffer plan (`memory_analysis().temp_size_in_bytes`, docs/design.md §4).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import l2_rel_error

import jaxrev as jr
from jaxrev.transforms.sweep.params import fresh_p

W, B = 16, 8  # width of the streams and of the MLPs' hidden layer, batch
# memory is measured at 4, 16 and 64 blocks (compiling 64 blocks takes a while: slow), and at
# 4 and 16 in the default run
DEPTHS = [(4, 16), pytest.param((4, 16, 64), marks=pytest.mark.slow)]
# XLA's buffer plan of a longer program may keep an activation or two more alive: two
# float64[8, 16] buffers (1 KiB each). One block's stored casts would be 8 KiB (four float32
# kernels 16x16 cast to float64), so 60 more blocks of them would be 480 KiB.
SLACK = 2 * B * W * 8


def _temp(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _loss(f):
    """A loss of the two streams, in float32 whatever their dtype."""

    def loss(p, x):
        y1, y2 = f(x, p)
        return jnp.sum(jnp.sin(y1.astype(jnp.float32))) + jnp.sum(y2.astype(jnp.float32) ** 2) / 2

    return loss


def _flat(mem):
    """The deepest figure within 10 % of the shallowest's, plus SLACK."""
    return mem[max(mem)] <= 1.1 * mem[min(mem)] + SLACK


# --------------------------------------------------------------------------- (a) Flax


def _flax_stack(n):
    """Additive coupling blocks (y1 = x1 + f(x2), y2 = x2 + g(y1)) of flax.linen MLPs with
    float32 parameters on float64 inputs: each Dense casts its kernel and bias to float64."""
    nn = pytest.importorskip("flax.linen")

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(W, param_dtype=jnp.float32, dtype=jnp.float64)(x)
            return nn.Dense(W, param_dtype=jnp.float32, dtype=jnp.float64)(jnp.tanh(h))

    class Stack(nn.Module):
        n: int

        @nn.compact
        def __call__(self, x):
            x1, x2 = x
            for i in range(self.n):
                x1 = x1 + MLP(name=f"f{i}")(x2)
                x2 = x2 + MLP(name=f"g{i}")(x1)
            return x1, x2

    m = Stack(n)
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    x = (jax.random.normal(k1, (B, W), jnp.float64), jax.random.normal(k2, (B, W), jnp.float64))
    params = m.init(jax.random.PRNGKey(0), x)
    return (lambda x, p: m.apply(p, x)), x, params


@pytest.mark.parametrize("depths", DEPTHS)
def test_flax_float32_parameters_float64_inputs_memory_is_flat(depths):
    mem = {}
    for n in depths:
        f, x, p = _flax_stack(n)
        mem[n] = _temp(jax.grad(_loss(jr.reversible(f)), argnums=(0, 1)), p, x)
    grad = _temp(jax.grad(_loss(f), argnums=(0, 1)), p, x)
    assert _flat(mem), mem
    assert mem[max(mem)] * 5 < grad, (mem, grad)  # jax.grad keeps every block's casts


def test_flax_float32_parameters_gradient_matches_jax_grad():
    f, x, p = _flax_stack(16)
    assert jr.memory_report(f, x, p, checkpoint_every=None).total_bytes == 0
    ref = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(p, x)
    g = jax.jit(jax.grad(_loss(jr.reversible(f)), argnums=(0, 1)))(p, x)
    assert all(
        a.dtype == b.dtype
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref))
    )
    # float32 parameters: their gradients are float64 sums rounded to float32 once
    assert l2_rel_error(g, ref) < 1e-6


# --------------------------------------------------------------------------- (b) bfloat16 RevNet

# residual branches scaled for depth (as Fixup and DeepNet do: gain ~ 2/sqrt(64) at 64 blocks),
# so that 64 bfloat16 blocks run backwards rebuild their input to about 1.2 % (see
# test_bf16_revnet_drift_is_within_the_default_tolerance)
GAIN = 0.25


def _master_weights(n, key=0):
    ks = jax.random.split(jax.random.PRNGKey(key), 4 * n)
    return [
        [
            jax.random.normal(k, (W, W), jnp.float32) * GAIN / np.sqrt(W)
            for k in ks[4 * i : 4 * i + 4]
        ]
        for i in range(n)
    ]


def _revnet(dtype):
    """Additive coupling blocks whose float32 master weights are cast to `dtype` in each
    block, on activations of `dtype`."""

    def mlp(x, w1, w2):
        return jnp.tanh(x @ w1.astype(dtype)) @ w2.astype(dtype)

    def f(x, p):
        x1, x2 = x
        for a, b, c, d in p:
            x1 = x1 + mlp(x2, a, b)
            x2 = x2 + mlp(x1, c, d)
        return x1, x2

    return f


def _streams(dtype, key=1):
    k1, k2 = jax.random.split(jax.random.PRNGKey(key))
    return (
        jax.random.normal(k1, (B, W)).astype(dtype),
        jax.random.normal(k2, (B, W)).astype(dtype),
    )


@pytest.mark.parametrize("depths", DEPTHS)
def test_bf16_revnet_memory_is_flat(depths):
    f = _revnet(jnp.bfloat16)
    x = _streams(jnp.bfloat16)
    mem = {
        n: _temp(jax.grad(_loss(jr.reversible(f)), argnums=(0, 1)), _master_weights(n), x)
        for n in depths
    }
    grad = _temp(jax.grad(_loss(f), argnums=(0, 1)), _master_weights(max(depths)), x)
    assert _flat(mem), mem
    assert mem[max(mem)] * 5 < grad, (mem, grad)


def _accuracy(f16, f32, p, x16, x32):
    """The relative errors of jax.grad's and jaxrev's bfloat16 gradients against the float32
    model's."""
    grad = lambda f, x: jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(p, x)  # noqa: E731
    ref = grad(f32, x32)
    return l2_rel_error(grad(f16, x16), ref), l2_rel_error(grad(jr.reversible(f16), x16), ref)


# jaxrev's gradient rebuilds 64 blocks' inputs by running them backwards in bfloat16, whose
# rounding is lost: its error may exceed jax.grad's (the forward run's rounding alone), by up
# to 2x, plus one bfloat16 rounding of the gradient (2**-8, relative)
BF16_SLACK = 2.0**-8


@pytest.mark.parametrize("n", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_bf16_revnet_gradient_as_accurate_as_jax_grad(n):
    p = _master_weights(n)
    err_grad, err_rev = _accuracy(
        _revnet(jnp.bfloat16),
        _revnet(jnp.float32),
        p,
        _streams(jnp.bfloat16),
        _streams(jnp.float32),
    )
    assert err_grad < 0.05  # bfloat16 itself: about 2 % here
    assert err_rev <= 2 * err_grad + BF16_SLACK, (err_rev, err_grad)


def test_bf16_revnet_drift_is_within_the_default_tolerance():
    """The input rebuilt through 64 bfloat16 blocks misses by about 1.2 %, well inside the
    default tolerance of the call's inputs (√eps of bfloat16: 8.8 %), so the default settings
    neither raise nor repair."""
    f = _revnet(jnp.bfloat16)
    p, x = _master_weights(64), _streams(jnp.bfloat16)
    back = jax.jit(jr.reverse(f))(jax.jit(f)(x, p), p)
    assert l2_rel_error(back, x) < 0.03


# --------------------------------------------------------------------------- (c) Equinox, scan


def _eqx_layers(n, gain=0.5):
    """`n` coupling layers of two eqx.nn.MLPs (float32 weights) stacked by filter_vmap, their
    weights scaled by `gain`."""
    eqx = pytest.importorskip("equinox")

    class Coupling(eqx.Module):
        f: eqx.nn.MLP
        g: eqx.nn.MLP

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.f = eqx.nn.MLP(W, W, W, 1, activation=jnp.tanh, key=k1, dtype=jnp.float32)
            self.g = eqx.nn.MLP(W, W, W, 1, activation=jnp.tanh, key=k2, dtype=jnp.float32)

        def __call__(self, x, dtype):
            # the master weights cast per layer, inside the scan's body
            f, g = jax.tree_util.tree_map(
                lambda a: a.astype(dtype) if eqx.is_array(a) else a, (self.f, self.g)
            )
            x1, x2 = x
            y1 = x1 + jax.vmap(f)(x2)
            return y1, x2 + jax.vmap(g)(y1)

    layers = eqx.filter_vmap(Coupling)(jax.random.split(jax.random.PRNGKey(0), n))
    return jax.tree_util.tree_map(lambda a: a * gain if eqx.is_array(a) else a, layers)


def _eqx_run(dtype):
    import equinox as eqx

    def run(x, layers):
        params, static = eqx.partition(layers, eqx.is_array)
        body = lambda x, p: (eqx.combine(p, static)(x, dtype), None)  # noqa: E731
        return jax.lax.scan(body, x, params)[0]

    return run


def _eqx_temp(fn, layers, x):
    import equinox as eqx

    return (
        eqx.filter_jit(eqx.filter_grad(_loss(fn)))
        .lower(layers, x)
        .compile()
        .compiled.memory_analysis()
        .temp_size_in_bytes
    )


@pytest.mark.parametrize("depths", DEPTHS)
def test_equinox_scan_over_stacked_layers_memory_is_flat(depths):
    """The per-layer casts are computed in each backward iteration from the layer's slice of
    the stacked float32 weights. Measured without checkpoints (checkpoint_every=None): by
    default `reversible` also keeps ⌈√T⌉ checkpoints of a top-level loop (docs/design.md
    §3.8), which is the dial's memory, not values of the parameters."""
    x = _streams(jnp.bfloat16)
    run = _eqx_run(jnp.bfloat16)
    mem = {
        n: _eqx_temp(jr.reversible(run, checkpoint_every=None), _eqx_layers(n), x) for n in depths
    }
    grad = _eqx_temp(run, _eqx_layers(max(depths)), x)
    assert _flat(mem), mem
    assert mem[max(mem)] * 5 < grad, (mem, grad)


def test_equinox_scan_gradient_as_accurate_as_jax_grad():
    import equinox as eqx

    layers = _eqx_layers(64)
    x16, x32 = _streams(jnp.bfloat16), _streams(jnp.float32)

    def grad(f, x):
        return eqx.filter_jit(eqx.filter_grad(_loss(f)))(layers, x)

    ref = grad(_eqx_run(jnp.float32), x32)
    err_grad = l2_rel_error(grad(_eqx_run(jnp.bfloat16), x16), ref)
    err_rev = l2_rel_error(grad(jr.reversible(_eqx_run(jnp.bfloat16)), x16), ref)
    assert err_grad < 0.05
    assert err_rev <= 2 * err_grad + BF16_SLACK, (err_rev, err_grad)


# --------------------------------------------------------------------------- any computation


def _weights_block_net(n, shared=False):
    """Blocks whose parameter-only values are not casts: a transposed weight, a bias
    broadcast and reshaped, a product of two weights; `shared`: one float32 weight cast to
    float64 once, before the blocks, and read by all of them."""

    def f(x, p):
        x1, x2 = x
        w0 = p["w0"].astype(jnp.float64)
        for k in range(n):
            w, b = p["w"][k], p["b"][k]
            m = w @ w.T * 0.1  # parameters only
            bias = jnp.broadcast_to(b.reshape(1, W), (B, W))  # parameters only
            x1 = x1 + jnp.tanh(x2 @ m + bias)
            x2 = x2 + jnp.sin(x1 @ (w0 if shared else w.T))
        return x1, x2

    ks = jax.random.split(jax.random.PRNGKey(3), 2 * n + 1)
    p = {
        "w": [jax.random.normal(k, (W, W)) * 0.2 for k in ks[:n]],
        "b": [jax.random.normal(k, (W,)) for k in ks[n : 2 * n]],
        "w0": jax.random.normal(ks[-1], (W, W), jnp.float32) * 0.2,
    }
    return f, p


@pytest.mark.parametrize("shared", [False, True])
def test_transposes_broadcasts_and_products_of_weights_are_not_stored(shared):
    """Flat in depth. A weight every block reads (`shared`) is differentiated with respect to
    the state only here: its cotangent is a sum over the blocks, which XLA:CPU fuses into one
    addition at the end, keeping every block's term alive (as it does for jax.grad): that is
    the gradient's accumulation, not a stored value of the parameters."""
    x = _streams(jnp.float64)
    mem = {}
    for n in (4, 16):
        f, p = _weights_block_net(n, shared)
        mem[n] = _temp(jax.grad(_loss(jr.reversible(f)), argnums=1 if shared else (0, 1)), p, x)
    assert _flat(mem), mem
    f, p = _weights_block_net(4, shared)
    ref = jax.grad(_loss(f), argnums=(0, 1))(p, x)
    assert l2_rel_error(jax.grad(_loss(jr.reversible(f)), argnums=(0, 1))(p, x), ref) < 1e-12
    # forward over reverse (a Hessian-vector product): the recomputations' tangents
    v = jax.tree_util.tree_map(jnp.ones_like, p)
    hvp = lambda fn: jax.jvp(
        lambda p: jax.grad(_loss(fn), argnums=(0, 1))(p, x),  # noqa: E731
        (p,),
        (v,),
    )[1]
    assert l2_rel_error(hvp(jr.reversible(f)), hvp(f)) < 1e-12


# --------------------------------------------------------------------------- fresh_p


@pytest.mark.parametrize(
    "dtype",
    [jnp.float32, jnp.bfloat16, jnp.float64, jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64],
)
def test_fresh_is_an_identity(dtype):
    x = (jnp.arange(6) - 2).astype(dtype)
    tie = jnp.array([jnp.nan, 1.0])  # its NaN is what the run-time zero is made of
    f = lambda x, t: fresh_p.bind(x, t, n=1)[0]  # noqa: E731
    for out in (f(x, tie), jax.jit(f)(x, tie), jax.vmap(f, (0, None))(x[:, None], tie)[:, 0]):
        assert out.dtype == x.dtype and bool(jnp.all(out == x))


def test_fresh_differentiates_as_the_identity():
    x = jnp.linspace(-1.0, 1.0, 5)
    f = lambda x, t: jnp.sum(jnp.sin(fresh_p.bind(x, t, n=1)[0]))  # noqa: E731
    t = jnp.ones(2)
    assert jnp.allclose(jax.grad(f)(x, t), jnp.cos(x))
    assert jnp.allclose(jax.jit(jax.hessian(f))(x, t), jnp.diag(-jnp.sin(x)))
    # and the reversible walks invert it
    g = lambda x: fresh_p.bind(x * 2.0, jnp.ones(1), n=1)[0]  # noqa: E731
    assert jnp.allclose(jr.reverse(g)(g(x)), x)


def test_small_parameter_values_are_not_tied():
    """Only parameter values of more than `SMALL` elements pass through `fresh_p`: a
    scalar's tie (its bits shifted by a run-time zero at every use) would cost XLA more
    instructions than keeping it alive costs bytes. A scan whose body reads a float32 scalar
    and a float32 16x16 kernel, both cast to float64: only the kernel's casts are tied, and
    the gradient is jax.grad's."""
    from jaxrev.transforms.sweep.params import SMALL

    def f(x, w, a):
        def body(c, _):
            return jnp.tanh(w.astype(c.dtype) @ c) * a.astype(c.dtype) + c, None

        return jax.lax.scan(body, x, None, length=5)[0]

    x = jnp.linspace(-1.0, 1.0, 16)
    a = jnp.float32(0.5)
    loss = lambda fn: lambda x, w, a: jnp.sum(fn(x, w, a) ** 2)  # noqa: E731

    def ties(x, w):
        grad = jax.jit(jax.grad(loss(jr.reversible(f)), argnums=(0, 1, 2)))
        return grad.lower(x, w, a).as_text().count("shift_right_logical")

    w = 0.1 * jax.random.normal(jax.random.PRNGKey(0), (16, 16), jnp.float32)
    assert w.size > SMALL >= a.size
    assert ties(x, w) > 0  # the kernel's casts are tied
    # a kernel of SMALL elements (and the scalar) are not
    assert ties(x[:4], w[:4, :4]) == 0
    ref = jax.grad(loss(f), argnums=(0, 1, 2))(x, w, a)
    got = jax.grad(loss(jr.reversible(f)), argnums=(0, 1, 2))(x, w, a)
    assert l2_rel_error(got, ref) < 1e-6  # float32 gradients of the float32 parameters
