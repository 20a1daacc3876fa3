"""Readers for ADBench's GMM and bundle adjustment input files (used by gmm.py and
bundle_adjustment.py).

The files are ADBench's own (Srajer, Kukelova and Fitzgibbon 2018; microsoft/ADBench), read as
they are. The folder is `../shared/data/adbench` next to the repository, or the one named by the
environment variable `JAXREV_ADBENCH`. Formats (the folder's README.md):

- `gmm/{10k,1k}/gmm_d{D}_K{K}.txt`: `D K n`, K logits, K means (D each), K inverse-Cholesky
  parameters (D log-diagonal entries, then the strictly lower triangle column by column), n points,
  and `gamma m` of the Wishart prior.
- `ba/ba{i}_n{n}_m{m}_p{p}.txt`: `n m p`, then one camera (11), one point (3), one weight and
  one feature (2); the instance replicates them, and observation i links camera i mod n to
  point i mod m.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

ENV_VAR = "JAXREV_ADBENCH"
N_CAM_PARAMS = 11


def data_dir() -> Path:
    """The ADBench data folder: $JAXREV_ADBENCH, else ../shared/data/adbench beside the repo."""
    override = os.environ.get(ENV_VAR)
    path = (
        Path(override)
        if override
        else Path(__file__).resolve().parents[1].parent / "shared" / "data" / "adbench"
    )
    if not (path / "gmm").is_dir() or not (path / "ba").is_dir():
        raise FileNotFoundError(
            f"ADBench inputs not found at {path} (expected its gmm/ and ba/ folders). Put "
            f"ADBench's data there, or set {ENV_VAR} to the folder that holds gmm/ and ba/."
        )
    return path


def _numbers(path: str | Path) -> np.ndarray:
    # Whitespace-separated numbers on ragged lines: one split beats line-by-line parsing.
    return np.array(Path(path).read_text().split(), dtype=np.float64)


def read_gmm(path: str | Path) -> dict:
    """One GMM instance: alphas (K,), means (K, D), icf (K, D(D+1)/2), x (n, D), gamma, m."""
    v = _numbers(path)
    d, k, n = (int(t) for t in v[:3])
    icf_size = d * (d + 1) // 2
    sizes = [k, k * d, k * icf_size, n * d, 2]
    if v.size != 3 + sum(sizes):
        raise ValueError(
            f"{path}: {v.size} numbers, expected {3 + sum(sizes)} for D={d} K={k} n={n}"
        )
    alphas, means, icf, x, wishart = np.split(v[3:], np.cumsum(sizes)[:-1])
    return {
        "alphas": alphas,
        "means": means.reshape(k, d),
        "icf": icf.reshape(k, icf_size),
        "x": x.reshape(n, d),
        "gamma": float(wishart[0]),
        "m": int(wishart[1]),
    }


def read_ba(path: str | Path) -> dict:
    """One BA instance, replicated as ADBench does: cams (n, 11), X (m, 3), w (p,),
    feats (p, 2), obs (p, 2) int with obs[i] = (i mod n, i mod m)."""
    v = _numbers(path)
    n, m, p = (int(t) for t in v[:3])
    if v.size != 3 + N_CAM_PARAMS + 3 + 1 + 2:
        raise ValueError(f"{path}: {v.size} numbers, expected {3 + N_CAM_PARAMS + 6}")
    cam, pt, w, feat = np.split(v[3:], np.cumsum([N_CAM_PARAMS, 3, 1]))
    i = np.arange(p)
    return {
        "cams": np.tile(cam, (n, 1)),
        "X": np.tile(pt, (m, 1)),
        "w": np.full(p, w[0]),
        "feats": np.tile(feat, (p, 1)),
        "obs": np.stack([i % n, i % m], axis=1),
    }


def _sorted_by_size(files: list[Path]) -> list[Path]:
    return sorted(files, key=lambda f: (f.stat().st_size, f.name))


def gmm_files(subset: str = "10k") -> list[Path]:
    """The GMM inputs of one folder ("10k" or "1k"), smallest file first."""
    return _sorted_by_size(list((data_dir() / "gmm" / subset).glob("gmm_d*_K*.txt")))


def ba_files() -> list[Path]:
    """The BA instances ba1 ... ba20, fewest observations first (the files all hold one camera,
    point, weight and feature, so their byte sizes say nothing about the instance's size)."""
    files = list((data_dir() / "ba").glob("ba*_n*_m*_p*.txt"))
    return sorted(files, key=lambda f: (ba_size(f)[2], f.name))


def gmm_size(path: str | Path) -> tuple[int, int]:
    """(D, K) from a GMM file name."""
    d, k = re.fullmatch(r"gmm_d(\d+)_K(\d+)\.txt", Path(path).name).groups()
    return int(d), int(k)


def ba_size(path: str | Path) -> tuple[int, int, int]:
    """(n cameras, m points, p observations) from a BA file name."""
    n, m, p = re.fullmatch(r"ba\d+_n(\d+)_m(\d+)_p(\d+)\.txt", Path(path).name).groups()
    return int(n), int(m), int(p)
