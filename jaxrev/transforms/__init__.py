"""jaxrev's transformations; the rule registries are public dicts keyed by primitive."""
from jaxrev.transforms.reverse import inverse_jvp_rules, inverse_rules, join_rules  # noqa: F401
