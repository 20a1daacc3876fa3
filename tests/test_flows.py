"""Log-determinants from the inversion sweep and the flows API (issue 17, docs/design.md §3.7).

Every program is checked against `jnp.linalg.slogdet(jax.jacfwd(f))` in float64 (sign exactly,
log|det| to 1e-10), eagerly, under `jit` and under `vmap`; `logdet_strategy` must say "sweep",
so a silent fall-back to the dense Jacobian fails the test. The forward and inverse entry points
must agree with each other and round-trip.
"""

from __future__ import annotations

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxrev as jr

sys.path.insert(0, os.path.dirname(__file__))
from programs import marker_line, splines  # noqa: E402
from programs.elements import programs  # noqa: E402
from programs.splines import one_hot_spline  # noqa: E402
from tiers import tiered  # noqa: E402

TOL = 1e-10
HERE = os.path.basename(__file__)
P = programs()


def _dense(f, x):
    return jnp.linalg.slogdet(jax.jacfwd(f)(x))


def _mlp_w(key, n, h=12, scale=0.3):
    k1, k2 = jax.random.split(key)
    return {
        "a": jax.random.normal(k1, (h, n)) * scale / np.sqrt(n),
        "b": jax.random.normal(k2, (2 * n, h)) * scale,
    }


def _coupling(x, w, mask):
    """distrax's MaskedCoupling written by hand: the conditioner reads the masked part."""
    h = jnp.tanh(w["a"] @ (x * mask))
    out = w["b"] @ h
    n = x.shape[0]
    s, t = jnp.tanh(out[:n]), out[n:]
    return jnp.where(mask, x, x * jnp.exp(s) + t)


def _lu_affine(x, lu):
    """Glow's invertible 1x1 convolution: x (pixels, channels) @ P L U."""
    c = x.shape[-1]
    L = jnp.tril(lu["m"], -1) + jnp.eye(c)
    U = jnp.triu(lu["m"], 1) + jnp.diag(jnp.exp(lu["logs"]) * lu["sign"])
    return x @ (lu["perm"] @ L @ U)


def _flow(x, ws):
    n = x.shape[0]
    for k, w in enumerate(ws):
        mask = jnp.arange(n) % 2 == k % 2
        x = _coupling(x, w, mask)
        x = jnp.where(x > 0, x, 0.2 * x)  # leaky relu: a choice per element
        x = x[jnp.array(np.random.RandomState(k).permutation(n))]  # a permutation
    return x


N = 10
KEY = jax.random.PRNGKey(3)
X = jax.random.normal(KEY, (N,))
WS = [_mlp_w(k, N) for k in jax.random.split(KEY, 3)]
LU = {
    "m": jax.random.normal(KEY, (4, 4)) * 0.3,
    "logs": jnp.array([0.1, -0.2, 0.3, 0.05]),
    "sign": jnp.array([1.0, -1.0, 1.0, 1.0]),
    "perm": jnp.eye(4)[jnp.array([2, 0, 3, 1])],
}

_LUW = jnp.eye(4)[jnp.array([1, 0, 2, 3])] + 0.3 * jax.random.normal(jax.random.PRNGKey(5), (4, 4))

