"""One factory for a jaxrev primitive's JAX rules (after Equinox's `create_vprim`).

`make_primitive` creates a primitive and registers, in one call, whatever JAX rules it has:
evaluation, abstract evaluation (plain or effectful), an XLA lowering of a JAX-traceable
function (one for every platform, or one per platform), JVP, transpose, batching and its own
linearization. jaxrev's rules (inverse, inverse JVP, sweep, ...) are not JAX's: they are
registered separately with `transforms.registry.define`.

Every primitive jaxrev defines is made here, so what each one has is recorded in one place
(`rules_of`); a test checks that against JAX's own tables (`_compat.registered_rules`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from jaxrev._compat import (
    Primitive,
    lower_fun,
    primitive_batchers,
    primitive_jvps,
    primitive_transposes,
    register_linearization,
    register_lowering,
)

__all__ = ["make_primitive", "rules_of", "made_primitives", "RULES"]

RULES = ("impl", "abstract", "lowering", "jvp", "transpose", "batch", "linearize")
"""The names of the JAX rules the factory registers, as `rules_of` reports them."""

# the primitives the factory made, with the rules it gave each (a registry: written only
# when a primitive is made, at import)
_made: dict[Primitive, frozenset[str]] = {}


def make_primitive(
    name: str,
    *,
    impl: Callable,
    abstract: Callable,
    effectful: bool = False,
    multiple_results: bool = False,
    lowering: Callable | Mapping[str | None, Callable] | None = None,
    jvp: Callable | None = None,
    transpose: Callable | None = None,
    batch: Callable | None = None,
    linearize: Callable | None = None,
) -> Primitive:
    """A new primitive `name` with its JAX rules registered.

    - `impl(*args, **params)`: eager evaluation.
    - `abstract(*avals, **params)`: the output avals; with ``effectful=True`` it returns
      ``(avals, effects)`` (a primitive that must not be removed as dead code).
    - `lowering`: the JAX-traceable function lowered (by `lower_fun`) for every platform;
      None lowers `impl`; a mapping ``{platform: fun}`` lowers per platform (the key None
      for the platforms not named).
    - `jvp(primals, tangents, **params)`, `transpose(cts, *args, **params)` (linear
      primitives only), `batch(args, dims, **params)`: JAX's rule contracts.
    - `linearize(nonzeros, *primals, **params)`: the primitive's own linearization (see
      `_compat.register_linearization`), which spares JAX tracing `jvp` with partial
      evaluation; without it JAX derives one from `jvp`.
    """
    p = Primitive(name)
    p.multiple_results = multiple_results
    p.def_impl(impl)
    if effectful:
        p.def_effectful_abstract_eval(abstract)
    else:
        p.def_abstract_eval(abstract)
    if not isinstance(lowering, Mapping):
        lowering = {None: impl if lowering is None else lowering}
    for platform, fun in lowering.items():
        rule = lower_fun(fun, multiple_results=multiple_results)
        if platform is None:
            register_lowering(p, rule)
        else:
            register_lowering(p, rule, platform=platform)
    given = {"impl", "abstract", "lowering"}
    for table, rule, what in (
        (primitive_jvps, jvp, "jvp"),
        (primitive_transposes, transpose, "transpose"),
        (primitive_batchers, batch, "batch"),
    ):
        if rule is not None:
            table[p] = rule
            given.add(what)
    if linearize is not None:
        register_linearization(p, linearize)
        given.add("linearize")
    _made[p] = frozenset(given)
    return p


def rules_of(p: Primitive) -> frozenset[str] | None:
    """The JAX rules `make_primitive` registered for `p` (names from `RULES`); None where
    `p` was not made by it."""
    return _made.get(p)


def made_primitives() -> Mapping[Primitive, frozenset[str]]:
    """Every primitive the factory made so far, with its rules (read-only)."""
    return MappingProxyType(_made)
