// XLA FFI handlers (platform "CUDA"): the all-reduce over the libra CUDA
// kernels (cpp/libra/cuda) on XLA's stream, the same kernel as a start/done
// pair on libra's own stream (to run beside compute), and, across processes,
// NCCL with a per-call CTA limit (cpp/libra/nccl.h).
//
// One handler serves every device of a single-process, multi-GPU program.
// It knows its GPU from `DeviceOrdinal` and finds its rank and team in the
// `devices` attribute: the CUDA ordinals of every replica group, group after
// group, each in rank order (XLA's order). Teams are created on first use,
// once per process and set of GPUs (staging memory, flags and the peers'
// pointers, with peer access enabled), by whichever member gets there first:
// no host rendezvous, then or later. A call only launches one kernel on XLA's
// stream, whose round counters live on the GPU, so the handler is safe to
// capture in a CUDA graph (kCmdBufferCompatible).
//
// A kernel that timed out waiting for a peer leaves a record in host-mapped
// memory; the next call on that team returns it as DEADLINE_EXCEEDED and the
// team is replaced by a fresh one (the old memory is leaked: kernels may still
// hold it).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "libra/cuda/allreduce.h"
#include "libra/engine.h"  // StagingBytes
#include "libra/nccl.h"
#include "xla_ffi/handlers.h"

namespace libra_ffi {
namespace {

namespace lc = libra::cuda;

struct TeamRegistry {
  std::mutex mu;
  std::map<std::vector<int>, std::shared_ptr<lc::Team>> teams;
};

TeamRegistry& Registry() {
  static TeamRegistry* registry = new TeamRegistry();  // never destroyed (XLA threads)
  return *registry;
}

// LIBRA_JAX_CUDA_STAGING_MIB: staging capacity per round (default 32 MiB; libra::StagingBytes).
libra::Status CapacityBytes(std::size_t* bytes) {
  return libra::StagingBytes(std::getenv("LIBRA_JAX_CUDA_STAGING_MIB"),
                             lc::kDefaultCapacityBytes, bytes);
}

std::string Join(const std::vector<int>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// Checks a call, finds (or creates) its team and launches this GPU's kernel
// on `stream`.
ffi::Error Launch(cudaStream_t stream, int32_t device, ffi::AnyBuffer x, ffi::AnyBuffer out,
                  ffi::Span<const int32_t> devices, int64_t world, int64_t blocks,
                  int64_t algorithm, int64_t timeout_ms) {
  ffi::ErrorOr<lc::DType> dtype = ToEngineDType(x.element_type());
  if (!dtype.has_value()) return dtype.error();
  if (*dtype == lc::DType::kS64) {
    return ffi::Error::InvalidArgument("libra_jax CUDA all-reduce: s64 is not supported on GPU");
  }
  if (out.element_type() != x.element_type() || out.size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "libra_jax CUDA all-reduce: output must match the input's type and size");
  }
  if (world < 1 || world > lc::kMaxRanks || devices.size() % world != 0) {
    return ffi::Error::InvalidArgument("libra_jax CUDA all-reduce: bad device table");
  }
  if (algorithm < 0 || algorithm > 2) {
    return ffi::Error::InvalidArgument("libra_jax CUDA all-reduce: bad algorithm");
  }
  // This GPU's rank and team.
  std::size_t index = devices.size();
  for (std::size_t i = 0; i < devices.size(); ++i) {
    if (devices[i] == device) {
      index = i;
      break;
    }
  }
  if (index == devices.size()) {
    return ffi::Error::InvalidArgument("libra_jax CUDA all-reduce: GPU " + std::to_string(device) +
                                       " is not in the call's device table");
  }
  const std::size_t w = static_cast<std::size_t>(world);
  const int rank = static_cast<int>(index % w);
  const std::size_t first = index - index % w;
  std::vector<int> members(devices.begin() + first, devices.begin() + first + w);

  std::shared_ptr<lc::Team> team;
  {
    TeamRegistry& registry = Registry();
    std::lock_guard<std::mutex> lock(registry.mu);
    auto it = registry.teams.find(members);
    if (it != registry.teams.end()) {
      team = it->second;
      const std::string timeout = team->TakeError();
      if (!timeout.empty()) {
        team->Abandon();
        registry.teams.erase(it);
        return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                          "libra_jax CUDA all-reduce over GPUs " + Join(members) +
                              ": an earlier call failed: " + timeout +
                              " (LIBRA_JAX_TIMEOUT_S); the team was reset");
      }
    } else {
      std::unique_ptr<lc::Team> created;
      std::string message;
      std::size_t capacity = 0;
      const libra::Status setting = CapacityBytes(&capacity);
      if (!setting.ok()) return ffi::Error::InvalidArgument(setting.message);
      if (lc::Team::Create(members, capacity, &created, &message) != cudaSuccess) {
        return ffi::Error::Internal("libra_jax CUDA all-reduce over GPUs " + Join(members) +
                                    ": " + message);
      }
      team = std::move(created);
      registry.teams.emplace(members, team);
    }
  }

