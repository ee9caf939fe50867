"""Native CPU kernels (C++): attention, norms, RoPE, SiLU, the decode GEMM; built once per torch
build and CPU (build.py), loaded by kernels.py."""
