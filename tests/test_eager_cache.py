"""Eager calls cached like `jax.jit`'s (issue 20, `jaxrev/_cache.py`): a repeated eager call of a
transform does not trace the user's function again, and what the function reads besides its
arguments (closures, attributes, globals, arrays changed in place) is part of the key, so a
change is never answered from a stale trace."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxrev as jr
from jaxrev._cache import call_key, function_key

jax.config.update("jax_enable_x64", True)


class Counter:
    """Counts the traces of user functions: a counter the function itself bumped would be
    part of the function's key (an attribute it reads), and change it on every trace."""

    def __init__(self, monkeypatch):
        import jaxrev._program as P

        self.n = 0
        for name in ("make_jaxpr", "eval_shape"):  # jaxrev's traces and shape checks
            real = getattr(P, name) if name == "make_jaxpr" else P.jax.eval_shape
            monkeypatch.setattr(P if name == "make_jaxpr" else P.jax, name, self.counting(real))

    def counting(self, real):
        def count(*a, **k):
            self.n += 1
            return real(*a, **k)

        return count


def run(xy, th):
    def body(c, _):
        a, b = c
        a = a + jnp.tanh(th * b)
        return (a, b + jnp.sin(a)), None

    return lax.scan(body, xy, None, length=20)[0]


def test_reversible_gradient_is_traced_once_under_eager_grad(monkeypatch):
    count = Counter(monkeypatch)
    f = jr.reversible(run)
    xy = (jnp.linspace(0.1, 1.0, 5), jnp.linspace(-1.0, 0.5, 5))

    def loss(fun):
        return lambda xy, th: jnp.vdot(*fun(xy, th))

    ref = jax.grad(loss(run), argnums=(0, 1))(xy, 0.3)
    count.n = 0
    for th in (0.3, 0.3, 0.7):
        got = jax.grad(loss(f), argnums=(0, 1))(xy, th)
    assert count.n == 1
    want = jax.grad(loss(run), argnums=(0, 1))(xy, 0.7)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-12)
    assert not np.allclose(jax.tree_util.tree_leaves(ref)[0], jax.tree_util.tree_leaves(got)[0])
    # another shape is another key
    xy2 = (jnp.ones(3), jnp.ones(3))
    jax.grad(loss(f), argnums=1)(xy2, 0.3)
    assert count.n == 2


def test_reverse_compiles_from_the_second_eager_call(monkeypatch):
    count = Counter(monkeypatch)

    def f(x, w):
        return lax.fori_loop(0, 10, lambda i, x: x + jnp.tanh(w * x[::-1]), x)

    x, w = jnp.linspace(0.1, 1.0, 4), 0.3
    y = f(x, w)
    inv = jr.reverse(f)
    outs = [inv(y, w) for _ in range(4)]
    # once by the first (eager) call, once for the compiled call
    assert count.n == 2
    for o in outs:
        np.testing.assert_allclose(o, x, rtol=1e-12)
    # a fresh reverse(f) of the same f shares the compiled call
    jr.reverse(f)(y, w)
    assert count.n == 2


def test_changed_closures_attributes_and_arrays_are_seen():
    class Model:
        def __init__(self):
            self.s = 1.0

        def run(self, x):
            return x + self.s * jnp.tanh(x[::-1])

    m = Model()
    x = jnp.linspace(0.1, 1.0, 4)
    for s in (1.0, 0.5, 1.0, 0.25):
        m.s = s
        np.testing.assert_allclose(jr.reverse(m.run)(m.run(x)), x, rtol=1e-10)
    w = np.ones(4)

    def g(x):
        return x * w + 1.0

    for v in (2.0, 3.0, 2.0, 5.0):
        w[:] = v  # changed in place
        np.testing.assert_allclose(jr.reverse(g)(g(x)), x, rtol=1e-12)
    for k in (2.0, 3.0, 2.0):
        h = lambda x: x * k  # noqa: E731 (a new closure each time)
        np.testing.assert_allclose(jr.reverse(h)(h(x)), x, rtol=1e-12)


def test_function_key():
    a = 1.0
    f1 = lambda x: a * x  # noqa: E731
    k1 = function_key(f1)[0]
    assert function_key(f1)[0] == k1
    a = 2.0
    assert function_key(lambda x: a * x)[0] != k1
    big = np.ones(1 << 20)
    assert function_key(lambda x: big * x) is None  # too large to compare: no key
    assert call_key(jnp.sin, (jax.core.ShapedArray((2,), jnp.float32),)) is not None


