"""A reversible residual network (RevNet) trained with gradients that store no activations.

Run with `python examples/revnet.py`. Each block is a pair of additive couplings,
x1 += MLP(x2); x2 += MLP(x1), so its input can be rebuilt exactly from its output whatever the
MLPs are. Wrapping the stack of blocks in `jr.reversible` makes `jax.grad` rebuild each block's
activations by running the network backwards instead of keeping them: the gradient's temporary
memory no longer grows with depth. The script trains the network with optax (adam) on a toy
classification task, checks one gradient against plain `jax.grad`, and compares the memory.
"""

import time

import jax

# The gradient check compares against jax.grad to 1e-9 relative: float64 rounding is needed.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxrev as jr  # noqa: E402

BLOCKS, FEATURES, HIDDEN, BATCH, CLASSES, STEPS = 32, 8, 32, 256, 3, 300


def mlp(w, x):
    # A tanh hidden layer wider than the features. It only runs forward, also when the block
    # is inverted (x1 = x1' - MLP(x2)), so it need not be invertible itself.
    return jnp.tanh(x @ w["a"] + w["b"]) @ w["c"]


def net(state, blocks):
    """The reversible part: (x1, x2) in, (x1, x2) out, one pair of couplings per block."""
    x1, x2 = state
    for w in blocks:  # unrolled: 32 blocks = 64 couplings in one traced program
        x1 = x1 + mlp(w["f"], x2)
        x2 = x2 + mlp(w["g"], x1)
    return x1, x2


rev_net = jr.reversible(net, argnums=0)  # same signature, same outputs, tape-free gradient


def init(rng):
    # numpy for the set-up: it is instant, where each jax.random call would be compiled
    def layer():
        return {
            "a": rng.normal(size=(FEATURES, HIDDEN)) / np.sqrt(FEATURES),
            "b": np.zeros(HIDDEN),
            # small output weights: each block starts near the identity, so 32 of them
            # stacked neither explode nor vanish
            "c": 0.1 * rng.normal(size=(HIDDEN, FEATURES)) / np.sqrt(HIDDEN),
        }

    return {
        "embed": rng.normal(size=(2, 2 * FEATURES)),
        "readout": 0.1 * rng.normal(size=(2 * FEATURES, CLASSES)),
        "blocks": [{"f": layer(), "g": layer()} for _ in range(BLOCKS)],
    }


def embed(params, x):
    h = jnp.tanh(x @ params["embed"])
    return h[:, :FEATURES], h[:, FEATURES:]


def make_loss(body):
    def loss(params, x, labels):
        # The embedding and the readout sit outside the reversible part (the readout is the
        # loss head; neither needs to keep the state's shape).
        x1, x2 = body(embed(params, x), params["blocks"])
        logits = jnp.concatenate([x1, x2], axis=1) @ params["readout"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return loss


def spirals(n, rng):
    """Three interleaved spiral arms in the plane; the label is the arm."""
    labels = rng.integers(0, CLASSES, n)
    r = rng.uniform(0.1, 1.0, n)
    theta = 3 * np.pi * r + 2 * np.pi * labels / CLASSES + 0.3 * rng.normal(size=n)
    return np.stack([r * np.cos(theta), r * np.sin(theta)], 1) * 2.0, labels


def compiled(f, *args):
    # One compile serves both to run f and to read XLA's temporary-buffer size.
    c = jax.jit(f).lower(*args).compile()
    return c(*args), c.memory_analysis().temp_size_in_bytes


def main():
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    x, labels = map(jnp.asarray, spirals(BATCH, rng))
    x_test, labels_test = map(jnp.asarray, spirals(1024, rng))
    params = jax.tree_util.tree_map(jnp.asarray, init(rng))
    loss, loss_plain = make_loss(rev_net), make_loss(net)

    # 1. The gradient matches plain jax.grad (which keeps all 64 hidden activations).
    g_rev, m_rev = compiled(jax.grad(loss), params, x, labels)
    g_ref, m_ref = compiled(jax.grad(loss_plain), params, x, labels)
    flat_rev, flat_ref = (
        jnp.concatenate([a.ravel() for a in jax.tree_util.tree_leaves(g)]) for g in (g_rev, g_ref)
    )
    rel = float(jnp.linalg.norm(flat_rev - flat_ref) / jnp.linalg.norm(flat_ref))
    print(f"{BLOCKS} blocks, gradient vs jax.grad, relative error: {rel:.2e}")

    # 2. Memory: XLA's temporary buffers for the whole gradient, both ways.
    print(f"temp memory: reversible {m_rev / 1e6:.2f} MB, jax.grad {m_ref / 1e6:.2f} MB")
    print(f"memory ratio (reversible / jax.grad): {m_rev / m_ref:.3f}")
    # Nothing lossy in the network, so nothing is stored beyond inputs and outputs:
    print(jr.memory_report(net, embed(params, x), params["blocks"]))

    # 3. Train with adam; every step's gradient runs the network backwards.
    opt = optax.adam(1e-3)

    @jax.jit
    def train_step(params, state):
        value, grads = jax.value_and_grad(loss)(params, x, labels)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    state = opt.init(params)
    first = None
    for step in range(STEPS + 1):
        params, state, value = train_step(params, state)
        first = float(value) if first is None else first
        if step % 50 == 0:
            print(f"step {step:4d}  loss {float(value):.4f}")
    predict = jax.jit(
        lambda p, x: jnp.argmax(
            jnp.concatenate(rev_net(embed(p, x), p["blocks"]), 1) @ p["readout"], 1
        )
    )
    acc = float(jnp.mean(predict(params, x_test) == labels_test))
    print(f"loss went from {first:.4f} to {float(value):.4f}; held-out accuracy {acc:.3f}")
    print(f"revnet finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
