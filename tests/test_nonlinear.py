"""Nonlinear lumps (docs/design.md §3.6): exact linear elimination and Newton's method.

Round trips, `reversible` gradients against `jax.grad`, `jit`, `vmap`, memory flat in the
number of steps, derivatives by the implicit function theorem, and the errors: no preimage
(`ReversibilityError`), a vanished Jacobian (`SingularJacobianError`), each naming the line.
The sharded runs are in `test_sharding.py`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abs_error, all_eqns, rel_error
from jax import lax
from jax import test_util as jtu
from programs.nonlinear import ROUND_TRIP, cases, heun, residual, simultaneous

import jaxrev as jr
from jaxrev.transforms.knowledge.context import Settings
from jaxrev.transforms.reverse import reverse_with

HERE = os.path.basename(__file__)
CASES = cases()


def _loss(f):
    def loss(s, p):
        out = jax.tree_util.tree_leaves(f(s, p))
        return sum(jnp.sum(jnp.sin(o) * (k + 1.0)) for k, o in enumerate(out))

    return loss


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_eager_and_jit(name):
    fun, s, p = CASES[name]
    y = fun(s, p)
    tol = ROUND_TRIP.get(name, 1e-10)
    assert abs_error(jr.reverse(fun)(y, p), s) <= tol
    assert abs_error(jax.jit(jr.reverse(fun))(y, p), s) <= tol


@pytest.mark.parametrize("name", list(CASES))
def test_reversible_gradient_equals_jax_grad_and_stores_nothing(name):
    fun, s, p = CASES[name]
    ref = jax.grad(_loss(fun), argnums=(0, 1))(s, p)
    got = jax.jit(jax.grad(_loss(jr.reversible(fun)), argnums=(0, 1)))(s, p)
    assert rel_error(got, ref) <= 1e-9
    rep = jr.memory_report(fun, s, p, checkpoint_every=None)
    assert rep.total_bytes == 0, str(rep)


@pytest.mark.parametrize(
    "name", ["simultaneous-1000", "heun-1000", "residual", "logit", "midpoint-100"]
)
def test_vmap(name):
    fun, s, p = CASES[name]
    batch = jax.tree_util.tree_map(lambda x: jnp.stack([x, 0.9 * x]), s)
    ys = jax.vmap(fun, in_axes=(0, None))(batch, p)
    assert abs_error(jax.jit(jax.vmap(jr.reverse(fun), in_axes=(0, None)))(ys, p), batch) <= 1e-10
    g = jax.jit(jax.vmap(jax.grad(_loss(jr.reversible(fun))), in_axes=(0, None)))(batch, p)
    ref = jax.vmap(jax.grad(_loss(fun)), in_axes=(0, None))(batch, p)
    assert rel_error(g, ref) <= 1e-9


def _temp(f, *args):
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize(
    "make,s,p",
    [
        (lambda n: simultaneous(n, h=0.05), CASES["simultaneous-50"][1], 0.7),
        (heun, CASES["heun-1000"][1], CASES["heun-1000"][2]),
    ],
    ids=["simultaneous", "heun"],
)
def test_temp_memory_is_flat_in_the_number_of_steps(make, s, p):
    grad = lambda n: jax.grad(
        _loss(jr.reversible(make(n), checkpoint_every=None)),  # noqa: E731
        argnums=(0, 1),
    )
    small, large = _temp(grad(100), s, p), _temp(grad(2000), s, p)
    assert large <= small * 1.05 + 4096, (small, large)
    assert _temp(jax.grad(_loss(make(2000)), argnums=(0, 1)), s, p) > 10 * large


def test_heun_inverts_by_elimination_alone():
    """The reversible Heun step is affine once f(z) counts as an unknown: no Newton needed."""
    fun, s, p = CASES["heun-1000"]
    y = fun(s, p)
    assert abs_error(reverse_with(fun, Settings(newton=False))(y, p), s) <= 1e-12


def test_derivatives_of_a_recovered_value_by_the_implicit_function_theorem():
    x = jnp.linspace(-2.0, 2.0, 5)
    inv = jr.reverse(residual)
    y = residual(x, 0.5)
    want = np.linalg.inv(jax.jacfwd(residual)(x, 0.5))
    np.testing.assert_allclose(jax.jit(jax.jacfwd(inv))(y, 0.5), want, atol=1e-13)
    np.testing.assert_allclose(jax.jit(jax.jacrev(inv))(y, 0.5), want, atol=1e-13)
    # with respect to the parameter: dx/da = -J^{-1} dF/da
    dxda = jax.jit(jax.jacfwd(inv, argnums=1))(y, 0.5)
    np.testing.assert_allclose(dxda, -want @ jnp.tanh(x), atol=1e-13)
    jtu.check_grads(jax.jit(lambda y: inv(y, 0.5)), (y,), order=1, modes=("fwd", "rev"))


def test_inverse_transforms_and_check_reversible_on_nonlinear_groups():
    x = jnp.linspace(-2.0, 2.0, 5)
    v = jnp.arange(1.0, 6.0)
    _, (t,) = jr.inverse_jvp(lambda x: residual(x, 0.5), (x,), v)
    np.testing.assert_allclose(t, jnp.linalg.solve(jax.jacfwd(residual)(x, 0.5), v), rtol=1e-12)
    rep = jr.check_reversible(residual, x, 0.5)
    assert rep.max_error < 1e-13
    fun, s, p = CASES["simultaneous-1000"]
    _, ivjp = jr.inverse_vjp(lambda a, b: fun((a, b), p), *s)
    w = ivjp((jnp.ones(16), jnp.zeros(16)))
    _, vjp = jax.vjp(lambda a, b: fun((a, b), p), *s)
    assert abs_error(vjp(w), (jnp.ones(16), jnp.zeros(16))) < 1e-9


def test_no_preimage_raises_naming_the_line():
    def f(x):
        return x + x**2  # <no-preimage>

    y = jnp.array([2.0, -0.5])  # x + x**2 >= -1/4 has no real solution at -0.5
    with pytest.raises(jr.ReversibilityError) as info:
        jr.reverse(f)(y)
    err = info.value
    assert "Newton" in str(err) and HERE in str(err) and "Ways out" in str(err)
    assert os.path.basename(err.file) == HERE and err.line == _line("no-preimage")
    out = jr.reverse(f, on_error="nan")(y)
    np.testing.assert_allclose(out[0], 1.0, rtol=1e-12)
    assert np.isnan(out[1])
    # under jit the check runs with the program
    with pytest.raises(Exception, match="Newton's method found no preimage"):
        jax.jit(jr.reverse(f))(y).block_until_ready()


def test_vanished_jacobian_raises_singular_naming_the_line():
    def f(x):
        return x - jnp.sin(x)  # <vanished>   (derivative 1 - cos x is 0 at x = 0)

    with pytest.raises(jr.SingularJacobianError) as info:
        jr.reverse(f)(jnp.array([0.0, 1.0]))
    assert info.value.line == _line("vanished") and "vanishes" in str(info.value)
    assert np.isnan(jr.reverse(f, on_error="nan")(jnp.array([0.0, 1.0]))[0])


def test_a_single_primitive_without_a_rule_stays_an_error():
    with pytest.raises(jr.NotInvertibleError, match="sin"):
        jr.reverse(jnp.sin)(jnp.array([0.3]))
    with pytest.raises(ValueError, match="on_error"):
        jr.reverse(jnp.sin, on_error="ignore")


def test_float32_round_trip():
    x = jnp.linspace(-2.0, 2.0, 7, dtype=jnp.float32)
    f = lambda x: residual(x, jnp.float32(0.5))  # noqa: E731
    back = jr.reverse(f)(f(x))
    assert back.dtype == jnp.float32 and float(jnp.max(jnp.abs(back - x))) < 1e-5


def _line(tag: str) -> int:
    marker = f"# <{tag}>"
    with open(__file__, encoding="utf-8") as fh:
        return next(i for i, t in enumerate(fh, 1) if marker in t and "_line(" not in t)


def _bratu(n: int):
    """-u'' - exp(u) by central differences on n points, the neighbours read by `roll` and
    the ends zeroed by `where`: F is of order 1/h² = (n + 1)²."""
    h2 = 1.0 / (n + 1) ** 2

    def F(u):
        i = jnp.arange(n)
        left = jnp.where(i == 0, 0.0, jnp.roll(u, 1))
        right = jnp.where(i == n - 1, 0.0, jnp.roll(u, -1))
        return (2 * u - left - right) / h2 - jnp.exp(u)

    return F


@pytest.mark.parametrize("n", [50, 1000])
def test_what_a_group_determines_does_not_depend_on_its_unknowns_scales(n):
    """The group ``y / h² - e = r`` (y, e unknown) determines neither unknown, whatever h. With
    h² = 1e-6 (n = 1000) y's share of the null space is (h²)² = 1e-12, and the rank test, not
    scaled, took y as determined: `reverse` returned NaN and wrong values without an error,
    `inverse_jvp` a wrong Newton step (error 0.9). Columns are scaled to 1 first."""
    F = _bratu(n)
    u = jnp.linspace(0.1, 0.5, n)
    with pytest.raises(jr.NotInvertibleError):
        jr.reverse(F)(F(u))
    v = jnp.cos(jnp.arange(n) + 1.0)
    want = jnp.linalg.solve(jax.jacfwd(F)(u), v)
    assert abs_error(jr.inverse_jvp(F, (u,), v)[1][0], want) < 1e-8 * float(jnp.max(jnp.abs(want)))


# --------------------------------------------------------------------------- torn groups


def _planar(d: int, m: int, dtype=jnp.float64):
    """m planar units ``y = x + U tanh(W x + b)`` (U: d x m, W: m x d), a contraction's
    perturbation of the identity (‖U‖ ‖W‖ < 1), so one-to-one: a group of d unknowns that
    its nonlinear part reads through m numbers."""
    k = jax.random.split(jax.random.key(7), 3)
    W = jax.random.normal(k[0], (m, d)) / np.sqrt(d)
    U = 0.6 * jax.random.normal(k[1], (d, m)) / np.sqrt(d * m)
    b = jax.random.normal(k[2], (m,))
    W, U, b = (a.astype(dtype) for a in (W, U, b))

    def f(x):
        return x + U @ jnp.tanh(W @ x + b)  # <planar>

    return f


def _factored(jaxpr) -> set[int]:
    """The sizes of the matrices a program LU-factors, at any depth."""
    return {e.invars[0].aval.shape[-1] for e in all_eqns(jaxpr) if e.primitive.name == "lu"}


def test_a_group_read_through_a_few_nonlinear_values_is_torn():
    """A planar group of 24 unknowns is solved by Newton's method on its m = 3 tanh values
    alone (the affine rest gives x from them): no 24 x 24 factorization anywhere in the
    inverse, its log-det or their derivatives; the values, the implicit-function-theorem
    derivatives and the log-det (matrix determinant lemma) as the dense references."""
    d, m = 24, 3
    f = _planar(d, m)
    x = jnp.linspace(-1.5, 1.3, d)
    y = f(x)
    inv = jr.reverse(f)
    assert abs_error(inv(y), x) <= 1e-12
    for fn in (inv, jr.inverse_and_slogdet(f), jr.forward_and_slogdet(f)):
        assert _factored(jax.make_jaxpr(fn)(y).jaxpr) <= {m}
    want = np.linalg.inv(jax.jacfwd(f)(x))
    np.testing.assert_allclose(jax.jit(jax.jacfwd(inv))(y), want, atol=1e-12)
    _, logdet = jnp.linalg.slogdet(jax.jacfwd(f)(x))
    x_back, inv_logdet = jax.jit(jr.inverse_and_slogdet(f))(y)
    assert abs_error(x_back, x) <= 1e-12 and abs(float(inv_logdet + logdet)) <= 1e-12
    y_fwd, fwd_logdet = jr.forward_and_slogdet(f)(x)
    assert abs_error(y_fwd, y) == 0 and abs(float(fwd_logdet - logdet)) <= 1e-12
    sign, s_logdet = jr.slogdet_jacobian(f, x)
    assert jr.logdet_strategy(f, x) == "sweep"
    assert float(sign) == 1.0 and abs(float(s_logdet - logdet)) <= 1e-12
    # the log-det's gradient (reverse mode through the inverse too): d/dy of
    # -log|det J(x(y))| is -(d/dx log|det J|) J⁻¹
    ref = -jax.grad(lambda x: jnp.linalg.slogdet(jax.jacfwd(f)(x))[1])(x) @ want
    got = jax.jit(jax.grad(lambda y: jr.inverse_and_slogdet(f)(y)[1]))(y)
    np.testing.assert_allclose(got, ref, atol=1e-12)


def test_torn_groups_under_vmap_float32_and_reversible():
    d = 12
    f = _planar(d, 2)
    xs = jax.random.normal(jax.random.key(1), (5, d))
    ys = jax.vmap(f)(xs)
    back, ld = jax.jit(jax.vmap(jr.inverse_and_slogdet(f)))(ys)
    assert abs_error(back, xs) <= 1e-12
    want = jax.vmap(lambda x: jnp.linalg.slogdet(jax.jacfwd(f)(x))[1])(xs)
    assert abs_error(ld, -want) <= 1e-12
    # float32: the float32 forward run's own accuracy
    f32, x32 = _planar(d, 2, jnp.float32), xs[0].astype(jnp.float32)
    back32 = jr.reverse(f32)(f32(x32))
    assert back32.dtype == jnp.float32 and abs_error(back32, x32) < 1e-5

    # a loop of torn layers: reversible's gradient (the backward walk solves them torn)
    def layers(x, scale):
        def step(c, s):
            return f(c) * 1.0 + s, None

        return lax.scan(step, x, scale)[0]

    scale = 0.01 * jnp.arange(6.0)
    loss = lambda g: lambda x, s: jnp.sum(jnp.sin(g(x, s)))  # noqa: E731
    ref = jax.grad(loss(layers), argnums=(0, 1))(xs[0], scale)
    got = jax.jit(jax.grad(loss(jr.reversible(layers)), argnums=(0, 1)))(xs[0], scale)
    assert rel_error(got, ref) <= 1e-10


def test_a_torn_group_without_a_preimage_raises_naming_the_line():
    """``y = x + u exp(w.x)`` with u.w = -0.5: along w, s = w.x maps to s - 0.5 exp(s) <=
    log 2 - 1, so a y with w.y = 1 has no preimage, and the torn solve says so (as the dense
    one did), naming the group's line; NaN where asked, the other points of a batch still
    inverted."""
    w = jnp.array([1.0, 0.5, 0.5])
    u = jnp.array([-1.0, 0.5, 0.5])

    def f(x):
        return x + u * jnp.exp(w @ x)  # <torn-no-preimage>

    y = jnp.array([0.5, 0.5, 0.5])  # w.y = 1
    assert not _factored(jax.make_jaxpr(jr.reverse(f))(y).jaxpr)
    with pytest.raises(jr.ReversibilityError) as info:
        jr.reverse(f)(y)
    assert info.value.line == _line("torn-no-preimage") and "Newton" in str(info.value)
    assert np.all(np.isnan(jr.reverse(f, on_error="nan")(y)))
    ys = jnp.stack([y, f(jnp.array([0.3, -1.0, 0.2]))])
    got = jax.vmap(jr.reverse(f, on_error="nan"))(ys)
    assert np.all(np.isnan(got[0])) and abs_error(got[1], jnp.array([0.3, -1.0, 0.2])) <= 1e-12


class _FloorSystem:
    """Scalar equations per element, ``F(u) = ((u + 8) - 8) + u / 2`` (8 read at run time,
    so that XLA cannot fold it away), whose float32 rounding floor (an ulp of 8, 1e-6) lies
    above a few ulps of their answers (near 0.01) and far below their starts' residuals:
    the regime of a torn group's small cut values. Counts its evaluations."""

    blocks = True

    def __init__(self, calls):
        self.calls = calls

    def F(self, u, reads):
        jax.debug.callback(lambda: self.calls.append(1))
        (big,) = reads
        return ((u + big) - big) + 0.5 * u

    def jacobian(self, u, reads):
        return jnp.full(u.shape + (1,), 1.5, u.dtype)

    def solve(self, J, r):
        return r / J[..., 0]

    def norm(self, r):
        return jnp.max(jnp.abs(r), axis=-1)

    def broadcast(self, per):
        return per[..., None]

    def guess(self, yp):
        return yp

    def read_guesses(self, reads, most=4):
        return []


