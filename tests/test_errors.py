"""Errors: where a program loses information, `jr.reverse` raises `jr.NotInvertibleError` at
trace time naming the primitive, the user's file and line, and a way out; outputs that do not
match the state raise `ValueError`; `jr.check_reversible` reports and polices round-trip drift.

Every lossy operation below sits on a line ending in a `# <tag>` marker, and each test checks
that the error points at exactly that line of this file.
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns
from jax import lax
from programs import marker_line

import jaxrev as jr

HERE = os.path.basename(__file__)


def _line(tag: str) -> int:
    return marker_line(__file__, tag)


def _check(err: BaseException, primitive: str, tag: str, hint: str | None = None) -> str:
    """The checks every NotInvertibleError must pass (docs/design.md §1, Errors)."""
    msg = str(err)
    assert isinstance(err, jr.NotInvertibleError)
    assert isinstance(err, jr.JaxrevError)
    assert err.primitive == primitive, msg
    assert re.search(rf"\b{re.escape(primitive)}\b", msg), msg
    assert HERE in msg, msg
    assert isinstance(err.line, int) and not isinstance(err.line, bool), (err.line, msg)
    assert err.line == _line(tag), (err.line, _line(tag), msg)
    assert err.file is not None and os.path.basename(err.file) == HERE, (err.file, msg)
    assert re.search(r"ways? out", msg, re.IGNORECASE), msg  # one way out
    if hint is not None:
        assert hint in msg, msg
    return msg


def _raises(f, *args, argnums=0):
    """Run `reverse(f)` on `f`'s own output; return the NotInvertibleError it raises."""
    y = f(*args)
    inv_args = list(args)
    inv_args[argnums] = y
    with pytest.raises(jr.NotInvertibleError) as info:
        jr.reverse(f, argnums=argnums)(*inv_args)
    return info.value


X = jnp.array([-1.5, -0.25, 0.5, 2.0])


# ----------------------------------------------------------------------------- class hierarchy


def test_error_classes_are_jaxrev_errors():
    assert issubclass(jr.NotInvertibleError, jr.JaxrevError)
    assert issubclass(jr.ReversibilityError, jr.JaxrevError)
    assert issubclass(jr.SingularJacobianError, jr.JaxrevError)
    assert issubclass(jr.JaxrevError, Exception)


# ----------------------------------------------------------------------------- relu / max


def test_relu():
    def f(x):
        return jax.nn.relu(x)  # <relu>

    _check(_raises(f, X), "max", "relu")


def test_maximum_with_zero():
    def f(x):
        return jnp.maximum(x, 0.0)  # <maximum>

    _check(_raises(f, X), "max", "maximum")


# ----------------------------------------------------------------------------- multiply by zero


def test_multiply_by_literal_zero():
    def f(x):
        return x * 0.0  # <mul-literal-zero>

    _check(_raises(f, X), "mul", "mul-literal-zero")


def test_multiply_by_concrete_zero_parameter():
    def f(x, w):
        return x * w  # <mul-zero-param>

    w = jnp.array([1.0, 2.0, 0.0, 3.0])  # one zero entry is enough to lose information
    _check(_raises(f, X, w), "mul", "mul-zero-param")


def test_multiply_by_closed_over_zero_array():
    w = jnp.zeros(4)

    def f(x):
        return x * w  # <mul-zero-const>

    _check(_raises(f, X), "mul", "mul-zero-const")


# ----------------------------------------------------------------------------- squares


def test_square_by_self_multiplication():
    def f(x):
        return x * x  # <x-times-x>

    _check(_raises(f, X), "mul", "x-times-x")


def test_square_by_integer_power():
    def f(x):
        return x**2  # <x-pow-2>

    _check(_raises(f, X), "integer_pow", "x-pow-2")


def test_square_by_jnp_square():
    def f(x):
        return jnp.square(x)  # <jnp-square>

    _check(_raises(f, X), "square", "jnp-square")


# ----------------------------------------------------------------------------- reductions


def test_sum_broadcast_back():
    def f(x):
        return jnp.broadcast_to(x.sum(), x.shape)  # <sum-broadcast>

    _check(_raises(f, X), "reduce_sum", "sum-broadcast")


def test_subtract_mean_raises_at_its_line():
    def f(x):
        return x - x.mean()  # <sub-mean-a>

    err = _raises(f, X)
    assert isinstance(err.line, int) and err.line == _line("sub-mean-a"), str(err)
    assert HERE in str(err) and err.primitive is not None and err.primitive in str(err)


def test_subtract_mean_names_reduce_sum():
    def f(x):
        return x - x.mean()  # <sub-mean-b>

    _check(_raises(f, X), "reduce_sum", "sub-mean-b")


# ----------------------------------------------------------------------------- rounding


def test_round():
    def f(x):
        return jnp.round(x)  # <round>

    _check(_raises(f, X), "round", "round")


def test_floor():
    def f(x):
        return jnp.floor(x)  # <floor>

    _check(_raises(f, X), "floor", "floor")


# ----------------------------------------------------------------------------- dtype narrowing


