#!/usr/bin/env bash
# The GPU path's one device script: install, flashinfer vs the torch reference, CUDA-graph decode
# vs eager, then gpu_bench.py, everything written under $OUT, in well under 8 minutes on a bare
# H200 (python3 with torch and nvcc, no network).
#
#   bash examples/benchmarks/gpu_check.sh --prepare   # here (PyPI reachable): wheels + W1 prompts
#   bash examples/benchmarks/gpu_check.sh --dry-run   # here: every step that needs no CUDA
#   bash examples/benchmarks/gpu_check.sh             # there, with .gpu carried along
#
# .gpu/ is ignored by git (.git/info/exclude): wheels/ holds what the machine's image lacks
# (KINDS.md lists its packages), w1_first_turns.json W1's tokenized prompts, and
# flashinfer_jit.tgz, when present, kernels an earlier run built (restored, not rebuilt).
set -uo pipefail
cd "$(dirname "$0")/../.."
GPU_DIR=.gpu
WHEELS=(
  flashinfer-python==0.6.18.post1 apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.9 gguf==0.19.0
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
)
MODE=${1:-run}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
log() { echo "[gpu_check $(date +%T)] $*" | tee -a "$OUT/log.txt"; }

prepare() {
  mkdir -p "$GPU_DIR/wheels"
  local platforms=()
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
  done
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d "$GPU_DIR/wheels" "${WHEELS[@]}" || return 1
  .venv/bin/python examples/benchmarks/gpu_bench.py --write-w1-ids "$GPU_DIR/w1_first_turns.json"
}

check_carried() {  # one wheel per package, and the prompts: a missing file costs a device run
  local missing=0
  for spec in "${WHEELS[@]}"; do
    local name=${spec%%==*} version=${spec##*==}
    local found
    found=$(ls "$GPU_DIR/wheels/${name//-/_}-${version}-"*.whl 2>/dev/null | wc -l)
    [[ $found == 1 ]] || { log "wheel $spec: $found files"; missing=1; }
  done
  [[ -f $GPU_DIR/w1_first_turns.json ]] || { log "no $GPU_DIR/w1_first_turns.json"; missing=1; }
  [[ $(ls "$GPU_DIR"/wheels/*.whl | wc -l) == "${#WHEELS[@]}" ]] || { log "extra wheels"; missing=1; }
  return $missing
}

case $MODE in
  --prepare) prepare; exit $? ;;
  --dry-run)
    check_carried || exit 1
    PY=${PYTHON:-.venv/bin/python}
    "$PY" -m pytest -q -p no:cacheprovider tests/test_cuda_graph.py tests/test_gpu.py \
      | tee "$OUT/test_gpu.txt" || exit 1
    "$PY" examples/benchmarks/gpu_bench.py --dry-run --w1-ids "$GPU_DIR/w1_first_turns.json" \
      --out "$OUT/gpu_bench.md" || exit 1
    log "dry run passed (nothing ran on a GPU)"
    exit 0 ;;
  run) ;;
  *) echo "usage: $0 [--prepare | --dry-run]" >&2; exit 2 ;;
esac

check_carried || exit 1
start=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv \
  | tee -a "$OUT/log.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  "$GPU_DIR"/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
  "transformers", transformers.__version__)' | tee -a "$OUT/log.txt"
if [[ -f $GPU_DIR/flashinfer_jit.tgz ]]; then  # as flashinfer's ahead-of-time kernels
  mkdir -p /tmp/site/flashinfer/data/aot && tar xzf "$GPU_DIR/flashinfer_jit.tgz" -C /tmp/site/flashinfer/data/aot
  log "restored flashinfer kernels built by an earlier run: $(ls /tmp/site/flashinfer/data/aot | tr '\n' ' ')"
fi

log "building flashinfer kernels (head_dim 128, bf16)"
timeout 300 python3 examples/benchmarks/gpu_bench.py --warm-jit 2>&1 | tail -20 | tee -a "$OUT/log.txt"
status=${PIPESTATUS[0]}
log "kernels: exit $status after $((SECONDS - start)) s"
# bring the built kernels back as cached_ops/NAME/NAME.so (a rerun restores them, no compile)
jit_dir=$(ls -d /tmp/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
[[ -n $jit_dir ]] && (cd "$jit_dir" && ls */*.so | tar czf "$OUT/flashinfer_jit.tgz" -T -)
[[ $status == 0 ]] || exit 1

log "tests/test_gpu.py on the GPU"
timeout 240 python3 -m pytest -p no:cacheprovider -m gpu -v -rA tests/test_gpu.py 2>&1 \
  | tee "$OUT/test_gpu.txt" | tail -30
tests=${PIPESTATUS[0]}
log "tests: exit $tests after $((SECONDS - start)) s"

log "gpu_bench.py"
timeout 240 python3 examples/benchmarks/gpu_bench.py --w1-ids "$GPU_DIR/w1_first_turns.json" \
  --out "$OUT/gpu_bench.md" 2>&1 | tee "$OUT/gpu_bench.log" | tail -40
bench=${PIPESTATUS[0]}
log "bench: exit $bench after $((SECONDS - start)) s"
exit $(( tests != 0 || bench != 0 ))