CASES = {
    "flow": (lambda x: _flow(x, WS), X),
    "lu_affine": (lambda x: _lu_affine(x.reshape(3, 4), LU).reshape(-1), jnp.linspace(-1, 1, 12)),
    "actnorm_rev": (
        lambda x: (x * jnp.exp(jnp.linspace(-1, 1, 9)) - 0.3)[::-1],
        jnp.linspace(-1, 1, 9),
    ),
    "roll_negate": (lambda x: -jnp.roll(x, 3) * 1.5, jnp.linspace(-1, 1, 7)),
    "swap_pair": (lambda x: x.at[0].set(x[4]).at[4].set(x[0]) * 2.0, jnp.linspace(0.5, 1, 5)),
    "simultaneous": (
        lambda x: jnp.concatenate([x[:3] + 0.5 * jnp.tanh(x[3:]), x[3:] + 0.5 * jnp.sin(x[:3])]),
        jnp.linspace(-1, 1, 6),
    ),
    "residual_newton": (lambda x: x + 0.5 * jnp.tanh(x), jnp.linspace(-2, 2, 5)),
    "scan_flow": (
        lambda x: lax.scan(
            lambda c, _: (_coupling(c, WS[0], jnp.arange(N) < 5)[::-1], None), x, None, length=5
        )[0],
        X,
    ),
    "odd_reverse_loop": (
        lambda x: lax.fori_loop(0, 3, lambda i, a: -a[::-1] * 1.5, x),
        jnp.linspace(-1, 1, 7),
    ),
    "cumsum_exp": (lambda x: jnp.cumsum(jnp.exp(x)), jnp.linspace(-1, 1, 6)),
    # Glow's 1x1 convolution as a convolution (Flax's nn.Conv), channels last and first
    "conv_nhwc": (
        lambda x: lax.conv_general_dilated(
            x.reshape(1, 2, 3, 4),
            _LUW[None, None],
            (1, 1),
            "VALID",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        ).reshape(-1),
        jnp.linspace(-1, 1, 24),
    ),
    "conv_nchw": (
        lambda x: lax.conv_general_dilated(
            x.reshape(1, 4, 2, 3), _LUW.T[:, :, None, None], (1, 1), "VALID"
        ).reshape(-1),
        jnp.linspace(-1, 1, 24),
    ),
    "w_at_x": (lambda x: (_LUW @ x.reshape(4, 3)).reshape(-1), jnp.linspace(-1, 1, 12)),
    "reshape_transpose": (
        lambda x: (x.reshape(2, 3).T * jnp.array([1.0, -2.0])).reshape(-1),
        jnp.linspace(-1, 1, 6),
    ),
}
# the element programs of issue 15 (couplings, splines, leaky nets, element loops, scans)
ELEMENTS = sorted(P)
# the sign of a permutation made at a loop counter is not followed (log|det| is)
UNSIGNED = {"swaps", "windows"}


def _case(name):
    if name in CASES:
        return CASES[name]
    f, x, p = P[name]
    return (lambda x: f(x, p)), x


@pytest.mark.parametrize("name", sorted(CASES) + ELEMENTS)
def test_logdet_matches_dense(name):
    f, x = _case(name)
    strategy = jr.logdet_strategy(f, x)
    assert strategy.startswith("sweep"), strategy
    assert (name in UNSIGNED) == ("sign" in strategy)
    ref_sign, ref = _dense(f, x)
    sign, logdet = jr.slogdet_jacobian(f, x)
    assert float(sign) == float(ref_sign)
    assert abs(float(logdet - ref)) < TOL * max(1.0, abs(float(ref)))
    # one pass each way, eagerly and under jit
    y, ld = jr.forward_and_slogdet(f)(x)
    assert abs(float(ld - ref)) < TOL * max(1.0, abs(float(ref)))
    assert float(jnp.max(jnp.abs(y - f(x)))) == 0.0
    x2, ild = jax.jit(jr.inverse_and_slogdet(f))(y)
    assert abs(float(ild + ref)) < TOL * max(1.0, abs(float(ref)))
    assert float(jnp.max(jnp.abs(x2 - x))) < 1e-10
    _, ld_jit = jax.jit(jr.forward_and_slogdet(f))(x)
    assert abs(float(ld_jit - ld)) < 1e-12


@pytest.mark.parametrize(
    "name",
    tiered(
        ["flow", "lu_affine", "scan_flow", "rq_spline", "mul_chain"], slow={"flow", "rq_spline"}
    ),
)
def test_vmap(name):
    f, x = _case(name)
    xs = jnp.stack([x, 0.9 * x + 0.05, -0.7 * x])
    _, lds = jax.vmap(jr.forward_and_slogdet(f))(xs)
    ref = jax.vmap(lambda x: _dense(f, x)[1])(xs)
    assert float(jnp.max(jnp.abs(lds - ref))) < TOL
    ys = jax.vmap(f)(xs)
    x2, ilds = jax.jit(jax.vmap(jr.inverse_and_slogdet(f)))(ys)
    assert float(jnp.max(jnp.abs(x2 - xs))) < 1e-10
    assert float(jnp.max(jnp.abs(ilds + ref))) < TOL


def test_argnums_and_parameters():
    def f(x, ws, scale):
        return _flow(x, ws) * scale

    sign, ld = jr.slogdet_jacobian(f, X, WS, 2.0)  # argnums=0: x only
    ref = _dense(lambda x: f(x, WS, 2.0), X)
    assert float(sign) == float(ref[0]) and abs(float(ld - ref[1])) < TOL

    def g(a, b):  # two state arguments
        return b * jnp.exp(a), a + jnp.tanh(b)

    a, b = jnp.linspace(-1, 1, 3), jnp.linspace(0.2, 0.8, 3)
    sign, ld = jr.slogdet_jacobian(g, a, b, argnums=(0, 1))
    J = jax.jacfwd(lambda v: jnp.concatenate(g(v[:3], v[3:])))(jnp.concatenate([a, b]))
    rs, rl = jnp.linalg.slogdet(J)
    assert float(sign) == float(rs) and abs(float(ld - rl)) < TOL
    with pytest.raises(ValueError, match="out of range"):
        jr.slogdet_jacobian(f, X, WS, 2.0, argnums=3)


