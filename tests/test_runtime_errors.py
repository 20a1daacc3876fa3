"""A jaxrev check that fails where a compiled program runs raises its documented error (issue 29,
item 3): under `jr.jit`, under `jax.jit` inside `jr.raise_runtime_errors()`, under `vmap`, and
on jaxrev's own compiled eager calls; message first, naming the user's line, never XLA's
``INTERNAL: CpuCallback error ...``. Each failing program's user line ends in a `# <tag>` marker.

`reversible` is always given ``on_drift="raise", checkpoint_every=None``: its default policy is
not what these tests are about.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from programs import marker_line

import jaxrev as jr
from jaxrev import _runtime

HERE = os.path.basename(__file__)


def _at(tag: str) -> str:
    return f"{HERE}:{marker_line(__file__, tag)}"


# --------------------------------------------------------------- three programs failing at run time


def _halve(y):
    # contracting: run backwards, each step doubles the rounding error
    return lax.fori_loop(0, 60, lambda i, y: 0.5 * y + 0.1, y)  # <drift>


_halving = jr.reversible(_halve, on_drift="raise", checkpoint_every=None)


def drift_grad(y):
    return jax.grad(lambda y: _halving(y).sum())(y)


def _flat_at_zero(x):
    # 1 - cos x vanishes at 0: so does the Jacobian of Newton's method there
    return x - jnp.sin(x)  # <singular>


def singular(y):
    return jr.reverse(_flat_at_zero)(y)


def _parabola(x):
    # x + x² >= -1/4: no x maps to -0.5
    return x + x**2  # <no-preimage>


def no_preimage(y):
    return jr.reverse(_parabola)(y)


# (program, its error type, the start of its message, its tag, a failing input, a good one)
CASES = {
    "drift": (drift_grad, jr.DriftError, "jaxrev.reversible(_halve): ", "drift", jnp.ones(2), None),
    "singular": (
        singular,
        jr.SingularJacobianError,
        "jaxrev.reverse: ",
        "singular",
        jnp.array([0.0, 1.0]),
        jnp.array([0.5, 1.0]),
    ),
    "no-preimage": (
        no_preimage,
        jr.ReversibilityError,
        "jaxrev.reverse: ",
        "no-preimage",
        jnp.array([2.0, -0.5]),
        jnp.array([2.0, 0.75]),
    ),
}
IDS = list(CASES)


def _check_message(err: BaseException, cls: type, start: str, tag: str) -> None:
    msg = str(err)
    assert type(err) is cls, (type(err), msg)
    assert msg.startswith(start), msg
    assert _at(tag) in msg, msg
    assert "INTERNAL" not in msg and "jaxrev-check-" not in msg, msg
    assert err.__cause__ is None and err.__suppress_context__  # the message comes first


@pytest.mark.parametrize("case", IDS)
def test_jr_jit_raises_the_documented_error(case):
    fun, cls, start, tag, bad, good = CASES[case]
    jf = jr.jit(fun)
    for _ in range(2):  # compiled on the first call, cached on the second
        with pytest.raises(cls) as info:
            jf(bad)
        _check_message(info.value, cls, start, tag)
        assert isinstance(info.value.__context__, jax.errors.JaxRuntimeError)
        jax.effects_barrier()  # the failed computation's runtime token is not kept
    if good is not None:
        np.testing.assert_allclose(fun(good), jf(good), rtol=1e-12)


@pytest.mark.parametrize("case", IDS)
def test_plain_jit_inside_raise_runtime_errors(case):
    fun, cls, start, tag, bad, _ = CASES[case]
    jf = jax.jit(fun)
    with pytest.raises(cls) as info:
        with jr.raise_runtime_errors():
            jax.block_until_ready(jf(bad))
    _check_message(info.value, cls, start, tag)
    # also a decorator
    with pytest.raises(cls):
        jr.raise_runtime_errors()(lambda y: jax.block_until_ready(jf(y)))(bad)
    # without it: JAX's runtime error, which still carries jaxrev's message
    with pytest.raises(jax.errors.JaxRuntimeError) as raw:
        jax.block_until_ready(jf(bad))
    assert start in str(raw.value) and "jr.raise_runtime_errors()" in str(raw.value)
    assert type(_runtime.runtime_error(raw.value)) is cls  # (taken out of the stash)


@pytest.mark.parametrize("case", IDS)
def test_vmap_inside_jr_jit(case):
    fun, cls, start, tag, bad, _ = CASES[case]
    batch = jnp.stack([bad + 0.0, bad])
    if case != "drift":  # one good sample beside the bad one
        batch = batch.at[0].set(CASES[case][5])
    with pytest.raises(cls) as info:
        jr.jit(jax.vmap(fun))(batch)
    _check_message(info.value, cls, start, tag)


@pytest.mark.parametrize("case", IDS)
def test_eager_calls_raise_the_documented_error(case):
    """Eagerly, and on jaxrev's compiled eager calls (from the second call on, `_cache`: a
    failed check there is re-run eagerly), never JAX's runtime error."""
    fun, cls, start, tag, bad, _ = CASES[case]
    for _ in range(3):
        with pytest.raises(cls) as info:
            fun(bad)
        msg = str(info.value)
        assert msg.startswith(start) and _at(tag) in msg, msg
        assert "INTERNAL" not in msg and "jaxrev-check-" not in msg, msg


