"""Gradients through thousands of leapfrog steps of an N-body system, in constant memory.

Run with `python examples/nbody.py`. A cluster of 32 stars under softened gravity is integrated
with kick-drift-kick leapfrog (p += dt/2 F(q); q += dt p; p += dt/2 F(q)). Each sub-step adds a
function of the *other* variable, so it is undone by subtracting it again: `jr.reversible` makes
`jax.grad` rebuild the trajectory by integrating backwards from the final state instead of
storing every step. Plain `jax.grad` of the same loop keeps each step's pairwise arrays, so its
memory grows with the number of steps; the reversible gradient's does not.
"""

import time

import jax

# Rebuilding a chaotic trajectory backwards amplifies rounding error: use float64.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxrev as jr  # noqa: E402

N, DIM, DT, SOFTENING = 32, 2, 0.01, 0.5


def force(q):
    # Plummer-softened gravity, unit masses, G = 1/N: the softening keeps the force smooth
    # (no singular close encounters), which keeps both the dynamics and its gradient tame.
    d = q[None, :, :] - q[:, None, :]  # d[i, j] = q_j - q_i
    r2 = jnp.sum(d**2, axis=-1) + SOFTENING**2
    return jnp.sum(d * r2[..., None] ** -1.5, axis=1) / N


def energy(q, p):
    d = q[None, :, :] - q[:, None, :]
    r = jnp.sqrt(jnp.sum(d**2, axis=-1) + SOFTENING**2)
    potential = -jnp.sum(jnp.triu(1.0 / r, k=1)) / N
    return 0.5 * jnp.sum(p**2) + potential


def kick_drift_kick(_, state):
    q, p = state
    p = p + 0.5 * DT * force(q)
    q = q + DT * p
    p = p + 0.5 * DT * force(q)
    return q, p


def trajectory(steps):
    # `steps` is a Python int closed over: a static fori_loop is a scan, which reversible runs
    # backwards as a scan. (A traced bound would make it a while loop, which also works but
    # stores its trip count.)
    def leapfrog(state):
        return lax.fori_loop(0, steps, kick_drift_kick, state)

    return leapfrog


def final_kinetic_energy(integrate):
    return lambda state: 0.5 * jnp.sum(integrate(state)[1] ** 2)


def compiled(f, *args):
    # One compile serves both to run f and to read XLA's temporary-buffer size.
    c = jax.jit(f).lower(*args).compile()
    return c(*args), c.memory_analysis().temp_size_in_bytes


def rel_error(a, b):
    a, b = (jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def main():
    t0 = time.perf_counter()
    kq, kp = jax.random.split(jax.random.PRNGKey(0))
    state = (jax.random.normal(kq, (N, DIM)), 0.3 * jax.random.normal(kp, (N, DIM)))
    print(f"{N} stars in {DIM}-D, dt = {DT}, softening {SOFTENING}")

    for steps in (1000, 4000):
        plain = trajectory(steps)
        # same function, tape-free gradient; fully reversible (the default also stores √T
        # checkpoints, to repair drift: leapfrog is symplectic, its backward run does not drift)
        rev = jr.reversible(plain, checkpoint_every=None)
        qT, pT = jax.jit(rev)(state)
        drift = abs(float(energy(qT, pT) / energy(*state)) - 1)
        # d(final kinetic energy) / d(initial positions and velocities), both ways
        g_rev, m_rev = compiled(jax.grad(final_kinetic_energy(rev)), state)
        g_ref, m_ref = compiled(jax.grad(final_kinetic_energy(plain)), state)
        print(f"\n{steps} steps (t = {steps * DT:g}): relative energy drift {drift:.1e}")
        err = rel_error(g_rev, g_ref)
        print(f"  {steps} steps gradient vs jax.grad, relative error: {err:.2e}")
        print(f"  {steps} steps temp memory: reversible {m_rev} B, jax.grad {m_ref} B")
        print(f"  {steps} steps memory ratio (reversible / jax.grad): {m_rev / m_ref:.2e}")

    # What reversible keeps besides inputs and outputs: only the loop counter's final value
    # (the trajectory's own outputs do not say how many steps were taken).
    print("\n" + str(jr.memory_report(trajectory(4000), state)))
    print(f"nbody finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
