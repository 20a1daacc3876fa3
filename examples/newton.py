"""Newton steps without Hessians: `jaxrev.optim` on the classic test problems.

A Newton step solves H d = g. jaxrev gets d by inverse accumulation over jax.grad(f): the
gradient program's tangent program is inverted step by step, and what is invertible only as a
whole (a lump) is solved with the structure its sparsity has. A chained Rosenbrock's Hessian
is tridiagonal, so its Newton direction costs O(n), where forming H and LU-solving it costs
n Hessian-vector products and O(n³).

    python examples/newton.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax

jax.config.update("jax_enable_x64", True)

import jaxrev as jr  # noqa: E402


def rosenbrock(x: jax.Array) -> jax.Array:
    """2-D Rosenbrock; minimum 0 at (1, 1)."""
    return (1.0 - x[0]) ** 2 + 100.0 * (x[1] - x[0] ** 2) ** 2


def extended_rosenbrock(x: jax.Array) -> jax.Array:
    """n/2 independent Rosenbrock pairs (x_{2i}, x_{2i+1})."""
    return jnp.sum(100.0 * (x[1::2] - x[::2] ** 2) ** 2 + (1.0 - x[::2]) ** 2)


def chained_rosenbrock(x: jax.Array) -> jax.Array:
    """Σ 100 (x_{i+1} - x_i²)² + (1 - x_i)²: a tridiagonal Hessian."""
    return jnp.sum(100.0 * (x[1:] - x[:-1] ** 2) ** 2 + (1.0 - x[:-1]) ** 2)


def broyden_tridiagonal(x: jax.Array) -> jax.Array:
    """F_i = (3 - 2 x_i) x_i - x_{i-1} - 2 x_{i+1} + 1 (x_0 = x_{n+1} = 0)."""
    xl = jnp.concatenate([jnp.zeros(1, x.dtype), x[:-1]])
    xr = jnp.concatenate([x[1:], jnp.zeros(1, x.dtype)])
    return (3.0 - 2.0 * x) * x - xl - 2.0 * xr + 1.0


def pure_newton_with_optax() -> None:
    print("1. pure Newton on 2-D Rosenbrock from (-1.2, 1), through optax")
    opt = jr.optim.newton(learning_rate=1.0)
    x = jnp.array([-1.2, 1.0])
    state = opt.init(x)

    @jax.jit
    def step(x, state):
        updates, state = opt.update(jax.grad(rosenbrock)(x), state, x, value_fn=rosenbrock)
        return optax.apply_updates(x, updates), state

    for k in range(1, 31):
        x, state = step(x, state)
        err = float(jnp.max(jnp.abs(x - 1.0)))
        if err < 1e-8:
            break
    print(f"   steps to |x - (1, 1)| < 1e-8: {k}; error {err:.1e}")


def trust_region_extended() -> None:
    print("2. trust-region Newton on the 100-dimensional extended Rosenbrock")
    x0 = jnp.tile(jnp.array([-1.2, 1.0]), 50)
    solve = jax.jit(
        lambda x0: jr.optim.minimize(extended_rosenbrock, x0, method="trust-region", tol=1e-10)
    )
    x, info = solve(x0)
    print(
        f"   loss {float(info.value):.2e} after {int(info.iterations)} iterations "
        f"({info.message}); max |x - 1| = {float(jnp.max(jnp.abs(x - 1.0))):.1e}"
    )


def newton_direction_chained(n: int = 4000) -> None:
    print(f"3. one Newton direction of the chained Rosenbrock, n = {n}, near its minimum")
    x = 1.0 + 0.01 * jax.random.normal(jax.random.PRNGKey(0), (n,))
    ours = jax.jit(lambda x: jr.optim.newton_direction(chained_rosenbrock, x))
    dense = jax.jit(
        lambda x: jnp.linalg.solve(
            jax.hessian(chained_rosenbrock)(x), jax.grad(chained_rosenbrock)(x)
        )
    )

    def timed(fn):
        fn(x).block_until_ready()
        t0 = time.perf_counter()
        for _ in range(3):
            d = fn(x).block_until_ready()
        return d, (time.perf_counter() - t0) / 3

    d, t_ours = timed(ours)
    d_ref, t_dense = timed(dense)
    g = jax.grad(chained_rosenbrock)(x)
    hd = jax.jvp(jax.grad(chained_rosenbrock), (x,), (d,))[1]
    res = float(jnp.linalg.norm(hd - g) / jnp.linalg.norm(g))
    diff = float(jnp.max(jnp.abs(d - d_ref)) / jnp.max(jnp.abs(d_ref)))
    print(
        f"   jaxrev {t_ours * 1e3:.2f} ms, dense Hessian + LU {t_dense * 1e3:.1f} ms "
        f"({t_dense / t_ours:.0f}x); relative residual {res:.1e}; vs dense {diff:.1e}"
    )


def broyden_root(n: int = 200) -> None:
    print(f"4. root of the Broyden tridiagonal system, n = {n}, from x = -1")
    x, info = jax.jit(lambda x0: jr.optim.root(broyden_tridiagonal, x0, atol=1e-12))(-jnp.ones(n))
    print(
        f"   residual {float(jnp.max(jnp.abs(broyden_tridiagonal(x)))):.1e} after "
        f"{int(info.iterations)} Newton steps ({info.message})"
    )


if __name__ == "__main__":
    pure_newton_with_optax()
    trust_region_extended()
    newton_direction_chained()
    broyden_root()
