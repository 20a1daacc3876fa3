"""jaxrev.optim: Newton directions against dense Hessian solves, the optax interface, minimize
(Newton and trust region) and root on the issue's problems."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import rel_error

import jaxrev as jr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from graph_embedding import embedding_loss, solve, starts  # noqa: E402
from newton import (
    broyden_tridiagonal,
    chained_rosenbrock,
    extended_rosenbrock,  # noqa: E402
    rosenbrock,
)

rng = np.random.default_rng(0)


def dense_newton(f, x, damping=0.0):
    v, unravel = jax.flatten_util.ravel_pytree(x)
    fv = lambda v: f(unravel(v))
    H = jax.hessian(fv)(v) + damping * jnp.eye(v.size)
    return unravel(jnp.linalg.solve(H, jax.grad(fv)(v)))


def dense_objective(x):
    A = jnp.asarray(np.random.default_rng(1).standard_normal((6, 6)) / 3)
    return jnp.sum(jnp.cosh(A @ x)) + 0.5 * jnp.sum(x**2)


# ------------------------------------------------------------------ newton_direction


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_newton_direction_matches_dense_solve(damping):
    x = jnp.asarray(rng.standard_normal(6))
    d = jr.optim.newton_direction(dense_objective, x, damping=damping)
    assert rel_error(d, dense_newton(dense_objective, x, damping)) < 1e-9


def test_newton_direction_of_a_pytree_and_float32():
    def f(p):
        return jnp.sum(p["w"] ** 4) + jnp.sum(jnp.exp(p["b"])) + jnp.sum(p["w"]) * p["b"][0]

    p = {"w": jnp.asarray(rng.standard_normal((2, 3))), "b": jnp.asarray(rng.standard_normal(2))}
    d = jr.optim.newton_direction(f, p)
    ref = dense_newton(f, p)
    assert jax.tree_util.tree_structure(d) == jax.tree_util.tree_structure(p)
    for k in p:
        assert rel_error(d[k], ref[k]) < 1e-9
    p32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), p)
    d32 = jr.optim.newton_direction(f, p32)
    assert d32["w"].dtype == jnp.float32
    for k in p:
        assert rel_error(d32[k], ref[k]) < 1e-3


def test_newton_direction_under_jit_and_vmap():
    xs = jnp.asarray(rng.standard_normal((3, 6)))
    ds = jax.jit(jax.vmap(lambda x: jr.optim.newton_direction(dense_objective, x)))(xs)
    for x, d in zip(xs, ds):
        assert rel_error(d, dense_newton(dense_objective, x)) < 1e-9


# ------------------------------------------------------------------ optax


def test_pure_newton_solves_rosenbrock_through_optax():
    # the figure: from (-1.2, 1) to 1e-8 within 30 steps
    opt = jr.optim.newton()
    x = jnp.array([-1.2, 1.0])
    state = opt.init(x)
    step = jax.jit(lambda x, s: opt.update(jax.grad(rosenbrock)(x), s, x, value_fn=rosenbrock))
    for k in range(1, 31):
        u, state = step(x, state)
        x = optax.apply_updates(x, u)
        if float(jnp.max(jnp.abs(x - 1.0))) < 1e-8:
            break
    assert float(jnp.max(jnp.abs(x - 1.0))) < 1e-8 and k <= 30
    assert int(state[0].count) == k


def test_newton_with_an_optax_line_search():
    opt = optax.chain(
        jr.optim.newton(), optax.scale_by_backtracking_linesearch(max_backtracking_steps=30)
    )
    x = jnp.array([-1.2, 1.0])
    state = opt.init(x)

    @jax.jit
    def step(x, state):
        value, grad = jax.value_and_grad(rosenbrock)(x)
        u, state = opt.update(grad, state, x, value=value, grad=grad, value_fn=rosenbrock)
        return optax.apply_updates(x, u), state, value

    values = []
    for _ in range(40):
        x, state, value = step(x, state)
        values.append(float(value))
    assert all(b <= a for a, b in zip(values, values[1:]))  # the line search never goes up
    assert float(jnp.max(jnp.abs(x - 1.0))) < 1e-8


def test_damped_newton_is_levenberg():
    x = jnp.asarray(rng.standard_normal(6))
    opt = jr.optim.newton(learning_rate=0.5, damping=2.0)
    g = jax.grad(dense_objective)(x)
    u, _ = opt.update(g, opt.init(x), x, value_fn=dense_objective)
    assert rel_error(u, -0.5 * dense_newton(dense_objective, x, 2.0)) < 1e-9


def test_scale_by_newton_errors():
    t = jr.optim.scale_by_newton()
    x = jnp.ones(2)
    with pytest.raises(ValueError, match="value_fn"):
        t.update(x, t.init(x), x)
    with pytest.raises(ValueError, match="needs params"):
        t.update(x, t.init(x), value_fn=rosenbrock)
    with pytest.raises(ValueError, match="damping"):
        jr.optim.scale_by_newton(damping=-1.0)


# ------------------------------------------------------------------ minimize


@pytest.mark.parametrize("method", ["newton", "trust-region"])
def test_minimize_rosenbrock(method):
    x, info = jax.jit(lambda x0: jr.optim.minimize(rosenbrock, x0, method=method))(
        jnp.array([-1.2, 1.0])
    )
    assert info.message == "converged" and float(info.residual) <= 1e-8
    assert rel_error(x, jnp.ones(2)) < 1e-8


def test_trust_region_extended_rosenbrock_100():
    x0 = jnp.tile(jnp.array([-1.2, 1.0]), 50)
    x, info = jax.jit(lambda x0: jr.optim.minimize(extended_rosenbrock, x0, tol=1e-10))(x0)
    assert float(extended_rosenbrock(x)) < 1e-10 and info.message == "converged"


def test_trust_region_petersen_embedding_k5():
    # the figure: loss < 1e-10 at k = 5 (NiLang §4.3); two starts at once under vmap
    fixed, x0, masks = starts([5], (0, 1))
    x, info = solve(fixed, x0, masks)
    assert float(jnp.min(info.value)) < 1e-10
    i = int(jnp.argmin(info.value))
    pos = (jnp.concatenate([fixed[i], x[i]]) * masks[i])[:, :5]
    assert float(embedding_loss(pos)) < 1e-10


def test_trust_region_escapes_a_saddle_where_newton_would_not():
    # at the origin the Hessian is indefinite (a saddle with zero gradient along y would stop
    # plain Newton); the trust region finds a minimum at (±1, ±1/√2)... with f = -1.25
    f = lambda v: (v[0] ** 2 - 1) ** 2 + (2 * v[1] ** 2 - 1) ** 2 / 4 - 1.25 + 0 * v[0]
    x, info = jr.optim.minimize(f, jnp.array([0.1, 0.05]), method="trust-region")
    assert info.message == "converged"
    assert float(f(x)) < -1.25 + 1e-12
    H = jax.hessian(f)(x)
    assert bool(jnp.all(jnp.linalg.eigvalsh(H) > 0))


def test_minimize_pytree_vmap_and_status():
    def f(p):
        return jnp.sum((p["a"] - 2.0) ** 4 + (p["a"] - 2.0) ** 2) + jnp.cosh(p["b"] - 1.0)

    p0 = {"a": jnp.zeros(3), "b": jnp.asarray(0.0)}
    p, info = jr.optim.minimize(f, p0, method="newton")
    assert rel_error(p["a"], 2.0 * jnp.ones(3)) < 1e-9 and abs(float(p["b"]) - 1.0) < 1e-9
    starts_ = jnp.asarray(rng.standard_normal((4, 2)))
    xs, infos = jax.vmap(lambda x0: jr.optim.minimize(rosenbrock, x0))(starts_)
    assert bool(jnp.all(infos.status == 0)) and rel_error(xs, jnp.ones((4, 2))) < 1e-8
    _, info = jr.optim.minimize(rosenbrock, jnp.array([-1.2, 1.0]), maxiter=2, throw=False)
    assert info.message == "max_iterations" and int(info.iterations) == 2
    with pytest.raises(
        jr.NotConvergedError,
        match=r"minimize \(called at .*test_optim.py.*"
        r"max_iterations after 2 iterations",
    ) as e:
        jr.optim.minimize(rosenbrock, jnp.array([-1.2, 1.0]), maxiter=2)
    assert e.value.status == "max_iterations"


def test_minimize_errors():
    with pytest.raises(ValueError, match="method must be"):
        jr.optim.minimize(rosenbrock, jnp.zeros(2), method="bfgs")
    with pytest.raises(ValueError, match="tol must be"):
        jr.optim.minimize(rosenbrock, jnp.zeros(2), tol=0.0)
    with pytest.raises(TypeError, match="scalar"):
        jr.optim.minimize(lambda x: x**2, jnp.zeros(2))
    with pytest.raises(jr.DtypeError, match=r"minimize \(called at .*test_optim.py.*complex64"):
        jr.optim.minimize(rosenbrock, jnp.zeros(2, jnp.complex64))


def test_integer_starts_are_converted_as_optimistix_does():
    # (an integer x0 was refused with a TypeError; Optimistix takes it as a float start)
    x, info = jr.optim.minimize(rosenbrock, jnp.zeros(2, jnp.int32))
    assert x.dtype == jnp.result_type(float) and int(info.status) == 0
    np.testing.assert_allclose(x, 1.0, rtol=1e-6)
    x, info = jr.optim.root(lambda z: z**3 + z - 2.0, 0)
    assert int(info.status) == 0 and abs(float(x) - 1.0) < 1e-8


# ------------------------------------------------------------------ root


def test_root_broyden_tridiagonal_200():
    # the figure: residual < 1e-10
    x, info = jax.jit(lambda x0: jr.optim.root(broyden_tridiagonal, x0))(-jnp.ones(200))
    assert float(jnp.max(jnp.abs(broyden_tridiagonal(x)))) < 1e-10
    assert info.message == "converged" and int(info.iterations) < 20


def test_root_pytree_float32_and_errors():
    def F(p):
        return {"u": p["u"] ** 3 - p["v"], "v": jnp.exp(p["v"]) - 2.0}

    p, info = jr.optim.root(F, {"u": jnp.ones(1), "v": jnp.zeros(1)})
    assert abs(float(p["v"][0]) - np.log(2.0)) < 1e-12
    assert abs(float(p["u"][0]) - np.log(2.0) ** (1 / 3)) < 1e-9 and float(info.residual) < 1e-10
    x32, info32 = jr.optim.root(
        lambda x: x**3 - 8.0, jnp.ones(3, jnp.float32), rtol=1e-5, atol=1e-5
    )
    assert x32.dtype == jnp.float32 and info32.message == "converged"
    with pytest.raises(ValueError, match="square"):
        jr.optim.root(lambda x: x[:2], jnp.ones(3))
    with pytest.raises(ValueError, match="rtol and atol"):
        jr.optim.root(lambda x: x, jnp.ones(3), rtol=-1.0)
    # a singular Jacobian at the root's start: no step can be taken
    _, info = jr.optim.root(lambda x: x**2 + 1.0, jnp.zeros(2), throw=False)
    assert info.message in ("stalled", "non_finite")


def test_chained_rosenbrock_newton_direction_is_banded():
    n = 300
    x = jnp.asarray(1.0 + 0.01 * rng.standard_normal(n))
    d = jax.jit(lambda x: jr.optim.newton_direction(chained_rosenbrock, x))(x)
    assert rel_error(d, dense_newton(chained_rosenbrock, x)) < 1e-9
    jaxpr = str(jax.make_jaxpr(lambda x: jr.optim.newton_direction(chained_rosenbrock, x))(x))
    assert "= lu " not in jaxpr and "= lu[" not in jaxpr


@pytest.mark.parametrize("damping", [0.0, 1e-3])
def test_extended_rosenbrock_direction_moves_data_instead_of_factoring(damping):
    """Undamped, the gradient of the extended Rosenbrock is two strided slices in, 2 x 2
    blocks, two pads summed out: the slices' and pads' groups are permutations, solved by a
    gather, not as dense lumps of n (which took 165 ms at n = 1 000 against 0.26 ms damped,
    issue 45): no n x n matrix in the program (the 2 x 2 blocks are inverted as a batch), the
    direction equal to the dense one."""
    n = 1000
    x = jnp.asarray(1.0 + 0.01 * np.sin(np.arange(n)))
    direction = lambda x: jr.optim.newton_direction(extended_rosenbrock, x, damping=damping)
    d = jax.jit(direction)(x)
    assert rel_error(d, dense_newton(extended_rosenbrock, x, damping)) < 1e-10
    assert f"[{n},{n}]" not in str(jax.make_jaxpr(direction)(x))


def test_dense_hessian_is_formed_and_factored():
    """A dense Hessian (logistic regression) is found when traced, formed by one batch of
    HVPs and solved by Cholesky; an indefinite one by LU; a banded one keeps the band path."""
    rng = np.random.default_rng(0)
    X = jnp.asarray(rng.standard_normal((60, 12)))
    y = jnp.asarray((rng.random(60) < 0.5).astype(float))

    def loss(w):
        z = X @ w
        return jnp.mean(jnp.logaddexp(0.0, z) - y * z) + 1e-3 * jnp.sum(w**2)

    w = jnp.linspace(-0.3, 0.3, 12)
    g = jax.grad(loss)(w)
    ref = jnp.linalg.solve(jax.hessian(loss)(w), g)
    d = jax.jit(lambda w: jr.optim.newton_direction(loss, w))(w)
    np.testing.assert_allclose(d, ref, rtol=1e-10)
    jaxpr = str(jax.make_jaxpr(lambda w: jr.optim.newton_direction(loss, w))(w))
    assert "cholesky" in jaxpr
    indefinite = lambda w: loss(w) - 0.5 * jnp.sum(w[:3] ** 2)  # noqa: E731
    ref = jnp.linalg.solve(jax.hessian(indefinite)(w), jax.grad(indefinite)(w))
    np.testing.assert_allclose(jr.optim.newton_direction(indefinite, w), ref, rtol=1e-9)
    banded = lambda x: jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)  # noqa: E731
    assert "cholesky" not in str(
        jax.make_jaxpr(lambda x: jr.optim.newton_direction(banded, x))(jnp.ones(40) * 1.01)
    )


def bratu(n, lam=1.0):
    """The Bratu problem -u'' = λ exp(u) on (0, 1), u(0) = u(1) = 0, by central differences on
    n interior points: F is of order 1/h², so its rounding is far above an absolute 1e-10."""
    h = 1.0 / (n + 1)

    def F(u):
        left = jnp.concatenate([jnp.zeros(1, u.dtype), u[:-1]])
        right = jnp.concatenate([u[1:], jnp.zeros(1, u.dtype)])
        return (2 * u - left - right) / h**2 - lam * jnp.exp(u)

    return F


def test_root_bratu_converges_to_rounding_and_a_stall_is_still_one():
    # issue 28: F ≈ 1/h² = 4e6 stops decreasing at ~2e-10 > atol; the Newton step says the
    # solve is there, so it is reported converged, not stalled
    F = bratu(2000)
    solve = jax.jit(
        lambda u0, rtol, atol: jr.optim.root(F, u0, rtol=rtol, atol=atol), static_argnums=(1, 2)
    )
    u, info = solve(jnp.zeros(2000), 1e-10, 1e-10)
    assert info.message == "converged" and int(info.iterations) < 10
    # an atol far below F's rounding: only the Newton step's test can say converged
    u, info = solve(jnp.zeros(2000), 1e-10, 1e-14)
    assert info.message == "converged" and float(info.residual) > 1e-14
    # Newton's step from the answer is at rounding: u is the root to working precision
    _, (d,) = jax.jit(lambda u: jr.inverse_jvp(F, (u,), F(u)))(u)
    assert float(jnp.max(jnp.abs(d))) < 1e-13 * float(jnp.max(jnp.abs(u)))
    # asking for less than rounding stalls, and says so
    _, info = jax.jit(lambda u0: jr.optim.root(F, u0, rtol=1e-20, atol=1e-20, throw=False))(
        jnp.zeros(2000)
    )
    assert info.message == "stalled"
    # no real root: the line search walks to where J is singular and stops
    _, info = jr.optim.root(lambda x: x**2 + 1.0, jnp.array([0.5, -3.0]), throw=False)
    assert info.message == "stalled" and float(info.residual) >= 1.0


class TraceCounter:
    """Counts traces of user functions by jaxrev (`_program.make_jaxpr`) and shape checks
    (`jax.eval_shape`), as tests/test_eager_cache.py does: a counter the function bumped
    itself would be part of the cache's key."""

    def __init__(self, monkeypatch):
        import jaxrev._program as P

        self.n = 0
        monkeypatch.setattr(P, "make_jaxpr", self.counting(P.make_jaxpr))
        monkeypatch.setattr(jax, "eval_shape", self.counting(jax.eval_shape))

    def counting(self, real):
        def count(*a, **k):
            self.n += 1
            return real(*a, **k)

        return count


