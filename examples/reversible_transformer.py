"""A reversible transformer language model, trained data- and tensor-parallel on a 2 x 2 mesh.

Run with `python examples/reversible_transformer.py` (about 50 s on two CPU cores; it
makes 4 CPU devices when JAX has not started yet). Options: `--flax` (the Flax linen model
instead of the Equinox one), `--shard-map` (the data-parallel axis written with
`jax.shard_map`, gradients `psum`med as JAX documents), `--exact` (train with exact
reversal: the residual streams held in fixed point and rebuilt bit for bit), `--steps N`,
`--depth N`.

Each block is a pair of additive couplings on two residual streams, as in RevViT:

    y1 = x1 + Attention(LayerNorm(x2))        y2 = x2 + MLP(LayerNorm(y1))

so its input is rebuilt exactly from its output, whatever the attention and MLP compute. The
blocks' parameters are stacked and the stack runs as one `lax.scan`; wrapping it in
`jr.reversible` makes `jax.grad` rebuild each block's activations by running the stack
backwards instead of storing them. Weights are float32 (optax AdamW updates them), activations
bfloat16: each block casts its weights where it reads them, and `jr.reversible` neither stores
nor rebuilds those casts. The parameters are sharded over the mesh's "model" axis (attention
heads and the MLP's hidden units: tensor parallel) and the batch over its "data" axis. The
script trains a character-level model on the project's own documentation and prints the loss,
the per-device scratch memory of one training step against `jax.grad` and `jax.checkpoint`
per block, and the time per step.
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import time
from collections.abc import Callable
from typing import Any

import jax

if __name__ == "__main__":  # 4 CPU devices for the 2 x 2 mesh (before JAX starts its backend)
    try:
        jax.config.update("jax_num_cpu_devices", 4)
    except RuntimeError:  # the backend is already up: use what it has
        pass

import equinox as eqx  # noqa: E402
import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.ad_checkpoint import checkpoint_policies  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P
from tqdm import tqdm  # noqa: E402

import jaxrev as jr  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- the Equinox model


class RevBlock(eqx.Module):
    """One reversible block: attention couples stream 1 to stream 2, the MLP stream 2 to 1."""

    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, d: int, heads: int, *, key: Any) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1, self.ln2 = eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d)
        self.attn = eqx.nn.MultiheadAttention(heads, d, key=k1)
        self.up = eqx.nn.Linear(d, 4 * d, key=k2)
        # small output weights: each block starts near the identity
        down = eqx.nn.Linear(4 * d, d, key=k3)
        self.down = eqx.tree_at(lambda m: m.weight, down, down.weight * 0.1)

    def __call__(self, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x1, x2: (sequence, d) in the activation dtype."""
        blk = cast(self, x1.dtype)
        S = x1.shape[0]
        causal = jnp.tril(jnp.ones((S, S), bool))
        h = jax.vmap(blk.ln1)(x2)
        y1 = x1 + blk.attn(h, h, h, mask=causal)
        h = jax.vmap(blk.ln2)(y1)
        y2 = x2 + jax.vmap(blk.down)(jax.nn.gelu(jax.vmap(blk.up)(h)))
        return y1, y2


def cast(tree: Any, dtype: Any) -> Any:
    """Floating leaves of `tree` cast to `dtype` (mixed precision: float32 master weights)."""
    return jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, tree)


def eqx_block(blocks: RevBlock) -> Callable:
    """One block as a function `(streams, one block's parameters) -> streams` on a batch of
    sequences; `blocks` (stacked by `eqx.filter_vmap`) gives the non-array fields."""
    _, static = eqx.partition(blocks, eqx.is_array)

    def block(streams, p):
        return jax.vmap(eqx.combine(p, static))(*streams)

    return block


# --------------------------------------------------------------------------- the Flax model