def test_disable_jit_raises_the_documented_error():
    fun, cls, start, tag, bad, _ = CASES["no-preimage"]
    with jax.disable_jit():
        with pytest.raises(cls) as info:
            jax.jit(fun)(bad)
    assert str(info.value).startswith(start) and _at(tag) in str(info.value)


def test_inverse_jvp_singular_at_run_time():
    """`inverse_jvp` under `jit` finds a vanished pivot from its non-finite result: the step is
    not named there (its message says so), but the type is the documented one."""

    def f(x, p):
        return x * p

    g = jr.jit(lambda p: jr.inverse_jvp(lambda x: f(x, p), (jnp.ones(2),), jnp.ones(2))[1][0])
    np.testing.assert_allclose(g(jnp.array([1.0, 2.0])), [1.0, 0.5])
    with pytest.raises(jr.SingularJacobianError) as info:
        g(jnp.array([1.0, 0.0]))
    assert str(info.value).startswith("jaxrev.inverse_jvp: the result is not finite")


# ------------------------------------------------------------------------- jr.jit is jax.jit


def test_jr_jit_without_checks_is_jax_jit_and_never_blocks(monkeypatch):
    traces = []
    blocked = []
    monkeypatch.setattr(_runtime, "block", lambda out: blocked.append(out))

    def f(x, n):
        traces.append(n)
        return jnp.sin(x) * n

    jf = jr.jit(f, static_argnums=1)
    x = jnp.linspace(0.0, 1.0, 5)
    for _ in range(3):
        out = jf(x, 2)
    assert traces == [2] and blocked == []
    jf(x, 3)
    assert traces == [2, 3] and blocked == []
    np.testing.assert_array_equal(out, jax.jit(f, static_argnums=1)(x, 2))
    assert jf.__name__ == "f" and jf.__wrapped__ is f
    # jax.jit's other methods, passed through
    assert jf.eval_shape(x, 2) == jax.eval_shape(lambda x: f(x, 2), x)
    assert str(jf.trace(x, 2).jaxpr) == str(jax.jit(f, static_argnums=1).trace(x, 2).jaxpr)
    np.testing.assert_array_equal(jf.lower(x, 2).compile()(x), out)
    jf.clear_cache()


def test_jr_jit_as_a_decorator_and_nested():
    @jr.jit(static_argnames="k")
    def g(x, k=1):
        return x * k

    assert float(g(jnp.float32(2.0), k=3)) == 6.0
    assert float(jax.jit(lambda x: g(x, k=2) + 1.0)(1.0)) == 3.0
    assert float(jax.grad(lambda x: g(x, k=2))(1.0)) == 2.0


