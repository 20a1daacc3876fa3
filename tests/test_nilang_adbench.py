"""The NiLang paper's ADBench workloads (examples/gmm.py, examples/bundle_adjustment.py): the
readers on ADBench's files, the objectives against independent numpy ports of ADBench's reference
code, the reversible gradients and Jacobian blocks against jax.grad / jax.jacfwd, and one run of
each script."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel_error
from scipy.special import multigammaln

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import adbench_io  # noqa: E402
import bundle_adjustment as ba  # noqa: E402
import gmm  # noqa: E402

try:
    DATA = adbench_io.data_dir()
except FileNotFoundError as e:  # a checkout without ../shared/data/adbench (and no override)
    pytest.skip(str(e), allow_module_level=True)


# ------------------------------------------------------------------ the two scripts, once each


def _start(script: str) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / script)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


SCRIPTS = ("gmm.py", "bundle_adjustment.py")


@pytest.fixture(scope="module", autouse=True)
def _scripts(request) -> dict[str, subprocess.Popen]:
    # Start both scripts before the first test of this file when the session will check them, so
    # that they run while the in-process tests do (each is mostly single-threaded compilation).
    # (a doctest item, of `--doctest-modules`, has no `module`)
    wanted = any(
        getattr(item, "module", None) is request.module and "script" in item.name
        for item in request.session.items
    )
    procs = {s: _start(s) for s in SCRIPTS} if wanted else {}
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.fixture(scope="module")
def outputs(_scripts) -> dict[str, str]:
    out = {}
    for script, proc in _scripts.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{stdout}\n{stderr}"
        out[script] = stdout
    return out


from test_examples import _number  # noqa: E402  (the examples' printed-figure reader)

# ------------------------------------------------------------------ readers


def test_read_gmm_shapes_and_parameter_count():
    for path, n in (
        (DATA / "gmm" / "10k" / "gmm_d2_K5.txt", 10000),
        (DATA / "gmm" / "1k" / "gmm_d64_K5.txt", 1000),
    ):
        g = adbench_io.read_gmm(path)
        d, k = adbench_io.gmm_size(path)
        assert g["alphas"].shape == (k,) and g["means"].shape == (k, d)
        assert g["icf"].shape == (k, d + d * (d - 1) // 2) and g["x"].shape == (n, d)
        assert (g["gamma"], g["m"]) == (1.0, 0)
        params = g["alphas"].size + g["means"].size + g["icf"].size
        assert params == k + k * d + k * d * (d + 1) // 2
    assert gmm.problem((2, 5))["parameters"] == 30  # the paper's smallest column
    first = adbench_io.read_gmm(DATA / "gmm" / "10k" / "gmm_d2_K5.txt")
    assert first["alphas"][0] == -0.649014 and first["means"][0, 1] == 0.396767
    assert first["icf"][0, 2] == -1.270071 and first["x"][-1, 0] == 0.407291


def test_read_ba_replicates_as_adbench():
    path = DATA / "ba" / "ba1_n49_m7776_p31843.txt"
    b = adbench_io.read_ba(path)
    n, m, p = adbench_io.ba_size(path)
    assert b["cams"].shape == (n, 11) and b["X"].shape == (m, 3)
    assert b["w"].shape == (p,) and b["feats"].shape == (p, 2) and b["obs"].shape == (p, 2)
    assert b["obs"].dtype.kind == "i"
    i = np.arange(p)
    assert np.array_equal(b["obs"][:, 0], i % n) and np.array_equal(b["obs"][:, 1], i % m)
    assert np.all(b["cams"] == b["cams"][0]) and b["cams"][0, 6] == 419.194514
    assert np.all(b["X"] == [7.203245, 0.001144, 3.023326]) and np.all(b["w"] == 0.417022)
    assert np.all(b["feats"] == [271.760969, 834.209256])


def test_file_lists_and_sizes():
    files = adbench_io.ba_files()
    assert len(files) == 20
    assert [adbench_io.ba_size(f)[2] for f in files] == sorted(
        adbench_io.ba_size(f)[2] for f in files
    )
    assert len(ba.sizes(False)) == 20 and set(ba.sizes(True)) < set(ba.sizes(False))
    full = gmm.sizes(False)
    assert len(full) == 24 and {d for d, _ in full} == {2, 10, 20, 32}
    assert set(gmm.sizes(True)) < set(full)
    g = adbench_io.gmm_files("10k")
    assert [f.stat().st_size for f in g] == sorted(f.stat().st_size for f in g)


def test_data_dir_override_and_error(monkeypatch, tmp_path):
    monkeypatch.setenv(adbench_io.ENV_VAR, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=adbench_io.ENV_VAR):
        adbench_io.data_dir()
    monkeypatch.setenv(adbench_io.ENV_VAR, str(DATA))
    assert adbench_io.data_dir() == DATA


# ------------------------------------------------------------------ GMM


def gmm_numpy(alphas, means, icf, x, gamma, m) -> float:
    """ADBench's C++ gmm_objective, ported loop by loop (vectorised over points only)."""
    k, d = means.shape
    n = x.shape[0]

    def lse(v, axis=None):
        mx = np.max(v, axis=axis, keepdims=True)
        return np.squeeze(np.log(np.sum(np.exp(v - mx), axis=axis, keepdims=True)) + mx)

    qdiags, sum_qs = np.exp(icf[:, :d]), icf[:, :d].sum(1)
    main = np.empty((n, k))
    for ik in range(k):
        xc = x - means[ik]
        out = qdiags[ik] * xc  # Qtimesx
        idx = d
        for i in range(d):
            for j in range(i + 1, d):
                out[:, j] += icf[ik, idx] * xc[:, i]
                idx += 1
        main[:, ik] = alphas[ik] + sum_qs[ik] - 0.5 * np.sum(out * out, axis=1)
    err = -n * d * 0.5 * math.log(2 * math.pi) + lse(main, axis=1).sum() - n * lse(alphas)
    nw = d + m + 1  # log_wishart_prior
    c = nw * d * (math.log(gamma) - 0.5 * math.log(2)) - multigammaln(0.5 * nw, d)
    frob = np.sum(qdiags**2, axis=1) + np.sum(icf[:, d:] ** 2, axis=1)
    return float(err + np.sum(0.5 * gamma * gamma * frob - m * sum_qs) - k * c)


