"""PRNG keys in inverted programs (issue 28): a key made inside the function, closed over, or
passed as a parameter is a parameter, computed forward and never inverted, whether it is a
new-style key (`jax.random.key`, dtype ``key<fry>``) or a raw ``uint32[2]`` one
(`jax.random.PRNGKey`). `reverse` round-trips and `reversible`'s gradients equal JAX's (float64,
1e-10), eagerly, under `jit` and under `vmap`; a key's cotangent is float0; keys may even be
state when the program only moves them; and what cannot be inverted raises a jaxrev error naming
the primitive and the user's line, never a `TypeError` from numpy.

Every unsupported step below sits on a line ending in a `# <tag>` marker; the tests check that
the error points at exactly that line.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import scaled_error
from jax import lax
from programs import marker_line
from tiers import cover

import jaxrev as jr

HERE = os.path.basename(__file__)
KINDS = {"key": jax.random.key, "raw": jax.random.PRNGKey}
X = jnp.linspace(0.3, 1.7, 6)
W = jnp.cos(jnp.arange(6.0))


def _line(tag: str) -> int:
    return marker_line(__file__, tag)


def _close(a, b, tol=1e-10):
    err = scaled_error(a, b)  # asserts the shapes match
    assert err <= tol, (err, a, b)


def _bits(k):
    return np.asarray(
        jax.random.key_data(k) if jax.dtypes.issubdtype(k.dtype, jax.dtypes.prng_key) else k
    )


# ----------------------------------------------------------------------------- programs


def programs(make):
    """The issue's programs for one kind of key: name -> (function, parameters after x)."""
    closed = make(7)

    def made_inside(x):  # the example
        noise = jax.random.normal(make(0), x.shape)
        return x * 2.0 + noise

    def split_fold(x):
        k1, k2 = jax.random.split(make(0))
        k3 = jax.random.fold_in(k2, 3)
        return x * 2.0 + jax.random.normal(k1, x.shape) + jax.random.uniform(k3, x.shape)

    def parameter(x, key):
        return x * 2.0 + 0.1 * jnp.sin(x) + jax.random.normal(key, x.shape)

    def closed_over(x):
        return x * 2.0 + jax.random.normal(closed, x.shape)

    def dropout_mask(x):  # a mask picking between invertible branches
        mask = jax.random.bernoulli(make(0), 0.5, x.shape)
        return jnp.where(mask, x * 2.0, x * 0.5) + 1.0

    def nonlinear(x):  # the noise feeds a Newton group
        return x + 0.3 * jnp.tanh(x * jax.random.normal(make(5), x.shape))

    def scan_xs(x):
        def body(c, k):
            return c * 1.5 + jax.random.normal(k, c.shape), None

        return lax.scan(body, x, jax.random.split(make(1), 4))[0]

    def scan_carry(x):
        def body(c, _):
            y, k = c
            k, s = jax.random.split(k)
            return (y * 1.5 + jax.random.normal(s, y.shape), k), None

        return lax.scan(body, (x, make(1)), None, length=4)[0][0]

    def scan_dropout(x, key):
        def body(c, k):
            m = jax.random.bernoulli(k, 0.7, c.shape)
            return jnp.where(m, c * 1.5, c * 0.5) + 0.1, None

        return lax.scan(body, x, jax.random.split(key, 4))[0]

    def fori_fold(x):
        def body(i, c):
            return c * 1.5 + jax.random.normal(jax.random.fold_in(make(2), i), c.shape)

        return lax.fori_loop(0, 3, body, x)

    def fori_carry(x):
        def body(i, c):
            y, k = c
            k, s = jax.random.split(k)
            return y * 1.5 + jax.random.normal(s, y.shape), k

        return lax.fori_loop(0, 3, body, (x, make(2)))[0]

    key = make(3)
    return {
        "made_inside": (made_inside, ()),
        "split_fold": (split_fold, ()),
        "parameter": (parameter, (key,)),
        "closed_over": (closed_over, ()),
        "dropout_mask": (dropout_mask, ()),
        "nonlinear": (nonlinear, ()),
        "scan_xs": (scan_xs, ()),
        "scan_carry": (scan_carry, ()),
        "scan_dropout": (scan_dropout, (key,)),
        "fori_fold": (fori_fold, ()),
        "fori_carry": (fori_carry, ()),
    }


NAMES = list(programs(jax.random.key))


def _loss(f, args):
    return lambda x: jnp.sum(W * f(x, *args) ** 2)


@pytest.mark.parametrize("name,kind", cover(list(NAMES), list(KINDS)))
def test_reverse_round_trips(name, kind):
    f, args = programs(KINDS[kind])[name]
    inv = jr.reverse(f)
    _close(inv(f(X, *args), *args), X)
    _close(jax.jit(inv)(f(X, *args), *args), X)
    xb = jnp.stack([X, X + 0.1, X - 0.2])
    yb = jax.vmap(lambda x: f(x, *args))(xb)
    _close(jax.vmap(lambda y: inv(y, *args))(yb), xb)


