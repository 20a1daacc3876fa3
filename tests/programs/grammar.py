"""A grammar of random invertible programs, emitted as Python source (issue 18).

`programs()` is a hypothesis strategy of `Program`s: the source of a self-contained module
defining ``f(s, p)`` on a state `s` (a tuple of 1-3 leaves of one shape) and parameters `p`,
with the parameters' values written into the source. A failing property prints the source:
it is the reproducer, runnable as it is.

Constructs (each a step on the state; compound steps hold a random sub-program):
additive and masked couplings between leaves (`jnp.where`, masks), a scale, a leaky relu (a
select on the state), `.at[]` updates (a half-split coupling and NiLang's `x[i] += g(x[i-1])`
chain), simultaneous updates and swaps, `jnp.roll`, gathers by a fixed permutation, steps
masked by a predicate known only when the program runs (a parameter per element or per step,
or the loop counter) and diffrax-style masked couplings; sub-programs wrapped in `jax.jit`,
`jax.custom_jvp` and `jax.custom_vjp` (rules written with `jax.jvp` / `jax.vjp` of the
sub-program, as library code does), elementwise functions under `jax.vmap`, `lax.scan`,
`lax.fori_loop` (zero-trip included, bodies that close over the counter), a `while_loop` of a
fixed trip count (plain `lax.while_loop`, or `fori_loop` when `WHILE = False`: the reference
`jax.grad` differentiates), and `lax.cond` on a parameter with branches that pass leaves through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st

LEAVES = "abc"

PRELUDE = '''\
import jax, jax.numpy as jnp
from jax import lax
import jaxrev as jr
jax.config.update("jax_enable_x64", True)
WHILE = True   # False: the same program with fori_loops (what jax.grad differentiates)
CUSTOM = True  # False: without its custom_jvp / custom_vjp wrappers (the reference)


def with_jvp(g):
    """g as a custom_jvp function whose rule is g's own JVP (as library code writes them)."""
    if not CUSTOM:
        return g
    gc = jax.custom_jvp(g)
    gc.defjvp(lambda primals, tangents: jax.jvp(g, primals, tangents))
    return gc


def with_vjp(g):
    """g as a custom_vjp function whose rule is g's own VJP."""
    if not CUSTOM:
        return g
    gc = jax.custom_vjp(g)
    gc.defvjp(lambda *args: (g(*args), args), lambda res, ct: jax.vjp(g, *res)[1](ct))
    return gc


def loop(n, body, init):
    """n iterations of body(i, carry): a while loop of a fixed trip count, or a fori_loop."""
    if WHILE:
        return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])),
                              (0, init))[1]
    return lax.fori_loop(0, n, body, init)
