// libra CUDA all-reduce kernels and team memory (see allreduce.h).
//
// Why re-using a staging half is safe. Round t writes half (t & 1), which
// round t - 2 used last; a peer still reading that half would be in round
// t - 2. Every block takes part in every barrier of its kernel, and a block
// owns the same tiles in every round of a kernel (tile-cyclic positions,
// relative to fixed offsets: segment s of a two-shot chunk always starts at
// s * capacity / n), so a partial last chunk only uses a subset of a block's
// usual tiles.
//  - Within one kernel: this rank's block b passed round t - 1's barrier, so
//    every peer's block b had signalled round t - 1, so it had finished its
//    reads of round t - 2, which touched only block b's tiles.
//  - Across kernels (block counts and algorithms may differ): if round t is
//    the first of this rank's kernel, this rank's previous kernel completed,
//    so all its blocks passed round t - 1's barrier, so each peer's blocks
//    signalled round t - 1, so each peer's round t - 2 is over. Otherwise the
//    first case applies, and a peer that signalled from a newer kernel has
//    completed its older ones.
// A peer can be at most one round ahead when it writes a flag, so waits use
// `flag - round >= 0` (wrap-safe) rather than equality.
#include "libra/cuda/allreduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace libra::cuda {

const char* Name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kAuto: return "auto";
    case Algorithm::kOneShot: return "oneshot";
    case Algorithm::kTwoShot: return "twoshot";
  }
  return "?";
}

Algorithm ChooseAlgorithm(std::size_t bytes, int nranks) {
  if (nranks <= 2) return Algorithm::kOneShot;
  if (nranks <= 4 && bytes < (std::size_t{512} << 10)) return Algorithm::kOneShot;
  if (bytes < (std::size_t{256} << 10)) return Algorithm::kOneShot;
  return Algorithm::kTwoShot;
}

namespace {

std::size_t CapacityVectors(std::size_t capacity_bytes, int nranks) {
  const std::size_t n = static_cast<std::size_t>(std::max(nranks, 1));
  const std::size_t vectors = capacity_bytes / kVectorBytes / n * n;
  return std::max(vectors, n);
}

Algorithm Resolve(Algorithm algorithm, std::size_t bytes, int nranks) {
  return algorithm == Algorithm::kAuto ? ChooseAlgorithm(bytes, nranks) : algorithm;
}

}  // namespace

int EffectiveBlocks(std::size_t bytes, int nranks, Algorithm algorithm, int blocks,
                    std::size_t capacity_bytes) {
  nranks = std::max(nranks, 1);
  const std::size_t capacity = CapacityVectors(capacity_bytes, nranks);
  const std::size_t per_round = std::min(bytes / kVectorBytes, capacity);
  std::size_t work = per_round;  // vectors a block count is spread over
  if (Resolve(algorithm, bytes, nranks) == Algorithm::kTwoShot) {
    work = (per_round + nranks - 1) / nranks;
  }
  const std::size_t tiles = std::max<std::size_t>(1, (work + kThreads - 1) / kThreads);
  return static_cast<int>(std::min<std::size_t>(std::clamp(blocks, 1, kMaxBlocks), tiles));
}

// --- Device code -------------------------------------------------------------

namespace {

struct KernelArgs {
  TeamView view;
  const uint4* input;
  uint4* output;
  std::size_t vectors;
  int two_shot;
  int blocks;  // grid size of one rank
  uint64_t timeout_ns;
};

template <typename T> struct Accumulate;
template <> struct Accumulate<float> {
  using A = float;
  static __device__ __forceinline__ A To(float x) { return x; }
  static __device__ __forceinline__ float From(A a) { return a; }
};
template <> struct Accumulate<double> {
  using A = double;
  static __device__ __forceinline__ A To(double x) { return x; }
  static __device__ __forceinline__ double From(A a) { return a; }
};
template <> struct Accumulate<__nv_bfloat16> {
  using A = float;
  static __device__ __forceinline__ A To(__nv_bfloat16 x) { return __bfloat162float(x); }
  static __device__ __forceinline__ __nv_bfloat16 From(A a) { return __float2bfloat16_rn(a); }
};
template <> struct Accumulate<__half> {
  using A = float;
  static __device__ __forceinline__ A To(__half x) { return __half2float(x); }
  static __device__ __forceinline__ __half From(A a) { return __float2half_rn(a); }
};
template <> struct Accumulate<int32_t> {
  using A = uint32_t;  // two's complement, wrapping, without undefined behaviour
  static __device__ __forceinline__ A To(int32_t x) { return static_cast<uint32_t>(x); }
  static __device__ __forceinline__ int32_t From(A a) { return static_cast<int32_t>(a); }
};

// Sum of vals[0..n) element-wise, from +0, in rank order.
template <typename T>
__device__ __forceinline__ uint4 SumVectors(const uint4 (&vals)[kMaxRanks], int n) {
  constexpr int kElems = kVectorBytes / sizeof(T);
  using A = typename Accumulate<T>::A;
  A acc[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) acc[e] = A(0);
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    if (r < n) {
      T x[kElems];
      memcpy(x, &vals[r], kVectorBytes);
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = acc[e] + Accumulate<T>::To(x[e]);
    }
  }
  T y[kElems];
#pragma unroll
  for (int e = 0; e < kElems; ++e) y[e] = Accumulate<T>::From(acc[e]);
  uint4 out;
  memcpy(&out, y, kVectorBytes);
  return out;
}

