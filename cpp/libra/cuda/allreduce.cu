// libra CUDA all-reduce kernels and team memory (see allreduce.h). The
// protocol itself (and why re-using a staging half is safe) is
// libra/cuda/protocol.h; this file gives it the GPU's memory operations
// (DeviceOps) and instantiates it.
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

// --- Device code -------------------------------------------------------------

namespace {

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

// An element-wise sum of 16-byte vectors of T, in T's accumulator type.
template <typename T>
struct VectorSum {
  static constexpr int kElems = kVectorBytes / sizeof(T);
  using A = typename Accumulate<T>::A;
  struct Acc {
    A e[kElems];
  };
  static __device__ __forceinline__ Acc Zero() {
    Acc acc;
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc.e[e] = A(0);
    return acc;
  }
  static __device__ __forceinline__ void Add(Acc& acc, uint4 v) {
    T x[kElems];
    memcpy(x, &v, kVectorBytes);
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc.e[e] = acc.e[e] + Accumulate<T>::To(x[e]);
  }
  static __device__ __forceinline__ uint4 Finish(const Acc& acc) {
    T y[kElems];
#pragma unroll
    for (int e = 0; e < kElems; ++e) y[e] = Accumulate<T>::From(acc.e[e]);
    uint4 out;
    memcpy(&out, y, kVectorBytes);
    return out;
  }
};

// The GPU's memory operations for the protocol (protocol.h): one thread a
// lane, flags with system-scope release/acquire (peers on other GPUs read
// and write them), peer staging read through L2 only (ld.global.cg: L1 is
// not coherent with a peer's writes).
template <typename T>
struct DeviceOps {
  using Vec = uint4;
  static constexpr int kLanes = kThreads;
  static constexpr uint32_t kPollEvery = 1024;  // spins between error/timeout checks

  __device__ __forceinline__ int FirstLane() const { return threadIdx.x; }
  __device__ __forceinline__ void SyncBlock() const { __syncthreads(); }
  __device__ __forceinline__ void FenceSystem() const { __threadfence_system(); }
  __device__ __forceinline__ void Pause() const {}
  __device__ __forceinline__ void StoreRelease(uint32_t* address, uint32_t value) const {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
  }
  __device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* address) const {
    uint32_t value;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
    return value;
  }
  __device__ __forceinline__ uint64_t NowNs() const {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ __forceinline__ Vec LoadInput(const Vec* p) const { return *p; }
  __device__ __forceinline__ Vec LoadPeer(const Vec* p) const { return __ldcg(p); }
  __device__ __forceinline__ void Store(Vec* p, Vec v) const { *p = v; }
  // A peer's signature word: read past L1 (not coherent with the peer's write).
  __device__ __forceinline__ uint32_t Load(const uint32_t* p) const { return __ldcv(p); }
  __device__ __forceinline__ void Store(uint32_t* p, uint32_t v) const {
    *reinterpret_cast<volatile uint32_t*>(p) = v;
  }
  // Sums in T's accumulator (fp32 for bf16/f16; wrapping for s32), from +0.
  using Acc = typename VectorSum<T>::Acc;
  __device__ __forceinline__ Acc Zero() const { return VectorSum<T>::Zero(); }
  __device__ __forceinline__ void Add(Acc& acc, Vec v) const { VectorSum<T>::Add(acc, v); }
  __device__ __forceinline__ Vec Finish(const Acc& acc) const { return VectorSum<T>::Finish(acc); }
  // The round counter, written by the previous kernel on this stream.
  __device__ __forceinline__ uint32_t LoadCounter(uint32_t* counters) const {
    return *reinterpret_cast<volatile uint32_t*>(&counters[0]);
  }
  // Whether this block is the kernel's last to finish (then resets the count).
  __device__ __forceinline__ bool ArriveDone(uint32_t* counters, int blocks) const {
    __threadfence();
    if (atomicAdd(&counters[1], 1u) != static_cast<uint32_t>(blocks) - 1) return false;
    counters[1] = 0;
    return true;
  }
  __device__ __forceinline__ void PublishRound(uint32_t* counters, uint32_t round) const {
    atomicExch(&counters[0], round);
    __threadfence();
  }
  __device__ __forceinline__ uint32_t ErrorCode(const ErrorRecord* e) const { return e->code; }
  // The record is in host-mapped memory that every GPU of the team writes.
  __device__ __forceinline__ bool ClaimError(ErrorRecord* e) const {
    return atomicCAS_system(const_cast<unsigned int*>(&e->code), 0u, 2u) == 0u;
  }
  __device__ __forceinline__ void PublishError(ErrorRecord* e) const {
    __threadfence_system();
    e->code = 1;
    __threadfence_system();
  }
};

// One rank of a team of at most N ranks per launch. 512 threads and at least
// kMinBlocksPerSm blocks per SM: at most 64 registers a thread (protocol.h
// says why; cpp/tools/kernel_resources.py checks it for every build arch).
template <typename T, int N>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm) AllReduceKernel(RankCall call) {
  __shared__ int aborted;
  if (threadIdx.x == 0) aborted = 0;
  DeviceOps<T> ops;
  protocol::RankBody<N>(ops, call, blockIdx.x, &aborted);
}