def test_gmm_objective_and_gradients():
    # The files all have gamma = 1, m = 0 (test_gmm_script checks that case on a 10k input):
    # other values exercise the prior's m and gamma terms. 250 points: two blocks through the
    # reversible scan and a partial one added outside it.
    g = adbench_io.read_gmm(DATA / "gmm" / "1k" / "gmm_d10_K5.txt")
    gamma, m = 2.5, 3
    args = tuple(jnp.asarray(g[key]) for key in ("alphas", "means", "icf"))
    args = args + (jnp.asarray(g["x"][:250]),)
    np_args = [np.asarray(a) for a in args]
    want = gmm_numpy(*np_args, gamma, m)
    value, ref = jax.jit(jax.value_and_grad(gmm.make_objective(gamma, m), argnums=(0, 1, 2)))(*args)
    value_rev, got = jax.jit(
        jax.value_and_grad(gmm.make_reversible_objective(gamma, m), argnums=(0, 1, 2))
    )(*args)
    assert abs(float(value) - want) < 1e-12 * abs(want)
    assert abs(float(value_rev) - want) < 1e-12 * abs(want)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and rel_error(a, b) < 1e-10
    # and against central differences of the independent numpy objective
    h = 1e-5
    for arg, idx in ((0, (1,)), (1, (2, 3)), (2, (4, 0)), (2, (0, 14))):
        plus, minus = [a.copy() for a in np_args], [a.copy() for a in np_args]
        plus[arg][idx] += h
        minus[arg][idx] -= h
        fd = (gmm_numpy(*plus, gamma, m) - gmm_numpy(*minus, gamma, m)) / (2 * h)
        assert abs(fd - float(got[arg][idx])) < 1e-6 * float(jnp.max(jnp.abs(got[arg])))


