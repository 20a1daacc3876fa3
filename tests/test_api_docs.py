"""docs/api.md is generated from the public names' docstrings by tools/gen_api.py: it must be
up to date, and every public function and class should carry an example (``>>>``)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "gen_api.py")


def _load_gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen_api = _load_gen_api()


def test_api_reference_is_up_to_date():
    stale = gen_api.check()
    assert not stale, (
        f"{', '.join(stale)} is stale: a public docstring or signature changed. Regenerate it "
        f"with `python tools/gen_api.py` (from the repository root) and commit the result."
    )


def test_render_is_deterministic():
    assert gen_api.render() == gen_api.render()


def test_default_values_render_without_addresses():
    class Thing:
        pass

    def f(a, b=Thing(), *, c=len, d=(1, "x"), e=None):
        pass

    text = gen_api.render_signature("f", inspect.signature(f))
    assert "0x" not in text
    assert "b=<Thing>" in text and "c=len" in text and "d=(1, 'x')" in text, text


def test_every_public_name_has_an_example():
    missing = gen_api.missing_examples()
    assert not missing, (
        "these public functions and classes have no example (>>>) in their "
        f"docstring: {', '.join(missing)}"
    )
