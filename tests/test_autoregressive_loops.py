"""Loops that overwrite one element of their carry per step with a function of the others,
through a network whose zeros are known when traced: a masked autoregressive flow's inverse as
flowjax writes it (`MaskedAutoregressive.inverse_and_log_det`: a `scan` whose step sets
element `rank` of the carry from a masked MLP of the whole carry). The element a step
overwrites is a window at a computed index; the network's outputs that read it are a `Spread`
of that window (`knowledge/regions.py`), decided at every iteration of the loop. Written here
as a user would write it, without flowjax: its inverse is the masked autoregressive map in
closed form, and its log-det the dense Jacobian's.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import all_eqns
from jax import lax

import jaxrev as jr

jax.config.update("jax_enable_x64", True)

HERE = os.path.basename(__file__)
D, H = 5, 12  # dimensions, hidden units


def _masks(d: int, h: int, strict_diag: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """MADE's masks: hidden unit j has rank j % (d - 1); output i reads hidden units of rank
    < i (strictly autoregressive) or <= i (a network that also reads element i itself)."""
    in_rank = np.arange(d)
    hid_rank = np.arange(h) % (d - 1)
    m1 = hid_rank[:, None] >= in_rank[None, :]
    out = np.repeat(np.arange(d), 2)  # a shift and a log-scale per dimension
    m2 = out[:, None] > hid_rank[None, :] if strict_diag else out[:, None] >= hid_rank[None, :]
    return m1, m2


def _params(key: jax.Array, d: int = D, h: int = H, strict: bool = True) -> dict:
    k1, k2, k3, k4 = jax.random.split(key, 4)
    m1, m2 = _masks(d, h, strict)
    return {
        "w1": 0.5 * jax.random.normal(k1, (h, d)),
        "b1": 0.1 * jax.random.normal(k2, (h,)),
        "w2": 0.3 * jax.random.normal(k3, (2 * d, h)),
        "b2": 0.1 * jax.random.normal(k4, (2 * d,)),
        "m1": jnp.asarray(m1),
        "m2": jnp.asarray(m2),
    }


def _shift_log_scale(p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The masked MLP, its weights masked as flowjax (paramax) does: ``where(mask, w, 0)``."""
    w1 = jnp.where(p["m1"], p["w1"], 0)
    w2 = jnp.where(p["m2"], p["w2"], 0)
    out = w2 @ jnp.tanh(w1 @ x + p["b1"]) + p["b2"]
    out = out.reshape(-1, 2)
    return out[:, 0], 0.5 * jnp.tanh(out[:, 1])


def maf_forward(p: dict, x: jax.Array) -> jax.Array:
    """The masked autoregressive map in closed form: y = x e^s(x) + t(x)."""
    t, s = _shift_log_scale(p, x)
    return x * jnp.exp(s) + t


def maf_inverse_loop(p: dict, y: jax.Array) -> jax.Array:
    """Its inverse as flowjax writes it: element `rank` recovered at step `rank`."""

    def step(carry, _):
        z, rank = carry
        t, s = _shift_log_scale(p, z)
        x = (z - t) * jnp.exp(-s)
        return (z.at[rank].set(x[rank]), rank + 1), None

    (x, _), _ = lax.scan(step, (y, 0), None, length=y.shape[0])
    return x


def _point(seed: int = 1, d: int = D) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(seed), (d,))


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_inverse_of_the_element_loop_is_the_closed_form(how):
    p = _params(jax.random.PRNGKey(0))
    x = _point()
    y = maf_forward(p, x)
    np.testing.assert_allclose(maf_inverse_loop(p, y), x, rtol=1e-12, atol=1e-12)
    back = jr.reverse(lambda y: maf_inverse_loop(p, y))
    if how == "jit":
        back = jax.jit(back)
    if how == "vmap":
        xs = jnp.stack([x, _point(2)])
        got = jax.vmap(back)(jax.vmap(lambda x: maf_inverse_loop(p, maf_forward(p, x)))(xs))
        np.testing.assert_allclose(got, jax.vmap(lambda x: maf_forward(p, x))(xs), atol=1e-12)
        return
    # reversing the loop gives the forward map, without having it
    np.testing.assert_allclose(back(x), maf_forward(p, x), rtol=1e-12, atol=1e-12)


