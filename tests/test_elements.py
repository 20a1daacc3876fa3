"""Inversion at element granularity (issue 15): masks, in-place updates, state-dependent selects,
structure-changing bijections, linear tracing cost.

Every program of `programs.elements.PROGRAMS` is checked the same way: the round trip eagerly,
under `jit` and under `vmap` to 1e-12 (float64), `reverse(reverse(f)) == f`, `reversible`
gradients against `jax.grad` to 1e-10 (state and parameters), and what `reversible` stores.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import scaled_error
from jax import lax
from tiers import tiered

import jaxrev as jr

sys.path.insert(0, os.path.dirname(__file__))
from programs.elements import (
    LOOPS,
    add_up,
    masked_coupling,
    masked_steps,  # noqa: E402
    mlp_params,
    programs,
    split_coupling,
)

HERE = os.path.basename(__file__)
P = programs()
RT = 1e-12
GRAD = 1e-10


def _line(tag: str) -> int:
    with open(__file__) as fh:
        for k, text in enumerate(fh, 1):
            if f"# <{tag}>" in text:
                return k
    raise AssertionError(tag)


# the spline's and the stable softplus's round trips (bins' choices, a Newton group) are
# the costliest four ways; by default test_flows inverts both once (eagerly and under jit)
@pytest.mark.parametrize("name", tiered(list(P), slow={"rq_spline", "stable_softplus"}))
def test_round_trip_eager_jit_vmap_and_double_reverse(name):
    f, x, p = P[name]
    y = f(x, p)
    inv = jr.reverse(f)
    assert scaled_error(inv(y, p), x) < RT
    assert scaled_error(jax.jit(inv)(y, p), x) < RT
    ys = jnp.stack([y, f(0.5 * x, p)])
    xs = jax.vmap(inv, (0, None))(ys, p)
    assert scaled_error(xs, jnp.stack([x, 0.5 * x])) < RT
    assert scaled_error(jr.reverse(inv)(x, p), y) < RT


@pytest.mark.parametrize("name", list(P))
def test_reversible_gradient_equals_jax_grad(name):
    f, x, p = P[name]

    def loss(g):
        return lambda x, p: jnp.sum(jnp.sin(g(x, p)))

    want = jax.grad(loss(f), argnums=(0, 1))(x, p)
    got = jax.jit(jax.grad(loss(jr.reversible(f)), argnums=(0, 1)))(x, p)
    assert scaled_error(got, want) < GRAD


@pytest.mark.parametrize("name", LOOPS)
def test_element_loops_store_nothing(name):
    f, x, p = P[name]
    rep = jr.memory_report(f, x, p, checkpoint_every=None)
    assert rep.total_bytes == 0, str(rep)


def _inverse_program(closed) -> list:
    """The equations of the inverse program: traced, `reverse(f)` is one `custom_inverse`
    step (whose own inverse is f), its function the walk's program."""
    (eqn,) = closed.jaxpr.eqns
    assert eqn.primitive.name == "jaxrev_custom_inverse"
    return eqn.params["fun_jaxpr"].jaxpr.eqns


def test_element_loop_inverse_is_one_update_per_iteration():
    # the inverse of x.at[i].add(g(x[i-1])) is x.at[i].add(-g(x[i-1])): no n-sized work per
    # iteration, so the inverse program does not grow with n (a dense lump would be n x n)
    def size(n):
        p = {"w": jnp.ones(n)}
        eqns = _inverse_program(jax.make_jaxpr(jr.reverse(add_up))(jnp.ones(n), p))
        body = [e for e in eqns if e.primitive.name == "scan"][-1].params["jaxpr"]
        return len(body.jaxpr.eqns), [str(v.aval) for e in body.jaxpr.eqns for v in e.outvars]

    (k1, _), (k2, a2) = size(64), size(4096)
    assert k1 == k2
    assert sum("4096" in a for a in a2) <= 1  # only the carried array itself is n-sized


