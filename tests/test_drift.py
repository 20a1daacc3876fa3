"""The drift guard and the time-space dial of `jr.reversible` (docs/design.md §3.8, issue 19).

References are `jax.grad` in float64. The programs: a contracting fixed point (a deep
equilibrium layer's shape: its backward run expands rounding without bound) as a `fori_loop`
and as a `while_loop`, reversible Heun, a coupled scan with `xs` and `ys`, nested loops.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import leaf_rel_error
from jax import lax
from tiers import cover

import jaxrev as jr

jax.config.update("jax_enable_x64", True)

N = 32
_W = np.random.default_rng(1).standard_normal((N, N))
W = jnp.asarray(0.5 * _W / np.linalg.norm(_W, 2))  # ||W|| = 0.5: a contraction
TH = 0.3 + 0.1 * jnp.sin(jnp.arange(N, dtype=jnp.float64))
X0 = jnp.zeros(N)
TOL = 1e-10


def fp_fori(x, th, n=40):
    return lax.fori_loop(0, n, lambda i, x: jnp.tanh(W @ x + th), x)  # FORI-LINE


def fp_while(x, th):
    cond = lambda x: jnp.max(jnp.abs(jnp.tanh(W @ x + th) - x)) > TOL  # noqa: E731
    return lax.while_loop(cond, lambda x: jnp.tanh(W @ x + th), x)  # WHILE-LINE


def trips(x, th):
    """How many iterations `fp_while` runs."""
    cond = lambda s: jnp.max(jnp.abs(jnp.tanh(W @ s[1] + th) - s[1])) > TOL  # noqa: E731
    return int(lax.while_loop(cond, lambda s: (s[0] + 1, jnp.tanh(W @ s[1] + th)), (0, x))[0])


def loss(f):
    return lambda th: jnp.sum(f(X0, th) ** 2)


def line_of(tag: str) -> int:
    with open(__file__) as fh:
        return next(i for i, ln in enumerate(fh, 1) if ln.rstrip().endswith(tag))


def heun(n=1000, dt=0.01):
    def step(c, A):
        (
            y,
            z,
        ) = c
        f = lambda v: jnp.tanh(A @ v)  # noqa: E731
        z1 = 2.0 * y - z + dt * f(z)
        return y + 0.5 * dt * (f(z) + f(z1)), z1

    return lambda s, A: lax.fori_loop(0, n, lambda i, c: step(c, A), s)  # HEUN-LINE


def heun_case():
    """benchmarks/reversible_heun.py's setting: ||A|| about 2, y = z at the start."""
    rng = np.random.default_rng(0)
    A = jnp.asarray(rng.standard_normal((64, 64)) / 8.0)
    z0 = jnp.asarray(rng.standard_normal(64) * 0.5)
    return (z0, z0), A


def heun_loss(f):
    return lambda s, A: jnp.sum(jnp.sin(f(s, A)[0])) + jnp.sum(f(s, A)[1] ** 2)


# --------------------------------------------------------------------------- the default repairs


