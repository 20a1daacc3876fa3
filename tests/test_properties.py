"""Property tests for `jr.reverse` on random compositions of invertible steps.

Hypothesis draws a state shape (1-D or 2-D, small), a list of steps and their parameters, and
builds ``f(x, params)`` by composing the steps. The properties (docs/design.md §1, §3.2):

* round trip: ``reverse(f)(f(x, p), p) == x``;
* double reverse: ``reverse(reverse(f))(x, p) == f(x, p)``;
* the same under ``jax.jit`` and in float32 (looser tolerance).

Steps: add / sub of ``tanh(p)``, multiplication by ``exp(p)``, an affine coupling of the two
halves with an MLP-like scale and shift, cumsum along an axis, ``jnp.flip``, transpose (square
2-D), reshape round trips, ``x @ W`` / ``W @ x`` with a well-conditioned ``W``, softplus
(``log1p(exp(x))``), a sinh-arcsinh transform, a Givens rotation of the two halves written with
``jnp.cos`` / ``jnp.sin`` (a linear lump), a concatenation of reordered slices, ``x ** 3``, a
static ``lax.fori_loop`` and a ``lax.scan`` over parameter ``xs`` (both around a small random
body), and any step wrapped in ``jax.jit``.

The value ranges are chosen so that every composition is well conditioned (the steps keep the
state O(1)-O(10); ``x ** 3`` is drawn only as the last step, where rounding from later steps
cannot be amplified by the cube root near 0), so a failure at 1e-9 is a jaxrev bug, not
floating-point noise.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from jax import lax
from programs.splines import one_hot_spline

import jaxrev as jr

jax.config.update("jax_enable_x64", True)

# JAXREV_HYPOTHESIS_SCALE=10 runs ten times the examples (a long soak; the default keeps the file
# under a minute on two cores).
SCALE = float(os.environ.get("JAXREV_HYPOTHESIS_SCALE", "1"))


def n_examples(n: int) -> int:
    return max(1, int(n * SCALE))


RTOL64 = 1e-9
RTOL32 = 1e-4

# Small, fixed set of shapes: eager op-by-op dispatch caches one executable per shape, so
# reusing shapes keeps the file fast.
SHAPES = [(2,), (3,), (5,), (6,), (2, 2), (3, 3), (2, 4), (3, 4), (4, 3)]

COMMON = dict(
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# ----------------------------------------------------------------------------- steps


@dataclass
class Step:
    name: str
    fn: Callable[[Any, Any], Any]  # (x, params) -> x' with x's shape and dtype
    params: Any
    shape_out: tuple[int, ...]

    def __repr__(self) -> str:  # readable in hypothesis' falsifying examples
        return self.name


def _normal(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(dtype)


def _well_conditioned(rng, n, dtype):
    return (np.eye(n) + 0.1 * rng.standard_normal((n, n))).astype(dtype)


# kinds drawn by every property test
BASE_KINDS = [
    "add",
    "sub",
    "mulexp",
    "cumsum",
    "flip",
    "transpose",
    "reshape",
    "softplus",
    "sinh_asinh",
    "reshape_cumsum",
]
# kinds whose inverse goes through a join of slices, a linear solve or a cube root, which must
# themselves be invertible for reverse(reverse(f)) (test_double_reverse_single_step)
REV2_KINDS = ["coupling", "givens", "roll", "matmul", "lmatmul"]
LOOP_KINDS = ["fori", "scan"]
LAST_KINDS = ["cube"]


def applicable(kind: str, shape: tuple[int, ...]) -> bool:
    if kind == "transpose":
        return len(shape) == 2 and shape[0] == shape[1]
    if kind == "lmatmul":
        return len(shape) == 2
    if kind in ("coupling", "givens", "roll"):
        return shape[-1] >= 2
    return True


def make_step(
    kind: str,
    shape: tuple[int, ...],
    rng: np.random.Generator,
    dtype=np.float64,
    body: list[Step] | None = None,
) -> Step:
    """One invertible step for a state of `shape`, with its parameters drawn from `rng`."""
    n = shape[-1]
    nrm = lambda *s, scale=1.0: _normal(rng, s, dtype, scale)  # noqa: E731
    if kind == "add":
        return Step(kind, lambda x, p: x + jnp.tanh(p), nrm(*shape), shape)
    if kind == "sub":
        return Step(kind, lambda x, p: x - jnp.tanh(p), nrm(*shape), shape)
    if kind == "mulexp":
        return Step(kind, lambda x, p: x * jnp.exp(p), nrm(*shape, scale=0.3), shape)
    if kind == "cumsum":
        axis = int(rng.integers(len(shape)))
        # halve so repeated cumsums keep the state O(1)
        return Step(f"cumsum{axis}", lambda x, p: jnp.cumsum(x, axis=axis) * 0.5, (), shape)
    if kind == "flip":
        axis = [None, *range(len(shape))][int(rng.integers(len(shape) + 1))]
        return Step(
            f"flip{'' if axis is None else axis}", lambda x, p: jnp.flip(x, axis), (), shape
        )
    if kind == "transpose":
        return Step(kind, lambda x, p: x.T, (), shape)
    if kind == "reshape":
        size = int(np.prod(shape))

        def reshape_rt(x, p):
            y = jnp.reshape(x, (size,)) + jnp.tanh(p)
            return jnp.reshape(y, shape)

        return Step(kind, reshape_rt, nrm(size), shape)
    if kind == "reshape_cumsum":
        # view the state under another shape, mix along it, view it back
        size = int(np.prod(shape))
        other = (
            (shape[1], shape[0])
            if len(shape) == 2
            else ((2, size // 2) if size % 2 == 0 else (1, size))
        )

        def reshape_cs(x, p):
            return jnp.reshape(jnp.cumsum(jnp.reshape(x, other), axis=-1) * 0.5, shape)

        return Step(kind, reshape_cs, (), shape)
    if kind == "softplus":
        return Step(kind, lambda x, p: jnp.log1p(jnp.exp(x)), (), shape)
    if kind == "sinh_asinh":
        # sinh(d * asinh(x) + e): a bijection of R that keeps the state's range moderate
        return Step(
            kind,
            lambda x, p: jnp.sinh(jnp.exp(p[0]) * jnp.arcsinh(x) + p[1]),
            nrm(2, scale=0.3),
            shape,
        )
    if kind == "coupling":
        k = n // 2
        params = dict(
            w1=nrm(k, n - k, scale=1 / np.sqrt(k)),
            c=nrm(n - k),
            w2=nrm(n - k, n - k, scale=0.5 / np.sqrt(n - k)),
        )

        def coupling(x, p):
            a, b = x[..., :k], x[..., k:]
            h = jnp.tanh(a @ p["w1"] + p["c"])
            s, t = 0.5 * jnp.tanh(h), h @ p["w2"]
            return jnp.concatenate([a, b * jnp.exp(s) + t], axis=-1)

        return Step(kind, coupling, params, shape)
    if kind == "givens":
        k = n // 2

        def givens(x, theta):
            a, b, rest = x[..., :k], x[..., k : 2 * k], x[..., 2 * k :]
            c, s = jnp.cos(theta), jnp.sin(theta)
            return jnp.concatenate([a * c - b * s, a * s + b * c, rest], axis=-1)

        return Step(kind, givens, nrm(k), shape)
    if kind == "roll":
        # concatenate reordered slices: three pieces in a random order
        cuts = sorted(rng.choice(np.arange(1, n), size=min(2, n - 1), replace=False).tolist())
        bounds = [0, *cuts, n]
        pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
        order = rng.permutation(len(pieces)).tolist()
        if order == sorted(order):
            order = order[::-1]

        def roll(x, p):
            return jnp.concatenate([x[..., pieces[i][0] : pieces[i][1]] for i in order], axis=-1)

        return Step(f"roll{order}", roll, (), shape)
    if kind == "matmul":
        return Step(kind, lambda x, w: x @ w, _well_conditioned(rng, n, dtype), shape)
    if kind == "lmatmul":
        return Step(kind, lambda x, w: w @ x, _well_conditioned(rng, shape[0], dtype), shape)
    if kind == "cube":
        return Step(kind, lambda x, p: x**3, (), shape)
    if kind == "fori":
        body = body or []
        lo, hi = 0, int(rng.integers(1, 4))

        def fori(x, p):
            def b(i, y):
                for s, q in zip(body, p[1]):
                    y = s.fn(y, q)
                return y + jnp.tanh(p[0] * i)  # the loop index enters the body

            return lax.fori_loop(lo, hi, b, x)

        return Step(
            f"fori({hi}){body}", fori, (nrm(*shape, scale=0.3), [s.params for s in body]), shape
        )
    if kind == "scan":
        body = body or []
        length = int(rng.integers(1, 4))

        def scan(x, p):
            def b(c, xt):
                for s, q in zip(body, p[1]):
                    c = s.fn(c, q)
                return c * jnp.exp(0.1 * jnp.tanh(xt)) + jnp.tanh(xt), None

            return lax.scan(b, x, p[0])[0]

        return Step(
            f"scan({length}){body}", scan, (nrm(length, *shape), [s.params for s in body]), shape
        )
    raise KeyError(kind)


def compose(steps: list[Step]) -> Callable[[Any, Any], Any]:
    def f(x, params):
        for s, p in zip(steps, params):
            x = s.fn(x, p)
        return x

    return f


def jitted(step: Step) -> Step:
    return Step(f"jit({step.name})", jax.jit(step.fn), step.params, step.shape_out)


# ----------------------------------------------------------------------------- strategies


@st.composite
def programs(
    draw, kinds, *, dtype=np.float64, max_steps=4, loops=True, allow_last=True, allow_jit=True
):
    """(f, x, params, steps) for a random composition of invertible steps."""
    shape = draw(st.sampled_from(SHAPES))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ok = [k for k in kinds if applicable(k, shape)]
    n_steps = draw(st.integers(1, max_steps))
    steps = []
    for _ in range(n_steps):
        kind = draw(st.sampled_from(ok + (LOOP_KINDS if loops else [])))
        body = None
        if kind in LOOP_KINDS:
            body = [
                make_step(draw(st.sampled_from(ok)), shape, rng, dtype)
                for _ in range(draw(st.integers(0, 2)))
            ]
        step = make_step(kind, shape, rng, dtype, body)
        if allow_jit and draw(st.integers(0, 2)) == 0:
            step = jitted(step)
        steps.append(step)
    if allow_last and draw(st.booleans()) and draw(st.booleans()):
        steps.append(make_step("cube", shape, rng, dtype))
    # magnitudes below 1e-6 become exact zeros: the cube of a value like 1e-257 underflows to 0,
    # a loss of information no inverse can undo
    x = draw(
        hnp.arrays(
            dtype,
            shape,
            elements=st.floats(
                -2,
                2,
                allow_nan=False,
                allow_infinity=False,
                allow_subnormal=False,
                width=np.dtype(dtype).itemsize * 8,
            ).map(lambda v: 0.0 if abs(v) < 1e-6 else v),
        )
    )
    params = [s.params for s in steps]
    return compose(steps), x, params, steps


def _forward(f, x, params):
    y = f(x, params)
    assert np.all(np.isfinite(np.asarray(y))), "the forward run left the range"
    return y


# ----------------------------------------------------------------------------- properties

ALL_KINDS = BASE_KINDS + REV2_KINDS


def _maybe_jit(fun, use_jit: bool):
    return jax.jit(fun) if use_jit else fun


# Each example runs eagerly or under `jax.jit` (drawn): jit exercises the interpreter's output
# as a traced program and costs one compile per example instead of one per new op shape.


@settings(max_examples=n_examples(15), **COMMON)
@given(programs(ALL_KINDS), st.booleans())
def test_round_trip(prog, use_jit):
    f, x, params, steps = prog
    y = _forward(_maybe_jit(f, use_jit), x, params)
    x_rec = _maybe_jit(jr.reverse(f), use_jit)(y, params)
    assert x_rec.shape == x.shape and x_rec.dtype == x.dtype
    assert rel_error(x_rec, x, y) <= RTOL64, (steps, rel_error(x_rec, x, y))


@settings(max_examples=n_examples(10), **COMMON)
@given(programs(BASE_KINDS + REV2_KINDS), st.booleans())
def test_double_reverse(prog, use_jit):
    f, x, params, steps = prog
    y = _forward(f, x, params)
    y2 = _maybe_jit(jr.reverse(jr.reverse(f)), use_jit)(x, params)
    assert y2.shape == y.shape and y2.dtype == y.dtype
    assert rel_error(y2, y, x) <= RTOL64, (steps, rel_error(y2, y, x))


F32_KINDS = ["add", "mulexp", "coupling", "cumsum", "flip", "matmul", "givens", "sinh_asinh"]


@settings(max_examples=n_examples(10), **COMMON)
@given(
    programs(
        F32_KINDS, dtype=np.float32, max_steps=3, loops=False, allow_last=False, allow_jit=False
    ),
    st.booleans(),
)
def test_round_trip_float32(prog, use_jit):
    f, x, params, steps = prog
    y = _forward(f, x, params)
    assert y.dtype == jnp.float32
    x_rec = _maybe_jit(jr.reverse(f), use_jit)(y, params)
    assert x_rec.dtype == jnp.float32
    assert rel_error(x_rec, x, y) <= RTOL32, (steps, rel_error(x_rec, x, y))


# ----------------------------------------------------------------------------- double reverse

# the inverse of each of these steps is built from a primitive that must be invertible in turn:
# slices joined back by `concatenate`, `x @ W` undone by a `custom_linear_solve` (inverted by its
# matvec), and `x ** 3` undone by `cbrt`
_REV2_STEPS = ["coupling", "givens", "roll", "matmul", "lmatmul", "cube"]


@pytest.mark.parametrize("kind", list(_REV2_STEPS))
def test_double_reverse_single_step(kind):
    """reverse(reverse(f)) on one step each: the kinds left out of `test_double_reverse`."""
    shape = (3, 4)
    rng = np.random.default_rng(0)
    step = make_step(kind, shape, rng)
    x = rng.standard_normal(shape)
    y = step.fn(x, step.params)
    y2 = jr.reverse(jr.reverse(step.fn))(x, step.params)
    assert rel_error(y2, y, x) <= RTOL64


NESTED_JIT = {
    "jit(jit(mul))": jax.jit(jax.jit(lambda x, p: x * jnp.exp(p))),
    "jit(cumsum)": jax.jit(lambda x, p: jnp.cumsum(x) + p),
    "jit(flip)": jax.jit(lambda x, p: jnp.flip(x) * jnp.exp(p)),
}


@pytest.mark.parametrize("name", list(NESTED_JIT))
def test_nested_jit_round_trip(name):
    """A call nested in a call (jnp.cumsum and jnp.flip are jitted inside JAX), the shape the
    property tests build when they wrap such a step in `jax.jit`, as a plain regression test."""
    f = NESTED_JIT[name]
    x, p = jnp.array([0.5, -1.0, 2.0]), jnp.array([0.1, 0.2, -0.3])
    assert rel_error(jr.reverse(f)(f(x, p), p), x) <= RTOL64


# ----------------------------------------------------------------------------- reversible


@settings(max_examples=n_examples(8), **COMMON)
@given(programs(ALL_KINDS))
def test_reversible_gradients_match_jax_grad(prog):
    """Gradients of `reversible(f)` with respect to the state and every parameter, under jit,
    equal jax.grad's on the same random program."""
    f, x, params, steps = prog

    def loss(fun):
        return jax.jit(jax.grad(lambda x, p: jnp.sum(jnp.sin(fun(x, p))), argnums=(0, 1)))

    _forward(f, x, params)
    g_ref = loss(f)(x, params)
    g = loss(jr.reversible(f))(x, params)
    assert rel_error(g, g_ref) <= 1e-8, (steps, rel_error(g, g_ref))