def test_eager_root_and_minimize_are_traced_once(monkeypatch):
    # issue 28: called eagerly, as the docs write them, each call traced the loop again
    count = TraceCounter(monkeypatch)
    F = bratu(8)
    u0 = jnp.zeros(8)
    u, info = jr.optim.root(F, u0)
    first = count.n
    assert first > 0 and info.message == "converged"
    for _ in range(2):
        u2, info2 = jr.optim.root(F, u0)
    assert count.n == first
    np.testing.assert_array_equal(u, u2)
    assert int(info2.status) == int(info.status)
    # other settings, shapes or closures are other keys
    jr.optim.root(F, u0, rtol=1e-8)
    assert count.n > first
    n = count.n
    jr.optim.root(bratu(8, lam=2.0), u0)
    assert count.n > n

    count.n = 0
    x, info = jr.optim.minimize(rosenbrock, jnp.array([-1.2, 1.0]), method="newton")
    first = count.n
    for _ in range(2):
        x2, _ = jr.optim.minimize(rosenbrock, jnp.array([-1.2, 1.0]), method="newton")
    assert count.n == first and info.message == "converged"
    np.testing.assert_array_equal(x, x2)
    # a pytree with a static leaf passes through the compiled call
    p, _ = jr.optim.minimize(
        lambda p: jnp.sum((p["w"] - 1.0) ** 2), {"w": jnp.zeros(3), "act": jnp.tanh}
    )
    assert p["act"] is jnp.tanh


