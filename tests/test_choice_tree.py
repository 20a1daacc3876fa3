"""The choice step's combinations as a tree, clips, exact quadratic roots and masked products
(issue 32), on programs written here (the libraries' own are `test_library_flows.py`).

- a spline written as flowjax writes it (clip to the interval, bin search, clip of the value,
  `where(in_bounds, ...)`) inverts, its combinations linear in the bins (counted);
- a clip that saturates an intermediate value is refused only where the output is the clip's
  end (when the program runs: eagerly, under `jit`, NaN on request), while a relu of the state
  is still refused when traced;
- a spline's bin index is searched (the map evaluated at the knots it compares with), not
  enumerated; an index computed from another function of the state is enumerated; a
  non-monotone tabled map is named, not answered wrongly;
- a ratio of quadratics in one unknown is solved by its roots, not by Newton's method; so is
  one square root of a quadratic (the spline's inverse as flowjax writes it, which flowjax's
  default flows run forward);
- a masked autoregressive layer inverts through the zeros of its masked weights, also with
  its layers stacked in a `scan`; with traced masks Newton's method solves the layer whole.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import tiered

import jaxrev as jr
from jaxrev._compat import make_jaxpr
from jaxrev._stats import counting
from jaxrev.transforms.knowledge import elements
from jaxrev.transforms.propagation import choices

jax.config.update("jax_enable_x64", True)
B = 3.0


def _spline_params(K: int, key: int = 0):
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    w = jax.nn.softmax(jax.random.normal(k1, (K,))) * 2 * B
    h = jax.nn.softmax(jax.random.normal(k2, (K,))) * 2 * B
    xk = jnp.concatenate([jnp.array([-B]), -B + jnp.cumsum(w)])
    yk = jnp.concatenate([jnp.array([-B]), -B + jnp.cumsum(h)])
    d = jax.nn.softplus(jax.random.normal(k3, (K + 1,))) + 1e-3
    return xk, yk, d


def clipped_spline(x, xk, yk, d, search=jnp.searchsorted):
    """flowjax's formulation, written out: two clips around the piece, a select on the
    interval; ``search(xk, xc)`` places the clipped input among the knots."""
    inb = (x >= -B) & (x <= B)
    xc = jnp.clip(x, -B, B)
    k = jnp.clip(search(xk, xc) - 1, 0, len(xk) - 2)
    xi = (xc - xk[k]) / (xk[k + 1] - xk[k])
    s = (yk[k + 1] - yk[k]) / (xk[k + 1] - xk[k])
    num = (yk[k + 1] - yk[k]) * (s * xi**2 + d[k] * xi * (1 - xi))
    den = s + (d[k + 1] + d[k] - 2 * s) * xi * (1 - xi)
    y = jnp.clip(yk[k] + num / den, -B, B)
    return jnp.where(inb, y, x)


def clipped_spline_inverse(y, xk, yk, d):
    """flowjax's `inverse_and_log_det`, written out: the bin searched over the output knots,
    the piece's quadratic solved by the stable root formula (a square root of a quadratic in
    `y`)."""
    inb = (y >= -B) & (y <= B)
    yc = jnp.clip(y, -B, B)
    k = jnp.clip(jnp.searchsorted(yk, yc) - 1, 0, len(xk) - 2)
    s = (yk[k + 1] - yk[k]) / (xk[k + 1] - xk[k])
    delta = (yc - yk[k]) * (d[k + 1] + d[k] - 2 * s)
    a = (yk[k + 1] - yk[k]) * (s - d[k]) + delta
    b = (yk[k + 1] - yk[k]) * d[k] - delta
    c = -s * (yc - yk[k])
    xi = (2 * c) / (-b - jnp.sqrt(b**2 - 4 * a * c))
    x = jnp.clip(xi * (xk[k + 1] - xk[k]) + xk[k], -B, B)
    return jnp.where(inb, x, y)


# K = 3 by default; 6 and 10 bins (the same checks, about 1.5x and 2.5x as long) are `slow`
@pytest.mark.parametrize(
    "K", [3, pytest.param(6, marks=pytest.mark.slow), pytest.param(10, marks=pytest.mark.slow)]
)
def test_flowjax_style_spline_inverts_with_combinations_linear_in_the_bins(K, monkeypatch):
    xk, yk, d = _spline_params(K)
    f = lambda x: clipped_spline(x, xk, yk, d)  # noqa: E731
    x = jnp.array([-4.0, -2.9, -1.0, 0.0, 0.3, 2.2, 2.99, 5.0])
    y = jax.vmap(f)(x)
    sizes = []
    real = choices._combos

    def spy(*a):
        out = real(*a)
        sizes.append(None if out is None else len(out))
        return out

    monkeypatch.setattr(choices, "_combos", spy)
    with counting() as c:
        got = jax.vmap(jr.reverse(f))(y)
    np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-12)
    # the out-of-bounds case once; under the in-bounds case the value clip's two saturated
    # branches, then one combination per value of the bin search (K values)
    assert sizes == [1 + 2 + K], sizes
    assert c["roots"] > 0 and c["newton"] == 0, c
    x2, ld = jax.jit(jax.vmap(jr.inverse_and_slogdet(f)))(y)
    want = -jax.vmap(lambda v: jnp.log(jax.grad(f)(v)))(x)
    np.testing.assert_allclose(ld, want, rtol=1e-10)


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_spline_inverse_with_a_square_root_is_solved_by_its_roots(how):
    """Inverting flowjax's spline inverse (its default flows' forward map): every bin's piece
    is one square root of a quadratic in the unknown, solved exactly (no Newton iterations);
    the spurious root squaring adds (the bin's left knot) fails the consistency check."""
    xk, yk, d = _spline_params(4, key=3)
    g = lambda y: clipped_spline_inverse(y, xk, yk, d)  # noqa: E731
    y = jnp.array([-4.0, -2.9, -1.0, 0.0, 1e-4, 0.3, 2.2, 2.99, 5.0])
    x = jax.vmap(g)(y)
    np.testing.assert_allclose(
        jax.vmap(lambda v: clipped_spline(v, xk, yk, d))(x), y, rtol=1e-12, atol=1e-13
    )
    inv = jax.vmap(jr.inverse_and_slogdet(g))
    with counting() as c:
        got, ld = (jax.jit(inv) if how == "jit" else inv)(x)
    assert c["roots"] > 0 and c["newton"] == 0, c
    np.testing.assert_allclose(got, y, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ld, -jax.vmap(lambda v: jnp.log(jax.grad(g)(v)))(y), rtol=1e-9)


def test_one_square_root_outside_a_choice_keeps_the_root_that_solves():
    """A group with a radical and no choice (one bin's piece): of the squared equation's two
    roots, the one whose residual passes, not merely the one nearer Newton's start."""
    a0, a1, b0, b1, c1 = 0.3, 0.4, 1.2, -0.2, -0.9

    def g(y):
        a, b, c = a0 + a1 * y, b0 + b1 * y, c1 * y
        return (2 * c) / (-b - jnp.sqrt(b * b - 4 * a * c))

    y = jnp.array([0.05, 0.4, 0.8])
    with counting() as c:
        got = jr.reverse(g)(g(y))
    assert c["roots"] == 1 and c["newton"] == 0, c
    np.testing.assert_allclose(got, y, rtol=1e-12)
    # a second radical of another argument: declined, Newton's method solves it
    k = lambda y: y + 0.1 * jnp.sqrt(2.0 + y * y) + 0.05 * jnp.sqrt(3.0 + y)  # noqa: E731
    with counting() as c:
        np.testing.assert_allclose(jr.reverse(k)(k(y)), y, rtol=1e-12)
    assert c["roots"] == 0 and c["newton"] == 1, c


def _spy_searched(monkeypatch) -> list:
    found: list = []
    real = choices._searched

    def spy(*a):
        out = real(*a)
        found.append(out is not None)
        return out

    monkeypatch.setattr(choices, "_searched", spy)
    return found


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_spline_bin_is_searched_over_its_knots_not_enumerated(how, monkeypatch):
    """The bins' family of combinations is one candidate: the map evaluated at the knots the
    bin search compares with (and the clip's bounds), the output placed among those values,
    the bin inside that piece assumed; both spline directions, eagerly and under jit."""
    xk, yk, d = _spline_params(6, key=5)
    for f, x in (
        (lambda x: clipped_spline(x, xk, yk, d), jnp.array([-4.0, -2.9, -1.0, 0.0, 0.3, 2.99])),
        (lambda y: clipped_spline_inverse(y, xk, yk, d), jnp.array([-2.95, -0.5, 1e-3, 2.5, 4.5])),
    ):
        found = _spy_searched(monkeypatch)
        inv = jax.vmap(jr.reverse(f))
        got = (jax.jit(inv) if how == "jit" else inv)(jax.vmap(f)(x))
        np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-13)
        assert found and all(found), found


