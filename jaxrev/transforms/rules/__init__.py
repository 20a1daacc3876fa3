"""The rules of each primitive family, one block per primitive: `jax.lax` arithmetic, indexing
(select, gather, scatter, slices), linear algebra (triangular solves), `scan`, `while` and
`cond`."""
