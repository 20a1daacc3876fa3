"""The NiLang paper's Bessel and sparse-dot workloads (examples/bessel.py, examples/sparse_dot.py):
derivatives through `jr.reversible` against analytic, SciPy, finite-difference and plain-JAX
references in float64, and one run of each script with its printed figures checked."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from jax.experimental import sparse

import jaxrev as jr

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import bessel  # noqa: E402
import sparse_dot  # noqa: E402

XS = np.array([-3.5, -0.7, 0.3, 1.0, 2.5, 6.0, 9.5])


def close(a, b, atol):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=atol)


# ------------------------------------------------------------------ Bessel


@pytest.mark.parametrize("nu", [-1, 0, 1, 2, 3])
def test_bessel_value_is_scipys(nu):
    close(bessel.bessel_j(nu, XS), scipy.special.jv(nu, XS), 1e-12)


def test_plain_jax_grad_refuses_the_while_loop():
    with pytest.raises(ValueError, match="while_loop"):
        jax.grad(functools.partial(bessel.bessel_j, 2))(1.0)


@pytest.mark.parametrize("nu", [0, 2])
def test_bessel_gradient(nu):
    g = np.array([bessel.grad_reversible(nu, x) for x in XS])
    # forward mode differentiates the same truncated loop: the same derivative up to the
    # rounding of terms rebuilt by division (terms reach ~300 at x = 9.5)
    close(g, [bessel.grad_forward(nu, x) for x in XS], 1e-12)
    # the references sum the series further (or are exact): they differ by the truncation
    close(g, bessel.d_analytic(nu, XS), 1e-11)
    close(g, [bessel.grad_fixed(nu, x) for x in XS], 1e-11)
    close(g, scipy.special.jvp(nu, XS), 1e-11)


def test_bessel_gradient_paper_value_and_finite_differences():
    g = float(bessel.grad_reversible(2, 1.0))
    assert abs(g - 0.2102436) < 1e-7  # the paper's Grad(ibesselj) output
    h = 1e-5
    fd = (bessel.bessel_j(2, 1.0 + h) - bessel.bessel_j(2, 1.0 - h)) / (2 * h)
    assert abs(g - float(fd)) < 1e-9


@pytest.mark.parametrize("nu", [1, 2])
def test_bessel_hessian_forward_over_reverse(nu):
    hs = np.array([bessel.hessian_reversible(nu, x) for x in XS])
    close(hs, bessel.d2_analytic(nu, XS), 1e-10)
    close(hs, scipy.special.jvp(nu, XS, 2), 1e-10)


def test_bessel_at_zero_is_finite():
    # the loop stops at x = 0 rather than divide by a zero factor on the way back
    for nu, want in [(0, 0.0), (1, 0.5), (2, 0.0)]:
        assert float(bessel.grad_reversible(nu, 0.0)) == want
    assert float(bessel.hessian_reversible(2, 0.0)) == pytest.approx(0.25, abs=1e-15)


def test_bessel_batch_vmap():
    xs = jnp.linspace(0.01, 10.0, 300)
    vg = jax.jit(jax.vmap(functools.partial(bessel.grad_reversible, 2)))(xs)
    close(vg, scipy.special.jvp(2, np.asarray(xs)), 1e-11)
    close(vg, jax.vmap(functools.partial(bessel.grad_fixed, 2))(xs), 1e-11)
    hv = jax.jit(jax.vmap(functools.partial(bessel.hessian_reversible, 2)))(xs[::10])
    close(hv, scipy.special.jvp(2, np.asarray(xs[::10]), 2), 1e-10)


def test_bessel_grad_of_vmap():
    # points take different trip counts: the ones that finish first must not turn NaN
    xs = jnp.array([0.5, 9.0])
    gv = jax.grad(
        lambda xs: jnp.sum(jax.vmap(functools.partial(bessel.bessel_j_reversible, 2))(xs))
    )(xs)
    close(gv, scipy.special.jvp(2, np.asarray(xs)), 1e-11)


def test_bessel_stores_a_few_bytes_whatever_the_number_of_terms():
    f = bessel.accumulator(2)
    few, many = (
        jr.memory_report(f, jnp.float64(0.0), jnp.float64(x), checkpoint_every=None).total_bytes
        for x in (0.1, 9.0)
    )
    assert few == many <= 32


@pytest.mark.parametrize("size", [1, 50])
def test_bessel_problem(size):
    p = bessel.problem(size)
    assert set(p) == {"label", "args", "objective", "jaxrev", "jax"}
    x = np.asarray(p["args"][0])
    close(jax.jit(p["objective"])(*p["args"]), scipy.special.jv(2, x), 1e-12)
    close(jax.jit(p["jaxrev"])(*p["args"]), jax.jit(p["jax"])(*p["args"]), 1e-11)


# ------------------------------------------------------------------ sparse dot


def _dense_grads(A, B):
    Ad, Bd = A.todense(), B.todense()
    return Bd[A.indices[:, 0], A.indices[:, 1]], Ad[B.indices[:, 0], B.indices[:, 1]]


def _grads(
    A, B, which=("reversible merge", "jax.grad merge", "reversible pairs", "jax.grad vectorised")
):
    a, al, b, bl = A.data, sparse_dot.linear_index(A), B.data, sparse_dot.linear_index(B)
    ia, ib = sparse_dot.match_pairs(al, bl)
    run = {
        "reversible merge": lambda: sparse_dot.grad_merge_reversible(a, al, b, bl),
        "jax.grad merge": lambda: sparse_dot.grad_merge_plain(a, al, b, bl),
        "reversible pairs": lambda: sparse_dot.grad_pairs_reversible(a, b, ia, ib),
        "jax.grad vectorised": lambda: sparse_dot.grad_vector(a, al, b, bl),
    }
    return {k: run[k]() for k in which}


def test_sparse_values_and_gradients():
    rng = np.random.default_rng(0)
    A, B = (sparse_dot.random_bcoo(rng, 120) for _ in range(2))
    a, al, b, bl = A.data, sparse_dot.linear_index(A), B.data, sparse_dot.linear_index(B)
    dense = float(jnp.sum(A.todense() * B.todense()))
    for v in (
        sparse_dot.merge_value(a, al, b, bl),
        sparse_dot.vector_dot(a, al, b, bl),
        sparse_dot.merge_value_reversible(a, al, b, bl),
    ):
        assert float(v) == pytest.approx(dense, rel=1e-13)
    want_a, want_b = _dense_grads(A, B)
    for label, (ga, gb) in _grads(A, B).items():
        assert jnp.array_equal(ga, want_a) and jnp.array_equal(gb, want_b), label


def _bcoo(n, cells, values):
    lin = np.asarray(cells)
    idx = np.stack([lin // n, lin % n], axis=1).astype(np.int32)
    return sparse.BCOO((jnp.asarray(values, float), jnp.asarray(idx)), shape=(n, n))


@pytest.mark.parametrize(
    "a_cells, b_cells",
    [
        ([0, 5, 9], [1, 2, 3]),  # no common position
        ([1, 2, 3], [4, 7, 8]),  # A runs out first, then B walks alone
        ([4, 7, 8], [1, 2, 3]),  # B runs out first
        ([2, 6, 11], [2, 6, 11]),  # the same pattern: every step a match
        ([0, 15, 16], [0, 3, 16]),  # matches at both ends
    ],
)
def test_sparse_merge_edge_cases(a_cells, b_cells):
    # three entries each: one compiled merge serves every case
    A = _bcoo(5, a_cells, np.arange(1.0, len(a_cells) + 1))
    B = _bcoo(5, b_cells, -np.arange(2.0, len(b_cells) + 2))
    want_a, want_b = _dense_grads(A, B)
    for label, (ga, gb) in _grads(A, B, ("reversible merge", "jax.grad vectorised")).items():
        assert jnp.array_equal(ga, want_a) and jnp.array_equal(gb, want_b), label


def test_sparse_merge_stores_one_byte_per_step():
    rng = np.random.default_rng(1)
    A, B = (sparse_dot.random_bcoo(rng, 60) for _ in range(2))
    state = (jnp.int32(0), jnp.int32(0), jnp.float64(0.0))
    report = jr.memory_report(
        sparse_dot.merge_dot,
        state,
        A.data,
        sparse_dot.linear_index(A),
        B.data,
        sparse_dot.linear_index(B),
        checkpoint_every=None,
    )
    assert report.total_bytes == A.nse + B.nse


def test_sparse_problem():
    p = sparse_dot.problem(300)
    assert set(p) == {"label", "args", "objective", "jaxrev", "jax"}
    a, al, b, bl = p["args"]
    assert float(jax.jit(p["objective"])(*p["args"])) == pytest.approx(
        float(sparse_dot.vector_dot(a, al, b, bl)), rel=1e-13
    )
    ra, rb = jax.jit(p["jaxrev"])(*p["args"])
    ja, jb = jax.jit(p["jax"])(*p["args"])
    assert jnp.array_equal(ra, ja) and jnp.array_equal(rb, jb)


# ------------------------------------------------------------------ the scripts

from test_examples import _number, _run  # noqa: E402  (the examples' script runner)


@pytest.mark.slow  # the whole script (61 s of a worker under load); functions tested in-process
def test_bessel_script():
    out = _run("bessel.py")
    assert "jax.grad of the plain while loop raises ValueError" in out
    assert _number(out, "value vs scipy.special.jv, relative error:") < 1e-12
    assert abs(_number(out, "dJ_2/dx at x = 1.0 by jr.reversible:") - 0.2102436) < 1e-7
    assert _number(out, "gradient vs analytic derivative, relative error:") < 1e-11
    assert _number(out, "gradient vs central finite differences, relative error:") < 1e-8
    assert _number(out, "gradient vs jax.grad of the fori_loop version, relative error:") < 1e-12
    assert _number(out, "Hessian vs analytic second derivative, relative error:") < 1e-10
    assert _number(out, "batch gradient vs scipy.special.jvp, max error / max |dJ|:") < 1e-10
    assert "reversible(accumulate_j) stores nothing" in out
    assert re.search(r"gradient, jr.reversible\s+one point\s+[0-9.]+ us, batch of 4000", out)
    assert "bessel finished in" in out


@pytest.mark.slow  # the whole script; its functions are tested in-process above
def test_sparse_dot_script():
    out = _run("sparse_dot.py")
    assert out.count("max abs error vs B at A's non-zeros (and A at B's): 0.0e+00") == 4
    assert out.count(": True") == 3
    assert _number(out, "value by merge loop, jr.reversible vs dense, relative error:") < 1e-12
    assert _number(out, "jr.reversible of the merge stores") == 100000
    m = re.search(r"merge gradient temp memory: reversible (\d+) B, jax.grad (\d+) B", out)
    assert m and int(m.group(1)) < int(m.group(2)), out
    assert _number(out, "bcoo_multiply_sparse(A, B) temp memory (compiled, not run):") > 1
    assert _number(out, "gradient, jr.reversible of the merge") > 0
    assert "sparse_dot finished in" in out
