// XLA FFI handlers (platform "CUDA"): the all-reduce over the libra CUDA
// kernels (cpp/libra/cuda) on XLA's stream, the same kernel as a start/done
// pair on libra's own stream (to run beside compute, libra/streams.h), and
// NCCL with a per-call CTA limit (cpp/libra/nccl.h), in one process or across
// processes, always on libra's stream: as one call or as start/done.
//
// One handler serves every device of a single-process, multi-GPU program.
// It knows its GPU from `DeviceOrdinal` and finds its rank and team in the
// `devices` attribute: the CUDA ordinals of every replica group, group after
// group, each in rank order (XLA's order). Teams are created on first use,
// once per process, set of GPUs and stream (staging memory, flags and the
// peers' pointers, with peer access enabled), by whichever member gets there
// first: no host rendezvous, then or later.
//
// One team per stream: a synchronous call runs on XLA's stream, a start on
// libra's; the calls of one stream follow the program's order on every GPU,
// but two streams' kernels may interleave differently on each, and a team's
// rounds pair the n-th call of every rank (libra/cuda/protocol.h). So XLA's
// stream and libra's stream each get their own team of every group (twice
// the staging memory). This assumes XLA issues every synchronous call of a
// device on one stream (its compute stream).
//
// Not command-buffer compatible: each call carries host state (its execution's
// RunId and its index in it, the signature its kernel checks against every
// peer's), and a graph replay would neither refresh that nor report a
// kernel's error, which the handler reads when called.
//
// A kernel that timed out waiting for a peer, or found a peer in another call,
// leaves a record in host-mapped memory and ends; its team is dead (every later
// kernel on it ends at once). A call that finds the record fails with
// DEADLINE_EXCEEDED, and so does every later call of each execution that made a
// call on the dead team, on every GPU; the next execution that never touched
// it gets a fresh team on every GPU, from its first call (lc::TeamGenerations;
// the old memory is leaked: kernels may still hold it).
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
#include "libra/streams.h"
#include "xla_ffi/handlers.h"

