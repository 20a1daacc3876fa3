"""Normalizing flows, the public entry points: log-determinants summed over the inversion
sweep's steps (`slogdet`) and distrax's bijector protocol (`bijector`). The engine they run,
the log-determinant plan, is `transforms/logdet.py` (rules layer: loop rules evaluate it)."""