@pytest.mark.parametrize(
    "name", ["add_up", "swaps", "leaky_net", "stable_softplus", "masked_coupling", "rq_spline"]
)
def test_inverse_ad_matches_dense_solve(name):
    # element loops, and choices: inverse AD differentiates the chosen branch
    f, x, p = P[name]
    g = lambda x: f(x, p)  # noqa: E731
    J = jax.jacfwd(g)(x)
    v = jnp.cos(jnp.arange(x.shape[0], dtype=x.dtype))
    _, (t,) = jr.inverse_jvp(g, (x,), v)
    assert scaled_error(t, jnp.linalg.solve(J, v)) < 1e-10
    _, ivjp = jr.inverse_vjp(g, x)
    assert scaled_error(ivjp((v,)), jnp.linalg.solve(J.T, v)) < 1e-10
    sign, logdet = jr.slogdet_jacobian(g, x)
    s_ref, l_ref = jnp.linalg.slogdet(J)
    assert float(sign) == float(s_ref) and abs(float(logdet - l_ref)) < 1e-10


def test_switch_on_the_state():
    # sum(x) < 0, in [0, 1), >= 1: three branches whose outputs do not overlap
    def f(x):
        k = jnp.clip(jnp.floor(jnp.sum(x)).astype(jnp.int32) + 1, 0, 2)
        return lax.switch(k, [lambda v: v - 10.0, lambda v: v * 2.0, lambda v: v + 10.0], x)

    for x in (jnp.array([-2.0, 0.5]), jnp.array([0.2, 0.1]), jnp.array([2.0, 1.0])):
        for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
            assert scaled_error(inv(f(x)), x) < RT


# --------------------------------------------------------------------------- flows at scale