namespace libra_ffi {
namespace {

namespace lc = libra::cuda;

// The streams a team serves: XLA's (the synchronous call) and libra's (start).
enum StreamKind : int { kXlaStream = 0, kLibraStream = 1 };
const char* StreamName(int stream) { return stream == kXlaStream ? "XLA's" : "libra's"; }

struct TeamRegistry {
  std::mutex mu;
  // Per (GPUs, stream): the group's team on that stream, across errors.
  std::map<std::pair<std::vector<int>, int>, std::unique_ptr<lc::TeamSlot<lc::Team>>> teams;
  lc::CoResidency co_residency;
  std::map<int, int> co_resident_blocks;  // per GPU: of the per-rank kernels
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

// How many blocks of the per-rank kernels fit on `device` at once (cached).
ffi::ErrorOr<int> CoResidentBlocks(TeamRegistry& registry, int device) {
  auto it = registry.co_resident_blocks.find(device);
  if (it != registry.co_resident_blocks.end()) return it->second;
  int current = -1, blocks = 0;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  if (err == cudaSuccess) err = lc::MaxCoResidentBlocks(&blocks);
  if (current >= 0 && current != device) cudaSetDevice(current);
  if (err != cudaSuccess) {
    return ffi::Unexpected(ffi::Error::Internal(
        std::string("libra_jax CUDA all-reduce: querying co-resident blocks: ") +
        cudaGetErrorString(err)));
  }
  registry.co_resident_blocks[device] = blocks;
  return blocks;
}

// One member of a call: its operand and its result (the same buffer where aliased).
struct KernelMember {
  ffi::AnyBuffer x;
  ffi::AnyBuffer out;
};

// The members of a P2P call: its first `count` operands and results, or what is wrong.
ffi::Error KernelMembers(ffi::RemainingArgs args, ffi::RemainingRets rets, std::size_t count,
                         std::vector<KernelMember>* members) {
  if (count == 0 || args.size() < count || rets.size() < count) {
    return ffi::Error::InvalidArgument(
        "libra_jax CUDA all-reduce: one operand and one result per member");
  }
  for (std::size_t i = 0; i < count; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return x.error();
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = rets.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return out.error();
    members->push_back({*x, **out});
  }
  return ffi::Error::Success();
}

// Checks a call of execution `run` over `members` (a bucket's, of one dtype, each whole
// 16-byte vectors), finds (or creates) its team on `stream_kind` and launches this GPU's
// kernels on `stream`: one per kMaxMembers members (the launch's table), each a call of the
// team (its own signature), in the same order on every GPU.
ffi::Error Launch(cudaStream_t stream, int stream_kind, int32_t device, int64_t run,
                  const std::vector<KernelMember>& members, ffi::Span<const int32_t> devices,
                  int64_t world, int64_t blocks, int64_t algorithm, int64_t timeout_ms) {
  const ffi::DataType type = members.front().x.element_type();
  ffi::ErrorOr<lc::DType> dtype = ToEngineDType(type);
  if (!dtype.has_value()) return dtype.error();
  if (*dtype == lc::DType::kS64) {
    return ffi::Error::InvalidArgument("libra_jax CUDA all-reduce: s64 is not supported on GPU");
  }
  for (const KernelMember& m : members) {
    if (m.x.element_type() != type || m.out.element_type() != type ||
        m.out.size_bytes() != m.x.size_bytes()) {
      return ffi::Error::InvalidArgument(
          "libra_jax CUDA all-reduce: every member and its output must have the first "
          "member's type, each output its input's size");
    }
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
  std::vector<int> gpus(devices.begin() + first, devices.begin() + first + w);

  const std::string group = "libra_jax CUDA all-reduce over GPUs " + Join(gpus) + " (" +
                            StreamName(stream_kind) + " stream)";
  for (std::size_t part = 0; part < members.size(); part += lc::kMaxMembers) {
    lc::CallArgs call;
    call.dtype = *dtype;
    for (std::size_t i = part; i < members.size() && i < part + lc::kMaxMembers; ++i) {
      call.members.push_back(
          {members[i].x.untyped_data(), members[i].out.untyped_data(), members[i].x.size_bytes()});
    }
    call.blocks = static_cast<int>(blocks);
    call.algorithm = static_cast<lc::Algorithm>(algorithm);
    call.timeout_ns = timeout_ms > 0 ? static_cast<uint64_t>(timeout_ms) * 1000000u : 0;
    std::size_t bytes = 0;
    for (const lc::Buffer& b : call.members) bytes += b.bytes;
    std::shared_ptr<lc::Team> team;
    {
      TeamRegistry& registry = Registry();
      std::lock_guard<std::mutex> lock(registry.mu);
      std::unique_ptr<lc::TeamSlot<lc::Team>>& slot = registry.teams[{gpus, stream_kind}];
      if (!slot) slot = std::make_unique<lc::TeamSlot<lc::Team>>();
      std::string message;
      const auto create = [&](std::string* why) -> std::shared_ptr<lc::Team> {
        std::size_t capacity = 0;
        const libra::Status setting = CapacityBytes(&capacity);
        if (!setting.ok()) {
          *why = setting.message;
          return nullptr;
        }
        std::unique_ptr<lc::Team> created;
        if (lc::Team::Create(gpus, capacity, &created, why) != cudaSuccess) return nullptr;
        return std::shared_ptr<lc::Team>(std::move(created));
      };
      const auto failure = [](const lc::Team& t) { return t.Failure(); };
      const auto retire = [](lc::Team& t) { t.Abandon(); };  // its kernels may still hold it
      switch (slot->Enter(run, rank, create, failure, retire, &team, &call.signature,
                          &message)) {
        case lc::TeamSlot<lc::Team>::Outcome::kLaunch: break;
        case lc::TeamSlot<lc::Team>::Outcome::kDoomed:
          return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                            group + ": this execution met a failed call: " + message +
                                " (LIBRA_JAX_TIMEOUT_S); it fails on every GPU of the group, "
                                "and the next execution gets a fresh team");
        case lc::TeamSlot<lc::Team>::Outcome::kFailedNow:
          return ffi::Error(ffi::ErrorCode::kDeadlineExceeded,
                            group + ": an earlier call failed: " + message +
                                " (LIBRA_JAX_TIMEOUT_S); this execution fails on every GPU of "
                                "the group, and the next one gets a fresh team");
        case lc::TeamSlot<lc::Team>::Outcome::kCreateError:
          return ffi::Error::Internal(group + ": " + message);
      }
      // The co-residency bound: libra's spinning kernels on this GPU, all streams.
      ffi::ErrorOr<int> capacity = CoResidentBlocks(registry, device);
      if (!capacity.has_value()) return capacity.error();
      const int effective = lc::EffectiveBlocks(bytes, static_cast<int>(world), call.algorithm,
                                                call.blocks, team->capacity_bytes());
      std::string crowded;
      if (!registry.co_residency.Admit(device, stream_kind, effective, *capacity, &crowded)) {
        return ffi::Error(ffi::ErrorCode::kResourceExhausted, group + ": " + crowded);
      }
    }
    std::string message;
    if (lc::LaunchAllReduce(team->View(rank), call, stream, &message) != cudaSuccess) {
      return ffi::Error::Internal("libra_jax CUDA all-reduce: " + message);
    }
  }
  return ffi::Error::Success();
}

// The synchronous call: the members (operands) and their results, in the same order.
ffi::Error Execute(cudaStream_t stream, int32_t device, ffi::RunId run, ffi::RemainingArgs args,
                   ffi::RemainingRets rets, ffi::Span<const int32_t> devices, int64_t world,
                   int64_t blocks, int64_t algorithm, int64_t timeout_ms) {
  std::vector<KernelMember> members;
  if (ffi::Error got = KernelMembers(args, rets, rets.size(), &members); got.failure()) {
    return got;
  }
  return Launch(stream, kXlaStream, device, run.run_id, members, devices, world, blocks,
                algorithm, timeout_ms);
}

// --- Start/done: the kernel on libra's own stream, beside XLA's compute ------
//
// start makes libra's stream on the GPU wait for XLA's stream (the input is
// ready there), launches the kernel on it and keeps an event for its end,
// keyed by (GPU, call id); done makes XLA's stream wait for that event
// (libra/streams.h). start's outputs alias its inputs (a bucket's members,
// reduced in place) and done's outputs alias those buffers, their only reader: so
// XLA keeps them alive and unread until done, and copies nothing (a second reader
// of one, as done(s, s) was, makes copy insertion copy it on XLA's stream while
// the kernel may still write it). done's other operand is a token written by
// the latest start, which orders every done after the last start. Neither is
// command-buffer compatible: a graph would capture the event hand-off once.
// NCCL's start/done (below) share the stream and the hand-off. A start whose
// execution failed before its done leaves its entry; a later start drops it once
// its work has ended and its done is overdue (SideStreams::Start), and
// cuda_pending_starts() counts the entries.

libra::Status CudaStatus(const char* what, cudaError_t err) {
  return libra::Status::Error(libra::Status::Code::kInternal,
                              std::string(what) + ": " + cudaGetErrorString(err));
}

// The CUDA runtime calls of libra's streams.
const libra::StreamOps kCudaStreamOps = {
    /*create=*/[](int device, void** stream) {
      int current = -1;
      cudaError_t err = cudaGetDevice(&current);
      if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
      cudaStream_t created = nullptr;
      std::string message = "cudaSetDevice";
      if (err == cudaSuccess) err = lc::CreatePriorityStream(&created, &message);
      if (current >= 0 && current != device) cudaSetDevice(current);
      *stream = created;
      return err == cudaSuccess ? libra::Status::Ok() : CudaStatus(message.c_str(), err);
    },
    /*record=*/[](void* stream, void** event) {
      cudaEvent_t created = nullptr;
      cudaError_t err = cudaEventCreateWithFlags(&created, cudaEventDisableTiming);
      if (err == cudaSuccess) err = cudaEventRecord(created, static_cast<cudaStream_t>(stream));
      if (err != cudaSuccess) {
        if (created != nullptr) cudaEventDestroy(created);
        return CudaStatus("cudaEventRecord", err);
      }
      *event = created;
      return libra::Status::Ok();
    },
    /*wait=*/[](void* stream, void* event) {
      const cudaError_t err = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                                  static_cast<cudaEvent_t>(event), 0);
      cudaEventDestroy(static_cast<cudaEvent_t>(event));  // released once its work is done
      return err == cudaSuccess ? libra::Status::Ok() : CudaStatus("cudaStreamWaitEvent", err);
    },
    /*query=*/[](void* event) {
      const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
      return err == cudaSuccess ? 1 : err == cudaErrorNotReady ? 0 : -1;
    },
    /*release=*/[](void* event) { cudaEventDestroy(static_cast<cudaEvent_t>(event)); },
};

libra::SideStreams& Side() {
  static libra::SideStreams* streams = new libra::SideStreams(kCudaStreamOps);  // never destroyed
  return *streams;
}

ffi::Error CudaError(const char* what, cudaError_t err) {
  return ffi::Error::Internal(std::string("libra_jax CUDA all-reduce: ") + what + ": " +
                              cudaGetErrorString(err));
}

// The token only orders done after this start (by data): written on XLA's stream.
ffi::Error WriteToken(cudaStream_t stream, ffi::AnyBuffer token) {
  const cudaError_t err = cudaMemsetAsync(token.untyped_data(), 0, token.size_bytes(), stream);
  return err == cudaSuccess ? ffi::Error::Success() : CudaError("writing its token", err);
}

ffi::Error Prefixed(const char* prefix, const libra::Status& status) {
  libra::Status named = status;
  named.message = std::string(prefix) + named.message;
  return ToFfiError(named);
}

// Start: the members (operands, then any values start must not run before, read by
// nothing), their results (in place: each aliases its operand) and a token.
ffi::Error ExecuteStart(cudaStream_t stream, int32_t device, ffi::RunId run,
                        ffi::RemainingArgs args, ffi::RemainingRets rets,
                        ffi::Span<const int32_t> devices, int64_t world, int64_t blocks,
                        int64_t algorithm, int64_t timeout_ms, int64_t call_id) {
  std::vector<KernelMember> members;
  if (rets.size() < 2) {
    return ffi::Error::InvalidArgument(
        "libra_jax CUDA all-reduce start: one operand and one result per member, then the "
        "token");
  }
  if (ffi::Error got = KernelMembers(args, rets, rets.size() - 1, &members); got.failure()) {
    return got;
  }
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> token = rets.get<ffi::AnyBuffer>(rets.size() - 1);
  if (!token.has_value()) return token.error();
  ffi::Error launched = ffi::Error::Success();
  const libra::Status status = Side().Start(
      device, call_id, stream,
      [&](void* side) {
        launched = Launch(static_cast<cudaStream_t>(side), kLibraStream, device, run.run_id,
                          members, devices, world, blocks, algorithm, timeout_ms);
        return launched.success() ? libra::Status::Ok()
                                  : libra::Status::Error(libra::Status::Code::kInternal, "launch");
      },
      timeout_ms);
  if (launched.failure()) return launched;
  if (!status.ok()) return Prefixed("libra_jax CUDA all-reduce: ", status);
  return WriteToken(stream, **token);
}

// Done's operands are its start's buffers (one per member, each aliased to its result),
// start's token and, as on CPU, operands that only order done after them: it waits for the
// call's end on XLA's stream, whatever the members.
ffi::Error ExecuteDone(cudaStream_t stream, int32_t device, ffi::RemainingArgs /*started*/,
                       ffi::RemainingRets /*out*/, int64_t call_id) {
  const libra::Status status = Side().Done(device, call_id, stream);
  return status.ok() ? ffi::Error::Success() : Prefixed("libra_jax CUDA all-reduce: ", status);
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

// The P2P kernel call's context (with the execution's RunId) and its members' buffers, as
// operands and results (start adds its token, the last result).
auto BindP2PBuffers() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::RunId>()
      .RemainingArgs()
      .RemainingRets();
}

auto BindKernelCall() { return BindKernelAttrs(BindP2PBuffers()); }

// The NCCL calls' context and buffers: the members' (a bucket's of one dtype, or one), then,
// for a start, any number of values it must not run before (read by nothing: XLA orders by
// data only; an all-gather issued ahead waits so for the gather before it); the members'
// results, and a start's token. The results say how many members there are.
auto BindNcclBuffers() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .RemainingArgs()
      .RemainingRets();
}

// --- NCCL with the call's block count as its CTA limit -----------------------
//
// `comm_ids` and `ranks` are indexed by this process's GPU ordinals: the
// communicator (registered by libra_jax._nccl at lowering) and rank of each;
// every GPU is one rank of its group. Communicators are made when XLA
// initialises the program (the initialize stage, before anything runs: every
// rank makes them, in the program's order), else on the first call; NCCL
// needs the call's GPU current for that. Every NCCL call runs on libra's
// stream of the GPU (libra/streams.h): the one-call form makes XLA's stream
// wait for it at once, start/done (libra_allreduce_nccl_start, then
// libra_allreduce_cuda_done, the kernels' done) later. Not command-buffer
// compatible: creation waits on the host for every rank.

// This GPU's (communicator, rank) in the call's tables, or InvalidArgument.
ffi::ErrorOr<std::pair<int64_t, int>> NcclRank(int32_t device, ffi::Span<const int64_t> comm_ids,
                                               ffi::Span<const int32_t> ranks) {
  if (device < 0 || static_cast<std::size_t>(device) >= comm_ids.size() ||
      comm_ids.size() != ranks.size() || comm_ids[device] < 0) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "libra_jax NCCL all-reduce: GPU " + std::to_string(device) +
        " has no communicator in this call's tables"));
  }
  return std::make_pair(comm_ids[device], static_cast<int>(ranks[device]));
}

