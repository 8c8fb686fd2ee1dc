// The P2P all-reduce's protocol, in one source for two compilers: the CUDA
// kernels (allreduce.cu, with DeviceOps: st.release.sys / ld.acquire.sys,
// fences, atomics on the GPU) and a CPU emulation (cpp/tests/
// p2p_emulation_test.cc, with HostOps: one std::thread per block per rank,
// the same flags as 32-bit words under the GCC/Clang __atomic builtins, the
// operations of std::atomic, with the matching acquire/release orders), so
// that the emulation runs, under ThreadSanitizer, the kernels' own flag and
// round arithmetic, staging index math, barrier phases, abort and the host's
// team recovery, not a copy of them.
//
// What the emulation checks is the C++ memory model, not PTX's: the kernels'
// st.release.sys, __threadfence_system() and L2-only (ld.global.cg) peer
// loads, and the ordering across GPUs over NVLink or PCIe, need hardware.
//
// The protocol (one call on every rank, in the same order on every rank of a
// team, with the same element count, algorithm and block count):
//   per round (one chunk of at most `capacity` vectors)
//     copy-in:  each block copies its tiles of the input into its staging half
//     barrier:  block b signals block b of every peer (release, system scope),
//               then waits for block b of every peer (acquire, system scope)
//     one-shot: block b sums its tiles over all ranks, in rank order 0..n-1
//     two-shot: block b sums its tiles of this rank's segment into a result
//               area, barrier again, then copies the other segments' results
//               from their owners (all-gather)
// Flags carry round numbers taken from a counter on the rank's memory that
// the last block of each kernel advances (no host state changes per call).
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
//
// All of this holds for the calls of one team issued in one order on every
// rank: two streams of one GPU (XLA's, for a synchronous call, and libra's,
// for a start) each get a team of their own (xla_ffi/cuda_collectives.cc),
// since the GPUs may interleave two streams' kernels differently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include <algorithm>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

// The protocol's functions: device code in the kernels, host code in the emulation.
#if defined(__CUDACC__)
#define LIBRA_PROTOCOL_FN __device__ __forceinline__
#define LIBRA_UNROLL _Pragma("unroll")
#define LIBRA_NO_UNROLL _Pragma("unroll 1")
#else
#define LIBRA_PROTOCOL_FN inline
#define LIBRA_UNROLL
#define LIBRA_NO_UNROLL
#endif

