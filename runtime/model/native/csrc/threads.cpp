// The calling thread's OpenMP workers, released. libgomp keeps a worker pool per thread that
// has run a parallel region; once more threads are pooled than there are cores, it cuts every
// worker's spin-wait to ~1,000 iterations, so each parallel region wakes its workers through
// a futex (~50 us here, per region). An engine builds its model on the caller's thread and
// then computes on its loop thread: releasing the builder's pool keeps the loop thread's
// workers spinning between the step's few hundred short regions.
#include "ops.h"

#include <omp.h>

namespace {

// 0 when released (or nothing to release); nonzero inside a parallel region, where it cannot.
int64_t release_openmp_workers() { return omp_pause_resource_all(omp_pause_soft); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(flowlang, m) {
  m.def("release_openmp_workers() -> int", &release_openmp_workers);
}
