"""The rule registries of every jaxrev transform, keyed by primitive object, and the one call
that fills them (`define`).

A primitive's rules are registered together, in one `define(...)` call right after the rules
themselves (as JAX's `lax/control_flow/loops.py` registers every interpreter's rule for `scan_p`
in one block). The call also tags the primitive with what the walker may assume of it
(`kinds`): elementwise, linear in every input, or bilinear. There is no default rule: a
transform that meets a primitive missing from the registry it needs raises naming it.

The registries:

- `inverse_rules`: ``rule(out, *invals, **params) -> recovered invals`` (see `register_inverse`).
- `inverse_jvp_rules`: ``rule(out_tangent, out, *invals, **params) -> input tangents``.
- `sweep_rules`: ``rule(plan, eqn_index, env, ctenv, active, residuals)``: `reversible`'s
  backward sweep of an equation whose inverse is a program of its own (loops, branches).
- `forward_rules`: ``rule(eqn, loop_plan, invals) -> (outvals, residuals)``: `reversible`'s
  forward run of such an equation, returning what its sweep needs stored.
- `choice_rules`: `ChoiceRule(count, branch, holds)`: a primitive that picks between values by
  a decision made on them (`select_n`, `max`, `abs`, `cond`), so that a group of equations
  whose decision depends on the unknown state inverts one branch at a time (see `choices`).
- `element_rules`: `ElementRule(forward, backward)`, each ``rule(eqn, env) -> bool | None``:
  propagation of knowledge of some elements of a value (docs/design.md §3.5; see `elements`), for
  primitives whose partial knowledge the generic elementwise and structural handling does not
  capture (`select_n`, `mul` by a factor with zeros, scatters, dynamic slices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp

from jaxrev._compat import DropVar, JaxprEqn, Primitive

__all__ = [
    "inverse_rules",
    "inverse_jvp_rules",
    "sweep_rules",
    "forward_rules",
    "element_rules",
    "ElementRule",
    "choice_rules",
    "ChoiceRule",
    "index_args",
    "logdet_rules",
    "kinds",
    "ELEMENTWISE",
    "LINEAR",
    "BILINEAR",
    "SMOOTH",
    "STRUCTURAL",
    "WALKS",
    "define",
    "is_kind",
    "elementwise_in",
    "elementwise_over",
    "broadcasts_to",
    "Lossy",
    "NeedMore",
    "Unsupported",
    "register_inverse",
    "register_inverse_jvp",
    "check_rule",
    "LogdetContext",
    "LogdetResult",
    "ElementResult",
    "DENSE_STEP",
]

inverse_rules: dict[Primitive, Callable[..., Sequence[Any]]] = {}
"""Inverse rule per primitive: ``rule(out, *invals, **params) -> recovered invals``."""

inverse_jvp_rules: dict[Primitive, Callable[..., Sequence[Any]]] = {}
"""Inverse-JVP rule per primitive: ``rule(out_tangent, out, *invals, **params) -> in tangents``
(the tangent of each input recovered by the inverse rule, None elsewhere)."""

sweep_rules: dict[Primitive, Callable[..., None]] = {}
"""`reversible`'s backward sweep of loops and branches:
``rule(plan, eqn_index, env, ctenv, active, residuals)``."""

forward_rules: dict[Primitive, Callable[..., tuple[list, list]]] = {}
"""`reversible`'s forward run of an equation whose sweep needs residuals:
``rule(eqn, loop_plan, invals) -> (outvals, residuals)``."""


class ElementResult(NamedTuple):
    """What an element rule may return instead of True / False / None: that (`learned`), and
    what it found lost on the way (`losses`: an equation, its own or another's, mapped to the
    `Lossy` reason its inversion is blocked by, or None: nothing lost there), which the walk
    keeps in its knowledge (`elements.forward` / `backward`) and reports if it ends stuck."""

    learned: bool | None
    losses: dict


class ElementRule(NamedTuple):
    """Element-level rules of one primitive: `forward(eqn, env)` computes outputs known on some
    elements from inputs known on some; `backward(eqn, env)` learns (some elements of) inputs
    from outputs. Each returns True (learned something), False (the equation is its: nothing
    new yet) or None (declined: the walker goes on with the generic handling and the primitive's
    ordinary inverse rule), or an `ElementResult`: one of those, with what it found lost. A
    rule writes what it learned through `elements.learn`, never into the walk's state."""

    forward: Callable[..., bool | None] | None = None
    backward: Callable[..., bool | None] | None = None


