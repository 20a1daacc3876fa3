#!/usr/bin/env bash
# The benchmarks at accelerator sizes, on one GPU, in at most about 8 minutes; results in
# benchmarks/results/gpu/. Run from the repository root, with the project installed:
#     bash benchmarks/gpu.sh
# Each benchmark has its own time limit, so one that runs long cannot take the others' time;
# the summary at the end says which finished.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export JAXREV_RESULTS="$PWD/benchmarks/results/gpu"
mkdir -p "$JAXREV_RESULTS"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$JAXREV_RESULTS/device.txt" 2>&1 || true
$PY -c "import jax; print(jax.__version__, jax.devices())" >> "$JAXREV_RESULTS/device.txt" 2>&1

run() {   # name, seconds, command...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout --signal=INT "$limit" "$@" > "$JAXREV_RESULTS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit s)" | tee -a "$JAXREV_RESULTS/summary.txt"
}

: > "$JAXREV_RESULTS/summary.txt"
# transformer depth 12, 24, 48 at d_model 1024 (sequence 512, batch 8): memory and step time
run transformer 170 $PY benchmarks/transformer.py --gpu
# quantum circuits, 24 to 28 qubits (complex128 state of 2^28 amplitudes: 4 GiB)
run quantum 120 $PY benchmarks/quantum.py --gpu
# the deep coupled scan (2 x 20000 float64 state, up to 10^4 steps)
run reversible_memory 90 $PY benchmarks/reversible_memory.py --only memory
# the neural ODE, ReversibleHeun with ReversibleAdjoint against diffrax's adjoints
run neural_ode 90 $PY benchmarks/neural_ode.py
cat "$JAXREV_RESULTS/summary.txt"