__device__ __forceinline__ void StoreRelease(uint32_t* address, uint32_t value) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* address) {
  uint32_t value;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Block `block` of this rank meets block `block` of every rank at `round`.
// Returns false if the wait was abandoned (timeout here or elsewhere).
__device__ bool Barrier(const KernelArgs& a, int stage, int block, uint32_t round,
                        int* aborted) {
  __syncthreads();
  const int t = threadIdx.x;
  const int n = a.view.nranks;
  if (t < n) {
    const int slot = (stage * kMaxBlocks + block) * kMaxRanks;
    __threadfence_system();  // this block's staging writes, before the flag
    StoreRelease(a.view.member[t].flags + slot + a.view.rank, round);
    const uint32_t* mine = a.view.member[a.view.rank].flags + slot + t;
    const uint64_t start = a.timeout_ns ? GlobalTimerNs() : 0;
    uint32_t spins = 0;
    while (static_cast<int32_t>(LoadAcquire(mine) - round) < 0) {
      if ((++spins & 1023u) != 0) continue;
      if (*aborted || a.view.error->code != 0) {  // given up elsewhere
        *aborted = 1;
        break;
      }
      if (a.timeout_ns && GlobalTimerNs() - start > a.timeout_ns) {
        ErrorRecord* e = a.view.error;
        e->rank = a.view.rank;
        e->block = block;
        e->peer = t;
        e->round = round;
        e->stage = stage;
        __threadfence_system();
        e->code = 1;
        __threadfence_system();
        *aborted = 1;
        break;
      }
    }
  }
  __syncthreads();
  return *aborted == 0;
}

__device__ __forceinline__ std::size_t MinSize(std::size_t a, std::size_t b) { return a < b ? a : b; }

template <typename T>
__device__ void AllReduceRank(const KernelArgs& a, int block) {
  __shared__ int aborted;
  const int t = threadIdx.x;
  if (t == 0) aborted = 0;
  const int n = a.view.nranks;
  const int rank = a.view.rank;
  const std::size_t cap = a.view.capacity_vectors;
  const std::size_t segcap = cap / n;
  const std::size_t half_stride = cap + segcap;
  const std::size_t step = static_cast<std::size_t>(a.blocks) * kThreads;
  const std::size_t first = static_cast<std::size_t>(block) * kThreads + t;
  uint32_t* counters = a.view.member[rank].counters;
  const uint32_t base = *reinterpret_cast<volatile uint32_t*>(&counters[0]);
  const std::size_t rounds = (a.vectors + cap - 1) / cap;

  const uint4* peer[kMaxRanks];
#pragma unroll
  for (int r = 0; r < kMaxRanks; ++r) {
    peer[r] = r < n ? static_cast<const uint4*>(a.view.member[r].staging) : nullptr;
  }
  uint4* const mine = static_cast<uint4*>(a.view.member[rank].staging);
  __syncthreads();

  for (std::size_t k = 0; k < rounds; ++k) {
    const uint32_t round = base + static_cast<uint32_t>(k) + 1;
    const std::size_t half = (round & 1u) * half_stride;
    const std::size_t off = k * cap;
    const std::size_t vc = MinSize(cap, a.vectors - off);
    const uint4* in = a.input + off;
    uint4* out = a.output + off;
    uint4 vals[kMaxRanks];

    if (!a.two_shot) {
      for (std::size_t v = first; v < vc; v += step) mine[half + v] = in[v];
      if (!Barrier(a, 0, block, round, &aborted)) break;
      for (std::size_t v = first; v < vc; v += step) {
#pragma unroll
        for (int r = 0; r < kMaxRanks; ++r) {
          if (r < n) vals[r] = __ldcg(peer[r] + half + v);
        }
        out[v] = SumVectors<T>(vals, n);
      }
      continue;
    }

    // Two-shot: segment s of the chunk is [s * seg, s * seg + len(s)) and lives
    // at s * segcap in the staging half; this rank reduces segment `rank`.
    const std::size_t seg = (vc + n - 1) / n;
    auto len = [&](int s) {
      const std::size_t begin = MinSize(vc, static_cast<std::size_t>(s) * seg);
      return MinSize(seg, vc - begin);
    };
    for (int s = 0; s < n; ++s) {
      const std::size_t ls = len(s);
      for (std::size_t v = first; v < ls; v += step) {
        mine[half + s * segcap + v] = in[s * seg + v];
      }
    }
    if (!Barrier(a, 0, block, round, &aborted)) break;
    const std::size_t own = len(rank);
    for (std::size_t v = first; v < own; v += step) {
#pragma unroll
      for (int r = 0; r < kMaxRanks; ++r) {
        if (r < n) vals[r] = __ldcg(peer[r] + half + rank * segcap + v);
      }
      const uint4 sum = SumVectors<T>(vals, n);
      mine[half + cap + v] = sum;
      out[rank * seg + v] = sum;
    }
    if (!Barrier(a, 1, block, round, &aborted)) break;
    for (int s = 0; s < n; ++s) {
      if (s == rank) continue;
      const std::size_t ls = len(s);
      for (std::size_t v = first; v < ls; v += step) {
        out[s * seg + v] = __ldcg(peer[s] + half + cap + v);
      }
    }
  }

  // The last block to finish advances the round counter for the next call.
  __syncthreads();
  if (t == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(&counters[1], 1u);
    if (done == static_cast<uint32_t>(a.blocks) - 1) {
      counters[1] = 0;
      atomicExch(&counters[0], base + static_cast<uint32_t>(rounds));
      __threadfence();
    }
  }
}

// One rank per launch (`virtual_args` null), or a virtual team launched as
// one grid of nranks x blocks blocks: block i serves rank i / blocks.
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) AllReduceKernel(KernelArgs args,
                                                            const KernelArgs* virtual_args) {
  if (virtual_args == nullptr) {
    AllReduceRank<T>(args, blockIdx.x);
  } else {
    const int blocks = args.blocks;
    AllReduceRank<T>(virtual_args[blockIdx.x / blocks], blockIdx.x % blocks);
  }
}

