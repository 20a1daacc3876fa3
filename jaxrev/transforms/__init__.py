"""jaxrev's transformations; the rule registries are public dicts keyed by primitive.

Importing this package registers every built-in rule: `rules.arithmetic` (the arithmetic
primitives of `jax.lax`), `rules.indexing` (the ones that select, gather and scatter elements),
`rules.scan`, `rules.while_loop`, `rules.cond` (loops and branches) and `custom` (jaxrev's own
primitives). `docs/architecture.md` maps the modules.
"""

from jaxrev._env import Unknown
from jaxrev.transforms import custom  # noqa: F401
from jaxrev.transforms.rules import arithmetic, cond, indexing, linalg, scan, while_loop  # noqa: F401
from jaxrev.transforms.registry import (
    Lossy,
    NeedMore,
    element_rules,  # noqa: F401
    forward_rules,
    inverse_jvp_rules,
    inverse_rules,
    kinds,
    sweep_rules,
)
