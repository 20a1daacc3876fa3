"""jaxrev's primitives: `rot`, `swap`, `apply_gate` against dense references, their inverses,
derivatives to order 2, transposes, batching, jit, and reversible gradients of circuits."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from jax.test_util import check_grads

import jaxrev as jr

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from quantum_circuit import circuit, ising_energy, zero_state  # noqa: E402

THIS_FILE = __file__
rng = np.random.default_rng(0)


def _line_of(tag):
    with open(THIS_FILE) as f:
        return next(i for i, line in enumerate(f, 1) if line.rstrip().endswith("# " + tag))


def random_unitary(k, dtype=np.complex128):
    z = rng.standard_normal((2**k, 2**k)) + 1j * rng.standard_normal((2**k, 2**k))
    q, r = np.linalg.qr(z)
    return (q * (np.diag(r) / np.abs(np.diag(r)))).astype(dtype)


def random_state(n, dtype=np.complex128, batch=()):
    z = rng.standard_normal(batch + (2**n,)) + 1j * rng.standard_normal(batch + (2**n,))
    return (z / np.linalg.norm(z, axis=-1, keepdims=True)).astype(dtype)


def dense_gate(n, M, locs, ctrl_locs=(), ctrl_vals=None):
    """The 2ⁿ x 2ⁿ operator, built basis state by basis state (qubit 0 most significant)."""
    ctrl_vals = ctrl_vals if ctrl_vals is not None else (1,) * len(ctrl_locs)
    U = np.zeros((2**n, 2**n), dtype=np.asarray(M).dtype)
    for j in range(2**n):
        bits = [(j >> (n - 1 - q)) & 1 for q in range(n)]
        if any(bits[c] != v for c, v in zip(ctrl_locs, ctrl_vals)):
            U[j, j] = 1
            continue
        b = sum(bits[q] << (len(locs) - 1 - i) for i, q in enumerate(locs))
        for a in range(2 ** len(locs)):
            out = list(bits)
            for i, q in enumerate(locs):
                out[q] = (a >> (len(locs) - 1 - i)) & 1
            i_out = sum(bit << (n - 1 - q) for q, bit in enumerate(out))
            U[i_out, j] += M[a, b]
    return U


def random_case(n):
    k = int(rng.integers(1, min(3, n) + 1))
    qubits = rng.permutation(n)
    locs = tuple(int(q) for q in qubits[:k])
    c = int(rng.integers(0, min(2, n - k) + 1))
    ctrl_locs = tuple(int(q) for q in qubits[k : k + c])
    ctrl_vals = tuple(int(v) for v in rng.integers(0, 2, c))
    return locs, ctrl_locs, ctrl_vals


# ------------------------------------------------------------------ apply_gate


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6])
def test_apply_gate_matches_dense_kronecker_construction(n):
    for _ in range(6):
        locs, ctrl_locs, ctrl_vals = random_case(n)
        M = random_unitary(len(locs))
        psi = random_state(n)
        got = jr.apply_gate(psi, M, locs, ctrl_locs, ctrl_vals)
        want = dense_gate(n, M, locs, ctrl_locs, ctrl_vals) @ psi
        assert rel_error(got, want) < 1e-13, (locs, ctrl_locs, ctrl_vals)
        # reverse undoes it
        back = jr.reverse(lambda s: jr.apply_gate(s, M, locs, ctrl_locs, ctrl_vals))(got)
        assert rel_error(back, psi) < 1e-13


def test_apply_gate_kron_of_adjacent_qubits_and_complex64():
    M = random_unitary(2, np.complex64)
    psi = random_state(4, np.complex64)
    got = jr.apply_gate(psi, M, (1, 2))
    want = np.kron(np.kron(np.eye(2), M), np.eye(2)) @ psi
    assert got.dtype == jnp.complex64 and rel_error(got, want) < 1e-5


def test_apply_gate_non_unitary_inverse_and_errors():
    M = np.array([[2.0, 1.0], [0.0, 0.5]], np.complex128)
    psi = random_state(3)
    f = lambda s: jr.apply_gate(s, M, 1, unitary=False)
    assert rel_error(jr.reverse(f)(f(psi)), psi) < 1e-13
    with pytest.raises(ValueError, match="2x2 matrix"):
        jr.apply_gate(psi, np.eye(4), 0)
    with pytest.raises(ValueError, match="distinct"):
        jr.apply_gate(psi, np.eye(2), 0, ctrl_locs=0)
    with pytest.raises(ValueError, match="qubits must lie in 0..2"):
        jr.apply_gate(psi, np.eye(2), 3)
    with pytest.raises(ValueError, match="2\\*\\*n"):
        jr.apply_gate(np.ones(6), np.eye(2), 0)
    with pytest.raises(ValueError, match="ctrl_vals"):
        jr.apply_gate(psi, np.eye(2), 0, ctrl_locs=1, ctrl_vals=2)


def test_reverse_with_an_unknown_matrix_names_the_primitive_and_line():
    psi = random_state(2)

    def f(m):  # the state is the gate's matrix, flattened
        return jr.apply_gate(psi, m.reshape(2, 2), 0)  # UNKNOWN-MATRIX

    with pytest.raises(jr.NotInvertibleError) as ei:
        jr.reverse(f)(jnp.eye(2, dtype=jnp.complex128).ravel())
    msg = str(ei.value)
    assert "jaxrev_apply_gate" in msg and "matrix is unknown" in msg
    assert f"test_primitives.py:{_line_of('UNKNOWN-MATRIX')}" in msg


@pytest.mark.parametrize("ctrl", [(), (2,)])
def test_apply_gate_grads_to_order_two(ctrl):
    M = random_unitary(1)
    psi = random_state(3)
    f = lambda s, m: jr.apply_gate(s, m, 0, ctrl_locs=ctrl)
    check_grads(f, (psi, M), order=2, modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)
    # a real loss of both: gradients against finite differences too
    loss = lambda s, m: jnp.sum(jnp.abs(f(s, m) * jnp.arange(1, 9)) ** 2)
    check_grads(loss, (psi, M), order=2, modes=("rev",), atol=1e-6, rtol=1e-6)


def test_apply_gate_transpose_is_the_transposed_matrix():
    M = random_unitary(2)
    psi = random_state(4)
    f = lambda s: jr.apply_gate(s, M, (3, 0), ctrl_locs=1, ctrl_vals=0)
    (t,) = jax.linear_transpose(f, psi)(psi)
    U = dense_gate(4, M, (3, 0), (1,), (0,))
    assert rel_error(t, U.T @ psi) < 1e-13


def test_apply_gate_vmap_over_states_and_matrices_under_jit():
    states = random_state(4, batch=(3,))
    mats = np.stack([random_unitary(1) for _ in range(3)])
    M = mats[0]
    g = lambda s, m: jr.apply_gate(s, m, 2, ctrl_locs=0)
    ref = lambda s, m: dense_gate(4, m, (2,), (0,)) @ s
    out = jax.jit(jax.vmap(g, (0, None)))(states, M)
    assert all(rel_error(o, ref(s, M)) < 1e-13 for o, s in zip(out, states))
    out = jax.jit(jax.vmap(g, (None, 0)))(states[0], mats)
    assert all(rel_error(o, ref(states[0], m)) < 1e-13 for o, m in zip(out, mats))
    out = jax.jit(jax.vmap(g, (0, 0)))(states, mats)
    assert all(rel_error(o, ref(s, m)) < 1e-13 for o, s, m in zip(out, states, mats))
    # nested: a batch of batches, the matrix per outer example only
    out = jax.vmap(jax.vmap(g, (0, None)), (0, 0))(states[None].repeat(2, 0), mats[:2])
    assert all(
        rel_error(out[i, j], ref(states[j], mats[i])) < 1e-13 for i in range(2) for j in range(3)
    )
    # derivatives of a vmapped gate
    loss = lambda ss, ms: jnp.sum(jnp.abs(jax.vmap(g)(ss, ms)) ** 4)
    gs = jax.grad(loss, argnums=(0, 1))(states, mats)
    gs_ref = [
        jax.grad(lambda s, m: jnp.sum(jnp.abs(g(s, m)) ** 4), argnums=(0, 1))(s, m)
        for s, m in zip(states, mats)
    ]
    assert rel_error(gs[1], np.stack([r[1] for r in gs_ref])) < 1e-12


# ------------------------------------------------------------------ rot and swap


def test_rot_round_trip_and_values():
    a, b = rng.standard_normal(5), rng.standard_normal(5)
    th = rng.standard_normal(5)
    ra, rb = jr.rot(a, b, th)
    assert rel_error(ra, a * np.cos(th) - b * np.sin(th)) < 1e-15
    assert rel_error(rb, a * np.sin(th) + b * np.cos(th)) < 1e-15
    f = lambda ab, th: jr.rot(ab[0], ab[1], th)
    back = jr.reverse(f)((ra, rb), th)
    assert rel_error(back[0], a) < 1e-12 and rel_error(back[1], b) < 1e-12
    # a long chain of rotations round-trips too
    chain = lambda ab, th: jax.lax.fori_loop(0, 1000, lambda i, s: f(s, th), ab)
    back = jr.reverse(chain)(chain((a, b), th), th)
    assert rel_error(back[0], a) < 1e-12 and rel_error(back[1], b) < 1e-12


def test_rot_grads_to_order_two_complex_and_scalar_theta():
    a, b = rng.standard_normal(3), rng.standard_normal(3)
    check_grads(
        lambda a, b, t: jr.rot(a, b, t),
        (a, b, rng.standard_normal(3)),
        order=2,
        modes=("fwd", "rev"),
    )
    check_grads(lambda a, b, t: jr.rot(a, b, t), (a, b, 0.7), order=2, modes=("fwd", "rev"))
    ac = a + 1j * rng.standard_normal(3)
    bc = b + 1j * rng.standard_normal(3)
    check_grads(lambda a, b, t: jr.rot(a, b, t), (ac, bc, 0.7), order=2, modes=("fwd", "rev"))


def test_rot_and_swap_vmap_jit_and_inverse_jvp():
    a, b = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    th = rng.standard_normal(4)
    out = jax.jit(jax.vmap(jr.rot, (0, 0, 0)))(a, b, th)
    ref = [jr.rot(a[i], b[i], th[i]) for i in range(4)]
    assert all(rel_error(out[0][i], ref[i][0]) < 1e-15 for i in range(4))
    out = jax.vmap(jr.rot, (0, None, None))(a, b[0], 0.3)
    assert rel_error(out[1][2], jr.rot(a[2], b[0], 0.3)[1]) < 1e-15
    s = jax.vmap(jr.swap, (0, None))(a, b[0])
    assert rel_error(s[0], np.broadcast_to(b[0], a.shape)) == 0 and rel_error(s[1], a) == 0
    # inverse_jvp through the registered inverse-JVP rules: J of rot is R(θ), so J⁻¹v = R(−θ)v
    f = lambda ab: jr.swap(*jr.rot(ab[0], ab[1], 0.4))
    v = (jnp.asarray(rng.standard_normal(3)), jnp.asarray(rng.standard_normal(3)))
    _, (t,) = jr.inverse_jvp(f, ((a[0], b[0]),), v, method="reverse")
    assert rel_error(t[0], jr.rot(v[1], v[0], -0.4)[0]) < 1e-14
    assert rel_error(t[1], jr.rot(v[1], v[0], -0.4)[1]) < 1e-14
    check_grads(jr.swap, (a[0], b[0]), order=2, modes=("fwd", "rev"))
    with pytest.raises(ValueError, match="one shape"):
        jr.rot(a, b[0], 0.1)


def test_rot_with_unknown_angle_names_the_line():
    def f(th):
        return jr.rot(jnp.ones(2), jnp.zeros(2), th)  # UNKNOWN-ANGLE

    with pytest.raises(jr.NotInvertibleError) as ei:
        jr.reverse(lambda th: f(th)[0])(jnp.ones(2))
    assert "jaxrev_rot" in str(ei.value)
    assert f"test_primitives.py:{_line_of('UNKNOWN-ANGLE')}" in str(ei.value)


# ------------------------------------------------------------------ circuits


def test_reversible_circuit_gradient_equals_jax_grad_and_memory_is_flat():
    n = 5
    params = jnp.asarray(0.3 * rng.standard_normal((4, n, 2)))
    psi0 = zero_state(n)
    loss = lambda run: lambda p: ising_energy(run(psi0, p))
    g_rev = jax.jit(jax.grad(loss(jr.reversible(circuit))))(params)  # eager dispatch: slow
    g_ref = jax.grad(loss(circuit))(params)
    assert rel_error(g_rev, g_ref) < 1e-9
    assert jr.memory_report(circuit, psi0, params, checkpoint_every=None).total_bytes == 0

    def temp(depth, run):
        p = jnp.zeros((depth, n, 2))
        c = jax.jit(jax.grad(loss(run))).lower(p).compile()
        return c.memory_analysis().temp_size_in_bytes

    full = jr.reversible(circuit, checkpoint_every=None)  # fully reversible: flat
    assert temp(8, full) == temp(32, full)
    assert temp(32, circuit) > 3 * temp(8, circuit)
