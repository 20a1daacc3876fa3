"""Exact integer arithmetic for exact reversal (docs/design.md §3.8, "Exact reversal"): the
information buffer that keeps the bits a multiplication destroys, and rational factors.

A multiplication of an integer by a factor g < 1 maps several integers to one, so undoing it
needs the bits that tell them apart: log2(1/g) of them per element on average (0.15 for a
momentum of 0.9). Maclaurin, Duvenaud & Adams (2015) keep them in one Python big integer per
element. Here the big integer is an rANS coder (range asymmetric numeral systems): a 64-bit
`state` per element in [2**31, 2**63) and a stack of 32-bit `words` per element that the state
spills into and refills from, so every push and pop is a handful of integer operations and one
gather or scatter, whatever the buffer holds.

- `push(buf, x, m)` stores an integer x in [0, m): the buffer grows by about log2(m) bits;
  `pop(buf, m)` takes one back out (its exact inverse: `pop(push(buf, x, m), m) == (buf, x)`).
  Popping from a buffer that holds too little borrows zero words, which the matching push
  returns, so a pop may come first ("bits back").
- `mul_exact(buf, c, n, d)` is c * n / d rounded by bits popped from the buffer, the rounding
  remainder pushed: a bijection of (c, buffer), whose inverse is `mul_exact(buf, c2, d, n)`.
- `rational(g)` approximates a float factor by n/d with n, d <= 2**30 (continued fractions:
  0.9 is 9/10, exactly as far as float64 can tell).

Uniform values in [0, m) are coded with frequencies quantized to 2**31 (rANS needs its total to
divide the state's lower bound; m need not): the code stays a bijection, costing at most a
fraction of a bit over log2(m) per value. Everything runs on 64-bit integers inside
`jax.enable_x64(True)`, whether or not the user's program enables them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "InfoBuffer",
    "empty",
    "push",
    "pop",
    "mul_exact",
    "Alphabet",
    "alphabet",
    "power_alphabet",
    "rational",
    "dyadic",
    "power_of_two",
    "RationalFactor",
    "x64",
    "FACTOR_BITS",
    "float_parts",
]

PRECISION = 31
TOTAL = 1 << PRECISION  # the quantized frequencies' total
LOW = 1 << 31  # the state's lower bound: states lie in [LOW, LOW << 32)
WORD = 32
FACTOR_BITS = 30  # numerators and denominators of rational factors are at most 2**30
_CF_TERMS = 64  # continued-fraction terms tried: a 53-bit mantissa needs at most 77 / 2


def x64() -> Any:
    """The context in which the buffer's 64-bit integers exist (also in a float32 program)."""
    return jax.enable_x64(True)


class InfoBuffer(NamedTuple):
    """The bits exact reversal keeps, per element of a carry (flattened to `n` elements).

    - `state`: int64[n], the rANS state, in [2**31, 2**63);
    - `words`: uint32[n, capacity + 1], the stack the state spills into (the last column is
      scratch: where the elements that do not push write);
    - `top`: int32[n], words pushed so far (negative: words borrowed from an empty buffer);
    - `peak`: int32[n], the most words held at once (beyond `capacity`, words were lost).
    """

    state: Any
    words: Any
    top: Any
    peak: Any

    @property
    def capacity(self) -> int:
        return self.words.shape[-1] - 1


def empty(n: int, capacity: int) -> InfoBuffer:
    """A buffer of `n` elements holding nothing, with room for `capacity` words each."""
    with x64():
        return InfoBuffer(
            jnp.full((n,), LOW, jnp.int64),
            jnp.zeros((n, max(capacity, 1) + 1), jnp.uint32),
            jnp.zeros((n,), jnp.int32),
            jnp.zeros((n,), jnp.int32),
        )


Rows = Any
"""Which elements of a buffer an operation touches: None (all), or a NumPy array of element
indices (a contiguous run is read and written as a slice)."""


def _rows(rows: Rows, n: int) -> tuple[Any, Any]:
    """(the index for the state-like vectors, the row numbers of `words`)."""
    if rows is None:
        return slice(None), jnp.arange(n)
    rows = np.asarray(rows)
    if rows.size and np.array_equal(rows, np.arange(rows[0], rows[0] + rows.size)):
        return slice(int(rows[0]), int(rows[0]) + rows.size), jnp.asarray(rows)
    return jnp.asarray(rows), jnp.asarray(rows)