# ------------------------------------------------------------------ never a wrong "converged"


@pytest.mark.parametrize("multiplicity", [2, 3])
@pytest.mark.parametrize("c", [1.0, 2.0, -0.5])
@pytest.mark.parametrize("tol", [1e-5, 1e-8])
def test_root_at_a_multiple_root_converges_only_near_it(c, tol, multiplicity):
    """Optimistix's `newton_bounded` problems, F(y) = (y - c)^m: |F| <= atol long before y is
    near c (root took |F| = 9.8e-6 at y 0.0031 from a double root for 'converged'). A root is
    converged when the Newton step is within the tolerance *and* F is (Optimistix's rule) or
    the steps' contraction puts x within it: y within (m - 1)(atol + rtol|c|) of c."""
    x, info = jr.optim.root(lambda y: (y - c) ** multiplicity, jnp.asarray(0.0), rtol=tol, atol=tol)
    assert info.message == "converged"
    assert abs(float(x) - c) <= (multiplicity - 1) * (tol + tol * abs(c))


def test_root_in_float32_takes_float32_tolerances():
    """Bratu, n = 2 000, lambda = 3, float32 (issue 45): with 1e-10 tolerances root ran to
    max_iterations at max u = 0.6356; the default tolerances are eps^(2/3) of the dtype."""
    F = bratu(2000, lam=3.0)
    u64, info64 = jr.optim.root(F, jnp.zeros(2000))
    u32, info32 = jr.optim.root(F, jnp.zeros(2000, jnp.float32))
    assert info32.message == "converged" and info64.message == "converged"
    assert u32.dtype == jnp.float32
    assert abs(float(jnp.max(u32)) - float(jnp.max(u64))) < 1e-4
    assert jr.optim.default_tolerance(jnp.float64, 1e-10) == 1e-10
    assert 2e-5 < jr.optim.default_tolerance(jnp.float32, 1e-10) < 3e-5


