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
// One call on every rank, in the same order on every rank, with the same
// element count, dtype, algorithm and block count (true of an SPMD program):
//   per round (one chunk of at most `capacity` bytes)
//     copy-in:  each block copies its tiles of the input into its staging half
//     barrier:  block b signals block b of every peer (release, system scope),
//               then waits for block b of every peer (acquire, system scope)
//     one-shot: block b sums its tiles over all ranks, in rank order 0..n-1,
//               and writes the output
//     two-shot: block b sums its tiles of this rank's segment (reduce-scatter)
//               into a result area, barrier again, then copies the other
//               segments' results from their owners (all-gather)
// Flags carry round numbers taken from a device-resident counter that the
// last block of each kernel advances, so no host state changes per call:
// CUDA-graph replays and changing block counts keep every rank in step. The
// staging half alternates with the round's parity and a block always owns the
// same tiles (tile-cyclic, offsets independent of the chunk size), which is
// what makes re-using a half two rounds later safe (see allreduce.cu).
//
// A wait that exceeds the call's timeout writes an error record to
// host-mapped memory and the kernel finishes without its result; the host
// reads the record at the next call (Team::TakeError). Never __trap().
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "libra/dtype.h"

namespace libra::cuda {

// The largest block count (grid size) of one call.
inline constexpr int kMaxBlocks = 64;
// The largest team.
inline constexpr int kMaxRanks = 8;
// Threads per block; each moves 16-byte vectors.
inline constexpr int kThreads = 512;
inline constexpr int kVectorBytes = 16;
// Default staging capacity per round (bytes of one chunk).
inline constexpr std::size_t kDefaultCapacityBytes = std::size_t{32} << 20;

using libra::DType;  // s64 is not served: KernelFor has no kernel for it.
using libra::Name;
using libra::SizeOf;

enum class Algorithm : int { kAuto = 0, kOneShot = 1, kTwoShot = 2 };
const char* Name(Algorithm algorithm);

// One-shot for 2 ranks and small buffers, two-shot otherwise (vLLM's rule).
Algorithm ChooseAlgorithm(std::size_t bytes, int nranks);

// Blocks a call uses: min(blocks, tiles of work per round), at least 1. A
// tile is kThreads vectors; extra blocks would only wait at the barriers.
int EffectiveBlocks(std::size_t bytes, int nranks, Algorithm algorithm, int blocks,
                    std::size_t capacity_bytes);

// Error record in host-mapped memory, shared by the team's ranks. `code` is
// written last; 0 means no error.
struct ErrorRecord {
  volatile uint32_t code;   // 1: a barrier wait timed out
  volatile uint32_t rank;   // the waiting rank
  volatile uint32_t block;  // its block
  volatile uint32_t peer;   // the rank it waited for
  volatile uint32_t round;  // the round number it waited for
  volatile uint32_t stage;  // 0: start barrier, 1: two-shot mid barrier
};

// What a kernel needs to know of one rank (device pointers).
struct RankMemory {
  void* staging = nullptr;     // 2 halves x (capacity + capacity / n) bytes
  uint32_t* flags = nullptr;   // [2 stages][kMaxBlocks][kMaxRanks], written by peers
  uint32_t* counters = nullptr;  // [0]: last round, [1]: blocks done (local only)
};

// A rank's view of its team: its peers' memory and its own rank.
struct TeamView {
  int nranks = 0;
  int rank = 0;
  std::size_t capacity_vectors = 0;  // per round; a multiple of nranks
  RankMemory member[kMaxRanks];
  ErrorRecord* error = nullptr;      // device pointer to the host-mapped record
};

// One rank's part of one call.
struct CallArgs {
  DType dtype = DType::kF32;
  const void* input = nullptr;  // device pointer, 16-byte aligned
  void* output = nullptr;       // device pointer, 16-byte aligned (may equal input)
  std::size_t bytes = 0;        // a multiple of 16
  int blocks = 1;               // 1..kMaxBlocks
  Algorithm algorithm = Algorithm::kAuto;
  uint64_t timeout_ns = 0;      // 0: wait forever
};

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

  // The error record written by a timed-out kernel, cleared; empty if none.
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
  // Virtual teams: per-rank kernel arguments in device memory, one buffer per
  // distinct call (so that a captured CUDA graph keeps its own), with the
  // host copy each was uploaded from.
  bool virtual_ = false;
  mutable std::vector<std::pair<std::vector<unsigned char>, void*>> virtual_args_;

  friend cudaError_t LaunchVirtualAllReduce(const Team&, const CallArgs&,
                                            const std::vector<const void*>&,
                                            const std::vector<void*>&, cudaStream_t,
                                            std::string*);
};

// Launches rank view.rank's part of an all-reduce on `stream` (of that
// rank's device, which must be current). Checks the arguments first.
cudaError_t LaunchAllReduce(const TeamView& view, const CallArgs& call, cudaStream_t stream,
                            std::string* message);

// Launches every rank of a virtual team as one cooperative grid of
// nranks x blocks blocks on the current device (so all ranks are
// co-resident); `inputs`/`outputs` hold one buffer per rank
// (`call.input`/`call.output` are ignored). The first launch of a new
// (call, buffers) combination uploads its arguments synchronously, so make
// it once before capturing a graph. Returns
// cudaErrorCooperativeLaunchTooLarge when the grid cannot be co-resident.
cudaError_t LaunchVirtualAllReduce(const Team& team, const CallArgs& call,
                                   const std::vector<const void*>& inputs,
                                   const std::vector<void*>& outputs, cudaStream_t stream,
                                   std::string* message);

// How many blocks of the all-reduce kernel fit on the current device at once.
cudaError_t MaxCoResidentBlocks(int* blocks);

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
};
// Replaces the launch functions (nullptr: CUDA's own) and returns the previous
// ones. For tests, before any launch; not thread-safe.
LaunchApi SetLaunchApiForTesting(const LaunchApi* api);
// Launches `kernel` (kThreads threads per block, no dynamic shared memory).
cudaError_t LaunchKernel(bool cooperative, const void* kernel, dim3 grid, void** params,
                         cudaStream_t stream);

}  // namespace libra::cuda