def test_inverse_transforms_and_newton_direction_repeat_without_retracing(monkeypatch):
    count = Counter(monkeypatch)

    def f(x):
        return jnp.cumsum(jnp.exp(x)) + x

    x = jnp.linspace(-1.0, 1.0, 6)
    J = jax.jacfwd(f)(x)
    count.n = 0
    for v in (jnp.ones(6), jnp.arange(6.0), jnp.ones(6)):
        _, (t,) = jr.inverse_jvp(f, (x,), v)
        np.testing.assert_allclose(J @ t, v, rtol=1e-10, atol=1e-12)
        _, ivjp = jr.inverse_vjp(f, x)
        w = ivjp((v,))
        np.testing.assert_allclose(J.T @ w, v, rtol=1e-10, atol=1e-12)
    n = count.n
    for _ in range(3):
        jr.inverse_jvp(f, (x,), jnp.ones(6))
        jr.inverse_vjp(f, x)[1]((jnp.ones(6),))
    assert count.n == n

    def value(p):
        return jnp.sum(p**4) + jnp.sum(jnp.roll(p, 1) * p) + jnp.sum(p**2)

    H = jax.hessian(value)(x)
    g = jax.grad(value)(x)
    count.n = 0
    for _ in range(4):
        d = jr.optim.newton_direction(value, x)
        np.testing.assert_allclose(H @ d, g, rtol=1e-9)
    first = count.n
    for _ in range(3):
        jr.optim.newton_direction(value, x)
    assert count.n == first


def test_a_failing_check_in_a_compiled_call_raises_its_own_error():
    f = lambda x: x**3  # noqa: E731 (pivot 3x² = 0 at 0)
    x = jnp.array([0.0, 1.0, 2.0])
    msgs = set()
    for _ in range(3):  # eager, then compiled (the check fails there, and is re-run)
        with pytest.raises(jr.SingularJacobianError) as e:
            jr.inverse_jvp(f, (x,), jnp.ones(3))
        msgs.add(str(e.value))
    assert len(msgs) == 1 and "on_error='nan'" in msgs.pop()
    ok = jnp.array([1.0, 2.0, 3.0])
    for _ in range(2):
        _, (t,) = jr.inverse_jvp(f, (ok,), jnp.ones(3))
        np.testing.assert_allclose(t, 1 / (3 * ok**2), rtol=1e-12)


def test_static_leaves_pass_through_the_compiled_call():
    eqx = pytest.importorskip("equinox")

    class Shift(eqx.Module):
        mlp: eqx.nn.MLP
        name: str = "shift"

        def __call__(self, x):
            a, b = x[:2], x[2:]
            return jnp.concatenate([a, b + self.mlp(a)])

    layer = Shift(eqx.nn.MLP(2, 2, 8, 2, activation=jnp.tanh, key=jax.random.PRNGKey(0)))
    x = jnp.linspace(-1.0, 1.0, 4)
    inv = jr.reverse(lambda x, m: m(x))
    for _ in range(3):
        np.testing.assert_allclose(inv(layer(x), layer), x, rtol=1e-12)


def test_a_zero_factor_is_named_on_every_eager_call():
    """Traced, a zero factor divides to an infinity; eagerly `reverse` names it. The compiled
    call's non-finite result is re-run eagerly, so every call raises."""
    f = lambda x, a: x * a  # noqa: E731
    for _ in range(3):
        with pytest.raises(jr.NotInvertibleError, match="mul"):
            jr.reverse(f)(jnp.ones(3), 0.0)
    np.testing.assert_allclose(jr.reverse(f)(jnp.ones(3), 2.0), 0.5)


class Config:
    scale = 2.0


def test_state_read_through_classes_objects_and_library_wrappers_is_seen():
    """Found by review: class attributes, dataclasses with slots, library objects holding the
    user's code (an `eqx.nn.Lambda`), sets, randomness drawn when traced."""
    import dataclasses

    x = jnp.array([1.0, 2.0])

    def f(x):
        return x * Config.scale + 1.0

    for s in (2.0, 2.0, 4.0, 4.0, 2.0):
        Config.scale = s
        np.testing.assert_allclose(jr.reverse(f)(f(x)), x, rtol=1e-12)

    @dataclasses.dataclass(slots=True)
    class Layer:
        w: float

    layers = [Layer(1.0), Layer(2.0)]

    def net(x):
        for layer in layers:
            x = x * layer.w
        return x

    for w in (2.0, 2.0, 4.0, 4.0):
        layers[1].w = w
        np.testing.assert_allclose(jr.reverse(net)(net(x)), x, rtol=1e-12)

    eqx = pytest.importorskip("equinox")
    k = [2.0]
    lam = eqx.nn.Lambda(lambda x: x * k[0] + 1.0)
    for v in (2.0, 2.0, 4.0, 4.0):
        k[0] = v
        np.testing.assert_allclose(jr.reverse(lambda x, m: m(x))(lam(x), lam), x, rtol=1e-12)

    flags = {"double"}

    def g(x):
        return x * (2.0 if "double" in flags else 1.5)

    for clear in (False, False, True, True):
        if clear:
            flags.clear()
        np.testing.assert_allclose(jr.reverse(g)(g(x)), x, rtol=1e-12)

    rng = np.random.default_rng(0)

    def noisy(x):
        return x + rng.normal(size=2)

    outs = [jr.reverse(noisy)(x) for _ in range(3)]  # fresh noise each call, as eagerly
    assert not np.allclose(outs[1], outs[2])