def test_throw_raises_a_named_error_eagerly_under_jit_and_vmap():
    F = lambda x: x**2 + 1.0  # noqa: E731  (no real root: the line search stalls)
    for call in (
        lambda: jr.optim.root(F, jnp.array(0.5)),
        lambda: jr.jit(lambda x0: jr.optim.root(F, x0))(jnp.array(0.5)),
        lambda: jax.vmap(lambda x0: jr.optim.root(lambda x: x**2 - 1.0, x0))(jnp.array([0.5, 0.0])),
    ):
        with pytest.raises(
            jr.NotConvergedError, match=r"root \(called at .*test_optim.py.*stalled"
        ) as e:
            call()
        assert e.value.status == "stalled"
    # only the samples that did not converge raise; throw=False returns the status
    x, info = jax.vmap(lambda x0: jr.optim.root(lambda x: x**2 - 1.0, x0))(jnp.array([0.5, 2.0]))
    np.testing.assert_allclose(x, 1.0)
    _, info = jr.optim.root(F, jnp.array(0.5), throw=False)
    assert info.message == "stalled"


def test_args_and_has_aux_as_optimistix_takes_them():
    """`fun(x, args)` when `args` is given (a traced input of the solve: new values reuse the
    compiled call), and ``(value, aux)`` with `has_aux`, aux at the solution in `info.aux`."""

    def residual(x, args):
        target, scale = args
        return scale * (x**3 - target), {"cube": x**3}

    for target in (jnp.array([8.0, 27.0]), jnp.array([1.0, 64.0])):
        x, info = jr.optim.root(residual, jnp.ones(2), args=(target, 2.0), has_aux=True)
        np.testing.assert_allclose(x, jnp.cbrt(target), rtol=1e-10)
        np.testing.assert_allclose(info.aux["cube"], target, rtol=1e-10)
    # vmapped over args, under jit
    targets = jnp.array([[8.0, 27.0], [1.0, 64.0]])
    xs, infos = jax.jit(
        jax.vmap(lambda t: jr.optim.root(residual, jnp.ones(2), args=(t, 2.0), has_aux=True))
    )(targets)
    np.testing.assert_allclose(xs, jnp.cbrt(targets), rtol=1e-10)
    assert infos.aux["cube"].shape == (2, 2)

    def loss(x, args):
        return jnp.sum((x - args) ** 2) + rosenbrock(x), jnp.linalg.norm(x)

    x, info = jr.optim.minimize(loss, jnp.zeros(2), args=jnp.array([1.0, 1.0]), has_aux=True)
    np.testing.assert_allclose(x, 1.0, rtol=1e-8)
    np.testing.assert_allclose(info.aux, np.sqrt(2.0), rtol=1e-8)
    # without args, fun takes x alone, as before
    x, info = jr.optim.minimize(rosenbrock, jnp.zeros(2))
    assert info.aux is None


