"""`reversible`'s backward sweep: plans of what to store, the backward walk, the time-space dial and
the drift checks."""