def test_grad_of_log_likelihood():
    """Maximum likelihood: the gradient through `inverse_and_slogdet` equals the one through
    `reverse` and the dense log-determinant."""
    ys = jax.vmap(lambda x: _flow(x, WS))(jnp.stack([X, X[::-1] * 0.5]))

    def nll(ws):
        z, ld = jax.vmap(jr.inverse_and_slogdet(_flow), (0, None))(ys, ws)
        return 0.5 * jnp.sum(z**2) - jnp.sum(ld)

    def nll_dense(ws):
        z = jax.vmap(jr.reverse(_flow), (0, None))(ys, ws)
        ld = jax.vmap(lambda x: _dense(lambda x: _flow(x, ws), x)[1])(z)
        return 0.5 * jnp.sum(z**2) + jnp.sum(ld)

    g, g_ref = jax.jit(jax.grad(nll))(WS), jax.grad(nll_dense)(WS)
    err = max(
        float(jnp.max(jnp.abs(a - b)))
        for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ref))
    )
    assert err < 1e-9


def test_float32():
    ws32 = jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), WS)
    _, ld = jr.forward_and_slogdet(_flow)(X.astype(jnp.float32), ws32)
    assert ld.dtype == jnp.float32
    assert abs(float(ld) - float(_dense(lambda x: _flow(x, WS), X)[1])) < 1e-4


def test_bijector_protocol():
    b = jr.Bijector(_flow)
    xb = jnp.stack([X, -X, 0.5 * X])
    y, ld = b.forward_and_log_det(xb, WS)
    assert y.shape == xb.shape and ld.shape == (3,)
    ref = jax.vmap(lambda x: _dense(lambda x: _flow(x, WS), x)[1])(xb)
    assert float(jnp.max(jnp.abs(ld - ref))) < TOL
    x2, ild = b.inverse_and_log_det(y, WS)
    assert float(jnp.max(jnp.abs(x2 - xb))) < 1e-10
    assert float(jnp.max(jnp.abs(ild + ref))) < TOL
    assert float(jnp.max(jnp.abs(b.forward_log_det_jacobian(xb, WS) - ref))) < TOL
    assert float(jnp.max(jnp.abs(b.inverse_log_det_jacobian(y, WS) + ref))) < TOL
    assert float(jnp.max(jnp.abs(b.inverse(b.forward(xb, WS), WS) - xb))) < 1e-10
    # batch dimensions of any rank; a scalar event
    y2, ld2 = b.forward_and_log_det(xb.reshape(3, 1, N), WS)
    assert ld2.shape == (3, 1)
    s = jr.Bijector(lambda x: jnp.sinh(x) + x, event_ndims=0)
    _, lds = s.forward_and_log_det(jnp.linspace(-1, 1, 4))
    assert float(jnp.max(jnp.abs(lds - jnp.log(jnp.cosh(jnp.linspace(-1, 1, 4)) + 1)))) < TOL
    with pytest.raises(ValueError, match="event_ndims"):
        b.forward(jnp.float64(1.0), WS)
    # the state in another position, as for jr.reverse
    b1 = jr.Bijector(lambda ws, x: _flow(x, ws), argnums=1)
    _, ld1 = b1.forward_and_log_det(xb, WS)
    assert float(jnp.max(jnp.abs(ld1 - ref))) < TOL


def test_chain_is_distrax_order():
    f = jr.Bijector(lambda x: x * 2.0)
    g = jr.Bijector(lambda x: jnp.exp(x))
    c = jr.Chain([f, g])  # f(g(x)), as distrax.Chain
    x = jnp.linspace(-1, 1, 3)
    y, ld = c.forward_and_log_det(x)
    assert float(jnp.max(jnp.abs(y - 2.0 * jnp.exp(x)))) < 1e-14
    assert abs(float(ld - (3 * jnp.log(2.0) + jnp.sum(x)))) < TOL
    x2, ild = c.inverse_and_log_det(y)
    assert float(jnp.max(jnp.abs(x2 - x))) < 1e-14 and abs(float(ild + ld)) < TOL