def test_args_are_traced_inputs_not_new_traces(monkeypatch):
    count = TraceCounter(monkeypatch)
    F = lambda x, a: x**3 - a  # noqa: E731
    jr.optim.root(F, jnp.ones(2), args=jnp.array([8.0, 27.0]))
    first = count.n
    x, _ = jr.optim.root(F, jnp.ones(2), args=jnp.array([1.0, 64.0]))
    assert count.n == first
    np.testing.assert_allclose(x, [1.0, 4.0], rtol=1e-10)


@pytest.mark.parametrize("method", ["trust-region", "newton"])
def test_minimize_defaults_solve_the_chained_rosenbrock_at_n_1000(method):
    """Newton's method moves the valley about one coordinate a step (1 474 Newton, 2 219
    trust-region steps from 0): the former maxiter=100 stopped 0.9999 from the minimum."""
    x, info = jr.optim.minimize(chained_rosenbrock, jnp.zeros(1000), method=method)
    assert info.message == "converged" and int(info.iterations) > 100
    np.testing.assert_allclose(x, 1.0, atol=1e-8)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_minimize_takes_the_dtypes_tolerance(dtype):
    # with the float64 default (1e-8) the bfloat16 trust region stalled
    x, info = jr.optim.minimize(rosenbrock, jnp.zeros(2, dtype))
    assert info.message == "converged" and x.dtype == dtype
    np.testing.assert_allclose(np.asarray(x, np.float64), 1.0, atol=4 * float(jnp.finfo(dtype).eps))