namespace libra::cuda {

// The largest block count (grid size) of one call.
inline constexpr int kMaxBlocks = 64;
// The largest team.
inline constexpr int kMaxRanks = 8;
// Threads per block; each moves 16-byte vectors. With kMinBlocksPerSm, the
// kernels' resource choice (allreduce.cu, checked by cpp/tools/kernel_resources.py):
// 512 threads (vLLM's and PyTorch's one-shot choice: enough loads in flight
// per block that 24-36 blocks saturate NVLink) ...
inline constexpr int kThreads = 512;
// ... and at least 2 blocks per SM (__launch_bounds__(512, 2): at most 64
// registers a thread, half an SM's register file a block), so a Libra block
// leaves room on its SM for compute (the contention model prices what it
// takes: libra_jax/profiles "libra_block") and 8 virtual ranks keep 2 blocks
// per SM co-resident.
inline constexpr int kMinBlocksPerSm = 2;
inline constexpr int kVectorBytes = 16;
// 16-byte loads a thread has in flight in the copy loops (copy-in, all-gather).
inline constexpr int kCopyUnroll = 4;
// The largest capacity of one round, in vectors: indices within a round are 32-bit.
inline constexpr std::size_t kMaxCapacityVectors = std::size_t{1} << 30;

// Error record in host-mapped memory, shared by the team's ranks. `code` is
// claimed (0 -> 2) by the first rank that gives up, then published (1) once
// the other fields are written; never cleared while kernels may run (Team).
struct ErrorRecord {
  volatile uint32_t code;   // 0: none; 2: being written; 1: written
  volatile uint32_t kind;   // 0: a barrier wait timed out; 1: a peer was in another call
  volatile uint32_t rank;   // the waiting rank
  volatile uint32_t block;  // its block
  volatile uint32_t peer;   // the rank it waited for
  volatile uint32_t round;  // the round number it waited for
  volatile uint32_t stage;  // 0: start barrier, 1: two-shot mid barrier
};

// What a kernel needs to know of one rank (device pointers).
struct RankMemory {
  void* staging = nullptr;       // 2 halves x (capacity + capacity / n) vectors
  // [4][kMaxBlocks][kMaxRanks], written by peers: [stage] round flags (stage 0:
  // start barrier, 1: two-shot mid barrier), then [2 + round parity] call signatures.
  uint32_t* flags = nullptr;
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

// One member of a call (a bucket's tensor): whole 16-byte vectors read at
// `input`, their sums written to `output` (which may be `input`: in place).
struct Member {
  const void* input;
  void* output;
  uint32_t vectors;
  uint32_t first;  // its first vector in the call (MakeRankCall sets it)
};

// The most vectors of one call (64 GiB): indices within a call are 32-bit,
// which keeps the kernels within their registers (kMinBlocksPerSm).
inline constexpr std::size_t kMaxCallVectors = (std::size_t{1} << 32) - 1;

// The members one launch takes: a table in the kernel's parameters (with the
// rest of the call, 1016 bytes, well inside the 4 KiB every driver takes); a
// bucket of more is launched in parts (xla_ffi/cuda_collectives.cc).
inline constexpr int kMaxMembers = 32;

// One rank's part of one call, as the kernel sees it, its members in a table
// of at most M. The call's rounds run over the members end to end, as if
// they were one buffer (RankBody): no copy of a bucket into one buffer.
template <int M>
struct RankCallOf {
  TeamView view;
  std::size_t vectors;  // of all members
  int two_shot;
  int blocks;           // grid size of one rank
  uint64_t timeout_ns;  // 0: wait forever
  // The same on every rank for the same call (CallSignature), so a rank that
  // pairs a peer's call with another of its own (a rank that skipped a call,
  // whose execution failed before it) finds out at the first barrier.
  uint32_t signature;
  int members;
  Member member[M];
};
using RankCall = RankCallOf<kMaxMembers>;

// Flag words per rank: 2 stages of round flags, 2 parities of signatures.
inline constexpr std::size_t kFlagWords = std::size_t{4} * kMaxBlocks * kMaxRanks;

enum class Algorithm : int { kAuto = 0, kOneShot = 1, kTwoShot = 2 };

// One-shot for 2 ranks and small buffers, two-shot otherwise (vLLM's rule).
inline Algorithm ChooseAlgorithm(std::size_t bytes, int nranks) {
  if (nranks <= 2) return Algorithm::kOneShot;
  if (nranks <= 4 && bytes < (std::size_t{512} << 10)) return Algorithm::kOneShot;
  if (bytes < (std::size_t{256} << 10)) return Algorithm::kOneShot;
  return Algorithm::kTwoShot;
}

inline Algorithm ResolveAlgorithm(Algorithm algorithm, std::size_t bytes, int nranks) {
  return algorithm == Algorithm::kAuto ? ChooseAlgorithm(bytes, nranks) : algorithm;
}

// A round's capacity in vectors for a staging capacity in bytes: a multiple of
// nranks, at most kMaxCapacityVectors (indices within a round are 32-bit).
inline std::size_t CapacityVectors(std::size_t capacity_bytes, int nranks) {
  const std::size_t n = static_cast<std::size_t>(std::max(nranks, 1));
  const std::size_t vectors =
      std::min(capacity_bytes / kVectorBytes, kMaxCapacityVectors) / n * n;
  return std::max(vectors, n);
}

// Blocks a call uses: min(blocks, tiles of work per round), at least 1. A
// tile is kThreads vectors; extra blocks would only wait at the barriers.
inline int EffectiveBlocks(std::size_t bytes, int nranks, Algorithm algorithm, int blocks,
                           std::size_t capacity_bytes) {
  nranks = std::max(nranks, 1);
  const std::size_t capacity = CapacityVectors(capacity_bytes, nranks);
  const std::size_t per_round = std::min(bytes / kVectorBytes, capacity);
  std::size_t work = per_round;  // vectors a block count is spread over
  if (ResolveAlgorithm(algorithm, bytes, nranks) == Algorithm::kTwoShot) {
    work = (per_round + nranks - 1) / nranks;
  }
  const std::size_t tiles = std::max<std::size_t>(1, (work + kThreads - 1) / kThreads);
  return static_cast<int>(std::min<std::size_t>(std::clamp(blocks, 1, kMaxBlocks), tiles));
}

// The signature of call `index` (0, 1, ...) of execution `run` on a team.
inline uint32_t CallSignature(int64_t run, uint32_t index) {
  uint64_t x = static_cast<uint64_t>(run) * 0x9E3779B97F4A7C15ull + index + 1;
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  return static_cast<uint32_t>(x ^ (x >> 29));
}

// One rank's call as its kernel sees it (also what a virtual launch uploads:
// zeroed first, since uploads are compared bytewise): members[0..count), each
// of whole vectors, count at most M (the launch checks both). The algorithm
// and the block count are chosen for all members together.
template <int M = kMaxMembers>
RankCallOf<M> MakeRankCall(const TeamView& view, Algorithm algorithm, const Member* members,
                           int count, int blocks, uint64_t timeout_ns, uint32_t signature) {
  RankCallOf<M> a;
  std::memset(static_cast<void*>(&a), 0, sizeof a);
  a.members = std::min(count, M);
  for (int m = 0; m < a.members; ++m) {
    a.member[m] = members[m];
    a.member[m].first = static_cast<uint32_t>(a.vectors);
    a.vectors += members[m].vectors;
  }
  const std::size_t bytes = a.vectors * kVectorBytes;
  const Algorithm resolved = ResolveAlgorithm(algorithm, bytes, view.nranks);
  a.view = view;
  a.two_shot = resolved == Algorithm::kTwoShot ? 1 : 0;
  a.blocks = EffectiveBlocks(bytes, view.nranks, resolved, blocks,
                             view.capacity_vectors * kVectorBytes);
  a.timeout_ns = timeout_ns;
  a.signature = signature;
  return a;
}

// A call of one buffer of `bytes` (a multiple of 16, at most kMaxCallVectors vectors).
inline RankCall MakeRankCall(const TeamView& view, Algorithm algorithm, std::size_t bytes,
                             int blocks, const void* input, void* output, uint64_t timeout_ns,
                             uint32_t signature) {
  const Member one{input, output, static_cast<uint32_t>(bytes / kVectorBytes), 0};
  return MakeRankCall(view, algorithm, &one, 1, blocks, timeout_ns, signature);
}

namespace protocol {

// Flag word of (stage, block, from-rank) in a rank's flag array.
LIBRA_PROTOCOL_FN uint32_t FlagIndex(int stage, int block, int from) {
  return static_cast<uint32_t>((stage * kMaxBlocks + block) * kMaxRanks + from);
}

// Whether a flag has reached `round` (wrap-safe: a peer is at most one round ahead).
LIBRA_PROTOCOL_FN bool Reached(uint32_t flag, uint32_t round) {
  return static_cast<int32_t>(flag - round) >= 0;
}

// Vectors of segment s of a chunk of `vc` vectors in n segments of `seg`.
LIBRA_PROTOCOL_FN uint32_t SegmentLength(uint32_t vc, uint32_t seg, int s) {
  const uint32_t begin = static_cast<uint32_t>(s) * seg;
  return begin >= vc ? 0u : (vc - begin < seg ? vc - begin : seg);
}

// Records why a wait was given up in the team's error record (the first rank
// to give up wins; the team is dead from then on).
template <class Ops>
LIBRA_PROTOCOL_FN void RecordError(Ops& ops, ErrorRecord* e, int kind, int rank, int block,
                                   int peer, uint32_t round, int stage) {
  if (!ops.ClaimError(e)) return;
  e->kind = static_cast<uint32_t>(kind);
  e->rank = static_cast<uint32_t>(rank);
  e->block = static_cast<uint32_t>(block);
  e->peer = static_cast<uint32_t>(peer);
  e->round = round;
  e->stage = static_cast<uint32_t>(stage);
  ops.PublishError(e);
}

// Block `block` of this rank meets block `block` of every rank at `round`,
// and checks that every peer is in the same call (its signature). Returns
// false if the wait was abandoned (a timeout or another call here, or an
// error of the team recorded anywhere: a dead team's kernels all end at once).
template <class Ops, class Call>
LIBRA_PROTOCOL_FN bool Barrier(Ops& ops, const Call& a, int stage, int block,
                               uint32_t round, volatile int* aborted) {
  ops.SyncBlock();
  const int n = a.view.nranks;
  const int rank = a.view.rank;
  // The signature goes with the start barrier of each round. A peer is at
  // most one round ahead: the signature of round t is in slot (t & 1),
  // overwritten at round t + 2 only after this block signalled t + 1.
  const int signatures = 2 + static_cast<int>(round & 1u);
  for (int p = ops.FirstLane(); p < n; p += Ops::kLanes) {
    uint32_t* peer_flags = a.view.member[p].flags;
    if (stage == 0) ops.Store(peer_flags + FlagIndex(signatures, block, rank), a.signature);
    ops.FenceSystem();  // this block's staging writes and the signature, before the flag
    ops.StoreRelease(peer_flags + FlagIndex(stage, block, rank), round);
  }
  const uint32_t* mine = a.view.member[rank].flags;
  for (int p = ops.FirstLane(); p < n && *aborted == 0; p += Ops::kLanes) {
    const uint32_t* flag = mine + FlagIndex(stage, block, p);
    const uint64_t start = a.timeout_ns ? ops.NowNs() : 0;
    uint32_t spins = 0;
    while (!Reached(ops.LoadAcquire(flag), round)) {
      ops.Pause();
      if ((++spins % Ops::kPollEvery) != 0) continue;
      if (*aborted != 0 || ops.ErrorCode(a.view.error) != 0) {  // given up elsewhere
        *aborted = 1;
        break;
      }
      if (a.timeout_ns && ops.NowNs() - start > a.timeout_ns) {
        RecordError(ops, a.view.error, 0, rank, block, p, round, stage);
        *aborted = 1;
        break;
      }
    }
    if (stage == 0 && *aborted == 0 &&
        ops.Load(mine + FlagIndex(signatures, block, p)) != a.signature) {
      RecordError(ops, a.view.error, 1, rank, block, p, round, stage);
      *aborted = 1;
    }
  }
  ops.SyncBlock();
  return *aborted == 0;
}

// dst[v] = load(src + v) for this lane's vectors v = first, first + step, ...
// below count: kCopyUnroll loads in flight before their stores (the copies'
// only latency is the loads'; one at a time left NVLink idle).
template <class Ops, class Load>
LIBRA_PROTOCOL_FN void CopyStrided(Ops& ops, typename Ops::Vec* dst,
                                   const typename Ops::Vec* src, uint32_t count,
                                   uint32_t first, uint32_t step, Load load) {
  uint32_t v = first;
  for (; v + (kCopyUnroll - 1) * step < count; v += kCopyUnroll * step) {
    typename Ops::Vec x[kCopyUnroll];
LIBRA_UNROLL
    for (int u = 0; u < kCopyUnroll; ++u) x[u] = load(src + v + u * step);
LIBRA_UNROLL
    for (int u = 0; u < kCopyUnroll; ++u) ops.Store(dst + v + u * step, x[u]);
  }
  for (; v < count; v += step) ops.Store(dst + v, load(src + v));
}

// The sum over ranks 0..n-1 (in rank order) of load(at(r)), loading
// kSumGroup ranks at a time: 8 ranks' 16-byte loads in flight at once need
// more registers than the 64 a thread has (kMinBlocksPerSm).
inline constexpr int kSumGroup = 4;
template <int N, class Ops, class At>
LIBRA_PROTOCOL_FN typename Ops::Vec SumRanks(Ops& ops, int n, At at) {
  constexpr int kGroup = N < kSumGroup ? N : kSumGroup;
  typename Ops::Acc acc = ops.Zero();
LIBRA_UNROLL
  for (int r0 = 0; r0 < N; r0 += kGroup) {
    typename Ops::Vec vals[kGroup];
LIBRA_UNROLL
    for (int g = 0; g < kGroup; ++g) {
      if (r0 + g < n) vals[g] = ops.LoadPeer(at(r0 + g));
    }
LIBRA_UNROLL
    for (int g = 0; g < kGroup; ++g) {
      if (r0 + g < n) ops.Add(acc, vals[g]);
    }
  }
  return ops.Finish(acc);
}

// The first of a lane's positions v = first, first + step, ... (first < step)
// at or after `at`, relative to `at`: where that lane starts in a piece of a
// range that begins `at` vectors into it, so that a lane owns the same
// positions of the range however the members cut it.
LIBRA_PROTOCOL_FN uint32_t LaneStart(uint32_t first, uint32_t at, uint32_t step) {
  const uint32_t phase = at % step;
  return first >= phase ? first - phase : first + step - phase;
}

// The pieces of the range [begin, begin + count) of a call's members taken end
// to end: piece(input, output, at, length) for each member's part in order,
// its input and output at the part's first vector, `at` its offset in the
// range. A range of one member (the common case) is one piece.
template <class Ops, class Call, class Piece>
LIBRA_PROTOCOL_FN void ForPieces(const Call& a, uint32_t begin, uint32_t count, Piece piece) {
  using Vec = typename Ops::Vec;
  uint32_t at = 0;
LIBRA_NO_UNROLL
  for (int m = 0; m < a.members && at < count; ++m) {
    // Members before m end at or before begin + at; member m starts there or before.
    const uint32_t skip = begin + at - a.member[m].first;
    const uint32_t vectors = a.member[m].vectors;
    if (skip < vectors) {
      const uint32_t length = vectors - skip < count - at ? vectors - skip : count - at;
      piece(static_cast<const Vec*>(a.member[m].input) + skip,
            static_cast<Vec*>(a.member[m].output) + skip, at, length);
      at += length;
    }
  }
}

// One block of one rank's call, for teams of at most N ranks (the kernels
// are instantiated for N = 4 and 8: the sums over ranks unroll to N, in
// groups of kSumGroup loads in flight).
// `aborted` is the block's shared abort word, 0 on entry.
//
// The rounds run over the call's members end to end (ForPieces): round k's
// chunk is vectors [k * cap, k * cap + vc) of that sequence, whichever members
// hold them, and its staging, flags and barriers are as for one buffer. Only
// where a vector is read from and written to depends on the members; a lane
// handles the same positions of a chunk (and so of the staging) as it would in
// one buffer (LaneStart), which is what re-using a staging half rests on.
template <int N, class Ops, class Call>
LIBRA_PROTOCOL_FN void RankBody(Ops& ops, const Call& a, int block, volatile int* aborted) {
  using Vec = typename Ops::Vec;
  const int n = a.view.nranks;
  const int rank = a.view.rank;
  const uint32_t cap = static_cast<uint32_t>(a.view.capacity_vectors);
  const uint32_t segcap = cap / static_cast<uint32_t>(n);
  const uint32_t half_stride = cap + segcap;
  const uint32_t step = static_cast<uint32_t>(a.blocks) * kThreads;
  uint32_t* counters = a.view.member[rank].counters;
  const uint32_t base = ops.LoadCounter(counters);
  const uint32_t total = static_cast<uint32_t>(a.vectors);  // at most kMaxCallVectors
  const uint32_t rounds = total / cap + (total % cap != 0);
  // A team whose error record is set is dead (Team, TeamGenerations): end at once.
  if (ops.ErrorCode(a.view.error) != 0) *aborted = 1;

  // Peers' staging pointers are read from the call where used (for a kernel
  // parameter, a constant-bank operand): kept in registers, 8 of them spilled.
  const auto peer = [&](int r) { return static_cast<Vec*>(a.view.member[r].staging); };
  Vec* const mine = peer(rank);
  const auto load_input = [&](const Vec* p) { return ops.LoadInput(p); };
  const auto load_peer = [&](const Vec* p) { return ops.LoadPeer(p); };
  ops.SyncBlock();

  for (uint32_t k = 0; k < rounds && *aborted == 0; ++k) {
    const uint32_t round = base + k + 1;
    const uint32_t half = (round & 1u) * half_stride;
    const uint32_t off = k * cap;
    const uint32_t vc = total - off < cap ? total - off : cap;

    if (!a.two_shot) {
      for (int lane = ops.FirstLane(); lane < kThreads; lane += Ops::kLanes) {
        const uint32_t first = static_cast<uint32_t>(block) * kThreads + lane;
        ForPieces<Ops>(a, off, vc, [&](const Vec* in, Vec*, uint32_t at, uint32_t length) {
          CopyStrided(ops, mine + half + at, in, length, LaneStart(first, at, step), step,
                      load_input);
        });
      }
      if (!Barrier(ops, a, 0, block, round, aborted)) break;
      for (int lane = ops.FirstLane(); lane < kThreads; lane += Ops::kLanes) {
        const uint32_t first = static_cast<uint32_t>(block) * kThreads + lane;
        ForPieces<Ops>(a, off, vc, [&](const Vec*, Vec* out, uint32_t at, uint32_t length) {
LIBRA_NO_UNROLL
          for (uint32_t v = LaneStart(first, at, step); v < length; v += step) {
            const uint32_t staged = half + at + v;
            ops.Store(out + v, SumRanks<N>(ops, n, [&](int r) { return peer(r) + staged; }));
          }
        });
      }
      continue;
    }

    // Two-shot: segment s of the chunk is [s * seg, s * seg + len(s)) and lives
    // at s * segcap in the staging half; this rank reduces segment `rank`.
    const uint32_t seg = (vc + n - 1) / n;
    for (int lane = ops.FirstLane(); lane < kThreads; lane += Ops::kLanes) {
      const uint32_t first = static_cast<uint32_t>(block) * kThreads + lane;
LIBRA_NO_UNROLL
      for (int s = 0; s < n; ++s) {  // no peer pointer: no need to unroll
        Vec* const staged = mine + half + s * segcap;
        ForPieces<Ops>(a, off + s * seg, SegmentLength(vc, seg, s),
                       [&](const Vec* in, Vec*, uint32_t at, uint32_t length) {
                         CopyStrided(ops, staged + at, in, length, LaneStart(first, at, step),
                                     step, load_input);
                       });
      }
    }
    if (!Barrier(ops, a, 0, block, round, aborted)) break;
    const uint32_t own = SegmentLength(vc, seg, rank);
    for (int lane = ops.FirstLane(); lane < kThreads; lane += Ops::kLanes) {
      const uint32_t first = static_cast<uint32_t>(block) * kThreads + lane;
      ForPieces<Ops>(a, off + rank * seg, own,
                     [&](const Vec*, Vec* out, uint32_t at, uint32_t length) {
LIBRA_NO_UNROLL
        for (uint32_t v = LaneStart(first, at, step); v < length; v += step) {
          const uint32_t staged = half + rank * segcap + at + v;
          const Vec sum = SumRanks<N>(ops, n, [&](int r) { return peer(r) + staged; });
          ops.Store(mine + half + cap + at + v, sum);
          ops.Store(out + v, sum);
        }
      });
    }
    if (!Barrier(ops, a, 1, block, round, aborted)) break;
    for (int lane = ops.FirstLane(); lane < kThreads; lane += Ops::kLanes) {
      const uint32_t first = static_cast<uint32_t>(block) * kThreads + lane;
      // Not unrolled over ranks: its loop holds 4 loads in flight (kCopyUnroll),
      // and peer(s) is an indexed constant-bank read; unrolled, it spills.
LIBRA_NO_UNROLL
      for (int s = 0; s < n; ++s) {
        if (s != rank) {
          const Vec* const reduced = peer(s) + half + cap;
          ForPieces<Ops>(a, off + s * seg, SegmentLength(vc, seg, s),
                         [&](const Vec*, Vec* out, uint32_t at, uint32_t length) {
                           CopyStrided(ops, out, reduced + at, length,
                                       LaneStart(first, at, step), step, load_peer);
                         });
        }
      }
    }
  }

  // The last block to finish advances the round counter for the next call
  // (an aborted kernel's team is dead: its counter no longer matters).
  ops.SyncBlock();
  if (ops.FirstLane() == 0 && ops.ArriveDone(counters, a.blocks)) {
    ops.PublishRound(counters, base + rounds);
  }
}

}  // namespace protocol

// --- Host side: team recovery and the co-residency bound ---------------------

// Which team serves each call of one replica group on one stream, across
// errors. A timed-out kernel leaves its team dead (its error record set,
// every later kernel on it ends at once). The fresh team that replaces it
// must start at the same program point on every rank, or ranks pair calls
// that are not the same: so the unit of recovery is the execution (XLA's
// RunId, shared by every device of one execution). Every execution that
// made a call on the dead team fails on every rank that calls again in it;
// an execution that had not touched it gets the fresh team from its first
// call, on every rank. In one process, an error of any device fails the
// whole execution, so the user sees the first.
class TeamGenerations {
 public:
  // The generation (team) for a call of execution `run`; false (with the
  // failure in `message`) where the call must fail instead.
  bool Enter(int64_t run, int* generation, std::string* message) {
    std::lock_guard<std::mutex> lock(mu_);
    if (Contains(doomed_, run)) {
      if (message) *message = failure_;
      return false;
    }
    if (failed_) {  // the first call of an execution after a failure: a fresh team
      ++generation_;
      failed_ = false;
      runs_.clear();
    }
    if (!Contains(runs_, run)) Remember(&runs_, run);
    *generation = generation_;
    return true;
  }
  // Generation `generation` is dead (its error record was found set).
  void Fail(int generation, const std::string& failure) {
    std::lock_guard<std::mutex> lock(mu_);
    if (generation != generation_ || failed_) return;
    failed_ = true;
    failure_ = failure;
    for (int64_t run : runs_) Remember(&doomed_, run);
  }
  int generation() {
    std::lock_guard<std::mutex> lock(mu_);
    return generation_;
  }

