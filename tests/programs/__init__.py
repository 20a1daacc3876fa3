"""Catalogues of programs that the tests (and `benchmarks/tracing.py`) run through jaxrev."""


def marker_line(path: str, tag: str) -> int:
    """Line number (1-based) of the line of the file at `path` that ends with `# <tag>`: the
    user line an error message must name."""
    marker = f"# <{tag}>"
    with open(path, encoding="utf-8") as fh:
        hits = [i for i, text in enumerate(fh, 1) if text.rstrip().endswith(marker)]
    assert len(hits) == 1, f"marker {marker} must occur exactly once, found {hits}"
    return hits[0]