  lc::CallArgs call;
  call.dtype = *dtype;
  call.input = x.untyped_data();
  call.output = out.untyped_data();
  call.bytes = x.size_bytes();
  call.blocks = static_cast<int>(blocks);
  call.algorithm = static_cast<lc::Algorithm>(algorithm);
  call.timeout_ns = timeout_ms > 0 ? static_cast<uint64_t>(timeout_ms) * 1000000u : 0;
  std::string message;
  if (lc::LaunchAllReduce(team->View(rank), call, stream, &message) != cudaSuccess) {
    return ffi::Error::Internal("libra_jax CUDA all-reduce: " + message);
  }
  return ffi::Error::Success();
}

ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int32_t> devices,
                   int64_t world, int64_t blocks, int64_t algorithm, int64_t timeout_ms) {
  return Launch(stream, device, x, *out, devices, world, blocks, algorithm, timeout_ms);
}

// --- Start/done: the kernel on libra's own stream, beside XLA's compute ------
//
// start makes the GPU's communication stream wait for XLA's stream (the input
// is ready there), launches the kernel on it and keeps an event for its end,
// keyed by (GPU, call id); done makes XLA's stream wait for that event.
// start's output aliases its input (the packed bucket, reduced in place) and
// done's output aliases that buffer, its only reader: so XLA keeps it alive and
// unread until done, and copies nothing (a second reader of it, as done(s, s)
// was, makes copy insertion copy it on XLA's stream while the kernel may still
// write it). done's other operand is a token written by the latest start, which
// orders every done after the last start. Neither is command-buffer compatible:
// a graph would capture the event hand-off once.
struct AsyncCalls {
  std::mutex mu;
  std::map<int32_t, cudaStream_t> streams;                     // per GPU, never destroyed
  std::map<std::pair<int32_t, int64_t>, cudaEvent_t> pending;  // (GPU, call id) -> end
};

AsyncCalls& Async() {
  static AsyncCalls* calls = new AsyncCalls();  // never destroyed (XLA threads)
  return *calls;
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("libra_jax CUDA all-reduce: ") + what + ": " +
                              cudaGetErrorString(err));
}

ffi::Error ExecuteStart(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> token,
                        ffi::Span<const int32_t> devices, int64_t world, int64_t blocks,
                        int64_t algorithm, int64_t timeout_ms, int64_t call_id) {
  AsyncCalls& calls = Async();
  cudaStream_t comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(calls.mu);
    if (calls.pending.count({device, call_id})) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "libra_jax CUDA all-reduce: call " +
                                            std::to_string(call_id) +
                                            " started again before its done");
    }
    auto it = calls.streams.find(device);
    if (it == calls.streams.end()) {
      int current = -1;
      cudaError_t err = cudaGetDevice(&current);
      if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
      if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking);
      if (current >= 0 && current != device) cudaSetDevice(current);
      if (err != cudaSuccess) return CudaError("creating its stream", err);
      calls.streams.emplace(device, comm);
    } else {
      comm = it->second;
    }
  }
  cudaEvent_t ready = nullptr, end = nullptr;
  cudaError_t err = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventRecord(ready, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(comm, ready, 0);
  if (ready != nullptr) cudaEventDestroy(ready);  // released once recorded work is done
  if (err != cudaSuccess) return CudaError("ordering its stream after XLA's", err);
  ffi::Error launched = Launch(comm, device, x, *out, devices, world, blocks, algorithm,
                               timeout_ms);
  if (launched.failure()) return launched;
  err = cudaEventCreateWithFlags(&end, cudaEventDisableTiming);
  if (err == cudaSuccess) err = cudaEventRecord(end, comm);
  if (err != cudaSuccess) {
    if (end != nullptr) cudaEventDestroy(end);
    return CudaError("recording its end", err);
  }
  // The token only orders done after this start (by data): written on XLA's stream.
  err = cudaMemsetAsync(token->untyped_data(), 0, token->size_bytes(), stream);
  if (err != cudaSuccess) {
    cudaEventDestroy(end);
    return CudaError("writing its token", err);
  }
  std::lock_guard<std::mutex> lock(calls.mu);
  calls.pending[{device, call_id}] = end;
  return ffi::Error::Success();
}

