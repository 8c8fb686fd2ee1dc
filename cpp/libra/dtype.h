// Element types and collective kinds of libra's calls, shared by the CPU engine,
// the CUDA kernels (which serve all types but s64 and kBytes, and only the
// all-reduce) and the NCCL path. kBytes is any element type moved as its bytes:
// copies only (an all-gather), never summed.
#pragma once

#include <cstddef>

namespace libra {

enum class DType : int { kF32 = 0, kF64, kBF16, kF16, kS32, kS64, kBytes };

inline std::size_t SizeOf(DType dtype) {
  switch (dtype) {
    case DType::kF32: case DType::kS32: return 4;
    case DType::kF64: case DType::kS64: return 8;
    case DType::kBF16: case DType::kF16: return 2;
    case DType::kBytes: return 1;
  }
  return 0;
}

inline const char* Name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kF64: return "f64";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kS32: return "s32";
    case DType::kS64: return "s64";
    case DType::kBytes: return "bytes";
  }
  return "?";
}

// What a call computes (the engine's table of kinds: engine.h; NCCL's calls: nccl.h).
enum class Collective : int { kAllReduce = 0, kReduceScatter, kAllGather, kAllToAll };

// One row per kind, indexed by Collective: its name and how it spreads the full buffer over
// the ranks. The engine's table (engine.cc kKinds), the XLA handlers and NCCL's path read a
// kind's shapes here instead of testing which kind it is (libra_jax/collectives.py is the
// Python side of the same rows).
struct Layout {
  const char* name;
  bool sums;       // Adds elements (else copies them, by their bytes: DType::kBytes too).
  bool shard_in;   // Each rank brings one shard of the full buffer (the all-gather).
  bool shard_out;  // Each rank keeps one shard of the full buffer (the reduce-scatter).
  // Each rank's segment d of every row goes to rank d, which keeps it as its segment of the
  // sender's rank (the all-to-all): every rank brings and gets the full buffer's `count`
  // elements, not in place, and the segment is the unit exchanged.
  bool exchanges;
  constexpr bool sharded() const { return shard_in || shard_out; }
  // Whether the buffer is cut in rows of world segments (CallSpec::segment): `count` must be
  // whole rows of `segment * world` elements.
  constexpr bool segmented() const { return sharded() || exchanges; }
  // One rank's call counted as NCCL counts it (libra::nccl::CountOf): its input holds
  // counts_in(world) counts, its output counts_out(world) (a reduce-scatter's input and an
  // all-gather's output one per rank, an all-to-all's both: a segment per peer).
  constexpr std::size_t counts_in(std::size_t world) const {
    return shard_out || exchanges ? world : 1;
  }
  constexpr std::size_t counts_out(std::size_t world) const {
    return shard_in || exchanges ? world : 1;
  }
};
inline constexpr Layout kLayouts[] = {
    {"all-reduce", true, false, false, false},
    {"reduce-scatter", true, false, true, false},
    {"all-gather", false, true, false, false},
    {"all-to-all", false, false, false, true},
};
inline constexpr int kNumCollectives = static_cast<int>(sizeof(kLayouts) / sizeof(kLayouts[0]));

inline bool KnownCollective(Collective collective) {
  return static_cast<unsigned>(collective) < static_cast<unsigned>(kNumCollectives);
}
// The row of a known kind (KnownCollective).
inline const Layout& LayoutOf(Collective collective) {
  return kLayouts[static_cast<int>(collective)];
}
inline const char* Name(Collective collective) {
  return KnownCollective(collective) ? LayoutOf(collective).name : "?";
}

}  // namespace libra