@pytest.mark.slow  # the whole script; its functions are checked in-process above
def test_gmm_script(outputs):
    out = outputs["gmm.py"]
    for d, k in gmm.sizes(quick=True):
        name = f"D={d} K={k}"
        assert _number(out, f"{name} gradient vs jax.grad, relative error:") < 1e-10
        assert _number(out, f"{name} jax.grad vs central differences, relative error:") < 1e-6
        m = re.search(
            re.escape(name) + r" gradient temp memory: jax.grad (\d+) B, "
            r"jr.reversible (\d+) B",
            out,
        )
        assert m and int(m.group(2)) * 20 < int(m.group(1)), out
        t = re.search(
            re.escape(name) + r" gradient time: jax.grad ([0-9.]+) ms, "
            r"jr.reversible ([0-9.]+) ms",
            out,
        )
        assert t and float(t.group(1)) > 0 and float(t.group(2)) > 0, out
    # the printed objective is ADBench's, by the numpy port
    g = adbench_io.read_gmm(DATA / "gmm" / "10k" / "gmm_d2_K5.txt")
    want = gmm_numpy(*(g[key] for key in ("alphas", "means", "icf", "x")), g["gamma"], g["m"])
    assert abs(_number(out, "D=2 K=5 objective:") - want) < 1e-9 * abs(want)
    m = re.search(
        r"n = 1000 -> 10000: jax.grad (\d+) -> (\d+) B, jr.reversible (\d+) -> (\d+) B", out
    )
    # jax.grad's memory follows n; the reversible gradient's does not (√T checkpoints of a
    # scalar, and one segment's blocks of points when it recomputes one)
    assert m, out
    assert int(m.group(4)) < 2 * int(m.group(3)) and int(m.group(2)) > 5 * int(m.group(1)), out


# ------------------------------------------------------------------ bundle adjustment


def project_numpy(cam, x):
    """ADBench's C++ project(), ported line by line."""
    rot, xo = cam[:3], x - cam[3:6]
    sqtheta = rot @ rot
    if sqtheta != 0:
        theta = math.sqrt(sqtheta)
        w = rot / theta
        tmp = (w @ xo) * (1 - math.cos(theta))
        xcam = xo * math.cos(theta) + np.cross(w, xo) * math.sin(theta) + w * tmp
    else:
        xcam = xo + np.cross(rot, xo)
    proj = xcam[:2] / xcam[2]
    rsq = proj @ proj
    proj = proj * (1 + cam[9] * rsq + cam[10] * rsq * rsq)
    return proj * cam[6] + cam[7:9]


def small_instance(seed: int = 0) -> tuple[np.ndarray, ...]:
    """ba1's camera, point, weight and feature, perturbed per copy so that every block differs,
    with one camera at exactly zero rotation (ADBench's other branch)."""
    b = adbench_io.read_ba(DATA / "ba" / "ba1_n49_m7776_p31843.txt")
    rng = np.random.default_rng(seed)
    n, m, p = 3, 5, 12
    cams = b["cams"][:n] * (1 + 0.05 * rng.standard_normal((n, 11)))
    cams[2, :3] = 0.0
    X = b["X"][:m] + 0.1 * rng.standard_normal((m, 3))
    w = b["w"][:p] + 0.1 * rng.standard_normal(p)
    feats = b["feats"][:p] + rng.standard_normal((p, 2))
    i = np.arange(p)
    return cams, X, w, feats, np.stack([i % n, i % m], axis=1)