def test_a_function_with_a_check_blocks_on_its_result(monkeypatch):
    blocked = []
    real = _runtime.block
    monkeypatch.setattr(_runtime, "block", lambda out: blocked.append(real(out)))
    jf = jr.jit(singular)
    good = jnp.array([0.5, 1.0])
    np.testing.assert_allclose(_flat_at_zero(jf(good)), good, rtol=1e-12)
    jf(good)
    assert len(blocked) == 2


def test_a_check_inside_an_inner_jit_traced_before_is_seen(monkeypatch):
    """JAX reuses the inner function's trace, so no check is staged while the outer function
    traces: the check is seen when it is lowered."""
    blocked = []
    monkeypatch.setattr(_runtime, "block", lambda out: blocked.append(out))
    inner = jax.jit(no_preimage)
    good = CASES["no-preimage"][5]
    jax.make_jaxpr(inner)(good)
    jr.jit(lambda y: inner(y) * 2.0)(good)
    assert len(blocked) == 1


def test_equinox_filter_jit():
    """`eqx.filter_jit` converts Equinox's own errors only: a jaxrev check's runtime error
    passes through it unchanged, and `jr.raise_runtime_errors()` around it converts it."""
    eqx = pytest.importorskip("equinox")
    fun, cls, start, tag, bad, _ = CASES["no-preimage"]
    ef = eqx.filter_jit(fun)
    with pytest.raises(jax.errors.JaxRuntimeError) as raw:
        ef(bad)
    _runtime.runtime_error(raw.value)
    with pytest.raises(cls) as info:
        jr.raise_runtime_errors()(ef)(bad)
    _check_message(info.value, cls, start, tag)


def test_stash_is_bounded_and_emptied_by_the_converters():
    fun, cls, *_ = CASES["no-preimage"]
    bad = CASES["no-preimage"][4]
    jf = jax.jit(fun)
    for _ in range(_runtime.STASH_SIZE + 5):
        with pytest.raises(jax.errors.JaxRuntimeError):
            jax.block_until_ready(jf(bad))
    assert len(_runtime._STASH.errors) == _runtime.STASH_SIZE
    _runtime._STASH.errors.clear()
    jr_f = jr.jit(fun)
    for _ in range(3):
        with pytest.raises(cls):
            jr_f(bad)
    assert len(_runtime._STASH.errors) == 0


def test_each_thread_gets_its_own_error():
    jf = jr.jit(lambda y, s: jr.reverse(lambda x: x + s * x**2)(y))
    results: dict = {}
    stashed = len(_runtime._STASH.errors)

    def run(k):
        s = float(k + 1)
        try:
            jf(jnp.array([-1.0 / s]), s)  # x + s x² >= -1/(4s): no preimage of -1/s
        except jr.ReversibilityError as e:
            results[k] = str(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2, 3]
    assert all(m.startswith("jaxrev.reverse: ") for m in results.values())
    # each its own: the residual left, 3/(4s), differs from thread to thread
    for k, m in results.items():
        assert f"residual {3 / (4 * (k + 1)):.3g} " in m, m
    assert len(_runtime._STASH.errors) == stashed


def test_the_failed_callback_log_is_one_line(caplog):
    fun, cls, start, *_ = CASES["no-preimage"]
    bad = CASES["no-preimage"][4]
    with caplog.at_level(logging.ERROR, logger="jax"):
        with pytest.raises(cls):
            jr.jit(fun)(bad)
    assert not [r for r in caplog.records if "callback failed" in r.getMessage()]
    with caplog.at_level(logging.ERROR, logger="jax"):
        with pytest.raises(jax.errors.JaxRuntimeError):
            jax.block_until_ready(jax.jit(fun)(bad))
    logged = [r for r in caplog.records if "callback failed" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None
    assert start in logged[0].getMessage() and "\n" not in logged[0].getMessage()
    _runtime._STASH.errors.clear()
