"""`jr.reversible`: gradients against jax.grad, composition, lossy steps, loops, memory shape."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaf_rel_error
from jax import lax
from jax.test_util import check_grads

import jaxrev as jr

THIS_FILE = __file__


def step(c, th):
    x, y = c
    x = x + jnp.tanh(th[0] * y)
    y = y + jnp.sin(th[1] * x)
    return x, y


def coupled_scan(depth):
    def f(c, th):
        return jax.lax.scan(lambda c, _: (step(c, th), None), c, None, length=depth)[0]

    return f


def coupled_fori(depth):
    def f(c, th):
        return jax.lax.fori_loop(0, depth, lambda i, c: step(c, th), c)

    return f


def two_leaf_loss(f):
    def loss(c, th):
        x, y = f(c, th)
        return jnp.sum(x**2) + jnp.sum(jnp.cos(y))

    return loss


C = (jnp.linspace(0.0, 1.0, 7), jnp.linspace(1.0, 2.0, 7))
TH = jnp.array([0.5, 0.4])


@pytest.mark.parametrize("make", [coupled_scan, coupled_fori])
@pytest.mark.parametrize("depth", [1, 10, 200])
def test_loop_gradients_match_jax_grad(make, depth):
    f = make(depth)
    g_ref = jax.grad(two_leaf_loss(f), argnums=(0, 1))(C, TH)
    g = jax.grad(two_leaf_loss(jr.reversible(f)), argnums=(0, 1))(C, TH)
    assert leaf_rel_error(g, g_ref) < 1e-10


def test_forward_values_unchanged():
    f = coupled_scan(30)
    assert leaf_rel_error(jr.reversible(f)(C, TH), f(C, TH)) == 0.0


def test_gradients_at_depth_1000_float64():
    f = coupled_scan(1000)
    c = (jnp.linspace(0.0, 1.0, 64), jnp.linspace(1.0, 2.0, 64))
    g_ref = jax.jit(jax.grad(two_leaf_loss(f), argnums=(0, 1)))(c, TH)
    g = jax.jit(jax.grad(two_leaf_loss(jr.reversible(f)), argnums=(0, 1)))(c, TH)
    assert leaf_rel_error(g, g_ref) < 1e-9


def test_float32_drift_is_small():
    f = coupled_scan(100)
    c32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), C)
    g_ref = jax.grad(two_leaf_loss(f), argnums=(0, 1))(C, TH)
    g = jax.grad(two_leaf_loss(jr.reversible(f)), argnums=(0, 1))(c32, TH.astype(jnp.float32))
    g32 = jax.grad(two_leaf_loss(f), argnums=(0, 1))(c32, TH.astype(jnp.float32))
    assert g[0][0].dtype == jnp.float32
    # rebuilding adds rounding of its own (here 3.9e-4 against jax.grad's 1.4e-5 in float32)
    assert leaf_rel_error(g32, g_ref) < 1e-4 and leaf_rel_error(g, g_ref) < 2e-3


def unrolled(n_blocks=6, width=5):
    ws = [jax.random.normal(jax.random.PRNGKey(i), (width, width)) * 0.3 for i in range(n_blocks)]

    def net(c, ws):
        a, b = c
        for w in ws:
            a = a + jnp.tanh(w @ b)
            b = b * jnp.exp(0.1 * jnp.sum(w)) - jnp.sin(w.T @ a) * 0.5
        return a, b

    return net, ws


def test_unrolled_network():
    net, ws = unrolled()
    g_ref = jax.grad(two_leaf_loss(net), argnums=(0, 1))((C[0][:5], C[1][:5]), ws)
    g = jax.grad(two_leaf_loss(jr.reversible(net)), argnums=(0, 1))((C[0][:5], C[1][:5]), ws)
    assert leaf_rel_error(g, g_ref) < 1e-12


def test_closed_over_constants_get_gradients():
    def outer(w):
        def f(x):
            return jax.lax.fori_loop(0, 20, lambda i, x: x + 0.1 * jnp.tanh(w), x)

        return jnp.sum(jr.reversible(f)(jnp.ones(3)) ** 2)

    def outer_ref(w):
        f = lambda x: jax.lax.fori_loop(0, 20, lambda i, x: x + 0.1 * jnp.tanh(w), x)
        return jnp.sum(f(jnp.ones(3)) ** 2)

    w = jnp.array([0.3, -0.2, 0.9])
    assert leaf_rel_error(jax.grad(outer)(w), jax.grad(outer_ref)(w)) < 1e-12


class State(NamedTuple):
    q: jax.Array
    p: jax.Array


def leapfrog(s, params):
    dt, k = params["dt"], params["k"]

    def body(i, s):
        p = s.p - 0.5 * dt * k * jnp.sin(s.q)
        q = s.q + dt * p
        p = p - 0.5 * dt * k * jnp.sin(q)
        return State(q, p)

    return jax.lax.fori_loop(0, 100, body, s)


def test_pytrees_namedtuple_and_dict():
    s = State(jnp.linspace(-1, 1, 4), jnp.zeros(4))
    params = {"dt": jnp.array(0.05), "k": jnp.array(1.5)}
    loss = lambda f: lambda s, p: jnp.sum(f(s, p).q ** 2) + jnp.sum(f(s, p).p)
    g_ref = jax.grad(loss(leapfrog), argnums=(0, 1))(s, params)
    g = jax.grad(loss(jr.reversible(leapfrog)), argnums=(0, 1))(s, params)
    assert isinstance(g[0], State) and set(g[1]) == {"dt", "k"}
    assert leaf_rel_error(g, g_ref) < 1e-11


def test_argnums_tuple():
    def f(x, th, y):
        def body(i, c):
            x, y = c
            x = x + th * jnp.tanh(y)
            return x, y + jnp.sin(x)

        return jax.lax.fori_loop(0, 30, body, (x, y))

    loss = lambda f: lambda x, th, y: jnp.sum(jnp.stack(f(x, th, y)) ** 2)
    args = (jnp.ones(3), 0.3, jnp.arange(3.0))
    g_ref = jax.grad(loss(f), argnums=(0, 1, 2))(*args)
    g = jax.grad(loss(jr.reversible(f, argnums=(0, 2))), argnums=(0, 1, 2))(*args)
    assert leaf_rel_error(g, g_ref) < 1e-12


class TestComposition:
    f = staticmethod(coupled_scan(40))

    def test_jit_and_value_and_grad(self):
        L = two_leaf_loss(self.f)
        v_ref, g_ref = jax.value_and_grad(L, argnums=(0, 1))(C, TH)
        v, g = jax.jit(jax.value_and_grad(two_leaf_loss(jr.reversible(self.f)), argnums=(0, 1)))(
            C, TH
        )
        assert abs(v - v_ref) < 1e-12 * abs(v_ref) and leaf_rel_error(g, g_ref) < 1e-10

    def test_vmap_of_grad_and_grad_of_vmap(self):
        cb = jax.tree_util.tree_map(lambda a: jnp.stack([a, 0.5 * a, a + 1.0]), C)
        L, Lr = two_leaf_loss(self.f), two_leaf_loss(jr.reversible(self.f))
        assert (
            leaf_rel_error(
                jax.vmap(jax.grad(Lr), (0, None))(cb, TH), jax.vmap(jax.grad(L), (0, None))(cb, TH)
            )
            < 1e-10
        )
        tot = lambda L: lambda cb, th: jnp.sum(jax.vmap(L, (0, None))(cb, th))
        assert (
            leaf_rel_error(
                jax.grad(tot(Lr), argnums=(0, 1))(cb, TH), jax.grad(tot(L), argnums=(0, 1))(cb, TH)
            )
            < 1e-10
        )

    def test_jvp_jacfwd_jacrev(self):
        r = jr.reversible(self.f)
        tang = (C, jnp.ones(2))
        assert leaf_rel_error(jax.jvp(r, (C, TH), tang), jax.jvp(self.f, (C, TH), tang)) < 1e-10
        assert (
            leaf_rel_error(jax.jacfwd(r, argnums=1)(C, TH), jax.jacfwd(self.f, argnums=1)(C, TH))
            < 1e-10
        )
        assert (
            leaf_rel_error(jax.jacrev(r, argnums=1)(C, TH), jax.jacrev(self.f, argnums=1)(C, TH))
            < 1e-10
        )

    def test_hessians(self):
        L, Lr = two_leaf_loss(self.f), two_leaf_loss(jr.reversible(self.f))
        H_ref = jax.hessian(L, argnums=1)(C, TH)
        # jax.hessian is forward-over-reverse (jacfwd of jacrev), NiLang's Hessians; the
        # state's second derivatives are test_check_grads_order_2's (slow)
        assert leaf_rel_error(jax.hessian(Lr, argnums=1)(C, TH), H_ref) < 1e-7

    @pytest.mark.slow  # (about 18 s; test_hessians covers second order in the default run)
    def test_check_grads_order_2(self):
        f = jr.reversible(coupled_fori(5))
        check_grads(
            lambda x, y, th: two_leaf_loss(f)((x, y), th),
            (C[0], C[1], TH),
            order=2,
            modes=["rev", "fwd"],
        )

    def test_inside_an_outer_scan(self):
        inner = jr.reversible(coupled_fori(5))
        ref = coupled_fori(5)

        def outer(f):
            def g(c, th):
                c, _ = jax.lax.scan(lambda c, t: (f(c, th * t), None), c, jnp.array([1.0, 0.5]))
                return two_leaf_loss(lambda c, th: c)(c, th)

            return g

        assert (
            leaf_rel_error(
                jax.grad(outer(inner), argnums=(0, 1))(C, TH),
                jax.grad(outer(ref), argnums=(0, 1))(C, TH),
            )
            < 1e-11
        )

    def test_complex_state(self):
        def f(z, th):
            def body(i, z):
                z = z * jnp.exp(1j * th)
                return z + 0.05 * th

            return jax.lax.fori_loop(0, 25, body, z)

        z = jnp.array([1.0 + 2.0j, -0.5 + 0.1j])
        L = lambda f: lambda z, th: jnp.sum(jnp.abs(f(z, th)) ** 2 + jnp.real(f(z, th)))
        assert (
            leaf_rel_error(
                jax.grad(L(jr.reversible(f)), argnums=(0, 1))(z, 0.3),
                jax.grad(L(f), argnums=(0, 1))(z, 0.3),
            )
            < 1e-12
        )


# --------------------------------------------------------------------------- lossy steps


def relu_body(x, th):
    def b(c, _):
        return jax.nn.relu(c * th) + 0.1 * jnp.sin(c), None  # LOSSY-LINE

    return jax.lax.scan(b, x, None, length=20)[0]


def _line_of(tag):
    with open(THIS_FILE) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith("# " + tag))


def test_lossy_relu_exact_gradients_and_report():
    x = jnp.linspace(-1.0, 1.0, 6)
    L = lambda f: lambda x, th: jnp.sum(f(x, th) ** 2)
    g_ref = jax.grad(L(relu_body), argnums=(0, 1))(x, 1.1)
    g = jax.grad(L(jr.reversible(relu_body)), argnums=(0, 1))(x, 1.1)
    assert leaf_rel_error(g, g_ref) < 1e-13
    rep = jr.memory_report(relu_body, x, 1.1, checkpoint_every=None)
    assert rep.total_bytes == 20 * 6 * 8  # one float64[6] per iteration
    [e] = rep.entries
    assert e["count"] == 20 and e["bytes"] == 48
    assert f"test_reversible.py:{_line_of('LOSSY-LINE')}" in e["where"], str(rep)
    assert "per iteration" in str(rep)


def test_overwritten_carry_is_stored():
    def f(c, th):
        def body(c, _):
            x, y = c
            x = x + jnp.tanh(th * y)
            y = jnp.full_like(y, 0.5) * th  # overwrites y: its old value is lost
            return (x, y), None

        return jax.lax.scan(body, c, None, length=10)[0]

    L = two_leaf_loss(f)
    g_ref = jax.grad(L, argnums=(0, 1))(C, 0.7)
    g = jax.grad(two_leaf_loss(jr.reversible(f)), argnums=(0, 1))(C, 0.7)
    assert leaf_rel_error(g, g_ref) < 1e-13
    rep = jr.memory_report(f, C, 0.7, checkpoint_every=None)
    assert rep.total_bytes == 10 * 7 * 8, str(rep)


def test_invertible_program_stores_nothing():
    rep = jr.memory_report(coupled_scan(100), C, TH, checkpoint_every=None)
    assert rep.entries == [] and rep.total_bytes == 0
    assert "stores nothing" in str(rep)


def test_lossy_straight_line():
    def f(x, w):
        h = jnp.maximum(x @ w, 0.0)
        return h + 0.5 * x

    x = jnp.linspace(-1.0, 1.0, 4)
    w = jnp.eye(4) + 0.1
    L = lambda f: lambda x, w: jnp.sum(jnp.sin(f(x, w)))
    assert (
        leaf_rel_error(
            jax.grad(L(jr.reversible(f)), argnums=(0, 1))(x, w),
            jax.grad(L(f), argnums=(0, 1))(x, w),
        )
        < 1e-13
    )
    assert jr.memory_report(f, x, w, checkpoint_every=None).total_bytes == 4 * 8


# --------------------------------------------------------------------------- while and cond


def while_prog(x, th):
    def body(c):
        (a, b), k = c
        a = a + th * jnp.tanh(b)
        return (a, b + jnp.sin(a)), k + 1

    return jax.lax.while_loop(lambda c: c[1] < 7, body, x)


def fori_ref(x, th):
    def body(i, c):
        a, b = c
        a = a + th * jnp.tanh(b)
        return a, b + jnp.sin(a)

    return jax.lax.fori_loop(0, 7, body, x)


def test_lax_while_loop_reverse_mode():
    x = (jnp.linspace(-1, 1, 5), jnp.linspace(0, 2, 5))
    with pytest.raises(ValueError, match="Reverse-mode differentiation does not work"):
        jax.grad(lambda th: jnp.sum(while_prog((x, 0), th)[0][0]))(0.3)
    L = lambda x, th: jnp.sum(jr.reversible(while_prog)((x, 0), th)[0][0] ** 2)
    g = jax.grad(L, argnums=(0, 1))(x, 0.3)
    g_ref = jax.grad(lambda x, th: jnp.sum(fori_ref(x, th)[0] ** 2), argnums=(0, 1))(x, 0.3)
    assert leaf_rel_error(g, g_ref) < 1e-13
    rep = jr.memory_report(while_prog, (x, 0), 0.3, checkpoint_every=None)
    assert rep.total_bytes == 4 and "trip count" in str(rep)
    # under jit and vmap too
    gj = jax.jit(jax.grad(L, argnums=(0, 1)))(x, 0.3)
    assert leaf_rel_error(gj, g_ref) < 1e-13


def test_lax_while_loop_data_dependent_trip_count():
    def f(c, th):
        return jax.lax.while_loop(
            lambda c: c[1] < 3.0, lambda c: (c[0] * th, c[1] + jnp.abs(th) * 0.7 + 0.1), c
        )

    L = lambda th: jnp.sum(jr.reversible(f)((jnp.ones(2), 0.0), th)[0])
    th = 0.5
    steps = int(np.ceil(3.0 / (0.5 * 0.7 + 0.1)))
    assert abs(jax.grad(L)(th) - 2 * steps * th ** (steps - 1)) < 1e-12


def test_jr_while_loop_needs_no_record():
    def f(x, th):
        def body(c):
            (a, b), k = c
            a = a + th * jnp.tanh(b)
            return (a, b + jnp.sin(a)), k + 1

        return jr.while_loop(lambda c: c[1] < 7, body, x, lambda c: c[1] > 0)

    x = (jnp.linspace(-1, 1, 5), jnp.linspace(0, 2, 5))
    L = lambda x, th: jnp.sum(jr.reversible(f)((x, 0), th)[0][0] ** 2)
    g_ref = jax.grad(lambda x, th: jnp.sum(fori_ref(x, th)[0] ** 2), argnums=(0, 1))(x, 0.3)
    assert leaf_rel_error(jax.grad(L, argnums=(0, 1))(x, 0.3), g_ref) < 1e-13
    assert jr.memory_report(f, (x, 0), 0.3, checkpoint_every=None).total_bytes == 0


@pytest.mark.parametrize("shift", [0.0, -3.0])
def test_lax_cond_records_branch_index(shift):
    def f(x, th):
        return jax.lax.cond(jnp.sum(x) > 0, lambda x: x * th + 1.0, lambda x: jnp.exp(x) - th, x)

    x = jnp.linspace(-1.0, 1.5, 4) + shift
    L = lambda f: lambda x, th: jnp.sum(f(x, th) ** 2)
    assert (
        leaf_rel_error(
            jax.grad(L(jr.reversible(f)), argnums=(0, 1))(x, 0.7),
            jax.grad(L(f), argnums=(0, 1))(x, 0.7),
        )
        < 1e-13
    )
    rep = jr.memory_report(f, x, 0.7, checkpoint_every=None)
    assert rep.total_bytes == 4 and "branch index" in str(rep)


def test_jr_cond_needs_no_record():
    def f(x, th):
        return jr.cond(
            jnp.sum(x) > 0,
            lambda x: x * 2.0 + 10.0,
            lambda x: x * 0.5 - 10.0,
            x,
            post=lambda y: jnp.sum(y) > 0,
        )

    x = jnp.linspace(-1.0, 1.5, 4)
    L = lambda f: lambda x: jnp.sum(f(x, 0.0) ** 2)
    assert leaf_rel_error(jax.grad(L(jr.reversible(f)))(x), jax.grad(L(f))(x)) < 1e-14
    assert leaf_rel_error(jax.grad(L(jr.reversible(f)))(-x - 1), jax.grad(L(f))(-x - 1)) < 1e-14
    assert jr.memory_report(f, x, 0.0, checkpoint_every=None).total_bytes == 0


# --------------------------------------------------------------------------- memory shape


def _temp(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_memory_is_flat_in_depth():
    c = (jnp.linspace(0.0, 1.0, 4096), jnp.linspace(1.0, 2.0, 4096))
    mem = {}
    for d in (50, 500):  # fully reversible: flat
        mem[d] = _temp(
            jax.grad(
                two_leaf_loss(jr.reversible(coupled_scan(d), checkpoint_every=None)), argnums=(0, 1)
            ),
            c,
            TH,
        )
    grad500 = _temp(jax.grad(two_leaf_loss(coupled_scan(500)), argnums=(0, 1)), c, TH)
    assert mem[500] <= 1.1 * mem[50]
    assert mem[500] * 100 < grad500
    # the default: ⌈√500⌉ = 23 checkpoints and a segment's carries, 2√T in all
    carry = 2 * 4096 * 8
    dflt = _temp(jax.grad(two_leaf_loss(jr.reversible(coupled_scan(500))), argnums=(0, 1)), c, TH)
    assert dflt <= mem[500] + 2 * 23 * carry * 1.25
    assert dflt * 5 < grad500


def test_memory_of_unrolled_blocks_below_grad():
    net, _ = unrolled(n_blocks=30, width=64)
    ws = [jax.random.normal(jax.random.PRNGKey(i), (64, 64)) * 0.1 for i in range(30)]
    c = (jnp.ones((64, 64)), jnp.zeros((64, 64)))
    m_ref = _temp(jax.grad(two_leaf_loss(net), argnums=(0, 1)), c, ws)
    m = _temp(jax.grad(two_leaf_loss(jr.reversible(net)), argnums=(0, 1)), c, ws)
    assert m * 4 < m_ref


def test_a_weight_read_by_many_stages_of_a_step_is_not_held_once_per_read():
    """A loop body that reads one weight in k places (a Runge–Kutta step's stages of an MLP
    field) gets k cotangents of it per iteration. They are added into one running sum one at
    a time (`sweep.sums`), not as one fused sum over all k (which XLA:CPU makes of a chain of
    additions, holding every stage's weight gradient at once: 12 reads took 147 KB more
    scratch than 3, 9 weights' worth, against 69 KB, the stages' activations)."""

    def loss_of(k):
        def body(c, W):
            x1, x2 = c
            for i in range(k):  # (each stage reads W; its VJP gives W's cotangent a term)
                x1, x2 = x2, x1 + 0.1 * jnp.tanh(x2 @ W) * (i + 1) / k
            return x1, x2

        def loss(x, W):
            y = jr.reversible(
                lambda x, W: lax.scan(lambda c, _: (body(c, W), None), x, None, length=20)[0],
                checkpoint_every=None,
            )(x, W)
            return jnp.sum(y[0] ** 2) + jnp.sum(jnp.sin(y[1]))

        return loss

    x = (jnp.ones((32, 64)) * 0.1, jnp.zeros((32, 64)))
    W = jax.random.normal(jax.random.PRNGKey(0), (64, 64)) * 0.1
    mem = {k: _temp(jax.grad(loss_of(k), argnums=(0, 1)), x, W) for k in (3, 12)}
    assert jax.default_backend() != "cpu" or mem[12] - mem[3] < 6 * W.nbytes, mem


def test_store_shows_in_memory():
    # stored residuals grow with depth, and the report says by how much
    m = {
        d: _temp(
            jax.grad(
                lambda x: jnp.sum(
                    jr.reversible(
                        lambda x: jax.lax.scan(
                            lambda c, _: (jax.nn.relu(c) + 0.1, None), x, None, length=d
                        )[0]
                    )(x)
                )
            ),
            jnp.ones(1024),
        )
        for d in (10, 100)
    }
    assert m[100] > m[10] + 80 * 1024 * 8 * 0.9


# --------------------------------------------------------------------------- errors


def test_lossy_while_body_error_names_line():
    def f(c):
        return jax.lax.while_loop(
            lambda c: c[1] < 3,
            lambda c: (jax.nn.relu(c[0]) - 1.0, c[1] + 1),  # WHILE-LOSSY
            c,
        )

    with pytest.raises(jr.NotInvertibleError) as ei:
        jax.grad(lambda x: jnp.sum(jr.reversible(f)((x, 0))[0]))(jnp.ones(3))
    msg = str(ei.value)
    assert f"test_reversible.py:{_line_of('WHILE-LOSSY')}" in msg
    assert "while loop" in msg and "scan" in msg


def test_structure_mismatch_names_function():
    def shrink(x):
        return x[:2]

    with pytest.raises(ValueError, match="jaxrev.reversible: shrink"):
        jr.reversible(shrink)(jnp.ones(3))


@pytest.mark.parametrize("shift", [0.0, -3.0])
def test_lossy_step_inside_a_cond_branch(shift):
    def f(x, th):
        return jax.lax.cond(
            jnp.sum(x) > 0,
            lambda x: jnp.maximum(x * th, 0.0) + 0.5,  # COND-LOSSY
            lambda x: x * th - 1.0,
            x,
        )

    x = jnp.linspace(-1.0, 1.5, 4) + shift
    L = lambda f: lambda x, th: jnp.sum(jnp.sin(f(x, th)))
    assert (
        leaf_rel_error(
            jax.grad(L(jr.reversible(f)), argnums=(0, 1))(x, 0.7),
            jax.grad(L(f), argnums=(0, 1))(x, 0.7),
        )
        < 1e-13
    )
    rep = jr.memory_report(f, x, 0.7, checkpoint_every=None)
    # the branch index and the lossy branch's input (zeros when the other branch ran)
    assert rep.total_bytes == 4 + 4 * 8, str(rep)
    assert f"test_reversible.py:{_line_of('COND-LOSSY')}" in str(rep)
    # vmapped: the index is batched
    xb = jnp.stack([x, -x - 2.0])
    tot = lambda f: lambda xb, th: jnp.sum(jax.vmap(L(f), (0, None))(xb, th))
    assert (
        leaf_rel_error(
            jax.grad(tot(jr.reversible(f)), argnums=(0, 1))(xb, 0.7),
            jax.grad(tot(f), argnums=(0, 1))(xb, 0.7),
        )
        < 1e-13
    )


# --------------------------------------------------------------------------- review findings


def test_grad_of_vmap_with_per_element_trip_counts():
    def wl(x):
        def body(s):
            a, b, i = s
            a = a + jnp.tanh(b)
            return a, b + jnp.sin(a), i + 1

        return jnp.stack(jax.lax.while_loop(lambda s: s[0] < 3.0, body, (x[0], x[1], 0))[:2])

    X = jnp.array([[0.1, 0.2], [0.5, 0.9]])  # the two elements stop after different counts
    ref = jax.jacfwd(lambda X: jax.vmap(wl)(X).sum())(X)
    assert leaf_rel_error(jax.grad(lambda X: jax.vmap(jr.reversible(wl))(X).sum())(X), ref) < 1e-12


def test_grad_of_vmap_jr_while_with_unbatched_parameter():
    def f(s, th):
        def body(c):
            a, b, k = c
            a = a + th * jnp.tanh(b)
            return a, b + jnp.sin(a), k + 1

        return jr.while_loop(lambda c: c[0] < 2.0, body, s, lambda c: c[2] > 0)

    def L(F):
        return lambda a, b, th: jnp.sum(jax.vmap(lambda a, b: F((a, b, 0), th)[0])(a, b))

    a, b = jnp.array([0.1, 1.5]), jnp.array([0.5, 0.9])
    ref = jax.jacfwd(L(f), 2)(a, b, 0.3)
    assert abs(float(jax.grad(L(jr.reversible(f)), 2)(a, b, 0.3)) - float(ref)) < 1e-12


def test_equation_without_outputs():
    def f(x):
        jax.debug.print("x={x}", x=x)
        return x * 2.0

    assert (
        leaf_rel_error(2 * jnp.ones(2), jax.grad(lambda x: jr.reversible(f)(x).sum())(jnp.ones(2)))
        == 0
    )


# ------------------------------------------------------------------ loops over parameters only


def test_loop_over_parameters_alone_runs_backwards():
    # the state joins only after the loop: the loop is computed forward from the parameter,
    # and its derivative must still run it backwards (a while loop jax.grad refuses; a scan
    # whose tape would grow with its length)
    def f(acc, x):
        s = jax.lax.while_loop(lambda c: c[0] < 5, lambda c: (c[0] + 1, c[1] * x), (0, x))[1]
        return acc + s

    g = jax.grad(lambda x: jr.reversible(f)(0.0, x))(1.1)
    assert abs(float(g) - 6 * 1.1**5) < 1e-12

    def h(acc, x):
        def body(c, _):
            a, b = c
            a = a + jnp.tanh(x * b)
            return (a, b + jnp.sin(a)), None

        a, b = jax.lax.scan(body, (x, x), None, length=length)[0]
        return acc + a + b

    x = jnp.full(512, 0.3)
    L = lambda run: jax.grad(lambda x: jnp.sum(run(jnp.zeros(512), x)))
    mems = []
    for length in (50, 200):
        assert leaf_rel_error(L(h)(x), L(jr.reversible(h))(x)) < 1e-11
        mems.append(_temp(L(jr.reversible(h, checkpoint_every=None)), x))
    assert mems[0] == mems[1]


def test_grad_of_vmap_through_while_loops_of_different_lengths_is_finite():
    # finished elements are back at their start, where the inverted step divides by k = 0
    def f(s, x):
        def body(c):
            k, s = c
            k = k + 1
            return k, s + x / k

        return jax.lax.while_loop(lambda c: c[0] < x, body, (jnp.zeros_like(x), s))[1]

    xs = jnp.array([2.0, 5.0, 3.5])
    ref = jnp.array([1.5, 1 + 1 / 2 + 1 / 3 + 1 / 4 + 1 / 5, 1 + 1 / 2 + 1 / 3 + 1 / 4])
    g1 = jax.grad(lambda xs: jnp.sum(jax.vmap(lambda x: jr.reversible(f)(0.0, x))(xs)))(xs)
    g2 = jax.grad(lambda xs: jnp.sum(jr.reversible(jax.vmap(f))(jnp.zeros(3), xs)))(xs)
    assert leaf_rel_error(ref, g1) < 1e-14 and leaf_rel_error(ref, g2) < 1e-14