// Runs `body` with `device` current (NCCL creates and launches on the current GPU).
template <typename Body>
ffi::Error OnDevice(int32_t device, Body body) {
  int current = -1;
  cudaError_t err = cudaGetDevice(&current);
  if (err == cudaSuccess && current != device) err = cudaSetDevice(device);
  if (err != cudaSuccess) return CudaError("making its GPU current", err);
  ffi::Error result = body();
  if (current >= 0 && current != device) cudaSetDevice(current);  // best effort restore
  return result;
}

// The NCCL call's buffers and attributes, shared by the one-call forms and the starts, of
// every collective kind (libra::Collective). Buffers as NCCL counts them (libra::nccl::CountOf,
// by the kind's row): an all-reduce's out is x's size; a reduce-scatter's x holds nranks of its
// out (recvcount: out's elements); an all-gather's out holds nranks of its x (sendcount: x's
// elements); an all-to-all's x and out hold nranks segments each (count: x's elements /
// nranks; segment d of x goes to rank d, segment s of out comes from rank s; never in place). `in_place` (the starts,
// whose buffer is one flat row of shards): the reduce-scatter's shard goes to x + rank x
// recvcount (out aliases x); the all-gather's shard is first copied to out + rank x sendcount,
// on XLA's stream, so that x may be reused as soon as start returns.
struct NcclCall {
  int32_t device;
  ffi::AnyBuffer x;
  ffi::AnyBuffer out;
  ffi::Span<const int64_t> comm_ids;
  ffi::Span<const int32_t> ranks;
  int64_t nranks, ctas, timeout_ms;
  libra::Collective kind = libra::Collective::kAllReduce;
  bool in_place = false;