using KernelFn = void (*)(KernelArgs, const KernelArgs*);

KernelFn KernelFor(DType dtype) {
  switch (dtype) {
    case DType::kF32: return AllReduceKernel<float>;
    case DType::kF64: return AllReduceKernel<double>;
    case DType::kBF16: return AllReduceKernel<__nv_bfloat16>;
    case DType::kF16: return AllReduceKernel<__half>;
    case DType::kS32: return AllReduceKernel<int32_t>;
    case DType::kS64: break;  // Not served on GPU (the lowering falls back to XLA).
  }
  return nullptr;
}

// --- Host helpers ------------------------------------------------------------

std::string Describe(cudaError_t err, const char* what) {
  return std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
}

#define LIBRA_CUDA_RETURN_IF_ERROR(expr)                   \
  do {                                                     \
    const cudaError_t libra_err_ = (expr);                 \
    if (libra_err_ != cudaSuccess) {                       \
      if (message) *message = Describe(libra_err_, #expr); \
      return libra_err_;                                   \
    }                                                      \
  } while (0)

// Restores the thread's current device, and its capture mode.
class DeviceScope {
 public:
  DeviceScope() {
    ok_ = cudaGetDevice(&device_) == cudaSuccess;
    mode_ = cudaStreamCaptureModeRelaxed;
    relaxed_ = cudaThreadExchangeStreamCaptureMode(&mode_) == cudaSuccess;
  }
  ~DeviceScope() {
    if (ok_) cudaSetDevice(device_);
    if (relaxed_) cudaThreadExchangeStreamCaptureMode(&mode_);
  }

 private:
  int device_ = 0;
  bool ok_ = false;
  cudaStreamCaptureMode mode_;
  bool relaxed_ = false;
};

cudaError_t CheckCall(const TeamView& view, const CallArgs& call, std::string* message) {
  auto invalid = [&](const std::string& what) {
    if (message) *message = what;
    return cudaErrorInvalidValue;
  };
  if (view.nranks < 1 || view.nranks > kMaxRanks || view.rank < 0 || view.rank >= view.nranks) {
    return invalid("libra cuda all-reduce: bad team view");
  }
  if (call.blocks < 1 || call.blocks > kMaxBlocks) {
    return invalid("libra cuda all-reduce: blocks must be in [1, " + std::to_string(kMaxBlocks) +
                   "], got " + std::to_string(call.blocks));
  }
  if (call.bytes % kVectorBytes != 0) {
    return invalid("libra cuda all-reduce: the byte count must be a multiple of 16, got " +
                   std::to_string(call.bytes));
  }
  if (call.bytes % SizeOf(call.dtype) != 0 || KernelFor(call.dtype) == nullptr) {
    return invalid("libra cuda all-reduce: bad dtype");
  }
  return cudaSuccess;
}

cudaError_t CheckPointers(const void* input, const void* output, std::string* message) {
  if (reinterpret_cast<uintptr_t>(input) % kVectorBytes != 0 ||
      reinterpret_cast<uintptr_t>(output) % kVectorBytes != 0) {
    if (message) *message = "libra cuda all-reduce: buffers must be 16-byte aligned";
    return cudaErrorMisalignedAddress;
  }
  return cudaSuccess;
}

KernelArgs MakeArgs(const TeamView& view, const CallArgs& call, const void* input,
                    void* output, int* blocks) {
  const Algorithm algorithm = Resolve(call.algorithm, call.bytes, view.nranks);
  *blocks = EffectiveBlocks(call.bytes, view.nranks, algorithm, call.blocks,
                            view.capacity_vectors * kVectorBytes);
  KernelArgs a;
  std::memset(static_cast<void*>(&a), 0, sizeof a);  // compared bytewise by virtual launches
  a.view = view;
  a.input = static_cast<const uint4*>(input);
  a.output = static_cast<uint4*>(output);
  a.vectors = call.bytes / kVectorBytes;
  a.two_shot = algorithm == Algorithm::kTwoShot ? 1 : 0;
  a.blocks = *blocks;
  a.timeout_ns = call.timeout_ns;
  return a;
}

}  // namespace

