"""A deep-equilibrium layer trained through `jr.reversible`, with the drift check and the dial.

The layer is the fixed point of ``z <- tanh(W z + U x + b)`` (W scaled to norm 0.6, so the
iteration contracts), found by a `lax.while_loop` that stops when the update is below 1e-10.
Its backward run expands the forward run's rounding by about 1/0.6 per step, so rebuilding the
whole loop by inversion loses every digit: by default `jr.reversible` says so
(`jr.DriftError`, naming the loop and the measured drift) instead of returning NaN. With
``checkpoint_every="auto"`` (and ``max_steps``, the bound a while loop needs to be
checkpointed) it stores the carry every ⌈√N⌉ iterations, rebuilds each segment from the next
checkpoint, recomputes the segments whose rebuilt start misses, and its gradient equals
`jax.grad` of the same iterations written as a `fori_loop`. The model is then fit to a
regression target with optax.

    python examples/fixed_point.py     # about 20 s on a laptop CPU
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jaxrev as jr

jax.config.update("jax_enable_x64", True)

D, H, BATCH, TOL = 4, 16, 64, 1e-10


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    W = jax.random.normal(k1, (H, H))
    return {
        "W": 0.6 * W / jnp.linalg.norm(W, 2),
        "U": jax.random.normal(k2, (H, D)),
        "b": jnp.zeros(H),
        "v": jax.random.normal(k3, (H,)) / 4,
    }


def equilibrium(z, p, x):
    """The fixed point reached from `z` by iterating to tolerance (a plain while loop)."""
    f = lambda z: jnp.tanh(p["W"] @ z + p["U"] @ x + p["b"])  # noqa: E731
    return lax.while_loop(lambda z: jnp.max(jnp.abs(f(z) - z)) > TOL, f, z)


def iterations(p, x):
    f = lambda z: jnp.tanh(p["W"] @ z + p["U"] @ x + p["b"])  # noqa: E731
    cond = lambda s: jnp.max(jnp.abs(f(s[1]) - s[1])) > TOL  # noqa: E731
    return int(lax.while_loop(cond, lambda s: (s[0] + 1, f(s[1])), (0, jnp.zeros(H)))[0])


def model(layer):
    def predict(p, x):
        return p["v"] @ layer(jnp.zeros(H), p, x)

    return predict


def loss_of(predict):
    def loss(p, xs, ys):
        return jnp.mean((jax.vmap(lambda x: predict(p, x))(xs) - ys) ** 2)

    return loss


def main() -> None:
    key = jax.random.PRNGKey(0)
    p = init(key)
    xs = jax.random.normal(jax.random.PRNGKey(1), (BATCH, D))
    ys = jnp.sin(xs[:, 0]) + 0.5 * xs[:, 1] * xs[:, 2]

    # 1. fully reversible: the drift check catches what would have been a NaN gradient
    x0 = xs[0]
    single = lambda p: model(jr.reversible(equilibrium))(p, x0)  # noqa: E731
    try:
        jax.grad(single)(p)
        print("fully reversible: no drift detected")
    except jr.DriftError as e:
        print(f"fully reversible: DriftError, drift {e.drift:.3g} > tolerance {e.tolerance:.3g}")
        print("  " + str(e).splitlines()[0][:160])

    # 2. the dial: checkpoints and recomputation where a segment misses
    layer = jr.reversible(equilibrium, checkpoint_every="auto", max_steps=200)
    n = iterations(p, x0)
    fori = lambda z, p, x: lax.fori_loop(  # noqa: E731
        0, n, lambda i, z: jnp.tanh(p["W"] @ z + p["U"] @ x + p["b"]), z
    )
    g = jax.grad(lambda p: model(layer)(p, x0))(p)
    ref = jax.grad(lambda p: model(fori)(p, x0))(p)
    err = max(float(jnp.max(jnp.abs(g[k] - ref[k]))) for k in p)
    print(
        f"fixed point after {n} iterations; checkpoint_every='auto' gradient vs jax.grad "
        f"of the fori_loop form, max error: {err:.2e}"
    )
    print(
        jr.memory_report(equilibrium, jnp.zeros(H), p, x0, checkpoint_every="auto", max_steps=200)
    )

    # 3. fit the equilibrium model
    loss = jax.jit(jax.value_and_grad(loss_of(model(layer))))
    opt = optax.adam(1e-2)
    state = opt.init(p)
    first = None
    for step in range(150):
        val, grads = loss(p, xs, ys)
        first = float(val) if first is None else first
        updates, state = opt.update(grads, state, p)
        p = optax.apply_updates(p, updates)
        # keep the layer a contraction (the fixed point exists and is unique)
        p["W"] = p["W"] * jnp.minimum(1.0, 0.6 / jnp.linalg.norm(p["W"], 2))
    final = float(loss(p, xs, ys)[0])
    print(f"training loss: {first:.4f} -> {final:.4f}")
    print(f"baseline (predict the mean): {float(np.var(np.asarray(ys))):.4f}")
    print("fixed_point finished")


if __name__ == "__main__":
    main()
