#!/usr/bin/env bash
# One-call GPU check. On a machine with one NVIDIA GPU, torch, nvcc and ninja (no network needed): builds
# rope_ext for this GPU's architecture only, then runs the steps of STEPS below, each under a timeout and all
# within a time budget, and writes into OUTDIR their logs (STEP.log), JUnit XML, benchmark JSON / CSV / plots,
# machine.txt, and summary.md: one row per step (pass, fail or skipped, seconds), added as each step ends.
#
#   benchmarks/gpu_check.sh OUTDIR             the check (exit 0 when no step failed)
#   benchmarks/gpu_check.sh --dry-run OUTDIR   no GPU, nvcc or compute-sanitizer needed, a few seconds: prints
#                                              every command of the check and checks what they name (pytest
#                                              selections collect tests, rope-bench parses its options and
#                                              modes, the sanitizer script runs its cases on the CPU, this
#                                              script's syntax); exit 1 when something is missing
#
# Environment: PYTHON (default python3); GPU_CHECK_BUDGET_S (default 480): seconds for the whole run, build
# included, after which the steps not started are reported skipped and running ones get no more than is left;
# GPU_CHECK_PARALLEL=0 runs the correctness steps one after the other (by default they run side by side when
# the GPU's compute mode is Default; the benchmarks always run alone); MAX_JOBS (build jobs, default 8).
# compute-sanitizer is looked up on PATH, then in $CUDA_HOME/bin; without it the sanitizer steps are skipped.
set -uo pipefail
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUTDIR=${1:?usage: benchmarks/gpu_check.sh [--dry-run] OUTDIR}
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
cd "$(dirname "$0")/.."
SCRIPT=benchmarks/gpu_check.sh
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if [ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ]; then export CUDA_HOME=/usr/local/cuda; fi
SANITIZER=$(command -v compute-sanitizer || true)
if [ -z "$SANITIZER" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ]; then
  SANITIZER=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
fi
T0=$(date +%s)
DEADLINE=$((T0 + ${GPU_CHECK_BUDGET_S:-480}))
if [ $DRY -eq 1 ]; then ARCH=CAPABILITY; else
  GPU=$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())
print(torch.cuda.get_device_name(), '- torch', torch.__version__, 'CUDA', torch.version.cuda)") || {
    echo "no CUDA device visible to torch" | tee "$OUTDIR/summary.md"; exit 1; }
  ARCH=$(head -n 1 <<< "$GPU") GPU=$(tail -n 1 <<< "$GPU")
fi

# ---------------------------------------------------------------------------------------------------------
# The steps, in order: NAME TIMEOUT_S KIND PHASE ARGS... The real run and the dry run read this one list.
#   kind build:     ARGS is the command;                       dry run: setup.py exists
#   kind pytest:    ARGS is the command (VAR=value first ok);  real run adds --junitxml=OUTDIR/NAME.xml;
#                                                              dry run collects (pytest fails on 0 tests)
#   kind sanitizer: ARGS is the compute-sanitizer tool;        dry run: a tool of compute-sanitizer's, and
#                                                              the script runs its cases on the CPU
#   kind bench:     ARGS are rope-bench's options;             dry run: rope-bench parses them
# Phases: "first" (the build; the run stops when it fails), then the "side" steps side by side (correctness
# only), then the "alone" steps (the benchmarks) one at a time, with the GPU to themselves. The side steps'
# timeouts are cut so that the alone steps keep theirs.
STEP_NAMES=() STEP_TIMEOUTS=() STEP_KINDS=() STEP_PHASES=() STEP_ARGS=()
step() {
  STEP_NAMES+=("$1") STEP_TIMEOUTS+=("$2") STEP_KINDS+=("$3") STEP_PHASES+=("$4")
  shift 4
  STEP_ARGS+=("$(printf '%q ' "$@")")
}
SANITIZE_SCRIPT=benchmarks/gpu_sanitize.py
BENCH_COMMON=(--device cuda --preset llama-3-8b --rounds 3 --min-run-time 0.01 --no-progress)

step build 300 build first ROPE_EXT_TESTING=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-8}" \
  "$PY" setup.py -q build_ext --inplace
