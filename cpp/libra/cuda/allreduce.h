// libra CUDA all-reduce: one-shot and two-shot sums over peer memory among
// the GPUs of one process, with the block count (grid size) a launch
// parameter. Framework-free: no XLA here.
//
// A Team is the set of GPUs of one replica group, in rank order. Every member
// owns a staging area (double-buffered, in chunks of a fixed capacity), a
// per-block flag array that its peers write, and two local counters. Peers'
// pointers are exchanged once, when the team is created (in one process,
// with peer access enabled, a peer's device pointer is usable as is).
//
// The protocol (rounds, flags, staging, barriers, abort) is in
// libra/cuda/protocol.h, one source for these kernels and for the CPU
// emulation that tests it under ThreadSanitizer (cpp/tests/p2p_emulation_test.cc).
//
// A wait that exceeds the call's timeout writes an error record to
// host-mapped memory and the kernel finishes without its result; from then on
// the team is dead (every later kernel on it ends at once) and the host reads
// the record (Team::Failure) and replaces the team (protocol.h's
// TeamGenerations says when). Never __trap().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "libra/cuda/protocol.h"
#include "libra/dtype.h"

namespace libra::cuda {

// Default staging capacity per round (bytes of one chunk).
inline constexpr std::size_t kDefaultCapacityBytes = std::size_t{32} << 20;

using libra::DType;  // s64 is not served: KernelFor has no kernel for it.
using libra::Name;
using libra::SizeOf;

// Algorithm, ChooseAlgorithm, EffectiveBlocks, ErrorRecord, RankMemory,
// TeamView: libra/cuda/protocol.h.
const char* Name(Algorithm algorithm);

// One member of a call (a bucket's tensor) on one rank: device pointers,
// 16-byte aligned; `output` may be `input` (in place).
struct Buffer {
  const void* input = nullptr;
  void* output = nullptr;
  std::size_t bytes = 0;  // a multiple of 16
};

// One rank's part of one call: its members, 1..kMaxMembers of them, the same
// sizes in the same order on every rank, reduced as one buffer would be (each
// element's sum in rank order; protocol::RankBody) in one launch.
struct CallArgs {
  DType dtype = DType::kF32;
  std::vector<Buffer> members;
  int blocks = 1;               // 1..kMaxBlocks
  Algorithm algorithm = Algorithm::kAuto;
  uint64_t timeout_ns = 0;      // 0: wait forever
  uint32_t signature = 0;       // the same on every rank for one call (CallSignature)
};

// The members a virtual launch takes per rank: its calls of every rank are
// one kernel parameter, kept under 4 KiB (allreduce.cu's VirtualCalls).
inline constexpr int kMaxVirtualMembers = 8;

// The GPU memory of a team. Not thread-safe; a team is used by one call at a
// time per rank (stream order).
class Team {
 public:
  // A team of distinct CUDA devices in rank order; enables peer access among
  // them. Restores the calling thread's current device. Safe while a stream
  // of this thread is being captured (switches to relaxed capture mode).
  static cudaError_t Create(const std::vector<int>& devices, std::size_t capacity_bytes,
                            std::unique_ptr<Team>* team, std::string* message);
  // `nranks` virtual ranks on one device (for the harness, cpp/tools/harness.cc).
  static cudaError_t CreateVirtual(int device, int nranks, std::size_t capacity_bytes,
                                   std::unique_ptr<Team>* team, std::string* message);
  ~Team();
  Team(const Team&) = delete;
  Team& operator=(const Team&) = delete;

  int nranks() const { return static_cast<int>(devices_.size()); }
  int device(int rank) const { return devices_[rank]; }
  std::size_t capacity_bytes() const { return capacity_vectors_ * kVectorBytes; }
  TeamView View(int rank) const;

  // The error record written by a timed-out kernel; empty if none. The record
  // stays: the team is dead (its kernels end at once) and is to be replaced.
  std::string Failure() const;
  // Failure(), then clears the record so the team serves again (the harness's
  // timeout check, where every rank's kernel has ended).
  std::string TakeError();
  // Leak the device memory at destruction (kernels may still use it).
  void Abandon() { abandoned_ = true; }

 private:
  Team() = default;
  cudaError_t Allocate(std::string* message);

  std::vector<int> devices_;
  std::size_t capacity_vectors_ = 0;
  std::vector<RankMemory> memory_;
  ErrorRecord* error_host_ = nullptr;
  ErrorRecord* error_device_ = nullptr;
  bool abandoned_ = false;
  bool virtual_ = false;

  friend cudaError_t LaunchVirtualAllReduce(const Team&, const CallArgs&,
                                            const std::vector<std::vector<Buffer>>&,
                                            cudaStream_t, std::string*);
};

// Launches rank view.rank's part of an all-reduce on `stream` (of that
// rank's device, which must be current). Checks the arguments first.
cudaError_t LaunchAllReduce(const TeamView& view, const CallArgs& call, cudaStream_t stream,
                            std::string* message);

// Launches every rank of a virtual team as one cooperative grid of
// nranks x blocks blocks on the current device (so all ranks are
// co-resident); `members` holds each rank's members, at most
// kMaxVirtualMembers (`call.members` is ignored); every rank's call is a
// kernel parameter, so a captured graph keeps its own. Returns
// cudaErrorCooperativeLaunchTooLarge when the grid cannot be co-resident.
cudaError_t LaunchVirtualAllReduce(const Team& team, const CallArgs& call,
                                   const std::vector<std::vector<Buffer>>& members,
                                   cudaStream_t stream, std::string* message);

// How many blocks of the all-reduce kernels fit on the current device at once
// (the least over the kernels' instantiations): of the per-rank kernels (at
// least kMinBlocksPerSm a SM), or of the virtual-rank kernel (1 a SM).
cudaError_t MaxCoResidentBlocks(int* blocks, bool virtual_team = false);

// --- Launching ---------------------------------------------------------------
// Every kernel of this library is launched through LaunchKernel: the outcome
// is the launch's own result (never a stale error another call left in CUDA's
// last-error slot), and a failed launch's error is cleared from that slot
// where it returns, so that a later check (ours, XLA's, a harness's) does not
// find it. The functions it calls are CUDA's, replaceable for a test (the
// harness's selftest emulates a failed launch and a stale error without a GPU).
struct LaunchApi {
  cudaError_t (*launch)(const void* kernel, dim3 grid, dim3 block, void** params,
                        std::size_t shared_bytes, cudaStream_t stream);
  cudaError_t (*launch_cooperative)(const void* kernel, dim3 grid, dim3 block, void** params,
                                    std::size_t shared_bytes, cudaStream_t stream);
  cudaError_t (*get_last_error)();
  // For CreatePriorityStream (null: CUDA's).
  cudaError_t (*stream_priority_range)(int* least, int* greatest) = nullptr;
  cudaError_t (*create_stream)(cudaStream_t* stream, unsigned int flags, int priority) = nullptr;
};
// Replaces the launch functions (nullptr: CUDA's own) and returns the previous
// ones. For tests, before any launch; not thread-safe.
LaunchApi SetLaunchApiForTesting(const LaunchApi* api);
// A non-blocking stream at the device's greatest priority on the current
// device: libra's stream (libra/streams.h), whose kernels spin at barriers
// until every peer's run, so its blocks go ahead of compute's waiting ones.
cudaError_t CreatePriorityStream(cudaStream_t* stream, std::string* message);
// Launches `kernel` (kThreads threads per block, no dynamic shared memory).
cudaError_t LaunchKernel(bool cooperative, const void* kernel, dim3 grid, void** params,
                         cudaStream_t stream);

}  // namespace libra::cuda
