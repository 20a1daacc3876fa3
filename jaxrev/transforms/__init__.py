"""jaxrev's transformations; the rule registries are public dicts keyed by primitive.

Importing this package registers every built-in rule: `rules` (the arithmetic primitives of
`jax.lax`), `index_rules` (the ones that select, gather and scatter elements), `scan_rules`,
`while_rules`, `cond_rules` (loops and branches) and `custom` (jaxrev's own primitives).
`docs/architecture.md` maps the modules.
"""
from jaxrev._jaxpr import Unknown  # noqa: F401
from jaxrev.transforms import (rules, index_rules, scan_rules, while_rules,  # noqa: F401
                               cond_rules, custom)
from jaxrev.transforms.registry import (Lossy, NeedMore, element_rules,  # noqa: F401
                                        forward_rules, inverse_jvp_rules, inverse_rules, kinds,
                                        sweep_rules)
