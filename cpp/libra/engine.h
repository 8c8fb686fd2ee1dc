// libra engine: in-process collectives (all-reduce, reduce-scatter, all-gather, all-to-all)
// among the participants of one call, with a configurable block count.
// Framework-free: no XLA here.
//
// A participant is one device's share of a collective: its rank, its input and
// output buffers, and a callback. The last of `world` participants to arrive
// starts the call: `blocks` worker tasks on the engine's own pool (one of
// them on its own thread when it asks to, `reduce_on_caller`) claim disjoint
// pieces of the full buffer's element range in turn; each piece is done as its
// collective kind says (summed over the inputs in rank order and written to every
// output, or to its shard's owner only; or copied from its shard's owner to every
// output; or each output's segments copied from the inputs' segments of its rank).
// Nobody waits for another participant:
// callers are told of completion (or failure) through their callback, run by
// the reduce thread that finished (one after another, with a completion thread
// standing by to take over from one that runs long), or, for a caller whose task
// finished last, on its own thread; errors on completion threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "libra/dtype.h"
#include "libra/status.h"

namespace libra {

// The largest block count a call may ask for: the size of the reduction pool.
inline constexpr int kMaxBlocks = 64;
// A block never gets fewer bytes than this (unless the buffer itself is
// smaller): asking for more blocks than bytes / kMinChunkBytes gives
// ceil(bytes / kMinChunkBytes) blocks. The pieces the blocks claim are no
// smaller either, and start on 64-byte boundaries.
inline constexpr std::size_t kMinChunkBytes = 16 * 1024;

// The CUDA kernels' staging per round from $LIBRA_JAX_CUDA_STAGING_MIB (`raw`, may be null):
// unset or empty gives `default_bytes`; a number of MiB in (0, kMaxStagingMib] gives that many
// bytes, rounded down to whole 16-byte vectors (at least one); anything else (a word, 0, a
// negative, inf, nan, 1e30) is an InvalidArgument naming the variable, never a size cast
// out of range. Host-side (the CUDA handler calls it), so tested without a GPU.
inline constexpr double kMaxStagingMib = 65536;  // 64 GiB per round
Status StagingBytes(const char* raw, std::size_t default_bytes, std::size_t* bytes);

// What a call computes: one row each of the engine's table of collective kinds (engine.cc),
// which share everything else (rendezvous, pool, block count, timeouts, records). A call's
// `count` is the full (unsharded) buffer's elements, and its pieces cut that range.
//  - kAllReduce:     count in, count out on every rank: out[i] = sum over r of in_r[i].
//  - kReduceScatter: count in, count / world out: rank r keeps shard r of the sum. Each
//                    input is read once; each output written once; no full-size temporary.
//  - kAllGather:     count / world in, count out on every rank: rank r's input is shard r.
//                    A copy: any element type, by its bytes (DType::kBytes).
//  - kAllToAll:      count in, count out on every rank, in rows of world segments of
//                    `segment` elements: output segment s of rank d (in each row) is input
//                    segment d of rank s (jax.lax.all_to_all with the split axis first). A
//                    copy, as the all-gather's; never in place: an output that overlaps any
//                    rank's input is refused (InvalidArgument), as its pieces run at once.
// In place (a start/done pair's buffers, NCCL's rule): with outer = 1, a reduce-scatter may
// write rank r's shard over its own input at offset r * shard (output = input + r * shard),
// and an all-gather may read rank r's shard from its own output at that offset (input =
// output + r * shard): every element is read from all inputs before its output is written,
// and a shard already in place is not copied.
// Shards: the full buffer is [outer][world][segment], row-major, and shard r is
// [outer][segment], its rows at r: a scatter or gather along one dimension of an array,
// `segment` the elements of one rank's share from that dimension on, `outer` the product of
// the dimensions before it (1 along the first). The all-to-all's buffers have the same rows
// (count = outer * world * segment; outer is usually 1): segment s of a row goes to rank s.
// (The enum and its Name are libra/dtype.h's, shared with the NCCL path.)

// Number of worker tasks that reduce `count` elements when `blocks` are asked
// for: min(blocks, ceil(bytes / kMinChunkBytes)) (fewer only when 64-byte
// aligned chunks leave the last one empty); 0 for an empty buffer.
int EffectiveBlocks(std::size_t count, DType dtype, int blocks);

// A call whose outputs total at least this many bytes (world x bytes per rank)
// writes those that are not in place with streaming stores (x86: movntdq), past
// the caches: such outputs would leave them before anyone reads them, and a
// plain store that misses reads the line first. Measured on the 2-core VM,
// 16 MiB x 8 ranks into warm outputs, one task: 12.9 -> 8.1 ms; in place, where
// the line was just read, they are slower and not used.
inline constexpr std::size_t kStreamingOutputBytes = std::size_t{32} << 20;

// Sums elements [begin, end) of inputs[0..n) in rank order, starting from +0
// as XLA:CPU does (all -0 inputs sum to +0), into every
// outputs[r]. Each element is read from all inputs before any output is
// written, so outputs[r] == inputs[r] (in place) is safe. `streaming_stores`:
// outputs that are not in place are written past the caches (f32, f64, s32,
// s64, on x86, where every output is aligned to the vectors' width at `begin`,
// ReduceVectorBytes); the values are the same either way.
//  - f32, f64: IEEE sums, left to right;
//  - bf16: accumulated in f32, rounded once (round to nearest even);
//  - f16: rounded to f16 after every addition;
//  - s32, s64: two's complement, wrapping.
void ReduceRange(DType dtype, const void* const* inputs, void* const* outputs,
                 int n, std::size_t begin, std::size_t end, bool streaming_stores = false);

// The width of the vectors ReduceRange sums with: 32 bytes (AVX2, and F16C for f16) where
// the CPU has them, else 16 (bf16 and f16 then partly element by element).
// The bits are the same either way; tests run both.
int ReduceVectorBytes();
// Sets it for the whole process: 16, or 32 where the CPU has AVX2 and F16C; false (and
// unchanged) otherwise. For tests and benchmarks.
bool SetReduceVectorBytes(int bytes);

// Sums elements [begin, end) of inputs[0..n) in rank order exactly as ReduceRange does,
// into out[0 .. end - begin) alone: a run of one rank's shard of a reduce-scatter.
void ReduceRangeTo(DType dtype, const void* const* inputs, int n, std::size_t begin,
                   std::size_t end, void* out, bool streaming_stores = false);

// Synchronous all-reduce of n buffers with `blocks` worker tasks on the
// engine's pool (for tests and benchmarks of the engine itself).
Status AllReduce(DType dtype, const std::vector<const void*>& inputs,
                 const std::vector<void*>& outputs, std::size_t count,
                 int blocks);

// Any collective kind, synchronously, as AllReduce: `count` is the full buffer's elements
// and `segment` one shard's run, or the all-to-all's segment (0: count / n), as CallSpec has
// them.
Status RunCollective(Collective collective, DType dtype, const std::vector<const void*>& inputs,
                     const std::vector<void*>& outputs, std::size_t count, std::size_t segment,
                     int blocks);

// One of several buffers a participant brings to one call (a bucket's members): each its
// own full buffer of `count` elements and, for a segmented kind (sharded, or the all-to-all),
// its own rows of world segments of `segment` elements (0: count / world), laid out as a
// one-buffer call's are. A call with
// members does each member as that call would, all in one round and one set of pieces: the
// pieces cut the members' ranges laid end to end, so one call with its block count serves a
// whole bucket where XLA put its tensors, with no packed copy. Each element's sum is the same
// as in a call of its member alone (rank order).
struct Member {
  std::size_t count = 0;
  std::size_t segment = 0;
  bool operator==(const Member& o) const { return count == o.count && segment == o.segment; }
  bool operator!=(const Member& o) const { return !(*this == o); }
};

// What one participant brings to one collective.
struct CallSpec {
  int64_t group = 0;   // Participants of the same group meet (replica group).
  int64_t run_id = 0;  // One execution of the program (same on all devices).
  int rank = 0;        // Position in the replica group: summation order.
  int world = 1;       // Size of the replica group.
  Collective collective = Collective::kAllReduce;
  DType dtype = DType::kF32;
  std::size_t count = 0;    // Elements of the full (unsharded) buffer, the same on every rank.
  std::size_t segment = 0;  // Segmented kinds: elements of one shard's run, or of one
                            // exchanged segment (the all-to-all) (0: count / world).
  int blocks = 1;           // Requested worker tasks, 1..kMaxBlocks.
  int64_t timeout_ms = 0;  // Give up on absent ranks after this long.
  // The caller's thread has nothing else to do until this call completes: if
  // it arrives last, it runs one of the worker tasks itself, and if that task
  // is the last to finish, its callback runs before Arrive returns (a thread hand-off less
  // each way). The synchronous AllReduce sets it. XLA's handlers leave it false:
  // their thread goes on with the program's independent compute meanwhile,
  // which measured faster in a train step (xla_ffi/cpu_collectives.cc).
  bool reduce_on_caller = false;
  // Several buffers (Member) instead of one: `count` is then their total and `segment` unused.
  // Empty: one buffer of `count` elements in runs of `segment`.
  std::vector<Member> members;
};

using DoneCallback = std::function<void(const Status&)>;

// The meeting point of one call site (one custom call in one executable).
// Rounds are keyed by (group, run_id, iteration), where iteration counts a
// rank's arrivals at this site within one run: devices run independent
// collectives in different orders, but each call site's own calls in order.
class Rendezvous {
 public:
  explicit Rendezvous(std::string label);
  ~Rendezvous();
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;

