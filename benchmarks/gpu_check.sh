#!/usr/bin/env bash
# One-call GPU check. On a machine with one NVIDIA GPU, torch, nvcc and ninja
# (no network needed): builds rope_ext for this GPU's architecture only, runs
# the GPU tests and the GPU benchmark, and writes logs, a JSON of results and
# a plot into OUTDIR. Usage: benchmarks/gpu_check.sh OUTDIR
set -uo pipefail
OUTDIR=${1:?usage: benchmarks/gpu_check.sh OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
status=0

{ nvidia-smi || true; "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"; } \
  > "$OUTDIR/machine.txt" 2>&1
cat "$OUTDIR/machine.txt"

arch=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
echo "== build (TORCH_CUDA_ARCH_LIST=$arch)"
start=$(date +%s)
ROPE_EXT_TESTING=1 TORCH_CUDA_ARCH_LIST="$arch" MAX_JOBS=${MAX_JOBS:-8} "$PY" setup.py -q build_ext --inplace > "$OUTDIR/build.log" 2>&1 \
  || { tail -50 "$OUTDIR/build.log"; echo "build failed"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"

echo "== GPU tests"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests -k "cuda or gpu" --junitxml="$OUTDIR/tests.xml" \
  2>&1 | tee "$OUTDIR/tests.log" | tail -25
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== distributed tests on CUDA tensors (NCCL with a GPU per rank, else gloo)"
ROPE_EXT_DIST_DEVICE=cuda timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_dtensor.py \
  --junitxml="$OUTDIR/tests-dist.xml" 2>&1 | tee "$OUTDIR/tests-dist.log" | tail -15
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU benchmark"
timeout 240 "$PY" -m rope_ext.bench --device cuda --preset llama-3-8b --dtype bf16,fp16,fp32 --pairing both \
  --tokens 1024,4096,16384,65536 --decode-tokens 1,4,16,64 --mode inplace,out,backward --rounds 5 \
  --min-run-time 0.02 --no-progress \
  --json "$OUTDIR/bench.json" --csv "$OUTDIR/bench.csv" --plot "$OUTDIR/bench.png" \
  2>&1 | tee "$OUTDIR/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== GPU benchmark: serving ops (RoPE + KV-cache write, fp8 cache, QK-RMSNorm + RoPE)"
timeout 180 "$PY" -m rope_ext.bench --device cuda --preset llama-3-8b --dtype bf16 --pairing model \
  --tokens 4096,16384 --decode-tokens 1,16,64 --mode cache,cache-fp8,qknorm --rounds 5 \
  --min-run-time 0.02 --no-progress \
  --json "$OUTDIR/bench-serving.json" --csv "$OUTDIR/bench-serving.csv" \
  2>&1 | tee "$OUTDIR/bench-serving.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
exit $status
