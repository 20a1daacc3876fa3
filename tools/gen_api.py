"""Write docs/api.md, the API reference, from the public names' docstrings and signatures.

    python tools/gen_api.py                      # regenerate docs/api.md
    python tools/gen_api.py --check              # exit 1 if docs/api.md is stale
    python tools/gen_api.py --missing-examples   # list public names whose docstring has no >>>

The page covers every name in `jaxrev.__all__` (in that order), every name in
`jaxrev.optim.__all__`, and the optional modules `jaxrev.diffrax` (`ReversibleAdjoint`,
`Reversible`), `jaxrev.flowjax` (`Bijection`), `jaxrev.numpyro` (`Transform`), `jaxrev.lineax`
(`InverseAccumulation`) and `jaxrev.optimistix` (`Newton`, `GaussNewton`,
`LevenbergMarquardt`, `NewtonMinimiser`). Classes list their public
methods and properties that have docstrings (and name the others). The output is
deterministic: no addresses, no timestamps; signatures are rendered from `inspect.signature`
by this script, and default values that are objects are rendered by name.

diffrax, flowjax, numpyro, lineax and optimistix are optional: where such a module cannot be
imported, the section it would produce is copied from the existing docs/api.md (so `--check`
still compares the rest), and a note says so.
`tests/test_api_docs.py` runs `check()` in-process.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import enum
import importlib
import inspect
import os
import re
import sys
import types
from collections.abc import Sequence
from typing import Any, ForwardRef

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_MD = os.path.join(ROOT, "docs", "api.md")
API_REL = os.path.join("docs", "api.md")
REGENERATE = "python tools/gen_api.py"

OPTIONAL = {
    "diffrax": ("ReversibleAdjoint", "Reversible"),
    "flowjax": ("Bijection",),
    "numpyro": ("Transform",),
    "lineax": ("InverseAccumulation",),
    "optimistix": ("Newton", "GaussNewton", "LevenbergMarquardt", "NewtonMinimiser"),
}
"""Optional modules (`jaxrev.<name>`, importing the library of that name) and their names."""


def _begin(mod: str) -> str:
    return f"<!-- begin jaxrev.{mod} -->"


def _end(mod: str) -> str:
    return f"<!-- end jaxrev.{mod} -->"


WIDTH = 92  # a signature longer than this is written one parameter a line

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


# --------------------------------------------------------------------------- import


def _import_jaxrev() -> types.ModuleType:
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    return importlib.import_module("jaxrev")


def _import_optional(mod: str) -> types.ModuleType | None:
    """`jaxrev.<mod>`, or None where its library (or equinox) is not installed."""
    _import_jaxrev()
    try:
        return importlib.import_module(f"jaxrev.{mod}")
    except ImportError:
        return None


# --------------------------------------------------------------------------- values and signatures


def _qualname(obj: Any) -> str:
    """``module.name``, by the shortest public path: a class that its top-level package
    exports is named from there (``diffrax.AbstractAdjoint``, not its private module)."""
    mod = getattr(obj, "__module__", None)
    name = (
        getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    )
    if mod in (None, "builtins"):
        return name
    top = sys.modules.get(mod.split(".")[0])
    if top is not None and "." not in name and getattr(top, name, None) is obj:
        return f"{top.__name__}.{name}"
    return f"{mod}.{name}"


def render_value(v: Any) -> str:
    """A default value or constant, written the same way on every run: literals by `repr`,
    containers element by element, functions, classes and modules by name, enums as
    ``Class.MEMBER``, and any other object as ``<TypeName>`` (never with its address)."""
    if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
        return repr(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        inner = ", ".join(render_value(x) for x in v)
        return f"({inner},)" if len(v) == 1 else f"({inner})"
    if isinstance(v, list):
        return "[" + ", ".join(render_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{render_value(k)}: {render_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (frozenset, set)):
        items = sorted(render_value(x) for x in v)
        return f"{type(v).__name__}({{{', '.join(items)}}})" if items else f"{type(v).__name__}()"
    if isinstance(v, types.ModuleType):
        return v.__name__
    if isinstance(v, type) or callable(v) and hasattr(v, "__qualname__"):
        return _qualname(v)
    text = repr(v)
    if _ADDRESS.search(text) or text.startswith("<"):
        # dataclasses' default-factory marker prints as "<factory>", which is stable
        return text if text == "<factory>" else f"<{type(v).__name__}>"
    return text


def render_annotation(a: Any) -> str:
    if a is inspect.Parameter.empty:
        return ""
    if isinstance(a, str):
        return a
    if isinstance(a, ForwardRef):
        return a.__forward_arg__
    if isinstance(a, type):
        return _qualname(a)
    return _ADDRESS.sub("", inspect.formatannotation(a))


def _param(p: inspect.Parameter) -> str:
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    text = prefix.get(p.kind, "") + p.name
    ann = render_annotation(p.annotation)
    if ann:
        text += f": {ann}"
    if p.default is not inspect.Parameter.empty:
        text += (" = " if ann else "=") + render_value(p.default)
    return text


def render_signature(
    name: str,
    sig: inspect.Signature | None,
    prefix: str = "",
    drop_first: bool = False,
    width: int = WIDTH,
) -> str:
    """``prefix name(params) -> ret``, one parameter a line where it is long."""
    if sig is None:
        return f"{prefix}{name}"
    params = list(sig.parameters.values())
    if drop_first and params:
        params = params[1:]
    parts: list[str] = []
    kinds = [p.kind for p in params]
    for i, p in enumerate(params):
        if (
            p.kind is inspect.Parameter.KEYWORD_ONLY
            and inspect.Parameter.VAR_POSITIONAL not in kinds
            and (i == 0 or params[i - 1].kind is not inspect.Parameter.KEYWORD_ONLY)
        ):
            parts.append("*")
        parts.append(_param(p))
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and (
            i + 1 == len(params) or params[i + 1].kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
    ret = render_annotation(sig.return_annotation)
    tail = f" -> {ret}" if ret else ""
    one = f"{prefix}{name}({', '.join(parts)}){tail}"
    if len(one) <= width or not parts:
        return one
    body = "".join(f"    {x},\n" for x in parts)
    return f"{prefix}{name}(\n{body}){tail}"


def _signature(obj: Any) -> inspect.Signature | None:
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        # an enum is looked up by its value (`Status(0)`); inspect renders EnumType's own
        # functional-API signature, which differs between Python versions
        return inspect.Signature([inspect.Parameter("value", inspect.Parameter.POSITIONAL_ONLY)])
    try:
        return inspect.signature(obj)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- docstrings


def own_doc(obj: Any) -> str:
    """`obj`'s own docstring, cleaned (never one inherited from a base class)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else getattr(obj, "__doc__", None)
    if isinstance(obj, property):
        doc = obj.__doc__ or (obj.fget.__doc__ if obj.fget else None)
    return inspect.cleandoc(doc) if isinstance(doc, str) and doc.strip() else ""