class FlaxRevBlock(nn.Module):
    """The same block in Flax linen (stacked by `jax.vmap` of its `init`)."""

    d: int
    heads: int

    @nn.compact
    def __call__(self, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x1, x2: (batch, sequence, d) in the activation dtype."""
        dt = x1.dtype
        h = nn.LayerNorm(dtype=dt)(x2)
        y1 = x1 + nn.MultiHeadDotProductAttention(self.heads, dtype=dt, name="attn")(
            h, h, mask=nn.make_causal_mask(h[..., 0])
        )
        h = nn.LayerNorm(dtype=dt)(y1)
        h = nn.gelu(nn.Dense(4 * self.d, dtype=dt, name="up")(h))
        y2 = x2 + nn.Dense(
            self.d,
            dtype=dt,
            name="down",
            kernel_init=nn.initializers.variance_scaling(0.01, "fan_in", "normal"),
        )(h)
        return y1, y2


# --------------------------------------------------------------------------- the language model


def init(
    kind: str, key: Any, *, vocab: int, depth: int, d: int, heads: int, seq: int
) -> tuple[dict, Callable]:
    """Float32 parameters `{"embed", "pos", "blocks", "ln", "head"}` ("equinox" or "flax"
    blocks, stacked) and the block function `block(streams, one block's parameters)`."""
    k_emb, k_pos, k_blocks, k_head = jax.random.split(key, 4)
    if kind == "equinox":
        blocks = eqx.filter_vmap(lambda k: RevBlock(d, heads, key=k))(
            jax.random.split(k_blocks, depth)
        )
        block, blocks = eqx_block(blocks), eqx.filter(blocks, eqx.is_array)
    elif kind == "flax":
        module = FlaxRevBlock(d, heads)
        x = jnp.zeros((1, seq, d))
        blocks = jax.vmap(lambda k: module.init(k, x, x)["params"])(
            jax.random.split(k_blocks, depth)
        )
        block = lambda streams, p: module.apply({"params": p}, *streams)
    else:
        raise ValueError(f"kind must be 'equinox' or 'flax', got {kind!r}")
    params = {
        "embed": 0.5 * jax.random.normal(k_emb, (vocab, d)),
        "pos": 0.1 * jax.random.normal(k_pos, (seq, d)),
        "blocks": blocks,
        "ln": jnp.ones(d),
        "head": jax.random.normal(k_head, (d, vocab)) / np.sqrt(d),
    }
    return params, block


METHODS = ("reversible", "exact reversal", "jax.grad", "remat", "remat (dots saveable)")


def through(block: Callable, method: str, **reversible_kw: Any) -> Callable:
    """The block stack, `(streams, stacked block parameters) -> streams`, one `lax.scan` over
    the blocks, as each method differentiates it: `jr.reversible` (the defaults), exact
    reversal (`jr.reversible(..., exact=True)`: the streams in fixed point, rebuilt bit for
    bit), plain, or `jax.checkpoint` around each block (the usual remat) with
    `nothing_saveable` or `dots_saveable`. `reversible_kw`: `jr.reversible`'s settings (the
    time-space dial)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method.startswith("remat"):
        policy = (
            checkpoint_policies.dots_saveable
            if "dots" in method
            else checkpoint_policies.nothing_saveable
        )
        block = jax.checkpoint(block, policy=policy)

    def stack(streams, blocks):
        return jax.lax.scan(lambda c, p: (block(c, p), None), streams, blocks)[0]

    if method == "exact reversal":
        return jr.reversible(stack, exact=True, **reversible_kw)
    return jr.reversible(stack, **reversible_kw) if method == "reversible" else stack


def logits_fn(params: dict, tokens: jax.Array, stack: Callable, dtype: Any) -> jax.Array:
    """(batch, seq) tokens -> (batch, seq, vocab) float32 logits; activations in `dtype`."""
    x = (params["embed"][tokens] + params["pos"]).astype(dtype)
    y1, y2 = stack((x, x), params["blocks"])
    h = (y1.astype(jnp.float32) + y2.astype(jnp.float32)) / 2
    h = h / jnp.sqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6) * params["ln"]
    return h @ params["head"]


def loss_fn(
    params: dict, batch: jax.Array, stack: Callable, dtype: Any = jnp.bfloat16
) -> jax.Array:
    """Next-character cross-entropy of a (batch, seq + 1) array of tokens."""
    logits = logits_fn(params, batch[:, :-1], stack, dtype)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


# --------------------------------------------------------------------------- sharding

# which axis of a stacked block parameter the "model" mesh axis splits (attention heads, the
# MLP's hidden units), by the module it sits in and its name; others are replicated
_MODEL_AXIS = {
    # Equinox: attention projections (L, H*k, d) in, (L, d, H*v) out; Linear (L, out, in)
    ("query_proj", "weight"): 1,
    ("key_proj", "weight"): 1,
    ("value_proj", "weight"): 1,
    ("output_proj", "weight"): 2,
    ("up", "weight"): 1,
    ("up", "bias"): 1,
    ("down", "weight"): 2,
    # Flax: DenseGeneral (L, d, H, k) in, (L, H, k, d) out; Dense kernels (L, in, out)
    ("query", "kernel"): 2,
    ("key", "kernel"): 2,
    ("value", "kernel"): 2,
    ("query", "bias"): 1,
    ("key", "bias"): 1,
    ("value", "bias"): 1,
    ("out", "kernel"): 1,
    ("up", "kernel"): 2,
    ("down", "kernel"): 1,
}


def _names(path: Any) -> tuple[str, str]:
    keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    return str(keys[-2]), str(keys[-1])


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """NamedShardings for the parameters: block weights split over "model", the rest
    replicated."""

    def spec(path, leaf):
        axis = (
            _MODEL_AXIS.get(_names(path))
            if len(path) > 2 and getattr(path[0], "key", None) == "blocks"
            else None
        )
        parts = [None] * leaf.ndim
        if axis is not None and leaf.shape[axis] % mesh.shape["model"] == 0:
            parts[axis] = "model"
        return NamedSharding(mesh, P(*parts))

    return jax.tree_util.tree_map_with_path(spec, params)