def test_custom_inverse_logdet_rule_is_used():
    @jr.custom_inverse
    def f(x):
        return x + 0.5 * jnp.sin(x)

    @f.definverse
    def f_inv(y):
        return lax.fori_loop(
            0, 40, lambda i, x: x - (x + 0.5 * jnp.sin(x) - y) / (1 + 0.5 * jnp.cos(x)), y
        )

    x = jnp.linspace(-1, 1, 5)
    want = jnp.sum(jnp.log1p(0.5 * jnp.cos(x)))
    # without a rule: the custom function's own Jacobian (small: dense)
    assert abs(float(jr.forward_and_slogdet(f)(x)[1] - want)) < TOL
    calls = []

    def logdet(x):
        calls.append(1)
        return jnp.sum(jnp.log1p(0.5 * jnp.cos(x)))

    f.deflogdet(logdet)
    y, ld = jr.forward_and_slogdet(f)(x)
    assert calls and abs(float(ld - want)) < TOL
    x2, ild = jax.jit(jr.inverse_and_slogdet(f))(y)
    assert abs(float(ild + want)) < TOL and float(jnp.max(jnp.abs(x2 - x))) < 1e-10
    # batched by vmap around the custom function: summed over the batch
    _, ldb = jr.forward_and_slogdet(lambda xs: jax.vmap(f)(xs))(jnp.stack([x, x]))
    assert abs(float(ldb - 2 * want)) < TOL
    # a rule giving log|det| only: log|det| is the rule's, the sign comes from the sweep over
    # the tangent program
    assert jr.logdet_strategy(f, x) == (
        "sweep (log|det| only: a `deflogdet` rule returns no "
        "sign; the sign from the linearized sweep)"
    )
    sign, ld = jr.slogdet_jacobian(f, x)
    assert float(sign) == 1.0 and abs(float(ld - want)) < TOL


def test_register_logdet_for_a_new_primitive():
    from jax.extend.core import Primitive

    triple_p = Primitive("jaxrev_test_triple")
    triple_p.def_impl(lambda x: 3 * x)
    triple_p.def_abstract_eval(lambda a: a)
    jr.register_inverse(triple_p, lambda out, x: [out / 3])
    f = lambda x: triple_p.bind(x) + 1.0  # noqa: E731
    x = jnp.ones(4)
    # no rule: a small step's Jacobian is formed densely, which needs its JVP
    with pytest.raises(Exception):
        jr.slogdet_jacobian(f, x, method="sweep")
    jr.register_logdet(triple_p, lambda rec, out, x: (1.0, x.size * jnp.log(3.0)))
    sign, ld = jr.slogdet_jacobian(f, x, method="sweep")
    assert float(sign) == 1.0 and abs(float(ld - 4 * np.log(3.0))) < TOL


def test_singular_step_is_named():
    w = jnp.array([1.0, 0.0, 2.0])
    with pytest.raises(jr.SingularJacobianError) as e:
        jr.forward_and_slogdet(lambda x: x * w)(jnp.ones(3))  # the singular step
    assert "mul" in str(e.value) and HERE in str(e.value)
    sign, ld = jr.slogdet_jacobian(lambda x: x * w, jnp.ones(3), on_error="nan")
    assert float(sign) == 0.0 and float(ld) == -np.inf
    # a state-dependent pivot that vanishes when the program runs
    f = lambda x: jnp.cumsum(x**3)  # noqa: E731  (the line the errors name)
    line = f"{HERE}:{f.__code__.co_firstlineno}"
    with pytest.raises(jr.SingularJacobianError, match="integer_pow") as e:
        jr.forward_and_slogdet(f)(jnp.array([1.0, 0.0, 2.0]))
    assert line in str(e.value)
    # under jit the forward direction returns the exact answer, -inf, with no host check
    assert float(jax.jit(jr.forward_and_slogdet(f))(jnp.array([1.0, 0.0, 2.0]))[1]) == -np.inf
    xs = jnp.array([[1.0, 3.0, 2.0], [1.0, 0.0, 2.0]])
    _, ld = jax.vmap(jr.forward_and_slogdet(f, on_error="nan"))(xs)
    assert np.isfinite(float(ld[0])) and float(ld[1]) == -np.inf
    # the inverse has none there: an error when the program runs, naming the step, also
    # vmapped (one check for the batch)
    g = lambda x: x**3  # noqa: E731  (the line the errors name)
    line = f"{HERE}:{g.__code__.co_firstlineno}"
    ys = jnp.array([[1.0, 27.0, 8.0], [1.0, 0.0, 8.0]])
    with pytest.raises(Exception, match=f"singular.*`integer_pow` at .*{line}"):
        jax.block_until_ready(jax.jit(jr.inverse_and_slogdet(g))(ys[1]))
    with pytest.raises(Exception, match=f"`integer_pow` at .*{line}"):
        jax.block_until_ready(jax.jit(jax.vmap(jr.inverse_and_slogdet(g)))(ys))
    _, ild = jax.jit(jax.vmap(jr.inverse_and_slogdet(g, on_error="nan")))(ys)
    assert np.isfinite(float(ild[0])) and float(ild[1]) == np.inf