ffi::Error ExecuteDone(cudaStream_t stream, int32_t device, ffi::AnyBuffer /*started*/,
                       ffi::AnyBuffer /*token*/, ffi::Result<ffi::AnyBuffer> /*out*/,
                       int64_t call_id) {
  cudaEvent_t end = nullptr;
  {
    AsyncCalls& calls = Async();
    std::lock_guard<std::mutex> lock(calls.mu);
    auto it = calls.pending.find({device, call_id});
    if (it == calls.pending.end()) {
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "libra_jax CUDA all-reduce: done of call " +
                                            std::to_string(call_id) + " without its start");
    }
    end = it->second;
    calls.pending.erase(it);
  }
  const cudaError_t err = cudaStreamWaitEvent(stream, end, 0);
  cudaEventDestroy(end);
  if (err != cudaSuccess) return CudaError("waiting for its end", err);
  return ffi::Error::Success();
}

// The P2P kernel's attributes, shared by the synchronous target and start.
template <typename Binding>
auto BindKernelAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const int32_t>>("devices")
      .template Attr<int64_t>("world")
      .template Attr<int64_t>("blocks")
      .template Attr<int64_t>("algorithm")
      .template Attr<int64_t>("timeout_ms");
}

// The kernel call's context and buffer (start adds its token result).
auto BindKernelBuffers() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Ret<ffi::AnyBuffer>();
}

auto BindKernelCall() { return BindKernelAttrs(BindKernelBuffers()); }

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduce, Execute, BindKernelCall(),
                              {ffi::Traits::kCmdBufferCompatible});

// --- Across processes: NCCL with the call's block count as its CTA limit -----
//
// `comm_ids` and `ranks` are indexed by this process's GPU ordinals: the
// communicator (registered by libra_jax._nccl at lowering) and rank of each.
// The first call on a communicator creates it (every rank does, in program
// order); NCCL needs the call's GPU current for that. Not command-buffer
// compatible: creation blocks on the host until every rank has joined.
//
// Flat (local_world 1): the GPU is one NCCL rank of the whole group.
// Hierarchical (local_world L > 1: this process holds L GPUs of the group,
// row `ordinal` of `local_teams` lists them): all on XLA's stream,
//   1. libra's P2P kernel sums the L local inputs into every local output;
//   2. local GPU j all-reduces slice j of that sum (HierarchicalSlice) over
//      NCCL with the j-th GPUs of the other processes (its communicator);
//   3. each GPU zeroes the slices it does not own, and a second P2P pass sums
//      them: every GPU gets every slice (an all-gather, exact: x + 0 = x).
// So NCCL moves 1/L of the buffer per GPU and the P2P kernels the rest.
// A failed NCCL call as XLA's error: a rank that never joined is DEADLINE_EXCEEDED, as on CPU.
ffi::Error NcclError(const libra::Status& status) {
  return status.code == libra::Status::Code::kDeadlineExceeded
             ? ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message)
             : ffi::Error::Internal(status.message);
}

