"""Other people's code as its users write it: Equinox modules (with activation functions and
strings among their leaves, differentiated with `eqx.filter_grad`), Flax linen parameter
dicts (float32 parameters, float64 state) and nnx states (issue 20, filter pytrees).

Non-array leaves are static: jaxrev passes them through, and gradients come back with None
there, as `eqx.filter_grad` gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaf_rel_error

import jaxrev as jr

jax.config.update("jax_enable_x64", True)
eqx = pytest.importorskip("equinox")


def leaves_close(a, b, tol=1e-12):
    la = [x for x in jax.tree_util.tree_leaves(a) if x is not None]
    lb = [x for x in jax.tree_util.tree_leaves(b) if x is not None]
    assert len(la) == len(lb)
    return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(la, lb)) < tol


class Coupling(eqx.Module):
    """An affine coupling layer holding an MLP (whose activations are function leaves) and a
    string."""

    net: eqx.nn.MLP
    name: str = "coupling"

    def __call__(self, x):
        a, b = x[:2], x[2:]
        h = self.net(a)
        return jnp.concatenate([a, b * jnp.exp(0.1 * jnp.tanh(h[:2])) + h[2:]])


def flow(x, layer):
    return jax.lax.fori_loop(0, 5, lambda i, x: layer(x)[::-1], x)


@pytest.fixture(scope="module")
def layer():
    return Coupling(eqx.nn.MLP(2, 4, 8, 2, key=jax.random.PRNGKey(0)))


X = jnp.linspace(-1.0, 1.0, 4)


def test_equinox_reverse_and_reports(layer):
    y = flow(X, layer)
    np.testing.assert_allclose(jr.reverse(flow)(y, layer), X, atol=1e-13)
    np.testing.assert_allclose(eqx.filter_jit(jr.reverse(flow))(y, layer), X, atol=1e-13)
    assert jr.check_reversible(flow, X, layer).max_error < 1e-12
    assert jr.memory_report(flow, X, layer, checkpoint_every=None).total_bytes == 0


def test_equinox_filter_grad_of_reversible(layer):
    g = eqx.filter_grad(lambda m: jnp.sum(jr.reversible(flow)(X, m) ** 2))(layer)
    ref = eqx.filter_grad(lambda m: jnp.sum(flow(X, m) ** 2))(layer)
    assert leaves_close(g, ref)
    assert g.name is None and g.net.activation is None  # static leaves: None
    gj = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(jr.reversible(flow)(X, m) ** 2)))(layer)
    assert leaves_close(gj, ref)
    # the module as state: its arrays are rebuilt, its functions passed through
    gx = jax.grad(lambda x: jnp.sum(jr.reversible(flow)(x, layer) ** 2))(X)
    np.testing.assert_allclose(gx, jax.grad(lambda x: jnp.sum(flow(x, layer) ** 2))(X), atol=1e-12)


def test_equinox_inverse_transforms_and_logdet(layer):
    J = jax.jacfwd(lambda x: flow(x, layer))(X)
    v = jnp.arange(1.0, 5.0)
    _, (t,) = jr.inverse_jvp(lambda x: flow(x, layer), (X,), v)
    np.testing.assert_allclose(J @ t, v, atol=1e-12)
    sign, logdet = jr.slogdet_jacobian(flow, X, layer)
    ref = jnp.linalg.slogdet(J)
    assert sign == ref.sign and abs(logdet - ref.logabsdet) < 1e-12
    y, ld = jr.forward_and_slogdet(flow)(X, layer)
    np.testing.assert_allclose(y, flow(X, layer))
    assert abs(ld - ref.logabsdet) < 1e-12


def test_equinox_inverse_jvp_over_a_module_argument():
    """Every traced leaf of the primals is an input; static leaves pass through and come back
    as None in the tangents."""

    class Scale(eqx.Module):
        w: jax.Array
        act: object = jnp.tanh

    def f(x, m):
        return x * jnp.exp(m.w), m.act(m.w) + 0 * x.sum()

    m = Scale(jnp.array([0.3, -0.2]))
    x = jnp.array([1.0, 2.0])
    (_, _), (tx, tm) = jr.inverse_jvp(f, (x, m), (jnp.ones(2), jnp.ones(2)))
    assert tm.act is None
    J = jax.jacfwd(lambda v: jnp.concatenate(f(v[:2], Scale(v[2:]))))(jnp.concatenate([x, m.w]))
    np.testing.assert_allclose(J @ jnp.concatenate([tx, tm.w]), jnp.ones(4), atol=1e-12)


def test_equinox_module_with_optim():
    """Newton on a module holding a function: the function passes through."""

    class Model(eqx.Module):
        lin: eqx.nn.Linear
        squash: object = jnp.tanh

        def __call__(self, x):
            return self.squash(self.lin(x))

    model = Model(eqx.nn.Linear(3, 2, key=jax.random.PRNGKey(0)))
    X3 = jax.random.normal(jax.random.PRNGKey(1), (20, 3))
    Y = 0.5 * jnp.tanh(X3[:, :2] - X3[:, 2:])

    def loss(m):
        return jnp.mean((jax.vmap(m)(X3) - Y) ** 2) + 1e-3 * jnp.sum(m.lin.weight**2)

    m, info = jr.optim.minimize(loss, model, maxiter=50)
    assert isinstance(m, Model) and m.squash is jnp.tanh
    assert int(info.status) == 0 and loss(m) < 0.1 * loss(model)
    g = eqx.filter_grad(loss)(m)
    assert (
        max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(g) if x is not None)
        < 1e-6
    )


def test_flax_linen_float32_parameters():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, a):
            h = nn.Dense(8, param_dtype=jnp.float32, dtype=jnp.float32)(a)
            return nn.Dense(2, param_dtype=jnp.float32, dtype=jnp.float32)(jnp.tanh(h))

    net = Net()
    params = net.init(jax.random.PRNGKey(0), X[:2])

    def f(x, params):
        def body(i, x):
            a, b = x[:2], x[2:]
            return jnp.concatenate([b + net.apply(params, a).astype(x.dtype), a])

        return jax.lax.fori_loop(0, 6, body, x)

    def grad(fn):
        return jax.jit(jax.grad(lambda p: jnp.sum(fn(X, p) ** 2)))

    g, ref = grad(jr.reversible(f))(params), grad(f)(params)
    assert all(a.dtype == jnp.float32 for a in jax.tree_util.tree_leaves(g))
    # float32: each leaf within a few ulps of its own scale (an absolute 1e-6 on gradients
    # near 46 asked for bitwise-equal rounding, which a change of compiler flags moves)
    assert leaf_rel_error(g, ref) < 1e-6
    # float32 parameters stay float32: the plan is no larger than jax.grad's own
    temp = lambda fn: grad(fn).lower(params).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(jr.reversible(f, checkpoint_every=None)) <= temp(f)


def test_flax_nnx_state():
    nnx = pytest.importorskip("flax.nnx")

    class M(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, a):
            return jnp.tanh(self.lin(a))

    graphdef, state = nnx.split(M(nnx.Rngs(0)))

    def f(x, state):
        m = nnx.merge(graphdef, state)
        return jax.lax.fori_loop(0, 6, lambda i, x: jnp.concatenate([x[2:] + m(x[:2]), x[:2]]), x)

    np.testing.assert_allclose(jr.reverse(f)(f(X, state), state), X, atol=1e-13)
    g = jax.grad(lambda s: jnp.sum(jr.reversible(f)(X, s) ** 2))(state)
    ref = jax.grad(lambda s: jnp.sum(f(X, s) ** 2))(state)
    # nnx.Linear's parameters are float32: their cotangents, summed over the iterations in
    # another order (each segment's share, then the total), may differ by an ulp (1.2e-7)
    assert leaves_close(g, ref, tol=1e-6)
