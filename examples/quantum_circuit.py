"""A variational quantum circuit trained with gradients whose memory does not grow with depth.

The circuit: `depth` layers, each a parametrised RY and RZ rotation on every qubit followed by
a ladder of CNOTs, applied to |0…0> with `jr.apply_gate` (a reshape and contraction on the
qubit axes, never a 2ⁿ × 2ⁿ matrix). The loss is the energy of a transverse-field Ising chain,
<ψ|H|ψ> with H = Σ Z_i Z_{i+1} + g Σ X_i.

The gradient goes through `jr.reversible(circuit)`: every gate is unitary, so the backward
pass rebuilds each layer's input state by applying the adjoint gates to its output instead of
storing it. That is the "adjoint method" of PennyLane and Yao, here derived from the circuit's
own jaxpr. `jax.grad` stores a state per gate.

    python examples/quantum_circuit.py     # about 2 minutes on a 2-core CPU
    python examples/quantum_circuit.py --qubits 4 --layers 3 --steps 60   # smaller

Most of the time is XLA compiling the gradient programs (nine of them: the check against
jax.grad, three ways at two depths for the memory figures, the training step), each with a
layer's gates unrolled.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

jax.config.update("jax_enable_x64", True)

import jaxrev as jr  # noqa: E402

X = jnp.array([[0, 1], [1, 0]])
G_FIELD = 1.0


def ry(theta: jax.Array, dtype) -> jax.Array:
    c, s = jnp.cos(theta / 2), jnp.sin(theta / 2)
    return jnp.array([[c, -s], [s, c]]).astype(dtype)


def rz(theta: jax.Array, dtype) -> jax.Array:
    e = jnp.exp(-0.5j * theta)
    return jnp.array([[e, 0], [0, jnp.conj(e)]]).astype(dtype)


def layer(state: jax.Array, theta: jax.Array) -> jax.Array:
    """RY(θ_q0) RZ(θ_q1) on every qubit q, then CNOT(q → q+1) down the chain."""
    n = theta.shape[0]
    for q in range(n):
        state = jr.apply_gate(state, ry(theta[q, 0], state.dtype), q)
        state = jr.apply_gate(state, rz(theta[q, 1], state.dtype), q)
    for q in range(n - 1):
        state = jr.apply_gate(state, X.astype(state.dtype), q + 1, ctrl_locs=q)
    return state


def circuit(state: jax.Array, params: jax.Array) -> jax.Array:
    """`params` has shape (depth, n, 2); one `scan` over the layers."""
    return jax.lax.scan(lambda s, th: (layer(s, th), None), state, params)[0]


def ising_energy(state: jax.Array) -> jax.Array:
    """<ψ| Σ Z_i Z_{i+1} + g Σ X_i |ψ>, real."""
    n = int(np.log2(state.shape[-1]))
    probs = (jnp.abs(state) ** 2).reshape((2,) * n)
    z = jnp.array([1.0, -1.0])
    zz = 0.0
    for i in range(n - 1):
        # Z_i Z_{i+1} is diagonal: +1 where the two bits agree, -1 where they differ
        zz_diag = (z[:, None] * z[None, :]).reshape([2 if k in (i, i + 1) else 1 for k in range(n)])
        zz = zz + jnp.sum(probs * zz_diag)
    xs = sum(
        jnp.real(jnp.vdot(state, jr.apply_gate(state, X.astype(state.dtype), i))) for i in range(n)
    )
    return zz + G_FIELD * xs


def zero_state(n: int, dtype=jnp.complex128) -> jax.Array:
    return jnp.zeros(2**n, dtype).at[0].set(1)


def loss_fn(params: jax.Array, n: int, reversible: bool = True, **options) -> jax.Array:
    """The circuit's energy; `reversible`: through `jr.reversible(circuit, **options)`."""
    run = jr.reversible(circuit, **options) if reversible else circuit
    return ising_energy(run(zero_state(n), params))


def main(n: int = 8, depth: int = 6, steps: int = 150) -> None:
    params = 0.1 * jax.random.normal(jax.random.PRNGKey(0), (depth, n, 2))
    g_rev = jax.jit(jax.grad(lambda p: loss_fn(p, n)))(params)
    g_ref = jax.jit(jax.grad(lambda p: loss_fn(p, n, reversible=False)))(params)
    err = float(jnp.max(jnp.abs(g_rev - g_ref)) / jnp.max(jnp.abs(g_ref)))
    print(f"{n} qubits, {depth} layers: gradient vs jax.grad, relative error: {err:.1e}")

    # scratch memory of the gradient at two depths: flat for the fully reversible mode
    # (checkpoint_every=None), linear for jax.grad; the default also stores the state at the
    # start of about sqrt(depth) segments, to check and repair drift (docs/reversible.md)
    def temp(depth, reversible, **options):
        p = jnp.zeros((depth, n, 2))
        loss = lambda p: loss_fn(p, n, reversible, **options)
        c = jax.jit(jax.grad(loss)).lower(p).compile()
        return c.memory_analysis().temp_size_in_bytes

    for d in (10, 40):
        print(
            f"depth {d}: gradient temp memory: reversible "
            f"{temp(d, True, checkpoint_every=None):,} B, jax.grad {temp(d, False):,} B, "
            f"default reversible (checkpoints) {temp(d, True):,} B"
        )

    opt = optax.adam(0.05)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: loss_fn(p, n))(params)
        u, state = opt.update(g, state, params)
        return optax.apply_updates(params, u), state, loss

    first = None
    for _ in range(steps):
        params, state, loss = step(params, state)
        first = float(loss) if first is None else first
    e0 = exact_ground_energy(n)
    print(
        f"energy went from {first:.4f} to {float(loss):.4f} in {steps} Adam steps "
        f"(exact ground state {e0:.4f})"
    )
    # undo the trained circuit: reverse(circuit) maps its output back to |0…0>
    out = circuit(zero_state(n), params)
    back = jr.reverse(circuit)(out, params)
    print(
        f"reverse(circuit) round-trip max error: "
        f"{float(jnp.max(jnp.abs(back - zero_state(n)))):.1e}"
    )


def exact_ground_energy(n: int) -> float:
    """Lowest eigenvalue of the Ising Hamiltonian, by a dense 2ⁿ × 2ⁿ construction."""
    Zm, Xm, Id = np.diag([1.0, -1.0]), np.array([[0.0, 1.0], [1.0, 0.0]]), np.eye(2)

    def op(single: dict) -> np.ndarray:
        out = np.ones((1, 1))
        for q in range(n):
            out = np.kron(out, single.get(q, Id))
        return out

    H = sum(op({i: Zm, i + 1: Zm}) for i in range(n - 1)) + G_FIELD * sum(
        op({i: Xm}) for i in range(n)
    )
    return float(np.linalg.eigvalsh(H)[0])


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qubits", type=int, default=8)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=150, help="Adam steps")
    args = ap.parse_args()
    main(args.qubits, args.layers, args.steps)
