"""Every bijection and flow constructor of the installed flowjax, built the way its users build
them (issue 32): `CASES` maps a name to ``make() -> (bijection, x, condition)``, where `x` lies
in the bijection's domain. Each case also appears inverted (`flowjax.bijections.Invert`), its
input then made by the library's own forward map so it lies in the inverse's domain.

Used by `tests/test_flowjax_all.py` (forward map alone → jaxrev's inverse and log-dets against
flowjax's own) and `benchmarks/flows_libraries.py`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flowjax.bijections as fb
import flowjax.flows as ff
import jax
import jax.numpy as jnp
from flowjax.distributions import Normal

D = 4
C = 2  # conditioning dimension


def _key(i: int) -> jax.Array:
    return jax.random.key(100 + i)


def _x(i: int, shape: tuple[int, ...] = (D,), scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(_key(i), shape)


def _cond() -> jax.Array:
    return jax.random.normal(_key(99), (C,))


def _perturbed(bij: Any, i: int = 7) -> Any:
    """The bijection with every float array moved off its initial value, so that a test cannot
    pass on an identity initialization (flowjax initialises many layers to the identity)."""
    leaves, tree = jax.tree_util.tree_flatten(bij)
    keys = jax.random.split(_key(i), len(leaves))
    out = [
        leaf + 0.3 * jax.random.normal(k, leaf.shape, leaf.dtype)
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)
        else leaf
        for leaf, k in zip(leaves, keys)
    ]
    return jax.tree_util.tree_unflatten(tree, out)


def _spline(knots: int = 5, interval: float = 3.0) -> Any:
    return fb.RationalQuadraticSpline(knots=knots, interval=interval)


def _base() -> Normal:
    return Normal(jnp.zeros(D))


Make = Callable[[], "tuple[Any, jax.Array, jax.Array | None]"]

CASES: dict[str, Make] = {
    # ------------------------------------------------------------ elementwise and linear maps
    "Affine": lambda: (fb.Affine(_x(1), jnp.exp(_x(2))), _x(3), None),
    "Loc": lambda: (fb.Loc(_x(1)), _x(3), None),
    "Scale": lambda: (fb.Scale(jnp.exp(_x(2))), _x(3), None),
    "TriangularAffine/lower": lambda: (
        fb.TriangularAffine(_x(1), jnp.eye(D) + 0.3 * _x(2, (D, D))),
        _x(3),
        None,
    ),
    "TriangularAffine/upper": lambda: (
        fb.TriangularAffine(_x(1), jnp.eye(D) + 0.3 * _x(2, (D, D)), lower=False),
        _x(3),
        None,
    ),
    "Exp": lambda: (fb.Exp((D,)), _x(3), None),
    "Tanh": lambda: (fb.Tanh((D,)), _x(3), None),
    "LeakyTanh": lambda: (fb.LeakyTanh(1.5, (D,)), _x(3, scale=2.0), None),
    "Sigmoid": lambda: (fb.Sigmoid((D,)), _x(3), None),
    "SoftPlus": lambda: (fb.SoftPlus((D,)), _x(3), None),
    "Power": lambda: (fb.Power(3.0, (D,)), jnp.abs(_x(3)) + 0.1, None),
    "Identity": lambda: (fb.Identity((D,)), _x(3), None),
    "Flip": lambda: (fb.Flip((D,)), _x(3), None),
    "Permute": lambda: (fb.Permute(jnp.array([2, 0, 3, 1])), _x(3), None),
    "Householder": lambda: (fb.Householder(_x(1)), _x(3), None),
    "DiscreteCosine": lambda: (fb.DiscreteCosine((D,)), _x(3), None),
    "Planar/tanh": lambda: (_perturbed(fb.Planar(_key(1), dim=D)), _x(3), None),
    "Planar/leaky_relu": lambda: (
        _perturbed(fb.Planar(_key(1), dim=D, negative_slope=0.2)),
        _x(3),
        None,
    ),
    "Planar/conditional": lambda: (
        _perturbed(fb.Planar(_key(1), dim=D, cond_dim=C, width_size=8, depth=1)),
        _x(3),
        _cond(),
    ),
    "RationalQuadraticSpline": lambda: (_perturbed(_spline()), jnp.asarray(1.3), None),
    "RationalQuadraticSpline/tail": lambda: (_perturbed(_spline()), jnp.asarray(-4.2), None),
    # ------------------------------------------------------------ conditioners
    "Coupling/affine": lambda: (
        _perturbed(
            fb.Coupling(
                _key(1), transformer=fb.Affine(), untransformed_dim=2, dim=D, nn_width=8, nn_depth=1
            )
        ),
        _x(3),
        None,
    ),
    "Coupling/spline": lambda: (
        _perturbed(
            fb.Coupling(
                _key(1), transformer=_spline(), untransformed_dim=2, dim=D, nn_width=8, nn_depth=1
            )
        ),
        _x(3),
        None,
    ),
    "Coupling/conditional": lambda: (
        _perturbed(
            fb.Coupling(
                _key(1),
                transformer=fb.Affine(),
                untransformed_dim=1,
                dim=D,
                cond_dim=C,
                nn_width=8,
                nn_depth=1,
            )
        ),
        _x(3),
        _cond(),
    ),
    "MaskedAutoregressive/affine": lambda: (
        _perturbed(
            fb.MaskedAutoregressive(_key(1), transformer=fb.Affine(), dim=D, nn_width=8, nn_depth=1)
        ),
        _x(3),
        None,
    ),
    "MaskedAutoregressive/spline": lambda: (
        _perturbed(
            fb.MaskedAutoregressive(_key(1), transformer=_spline(), dim=D, nn_width=8, nn_depth=1)
        ),
        _x(3),
        None,
    ),
    "MaskedAutoregressive/conditional": lambda: (
        _perturbed(
            fb.MaskedAutoregressive(
                _key(1), transformer=fb.Affine(), dim=D, cond_dim=C, nn_width=8, nn_depth=1
            )
        ),
        _x(3),
        _cond(),
    ),
    "BlockAutoregressiveNetwork": lambda: (
        _perturbed(fb.BlockAutoregressiveNetwork(_key(1), dim=D, depth=1, block_dim=3)),
        _x(3),
        None,
    ),
    "AdditiveCondition": lambda: (
        fb.AdditiveCondition(lambda c: jnp.concatenate([c, c]) * 0.5, (D,), (C,)),
        _x(3),
        _cond(),
    ),
    # ------------------------------------------------------------ combinators
    "Chain": lambda: (
        fb.Chain(
            [fb.Affine(_x(1), jnp.exp(_x(2))), fb.Tanh((D,)), fb.Permute(jnp.array([3, 2, 1, 0]))]
        ),
        _x(3),
        None,
    ),
    "Concatenate": lambda: (
        fb.Concatenate([fb.Exp((2,)), fb.Affine(_x(1, (2,)), 2.0)]),
        _x(3),
        None,
    ),
    "Stack": lambda: (
        fb.Stack([fb.Exp(), fb.Tanh(), fb.Affine(0.5, 2.0), fb.SoftPlus()]),
        _x(3),
        None,
    ),
    "Vmap/spline": lambda: (
        _perturbed(fb.Vmap(eqx_filter_vmap_spline(), in_axes=eqx.if_array(0))),
        _x(3),
        None,
    ),
    "Scan": lambda: (fb.Scan(_perturbed(eqx_filter_vmap_affine())), _x(3), None),
    "Sandwich": lambda: (fb.Sandwich(fb.Exp((D,)), fb.Affine(_x(1), jnp.exp(_x(2)))), _x(3), None),
    "Indexed": lambda: (
        fb.Indexed(fb.Affine(_x(1, (2,)), 2.0), jnp.array([0, 2]), (D,)),
        _x(3),
        None,
    ),
    "Reshape": lambda: (fb.Reshape(fb.Affine(_x(1), jnp.exp(_x(2))), (2, 2)), _x(3, (2, 2)), None),
    "EmbedCondition": lambda: (
        fb.EmbedCondition(
            fb.Coupling(
                _key(1),
                transformer=fb.Affine(),
                untransformed_dim=2,
                dim=D,
                cond_dim=C,
                nn_width=8,
                nn_depth=1,
            ),
            lambda c: jnp.tanh(c[:C]),
            (3,),
        ),
        _x(3),
        jax.random.normal(_key(98), (3,)),
    ),
    # ------------------------------------------------------------ flow constructors
    "coupling_flow/affine": lambda: (
        _perturbed(
            ff.coupling_flow(
                _key(1), base_dist=_base(), transformer=fb.Affine(), flow_layers=2
            ).bijection
        ),
        _x(3),
        None,
    ),
    "coupling_flow/spline": lambda: (
        _perturbed(
            ff.coupling_flow(
                _key(1), base_dist=_base(), transformer=_spline(), flow_layers=2
            ).bijection
        ),
        _x(3),
        None,
    ),
    "coupling_flow/conditional": lambda: (
        _perturbed(
            ff.coupling_flow(_key(1), base_dist=_base(), cond_dim=C, flow_layers=2).bijection
        ),
        _x(3),
        _cond(),
    ),
    "masked_autoregressive_flow/affine": lambda: (
        _perturbed(
            ff.masked_autoregressive_flow(_key(1), base_dist=_base(), flow_layers=2).bijection
        ),
        _x(3),
        None,
    ),
    "masked_autoregressive_flow/spline": lambda: (
        _perturbed(
            ff.masked_autoregressive_flow(
                _key(1), base_dist=_base(), transformer=_spline(), flow_layers=2
            ).bijection
        ),
        _x(3),
        None,
    ),
    "block_neural_autoregressive_flow": lambda: (
        _perturbed(
            ff.block_neural_autoregressive_flow(
                _key(1), base_dist=_base(), flow_layers=1, nn_block_dim=3
            ).bijection
        ),
        _x(3),
        None,
    ),
    "planar_flow": lambda: (
        _perturbed(ff.planar_flow(_key(1), base_dist=_base(), flow_layers=3).bijection),
        _x(3),
        None,
    ),
    "triangular_spline_flow": lambda: (
        _perturbed(ff.triangular_spline_flow(_key(1), base_dist=_base(), flow_layers=2).bijection),
        _x(3, scale=0.5),
        None,
    ),
}


def eqx_filter_vmap_spline() -> Any:
    return eqx.filter_vmap(
        lambda k: fb.RationalQuadraticSpline(knots=5, interval=3.0), axis_size=D
    )(jax.random.split(_key(5), D))


def eqx_filter_vmap_affine() -> Any:
    return eqx.filter_vmap(lambda k: fb.Affine(jax.random.normal(k, (D,)), 1.5))(
        jax.random.split(_key(6), 3)
    )


def _implements(bij: Any, method: str) -> bool:
    try:
        getattr(bij, method)(
            jnp.zeros(bij.shape), None if bij.cond_shape is None else jnp.zeros(bij.cond_shape)
        )
        return True
    except NotImplementedError:
        return False


def _forward_exists(bij: Any) -> bool:
    return _implements(bij, "transform_and_log_det")


def has_inverse(bij: Any) -> bool:
    """Whether flowjax implements the bijection's inverse (block neural autoregressive
    networks and planar layers with tanh raise `NotImplementedError` in it)."""
    return _implements(bij, "inverse_and_log_det")


@functools.cache  # built once per test process: a case costs 30-60 small compilations
def case(name: str, scale: float = 1.0) -> tuple[Any, jax.Array, jax.Array | None]:
    """``(bijection, x, condition)`` for a name of `all_names()`: ``"X@inverted"`` is
    `Invert(X)` with an input made by X's forward map (`scale` scales X's input: a second
    point of the domain)."""
    base, _, tag = name.rpartition("@")
    bij, x, cond = CASES[base if tag == "inverted" else name]()
    if not _forward_exists(bij):
        # (flowjax's planar_flow with tanh layers is built inverted: its `transform` raises,
        # only the density direction exists; the map that exists is taken as the forward map)
        bij = fb.Invert(bij)
    if tag != "inverted":
        return bij, scale * x, cond
    return fb.Invert(bij), bij.transform(scale * x, cond), cond


NO_INVERSE = frozenset(
    {"Planar/tanh", "Planar/conditional", "BlockAutoregressiveNetwork", "planar_flow"}
)
"""The cases whose inverse flowjax does not implement (`has_inverse` false): no
``@inverted`` twin. Written out, not probed, because building every case to probe it takes
about 40 s at each test process's collection; `test_library_flows` checks it (slow)."""