  // The engine's element type (any whole-byte type as bytes for a kind that copies: the
  // all-gather, the all-to-all), NCCL's count (libra::nccl::CountOf: the kind's row says how
  // many counts each buffer holds; an all-to-all's is its segment per peer) and the byte size
  // of one rank's share (an in-place start's offset); or what is wrong with the buffers.
  ffi::Error Shape(lc::DType* dtype, std::size_t* count, std::size_t* share) const {
    const std::string what = std::string("libra_jax NCCL ") + libra::Name(kind) + ": ";
    if (out.element_type() != x.element_type() || nranks < 1) {
      return ffi::Error::InvalidArgument(what + "output must have the input's element type");
    }
    const libra::Layout& layout = libra::LayoutOf(kind);
    ffi::ErrorOr<lc::DType> engine = ToEngineDType(x.element_type());
    if (!engine.has_value() && layout.sums) return engine.error();
    *dtype = engine.has_value() ? *engine : lc::DType::kBytes;
    const std::size_t unit = libra::SizeOf(*dtype);
    // In place, a reduce-scatter's output is its whole row (out aliases x): NCCL's output is
    // this rank's shard of it.
    const bool whole_row = in_place && layout.shard_out;
    const std::size_t n = static_cast<std::size_t>(nranks);
    const std::size_t out_units = (whole_row ? out.size_bytes() / n : out.size_bytes()) / unit;
    if ((whole_row && out.size_bytes() != x.size_bytes()) ||
        !libra::nccl::CountOf(kind, x.size_bytes() / unit, out_units, static_cast<int>(nranks),
                              count)
             .ok()) {
      return ffi::Error::InvalidArgument(what + "the buffers' sizes do not fit " +
                                         std::to_string(nranks) + " ranks");
    }
    *share = *count * unit;
    return ffi::Error::Success();
  }

