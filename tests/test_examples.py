"""The examples run as scripts and print real results (the README's demo command)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    """Run `examples/script` with command-line `args` (the long examples' tests pass smaller
    sizes than the README's runs: the same code, less compiling and training)."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
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
    for title in (
        "1. affine coupling layer",
        "2. leapfrog integrator",
        "3. jr.while_loop",
        "4. jr.check_reversible",
        "5. jr.reversible",
        "6. an error on purpose",
    ):
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


def test_tour_reversible_gradient(tour):
    assert _number(tour, "relative difference from jax.grad:") < 1e-12
    m = re.search(
        r"20,000 steps: jax.grad ([0-9,]+) B, jr.reversible ([0-9,]+) B, fully "
        r"reversible ([0-9,]+) B",
        tour,
    )
    assert m, tour
    grad, dflt, full = (int(m.group(k).replace(",", "")) for k in (1, 2, 3))
    assert dflt * 30 < grad and full * 100 < grad  # 2√T carries by default, flat opted in


def test_tour_error_on_purpose(tour):
    assert "NotInvertibleError (primitive 'max'" in tour
    assert "jaxrev.reverse cannot invert `max` at " in tour
    # the message names the user's file and line, and a way out
    assert re.search(r"cannot invert `max` at \S*tour\.py:\d+", tour), tour
    assert "Ways out" in tour


# ------------------------------------------------------------------ reversible gradients


@pytest.fixture(scope="module")
def revnet() -> str:
    return _run("revnet.py")


@pytest.mark.slow  # 37 s in a slow run; test_reversible checks reversible nets' gradients
def test_revnet_gradient_memory_and_training(revnet):
    # the tape-free gradient is jax.grad's, in a fraction of the temporary memory
    assert _number(revnet, "gradient vs jax.grad, relative error:") < 1e-9
    assert _number(revnet, "memory ratio (reversible / jax.grad):") < 0.5
    assert "reversible(net) stores nothing beyond its inputs and outputs." in revnet
    m = re.search(r"loss went from ([0-9.]+) to ([0-9.]+); held-out accuracy ([0-9.]+)", revnet)
    assert m, revnet
    assert float(m.group(2)) < 0.25 * float(m.group(1))
    assert float(m.group(3)) > 0.9


@pytest.fixture(scope="module")
def nbody() -> str:
    return _run("nbody.py")


def test_nbody_gradient_matches_jax_grad(nbody):
    for steps in (1000, 4000):
        assert _number(nbody, f"{steps} steps gradient vs jax.grad, relative error:") < 1e-9


def test_nbody_memory_flat_in_steps(nbody):
    mem = {
        int(s): (int(r), int(g))
        for s, r, g in re.findall(
            r"(\d+) steps temp memory: reversible (\d+) B, jax.grad (\d+) B", nbody
        )
    }
    assert set(mem) == {1000, 4000}, nbody
    assert mem[4000][0] == mem[1000][0]  # reversible: the same at 4x the steps
    assert mem[4000][1] > 3 * mem[1000][1]  # jax.grad: grows with the steps
    assert _number(nbody, "4000 steps memory ratio (reversible / jax.grad):") < 1e-3


@pytest.fixture(scope="module")
def realnvp_reversible() -> str:
    return _run("realnvp_reversible.py")


@pytest.mark.slow  # 30 s in a slow run; test_elements checks RealNVP couplings in-process
def test_realnvp_reversible_gradient_and_memory(realnvp_reversible):
    out = realnvp_reversible
    assert _number(out, "gradient vs jax.grad, relative error:") < 1e-9
    assert _number(out, "memory ratio (reversible / jax.grad):") < 0.5
    assert "reversible(flow) stores nothing beyond its inputs and outputs." in out


@pytest.mark.slow  # the same run as the test above
def test_realnvp_reversible_trains_and_samples_backwards(realnvp_reversible):
    out = realnvp_reversible
    m = re.search(r"held-out negative log-likelihood: ([0-9.]+) \(untrained flow: ([0-9.]+)\)", out)
    assert m, out
    assert float(m.group(1)) < float(m.group(2)) - 1.0
    assert _number(out, "flow(reverse(flow)(z)) round-trip max error:") < 1e-10
    assert _number(out, "reverse(flow)(flow(x)) round-trip max error:") < 1e-10


# ------------------------------------------------------------------ normalizing flows


@pytest.fixture(scope="module")
def flow() -> str:
    return _run("flow.py", "--steps", "250")


@pytest.mark.slow  # 44 s in a slow run; test_flows checks the sweep's log-dets in-process
def test_flow_logdet_is_the_sweep_and_exact(flow):
    # no dense Jacobian anywhere, and the log-det is slogdet(jacfwd) to rounding
    assert re.search(r"^logdet strategy: sweep$", flow, re.MULTILINE), flow
    assert _number(flow, "log-det vs dense slogdet, max abs error:") < 1e-9
    assert _number(flow, "round-trip max error:") < 1e-10


@pytest.mark.slow  # the same run as the test above
def test_flow_trains(flow):
    start = _number(flow, "initial held-out NLL:")
    end = _number(flow, "final held-out NLL:")
    bits = [float(b) for b in re.findall(r"= ([-0-9.]+) bits/dim", flow)]
    assert len(bits) == 2, flow
    assert end < start - 1.0  # nats per dimension
    assert bits[1] < bits[0] - 1.5
    assert "data (left) and samples from the flow (right):" in flow
    assert re.search(r"flow finished in [0-9.]+ s", flow)


# ------------------------------------------------------------------ Newton optimizers


@pytest.fixture(scope="module")
def newton() -> str:
    return _run("newton.py")


@pytest.mark.slow  # 32 s in a slow run; test_optim checks the same optimizers in-process
def test_newton_example(newton):
    m = re.search(r"steps to \|x - \(1, 1\)\| < 1e-8: (\d+); error ([0-9.e+-]+)", newton)
    assert m, newton
    assert int(m.group(1)) <= 30 and float(m.group(2)) < 1e-8
    m = re.search(r"loss ([0-9.e+-]+) after \d+ iterations \(converged\)", newton)
    assert m and float(m.group(1)) < 1e-10, newton
    assert _number(newton, "relative residual") < 1e-9
    m = re.search(
        r"4\. root .*\n\s+residual ([0-9.e+-]+) after \d+ Newton steps \(converged\)", newton
    )
    assert m and float(m.group(1)) < 1e-10, newton


@pytest.mark.slow  # 38 s in a slow run; test_optim tests the same functions in-process
def test_graph_embedding_example():
    out = _run("graph_embedding.py")
    assert _number(out, "reversible gradient vs jax.grad, relative error:") < 1e-12
    assert _number(out, "forward-over-reverse Hessian vs jax.hessian, relative error:") < 1e-12
    assert "smallest dimension with a zero-loss embedding: k = 5" in out
    assert re.search(r"k = 5: loss [0-9.e+-]+ after \d+ Newton steps; l2/l1 = 1\.41421356", out)


# ------------------------------------------------------------------ quantum circuit


@pytest.mark.slow  # 40 s in a slow run at 4 qubits; test_primitives tests the circuit
def test_quantum_circuit_example():
    out = _run("quantum_circuit.py", "--qubits", "4", "--layers", "3", "--steps", "100")
    assert _number(out, "gradient vs jax.grad, relative error:") < 1e-9
    line = (
        r"depth (\d+): gradient temp memory: reversible ([0-9,]+) B, jax.grad ([0-9,]+) B, "
        r"default reversible \(checkpoints\) ([0-9,]+) B"
    )
    mem = {
        int(d): [int(v.replace(",", "")) for v in bytes_] for d, *bytes_ in re.findall(line, out)
    }
    assert set(mem) == {10, 40}, out
    # fully reversible: flat; jax.grad: linear; the default's checkpoints: about sqrt(depth)
    assert mem[10][0] == mem[40][0] and mem[40][1] > 3 * mem[10][1], mem
    assert mem[40][2] < 0.5 * mem[40][1], mem
    m = re.search(
        r"energy went from ([-0-9.]+) to ([-0-9.]+) in \d+ Adam steps "
        r"\(exact ground state ([-0-9.]+)\)",
        out,
    )
    assert m, out
    assert float(m.group(2)) < float(m.group(1)) and float(m.group(2)) < float(m.group(3)) + 0.1
    assert _number(out, "reverse(circuit) round-trip max error:") < 1e-12


def test_fixed_point_example():
    out = _run("fixed_point.py")
    assert "fully reversible: DriftError" in out
    assert _number(out, "gradient vs jax.grad of the fori_loop form, max error:") < 1e-10
    m = re.search(r"training loss: ([0-9.]+) -> ([0-9.]+)", out)
    assert m and float(m.group(2)) < 0.1 * float(m.group(1)), out
    assert out.rstrip().endswith("fixed_point finished")


@pytest.mark.slow  # 53 s in a slow run; test_diffrax checks the same solves in-process
def test_neural_ode_example():
    out = _run("neural_ode.py", "--steps", "100")
    assert _number(out, "gradient vs DirectAdjoint, max relative error:") < 1e-10
    m = re.search(r"first batch ([0-9.]+), whole dataset after training ([0-9.]+)", out)
    assert m, out
    assert float(m.group(2)) < 0.1 * float(m.group(1))


@pytest.mark.slow  # 52 s in a slow run at 8 blocks; test_transformer checks its functions
def test_reversible_transformer_trains():
    out = _run("reversible_transformer.py", "--depth", "8", "--steps", "40")
    m = re.search(r"loss: ([0-9.]+) at step 1 -> ([0-9.]+)", out)
    assert m, out
    assert float(m.group(2)) < 0.7 * float(m.group(1)), out
    assert "per-device scratch" in out and "remat" in out


@pytest.mark.slow  # 100 s in a slow run; test_reversible_rk checks the adaptive solves
def test_continuous_flow_trains():
    out = _run("continuous_flow.py")
    m = re.search(
        r"gradient vs DirectAdjoint \(float32\): largest relative difference "
        r"([0-9.e+-]+)",
        out,
    )
    assert m and float(m.group(1)) < 1e-3, out
    m = re.search(r"NLL ([0-9.]+) -> ([0-9.]+)", out)
    assert m and float(m.group(2)) < float(m.group(1)) - 0.5, out