def test_contracting_loop_is_repaired_by_default():
    """The default checkpoints the loop every ⌈√T⌉ iterations and recomputes the segments
    whose rebuilt start would change the gradient: jax.grad's answer, eager and under jit."""
    ref = jax.grad(loss(fp_fori))(TH)
    g = jax.grad(loss(jr.reversible(fp_fori)))
    np.testing.assert_allclose(g(TH), ref, atol=1e-12, rtol=0)
    np.testing.assert_allclose(jax.jit(g)(TH), ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("form", ["fori", "while"])
def test_contracting_loop_raises_naming_the_loop(form):
    """on_drift="raise" (strict): a segment whose drift moves the gradient more than rounding
    does raises, naming the loop; fully reversible, the call's inputs miss by more than √eps."""
    f, tag = (fp_fori, "# FORI-LINE") if form == "fori" else (fp_while, "# WHILE-LINE")
    kw = dict(max_steps=200) if form == "while" else {}
    g = jax.grad(loss(jr.reversible(f, on_drift="raise", **kw)))
    with pytest.raises(jr.DriftError) as ei:
        g(TH)
    msg = str(ei.value)
    assert "moves the gradient" in msg or "not finite" in msg, msg
    assert f"test_drift.py:{line_of(tag)}" in msg, msg
    g = jax.grad(loss(jr.reversible(f, on_drift="raise", checkpoint_every=None)))
    with pytest.raises(jr.DriftError) as ei:
        g(TH)
    msg = str(ei.value)
    assert "the inputs of the call" in msg and "not finite" in msg
    # under jit: a runtime error with the same message, never a NaN returned
    with pytest.raises(Exception, match="not finite"):
        jax.block_until_ready(jax.jit(g)(TH))


def test_heun_is_checked_and_passes():
    """Reversible Heun's backward run is stable here (symmetric method): the default check
    passes and the gradient is jax.grad's; a tolerance below its measured drift names the
    loop."""
    s, A = heun_case()
    ref = jax.grad(heun_loss(heun()), argnums=(0, 1))(s, A)
    got = jax.jit(jax.grad(heun_loss(jr.reversible(heun())), argnums=(0, 1)))(s, A)
    assert leaf_rel_error(got, ref) < 1e-10
    g = jax.grad(
        heun_loss(jr.reversible(heun(), drift_rtol=1e-17, on_drift="raise")), argnums=(0, 1)
    )
    with pytest.raises(jr.DriftError) as ei:
        g(s, A)
    assert f"test_drift.py:{line_of('# HEUN-LINE')}" in str(ei.value)
    assert 0 < ei.value.drift < 1e-10 and ei.value.tolerance == 1e-17


# --------------------------------------------------------------------------- the dial fixes it


@pytest.mark.parametrize("every", [1, "auto"])
@pytest.mark.parametrize("form", ["fori", "while"])
def test_checkpoints_give_jax_grad(form, every):
    n = trips(X0, TH) if form == "while" else 40
    ref = jax.grad(loss(lambda x, th: fp_fori(x, th, n)))(TH)
    f = fp_while if form == "while" else fp_fori
    kw = dict(checkpoint_every=every, max_steps=200 if form == "while" else None)
    g = jax.grad(loss(jr.reversible(f, **kw)))
    np.testing.assert_allclose(g(TH), ref, atol=1e-10, rtol=0)
    np.testing.assert_allclose(jax.jit(g)(TH), ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("every", [1, "auto"])
def test_heun_with_checkpoints(every):
    s, A = heun_case()
    ref = jax.grad(heun_loss(heun()), argnums=(0, 1))(s, A)
    got = jax.jit(
        jax.grad(heun_loss(jr.reversible(heun(), checkpoint_every=every)), argnums=(0, 1))
    )(s, A)
    assert leaf_rel_error(got, ref) < 1e-10


def test_segments_bound_the_drift():
    """The fully reversible run is off by its drift; segments of K = 5 are not."""
    ref = jax.grad(loss(fp_fori))(TH)
    full = jax.grad(loss(jr.reversible(fp_fori, on_drift="ignore")))(TH)
    seg = jax.grad(loss(jr.reversible(fp_fori, checkpoint_every=5, on_drift="ignore")))(TH)
    assert not np.all(np.isfinite(full)) or np.max(np.abs(full - ref)) > 1e-6
    assert np.max(np.abs(seg - ref)) < 1e-8


# --------------------------------------------------------------------------- on_drift


def test_on_drift_nan_warn_ignore():
    g = jax.grad(loss(jr.reversible(fp_fori, on_drift="nan")))
    assert np.all(np.isnan(g(TH))) and np.all(np.isnan(jax.jit(g)(TH)))
    with pytest.warns(jr.DriftWarning, match="moves the gradient"):
        jax.grad(loss(jr.reversible(fp_fori, on_drift="warn")))(TH)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jax.grad(loss(jr.reversible(fp_fori, on_drift="ignore")))(TH)  # no check at all


def test_drift_check_under_vmap_and_jit():
    ths = jnp.stack([TH, 0.5 * TH])
    g = jax.jit(jax.vmap(jax.grad(loss(jr.reversible(fp_fori, on_drift="raise")))))
    with pytest.raises(Exception, match="moves the gradient"):
        jax.block_until_ready(g(ths))
    ref = jax.vmap(jax.grad(loss(fp_fori)))(ths)
    rep = jax.jit(jax.vmap(jax.grad(loss(jr.reversible(fp_fori)))))(ths)  # the default
    np.testing.assert_allclose(rep, ref, atol=1e-10, rtol=0)
    ok = jax.jit(jax.vmap(jax.grad(loss(jr.reversible(fp_fori, checkpoint_every=1)))))(ths)
    np.testing.assert_allclose(ok, ref, atol=1e-10, rtol=0)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="on_drift"):
        jr.reversible(fp_fori, on_drift="loud")
    with pytest.raises(ValueError, match="checkpoint_every"):
        jr.reversible(fp_fori, checkpoint_every=0)
    with pytest.raises(ValueError, match="memory_budget"):
        jr.reversible(fp_fori, memory_budget=-1)


def test_true_infinities_are_not_drift():
    """A carry that holds an infinity the program put there is rebuilt as that infinity."""

    def f(s, th):
        return lax.fori_loop(0, 10, lambda i, s: (s[0] + th * jnp.exp(-s[1]), s[1]), s)

    s = (jnp.linspace(0.0, 1.0, 4), jnp.array([1.0, 2.0, 3.0, jnp.inf]))
    g = jax.grad(lambda th: jnp.sum(jr.reversible(f, checkpoint_every=3)(s, th)[0][:3]))(0.3)
    ref = jax.grad(lambda th: jnp.sum(f(s, th)[0][:3]))(0.3)
    assert np.isfinite(g) and abs(g - ref) < 1e-10


# --------------------------------------------------------------------------- segments on scans


def scan_xs(rev):
    """State (c, xs): the loop rebuilds its xs from its ys (ys = x * exp(a))."""

    def f(c, xs, th):
        def body(c, x):
            a, b = c
            a = a + jnp.tanh(th[0] * b)
            b = b + jnp.sin(th[1] * a)
            return (a, b), x * jnp.exp(0.1 * a)

        return lax.scan(body, c, xs, reverse=rev)

    return f


def scan_ys(rev):
    """State (c, z): xs are known parameters, the ys are read by the output (ys + z)."""

    def f(c, z, th, xs):
        def body(c, x):
            a, b = c
            a = a + jnp.tanh(th[0] * b + x)
            b = b + jnp.sin(th[1] * a)
            return (a, b), a * x

        c2, ys = lax.scan(body, c, xs, reverse=rev)
        return c2, ys + z

    return f


@pytest.mark.parametrize(
    "kind,every",
    # every checkpoint interval (one step, one dividing the length or not, longer than the
    # loop, the automatic one, none) and every layout by default, the full product in soak
    cover(["xs", "ys", "xs-reverse", "ys-reverse"], [1, 3, 7, 20, 23, "auto", None]),
)
def test_checkpointed_scan_with_xs_and_ys(kind, every):
    rev = kind.endswith("reverse")
    c = (jnp.linspace(0.0, 1.0, 5), jnp.linspace(1.0, 2.0, 5))
    xs = jnp.linspace(-0.5, 0.5, 23)[:, None] * jnp.ones(5)
    th = jnp.array([0.5, 0.6])
    if kind.startswith("xs"):
        prog, args, nums = scan_xs(rev), (c, xs, th), (0, 1)
    else:
        prog, args, nums = scan_ys(rev), (c, jnp.zeros((23, 5)), th, xs), (0, 1)

    def lossf(f):
        def L(*a):
            (p, q), ys = f(*a)
            return jnp.sum(p**2) + jnp.sum(q) + jnp.sum(jnp.sin(ys))

        return jax.grad(L, argnums=tuple(range(len(args))))

    ref = lossf(prog)(*args)
    got = jax.jit(lossf(jr.reversible(prog, nums, checkpoint_every=every)))(*args)
    assert leaf_rel_error(got, ref) < 1e-10


def test_nested_loops_and_float32():
    def f(x, th):
        def outer(i, x):
            return lax.fori_loop(0, 6, lambda j, x: x + 0.1 * jnp.tanh(th * x[::-1]), x)

        return lax.fori_loop(0, 8, outer, x)

    x = jnp.linspace(-1.0, 1.0, 6)
    ref = jax.grad(lambda th: jnp.sum(f(x, th) ** 2))(0.7)
    for kw in (dict(checkpoint_every=4), dict(checkpoint_every="auto"), dict(memory_budget=200)):
        g = jax.jit(jax.grad(lambda th: jnp.sum(jr.reversible(f, **kw)(x, th) ** 2)))(0.7)
        assert abs(g - ref) < 1e-10 * abs(ref), kw
    g32 = jax.jit(
        jax.grad(
            lambda th: jnp.sum(jr.reversible(f, checkpoint_every=4)(x.astype(jnp.float32), th) ** 2)
        )
    )(jnp.float32(0.7))
    assert g32.dtype == jnp.float32 and abs(g32 - ref) < 1e-4 * abs(ref)


# --------------------------------------------------------------------------- memory


def _temp(g, *a):
    return jax.jit(g).lower(*a).compile().memory_analysis().temp_size_in_bytes


def test_a_memory_budget_picks_the_most_checkpoints_that_leave_room_for_a_repair():
    """`Dial.levels` under `memory_budget`: the repairing dial takes the smallest K whose
    ⌈T/K⌉ checkpoints and K carries of a recomputed segment fit, or a length within a
    quarter of it that divides T and fits (no shorter first segment: one copy of the
    segment loops); below that (about 2√T carries: 64 for T = 1000), segments of L²
    recomputed L at a time, ⌈T/L²⌉ + 2L carries, the least L that fits; below those (30 at
    L = 10) the least, and a warning naming the loop; the dials that do not repair store
    ⌈T/slots⌉-long segments, all slots checkpoints."""
    from jaxrev.transforms.sweep.dial import Dial

    carry = 8000

    def levels(slots, T=1000, on_drift="repair", where=""):
        return Dial(budget=slots * carry, on_drift=on_drift).levels(T, carry, where)

    assert levels(125) == (10, None)  # 100 + 10 carries (K = 9: 112 + 9)
    assert levels(125, T=997) == (9, None)  # (997 is prime: 111 + 9)
    assert levels(64) == (28, None)  # 36 + 28
    assert levels(50) == (25, 5)  # 40 + 5 + 5
    assert levels(40) == (36, 6)  # 28 + 6 + 6
    with pytest.warns(jr.PerformanceWarning, match=r"at here\.py:1, whose 1000 iterations.*30"):
        assert levels(25, where=" at here.py:1") == (100, 10)
    assert levels(25, on_drift="raise") == (40, None)
    with pytest.warns(jr.PerformanceWarning, match=r"need at least 5 .*recomputed at once"):
        assert levels(4, T=5) == (2, None)  # (short: one level's 3 + 2, not two levels' 6)
    with pytest.warns(jr.PerformanceWarning):
        assert Dial(budget=25 * carry, on_drift="repair").segment(1000, carry) == 100
    assert Dial(budget=25 * carry, on_drift="repair").sub_segment(1000, 100, carry) == 10
    assert Dial(budget=64 * carry, on_drift="repair").sub_segment(1000, 28, carry) is None


def test_memory_follows_the_dial():
    """Checkpoints are T / K carries; a budget bounds them; memory_report lists them."""

    def f(c, th):
        return lax.scan(
            lambda c, _: ((c[0] + jnp.tanh(th * c[1]), c[1] + jnp.sin(c[0])), None),
            c,
            None,
            length=1000,
        )[0]

    c = (jnp.zeros(1000), jnp.ones(1000))

    def grad(**kw):
        return jax.grad(lambda c, th: jnp.sum(jr.reversible(f, **kw)(c, th)[0]), argnums=(0, 1))

    carry = 2 * 1000 * 8
    m = {k: _temp(grad(checkpoint_every=k, on_drift="ignore"), c, 0.5) for k in (10, 100)}
    m[None] = _temp(grad(on_drift="ignore"), c, 0.5)
    assert m[10] - m[None] >= 100 * carry * 0.9  # 100 checkpoints stored
    assert m[100] - m[None] <= 10 * carry * 1.5  # 10
    budget = 25 * carry
    mb = _temp(grad(memory_budget=budget, on_drift="raise"), c, 0.5)
    assert mb - m[None] <= budget * 1.25  # the checkpoints, and the check's temporaries
    rbudget = 80 * carry  # repairing: the checkpoints and one segment's carries fit
    mb = _temp(grad(memory_budget=rbudget), c, 0.5)
    assert mb - m[None] <= rbudget * 1.25
    # repairing under a budget below its least (segments of L² recomputed L at a time,
    # ⌈T/L²⌉ + 2L carries, 30 at L = 10): that least, and a warning naming the loop's line
    with pytest.warns(jr.PerformanceWarning, match=r"test_drift.py:\d+.*need at least 30"):
        small = _temp(grad(memory_budget=budget), c, 0.5)
    assert small - m[None] <= 30 * carry * 1.25
    # the default: ⌈√T⌉ checkpoints and a segment's carries, 2√T carries in all
    md = _temp(grad(), c, 0.5)
    assert md - m[None] <= 2 * 32 * carry * 1.25
    rep = jr.memory_report(f, c, 0.5, memory_budget=budget, on_drift="raise")
    ck = [e for e in rep.entries if e["what"].startswith("checkpoint")]
    assert ck and sum(e["bytes"] * e["count"] for e in ck) <= budget
    assert "per checkpoint x 25" in str(rep)


def test_lossy_while_body_with_max_steps():
    """A while body that loses information (a relu) is stored per iteration up to max_steps;
    past the bound the forward run raises naming the loop."""

    def f(x, th):
        cond = lambda s: s[0] < s[2]  # noqa: E731
        body = lambda s: (s[0] + 1, jax.nn.relu(s[1] - th) + 0.5, s[2])  # noqa: E731
        return lax.while_loop(cond, body, (0, x, 7))[1]

    x = jnp.linspace(-1.0, 2.0, 5)
    ref = jax.grad(
        lambda th: jnp.sum(lax.fori_loop(0, 7, lambda i, x: jax.nn.relu(x - th) + 0.5, x) ** 2)
    )(0.3)

    def g(**kw):
        return jax.grad(lambda th: jnp.sum(jr.reversible(lambda x, th: f(x, th), **kw)(x, th) ** 2))

    with pytest.raises(jr.NotInvertibleError, match="max_steps"):
        g()(0.3)
    for kw in (dict(max_steps=10), dict(max_steps=10, checkpoint_every=3)):
        np.testing.assert_allclose(g(**kw)(0.3), ref, rtol=1e-12)
        np.testing.assert_allclose(jax.jit(g(**kw))(0.3), ref, rtol=1e-12)
    with pytest.raises(jr.NotInvertibleError, match="max_steps=5"):
        g(max_steps=5)(0.3)


# --------------------------------------------------------------------------- check_reversible


def test_check_reversible_at_zero_and_on_while_loops():
    rep = jr.check_reversible(lambda x: jnp.expm1(x) * 3.0, jnp.zeros(4))
    assert rep.max_error < 1e-12
    rep = jr.check_reversible(lambda x: jnp.exp(x) * 3.0 - 3.0, jnp.zeros(4))
    assert rep.max_error < 1e-12  # was 7e294: relative at x = 0
    rep = jr.check_reversible(fp_while, X0, TH)  # a plain while loop: trip count recorded
    assert not rep.max_error < 1e-6  # the contraction's drift, reported
    rep = jr.check_reversible(fp_while, X0, TH, checkpoint_every=4, max_steps=200)
    assert rep.max_error == 0.0 and rep.segments
    what, d = rep.segments[0]
    assert f"test_drift.py:{line_of('# WHILE-LINE')}" in what and d > 0
    assert "drift" in str(rep)


def test_docs_drift_examples_run():
    """The drift section's examples in docs/reversible.md run as written."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "reversible.md")) as fh:
        blocks = [
            b
            for b in re.findall(r"```python\n(.*?)```", fh.read(), flags=re.S)
            if "checkpoint_every" in b or "DriftError" in b
        ]
    assert len(blocks) == 2
    for code in blocks:
        p = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=root,
            check=False,
        )
        assert p.returncode == 0, p.stderr
        assert (
            "relative drift of" in p.stdout
            or "not finite" in p.stdout
            or "checkpoint of the loop carry" in p.stdout
        )


@pytest.mark.parametrize("every", [1, 3, "auto"])
def test_while_checkpoints_under_vmap(every):
    """A vmapped while loop stops per element: each element's own trip count, checkpoints and
    recomputation; the gradient of a batch equals jax.grad of each element's fori_loop."""
    ths = jnp.stack([TH, 0.5 * TH, -TH])
    f = jr.reversible(fp_while, checkpoint_every=every, max_steps=100)
    g = jax.jit(jax.grad(lambda ths: jnp.sum(jax.vmap(lambda t: f(X0, t))(ths) ** 2)))(ths)
    for b in range(3):
        n = trips(X0, ths[b])
        ref = jax.grad(loss(lambda x, th: fp_fori(x, th, n)))(ths[b])
        np.testing.assert_allclose(g[b], ref, atol=1e-10, rtol=0)


# --------------------------------------------------------------------------- review findings


def test_nested_reversible_calls():
    """A reversible call inside another's loop: its plan is made while the outer backward run
    is live (its placeholders must not reach the outer run's comparisons)."""
    inner = jr.reversible(
        lambda x, th: lax.fori_loop(0, 3, lambda i, x: x + 0.1 * jnp.tanh(th * x[::-1]), x)
    )

    def outer(x, th):
        return lax.scan(lambda x, _: (inner(x, th), None), x, None, length=9)[0]

    def plain(x, th):
        return lax.scan(
            lambda x, _: (
                lax.fori_loop(0, 3, lambda i, x: x + 0.1 * jnp.tanh(th * x[::-1]), x),
                None,
            ),
            x,
            None,
            length=9,
        )[0]

    x0 = jnp.linspace(0.1, 1.0, 3)
    ref = jax.grad(lambda th: jnp.sum(plain(x0, th) ** 2))(0.5)
    for kw in (dict(), dict(checkpoint_every=3), dict(checkpoint_every="auto")):
        g = jax.grad(lambda th: jnp.sum(jr.reversible(outer, **kw)(x0, th) ** 2))(0.5)
        assert abs(g - ref) < 1e-12 * abs(ref), kw


def test_auto_with_a_while_loop_in_the_body():
    """JAX cannot take the VJP of a while loop: such a body is checkpointed and checked, not
    recomputed."""

    def f(x, th):
        def body(x, _):
            x, _ = lax.while_loop(
                lambda s: s[1] < 3,
                lambda s: (s[0] + 0.1 * jnp.tanh(th * s[0][::-1]), s[1] + 1),
                (x, 0),
            )
            return x, None

        return lax.scan(body, x, None, length=9)[0]

    x0 = jnp.linspace(0.1, 1.0, 3)
    ref = jax.grad(lambda th: jnp.sum(jr.reversible(f)(x0, th) ** 2))(0.5)
    g = jax.grad(lambda th: jnp.sum(jr.reversible(f, checkpoint_every="auto")(x0, th) ** 2))(0.5)
    assert abs(g - ref) < 1e-12 * abs(ref)


def test_mixed_precision_carry_is_not_a_false_alarm():
    """A float64 carry that reads a float32 one is rebuilt to float32's precision: the
    tolerance is the loosest dtype's."""

    def f(c, th):
        def body(c, _):
            a, b = c
            a = a + jnp.tanh(th * b)
            b = b + (0.5 * jnp.sin(a)).astype(jnp.float32)
            return (a, b), None

        return lax.scan(body, c, None, length=13)[0]

    c0 = (jnp.linspace(0.1, 1.0, 3), jnp.linspace(-1.0, 1.0, 3).astype(jnp.float32))
    jax.grad(lambda th: jnp.sum(jr.reversible(f, checkpoint_every=1)(c0, th)[0] ** 2))(0.7)


def test_eager_calls_see_changed_closures_and_attributes():
    """The eager trace cache keys on the traced program (text and constants), so a changed
    attribute, a changed closure of a helper, or an array mutated in place is seen."""

    class Model:
        def __init__(self):
            self.s = 1.0

        def run(self, x):
            return lax.fori_loop(0, 5, lambda i, x: x + self.s * 0.1 * jnp.tanh(x[::-1]), x)

    m = Model()
    x0 = jnp.linspace(0.1, 1.0, 3)

    def grads(fun):
        return (
            jax.grad(lambda x: jnp.sum(jr.reversible(fun)(x) ** 2))(x0),
            jax.grad(lambda x: jnp.sum(fun(x) ** 2))(x0),
        )

    for s in (1.0, 4.0):
        m.s = s
        got, ref = grads(m.run)
        np.testing.assert_allclose(got, ref, rtol=1e-12)
    w = np.ones(3)

    def g(x):
        return lax.fori_loop(0, 5, lambda i, x: x + 0.1 * jnp.tanh(w * x[::-1]), x)

    for v in (1.0, 3.0):
        w[:] = v  # in place
        got, ref = grads(g)
        np.testing.assert_allclose(got, ref, rtol=1e-12)