def test_newton_stops_at_a_rounding_floor_above_its_tolerance():
    # an element whose residual cannot reach the tolerance stops once a full step no longer
    # halves it: it is not damped (thirty halvings of the step, each a residual of the whole
    # vmapped batch) nor stepped on by ulps until the iteration cap
    from jaxrev.transforms.propagation.nonlinear import _iterate

    calls = []
    system = _FloorSystem(calls)
    yp = jnp.linspace(0.005, 0.02, 64, dtype=jnp.float32)[:, None]
    big = jnp.float32(8.0)
    u = jax.jit(lambda yp, big: _iterate(system, yp, [big], None))(yp, big)
    floor = float(jnp.finfo(jnp.float32).eps) * 8.0
    assert float(jnp.max(jnp.abs(system.F(u, [big]) - yp))) <= 2 * floor
    assert float(jnp.max(jnp.abs(u - yp / 1.5))) <= 2 * floor
    # (a start's residual, then each iteration's Jacobian-free step and its full-step
    # residual: 13 evaluations; the damped loop made 265)
    assert len(calls) <= 20, len(calls)


def test_a_torn_groups_affine_part_is_taken_exactly_next_to_large_values():
    # a planar layer whose u tanh(.) is of order 1e8 in float32: its affine part's matrix
    # (the identity) taken as F(s) - F(0) rounded to 0 there, and the log-det raised
    # "singular"; taken by a JVP, it is exact (and, being constant, XLA folds it)
    D = 6
    k = jax.random.split(jax.random.key(0), 3)
    u = (1e9 * (1 + 0.1 * jax.random.normal(k[0], (D,)))).astype(jnp.float32)
    w = (1e-9 * jnp.abs(jax.random.normal(k[1], (D,)))).astype(jnp.float32)

    def layer(x):
        return x + u * jnp.tanh(jnp.dot(w, x) + 0.3)

    x = jax.random.normal(k[2], (D,), jnp.float32)
    t = jnp.tanh(jnp.dot(w, x) + 0.3)
    want = jnp.log(jnp.abs(1 + (1 - t**2) * jnp.dot(w, u)))
    for g in (jr.forward_and_slogdet(layer), jax.jit(jr.forward_and_slogdet(layer))):
        y, logdet = g(x)
        np.testing.assert_allclose(y, layer(x), rtol=1e-6)
        np.testing.assert_allclose(logdet, want, rtol=1e-5)