@pytest.mark.parametrize("n", [64, 784])
def test_couplings_at_scale(n):
    key = jax.random.PRNGKey(n)
    x = jax.random.normal(key, (n,))
    even = jnp.arange(n) % 2 == 0
    pm = mlp_params(key, n, 64, 2 * n)
    ps = mlp_params(key, n // 2, 64, n)
    for f, p in ((lambda x, p: masked_coupling(x, p, even), pm), (split_coupling, ps)):
        y = f(x, p)
        assert scaled_error(jax.jit(jr.reverse(f))(y, p), x) < RT
        xs = jnp.stack([x, -x])
        ys = jax.vmap(f, (0, None))(xs, p)
        assert scaled_error(jax.jit(jax.vmap(jr.reverse(f), (0, None)))(ys, p), xs) < RT
        assert scaled_error(jax.jit(jr.reverse(jr.reverse(f)))(x, p), y) < RT
        if n == 64:
            assert scaled_error(jr.reverse(f)(y, p), x) < RT
            want = jax.grad(lambda x: jnp.sum(jnp.sin(f(x, p))))(x)
            got = jax.grad(lambda x: jnp.sum(jnp.sin(jr.reversible(f)(x, p))))(x)
            assert scaled_error(got, want) < GRAD


def test_masked_coupling_runs_its_conditioner_once():
    # the inverse of where(mask, x, x * exp(s(x * mask)) + t(x * mask)) runs s and t once
    n = 16
    even = jnp.arange(n) % 2 == 0
    p = mlp_params(jax.random.PRNGKey(0), n, 32, 2 * n)
    f = lambda x, p: masked_coupling(x, p, even)  # noqa: E731
    eqns = _inverse_program(jax.make_jaxpr(jr.reverse(f))(jnp.ones(n), p))
    dots = [e for e in eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2  # the conditioner's two layers, nothing else


# --------------------------------------------------------------------------- structure


def test_reshape_concatenate_and_split_bijections():
    x = jnp.arange(6.0).reshape(2, 3)
    r = lambda x: jnp.tanh(x.reshape(6)) * 2.0  # noqa: E731
    inv = jr.reverse(r, state=x)
    assert inv(r(x)).shape == (2, 3) and scaled_error(inv(r(x)), x) < RT
    assert scaled_error(jr.reverse(inv)(x), r(x)) < RT  # reverse(reverse(f)) needs no state
    assert scaled_error(jax.jit(inv)(r(x)), x) < RT

    a, b = jnp.ones(2), jnp.arange(3.0)
    cat = lambda a, b, t: jnp.concatenate([a * t, jnp.exp(b)])  # noqa: E731
    inv = jr.reverse(cat, (0, 1), state=(a, b))
    got = inv(cat(a, b, 2.0), 2.0)  # the output fills both state positions
    assert isinstance(got, tuple) and scaled_error(got, (a, b)) < RT
    assert scaled_error(jr.reverse(inv)((a, b), 2.0), cat(a, b, 2.0)) < RT

    z = jnp.arange(5.0)
    spl = lambda z: tuple(jnp.split(z * 3.0, [1, 3]))  # noqa: E731
    inv = jr.reverse(spl, state=z)
    assert scaled_error(inv(spl(z)), z) < RT
    # gradients through the bijection, by inversion
    want = jax.grad(lambda z: sum(jnp.sum(jnp.sin(t)) for t in spl(z)))(z)
    got = jax.grad(lambda z: sum(jnp.sum(jnp.sin(t)) for t in jr.reversible(spl)(z)))(z)
    assert scaled_error(got, want) < GRAD


def test_a_bijection_that_changes_the_size_is_refused():
    with pytest.raises(ValueError, match="number of elements"):
        jr.reverse(lambda x: x[:3], state=jnp.ones(5))(jnp.ones(3))
    # without `state`, the inverse's argument must map to itself: a silent identity is gone
    with pytest.raises(ValueError, match="float64\\[4\\]"):
        jr.reverse(lambda x: x.reshape(4))(jnp.ones((2, 2)))


# --------------------------------------------------------------------------- rules


def test_erf_and_powers_of_python_scalars():
    x = jnp.linspace(-0.9, 0.9, 5)
    assert scaled_error(jr.reverse(jax.scipy.special.erf)(jax.scipy.special.erf(x)), x) < 1e-12
    assert scaled_error(jr.reverse(lax.erf_inv)(lax.erf_inv(x)), x) < 1e-12
    assert abs(float(jr.reverse(lambda x: x**3)(8.0)) - 2.0) < 1e-15


def test_mask_known_only_when_the_program_runs():
    # diffrax's masked step: the mask is a parameter (traced), so the select's cases are known
    # where it picks them, when the program runs
    def f(ab, keep):
        a, b = ab
        for _ in range(3):
            a2 = a + jnp.tanh(b)
            b2 = b + jnp.sin(a2)
            a, b = jnp.where(keep, a2, a), jnp.where(keep, b2, b)
        return a, b

    ab = (jnp.linspace(-1, 1, 8), jnp.linspace(2, -1, 8))
    keep = jnp.arange(8) < 3
    for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
        assert scaled_error(inv(f(ab, keep), keep), ab) < RT
    want = jax.grad(lambda ab: jnp.sum(f(ab, keep)[1] ** 2))(ab)
    got = jax.grad(lambda ab: jnp.sum(jr.reversible(f)(ab, keep)[1] ** 2))(ab)
    assert scaled_error(got, want) < GRAD


# --------------------------------------------------------------------------- tracing cost


def test_tracing_cost_is_linear_in_masked_steps():
    """diffrax masks every step with where(keep, new, old): rule applications must grow
    linearly with the number of steps (a case split per select grew exponentially)."""
    from jaxrev._stats import counting

    def applications(k):
        ab = (jnp.ones(8), jnp.zeros(8))
        t = jnp.linspace(0, 1, 8)
        with counting() as c:
            jax.make_jaxpr(
                jax.grad(lambda ab, t: jnp.sum(jr.reversible(masked_steps(k))(ab, t)[0]))
            )(ab, t)
        return c["rules"] + c["elements"]

    a5, a20 = applications(5), applications(20)
    assert a20 <= 4.5 * a5, (a5, a20)


# --------------------------------------------------------------------------- refusals


def _raises(f, x, cls=jr.NotInvertibleError):
    with pytest.raises(cls) as info:
        jr.reverse(f)(f(x))
    return info.value


def _names(err, primitive, tag):
    msg = str(err)
    assert err.primitive == primitive, msg
    assert err.line == _line(tag), (err.line, msg)
    assert os.path.basename(err.file) == HERE, msg
    assert re.search(r"ways? out", msg, re.IGNORECASE), msg
    return msg


X = jnp.array([-1.5, -0.25, 0.5, 2.0])


def test_relu_zero_case_is_refused_when_traced():
    def f(x):
        return jnp.where(x > 0, 2.0 * x, 0.0)  # <relu-where>

    msg = _names(_raises(f, X), "select_n", "relu-where")
    assert "relu" in msg
    with pytest.raises(jr.NotInvertibleError):  # the same under jit: decided when traced
        jax.jit(jr.reverse(f))(f(X))


def test_two_consistent_candidates_are_refused():
    def f(x):
        return jnp.where(x > 0, x, -x) + 1.0  # <two-candidates>

    msg = _names(_raises(f, X), "select_n", "two-candidates")
    assert "two different branches" in msg


def test_a_scatter_that_may_overwrite_is_refused():
    idx = np.array([0, 2, 2])

    def f(x):
        return x.at[idx].set(x[jnp.array([1, 3, 0])] * 2.0)  # <overwrite>

    msg = _names(_raises(f, X), "scatter", "overwrite")
    assert "twice" in msg


def test_an_unprovable_index_is_refused_naming_it():
    # the index comes from a parameter: x[j] may be the element x.at[i] writes
    def f(x, j):
        return lax.fori_loop(0, 3, lambda i, x: x.at[i].add(jnp.sin(x[j])), x)  # <unprovable>

    j = jnp.asarray(3)
    with pytest.raises(jr.NotInvertibleError) as info:
        jr.reverse(f)(f(X, j), j)
    msg = _names(info.value, "scatter-add", "unprovable")
    assert "index" in msg


def test_no_consistent_branch_is_a_run_time_error():
    # the stable sigmoid's range is (0, 1): 1.5 has no preimage
    f, x, p = P["stable_sigmoid"]
    bad = jnp.full_like(x, 1.5)
    with pytest.raises(jr.ReversibilityError, match="no branch"):
        jr.reverse(f)(bad, p)
    assert bool(jnp.all(jnp.isnan(jr.reverse(f, on_error="nan")(bad, p))))


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_a_condition_concatenated_to_the_state_opens_a_masked_network(how):
    """A conditional masked autoregressive layer as flowjax writes it: the condition enters the
    masked network through `concatenate([x, c])`, with rank -1 (hidden units of rank -1 read
    the condition alone). The concatenation's output is known on the condition's elements, so
    the first outputs follow from the condition and each recovered element opens the next (D
    passes); it was refused at the affine step's `add` (the concatenation was all unknown)."""
    rng = np.random.default_rng(0)
    D, C, H = 4, 2, 8
    ranks_in = np.concatenate([np.arange(D), -np.ones(C)])
    ranks_hidden = np.arange(H) % D - 1
    ranks_out = np.repeat(np.arange(D), 2)
    m1, m2 = ranks_hidden[:, None] >= ranks_in, ranks_out[:, None] > ranks_hidden
    w1, w2 = rng.standard_normal((H, D + C)), rng.standard_normal((2 * D, H))

    def layer(x, c):
        h = jax.nn.relu(jnp.where(m1, w1, 0) @ jnp.concatenate([x, c]))
        shift, scale = jnp.split((jnp.where(m2, w2, 0) @ h).reshape(D, 2), 2, axis=1)
        return x * jax.nn.softplus(scale[:, 0]) + shift[:, 0]

    x, c = jnp.asarray(rng.standard_normal(D)), jnp.asarray(rng.standard_normal(C))
    inv = jr.inverse_and_slogdet(layer)
    if how == "jit":
        inv = jax.jit(inv)
    if how == "vmap":
        xs = jnp.stack([x, 0.5 * x])
        got, ld = jax.vmap(inv, (0, None))(jax.vmap(layer, (0, None))(xs, c), c)
        got, ld, x = got[1], ld[1], xs[1]
    else:
        got, ld = inv(layer(x, c), c)
    np.testing.assert_allclose(got, x, atol=1e-12)
    _, ref = jnp.linalg.slogdet(jax.jacfwd(layer)(x, c))
    np.testing.assert_allclose(ld, -ref, atol=1e-12)


@pytest.mark.parametrize("reduce", ["max", "sum", "cumsum"])
def test_a_rows_reduction_is_known_once_its_row_is(reduce):
    """An autoregressive affine layer whose scale is a reduction over a row a masked product
    computes (a max, a sum, the last of a cumsum): the row of element i reads the elements
    before i only, so its reduction is known once they are, and the layer inverts element by
    element (`elements.along_axes_forward`; before, nothing of a reduction of a partly known
    operand was known, and the walk was stuck)."""
    D, R = 5, 3
    mask = np.repeat(np.tril(np.ones((D, D), bool), -1), R, axis=0).reshape(D, R, D)
    M = jnp.where(mask, 0.4 * jax.random.normal(jax.random.key(2), (D, R, D)), 0.0)
    red = {
        "max": lambda r: jnp.max(r, axis=-1),
        "sum": lambda r: jnp.sum(r, axis=-1),
        "cumsum": lambda r: jnp.cumsum(r, axis=-1)[:, -1],
    }[reduce]

    def f(x):
        rows = jnp.tanh(jnp.einsum("irj,j->ir", M, x))
        return x * jnp.exp(0.5 * red(rows)) + 0.1

    x = jnp.array([0.3, -1.2, 0.8, 2.0, -0.4])
    for inv in (jr.inverse_and_slogdet(f), jax.jit(jr.inverse_and_slogdet(f))):
        got, ld = inv(f(x))
        np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ld, -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-10)


def test_an_integer_step_met_on_some_elements_waits_for_its_whole_output():
    """An integer's inverse rule applied by element-level propagation (on an output known on
    some elements: the argmax of a masked row, cast to a float scale, in a loop writing one
    element per step) waits for the whole output; it raised `TypeError` (`NeedMore` made
    without its reason) instead of the walk's own error, which names the step and the user's
    line (a review found it)."""
    D = 4
    M = jnp.tril(jax.random.normal(jax.random.key(7), (D, D)), -1)  # row i reads x_<i
    mask = np.tril(np.ones((D, D), bool), -1)

    def g(x):
        s = 0.2 * jnp.argmax(jnp.where(mask, M * x[None, :], -jnp.inf), axis=1).astype(x.dtype)
        return x * jnp.exp(s) + 0.1

    def f(y):
        return jax.lax.fori_loop(0, D, lambda i, y: y.at[i].set(g(y)[i]), y)

    x = jnp.array([-1.7, 0.4, 2.2, -0.3])
    with pytest.raises(jr.JaxrevError) as info:
        jr.inverse_and_slogdet(f)(f(x))
    assert "`dynamic_slice`" in str(info.value) and "test_elements.py:" in str(info.value)


def test_an_argmax_of_a_row_used_as_an_index_inverts():
    """An autoregressive affine layer scaled by a table entry at the argmax of its row: the
    argmax is known once its row is, and, an integer choice that never compares the state,
    it is enumerated, not searched as a bin (a review found it refused as "not monotone")."""
    D, R = 3, 3
    mask = np.repeat(np.tril(np.ones((D, D), bool), -1), R, axis=0).reshape(D, R, D)
    M = jnp.where(mask, 0.4 * jax.random.normal(jax.random.key(2), (D, R, D)), 0.0)
    tab = jnp.array([0.3, -0.2, 0.5])

    def f(x):
        rows = jnp.tanh(jnp.einsum("irj,j->ir", M, x))
        return x * jnp.exp(0.5 * tab[jnp.argmax(rows, axis=-1)]) + 0.1

    x = jnp.array([0.3, -1.2, 0.8])
    got, ld = jr.inverse_and_slogdet(f)(f(x))
    np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-10)
