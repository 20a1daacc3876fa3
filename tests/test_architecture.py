"""The engine's structure (docs/architecture.md): one walker, rule blocks per primitive, tags set
by the registering call, no silent default rule, modules of one concept, ruff's style."""

import ast
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Primitive

import jaxrev as jr
from jaxrev import transforms as T
from jaxrev._compat import prims
from jaxrev.primitives import rot_p, swap_p
from jaxrev.transforms.rules.cond import cond_p
from jaxrev.transforms.rules.while_loop import while_p

PKG = pathlib.Path(jr.__file__).parent


def _modules():
    return sorted(PKG.rglob("*.py"))


def test_no_backslash_continuations():
    """Modules are split by concept, not by length: there is no line cap (JAX's `loops.py` is
    3 000 lines of one idea); lines continue inside brackets, never with a backslash."""
    for path in _modules():
        text = path.read_text()
        for k, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            assert not code.rstrip().endswith("\\"), f"{path}:{k} continues with a backslash"


def test_ruff_lint_and_format_pass():
    """The house style is ruff's (configured in pyproject.toml), over the whole repository."""
    ruff = shutil.which("ruff") or shutil.which(
        "ruff", path=str(pathlib.Path(sys.executable).parent)
    )
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    root = PKG.parent
    for cmd in ([ruff, "check", "--no-cache", "."], [ruff, "format", "--check", "--no-cache", "."]):
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(cmd[1:])}:\n{done.stdout}{done.stderr}"


def test_no_private_names_imported_across_modules():
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxrev"):
                for alias in node.names:
                    assert not alias.name.startswith("_"), (
                        f"{path} imports the private name {alias.name} from {node.module}"
                    )


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _jaxrev_imports(path: pathlib.Path) -> list[tuple[ast.AST, str, bool]]:
    """(node, imported module, at module level) for every import of a jaxrev module; `from
    pkg import name` counts as importing `pkg.name` when that is a module."""
    names = {_module_name(p) for p in _modules()}
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                for a in node.names
            ]
        for t in targets:
            if t == "jaxrev" or t.startswith("jaxrev."):
                out.append((node, t, id(node) in top))
    return out


def _import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in _modules():
        graph[_module_name(path)] = {t for _, t, _ in _jaxrev_imports(path)}
    return graph