def test_linearized_sweep():
    """A triangular nonlinear recurrence `reverse` cannot invert (each element depends on the
    previous one through a nonlinearity): its tangent program inverts as a banded lump."""
    w = jnp.linspace(0.2, 1.0, 1500)

    def f(x):
        for _ in range(2):
            x = x.at[1:].add(jnp.tanh(w[1:] * x[:-1]))
            x = x * 1.1 + 0.1 * x**3
        return x

    x = jnp.linspace(-1, 1, 1500)
    assert jr.logdet_strategy(f, x) == "sweep (linearized)"
    sign, ld = jax.jit(lambda x: jr.slogdet_jacobian(f, x, method="sweep"))(x)
    ref = _dense(f, x)
    assert float(sign) == float(ref[0]) and abs(float(ld - ref[1])) < TOL * abs(float(ref[1]))
    _, ld2 = jr.forward_and_slogdet(f)(x)
    assert abs(float(ld2 - ref[1])) < TOL * abs(float(ref[1]))


def test_run_time_checks_are_one_per_call_under_vmap():
    """The singular-pivot check (and a choice's consistency check) call the host only when
    something is wrong, and under vmap once per batch: the compiled program has as many host
    callbacks for a batch of 64 as for one sample."""
    f = lambda x: jnp.where(x > 0, x, 0.1 * x) * 2.0  # noqa: E731

    def callbacks(fn, *args):
        return jax.jit(fn).lower(*args).as_text().count("callback")

    one = callbacks(jr.inverse_and_slogdet(f), jnp.ones(3))
    assert one >= 1
    assert callbacks(jax.vmap(jr.inverse_and_slogdet(f)), jnp.ones((64, 3))) == one
    assert callbacks(jax.vmap(jax.vmap(jr.inverse_and_slogdet(f))), jnp.ones((4, 8, 3))) == one
    _, ld = jax.jit(jax.vmap(jax.vmap(jr.inverse_and_slogdet(f))))(jnp.ones((4, 8, 3)))
    assert ld.shape == (4, 8)
    # the forward direction compiles no check at all
    assert callbacks(jax.vmap(jr.forward_and_slogdet(f)), jnp.ones((64, 3))) == 0


def test_dense_nonlinear_group_is_one_sweep_step():
    # a dense mixing the walker solves as one 40-unknown Newton group with no structure: the
    # sweep takes that one step's Jacobian densely
    A = jnp.eye(40) + 0.1 * jax.random.normal(KEY, (40, 40))
    f = lambda x: jnp.tanh(A @ x) * 0.5 + x  # noqa: E731  (a dense nonlinear group)
    x = jnp.linspace(-1, 1, 40)
    assert jr.logdet_strategy(f, x) == "sweep"
    ref = _dense(f, x)
    sign, ld = jr.slogdet_jacobian(f, x)
    assert float(sign) == float(ref[0]) and abs(float(ld - ref[1])) < TOL
    with pytest.raises(ValueError, match="method"):
        jr.slogdet_jacobian(f, x, method="lu")


def test_dense_fallback_names_the_step():
    # a 3x3 convolution: neither the program nor its tangent program inverts step by step
    K = jnp.zeros((3, 3, 2, 2)).at[1, 1].set(jnp.eye(2)) + 0.05 * jax.random.normal(
        KEY, (3, 3, 2, 2)
    )
    f = lambda x: lax.conv_general_dilated(  # noqa: E731
        x[None], K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )[0]
    x = jnp.linspace(-1, 1, 32).reshape(4, 4, 2)
    s = jr.logdet_strategy(f, x)
    assert s.startswith("dense:") and "conv_general_dilated" in s and f"{HERE}:" in s
    ref = _dense(lambda v: f(v.reshape(x.shape)).reshape(-1), x.reshape(-1))
    sign, ld = jr.slogdet_jacobian(f, x)  # "auto": the dense Jacobian
    assert float(sign) == float(ref[0]) and abs(float(ld - ref[1])) < TOL
    _, ld2 = jax.jit(jr.forward_and_slogdet(f))(x)
    assert abs(float(ld2 - ref[1])) < TOL
    with pytest.raises(jr.NotInvertibleError, match="conv_general_dilated"):
        jr.slogdet_jacobian(f, x, method="sweep")


