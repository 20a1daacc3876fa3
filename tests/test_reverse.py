"""jr.reverse: round trips of the issue's programs, partial inversion, lumps, loops, pytrees,
dtypes, and composition with jit / vmap / grad."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaf_rel_error
from jax import lax
from jax import test_util as jtu

import jaxrev as jr


def key(i=0):
    return jax.random.PRNGKey(i)


# ----------------------------------------------------------------------------- programs


def affine_coupling(x, params):
    w1, b1, w2 = params
    a, b = x[: x.shape[0] // 2], x[x.shape[0] // 2 :]
    h = jnp.tanh(a @ w1 + b1)
    s, t = jnp.tanh(h @ w2), h @ w2.T
    b = b * jnp.exp(s) + t
    # second half-step conditions a on the new b
    a = a + jnp.sinh(b * 0.5)
    return jnp.concatenate([a, b])


def additive_coupling(x, w):
    a, b = jnp.split(x, 2)
    b = b + jnp.tanh(w @ a)
    a = a - jnp.sin(b) ** 3
    return jnp.concatenate([b, a])


def coupling_params(n, dtype):
    k1, k2, k3 = jax.random.split(key(1), 3)
    h = n // 2
    return (
        jax.random.normal(k1, (h, h), dtype) * 0.5,
        jax.random.normal(k2, (h,), dtype),
        jax.random.normal(k3, (h, h), dtype) * 0.5,
    )


def leapfrog(state, dt):
    """200 steps of a nonlinear (sine-Gordon-like) chain."""

    def force(q):
        return -jnp.sin(q) + 0.3 * (jnp.roll(q, 1) - 2 * q + jnp.roll(q, -1))

    def step(i, s):
        q, p = s
        p = p + 0.5 * dt * force(q)
        q = q + dt * p
        p = p + 0.5 * dt * force(q)
        return q, p

    return lax.fori_loop(0, 200, step, state)


def scan_with_xs(c, xs):
    def body(c, x):
        c = c * 1.05 + jnp.tanh(x) * c[::-1]
        return c, None

    return lax.scan(body, c, xs)[0]


def givens(v, theta):
    x, y = v
    c, s = jnp.cos(theta), jnp.sin(theta)
    return x * c - y * s, x * s + y * c


def cumsum_after_matmul(x, W):
    return jnp.cumsum(x @ W, axis=0)


def doubling(c):
    return jr.while_loop(
        lambda c: c[1] < 1e3, lambda c: (c[0] + 1, c[1] * 2.0 + 1.0), c, lambda c: c[0] > 0
    )


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype,tol", [(jnp.float64, 1e-12), (jnp.float32, 1e-5)])
class TestRoundTrip:
    def test_affine_coupling(self, dtype, tol):
        x = jax.random.normal(key(), (8,), dtype)
        p = coupling_params(8, dtype)
        assert leaf_rel_error(jr.reverse(affine_coupling)(affine_coupling(x, p), p), x) < tol

    def test_additive_coupling(self, dtype, tol):
        x = jax.random.normal(key(), (10,), dtype)
        w = jax.random.normal(key(2), (5, 5), dtype)
        assert leaf_rel_error(jr.reverse(additive_coupling)(additive_coupling(x, w), w), x) < tol

    def test_leapfrog_200_steps(self, dtype, tol):
        q = jax.random.normal(key(), (16,), dtype)
        s = (q, jnp.cos(q))
        dt = jnp.asarray(0.02, dtype)
        assert leaf_rel_error(jr.reverse(leapfrog)(leapfrog(s, dt), dt), s) < tol

    def test_scan_with_xs(self, dtype, tol):
        c = jax.random.normal(key(), (6,), dtype)
        xs = jax.random.normal(key(3), (30, 6), dtype) * 0.1
        assert leaf_rel_error(jr.reverse(scan_with_xs)(scan_with_xs(c, xs), xs), c) < tol

    def test_givens_rotation(self, dtype, tol):
        v = (jax.random.normal(key(), (5,), dtype), jax.random.normal(key(4), (5,), dtype))
        th = jnp.asarray(0.7, dtype)
        assert leaf_rel_error(jr.reverse(givens)(givens(v, th), th), v) < tol

    def test_cumsum_after_matmul(self, dtype, tol):
        x = jax.random.normal(key(), (7, 3), dtype)
        W = (jnp.eye(3) + 0.3 * jax.random.normal(key(5), (3, 3))).astype(dtype)
        assert (
            leaf_rel_error(jr.reverse(cumsum_after_matmul)(cumsum_after_matmul(x, W), W), x) < tol
        )

    def test_reversible_while_loop(self, dtype, tol):
        c = (jnp.asarray(0), jnp.asarray(1.7, dtype))
        out = doubling(c)
        assert int(out[0]) > 5
        back = jr.reverse(doubling)(out)
        assert int(back[0]) == 0 and leaf_rel_error(back[1], c[1]) < tol


# ----------------------------------------------------------------------------- mechanisms


def test_partial_inversion_uses_known_values():
    # x2 = x + tanh(y) inverts once y is known (recovered first from y2 = 2 y)
    def f(s):
        x, y = s
        return x + jnp.tanh(y), 2.0 * y

    s = (jnp.arange(3.0), jnp.linspace(-1, 1, 3))
    assert leaf_rel_error(jr.reverse(f)(f(s)), s) < 1e-15


def test_linear_lump_dense_mixing():
    # three vectors mixed by a matrix written elementwise: inverted as one elementwise lump
    def f(v, m):
        a, b, c = v
        return (
            m[0, 0] * a + m[0, 1] * b + m[0, 2] * c,
            m[1, 0] * a + m[1, 1] * b + m[1, 2] * c,
            m[2, 0] * a + m[2, 1] * b + m[2, 2] * c,
        )

    m = jnp.eye(3) + 0.4 * jax.random.normal(key(), (3, 3))
    v = tuple(jax.random.normal(key(i), (4,)) for i in range(3))
    assert leaf_rel_error(jr.reverse(f)(f(v, m), m), v) < 1e-12


def test_linear_lump_non_elementwise():
    # x and y mixed through a reversal: the lump is not elementwise, solved densely
    def f(v):
        x, y = v
        return x + y[::-1], x - 2.0 * y

    v = (jnp.arange(4.0), jnp.ones(4) * 3.0)
    assert leaf_rel_error(jr.reverse(f)(f(v)), v) < 1e-12


def test_select_with_known_predicate_is_case_split():
    def f(x, mask):
        return jnp.where(mask, jnp.exp(x), 3.0 * x - 1.0)

    x = jax.random.normal(key(), (9,))
    mask = x > 0.1
    assert leaf_rel_error(jr.reverse(f)(f(x, mask), mask), x) < 1e-14


def test_plain_cond_with_known_predicate():
    def f(x, flag):
        return lax.cond(flag > 0, lambda v: v * 2.0, lambda v: jnp.exp(v), x)

    x = jnp.linspace(-1, 1, 4)
    for flag in (1.0, -1.0):
        assert leaf_rel_error(jr.reverse(f)(f(x, flag), flag), x) < 1e-15


def test_cond_waits_for_an_operand_forwarded_around_it():
    """JAX forwards `c`, which the branch reads but returns unchanged, around the cond; the
    walk learns it only afterwards, from the leaky ReLU's choice group (found by the grammar
    soak: before, the cond's rule raised at its first try, naming the branch's `select_n`)."""

    def f(s, w):
        b, c = s

        def mixed(b, c):
            scaled = b * jnp.exp(0.3 * jnp.tanh(c)) + jnp.tanh(c)
            return jnp.where(jnp.array([True, False]), b, scaled), c

        b, c = lax.cond(w > 0, mixed, lambda b, c: (b * 1.25, c), b, c)
        return b, jnp.where(c > 0, c, 0.125 * c)

    s = (jnp.array([0.005, 0.0067]), jnp.array([0.0083, -0.01]))
    for w in (0.8, -0.8):
        for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
            assert leaf_rel_error(inv(f(s, w), w), s) < 1e-14


def test_jaxrev_cond_uses_post_condition():
    def f(x):
        return jr.cond(
            x.sum() > 0,
            lambda v: v * 2.0 + 1.0,
            lambda v: v - 100.0,
            x,
            post=lambda v: v.sum() > -50.0,
        )

    for x in (jnp.ones(3), -jnp.ones(3)):
        assert leaf_rel_error(jr.reverse(f)(f(x)), x) < 1e-15


def test_slices_joined_back():
    def f(x):
        a, b, c = x[:2], x[2:5], x[5:]
        return jnp.concatenate([c * 2.0, a, jnp.exp(b)])

    x = jnp.arange(7.0) / 7
    assert leaf_rel_error(jr.reverse(f)(f(x)), x) < 1e-15


def test_broadcast_scalar_parameter_and_reshape_transpose():
    def f(x, s):
        y = jnp.reshape(x, (3, 4)).T * s
        return jnp.reshape(jnp.flip(y, 0) + jnp.broadcast_to(s, (4, 3)), (12,))

    x = jnp.arange(12.0)
    assert leaf_rel_error(jr.reverse(f)(f(x, 1.5), 1.5), x) < 1e-15


def test_unary_rules():
    def f(x):
        x = jnp.exp(x)
        x = jnp.log1p(x)
        x = jnp.sinh(x)
        x = jnp.expm1(0.1 * jnp.arcsinh(x))
        x = jax.nn.sigmoid(x)
        x = jnp.sqrt(x) ** 3
        x = jnp.log(x) / 2.0
        x = jnp.cbrt(x)
        return jnp.tanh(x)

    x = jnp.linspace(-1.0, 1.0, 7)
    assert leaf_rel_error(jr.reverse(f)(f(x)), x) < 1e-12


def test_pow_with_known_exponent_and_base():
    def f(x, p):
        return 2.0 ** (x**p)

    x = jnp.linspace(0.5, 2.0, 5)
    assert leaf_rel_error(jr.reverse(f)(f(x, 1.7), 1.7), x) < 1e-13


def test_widening_convert_and_complex():
    def f(x):
        return (x.astype(jnp.float64) * 2.0).astype(jnp.float64)

    x32 = jnp.arange(3.0, dtype=jnp.float32)

    def g(x):  # float32 state widened inside, narrowed back is lossy: keep it wide
        return x * 3.0

    assert leaf_rel_error(jr.reverse(g)(g(x32)), x32) < 1e-7

    def h(z, w):
        return jnp.conj(z * w) + 1j

    z = jnp.array([1 + 2j, -0.5j, 3.0])
    w = jnp.array([0.5 - 1j, 2.0, 1j])
    out = jr.reverse(h)(h(z, w), w)
    assert out.dtype == jnp.complex128 and leaf_rel_error(out, z) < 1e-15


def test_dot_general_batched_and_rhs():
    def f(x, W):  # W (B, n, n) batched matrix, x (B, n, m) on the right
        return jnp.einsum("bij,bjk->bik", W, x)

    W = jnp.eye(3) + 0.2 * jax.random.normal(key(), (2, 3, 3))
    x = jax.random.normal(key(1), (2, 3, 4))
    assert leaf_rel_error(jr.reverse(f)(f(x, W), W), x) < 1e-12

    def g(x, W):
        return jnp.einsum("ij,ik->kj", x, W)  # contract the first axes of x and W

    W2 = jnp.eye(4) + 0.2 * jax.random.normal(key(2), (4, 4))
    x2 = jax.random.normal(key(3), (4, 3))
    assert leaf_rel_error(jr.reverse(g)(g(x2, W2), W2), x2) < 1e-12


def test_scatter_add_with_known_update():
    def f(x, u):
        return x.at[1:].add(u * 2.0)

    x, u = jnp.arange(5.0), jnp.ones(4)
    assert leaf_rel_error(jr.reverse(f)(f(x, u), u), x) < 1e-15


def test_nested_loops_and_scan_ys():
    def f(x, xs):
        def outer(c, xi):
            c = lax.fori_loop(0, 3, lambda i, c: c + jnp.tanh(xi * i), c)
            return c * 1.1, c.sum()

        c, ys = lax.scan(outer, x, xs)
        return c

    x = jnp.arange(4.0)
    xs = jnp.linspace(0, 1, 5)
    assert leaf_rel_error(jr.reverse(f)(f(x, xs), xs), x) < 1e-14


def test_scan_recovers_xs_from_ys():
    # the state includes xs: each x_t comes back from y_t, then c_t from c_{t+1}
    def f(s):
        c, xs = s

        def body(c, x):
            return c * 0.5 + x, jnp.exp(x) * 2.0

        c, ys = lax.scan(body, c, xs)
        return c, ys

    s = (jnp.asarray(0.3), jnp.linspace(-1, 1, 6))
    assert leaf_rel_error(jr.reverse(f)(f(s)), s) < 1e-13


def test_reverse_scan_direction_and_unroll():
    def f(x):
        return lax.scan(
            lambda c, _: (jnp.sinh(c) + 0.1, None), x, None, length=7, reverse=True, unroll=3
        )[0]

    x = jnp.linspace(-0.5, 0.5, 3)
    assert leaf_rel_error(jr.reverse(f)(f(x)), x) < 1e-13


# ----------------------------------------------------------------------------- pytrees, argnums


class State(NamedTuple):
    q: jax.Array
    p: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    w: jax.Array
    dt: float = dataclasses.field(metadata=dict(static=True), default=0.1)


def test_pytree_state_and_params():
    def f(s: State, prm: Params, extra):
        p = s.p - prm.dt * jnp.tanh(s.q @ prm.w) * extra["scale"]
        return State(q=s.q + prm.dt * p, p=p)

    s = State(jnp.arange(3.0), jnp.ones(3))
    prm = Params(w=jnp.eye(3) * 0.5)
    extra = {"scale": jnp.asarray(2.0)}
    back = jr.reverse(f)(f(s, prm, extra), prm, extra)
    assert isinstance(back, State) and leaf_rel_error(back, s) < 1e-15


def test_dict_state():
    def f(d):
        return {"a": d["a"] + d["b"] ** 3, "b": jnp.exp(d["b"])}

    d = {"a": jnp.arange(2.0), "b": jnp.array([0.1, -0.2])}
    assert leaf_rel_error(jr.reverse(f)(f(d)), d) < 1e-15


def test_tuple_argnums():
    def f(x, theta, y):
        return x + jnp.tanh(theta * y), y * jnp.exp(theta)

    x, y, th = jnp.arange(3.0), jnp.ones(3) * 0.5, jnp.asarray(0.3)
    inv = jr.reverse(f, argnums=(0, 2))
    x2, y2 = f(x, th, y)
    bx, by = inv(x2, th, y2)
    assert leaf_rel_error((bx, by), (x, y)) < 1e-15
    # the state may come in any position order
    inv2 = jr.reverse(lambda y, x: f(x, th, y)[::-1], argnums=(0, 1))
    assert leaf_rel_error(inv2(*f(x, th, y)[::-1]), (y, x)) < 1e-15


def test_parameter_first_argnums():
    def f(theta, x):
        return x * jnp.exp(theta)

    assert (
        leaf_rel_error(jr.reverse(f, argnums=1)(0.5, f(0.5, jnp.arange(3.0))), jnp.arange(3.0))
        < 1e-15
    )


# ----------------------------------------------------------------------------- composition


def test_jit_of_reverse_and_reverse_of_jit():
    w = jax.random.normal(key(2), (4, 4))
    x = jax.random.normal(key(), (8,))
    y = additive_coupling(x, w)
    assert leaf_rel_error(jax.jit(jr.reverse(additive_coupling))(y, w), x) < 1e-12
    assert leaf_rel_error(jr.reverse(jax.jit(additive_coupling))(y, w), x) < 1e-12


def test_vmap_of_reverse_and_reverse_of_vmap():
    w = jax.random.normal(key(2), (4, 4))
    xs = jax.random.normal(key(), (5, 8))
    ys = jax.vmap(additive_coupling, (0, None))(xs, w)
    assert leaf_rel_error(jax.vmap(jr.reverse(additive_coupling), (0, None))(ys, w), xs) < 1e-12
    fv = jax.vmap(additive_coupling, (0, None))
    assert leaf_rel_error(jr.reverse(fv)(ys, w), xs) < 1e-12


def test_vmap_over_reversible_control_flow():
    c = (jnp.zeros(4, jnp.int64), jnp.array([0.5, 3.0, 40.0, 900.0]))
    out = jax.vmap(doubling)(c)
    back = jax.vmap(jr.reverse(doubling))(out)
    assert leaf_rel_error(back, c) < 1e-13
    assert leaf_rel_error(jr.reverse(jax.vmap(doubling))(out), c) < 1e-13

    def f(x):
        return jr.cond(x[0] > 0, lambda v: v * 2.0, lambda v: v - 10.0, x, post=lambda v: v[0] > 0)

    xs = jnp.array([[1.0, 2.0], [-1.0, 0.5], [3.0, -4.0]])
    assert leaf_rel_error(jax.vmap(jr.reverse(f))(jax.vmap(f)(xs)), xs) < 1e-15
    assert leaf_rel_error(jr.reverse(jax.vmap(f))(jax.vmap(f)(xs)), xs) < 1e-15


def test_grad_through_reverse():
    w = jax.random.normal(key(2), (3, 3))
    y = jax.random.normal(key(), (6,))

    def loss(y, w):
        return jnp.sum(jr.reverse(additive_coupling)(y, w) ** 2)

    def ref(y, w):  # the analytic inverse of additive_coupling
        b, a = jnp.split(y, 2)
        a = a + jnp.sin(b) ** 3
        b = b - jnp.tanh(w @ a)
        return jnp.sum(jnp.concatenate([a, b]) ** 2)

    for argnum in (0, 1):
        g = jax.grad(loss, argnum)(y, w)
        gr = jax.grad(ref, argnum)(y, w)
        assert leaf_rel_error(g, gr) < 1e-12
    jtu.check_grads(lambda y: loss(y, w), (y,), order=2, modes=["rev", "fwd"])


def test_reverse_of_reverse_is_forward():
    w = jax.random.normal(key(2), (4, 4))
    x = jax.random.normal(key(), (8,))
    ff = jr.reverse(jr.reverse(additive_coupling))
    assert leaf_rel_error(ff(x, w), additive_coupling(x, w)) < 1e-12
    s = (jnp.asarray(0), jnp.asarray(3.0))
    assert leaf_rel_error(jr.reverse(jr.reverse(doubling))(s), doubling(s)) < 1e-15
    q = jnp.linspace(0, 1, 16)
    dt = jnp.asarray(0.02)
    assert (
        leaf_rel_error(jr.reverse(jr.reverse(leapfrog))((q, q), dt), leapfrog((q, q), dt)) < 1e-12
    )


def test_reverse_of_while_loop_under_jit():
    out = doubling((jnp.asarray(0), jnp.asarray(2.0)))
    back = jax.jit(jr.reverse(doubling))(out)
    assert int(back[0]) == 0 and abs(float(back[1]) - 2.0) < 1e-12


def test_check_reversible_report():
    q = jnp.linspace(0, 1, 16)
    rep = jr.check_reversible(leapfrog, (q, q), jnp.asarray(0.02))
    assert rep.max_error < 1e-12
    assert "round-trip relative error" in str(rep)
    assert isinstance(rep.leaf_errors, list) and len(rep.leaf_errors) == 2


# ----------------------------------------------------------------------------- user rules


def _make_scale_p():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    p = Primitive("test_scale3")
    p.def_impl(lambda x: 3.0 * x)
    p.def_abstract_eval(lambda a: a)
    mlir.register_lowering(p, mlir.lower_fun(lambda x: 3.0 * x, multiple_results=False))
    return p


scale3_p = _make_scale_p()


def test_register_inverse_for_a_primitive_defined_here():
    f = lambda x: jnp.exp(scale3_p.bind(x))
    x = jnp.linspace(-1, 1, 4)
    with pytest.raises(jr.NotInvertibleError, match="test_scale3"):
        jr.reverse(f)(f(x))
    jr.register_inverse(scale3_p, lambda out, x: [out / 3.0])
    try:
        assert leaf_rel_error(jr.reverse(f)(f(x)), x) < 1e-15
        assert leaf_rel_error(jax.jit(jr.reverse(f))(f(x)), x) < 1e-15
    finally:
        jr.transforms.inverse_rules.pop(scale3_p)


def test_register_inverse_wrong_output_names_the_rule():
    def bad_rule(out, x):
        return out / 3.0  # not a list with one entry per input

    jr.register_inverse(scale3_p, bad_rule)
    try:
        with pytest.raises(TypeError, match="bad_rule.*test_scale3"):
            jr.reverse(lambda x: scale3_p.bind(x))(jnp.ones(2))
    finally:
        jr.transforms.inverse_rules.pop(scale3_p)
    with pytest.raises(TypeError, match="Primitive"):
        jr.register_inverse("add", bad_rule)


def test_two_selects_case_split_do_not_recurse():
    # two case splits in one program (the nested-split recursion itself is pinned down by
    # test_reversible.py::test_lossy_step_inside_a_cond_branch, whose vmapped cond recursed)
    def f(x, p):
        y = jnp.where(p > 0, x * 2.0, x * 3.0)
        return jnp.where(p > 1, y + 1.0, jnp.exp(y))

    x = jnp.linspace(-1.0, 1.0, 5)
    p = jnp.array([-1.0, 0.5, 2.0, 0.5, 3.0])
    assert jnp.max(jnp.abs(jr.reverse(f)(f(x, p), p) - x)) < 1e-12


def test_scan_final_carry_recovered_from_its_per_iteration_output():
    # the final carry is discarded, but the body also emits it: its last entry stands in
    def body(c, _):
        c = c * 2.0 + 1.0
        return c, c

    def f(x):
        return jax.lax.scan(body, x[0], None, length=1)[1]

    x = jnp.array([0.75])
    assert jnp.max(jnp.abs(jr.reverse(f)(f(x)) - x)) == 0.0


def test_a_step_whose_last_input_arrives_while_it_waits_runs_before_the_loop_reading_it():
    # flowjax's triangular spline flow: the loop over layers reads matrices computed from
    # constants; a step of that computation, woken when its first input was known, waited in
    # the walk's `whole` queue behind the loop and ran only after the loop had been inverted
    # with the matrix taken for unknown (refused at `triangular_solve`)
    from jax.scipy.linalg import solve_triangular

    W = jnp.arange(18.0, dtype=jnp.float32).reshape(2, 3, 3) / 10 + jnp.eye(3)

    def f(x):
        p = jnp.sin(W)  # known first: wakes the loop, which reads it
        u = jnp.tril(W)  # wakes `m`, whose other input is computed later
        v = jnp.exp(jnp.cos(jnp.tanh(W)))
        m = u * jnp.tril(v) + jnp.eye(3)

        def body(c, pm):
            p_i, m_i = pm
            return solve_triangular(m_i, c, lower=True) + p_i[0], None

        return jax.lax.scan(body, x, (p, m))[0]

    x = jnp.array([0.3, -1.2, 2.0])
    np.testing.assert_allclose(jr.reverse(f)(f(x)), x, rtol=1e-5)
    np.testing.assert_allclose(jax.jit(jr.reverse(f))(f(x)), x, rtol=1e-5)


def single_slot_chain(n=30):
    w = jnp.linspace(-1.0, 1.0, n)

    def f(x):
        def body(prev, xw):  # slot i is pushed by the new value of slot i - 1
            xi, wi = xw
            xi = xi + jnp.tanh(wi * prev)
            return xi, xi

        _, rest = jax.lax.scan(body, x[0], (x[1:], w[1:]))
        return jnp.concatenate([x[:1], rest])  # x[:1] and x[0] slice x twice

    return f


@pytest.mark.parametrize("use_jit", [False, True])
def test_chain_over_slots_inverts_in_parallel(use_jit):
    # the carry the body also emits is known at every iteration once its start is: the
    # start comes back through an identical slice (x[:1] in the output, x[0] into the loop)
    f = single_slot_chain()
    x = jnp.sin(jnp.arange(30.0))
    inv = jax.jit(jr.reverse(f)) if use_jit else jr.reverse(f)
    assert jnp.max(jnp.abs(inv(f(x)) - x)) < 1e-13


@pytest.mark.parametrize(
    "name,f,x",
    [
        ("sqrt", lambda x: jnp.sqrt(x) * 2.0, jnp.array([0.5, 2.0, 9.0])),
        ("rsqrt", lambda x: jax.lax.rsqrt(x) + 1.0, jnp.array([0.5, 2.0, 9.0])),
        ("cbrt", lambda x: jnp.cbrt(x) - 0.5, jnp.array([-8.0, 0.3, 27.0])),
        ("logistic", lambda x: jax.nn.sigmoid(x) * 0.5, jnp.array([-3.0, 0.1, 2.0])),
    ],
)
def test_reverse_of_reverse_through_roots_and_logistic(name, f, x):
    """The inverses of sqrt, rsqrt, cbrt and logistic carry their own inverse, so reversing
    the reversed program computes the program again (eager, jit, and its derivative)."""
    y = f(x)
    inv = jr.reverse(f)
    np.testing.assert_allclose(inv(y), x, rtol=1e-12)
    twice = jr.reverse(inv)
    np.testing.assert_allclose(twice(x), y, rtol=1e-12)
    np.testing.assert_allclose(jax.jit(twice)(x), y, rtol=1e-12)
    np.testing.assert_allclose(jax.jacfwd(twice)(x), jax.jacfwd(f)(x), rtol=1e-10)
    np.testing.assert_allclose(jax.jacfwd(inv)(y), np.linalg.inv(jax.jacfwd(f)(x)), rtol=1e-10)
