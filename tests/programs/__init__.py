"""Catalogues of programs that the tests (and `benchmarks/tracing.py`) run through jaxrev."""