# ----------------------------------------------------------------------------- inverse AD


def _dense_jacobian(f, x, params):
    return jax.jacfwd(lambda z: jnp.ravel(f(jnp.reshape(z, x.shape), params)))(jnp.ravel(x))


@settings(max_examples=n_examples(5), **COMMON)
@given(programs(ALL_KINDS), st.sampled_from(["auto", "linearize"]))
def test_inverse_jvp_and_vjp_match_dense_solve(prog, method):
    """J⁻¹v and J⁻ᵀc of random invertible programs, by each step-by-step strategy, against a
    dense solve of the materialised Jacobian."""
    f, x, params, steps = prog
    _forward(f, x, params)
    J = np.asarray(_dense_jacobian(f, x, params))
    if np.linalg.cond(J) > 1e8:  # a near-singular draw: the comparison would measure rounding
        return
    rng = np.random.default_rng(0)
    v = rng.standard_normal(x.shape)
    g = lambda z: f(z, params)  # noqa: E731
    _, (t,) = jax.jit(lambda x, v: jr.inverse_jvp(g, (x,), v, method=method))(x, v)
    t_ref = np.linalg.solve(J, v.ravel())
    assert rel_error(np.ravel(t), t_ref) <= 1e-8, (steps, method)
    _, ivjp = jr.inverse_vjp(g, x, method=method)
    w = ivjp((jnp.asarray(v),))
    assert rel_error(np.ravel(w), np.linalg.solve(J.T, v.ravel())) <= 1e-8, (steps, method)