element_rules: dict[Primitive, ElementRule] = {}
"""Element-level rules per primitive (see `ElementRule`)."""


class ChoiceRule(NamedTuple):
    """A primitive that picks one of a few values by a decision on its inputs (docs/design.md
    §3.5): `count(eqn)` branches; `branch(eqn, k)` is what branch k computes, as an equation
    with the same output (a copy of a case, `neg` for `abs`), or the operand (Var or Literal)
    whose value, broadcast, the output then is; `holds(eqn, invals, k)` is where branch k is
    the one taken (a boolean of the output's shape, or a scalar for a whole-array decision);
    `fails(eqn, k)` (optional) says branch k never returns a value: it raises when it runs
    (Equinox's `error_if`), so no output comes from it and it is no case to invert."""

    count: Callable[..., int]
    branch: Callable[..., Any]
    holds: Callable[..., Any]
    fails: Callable[..., bool] | None = None


choice_rules: dict[Primitive, ChoiceRule] = {}
"""Choice rules per primitive (see `ChoiceRule`)."""

logdet_rules: dict[Primitive, Callable[..., tuple[Any, Any]]] = {}
"""log|det| of a step the log-determinant sweep cannot see into (`logdet.LogdetContext` ->
(sign, log|det ∂outputs/∂recovered inputs|), both in flat order): loops, products by known
matrices, the user's `register_logdet`."""

index_args: dict[Primitive, tuple[int, ...]] = {}
"""For a `STRUCTURAL` primitive, the operands that are indices (a gather's, a dynamic slice's
starts): the element positions it moves depend on their values, not on the data operands'."""

ELEMENTWISE = "elementwise"
"""Output element k depends on input element k only (scalars broadcast)."""
LINEAR = "linear"
"""Linear (affine with a literal offset) in every floating-point input."""
BILINEAR = "bilinear"
"""Linear in each input when the others are fixed (`mul`, `dot_general`)."""
STRUCTURAL = "structural"
"""Moves elements without computing on them: every output element is a copy of one element of
an operand (reshape, transpose, slices, concatenate, pad, gather, set-scatter, select_n, ...),
which positions being fixed by the params and the `index_args` operands."""
SMOOTH = "smooth"
"""Differentiable wherever it is defined (linear and bilinear primitives are too): Newton's
method may solve a group of such equations (docs/design.md §3.6)."""
WALKS = "jaxrev_walks"
"""The mark (an attribute, set by ``define(..., walks=True)``) of an inverse rule that walks on
its own (a loop's or branch's body, inverted by `invert_jaxpr`) or checks values when the
program runs: the walker passes it the walk's `RuleContext` (the equation, its env, the walk
context) as the keyword `ctx`. The mark is the rule's, not the primitive's: a built-in rule
registered again (or wrapped with `functools.wraps`) still gets its `ctx`, and a user's rule
keeps the signature ``rule(out, *invals, **params)``."""

kinds: dict[Primitive, frozenset[str]] = {}
"""What the walker may assume of a primitive, set by the call that registers its rules."""


class Lossy(Exception):
    """Raised by an inverse rule when its equation destroys information: `singular`, it
    divides by an exact zero; `subspace`, it is linear and drops dimensions (the real part of
    a complex value), which a group of equations whose inputs have no more freedom may not
    need (a linear lump then holds it where the lump is regular)."""

    def __init__(
        self, reason: str, hint: str | None = None, singular: bool = False, subspace: bool = False
    ) -> None:
        super().__init__(reason)
        self.reason = reason
        self.hint = hint
        self.singular = singular
        self.subspace = subspace


class Unsupported(Exception):
    """Raised by a log-determinant rule (and the sweep) for a step it cannot describe: the
    caller then takes the dense Jacobian's."""