def test_narrowing_conversion_float64_to_float32_and_back():
    def f(x):
        return x.astype(jnp.float32).astype(jnp.float64)  # <narrow>

    assert X.dtype == jnp.float64
    _check(_raises(f, X), "convert_element_type", "narrow")


# ----------------------------------------------------------------------------- control flow


def test_plain_while_loop_suggests_jr_while_loop():
    def f(x):
        return lax.while_loop(lambda c: c.sum() < 10.0, lambda c: c + 1.0, x)  # <while>

    _check(_raises(f, X), "while", "while", hint="jr.while_loop")


def test_plain_cond_with_two_consistent_branches_suggests_jr_cond():
    # y = x where sum(x) > 0, else -x: for sum(y) > 0 both x = y and x = -y map to y
    def f(x):
        return lax.cond(x.sum() > 0, lambda v: v, lambda v: -v, x)  # <cond>

    msg = _check(_raises(f, X), "cond", "cond", hint="jr.cond")
    assert "two different branches" in msg, msg


def test_plain_cond_with_a_state_dependent_index_inverts():
    def f(x):
        return lax.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: v * 3.0, x)

    for x in (X, -X):
        assert jnp.allclose(jr.reverse(f)(f(x)), x, atol=1e-15)
        assert jnp.allclose(jax.jit(jr.reverse(f))(f(x)), x, atol=1e-15)


def test_where_with_a_constant_case_is_refused_when_traced():
    # relu written with where: its zero case does not depend on x
    def f(x):
        return jnp.where(x > 0, x, 0.0)  # <where>

    msg = _check(_raises(f, X), "select_n", "where")
    assert "relu" in msg, msg
    with pytest.raises(jr.NotInvertibleError):  # the same when traced under jit
        jax.jit(jr.reverse(f))(f(X))


def test_two_consistent_cases_raise_naming_the_select():
    # |x| written with where: for y > 0 both x = y and x = -y are consistent
    def f(x):
        return jnp.where(x > 0, x, -x)  # <two-cases>

    _check(_raises(f, X), "select_n", "two-cases")
    with pytest.raises(Exception, match="two different branches"):  # a runtime error
        jax.block_until_ready(jax.jit(jr.reverse(f))(f(X)))
    inv = jr.reverse(f, on_error="nan")(f(X))  # NaN where asked for, at the ambiguous ones
    assert bool(jnp.all(jnp.isnan(inv)))


# ----------------------------------------------------------------------------- linear algebra


def test_singular_known_matrix():
    def f(x, w):
        return x @ w  # <singular-matmul>

    w = jnp.array([[1.0, 2.0, 0.0], [2.0, 4.0, 0.0], [0.0, 0.0, 1.0]])  # rank 2
    _check(_raises(f, X[:3], w), "dot_general", "singular-matmul")


# ----------------------------------------------------------------------------- sin


def test_sin_is_not_globally_invertible():
    def f(x):
        return jnp.sin(x)  # <sin>

    _check(_raises(f, X), "sin", "sin")


# ----------------------------------------------------------------------------- nested programs


def test_error_inside_jitted_inner_function():
    @jax.jit
    def inner(x):
        return jax.nn.relu(x) + 1.0  # <jit-inner>

    def f(x):
        return inner(x) * 2.0

    _check(_raises(f, X), "max", "jit-inner")


def test_error_inside_scan_body():
    def body(c, _):
        return jnp.maximum(c, 0.0) + 1.0, None  # <scan-body>

    def f(x):
        return lax.scan(body, x, None, length=3)[0]

    _check(_raises(f, X), "max", "scan-body")


def test_error_inside_fori_loop_body():
    def body(i, c):
        return jnp.floor(c) + 1.0  # <fori-body>

    def f(x):
        return lax.fori_loop(0, 3, body, x)

    _check(_raises(f, X), "floor", "fori-body")


def test_error_is_raised_at_trace_time():
    def f(x):
        return jnp.maximum(x, 0.0)  # <trace-time>

    # no concrete values at all: the error must come from tracing alone
    with pytest.raises(jr.NotInvertibleError) as info:
        jax.eval_shape(jr.reverse(f), jax.ShapeDtypeStruct(X.shape, X.dtype))
    _check(info.value, "max", "trace-time")
    with pytest.raises(jr.NotInvertibleError) as info:
        jax.jit(jr.reverse(f))(X)
    _check(info.value, "max", "trace-time")


# ----------------------------------------------------------------------------- structure mismatch


def test_output_tuple_for_array_state():
    def returns_tuple(x):
        return x, x

    with pytest.raises(ValueError, match="returns_tuple"):
        jr.reverse(returns_tuple)(X)


def test_output_with_different_shape():
    def drops_last(x):
        return x[:-1]

    with pytest.raises(ValueError, match="drops_last"):
        jr.reverse(drops_last)(X)


def test_output_with_different_dtype():
    def to_float32(x):
        return x.astype(jnp.float32)

    with pytest.raises(ValueError, match="to_float32"):
        jr.reverse(to_float32)(X)


