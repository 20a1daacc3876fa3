"""Rerun every benchmark's quick mode and compare its headline figures with the committed ones.

Issue 28, item 5: run it before closing any issue that touches the engine, and commit the
refreshed results (results/run_all.{json,md}).

Each benchmark in `BENCHMARKS` runs as ``python benchmarks/<script> --quick`` in its own
subprocess (the scripts pin XLA:CPU and OpenBLAS to one thread themselves; the environment is
passed on unchanged), under a timeout, so that one hang or crash does not stop the rest. From
the JSON its quick run writes (results/<name>_quick.json; for the two scripts whose quick run
only prints its table, run_all parses the printed table and writes that file itself) it
extracts a few HEADLINE figures: ratios against a peer measured in the same run, operation
counts and log-log slopes, never absolute seconds (docs/design.md §4), each with the direction
that is good. A headline that moved more than 20 % (--threshold) the wrong way is REGRESSED,
one that moved more than 20 % the right way is "improved". Timings on a shared machine are
noisy (two runs of the same code can differ by more than 20 % at quick sizes), so a benchmark
with a REGRESSED headline is rerun twice more (--confirm) and each headline's median over its
runs is what is compared; --repeat N runs every benchmark N times (the median is also what is
recorded, so use it when refreshing the baseline).

The baseline, at --rev (HEAD by default):

1. the committed version of the quick JSON itself (`git show HEAD:benchmarks/results/<file>`),
   when it is tracked: a quick-against-quick comparison;
2. otherwise the headline values recorded by the last committed run of this script
   (HEAD:benchmarks/results/run_all.json, "headlines"): also quick against quick. The quick
   files match `benchmarks/results/*_quick.*` in .gitignore, so this is the usual source;
3. otherwise "no baseline (first run)"; the new value is recorded in results/run_all.json.

Quick results are never compared with the full runs' results (other sizes, other repetitions).
A benchmark whose run fails, times out, or does not write its quick JSON is reported as
failed, not skipped. Output: a Markdown table on stdout and in results/run_all.md, the same in
results/run_all.json (which also carries each benchmark's latest recorded headline values,
the next baseline), each run's stdout and stderr in results/<name>_quick.log. Exit status 1 if
any headline regressed or any benchmark failed.

    python benchmarks/run_all.py                        # every benchmark
    python benchmarks/run_all.py --only eager_cache,nilang_tables
    python benchmarks/run_all.py --skip quantum --timeout 900
    python benchmarks/run_all.py --repeat 3             # a steadier baseline to commit
    python benchmarks/run_all.py --no-run               # compare the quick JSONs already here
    python benchmarks/run_all.py --list                 # the benchmarks and their headlines
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import RESULTS, progress  # noqa: E402

LOWER, HIGHER = "lower", "higher"
THRESHOLD = 0.20
RUN_ALL = "run_all"


@dataclass
class Headline:
    """One figure of a benchmark's quick JSON `file`: `get(data)` gives a number, None where
    it was not measured (an optional peer is not installed), or a dict {suffix: number} for a
    family of headlines (one per family of programs, say)."""

    file: str
    label: str
    better: str
    get: Callable[[dict], Any]
    why: str = ""


@dataclass
class Bench:
    name: str
    script: str
    headlines: list[Headline]
    timeout: float = 1200.0  # seconds for the quick run
    args: tuple[str, ...] = ("--quick",)
    # the quick run prints its table and writes no JSON: run_all parses stdout into this file
    parse_stdout: Callable[[str], dict] | None = None
    files: tuple[str, ...] = field(default=())

    def __post_init__(self):
        if not self.files:
            self.files = tuple(dict.fromkeys(h.file for h in self.headlines))


# ------------------------------------------------------------------- helpers for the extractors


def _row(rows: list[dict], **match) -> dict:
    """The row whose fields equal `match` (compared as strings: JSON turns tuples into text)."""
    for r in rows:
        if all(str(r.get(k)) == str(v) for k, v in match.items()):
            return r
    raise KeyError(f"no row with {match}")


def md_tables(text: str) -> list[list[dict[str, str]]]:
    """The Markdown tables of `text`, each a list of {header: cell} rows."""
    tables, lines = [], [ln.strip() for ln in text.splitlines()]
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and set(lines[i + 1]) <= set("|-: ") and "-" in lines[i + 1]:
            head = [c.strip() for c in lines[i].strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip("|").split("|")]
                rows.append(dict(zip(head, cells)))
                i += 1
            tables.append(rows)
        else:
            i += 1
    return tables


def _parsed(stdout: str) -> dict:
    tables = md_tables(stdout)
    if not tables:
        raise ValueError("no Markdown table in the quick run's output")
    return {"source": "the quick run's printed tables, parsed by run_all.py", "tables": tables}


def _cell(data: dict, column: str, key: str, value: Any) -> float:
    """The number in `column` of the row whose `key` column is `value`, from the first parsed
    table that has that column."""
    for table in data["tables"]:
        if table and column in table[0]:
            return float(_row(table, **{key: value})[column])
    raise KeyError(f"no parsed table with the column {column!r}")


# ------------------------------------------------------------------------------ the benchmarks


def _eager(num: str, den: str, n: int = 100) -> Callable[[dict], float]:
    def get(d):
        t = _row(d["rows"], n=n)["time"]
        return t[num] / t[den]

    return get


def _flows(what: str, n: int = 196, batch: int = 64) -> Callable[[dict], float]:
    def get(d):
        r = _row(d["rows"], n=n, batch=batch)
        if what == "inv temp":
            m = r["temp_bytes"]
            return m["inv jaxrev"] / m["inv analytic"]
        if what == "inv eqns":
            return r["program_stats"]["inv jaxrev"]["jaxpr_eqns"]
        t = r["times"]
        return t[f"{what} jaxrev"] / t[f"{what} analytic"]

    return get


def _inv_ad(name: str, num: str = "jr.inverse_jvp", den: str = "jax.jvp"):
    def get(d):
        t = _row(d["rows"], name=name)["times"]
        return t[num] / t[den]

    return get


def _neural_ode(column: str, steps: int = 1000):
    return lambda d: _cell(d, column, "steps", steps)


def _heun(what: str, steps: int = 1000):
    def get(d):
        if what == "memory":
            return _cell(d, "jax.grad temp MB", "steps", steps) / _cell(
                d, "jr.reversible temp MB", "steps", steps
            )
        return _cell(d, what, "steps", steps)

    return get


def _nilang(workload: str, size: Any, what: str = "time"):
    def get(d):
        r = _row(d["rows"], workload=workload, size=size)
        if what == "temp":
            return r["temp_bytes"]["jaxrev"] / r["temp_bytes"]["jax"]
        if what == "hessian":
            return r["time"]["jaxrev_hessian"] / r["time"]["jax_hessian"]
        return r["time"]["jaxrev"] / r["time"]["jax"]

    return get


def _newton_b(n: int, what: str):
    def get(d):
        runs = _row(d["part_b"], n=n)["runs"]
        if what == "optax":
            return runs["optax L-BFGS"]["seconds"] / runs["jaxrev newton"]["seconds"]
        return runs[what]["steps"]

    return get


def _newton_a(n: int, peer: str):
    def get(d):
        t = _row(d["part_a"], n=n)["times"]
        return t[peer] / t["jaxrev newton_direction"]

    return get


def _quantum_pennylane(d: dict) -> float | None:
    if not d.get("pennylane"):
        return None  # PennyLane is not installed
    pl = _row(d["pennylane"], qubits=16, depth=10)
    return pl["time"] / _row(d["time"], qubits=16, depth=10)["time"]["jaxrev"]


def _memory(what: str):
    def get(d):
        if what == "unrolled temp":
            m = d["unrolled_net"]["mem"]
            return m["jr.reversible"] / m["jax.grad"]
        rows = d["coupled_scan"]
        r = _row(rows, depth=1000)
        if what == "temp":
            return r["mem"]["jr.reversible"] / r["mem"]["jax.grad"]
        if what == "flat":  # the fully reversible mode's (the default's grows as √depth)
            rev = [
                x["mem"].get("jr.reversible fully reversible", x["mem"]["jr.reversible"])
                for x in rows
            ]
            return rev[-1] / rev[0]
        if what == "equinox":
            if "equinox checkpointed" not in r["time"]:
                return None  # Equinox is not installed
            return r["time"]["equinox checkpointed"] / r["time"]["jr.reversible"]
        return r["time"]["jr.reversible"] / r["time"]["jax.grad"]

    return get


def _dial(setting: str, what: str):
    def get(d):
        f = d["float64"]
        r = _row(f["rows"], setting=setting)
        return r["time"] / f["jax.grad_time"] if what == "time" else r["mem"] / f["jax.grad_mem"]

    return get


def _tracing_rules(d: dict) -> dict[str, float]:
    kmax = max(d["ks"])
    out = {}
    for fam in d["log-log slopes"]:
        r = _row(d["rows"], family=fam, k=kmax)
        out[fam] = sum(v for k, v in r.items() if k.endswith(" rules"))
    return out


def _tracing_slope(d: dict) -> float:
    return max(w["rules"] for fit in d["log-log slopes"].values() for w in fit.values())


def _transformer(what: str):
    def get(d):
        r = _row(d["rows"], depth=max(x["depth"] for x in d["rows"]), dtype="float32")
        if what == "memory":
            return r["mem"]["remat"] / r["mem"]["reversible"]
        return r["time"]["reversible"] / r["time"]["remat"]

    return get


EC, FL, IA, NO, RH = (
    "eager_cache_quick.json",
    "flows_quick.json",
    "inverse_ad_quick.json",
    "neural_ode_quick.json",
    "reversible_heun_quick.json",
)
NT, NW, QU, RM, RD, TR = (
    "nilang_tables_quick.json",
    "newton_quick.json",
    "quantum_quick.json",
    "reversible_memory_quick.json",
    "reversible_dial_quick.json",
    "tracing_quick.json",
)
CHAIN, ATADD = "single-slot chain", "single-slot chain, fori_loop of .at[i].add"
KG, COUPLING = "Klein-Gordon leapfrog, 200 steps", "coupling chain .at[1:].add"
GR = "eager grad(reversible(f))"

ER = "exact_reversal_quick.json"


def _exact(key: str) -> Callable[[dict], Any]:
    return lambda d: _row(d["rows"], case="SGD momentum 0.9, float64")["ratios"][key]


BENCHMARKS: list[Bench] = [
    Bench(
        "exact_reversal",
        "exact_reversal.py",
        timeout=900,
        headlines=[
            Headline(
                ER,
                "exact / jax.grad time, momentum SGD 0.9, 2000 steps",
                LOWER,
                _exact("time exact/jax.grad"),
            ),
            Headline(
                ER,
                "exact / jax.grad memory, momentum SGD 0.9, 2000 steps",
                LOWER,
                _exact("memory exact/jax.grad"),
            ),
        ],
    ),
    Bench(
        "eager_cache",
        "eager_cache.py",
        timeout=600,
        headlines=[
            Headline(
                EC,
                f"{GR} / eager grad(jit(f)), N=100",
                LOWER,
                _eager(GR, "eager grad(jit(f))"),
                "the cache against JAX's own eager grad",
            ),
            Headline(
                EC,
                f"{GR} / jit(grad(reversible(f))), N=100",
                LOWER,
                _eager(GR, "jit(grad(reversible(f)))"),
                "what a cached eager call adds",
            ),
            Headline(
                EC,
                "eager reverse / jit(reverse), N=100",
                LOWER,
                _eager("eager reverse(f)", "jit(reverse(f))"),
            ),
            Headline(
                EC,
                "eager inverse_jvp / jit(inverse_jvp), N=100",
                LOWER,
                _eager("eager inverse_jvp", "jit(inverse_jvp)"),
            ),
        ],
    ),
    Bench(
        "flows",
        "flows.py",
        headlines=[
            Headline(
                FL,
                "fwd jaxrev / analytic time, n=196 B=64",
                LOWER,
                _flows("fwd"),
                "the hand-written log-det is always measured (distrax is optional)",
            ),
            Headline(FL, "inv jaxrev / analytic time, n=196 B=64", LOWER, _flows("inv")),
            Headline(
                FL, "inv jaxrev / analytic temp memory, n=196 B=64", LOWER, _flows("inv temp")
            ),
            Headline(
                FL,
                "inv jaxrev jaxpr equations (count)",
                LOWER,
                _flows("inv eqns"),
                "program size: deterministic",
            ),
        ],
    ),
    Bench(
        "inverse_ad",
        "inverse_ad.py",
        headlines=[
            Headline(IA, f"inverse_jvp / jax.jvp, {CHAIN}", LOWER, _inv_ad(CHAIN)),
            Headline(
                IA,
                "inverse_jvp / jax.jvp, fori_loop .at[i].add chain",
                LOWER,
                _inv_ad(ATADD),
                "element-level inversion",
            ),
            Headline(IA, "inverse_jvp / jax.jvp, Klein-Gordon", LOWER, _inv_ad(KG)),
            Headline(
                IA,
                "inverse_jvp / jax.jvp, coupling chain (linearize)",
                LOWER,
                _inv_ad(COUPLING),
                "the 'linearize' strategy",
            ),
            Headline(
                IA,
                "slogdet_jacobian / dense slogdet, fori_loop chain",
                LOWER,
                _inv_ad(ATADD, "jr.slogdet_jacobian", "dense slogdet"),
            ),
        ],
    ),
    Bench(
        "neural_ode",
        "neural_ode.py",
        parse_stdout=_parsed,
        headlines=[
            Headline(
                NO,
                "ReversibleAdjoint / RecursiveCheckpoint memory, 1000 steps",
                LOWER,
                _neural_ode("memory / RecursiveCheckpoint"),
            ),
            Headline(
                NO,
                "ReversibleAdjoint / RecursiveCheckpoint time, 1000 steps",
                LOWER,
                _neural_ode("time / RecursiveCheckpoint"),
            ),
            Headline(
                NO,
                "ReversibleAdjoint / Backsolve time, 1000 steps",
                LOWER,
                _neural_ode("time / Backsolve"),
            ),
        ],
    ),
    Bench(
        "newton",
        "newton.py",
        headlines=[
            Headline(
                NW, "GMRES / jaxrev direction time, n=4000", HIGHER, _newton_a(4000, "lineax GMRES")
            ),
            Headline(
                NW, "CG / jaxrev direction time, n=4000", HIGHER, _newton_a(4000, "lineax CG")
            ),
            Headline(
                NW,
                "dense / jaxrev direction time, n=1000",
                HIGHER,
                _newton_a(1000, "dense hessian + solve"),
            ),
            Headline(
                NW,
                "optax L-BFGS / jaxrev newton minimize time, n=1000",
                HIGHER,
                _newton_b(1000, "optax"),
            ),
            Headline(
                NW, "jaxrev newton steps, n=1000 (count)", LOWER, _newton_b(1000, "jaxrev newton")
            ),
            Headline(
                NW,
                "jaxrev trust-region steps, n=1000 (count)",
                LOWER,
                _newton_b(1000, "jaxrev trust-region"),
            ),
        ],
    ),
    Bench(
        "nilang_tables",
        "nilang_tables.py",
        timeout=900,
        headlines=[
            Headline(NT, "jaxrev / JAX time, Bessel batch 4000", LOWER, _nilang("bessel", 4000)),
            Headline(NT, "jaxrev / JAX time, sparse dot", LOWER, _nilang("sparse", 1000)),
            Headline(NT, "jaxrev / JAX gradient time, graph k=10", LOWER, _nilang("graph", 10)),
            Headline(
                NT, "jaxrev / JAX Hessian time, graph k=10", LOWER, _nilang("graph", 10, "hessian")
            ),
            Headline(NT, "jaxrev / JAX time, GMM (10, 5)", LOWER, _nilang("gmm", (10, 5))),
            Headline(
                NT, "jaxrev / JAX temp memory, GMM (10, 5)", LOWER, _nilang("gmm", (10, 5), "temp")
            ),
            Headline(NT, "jaxrev / JAX time, bundle adjustment 1", LOWER, _nilang("ba", 1)),
        ],
    ),
    Bench(
        "quantum",
        "quantum.py",
        timeout=1500,
        headlines=[
            Headline(
                QU,
                "jax.grad / jaxrev temp memory, 16 qubits depth 100",
                HIGHER,
                lambda d: d["targets"]["memory_ratio"]["value"],
            ),
            Headline(
                QU,
                "jaxrev temp memory max / min over depths, 16 qubits",
                LOWER,
                lambda d: d["targets"]["memory_flat_in_depth"]["value"],
            ),
            Headline(
                QU,
                "jaxrev / jax.grad time, 16 qubits depth 100",
                LOWER,
                lambda d: d["targets"]["time_ratio"]["value"],
            ),
            Headline(
                QU,
                "PennyLane adjoint / jaxrev time, 16 qubits depth 10",
                HIGHER,
                _quantum_pennylane,
                "measured (its depth 100 is extrapolated in --quick)",
            ),
        ],
    ),
    Bench(
        "reversible_heun",
        "reversible_heun.py",
        parse_stdout=_parsed,
        timeout=600,
        headlines=[
            Headline(
                RH, "jax.grad / jr.reversible temp memory, 1000 steps", HIGHER, _heun("memory")
            ),
            Headline(
                RH,
                "jr.reversible / jax.grad time, 1000 steps",
                LOWER,
                _heun("reversible time / grad time"),
            ),
            Headline(
                RH,
                "jr.reversible / jax.checkpoint time, 1000 steps",
                LOWER,
                _heun("reversible time / checkpoint time"),
            ),
        ],
    ),
    Bench(
        "reversible_memory",
        "reversible_memory.py",
        headlines=[
            Headline(
                RM, "jr.reversible / jax.grad temp memory, depth 1000", LOWER, _memory("temp")
            ),
            Headline(
                RM,
                "jr.reversible fully reversible temp memory, deepest / shallowest",
                LOWER,
                _memory("flat"),
                "flat in depth: 1",
            ),
            Headline(RM, "jr.reversible / jax.grad time, depth 1000", LOWER, _memory("time")),
            Headline(
                RM,
                "equinox checkpointed / jr.reversible time, depth 1000",
                HIGHER,
                _memory("equinox"),
            ),
            Headline(
                RM,
                "jr.reversible / jax.grad temp memory, unrolled net",
                LOWER,
                _memory("unrolled temp"),
            ),
            Headline(
                RD, "dial: default / jax.grad time", LOWER, _dial("default (repair, auto)", "time")
            ),
            Headline(
                RD,
                "dial: default / jax.grad temp memory",
                LOWER,
                _dial("default (repair, auto)", "mem"),
            ),
            Headline(
                RD,
                "dial: fully reversible / jax.grad time",
                LOWER,
                _dial("fully reversible (opt-in)", "time"),
            ),
            Headline(
                RD,
                "dial: memory_budget=1% / jax.grad time",
                LOWER,
                _dial("memory_budget=1%", "time"),
            ),
            Headline(
                RD,
                "dial: memory_budget=1% / jax.grad temp memory",
                LOWER,
                _dial("memory_budget=1%", "mem"),
            ),
        ],
    ),
    Bench(
        "transformer",
        "transformer.py",
        timeout=900,
        headlines=[
            Headline(
                "transformer_quick.json",
                "remat / reversible per-device memory, depth 24",
                HIGHER,
                _transformer("memory"),
                "2 x 2 mesh of CPU devices, float32",
            ),
            Headline(
                "transformer_quick.json",
                "reversible / remat step time, depth 24",
                LOWER,
                _transformer("time"),
            ),
        ],
    ),
    Bench(
        "tracing",
        "tracing.py",
        timeout=900,
        headlines=[
            Headline(
                TR,
                "rule applications at the largest k, all transforms",
                LOWER,
                _tracing_rules,
                "operation counts: deterministic; one per family",
            ),
            Headline(
                TR,
                "worst log-log slope of rule applications",
                LOWER,
                _tracing_slope,
                "time slopes from two k are too noisy to flag",
            ),
        ],
    ),
]


# ------------------------------------------------------------------------------ git, files


def _git(*args: str) -> str | None:
    try:
        p = subprocess.run(
            ["git", *args], cwd=HERE, capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout if p.returncode == 0 else None


def _repo_path(file: str) -> str:
    top = (_git("rev-parse", "--show-toplevel") or "").strip() or os.path.dirname(HERE)
    return os.path.relpath(os.path.join(RESULTS, file), top).replace(os.sep, "/")


def committed_json(rev: str, file: str) -> dict | None:
    text = _git("show", f"{rev}:{_repo_path(file)}")
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return None


def working_json(file: str) -> dict | None:
    try:
        with open(os.path.join(RESULTS, file)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def extract(h: Headline, data: dict) -> dict[str, float | None]:
    """{label: value} of headline `h` in `data` (several labels for a family)."""
    v = h.get(data)
    if isinstance(v, dict):
        return {f"{h.label} ({k})": float(x) for k, x in v.items()}
    return {h.label: None if v is None else float(v)}


# ------------------------------------------------------------------------------ running


def run_quick(b: Bench, timeout: float) -> dict:
    """Run `b`'s quick mode in its own process group (killed whole on a timeout); its output
    goes to results/<name>_quick.log. Returns {"ok", "error", "seconds"}."""
    cmd = [sys.executable, os.path.join(HERE, b.script), *b.args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start, wall0 = time.time(), time.monotonic()
    error = None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            cmd,
            cwd=os.path.dirname(HERE),
            env=env,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        try:
            rc = proc.wait(timeout=timeout)
            if rc != 0:
                error = f"exit status {rc}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:g} s"
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
                try:
                    os.killpg(proc.pid, sig)  # its process group: the script and its children
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        seconds = time.monotonic() - wall0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{b.name}_quick.log"), "w") as f:
        f.write(
            f"$ {' '.join(cmd)}\n# {error or 'ok'}, {seconds:.0f} s\n\n{stdout}\n"
            f"--- stderr ---\n{stderr}"
        )
    if error is None and b.parse_stdout is not None:
        try:
            data = b.parse_stdout(stdout)
            with open(os.path.join(RESULTS, b.files[0]), "w") as f:
                json.dump(data, f, indent=1)
        except Exception as e:  # noqa: BLE001 - reported, not raised
            error = f"could not parse its output: {e!r}"
    if error is None:
        for file in b.files:
            p = os.path.join(RESULTS, file)
            if not os.path.exists(p) or os.path.getmtime(p) < start - 1:
                error = f"did not write results/{file}"
    if error is not None:
        tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:] or [""]
        error += f": {tail[0][-200:]}" if tail[0] else ""
    return {"ok": error is None, "error": error, "seconds": seconds}


# ------------------------------------------------------------------------------ comparing


def verdict(
    better: str, base: float | None, now: float | None, threshold: float
) -> tuple[float | None, str]:
    if now is None:
        return None, "not measured (optional peer missing)"
    if base is None:
        return None, "no baseline (first run)"
    if base == 0:
        change = 0.0 if now == 0 else float("inf") * (1 if now > 0 else -1)
    else:
        change = (now - base) / abs(base)
    worse = change > threshold if better == LOWER else change < -threshold
    improved = change < -threshold if better == LOWER else change > threshold
    return change, "REGRESSED" if worse else "improved" if improved else "ok"


def baselines(b: Bench, rev: str, recorded: dict) -> tuple[dict[str, float], str]:
    """{label: committed value} for `b` and where they come from."""
    out: dict[str, float] = {}
    sources = []
    for file in b.files:
        data = committed_json(rev, file)
        if data is None:
            continue
        sources.append(f"{rev}:results/{file}")
        for h in b.headlines:
            if h.file == file:
                try:
                    out.update({k: v for k, v in extract(h, data).items() if v is not None})
                except Exception:  # noqa: BLE001 - an older format: no baseline for it
                    pass
    rec = recorded.get(b.name)
    if rec:
        missing = {k: v for k, v in rec.get("values", {}).items() if k not in out and v is not None}
        if missing:
            out.update(missing)
            sources.append(
                f"{rev}:results/{RUN_ALL}.json (recorded {rec.get('recorded', '?')}"
                f" at {rec.get('commit', '?')})"
            )
    return out, "; ".join(sources) or "none"


def fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def fmt_change(c: float | None) -> str:
    return "–" if c is None else f"{c * 100:+.1f} %"


def measure(b: Bench, args: argparse.Namespace) -> dict:
    """One quick run of `b` (with --no-run, the files already in results/) and its headline
    values: {"ok", "error", "seconds", "values": {label: value or None}, "headline_errors"}."""
    run = (
        {"ok": True, "error": None, "seconds": None}
        if args.no_run
        else run_quick(b, args.timeout or b.timeout)
    )
    run["values"], run["headline_errors"] = {}, {}
    if not run["ok"]:
        return run
    missing = [f"results/{file}" for file in b.files if working_json(file) is None]
    if missing:
        run["ok"] = False
        run["error"] = (
            f"no {', '.join(missing)} (run it without --no-run)"
            if args.no_run
            else f"{', '.join(missing)} not readable JSON"
        )
        return run
    if args.no_run:
        mtime = min(os.path.getmtime(os.path.join(RESULTS, f)) for f in b.files)
        run["results_from"] = datetime.datetime.fromtimestamp(mtime).isoformat(timespec="minutes")
    for h in b.headlines:
        try:
            run["values"].update(extract(h, working_json(h.file)))
        except Exception as e:  # noqa: BLE001 - reported as a failure
            run["values"][h.label] = None
            run["headline_errors"][h.label] = repr(e)
    return run


def judge(
    b: Bench, attempts: list[dict], base: dict[str, float], args: argparse.Namespace
) -> tuple[dict, list[dict]]:
    """The benchmark's record over its runs (each headline: the median over them) and its
    table rows. Any failed run fails the benchmark."""
    failure = next((a["error"] for a in attempts if not a["ok"]), None)
    errors = {k: v for a in attempts for k, v in a["headline_errors"].items()}
    now: dict[str, float | None] = {}
    spread: dict[str, list[float]] = {}
    if failure is None:
        for label in dict.fromkeys(k for a in attempts for k in a["values"]):
            vals = [a["values"][label] for a in attempts if a["values"].get(label) is not None]
            spread[label] = vals
            now[label] = statistics.median(vals) if vals else None
    run = {
        "ok": failure is None,
        "error": failure,
        "seconds": [a["seconds"] for a in attempts if a["seconds"] is not None],
        "values": now,
        "runs": [a["values"] for a in attempts],
    }
    if "results_from" in attempts[-1]:
        run["results_from"] = attempts[-1]["results_from"]
    if errors:
        run["headline_errors"] = errors
    labels = list(dict.fromkeys([*now, *base]))
    if not labels:  # failed, and nothing committed: one row for the benchmark
        labels = [f"all {len(b.headlines)} headline(s)"]
    rows = []
    for label in labels:
        change = None
        if failure is not None:
            v = ("not run" if args.no_run else "failed") + f": {failure}"
        elif label in errors:
            v = f"failed: {errors[label]}"
        elif label not in now:
            v = "failed: the headline is missing from the new results"
        else:
            change, v = verdict(_better(b, label), base.get(label), now[label], args.threshold)
            if len(spread[label]) > 1:
                v += (
                    f" (median of {len(spread[label])} runs: "
                    + ", ".join(fmt(x) for x in spread[label])
                    + ")"
                )
        rows.append(
            {
                "benchmark": b.name,
                "headline": label,
                "better": _better(b, label),
                "committed": base.get(label),
                "now": now.get(label),
                "change": change,
                "verdict": v,
            }
        )
    return run, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [b.name for b in BENCHMARKS]
    ap.add_argument("--only", default="", help="comma-separated benchmarks: " + ",".join(names))
    ap.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    ap.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds per benchmark (default: each benchmark's own, 600-1500)",
    )
    ap.add_argument(
        "--no-run",
        action="store_true",
        help="do not rerun: compare the quick JSONs already in results/",
    )
    ap.add_argument("--rev", default="HEAD", help="the git revision holding the baseline")
    ap.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help="relative change the wrong way that counts as a regression",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="quick runs per benchmark; each headline is the median over them",
    )
    ap.add_argument(
        "--confirm",
        type=int,
        default=2,
        help="reruns of a benchmark with a regressed headline before it counts "
        "(the median over all its runs is compared; 0: none)",
    )
    ap.add_argument("--list", action="store_true", help="list benchmarks and headlines")
    args = ap.parse_args(argv)

    only = [s for s in args.only.split(",") if s]
    skip = [s for s in args.skip.split(",") if s]
    unknown = [s for s in only + skip if s not in names]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; known: {names}")
    chosen = [b for b in BENCHMARKS if (not only or b.name in only) and b.name not in skip]
    if args.list:
        for b in chosen:
            print(
                f"{b.name}: python benchmarks/{b.script} {' '.join(b.args)} -> "
                f"{', '.join('results/' + f for f in b.files)} (timeout {b.timeout:g} s)"
            )
            for h in b.headlines:
                print(f"  [{h.better} is better] {h.label}" + (f"  ({h.why})" if h.why else ""))
        return 0

    committed_record = committed_json(args.rev, f"{RUN_ALL}.json") or {}
    recorded = committed_record.get("headlines", {})
    commit = (_git("describe", "--always", "--dirty") or "?").strip()
    today = datetime.date.today().isoformat()

    runs, rows = {}, []
    bar = progress(chosen, desc="benchmarks (quick)")
    for b in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(b.name)
        base, source = baselines(b, args.rev, recorded)
        attempts = [measure(b, args)]
        while not args.no_run and len(attempts) < args.repeat and attempts[-1]["ok"]:
            attempts.append(measure(b, args))
        run, rows_b = judge(b, attempts, base, args)
        if (
            not args.no_run
            and args.confirm
            and any(r["verdict"].startswith("REGRESSED") for r in rows_b)
        ):
            # timings on a shared machine are noisy: a regression must survive reruns
            for _ in range(args.confirm):
                if hasattr(bar, "set_postfix_str"):
                    bar.set_postfix_str(f"{b.name}, confirming")
                attempts.append(measure(b, args))
            run, rows_b = judge(b, attempts, base, args)
        run["baseline"] = source
        runs[b.name] = run
        rows += rows_b
        say = bar.write if hasattr(bar, "write") else print
        say(
            f"{b.name}: {run['error'] or 'ok'}"
            + (f" ({' + '.join(f'{t:.0f}' for t in run['seconds'])} s)" if run["seconds"] else "")
        )

    regressed = [r for r in rows if r["verdict"].startswith("REGRESSED")]
    failed = sorted({r["benchmark"] for r in rows if r["verdict"].startswith("failed")})
    table = markdown(rows, runs, args, commit, regressed, failed)
    print(table)

    # the record: this run's table, and every benchmark's latest headline values (the next
    # baseline); benchmarks not run now, or failed, keep what was recorded before
    previous = (working_json(f"{RUN_ALL}.json") or committed_record).get("headlines", {})
    headlines = dict(previous)
    for name, run in runs.items():
        vals = {k: v for k, v in run["values"].items() if v is not None}
        if vals:
            headlines[name] = {
                "recorded": run.get("results_from", today),
                "commit": commit,
                "values": vals,
            }
    record = {
        "generated": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": commit,
        "baseline_rev": args.rev,
        "threshold": args.threshold,
        "no_run": args.no_run,
        "runs": runs,
        "rows": rows,
        "headlines": dict(sorted(headlines.items())),
    }
    with open(os.path.join(RESULTS, f"{RUN_ALL}.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(RESULTS, f"{RUN_ALL}.md"), "w") as f:
        f.write(table)
    return 1 if regressed or failed else 0


def _better(b: Bench, label: str) -> str:
    """The good direction of `label`: its headline's, or its family's ("<label> (<member>)")."""
    for h in b.headlines:
        if label == h.label:
            return h.better
    for h in b.headlines:
        if label.startswith(h.label + " ("):
            return h.better
    return "–"


def markdown(rows, runs, args, commit, regressed, failed) -> str:
    mode = "compared without rerunning (--no-run)" if args.no_run else "quick runs"
    out = [
        f"# Benchmark headlines: {mode}, against {args.rev} ({commit})",
        "",
        "Each benchmark's quick mode (`python benchmarks/<name>.py --quick`), its headline "
        "ratios (against a peer measured in the same run), counts and slopes against the "
        f"committed ones; a change of more than {args.threshold:.0%} the wrong way is "
        "REGRESSED. `python benchmarks/run_all.py`; see its docstring.",
        "",
        "| benchmark | headline | better | committed | now | change | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['benchmark']} | {r['headline']} | {r['better']} | "
            f"{fmt(r['committed'])} | {fmt(r['now'])} | {fmt_change(r['change'])} | "
            f"{r['verdict']} |"
        )
    out += ["", "| benchmark | run | seconds | baseline from |", "|---|---|---|---|"]
    for name, run in runs.items():
        secs = " + ".join(f"{t:.0f}" for t in run["seconds"]) or "–"
        if args.no_run:
            state = (
                f"not rerun (results of {run.get('results_from', '?')})"
                if run["ok"]
                else f"not run: {run['error']}"
            )
        else:
            state = "ok" if run["ok"] else f"failed: {run['error']}"
        out.append(f"| {name} | {state} | {secs} | {run['baseline']} |")
    out += [
        "",
        f"Regressed: {len(regressed)} headline(s)"
        + (
            " (" + ", ".join(f"{r['benchmark']}: {r['headline']}" for r in regressed) + ")"
            if regressed
            else ""
        )
        + f"; failed: {', '.join(failed) if failed else 'none'}.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
