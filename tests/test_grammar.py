"""Random programs from `programs.grammar` against every property of issue 18.

One drawn program is checked for all properties at once (tracing dominates the cost):

* round trip, eagerly and under `jit`; `reverse(reverse(f)) == f`; `vmap` of the inverse;
* `reversible` gradients (state and parameters) against `jax.grad` of the same program with
  its while loops written as `fori_loop`s;
* `inverse_jvp`, `inverse_vjp`, `slogdet_jacobian` and `inverse_and_slogdet` against the dense
  Jacobian (float64);
* whatever fails raises a jaxrev error naming a primitive and the program's line: never an
  error of another kind, never a NaN.

The default run draws `EXAMPLES` programs; ``pytest -m slow tests/test_grammar.py`` draws
`SLOW_EXAMPLES` (``JAXREV_GRAMMAR_EXAMPLES`` overrides both: CI's slow run, `.ci/run`, sets 25;
the 500 of a run without it are a soak of about half an hour on two cores, for a person to
run). With the count given, the slow run's programs are the same every run (derandomized:
CI is reproducible; ``JAXREV_GRAMMAR_EXPLORE=1`` draws new ones at that count); the soak
explores new ones each time, and what it finds becomes a test of its own. A failure prints
the program's source, which runs as it is.
"""

from __future__ import annotations

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import scaled_error
from hypothesis import HealthCheck, given, settings

import jaxrev as jr

sys.path.insert(0, os.path.dirname(__file__))
from programs.grammar import Program, programs  # noqa: E402

jax.config.update("jax_enable_x64", True)

EXAMPLES = int(os.environ.get("JAXREV_GRAMMAR_EXAMPLES", "2"))
SLOW_EXAMPLES = int(os.environ.get("JAXREV_GRAMMAR_EXAMPLES", "500"))
# the soak explores new programs every run; a count given (CI's) draws the same ones, unless
# JAXREV_GRAMMAR_EXPLORE=1 asks for new ones too
EXPLORE = "JAXREV_GRAMMAR_EXAMPLES" not in os.environ or bool(
    os.environ.get("JAXREV_GRAMMAR_EXPLORE")
)
COMMON = dict(
    deadline=None,
    print_blob=True,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Refusals that are the documented contract, not defects (its while loops count to a bound,
# which `reverse` computes from the counter, so none of those): a log-det that needs the dense
# Jacobian of a program JAX itself cannot differentiate (a custom_jvp function the grammar
# writes inside a loop body, closing over the iteration's value: `jax.grad` of the program
# fails too; the reference is the program without its custom rules).
EXPECTED: list[str] = [r"JAX cannot differentiate the program"]
_LINE = re.compile(r"`[\w\-]+` at (<grammar program>:\d+|an equation with no user source line)")


def _leaves(t):
    return [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(t)]


class Refused(Exception):
    pass


def _attempt(label: str, fn, src: str):
    """Run one property: a jaxrev error must name a primitive and a program line; an expected
    refusal skips the property; a result must be finite."""
    try:
        out = fn()
    except jr.JaxrevError as e:
        msg = str(e)
        assert _LINE.search(msg), f"{label}: the error names no primitive and line:\n{msg}"
        if any(re.search(p, msg, re.S) for p in EXPECTED):
            raise Refused(label) from e
        raise AssertionError(f"{label}: refused an invertible program:\n{msg}") from e
    for x in _leaves(out):
        assert np.all(np.isfinite(x)), f"{label}: a NaN or inf came back"
    return out


def check(prog: Program) -> dict:
    ns = prog.build()
    f, p, s = ns["f"], ns["p"], ns["s"]
    f_ref = prog.build(reference=True)["f"]
    f64 = prog.dtype == "float64"
    tol, gtol = (1e-9, 1e-8) if f64 else (2e-4, 2e-3)
    y = f(s, p)
    ran: dict[str, bool] = {}

    def prop(label, fn, want=None, t=tol):
        try:
            got = _attempt(label, fn, prog.source)
        except Refused:
            ran[label] = False
            return None
        if want is not None:
            e = scaled_error(got, want)
            assert e < t, f"{label}: error {e:.3g} > {t:g}"
        ran[label] = True
        return got

    inv = jr.reverse(f)
    prop("round trip", lambda: inv(y, p), s)
    prop("round trip (jit)", lambda: jax.jit(inv)(y, p), s)
    prop("reverse(reverse(f))", lambda: jr.reverse(inv)(s, p), y)
    s2 = jax.tree_util.tree_map(lambda v: 0.5 * v, s)
    ys = jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), y, f(s2, p))
    prop(
        "vmap of the inverse",
        lambda: jax.vmap(inv, (0, None))(ys, p),
        jax.tree_util.tree_map(lambda a, b: jnp.stack([a, b]), s, s2),
    )

    def loss(g):
        return lambda s, p: sum(jnp.sum(jnp.sin(v)) for v in g(s, p))

    want = jax.grad(loss(f_ref), argnums=(0, 1))(s, p)
    prop(
        "reversible gradient",
        lambda: jax.jit(jax.grad(loss(jr.reversible(f)), argnums=(0, 1)))(s, p),
        want,
        gtol,
    )

    if f64:
        flat = lambda v: jnp.concatenate([jnp.ravel(t) for t in f_ref(unflat(v), p)])  # noqa: E731
        sizes = [int(np.size(t)) for t in s]

        def unflat(v):
            parts = jnp.split(v, np.cumsum(sizes)[:-1])
            return tuple(q.reshape(t.shape) for q, t in zip(parts, s))

        x = jnp.concatenate([jnp.ravel(t) for t in s])
        J = jax.jacfwd(flat)(x)
        v = jnp.cos(jnp.arange(x.size) + 1.0)
        g = lambda s_: f(s_, p)  # noqa: E731
        prop(
            "inverse_jvp",
            lambda: jr.inverse_jvp(g, (s,), unflat(v))[1][0],
            unflat(jnp.linalg.solve(J, v)),
            1e-8,
        )
        prop(
            "inverse_vjp",
            lambda: jr.inverse_vjp(g, s)[1]((unflat(v),)),
            unflat(jnp.linalg.solve(J.T, v)),
            1e-8,
        )
        sign, logdet = jnp.linalg.slogdet(J)
        got = prop("slogdet", lambda: jr.slogdet_jacobian(g, s))
        if got is not None:
            assert float(got[0]) == float(sign), "slogdet: wrong sign"
            assert abs(float(got[1]) - float(logdet)) < 1e-8 * max(1.0, abs(float(logdet)))
        # the inverse direction's sweep reads the walk's own (partly known) values
        got = prop("inverse_and_slogdet", lambda: jax.jit(jr.inverse_and_slogdet(g))(y))
        if got is not None:
            assert abs(float(got[1]) + float(logdet)) < 1e-8 * max(1.0, abs(float(logdet))), (
                "inverse_and_slogdet: wrong log-determinant"
            )
    return ran


# the default run is the same programs every time (CI stays deterministic); the slow run explores
@settings(max_examples=EXAMPLES, **{**COMMON, "derandomize": True, "database": None})
@given(programs())
def test_grammar(prog):
    check(prog)


@pytest.mark.slow
@settings(
    max_examples=SLOW_EXAMPLES,
    **{**COMMON, **({} if EXPLORE else {"derandomize": True, "database": None})},
)
@given(programs())
def test_grammar_slow(prog):
    check(prog)