def test_a_rectangular_product_inside_a_square_group_is_solved_by_newton():
    """``W2 tanh(W1 x)`` (4 -> 16 -> 4, a block neural autoregressive layer's shape): the
    product by the wide W2 recovers nothing alone, but the group is square (before: refused
    at that `dot_general` as losing information). Its weights come out of a loop over layers
    whose stacked weights are computed from constants by a `where` (weight normalisation
    behind a mask, as flowjax writes it): the walker computes them before it inverts the
    loop (before: the loop was inverted first, with the weights taken as unknowns). The
    layer's log-Jacobian, computed beside its output through a max, is left out of the
    group."""
    k1, k2 = jax.random.split(jax.random.key(3))
    mask = jnp.arange(16)[:, None] % 4 >= jnp.arange(4)[None, :]
    W1 = jnp.abs(jax.random.normal(k1, (1, 16, 4))) * 0.5
    W2 = jnp.abs(jax.random.normal(k2, (1, 4, 16))) * 0.3

    def f(x):
        w1 = jnp.where(mask, W1, 0.0)
        w1 = w1 / jnp.linalg.norm(w1, axis=-1, keepdims=True)

        def layer(carry, w):
            h, side = carry
            a = w[0] @ h
            side = side + jnp.max(jnp.log1p(a * a))  # (beside the output: not in the group)
            return (w[1] @ jnp.tanh(a), side), None

        (y, _), _ = jax.lax.scan(layer, (x, 0.0), (w1, W2))
        return y

    x = jnp.array([0.3, -0.2, 0.5, 0.1])
    for call in (jr.reverse(f), jax.jit(jr.reverse(f))):
        np.testing.assert_allclose(call(f(x)), x, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("cum", ["cumprod", "cumlogsumexp"])
def test_a_cumulative_product_inside_a_group_is_solved_by_newton(cum):
    """A stick-breaking map, each coordinate scaled by a cumulative product (or shifted by a
    cumulative log-sum-exp) of the ones before it: triangular in the state, its cumulative
    step smooth (before: no rule for it, refused at the `mul`). Inverted by Newton's method,
    eagerly, under jit and vmap; its log-det is the dense one."""
    op = {"cumprod": lax.cumprod, "cumlogsumexp": lax.cumlogsumexp}[cum]

    def f(x):
        t = jnp.tanh(x)
        scale = jnp.pad(op(jax.nn.sigmoid(t[:-1])), (1, 0), constant_values=1.0)
        return t * scale + 0.1 * x

    x = jnp.array([0.3, -0.8, 0.5, 1.2])
    for call in (jr.reverse(f), jax.jit(jr.reverse(f))):
        np.testing.assert_allclose(call(f(x)), x, rtol=1e-10, atol=1e-12)
    xs = jnp.stack([x, -x, 0.5 * x])
    np.testing.assert_allclose(jax.vmap(jr.reverse(f))(jax.vmap(f)(xs)), xs, atol=1e-10)
    _, ld = jr.inverse_and_slogdet(f)(f(x))
    np.testing.assert_allclose(-ld, jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-10)
