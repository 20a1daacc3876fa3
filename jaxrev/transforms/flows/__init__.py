"""Normalizing flows: log-determinants summed over the inversion sweep's steps (`logdet`), the
public entry points (`slogdet`) and distrax's bijector protocol (`bijector`)."""
