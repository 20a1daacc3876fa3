"""Edge inputs behave as in JAX (issue 46, docs/design.md §1 "Edge inputs"): integers inverted
exactly or refused, NaN and inf per element, the user's line named also for a library function
passed as it is, and a property test over dtypes, shapes and special values for every public
transform: each result right against JAX's own (or the map's known inverse), or an error
jaxrev names, never a silent wrong value nor an error from JAX's internals."""

import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jaxrev as jr

HERE = re.escape(__file__.rsplit("/", 1)[-1])

# --------------------------------------------------------------------------- integers


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x + 3,
        lambda x: 7 - x,
        lambda x: -x,
        lambda x: (x + 3) ^ 5,
        lambda x: ~x,
        lambda x: -1 * x + 2,
        lambda x: x << 2,
        lambda x: 3 * x + 5,
        lambda x: x**3,
        lambda x: x.astype(jnp.int8).astype(jnp.int32),
    ],
    ids=["add", "sub", "neg", "xor", "not", "mul-1", "shl", "mul3", "cube", "int8"],
)
def test_integer_steps_invert_exactly(f):
    x = jnp.array([3, -4, 7, 0], jnp.int32)
    inv = jr.reverse(f)
    for run in (inv, jr.jit(inv)):
        got = run(f(x))
        assert got.dtype == x.dtype and np.array_equal(got, x)


def test_integer_product_outside_its_image_raises_eagerly_and_under_jit():
    """The issue's silent wrong inverse: 2 * x = [3, 4] has no integer preimage."""
    inv = jr.reverse(lambda x: 2 * x)
    for run in (inv, jr.jit(inv)):
        with pytest.raises(
            jr.ReversibilityError, match=rf"image.*element \(0,\).*`mul` at .*{HERE}"
        ):
            run(jnp.array([3, 4]))
    assert np.array_equal(inv(jnp.array([4, 6])), [2, 3])
    # an integer has no NaN to show the failure: on_error="nan" raises too
    with pytest.raises(jr.ReversibilityError, match="`mul`"):
        jr.reverse(lambda x: 2 * x, on_error="nan")(jnp.array([3, 4]))
    with pytest.raises(jr.ReversibilityError, match="`mul`"):
        jr.jit(jax.vmap(inv))(jnp.array([4, 3]))


