"""The examples run as scripts and print real results (the README's demo command)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str) -> str:
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _number(out: str, label: str) -> float:
    m = re.search(re.escape(label) + r"\s*([-+0-9.eE]+|nan|inf)", out)
    assert m, f"{label!r} not printed:\n{out}"
    return float(m.group(1))


@pytest.fixture(scope="module")
def tour() -> str:
    return _run("tour.py")


def test_tour_runs_to_the_end(tour):
    for title in ("1. affine coupling layer", "2. leapfrog integrator", "3. jr.while_loop",
                  "4. jr.check_reversible", "5. an error on purpose"):
        assert title in tour
    assert tour.rstrip().endswith("tour finished")


def test_tour_coupling_round_trip(tour):
    assert _number(tour, "coupling round-trip max error:") < 1e-12
    assert _number(tour, "two-layer flow round-trip max error:") < 1e-12


def test_tour_leapfrog_backwards(tour):
    # the trajectory really moved, and running it backwards lands on the start
    assert _number(tour, "final state moved by:") > 0.1
    assert _number(tour, "recovered initial conditions max error:") < 1e-9
    assert _number(tour, "under jax.jit, max error:") < 1e-9
    m = re.search(r"energy: initial ([0-9.]+), final ([0-9.]+), recovered ([0-9.]+)", tour)
    assert m, tour
    assert m.group(1) == m.group(3)


def test_tour_while_loop_backwards(tour):
    assert "forward: 3.0 doubled 6 times -> 192.0" in tour
    assert "backward: counter 0, value 3.0" in tour


def test_tour_check_reversible_report(tour):
    assert _number(tour, "round-trip relative error:") < 1e-12


def test_tour_error_on_purpose(tour):
    assert "NotInvertibleError (primitive 'max'" in tour
    assert "jaxrev.reverse cannot invert `max` at " in tour
    # the message names the user's file and line, and a way out
    assert re.search(r"cannot invert `max` at \S*tour\.py:\d+", tour), tour
    assert "Ways out" in tour