NUMERICAL_INVERSE = frozenset({"block_neural_autoregressive_flow@inverted"})
"""The cases whose flowjax inverse is a numerical solve (bisection, to its own tolerance:
1e-3 off the true input where the network saturates): jaxrev's inverse is checked against
the true input instead."""


def all_names() -> list[str]:
    """Every case, and ``X@inverted`` for those flowjax can invert."""
    out = []
    for name in CASES:
        out.append(name)
        if name not in NO_INVERSE:
            out.append(name + "@inverted")
    return out


def check(name: str, how: str, tol: float = 1e-8) -> str:
    """Run one case one way (``"eager"``, ``"jit"`` or ``"vmap"``): jaxrev's forward log-det,
    inverse and inverse log-det of the forward map alone against flowjax's. Returns ``"ok"``;
    raises the jaxrev error for a refusal and `AssertionError` for a wrong value."""
    import numpy as np

    import jaxrev as jr

    bij, x, cond = case(name)
    f = lambda x, c: bij.transform(x, c)  # noqa: E731
    fwd, inv = jr.forward_and_slogdet(f), jr.inverse_and_slogdet(f)
    if how == "vmap":
        xs = jnp.stack([x, case(name, 0.9)[1]])
        lib_f = jax.vmap(bij.transform_and_log_det, (0, None))
        lib_i = jax.vmap(bij.inverse_and_log_det, (0, None))
        fwd, inv, x = jax.vmap(fwd, (0, None)), jax.vmap(inv, (0, None)), xs
    else:
        lib_f, lib_i = bij.transform_and_log_det, bij.inverse_and_log_det
        if how == "jit":
            fwd, inv = jax.jit(fwd), jax.jit(inv)
    y_ref, ld_ref = lib_f(x, cond)
    y, ld = fwd(x, cond)
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol, err_msg="forward value")
    np.testing.assert_allclose(ld, ld_ref, rtol=tol, atol=tol, err_msg="forward log-det")
    xi, ldi = inv(y_ref, cond)
    if has_inverse(bij) and name not in NUMERICAL_INVERSE:
        xi_ref, ldi_ref = lib_i(y_ref, cond)
    else:
        xi_ref, ldi_ref = x, -ld_ref
    np.testing.assert_allclose(xi, xi_ref, rtol=tol, atol=tol, err_msg="inverse value")
    np.testing.assert_allclose(ldi, ldi_ref, rtol=tol, atol=tol, err_msg="inverse log-det")
    return "ok"