def test_no_function_level_imports_of_jaxrev_modules():
    """An import inside a function is how an import circle hides: jaxrev has none."""
    for path in _modules():
        for node, target, at_top in _jaxrev_imports(path):
            assert at_top, f"{path}:{node.lineno} imports {target} inside a function or block"


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle of `graph` (module -> imported modules), or None."""
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if t not in graph or t == m or m.startswith(t + "."):
                continue  # a package's own __init__ importing its modules is not a circle
            if state.get(t) == 1:
                return stack[stack.index(t) :] + [t]
            if t not in state:
                found = visit(t, stack + [t])
                if found:
                    return found
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_circle():
    found = _circle(_import_graph())
    assert found is None, "import circle: " + " -> ".join(found)
    # the check itself finds one
    assert _circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# docs/architecture.md's layers, lowest first: a module imports only modules of its own layer
# or below (package __init__ files re-export and are exempt)
LAYERS = [
    (
        "core",
        (
            "jaxrev._compat",
            "jaxrev._errors",
            "jaxrev._env",
            "jaxrev._evaluate",
            "jaxrev._graph",
            "jaxrev._prepare",
            "jaxrev._batching",
            "jaxrev._program",
            "jaxrev._cache",
            "jaxrev._primitive",
            "jaxrev._stats",
            "jaxrev._dense",
            "jaxrev._bits",
            "jaxrev._host",
            "jaxrev._runtime",
        ),
    ),
    (
        "registry and knowledge",
        ("jaxrev.transforms.registry", "jaxrev.transforms.knowledge.", "jaxrev.transforms.custom"),
    ),
    ("propagation", ("jaxrev.transforms.propagation.",)),
    ("sweep", ("jaxrev.transforms.sweep.",)),
    (
        "rules and log-dets",
        ("jaxrev.transforms.rules.", "jaxrev.transforms.logdet", "jaxrev.primitives."),
    ),
    (
        "public transforms",
        (
            "jaxrev.transforms.reverse",
            "jaxrev.transforms.reversible",
            "jaxrev.transforms.reports",
            "jaxrev.transforms.inverse_ad",
            "jaxrev.transforms.control_flow",
            "jaxrev.transforms.custom_rules",
            "jaxrev.transforms.flows.",
            "jaxrev.optim",
            "jaxrev.diffrax",
            "jaxrev.flowjax",
            "jaxrev.numpyro",
            "jaxrev.lineax",
            "jaxrev.optimistix",
        ),
    ),
]


def _layer(module: str) -> int | None:
    for k, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or (p.endswith(".") and module.startswith(p)) for p in prefixes):
            return k
    return None


def _layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for m, targets in sorted(graph.items()):
        if m in ("jaxrev", "jaxrev.transforms", "jaxrev.primitives") or _is_package(m):
            continue
        lm = _layer(m)
        if lm is None:
            out.append(f"{m} is in no layer of docs/architecture.md (add it there and here)")
            continue
        for t in sorted(targets):
            lt = _layer(t)
            if lt is not None and lt > lm:
                out.append(f"{m} ({LAYERS[lm][0]}) imports {t}, a higher layer ({LAYERS[lt][0]})")
    return out


def test_lower_layers_never_import_higher_ones():
    assert _layer_violations(_import_graph()) == []
    # the check itself finds one
    assert _layer_violations(
        {"jaxrev.transforms.propagation.lumps": {"jaxrev.transforms.reverse"}}
    ) == [
        "jaxrev.transforms.propagation.lumps (propagation) imports jaxrev.transforms.reverse, "
        "a higher layer (public transforms)"
    ]


def _is_package(module: str) -> bool:
    return (PKG.parent / module.replace(".", "/") / "__init__.py").exists()


# the registries are the documented extension point (filled at import, and by
# `jr.register_inverse` on request); nothing else in the transforms may be mutable state
_REGISTRIES = {
    "inverse_rules",
    "inverse_jvp_rules",
    "sweep_rules",
    "forward_rules",
    "element_rules",
    "choice_rules",
    "logdet_rules",
    "index_args",
    "kinds",
}
_MUTABLE_CALLS = {
    "list",
    "dict",
    "set",
    "OrderedDict",
    "defaultdict",
    "deque",
    "Counter",
    "Cache",
    "bytearray",
}


def test_no_module_level_mutable_state_in_the_transforms():
    """What a walk does depends only on its arguments and its context: no module of
    jaxrev/transforms/ keeps lists, dicts, sets or caches of its own at module level."""
    for path in sorted((PKG / "transforms").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            assert not isinstance(node, ast.Global), f"{path}:{node.lineno} uses `global`"
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [t.id for t in targets if isinstance(t, ast.Name)]
                value = node.value
                if value is None or names == ["__all__"]:
                    continue
                if path.name == "registry.py" and set(names) <= _REGISTRIES:
                    continue
                call = (
                    value.func.id
                    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    else value.func.attr
                    if isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                    else None
                )
                mutable = call in _MUTABLE_CALLS or isinstance(
                    value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)
                )
                assert not mutable, (
                    f"{path}:{node.lineno} keeps mutable state at module level: {', '.join(names)}"
                )


def test_only_compat_imports_jax_internals():
    for path in _modules():
        if path.name == "_compat.py":
            continue
        text = path.read_text()
        assert not re.search(r"^\s*(from|import) jax\._src", text, re.M), path
        assert not re.search(r"^\s*(from|import) jax\.interpreters", text, re.M), path


@pytest.mark.parametrize(
    "prim", [prims.scan, prims.while_, prims.cond, while_p, cond_p], ids=lambda p: p.name
)
def test_control_flow_rules_live_in_one_block(prim):
    rules = [T.inverse_rules[prim], T.sweep_rules[prim]]
    if prim in T.forward_rules:
        rules.append(T.forward_rules[prim])
    assert len({r.__module__ for r in rules}) == 1


def test_one_walker_and_one_evaluator():
    """`propagate` is defined once, `bind_eqn` is called only by the evaluator, and nothing
    else calls `jax.core.eval_jaxpr`."""
    defs, binds = [], []
    for path in _modules():
        text = path.read_text()
        if re.search(r"^def propagate\(", text, re.M):
            defs.append(path.name)
        if "bind_eqn(" in text and path.name != "_compat.py":
            binds.append(path.name)
        assert "eval_jaxpr(" not in text or path.name == "_compat.py", path
    assert defs == ["walker.py"]
    # the evaluator, trace-time values of static inputs (`Statics`), and the per-equation VJP
    # of reversible's sweep
    assert sorted(binds) == ["_env.py", "_evaluate.py", "backward.py"]


def test_tags_are_set_by_the_registering_call():
    assert {"elementwise", "linear"} <= T.kinds[lax.add_p]
    assert "bilinear" in T.kinds[lax.mul_p]
    assert {"linear", "structural"} <= T.kinds[prims.slice] and prims.slice in T.element_rules
    assert T.kinds[lax.exp_p] == frozenset({"elementwise", "smooth"})
    assert T.kinds[lax.max_p] == frozenset({"elementwise"})  # not smooth: never in a Newton group


@pytest.mark.parametrize(
    "prim,fun",
    [
        (rot_p, lambda s, th: jr.rot(s[0], s[1], th)),
        (swap_p, lambda s, th: jr.swap(s[0] * th, s[1])),
    ],
    ids=["rot", "swap"],
)
def test_inverse_jvp_rules_of_multi_output_primitives_are_used(prim, fun, monkeypatch):
    calls = []
    rule = T.inverse_jvp_rules[prim]

    def spy(*a, **k):
        calls.append(1)
        return rule(*a, **k)

    monkeypatch.setitem(T.inverse_jvp_rules, prim, spy)
    s = (jnp.array([0.3, -1.2]), jnp.array([0.7, 2.0]))
    th = 0.4
    y = fun(s, th)
    inv = jr.reverse(fun)
    t = (jnp.array([1.0, 0.5]), jnp.array([-0.2, 0.3]))
    _, got = jax.jvp(lambda y: inv(y, th), (y,), (t,))
    _, want = jax.jvp(lambda y: jr.reverse(fun)(y, th), (y,), (t,))  # same path, spied too
    assert calls, "the inverse-JVP rule was not applied"
    # against the Jacobian of the forward map: J(x) dx = t
    x = inv(y, th)
    flat = lambda v: jnp.concatenate(fun((v[:2], v[2:]), th))  # noqa: E731
    J = jax.jacfwd(flat)(jnp.concatenate(x))
    dx = np.linalg.solve(np.asarray(J), np.concatenate(t))
    np.testing.assert_allclose(np.concatenate(got), dx, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.concatenate(want), dx, rtol=1e-12, atol=1e-12)


def test_reversible_says_which_inverse_rule_is_missing():
    norule_p = Primitive("jaxrev_test_norule")
    norule_p.def_impl(lambda x: x * 2.0)
    norule_p.def_abstract_eval(lambda a: a)
    jax.interpreters.ad.defjvp(norule_p, lambda t, x: 2.0 * t)
    jax.interpreters.mlir.register_lowering(
        norule_p, jax.interpreters.mlir.lower_fun(lambda x: x * 2.0, multiple_results=False)
    )

    def f(x):
        return lax.fori_loop(0, 3, lambda i, x: norule_p.bind(x) + 1.0, x)

    rep = jr.memory_report(f, jnp.ones(4), checkpoint_every=None)
    whats = [e["what"] for e in rep.entries]
    assert any("no inverse rule for `jaxrev_test_norule`" in w for w in whats), str(rep)
    assert "lossy" not in str(rep)
    g = jax.grad(lambda x: jr.reversible(f)(x).sum())(jnp.ones(4))
    np.testing.assert_allclose(g, jax.grad(lambda x: f(x).sum())(jnp.ones(4)))
    with pytest.raises(jr.NotInvertibleError, match="jaxrev_test_norule.*no inverse rule"):
        jr.reverse(f)(jnp.ones(4))