@pytest.mark.parametrize("name,kind", cover(list(NAMES), list(KINDS), shift=1))
def test_reversible_gradients_equal_jax(name, kind):
    f, args = programs(KINDS[kind])[name]
    rf = jr.reversible(f)
    g0 = jax.grad(_loss(f, args))(X)
    _close(jax.grad(_loss(rf, args))(X), g0)
    _close(jax.jit(jax.grad(_loss(rf, args)))(X), g0)
    xb = jnp.stack([X, X + 0.1])
    _close(jax.vmap(jax.grad(_loss(rf, args)))(xb), jax.vmap(jax.grad(_loss(f, args)))(xb))


# ----------------------------------------------------------------------------- keys as values


@pytest.mark.parametrize("kind", KINDS)
def test_batched_keys(kind):
    """A batch of keys, one per example (vmapped with the state), for both transforms."""
    make = KINDS[kind]
    keys = jax.vmap(make)(jnp.arange(3))
    xb = jnp.stack([X, X + 0.1, X - 0.2])
    for name in ("parameter", "scan_dropout"):
        f, _ = programs(make)[name]
        yb = jax.vmap(f)(xb, keys)
        _close(jax.vmap(jr.reverse(f))(yb, keys), xb)
        _close(jax.jit(jax.vmap(jr.reverse(f)))(yb, keys), xb)
        loss = lambda g: lambda x, k: jnp.sum(W * g(x, k) ** 2)  # noqa: E731
        _close(
            jax.vmap(jax.grad(loss(jr.reversible(f))))(xb, keys),
            jax.vmap(jax.grad(loss(f)))(xb, keys),
        )


@pytest.mark.parametrize("kind", KINDS)
def test_a_keys_cotangent_is_float0(kind):
    f, (key,) = programs(KINDS[kind])["scan_dropout"]
    y, pull = jax.vjp(jr.reversible(f), X, key)
    y0, pull0 = jax.vjp(f, X, key)
    (gx, gk), (gx0, gk0) = pull(W), pull0(W)
    _close(y, y0)
    _close(gx, gx0)
    assert gk.dtype == gk0.dtype == jax.dtypes.float0 and gk.shape == gk0.shape
    _close(
        jax.jvp(lambda x: jr.reversible(f)(x, key), (X,), (W,))[1],
        jax.jvp(lambda x: f(x, key), (X,), (W,))[1],
    )


@pytest.mark.parametrize("kind", KINDS)
def test_key_carries_under_the_dial(kind):
    """A key carried through a loop is stored per iteration (splitting loses it): with
    checkpoints, a memory budget, and in a `while_loop` bounded by `max_steps` whose trip count
    differs per example (the carries are selected per element)."""
    make = KINDS[kind]
    f, _ = programs(make)["scan_carry"]
    g0 = jax.grad(_loss(f, ()))(X)
    for kw in (dict(checkpoint_every=2), dict(memory_budget=64)):
        _close(jax.grad(_loss(jr.reversible(f, **kw), ()))(X), g0)

    def loop(x, n):
        def body(c):
            y, k, i = c
            k, s = jax.random.split(k)
            return y * 1.5 + jax.random.normal(s, y.shape), k, i + 1

        return lax.while_loop(lambda c: c[2] < n, body, (x, make(2), 0))[0]

    def masked(x, n):  # the same loop as a scan (which JAX differentiates)
        def body(c, i):
            y, k = c
            k2, s = jax.random.split(k)
            on = i < n
            return (
                jnp.where(on, y * 1.5 + jax.random.normal(s, y.shape), y),
                jnp.where(on, k2, k),
            ), None

        return lax.scan(body, (x, make(2)), jnp.arange(6))[0][0]

    xb, ns = jnp.stack([X, X + 0.1]), jnp.array([2, 4])
    loss = lambda g: lambda x, n: jnp.sum(W * g(x, n) ** 2)  # noqa: E731
    want = jax.vmap(jax.grad(loss(masked)))(xb, ns)
    for ck in (None, 2):
        rf = jr.reversible(loop, max_steps=6, checkpoint_every=ck)
        _close(jax.jit(jax.vmap(jax.grad(loss(rf))))(xb, ns), want)


@pytest.mark.parametrize("kind", KINDS)
def test_reports_on_keys(kind):
    progs = programs(KINDS[kind])
    f = progs["closed_over"][0]
    assert jr.memory_report(f, X, checkpoint_every=None).total_bytes == 0
    assert jr.check_reversible(f, X).max_error < 1e-12
    f = progs["scan_carry"][0]
    # the key each iteration overwrites: 8 bytes
    (entry,) = jr.memory_report(f, X, checkpoint_every=None).entries
    assert entry["bytes"] == 8 and entry["count"] == 4, entry
    assert jr.check_reversible(f, X).max_error < 1e-12