def test_log_dets_of_the_element_loop_against_the_dense_jacobian():
    p = _params(jax.random.PRNGKey(3))
    y = _point(4)
    f = lambda y: maf_inverse_loop(p, y)  # noqa: E731
    want = jnp.linalg.slogdet(jax.jacfwd(f)(y))[1]
    out, ld = jax.jit(jr.forward_and_slogdet(f))(y)
    np.testing.assert_allclose(out, f(y), atol=1e-12)
    np.testing.assert_allclose(ld, want, rtol=1e-10, atol=1e-10)
    x_back, ld_inv = jr.inverse_and_slogdet(f)(out)
    np.testing.assert_allclose(x_back, y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld_inv, -want, rtol=1e-10, atol=1e-10)


def test_traced_weights_with_static_masks():
    """Weights passed as arguments (traced, as while training), masked by static masks: the
    zeros of ``where(mask, w, 0)`` are known when traced whatever w is."""
    p = _params(jax.random.PRNGKey(5))
    masks = {k: p[k] for k in ("m1", "m2")}
    weights = {k: v for k, v in p.items() if k not in masks}
    x = _point(6)

    @jax.jit
    def forward(weights, x):
        return jr.reverse(lambda y: maf_inverse_loop({**weights, **masks}, y))(x)

    np.testing.assert_allclose(forward(weights, x), maf_forward(p, x), rtol=1e-12, atol=1e-12)