@pytest.mark.parametrize("K", [40])
def test_spline_of_many_bins_is_searched(K, monkeypatch):
    """A spline of 40 bins (more than the 16 values of a bin index that were enumerated
    before: refused at the index, `NotInvertibleError`), both directions: its bin is
    searched over its 41 knots, the answer right to 1e-11, its log-det too."""
    xk, yk, d = _spline_params(K, key=11)
    x = jnp.array([-3.5, -2.99, -1.3, -0.2, 0.05, 0.7, 1.9, 2.999, 4.0])
    for f, xs in (
        (lambda v: clipped_spline(v, xk, yk, d), x),
        (
            lambda v: clipped_spline_inverse(v, xk, yk, d),
            jax.vmap(lambda v: clipped_spline(v, xk, yk, d))(x),
        ),
    ):
        found = _spy_searched(monkeypatch)
        got, ld = jax.jit(jax.vmap(jr.inverse_and_slogdet(f)))(jax.vmap(f)(xs))
        np.testing.assert_allclose(got, xs, rtol=1e-11, atol=1e-11)
        want = -jax.vmap(lambda v: jnp.log(jax.grad(f)(v)))(xs)
        np.testing.assert_allclose(ld, want, rtol=1e-8, atol=1e-10)
        assert found and all(found), found