class _Part(NamedTuple):
    """Some elements of a buffer: their state, top and peak, and the rows of `words`."""

    state: Any
    top: Any
    peak: Any
    words: Any
    at: Any  # the index of the elements in state, top and peak
    rows: Any  # their rows of words

    @classmethod
    def of(cls, buf: InfoBuffer, rows: Rows) -> _Part:
        at, word_rows = _rows(rows, buf.state.shape[0])
        return cls(buf.state[at], buf.top[at], buf.peak[at], buf.words, at, word_rows)

    def back(self, buf: InfoBuffer) -> InfoBuffer:
        if isinstance(self.at, slice) and self.at == slice(None):
            return InfoBuffer(self.state, self.words, self.top, self.peak)
        return InfoBuffer(
            buf.state.at[self.at].set(self.state),
            self.words,
            buf.top.at[self.at].set(self.top),
            buf.peak.at[self.at].set(self.peak),
        )

    def push_word(self, cond: Any, word: Any) -> _Part:
        """Push `word` (int64 in [0, 2**32)) where `cond` holds. The other elements write to
        their row's spare last column, so that a push is one scatter and no gather."""
        capacity = self.words.shape[-1] - 1
        write = cond & (self.top >= 0) & (self.top < capacity)
        col = jnp.where(write, self.top, capacity)
        words = self.words.at[self.rows, col].set(word.astype(jnp.uint32), mode="promise_in_bounds")
        top = self.top + cond.astype(jnp.int32)
        return self._replace(words=words, top=top, peak=jnp.maximum(self.peak, top))

    def pop_word(self, cond: Any) -> tuple[_Part, Any]:
        """Pop a word (int64) where `cond` holds (0 elsewhere, and where the buffer is empty:
        a borrowed word)."""
        capacity = self.words.shape[-1] - 1
        top = self.top - cond.astype(jnp.int32)
        held = cond & (top >= 0) & (top < capacity)
        col = jnp.clip(top, 0, capacity - 1)
        word = self.words.at[self.rows, col].get(mode="promise_in_bounds")
        return self._replace(top=top), jnp.where(held, word, 0).astype(jnp.int64)


class Alphabet(NamedTuple):
    """Integers in [0, m) as the coder sees them, found once per factor (not per element, nor
    per step where the factor is the loop's): the quantized uniform frequencies, the first `b`
    values having frequency a + 1 and the rest a (a * m + b == TOTAL). Integer division is
    most of a coding step's time (x86 has no vector instruction for it)."""

    m: Any
    a: Any
    b: Any
    log2: Any = None  # m = 2**log2 where known to be a power of two (divisions are shifts)

    def broadcast(self, shape: tuple[int, ...]) -> Alphabet:
        def b(v: Any) -> Any:
            return None if v is None else jnp.broadcast_to(v, shape).reshape(-1)

        return Alphabet(*(b(v) for v in self))


def alphabet(m: Any) -> Alphabet:
    """The `Alphabet` of [0, m), m int64 in [1, 2**31]."""
    with x64():
        m = jnp.asarray(m).astype(jnp.int64)
        a, b = _truncated(jnp.int64(TOTAL), m)
        return Alphabet(m, a, b)


def power_alphabet(k: Any) -> Alphabet:
    """The `Alphabet` of [0, 2**k), k int64 in [0, 31]: every value of frequency 2**(31 - k),
    and every division by m or by a frequency a shift."""
    with x64():
        k = jnp.asarray(k).astype(jnp.int64)
        one = jnp.ones_like(k)
        return Alphabet(one << k, one << (PRECISION - k), jnp.zeros_like(k), k)


def _div_by(x: Any, al: Alphabet) -> tuple[Any, Any]:
    """floor(x / m) and x mod m for int64 x (of either sign) and m = `al.m`: a shift and a
    mask where m is a power of two."""
    if al.log2 is None:
        return _divmod(x, al.m)
    return x >> al.log2, x & (al.m - 1)


def _divmod(x: Any, y: Any) -> tuple[Any, Any]:
    """floor(x / y) and x mod y (in [0, y)) for int64 x and y >= 1, by one division
    instruction (`jnp.floor_divide` and `jnp.remainder` each compute both a quotient and a
    remainder, and XLA:CPU does not merge them: four scalar 64-bit divisions where one
    suffices)."""
    q, r = _truncated(x, y)
    neg = r < 0
    return jnp.where(neg, q - 1, q), jnp.where(neg, r + y, r)


def _truncated(x: Any, y: Any) -> tuple[Any, Any]:
    """x / y rounded toward zero, and x minus y times it: floor(x / y) and x mod y where
    x >= 0."""
    q = lax.div(x, y)
    return q, x - q * y