def test_layers_stacked_in_a_scan():
    """Two such loops in a scan over stacked layers (flowjax's `Scan` of its flows' layers):
    the masked weights differ per layer, their zeros do not (`Statics.support` handed to the
    inner loop's body)."""
    keys = jax.random.split(jax.random.PRNGKey(7), 2)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *[_params(k) for k in keys])

    def flow(y):
        def layer(z, p):
            return jnp.flip(maf_inverse_loop(p, z)), None

        return lax.scan(layer, y, stacked)[0]

    def closed_form(x):
        for i in reversed(range(2)):
            p = jax.tree.map(lambda a: a[i], stacked)
            x = maf_forward(p, jnp.flip(x))
        return x

    x = _point(8)
    np.testing.assert_allclose(flow(closed_form(x)), x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(jr.reverse(flow)(x), closed_form(x), rtol=1e-12, atol=1e-12)
    out, ld = jr.forward_and_slogdet(flow)(x)
    np.testing.assert_allclose(out, flow(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, jnp.linalg.slogdet(jax.jacfwd(flow)(x))[1], atol=1e-10)
    # each loop runs once: the layers' loop gives its outputs with its log-det, and so does
    # the element loop inside each layer (`logdet.run_forward` on the outer loop's body)
    assert _count(jax.make_jaxpr(jr.forward_and_slogdet(flow))(x).jaxpr, "scan") == 2
    # and inverted: the layers' inverse loop takes each layer's log-det from its body's
    # walk, and that walk takes the element loop's from the element loop's own inverse (no
    # loop run forward again for a log-det: the layers' inverse, and in its body the element
    # loop's counter; the element loop's iterations are undone at once, no loop)
    y = flow(x)
    back, ld_inv = jr.inverse_and_slogdet(flow)(y)
    np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld_inv, -ld, atol=1e-10)
    assert _count(jax.make_jaxpr(jr.inverse_and_slogdet(flow))(y).jaxpr, "scan") == 2


def _count(jaxpr, name: str) -> int:
    """Equations of primitive `name` at any depth."""
    return sum(e.primitive.name == name for e in all_eqns(jaxpr))


@pytest.mark.parametrize("transform", [jr.reverse, jr.inverse_and_slogdet])
def test_a_network_that_reads_the_overwritten_element_is_refused(transform):
    """Output i reading hidden units of rank i reads element i itself: the step's element is
    then not recovered from the others, and the walk says where, never a wrong value."""
    p = _params(jax.random.PRNGKey(9), strict=False)
    with pytest.raises(jr.NotInvertibleError) as info:
        transform(lambda y: maf_inverse_loop(p, y))(_point())
    msg = str(info.value)
    assert "`dynamic_slice`" in msg or "`scatter`" in msg, msg
    assert f"{HERE}:" in msg, msg


def test_masks_known_only_when_the_program_runs_are_refused():
    """Masks passed as arguments: their zeros are not known when traced, so nothing tells
    which outputs read the overwritten element: refused, naming the step."""
    p = _params(jax.random.PRNGKey(10))
    masks = {k: p[k] for k in ("m1", "m2")}
    weights = {k: v for k, v in p.items() if k not in masks}

    @jax.jit
    def forward(masks, x):
        return jr.reverse(lambda y: maf_inverse_loop({**weights, **masks}, y))(x)

    with pytest.raises(jr.NotInvertibleError) as info:
        forward(masks, _point())
    assert f"{HERE}:" in str(info.value), str(info.value)


def _conditional(seed: int) -> tuple:
    """A conditional flow's network, reading ``concatenate([z, condition])`` (a condition of
    2), and its element loop and closed form, as in `maf_inverse_loop` / `maf_forward`."""
    p = _params(jax.random.PRNGKey(seed))
    m1 = jnp.concatenate([p["m1"], jnp.ones((H, 2), bool)], axis=1)
    w1 = jnp.concatenate([p["w1"], 0.4 * jnp.ones((H, 2))], axis=1)

    def shift_log_scale(z, c):
        hidden = jnp.tanh(jnp.where(m1, w1, 0) @ jnp.concatenate([z, c]) + p["b1"])
        out = (jnp.where(p["m2"], p["w2"], 0) @ hidden + p["b2"]).reshape(-1, 2)
        return out[:, 0], 0.5 * jnp.tanh(out[:, 1])

    def loop(y, c):
        def step(carry, _):
            z, rank = carry
            t, s = shift_log_scale(z, c)
            return (z.at[rank].set(((z - t) * jnp.exp(-s))[rank]), rank + 1), None

        return lax.scan(step, (y, 0), None, length=D)[0][0]

    def closed(x, c):
        t, s = shift_log_scale(x, c)
        return x * jnp.exp(s) + t

    return loop, closed


def test_a_condition_joined_to_the_carry():
    """A conditional flow's network reads ``concatenate([z, condition])``: the overwritten
    element's window, read through the concatenation, is a spread of it (`regions.pullback`)."""
    loop, closed = _conditional(11)
    cond = jnp.array([0.3, -1.2])
    x = _point(12)
    y = closed(x, cond)
    np.testing.assert_allclose(loop(y, cond), x, atol=1e-12)
    got = jax.jit(jr.reverse(loop))(x, cond)
    np.testing.assert_allclose(got, y, rtol=1e-12, atol=1e-12)


def test_a_condition_joined_to_the_carry_log_det_undone_at_once():
    """The same conditional loop under `inverse_and_slogdet`: undone at once, its steps' log-det
    pivots are taken on the element each recovers, a window found within the spread of the
    joined network's outputs by its positions at every step (`regions.window_between`).
    Values and log-det are the closed form's and the dense Jacobian's, eager and under jit."""
    loop, closed = _conditional(38)
    cond = jnp.array([0.7, -0.4])
    x = _point(39)
    f = lambda y: loop(y, cond)  # noqa: E731
    inv = jr.inverse_and_slogdet(f)
    assert not _looped_with_net(jax.make_jaxpr(inv)(x).jaxpr)
    want = jnp.linalg.slogdet(jax.jacfwd(lambda z: closed(z, cond))(x))[1]
    for run in (inv, jax.jit(inv)):
        back, ld = run(x)
        np.testing.assert_allclose(back, closed(x, cond), rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ld, want, rtol=1e-10, atol=1e-10)


def test_pivots_of_one_equation_are_taken_once():
    # inverting the closed-form map recovers x one element per step, each through the same
    # ``x * exp(s) + t``: the log-det takes that equation's pivots once over all D elements
    # (one log of |pivot|), not once per step, and agrees with the dense Jacobian's
    p = _params(jax.random.PRNGKey(5))
    x = _point(6)
    f = lambda x: maf_forward(p, x)  # noqa: E731
    y, ld = jax.jit(jr.forward_and_slogdet(f))(x)
    np.testing.assert_allclose(y, f(x), rtol=1e-12)
    _, ref = jnp.linalg.slogdet(jax.jacfwd(f)(x))
    np.testing.assert_allclose(ld, ref, rtol=1e-10)
    jaxpr = jax.make_jaxpr(jr.forward_and_slogdet(f))(x).jaxpr
    assert _count(jaxpr, "log") == 1
    sign, ld2 = jr.slogdet_jacobian(f, x)
    np.testing.assert_allclose(ld2, ref, rtol=1e-10)
    assert sign == 1


# --------------------------------------------------------------------------- undone at once


def _run_eqns(jaxpr) -> list:
    """The equations a program runs, at any depth (of a `custom_inverse` step, its function's,
    not those of the inverse it carries for a later `reverse`)."""
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        for k, v in e.params.items():
            if e.primitive.name == "jaxrev_custom_inverse" and k != "fun_jaxpr":
                continue
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    out.extend(_run_eqns(getattr(inner, "jaxpr", inner)))
    return out


def _looped_with_net(jaxpr) -> list:
    """The loops (`scan`s) a program runs whose body evaluates a network (a `dot_general`)."""
    return [
        e
        for e in _run_eqns(jaxpr)
        if e.primitive.name == "scan"
        and any(u.primitive.name == "dot_general" for u in _run_eqns(e.params["jaxpr"].jaxpr))
    ]


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_the_element_loop_is_undone_at_once(how):
    """The log-det transforms undo the element loop's iterations all at once: each step's
    element reads only elements that earlier steps wrote, so every step is inverted from the
    loop's final carry (one pass of the network, under `vmap` over the steps), not one after
    the other (D passes). Values, log-det and derivatives are the closed form's."""
    p = _params(jax.random.PRNGKey(21))
    f = lambda y: maf_inverse_loop(p, y)  # noqa: E731
    inv = jr.inverse_and_slogdet(f)
    x = _point(22)
    out = f(x)
    assert not _looped_with_net(jax.make_jaxpr(inv)(out).jaxpr)
    want_ld = -jnp.linalg.slogdet(jax.jacfwd(f)(x))[1]
    if how == "vmap":
        xs = jnp.stack([x, _point(23), _point(24)])
        back, ld = jax.vmap(inv)(jax.vmap(f)(xs))
        np.testing.assert_allclose(back, xs, rtol=1e-12, atol=1e-12)
        return
    back, ld = (jax.jit(inv) if how == "jit" else inv)(out)
    np.testing.assert_allclose(back, x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(back, maf_forward(p, out), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, want_ld, rtol=1e-10, atol=1e-10)


def test_derivatives_through_the_loop_undone_at_once():
    """`grad` of the inverse and its log-det, in the input and in the (traced) weights, equal
    the closed form's."""
    p = _params(jax.random.PRNGKey(25))
    masks = {k: p[k] for k in ("m1", "m2")}
    weights = {k: v for k, v in p.items() if k not in masks}
    out = maf_inverse_loop(p, _point(26))

    def via_jaxrev(weights, y):
        x, ld = jr.inverse_and_slogdet(lambda z: maf_inverse_loop({**weights, **masks}, z))(y)
        return jnp.sum(jnp.sin(x)) + ld

    def closed(weights, y):
        q = {**weights, **masks}
        x = maf_forward(q, y)
        return (
            jnp.sum(jnp.sin(x)) + jnp.linalg.slogdet(jax.jacfwd(lambda z: maf_forward(q, z))(y))[1]
        )

    got = jax.jit(jax.grad(via_jaxrev, argnums=(0, 1)))(weights, out)
    want = jax.grad(closed, argnums=(0, 1))(weights, out)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-11)


def test_a_reversed_loop_is_undone_at_once():
    """A loop run from its last element to its first (``scan(..., reverse=True)``), whose
    network reads the elements after the one it writes: those are what the steps that ran
    before wrote, so it is undone at once too."""
    p = _params(jax.random.PRNGKey(27))

    def shift_log_scale(z):
        t, s = _shift_log_scale(p, z[::-1])
        return t[::-1], s[::-1]

    def loop(y):
        def step(z, i):
            t, s = shift_log_scale(z)
            return z.at[i].set(((z - t) * jnp.exp(-s))[i]), None

        return lax.scan(step, y, jnp.arange(D), reverse=True)[0]

    def closed(x):
        t, s = shift_log_scale(x)
        return x * jnp.exp(s) + t

    _undone_at_once_as_closed_form(loop, closed, _point(28))


def _undone_at_once_as_closed_form(loop, closed, x) -> None:
    """`loop` (an element loop, the inverse of `closed`) is undone at once by
    `inverse_and_slogdet` (no loop evaluating a network), into `closed`'s values and log-det."""
    np.testing.assert_allclose(loop(closed(x)), x, rtol=1e-12, atol=1e-12)
    inv = jr.inverse_and_slogdet(loop)
    assert not _looped_with_net(jax.make_jaxpr(inv)(x).jaxpr)
    back, ld = jax.jit(inv)(x)
    np.testing.assert_allclose(back, closed(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, jnp.linalg.slogdet(jax.jacfwd(closed)(x))[1], rtol=1e-10)


def test_a_step_reading_what_a_later_step_writes_is_undone_one_by_one():
    """Step i reads element i + 1, which step i + 1 overwrites: undone from the final carry,
    step i would read the new value, not the one it read. Such a loop is undone one step after
    the other, and right."""

    def loop(y):
        def step(z, i):
            nxt = z[jnp.minimum(i + 1, D - 1)]
            return z.at[i].set(z[i] * jnp.exp(0.3 * jnp.tanh(nxt)) + 0.2 * nxt), None

        return lax.scan(step, y, jnp.arange(D - 1))[0]

    y = _point(29)
    inv = jr.inverse_and_slogdet(loop)
    assert len([e for e in all_eqns(jax.make_jaxpr(inv)(y).jaxpr) if e.primitive.name == "scan"])
    back, ld = jax.jit(inv)(y)
    np.testing.assert_allclose(loop(back), y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ld, -jnp.linalg.slogdet(jax.jacfwd(loop)(back))[1], rtol=1e-10)


def test_a_step_overwriting_an_element_twice_is_undone_one_by_one():
    """Two steps add to the same element (a counter modulo D): what each adds reads nothing
    later steps write, but undone at once, the first step would undo its addition from the
    final value, which holds the second's too; one by one, it is right."""

    def loop(y):
        def step(z, i):
            k = i % D
            return z.at[k].add(jnp.sin(1.0 + i)), None

        return lax.scan(step, y, jnp.arange(D + 2))[0]

    y = _point(30)
    back, _ = jax.jit(jr.inverse_and_slogdet(loop))(y)
    np.testing.assert_allclose(loop(back), y, rtol=1e-12, atol=1e-12)


def test_an_autoregressive_map_of_many_dimensions_inverts_element_by_element():
    """D = 40 elements learned one at a time: each an update of the state's partial knowledge,
    more than the walk's guard of 32 allowed (flowjax's MAF with `invert=False` at D = 64 was
    refused at `add`, and its forward log-det fell back to the dense Jacobian)."""
    d, h = 40, 48
    p = _params(jax.random.PRNGKey(31), d, h)
    f = lambda x: maf_forward(p, x)  # noqa: E731
    x = _point(32, d)
    y, ld = jax.jit(jr.forward_and_slogdet(f))(x)
    np.testing.assert_allclose(y, f(x), rtol=1e-12)
    np.testing.assert_allclose(ld, jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-10)
    assert not jr.logdet_strategy(f, x).startswith("dense"), jr.logdet_strategy(f, x)
    back, ld_inv = jax.jit(jr.inverse_and_slogdet(f))(y)
    np.testing.assert_allclose(back, x, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(ld_inv, -ld, rtol=1e-10)


def test_the_element_loops_log_det_takes_one_pivot_per_step():
    """Run forward for its log-det, each step of the element loop recovers one element: its
    pivot is taken on that element's window (one log per step), not over the whole carry
    masked to it (D logs per step, D² in all: 2.6x flowjax's forward at D = 64, now 1.3x)."""
    d = 12
    p = _params(jax.random.PRNGKey(33), d, 16)
    f = lambda y: maf_inverse_loop(p, y)  # noqa: E731
    x = _point(34, d)
    out, ld = jax.jit(jr.forward_and_slogdet(f))(x)
    np.testing.assert_allclose(out, f(x), rtol=1e-12)
    np.testing.assert_allclose(ld, jnp.linalg.slogdet(jax.jacfwd(f)(x))[1], rtol=1e-10)
    (loop,) = _looped_with_net(jax.make_jaxpr(jr.forward_and_slogdet(f))(x).jaxpr)
    logs = [e for e in all_eqns(loop.params["jaxpr"].jaxpr) if e.primitive.name == "log"]
    assert logs and all(np.size(np.zeros(e.invars[0].aval.shape)) == 1 for e in logs), logs


@pytest.mark.parametrize("how", ["eager", "jit", "vmap"])
def test_reverse_undoes_the_element_loop_at_once_and_reverses_back(how):
    """`reverse` undoes the element loop's steps at once too: the step it emits is a
    `custom_inverse` whose inverse is the loop itself, so ``reverse(reverse(f))`` runs the
    loop again. Values and derivatives are the closed form's."""
    p = _params(jax.random.PRNGKey(35))
    f = lambda y: maf_inverse_loop(p, y)  # noqa: E731
    back = jr.reverse(f)
    x = _point(36)
    assert not _looped_with_net(jax.make_jaxpr(back)(x).jaxpr)
    if how == "vmap":
        xs = jnp.stack([x, _point(37)])
        got = jax.vmap(jax.jit(back))(xs)
        np.testing.assert_allclose(got, jax.vmap(lambda z: maf_forward(p, z))(xs), atol=1e-12)
        return
    run = jax.jit if how == "jit" else (lambda g: g)
    y = run(back)(x)
    np.testing.assert_allclose(y, maf_forward(p, x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(run(jr.reverse(back))(y), f(y), rtol=1e-12, atol=1e-12)
    assert _looped_with_net(jax.make_jaxpr(jr.reverse(back))(y).jaxpr)  # (the loop itself)
    grad = jax.grad(lambda z: jnp.sum(jnp.sin(back(z))))(x)
    want = jax.grad(lambda z: jnp.sum(jnp.sin(maf_forward(p, z))))(x)
    np.testing.assert_allclose(grad, want, rtol=1e-10, atol=1e-12)


def _blocked(key: jax.Array, order: np.ndarray, size: int, h: int) -> tuple[dict, callable]:
    """An autoregressive map over blocks of `size` elements, the blocks in `order` (block
    order[i] is recovered at step i), with its masked network; returns its parameters and its
    shift and log-scale."""
    nblocks = len(order)
    d = nblocks * size
    rank_of_block = np.argsort(order)
    in_rank = np.repeat(rank_of_block, size)
    hid_rank = np.arange(h) % max(nblocks - 1, 1)
    m1 = hid_rank[:, None] >= in_rank[None, :]
    m2 = np.repeat(in_rank, 2)[:, None] > hid_rank[None, :]
    p = _params(key, d, h)
    p["m1"], p["m2"] = jnp.asarray(m1), jnp.asarray(m2)
    return p, (lambda z: _shift_log_scale(p, z))


@pytest.mark.parametrize("size", [1, 2])
def test_blocks_written_in_any_order_are_undone_at_once(size):
    """The steps write blocks of the carry (``dynamic_update_slice`` of `size` elements) in a
    permuted order read from the loop's `xs`: undone at once, each step's window goes to the
    positions that step writes (`rules.scan._owned_windows`); values and log-det are the
    closed form's."""
    order = np.array([3, 0, 5, 1, 4, 2])
    p, net = _blocked(jax.random.PRNGKey(45), order, size, 20)
    d = len(order) * size

    def loop(y):
        def step(z, k):
            t, s = net(z)
            x = (z - t) * jnp.exp(-s)
            block = lax.dynamic_slice(x, (k * size,), (size,))
            return lax.dynamic_update_slice(z, block, (k * size,)), None

        return lax.scan(step, y, jnp.asarray(order))[0]

    def closed(x):
        t, s = net(x)
        return x * jnp.exp(s) + t

    _undone_at_once_as_closed_form(loop, closed, _point(46, d))


@pytest.mark.parametrize("how", ["eager", "jit"])
def test_a_negative_corner_is_clamped_as_the_primitive_clamps_it(how):
    """A window whose corner operand is negative in the program (``allow_negative_indices=
    False``, or ``-8`` on 6 elements, which `lax` counts from the end to ``-2`` before the
    primitive): the `dynamic_slice` primitive clamps it to 0, and so do the walk's reads and
    writes of that window and the steps undone at once (they counted it from the end again:
    wrong values, eager and under `jit`)."""

    def f(x):
        w = lax.dynamic_slice(x, (-8,), (2,))
        return lax.dynamic_update_slice(x, 2.0 * w + 1.0, (-8,))

    x = jnp.arange(6.0) + 1
    run = jax.jit if how == "jit" else (lambda g: g)
    np.testing.assert_allclose(run(jr.reverse(f))(f(x)), x, rtol=1e-12)
    order, size = np.array([2, 0, 1]), 2
    corners = np.array([4, -1, 2])  # (block 0 given as -1: the primitive clamps it to 0)
    p, net = _blocked(jax.random.PRNGKey(47), order, size, 20)

    def loop(y):
        def step(z, c):
            t, s = net(z)
            x = (z - t) * jnp.exp(-s)
            block = lax.dynamic_slice(x, (c,), (size,), allow_negative_indices=False)
            return lax.dynamic_update_slice(z, block, (c,), allow_negative_indices=False), None

        return lax.scan(step, y, jnp.asarray(corners))[0]

    def closed(x):
        t, s = net(x)
        return x * jnp.exp(s) + t

    x = _point(48, len(order) * size)
    back, ld = run(jr.inverse_and_slogdet(loop))(x)
    np.testing.assert_allclose(back, closed(x), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(run(jr.reverse(loop))(x), closed(x), rtol=1e-12, atol=1e-12)


def test_an_eager_inverse_whose_final_carry_is_known_when_traced():
    """Eagerly, the loop's final carry may be known when traced with a window written into it
    (an update of the loop's result after the loop), written by numpy: the steps undone at
    once write into it, and the inverse hands back JAX arrays."""
    p = _params(jax.random.PRNGKey(49))

    def f(y):
        z = maf_inverse_loop(p, y)
        head = lax.dynamic_slice(z, (0,), (1,))
        return lax.dynamic_update_slice(z, 2.0 * head + 1.0, (0,))

    y = _point(50)
    out = f(y)
    for transform in (jr.reverse, jr.inverse_and_slogdet):
        got = transform(f)(out)
        back = got[0] if isinstance(got, tuple) else got
        assert isinstance(back, jax.Array), type(back)
        np.testing.assert_allclose(back, y, rtol=1e-12, atol=1e-12)


def test_a_dropped_write_out_of_bounds_in_a_loop_is_a_typed_error_or_right():
    """A step writing past the end (``.at[c].set(..., mode="drop")``, c = 7 on 5 elements)
    writes nothing: the region tests placed the dropped box outside the masks' table and
    raised IndexError. Now the inverse is right or refused naming the step."""
    order = np.array([3, 1, 4, 0, 2])
    p, net = _blocked(jax.random.PRNGKey(51), order, 1, 12)
    corners = jnp.asarray([3, 1, 7, 0, 2, 4])

    def loop(y):
        def step(z, c):
            t, s = net(z)
            x = (z - t) * jnp.exp(-s)
            return z.at[c].set(x[jnp.clip(c, 0, 4)], mode="drop"), None

        return lax.scan(step, y, corners)[0]

    def closed(x):
        t, s = net(x)
        return x * jnp.exp(s) + t

    x = _point(52)
    try:
        back = jax.jit(jr.reverse(loop))(x)
    except jr.NotInvertibleError as e:
        assert "`scatter`" in str(e) and HERE in str(e), str(e)
        return
    np.testing.assert_allclose(back, closed(x), rtol=1e-12, atol=1e-12)
