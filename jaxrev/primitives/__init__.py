"""jaxrev's own primitives (rotations, quantum gates) live here."""