# --------------------------------------------------------------------------- one-hot splines


def _one_hot_rqs(x, xs, ys, d):
    return jax.vmap(lambda x: one_hot_spline(x, xs, ys, d))(x)


_ONE_HOT = jax.jit(jr.reverse(_one_hot_rqs, on_error="nan"))


@settings(max_examples=n_examples(12), **COMMON)
@given(
    widths=hnp.arrays(np.float64, 5, elements=st.floats(0.2, 3.0)),
    heights=hnp.arrays(
        np.float64,
        5,
        elements=st.one_of(st.floats(0.05, 3.0), st.floats(-1.0, -0.05), st.just(0.0)),
    ),
    slopes=hnp.arrays(np.float64, 6, elements=st.floats(0.05, 4.0)),
    at=hnp.arrays(np.float64, 7, elements=st.floats(-1.2, 1.2)),
    knot=st.integers(0, 5),
)
def test_one_hot_splines_invert_or_say_so(widths, heights, slopes, at, knot):
    """Random one-hot splines (5 bins, some heights negative or zero: maps that are not
    one-to-one), inputs inside, on a knot and on both tails: every element comes back, or is
    NaN (with ``on_error="nan"``) where the map is not shown one-to-one; never another
    preimage (a flat bin's far end was returned for an input inside it before its values'
    equality counted against the certificate). A monotone map (every height positive) gives
    every element back."""
    xs = jnp.concatenate([jnp.zeros(1), jnp.cumsum(widths)]) - 4.0
    ys = jnp.concatenate([jnp.zeros(1), jnp.cumsum(heights)]) - 4.0
    span = xs[-1] - xs[0]
    x = jnp.concatenate([xs[0] + (at * 0.5 + 0.5) * span, xs[knot : knot + 1]])
    x = x.at[0].set(xs[0] - 1.5).at[1].set(xs[-1] + 0.5)  # (both tails)
    y = _one_hot_rqs(x, xs, ys, slopes)
    got = _ONE_HOT(y, xs, ys, slopes)
    ok = jnp.isnan(got) | (jnp.abs(got - x) <= 1e-8 * (1 + jnp.abs(x)))
    assert bool(jnp.all(ok)), (got, x)
    if bool(jnp.all(heights > 0)):
        np.testing.assert_allclose(got, x, rtol=1e-8, atol=1e-8)
