#pragma once
// For the standalone research probes (bench/research/*.cu), which link only the CUDA runtime:
// a failed CUDA call ends the probe with its name and the error.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