  // Checked, this rank's member of the call: its buffers as NCCL takes them.
  ffi::Error Member(int rank, libra::nccl::Library::Member* member) const {
    lc::DType dtype;
    std::size_t count = 0, share = 0;
    if (ffi::Error shaped = Shape(&dtype, &count, &share); shaped.failure()) return shaped;
    const void* input = x.untyped_data();
    void* output = out.untyped_data();
    const std::size_t own = share * static_cast<std::size_t>(rank);
    if (in_place && libra::LayoutOf(kind).shard_out) {
      output = static_cast<char*>(out.untyped_data()) + own;
    } else if (in_place && libra::LayoutOf(kind).shard_in) {
      input = static_cast<const char*>(out.untyped_data()) + own;
    }
    *member = {input, output, count, dtype};
    return ffi::Error::Success();
  }

  // Checks it and issues it on `side` (called by SideStreams), with `more` (a bucket's other
  // members: the same communicator and limit) as one NCCL group.
  ffi::Error Issue(cudaStream_t side, const std::vector<NcclCall>& more = {}) const {
    ffi::ErrorOr<std::pair<int64_t, int>> me = NcclRank(device, comm_ids, ranks);
    if (!me.has_value()) return me.error();
    std::vector<libra::nccl::Library::Member> members(1 + more.size());
    if (ffi::Error first = Member(me->second, &members[0]); first.failure()) return first;
    for (std::size_t i = 0; i < more.size(); ++i) {
      if (ffi::Error next = more[i].Member(me->second, &members[1 + i]); next.failure()) {
        return next;
      }
    }
    libra::nccl::Communicators& comms = libra::nccl::Communicators::Get();
    const int n = static_cast<int>(nranks);
    const int limit = static_cast<int>(ctas);
    const libra::nccl::Library::Member& one = members[0];
    libra::Status status =
        members.size() == 1
            ? comms.Call(kind, me->first, n, me->second, limit, one.input, one.output,
                         one.count, one.dtype, side, timeout_ms)
            : comms.CallGroup(kind, me->first, n, me->second, limit, members, side, timeout_ms);
    // Enqueued: a peer that never comes is the watchdog's to end (libra/nccl.h).
    if (status.ok()) status = comms.Watch(me->first, me->second, side, timeout_ms, kCudaStreamOps);
    return ToFfiError(status);
  }

