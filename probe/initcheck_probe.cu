#include <cuda_runtime.h>
#include <cstdio>
__global__ void sum(const unsigned* p, size_t n, unsigned long long* out) {
  unsigned long long s = 0;
  for (size_t i = threadIdx.x + blockIdx.x * blockDim.x; i < n; i += blockDim.x * gridDim.x) s += p[i];
  atomicAdd(out, s);
}
int main() {
  const size_t bytes = 2 << 20;
  unsigned *host, *a, *b; unsigned long long* out;
  cudaHostAlloc((void**)&host, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
  for (size_t i = 0; i < bytes / 4; ++i) host[i] = 1;
  cudaMalloc(&a, bytes); cudaMalloc(&b, bytes); cudaMalloc(&out, 8); cudaMemset(out, 0, 8);
  cudaStream_t s; cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  void* dst[2] = {a, (char*)a + bytes / 2}; void* src[2] = {host, (char*)host + bytes / 2};
  size_t sz[2] = {bytes / 2, bytes / 2};
  cudaMemcpyAttributes attr{}; attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream; size_t idx = 0;
  printf("batch: %s\n", cudaGetErrorString(cudaMemcpyBatchAsync(dst, src, sz, 2, &attr, &idx, 1, s)));
  printf("-- kernel over the batch-copied buffer\n"); fflush(stdout);
  sum<<<4, 256, 0, s>>>(a, bytes / 4, out); cudaStreamSynchronize(s);
  cudaMemcpyAsync(b, host, bytes, cudaMemcpyDefault, s);
  printf("-- kernel over the cudaMemcpyAsync-copied buffer\n"); fflush(stdout);
  sum<<<4, 256, 0, s>>>(b, bytes / 4, out); cudaStreamSynchronize(s);
  unsigned long long r; cudaMemcpy(&r, out, 8, cudaMemcpyDeviceToHost);
  printf("sum %llu (expect %zu)\n", r, bytes / 2);
}
