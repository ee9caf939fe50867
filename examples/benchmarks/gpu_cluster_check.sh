#!/usr/bin/env bash
# Ray replicas as CUDA engines on one device run: now a stage of gpu_check.sh (one carried
# folder, .gpu/, one install). This runs that stage alone, with the same flags:
#
#   bash examples/benchmarks/gpu_cluster_check.sh --prepare   # = gpu_check.sh --prepare
#   bash examples/benchmarks/gpu_cluster_check.sh --dry-run   # the trimmed Ray, on CPU
#   bash examples/benchmarks/gpu_cluster_check.sh             # there, with .gpu carried
exec bash "$(dirname "$0")/gpu_check.sh" "$@" --only cluster
