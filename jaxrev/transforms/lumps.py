"""Lump structure for inverse accumulation: per-step log-determinants."""
from __future__ import annotations

from typing import Any, Sequence


def structured_slogdet(sq: Any, fun: Any, primals: Sequence[Any]):
    raise NotImplementedError