def test_status_by_name_under_jit_and_a_message_that_says_where_it_works():
    solve = jax.jit(jax.vmap(lambda x0: jr.optim.root(lambda x: x**2 - 1.0, x0, throw=False)[1]))
    info = solve(jnp.array([0.5, 0.0]))
    np.testing.assert_array_equal(info.status == jr.optim.Status.converged, [True, False])
    assert int(info.status[1]) == jr.optim.Status.stalled
    with pytest.raises(TypeError, match="index one sample"):
        info.message
    with pytest.raises(TypeError, match="Status.converged"):
        jax.jit(lambda x0: jr.optim.root(lambda x: x**3 - 8.0, x0)[1].message)(jnp.array(1.0))
    assert jr.optim.root(lambda x: x**3 - 8.0, jnp.array(1.0))[1].message == "converged"


def _decay_solve(theta):
    """y' = -a y + b sin t from 0 to 1 by an adaptive Tsit5, differentiable in forward mode
    only (diffrax's ForwardMode: a while loop with a dynamic number of steps)."""
    import diffrax

    term = diffrax.ODETerm(lambda t, y, a: -a[0] * y + a[1] * jnp.sin(t))
    sol = diffrax.diffeqsolve(
        term,
        diffrax.Tsit5(),
        0.0,
        1.0,
        0.1,
        jnp.array([1.0, 0.5]),
        args=theta,
        stepsize_controller=diffrax.PIDController(rtol=1e-10, atol=1e-10),
        adjoint=diffrax.ForwardMode(),
    )
    return sol.ys[-1]


