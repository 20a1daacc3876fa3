"""Which cases of a test matrix the default tier runs, and which only the slow tier runs.

The default tier (`python -m pytest -q`) must stay near ten minutes on two cores, so a matrix
runs a subset by default that still exercises every value of every axis; `pytest -m slow`
runs the costly cases, `pytest -m soak` the whole products. Two ways to say which:

- `cover(*axes, shift=0)`: the product of several axes, the default tier running a covering
  subset (combination i takes value i modulo each axis's length, i + shift for the axes after
  the first, for i below the longest axis's length: every value of every axis at least once),
  the rest of the product soak (the slow tier, which CI runs once on two cores, has no room
  for whole products: it holds the costly tests whose paths no default test takes); two
  tests of the same matrix pass different shifts to cover different combinations;
- `tiered(values, slow=..., soak=...)`: one axis, the values named in `slow` marked slow (the
  costly cases whose path other default cases already take), those in `soak` soak (the
  costliest, whose path a slow case takes).

A matrix that is itself slow passes ``marks=pytest.mark.slow`` to
`cover`: the slow tier runs the covering subset and ``pytest -m soak`` the whole product.

Both return `pytest.param`s for `pytest.mark.parametrize`, with the ids pytest would give.

>>> [p.values for p in cover(["a", "b", "c"], [1, 2]) if not p.marks]
[('a', 1), ('b', 2), ('c', 1)]
>>> [p.values for p in cover(["a", "b", "c"], [1, 2], shift=1) if not p.marks]
[('a', 2), ('b', 1), ('c', 2)]
>>> len(cover(["a", "b", "c"], [1, 2]))
6
>>> [p.values[0] for p in tiered(["x", "y"], slow={"y"}) if p.marks]
['y']
>>> [p.marks[0].name for p in tiered(["x", "y", "z"], slow={"y"}, soak={"z"}) if p.marks]
['slow', 'soak']
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

import pytest

__all__ = ["cover", "tiered"]


def _id(value) -> str:
    return value if isinstance(value, str) else repr(value)


def cover(*axes: Sequence, shift: int = 0, marks: Any = (), rest: Any = pytest.mark.soak) -> list:
    """The product of `axes`, as `pytest.param`s: the covering subset (see the module) with
    `marks` (none: the default tier), the rest with `rest` (the soak tier). Each param's
    values are one combination, in the order of `axes`; its id joins the values' ids with
    "-"."""
    longest = max(len(axis) for axis in axes)
    default = {
        tuple(axis[(i + (shift if a else 0)) % len(axis)] for a, axis in enumerate(axes))
        for i in range(longest)
    }
    return [
        pytest.param(
            *combo,
            id="-".join(_id(v) for v in combo),
            marks=marks if combo in default else rest,
        )
        for combo in itertools.product(*axes)
    ]


def tiered(values: Sequence, slow: Collection = (), soak: Collection = ()) -> list:
    """`values` as `pytest.param`s, those in `slow` marked slow, those in `soak` soak (the
    costliest, whose path a slow case takes already), the others run by default."""
    unknown = (set(slow) | set(soak)) - set(values)
    if unknown:  # a renamed case must not leave its costly twin in the default tier
        raise ValueError(f"tiered: not among the values: {sorted(unknown)}")
    return [
        pytest.param(
            v, marks=pytest.mark.soak if v in soak else pytest.mark.slow if v in slow else ()
        )
        for v in values
    ]
