"""Gradient and Hessian of the Bessel function J_nu(x) through a `lax.while_loop`.

Run with `python examples/bessel.py`. This is the NiLang paper's Bessel benchmark (sections 4.2
and 5.2, Table 3). The first-kind Bessel function is summed from its series

    J_nu(x) = sum_k (-1)^k (x/2)^(2k+nu) / (k! (k+nu)!)

with a running term, term <- -term (x/2)^2 / (k (k+nu)), and s <- s + term, in a
`lax.while_loop` that stops when |term| < atol. The number of terms depends on x, so this is a
while loop. `jax.grad` cannot differentiate it: the loop has no static length to store a tape
for. Every step of the loop can be undone, though. k <- k + 1 is undone by subtracting, the term
update by dividing by the same non-zero factor, and the sum by subtracting the term again. So
`jr.reversible` runs the loop backwards over its trip count. The loop's condition reads only k
and the term, whose updates read nothing but each other and x, so the trip count and the two
carries the output drops are computed again from x: it stores nothing, whatever the number of
terms.

The script shows:
- `jax.grad` of the plain while loop raising;
- dJ/dx from `jr.reversible` against the analytic derivative (J_{nu-1} - J_{nu+1})/2, central
  finite differences, `jax.grad` of a fixed-length `fori_loop` version and forward mode;
- the second derivative by forward-over-reverse (`jax.jacfwd(jax.grad(...))`) against
  (J_{nu-2} - 2 J_nu + J_{nu+2})/4;
- a batch of 4000 points (the paper's GPU batch), differentiated under `vmap`;
- timings of the objective and each gradient (jit, warm).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax

# The series cancels terms of both signs and the gradient is checked to ~1e-12: use float64.
jax.config.update("jax_enable_x64", True)

import _timing  # noqa: E402  (beside this script)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import scipy.special  # noqa: E402
from jax import lax  # noqa: E402

import jaxrev as jr  # noqa: E402

NU = 2  # the paper's J_2
X0 = 1.0  # ... at x = 1 (Table 3)
ATOL = 1e-12  # stop once a term is below this
N_FIXED = 40  # terms of the fixed-length version: below 1e-20 of the sum for |x| <= 10
BATCH = 4000  # the paper's GPU batch size


# ------------------------------------------------------------------ the series


@functools.cache
def accumulator(nu: int, atol: float = ATOL) -> Callable[[Any, Any], Any]:
    """`accumulate_j(acc, x) = acc + J_nu(x)` for an integer nu >= 0: a program that is
    invertible in `acc` (its state), with x a parameter, so `jr.reversible` applies to it."""
    if nu < 0:
        raise ValueError(f"nu must be >= 0, got {nu}")

    def accumulate_j(acc, x):
        hz2 = (x / 2) ** 2
        term0 = (x / 2) ** nu / math.factorial(nu)

        def more(carry):
            # At x = 0 the series is its first term: stop there, so that every step taken
            # multiplies by a non-zero factor (a zero one could not be divided out again, and
            # the gradient would be NaN). The price: at exactly x = 0 the second derivative of
            # J_0, which comes from the skipped k = 1 term, reads 0 instead of -1/2.
            return (jnp.abs(carry[1]) > atol) & (hz2 > 0)

        def step(carry):
            k, term, s = carry
            k = k + 1  # undone by k - 1
            term = term * (-hz2 / (k * (k + nu)))  # non-zero factor: undone by dividing
            return k, term, s + term  # undone by subtracting the term

        # The state is summed *inside* the loop (s starts at acc + term0), as NiLang does with
        # out!. A loop that reads only parameters would be differentiated by jax.vjp rather than
        # run backwards, and jax.vjp refuses a while loop.
        _, _, s = lax.while_loop(more, step, (jnp.zeros_like(term0), term0, acc + term0))
        return s

    return accumulate_j


def _signed_order(nu: int) -> tuple[int, int]:
    # J_{-n} = (-1)^n J_n: the derivative formulas need orders nu - 1 and nu - 2.
    return abs(nu), (-1) ** nu if nu < 0 else 1


@functools.partial(jax.jit, static_argnames=("nu", "atol"))
def bessel_j(nu: int, x, atol: float = ATOL):
    """J_nu(x) by the series in a `lax.while_loop` (the objective). Integer nu of any sign;
    x a scalar, or an array evaluated elementwise."""
    x = jnp.asarray(x, dtype=float)
    order, sign = _signed_order(nu)
    one = jnp.vectorize(lambda x: accumulator(order, atol)(jnp.zeros_like(x), x))
    return sign * one(x)


def bessel_j_reversible(nu: int, x, atol: float = ATOL):
    """The same value, through `jr.reversible`: its derivatives run the while loop backwards."""
    x = jnp.asarray(x, dtype=float)
    order, sign = _signed_order(nu)
    return sign * jr.reversible(accumulator(order, atol))(jnp.zeros_like(x), x)


@functools.partial(jax.jit, static_argnames=("nu", "n_terms"))
def bessel_j_fixed(nu: int, x, n_terms: int = N_FIXED):
    """The series with a fixed number of terms (a static `fori_loop`), which `jax.grad`
    differentiates by storing every step."""
    x = jnp.asarray(x, dtype=float)
    order, sign = _signed_order(nu)
    hz2 = (x / 2) ** 2
    term0 = (x / 2) ** order / math.factorial(order)

    def step(i, carry):
        term, s = carry
        k = i + 1
        term = term * (-hz2 / (k * (k + order)))
        return term, s + term

    return sign * lax.fori_loop(0, n_terms, step, (term0, term0))[1]


@functools.partial(jax.jit, static_argnames="nu")
def grad_reversible(nu: int, x):
    """dJ_nu/dx through the while loop, by `jr.reversible`."""
    return jax.grad(functools.partial(bessel_j_reversible, nu))(x)


@functools.partial(jax.jit, static_argnames="nu")
def grad_fixed(nu: int, x):
    """dJ_nu/dx by `jax.grad` of the fixed-length version (the plain-JAX reference)."""
    return jax.grad(functools.partial(bessel_j_fixed, nu))(x)


@functools.partial(jax.jit, static_argnames="nu")
def grad_forward(nu: int, x):
    """dJ_nu/dx in forward mode: `jax.jvp` goes through a while loop (one input, one pass)."""
    return jax.jacfwd(functools.partial(bessel_j, nu))(x)


@functools.partial(jax.jit, static_argnames="nu")
def hessian_reversible(nu: int, x):
    """d^2 J_nu/dx^2 by forward-over-reverse: tangents pushed through the backward sweep."""
    return jax.jacfwd(jax.grad(functools.partial(bessel_j_reversible, nu)))(x)


def d_analytic(nu: int, x):
    """J_nu'(x) = (J_{nu-1}(x) - J_{nu+1}(x)) / 2, from the same series and tolerance."""
    return (bessel_j(nu - 1, x) - bessel_j(nu + 1, x)) / 2


