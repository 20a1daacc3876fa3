"""jaxrev's transformations; the rule registries are public dicts keyed by primitive.

Importing this package registers every built-in rule: `rules` (the primitives of `jax.lax`),
`scan_rules`, `while_rules`, `cond_rules` (loops and branches) and `custom` (jaxrev's own
primitives). `docs/architecture.md` maps the modules.
"""
from jaxrev._jaxpr import Unknown  # noqa: F401
from jaxrev.transforms import rules, scan_rules, while_rules, cond_rules, custom  # noqa: F401
from jaxrev.transforms.registry import (Lossy, NeedMore, forward_rules,  # noqa: F401
                                        inverse_jvp_rules, inverse_rules, join_rules, kinds,
                                        sweep_rules)