def test_a_forward_mode_diffrax_objective_minimises_and_its_root_is_found():
    """Issue 45: a diffrax solve with ForwardMode cannot run in reverse mode; minimize takes
    autodiff_mode="fwd" (Optimistix's option) and says so when it is missing; root's Newton
    steps are inverse JVPs already (an int64 step counter beside int32 indices crashed
    them)."""
    truth = jnp.array([0.7, 0.3])
    target = _decay_solve(truth)
    loss = lambda th: jnp.sum((_decay_solve(th) - target) ** 2)
    with pytest.raises(ValueError, match='autodiff_mode="fwd"') as ei:
        jr.optim.minimize(loss, jnp.array([1.0, 0.0]))
    assert "test_optim.py" in str(ei.value)
    x, info = jr.optim.minimize(loss, jnp.array([1.0, 0.0]), autodiff_mode="fwd")
    assert info.message == "converged" and float(jnp.max(jnp.abs(x - truth))) < 1e-6
    x, info = jr.optim.root(lambda th: _decay_solve(th) - target, jnp.array([1.0, 0.0]))
    assert info.message == "converged" and float(jnp.max(jnp.abs(x - truth))) < 1e-9


@pytest.mark.parametrize("damping", [0.0, 0.5])
def test_forward_mode_newton_direction_matches_reverse_mode(damping):
    f = lambda x: jnp.sum(jnp.cosh(x) * x[::-1]) + jnp.sum(x**4)
    x = jnp.asarray(rng.standard_normal(6))
    d_fwd = jr.optim.newton_direction(f, x, damping=damping, autodiff_mode="fwd")
    assert rel_error(d_fwd, dense_newton(f, x, damping)) < 1e-12
    with pytest.raises(ValueError, match="autodiff_mode"):
        jr.optim.newton_direction(f, x, autodiff_mode="forward")