@pytest.mark.parametrize(
    "f, prim",
    [
        (lambda x: x // 2, "div"),
        (lambda x: x >> 1, "shift_right_arithmetic"),
        (lambda x: (x.astype(jnp.float64) * 0.5).astype(jnp.int32), "convert_element_type"),
        (lambda x: x**2, "integer_pow"),
    ],
    ids=["floordiv", "shr", "float-int", "square"],
)
def test_lossy_integer_steps_are_refused_by_name(f, prim):
    with pytest.raises(jr.NotInvertibleError, match=rf"`{prim}` at .*{HERE}"):
        jr.reverse(f)(f(jnp.array([4, 6], jnp.int32)))


def test_under_vmap_an_error_names_the_sample_and_its_element():
    """A per-element check under `vmap` runs once per batch with the first bad sample's flags:
    its message names that sample beside the element (it named the element alone, ambiguous
    across the batch), eagerly and compiled, nested `vmap`s included."""
    y = jnp.array([[4, 6], [8, 3]])
    f = jax.vmap(jr.reverse(lambda x: 2 * x))
    for call in (f, jr.jit(f)):
        with pytest.raises(jr.ReversibilityError, match=r"element \(1,\) of sample \(1,\)"):
            call(y)
    with pytest.raises(jr.ReversibilityError, match=r"at sample \(1, 1\) of the vmapped"):
        jax.vmap(jax.vmap(jr.reverse(lambda x: 2 * x)))(y)


def test_a_narrowing_cast_checks_its_image():
    via_int8 = jr.reverse(lambda x: x.astype(jnp.int8).astype(jnp.int32))
    with pytest.raises(jr.ReversibilityError, match="narrowing cast"):
        via_int8(jnp.array([300], jnp.int32))


# --------------------------------------------------------------------------- NaN, inf, singular


def test_newton_group_fails_per_element_and_names_the_element():
    f = lambda x: x - jnp.sin(x)  # noqa: E731  (singular at 0)
    y = jnp.array([0.5, 0.0])
    with pytest.raises(jr.SingularJacobianError, match=rf"element \(1,\).*`sin` at .*{HERE}"):
        jr.reverse(f)(y)
    got = jr.reverse(f, on_error="nan")(y)
    assert np.isnan(got[1]) and abs(float(f(got[0])) - 0.5) < 1e-12


def test_a_nan_input_is_named_as_the_cause_not_the_solver():
    f = lambda x: x + 0.5 * jnp.sin(x)  # noqa: E731
    with pytest.raises(jr.ReversibilityError, match=r"not finite.*element \(1,\).*the input"):
        jr.reverse(f)(jnp.array([0.5, jnp.nan]))
    got = jr.reverse(f, on_error="nan")(jnp.array([0.5, jnp.inf]))
    assert np.isfinite(got[0]) and np.isnan(got[1])


# ------------------------------------------------- reversible: the forward run's own NaN and inf


def _newton_loop(x):  # each step's inverse is a Newton group per element
    return jax.lax.fori_loop(0, 100, lambda i, x: x + 0.01 * jnp.tanh(x), x)


def _coupled_scan(x):  # x[0] NaN makes the other stream's x[2] NaN in the forward run too
    def body(carry, _):
        a, b = carry
        a = a + jnp.tanh(0.9 * b)
        return (a, b + jnp.sin(1.1 * a)), None

    return jax.lax.scan(body, (x[:2], x[2:]), None, length=50)[0]


def _summed(f):
    return lambda x: sum(jnp.sum(leaf) for leaf in jax.tree.leaves(f(x)))


@pytest.mark.parametrize("special", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("program", [_newton_loop, _coupled_scan], ids=["newton", "coupled"])
def test_reversible_at_nan_and_inf_inputs_gives_jax_grads_gradient(program, special):
    """A NaN or an infinity the forward run itself holds is not drift (issue 43 item 6): the
    default's gradient is jax.grad's, NaN where jax.grad's is NaN, eagerly and under jit (an
    eager call raised JAX's runtime error, blaming Newton's method for the input)."""
    x = jnp.array([special, 1.0, 0.3, -0.5])
    want = jax.grad(_summed(program))(x)
    grad = jax.grad(_summed(jr.reversible(program)))
    for got in (grad(x), jax.jit(grad)(x)):
        np.testing.assert_allclose(got, want, rtol=1e-10, equal_nan=True)
    got32 = grad(x.astype(jnp.float32))
    want32 = jax.grad(_summed(program))(x.astype(jnp.float32))
    np.testing.assert_array_equal(np.isnan(got32), np.isnan(want32))


def test_reversible_at_a_superattracting_fixed_point_gives_jax_grads_gradient():
    """x + sin(2x)/2 sits on pi/2, where its derivative vanishes: the backward run's Newton
    step is singular there. Under the repairing default that is drift like any other (the
    segment is recomputed) and the gradient is jax.grad's; `reverse`, which has nothing to
    repair from, names the singular step, eagerly on every call (its first call, uncompiled,
    runs the loop compiled all the same: JAX's runtime error is converted)."""
    f = lambda x: jax.lax.fori_loop(0, 20, lambda i, x: x + 0.5 * jnp.sin(2 * x), x)  # noqa: E731
    x = jnp.array([np.pi / 2, 0.3])
    want = jax.grad(_summed(f))(x)
    got = jax.grad(_summed(jr.reversible(f)))(x)
    np.testing.assert_allclose(got, want, atol=1e-12)
    for _ in range(2):  # the first call eager, the second compiled
        with pytest.raises(jr.SingularJacobianError, match=rf"element \(0,\).*`mul` at .*{HERE}"):
            jr.reverse(f)(f(x))


def test_log_determinants_at_nan_points_are_nan():
    f = lambda x: 2.0 * x + 1.0  # noqa: E731  (pivots that do not read the point)
    p = jnp.array([jnp.nan, 1.0])
    x, ld = jr.inverse_and_slogdet(f)(p)
    assert np.isnan(x[0]) and x[1] == 0 and np.isnan(ld)
    assert np.isnan(jr.forward_and_slogdet(f)(p)[1])
    assert np.isnan(jr.slogdet_jacobian(f, p)[1])
    # per sample under vmap
    _, lds = jax.vmap(jr.inverse_and_slogdet(f))(jnp.stack([p, jnp.ones(2)]))
    assert np.isnan(lds[0]) and np.isclose(lds[1], -2 * np.log(2.0))


# --------------------------------------------------------------------------- lines, regressions


@pytest.mark.parametrize("fun, prim", [(jnp.sin, "sin"), (jnp.sort, "sort")])
def test_a_library_function_passed_as_it_is_names_the_users_call(fun, prim):
    with pytest.raises(jr.NotInvertibleError, match=rf"`{prim}` at .*{HERE}:\d+") as e:
        jr.reverse(fun)(jnp.array([2.0, 1.0]))
    assert e.value.file.endswith("test_edge_inputs.py") and e.value.line is not None


def test_a_run_time_check_names_the_users_call_of_a_library_function():
    with pytest.raises(jr.NotInvertibleError, match=rf"`pow` at .*{HERE}"):
        jr.jit(jr.reverse(jnp.power, argnums=1))(jnp.array(1.0), jnp.array(3.0))


def test_pow_exponent_inverts_under_jit_and_vmap():
    """A regression: the check on the base took a Python bool of a traced value."""
    inv = jr.reverse(lambda x: 2.0**x)
    assert np.isclose(jax.jit(inv)(8.0), 3.0)
    assert np.allclose(jax.vmap(inv)(jnp.array([8.0, 0.25])), [3.0, -2.0])


def test_bijector_under_jit_grad_with_closed_over_parameters():
    """A regression: the eager re-run of a failed sample took a Python bool of values traced
    through the function's closure (the usual way to train a flow)."""

    def coupling(x, ps):
        w, b = ps
        a, c = x[..., :2], x[..., 2:]
        return jnp.concatenate([a, c * jnp.exp(jnp.tanh(a @ w + b)) + a @ w], -1)

    ps = (0.1 * jnp.ones((2, 2)), jnp.zeros(2))
    ys = jax.random.normal(jax.random.key(0), (8, 4))

    def nll(ps):
        x, ld = jr.Bijector(lambda x: coupling(x, ps)).inverse_and_log_det(ys)
        return -(jnp.sum(-0.5 * x**2) + jnp.sum(ld))

    def dense(ps):
        inv = lambda y: jr.reverse(lambda x: coupling(x, ps))(y)  # noqa: E731
        x = jax.vmap(inv)(ys)
        ld = jax.vmap(lambda y: jnp.linalg.slogdet(jax.jacfwd(inv)(y))[1])(ys)
        return -(jnp.sum(-0.5 * x**2) + jnp.sum(ld))

    want = jax.grad(dense)(ps)
    for got in (jax.jit(jax.grad(nll))(ps), jax.grad(nll)(ps)):
        for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_allclose(g, w, rtol=1e-10)


# --------------------------------------------------------------------------- property test

DTYPES = ["int32", "bool", "float16", "bfloat16", "float32", "float64", "complex64"]
SHAPES = [None, (), (0,), (3,), (2, 0), (2, 3)]  # None: a Python scalar


def _bisect_tanh_step(y):
    """The inverse of u + 0.3 tanh(u) (increasing, |u - y| <= 0.3) in float64, per element;
    inf to inf and NaN to NaN, as the map sends them."""
    lo, hi = y - 0.3, y + 0.3
    for _ in range(80):
        mid = 0.5 * (lo + hi)
        low = mid + 0.3 * np.tanh(mid) < y
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    return np.where(np.isfinite(y), 0.5 * (lo + hi), y)


def _cumsum(x):
    return jnp.cumsum(x, axis=-1)


def _cumsum_inverse(y):
    # the first differences, as the reference: inf - inf is NaN there as in any inverse
    return np.concatenate([y[..., :1], y[..., 1:] - y[..., :-1]], axis=-1)


def _conj_step_inverse(y):
    if np.iscomplexobj(y):
        return np.real(y) / 1.5 + 1j * (np.imag(y) / 0.5)
    return y / 1.5


# one step of a drawn program: the map, its reference inverse (float64 NumPy for inexact
# dtypes, the dtype's own exact arithmetic for integers and booleans) and the log of its
# derivative per element at the step's input (0 for a unit-triangular step); `last_axis` steps
# need an array of at least one axis
STEPS = {
    "inexact": {
        "affine": (lambda x: 2 * x + 1, lambda y: (y - 1) / 2, lambda u: np.log(2.0) + 0 * u),
        "shrink": (lambda x: 0.5 * x - 3, lambda y: (y + 3) * 2, lambda u: np.log(0.5) + 0 * u),
        "tanh": (
            lambda x: x + 0.3 * jnp.tanh(x),
            _bisect_tanh_step,
            lambda u: np.log1p(0.3 / np.cosh(u) ** 2),
        ),
        "cumsum": (_cumsum, _cumsum_inverse, lambda u: 0 * u),
        # linear over the reals only for complex values (1.5 re x + 0.5 i im x)
        "conj": (
            lambda x: x + 0.5 * jnp.conj(x),
            _conj_step_inverse,
            lambda u: np.log(1.5) + 0 * u,
        ),
    },
    "int32": {
        "affine": (lambda x: (3 * x + 5) ^ 9, lambda y: ((y ^ 9) - 5) // 3, None),
        "add": (lambda x: x + 7, lambda y: y - 7, None),
        "neg": (lambda x: -x, lambda y: -y, None),
        "xor": (lambda x: x ^ 5, lambda y: y ^ 5, None),
        "cumsum": (_cumsum, lambda y: jnp.diff(y, axis=-1, prepend=0), None),
    },
    "bool": {
        "not": (lambda x: ~x, lambda y: ~y, None),
        "xor": (lambda x: x ^ True, lambda y: y ^ True, None),
    },
}
REAL_ONLY = {"tanh"}  # (no bracketing reference inverse for complex values)
LAST_AXIS = {"cumsum"}


def _draw_program(dtype, ndim, draw):
    """A random composition of 1 to 3 steps of the dtype: (f, its reference inverse, the
    log|det| of f's Jacobian at a point as float64, None for exact dtypes)."""
    family = dtype if dtype in ("int32", "bool") else "inexact"
    names = [
        n
        for n in STEPS[family]
        if not (n in LAST_AXIS and ndim == 0) and not (n in REAL_ONLY and dtype == "complex64")
    ]
    steps = [
        STEPS[family][n] for n in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3))
    ]

    def f(x):
        for step, _, _ in steps:
            x = step(x)
        return x

    def f_inv(y):
        if family != "inexact":
            for _, inverse, _ in reversed(steps):
                y = inverse(y)
            return y
        y = np.asarray(y, np.complex128 if dtype == "complex64" else np.float64)
        for _, inverse, _ in reversed(steps):
            y = inverse(y)
        return y

    def logdet(x):
        if family != "inexact":
            return None
        u, total = np.asarray(x, np.float64), 0.0
        for step, _, dlog in steps:
            total = total + np.sum(dlog(u))
            u = np.asarray(step(jnp.asarray(u)), np.float64)
        return total

    return f, f_inv, logdet


def _point(dtype, shape, special, draw):
    if shape is None:  # a Python scalar
        if dtype in ("bool", "complex64", "float16", "bfloat16"):
            shape = ()
        else:
            v = draw(st.integers(-50, 50))
            return float(v) if dtype.startswith("float") else int(v)
    n = int(np.prod(shape))
    vals = np.asarray(draw(st.lists(st.integers(-50, 50), min_size=n, max_size=n)))
    vals = vals.reshape(shape)
    if dtype == "bool":
        return jnp.asarray(vals % 2 == 0)
    x = jnp.asarray(vals, dtype)
    if special and n and jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.reshape(-1).at[draw(st.integers(0, n - 1))].set(special).reshape(shape)
    return x


def _named(e: Exception) -> bool:
    """An error jaxrev names: its own class (`jr.DtypeError` for a tangent or a log-det of a
    dtype that has none), never one from JAX's or NumPy's internals."""
    return isinstance(e, jr.JaxrevError)


# a few units of the dtype's epsilon: rounding through up to three steps and their inverses
TOLERANCES = {
    "float16": 8e-3,
    "bfloat16": 6e-2,
    "float32": 1e-5,
    "complex64": 1e-5,
    "float64": 1e-11,
    "float64-solve": 1e-8,  # a solver's answer (its rtol), not a rounding
}


def _close(got, want, dtype, special=False):
    """`got` equals `want` to the dtype's rounding, relative to the largest finite magnitude
    (an inverse's differences cancel); exactly for integers and booleans. At a NaN or inf
    input (`special`) an element whose reference is finite may also be NaN (a coupled solve
    poisons its outputs, as JAX's own solves do) and one whose reference is not finite must
    not be finite."""
    got = np.asarray(got).astype(np.complex128) if dtype not in ("int32", "bool") else got
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    if dtype in ("int32", "bool"):
        assert np.array_equal(got, want)
        return
    want = want.astype(np.complex128)
    fin = np.isfinite(want)
    scale = max([1.0] + [float(np.max(np.abs(a[np.isfinite(a)]), initial=0)) for a in (got, want)])
    tol = TOLERANCES[dtype]
    if special:
        assert not np.any(np.isfinite(got[~fin])), (got, want)
        keep = fin & ~np.isnan(got)
        got, want = got[keep], want[keep]
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


TRANSFORMS = [
    "reverse",
    "reverse_jit",
    "grad",
    "inverse_jvp",
    "inverse_vjp",
    "slogdet",
    "forward_and_slogdet",
    "inverse_and_slogdet",
    "bijector",
    "root",
    "minimize",
]


def _check(transform, dtype, x, program):
    f, f_inv, logdet = program
    y = f(x)
    special = dtype not in ("int32", "bool") and not np.all(np.isfinite(np.asarray(x, complex)))
    nan_in = special and bool(np.any(np.isnan(np.asarray(x, np.complex128))))
    real = dtype.startswith("float") or dtype == "bfloat16"
    if transform == "reverse":
        _close(jr.reverse(f)(y), f_inv(y), dtype, special)
    elif transform == "reverse_jit":
        _close(jr.jit(jr.reverse(f))(y), f_inv(y), dtype, special)
    elif transform == "grad":
        want = jax.grad(lambda x: jnp.sum(f(x)).real)(x)
        _close(jax.grad(lambda x: jnp.sum(jr.reversible(f)(x)).real)(x), want, dtype, special)
    elif transform == "inverse_jvp":
        # the tangent returned is the preimage of t under the Jacobian: f's JVP maps it to t
        t = jnp.ones_like(jnp.asarray(x))
        yo, (tx,) = jr.inverse_jvp(f, (x,), t)
        _close(yo, y, dtype, special)
        if not special:
            _close(jax.jvp(f, (x,), (tx,))[1], t, dtype)
    elif transform == "inverse_vjp":
        yo, pull = jr.inverse_vjp(f, x)
        ct = jnp.ones_like(jnp.asarray(x))
        w = pull((ct,))
        w = w[0] if isinstance(w, tuple) else w
        _close(yo, y, dtype, special)
        if not special:
            _close(jax.vjp(f, x)[1](w)[0], ct, dtype)
    elif transform in ("root", "minimize"):
        # never a wrong "converged": a status 0 answer is the solution to the dtype's precision
        if transform == "root":
            got, info = jr.optim.root(lambda z: z**3 + z - 2.0, x, throw=False)
        else:
            got, info = jr.optim.minimize(lambda z: jnp.sum(jnp.abs(z - 1.0) ** 2), x, throw=False)
        if int(info.status) == 0:
            _close(got, np.ones(np.shape(x)), dtype if dtype != "float64" else "float64-solve")
    else:
        if not real:  # no log-det exists: the call must raise (checked by the caller)
            {
                "slogdet": lambda: jr.slogdet_jacobian(f, x),
                "forward_and_slogdet": lambda: jr.forward_and_slogdet(f)(x),
                "inverse_and_slogdet": lambda: jr.inverse_and_slogdet(f)(y),
                "bijector": lambda: jr.Bijector(f, event_ndims=np.ndim(x)).inverse_and_log_det(y),
            }[transform]()
            return "gave a log-det"
        ld = logdet(x)
        if transform == "slogdet":
            sign, got = jr.slogdet_jacobian(f, x)
            _close(sign, np.nan if nan_in else 1.0, dtype)
        elif transform == "forward_and_slogdet":
            yo, got = jr.forward_and_slogdet(f)(x)
            _close(yo, y, dtype, special)
        elif transform == "inverse_and_slogdet":
            xo, got = jr.inverse_and_slogdet(f)(y)
            ld = -ld
            _close(xo, f_inv(y), dtype, special)
        else:  # bijector
            xo, got = jr.Bijector(f, event_ndims=np.ndim(x)).inverse_and_log_det(y)
            ld = -ld
            _close(xo, f_inv(y), dtype, special)
        if nan_in:
            assert np.isnan(np.asarray(got, np.float64)), got  # a NaN point's log-det is NaN
        elif not special:
            _close(got, ld, dtype)
    return "ok"


@settings(
    max_examples=int(os.environ.get("JAXREV_EDGE_EXAMPLES", "100")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)
@given(st.data())
def test_every_transform_on_edge_inputs_is_right_or_names_its_refusal(data):
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    shape = data.draw(st.sampled_from(SHAPES), label="shape")
    special = data.draw(st.sampled_from([None, jnp.nan, jnp.inf, -jnp.inf]), label="special")
    transform = data.draw(st.sampled_from(TRANSFORMS), label="transform")
    x = _point(dtype, shape, special, data.draw)
    program = _draw_program(dtype, np.ndim(x), data.draw)
    exact = dtype in ("int32", "bool")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            outcome = _check(transform, dtype, x, program)
        except Exception as e:  # noqa: BLE001  (the property: which errors may come out)
            if transform == "grad" and exact and isinstance(e, TypeError):
                return  # jax.grad itself refuses integer and boolean inputs
            assert _named(e), f"{transform} on {dtype}{np.shape(x)}: {type(e).__name__}: {e}"
            return
    # a log-det of an exact or complex dtype does not exist: it must have been refused
    assert outcome == "ok", f"{transform} on {dtype} gave a log-det without refusing"


@pytest.mark.parametrize(
    "call, what",
    [
        (lambda x: jr.inverse_jvp(lambda x: x + 7, (x,), x), "inverse_jvp.*no tangents"),
        (lambda x: jr.inverse_vjp(lambda x: x + 7, x), "inverse_vjp.*no tangents"),
        (lambda x: jr.slogdet_jacobian(lambda x: x + 7, x), "slogdet_jacobian.*no Jacobian"),
        (lambda x: jr.inverse_and_slogdet(lambda x: x + 7)(x), "inverse_and_slogdet"),
        (lambda x: jr.Bijector(lambda x: x + 7).inverse_and_log_det(x), "no Jacobian"),
    ],
)
def test_integer_tangents_and_log_dets_say_they_do_not_exist(call, what):
    """A `jr.DtypeError` (also a `TypeError`, as JAX's dtype refusals are) naming the
    transform, the dtype and the user's call."""
    with pytest.raises(jr.DtypeError, match=f"{what}|called at .*{HERE}") as info:
        call(jnp.arange(3))
    assert re.search(what, str(info.value)) and re.search(f"called at .*{HERE}", str(info.value))
    assert "int32" in str(info.value) or "int64" in str(info.value)


# --------------------------------------------------------------------------- complex

_P = np.array([[0, 1, 0], [0, 0, 1], [1, 0, 0]])


@pytest.mark.parametrize(
    "f",
    [
        lambda x: x + 0.5 * jnp.conj(x),  # elementwise
        lambda x: x + 0.5 * jnp.cumsum(jnp.conj(x)),  # triangular
        lambda x: x + 0.5 * jnp.conj(x[::-1]),
        lambda x: x + 0.5 * jnp.conj(jnp.asarray(_P, x.dtype) @ x),  # one dense group
        lambda x: x + 0.5j * jnp.imag(jnp.cumsum(x)),
        # JAX 0.12.1 writes `0.5j * real` so: a factor zero whose product comes forward
        lambda x: x + jax.lax.complex(0.0 * jnp.imag(x), 0.5 * jnp.imag(jnp.cumsum(x))),
    ],
)
def test_complex_groups_linear_over_the_reals_only_invert(f):
    """A complex group through conj, real or imag is not one complex matrix: it was solved
    with the holomorphic Jacobian (conj's derivative taken as 1) and returned a wrong inverse,
    1.3 off, with no error. It is solved as the real system of twice the size."""
    x = jnp.array([1 + 2j, 0.5 - 1j, 2 + 0.3j])
    for inverse in (jr.reverse(f), jax.jit(jr.reverse(f))):
        np.testing.assert_allclose(inverse(f(x)), x, atol=1e-12)
    t = jnp.array([1 + 1j, 2.0, 1j])
    _, (tx,) = jr.inverse_jvp(f, (x,), t)
    np.testing.assert_allclose(jax.jvp(f, (x,), (tx,))[1], t, atol=1e-12)


def test_a_complex_group_singular_over_the_reals_is_refused():
    with pytest.raises(jr.NotInvertibleError, match=f"add.*{HERE}.*singular linear map"):
        jr.reverse(lambda x: x + jnp.conj(x))(jnp.array([1 + 2j, 3.0]))


def _round_trip(f, x, how):
    """`reverse(f)` gives `x` back from `f(x)` (returned), eagerly, under `jit` or `vmap`."""
    y = f(x)
    inverse = {
        "eager": jr.reverse(f),
        "jit": jax.jit(jr.reverse(f)),
        "vmap": jax.vmap(jr.reverse(f)),
    }
    got = inverse[how](jnp.stack([y, 2 * y]))[1] / 2 if how == "vmap" else inverse[how](y)
    np.testing.assert_allclose(got, x, atol=1e-12)
    return y


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
@pytest.mark.parametrize(
    "f",
    [
        jnp.fft.fft,
        lambda x: jnp.fft.ifft(x * jnp.arange(1, 7)),
        lambda x: jnp.fft.fft2(x.reshape(2, 3)).ravel(),
    ],
)
def test_complex_ffts_invert_by_the_opposite_fft(f, how):
    x = jnp.asarray(np.random.default_rng(0).standard_normal(6) + 1j * np.arange(6.0))
    _round_trip(f, x, how)
    t = jnp.asarray(np.arange(6.0) - 1j)
    _, (tx,) = jr.inverse_jvp(f, (x,), t)
    np.testing.assert_allclose(jax.jvp(f, (x,), (tx,))[1], t, atol=1e-12)


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
@pytest.mark.parametrize(
    "f",
    [
        lambda x: jax.scipy.fft.dct(x, norm="ortho"),
        lambda x: jax.scipy.fft.idct(x, norm="ortho"),
        lambda x: jax.scipy.fft.dct(x),  # (no norm: not orthogonal)
        lambda x: jax.scipy.fft.idct(x[::-1], type=2, norm="ortho") * 2.0,
        lambda x: jax.scipy.fft.dct(x.reshape(2, 3), axis=0, norm="ortho").ravel(),
    ],
)
def test_discrete_cosine_transforms_invert_as_one_real_lump(f, how):
    """JAX writes a DCT as FFTs between real vectors, taking `real` and `imag` of complex
    intermediates (a real FFT, or a complex one of the real input, by JAX version): `real` alone
    loses the imaginary part, but the group from input to output is square over the reals and
    regular on the twiddle factors' values (computed from constants, also under `jit`)."""
    x = jnp.asarray(np.random.default_rng(1).standard_normal(6))
    y = _round_trip(f, x, how)
    sign, logdet = jnp.linalg.slogdet(jax.jacfwd(f)(x))
    np.testing.assert_allclose(jr.slogdet_jacobian(f, x)[1], logdet, atol=1e-12)
    _, ld = jr.inverse_and_slogdet(f)(y)
    np.testing.assert_allclose(ld, -logdet, atol=1e-12)


def test_a_real_part_that_loses_what_the_group_needs_is_refused_naming_it():
    """The real part of a real vector's FFT is symmetric (a cosine transform of both halves):
    the group is square but singular, and `real` is named, not solved into garbage."""
    with pytest.raises(jr.NotInvertibleError, match=f"`real` at .*{HERE}.*imaginary part"):
        jr.reverse(lambda x: jnp.real(jnp.fft.fft(x)))(jnp.arange(4.0))
    with pytest.raises(jr.NotInvertibleError, match=f"`fft` at .*{HERE}.*Nyquist"):
        # the fourth number is the zero frequency's imaginary part, which irfft drops
        jr.reverse(lambda x: jnp.fft.irfft(jax.lax.complex(x[:3], jnp.stack([x[3], 0.0, 0.0])), 4))(
            jnp.arange(4.0)
        )


# --------------------------------------------------------------------------- half precision

_W = np.array([[0.5, 0.2, 0.1], [0.1, 0.4, -0.3], [0.2, 0.0, 0.6]])
HALF_PROGRAMS = {
    # a coupled Newton group (its rank test and its dense solve)
    "newton": lambda x: x + 0.3 * jnp.tanh(jnp.asarray(_W, x.dtype) @ x),
    # a dense linear map (its inverse and log-det by a factorization)
    "matvec": lambda x: jnp.asarray(_W + 2 * np.eye(3), x.dtype) @ x,
    "vecmat": lambda x: x @ jnp.asarray(_W + 2 * np.eye(3), x.dtype),
}


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16", "complex128"])
def test_one_by_one_blocks_are_divisions_as_jnp_linalg_answers(dtype):
    """Batches of 1 x 1 systems (an elementwise Newton step) are divided, not LU-factored
    (one LAPACK call per matrix on CPU): the same answers as `jnp.linalg`, zero and negative
    pivots included."""
    from jaxrev import _dense

    a = jnp.array([2.0, -0.5, 0.0, 3.0]).astype(dtype).reshape(4, 1, 1)
    b = jnp.array([1.0, 2.0, 1.0, -6.0]).astype(dtype)
    want = jnp.linalg.solve(a.astype(_dense.solver_dtype(dtype)), b[:, None, None])
    got = _dense.solve(a, b[:, None, None])
    assert got.dtype == dtype and _dense.solve(a, b[:, None]).shape == (4, 1)
    keep = np.array([0, 1, 3])
    np.testing.assert_allclose(
        np.asarray(got[keep], np.complex128), np.asarray(want[keep], np.complex128), rtol=1e-2
    )
    assert not np.isfinite(complex(got[2, 0, 0]))
    sign, ld = _dense.slogdet(a)
    ws, wl = jnp.linalg.slogdet(a.astype(_dense.solver_dtype(dtype)))
    np.testing.assert_array_equal(np.asarray(sign, np.complex128), np.asarray(ws, np.complex128))
    np.testing.assert_allclose(np.asarray(ld, np.float64), np.asarray(wl, np.float64), rtol=1e-2)


@pytest.mark.parametrize("program", sorted(HALF_PROGRAMS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dense_solves_run_in_half_precision(dtype, program):
    """LAPACK and NumPy have no float16 / bfloat16 kernels (jaxlib's NotImplementedError, or
    NumPy's TypeError, came out of every transform): the dense factorizations run in float32
    and round back, so each transform answers in the dtype, near the float64 answer."""
    f = HALF_PROGRAMS[program]
    x64 = jnp.array([0.3, -0.2, 0.5])
    x = x64.astype(dtype)
    y = f(x)
    tol = TOLERANCES[dtype] * 2
    for got in (jr.reverse(f)(y), jr.jit(jr.reverse(f))(y), jr.inverse_and_slogdet(f)(y)[0]):
        assert got.dtype == dtype
        np.testing.assert_allclose(np.asarray(got, np.float64), x64, atol=tol)
    _, ld = jr.slogdet_jacobian(f, x)
    _, ld64 = jr.slogdet_jacobian(f, x64)
    assert ld.dtype == dtype
    np.testing.assert_allclose(float(ld), float(ld64), atol=tol * 4)
    _, (tx,) = jr.inverse_jvp(f, (x,), jnp.ones(3, dtype))
    _, (tx64,) = jr.inverse_jvp(f, (x64,), jnp.ones(3))
    np.testing.assert_allclose(np.asarray(tx, np.float64), tx64, atol=tol * 2)
    g = jax.grad(lambda x: jnp.sum(jr.reversible(f)(x)).astype(jnp.float32))(x)
    np.testing.assert_allclose(
        np.asarray(g, np.float64), jax.grad(lambda x: jnp.sum(f(x)))(x64), atol=tol * 4
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_optim_in_half_precision(dtype):
    x, info = jr.optim.root(lambda z: z**3 + z - 2.0, jnp.asarray(0.0, dtype))
    assert x.dtype == dtype and int(info.status) == 0
    np.testing.assert_allclose(float(x), 1.0, atol=TOLERANCES[dtype])
    x, info = jr.optim.minimize(lambda z: jnp.sum((z - 1.0) ** 2), jnp.zeros(3, dtype))
    assert x.dtype == dtype and int(info.status) == 0
    np.testing.assert_allclose(np.asarray(x, np.float64), 1.0, atol=TOLERANCES[dtype])