def test_spline_searched_over_a_table_padded_with_infinities():
    """Open-ended bins written as a search over ``[-inf, inner knots, inf]`` (the padded ends
    stand for the table's finite ends: it stays in order, and the map is shown monotone)."""
    xk, yk, d = _spline_params(5, key=12)
    edges = jnp.concatenate([jnp.array([-jnp.inf]), xk[1:-1], jnp.array([jnp.inf])])
    f = lambda x: clipped_spline(x, xk, yk, d, lambda _, xc: jnp.searchsorted(edges, xc))  # noqa: E731
    x = jnp.array([-3.2, -2.5, -0.4, 0.9, 2.6, 3.3])
    np.testing.assert_allclose(jax.vmap(f)(x), jax.vmap(lambda v: clipped_spline(v, xk, yk, d))(x))
    for call in (jax.vmap(jr.reverse(f)), jax.jit(jax.vmap(jr.reverse(f)))):
        np.testing.assert_allclose(call(jax.vmap(f)(x)), x, rtol=1e-12, atol=1e-12)


def test_a_search_runs_unrolled_and_a_long_loop_stays_a_loop():
    """`jnp.searchsorted`'s bisection is a `scan` of a few trips; the programs jaxrev emits
    run such short loops unrolled (`_compat.SHORT_LOOP_TRIPS`: XLA:CPU pays several
    microseconds a trip, and a search runs it at every knot): the compiled inverse of a spline
    holds no loop, values unchanged. A loop of many trips in the same program stays a loop."""
    xk, yk, d = _spline_params(6, key=3)

    def f(x):
        return clipped_spline(x, xk, yk, d)

    def g(x):  # (the spline, then a long loop of a small body)
        return jax.lax.fori_loop(0, 100, lambda i, v: v + 0.01 * jnp.sin(v), f(x))

    x = jnp.array([-3.2, -2.5, -0.4, 0.9, 2.6, 3.3])

    def scans(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name == "scan":
                yield e
            for v in e.params.values():
                inner = getattr(v, "jaxpr", v)
                if hasattr(inner, "eqns"):
                    yield from scans(inner)

    loops = list(scans(make_jaxpr(f, x[0])[0].jaxpr))
    assert loops and all(e.params["unroll"] == e.params["length"] for e in loops)
    assert [
        e.params["unroll"] for e in scans(make_jaxpr(g, x[0])[0].jaxpr) if e.params["length"] == 100
    ] == [1]
    inv = jax.jit(jax.vmap(jr.reverse(f)))
    assert "while" not in inv.lower(jax.vmap(f)(x)).compile().as_text()
    np.testing.assert_allclose(inv(jax.vmap(f)(x)), x, rtol=1e-12, atol=1e-12)
    inv_g = jax.jit(jax.vmap(jr.reverse(g)))
    y = jax.vmap(g)(x)
    assert " while(" in inv_g.lower(y).compile().as_text()
    np.testing.assert_allclose(inv_g(y), x, rtol=1e-10, atol=1e-10)

    def nested(v):  # (loops of 8 trips in loops of 8: only the innermost is unrolled, the
        # outer ones would hold its body 8 times per trip: 8^3 bodies)
        def inner(u, _):  # (28 equations: 8 trips unrolled are 224)
            for k in range(7):
                u = u + 0.001 * jnp.tanh(u * (k + 1))
            return u, None

        def middle(u, _):
            return jax.lax.scan(inner, u, None, length=8)[0], None

        return jax.lax.scan(middle, v, None, length=8)[0]

    got = {
        e.params["length"] * 100 + e.params["unroll"] for e in scans(make_jaxpr(nested, x)[0].jaxpr)
    }
    assert got == {808, 801}, got


def test_a_tables_order_is_checked_in_one_walk_either_way():
    """The certificate's walk along a searched table (`choices._table_in_order`): values
    rising along thresholds in order, or in reverse order, pass; a value below an earlier
    one by more than the rounding allowance, a value equal to the one before it at a
    threshold apart (a flat stretch), or a table out of order, does not."""
    p = jnp.array([[-2.0], [-1.0], [-1.0], [0.5], [3.0]])
    r = jnp.array([[-5.0], [-1.0], [-1.0], [2.0], [2.5]])
    tiny = jnp.array([1e-9])

    def ok(p, r):
        return choices._table_in_order(p, r, tiny, tiny)[0]

    assert ok(p, r) and ok(p[::-1], r[::-1])  # (equal thresholds, equal values: fine)
    assert not ok(p, r.at[3, 0].set(-2.0))  # falls below -1 after it
    assert not ok(p, r.at[4, 0].set(2.0))  # flat from 0.5 to 3
    assert not ok(p[::-1], r[::-1].at[0, 0].set(2.0))
    assert ok(p, r.at[4, 0].set(2.0 + 1e-6))  # (rising, however little)
    assert not ok(p[::-1], r[::-1].at[1, 0].set(-3.0))
    assert not ok(p.at[0, 0].set(1.0), r)  # thresholds in neither order
    assert ok(p, r.at[2, 0].set(jnp.nan))  # (NaN: no evidence here; `_monotone` refuses it)


def test_bin_index_of_another_function_of_the_state_is_enumerated(monkeypatch):
    """An index computed from ``0.5 x`` compares thresholds in another space than x's: the
    search declines and the bins are enumerated (still right)."""
    xk, yk, d = _spline_params(4, key=6)

    def f(x):  # (flowjax's spline, its bin searched on half the knots and half of x)
        inb = (x >= -B) & (x <= B)
        xc = jnp.clip(x, -B, B)
        k = jnp.clip(jnp.searchsorted(0.5 * xk, 0.5 * xc) - 1, 0, len(xk) - 2)
        xi = (xc - xk[k]) / (xk[k + 1] - xk[k])
        s = (yk[k + 1] - yk[k]) / (xk[k + 1] - xk[k])
        num = (yk[k + 1] - yk[k]) * (s * xi**2 + d[k] * xi * (1 - xi))
        den = s + (d[k + 1] + d[k] - 2 * s) * xi * (1 - xi)
        return jnp.where(inb, jnp.clip(yk[k] + num / den, -B, B), x)

    x = jnp.array([-2.5, -0.3, 0.8, 2.7])
    found = _spy_searched(monkeypatch)
    np.testing.assert_allclose(jax.vmap(jr.reverse(f))(jax.vmap(f)(x)), x, rtol=1e-12)
    assert found and not any(found), found


def test_spline_with_a_compare_all_search_inverts():
    """``jnp.searchsorted(..., method="compare_all")`` counts booleans of the knots' shape
    before the bin index: those are no choice of the group (before: a broadcast `ValueError`
    out of the choice step). Its NaN normalizations keep the index off the search: the bins
    are enumerated."""
    xk, yk, d = _spline_params(5, key=8)

    def f(x):
        return clipped_spline(
            x, xk, yk, d, lambda t, xc: jnp.searchsorted(t, xc, method="compare_all")
        )

    x = jnp.array([-4.0, -2.9, -1.0, 0.3, 2.2, 5.0])
    got = jax.jit(jax.vmap(jr.reverse(f)))(jax.vmap(f)(x))
    np.testing.assert_allclose(got, x, rtol=1e-12, atol=1e-13)


def test_non_monotone_tabled_map_is_named_not_answered(monkeypatch):
    """Knot heights that go down in one bin: the map's values at the knots are not sorted,
    so no piece is searched; the bin index is named (NaN on request), never a wrong input."""
    xk, yk, d = _spline_params(4, key=7)
    yk = yk.at[2].set(yk[1] - 0.5)  # bin 1 descends
    f = lambda x: clipped_spline(x, xk, yk, d)  # noqa: E731
    x = jnp.array([-2.0, 1.0])
    with pytest.raises(jr.ReversibilityError, match="not monotone") as e:
        jax.vmap(jr.reverse(f))(jax.vmap(f)(x))
    assert "test_choice_tree.py" in str(e.value)
    got = jax.vmap(jr.reverse(f, on_error="nan"))(jax.vmap(f)(x))
    assert np.all(np.isnan(got))


def test_saturated_clip_of_an_intermediate_is_refused_only_at_its_end():
    f = lambda x: jnp.clip(2.0 * jnp.tanh(x), -2.0 + 1e-12, 2.0 - 1e-12)  # noqa: E731
    x = jnp.array([-1.0, 0.25, 3.0])
    np.testing.assert_allclose(jr.reverse(f)(f(x)), x, rtol=1e-12)
    far = jnp.array([0.5, 40.0])  # tanh(40) rounds to 1: the clip saturates
    with pytest.raises(jr.NotInvertibleError, match="saturated clip") as e:
        jr.reverse(f)(f(far))
    assert e.value.primitive in ("max", "min")
    with pytest.raises(Exception, match="saturated clip"):
        jax.block_until_ready(jax.jit(jr.reverse(f))(f(far)))
    got = jr.reverse(f, on_error="nan")(f(far))
    assert np.isclose(got[0], 0.5) and np.isnan(got[1])


def test_relu_of_the_state_is_still_refused_when_traced():
    for f in (jax.nn.relu, lambda x: jax.nn.relu(2.0 * x - 1.0), lambda x: jnp.clip(x, 0, 1)):
        with pytest.raises(jr.NotInvertibleError):
            jax.make_jaxpr(jr.reverse(f))(jnp.ones(3))


def test_ratio_of_quadratics_is_solved_by_its_roots():
    a = jnp.array([2.0, 0.5, 1.5])

    def f(x):  # a Moebius map and a quadratic over a quadratic, both monotone on x > 0
        m = (a * x + 1.0) / (x + 3.0)
        return m + (x * x) / (1.0 + x * x) * 0.1

    x = jnp.array([0.3, 1.7, 4.0])
    with counting() as c:
        got = jr.reverse(f)(f(x))
    # (m + q is a ratio of degree 4: past two, Newton's method takes it)
    assert c["newton"] == 1 and c["roots"] == 0
    np.testing.assert_allclose(got, x, rtol=1e-12)
    g = lambda x: (a * x + 1.0) / (x + 3.0) + 0.25 * x  # noqa: E731
    with counting() as c:
        got = jr.reverse(g)(g(x))
    assert c["roots"] == 1 and c["newton"] == 0, c
    np.testing.assert_allclose(got, x, rtol=1e-13)


def _made(D: int, H: int, key: int):
    """A MADE layer pair with masks by rank (MADE, flowjax's and numpyro's construction)."""
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    rin, rh = np.arange(D), np.arange(H) % (D - 1)
    m1 = rin[:, None] <= rh[None, :]
    m2 = rh[:, None] < rin[None, :]
    W1 = jnp.where(m1, jax.random.normal(k1, (D, H)) / np.sqrt(D), 0.0)
    W2 = jnp.where(
        np.concatenate([m2, m2], 1), 0.3 * jax.random.normal(k2, (H, 2 * D)) / np.sqrt(H), 0.0
    )
    b = 0.1 * jax.random.normal(k3, (2 * D,))
    return W1, W2, b


def _maf_layer(x, W1, W2, b):
    p = jnp.tanh(x @ W1) @ W2 + b
    loc, log_scale = p[: x.shape[-1]], p[x.shape[-1] :]
    return x * jnp.exp(log_scale) + loc


def test_masked_autoregressive_layer_inverts_in_d_passes():
    D = 6
    W1, W2, b = _made(D, 16, 0)
    f = lambda x: _maf_layer(x, W1, W2, b)  # noqa: E731
    x = jax.random.normal(jax.random.key(1), (D,))
    xi, ld = jax.jit(jr.inverse_and_slogdet(f))(f(x))
    np.testing.assert_allclose(xi, x, rtol=1e-12)
    np.testing.assert_allclose(ld, -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-10)


def _ar_spline(x, W1, W2, b, K: int):
    """An autoregressive rational-quadratic spline as flowjax's `MaskedAutoregressive` writes
    one: a masked network of the state gives each element's bin widths, heights (softmax,
    cumsum) and derivatives (softplus), and element i is the spline of x_i on its knots."""
    D = x.shape[-1]
    p = (jnp.tanh(x @ W1) @ W2 + b).reshape(D, 3 * K - 1)
    w, h, d = p[:, :K], p[:, K : 2 * K], p[:, 2 * K :]

    def knots(u):
        c = jnp.cumsum(jax.nn.softmax(u, axis=-1), axis=-1) * 2 * B - B
        return jnp.concatenate([jnp.full((D, 1), -B), c[:, :-1], jnp.full((D, 1), B)], axis=1)

    xk, yk = knots(w), knots(h)
    dk = jnp.concatenate([jnp.ones((D, 1)), jax.nn.softplus(d) + 1e-3, jnp.ones((D, 1))], axis=1)
    return jax.vmap(clipped_spline)(x, xk, yk, dk)


def _inverts_two_points(f, how: str) -> None:
    """`inverse_and_slogdet(f)` called `how` on two points (one past the splines' interval):
    the points and the log-dets of the dense Jacobian."""
    xs = jnp.array([[-1.7, 0.4, 2.2, -0.3], [0.9, -2.5, 0.1, 3.5]])
    inv = jr.inverse_and_slogdet(f)
    if how == "jit":
        inv = jax.jit(inv)
    if how == "vmap":
        got, ld = jax.vmap(inv)(jax.vmap(f)(xs))
    else:
        got, ld = zip(*[inv(f(x)) for x in xs])
        got, ld = jnp.stack(got), jnp.stack(ld)
    np.testing.assert_allclose(got, xs, rtol=1e-10, atol=1e-10)
    want = jnp.stack([-jnp.linalg.slogdet(jax.jacfwd(f)(x))[1] for x in xs])
    np.testing.assert_allclose(ld, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_autoregressive_spline_inverts_element_by_element(how):
    """Knots known on some elements only (the rows a masked network has computed from the
    elements already recovered): each pass solves those elements' bins (a choice group on
    partly known reads, `choices._partly_known`; reductions over a row, a softmax's max
    and sum and its cumsum, known once the row is: `elements.along_axes_forward`). Before,
    refused at the spline's select."""
    D, K = 4, 5
    W1, W2, b = _made_spline(D, K)
    f = lambda x: _ar_spline(x, W1, W2, b, K)  # noqa: E731
    _inverts_two_points(f, how)


def _made_spline(D: int, K: int, key: int = 4):
    """A masked network's weights for `_ar_spline` (row i of the knots reads x_<i)."""
    rin, rh = np.arange(D), np.arange(12) % (D - 1)
    k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
    W1 = jnp.where(rin[:, None] <= rh[None, :], jax.random.normal(k1, (D, 12)) / 2, 0.0)
    m2 = np.repeat(rh[:, None] < rin[None, :], 3 * K - 1, axis=1)
    W2 = jnp.where(m2, 0.3 * jax.random.normal(k2, (12, D * (3 * K - 1))), 0.0)
    return W1, W2, 0.2 * jax.random.normal(k3, (D * (3 * K - 1),))


def _ar_spline_loop(y, W1, W2, b, K: int):
    """The autoregressive spline as flowjax's `MaskedAutoregressive.inv_scan_fn` loops over
    it (the `transform` of flowjax's default flows): D steps, each computing every element's
    spline from the current state and keeping element `rank`'s."""

    def step(carry, _):
        y, rank = carry
        return (y.at[rank].set(_ar_spline(y, W1, W2, b, K)[rank]), rank + 1), None

    return jax.lax.scan(step, (y, 0), None, length=y.shape[-1])[0][0]


@pytest.mark.parametrize("how", tiered(["eager", "jit", "vmap"], slow={"eager", "vmap"}))
def test_an_autoregressive_spline_loop_inverts_one_element_per_step(how):
    """Each step's spline is a choice group whose knots are known on the rows of the elements
    already recovered and whose output is known on element `rank` alone: a window decided
    when the program runs. The group is solved there (`choices._partly_known`, its checks on
    that element), and the record says which element it recovered, so that the log-det
    takes its pivot there (`logdet._plan_some_elements`). Before: refused at the loop's
    `dynamic_slice` (and, solved but unrecorded, a log-det of 0)."""
    D, K = 4, 5
    W1, W2, b = _made_spline(D, K)
    f = lambda y: _ar_spline_loop(y, W1, W2, b, K)  # noqa: E731
    _inverts_two_points(f, how)
    assert jr.logdet_strategy(f, f(jnp.array([-1.7, 0.4, 2.2, -0.3]))).startswith("sweep")


def test_a_recovery_missing_from_the_record_falls_back_to_the_dense_log_det(monkeypatch):
    """The log-det's plan lets a step at elements decided when the program runs (the loop's
    carry outside element `rank`) take all of its output's slots, on the promise that other
    steps recover the rest; a goal claimed so and recovered by no other recorded step is not
    followed (`logdet._Slots.owed`): with the partly known group's record dropped, the
    log-det is the dense Jacobian's, right, not the sweep's 0."""
    from jaxrev.transforms.knowledge import records

    D, K = 4, 5
    W1, W2, b = _made_spline(D, K)
    f = lambda y: _ar_spline_loop(y, W1, W2, b, K)  # noqa: E731
    x = jnp.array([-1.7, 0.4, 2.2, -0.3])
    group_step = records.group_step

    def unrecorded(env, kind, eqns, inputs, outputs, tear=None, elementwise=False, recovered=()):
        if not recovered:
            group_step(env, kind, eqns, inputs, outputs, tear, elementwise)

    monkeypatch.setattr(records, "group_step", unrecorded)
    assert jr.logdet_strategy(f, f(x)).startswith("dense: elements recovered at run time")
    _, ld = jr.inverse_and_slogdet(f)(f(x))
    np.testing.assert_allclose(ld, -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-9)


def _masked_net(D: int, n: int, key: int = 1):
    """A masked network whose row i reads x_<i: ``(D,) -> (D, n)``."""
    rin, rh = np.arange(D), np.arange(8) % (D - 1)
    k1, k2 = jax.random.split(jax.random.key(key))
    W1 = jnp.where(rin[:, None] <= rh[None, :], jax.random.normal(k1, (D, 8)) / 2, 0.0)
    m2 = np.repeat(rh[:, None] < rin[None, :], n, axis=1)
    W2 = jnp.where(m2, 0.4 * jax.random.normal(k2, (8, D * n)), 0.0)
    return lambda x: (jnp.tanh(x @ W1) @ W2).reshape(D, n)


def _written_per_step(g):
    """``y.at[i].set(g(y)[i])`` for each i in turn: an autoregressive map as a loop."""

    def f(y):
        return jax.lax.fori_loop(0, y.shape[0], lambda i, y: y.at[i].set(g(y)[i]), y)

    return f


def _selected_per_step(g):
    """The same loop written as a select of element i (``where(arange == i, g(y), y)``)."""

    def f(y):
        n = y.shape[0]
        return jax.lax.fori_loop(0, n, lambda i, y: jnp.where(jnp.arange(n) == i, g(y), y), y)

    return f


@pytest.mark.parametrize(
    "name",
    [
        "relu_plus_shift",
        "relu_times_scale",
        "loop_relu_times_scale",
        "loop_select",
        "loop_relu_first_plus_shift",
    ],
)
def test_log_dets_of_groups_solved_on_some_elements_count_each_pivot_once(name):
    """A review's programs: a choice group solved on some elements (its record new this
    round) whose outputs an element step inside the group had consumed first (a shift's or a
    scale's element rule recovering the leaky relu's output), statically and at a loop's
    window, counted those elements' pivots twice; and a select's case at a loop's window lost
    its pivots to a check that its output's slots were spent by the other case; a group
    solved whole at a loop's step whose state was known but at the window counted every
    element's pivot at every step. Each log-det against the dense Jacobian's, both ways."""
    D = 4
    net = _masked_net(D, 3)

    def lrelu_shift(x):
        s = net(x)[:, 2]  # (the network first: the other order is refused, as before)
        return jax.nn.leaky_relu(x, 0.3) + s

    def lrelu_scale(x):
        s = net(x)[:, 2]
        return jax.nn.leaky_relu(x, 0.3) * jnp.exp(s)

    def lrelu_first(x):  # (in a loop, whose step's group is solved whole on a carry known
        r = jax.nn.leaky_relu(x, 0.3)  # but at the window: its pivots there only)
        return r + net(x)[:, 2]

    def affine(x):
        p = net(x)
        return x * jnp.exp(p[:, 0]) + p[:, 1]

    f = {
        "relu_plus_shift": lrelu_shift,
        "relu_times_scale": lrelu_scale,
        "loop_relu_times_scale": _written_per_step(lrelu_scale),
        "loop_select": _selected_per_step(affine),
        "loop_relu_first_plus_shift": _written_per_step(lrelu_first),
    }[name]
    x = jnp.array([0.9, -2.5, 0.1, 1.5])
    want = jnp.linalg.slogdet(jax.jacfwd(f)(x))[1]
    y, ld = jax.jit(jr.forward_and_slogdet(f))(x)
    np.testing.assert_allclose(ld, want, rtol=1e-9)
    got, ldi = jax.jit(jr.inverse_and_slogdet(f))(y)
    np.testing.assert_allclose(got, x, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ldi, -want, rtol=1e-9)


def test_a_group_that_sums_a_partly_known_table_over_its_elements_is_not_solved_apart():
    """A choice group whose scale sums a masked network's rows over the elements (element 0's
    output reads row 1, which reads x0): solved on the elements whose rows are known, element
    0 would read row 1's fill value. Not solved so (`elements.per_element` over the reads too): the
    map is refused, not inverted wrongly (a review found the wrong inverse)."""
    M = jnp.array([[[0.0, 0.0]], [[1.3, 0.0]]])  # (D, 1, D): row i reads x_<i

    def f(x):
        rows = jnp.tanh(jnp.einsum("irj,j->ir", M, x))
        s = jnp.sum(rows[:, 0])  # (mixes the elements' rows)
        return jnp.where(x > 0, 2 * x, x) * jnp.exp(0.3 * s) + 0.1

    x = jnp.array([0.7, -1.2])
    for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
        with pytest.raises(jr.JaxrevError):
            inv(f(x))


def test_masked_autoregressive_layers_stacked_in_a_scan():
    D, L = 5, 3
    Ws = [_made(D, 12, k) for k in range(L)]
    W1s, W2s, bs = (jnp.stack(t) for t in zip(*Ws))

    def f(x):
        def body(x, w):
            return _maf_layer(x, *w)[::-1], None

        return jax.lax.scan(body, x, (W1s, W2s, bs))[0]

    x = jax.random.normal(jax.random.key(2), (D,))
    np.testing.assert_allclose(jax.jit(jr.reverse(f))(f(x)), x, rtol=1e-11)


def test_masked_layer_with_traced_masks_falls_back_to_newton():
    """Masks passed as arguments under `jit` are traced: no zeros are known when the walk
    runs, so the layer is one nonlinear group (Newton's method on all D unknowns at once,
    checked on its residual) instead of D passes."""
    D = 4
    W1, W2, b = _made(D, 8, 3)
    f = lambda x, W1, W2, b: _maf_layer(x, W1, W2, b)  # noqa: E731
    x = jax.random.normal(jax.random.key(4), (D,))
    with counting() as c:
        got = jax.jit(jr.reverse(f))(f(x, W1, W2, b), W1, W2, b)
    np.testing.assert_allclose(got, x, rtol=1e-10)
    assert c["newton"] >= 1
    with counting() as c:
        got = jax.jit(jr.reverse(lambda x: f(x, W1, W2, b)))(f(x, W1, W2, b))
    np.testing.assert_allclose(got, x, rtol=1e-12)
    assert c["newton"] == 0


@settings(max_examples=6, deadline=None)
@given(
    K=st.integers(2, 7),
    key=st.integers(0, 10_000),
    inverse=st.booleans(),
    pts=st.lists(st.floats(-3.6, 3.6), min_size=1, max_size=5),
)
def test_searched_splines_invert_random_knots_both_directions(K, key, inverse, pts):
    """Random monotone splines (knot widths, heights and derivatives drawn), written both
    ways (the forward formula and flowjax's inverse formula): the searched bin gives back the
    input to 1e-10, inside the interval and past it (where the map is the identity)."""
    xk, yk, d = _spline_params(K, key=key)
    f = (
        (lambda v: clipped_spline_inverse(v, xk, yk, d))
        if inverse
        else (lambda v: clipped_spline(v, xk, yk, d))
    )
    # (not within 1e-6 of the interval's ends: the clip saturates there, refused by design)
    x = jnp.array([p if abs(abs(p) - B) > 1e-6 else p / 2 for p in pts])
    got = jax.vmap(jr.reverse(f))(jax.vmap(f)(x))
    np.testing.assert_allclose(got, x, rtol=1e-10, atol=1e-10)


def test_inputs_on_a_knot_invert():
    """An input exactly on a knot: the root the bin on one side gives rounds into the other
    bin, so no branch's decisions held (before, "no branch ... consistent"); the group run
    forward from it gives the output back, and that makes it a preimage."""
    xk, yk, d = _spline_params(6, key=5)
    fwd = lambda v: clipped_spline(v, xk, yk, d)  # noqa: E731
    inv = lambda v: clipped_spline_inverse(v, xk, yk, d)  # noqa: E731
    # (the inverse formula's last knot maps to 1.6e-4: rounding of order 1 there is 1e-12 of
    # it, past the tolerance relative to the output; left out)
    for f, x in ((fwd, xk[1:-1]), (inv, yk[1:-2])):
        y = jax.vmap(f)(x)
        for call in (jax.vmap(jr.reverse(f)), jax.jit(jax.vmap(jr.reverse(f)))):
            np.testing.assert_allclose(call(y), x, rtol=1e-12, atol=1e-13)


def _per_element_of(f, *args) -> bool:
    """`elements.per_element` of `f`'s equations, what they compute from its first argument
    laid out per element of that argument's shape (traced as jaxrev traces: on JAX >= 0.12,
    `searchsorted` lowered to its bisection)."""
    jaxpr = make_jaxpr(f, *args)[0].jaxpr
    return elements.per_element(jaxpr.eqns, {jaxpr.invars[0]}, tuple(args[0].shape))


def test_what_is_computed_element_by_element_is_told_apart():
    """`elements.per_element`: a search per element (a table of knots per element, as flowjax's
    spline coupling writes it under `vmap`, or one table for all), a gather per element,
    elementwise arithmetic and reductions over trailing axes are element by element; a
    reduction over the elements, a reversal, a sort or a cumulative sum is not."""
    x = jnp.linspace(-1.0, 1.0, 4)
    tables = jnp.sort(jax.random.normal(jax.random.key(0), (4, 9)), axis=1)
    per_row = jax.vmap(jnp.searchsorted)
    assert _per_element_of(lambda x, t: per_row(t, x), x, tables)
    assert _per_element_of(lambda x, t: jnp.searchsorted(t[0], x), x, tables)
    assert _per_element_of(
        lambda x, t: jnp.take_along_axis(t, per_row(t, x)[:, None] % 9, axis=1)[:, 0] * x,
        x,
        tables,
    )
    assert _per_element_of(lambda x, t: jnp.sum(t * x[:, None] ** 2, axis=1), x, tables)
    for f in (
        lambda x, t: x * jnp.sum(x),
        lambda x, t: x[::-1],
        lambda x, t: jnp.sort(x),
        lambda x, t: jnp.cumsum(x),
        lambda x, t: x[per_row(t, x) % 4],  # (another element of x, picked by x's bin)
    ):
        assert not _per_element_of(f, x, tables)


def test_a_spline_searched_per_element_is_checked_once_not_again_together(monkeypatch):
    """A spline coupling's layout (a table of knots per element, the bin searched element by
    element under `vmap`): the candidates are checked once, all at once (one forward run of
    the group, vmapped over them), and the picked ones are not run forward again to check
    them together; the inverse and its log-det are right."""
    K, n = 6, 5
    params = [_spline_params(K, key=k) for k in range(n)]
    xk, yk, d = (jnp.stack(p) for p in zip(*params))

    def f(v):
        return jax.vmap(clipped_spline)(v, xk, yk, d)

    calls = {"holds": 0, "recheck": 0}
    real_holds = choices._holds

    def holds(*a):
        calls["holds"] += 1
        return real_holds(*a)

    monkeypatch.setattr(choices, "_holds", holds)
    monkeypatch.setattr(
        choices, "_recheck", lambda *a: calls.__setitem__("recheck", calls["recheck"] + 1)
    )
    x = jnp.array([-3.5, -1.3, 0.05, 1.9, 2.5])
    got, ld = jax.jit(jr.inverse_and_slogdet(f))(f(x))
    np.testing.assert_allclose(got, x, rtol=1e-11, atol=1e-11)
    want = -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1]
    np.testing.assert_allclose(ld, want, rtol=1e-9)
    assert calls == {"holds": 1, "recheck": 0}, calls


def _primitives(closed) -> set:
    """The names of every primitive in a jaxpr, its sub-jaxprs included."""
    seen: set = set()

    def walk(j):
        for e in j.eqns:
            seen.add(e.primitive.name)
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return seen


def test_a_solve_is_wrapped_to_invert_again_only_where_its_program_may_be():
    """`reverse`'s program may be inverted again (``reverse(reverse(f))``): a choice group's
    solve is a `custom_inverse` step there, whose inverse is the group run forward; the
    log-det transforms' programs only run, so their solve is emitted as it is (traced once,
    not once more by every `vmap` around it). Both give the input back."""
    xk, yk, d = _spline_params(3, key=5)
    f = lambda v: clipped_spline(v, xk, yk, d)  # noqa: E731
    x = jnp.array([-2.9, -1.0, 0.3, 2.5])
    y = jax.vmap(f)(x)
    rev = jax.vmap(jr.reverse(f))
    assert "jaxrev_custom_inverse" in _primitives(jax.make_jaxpr(rev)(y))
    np.testing.assert_allclose(jax.jit(jax.vmap(jr.reverse(jr.reverse(f))))(x), y, rtol=1e-12)
    ild = jax.vmap(jr.inverse_and_slogdet(f))
    assert "jaxrev_custom_inverse" not in _primitives(jax.make_jaxpr(ild)(y))
    np.testing.assert_allclose(jax.jit(ild)(y)[0], x, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(jax.jit(rev)(y), x, rtol=1e-12, atol=1e-13)
