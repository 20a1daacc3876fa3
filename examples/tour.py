"""A tour of jaxrev: run JAX programs backwards, and differentiate them without a tape.

Run with `python examples/tour.py`. Each section prints a real result computed just now.
"""

import jax

# Round trips are judged against float64 rounding, so switch it on before any array exists.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

import jaxrev as jr  # noqa: E402


def section(title):
    print(f"\n== {title} ==")


# --------------------------------------------------------------------------------------------
# 1. An affine coupling layer (RealNVP). Half of the vector passes through unchanged and
#    parameterises an invertible affine map of the other half, so the layer is invertible
#    whatever the networks `s` and `t` are: nobody has to write the inverse by hand.
section("1. affine coupling layer")


def coupling(x, params):
    w_h, b_h, w_s, w_t = params
    x1, x2 = jnp.split(x, 2)
    h = jnp.tanh(w_h @ x1 + b_h)  # a small network of x1: re-evaluated backwards, never inverted
    log_s = jnp.tanh(w_s @ h)  # bounded log-scale: the scale exp(log_s) never reaches zero
    y2 = x2 * jnp.exp(log_s) + w_t @ h
    return jnp.concatenate([x1, y2])


k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
n, hidden = 8, 16
params = (
    jax.random.normal(k1, (hidden, n // 2)),
    jnp.zeros(hidden),
    jax.random.normal(k2, (n // 2, hidden)) / 4,
    jax.random.normal(k3, (n // 2, hidden)),
)
x = jax.random.normal(k4, (n,))
y = coupling(x, params)
# `params` is a read-only parameter: argnums=0 (the default) makes only `x` the state.
x_back = jr.reverse(coupling)(y, params)
print("coupling round-trip max error:", float(jnp.max(jnp.abs(x_back - x))))
# Stacking layers with swapped halves still inverts: reverse sees one traced program.
flip = lambda v: jnp.concatenate([v[n // 2 :], v[: n // 2]])
flow = lambda v, p: coupling(flip(coupling(v, p)), p)
print(
    "two-layer flow round-trip max error:",
    float(jnp.max(jnp.abs(jr.reverse(flow)(flow(x, params), params) - x))),
)

# --------------------------------------------------------------------------------------------
# 2. A leapfrog integrator run backwards. Each leapfrog sub-step adds a function of the
#    *other* variable (q += dt*p, p -= dt*F(q)), so each is exactly undoable; a static
#    fori_loop inverts to the same loop run in reverse. No trajectory is stored.
section("2. leapfrog integrator (anharmonic chain), 200 steps backwards")

N_MASSES, DT, STEPS = 6, 0.05, 200


def force(q):
    # Fixed-end chain of unit masses with quartic (FPU-beta) springs.
    d = jnp.diff(jnp.concatenate([jnp.zeros(1), q, jnp.zeros(1)]))
    t = d + d**3
    return t[1:] - t[:-1]


def energy(q, p):
    d = jnp.diff(jnp.concatenate([jnp.zeros(1), q, jnp.zeros(1)]))
    return 0.5 * jnp.sum(p**2) + jnp.sum(0.5 * d**2 + 0.25 * d**4)


def leapfrog(state, dt):
    def step(_, s):
        q, p = s
        p = p + 0.5 * dt * force(q)
        q = q + dt * p
        p = p + 0.5 * dt * force(q)
        return q, p

    return lax.fori_loop(0, STEPS, step, state)


q0 = jnp.sin(jnp.linspace(0.3, 2.5, N_MASSES))
p0 = jnp.zeros(N_MASSES)
qT, pT = leapfrog((q0, p0), DT)
q_rec, p_rec = jr.reverse(leapfrog)((qT, pT), DT)
print("final state moved by:", float(jnp.max(jnp.abs(qT - q0))))
print(
    "recovered initial conditions max error:",
    float(max(jnp.max(jnp.abs(q_rec - q0)), jnp.max(jnp.abs(p_rec - p0)))),
)
print(
    f"energy: initial {float(energy(q0, p0)):.6f}, final {float(energy(qT, pT)):.6f}, "
    f"recovered {float(energy(q_rec, p_rec)):.6f}"
)
# reverse composes with jit: the backward program is ordinary JAX.
q_jit, _ = jax.jit(jr.reverse(leapfrog))((qT, pT), DT)
print("under jax.jit, max error:", float(jnp.max(jnp.abs(q_jit - q0))))

# --------------------------------------------------------------------------------------------
# 3. A while loop run backwards. A plain lax.while_loop forgets its trip count; jr.while_loop
#    takes a post condition (false at the start, true after every iteration) so the backward
#    loop knows when to stop from the final value alone.
section("3. jr.while_loop with a post condition")


def grow_counted(c):
    # The counter is part of the state, so the post condition `n > 0` holds after each step.
    return jr.while_loop(
        lambda c: c[1] < 100.0, lambda c: (c[0] + 1, c[1] * 2.0), c, post_fun=lambda c: c[0] > 0
    )


x0 = (jnp.int32(0), jnp.float64(3.0))
n_out, v_out = grow_counted(x0)
n_back, v_back = jr.reverse(grow_counted)((n_out, v_out))
print(f"forward: 3.0 doubled {int(n_out)} times -> {float(v_out)}")
print(f"backward: counter {int(n_back)}, value {float(v_back)}")

# --------------------------------------------------------------------------------------------
# 4. How accurate is a round trip? check_reversible runs forward and backward and names the
#    equation whose inversion adds the most floating-point error.
section("4. jr.check_reversible")
report = jr.check_reversible(coupling, x, params)
print(report)

# --------------------------------------------------------------------------------------------
# 5. Gradients without a tape. jr.reversible(f) computes the same values as f, but its gradient
#    rebuilds the trajectory by running the integrator backwards instead of storing all 200
#    steps: memory stays at one step's width however long the trajectory is.
section("5. jr.reversible: the leapfrog's gradient without storing its trajectory")


def final_energy_of_first_mass(f):
    def loss(state, dt):
        q, p = f(state, dt)
        return 0.5 * p[0] ** 2 + q[0] ** 2

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


g_ref = final_energy_of_first_mass(leapfrog)((q0, p0), DT)
g_rev = final_energy_of_first_mass(jr.reversible(leapfrog))((q0, p0), DT)
err = max(
    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(a)))
    for a, b in zip(jax.tree_util.tree_leaves(g_ref), jax.tree_util.tree_leaves(g_rev))
)
print(f"d(loss)/d(q0) = {g_rev[0][0]}")
print(f"d(loss)/d(dt) = {float(g_rev[1]):.6f}; relative difference from jax.grad: {err:.1e}")


def scratch_bytes(f):
    def loss(state, dt):
        q, p = f(state, dt)
        return jnp.sum(q**2)

    return (
        jax.jit(jax.grad(loss)).lower((q0, p0), DT).compile().memory_analysis().temp_size_in_bytes
    )


def _step(s, dt):
    q, p = s
    p = p + 0.5 * dt * force(q)
    q = q + dt * p
    return q, p + 0.5 * dt * force(q)


def long_leapfrog(s, dt):
    return lax.fori_loop(0, 20_000, lambda i, s: _step(s, dt), s)


# the default stores the carry every ⌈√T⌉ steps, to recompute a segment whose drift would
# change the gradient; checkpoint_every=None is fully reversible (flat in the steps)
print(
    f"XLA scratch memory for 20,000 steps: jax.grad {scratch_bytes(long_leapfrog):,} B, "
    f"jr.reversible {scratch_bytes(jr.reversible(long_leapfrog)):,} B, fully reversible "
    f"{scratch_bytes(jr.reversible(long_leapfrog, checkpoint_every=None)):,} B"
)

# --------------------------------------------------------------------------------------------
# 6. A program that loses information cannot be reversed, and the error says where and why.
section("6. an error on purpose: relu is not invertible")


def relu_layer(x):
    # relu sends every negative input to 0: from an output of 0 the input cannot be recovered.
    return jnp.maximum(x, 0.0)


try:
    jr.reverse(relu_layer)(jnp.array([0.5, 0.0, 2.0]))
except jr.NotInvertibleError as e:
    print(f"NotInvertibleError (primitive {e.primitive!r}, line {e.line}):")
    print(e)

print("\ntour finished")
