#!/usr/bin/env bash
# Everything GPU in one device run (issue 36): install from .gpu/, flashinfer's kernels, the GPU
# tests (flashinfer vs the torch reference, graphs vs eager, speculative decoding, Gemma 2 and 3
# vs transformers, the host KV tier), two Ray replicas sharing the GPU, then gpu_bench.py; each
# stage under its own timeout and all of them under one deadline (BUDGET_S, inside the device's
# 10-minute command limit), results under $OUT: log.txt, test_gpu.txt, gpu_bench.md,
# cluster_gpu.md, flashinfer_jit.tgz.
#
#   bash examples/benchmarks/gpu_check.sh --prepare   # here (PyPI reachable): everything into .gpu/
#   bash examples/benchmarks/gpu_check.sh --dry-run   # here: carried files, sizes, every CPU step
#   bash examples/benchmarks/gpu_check.sh             # there, with `carry: [".gpu"]`
#   bash examples/benchmarks/gpu_check.sh --only cluster,bench   # there: what a deadline skipped
#
# Stages (seconds: most, and least worth starting with; the deadline cuts the most):
#   install  60       small wheels (pip --target /tmp/site), Ray and flashinfer from .tar.xz
#   kernels  300/60   flashinfer's JIT (head_dim 128, bf16), restored from .gpu/flashinfer_jit.tgz
#                     when present (a run brings its kernels back as $OUT/flashinfer_jit.tgz)
#   cluster  300/120  gpu_cluster_check.py --device cuda, in the background from the end of the
#                     install, beside kernels and tests (fp32 engines, torch attention; its wall
#                     times are never checked), awaited before the bench
#   tests    240/90   pytest -m gpu tests/test_gpu.py tests/test_cuda_graph.py (a skip there fails)
#   bench    240/150  gpu_bench.py, alone on the GPU
# A stage the deadline leaves too little time is skipped and named in the log: run it again with
# --only on the still-warm machine (the install is kept in /tmp and not repeated).
#
# .gpu/ (ignored by git, .gitignore) holds: wheels/ (the packages the image lacks, KINDS.md, one
# version each), flashinfer.tar.xz and ray.tar.xz (their wheels' trees, Ray trimmed of its Java
# jars, dashboard web client and libraries a driver never imports, binaries stripped: 79 MB of
# wheel in 28 MB), w1_first_turns.json, and flashinfer_jit.tgz when an earlier run made one.
# With the working tree it must stay under LIMIT_MIB (the device carries 64 MiB in all).
set -uo pipefail
cd "$(dirname "$0")/../.."
GPU_DIR=.gpu
LIMIT_MIB=60
RAY_VERSION=2.60.0
FLASHINFER_VERSION=0.6.18.post1
WHEELS=(  # the engine's (xgrammar, gguf, pydantic), flashinfer's (tvm-ffi) and Ray's (jsonschema)
  apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.9 gguf==0.19.0 pydantic==2.14.4 pydantic-core==2.50.5
  annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 jsonschema==4.25.1
  jsonschema-specifications==2025.9.1 referencing==0.36.2 rpds-py==0.27.1
)
RAY_DROP=(jars dashboard/client rllib tune train serve data llm)  # under ray/
BUDGET_S=${BUDGET_S:-560}
declare -A MOST=([install]=60 [kernels]=300 [cluster]=300 [tests]=240 [bench]=240)
declare -A LEAST=([install]=60 [kernels]=60 [cluster]=120 [tests]=90 [bench]=150)

MODE=run
ONLY=kernels,tests,cluster,bench
while (($#)); do
  case $1 in
    --prepare | --dry-run) MODE=$1 ;;
    --only) ONLY=${2:?--only takes stages, e.g. cluster,bench}; shift ;;
    *) echo "usage: $0 [--prepare | --dry-run] [--only kernels,tests,cluster,bench]" >&2; exit 2 ;;
  esac
  shift