# Every CUDA test (each test whose id names cuda or gpu): the cuda backends of the test matrices,
# tests/test_gpu.py, tests/test_serving_gpu.py (CUDA-graph capture and replay of every serving op, position
# checks off and on).
step tests 240 pytest side "$PY" -m pytest -q -p no:cacheprovider tests -k "cuda or gpu" \
  --ignore=tests/test_gpu_check.py
step tests-dist 150 pytest side ROPE_EXT_DIST_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider \
  tests/test_dtensor.py
for tool in memcheck racecheck synccheck initcheck; do
  step "sanitize-$tool" 180 sanitizer side "$tool"
done
step bench 120 bench alone "${BENCH_COMMON[@]}" --dtype bf16,fp32 --pairing both --tokens 4096,65536 \
  --decode-tokens 1,64 --mode inplace,out,backward \
  --json "$OUTDIR/bench.json" --csv "$OUTDIR/bench.csv" --plot "$OUTDIR/bench.png"
step bench-serving 60 bench alone "${BENCH_COMMON[@]}" --dtype bf16 --pairing model --tokens 4096 \
  --decode-tokens 1,64 --mode cache,cache-fp8,qknorm,rerotate,rerotate-fp8 \
  --json "$OUTDIR/bench-serving.json" --csv "$OUTDIR/bench-serving.csv"
step bench-mla 40 bench alone "${BENCH_COMMON[@]/llama-3-8b/deepseek-v3}" --dtype bf16 --pairing model \
  --tokens 4096 --decode-tokens 1,64 --mode inplace,mla,mla-fp8 \
  --json "$OUTDIR/bench-mla.json" --csv "$OUTDIR/bench-mla.csv"
# Vision and diffusion shapes: N-axis positions with a table and without one (table-free), against the
# model's own eager RoPE code.
step bench-vision 40 bench alone "${BENCH_COMMON[@]/llama-3-8b/flux,wan2.1-1.3b,qwen2-vl-vision}" \
  --dtype bf16,fp32 --tokens model --decode-tokens '' --mode inplace,out \
  --providers "rope_ext,rope_ext table-free,model-eager" \
  --json "$OUTDIR/bench-vision.json" --csv "$OUTDIR/bench-vision.csv"

# ---------------------------------------------------------------------------------------------------------
SANITIZER_TOOLS=" memcheck racecheck synccheck initcheck "
BENCH_PARSE='import sys
from rope_ext.bench.cli import config_from_args, parse_args
c = config_from_args(parse_args(sys.argv[1:]))
print("rope-bench options parse; modes:", ",".join(c.modes))'

command_of() {  # the real command of step $1, into CMD
  local i=$1
  eval "set -- ${STEP_ARGS[$i]}"
  case ${STEP_KINDS[$i]} in
    build) CMD=(env "$@") ;;
    pytest) CMD=(env "$@" --junitxml="$OUTDIR/${STEP_NAMES[$i]}.xml") ;;
    sanitizer) CMD=(env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "${SANITIZER:-compute-sanitizer}" --tool "$1"
                    --error-exitcode 1 "$PY" "$SANITIZE_SCRIPT") ;;
    bench) CMD=("$PY" -m rope_ext.bench "$@") ;;
  esac
}

check_of() {  # the dry run's check of step $1, into CMD (empty: nothing to run)
  local i=$1
  eval "set -- ${STEP_ARGS[$i]}"
  CMD=()
  case ${STEP_KINDS[$i]} in
    build) [ -f setup.py ] || { echo "setup.py is missing"; return 1; }; echo "setup.py is there" ;;
    pytest) CMD=(env "$@" --collect-only) ;;
    sanitizer)
      case $SANITIZER_TOOLS in *" $1 "*) ;; *) echo "unknown compute-sanitizer tool $1"; return 1 ;; esac
      [ -f "$SANITIZE_SCRIPT" ] || { echo "$SANITIZE_SCRIPT is missing"; return 1; }
      echo "tool $1, compute-sanitizer ${SANITIZER:-not found here: the step would be skipped}" ;;
    bench) CMD=("$PY" -c "$BENCH_PARSE" "$@") ;;
  esac
}

SUMMARY=$OUTDIR/summary.md
row() {  # NAME RESULT SECONDS NOTE: one row of summary.md
  printf '| %s | %s | %s | %s |\n' "$1" "$2" "$3" "$4" >> "$SUMMARY"
}