// Every rank of a virtual team (N ranks on one GPU, the harness's) as one
// cooperative grid of N x blocks blocks: block i serves rank i / blocks. The
// calls are a kernel parameter (constant bank, indexed where used; a copy in
// registers or shared memory spills), so a captured graph keeps its own.
struct VirtualCalls {
  RankCallOf<kMaxVirtualMembers> call[kMaxRanks];
};
// Kernel parameters beyond 4 KiB need CUDA 12.1 and a driver to match: not asked for.
static_assert(sizeof(VirtualCalls) <= 4000, "kernel parameters are limited to 4 KiB");
static_assert(sizeof(RankCall) <= 4000, "kernel parameters are limited to 4 KiB");

// Its own resource choice: 1 block per SM (up to 128 registers). At 64, the
// indexed reads of its calls spill 8-48 bytes (nvcc 13); it is the harness's
// (N ranks' correctness and timings on one GPU), not the path XLA calls, so
// what a Libra block costs beside compute is measured on AllReduceKernel.
inline constexpr int kVirtualBlocksPerSm = 1;

template <typename T, int N>
__global__ void __launch_bounds__(kThreads, kVirtualBlocksPerSm)
    VirtualAllReduceKernel(VirtualCalls calls) {
  __shared__ int aborted;
  if (threadIdx.x == 0) aborted = 0;
  DeviceOps<T> ops;
  const int blocks = calls.call[0].blocks;
  protocol::RankBody<N>(ops, calls.call[blockIdx.x / blocks], blockIdx.x % blocks, &aborted);
}

// The instantiation of team size `nranks`: N = 4 up to 4 ranks, else 8 (an
// N = 2 form spills on sm_80 at 64 registers, and would save little: the
// loops over ranks are bounded by n, not N). The virtual-rank kernel (the
// harness's) is instantiated for N = 8 only.
int KernelRanks(int nranks) { return nranks <= 4 ? 4 : 8; }

template <typename T>
const void* KernelOf(int nranks, bool virtual_team) {
  if (virtual_team) return reinterpret_cast<const void*>(VirtualAllReduceKernel<T, kMaxRanks>);
  switch (KernelRanks(nranks)) {
    case 4: return reinterpret_cast<const void*>(AllReduceKernel<T, 4>);
    default: return reinterpret_cast<const void*>(AllReduceKernel<T, 8>);
  }
}