  // Registers a participant. `done` is called exactly once: after the
  // reduction has written every output, or with an error (bad arguments, a
  // timeout waiting for absent ranks, the site being destroyed).
  void Arrive(const CallSpec& spec, const void* input, void* output,
              DoneCallback done);
  // The same with one input and one output per member of `spec.members` (in their order).
  void Arrive(const CallSpec& spec, std::vector<const void*> inputs, std::vector<void*> outputs,
              DoneCallback done);

  struct State;  // Shared with the watchdog; defined in engine.cc.

 private:
  std::shared_ptr<State> state_;
};

// Per-call debug logging to stderr, switched on by LIBRA_JAX_DEBUG=1.
bool DebugLoggingEnabled();

// One completed call, as recorded for calibration and overlap studies.
// Times are microseconds on the steady clock since the engine's first use.
struct CallRecord {
  std::string label;
  int64_t group = 0, iteration = 0;
  int world = 0;
  Collective collective = Collective::kAllReduce;
  DType dtype = DType::kF32;
  std::size_t bytes = 0;  // The full (unsharded) buffer, per rank.
  int blocks = 0, tasks = 0;
  int64_t first_arrival_us = 0, start_us = 0, end_us = 0;
};

// Recording keeps the last `capacity` calls in memory (0 stops recording and
// drops them); TakeCallRecords returns and clears what was recorded.
void SetCallRecording(std::size_t capacity);
std::vector<CallRecord> TakeCallRecords();
// Now, on the records' clock.
int64_t NowMicros();

// Internal: forget the watchdog thread in a fork child.
void ResetWatchdogAfterFork();

}  // namespace libra