run_step() {  # step $1, its timeout cut to the budget left minus $2 seconds; its row in summary.md
  local i=$1 reserve=${2:-0} name=${STEP_NAMES[$1]} left limit start rc log
  log=$OUTDIR/$name.log
  left=$((DEADLINE - $(date +%s) - reserve))
  limit=${STEP_TIMEOUTS[$i]}
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "${STEP_KINDS[$i]}" = sanitizer ] && [ -z "$SANITIZER" ]; then
    echo "compute-sanitizer not found (PATH, \$CUDA_HOME/bin)" > "$log"
    row "$name" skipped 0 "compute-sanitizer not found"
    return 0
  fi
  if [ "$limit" -lt 20 ]; then
    echo "not run: the time budget (GPU_CHECK_BUDGET_S) is spent" > "$log"
    row "$name" skipped 0 "time budget spent"
    return 0
  fi
  command_of "$i"
  start=$(date +%s)
  { printf '$ '; printf '%q ' "${CMD[@]}"; printf '\n'; } > "$log"
  timeout -k 10 "$limit" "${CMD[@]}" >> "$log" 2>&1
  rc=$?
  if [ $rc -eq 0 ]; then row "$name" pass $(($(date +%s) - start)) "$name.log"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    row "$name" fail $(($(date +%s) - start)) "timed out after $limit s, $name.log"
  else row "$name" fail $(($(date +%s) - start)) "exit $rc, $name.log"; fi
  return $rc
}

show_log() {
  echo "== ${STEP_NAMES[$1]}: the end of ${STEP_NAMES[$1]}.log"
  tail -n "${2:-20}" "$OUTDIR/${STEP_NAMES[$1]}.log"
}

