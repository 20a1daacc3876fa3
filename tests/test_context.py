"""The walk context (issue 27, items 3 and 4): every walk is steered by its own transform's
settings, never by a global, and one keyword (`on_error`) says what a failure does."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxrev as jr
from jaxrev._stats import counting
from jaxrev.transforms.knowledge.context import Settings, WalkContext


def gap(x):
    """A one-to-one map whose range misses (-1, 1): inverting it there fails a run-time check
    (no branch of the select is consistent)."""
    return jnp.where(x > 0, x + 1.0, x - 1.0)


def with_inner_inverse(**inner):
    """A map of (a, b): `a` through a `custom_inverse` whose inverse is `jr.reverse(gap,
    **inner)` (a walk of its own, started inside the outer walk's rule), `b` through `gap`
    (a check of the outer walk)."""

    @jr.custom_inverse
    def step(a):
        return gap(a)

    @step.definverse
    def _(y):
        return jr.reverse(gap, **inner)(y)

    return lambda ab: (step(ab[0]), gap(ab[1]))


OK, BAD = 2.5, 0.5  # gap's output at 1.5, and a value outside its range


def test_nested_transform_keeps_its_own_policy_inner_raise_outer_nan():
    f = with_inner_inverse()  # inner: the default, "raise"
    inv = jr.reverse(f, on_error="nan")
    # the outer walk's own check fails (b): NaN there, no error; the inner walk succeeds
    a, b = inv((jnp.asarray(OK), jnp.asarray(BAD)))
    assert float(a) == pytest.approx(1.5) and np.isnan(b)
    # the inner walk's check fails (a): the inner walk raises, whatever the outer asked (the
    # custom inverse is staged, so its check raises when the program runs)
    f = with_inner_inverse()
    with pytest.raises(Exception, match=r"jaxrev\.reverse: no branch"):
        jr.reverse(f, on_error="nan")((jnp.asarray(BAD), jnp.asarray(OK)))


def test_nested_transform_keeps_its_own_policy_inner_nan_outer_raise():
    f = with_inner_inverse(on_error="nan")
    a, b = jr.reverse(f)((jnp.asarray(BAD), jnp.asarray(OK)))  # the inner walk's NaN only
    assert np.isnan(a) and float(b) == pytest.approx(1.5)
    f = with_inner_inverse(on_error="nan")
    with pytest.raises(jr.ReversibilityError, match="no branch"):
        jr.reverse(f)((jnp.asarray(OK), jnp.asarray(BAD)))


def residual(x):
    """Invertible only by Newton's method (a walk that may not use it cannot invert it)."""
    return x + 0.5 * jnp.tanh(x)


def loop_with_inner_reverse():
    """A loop whose body applies a `custom_inverse` step whose inverse is `jr.reverse(residual)`:
    `reversible`'s backward sweep walks the body, and the step's rule starts a walk of
    `reverse` inside it."""

    @jr.custom_inverse
    def step(a):
        return residual(a)

    @step.definverse
    def _(y):
        return jr.reverse(residual)(y)

    def f(x, t):
        return jax.lax.fori_loop(0, 3, lambda i, x: step(x) * t, x)

    return f


def test_transform_inside_a_reversible_sweep_sees_only_its_own_settings():
    """The sweep's walks may not use Newton's method (as `inverse_vjp`'s do); the `reverse`
    that a rule of the body starts needs it, and uses it: its settings are its own."""
    from jaxrev.transforms.reversible import reversible_with
    from jaxrev.transforms.sweep.dial import Dial

    f = loop_with_inner_reverse()
    sweep = reversible_with(f, 0, Dial(name="f", walk=Settings("jaxrev.reversible", newton=False)))
    x = jnp.asarray([1.5, -0.3])
    want = jax.grad(lambda t: f(x, t).sum())(1.2)
    with counting() as c:
        got = jax.grad(lambda t: sweep(x, t).sum())(1.2)
    assert float(got) == pytest.approx(float(want), rel=1e-4)
    assert c["newton"] >= 1  # the nested reverse, not the sweep, solved by Newton
    # and the other way round: a reverse that may not use Newton's method does not make the
    # nested one give up
    g = lambda y: f(y, 1.2)  # noqa: E731
    from jaxrev.transforms.reverse import reverse_with

    back = reverse_with(g, Settings(newton=False))(g(x))
    np.testing.assert_allclose(back, x, rtol=1e-4)


def _residual_p():
    """A user's primitive computing `residual`, whose inverse rule runs `jr.reverse(residual)`:
    a walk of its own, started while the walk that applies the rule is live."""
    from jax.extend.core import Primitive
    from jax.interpreters import ad, mlir

    p = Primitive("jaxrev_test_residual")
    p.def_impl(residual)
    p.def_abstract_eval(lambda a: a)
    ad.defjvp(p, lambda t, x: t * (1.0 + 0.5 * (1.0 - jnp.tanh(x) ** 2)))
    mlir.register_lowering(p, mlir.lower_fun(residual, multiple_results=False))
    jr.register_inverse(p, lambda out, x: [jr.reverse(residual)(out)])
    return p


def test_a_walk_started_by_another_walks_rule_sees_only_its_own_settings():
    """`inverse_jvp` walks without Newton's method; the rule it applies mid-walk starts a
    `reverse` whose map only Newton's method inverts. With settings on a global stack the inner
    walk inherited "no Newton" and failed; with its own context it solves."""
    p = _residual_p()
    f = lambda x: p.bind(x) * 2.0  # noqa: E731
    x = jnp.asarray([0.3, -1.0, 2.0])
    v = jnp.asarray([1.0, -0.5, 0.25])
    with counting() as c:
        y, dx = jr.inverse_jvp(f, (x,), v, method="reverse")
    assert c["newton"] >= 1  # by the inner walk
    J = jax.jacfwd(f)(x)
    np.testing.assert_allclose(dx[0], np.linalg.solve(np.asarray(J), np.asarray(v)), rtol=1e-10)
    np.testing.assert_allclose(y, f(x), rtol=1e-12)


def test_errors_of_a_reversible_walk_name_reversible():
    def lossy_while(x):
        return jax.lax.while_loop(
            lambda s: s[1] < 3, lambda s: (jnp.maximum(s[0], 0.0) + 1.0, s[1] + 1), (x, 0)
        )[0]

    with pytest.raises(jr.NotInvertibleError, match=r"^jaxrev\.reversible cannot invert"):
        jax.grad(lambda x: jr.reversible(lossy_while)(x).sum())(jnp.ones(2))


def test_errors_of_inverse_jvp_name_inverse_jvp():
    f = lambda x: jnp.where(x > 0, x, 0.0) + jnp.sum(x) * 0.0  # noqa: E731  relu: lossy
    with pytest.raises(jr.JaxrevError, match=r"jaxrev\.inverse_jvp"):
        jr.inverse_jvp(f, (jnp.ones(3),), jnp.ones(3), method="reverse")


def test_a_branch_contexts_newton_use_is_its_own():
    """A choice's branch walks each get a derived context: Newton's use in one is counted in
    it and its parents, never in a sibling (whose candidate count it must not change)."""
    group = WalkContext(Settings("jaxrev.reverse"))
    first = group.replace(on_error="nan")
    second = group.replace(on_error="nan")
    first.replace(newton_start=1).used_newton()
    assert first.newton_uses == 1 and second.newton_uses == 0 and group.newton_uses == 1
    assert first.on_error == "nan" and group.on_error == "raise"  # derived, not shared
    assert second.replace(newton_start=2).newton_start == 2 and first.newton_start is None


def test_choice_candidates_follow_their_own_branch_walk():
    """A spline-like choice solved by Newton in one branch only: the inverse is right (each
    branch's candidates are counted from its own walk), and counting sees Newton's use."""
    f = lambda x: jnp.where(x > 0, x + 0.5 * jnp.tanh(x), 2.0 * x)  # noqa: E731
    x = jnp.asarray([-1.0, 0.3, 2.0])
    with counting() as c:
        got = jr.reverse(f)(f(x))
    np.testing.assert_allclose(got, x, rtol=1e-5)
    assert c["newton"] >= 1 and c["rules"] > 0


def test_counting_sees_every_walk_of_a_call_and_nothing_outside():
    f = lambda x, w: jnp.cumsum(x * w)  # noqa: E731
    with counting() as c:
        jax.make_jaxpr(jr.reverse(f))(jnp.ones(4), jnp.ones(4))
    n = c["rules"] + c["elements"]
    assert n > 0
    jax.make_jaxpr(jr.reverse(f))(jnp.ones(4), jnp.ones(4))
    assert c["rules"] + c["elements"] == n


# --------------------------------------------------------------------------- one vocabulary


def test_reverse_warn_returns_nan_and_warns_eagerly_and_under_jit():
    inv = jr.reverse(gap, on_error="warn")
    with pytest.warns(jr.FailureWarning, match="no branch"):
        out = inv(jnp.asarray([BAD, OK]))
    assert np.isnan(out[0]) and float(out[1]) == pytest.approx(1.5)
    inv = jr.reverse(lambda x: gap(x) * 1.0, on_error="warn")
    with pytest.warns(jr.FailureWarning, match="no branch"):
        out = jax.block_until_ready(jax.jit(inv)(jnp.asarray([BAD, OK])))
        jax.effects_barrier()
    assert np.isnan(out[0])


def test_inverse_jvp_warn_returns_nan_and_warns_eagerly_and_under_jit():
    w = jnp.asarray([1.0, 0.0, 2.0])
    f = lambda x: x * w  # noqa: E731
    with pytest.warns(jr.FailureWarning, match="singular"):
        _, (t,) = jr.inverse_jvp(f, (jnp.ones(3),), jnp.ones(3), on_error="warn")
    assert not np.all(np.isfinite(t))
    g = lambda x: x * w * 1.0  # noqa: E731
    with pytest.warns(jr.FailureWarning, match="singular"):
        _, (t,) = jax.jit(lambda x, v: jr.inverse_jvp(g, (x,), v, on_error="warn"))(
            jnp.ones(3), jnp.ones(3)
        )
        jax.block_until_ready(t)
        jax.effects_barrier()
    assert not np.all(np.isfinite(t))


def test_nan_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert np.isnan(jr.reverse(gap, on_error="nan")(jnp.asarray(BAD)))


def test_a_loop_cut_short_raises_under_every_policy():
    """A while loop that runs past `max_steps` leaves no NaN behind to show that its result is
    wrong: "nan" and "warn" raise too, never a wrong gradient with a warning."""

    def f(x):
        return jax.lax.while_loop(
            lambda s: s[1] < 10, lambda s: (jnp.maximum(s[0], 0.0) * 1.1 + 0.1, s[1] + 1), (x, 0)
        )[0]

    for on_error in ("raise", "nan", "warn"):
        g = jax.grad(lambda x: jr.reversible(f, max_steps=3, on_error=on_error)(x).sum())
        with pytest.raises(jr.NotInvertibleError, match="ran past max_steps=3"):
            g(jnp.ones(2))
        with pytest.raises(Exception, match="ran past max_steps=3"):
            jax.block_until_ready(jax.jit(g)(jnp.ones(2)))


def test_a_built_in_walking_rule_registered_again_still_walks():
    """The mark that a rule takes the walk's `ctx` is the rule's: putting the built-in gather
    rule back (after an override, say), or a `functools.wraps` wrapper of it, keeps working."""
    import functools

    from jaxrev._compat import prims
    from jaxrev.transforms import inverse_rules

    builtin = inverse_rules[prims.gather]
    perm = jnp.asarray([2, 0, 1])
    x = jnp.asarray([1.0, 2.0, 3.0])
    f = lambda x, p: x[p]  # noqa: E731
    calls = []

    @functools.wraps(builtin)
    def spy(*args, **kwargs):
        calls.append(1)
        return builtin(*args, **kwargs)

    try:
        jr.register_inverse(prims.gather, builtin)
        np.testing.assert_allclose(jr.reverse(f)(f(x, perm), perm), x)
        jr.register_inverse(prims.gather, spy)
        np.testing.assert_allclose(jr.reverse(f)(f(x, perm), perm), x)
        assert calls
    finally:
        jr.register_inverse(prims.gather, builtin)