def d2_analytic(nu: int, x):
    """J_nu''(x) = (J_{nu-2}(x) - 2 J_nu(x) + J_{nu+2}(x)) / 4."""
    return (bessel_j(nu - 2, x) - 2 * bessel_j(nu, x) + bessel_j(nu + 2, x)) / 4


def batch_points(size: int) -> jnp.ndarray:
    """`size` points in [0.01, 10]: from one term to ~30 terms of the series."""
    return jnp.linspace(0.01, 10.0, size)


def problem(size: int = 1) -> dict:
    """The benchmark workload: J_2 and its gradient at `size` points (1: J_2(1.0) as in the
    paper's Table 3; more: a vmapped batch). The callables take `*args` and are jittable."""
    nu = NU
    if size == 1:
        args = (jnp.float64(X0),)
        objective = functools.partial(bessel_j, nu)
        rev = functools.partial(grad_reversible, nu)
        ref = functools.partial(grad_fixed, nu)
    else:
        args = (batch_points(size),)
        objective = jax.vmap(functools.partial(bessel_j, nu))
        rev = jax.vmap(functools.partial(grad_reversible, nu))
        ref = jax.vmap(functools.partial(grad_fixed, nu))
    return {
        "label": f"Bessel J_{nu}(x) gradient, batch {size}",
        "args": args,
        "objective": objective,
        "jaxrev": rev,
        "jax": ref,
    }


# ------------------------------------------------------------------ the demo