'''


@dataclass
class Program:
    source: str
    n_leaves: int
    shape: tuple
    dtype: str
    params: dict = field(default_factory=dict)
    has_while: bool = False

    def build(self, reference: bool = False) -> dict:
        """The program's namespace; `reference`: with fori_loops for while loops and without
        the custom rules (what `jax.grad` differentiates, and the same function)."""
        ns: dict = {}
        src = self.source
        if reference:
            src = src.replace("WHILE = True", "WHILE = False").replace(
                "CUSTOM = True", "CUSTOM = False"
            )
        exec(compile(src, "<grammar program>", "exec"), ns)
        return ns

    def __repr__(self) -> str:  # hypothesis prints the falsifying example with this
        return "\n# ---- reproducer ----\n" + self.source


class _Gen:
    def __init__(self, draw, n: int, k: int, dtype: str) -> None:
        self.draw, self.n, self.k, self.dtype = draw, n, k, dtype
        self.params: dict[str, list] = {}
        self.defs: list[str] = []
        self.count = 0
        self.has_while = False

    def fresh(self, stem: str) -> str:
        self.count += 1
        return f"{stem}{self.count}"

    def param(self, shape: tuple, lo: float = -1.0, hi: float = 1.0) -> str:
        name = self.fresh("w")
        size = int(np.prod(shape, dtype=np.int64))
        vals = self.draw(
            st.lists(st.floats(lo, hi, allow_nan=False, width=32), min_size=size, max_size=size)
        )
        self.params[name] = np.asarray(vals, np.float64).reshape(shape).round(4).tolist()
        return f'p["{name}"]'

    def leaf(self, exclude: str | None = None) -> str:
        choices = [c for c in LEAVES[: self.k] if c != exclude]
        return self.draw(st.sampled_from(choices))

    # ---------------------------------------------------------------- simple steps
    def simple(self, counter: str | None) -> list[str]:
        n, k = self.n, self.k
        kinds = ["scale", "leaky", "half", "chain", "roll", "mask_self", "perm", "pmask"]
        if k > 1:
            kinds += ["add", "mask", "swap", "simul", "pcoupling"]
        if counter is not None:
            kinds += ["shift"]
        kind = self.draw(st.sampled_from(kinds))
        t = self.leaf()
        if kind == "scale":
            return [f"{t} = {t} * jnp.exp(0.3 * {self.param((n,))})"]
        if kind == "leaky":
            return [f"{t} = jnp.where({t} > 0, {t}, 0.5 * {t})"]
        if kind == "half":
            h = n // 2 or 1
            if n < 2:
                return [f"{t} = {t} + 0.5"]
            return [f"{t} = {t}.at[{n - h}:].add(jnp.tanh({self.param((h,))} * {t}[:{h}]))"]
        if kind == "chain":
            w = self.param((n,))
            return [
                f"{t} = lax.fori_loop(1, {n}, lambda j, x: "
                f"x.at[j].add(jnp.tanh({w}[j] * x[j - 1])), {t})"
            ]
        if kind == "roll":
            r = self.draw(st.integers(0, n))
            return [f"{t} = jnp.roll({t}, {r}, axis=-1)"]
        if kind == "mask_self":
            m = self.draw(st.lists(st.booleans(), min_size=n, max_size=n))
            mask = "jnp.array(" + repr(m) + ")"
            w = self.param((n,))
            return [
                f"{t} = jnp.where({mask}, {t}, {t} * jnp.exp(0.3 * jnp.tanh({w} * "
                f"jnp.sum({t} * {mask}))) + jnp.tanh(jnp.sum({t} * {mask})))"
            ]
        if kind == "shift":
            return [f"{t} = {t} + 0.1 * {counter}.astype({t}.dtype)"]
        if kind == "perm":  # a gather by a fixed permutation, as flows permute between couplings
            perm = self.draw(st.permutations(list(range(n))))
            return [f"{t} = {t}[jnp.array({list(perm)!r})]"]
        if kind == "pmask":  # a step kept where a parameter says (known when the program runs)
            return [
                f"{t} = jnp.where({self._predicate(counter)}, {t} * jnp.exp(0.3 * "
                f"{self.param((n,))}) + 0.25, {t})"
            ]
        u = self.leaf(exclude=t)
        if kind == "add":
            return [f"{t} = {t} + jnp.tanh({self.param((n,))} * {u})"]
        if kind == "mask":
            m = self.draw(st.lists(st.booleans(), min_size=n, max_size=n))
            mask = "jnp.array(" + repr(m) + ")"
            return [
                f"{t} = jnp.where({mask}, {t}, {t} * jnp.exp(0.3 * jnp.tanh({u})) + jnp.tanh({u}))"
            ]
        if kind == "swap":
            return [f"{t}, {u} = {u}, {t}"]
        if kind == "pcoupling":  # diffrax's masked step: both halves kept or not, together
            keep = self._predicate(counter)
            t2, u2 = self.fresh("t"), self.fresh("u")
            return [
                f"{t2} = {t} + jnp.tanh({u}[::-1])",
                f"{u2} = {u} + jnp.sin({self.param((n,))} * {t2})",
                f"{t}, {u} = jnp.where({keep}, {t2}, {t}), jnp.where({keep}, {u2}, {u})",
            ]
        return [f"{t}, {u} = {t} + jnp.tanh({u}), {u} * 1.5"]  # simul: one simultaneous update

    def _predicate(self, counter: str | None) -> str:
        """A mask that does not depend on the state: one from a parameter, per element or
        one for the whole step (as diffrax's `t < t1`), or from the loop counter."""
        kind = self.draw(st.sampled_from(["vector", "scalar"] + (["counter"] if counter else [])))
        if kind == "vector":
            return f"{self.param((self.n,))} > 0"
        if kind == "scalar":
            return f"{self.param(())} > {self.draw(st.sampled_from([-0.5, 0.0, 0.5]))}"
        return f"{self.param(())} * 4.0 > {counter}.astype(jnp.float32)"

    # ---------------------------------------------------------------- programs
    def block(self, depth: int, counter: str | None) -> list[str]:
        steps = self.draw(st.integers(1, 3 if depth else 4))
        lines: list[str] = []
        for _ in range(steps):
            lines += self.step(depth, counter)
        return lines

    def step(self, depth: int, counter: str | None) -> list[str]:
        kinds = ["simple"] * 3
        if depth < 2:
            kinds += ["jit", "custom_jvp", "custom_vjp", "vmap", "scan", "fori", "while", "cond"]
        kind = self.draw(st.sampled_from(kinds))
        if kind == "simple":
            return self.simple(counter)
        state = ", ".join(LEAVES[: self.k]) + ","
        if kind == "vmap":
            t = self.leaf()
            c = self.draw(st.floats(0.125, 0.875))
            return [f"{t} = jax.vmap(lambda z: jnp.where(z > 0, z, {c:.3f} * z) * 1.5)({t})"]
        name = self.fresh("g")
        if kind in ("jit", "custom_jvp", "custom_vjp"):
            # parameters are passed in (a custom rule closing over a differentiated value leaks
            # it, in JAX itself); a custom_jvp body may close over a loop counter
            body = self.block(depth + 1, counter if kind == "custom_jvp" else None)
            lines = (
                [f"def {name}(p, {state}):"] + ["    " + s for s in body] + [f"    return {state}"]
            )
            wrap = {"jit": "jax.jit", "custom_jvp": "with_jvp", "custom_vjp": "with_vjp"}[kind]
            return lines + [f"{state} = {wrap}({name})(p, {state})"]
        if kind == "cond":
            t = self.leaf()
            flag = self.param((), -1.0, 1.0)
            yes = self.block(depth + 1, counter)
            lines = [f"def {name}y({state}):"] + ["    " + s for s in yes] + [f"    return {state}"]
            lines += [f"def {name}n({state}):", f"    {t} = {t} * 1.25", f"    return {state}"]
            return lines + [f"{state} = lax.cond({flag} > 0, {name}y, {name}n, {state})"]
        length = self.draw(st.integers(0, 3)) if kind != "scan" else self.draw(st.integers(1, 3))
        i = self.fresh("i")
        body = self.block(depth + 1, i)
        if kind == "scan":
            t = self.leaf()
            xs = self.param((length, self.n))
            lines = [
                f"def {name}(carry, {i}x):",
                f"    {state} = carry",
                f"    {i} = {i}x[0]",
                f"    {t} = {t} + 0.1 * {i}x[1]",
            ]
            lines += ["    " + s for s in body] + [f"    return ({state}), None"]
            return lines + [
                f"({state}), _ = lax.scan({name}, ({state}), (jnp.arange({length}), {xs}))"
            ]
        lines = [f"def {name}({i}, carry):", f"    {state} = carry"]
        lines += ["    " + s for s in body] + [f"    return ({state})"]
        if kind == "fori":
            return lines + [f"{state} = lax.fori_loop(0, {length}, {name}, ({state}))"]
        self.has_while = True
        return lines + [f"{state} = loop({length}, {name}, ({state}))"]


@st.composite
def programs(draw, dtypes=("float64", "float32")) -> Program:
    n = draw(st.integers(2, 4))
    k = draw(st.integers(1, 3))
    dtype = draw(st.sampled_from(dtypes))
    g = _Gen(draw, n, k, dtype)
    body = g.block(0, None)
    state = ", ".join(LEAVES[:k]) + ","
    src = [PRELUDE, "", "def f(s, p):", f"    {state} = s"]
    src += ["    " + s for s in body] + [f"    return ({state})", ""]
    x = draw(
        st.lists(st.floats(-1.5, 1.5, allow_nan=False, width=32), min_size=n * k, max_size=n * k)
    )
    # off the kinks (x = 0 exactly, where `jnp.where(x > 0, ...)`'s derivative is a convention)
    x = (np.asarray(x).round(4) + 0.01 * (1 + np.arange(n * k)) / (n * k)).reshape(k, n).tolist()
    src += [
        f"p = {{k: jnp.asarray(v, jnp.{dtype}) for k, v in {g.params!r}.items()}}",
        f"s = tuple(jnp.asarray(v, jnp.{dtype}) for v in {x!r})",
        "",
    ]
    return Program("\n".join(src), k, (n,), dtype, g.params, g.has_while)