def test_flax_conv_1x1():
    nn = pytest.importorskip("flax.linen")
    m = nn.Conv(3, (1, 1))
    x = jax.random.normal(KEY, (4, 4, 3))
    p = m.init(KEY, x[None])
    f = lambda x, p: m.apply(p, x[None])[0]  # noqa: E731
    assert jr.logdet_strategy(f, x, p) == "sweep"
    y, ld = jr.forward_and_slogdet(f)(x, p)
    ref = _dense(lambda v: f(v.reshape(x.shape), p).reshape(-1), x.reshape(-1))
    assert abs(float(ld - ref[1])) < TOL
    x2, _ = jr.inverse_and_slogdet(f)(y, p)
    assert float(jnp.max(jnp.abs(x2 - x))) < 1e-12


def test_shape_changing_bijection():
    """Glow's squeeze (space to depth) then a scale: a permutation with a sign to follow."""

    def squeeze(x):
        h, w, c = x.shape
        y = x.reshape(h // 2, 2, w // 2, 2, c).transpose(0, 2, 1, 3, 4)
        return y.reshape(h // 2, w // 2, 4 * c) * jnp.exp(jnp.linspace(-1, 2, 4 * c))

    x = jnp.linspace(-1, 1, 48).reshape(4, 4, 3)
    ref = _dense(lambda v: squeeze(v.reshape(x.shape)).reshape(-1), x.reshape(-1))
    sign, ld = jr.slogdet_jacobian(squeeze, x, method="sweep")
    assert float(sign) == float(ref[0]) and abs(float(ld - ref[1])) < TOL
    y, ld2 = jax.jit(jr.forward_and_slogdet(squeeze))(x)
    assert y.shape == (2, 2, 12) and abs(float(ld2 - ref[1])) < TOL


def test_a_3x3_conv_is_refused_naming_it():
    K = jnp.ones((3, 3, 2, 2)) * 0.1
    f = lambda x: lax.conv_general_dilated(  # noqa: E731
        x[None], K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )[0]
    x = jnp.ones((4, 4, 2))
    with pytest.raises(jr.NotInvertibleError, match="conv_general_dilated") as e:
        jr.reverse(f)(f(x))
    assert f"{HERE}:" in str(e.value) and "1x1" in str(e.value)


def test_integer_state_is_refused():
    with pytest.raises(TypeError, match="floating"):
        jr.slogdet_jacobian(lambda x: x + 1, jnp.arange(3))


def _scanned_layers(n, layers, reverse):
    """A stack of coupling layers scanned over stacked weights (flowjax's `Scan`)."""
    ws = jax.vmap(lambda k: _mlp_w(k, n // 2))(jax.random.split(jax.random.key(3), layers))

    def flow(x):
        def layer(x, w):
            x1, x2 = x[: n // 2], x[n // 2 :]
            h = w["b"] @ jnp.tanh(w["a"] @ x1)
            x2 = x2 * jnp.exp(0.5 * jnp.tanh(h[: n // 2])) + h[n // 2 :]
            return jnp.concatenate([x2, x1]), jnp.sum(x2)

        return lax.scan(layer, x, ws, reverse=reverse)

    return flow


@pytest.mark.parametrize("reverse", [False, True])
def test_forward_and_slogdet_runs_a_scan_of_layers_once(reverse):
    """The loop's log-det rule runs a scan of layers forward anyway, so its outputs are taken
    from that run: one loop in the program, not one for the outputs and another for the
    log-det (issue 44 item 3)."""
    n = 4
    flow = _scanned_layers(n, 5, reverse)
    x = jnp.linspace(-1.0, 1.0, n)
    fwd = jr.forward_and_slogdet(lambda x: flow(x)[0])
    jaxpr = jax.make_jaxpr(fwd)(x)
    assert sum(e.primitive.name == "scan" for e in jaxpr.eqns) == 1
    for call in (fwd, jax.jit(fwd)):
        y, logdet = call(x)
        np.testing.assert_array_equal(y, flow(x)[0])
        np.testing.assert_allclose(logdet, _dense(lambda x: flow(x)[0], x)[1], rtol=0, atol=TOL)


@pytest.mark.parametrize("reverse", [False, True])
def test_inverse_and_slogdet_takes_a_scan_of_layers_log_det_in_the_inverse_loop(reverse):
    """The inverse loop takes each iteration's log-det from its body's walk: one loop in the
    program (before, the loop ran forward again from the recovered input for its log-det),
    right against the dense Jacobian, eagerly, under jit and vmap (issue 44 item 3)."""
    n = 4
    flow = _scanned_layers(n, 5, reverse)
    f = lambda x: flow(x)[0]  # noqa: E731
    x = jnp.linspace(-1.0, 1.0, n)
    y = f(x)
    inv = jr.inverse_and_slogdet(f)
    assert sum(e.primitive.name == "scan" for e in jax.make_jaxpr(inv)(y).eqns) == 1
    want = -_dense(f, x)[1]
    for call in (inv, jax.jit(inv)):
        got_x, logdet = call(y)
        np.testing.assert_allclose(got_x, x, rtol=0, atol=1e-12)
        np.testing.assert_allclose(logdet, want, rtol=0, atol=TOL)
    xs = jnp.stack([x, 0.5 * x, -x])
    got_x, logdets = jax.vmap(inv)(jax.vmap(f)(xs))
    np.testing.assert_allclose(got_x, xs, rtol=0, atol=1e-12)
    np.testing.assert_allclose(logdets, [-_dense(f, a)[1] for a in xs], rtol=0, atol=TOL)


@pytest.mark.parametrize("third", [[0, 2, 1], [2, 0, 1]])
def test_a_permutation_per_layer_of_a_scan_keeps_the_sweeps_sign(third):
    """flowjax's `Scan` of layers carries each layer's permutation in the loop's `xs`: the
    body's permutation differs per iteration (one is odd, the other even), known at trace time
    all the same. The sweep follows the sign iteration by iteration (the loop's sign is their
    product) instead of taking it from a dense Jacobian (issue 44 item 3)."""
    n = 3
    perms = jnp.array([[2, 1, 0], [1, 2, 0], third])  # odd, even, then odd or even
    scales = jnp.array([[-1.5, 0.7, 2.0], [0.5, -2.0, 1.1], [1.2, 0.9, -0.4]])

    def f(x):
        def layer(x, p):
            perm, s = p
            x = x[perm]
            return x * s + 0.1 * jnp.tanh(jnp.roll(x, 1)) * (jnp.arange(n) == 0), None

        return lax.scan(layer, x, (perms, scales))[0]

    x = jnp.array([0.3, -0.7, 1.1])
    assert "dense" not in jr.logdet_strategy(f, x), jr.logdet_strategy(f, x)
    sign, logabs = jr.slogdet_jacobian(f, x)
    want_sign, want = _dense(f, x)
    assert sign == want_sign
    np.testing.assert_allclose(logabs, want, rtol=0, atol=TOL)
    y, ld = jr.forward_and_slogdet(f)(x)
    np.testing.assert_allclose(ld, want, rtol=0, atol=TOL)


def test_a_large_dense_fallback_warns_once_naming_why():
    """A log-determinant the sweep cannot give is taken from the dense Jacobian: right, but
    n forward passes and an LU; past 64 unknowns a `PerformanceWarning` says so once (issue 44
    item 3), naming the function and the step; `method="dense"`, asked for, does not warn."""
    K = jnp.zeros((3, 3, 2, 2)).at[1, 1].set(jnp.eye(2)) + 0.05 * jax.random.normal(
        KEY, (3, 3, 2, 2)
    )

    def conv(x):
        return lax.conv_general_dilated(
            x[None], K, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )[0]

    x = jnp.linspace(-1, 1, 128).reshape(8, 8, 2)
    with pytest.warns(jr.PerformanceWarning, match=r"conv.*128 unknowns.*conv_general_dilated"):
        jr.slogdet_jacobian(conv, x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jr.PerformanceWarning)
        jr.slogdet_jacobian(conv, x)  # (once)
        jr.slogdet_jacobian(conv, x, method="dense")
        small = jnp.linspace(-1, 1, 32).reshape(4, 4, 2)
        jr.slogdet_jacobian(conv, small)  # (below the size)


def test_a_spline_binned_by_a_one_hot_mask_inverts_by_one_piece_search():
    """distrax's bin search (a one-hot mask over bins from ``x >= x_pos[:-1]`` and
    ``x < x_pos[1:]``, multiplied into the knot table) has no index to enumerate: its
    comparisons with the knots are decided together by the piece the state lies in, found by
    one search (`choices._Piece`). Inside the knots, on them (where the ratio's clip saturates
    at the piece's end: no ambiguity) and on both linear tails; eager, `jit` and `vmap`; the
    log-det against the dense Jacobian's."""
    xs = jnp.array([-3.0, -1.0, 0.5, 3.0])
    ys = jnp.array([-3.0, -0.5, 1.0, 3.0])
    d = jnp.array([1.0, 0.7, 1.6, 1.0])
    f = jax.vmap(lambda x: one_hot_spline(x, xs, ys, d))
    x = jnp.array([-4.0, -3.0, -1.2, -1.0, 0.3, 0.5, 2.5, 3.0, 5.0])
    y = f(x)
    for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
        np.testing.assert_allclose(inv(y), x, rtol=1e-12, atol=1e-12)
    batch = jnp.stack([x, x[::-1] * 0.9])
    np.testing.assert_allclose(
        jax.vmap(jr.reverse(f))(jax.vmap(f)(batch)), batch, rtol=1e-12, atol=1e-12
    )
    xr, ld = jax.jit(jr.inverse_and_slogdet(f))(y)
    np.testing.assert_allclose(xr, x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, -_dense(f, x)[1], rtol=1e-10)


def test_a_one_hot_spline_that_is_not_monotone_is_refused_naming_its_comparison():
    """A knot table out of order: the piece search cannot show the map one-to-one, and says
    so where it runs (eagerly; under `jit` by `jr.raise_runtime_errors`), naming the
    comparison's line; with ``on_error="nan"``, NaN there and the answer elsewhere."""
    xs = jnp.array([-3.0, -1.0, 0.5, 3.0])
    ys = jnp.array([-3.0, 1.5, 1.0, 3.0])  # (falls on the second bin)
    d = jnp.array([1.0, 0.7, 1.6, 1.0])
    f = jax.vmap(lambda x: one_hot_spline(x, xs, ys, d))
    x = jnp.array([-2.0, 0.0, 2.0])
    line = marker_line(splines.__file__, "one-hot bins")
    with pytest.raises(jr.ReversibilityError, match=f"at .*splines.py:{line}"):
        jr.reverse(f)(f(x))
    with pytest.raises(jr.ReversibilityError, match=f"at .*splines.py:{line}"):
        with jr.raise_runtime_errors():
            jax.jit(jr.reverse(f))(f(x)).block_until_ready()
    got = jr.reverse(f, on_error="nan")(f(x))
    assert bool(jnp.all(jnp.isnan(got) | (jnp.abs(got - x) < 1e-12)))
    assert bool(jnp.any(jnp.isnan(got)))


def test_a_flat_branch_after_a_one_hot_spline_is_still_refused_where_it_loses_the_state():
    """A relu after the spline: its zero branch loses the state on an interval inside a
    piece, which no knot explains; an output it could have made is refused (not one
    preimage of many picked), while positive outputs invert."""
    xs = jnp.array([-3.0, -1.0, 0.5, 3.0])
    ys = jnp.array([-3.0, -0.5, 1.0, 3.0])
    d = jnp.array([1.0, 0.7, 1.6, 1.0])
    f = jax.vmap(lambda x: jax.nn.relu(one_hot_spline(x, xs, ys, d) - 0.25))
    x = jnp.array([0.3, 2.0])
    np.testing.assert_allclose(jr.reverse(f)(f(x)), x, rtol=1e-12, atol=1e-12)
    with pytest.raises(jr.JaxrevError):
        jr.reverse(f)(f(jnp.array([-2.0, 2.0])))


def test_a_one_hot_spline_clipped_to_its_range_is_refused_at_the_range_end():
    """Tails clipped to the spline's range (as flowjax clips its spline's output): every input
    below the first knot gives the first knot's value. The output at that knot is made by the
    clip's saturated branch on the whole tail, where the piece is dead, so the knot's
    exemption for the bin ratio's own clip (`_Point.knot`) does not apply: it is refused, as
    flowjax's clip at its interval's end is; outputs inside the range invert."""
    xs = jnp.array([-3.0, -1.0, 0.5, 3.0])
    ys = jnp.array([-3.0, -0.5, 1.0, 3.0])
    d = jnp.array([1.0, 0.7, 1.6, 1.0])
    f = jax.vmap(lambda x: jnp.clip(one_hot_spline(x, xs, ys, d), ys[0], ys[-1]))
    x = jnp.array([-1.2, 0.3, 2.5])
    np.testing.assert_allclose(jr.reverse(f)(f(x)), x, rtol=1e-12, atol=1e-12)
    with pytest.raises(jr.JaxrevError):
        jr.reverse(f)(f(jnp.array([-4.0, 0.3, 2.5])))
    got = jr.reverse(f, on_error="nan")(f(jnp.array([-4.0, 0.3, 2.5])))
    assert bool(jnp.isnan(got[0])) and bool(jnp.all(jnp.abs(got[1:] - x[1:]) < 1e-12))