def seconds_per_call(f: Callable, *args, number: int = 20, repeat: int = 5) -> float:
    """Best of `repeat` timings of `number` calls (after a warm-up call that compiles)."""
    return _timing.seconds_per_call(f, *args, number=number, repeat=repeat)


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def main() -> None:
    t0 = time.perf_counter()
    nu, x0 = NU, jnp.float64(X0)
    value = bessel_j(nu, x0)
    print(f"J_{nu}({X0}) = {float(value):.16f} (atol {ATOL:g})")
    err = rel(value, scipy.special.jv(nu, X0))
    print(f"value vs scipy.special.jv, relative error: {err:.1e}")
    assert err < 1e-12

    # jax.grad cannot reverse the while loop: it has no static length to record a tape for.
    try:
        jax.grad(functools.partial(bessel_j, nu))(x0)
        raise AssertionError("jax.grad of a while loop was expected to fail")
    except ValueError as e:
        print(f"jax.grad of the plain while loop raises ValueError: {str(e).split('. ')[0]}.")

    # ---- first derivative at x = 1, four references
    g = grad_reversible(nu, x0)
    print(f"\ndJ_{nu}/dx at x = {X0} by jr.reversible: {float(g):.16f}")
    h = 1e-5
    fd = (bessel_j(nu, x0 + h) - bessel_j(nu, x0 - h)) / (2 * h)
    checks = [
        ("analytic derivative", d_analytic(nu, x0), 1e-11),
        ("central finite differences", fd, 1e-8),
        ("jax.grad of the fori_loop version", grad_fixed(nu, x0), 1e-12),
        ("forward mode (jacfwd of the while loop)", grad_forward(nu, x0), 1e-12),
    ]
    for label, ref, tol in checks:
        err = rel(g, ref)
        print(f"  gradient vs {label}, relative error: {err:.1e}")
        assert err < tol, (label, err)

    # ---- second derivative: forward-over-reverse
    hess = hessian_reversible(nu, x0)
    err = rel(hess, d2_analytic(nu, x0))
    print(f"d2J_{nu}/dx2 at x = {X0} by jacfwd(grad(reversible)): {float(hess):.16f}")
    print(f"  Hessian vs analytic second derivative, relative error: {err:.1e}")
    assert err < 1e-10

    # what reversible keeps besides inputs and outputs: nothing (k and the term follow from x)
    print("\n" + str(jr.memory_report(accumulator(nu), jnp.zeros_like(x0), x0)))

    # ---- a batch of points under vmap
    xs = batch_points(BATCH)
    batch_rev = jax.jit(jax.vmap(functools.partial(grad_reversible, nu)))
    batch_fixed = jax.jit(jax.vmap(functools.partial(grad_fixed, nu)))
    batch_fwd = jax.jit(jax.vmap(functools.partial(grad_forward, nu)))
    gs = batch_rev(xs)
    print(f"\nbatch of {BATCH} points in [{float(xs[0])}, {float(xs[-1])}]:")
    for label, ref, tol in [
        ("analytic derivative", d_analytic(nu, xs), 1e-10),
        ("jax.grad of the fori_loop version", batch_fixed(xs), 1e-10),
        ("scipy.special.jvp", scipy.special.jvp(nu, np.asarray(xs)), 1e-10),
    ]:
        err = rel(gs, ref)
        print(f"  batch gradient vs {label}, max error / max |dJ|: {err:.1e}")
        assert err < tol, (label, err)

    # ---- timings (jit, warm; a single point is dominated by the call overhead of jit)
    print("\ntimings (CPU, jit, warm, best of 5):")
    rows = [
        (
            "objective (while loop)",
            functools.partial(bessel_j, nu),
            jax.jit(jax.vmap(functools.partial(bessel_j, nu))),
        ),
        ("gradient, jr.reversible", functools.partial(grad_reversible, nu), batch_rev),
        ("gradient, jax.grad of fori_loop", functools.partial(grad_fixed, nu), batch_fixed),
        ("gradient, forward mode", functools.partial(grad_forward, nu), batch_fwd),
        (
            "Hessian, jacfwd(grad(reversible))",
            functools.partial(hessian_reversible, nu),
            jax.jit(jax.vmap(functools.partial(hessian_reversible, nu))),
        ),
    ]
    for label, one, batch in rows:
        t1 = seconds_per_call(one, x0)
        tb = seconds_per_call(batch, xs, number=5)
        print(
            f"  {label:36s} one point {t1 * 1e6:7.1f} us, batch of {BATCH} {tb * 1e3:7.3f} ms"
            f" ({tb / BATCH * 1e9:6.1f} ns per point)"
        )
    print(f"bessel finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
