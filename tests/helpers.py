"""Shared helpers of the test suite: how far a result is from its reference.

Every error is measured in float64 over all the leaves of two pytrees (arrays, scalars or
nested containers of them), which must have as many leaves, pairwise of one shape. They
differ in what the difference is relative to, and a test chooses the one its tolerance was
set for:

- `rel_error`: the largest difference over all leaves, relative to the largest magnitude of
  the reference (and of `others`, the other end of a round trip, say);
- `leaf_rel_error`: each leaf's largest difference relative to that leaf's own largest
  magnitude, the worst leaf (a small leaf, a gradient of a parameter barely used, is held to
  its own scale: never looser than `rel_error`);
- `abs_error`: the largest difference, absolute;
- `scaled_error`: absolute below magnitude 1, relative above it;
- `l2_rel_error`: the Euclidean norm of the difference relative to the reference's.

`all_eqns` yields a program's equations at any depth (inside loops, branches, calls), for
tests that count primitives.

Tests import them by name (``from helpers import rel_error``): pytest puts ``tests/`` (the
folder of ``tests/conftest.py``) on ``sys.path``, and so does a script run from it.

>>> rel_error([1.0, 2.0], [1.0, 4.0])
0.5
>>> leaf_rel_error({"a": 1.0, "b": 100.0}, {"a": 2.0, "b": 100.0})
0.5
>>> rel_error({"a": 1.0, "b": 100.0}, {"a": 2.0, "b": 100.0})
0.01
>>> scaled_error(0.25, 0.5), scaled_error(1.0, 4.0)
(0.25, 0.75)
"""

from __future__ import annotations

import jax
import numpy as np

# the smallest scale an error is relative to: two all-zero trees are 0 apart, not NaN
TINY = 1e-300


def leaves64(tree) -> list[np.ndarray]:
    """The leaves of `tree` as float64 (complex128 for complex leaves) NumPy arrays."""
    out = []
    for x in jax.tree_util.tree_leaves(tree):
        x = np.asarray(x)
        out.append(x.astype(np.complex128 if np.iscomplexobj(x) else np.float64))
    return out


def _pairs(a, b) -> list[tuple[np.ndarray, np.ndarray]]:
    """The leaves of `a` and `b`, paired: as many on each side, each pair of one shape (no
    broadcasting: a result of the wrong shape is an error, not a small difference)."""
    la, lb = leaves64(a), leaves64(b)
    assert len(la) == len(lb), (len(la), len(lb))
    assert [x.shape for x in la] == [y.shape for y in lb], [
        (x.shape, y.shape) for x, y in zip(la, lb)
    ]
    return list(zip(la, lb))


def _amax(x: np.ndarray) -> float:
    return float(np.max(np.abs(x))) if x.size else 0.0


def abs_error(a, b) -> float:
    """max |a - b| over every element of every leaf."""
    return max([0.0] + [_amax(x - y) for x, y in _pairs(a, b)])


def rel_error(a, b, *others) -> float:
    """max |a - b| over all leaves, relative to the largest magnitude in `b` and in `others`
    (say, the other end of a round trip, so that a reference that is nearly zero still
    gives a meaningful error)."""
    scale = max([TINY] + [_amax(y) for y in leaves64(b)] + [_amax(o) for o in leaves64(others)])
    return abs_error(a, b) / scale


def leaf_rel_error(a, b) -> float:
    """The worst leaf's max |a - b| relative to that leaf's max |b|."""
    return max([0.0] + [_amax(x - y) / max(_amax(y), TINY) for x, y in _pairs(a, b)])


def scaled_error(a, b) -> float:
    """max |a - b| over all leaves divided by max(1, max |b|): absolute for a reference of
    magnitude up to 1, relative beyond."""
    return abs_error(a, b) / max([1.0] + [_amax(y) for y in leaves64(b)])


def l2_rel_error(a, b) -> float:
    """‖a - b‖₂ / ‖b‖₂, each over all leaves together."""
    pairs = _pairs(a, b)
    num = sum(float(np.sum(np.abs(x - y) ** 2)) for x, y in pairs)
    den = sum(float(np.sum(np.abs(y) ** 2)) for _, y in pairs)
    return float(np.sqrt(num / max(den, TINY)))


def all_eqns(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs in its equations' params, at any depth."""
    from jax.extend.core import jaxprs_in_params

    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)
