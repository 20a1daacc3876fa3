"""`jr.reverse` on sharded arrays: a 1-D mesh of 4 (forced) CPU devices.

The device count is fixed when JAX initializes its backend, so the programs run in a fresh
interpreter with ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` and
``JAX_ENABLE_X64=1``. It puts an (8, 16) state on the mesh (rows, then columns, over the
devices), checks ``jax.jit(jr.reverse(f))(jax.jit(f)(x, p), p)`` against ``x``, prints one
``CASE {json}`` line per program (error, the shardings seen) and a final marker. The interpreter
runs once per module; each case is its own test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from programs.nonlinear import ROUND_TRIP

MARKER = "JAXREV_SHARDING_DONE"

SCRIPT = textwrap.dedent(r"""
    import json
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import jaxrev as jr

    assert jax.config.jax_enable_x64, "JAX_ENABLE_X64 was not honoured"
    devices = jax.devices()
    assert len(devices) == 4 and all(d.platform == "cpu" for d in devices), devices
    mesh = Mesh(np.array(devices), ("d",))

    def additive_coupling(x, w):
        # NICE-style additive coupling on the two column halves: b' = b + m(a)
        a, b = x[:, :8], x[:, 8:]
        b = b + jnp.tanh(a @ w["w1"] + w["c"]) @ w["w2"]
        return jnp.concatenate([a, b], axis=1)

    def elementwise(x, p):
        x = x * jnp.exp(0.1 * p) + jnp.tanh(p)
        x = jnp.sinh(0.5 * jnp.arcsinh(x) + 0.1)
        x = jnp.log1p(jnp.exp(x))
        return x - jnp.tanh(2.0 * p)

    rng = np.random.default_rng(0)
    w = {"w1": rng.standard_normal((8, 8)) / 3, "c": rng.standard_normal(8),
         "w2": rng.standard_normal((8, 8)) / 3}
    p_host = rng.standard_normal((8, 16))
    x_host = rng.standard_normal((8, 16))

    for axis_name, spec in (("rows", P("d", None)), ("cols", P(None, "d"))):
        sh = NamedSharding(mesh, spec)
        x = jax.device_put(x_host, sh)
        assert len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated
        for name, f, p in (("additive_coupling", additive_coupling, w),
                           ("elementwise", elementwise, jax.device_put(p_host, sh))):
            y = jax.jit(f)(x, p)
            x_rec = jax.jit(jr.reverse(f))(y, p)
            err = float(jnp.max(jnp.abs(x_rec - x)) / jnp.max(jnp.abs(x)))
            print("CASE " + json.dumps({
                "case": f"{name}-{axis_name}",
                "rel_err": err,
                "shape": list(x_rec.shape), "dtype": str(x_rec.dtype),
                "x_sharding": str(x.sharding), "y_sharding": str(y.sharding),
                "x_rec_sharding": str(x_rec.sharding),
                "n_devices": len(x_rec.sharding.device_set),
                "fully_replicated": bool(x_rec.sharding.is_fully_replicated),
                "shard_shapes": sorted({tuple(s.data.shape) for s in x_rec.addressable_shards}),
                "input_shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards}),
            }), flush=True)
        # reversible gradients of a 20-step coupling loop, against jax.grad
        def loop(x, w):
            return jax.lax.fori_loop(0, 20, lambda i, x: additive_coupling(x, w), x)

        def loss(f):
            return lambda x, w: jnp.sum(jnp.sin(f(x, w)))

        g_ref = jax.jit(jax.grad(loss(loop), argnums=(0, 1)))(x, w)
        g = jax.jit(jax.grad(loss(jr.reversible(loop)), argnums=(0, 1)))(x, w)
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
                  for a, b in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g)))
        print("CASE " + json.dumps({
            "case": f"reversible_grad-{axis_name}", "rel_err": err,
            "n_devices": len(g[0].sharding.device_set),
            "fully_replicated": bool(g[0].sharding.is_fully_replicated),
        }), flush=True)
    # nonlinear groups (elimination, Newton) on states sharded over the 4 devices
    import programs.nonlinear as nlp
    sh1 = NamedSharding(mesh, P("d"))
    for name, (fun, s, p) in nlp.cases().items():
        s = jax.tree_util.tree_map(lambda v: jax.device_put(jnp.asarray(v), sh1), s)
        y = jax.jit(fun)(s, p)
        back = jax.jit(jr.reverse(fun))(y, p)
        rt = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                 zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(s)))
        loss = lambda f: lambda s, p: sum(jnp.sum(jnp.sin(o) * (k + 1.0)) for k, o in
                                          enumerate(jax.tree_util.tree_leaves(f(s, p))))
        g_ref = jax.jit(jax.grad(loss(fun), argnums=(0, 1)))(s, p)
        g = jax.jit(jax.grad(loss(jr.reversible(fun)), argnums=(0, 1)))(s, p)
        scale = max(float(jnp.max(jnp.abs(a))) for a in jax.tree_util.tree_leaves(g_ref))
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                  zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g))) / scale
        leaf = jax.tree_util.tree_leaves(back)[0]
        print("CASE " + json.dumps({"case": "nonlinear-" + name, "round_trip": rt,
                                    "rel_err": err,
                                    "n_devices": len(leaf.sharding.device_set)}), flush=True)
    print("MARKER", flush=True)