ffi::Error ExecuteNccl(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                       ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> comm_ids,
                       ffi::Span<const int32_t> ranks, int64_t nranks, int64_t ctas,
                       ffi::Span<const int32_t> local_teams, int64_t local_world,
                       int64_t timeout_ms) {
  ffi::ErrorOr<lc::DType> dtype = ToEngineDType(x.element_type());
  if (!dtype.has_value()) return dtype.error();
  if (out->element_type() != x.element_type() || out->size_bytes() != x.size_bytes()) {
    return ffi::Error::InvalidArgument(
        "libra_jax NCCL all-reduce: output must match the input's type and size");
  }
  if (device < 0 || static_cast<std::size_t>(device) >= comm_ids.size() ||
      comm_ids.size() != ranks.size() || comm_ids[device] < 0 || local_world < 1 ||
      local_teams.size() != comm_ids.size() * static_cast<std::size_t>(local_world)) {
    return ffi::Error::InvalidArgument("libra_jax NCCL all-reduce: GPU " +
                                       std::to_string(device) +
                                       " has no communicator in this call's tables");
  }
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("libra_jax NCCL all-reduce: ") +
                                cudaGetErrorString(err));
  }
  libra::nccl::Communicators& comms = libra::nccl::Communicators::Get();
  ffi::Error result = ffi::Error::Success();
  if (local_world == 1) {
    const libra::Status status = comms.AllReduce(
        comm_ids[device], static_cast<int>(nranks), ranks[device], static_cast<int>(ctas),
        x.untyped_data(), out->untyped_data(), x.element_count(), *dtype, stream, timeout_ms);
    if (!status.ok()) result = NcclError(status);
  } else {
    const std::size_t row = static_cast<std::size_t>(device * local_world);
    ffi::Span<const int32_t> team(local_teams.begin() + row, local_world);
    int j = 0;
    while (j < local_world && team[j] != device) ++j;
    const std::size_t itemsize = lc::SizeOf(*dtype);
    const auto [offset, n] = libra::nccl::HierarchicalSlice(
        x.element_count(), static_cast<int>(local_world), j);
    char* base = static_cast<char*>(out->untyped_data());
    result = Launch(stream, device, x, *out, team, local_world, ctas, 0, timeout_ms);
    if (result.success() && n > 0) {
      const libra::Status status = comms.AllReduce(
          comm_ids[device], static_cast<int>(nranks), ranks[device], static_cast<int>(ctas),
          base + offset * itemsize, base + offset * itemsize, n, *dtype, stream, timeout_ms);
      if (!status.ok()) result = NcclError(status);
    }
    if (result.success()) {
      const std::size_t end = (offset + n) * itemsize;
      err = cudaMemsetAsync(base, 0, offset * itemsize, stream);
      if (err == cudaSuccess) err = cudaMemsetAsync(base + end, 0, out->size_bytes() - end, stream);
      result = err == cudaSuccess ? Launch(stream, device, *out, *out, team, local_world, ctas, 0,
                                           timeout_ms)
                                  : CudaError("zeroing the slices of other GPUs", err);
    }
  }
  if (current >= 0 && current != device) cudaSetDevice(current);  // best effort restore
  return result;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllReduce, ExecuteNccl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<ffi::Span<const int64_t>>("comm_ids")
                                  .Attr<ffi::Span<const int32_t>>("ranks")
                                  .Attr<int64_t>("nranks")
                                  .Attr<int64_t>("ctas")
                                  .Attr<ffi::Span<const int32_t>>("local_teams")
                                  .Attr<int64_t>("local_world")
                                  .Attr<int64_t>("timeout_ms"));

// Start: the kernel call's operand, its result (in place) and a token for done.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduceStart, ExecuteStart,
                              BindKernelAttrs(BindKernelBuffers().Ret<ffi::AnyBuffer>())
                                  .Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduceDone, ExecuteDone,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("call_id"));

int CudaEffectiveBlocks(std::size_t bytes, int nranks, int algorithm, int blocks) {
  std::size_t capacity = 0;
  const libra::Status setting = CapacityBytes(&capacity);
  if (!setting.ok()) throw std::invalid_argument(setting.message);  // a ValueError in Python
  return lc::EffectiveBlocks(bytes, nranks, static_cast<lc::Algorithm>(algorithm), blocks,
                             capacity);
}

}  // namespace libra_ffi

static_assert(libra_ffi::kCudaMaxRanks == libra::cuda::kMaxRanks);
