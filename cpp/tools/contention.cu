#include "tools/contention.h"

#include "libra/cuda/allreduce.h"

namespace libra::cuda {
namespace {

constexpr int kTile = 32;  // GEMM tile; each thread computes kTile / 8 = 4 outputs

__global__ void GemmKernel(const float* __restrict__ a, const float* __restrict__ b,
                           float* __restrict__ c, int n) {
  __shared__ float as[kTile][kTile + 1];
  __shared__ float bs[kTile][kTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;  // 32 x 8 threads
  const int row0 = blockIdx.y * kTile, col = blockIdx.x * kTile + tx;
  float acc[kTile / 8] = {0.f, 0.f, 0.f, 0.f};
  for (int k0 = 0; k0 < n; k0 += kTile) {
    for (int r = ty; r < kTile; r += 8) {
      as[r][tx] = a[static_cast<std::size_t>(row0 + r) * n + k0 + tx];
      bs[r][tx] = b[static_cast<std::size_t>(k0 + r) * n + col];
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile; ++k) {
      const float bv = bs[k][tx];
#pragma unroll
      for (int i = 0; i < kTile / 8; ++i) acc[i] += as[ty + 8 * i][k] * bv;
    }
    __syncthreads();
  }
#pragma unroll
  for (int i = 0; i < kTile / 8; ++i) {
    c[static_cast<std::size_t>(row0 + ty + 8 * i) * n + col] = acc[i];
  }
}

__global__ void TriadKernel(float4* __restrict__ a, const float4* __restrict__ b,
                            const float4* __restrict__ c, std::size_t vectors) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < vectors;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const float4 x = b[i], y = c[i];
    a[i] = make_float4(x.x + 3.f * y.x, x.y + 3.f * y.y, x.z + 3.f * y.z, x.w + 3.f * y.w);
  }
}

__global__ void RankShareKernel(const float* const* __restrict__ inputs, int n,
                                float4* __restrict__ out, std::size_t vectors) {
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < vectors;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int r = 0; r < n; ++r) {  // rank order, as the all-reduce kernels sum
      const float4 v = reinterpret_cast<const float4*>(inputs[r])[i];
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    out[i] = sum;
  }
}

__global__ void SpinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

}  // namespace

cudaError_t LaunchGemm(const float* a, const float* b, float* c, int n, cudaStream_t stream) {
  if (n <= 0 || n % kTile != 0) return cudaErrorInvalidValue;
  GemmKernel<<<dim3(n / kTile, n / kTile), dim3(kTile, 8), 0, stream>>>(a, b, c, n);
  return cudaGetLastError();
}

cudaError_t LaunchTriad(float* a, const float* b, const float* c, std::size_t count,
                        cudaStream_t stream) {
  if (count % 4 != 0) return cudaErrorInvalidValue;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  TriadKernel<<<sms * 4, 512, 0, stream>>>(reinterpret_cast<float4*>(a),
                                          reinterpret_cast<const float4*>(b),
                                          reinterpret_cast<const float4*>(c), count / 4);
  return cudaGetLastError();
}

cudaError_t LaunchRankShare(const float* const* inputs, int n, float* out, std::size_t bytes,
                            int blocks, cudaStream_t stream) {
  if (n < 1 || blocks < 1 || blocks > kMaxBlocks || bytes % kVectorBytes != 0) {
    return cudaErrorInvalidValue;
  }
  RankShareKernel<<<blocks, kThreads, 0, stream>>>(inputs, n, reinterpret_cast<float4*>(out),
                                                   bytes / kVectorBytes);
  return cudaGetLastError();
}

cudaError_t LaunchSpin(unsigned us, cudaStream_t stream) {
  int device = 0, khz = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  if (err != cudaSuccess) return err;
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<long long>(khz) * us / 1000);
  return cudaGetLastError();
}

}  // namespace libra::cuda