""").replace("MARKER", MARKER)

CASES = ["additive_coupling-rows", "elementwise-rows", "additive_coupling-cols", "elementwise-cols"]


@pytest.fixture(scope="module")
def sharded_run():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    ).strip()
    env["JAX_ENABLE_X64"] = "1"
    env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.abspath(__file__))  # the shared nonlinear programs
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=900
    )
    msg = f"returncode {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CASE "):
            r = json.loads(line[len("CASE ") :])
            results[r["case"]] = r
    return proc, results, msg


@pytest.mark.parametrize("case", ["reversible_grad-rows", "reversible_grad-cols"])
@pytest.mark.slow
def test_sharded_reversible_grad(sharded_run, case):
    r, msg = _case(sharded_run, case)
    assert r["rel_err"] <= 1e-10, msg
    assert r["n_devices"] == 4, msg


def _case(sharded_run, case):
    proc, results, msg = sharded_run
    assert proc.returncode == 0, msg
    assert MARKER in proc.stdout, msg
    assert case in results, msg
    return results[case], msg


NONLINEAR = [
    "simultaneous-50",
    "simultaneous-1000",
    "heun-1000",
    "residual",
    "logit",
    "midpoint-100",
]


@pytest.mark.parametrize("name", NONLINEAR)
@pytest.mark.slow
def test_sharded_nonlinear_groups(sharded_run, name):
    """Round trips (`programs.nonlinear.ROUND_TRIP`: 1e-12 by elimination, 1e-10 by Newton but
    the expanding 50-step map) and reversible gradients (1e-9) of the nonlinear-lump programs
    on states sharded over 4 devices."""
    r, msg = _case(sharded_run, "nonlinear-" + name)
    assert r["round_trip"] <= ROUND_TRIP.get(name, 1e-10), msg
    assert r["rel_err"] <= 1e-9, msg
    assert r["n_devices"] == 4, msg


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_sharded_round_trip(sharded_run, case):
    r, msg = _case(sharded_run, case)
    assert r["shape"] == [8, 16] and r["dtype"] == "float64", msg
    assert r["rel_err"] <= 1e-12, msg


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_sharded_result_stays_sharded(sharded_run, case):
    r, msg = _case(sharded_run, case)
    print(f"{case}: x_rec.sharding = {r['x_rec_sharding']}")
    assert r["n_devices"] == 4, msg
    assert not r["fully_replicated"], msg
    # each device holds one shard of the recovered state, shaped like the input's shards
    assert r["shard_shapes"] == r["input_shard_shapes"], msg