// --- Team --------------------------------------------------------------------

cudaError_t Team::Create(const std::vector<int>& devices, std::size_t capacity_bytes,
                         std::unique_ptr<Team>* team, std::string* message) {
  if (devices.empty() || devices.size() > static_cast<std::size_t>(kMaxRanks)) {
    if (message) *message = "libra cuda team: 1.." + std::to_string(kMaxRanks) + " devices";
    return cudaErrorInvalidValue;
  }
  for (std::size_t i = 0; i < devices.size(); ++i) {
    for (std::size_t j = 0; j < i; ++j) {
      if (devices[i] == devices[j]) {
        if (message) *message = "libra cuda team: a device appears twice";
        return cudaErrorInvalidValue;
      }
    }
  }
  DeviceScope scope;
  // Peer access among all members (XLA may have enabled it already).
  for (int a : devices) {
    LIBRA_CUDA_RETURN_IF_ERROR(cudaSetDevice(a));
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      LIBRA_CUDA_RETURN_IF_ERROR(cudaDeviceCanAccessPeer(&can, a, b));
      if (!can) {
        if (message) {
          *message = "libra cuda team: GPU " + std::to_string(a) + " cannot access GPU " +
                     std::to_string(b) + " (no P2P); set LIBRA_JAX_CUDA=xla to use XLA's all-reduce";
        }
        return cudaErrorPeerAccessUnsupported;
      }
      const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) {
        cudaGetLastError();  // clear it
      } else {
        LIBRA_CUDA_RETURN_IF_ERROR(err);
      }
    }
  }
  std::unique_ptr<Team> t(new Team());
  t->devices_ = devices;
  t->capacity_vectors_ = CapacityVectors(capacity_bytes, static_cast<int>(devices.size()));
  LIBRA_CUDA_RETURN_IF_ERROR(t->Allocate(message));
  *team = std::move(t);
  return cudaSuccess;
}

