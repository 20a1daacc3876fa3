"""`jaxrev._host`: the numpy forms of primitives the walks evaluate on constants when they
trace, against JAX's own evaluation of the same equations (bit for bit)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxrev import _host as host
from jaxrev._compat import bind_eqn

MOVES = {
    "pad": (lambda x: lax.pad(x, np.int32(-7), ((1, -1, 2), (-1, 2, 0))), (4, 3)),
    "pad negative": (lambda x: lax.pad(x, np.int32(-7), ((-2, -1, 1),)), (5,)),
    "slice strided": (lambda x: lax.slice(x, (1, 0), (5, 3), (2, 2)), (6, 3)),
    "concatenate": (lambda x: jnp.concatenate([x, x[:, :1]], axis=1), (2, 3)),
    "reshape": (lambda x: x.reshape(3, 4), (2, 6)),
    "broadcast_in_dim": (lambda x: lax.broadcast_in_dim(x, (2, 3, 4), (0, 2)), (2, 4)),
    "transpose": (lambda x: x.transpose(2, 0, 1), (2, 3, 4)),
    "squeeze": (lambda x: lax.squeeze(x, (1,)), (3, 1, 2)),
    "rev": (lambda x: lax.rev(x, (0, 1)), (3, 2)),
    "dynamic_slice clamped": (
        lambda x: lax.dynamic_slice(x, (np.int32(5), np.int32(1)), (2, 2)),
        (4, 3),
    ),
    "dynamic_update_slice clamped": (
        lambda x: lax.dynamic_update_slice(x, x[:2, :2], (np.int32(-3), np.int32(2))),
        (4, 3),
    ),
    "select_n": (lambda x: lax.select_n(x % 3, x, -x, 2 * x), (3, 4)),
}


def _run(fun, *args):
    """Every equation of `fun`'s jaxpr (calls included) with its input values, by JAX."""
    jaxpr = jax.make_jaxpr(fun)(*args).jaxpr
    env = dict(zip(jaxpr.invars, args))

    def read(v):
        return np.asarray(v.val, v.aval.dtype) if hasattr(v, "val") else env[v]

    out = []
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        out.append((e, ins))
        for o, val in zip(e.outvars, bind_eqn(e, ins)):
            env[o] = np.asarray(val)
    return out


@pytest.mark.parametrize("name", sorted(MOVES))
def test_moves_equal_jaxs(name):
    fun, shape = MOVES[name]
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    e, ins = _run(fun, x)[-1]
    got = host.moves(e, ins)
    assert got is not None, name
    want = np.asarray(bind_eqn(e, ins)[0])
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


ELEMENTWISE = {
    "add wraps": (lambda a, b: a + b, np.int32),
    "mul wraps": (lambda a, b: a * b, np.int32),
    "sub": (lambda a, b: a - b, np.uint32),
    "compare": (lambda a, b: a < b, np.int32),
    "max": (lambda a, b: jnp.maximum(a, b), np.int8),
    "bool ops": (lambda a, b: (a > 0) & ~(b > 0) ^ (a == b), np.int32),
    "select": (lambda a, b: lax.select(a > b, a, b), np.int32),
    "convert": (lambda a, b: (a + b).astype(jnp.int8), np.int32),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_equal_jaxs_with_a_leading_axis(name):
    """Integer and boolean steps at every iteration at once (a leading axis on one operand,
    the other broadcast), overflow wrapping as XLA's does."""
    fun, dt = ELEMENTWISE[name]
    rng = np.random.default_rng(0)
    info = np.iinfo(dt)
    a = rng.integers(info.min // 2, info.max // 2, (5, 3), dtype=np.int64).astype(dt)
    b = rng.integers(info.min // 2, info.max // 2, (3,), dtype=np.int64).astype(dt)
    for q, ins in _run(fun, a[0], b):
        if q.primitive.name in ("pjit", "jit"):
            continue
        # (every iteration at once: the first operand with a leading axis, the others
        # broadcast over it)
        first = np.stack([ins[0], ins[0] + np.asarray(1, ins[0].dtype)])
        lead = [first] + [np.asarray(x)[None] if np.ndim(x) else x for x in ins[1:]]
        got = host.elementwise(q, lead)
        assert got is not None, q.primitive
        axes = (0,) + (None,) * (len(ins) - 1)
        with jax.ensure_compile_time_eval():
            want = np.asarray(jax.vmap(lambda *z: bind_eqn(q, z)[0], in_axes=axes)(first, *ins[1:]))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)


def test_what_the_host_does_not_know_is_declined():
    """A float step and an integer division (XLA truncates, numpy floors) go to JAX."""
    e, ins = next((q, i) for q, i in _run(lax.div, np.int32(7), np.int32(-2)))
    assert host.elementwise(e, ins) is None
    e, ins = _run(lax.add, np.float32(1), np.float32(2))[0]
    assert host.elementwise(e, ins) is None


def test_select_n_as_xla_lowers_it():
    """An integer `which` past the last case takes the last one, a negative one the first
    (XLA halves the cases by ``which < mid``), with any number of cases (numpy's `choose`
    stops at 64 and raises out of range)."""
    which = np.array([-1, 0, 1, 2, 5], np.int32)
    for n in (2, 3, 70):
        cases = [np.full(5, 10 * k, np.int32) for k in range(n)]
        e, ins = _run(lambda w, *c: lax.select_n(w, *c), which, *cases)[0]
        np.testing.assert_array_equal(host.elementwise(e, ins), np.asarray(bind_eqn(e, ins)[0]))
        np.testing.assert_array_equal(host.moves(e, ins), np.asarray(bind_eqn(e, ins)[0]))


def test_operands_of_different_dtypes_are_declined():
    """A float padding value beside integer positions: JAX refuses the pad (the caller then
    knows nothing of the step), where numpy would cast the value into a position."""
    x = np.arange(3, dtype=np.int32)
    e = jax.make_jaxpr(lambda x: lax.pad(x, np.int32(1), ((0, 2, 0),)))(x).jaxpr.eqns[0]
    assert host.moves(e, [x, np.float32(1.0)]) is None


@pytest.mark.parametrize("case", ["clamp", "select", "key"])
def test_every_iteration_at_once_aligns_on_the_iterations(case):
    """`Statics.enum` of a step whose operand is a scalar at every iteration (a loop counter)
    beside an array: the counter's values meet the iterations, not the array's last axis
    (T == n made it silently wrong); a PRNG key operand stays with JAX."""
    from jaxrev._env import Statics

    T = 3
    f = {
        "clamp": lambda i: lax.clamp(np.int32(0), jnp.arange(3, dtype=jnp.int32) + i, i),
        "select": lambda i: lax.select_n(
            i > 0, jnp.arange(3, dtype=jnp.int32) + i, jnp.arange(3, dtype=jnp.int32) - i
        ),
        "key": lambda i: jax.random.key_data(
            jax.vmap(jax.random.fold_in)(jax.random.split(jax.random.key(0), 2), jnp.stack([i, i]))
        ),
    }[case]
    closed = jax.make_jaxpr(f)(jnp.int32(0))
    jaxpr = closed.jaxpr
    st = Statics(
        jaxpr, closed.consts, enum_in={jaxpr.invars[0]: np.arange(T, dtype=np.int32)}, length=T
    )
    want = np.stack([np.asarray(f(jnp.int32(t))) for t in range(T)])
    np.testing.assert_array_equal(st.enum(jaxpr.outvars[0]), want)