 private:
  // Executions in flight are few (dispatch runs ahead by a handful): the last
  // kRemembered of each kind are enough.
  static constexpr std::size_t kRemembered = 4096;
  static bool Contains(const std::deque<int64_t>& d, int64_t run) {
    return std::find(d.begin(), d.end(), run) != d.end();
  }
  static void Remember(std::deque<int64_t>* d, int64_t run) {
    d->push_back(run);
    if (d->size() > kRemembered) d->pop_front();
  }

  std::mutex mu_;
  int generation_ = 0;
  bool failed_ = false;
  std::string failure_;
  std::deque<int64_t> runs_;    // executions that called on the current generation
  std::deque<int64_t> doomed_;  // executions that called on a dead generation
};

// One replica group's team on one stream, across errors: the handler's
// per-call logic (xla_ffi/cuda_collectives.cc), run by the emulation too.
// Enter gives a call of execution `run` from `rank` its team and signature:
// the team of its generation (TeamGenerations), made by `create` where the
// generation is new (the old one is passed to `retire`: its kernels may still
// hold its memory); a team whose error record is set (`failure` not empty) is
// failed there. The signature counts this rank's calls in the execution.
template <class Team>
class TeamSlot {
 public:
  enum class Outcome {
    kLaunch,       // launch on `team` with `signature`
    kDoomed,       // the execution met a failed call before: fail (message: why)
    kFailedNow,    // the team's record is set: fail (message: the record)
    kCreateError,  // `create` failed (message: its)
  };
  template <class Create, class Failure, class Retire>
  Outcome Enter(int64_t run, int rank, Create create, Failure failure, Retire retire,
                std::shared_ptr<Team>* team, uint32_t* signature, std::string* message) {
    std::lock_guard<std::mutex> lock(mu_);
    int generation = 0;
    if (!generations_.Enter(run, &generation, message)) return Outcome::kDoomed;
    if (generation != generation_ || !team_) {  // the first call, or after a failure
      if (team_) retire(*team_);
      team_.reset();
      calls_.clear();
      std::shared_ptr<Team> created = create(message);
      if (!created) return Outcome::kCreateError;
      team_ = std::move(created);
      generation_ = generation;
    }
    const std::string failed = failure(*team_);
    if (!failed.empty()) {
      generations_.Fail(generation, failed);
      if (message) *message = failed;
      return Outcome::kFailedNow;
    }
    std::pair<int64_t, uint32_t>& calls = calls_[rank];
    if (calls.first != run) calls = {run, 0};
    *signature = CallSignature(run, calls.second++);
    *team = team_;
    return Outcome::kLaunch;
  }
  int generation() { return generations_.generation(); }