cudaError_t Team::CreateVirtual(int device, int nranks, std::size_t capacity_bytes,
                                std::unique_ptr<Team>* team, std::string* message) {
  if (nranks < 1 || nranks > kMaxRanks) {
    if (message) *message = "libra cuda team: 1.." + std::to_string(kMaxRanks) + " ranks";
    return cudaErrorInvalidValue;
  }
  DeviceScope scope;
  std::unique_ptr<Team> t(new Team());
  t->devices_.assign(nranks, device);
  t->capacity_vectors_ = CapacityVectors(capacity_bytes, nranks);
  LIBRA_CUDA_RETURN_IF_ERROR(t->Allocate(message));
  t->virtual_ = true;
  *team = std::move(t);
  return cudaSuccess;
}

cudaError_t Team::Allocate(std::string* message) {
  const int n = nranks();
  const std::size_t segcap = capacity_vectors_ / n;
  const std::size_t staging_bytes = 2 * (capacity_vectors_ + segcap) * kVectorBytes;
  const std::size_t flag_bytes = sizeof(uint32_t) * 2 * kMaxBlocks * kMaxRanks;
  memory_.assign(n, RankMemory{});
  LIBRA_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[0]));
  LIBRA_CUDA_RETURN_IF_ERROR(cudaHostAlloc(reinterpret_cast<void**>(&error_host_),
                                           sizeof(ErrorRecord),
                                           cudaHostAllocMapped | cudaHostAllocPortable));
  std::memset(const_cast<ErrorRecord*>(error_host_), 0, sizeof(ErrorRecord));
  LIBRA_CUDA_RETURN_IF_ERROR(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0));
  for (int r = 0; r < n; ++r) {
    LIBRA_CUDA_RETURN_IF_ERROR(cudaSetDevice(devices_[r]));
    RankMemory& m = memory_[r];
    LIBRA_CUDA_RETURN_IF_ERROR(cudaMalloc(&m.staging, staging_bytes));
    LIBRA_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&m.flags), flag_bytes));
    LIBRA_CUDA_RETURN_IF_ERROR(cudaMalloc(reinterpret_cast<void**>(&m.counters), 256));
    // Zeroed on a private stream: never on a stream that may be capturing.
    cudaStream_t stream;
    LIBRA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaError_t err = cudaMemsetAsync(m.flags, 0, flag_bytes, stream);
    if (err == cudaSuccess) err = cudaMemsetAsync(m.counters, 0, 256, stream);
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    cudaStreamDestroy(stream);
    LIBRA_CUDA_RETURN_IF_ERROR(err);
  }
  return cudaSuccess;
}

Team::~Team() {
  if (abandoned_) return;
  int current = 0;
  const bool restore = cudaGetDevice(&current) == cudaSuccess;
  for (std::size_t r = 0; r < memory_.size(); ++r) {
    if (cudaSetDevice(devices_[r]) != cudaSuccess) continue;
    cudaFree(memory_[r].staging);
    cudaFree(memory_[r].flags);
    cudaFree(memory_[r].counters);
  }
  if (!virtual_args_.empty() && cudaSetDevice(devices_[0]) == cudaSuccess) {
    for (auto& entry : virtual_args_) cudaFree(entry.second);
  }
  if (error_host_ != nullptr) cudaFreeHost(const_cast<ErrorRecord*>(error_host_));
  if (restore) cudaSetDevice(current);
}

TeamView Team::View(int rank) const {
  TeamView view;
  view.nranks = nranks();
  view.rank = rank;
  view.capacity_vectors = capacity_vectors_;
  for (int r = 0; r < nranks(); ++r) view.member[r] = memory_[r];
  view.error = error_device_;
  return view;
}

std::string Team::TakeError() {
  if (error_host_ == nullptr || error_host_->code == 0) return {};
  const ErrorRecord& e = *error_host_;
  std::string text = "rank " + std::to_string(e.rank) + " (GPU " +
                     std::to_string(e.rank < devices_.size() ? devices_[e.rank] : -1) +
                     "), block " + std::to_string(e.block) + ", timed out waiting for rank " +
                     std::to_string(e.peer) + " at round " + std::to_string(e.round) +
                     (e.stage ? " (mid barrier)" : " (start barrier)");
  error_host_->code = 0;
  return text;
}

// --- Launches ----------------------------------------------------------------

namespace {

const LaunchApi kCudaLaunchApi = {
    [](const void* kernel, dim3 grid, dim3 block, void** params, std::size_t shared,
       cudaStream_t stream) {
      return cudaLaunchKernel(kernel, grid, block, params, shared, stream);
    },
    [](const void* kernel, dim3 grid, dim3 block, void** params, std::size_t shared,
       cudaStream_t stream) {
      return cudaLaunchCooperativeKernel(kernel, grid, block, params, shared, stream);
    },
    [] { return cudaGetLastError(); },
};
LaunchApi g_launch_api = kCudaLaunchApi;

}  // namespace

