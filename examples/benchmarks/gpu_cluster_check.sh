#!/usr/bin/env bash
# Issue 17's GPU part on one device run: Ray replicas as CUDA engines, two sharing the GPU
# (gpu_cluster_check.py), results under $OUT. The device image has no Ray, and Ray 2.60's wheel
# (79 MB) is over the 64 MiB a run may carry: --prepare keeps it without its Java jar (32 MB)
# and dashboard web client (2.5 MB), which a Python driver never loads (about 45 MB).
#
#   bash examples/benchmarks/gpu_cluster_check.sh --prepare   # here (PyPI reachable)
#   bash examples/benchmarks/gpu_cluster_check.sh --dry-run   # here: the trimmed Ray runs
#   bash examples/benchmarks/gpu_cluster_check.sh             # there, with .gpu-cluster carried
#
# .gpu-cluster/ is ignored by git (.gitignore), so `carry` can take it.
set -uo pipefail
cd "$(dirname "$0")/../.."
DIR=.gpu-cluster
RAY_VERSION=2.60.0
WHEELS=(  # what the image lacks (KINDS.md), for Ray and for the engine
  jsonschema==4.25.1 jsonschema-specifications==2025.9.1 referencing==0.36.2 rpds-py==0.27.1
  xgrammar==0.2.9 gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 typing-extensions==4.16.0
)
MODE=${1:-run}
OUT=${OUT:-/tmp/gpu_cluster_check}
mkdir -p "$OUT"
log() { echo "[gpu_cluster_check $(date +%T)] $*" | tee -a "$OUT/log.txt"; }

download() {  # $1: python version (3.12 there), $2: destination, then the specs
  local version=$1 dest=$2 platforms=()
  shift 2
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
    platforms+=(--platform "${p}_x86_64")
  done
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "$version" \
    --implementation cp "${platforms[@]}" -d "$dest" "$@"
}

trim_ray() {  # $1: a Ray wheel, $2: the zip to write (the wheel's tree minus jar and web client)
  local tree out
  tree=$(mktemp -d)
  out=$(realpath -m "$2")
  python3 -m zipfile -e "$1" "$tree" || return 1
  rm -rf "$tree/ray/jars" "$tree/ray/dashboard/client"
  rm -f "$out"
  (cd "$tree" && python3 -m zipfile -c "$out" ray ray-*.dist-info) || return 1
  rm -rf "$tree"
}

case $MODE in
  --prepare)
    mkdir -p "$DIR/wheels" "$DIR/ray"
    download 3.12 "$DIR/wheels" "${WHEELS[@]}" || exit 1
    download 3.12 "$DIR/ray" "ray==$RAY_VERSION" || exit 1
    trim_ray "$DIR"/ray/ray-*.whl "$DIR/ray_trimmed.zip" || exit 1
    rm -rf "$DIR/ray"
    du -sh "$DIR"
    exit 0 ;;
  --dry-run)  # the same trimming of this machine's (3.11) wheel, then the checks on CPU
    du -sh "$DIR" | tee -a "$OUT/log.txt"
    [[ $(du -sm "$DIR" | cut -f1) -lt 60 ]] || { log "$DIR is over the carry limit"; exit 1; }
    tmp=$(mktemp -d)
    .venv/bin/python -m pip download --quiet --no-deps -d "$tmp" "ray==$RAY_VERSION" || exit 1
    trim_ray "$tmp"/ray-*.whl "$tmp/ray.zip" || exit 1
    python3 -m zipfile -e "$tmp/ray.zip" "$tmp/site" || exit 1
    chmod -R u+x "$tmp/site/ray/core/src"
    PYTHONPATH=$tmp/site:$PWD .venv/bin/python -c 'import ray; assert "/site/" in ray.__file__' \
      || { log "the trimmed Ray is not the one imported"; exit 1; }
    PYTHONPATH=$tmp/site:$PWD timeout 600 .venv/bin/python \
      examples/benchmarks/gpu_cluster_check.py --device cpu --out "$OUT/cluster_cpu.md"
    status=$?
    rm -rf "$tmp"
    log "dry run: exit $status (nothing ran on a GPU)"
    exit $status ;;
  run) ;;
  *) echo "usage: $0 [--prepare | --dry-run]" >&2; exit 2 ;;
esac

start=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$OUT/log.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  "$DIR"/wheels/*.whl || exit 1
python3 -m zipfile -e "$DIR/ray_trimmed.zip" /tmp/site || exit 1
chmod -R u+x /tmp/site/ray/core/src  # zip keeps no modes: the raylet and GCS binaries
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 RAY_AUTH_MODE=disabled
log "installed after $((SECONDS - start)) s"
timeout 420 python3 examples/benchmarks/gpu_cluster_check.py --device cuda \
  --out "$OUT/cluster_gpu.md" 2>&1 | tee "$OUT/cluster_gpu.log" | tail -20
status=${PIPESTATUS[0]}
log "check: exit $status after $((SECONDS - start)) s"
exit "$status"
