// What every kernel file needs of torch: tensors, their factories, parallel_for and the op
// registry. Not <torch/extension.h>: that pulls in pybind11, Python and torch's C++ frontend,
// and parsing it took ~35 s of each file's compile on 2 cores (the kernels are not a Python
// module, so none of it is used).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