# ---------------------------------------------------------------------------------------------------------
if [ $DRY -eq 1 ]; then
  echo "# gpu_check dry run ($(date -u +%FT%TZ)); compute-sanitizer: ${SANITIZER:-not found (its steps would be skipped)}" \
    > "$SUMMARY"
  printf '| step | result | seconds | note |\n|---|---|---|---|\n' >> "$SUMMARY"
  status=0
  bash -n "$SCRIPT" || { echo "bash -n $SCRIPT fails"; status=1; }
  pids=()
  for i in "${!STEP_NAMES[@]}"; do
    name=${STEP_NAMES[$i]}
    command_of "$i"
    echo "== step $name (${STEP_KINDS[$i]}, ${STEP_PHASES[$i]}, timeout ${STEP_TIMEOUTS[$i]} s)"
    printf '  $ '; printf '%q ' "${CMD[@]}"; printf '\n'
    if ! check_of "$i" > "$OUTDIR/dry-$name.log" 2>&1; then
      pids+=(fail)
    elif [ ${#CMD[@]} -eq 0 ]; then
      pids+=(ok)
    else
      printf '  check $ '; printf '%q ' "${CMD[@]}"; printf '\n'
      ( "${CMD[@]}" > "$OUTDIR/dry-$name.log" 2>&1 ) &
      pids+=($!)
    fi
  done
  echo "== the sanitizer script's cases on the CPU"
  printf '  check $ %q %q --device cpu\n' "$PY" "$SANITIZE_SCRIPT"
  ( "$PY" "$SANITIZE_SCRIPT" --device cpu > "$OUTDIR/dry-sanitize-script.log" 2>&1 ) &
  script_pid=$!
  for i in "${!STEP_NAMES[@]}"; do
    name=${STEP_NAMES[$i]} p=${pids[$i]}
    if [ "$p" = fail ]; then rc=1; elif [ "$p" = ok ]; then rc=0; else wait "$p"; rc=$?; fi
    if [ "${STEP_KINDS[$i]}" = pytest ] && [ $rc -eq 0 ]; then
      note="collects $(grep -c '::' "$OUTDIR/dry-$name.log") tests (dry-$name.log)"
      grep '::' "$OUTDIR/dry-$name.log" | cut -d: -f1 | uniq -c | sed 's/^ */    /'
    else
      note=$(tail -n 1 "$OUTDIR/dry-$name.log" 2>/dev/null)
    fi
    if [ $rc -eq 0 ]; then result=ok; else result=MISSING; status=1; fi
    echo "$result $name: $note"
    [ $rc -eq 0 ] || tail -n 15 "$OUTDIR/dry-$name.log"
    row "$name" "$result" - "$note"
  done
  wait "$script_pid"; rc=$?
  note=$(tail -n 1 "$OUTDIR/dry-sanitize-script.log")
  if [ $rc -eq 0 ]; then result=ok; else result=MISSING; status=1; tail -n 15 "$OUTDIR/dry-sanitize-script.log"; fi
  echo "$result sanitizer script: $note"
  row sanitize-script "$result" - "$note"
  echo "dry run: $([ $status -eq 0 ] && echo "every step's command is in place" || echo "something is missing") ($(($(date +%s) - T0)) s)"
  exit $status
fi

# ---------------------------------------------------------------------------------------------------------
{ nvidia-smi || true; echo "$GPU"; echo "compute-sanitizer: ${SANITIZER:-not found}"
  [ -n "$SANITIZER" ] && "$SANITIZER" --version; } > "$OUTDIR/machine.txt" 2>&1
cat "$OUTDIR/machine.txt"
mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -n 1)
PARALLEL=${GPU_CHECK_PARALLEL:-1}
[ "$mode" = Default ] || PARALLEL=0
{ echo "# gpu_check $(date -u +%FT%TZ): $GPU"
  echo "budget ${GPU_CHECK_BUDGET_S:-480} s; correctness steps side by side: $([ "$PARALLEL" = 1 ] && echo yes || echo no)"
  echo
  printf '| step | result | seconds | note |\n|---|---|---|---|\n'; } > "$SUMMARY"

reserve=0  # the alone steps' time, kept from the side steps (at most a third of what the build leaves)
for i in "${!STEP_NAMES[@]}"; do
  [ "${STEP_PHASES[$i]}" = alone ] && reserve=$((reserve + STEP_TIMEOUTS[i]))
done
for i in "${!STEP_NAMES[@]}"; do
  [ "${STEP_PHASES[$i]}" = first ] || continue
  echo "== ${STEP_NAMES[$i]} (TORCH_CUDA_ARCH_LIST=$ARCH)"
  if ! run_step "$i"; then
    show_log "$i" 50
    for j in "${!STEP_NAMES[@]}"; do
      [ "${STEP_PHASES[$j]}" = first ] || row "${STEP_NAMES[$j]}" skipped 0 "the build failed"
    done
    echo "build failed"; exit 1
  fi
done
left=$((DEADLINE - $(date +%s)))
[ "$reserve" -gt $((left / 3)) ] && reserve=$((left / 3))  # a slow build: the correctness steps come first
echo "== correctness steps$([ "$PARALLEL" = 1 ] && echo ", side by side")"
pids=()
for i in "${!STEP_NAMES[@]}"; do
  [ "${STEP_PHASES[$i]}" = side ] || continue
  echo "   ${STEP_NAMES[$i]}"
  if [ "$PARALLEL" = 1 ]; then run_step "$i" "$reserve" & pids+=($!); else run_step "$i" "$reserve"; fi
done
for p in "${pids[@]}"; do wait "$p"; done
for i in "${!STEP_NAMES[@]}"; do [ "${STEP_PHASES[$i]}" = side ] && show_log "$i"; done
reserve=0
for i in "${!STEP_NAMES[@]}"; do
  [ "${STEP_PHASES[$i]}" = alone ] && reserve=$((reserve + STEP_TIMEOUTS[i]))
done
for i in "${!STEP_NAMES[@]}"; do
  [ "${STEP_PHASES[$i]}" = alone ] || continue
  reserve=$((reserve - STEP_TIMEOUTS[i]))  # what the next ones keep, as far as the budget allows
  left=$((DEADLINE - $(date +%s)))
  [ "$reserve" -gt $((left / 3)) ] && reserve=$((left / 3))
  echo "== ${STEP_NAMES[$i]}"
  run_step "$i" "$reserve"
  show_log "$i" 30
done
failed=$(grep -c '^| [^|]* | fail |' "$SUMMARY")
echo "$([ "$failed" -eq 0 ] && echo "every step passed or was skipped" || echo "$failed step(s) failed") in $(($(date +%s) - T0)) s" \
  >> "$SUMMARY"
cat "$SUMMARY"
[ "$failed" -eq 0 ]
