"""Write `tests/slow_cases.txt`: the default tier's costliest tests, which the slow tier runs.

The default tier (`python -m pytest -q`) is meant to take about ten minutes on a quiet 2-core
machine; `.ci/run` runs it twice (Python 3.11 and 3.12) and the slow tier once. The tests
marked ``slow`` in their files are the long matrices and subprocess checks by design; this
list moves to the slow tier, by measurement, every other test that took more than
THRESHOLD seconds in a default run, except those in KEEP (the only default-tier test of a
library or a documented path). `tests/conftest.py` marks the listed tests ``slow``.

Usage, from the repository root::

    .venv/bin/python -m pytest -q --junitxml=/tmp/default.xml   # the default tier
    .venv/bin/python tools/slow_cases.py /tmp/default.xml

The entries already listed are kept (they no longer run in the default tier, so the run
does not time them) and the new ones added; ``--fresh`` starts from an empty list (then run
the default tier with ``JAXREV_SLOW_CASES=0``, which ignores the list).
"""

from __future__ import annotations

import argparse
import os
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIST = os.path.join(ROOT, "tests", "slow_cases.txt")
THRESHOLD = 4.0

KEEP = {
    # the README's demo script, end to end
    "tests/test_examples.py::test_tour_runs_to_the_end": "the README's demo",
    # the default tier's only diffrax.diffeqsolve through jr.reversible
    "tests/test_diffrax.py::test_reversible_over_diffeqsolve": "diffrax",
    # random programs and property tests: a few examples each, every run
    "tests/test_grammar.py::test_grammar": "random programs",
    "tests/test_properties.py::test_inverse_jvp_and_vjp_match_dense_solve": "hypothesis",
    "tests/test_properties.py::test_reversible_gradients_match_jax_grad": "hypothesis",
    "tests/test_properties.py::test_round_trip": "hypothesis",
    "tests/test_properties.py::test_one_hot_splines_invert_or_say_so": "hypothesis",
    # the forward log-det's planning walk (solves nothing), the only test of it
    "tests/test_tracing_cost.py::test_the_forward_log_dets_plan_solves_nothing": "plan",
    # one shard_map gradient on 4 devices under the default dial
    "tests/test_shard_map.py::test_reversible_gradient_inside_shard_map_equals_jax_grad"
    "[fori-auto-4]": "shard_map",
    # second order through jr.reversible (forward-over-reverse)
    "tests/test_reversible.py::TestComposition::test_hessians": "second order",
    # one adaptive diffrax solve through ReversibleAdjoint
    "tests/test_reversible_rk.py::test_adaptive_steps_equal_direct_adjoint[t0-ts-t1]": "adaptive",
    # every public transform on NaN/inf inputs (a property test, a few examples each run)
    "tests/test_edge_inputs.py::"
    "test_every_transform_on_edge_inputs_is_right_or_names_its_refusal": "edge inputs",
    # what reversible(..., report=) says of a call
    "tests/test_drift_repair.py::test_report_says_what_each_call_repaired": "repair report",
    # tensor-parallel blocks inside shard_map under the default dial
    "tests/test_shard_map.py::test_tensor_parallel_blocks_inside_shard_map[auto]": (
        "tensor parallel"
    ),
}

HEADER = """\
# The default tier's costliest tests (over {threshold:g} s in a default run on a quiet 2-core
# machine), run by the slow tier only: tests/conftest.py marks them slow. Written by
# tools/slow_cases.py from a measured run; its KEEP list names the costly tests the
# default tier keeps. One pytest node id per line, then " # " and its measured seconds.
"""


def node_id(case: ET.Element) -> str | None:
    """A junit test case's pytest node id (None: a doctest in the package)."""
    parts = case.get("classname", "").split(".")
    if parts[0] != "tests":
        return None
    return "::".join(["/".join(parts[:2]) + ".py", *parts[2:], case.get("name", "")])


def read_list(path: str) -> dict[str, str]:
    """The listed node ids, each with the rest of its line (its measured seconds)."""
    entries = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    # an id may hold spaces ("[jit inside]"): the seconds follow " # "
                    nid, _, seconds = line.partition(" # ")
                    entries[nid.strip()] = seconds.strip()
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", help="junit XML of a default-tier run")
    parser.add_argument("--threshold", type=float, default=THRESHOLD)
    parser.add_argument("--fresh", action="store_true", help="drop the current entries")
    args = parser.parse_args()
    entries = {} if args.fresh else read_list(LIST)
    for case in ET.parse(args.junit).getroot().iter("testcase"):
        nid, seconds = node_id(case), float(case.get("time", 0.0))
        if nid and seconds > args.threshold and nid not in KEEP:
            entries[nid] = f"{seconds:.1f} s"
    with open(LIST, "w") as f:
        f.write(HEADER.format(threshold=args.threshold))
        for nid in sorted(entries):
            f.write(f"{nid} # {entries[nid]}\n")
    print(f"{len(entries)} tests listed in {os.path.relpath(LIST, ROOT)}")


if __name__ == "__main__":
    main()
