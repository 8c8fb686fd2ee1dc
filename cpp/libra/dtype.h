// Element types of libra's collectives, shared by the CPU engine and the CUDA
// kernels (which serve all of them but s64 and kBytes). kBytes is any element
// type moved as its bytes: copies only (an all-gather), never summed.
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

}  // namespace libra