 private:
  std::mutex mu_;
  TeamGenerations generations_;
  int generation_ = -1;  // of team_
  std::shared_ptr<Team> team_;
  // Per rank: the execution of its latest call and how many calls it made in it.
  std::map<int, std::pair<int64_t, uint32_t>> calls_;
};

// The co-residency bound of libra's spinning kernels on each GPU. A libra
// kernel's blocks spin at barriers until every peer's matching block runs,
// so the blocks of libra kernels that can be in flight at once on one GPU
// must all fit on it, or a block that never gets an SM deadlocks its team.
// Kernels of one stream run one after another, so that is the sum over the
// GPU's streams of the largest grid each has launched. (XLA's own NCCL
// kernels spin too and are invisible here: a GPU busy with them can still
// starve libra's blocks; the timeout then ends the wait.)
class CoResidency {
 public:
  // Admits a kernel of `blocks` blocks on (device, stream) where `capacity`
  // blocks fit on the device at once; false, with why, where it would not fit.
  bool Admit(int device, int stream, int blocks, int capacity, std::string* message) {
    std::lock_guard<std::mutex> lock(mu_);
    int others = 0;
    for (const auto& [key, most] : largest_) {
      if (key.first == device && key.second != stream) others += most;
    }
    if (others + blocks > capacity) {
      if (message) {
        *message = "a kernel of " + std::to_string(blocks) + " blocks beside " +
                   std::to_string(others) + " blocks of libra kernels on GPU " +
                   std::to_string(device) + "'s other streams would exceed the " +
                   std::to_string(capacity) +
                   " blocks that can be resident on it at once (libra's kernels spin until "
                   "every peer's blocks run); use fewer blocks";
      }
      return false;
    }
    int& most = largest_[{device, stream}];
    most = std::max(most, blocks);
    return true;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int, int>, int> largest_;
};

}  // namespace libra::cuda
