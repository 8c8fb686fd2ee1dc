// Workloads for measuring contention on one GPU (the harness's `contend`
// mode): what an all-reduce with k blocks costs the compute beside it, and
// what that compute costs the all-reduce. These are the two curves Libra's
// model is made of (compute slowdown vs blocks, all-reduce time vs blocks
// under contention).
//
// On one GPU a virtual team's cooperative grid holds every rank's blocks, so it
// takes n times the SMs of one rank. The contention workload is therefore one
// rank's share of a one-shot all-reduce alone: `blocks` blocks read the same
// element of n buffers (local HBM here, peers' memory over NVLink on a real
// team), sum them and write the result, with the kernels' 16-byte accesses.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

namespace libra::cuda {

// C = A x B for n x n float32 matrices (n a multiple of 32): a shared-memory
// tiled GEMM, compute-bound. Not cuBLAS (no library beyond cudart here), so
// its rate is below the GPU's peak; what matters is that it fills every SM.
cudaError_t LaunchGemm(const float* a, const float* b, float* c, int n, cudaStream_t stream);

// a = b + 3 c over `count` float32 (a multiple of 4): memory-bound (STREAM triad).
cudaError_t LaunchTriad(float* a, const float* b, const float* c, std::size_t count,
                        cudaStream_t stream);

// One rank's part of a one-shot all-reduce without its barriers: out = sum of
// the `n` buffers in `inputs` (a device array of n device pointers), `bytes`
// each (a multiple of 16), with `blocks` blocks of kThreads threads.
cudaError_t LaunchRankShare(const float* const* inputs, int n, float* out, std::size_t bytes,
                            int blocks, cudaStream_t stream);

// Spins for about `us` microseconds on the GPU (to start two streams together).
cudaError_t LaunchSpin(unsigned us, cudaStream_t stream);

}  // namespace libra::cuda