def test_calls_inside_jit_on_concrete_arguments():
    """A transform applied to constants inside `jit` (its arguments concrete, the call
    traced) runs as it is, also once its key was seen eagerly."""
    f = lambda x: 2.0 * x  # noqa: E731
    y0 = jnp.array([2.0, 4.0])
    jr.reverse(f)(y0)
    jr.reverse(f)(y0)
    out = jax.jit(lambda th: th * jr.reverse(f)(y0))(2.0)
    np.testing.assert_allclose(out, [2.0, 4.0])
    g = lambda p: jnp.sum(p**4) + jnp.sum(p**2)  # noqa: E731
    p0 = jnp.array([1.0, 2.0])
    jr.optim.newton_direction(g, p0)
    jr.optim.newton_direction(g, p0)
    d = jax.jit(lambda s: s * jr.optim.newton_direction(g, p0))(2.0)
    np.testing.assert_allclose(d, 2 * jr.optim.newton_direction(g, p0), rtol=1e-12)


def test_cache_entries_do_not_keep_arrays_alive():
    import gc
    import weakref

    x = jnp.ones(4)
    refs = []
    for step in range(5):
        W = jnp.full(4, 2.0 + step)  # new weights every step, as in training
        refs.append(weakref.ref(W))
        h = lambda x, W=W: x * W  # noqa: E731
        np.testing.assert_allclose(jr.reverse(h)(h(x)), x)
        del W, h
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_log_det_transforms_of_a_flowjax_flow_compile_from_the_second_eager_call(monkeypatch):
    """A flowjax flow (modules of an installed library, nested ten deep, its classes ABCs)
    has a key: before, it had none (its classes were keyed by their attributes, an ABC's
    registry among them) and every eager call traced and ran operation by operation."""
    pytest.importorskip("flowjax")
    import flowjax.distributions as fd
    import flowjax.flows as ff

    flow = ff.coupling_flow(jax.random.key(0), base_dist=fd.Normal(jnp.zeros(3)), flow_layers=2)
    bij = flow.bijection
    x = jnp.array([0.3, -1.2, 0.8])
    y, ld = bij.transform_and_log_det(x)
    count = Counter(monkeypatch)
    fwd = jr.forward_and_slogdet(lambda x: bij.transform(x))
    inv = jr.inverse_and_slogdet(lambda y: bij.transform(y))
    for _ in range(3):
        got_y, got_ld = fwd(x)
        got_x, got_ild = inv(y)
        np.testing.assert_allclose(got_y, y, rtol=1e-12)
        np.testing.assert_allclose(got_ld, ld, rtol=1e-12)
        np.testing.assert_allclose(got_x, x, rtol=1e-10)
        np.testing.assert_allclose(got_ild, -ld, rtol=1e-10)
    first = count.n
    for _ in range(3):
        fwd(x), inv(y)
    assert count.n == first  # compiled from the second call: nothing traced again
    signs = []
    for _ in range(3):  # a fresh lambda of the same code and closure: the same key
        first = count.n
        signs.append(jr.slogdet_jacobian(lambda x: bij.transform(x), x))
    assert count.n == first  # the third call traced nothing
    sign, logdet = jnp.linalg.slogdet(jax.jacfwd(bij.transform)(x))
    for got in signs:
        np.testing.assert_allclose(got, (sign, logdet), rtol=1e-12)


def test_a_user_abc_is_keyed_by_its_attributes():
    import abc

    class Scale(abc.ABC):
        factor = 2.0

        @abc.abstractmethod
        def apply(self, x): ...

    class Double(Scale):
        def apply(self, x):
            return self.factor * x

    m = Double()
    assert call_key(lambda x: m.apply(x), (jnp.ones(2),)) is not None
    k1 = call_key(lambda x: m.apply(x), (jnp.ones(2),))[0]
    Scale.factor = 3.0  # a class-level setting changed between calls: a new key
    assert call_key(lambda x: m.apply(x), (jnp.ones(2),))[0] != k1


def test_a_key_whose_traced_call_raises_runs_eagerly_from_then_on():
    """What works only on values (here: a transform that raises when traced) keeps working
    on every eager call: the compiled attempt of the second call raises a jaxrev error, that
    call and every later one of its key run eagerly, and nothing is traced again."""
    from jaxrev._cache import cached_call

    traced = []

    def impl(x):
        if isinstance(x, jax.core.Tracer):
            traced.append(1)
            raise jr.JaxrevError("needs values")
        return 2 * x

    f = lambda x: x  # noqa: E731  (what the key is built from)
    outs = [cached_call("values-only", f, impl, (jnp.arange(3.0),)) for _ in range(4)]
    for o in outs:
        np.testing.assert_array_equal(o, 2 * jnp.arange(3.0))
    assert len(traced) == 1  # the second call's compiled attempt only
