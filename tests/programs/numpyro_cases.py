"""numpyro's transforms built as its users build them (issue 32): `CASES` maps a name to
``make() -> (transform, x)``, `x` in the transform's domain.

`SQUARE` are the transforms that map n numbers to n numbers (their log-det is a
determinant): jaxrev inverts them from the forward map alone and log-dets them, checked
against numpyro's `inv` and `log_abs_det_jacobian`. `RECTANGULAR` change the number of
elements (a vector to a triangular matrix, a simplex, a complex spectrum): they are inverted
given the input's shape (`state=`), and their log-det (numpyro's, in its own coordinates) is
no determinant of the map's Jacobian: jaxrev's log-dets refuse them naming the transform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from numpyro.distributions import transforms as T
from numpyro.distributions.flows import (
    BlockNeuralAutoregressiveTransform,
    InverseAutoregressiveTransform,
)
from numpyro.nn import AutoregressiveNN, BlockNeuralAutoregressiveNN

D = 4


def _x(i: int, shape: tuple[int, ...] = (D,), scale: float = 1.0) -> jax.Array:
    return scale * jax.random.normal(jax.random.key(200 + i), shape)


def _tril() -> jax.Array:
    return jnp.tril(0.4 * _x(1, (D, D)), -1) + jnp.diag(jnp.exp(0.3 * _x(2)))


def _iaf() -> Any:
    init, apply = AutoregressiveNN(D, [8], permutation=jnp.array([2, 0, 3, 1]))
    _, params = init(jax.random.key(5), (D,))
    params = jax.tree_util.tree_map(
        lambda p: p + 0.2 * jax.random.normal(jax.random.key(6), p.shape), params
    )
    return InverseAutoregressiveTransform(lambda x: apply(params, x))


def _bnaf() -> Any:
    init, apply = BlockNeuralAutoregressiveNN(D, hidden_factors=[2])
    _, params = init(jax.random.key(7), (D,))
    return BlockNeuralAutoregressiveTransform(lambda x: apply(params, x))


SQUARE: dict[str, Callable[[], tuple[Any, jax.Array]]] = {
    "AffineTransform": lambda: (T.AffineTransform(_x(1), jnp.exp(_x(2))), _x(3)),
    "AffineTransform/scalar": lambda: (T.AffineTransform(0.5, -2.0), _x(3)),
    "ExpTransform": lambda: (T.ExpTransform(), _x(3)),
    "SigmoidTransform": lambda: (T.SigmoidTransform(), _x(3)),
    "SoftplusTransform": lambda: (T.SoftplusTransform(), _x(3)),
    "PowerTransform": lambda: (T.PowerTransform(3.0), jnp.exp(_x(3))),
    "PowerTransform/root": lambda: (T.PowerTransform(0.5), jnp.exp(_x(3))),
    "IdentityTransform": lambda: (T.IdentityTransform(), _x(3)),
    "PermuteTransform": lambda: (T.PermuteTransform(jnp.array([2, 0, 3, 1])), _x(3)),
    "LowerCholeskyAffine": lambda: (T.LowerCholeskyAffine(_x(1), _tril()), _x(3)),
    "OrderedTransform": lambda: (T.OrderedTransform(), _x(3)),
    "HaarTransform": lambda: (T.HaarTransform(), _x(3)),
    "DiscreteCosineTransform": lambda: (T.DiscreteCosineTransform(), _x(3)),
    "RecursiveLinearTransform": lambda: (T.RecursiveLinearTransform(0.5 * _tril()), _x(3, (5, D))),
    "ComposeTransform": lambda: (
        T.ComposeTransform(
            [
                T.AffineTransform(0.5, 2.0),
                T.PermuteTransform(jnp.arange(D)[::-1]),
                T.SigmoidTransform(),
            ]
        ),
        _x(3),
    ),
    "InverseTransform(Exp)": lambda: (T.ExpTransform().inv, jnp.exp(_x(3))),
    "InverseAutoregressiveTransform": lambda: (_iaf(), _x(3)),
    "BlockNeuralAutoregressiveTransform": lambda: (_bnaf(), _x(3)),
    "L1BallTransform": lambda: (T.L1BallTransform(), _x(3)),
}

RECTANGULAR: dict[str, Callable[[], tuple[Any, jax.Array]]] = {
    "LowerCholeskyTransform": lambda: (T.LowerCholeskyTransform(), _x(3, (6,))),
    "ScaledUnitLowerCholeskyTransform": lambda: (T.ScaledUnitLowerCholeskyTransform(), _x(3, (6,))),
    "SoftplusLowerCholeskyTransform": lambda: (T.SoftplusLowerCholeskyTransform(), _x(3, (6,))),
    "CorrCholeskyTransform": lambda: (T.CorrCholeskyTransform(), _x(3, (6,))),
    "StickBreakingTransform": lambda: (T.StickBreakingTransform(), _x(3)),
    "ZeroSumTransform": lambda: (T.ZeroSumTransform(), _x(3)),
}


def has_inverse(t: Any, y: jax.Array) -> bool:
    try:
        t.inv(y)
        return True
    except NotImplementedError:
        return False
