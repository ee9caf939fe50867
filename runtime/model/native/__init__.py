"""Native CPU kernels (C++, compiled on first use): attention and RMSNorm."""