def test_ba_residuals_match_numpy():
    cams, X, w, feats, obs = small_instance()
    reproj, werr = jax.jit(ba.residuals)(cams, X, w, feats, obs)
    for i, (c, j) in enumerate(obs):
        proj = project_numpy(cams[c], X[j])
        assert np.allclose(ba.project(cams[c], X[j]), proj, rtol=1e-13, atol=0)
        # the residual cancels (projection ~ feature ~ 800 px): compare at the projection's scale
        want = w[i] * (proj - feats[i])
        assert np.allclose(reproj[i], want, rtol=0, atol=1e-13 * np.max(np.abs(w[i] * proj)))
    assert np.allclose(werr, 1 - w * w, rtol=1e-14, atol=0)
    # and on a file, as ADBench replicates it
    prob = ba.problem(1)
    reproj, _ = jax.jit(prob["objective"])(*prob["args"])
    b = adbench_io.read_ba(DATA / "ba" / "ba1_n49_m7776_p31843.txt")
    proj = project_numpy(b["cams"][0], b["X"][0])
    want = b["w"][0] * (proj - b["feats"][0])
    assert reproj.shape == (31843, 2)
    assert np.allclose(reproj, want, rtol=0, atol=1e-13 * np.max(np.abs(proj)))


def test_ba_jacobian_blocks_against_dense_jacfwd(monkeypatch):
    cams, X, w, feats, obs = small_instance()
    n, m, p = cams.shape[0], X.shape[0], w.shape[0]

    def all_residuals(cams, X, w):
        reproj, werr = ba.residuals(cams, X, w, feats, obs)
        return jnp.concatenate([reproj.ravel(), werr])

    dense = jax.jit(jax.jacfwd(all_residuals, argnums=(0, 1, 2)))(cams, X, w)
    dense = np.concatenate(
        [dense[0].reshape(3 * p, -1), dense[1].reshape(3 * p, -1), dense[2]], axis=1
    )
    # Blocks by jr.reversible, mapped in chunks of 5 (lax.map, a partial last chunk): the path
    # of instances above CHUNK observations. The script checks the one-vmap path against
    # jacfwd and jacrev on the files.
    monkeypatch.setattr(ba, "CHUNK", 5)
    blocks, dw = jax.jit(ba.per_observation(ba.reversible_block))(cams, X, w, feats, obs)
    assert blocks.shape == (p, 2, 15) and dw.shape == (p,)
    rows, cols, vals, shape = ba.sparse_jacobian(blocks, dw, obs, n, m)
    assert shape == dense.shape and vals.size == 31 * p
    sparse = np.zeros(shape)
    np.add.at(sparse, (rows, cols), vals)
    assert rel_error(sparse, dense) < 1e-10
    # observation 2 sees camera 2, whose rotation is exactly zero (ADBench's first-order branch)
    cam_cols, point_cols, weight_col = slice(22, 33), slice(33 + 6, 33 + 9), slice(48 + 2, 48 + 3)
    want = np.concatenate(
        [dense[4:6, cam_cols], dense[4:6, point_cols], dense[4:6, weight_col]], axis=1
    )
    assert rel_error(blocks[2], want) < 1e-10


@pytest.mark.slow  # the whole script; its functions are checked in-process above
def test_ba_script(outputs):
    out = outputs["bundle_adjustment.py"]
    for size in ba.sizes(quick=True):
        name = size.split("_")[0]
        p = adbench_io.ba_size(size)[2]
        assert (
            _number(out, f"{name} Jacobian blocks, max relative difference between the three:")
            < 1e-10
        )
        assert re.search(re.escape(name) + rf" Jacobian {3 * p} x \d+, nnz: {31 * p} ", out), out
        t = re.search(
            re.escape(name) + r" Jacobian time: jacfwd ([0-9.]+) ms, jacrev ([0-9.]+) "
            r"ms, jr.reversible ([0-9.]+) ms",
            out,
        )
        assert t and all(float(v) > 0 for v in t.groups()), out
        assert _number(out, f"{name} objective time:") > 0
    assert "ba10 Jacobian 1691202 x 955882, nnz: 17475754" in out