def has_example(doc: str) -> bool:
    return ">>>" in doc


def doc_to_markdown(doc: str) -> str:
    """A docstring as Markdown: doctest blocks (from a ``>>>`` line to the next blank line or
    dedent) become ```pycon fences, dedented; everything else is kept as written."""
    if not doc:
        return "*(no docstring)*"
    lines = doc.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            indent = len(line) - len(line.lstrip())
            block = []
            while (
                i < len(lines)
                and lines[i].strip()
                and (len(lines[i]) - len(lines[i].lstrip()) >= indent)
            ):
                block.append(lines[i][indent:].rstrip())
                i += 1
            if out and out[-1].strip():
                out.append("")
            out += ["```pycon", *block, "```", ""]
            continue
        out.append(line.rstrip())
        i += 1
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _attribute_doc(module: types.ModuleType, name: str) -> str:
    """The string literal right after ``name = ...`` at the top level of `module`'s source."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return ""
    body = tree.body
    for k, node in enumerate(body[:-1]):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, ast.AnnAssign)
            else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            nxt = body[k + 1]
            if (
                isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                return inspect.cleandoc(nxt.value.value)
    return ""


# --------------------------------------------------------------------------- entries


@dataclasses.dataclass
class Entry:
    qualname: str  # e.g. "jaxrev.reverse"
    obj: Any
    module: types.ModuleType  # where the name is exported from

    @property
    def anchor(self) -> str:
        # a module exported by name (`jaxrev.optim`) has a section of its own with that id
        return self.qualname + ("-module" if isinstance(self.obj, types.ModuleType) else "")


def _public_ancestors(cls: type, exported: dict[int, str]) -> list[str]:
    """`cls`'s bases, private ones replaced by their own bases; exported ones by their public
    name."""
    out: list[str] = []
    for base in cls.__bases__:
        if base is object:
            continue
        if id(base) in exported:
            out.append(exported[id(base)])
        elif base.__name__.startswith("_"):
            out += _public_ancestors(base, exported)
        else:
            out.append(_qualname(base))
    return out


def _foreign(cls: type, name: str) -> bool:
    """Whether `name` is also defined by a base class outside jaxrev (a protocol's method that
    `cls` implements, such as diffrax's `AbstractAdjoint.loop`)."""
    return any(
        name in klass.__dict__
        for klass in cls.__mro__[1:]
        if not (getattr(klass, "__module__", "") or "").startswith("jaxrev")
    )


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined in jaxrev (first definition in the MRO wins), in
    definition order."""
    seen: dict[str, Any] = {}
    for klass in cls.__mro__:
        if not (getattr(klass, "__module__", "") or "").startswith("jaxrev"):
            continue
        for name, member in klass.__dict__.items():
            if name.startswith("_") or name in seen:
                continue
            if isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member) or isinstance(member, property):
                seen[name] = member
    return list(seen.items())


def render_entry(e: Entry, exported: dict[int, str]) -> str:
    obj, q = e.obj, e.qualname
    out = [f'<a id="{e.anchor}"></a>', "", f"### `{q}`", ""]
    if isinstance(obj, types.ModuleType):
        out += [
            f"Module `{obj.__name__}`; its names are listed under "
            f"[`{obj.__name__}`](#{obj.__name__}) below.",
            "",
        ]
        first = own_doc(obj).split("\n\n")[0]
        if first:
            out += [first, ""]
        return "\n".join(out)
    if isinstance(obj, type):
        sig = _signature(obj)
        if sig is not None:  # a constructor returns the instance: no "-> None"
            sig = sig.replace(return_annotation=inspect.Signature.empty)
        out += ["```python", render_signature(q, sig, prefix="class "), "```", ""]
        bases = _public_ancestors(obj, exported)
        if bases:
            out += ["Bases: " + ", ".join(f"`{b}`" for b in bases), ""]
        out += [doc_to_markdown(own_doc(obj)), ""]
        documented, others = [], []
        for name, member in _members(obj):
            if own_doc(member):
                documented.append((name, member))
            elif not _foreign(obj, name):
                others.append((name, member))
        for name, member in documented:
            out += [f"#### `{q}.{name}`", ""]
            if isinstance(member, property):
                out += ["*property*", ""]
            else:
                out += [
                    "```python",
                    render_signature(f"{q}.{name}", _signature(member), drop_first=True),
                    "```",
                    "",
                ]
            out += [doc_to_markdown(own_doc(member)), ""]
        if others:
            names = []
            for name, member in others:
                if isinstance(member, property):
                    names.append(f"`{name}` (property)")
                else:
                    names.append(
                        "`"
                        + render_signature(name, _signature(member), drop_first=True, width=10**6)
                        + "`"
                    )
            out += ["Other public members (no docstring yet): " + "; ".join(names) + ".", ""]
        return "\n".join(out).rstrip() + "\n"
    if callable(obj):
        out += ["```python", render_signature(q, _signature(obj)), "```", ""]
        out += [doc_to_markdown(own_doc(obj)), ""]
        return "\n".join(out).rstrip() + "\n"
    # a constant
    out += ["```python", f"{q} = {render_value(obj)}", "```", ""]
    doc = _attribute_doc(e.module, q.rsplit(".", 1)[1])
    out += [doc_to_markdown(doc) if doc else "", ""]
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------- the page

HEADER = f"""# API reference

<!-- Generated by `{REGENERATE}` from the docstrings and signatures: do not edit by
hand. `{REGENERATE} --check` (run by tests/test_api_docs.py) fails when it is stale. -->

Every public name of `jaxrev` (its `__all__`, in that order), of `jaxrev.optim` and
`jaxrev.diffrax` (`ReversibleAdjoint`, `Reversible`), with its signature and docstring. The guides
(`docs/reverse.md`, `docs/reversible.md`, `docs/inverse_ad.md`, `docs/flows.md`,
`docs/optim.md`, `docs/primitives.md`, `docs/custom_rules.md`) explain how to use them;
`docs/design.md` is the contract they implement.
"""


def _entries() -> tuple[list[Entry], list[Entry], dict[str, types.ModuleType | None]]:
    jr = _import_jaxrev()
    optim = importlib.import_module("jaxrev.optim")
    top = [Entry(f"jaxrev.{n}", getattr(jr, n), jr) for n in jr.__all__]
    opt = [Entry(f"jaxrev.optim.{n}", getattr(optim, n), optim) for n in optim.__all__]
    return top, opt, {m: _import_optional(m) for m in OPTIONAL}


def _optional_entries(mods: dict) -> dict[str, list[Entry]]:
    return {
        m: [Entry(f"jaxrev.{m}.{n}", getattr(mod, n), mod) for n in OPTIONAL[m]]
        for m, mod in mods.items()
        if mod is not None
    }


def _exported(entries: Sequence[Entry]) -> dict[int, str]:
    return {id(e.obj): e.qualname for e in entries if isinstance(e.obj, type)}


def _existing_section(mod: str) -> str | None:
    try:
        with open(API_MD, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return None
    a, b = text.find(_begin(mod)), text.find(_end(mod))
    if a < 0 or b < a:
        return None
    return text[a : b + len(_end(mod))]


def render() -> str:
    """The text of docs/api.md."""
    top, opt, mods = _entries()
    extra = _optional_entries(mods)
    exported = _exported(top + opt + [e for es in extra.values() for e in es])
    optim = importlib.import_module("jaxrev.optim")

    parts = [HEADER, "## Contents", ""]
    parts.append(
        "- [`jaxrev`](#jaxrev): "
        + ", ".join(f"[`{e.qualname.split('.', 1)[1]}`](#{e.anchor})" for e in top)
    )
    parts.append(
        "- [`jaxrev.optim`](#jaxrev.optim): "
        + ", ".join(f"[`{e.qualname.rsplit('.', 1)[1]}`](#{e.anchor})" for e in opt)
    )
    for m, names in OPTIONAL.items():
        parts.append(
            f"- [`jaxrev.{m}`](#jaxrev.{m}): "
            + ", ".join(f"[`{n}`](#jaxrev.{m}.{n})" for n in names)
        )
    parts.append("")

    parts += [
        '<a id="jaxrev"></a>',
        "",
        "## `jaxrev`",
        "",
        doc_to_markdown(own_doc(sys.modules["jaxrev"])),
        "",
    ]
    parts += [render_entry(e, exported) for e in top]

    parts += [
        '<a id="jaxrev.optim"></a>',
        "",
        "## `jaxrev.optim`",
        "",
        doc_to_markdown(own_doc(optim)),
        "",
    ]
    parts += [render_entry(e, exported) for e in opt]

    for m in OPTIONAL:
        if mods[m] is not None:
            section = [
                _begin(m),
                "",
                f'<a id="jaxrev.{m}"></a>',
                "",
                f"## `jaxrev.{m}`",
                "",
                doc_to_markdown(own_doc(mods[m])),
                "",
            ]
            section += [render_entry(e, exported) for e in extra[m]]
            parts.append("\n".join(section).rstrip() + "\n\n" + _end(m))
            continue
        kept = _existing_section(m)
        if kept is None:
            kept = "\n".join(
                [
                    _begin(m),
                    "",
                    f'<a id="jaxrev.{m}"></a>',
                    "",
                    f"## `jaxrev.{m}`",
                    "",
                    f"*({m} was not installed when this page was generated: run "
                    f"`{REGENERATE}` where it is.)*",
                    "",
                    _end(m),
                ]
            )
        parts.append(kept)
    text = "\n".join(parts)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip() + "\n"
    return _ADDRESS.sub("", text)


def write(path: str = API_MD) -> str:
    text = render()
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)
    return text


def check(path: str = API_MD) -> list[str]:
    """The files that are stale (empty when docs/api.md matches the docstrings)."""
    try:
        with open(path, encoding="utf-8") as f:
            current = f.read()
    except OSError:
        return [API_REL]
    return [] if current == render() else [API_REL]


def missing_examples(names: Sequence[str] | None = None, *, everything: bool = False) -> list[str]:
    """Public functions and classes whose own docstring has no ``>>>`` example.

    By default the names of `jaxrev.__all__` (modules and constants are not counted);
    ``everything=True`` adds `jaxrev.optim`'s and the optional modules'."""
    top, opt, mods = _entries()
    entries = list(top)
    if everything:
        entries += opt
        entries += [e for es in _optional_entries(mods).values() for e in es]
    if names is not None:
        entries = [e for e in entries if e.qualname in names or e.qualname.split(".")[-1] in names]
    return [
        e.qualname
        for e in entries
        if (isinstance(e.obj, type) or inspect.isfunction(e.obj) or inspect.isroutine(e.obj))
        and not has_example(own_doc(e.obj))
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 (writing nothing) if docs/api.md is stale"
    )
    ap.add_argument(
        "--missing-examples",
        action="store_true",
        help="list the public functions and classes whose docstring has no >>>",
    )
    args = ap.parse_args(argv)
    for m in OPTIONAL:
        if _import_optional(m) is None:
            print(
                f"gen_api: jaxrev.{m} cannot be imported (is {m} installed?); its section "
                "is kept as it is in docs/api.md",
                file=sys.stderr,
            )
    if args.missing_examples:
        for q in missing_examples(everything=True):
            print(q)
        return 0
    if args.check:
        stale = check()
        if stale:
            for p in stale:
                print(
                    f"{p} is stale (the docstrings or signatures changed): run "
                    f"`{REGENERATE}` to regenerate it",
                    file=sys.stderr,
                )
            return 1
        print(f"{API_REL} is up to date")
        return 0
    write()
    print(f"wrote {API_REL}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
