"""The sharded reversible transformer's checks, run in a fresh interpreter by
`tests/test_transformer.py` (the device count is fixed when JAX starts).

`python tests/transformer_worker.py single` makes 4 CPU devices in one process;
`python tests/transformer_worker.py process I N PORT` is process I of N under
`jax.distributed` (2 CPU devices each, gloo collectives). Each prints one `CASE {json}` line
per check and a final `DONE`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
)
import reversible_transformer as rt  # noqa: E402
from helpers import rel_error  # noqa: E402

VOCAB, D, HEADS, SEQ, BATCH = 11, 16, 2, 8, 4


def case(**kw) -> None:
    print("CASE " + json.dumps(kw), flush=True)


def model(kind: str, depth: int, dtype=jnp.float64):
    params, block = rt.init(
        kind, jax.random.key(1), vocab=VOCAB, depth=depth, d=D, heads=HEADS, seq=SEQ
    )
    params = jax.tree.map(lambda a: a.astype(dtype), params)
    batch = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    return params, block, batch


def put(tree, shardings):
    """Global arrays from values every process holds (multi-process: its own shards)."""
    return jax.tree.map(
        lambda a, s: jax.make_array_from_callback(np.shape(a), s, lambda idx: np.asarray(a)[idx]),
        tree,
        shardings,
    )


def gather(tree):
    if jax.process_count() == 1:
        return tree
    return multihost_utils.process_allgather(tree, tiled=True)


def sharded_grads(kind, depth, method, dtype, shard_map=False, ref_params=None):
    params, block, batch = model(kind, depth, jnp.float32)
    params = params if ref_params is None else ref_params
    mesh = rt.make_mesh()
    p = put(params, rt.param_shardings(params, mesh))
    b = put(batch, NamedSharding(mesh, P("data")))
    fn = jax.jit(rt.grad_fn(block, method, dtype, mesh, shard_map))
    loss, g = fn(p, b)
    n_sharded = sum(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(p))
    return float(loss), gather(g), n_sharded, fn, (p, b)


def local_grads(kind, depth, method, dtype, params=None):
    """The reference on one device, the full batch: plain `jax.grad` unless asked."""
    p0, block, batch = model(kind, depth)
    params = p0 if params is None else params
    fn = jax.jit(rt.grad_fn(block, method, dtype))
    return fn(params, batch)


def scratch(kind, depth):
    params, block, batch = model(kind, depth, jnp.float32)
    mesh = rt.make_mesh()
    p = put(params, rt.param_shardings(params, mesh))
    b = put(batch, NamedSharding(mesh, P("data")))
    fn = rt.grad_fn(block, "reversible", jnp.float32, mesh)
    return int(jax.jit(fn).lower(p, b).compile().memory_analysis().temp_size_in_bytes)


def start(argv: list[str]) -> str:
    """Set the device count (and join the other processes) before JAX starts its backend."""
    mode = argv[1] if len(argv) > 1 else "single"
    if mode == "process":
        jax.config.update("jax_num_cpu_devices", 2)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"127.0.0.1:{argv[4]}",
            num_processes=int(argv[3]),
            process_id=int(argv[2]),
            initialization_timeout=120,
        )
    else:
        jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_enable_x64", True)
    return mode


def main(mode: str) -> None:
    multi = mode == "process"
    kinds = ("equinox",) if multi else ("equinox", "flax")
    for kind in kinds:
        params64 = model(kind, 4)[0]
        loss_ref, g_ref = local_grads(kind, 4, "jax.grad", jnp.float64, params64)
        for sm in (False, True) if kind == "equinox" else (False,):
            loss, g, n_sh, _, _ = sharded_grads(
                kind, 4, "reversible", jnp.float64, sm, ref_params=params64
            )
            _, g_sh, _, _, _ = sharded_grads(
                kind, 4, "jax.grad", jnp.float64, sm, ref_params=params64
            )
            # against jax.grad on the same mesh, and on one device with the full batch (XLA's
            # sharded program itself differs from the one-device one by about 2e-8)
            case(
                case=f"grad64-{kind}-{'shard_map' if sm else 'jit'}",
                rel_err=rel_error(g, g_sh),
                rel_err_one_device=rel_error(g, g_ref),
                grad_vs_one_device=rel_error(g_sh, g_ref),
                loss_err=abs(loss - float(loss_ref)),
                sharded_leaves=n_sh,
                devices=len(jax.devices()),
                processes=jax.process_count(),
            )
    if multi:
        print("DONE", flush=True)
        return
    # bfloat16 activations: reversible against jax.grad on the same mesh (tensor parallel
    # sums partial products across devices in bfloat16: one device rounds differently), both
    # against a float32 reference
    params32 = model("equinox", 8, jnp.float32)[0]
    _, g32 = local_grads("equinox", 8, "jax.grad", jnp.float32, params32)
    _, g_bf, _, _, _ = sharded_grads("equinox", 8, "jax.grad", jnp.bfloat16, ref_params=params32)
    _, g_rev, _, _, _ = sharded_grads("equinox", 8, "reversible", jnp.bfloat16, ref_params=params32)
    _, g_bf1 = local_grads("equinox", 8, "jax.grad", jnp.bfloat16, params32)
    _, g_exact, _, _, _ = sharded_grads(
        "equinox", 8, "exact reversal", jnp.bfloat16, ref_params=params32
    )
    case(
        case="bf16",
        rev_err=rel_error(g_rev, g32),
        exact_err=rel_error(g_exact, g32),
        grad_err=rel_error(g_bf, g32),
        grad_one_device_err=rel_error(g_bf1, g32),
    )
    # per-device scratch at 8 and 32 blocks, with the defaults
    case(case="flat", scratch8=scratch("equinox", 8), scratch32=scratch("equinox", 32))
    print("DONE", flush=True)


if __name__ == "__main__":
    main(start(sys.argv))