def test_output_structure_for_tuple_state():
    def returns_one(x, y):
        return x + y

    with pytest.raises(ValueError, match="returns_one"):
        jr.reverse(returns_one, argnums=(0, 1))(X, X)


def test_argnums_out_of_range_is_value_error():
    def two_args(x, w):
        return x * w

    with pytest.raises(ValueError, match="argnums"):
        jr.reverse(two_args, argnums=2)(X, X)
    with pytest.raises(ValueError, match="argnums"):
        jr.reverse(two_args, argnums=(0, -3))(X, X)


def test_argnums_out_of_range_names_the_function():
    def two_args(x, w):
        return x * w

    with pytest.raises(ValueError, match="two_args"):
        jr.reverse(two_args, argnums=2)(X, X)


# ----------------------------------------------------------------------------- check_reversible


def _tripling(x):
    # x -> 3x - 1, 30 times: invertible, but float32 rounding in the forward run is amplified
    return lax.fori_loop(0, 30, lambda i, c: 3.0 * c - 1.0, x)  # <tripling>


def _primitive_names(jaxpr) -> set[str]:
    return {e.primitive.name for e in all_eqns(jaxpr)}


def test_check_reversible_raises_on_float32_drift():
    x = jnp.linspace(0.1, 0.9, 5, dtype=jnp.float32)
    with pytest.raises(jr.ReversibilityError) as info:
        jr.check_reversible(_tripling, x, rtol=1e-14)
    err = info.value
    assert isinstance(err, jr.JaxrevError)
    msg = str(err)
    assert HERE in msg, msg
    named = re.findall(r"`(\w+)`", msg)
    prims = _primitive_names(jax.make_jaxpr(_tripling)(x).jaxpr)
    assert named and set(named) <= prims, (named, prims, msg)


def test_check_reversible_report():
    x = jnp.linspace(0.1, 0.9, 5, dtype=jnp.float32)
    rep = jr.check_reversible(_tripling, x)  # no rtol: report, never raise
    assert isinstance(rep.max_error, float)
    assert 1e-14 < rep.max_error < 1e-3  # float32 drift, but a round trip nonetheless
    assert isinstance(rep.worst, str)
    prims = _primitive_names(jax.make_jaxpr(_tripling)(x).jaxpr)
    assert any(re.search(rf"\b{p}\b", rep.worst) for p in prims), (rep.worst, prims)
    assert HERE in rep.worst and str(_line("tripling")) in rep.worst, rep.worst
    text = str(rep)
    assert isinstance(text, str) and rep.worst in text
    # the error sits where it is: a looser rtol passes and returns the same report
    rep2 = jr.check_reversible(_tripling, x, rtol=1e-3)
    assert rep2.max_error == pytest.approx(rep.max_error)


def test_check_reversible_exact_in_float64():
    x = jnp.linspace(0.1, 0.9, 5)

    def f(x):
        return jnp.exp(x) * 3.0 + 1.0

    rep = jr.check_reversible(f, x, rtol=1e-12)
    assert rep.max_error <= 1e-12
    np.testing.assert_allclose(np.asarray(jr.reverse(f)(f(x))), np.asarray(x), rtol=1e-12)


def test_check_reversible_propagates_not_invertible():
    def f(x):
        return jnp.floor(x)  # <check-floor>

    with pytest.raises(jr.NotInvertibleError) as info:
        jr.check_reversible(f, X)
    _check(info.value, "floor", "check-floor")


def test_dense_log_det_of_a_program_jax_cannot_differentiate_names_the_rule():
    """A custom_jvp function closing over a scan's iteration value: `jax.jacfwd` and
    `jax.grad` of the program fail in JAX itself (a leaked tracer). The sweep's log-det does
    not need them; the dense Jacobian does, and says so, naming the rule and its line (found by
    the grammar soak: before, JAX's `UnexpectedTracerError` came out of jaxrev)."""

    def f(x):
        def body(c, i):
            def g(c):
                return c + jnp.tanh(c[::-1]) * 0.1 * i

            rule = jax.custom_jvp(g)
            rule.defjvp(lambda primals, tangents: jax.jvp(g, primals, tangents))
            return rule(c), None  # <closing-rule>

        return lax.scan(body, x, jnp.arange(2.0))[0]

    x = jnp.array([0.3, -0.2])
    with pytest.raises(TypeError):
        jax.jacfwd(f)(x)
    J = jax.jacfwd(
        lambda x: lax.scan(
            lambda c, i: (c + jnp.tanh(c[::-1]) * 0.1 * i, None), x, jnp.arange(2.0)
        )[0]
    )(x)
    sign, logdet = jr.slogdet_jacobian(f, x)  # the sweep: no JAX derivative needed
    assert float(sign) == 1.0 and abs(float(logdet) - float(jnp.linalg.slogdet(J)[1])) < 1e-12
    with pytest.raises(jr.JaxrevError) as info:
        jr.slogdet_jacobian(f, x, method="dense")
    msg = str(info.value)
    assert "`custom_jvp_call` at" in msg and f"{HERE}:{_line('closing-rule')}" in msg, msg
    assert "JAX cannot differentiate" in msg and "as an argument" in msg, msg