// The kernel for a dtype and team size; nullptr for a dtype not served.
const void* KernelFor(DType dtype, int nranks, bool virtual_team = false) {
  switch (dtype) {
    case DType::kF32: return KernelOf<float>(nranks, virtual_team);
    case DType::kF64: return KernelOf<double>(nranks, virtual_team);
    case DType::kBF16: return KernelOf<__nv_bfloat16>(nranks, virtual_team);
    case DType::kF16: return KernelOf<__half>(nranks, virtual_team);
    case DType::kS32: return KernelOf<int32_t>(nranks, virtual_team);
    case DType::kS64: break;  // Not served on GPU (the lowering falls back to XLA).
    case DType::kBytes: break;  // Copies only: never summed.
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
  if (call.members.empty() || call.members.size() > static_cast<std::size_t>(kMaxMembers)) {
    return invalid("libra cuda all-reduce: a launch takes 1 to " + std::to_string(kMaxMembers) +
                   " members, got " + std::to_string(call.members.size()));
  }
  if (KernelFor(call.dtype, view.nranks) == nullptr) {
    return invalid("libra cuda all-reduce: bad dtype");
  }
  std::size_t vectors = 0;
  for (const Buffer& member : call.members) {
    vectors += member.bytes / kVectorBytes;
    if (vectors > kMaxCallVectors) {
      return invalid("libra cuda all-reduce: a launch takes at most " +
                     std::to_string(kMaxCallVectors * kVectorBytes) + " bytes");
    }
    if (member.bytes % kVectorBytes != 0) {
      return invalid("libra cuda all-reduce: a member's byte count must be a multiple of 16, "
                     "got " + std::to_string(member.bytes));
    }
    if (member.bytes % SizeOf(call.dtype) != 0) return invalid("libra cuda all-reduce: bad dtype");
  }
  return cudaSuccess;
}

cudaError_t CheckPointers(const std::vector<Buffer>& members, std::string* message) {
  for (const Buffer& member : members) {
    if (reinterpret_cast<uintptr_t>(member.input) % kVectorBytes != 0 ||
        reinterpret_cast<uintptr_t>(member.output) % kVectorBytes != 0) {
      if (message) *message = "libra cuda all-reduce: buffers must be 16-byte aligned";
      return cudaErrorMisalignedAddress;
    }
  }
  return cudaSuccess;
}

std::size_t TotalBytes(const std::vector<Buffer>& members) {
  std::size_t bytes = 0;
  for (const Buffer& member : members) bytes += member.bytes;
  return bytes;
}

// The kernel's call for one rank's members (at most M, checked before).
template <int M>
RankCallOf<M> MakeArgs(const TeamView& view, const CallArgs& call,
                       const std::vector<Buffer>& members, int* blocks) {
  Member table[M] = {};
  const int count = static_cast<int>(std::min<std::size_t>(members.size(), M));
  for (int m = 0; m < count; ++m) {
    table[m] = {members[m].input, members[m].output,
                static_cast<uint32_t>(members[m].bytes / kVectorBytes), 0};
  }
  const RankCallOf<M> a = MakeRankCall<M>(view, call.algorithm, table, count, call.blocks,
                                          call.timeout_ns, call.signature);
  *blocks = a.blocks;
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
  const std::size_t flag_bytes = sizeof(uint32_t) * kFlagWords;
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

std::string Team::Failure() const {
  if (error_host_ == nullptr || error_host_->code == 0) return {};
  const ErrorRecord& e = *error_host_;
  if (e.code != 1) return "a rank timed out (its record was still being written)";
  return "rank " + std::to_string(e.rank) + " (GPU " +
         std::to_string(e.rank < devices_.size() ? devices_[e.rank] : -1) + "), block " +
         std::to_string(e.block) +
         (e.kind == 1 ? ", found rank " + std::to_string(e.peer) + " in another call"
                      : ", timed out waiting for rank " + std::to_string(e.peer)) +
         " at round " + std::to_string(e.round) +
         (e.stage ? " (mid barrier)" : " (start barrier)");
}

std::string Team::TakeError() {
  std::string text = Failure();
  if (error_host_ != nullptr) error_host_->code = 0;
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

cudaError_t CreatePriorityStream(cudaStream_t* stream, std::string* message) {
  const auto range = g_launch_api.stream_priority_range
                         ? g_launch_api.stream_priority_range
                         : [](int* least, int* greatest) {
                             return cudaDeviceGetStreamPriorityRange(least, greatest);
                           };
  const auto create = g_launch_api.create_stream
                          ? g_launch_api.create_stream
                          : [](cudaStream_t* s, unsigned int flags, int priority) {
                              return cudaStreamCreateWithPriority(s, flags, priority);
                            };
  int least = 0, greatest = 0;
  LIBRA_CUDA_RETURN_IF_ERROR(range(&least, &greatest));
  LIBRA_CUDA_RETURN_IF_ERROR(create(stream, cudaStreamNonBlocking, greatest));
  return cudaSuccess;
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
  LIBRA_CUDA_RETURN_IF_ERROR(CheckPointers(call.members, message));
  if (TotalBytes(call.members) == 0) return cudaSuccess;  // the same on every rank: nothing to do
  int blocks = 1;
  RankCall args = MakeArgs<kMaxMembers>(view, call, call.members, &blocks);
  void* params[] = {&args};
  LIBRA_CUDA_RETURN_IF_ERROR(
      LaunchKernel(false, KernelFor(call.dtype, view.nranks), dim3(blocks), params, stream));
  return cudaSuccess;
}

cudaError_t LaunchVirtualAllReduce(const Team& team, const CallArgs& call,
                                   const std::vector<std::vector<Buffer>>& members,
                                   cudaStream_t stream, std::string* message) {
  const int n = team.nranks();
  if (!team.virtual_ || static_cast<int>(members.size()) != n) {
    if (message) *message = "libra cuda all-reduce: a virtual team needs members for each rank";
    return cudaErrorInvalidValue;
  }
  for (int r = 0; r < n; ++r) {
    bool same = members[r].size() == members[0].size() &&
                members[r].size() <= static_cast<std::size_t>(kMaxVirtualMembers);
    for (std::size_t m = 0; same && m < members[r].size(); ++m) {
      same = members[r][m].bytes == members[0][m].bytes;
    }
    if (!same) {
      if (message) {
        *message = "libra cuda all-reduce: a virtual team's ranks need the same members, at "
                   "most " + std::to_string(kMaxVirtualMembers);
      }
      return cudaErrorInvalidValue;
    }
  }
  int blocks = 1;
  VirtualCalls calls;
  std::memset(static_cast<void*>(&calls), 0, sizeof calls);
  for (int r = 0; r < n; ++r) {
    const TeamView view = team.View(r);
    CallArgs rank_call = call;
    rank_call.members = members[r];
    LIBRA_CUDA_RETURN_IF_ERROR(CheckCall(view, rank_call, message));
    LIBRA_CUDA_RETURN_IF_ERROR(CheckPointers(members[r], message));
    calls.call[r] = MakeArgs<kMaxVirtualMembers>(view, call, members[r], &blocks);
  }
  if (TotalBytes(members[0]) == 0) return cudaSuccess;
  void* params[] = {&calls};
  // cudaErrorCooperativeLaunchTooLarge (the grid cannot be co-resident) is returned as is,
  // and cleared from CUDA's last-error slot, like any failed launch (LaunchKernel).
  return LaunchKernel(true, KernelFor(call.dtype, n, /*virtual_team=*/true), dim3(n * blocks),
                      params, stream);
}

cudaError_t MaxCoResidentBlocks(int* blocks, bool virtual_team) {
  std::string* message = nullptr;
  int device = 0, sms = 0, least = 0;
  LIBRA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  LIBRA_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const DType dtypes[] = {DType::kF32, DType::kF64, DType::kBF16, DType::kF16, DType::kS32};
  bool any = false;
  for (DType dtype : dtypes) {
    for (int nranks : {4, 8}) {
      int per_sm = 0;
      LIBRA_CUDA_RETURN_IF_ERROR(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &per_sm, KernelFor(dtype, nranks, virtual_team), kThreads, 0));
      least = any ? std::min(least, per_sm) : per_sm;
      any = true;
    }
  }
  *blocks = least * sms;
  return cudaSuccess;
}

}  // namespace libra::cuda