class NeedMore(Exception):
    """Raised by an inverse rule that may succeed once more of its inputs are known."""

    def __init__(self, reason: str, inner: list | None = None, hint: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.inner = inner or []
        self.hint = hint


def define(
    p: Primitive | None,
    *,
    inverse: Callable | None = None,
    inverse_jvp: Callable | None = None,
    sweep: Callable | None = None,
    forward: Callable | None = None,
    element: ElementRule | None = None,
    choice: ChoiceRule | None = None,
    logdet: Callable | None = None,
    kind: Sequence[str] = (),
    index: Sequence[int] = (),
    walks: bool = False,
) -> None:
    """Register every jaxrev rule of `p` at once and tag it with `kind` (`walks`: its inverse
    rule takes the walk's `ctx`, see `WALKS`). A primitive missing from this JAX version (None) is
    skipped, so rule blocks need no version checks."""
    if p is None:
        return
    for table, rule in (
        (inverse_rules, inverse),
        (inverse_jvp_rules, inverse_jvp),
        (sweep_rules, sweep),
        (forward_rules, forward),
        (element_rules, element),
        (choice_rules, choice),
        (logdet_rules, logdet),
    ):
        if rule is not None:
            table[p] = rule
    if index:
        index_args[p] = tuple(index)
    if walks and inverse is not None:
        setattr(inverse, WALKS, True)
    if kind:
        kinds[p] = kinds.get(p, frozenset()) | frozenset(kind)


def is_kind(p: Primitive, kind: str) -> bool:
    if kind == SMOOTH:
        return bool(kinds.get(p, frozenset()) & {SMOOTH, LINEAR, BILINEAR})
    return kind in kinds.get(p, ())


def elementwise_in(eqn: Any, shape: tuple[int, ...]) -> bool:
    """An elementwise equation all of whose operands have `shape` (or are scalars)."""
    return (
        is_kind(eqn.primitive, ELEMENTWISE)
        and all(tuple(o.aval.shape) == shape for o in eqn.outvars if not isinstance(o, DropVar))
        and all(tuple(v.aval.shape) in (shape, ()) for v in eqn.invars)
    )


def broadcasts_to(a: tuple, shape: tuple) -> bool:
    """Whether an operand of shape `a` meets the output `shape` elementwise: the same shape,
    a scalar, or the same rank with size-1 axes (lax's binary ops broadcast those, as
    `s * w[None]` under `vmap` writes them)."""
    return a in (shape, ()) or (len(a) == len(shape) and all(x in (1, y) for x, y in zip(a, shape)))


def elementwise_over(eqn: Any, shape: tuple[int, ...]) -> bool:
    """`elementwise_in`, also with operands broadcast over size-1 axes (`broadcasts_to`)."""
    return (
        is_kind(eqn.primitive, ELEMENTWISE)
        and all(tuple(o.aval.shape) == shape for o in eqn.outvars if not isinstance(o, DropVar))
        and all(broadcasts_to(tuple(v.aval.shape), shape) for v in eqn.invars)
    )


def check_rule(who: str, primitive: Any, rule: Any) -> None:
    """The arguments of a public `register_*` call: a primitive and a callable."""
    if not isinstance(primitive, Primitive):
        raise TypeError(f"{who} expects a jax.extend.core.Primitive, got {primitive!r}")
    if not callable(rule):
        raise TypeError(f"{who} expects a callable rule, got {rule!r}")


def register_inverse(primitive: Primitive, rule: Callable[..., Sequence[Any]]) -> None:
    """Make `reverse` (and every transform built on it) able to invert `primitive`.

    **Arguments:**

    - `primitive`: a JAX primitive (`jax.extend.core.Primitive`).
    - `rule`: ``rule(out, *invals, **params)``. It receives the equation's output (a list for
      a primitive with multiple results), its inputs with the unknown ones passed as `Unknown`
      objects (which carry `.aval`, `.shape`, `.dtype`), and its params. It returns one entry
      per input: the recovered value, or None where it recovers nothing. It raises
      `jaxrev.transforms.Lossy(reason)` where the step destroys information.

    **Returns:**

    None; the rule is registered for every later trace.

    **Example:**

        >>> import jax.numpy as jnp, jaxrev as jr
        >>> from jax.extend.core import Primitive
        >>> double_p = Primitive("double"); _ = double_p.def_impl(lambda x: 2 * x)
        >>> _ = double_p.def_abstract_eval(lambda a: a)
        >>> jr.register_inverse(double_p, lambda out, x: [out / 2])
        >>> jr.reverse(lambda x: double_p.bind(x))(jnp.ones(2)).tolist()
        [0.5, 0.5]
    """
    check_rule("register_inverse", primitive, rule)
    define(primitive, inverse=rule)


def register_inverse_jvp(primitive: Primitive, rule: Callable[..., Sequence[Any]]) -> None:
    """State the derivative of `primitive`'s inverse, for `inverse_jvp` and for derivatives taken
    through `reverse`.

    Without it, derivatives go through the inverse rule's own code, which is right whenever
    that code is differentiable.

    **Arguments:**

    - `primitive`: a primitive with an inverse rule (`register_inverse`).
    - `rule`: ``rule(out_tangent, out, *invals, **params)``. It receives the output's tangent
      (with the known inputs' part already taken out), the output, and every input (the
      recovered ones filled in); for a primitive with multiple results `out_tangent` and `out`
      are lists. It returns one entry per input: the tangent of each input its inverse rule
      recovers (solving ``J_x t = out_tangent``), None elsewhere.

    **Returns:**

    None; the rule is registered for every later trace.

    **Example:**

        >>> import jax, jax.numpy as jnp, jaxrev as jr
        >>> from jax.extend.core import Primitive
        >>> cube_p = Primitive("cube"); _ = cube_p.def_impl(lambda x: x ** 3)
        >>> _ = cube_p.def_abstract_eval(lambda a: a)
        >>> # an inverse computed where JAX cannot differentiate it (stop_gradient stands in)
        >>> jr.register_inverse(cube_p, lambda out, x: [jax.lax.stop_gradient(jnp.cbrt(out))])
        >>> jr.register_inverse_jvp(cube_p, lambda t, out, x: [t / (3 * x ** 2)])
        >>> round(float(jax.jvp(jr.reverse(cube_p.bind), (8.0,), (1.0,))[1]), 6)  # 1/12
        0.083333
    """
    check_rule("register_inverse_jvp", primitive, rule)
    define(primitive, inverse_jvp=rule)


# --------------------------------------------------------------------------- log-det rule contract

DENSE_STEP = 1024
"""Unknowns of a step, at most, whose log-determinant is found from its dense Jacobian."""


class LogdetResult(NamedTuple):
    """What a `logdet_rules` entry may return instead of ``(sign, logabs)``: also the
    equation's outputs, where it computed them on the way (a loop's rule runs the loop
    forward over its recovered inputs), so that a forward run that asks for the log-det
    (`forward_and_slogdet`) takes them from it instead of running the loop a second time;
    `outs` None where it did not."""

    sign: Any
    logabs: Any
    outs: list | None = None


class LogdetContext:
    """What a `logdet_rules` entry gets: the equation, its inputs' and outputs' values (an
    output not computed yet reads None: the forward sweep asks a loop's rule for them), which
    inputs were recovered, and (for a loop or branch) the plan of its sub-jaxpr's walk. A rule
    returns ``(sign, logabs)`` or a `LogdetResult`."""

    def __init__(
        self, eqn: JaxprEqn, read: Callable[[Any], Any], recovered: Sequence[bool], child: Any
    ) -> None:
        self.eqn, self.recovered, self.child = eqn, list(recovered), child
        self.invals = [read(v) for v in eqn.invars]
        self.outvals = [_read_or_none(read, v) for v in eqn.outvars]

    @property
    def dtype(self) -> Any:
        """The floating-point type the log-determinant is computed in."""
        fl = [
            jnp.result_type(x)
            for x in self.invals
            if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)
        ]
        return jnp.result_type(*fl) if fl else jnp.float32


def _read_or_none(read: Callable, v: Any) -> Any:
    if isinstance(v, DropVar):
        return None
    try:
        return read(v)
    except KeyError:
        return None
