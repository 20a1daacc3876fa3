"""Statistics of the walks, observed from outside them: how much tracing work a call does.

Nothing here steers a walk. A walk context (`transforms/knowledge/context.py`) captures the
observers active when it is created and adds its counts to them, so a test or a benchmark can
measure every walk of one call (its nested and deferred walks included):

    >>> with counting() as c:
    ...     pass   # jax.make_jaxpr(jr.reverse(f))(y)
    >>> c["rules"] + c["elements"]
    0
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

__all__ = ["counting", "observers"]

_OBSERVERS: list[Counter] = []  # statistics only: a walk reads none of it


@contextlib.contextmanager
def counting() -> Iterator[Counter]:
    """Count, inside, what the walks do: "rules" (inverse rules applied), "elements"
    (element-level steps), "newton" (groups solved by Newton's method), "roots" (groups
    solved by a quadratic's roots)."""
    c: Counter = Counter()
    _OBSERVERS.append(c)
    try:
        yield c
    finally:
        _OBSERVERS.remove(c)


def observers() -> tuple[Counter, ...]:
    """The counters active now (a walk context keeps them for its whole life)."""
    return tuple(_OBSERVERS)