@pytest.mark.parametrize("kind", KINDS)
def test_hook_passes_a_key_along(kind):
    key = KINDS[kind](1)

    def f(x):
        y, k = jr.hook(lambda g: g, (x, key))
        return y * 2.0 + jax.random.normal(k, y.shape)

    _close(jax.grad(_loss(jr.reversible(f), ()))(X), jax.grad(_loss(f, ()))(X))


# ----------------------------------------------------------------------------- keys as state

MOVES = {
    "reverse": lambda k: k[::-1],
    "roll": lambda k: jnp.concatenate([k[1:], k[:1]]),
    "transpose": lambda k: k.reshape((2, 2) + k.shape[1:]).swapaxes(0, 1).reshape(k.shape),
    "permute": lambda k: k[jnp.array([2, 0, 3, 1])],
    "scatter": lambda k: k.at[jnp.array([1, 0])].set(k[jnp.array([0, 1])]),
    "scan": lambda k: lax.scan(lambda c, _: (c[::-1], None), k, None, length=3)[0],
}


@pytest.mark.parametrize("move,kind", cover(list(MOVES), list(KINDS)))
def test_keys_moved_around_are_state(move, kind):
    """A program that only moves keys inverts them (exactly: their bits)."""
    keys = jax.vmap(KINDS[kind])(jnp.arange(4))
    f = MOVES[move]
    assert (_bits(jr.reverse(f)(f(keys))) == _bits(keys)).all()
    assert (_bits(jax.jit(jr.reverse(f))(f(keys))) == _bits(keys)).all()
    assert jr.check_reversible(f, keys).max_error == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_keys_in_a_mixed_state(kind):
    keys = jax.vmap(KINDS[kind])(jnp.arange(4))
    x = X[:4]

    def f(x, k):
        return x * 2.0 + jax.random.normal(k[0], x.shape), k[::-1]

    def g(x, k):  # the state's structure changes (a list): element counts are checked
        return [x * 2.0 + jax.random.normal(k[0], x.shape), k[::-1]]

    back = jr.reverse(f, argnums=(0, 1))(*f(x, keys))
    _close(back[0], x)
    assert (_bits(back[1]) == _bits(keys)).all()
    assert jr.check_reversible(f, x, keys, argnums=(0, 1)).max_error < 1e-12
    want = jax.grad(lambda x: jnp.sum(f(x, keys)[0] ** 2))(x)
    for h in (f, g):
        rf = jr.reversible(h, argnums=(0, 1))
        _close(jax.grad(lambda x: jnp.sum(rf(x, keys)[0] ** 2))(x), want)


# ----------------------------------------------------------------------------- what cannot be


def _check(err, primitives, tag):
    msg = str(err)
    assert isinstance(err, jr.NotInvertibleError), (type(err), msg)
    assert err.primitive in primitives.split(), msg
    assert err.line == _line(tag), (err.line, _line(tag), msg)
    assert HERE in msg, msg


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_that_zeroes_is_named(kind):
    """Real dropout loses the dropped elements: `reverse` names the select and its line;
    `reversible` stores what it drops."""
    make = KINDS[kind]

    def f(x):
        mask = jax.random.bernoulli(make(0), 0.5, x.shape)
        return jnp.where(mask, x / 0.5, 0.0)  # <dropout>

    with pytest.raises(jr.NotInvertibleError) as ei:
        jr.reverse(f)(f(X))
    _check(ei.value, "select_n", "dropout")
    _close(jax.grad(_loss(jr.reversible(f), ()))(X), jax.grad(_loss(f, ()))(X))
    assert jr.memory_report(f, X, checkpoint_every=None).total_bytes == X.nbytes


@pytest.mark.parametrize("kind", KINDS)
def test_splitting_a_key_state_is_named(kind):
    def f(k):
        return jax.random.split(k)[0]  # <split-state>

    with pytest.raises(jr.NotInvertibleError) as ei:
        jr.reverse(f)(f(KINDS[kind](0)))
    _check(ei.value, "slice squeeze unstack", "split-state")  # (as JAX versions spell it)


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_picked_by_the_state_is_a_jaxrev_error(kind):
    """A key chosen by the state is no parameter; what stops the walk is named."""
    make = KINDS[kind]

    def f(x):
        k = jnp.where(x[0] > 1.0, jax.random.fold_in(make(0), 1), make(0))
        return x * 2.0 + jax.random.normal(k, x.shape)  # <picked>

    with pytest.raises(jr.NotInvertibleError) as ei:
        jr.reverse(f)(f(X))
    _check(ei.value, "add", "picked")
    _close(jax.grad(_loss(jr.reversible(f), ()))(X), jax.grad(_loss(f, ()))(X))
