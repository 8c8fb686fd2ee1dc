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
enum class Collective : int { kAllReduce = 0, kReduceScatter, kAllGather };

inline const char* Name(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce: return "all-reduce";
    case Collective::kReduceScatter: return "reduce-scatter";
    case Collective::kAllGather: return "all-gather";
  }
  return "?";
}

}  // namespace libra
