"""jaxrev's own JAX primitives (docs/design.md §1 Primitives): NiLang's reversible instructions
(`rot`, `swap`) and in-place quantum-gate application (`apply_gate`). Each has abstract
evaluation, an XLA lowering, JVP, transpose, batching, and inverse and inverse-JVP rules."""

from jaxrev.primitives.gates import apply_gate, apply_gate_p
from jaxrev.primitives.rotations import rot, rot_p, swap, swap_p

__all__ = ["apply_gate", "apply_gate_p", "rot", "rot_p", "swap", "swap_p"]