LaunchApi SetLaunchApiForTesting(const LaunchApi* api) {
  const LaunchApi previous = g_launch_api;
  g_launch_api = api ? *api : kCudaLaunchApi;
  return previous;
}

cudaError_t LaunchKernel(bool cooperative, const void* kernel, dim3 grid, void** params,
                         cudaStream_t stream) {
  const auto launch = cooperative ? g_launch_api.launch_cooperative : g_launch_api.launch;
  const cudaError_t err = launch(kernel, grid, dim3(kThreads), params, 0, stream);
  // A launch error (a grid too large to be co-resident, an invalid configuration) is
  // not sticky: clear it, or the next cudaGetLastError() anywhere reports it again.
  if (err != cudaSuccess) g_launch_api.get_last_error();
  return err;
}

cudaError_t LaunchAllReduce(const TeamView& view, const CallArgs& call, cudaStream_t stream,
                            std::string* message) {
  LIBRA_CUDA_RETURN_IF_ERROR(CheckCall(view, call, message));
  LIBRA_CUDA_RETURN_IF_ERROR(CheckPointers(call.input, call.output, message));
  if (call.bytes == 0) return cudaSuccess;  // the same on every rank: nothing to do
  int blocks = 1;
  const KernelArgs args = MakeArgs(view, call, call.input, call.output, &blocks);
  KernelArgs grid_args = args;
  const KernelArgs* no_device_args = nullptr;  // read from `grid_args` (not virtual)
  void* params[] = {&grid_args, &no_device_args};
  LIBRA_CUDA_RETURN_IF_ERROR(LaunchKernel(
      false, reinterpret_cast<const void*>(KernelFor(call.dtype)), dim3(blocks), params, stream));
  return cudaSuccess;
}

cudaError_t LaunchVirtualAllReduce(const Team& team, const CallArgs& call,
                                   const std::vector<const void*>& inputs,
                                   const std::vector<void*>& outputs, cudaStream_t stream,
                                   std::string* message) {
  const int n = team.nranks();
  if (!team.virtual_ || static_cast<int>(inputs.size()) != n ||
      static_cast<int>(outputs.size()) != n) {
    if (message) *message = "libra cuda all-reduce: a virtual team needs one buffer per rank";
    return cudaErrorInvalidValue;
  }
  if (call.bytes == 0) return cudaSuccess;
  int blocks = 1;
  std::vector<KernelArgs> args(n);
  for (int r = 0; r < n; ++r) {
    const TeamView view = team.View(r);
    LIBRA_CUDA_RETURN_IF_ERROR(CheckCall(view, call, message));
    LIBRA_CUDA_RETURN_IF_ERROR(CheckPointers(inputs[r], outputs[r], message));
    args[r] = MakeArgs(view, call, inputs[r], outputs[r], &blocks);
  }
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(args.data());
  const std::vector<unsigned char> key(bytes, bytes + sizeof(KernelArgs) * n);
  void* uploaded = nullptr;
  for (const auto& entry : team.virtual_args_) {
    if (entry.first == key) uploaded = entry.second;
  }
  if (uploaded == nullptr) {
    LIBRA_CUDA_RETURN_IF_ERROR(cudaMalloc(&uploaded, key.size()));
    team.virtual_args_.emplace_back(key, uploaded);
    LIBRA_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(uploaded, key.data(), key.size(), cudaMemcpyHostToDevice));
  }
  KernelArgs grid_args = args[0];  // only `blocks` is read in virtual mode
  const KernelArgs* device_args = static_cast<const KernelArgs*>(uploaded);
  void* params[] = {&grid_args, &device_args};
  // cudaErrorCooperativeLaunchTooLarge (the grid cannot be co-resident) is returned as is,
  // and cleared from CUDA's last-error slot, like any failed launch (LaunchKernel).
  return LaunchKernel(true, reinterpret_cast<const void*>(KernelFor(call.dtype)),
                      dim3(n * blocks), params, stream);
}

cudaError_t MaxCoResidentBlocks(int* blocks) {
  std::string* message = nullptr;
  int device = 0, per_sm = 0, sms = 0;
  LIBRA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  LIBRA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  LIBRA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
      &per_sm, reinterpret_cast<const void*>(AllReduceKernel<float>), kThreads, 0));
  *blocks = per_sm * sms;
  return cudaSuccess;
}

}  // namespace libra::cuda