def _small_div(x: Any, y: Any) -> Any:
    """floor(x / y) for 0 <= x < 2**32 and 1 <= y < 2**32, in 32 bits (x86 has no vector
    64-bit division, and its scalar one is several times slower than the 32-bit one)."""
    return (x.astype(jnp.uint32) // y.astype(jnp.uint32)).astype(jnp.int64)


def _freq(x: Any, al: Alphabet) -> tuple[Any, Any]:
    """Value x's frequency and cumulative frequency."""
    return al.a + (x < al.b).astype(jnp.int64), x * al.a + jnp.minimum(x, al.b)


def _push(p: _Part, x: Any, al: Alphabet) -> _Part:
    f, c = _freq(x.astype(jnp.int64), al)
    s = p.state
    spill = (s >> WORD) >= f  # s >= f * 2**32, without forming 2**63 (m = 1)
    p = p.push_word(spill, s & 0xFFFFFFFF)
    s = jnp.where(spill, s >> WORD, s)
    if al.log2 is None:
        q, r = _truncated(s, f)
    else:  # f = 2**(31 - log2) for every value
        q, r = s >> (PRECISION - al.log2), s & (f - 1)
    return p._replace(state=q * TOTAL + r + c)


def _pop(p: _Part, al: Alphabet) -> tuple[_Part, Any]:
    s = p.state
    slot = s & (TOTAL - 1)
    if al.log2 is not None:  # every value of frequency a = 2**(31 - log2)
        x = slot >> (PRECISION - al.log2)
    else:
        wide = al.b * (al.a + 1)  # the slots of the values of frequency a + 1
        first = slot < wide  # (one division for both cases)
        q = _small_div(jnp.where(first, slot, slot - wide), jnp.where(first, al.a + 1, al.a))
        x = jnp.where(first, q, al.b + q)
    f, c = _freq(x, al)
    s = f * (s >> PRECISION) + slot - c
    refill = s < LOW
    p, word = p.pop_word(refill)
    return p._replace(state=jnp.where(refill, (s << WORD) | word, s)), x


def _elements(al: Alphabet | Any, n: int) -> Alphabet:
    """An alphabet per element (an `Alphabet` broadcast, or made from integers m)."""
    if not isinstance(al, Alphabet):
        al = alphabet(al)
    return al.broadcast((n,)) if al.m.shape != (n,) else al


def push(buf: InfoBuffer, x: Any, m: Any, rows: Rows = None) -> InfoBuffer:
    """Store x (integers in [0, m), one per element of `rows`; m in [1, 2**31], or its
    `Alphabet`)."""
    with x64():
        part = _Part.of(buf, rows)
        return _push(part, x, _elements(m, part.state.shape[0])).back(buf)


def pop(buf: InfoBuffer, m: Any, rows: Rows = None) -> tuple[InfoBuffer, Any]:
    """Take out the integers in [0, m) that `push(·, x, m)` stored last (int64)."""
    with x64():
        part = _Part.of(buf, rows)
        p, x = _pop(part, _elements(m, part.state.shape[0]))
        return p.back(buf), x


def mul_exact(buf: InfoBuffer, c: Any, n: Any, d: Any, rows: Rows = None) -> tuple[InfoBuffer, Any]:
    """c * n / d (c int64, n and d in [1, 2**30] or their `Alphabet`s, one per element of
    `rows`), exactly reversible: r in [0, n) is popped from the buffer, c * n + r = c2 * d + s
    with s in [0, d), and s pushed. The inverse is `mul_exact(buf, c2, d, n)`. No product
    exceeds 2**62 unless c2 does."""
    with x64():
        part = _Part.of(buf, rows)
        size = part.state.shape[0]
        n, d = _elements(n, size), _elements(d, size)
        p, r = _pop(part, n)
        q, rem = _div_by(c, d)
        hi, s = _div_by(rem * n.m + r, d)  # rem * n + r in [0, d * n)
        return _push(p, s, d).back(buf), q * n.m + hi


def float_parts(x: Any) -> tuple[Any, Any]:
    """(mantissa, exponent) of float64 values x >= 0 as int64, x = mantissa * 2**(exponent -
    52) with the implicit bit in the mantissa (normal numbers; 0 gives (0, -1023)). Read off the
    bits (`jnp.frexp` fails to lower inside a scoped x64 on some JAX versions)."""
    with x64():
        bits = lax.bitcast_convert_type(x.astype(jnp.float64), jnp.int64)
        exponent = ((bits >> 52) & 0x7FF) - 1023
        mantissa = (bits & ((1 << 52) - 1)) | jnp.where(exponent > -1023, 1 << 52, 0)
        return mantissa, exponent


class RationalFactor(NamedTuple):
    """A factor g as sign * num / den (int64), and whether g could be held (finite, nonzero,
    in [2**-8, 2**8])."""

    sign: Any
    num: Any
    den: Any
    ok: Any
    den_log2: Any = None  # den = 2**den_log2 where known (`dyadic`)


def dyadic(g: Any) -> RationalFactor:
    """|g| (float) as n / 2**k with n of 30 bits where |g| >= 1/2 (k <= 30; 22 bits at
    |g| = 2**-8): relative error at most 2**-30 there, 2**-22 at worst, finer than a float32
    factor's own rounding but where |g| < 2**-6. A handful of vector operations per element,
    where `rational`'s continued fraction takes 64 rounds of 64-bit divisions: for the factors
    a loop computes anew every step and element (a gate), in 16- and 32-bit floats."""
    with x64():
        g = jnp.asarray(g).astype(jnp.float64)
        mag = jnp.abs(g)
        ok = jnp.isfinite(g) & (mag >= 2.0**-8) & (mag <= 2.0**8)
        _, exp = float_parts(jnp.where(ok, mag, 1.0))  # mag in [2**exp, 2**(exp + 1))
        k = jnp.minimum(FACTOR_BITS - 1 - exp, FACTOR_BITS)
        num = jnp.round(mag * power_of_two(k)).astype(jnp.int64)
        sign = jnp.where(g < 0, -1, 1).astype(jnp.int64)
        good = ok & (num >= 1)
        k = jnp.where(good, k, 0)
        return RationalFactor(
            sign, jnp.where(good, num, 1), jnp.left_shift(jnp.ones_like(k), k), good, k
        )


def power_of_two(k: Any) -> Any:
    """2.0**k in float64 (|k| < 1023), from its bits (`jnp.ldexp`, an inner `jit`, lowers
    with the wrong types inside a scoped x64 on JAX 0.12)."""
    e = (jnp.asarray(k).astype(jnp.int64) + 1023) << 52
    return lax.bitcast_convert_type(e, jnp.float64)


def rational(g: Any) -> RationalFactor:
    """The closest fraction to |g| (float) with numerator and denominator at most 2**30 (a
    continued-fraction convergent or semiconvergent): exact for factors such as 0.5 or 9/10
    (the float nearest 0.9), and within 2**-60 relatively of most others (2**-46 at worst
    seen)."""
    with x64():
        g = jnp.asarray(g).astype(jnp.float64)
        mag = jnp.abs(g)
        ok = jnp.isfinite(g) & (mag >= 2.0**-8) & (mag <= 2.0**8)
        p, exp = float_parts(jnp.where(ok, mag, 1.0))
        # |g| = p / q exactly, q = 2**(52 - exp) with 52 - exp in [44, 60]
        q = jnp.left_shift(jnp.int64(1), 52 - exp)
        limit = jnp.int64(1 << FACTOR_BITS)
        one, zero = jnp.ones_like(p), jnp.zeros_like(p)

        def term(_, st):
            p, q, h1, h2, k1, k2, done, last = st
            a = p // jnp.maximum(q, 1)
            small = a <= limit  # beyond it a * h1 could overflow, and the bound is broken
            h = jnp.where(small, a * h1 + h2, limit + 1)
            k = jnp.where(small, a * k1 + k2, limit + 1)
            take = ~done & (h <= limit) & (k <= limit)
            rem = p - a * q
            last = jnp.where(~done & ~take, a, last)  # the partial quotient the bound stopped
            done = done | ~take | (rem == 0)  # the bound reached, or the fraction exact
            return (
                jnp.where(take, q, p),
                jnp.where(take, rem, q),
                jnp.where(take, h, h1),
                jnp.where(take, h1, h2),
                jnp.where(take, k, k1),
                jnp.where(take, k1, k2),
                done,
                last,
            )

        init = (p, q, one, zero, zero, one, jnp.zeros(p.shape, bool), zero)
        _, _, h, h0, k, k0, _, a = lax.fori_loop(0, _CF_TERMS, term, init)
        # the best approximation within the bound may be a semiconvergent (h0 + j h)/(k0 + j k)
        # with j < a: closer than h/k exactly when 2 j > a
        j = jnp.minimum((limit - h0) // jnp.maximum(h, 1), (limit - k0) // jnp.maximum(k, 1))
        semi = (a > 0) & (2 * j > a)
        h, k = jnp.where(semi, h0 + j * h, h), jnp.where(semi, k0 + j * k, k)
        sign = jnp.where(g < 0, -1, 1).astype(jnp.int64)
        good = ok & (h >= 1) & (k >= 1)
        return RationalFactor(sign, jnp.where(good, h, 1), jnp.where(good, k, 1), good)