def chained_rosenbrock_residuals(x):
    return jnp.concatenate([10.0 * (x[1:] - x[:-1] ** 2), 1.0 - x[:-1]])


@pytest.mark.parametrize("damping", [0.0, 0.3])
def test_gauss_newton_direction_keeps_the_residuals_structure(damping):
    """JᵀJ of the chained Rosenbrock's residuals is tridiagonal: the Gauss-Newton direction is
    the dense least-squares one, with no n x n matrix in its program."""
    n = 1000
    x = jnp.asarray(1.0 + 0.1 * rng.standard_normal(n))
    direction = lambda x: jr.optim.gauss_newton_direction(
        chained_rosenbrock_residuals, x, damping=damping
    )
    J = jax.jacfwd(chained_rosenbrock_residuals)(x)
    r = chained_rosenbrock_residuals(x)
    ref = jnp.linalg.solve(J.T @ J + damping * jnp.eye(n), J.T @ r)
    assert rel_error(jax.jit(direction)(x), ref) < 1e-9
    assert f"[{n},{n}]" not in str(jax.make_jaxpr(direction)(x))
    fwd = jr.optim.gauss_newton_direction(
        chained_rosenbrock_residuals, x[:50], damping=damping, autodiff_mode="fwd"
    )
    J = J[: 2 * 49][:, :50]
    J = jax.jacfwd(chained_rosenbrock_residuals)(x[:50])
    r = chained_rosenbrock_residuals(x[:50])
    assert rel_error(fwd, jnp.linalg.solve(J.T @ J + damping * jnp.eye(50), J.T @ r)) < 1e-9


def test_least_squares_pytree_aux_vmap_and_errors():
    """Residuals as a pytree with an aux output, several starts under vmap, float32, and the
    errors (method, a complex start)."""

    def residuals(p, data):
        r = {"fit": p["a"] * jnp.exp(-p["k"] * data[0]) - data[1], "prior": 0.01 * p["k"]}
        return r, jnp.sum(r["fit"] ** 2)

    t = jnp.linspace(0.0, 2.0, 20)
    data = (t, 2.0 * jnp.exp(-0.7 * t))
    p0 = {"a": jnp.array(1.0), "k": jnp.array(0.1)}
    p, info = jr.optim.least_squares(residuals, p0, args=data, has_aux=True)
    assert info.message == "converged" and abs(float(p["a"]) - 2.0) < 1e-3
    assert float(info.aux) < 1e-6
    starts = {"a": jnp.array([1.0, 3.0]), "k": jnp.array([0.1, 1.5])}
    batch = jax.vmap(lambda p0: jr.optim.least_squares(residuals, p0, args=data, has_aux=True))
    ps, infos = batch(starts)
    assert bool(jnp.all(infos.status == jr.optim.Status.converged))
    assert float(jnp.max(jnp.abs(ps["a"] - p["a"]))) < 1e-8
    p32, info32 = jr.optim.least_squares(
        residuals,
        jax.tree.map(lambda v: v.astype(jnp.float32), p0),
        args=jax.tree.map(lambda v: v.astype(jnp.float32), data),
        has_aux=True,
    )
    assert p32["a"].dtype == jnp.float32 and info32.message == "converged"
    with pytest.raises(ValueError, match="method"):
        jr.optim.least_squares(residuals, p0, args=data, has_aux=True, method="dogleg")
    with pytest.raises(jr.DtypeError):
        jr.optim.least_squares(lambda z: z - 1.0, jnp.ones(2, jnp.complex128))
