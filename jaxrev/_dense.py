"""Dense linear algebra in every floating dtype JAX computes in.

LAPACK (CPU), cuSOLVER and rocSOLVER have no float16 or bfloat16 kernels, and NumPy's
`numpy.linalg` refuses both: `jnp.linalg.solve` of a bfloat16 matrix fails inside jaxlib with
``NotImplementedError: Unsupported dtype bfloat16``, which a user who asked jaxrev for a
half-precision inverse cannot act on. Every dense factorization jaxrev makes goes through here:
an operand of a half-precision dtype is solved in float32 and the answer rounded back to the
operand's dtype, as a half-precision user does by hand (JAX's own `jnp.linalg` does the same for
no dtype); every other dtype goes straight through, so float32, float64 and complex programs
compile to exactly the calls they did before.

    >>> import jax.numpy as jnp
    >>> a = jnp.array([[2.0, 0.0], [0.0, 4.0]], jnp.bfloat16)
    >>> solve(a, jnp.ones(2, jnp.bfloat16)).dtype
    dtype(bfloat16)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "cho_solve",
    "cholesky",
    "inv",
    "lu_factor",
    "lu_solve",
    "numpy_svd",
    "slogdet",
    "solve",
    "solver_dtype",
    "tridiagonal_solve",
]

# the floating dtypes no dense solver library has kernels for
_HALF = (np.dtype(jnp.float16), np.dtype(jnp.bfloat16))


def solver_dtype(dtype: Any) -> np.dtype:
    """The dtype a factorization of `dtype` operands runs in: float32 for float16 and
    bfloat16, `dtype` itself otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in _HALF else dtype


def _working(x: Any) -> Any:
    x = jnp.asarray(x)
    return x.astype(solver_dtype(x.dtype))


def _back(out: Any, like: Any) -> Any:
    """`out` in the dtype of the operand `like` (a no-op unless that is half precision)."""
    return out.astype(jnp.result_type(like)) if jnp.result_type(like) in _HALF else out


def _scalar_blocks(a: Any) -> bool:
    # 1 x 1 systems (an elementwise Newton step, one per element of a spline's piece) are a
    # division: XLA:CPU runs a batched LU as one LAPACK call per matrix (2.3 ms of a 4.4 ms
    # spline inverse for 256 x 4 x 16 candidates)
    return jnp.ndim(a) >= 2 and jnp.shape(a)[-1] == 1 and jnp.shape(a)[-2] == 1


def solve(a: Any, b: Any) -> Any:
    """`jnp.linalg.solve(a, b)`, in float32 for half-precision operands."""
    if _scalar_blocks(a) and jnp.ndim(b) == jnp.ndim(a):  # (a batch of 1 x k right sides)
        return _back(_working(b) / _working(a), jnp.result_type(a, b))
    if _scalar_blocks(a) and jnp.ndim(b) == jnp.ndim(a) - 1:  # (a batch of vectors)
        return _back(_working(b) / _working(a)[..., 0], jnp.result_type(a, b))
    return _back(jnp.linalg.solve(_working(a), _working(b)), jnp.result_type(a, b))


def inv(a: Any) -> Any:
    """`jnp.linalg.inv(a)`, in float32 for a half-precision `a`."""
    return _back(jnp.linalg.inv(_working(a)), a)


def slogdet(a: Any) -> tuple[Any, Any]:
    """`jnp.linalg.slogdet(a)` as (sign, log|det|) in `a`'s dtype, computed in float32 for a
    half-precision `a` (a bfloat16 log-determinant is rounded once, at the end)."""
    if _scalar_blocks(a):
        w = _working(a)[..., 0, 0]
        return _back(jnp.sign(w), a), _back(jnp.log(jnp.abs(w)), a)
    sign, logabsdet = jnp.linalg.slogdet(_working(a))
    return _back(sign, a), _back(logabsdet, a)


def lu_factor(a: Any) -> tuple[Any, Any]:
    """`jax.scipy.linalg.lu_factor(a)`; the factors of a half-precision `a` stay in float32
    (rounding them would lose the pivots' accuracy) and `lu_solve` rounds its answer."""
    return jax.scipy.linalg.lu_factor(_working(a))


def lu_solve(lu_and_piv: tuple[Any, Any], b: Any, trans: int = 0) -> Any:
    """`jax.scipy.linalg.lu_solve` with factors from `lu_factor`; the answer in `b`'s dtype."""
    lu, piv = lu_and_piv
    return _back(jax.scipy.linalg.lu_solve((lu, piv), _working(b).astype(lu.dtype), trans), b)


def cholesky(a: Any) -> Any:
    """`jnp.linalg.cholesky(a)`; the factor of a half-precision `a` stays in float32."""
    return jnp.linalg.cholesky(_working(a))


def cho_solve(factor: tuple[Any, bool], b: Any) -> Any:
    """`jax.scipy.linalg.cho_solve` with a factor from `cholesky`; the answer in `b`'s dtype."""
    c, lower = factor
    return _back(jax.scipy.linalg.cho_solve((c, lower), _working(b).astype(c.dtype)), b)


def tridiagonal_solve(dl: Any, d: Any, du: Any, b: Any) -> Any:
    """`lax.linalg.tridiagonal_solve`, in float32 for half-precision operands."""
    args = [_working(x) for x in (dl, d, du, b)]
    return _back(lax.linalg.tridiagonal_solve(*args), b)


def numpy_svd(m: np.ndarray, **kwargs: Any) -> Any:
    """`numpy.linalg.svd` of a concrete array, in float32 for half precision (the rank tests
    that call this compare singular values with the operand's own epsilon, not float32's)."""
    m = np.asarray(m)
    return np.linalg.svd(m.astype(solver_dtype(m.dtype)), **kwargs)
