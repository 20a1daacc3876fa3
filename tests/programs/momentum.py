"""SGD with momentum, the loop whose hypergradients drift when run backwards (each reversed
step divides the velocity by the momentum): the tests of the default's repair share it."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def momentum_sgd(steps: int):
    """``train(wv, hp, beta)``: `steps` steps of SGD with momentum `beta` and learning rate
    `hp` on the state ``wv = (w, v)``, the gradient ``tanh(w) + 0.1 w`` (a Python `beta` is a
    constant of the program; a traced one may differ per `vmap` sample)."""

    def train(wv, hp, beta):
        def body(i, s):
            w, v = s
            v = beta * v + jnp.tanh(w) + 0.1 * w
            return w - hp * v, v

        return lax.fori_loop(0, steps, body, wv)

    return train