def make_mesh(devices: Any = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "model"))


def grad_fn(
    block: Callable,
    method: str,
    dtype: Any,
    mesh: Mesh | None = None,
    shard_map: bool = False,
    **reversible_kw: Any,
) -> Callable:
    """(params, batch) -> (loss, grads). With `shard_map`, the data axis is manual: each
    device's loss on its shard of the batch, the parameters cast to vary over "data"
    (`lax.pcast`) and the gradients `psum`med, as JAX documents for data parallelism."""
    s = through(block, method, **reversible_kw)
    vg = jax.value_and_grad(lambda p, b: loss_fn(p, b, s, dtype))
    if not shard_map:
        return vg

    def per_device(p, b):
        p = jax.tree.map(lambda a: jax.lax.pcast(a, "data", to="varying"), p)
        loss, g = vg(p, b)
        n = jax.lax.psum(1, "data")
        return jax.lax.psum(loss, "data") / n, jax.tree.map(
            lambda a: jax.lax.psum(a, "data") / n, g
        )

    return jax.shard_map(
        per_device, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P(), P()), axis_names={"data"}
    )


# --------------------------------------------------------------------------- data and training


def corpus() -> str:
    """The project's own documentation: the text the model learns to continue."""
    root = os.path.dirname(HERE)
    files = sorted(glob.glob(os.path.join(root, "docs", "*.md"))) + [
        os.path.join(root, "README.md")
    ]
    return "\n".join(open(f, encoding="utf-8").read() for f in files if os.path.exists(f))


def batches(text: str, seq: int, batch: int, seed: int = 0):
    chars = sorted(set(text))
    data = np.array([chars.index(c) for c in text], np.int32)
    rng = np.random.default_rng(seed)
    while True:
        idx = rng.integers(0, len(data) - seq - 1, batch)
        yield np.stack([data[i : i + seq + 1] for i in idx]), len(chars)


def scratch(fn: Callable, *args: Any) -> int:
    """Per-device scratch bytes XLA plans for `jit(fn)(*args)`."""
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flax", action="store_true")
    ap.add_argument("--shard-map", action="store_true")
    ap.add_argument("--exact", action="store_true")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    kind = "flax" if args.flax else "equinox"
    mesh = make_mesh()
    text = corpus()
    data = batches(text, args.seq, 16)
    first, vocab = next(data)
    params, block = init(
        kind, jax.random.key(0), vocab=vocab, depth=args.depth, d=args.d, heads=4, seq=args.seq
    )
    params = jax.device_put(params, param_shardings(params, mesh))
    data_sh = NamedSharding(mesh, P("data"))
    print(
        f"{kind} model: {args.depth} reversible blocks, d_model {args.d}, "
        f"{sum(a.size for a in jax.tree.leaves(params)):,} float32 parameters, "
        f"bfloat16 activations, mesh {dict(mesh.shape)} over {mesh.devices.size} devices "
        f"({'shard_map' if args.shard_map else 'NamedSharding + jit'})"
    )

    opt = optax.adamw(3e-3, weight_decay=1e-4)
    opt_state = opt.init(params)
    method = "exact reversal" if args.exact else "reversible"
    vg = grad_fn(block, method, jnp.bfloat16, mesh, args.shard_map)

    # the updated parameters keep their shardings (else the second step compiles again)
    p_sh = jax.tree.map(
        lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else NamedSharding(mesh, P()),
        (params, opt_state),
    )
    params, opt_state = jax.device_put((params, opt_state), p_sh)

    @functools.partial(jax.jit, out_shardings=(*p_sh, NamedSharding(mesh, P())))
    def train_step(params, opt_state, batch):
        loss, g = vg(params, batch)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch0 = jax.device_put(first, data_sh)
    mem = {
        m: scratch(grad_fn(block, m, jnp.bfloat16, mesh, args.shard_map), params, batch0)
        for m in METHODS
    }
    losses, t0 = [], None
    for step in (bar := tqdm(range(args.steps), desc="training", ncols=80)):
        batch = jax.device_put(next(data)[0], data_sh)
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(float(loss))
        if step == 0:
            t0 = time.perf_counter()  # the first step compiles
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    per_step = (time.perf_counter() - t0) / max(1, args.steps - 1)
    print(
        f"loss: {losses[0]:.3f} at step 1 -> {np.mean(losses[-10:]):.3f} "
        f"(mean of the last 10 steps); {1e3 * per_step:.0f} ms per step"
    )
    print("per-device scratch of one gradient step (XLA's plan):")
    for m in METHODS:
        print(f"  {m:<24} {mem[m] / 1e6:8.2f} MB   ({mem[m] / mem[method]:.2f}x {method})")


if __name__ == "__main__":
    main()