  // An in-place all-gather's own shard, copied into place on XLA's `stream` before start
  // hands the call to libra's stream (which waits for XLA's).
  ffi::Error PlaceOwnShard(cudaStream_t stream) const {
    if (!(in_place && libra::LayoutOf(kind).shard_in)) return ffi::Error::Success();
    ffi::ErrorOr<std::pair<int64_t, int>> me = NcclRank(device, comm_ids, ranks);
    if (!me.has_value()) return me.error();
    char* own = static_cast<char*>(out.untyped_data()) +
                x.size_bytes() * static_cast<std::size_t>(me->second);
    if (out.size_bytes() != x.size_bytes() * static_cast<std::size_t>(nranks)) {
      return ffi::Error::InvalidArgument("libra_jax NCCL all-gather start: output must hold "
                                         "nranks inputs");
    }
    const cudaError_t err =
        cudaMemcpyAsync(own, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    return err == cudaSuccess ? ffi::Error::Success()
                              : CudaError("placing the all-gather's own shard", err);
  }
};

// Runs `call` (with `more`, a bucket's other members, as one NCCL group) on libra's stream
// through `run` (SideStreams::Call or Start).
template <typename Run>
ffi::Error IssueNccl(const NcclCall& call, Run run, const std::vector<NcclCall>& more = {}) {
  return OnDevice(call.device, [&] {
    ffi::Error issued = ffi::Error::Success();
    const libra::Status status = run([&](void* side) {
      issued = call.Issue(static_cast<cudaStream_t>(side), more);
      return issued.success() ? libra::Status::Ok()
                              : libra::Status::Error(libra::Status::Code::kInternal, "issue");
    });
    if (issued.failure()) return issued;
    const std::string prefix = std::string("libra_jax NCCL ") + libra::Name(call.kind) + ": ";
    return status.ok() ? ffi::Error::Success() : Prefixed(prefix.c_str(), status);
  });
}

// The initialize stage: this GPU's communicator, before the program runs.
ffi::Error InitializeNccl(int32_t device, ffi::RemainingArgs, ffi::RemainingRets,
                          ffi::Span<const int64_t> comm_ids,
                          ffi::Span<const int32_t> ranks, int64_t nranks, int64_t ctas,
                          int64_t timeout_ms) {
  ffi::ErrorOr<std::pair<int64_t, int>> me = NcclRank(device, comm_ids, ranks);
  if (!me.has_value()) return me.error();
  return OnDevice(device, [&] {
    return ToFfiError(libra::nccl::Communicators::Get().Prepare(
        me->first, static_cast<int>(nranks), me->second, static_cast<int>(ctas), timeout_ms));
  });
}

ffi::Error InitializeNcclStart(int32_t device, ffi::RemainingArgs args, ffi::RemainingRets rets,
                               ffi::Span<const int64_t> comm_ids,
                               ffi::Span<const int32_t> ranks, int64_t nranks, int64_t ctas,
                               int64_t timeout_ms, int64_t /*call_id*/) {
  return InitializeNccl(device, args, rets, comm_ids, ranks, nranks, ctas, timeout_ms);
}

// The one-call form: the members (a bucket's, each as NCCL takes it: an all-reduce's buffer,
// a sharded kind's row of shards, an all-to-all's row of segments, one per rank in rank order)
// and their results, as one NCCL group.
template <libra::Collective kKind>
ffi::Error ExecuteNccl(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                       ffi::RemainingRets rets, ffi::Span<const int64_t> comm_ids,
                       ffi::Span<const int32_t> ranks, int64_t nranks, int64_t ctas,
                       int64_t timeout_ms) {
  if (rets.size() < 1 || args.size() < rets.size()) {
    return ffi::Error::InvalidArgument(std::string("libra_jax NCCL ") + libra::Name(kKind) +
                                       ": one operand and one result per member");
  }
  std::vector<NcclCall> calls;
  for (std::size_t i = 0; i < rets.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return x.error();
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = rets.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return out.error();
    calls.push_back({device, *x, **out, comm_ids, ranks, nranks, ctas, timeout_ms, kKind});
  }
  const std::vector<NcclCall> more(calls.begin() + 1, calls.end());
  return IssueNccl(
      calls.front(), [&](auto issue) { return Side().Call(device, stream, issue); }, more);
}

// Start: the all-reduce in place (out aliases x), the reduce-scatter and the all-gather in
// place in one flat row of shards (NcclCall); several members (a bucket's) as one NCCL group;
// done is kCudaAllReduceDone for every kind.
template <libra::Collective kKind>
ffi::Error ExecuteNcclStart(cudaStream_t stream, int32_t device, ffi::RemainingArgs args,
                            ffi::RemainingRets rets, ffi::Span<const int64_t> comm_ids,
                            ffi::Span<const int32_t> ranks, int64_t nranks, int64_t ctas,
                            int64_t timeout_ms, int64_t call_id) {
  const std::string what = std::string("libra_jax NCCL ") + libra::Name(kKind) + " start: ";
  if (rets.size() < 2 || args.size() < rets.size() - 1) {
    return ffi::Error::InvalidArgument(what + "one operand and one result per member, then "
                                              "the token");
  }
  const std::size_t count = rets.size() - 1;
  std::vector<NcclCall> calls;
  for (std::size_t i = 0; i < count; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return x.error();
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = rets.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return out.error();
    calls.push_back({device, *x, **out, comm_ids, ranks, nranks, ctas, timeout_ms, kKind,
                     libra::LayoutOf(kKind).sharded()});
    if (ffi::Error placed = calls.back().PlaceOwnShard(stream); placed.failure()) return placed;
  }
  ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> token = rets.get<ffi::AnyBuffer>(count);
  if (!token.has_value()) return token.error();
  const std::vector<NcclCall> more(calls.begin() + 1, calls.end());
  ffi::Error issued = IssueNccl(
      calls.front(),
      [&](auto issue) { return Side().Start(device, call_id, stream, issue, timeout_ms); },
      more);
  if (issued.failure()) return issued;
  return WriteToken(stream, **token);
}

// The NCCL call's attributes, in every stage.
template <typename Binding>
auto BindNcclAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<ffi::Span<const int64_t>>("comm_ids")
      .template Attr<ffi::Span<const int32_t>>("ranks")
      .template Attr<int64_t>("nranks")
      .template Attr<int64_t>("ctas")
      .template Attr<int64_t>("timeout_ms");
}

}  // namespace

