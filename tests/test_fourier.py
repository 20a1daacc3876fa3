"""Discrete Fourier transforms (`fft`): inverted by the opposite transform, and as part of
real-linear groups (a DCT computed as ``real(fft(x) * w)``, how `jax.scipy.fft.dct` and
flowjax's `DiscreteCosine` write it), against NumPy and dense log-determinants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.fft as jfft
import numpy as np
import pytest
from helpers import scaled_error

import jaxrev as jr

jax.config.update("jax_enable_x64", True)

X = jnp.array([0.3, -0.2, 0.5, 0.1, -0.7, 0.25])


@pytest.mark.parametrize(
    "f",
    [
        lambda z: jnp.fft.fft(z) * 0.5,
        lambda z: jnp.fft.ifft(z) + 1.0,
        lambda z: jnp.fft.fft2(z.reshape(2, 3)).ravel(),
    ],
    ids=["fft", "ifft", "fft2"],
)
def test_complex_transforms_invert(f):
    z = X + 1j * X[::-1]
    for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
        assert scaled_error(inv(f(z)), z) < 1e-14


def test_real_ffts_invert_as_a_group():
    """An inverse real FFT alone drops the imaginary parts of its zero and Nyquist
    frequencies; between a real input and a real output of one size the group is solved."""
    w = jnp.array([2.0, 1.5, 0.5, 3.0])  # (a real filter: the spectrum stays Hermitian)
    f = lambda x: jnp.fft.irfft(jnp.fft.rfft(x) * w, n=6)  # noqa: E731
    for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
        assert scaled_error(inv(f(X)), X) < 1e-13


def test_the_real_part_of_a_transform_that_loses_rank_is_refused_naming_it():
    # real(fft(x)) is the cosine part alone: a symmetric spectrum, rank n/2 + 1
    with pytest.raises(jr.NotInvertibleError, match="`real`"):
        jr.reverse(lambda x: jnp.real(jnp.fft.fft(x)))(X)


@pytest.mark.parametrize("norm", ["ortho", None])
@pytest.mark.parametrize("transform", [jfft.dct, jfft.idct], ids=["dct", "idct"])
def test_cosine_transforms_invert_with_their_log_determinant(transform, norm):
    """``real(fft(x) * w)``: `real` alone drops the imaginary part, but the group from the real
    input to the real output is a square real-linear map, solved as one."""
    f = lambda x: transform(x, norm=norm)  # noqa: E731
    y = f(X)
    want = np.asarray(jnp.linalg.slogdet(jax.jacfwd(f)(X)))
    for inv in (jr.reverse(f), jax.jit(jr.reverse(f))):
        assert scaled_error(inv(y), X) < 1e-13
    assert (
        scaled_error(jax.vmap(jr.reverse(f))(jnp.stack([y, 2 * y])), jnp.stack([X, 2 * X])) < 1e-13
    )
    x2, logdet = jr.inverse_and_slogdet(f)(y)
    assert scaled_error(x2, X) < 1e-13 and abs(float(logdet) + want[1]) < 1e-12 * max(
        1, abs(want[1])
    )
    y2, logdet = jr.forward_and_slogdet(f)(X)
    assert scaled_error(y2, y) < 1e-14 and abs(float(logdet) - want[1]) < 1e-12 * max(
        1, abs(want[1])
    )
    sign, logdet = jr.slogdet_jacobian(f, X)
    assert float(sign) == want[0] and abs(float(logdet) - want[1]) < 1e-12 * max(1, abs(want[1]))
    np.testing.assert_allclose(
        jr.inverse_jvp(f, (X,), jnp.cos(X))[1][0],
        jnp.linalg.solve(jax.jacfwd(f)(X), jnp.cos(X)),
        rtol=1e-12,
        atol=1e-12,
    )
