"""Reversible learning: hypergradients of SGD with momentum through 10^4 training steps.

Maclaurin, Duvenaud & Adams (2015) differentiated a validation loss with respect to the
learning rate and the momentum of SGD by running training backwards, storing the bits that
momentum's decay destroys; they reached about 100 steps with exact arithmetic. Here the
training loop is plain optax (`optax.sgd(learning_rate, momentum)`) inside `lax.fori_loop`,
and `jr.reversible` with its default settings differentiates it: the loop runs backwards (the
step ``v <- m v + g(w); w <- w - lr v`` inverts as ``w <- w + lr v; v <- (v - g(w)) / m``),
and since dividing by the momentum amplifies rounding 1/m times per step, the default
checkpoints every ⌈√T⌉ steps and recomputes the segments whose drift would change the
gradient (docs/design.md §3.8). No setting to choose.

`jr.reversible(..., exact=True)` does what Maclaurin et al. did, in XLA: the parameters and
velocities are held in fixed point, the step is applied exactly, and the bits that the
multiplication by the momentum destroys (log2(1/m) per number per step) are kept in an
information buffer, so the loop runs backwards bit for bit with no checkpoints and no repair.

Run: python examples/hypergradients.py [--steps 10000] [--dtype float64|float32]
     [--momentum 0.9]
Prints the hypergradients of jax.grad, of jr.reversible's default and of exact reversal, the
scratch memory of each (XLA's plan) and their times.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jaxrev as jr

jax.config.update("jax_enable_x64", True)


def make_data(dtype, n=512, d=16, batches=8):
    """A small regression problem: n examples in `batches` minibatches, and a validation
    set."""
    k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
    w_true = jax.random.normal(k1, (d,))
    X = jax.random.normal(k2, (batches, n // batches, d))
    y = jnp.tanh(X @ w_true) + 0.1 * jax.random.normal(k3, X.shape[:2])
    Xv = jax.random.normal(k4, (256, d))
    yv = jnp.tanh(Xv @ w_true)
    return [a.astype(dtype) for a in (X, y, Xv, yv)]


def model(w, X):
    return jnp.tanh(X @ w["a"]) * w["s"]


def train_loss(w, X, y):
    return jnp.mean((model(w, X) - y) ** 2) + 1e-3 * jnp.sum(w["a"] ** 2)


def trainer(steps):
    """`train(state, hyper, data)`: `steps` steps of optax SGD with momentum from `state` =
    (params, optimizer state). (`steps` is closed over: an int passed as an argument would be
    traced, and the loop would become a `while_loop` of unknown length.)"""
    return lambda state, hyper, data: train(state, hyper, data, steps)


def train(state, hyper, data, steps):
    X, y, _, _ = data
    lr, momentum = hyper
    opt = optax.sgd(learning_rate=lr, momentum=momentum)

    def step(i, state):
        w, s = state
        b = i % X.shape[0]
        g = jax.grad(train_loss)(w, X[b], y[b])
        upd, s = opt.update(g, s, w)
        return optax.apply_updates(w, upd), s

    return lax.fori_loop(0, steps, step, state)


def init_state(dtype, d=16):
    w = {"a": jnp.zeros(d, dtype), "s": jnp.ones((), dtype)}
    opt = optax.sgd(learning_rate=0.1, momentum=0.9)  # (the state's structure only)
    return w, opt.init(w)


def validation(train_fn, data):
    _, _, Xv, yv = data

    def val(hyper):
        w, _ = train_fn(init_state(Xv.dtype), hyper, data)
        return jnp.mean((model(w, Xv) - yv) ** 2)

    return val


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--dtype", choices=["float64", "float32", "both"], default="both")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument(
        "--momentum",
        type=float,
        default=0.9,
        help="0.5 or 0.1 divide rounding by the momentum at every backward step",
    )
    args = ap.parse_args(argv)
    dtypes = ["float64", "float32"] if args.dtype == "both" else [args.dtype]
    ref64 = None
    for name in dtypes:
        dt = jnp.dtype(name)
        data = make_data(dt)
        hyper = (jnp.asarray(args.lr, dt), jnp.asarray(args.momentum, dt))
        rev_train = jr.reversible(trainer(args.steps), argnums=0)
        exact_train = jr.reversible(trainer(args.steps), argnums=0, exact=True)
        grads = (
            ("jax.grad", jax.jit(jax.grad(validation(trainer(args.steps), data)))),
            ("jr.reversible", jr.jit(jax.grad(validation(rev_train, data)))),
            ("exact=True", jr.jit(jax.grad(validation(exact_train, data)))),
        )
        mem = {}
        for k, g in grads:
            mem[k] = g.lower(hyper).compile().memory_analysis().temp_size_in_bytes
        out = {k: jax.block_until_ready(g(hyper)) for k, g in grads}
        times = {k: [] for k in out}
        for _ in range(3):  # interleaved, median
            for k, g in grads:
                t = time.perf_counter()
                jax.block_until_ready(g(hyper))
                times[k].append(time.perf_counter() - t)
        if name == "float64":
            ref64 = np.asarray(out["jax.grad"], np.float64)
        print(
            f"\n{name}, {args.steps} steps of SGD with momentum (lr {args.lr}, momentum "
            f"{args.momentum}):"
        )
        for k in out:
            v = np.asarray(out[k], np.float64)
            err = ""
            if ref64 is not None:
                rel = np.max(np.abs(v - ref64)) / np.max(np.abs(ref64))
                err = f"  error vs float64 jax.grad {rel:.2e}"
            print(f"  {k:14s} d val / d(lr, momentum) = ({v[0]: .6e}, {v[1]: .6e}){err}")
            print(f"  {'':14s} scratch {mem[k] / 1e6:9.3f} MB, time {np.median(times[k]):.3f} s")
        for k in ("jr.reversible", "exact=True"):
            print(f"  memory: jax.grad / {k} = {mem['jax.grad'] / mem[k]:.0f}x")


if __name__ == "__main__":
    main()
