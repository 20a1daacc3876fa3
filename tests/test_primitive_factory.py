"""One factory for a primitive's JAX rules (`jaxrev._primitive.make_primitive`): every primitive
jaxrev defines is made by it and has evaluation, abstract evaluation, a lowering, JVP and
batching registered with JAX (transpose where it is linear); the factory's own options
(a lowering per platform, an effectful abstract evaluation) work."""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jaxrev as jr
from jaxrev import transforms as T
from jaxrev._compat import debug_effect, registered_rules
from jaxrev._primitive import RULES, made_primitives, make_primitive, rules_of
from jaxrev.primitives import rotations
from jaxrev.transforms.reversible import reversible_p, reversible_store_p

PKG = pathlib.Path(jr.__file__).parent

EXPECTED = {
    "jaxrev_any_in_batch",
    "jaxrev_rot",
    "jaxrev_swap",
    "jaxrev_apply_gate",
    "jaxrev_custom_inverse",
    "jaxrev_hook",
    "jaxrev_store",
    "jaxrev_recompute",
    "jaxrev_check",
    "jaxrev_while",
    "jaxrev_cond",
    "jaxrev_reversible",
    "jaxrev_reversible_store",
    "jaxrev_reversible_lin",
    "jaxrev_fresh",
}
# linear in (some of) their operands: they transpose
LINEAR = {
    "jaxrev_rot",
    "jaxrev_swap",
    "jaxrev_apply_gate",
    "jaxrev_hook",
    "jaxrev_store",
    "jaxrev_recompute",
    "jaxrev_reversible_lin",
    "jaxrev_fresh",
}


def _jaxrev_primitives() -> dict[str, Primitive]:
    """Every primitive a jaxrev module holds at module level, by name."""
    found = {}
    for info in pkgutil.walk_packages(jr.__path__, "jaxrev."):
        mod = importlib.import_module(info.name)
        for value in vars(mod).values():
            if isinstance(value, Primitive) and value.name.startswith("jaxrev_"):
                found[value.name] = value
    return found


def test_every_jaxrev_primitive_is_made_by_the_factory():
    found = _jaxrev_primitives()
    assert set(found) == EXPECTED
    made = made_primitives()
    for name, p in found.items():
        assert p in made, f"{name} was not made by make_primitive"
    # and none is made by hand: only the factory calls Primitive(...)
    for path in sorted(PKG.rglob("*.py")):
        if path.name == "_primitive.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                assert name != "Primitive", f"{path}:{node.lineno} makes a primitive by hand"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_primitive_has_its_jax_rules(name):
    p = _jaxrev_primitives()[name]
    have = registered_rules(p)
    assert {"impl", "abstract", "lowering", "jvp", "batch"} <= have, (name, have)
    assert ("transpose" in have) == (name in LINEAR), (name, have)
    # what the factory says it registered is what JAX's tables hold (linearization rules
    # exist only on JAX versions with the linearize trace)
    assert rules_of(p) - {"linearize"} == have - {"linearize"}
    assert rules_of(p) <= set(RULES)


def test_reversible_has_its_own_linearization_and_no_store_param():
    if "linearize" in registered_rules(reversible_p):
        assert "linearize" not in registered_rules(reversible_store_p)  # JAX's, from its JVP
    f = jr.reversible(lambda x: jnp.sin(x) * 2.0)
    # forward mode binds both parts of the split; reverse mode transposes the linear one away
    x = jnp.ones(3)
    for program, parts in (
        (
            jax.make_jaxpr(lambda x, t: jax.jvp(f, (x,), (t,)))(x, x),
            {"jaxrev_reversible_store", "jaxrev_reversible_lin"},
        ),
        (jax.make_jaxpr(jax.grad(lambda x: f(x).sum()))(x), {"jaxrev_reversible_store"}),
    ):
        names = {e.primitive.name: e.params for e in program.jaxpr.eqns}
        assert parts <= set(names)
        assert all("store" not in params for params in names.values())
    fwd = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
    assert [e.primitive.name for e in fwd] == ["jaxrev_reversible"]
    assert "store" not in fwd[0].params


def test_the_registry_define_is_the_only_define():
    """`primitives/rotations.py` no longer has a `define` of its own (another contract under
    the registry's name)."""
    assert getattr(rotations, "define", T.registry.define) is T.registry.define


def test_lowering_per_platform_and_effectful_abstract_eval():
    # one function lowered on CPU, another on the platforms not named; eager runs `impl`
    p = make_primitive(
        "factory_test_platforms",
        impl=lambda x: x * 3.0,
        abstract=lambda a: a,
        lowering={"cpu": lambda x: x * 2.0, None: lambda x: x * 5.0},
        jvp=lambda ps, ts: (p.bind(*ps), ts[0]),
        batch=lambda args, dims: (p.bind(*args), dims[0]),
    )
    assert rules_of(p) == frozenset({"impl", "abstract", "lowering", "jvp", "batch"})
    x = jnp.arange(3.0)
    assert np.allclose(p.bind(x), 3 * x)
    jitted = jax.jit(p.bind)(x)
    assert np.allclose(jitted, (2 if jax.default_backend() == "cpu" else 5) * x)
    assert jax.vmap(p.bind)(jnp.ones((2, 3))).shape == (2, 3)

    # an effectful primitive is kept under jit although it has no result
    seen = []

    def report(x):
        jax.debug.callback(lambda v: seen.append(float(v)), x)
        return []

    e = make_primitive(
        "factory_test_effect",
        multiple_results=True,
        effectful=True,
        impl=report,
        abstract=lambda a: ([], {debug_effect}),
    )
    jax.jit(lambda x: (e.bind(x), x + 1)[1])(jnp.float32(4.0)).block_until_ready()
    assert seen == [4.0]
    assert registered_rules(e) == frozenset({"impl", "abstract", "lowering"})