done
for stage in ${ONLY//,/ }; do
  [[ -n ${MOST[$stage]:-} && $stage != install ]] || { echo "unknown stage $stage" >&2; exit 2; }
done
wants() { [[ ,$ONLY, == *,$1,* ]]; }
wants tests || wants bench && ONLY+=,kernels  # both need the kernels (rebuilt or found warm)

OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
START=$SECONDS
log() { echo "[gpu_check +$((SECONDS - START))s] $*" | tee -a "$OUT/log.txt"; }

platforms() {
  local p
  for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    echo --platform "${p}_x86_64"
  done
}

download() {  # $1: destination, then the specs (the device's Python 3.12, x86-64 Linux)
  local dest=$1
  shift
  # shellcheck disable=SC2046
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $(platforms) -d "$dest" "$@" 2>&1 | grep -v "is ignored" >&2
  return "${PIPESTATUS[0]}"
}

trim_ray() {  # $1: an unpacked Ray tree: drop what a Python driver never loads, strip binaries
  local dir=$1 f
  for f in "${RAY_DROP[@]}"; do rm -rf "${dir:?}/ray/$f"; done
  command -v strip >/dev/null || { echo "no strip here: binaries kept whole" >&2; return 0; }
  for f in "$dir/ray/_raylet.so" "$dir/ray/core/src/ray/raylet/raylet" \
    "$dir/ray/core/src/ray/gcs/gcs_server"; do
    strip --strip-unneeded "$f" || return 1
  done
}

pack_wheel() {  # $1: a wheel, $2: the .tar.xz of its tree, $3: a function to apply first (or :)
  local tree out
  tree=$(mktemp -d)
  out=$(realpath -m "$2")
  python3 -m zipfile -e "$1" "$tree" || return 1
  chmod -R u+rwX,go+rX "$tree"  # zip keeps no modes: the executables (Ray's raylet, GCS)
  find "$tree" -type f \( -name '*.so' -o -path '*/core/src/ray/*' \) -exec chmod +x {} +
  "$3" "$tree" || return 1
  (cd "$tree" && tar cf - --sort=name ./* | nice xz -6 -T1 >"$out") || return 1
  rm -rf "$tree"
}

prepare() {
  local tmp
  tmp=$(mktemp -d)
  rm -rf "$GPU_DIR/wheels" "$GPU_DIR/flashinfer.tar.xz" "$GPU_DIR/ray.tar.xz"
  rm -rf "$GPU_DIR/ray_trimmed.zip"  # what an older --prepare left
  mkdir -p "$GPU_DIR/wheels"
  download "$GPU_DIR/wheels" "${WHEELS[@]}" || return 1
  download "$tmp" "flashinfer-python==$FLASHINFER_VERSION" "ray==$RAY_VERSION" || return 1
  echo "packing flashinfer and Ray as .tar.xz (a few minutes)"
  pack_wheel "$tmp"/flashinfer_python-*.whl "$GPU_DIR/flashinfer.tar.xz" : || return 1
  pack_wheel "$tmp"/ray-*.whl "$GPU_DIR/ray.tar.xz" trim_ray || return 1
  rm -rf "$tmp"
  [[ -f $GPU_DIR/w1_first_turns.json ]] ||
    .venv/bin/python examples/benchmarks/gpu_bench.py --write-w1-ids "$GPU_DIR/w1_first_turns.json" ||
    return 1
  ls -l "$GPU_DIR" "$GPU_DIR/wheels"
}

carried_mib() {  # what a device call carries: the working tree (tracked + untracked, not
  # ignored) and .gpu/, in MiB
  {
    git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null
    find "$GPU_DIR" -type f -printf '%s\n'
  } | awk '{s += $1} END {printf "%.1f", s / 1048576}'
}

check_carried() {  # every file there, one wheel per package, and the size: a miss costs a run
  local missing=0 spec name version found
  for spec in "${WHEELS[@]}"; do
    name=${spec%%==*} version=${spec##*==}
    found=$(ls "$GPU_DIR/wheels/${name//-/_}-${version}-"*.whl 2>/dev/null | wc -l)
    [[ $found == 1 ]] || { log "wheel $spec: $found files"; missing=1; }
  done
  [[ $(ls "$GPU_DIR"/wheels/*.whl 2>/dev/null | wc -l) == "${#WHEELS[@]}" ]] ||
    { log "other wheels in $GPU_DIR/wheels"; missing=1; }
  for f in flashinfer.tar.xz ray.tar.xz w1_first_turns.json; do
    [[ -s $GPU_DIR/$f ]] || { log "no $GPU_DIR/$f (run --prepare)"; missing=1; }
  done
  git check-ignore -q "$GPU_DIR/wheels" || { log "$GPU_DIR is not ignored by git"; missing=1; }
  local mib
  mib=$(carried_mib)
  log "carried: $mib MiB (working tree + $GPU_DIR: $(du -sh "$GPU_DIR" | cut -f1)), limit $LIMIT_MIB"
  awk -v m="$mib" -v l="$LIMIT_MIB" 'BEGIN {exit !(m < l)}' ||
    { log "over $LIMIT_MIB MiB: drop $GPU_DIR/flashinfer_jit.tgz or run --only cluster apart"; missing=1; }
  return $missing
}

unpack() {  # $1: .tar.xz, $2: where (tar's modes kept: Ray's binaries stay executable)
  mkdir -p "$2" && python3 -c '
import sys, tarfile
kw = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}  # 3.12 warns without one
tarfile.open(sys.argv[1]).extractall(sys.argv[2], **kw)' "$1" "$2"
}

if [[ $MODE == --prepare ]]; then
  prepare || exit 1
  check_carried
  exit $?
fi

if [[ $MODE == --dry-run ]]; then  # what needs no CUDA, with this machine's Python (3.11)
  check_carried || exit 1
  PY=${PYTHON:-.venv/bin/python}
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # the install, as pip resolves it for the device's Python 3.12: one version of each package
  # shellcheck disable=SC2046
  python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp $(platforms) --target "$tmp/site" \
    "$GPU_DIR"/wheels/*.whl || { log "the wheels do not install for Python 3.12"; exit 1; }
  unpack "$GPU_DIR/flashinfer.tar.xz" "$tmp/site-fi" && unpack "$GPU_DIR/ray.tar.xz" "$tmp/site" ||
    { log "a .tar.xz does not unpack"; exit 1; }
  for f in site/pydantic site/xgrammar site/tvm_ffi site/gguf site/jsonschema site/ray/_raylet.so \
    site-fi/flashinfer/data/csrc site/ray/core/src/ray/raylet/raylet; do
    [[ -e $tmp/$f ]] || { log "not installed: $f"; exit 1; }
  done
  [[ -x $tmp/site/ray/core/src/ray/gcs/gcs_server ]] || { log "Ray's GCS is not executable"; exit 1; }
  log "install rehearsed for Python 3.12: $(ls "$tmp/site" | grep -vc dist-info) packages + flashinfer"
  rm -rf "$tmp/site" "$tmp/site-fi"
  status=0
  if wants tests; then
    "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py tests/test_cuda_graph.py \
      2>&1 | tee "$OUT/test_gpu.txt" | tail -15
    tests=${PIPESTATUS[0]}
    log "tests on CPU (the GPU ones skip): exit $tests"
    ((tests == 0)) || status=1
  fi
  if wants bench; then
    "$PY" examples/benchmarks/gpu_bench.py --dry-run --w1-ids "$GPU_DIR/w1_first_turns.json" \
      --out "$OUT/gpu_bench.md" >/dev/null
    bench=$?
    log "gpu_bench.py --dry-run: exit $bench; $(head -1 "$OUT/gpu_bench.md"); $(grep ^W1 "$OUT/gpu_bench.md")"
    ((bench == 0)) || status=1
  fi
  if wants cluster; then  # this machine's own Ray, trimmed as the carried one is
    ray_dir=$("$PY" -c 'import ray, os; print(os.path.dirname(ray.__file__))') || exit 1
    "$PY" -c "import ray; assert ray.__version__ == '$RAY_VERSION', ray.__version__" || exit 1
    mkdir -p "$tmp/site" && cp -a "$ray_dir" "$tmp/site/ray" && trim_ray "$tmp/site" || exit 1
    ours=$(cd "$tmp/site" && find ray -type f ! -name '*.pyc' | sed 's/cpython-31[0-9]/cpython-3X/' | sort)
    carried=$(tar tJf "$GPU_DIR/ray.tar.xz" | sed -n 's|^\./||; /^ray\/.*[^/]$/p' |
      sed 's/cpython-31[0-9]/cpython-3X/' | sort)
    extra=$(comm -13 <(echo "$carried") <(echo "$ours"))
    log "trimmed Ray: $(echo "$ours" | wc -l) files here, $(echo "$carried" | wc -l) carried;" \
      "here only: $(echo "$extra" | grep -c .) $(echo "$extra" | head -5 | tr '\n' ' ')"
    PYTHONPATH=$tmp/site:$PWD "$PY" -c 'import ray; assert "/site/" in ray.__file__' ||
      { log "the trimmed Ray is not the one imported"; exit 1; }
    PYTHONPATH=$tmp/site:$PWD RAY_AUTH_MODE=disabled timeout 600 "$PY" \
      examples/benchmarks/gpu_cluster_check.py --device cpu --out "$OUT/cluster_cpu.md" \
      >>"$OUT/log.txt" 2>&1
    cluster=$?
    cat "$OUT/cluster_cpu.md" 2>/dev/null
    log "cluster on CPU with the trimmed Ray: exit $cluster"
    ((cluster == 0)) || status=1
  fi
  log "dry run: $([[ $status == 0 ]] && echo passed || echo FAILED) (nothing ran on a GPU)"
  exit $status
fi

# ---- on the device ----
declare -A RESULT
left() { echo $((BUDGET_S - (SECONDS - START))); }
stage_timeout() {  # $1: stage; prints its timeout, or nothing when too little time is left
  local t
  t=$(left)
  ((t > MOST[$1])) && t=${MOST[$1]}
  ((t >= LEAST[$1])) && echo "$t"
}
finish() {  # $1: stage, $2: exit status, $3: started at
  local status=$2 what=ok
  ((status == 124 || status == 137)) && what="TIMED OUT"
  ((status != 0 && status != 124 && status != 137)) && what="FAILED (exit $status)"
  RESULT[$1]="$what after $((SECONDS - $3)) s"
  log "stage $1: ${RESULT[$1]}"
}
skip() { RESULT[$1]="SKIPPED: $(left) s left, it needs ${LEAST[$1]} (rerun: --only $1)"; log "stage $1: ${RESULT[$1]}"; }

check_carried || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/log.txt"
export PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws MAX_JOBS=16 RAY_AUTH_MODE=disabled
SITE=/tmp/site SITE_FI=/tmp/site-fi
WITH_FI=$SITE_FI:$SITE:$PWD
WITHOUT_FI=$SITE:$PWD  # the cluster's fp32 engines: flashinfer's fused ops take bf16/fp16 only

started=$SECONDS
if [[ -f $SITE/.installed && -f $SITE_FI/.installed ]]; then
  log "stage install: found in /tmp from an earlier call"
else
  rm -rf "$SITE" "$SITE_FI"
  install() {
    python3 -m pip install -q --root-user-action=ignore --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      "$GPU_DIR"/wheels/*.whl &&
      unpack "$GPU_DIR/ray.tar.xz" "$SITE" && unpack "$GPU_DIR/flashinfer.tar.xz" "$SITE_FI" &&
      PYTHONPATH=$WITH_FI python3 -c 'import flashinfer, xgrammar, ray, pydantic' &&
      PYTHONPATH=$WITHOUT_FI python3 -c 'import importlib.util as u; assert not u.find_spec("flashinfer")'
  }
  export -f install unpack
  export GPU_DIR SITE SITE_FI WITH_FI WITHOUT_FI
  timeout "${MOST[install]}" bash -c install 2>&1 | tail -20 | tee -a "$OUT/log.txt"
  status=${PIPESTATUS[0]}
  finish install "$status" "$started"
  ((status == 0)) || exit 1
  touch "$SITE/.installed" "$SITE_FI/.installed"
fi
PYTHONPATH=$WITH_FI python3 -c 'import torch, transformers, flashinfer, ray
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      "flashinfer", flashinfer.__version__, "ray", ray.__version__)' 2>&1 | tee -a "$OUT/log.txt"

cluster_pid=
if wants cluster; then  # in the background, beside the kernels and the tests
  if t=$(stage_timeout cluster); then
    log "stage cluster: 2 Ray replicas on the GPU, in the background (timeout $t s)"
    cluster_started=$SECONDS
    (PYTHONPATH=$WITHOUT_FI timeout "$t" python3 examples/benchmarks/gpu_cluster_check.py \
      --device cuda --out "$OUT/cluster_gpu.md" >/tmp/cluster_gpu.log 2>&1) &
    cluster_pid=$!
  else
    skip cluster
  fi
fi

if wants kernels; then
  started=$SECONDS
  aot=$SITE_FI/flashinfer/data/aot
  if [[ -f $GPU_DIR/flashinfer_jit.tgz && ! -d $aot ]]; then  # as flashinfer's ahead-of-time kernels
    mkdir -p "$aot" && tar xzf "$GPU_DIR/flashinfer_jit.tgz" -C "$aot"
    log "restored flashinfer kernels built by an earlier run: $(ls "$aot" | tr '\n' ' ')"
  fi
  if t=$(stage_timeout kernels); then
    log "stage kernels: flashinfer (head_dim 128, bf16; timeout $t s)"
    PYTHONPATH=$WITH_FI timeout "$t" python3 examples/benchmarks/gpu_bench.py --warm-jit 2>&1 |
      tail -20 | tee -a "$OUT/log.txt"
    status=${PIPESTATUS[0]}
    finish kernels "$status" "$started"
    # bring the built kernels back as cached_ops/NAME/NAME.so (a rerun restores them, no compile)
    jit_dir=$(ls -d /tmp/fiws/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
    [[ -n $jit_dir ]] && (cd "$jit_dir" && ls */*.so | tar czf "$OUT/flashinfer_jit.tgz" -T -)
    [[ -f $OUT/flashinfer_jit.tgz ]] && log "kernels brought back: $(du -h "$OUT/flashinfer_jit.tgz" | cut -f1)"
  else
    skip kernels
  fi
fi

if wants tests; then
  started=$SECONDS
  if t=$(stage_timeout tests); then
    log "stage tests: pytest -m gpu (timeout $t s)"
    PYTHONPATH=$WITH_FI timeout "$t" python3 -m pytest -p no:cacheprovider -m gpu -v -rA \
      tests/test_gpu.py tests/test_cuda_graph.py >"$OUT/test_gpu.txt" 2>&1
    status=$?
    tail -3 "$OUT/test_gpu.txt" | tee -a "$OUT/log.txt"
    if ((status == 0)) && grep -q "^SKIPPED" "$OUT/test_gpu.txt"; then
      log "a GPU test was skipped on the device"
      status=1
    fi
    finish tests "$status" "$started"
  else
    skip tests
  fi
fi

if [[ -n $cluster_pid ]]; then
  log "waiting for the cluster stage"
  wait "$cluster_pid"
  status=$?
  {
    echo "---- gpu_cluster_check.py output ----"
    tail -60 /tmp/cluster_gpu.log
    echo "----"
  } >>"$OUT/log.txt"
  cat "$OUT/cluster_gpu.md" 2>/dev/null
  finish cluster "$status" "$cluster_started"
fi

if wants bench; then
  started=$SECONDS
  if t=$(stage_timeout bench); then
    log "stage bench: gpu_bench.py (timeout $t s)"
    PYTHONPATH=$WITH_FI timeout "$t" python3 examples/benchmarks/gpu_bench.py \
      --w1-ids "$GPU_DIR/w1_first_turns.json" --out "$OUT/gpu_bench.md" >/tmp/gpu_bench.log 2>&1
    status=$?
    {
      echo "---- gpu_bench.py output ----"
      tail -80 /tmp/gpu_bench.log
      echo "----"
    } >>"$OUT/log.txt"
    cat "$OUT/gpu_bench.md" 2>/dev/null
    finish bench "$status" "$started"
  else
    skip bench
  fi
fi

failed=0
log "summary after $((SECONDS - START)) s (deadline $BUDGET_S s):"
for stage in install kernels cluster tests bench; do
  [[ -n ${RESULT[$stage]:-} ]] || continue
  log "  $stage: ${RESULT[$stage]}"
  [[ ${RESULT[$stage]} == ok* ]] || failed=1
done
exit $failed