// Not command-buffer compatible (see the top of this file).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduce, Execute, BindKernelCall());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllReduce, ExecuteNccl<libra::Collective::kAllReduce>,
                              BindNcclAttrs(BindNcclBuffers()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclReduceScatter, ExecuteNccl<libra::Collective::kReduceScatter>,
                              BindNcclAttrs(BindNcclBuffers()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllGather, ExecuteNccl<libra::Collective::kAllGather>,
                              BindNcclAttrs(BindNcclBuffers()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllToAll, ExecuteNccl<libra::Collective::kAllToAll>,
                              BindNcclAttrs(BindNcclBuffers()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllReduceInitialize, InitializeNccl,
                              BindNcclAttrs(ffi::Ffi::BindInitialize()
                                                .Ctx<ffi::DeviceOrdinal>()
                                                .RemainingArgs()
                                                .RemainingRets()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllReduceStart,
                              ExecuteNcclStart<libra::Collective::kAllReduce>,
                              BindNcclAttrs(BindNcclBuffers()).Attr<int64_t>("call_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclReduceScatterStart,
                              ExecuteNcclStart<libra::Collective::kReduceScatter>,
                              BindNcclAttrs(BindNcclBuffers()).Attr<int64_t>("call_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllGatherStart,
                              ExecuteNcclStart<libra::Collective::kAllGather>,
                              BindNcclAttrs(BindNcclBuffers()).Attr<int64_t>("call_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kNcclAllReduceStartInitialize, InitializeNcclStart,
                              BindNcclAttrs(ffi::Ffi::BindInitialize()
                                                .Ctx<ffi::DeviceOrdinal>()
                                                .RemainingArgs()
                                                .RemainingRets())
                                  .Attr<int64_t>("call_id"));

// Start: the members, their results (in place) and a token for done.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduceStart, ExecuteStart,
                              BindKernelAttrs(BindP2PBuffers()).Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCudaAllReduceDone, ExecuteDone,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("call_id"));

std::size_t CudaPendingStarts() { return Side().pending(); }

int CudaPeerAccess(const std::vector<int>& devices) {
  for (int a : devices) {
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) {
        cudaGetLastError();  // not sticky: clear it
        return -1;
      }
      if (!can) return 0;
    }
  }
  return 1;
}

int CudaEffectiveBlocks(std::size_t bytes, int nranks, int algorithm, int blocks) {
  std::size_t capacity = 0;
  const libra::Status setting = CapacityBytes(&capacity);
  if (!setting.ok()) throw std::invalid_argument(setting.message);  // a ValueError in Python
  return lc::EffectiveBlocks(bytes, nranks, static_cast<lc::Algorithm>(algorithm), blocks,
                             capacity);
}

}  // namespace libra_ffi

static_assert(libra_ffi::kCudaMaxRanks == libra::cuda::kMaxRanks);
