#include "libra/engine.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "libra/thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace libra {
namespace {

using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// 16-bit float conversions (bit exact, no hardware or compiler support needed)

uint32_t FloatBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float BitsFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

float Bf16ToFloat(uint16_t h) { return BitsFloat(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN becomes the canonical quiet NaN of its sign, as
// Eigen's (and so XLA:CPU's) conversion does.
uint16_t FloatToBf16(float f) {
  uint32_t u = FloatBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u & 0x80000000u) ? 0xffc0 : 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return BitsFloat(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return BitsFloat(sign | ((em << 13) + ((127u - 15u) << 23)));
  // Subnormal or zero: em * 2^-24 is exact in float.
  const float magnitude = static_cast<float>(em) * 5.9604644775390625e-8f;
  return BitsFloat(sign | FloatBits(magnitude));
}

// Round to nearest even. Results below the f16 normal range are rounded by an
// exact float addition that aligns the f16 subnormal ulp (2^-24) with the
// float ulp; normal results by adding half an ulp (minus one if even).
uint16_t FloatToF16(float f) {
  uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  uint32_t h;
  if (u >= (127u + 16u) << 23) {  // >= 65536: inf, or NaN
    h = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < (127u - 14u) << 23) {  // below 2^-14: f16 subnormal or zero
    const float magic = BitsFloat(((127u - 15u) + (23u - 10u) + 1u) << 23);
    h = FloatBits(BitsFloat(u) + magic) - FloatBits(magic);
  } else {
    const uint32_t mantissa_odd = (u >> 13) & 1u;
    u += ((15u - 127u) << 23) + 0xfffu + mantissa_odd;
    h = u >> 13;
  }
  return static_cast<uint16_t>(h | sign);
}

// ---------------------------------------------------------------------------
// Reduction kernels, one pass: each step (64 bytes of every input) is summed
// over all ranks in registers, then written to every output. Each input is read
// once and each output written once; a step reads every input before it writes
// any output, so outputs[r] == inputs[r] (in place) is safe.
//
// Bit for bit XLA:CPU's psum: the sum starts from +0 (all -0 inputs give +0)
// and adds the inputs in rank order. Where two NaNs meet, x86 returns the first
// operand's, and XLA's psum returns the later rank's NaN for f32, f64 and bf16
// (input + sum) and the earlier one's for f16 (sum + input); measured on jax
// 0.10 to 0.12, pinned by tests/test_allreduce.py. A C++ compiler treats + as
// commutative even for NaN payloads, so the order is fixed by the instruction
// itself (asm); on other architectures the compiler's order stands.

using F32x4 = float __attribute__((vector_size(16)));
using F64x2 = double __attribute__((vector_size(16)));
using U32x4 = uint32_t __attribute__((vector_size(16)));
using U64x2 = uint64_t __attribute__((vector_size(16)));

constexpr std::size_t kStepBytes = 64;  // One cache line of every input per step.

#if defined(__x86_64__) && defined(__AVX__)
#define LIBRA_ADD_IN_ORDER(insn, a, b) asm("v" insn " %2, %1, %0" : "=x"(a) : "x"(a), "x"(b))
#elif defined(__x86_64__)
#define LIBRA_ADD_IN_ORDER(insn, a, b) asm(insn " %1, %0" : "+x"(a) : "x"(b))
#else
#define LIBRA_ADD_IN_ORDER(insn, a, b) (a = a + b)
#endif

// a + b, keeping a's NaN where both are NaN.
inline F32x4 AddFirstNaN(F32x4 a, F32x4 b) { LIBRA_ADD_IN_ORDER("addps", a, b); return a; }
inline F64x2 AddFirstNaN(F64x2 a, F64x2 b) { LIBRA_ADD_IN_ORDER("addpd", a, b); return a; }
inline float AddFirstNaN(float a, float b) { LIBRA_ADD_IN_ORDER("addss", a, b); return a; }
inline double AddFirstNaN(double a, double b) { LIBRA_ADD_IN_ORDER("addsd", a, b); return a; }
#undef LIBRA_ADD_IN_ORDER

// The sum's next value: the input first (XLA's order for f32 and f64).
struct InputFirst {
  template <typename V>
  V operator()(V sum, V input) const { return AddFirstNaN(input, sum); }
};
// Integers as unsigned: wrapping, no UB, no order to keep.
struct Wrapping {
  template <typename V>
  V operator()(V sum, V input) const { return sum + input; }
};

template <typename V>
V Load(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// Writes one step (64 bytes, 16-byte aligned) around the caches: a large call's outputs
// would leave them before anyone reads them, and a store that misses first reads the line
// it overwrites. Visible to other threads after StreamFence.
template <typename T, typename V>
void StoreStep(T* out, const V (&step)[4]) {
#if defined(__x86_64__)
  for (int k = 0; k < 4; ++k) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(out) + k, reinterpret_cast<__m128i>(step[k]));
  }
#else
  std::memcpy(out, step, kStepBytes);
#endif
}

void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// f32, f64, s32, s64: steps of four 16-byte vectors (V), then the rest element by element.
// `stream`: outputs that are not their rank's input are written with StoreStep.
template <typename T, typename V, typename Add>
void SumVectors(const void* const* inputs, void* const* outputs, int n, int m,
                std::size_t begin, std::size_t end, bool stream, Add add) {
  constexpr std::size_t kStep = kStepBytes / sizeof(T);
  constexpr std::size_t kLanes = sizeof(V) / sizeof(T);
  std::size_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    V sum[4] = {};
    for (int r = 0; r < n; ++r) {
      const T* x = static_cast<const T*>(inputs[r]) + i;
      for (int k = 0; k < 4; ++k) sum[k] = add(sum[k], Load<V>(x + k * kLanes));
    }
    for (int r = 0; r < m; ++r) {
      T* out = static_cast<T*>(outputs[r]) + i;
      if (stream && out != static_cast<const T*>(inputs[r]) + i) {
        StoreStep(out, sum);
      } else {
        std::memcpy(out, sum, kStepBytes);
      }
    }
  }
  if (stream) StreamFence();
  for (; i < end; ++i) {
    T sum = T(0);
    for (int r = 0; r < n; ++r) sum = add(sum, static_cast<const T*>(inputs[r])[i]);
    for (int r = 0; r < m; ++r) static_cast<T*>(outputs[r])[i] = sum;
  }
}

// The same steps with 32-byte vectors (AVX2), where the CPU has them: the same additions,
// element by element and in the same operand order, in half the instructions. Sums of
// cache-resident buffers are bound by instructions, not by memory: 1 MiB x 8 ranks, one
// thread, on the 2-core VM (an AMD EPYC), 557-655 us with 16-byte vectors, 326-432 us with
// these. Compiled for AVX2 and F16C by attribute, chosen at run time (ReduceVectorBytes).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LIBRA_HAVE_AVX2 1
#define LIBRA_AVX2 __attribute__((target("avx2,f16c")))

struct InputFirstF32x8 {
  LIBRA_AVX2 __m256i operator()(__m256i sum, __m256i input) const {
    __m256 a = _mm256_castsi256_ps(input);
    const __m256 b = _mm256_castsi256_ps(sum);
    asm("vaddps %2, %1, %0" : "=x"(a) : "x"(a), "x"(b));  // a + b, a's NaN
    return _mm256_castps_si256(a);
  }
};
struct InputFirstF64x4 {
  LIBRA_AVX2 __m256i operator()(__m256i sum, __m256i input) const {
    __m256d a = _mm256_castsi256_pd(input);
    const __m256d b = _mm256_castsi256_pd(sum);
    asm("vaddpd %2, %1, %0" : "=x"(a) : "x"(a), "x"(b));
    return _mm256_castpd_si256(a);
  }
};
struct WrappingU32x8 {
  LIBRA_AVX2 __m256i operator()(__m256i sum, __m256i input) const {
    return _mm256_add_epi32(sum, input);
  }
};
struct WrappingU64x4 {
  LIBRA_AVX2 __m256i operator()(__m256i sum, __m256i input) const {
    return _mm256_add_epi64(sum, input);
  }
};

// Steps of two 32-byte vectors; the element-wise rest as SumVectors does it. `stream`
// needs every output 32-byte aligned at `begin`.
template <typename T, typename V, typename Add, typename Add256>
LIBRA_AVX2 void SumVectorsAvx2(const void* const* inputs, void* const* outputs, int n, int m,
                               std::size_t begin, std::size_t end, bool stream, Add add,
                               Add256 add256) {
  constexpr std::size_t kStep = kStepBytes / sizeof(T);
  constexpr std::size_t kLanes = 32 / sizeof(T);
  std::size_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    __m256i sum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int r = 0; r < n; ++r) {
      const T* x = static_cast<const T*>(inputs[r]) + i;
      for (int k = 0; k < 2; ++k) {
        sum[k] = add256(sum[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + k * kLanes)));
      }
    }
    for (int r = 0; r < m; ++r) {
      T* out = static_cast<T*>(outputs[r]) + i;
      __m256i* o = reinterpret_cast<__m256i*>(out);
      if (stream && out != static_cast<const T*>(inputs[r]) + i) {
        _mm256_stream_si256(o, sum[0]);
        _mm256_stream_si256(o + 1, sum[1]);
      } else {
        _mm256_storeu_si256(o, sum[0]);
        _mm256_storeu_si256(o + 1, sum[1]);
      }
    }
  }
  if (stream) StreamFence();
  if (i < end) SumVectors<T, V>(inputs, outputs, n, m, i, end, false, add);
}
#endif

// AVX2 and F16C (every x86 CPU with AVX2 has F16C too).
bool CpuHasWideVectors() {
#if defined(LIBRA_HAVE_AVX2)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

std::atomic<int>& VectorBytes() {
  static std::atomic<int> bytes{CpuHasWideVectors() ? 32 : 16};
  return bytes;
}

// bf16: accumulated in f32 (input first, as XLA), rounded once. Steps of 16 elements.
void SumBf16(const void* const* inputs, void* const* outputs, int n, int m,
             std::size_t begin, std::size_t end) {
  constexpr std::size_t kStep = 16;
  for (std::size_t i = begin; i < end; i += kStep) {
    const std::size_t len = std::min(kStep, end - i);
    F32x4 sum[4] = {};
    for (int r = 0; r < n; ++r) {
      const uint16_t* x = static_cast<const uint16_t*>(inputs[r]) + i;
      float wide[kStep] = {};
      for (std::size_t j = 0; j < len; ++j) wide[j] = Bf16ToFloat(x[j]);
      for (int k = 0; k < 4; ++k) sum[k] = AddFirstNaN(Load<F32x4>(wide + 4 * k), sum[k]);
    }
    float total[kStep];
    std::memcpy(total, sum, sizeof(total));
    uint16_t result[kStep];
    for (std::size_t j = 0; j < kStep; ++j) result[j] = FloatToBf16(total[j]);
    for (int r = 0; r < m; ++r) {
      std::memcpy(static_cast<uint16_t*>(outputs[r]) + i, result, len * 2);
    }
  }
}

// f16: rounded to f16 after every addition (an f32 add then rounding is the
// exact f16 add), the sum first (XLA's order for f16). Steps of 16 elements.
void SumF16(const void* const* inputs, void* const* outputs, int n, int m,
            std::size_t begin, std::size_t end) {
  constexpr std::size_t kStep = 16;
  for (std::size_t i = begin; i < end; i += kStep) {
    const std::size_t len = std::min(kStep, end - i);
    float sum[kStep] = {};
    for (int r = 0; r < n; ++r) {
      const uint16_t* x = static_cast<const uint16_t*>(inputs[r]) + i;
      for (std::size_t j = 0; j < len; ++j) {
        sum[j] = F16ToFloat(FloatToF16(AddFirstNaN(sum[j], F16ToFloat(x[j]))));
      }
    }
    uint16_t result[kStep];
    for (std::size_t j = 0; j < len; ++j) result[j] = FloatToF16(sum[j]);
    for (int r = 0; r < m; ++r) {
      std::memcpy(static_cast<uint16_t*>(outputs[r]) + i, result, len * 2);
    }
  }
}

#if defined(LIBRA_HAVE_AVX2)
// bf16 and f16 eight lanes at a time (SumHalfAvx2), the same operations as SumBf16 and SumF16.
// A format gives the widening of eight values to f32 (exact), one accumulation, and the
// rounding of a step's sums back to its 16 bits.
//
// bf16: widened by a shift, accumulated in f32 with the input first, rounded once as
// FloatToBf16 rounds (to nearest even, NaN made canonical: sign | 0x7fc0). 4 MiB of bf16 per
// device x 8 ranks, default blocks, in XLA's calls on the 2-core VM: 9.9-10.9 ms with
// SumBf16, 5.0 ms with this (jax.lax.psum 14-25 ms).
struct Bf16Avx2 {
  LIBRA_AVX2 static __m256 Widen(__m128i half) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  LIBRA_AVX2 static __m256 Accumulate(__m256 sum, __m256 input) {
    asm("vaddps %2, %1, %0" : "=x"(input) : "x"(input), "x"(sum));  // input + sum, input's NaN
    return input;
  }
  LIBRA_AVX2 static __m256i Round(__m256 sum) {  // 16-bit results in 32-bit lanes
    const __m256i u = _mm256_castps_si256(sum);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i canonical = _mm256_or_si256(
        _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x8000)),
        _mm256_set1_epi32(0x7fc0));
    return _mm256_blendv_epi8(rounded, canonical, nan);
  }
  LIBRA_AVX2 static __m256i Narrow(const __m256 (&sum)[2]) {
    // Packing works within 128-bit halves (0-3, 8-11, 4-7, 12-15); the permute restores order.
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(Round(sum[0]), Round(sum[1])), 0xd8);
  }
};

// f16: an f32 addition, the sum first, rounded to f16 (to nearest even) after each; NaN
// results made canonical at the end (sign | 0x7e00), as FloatToF16 does. Payloads can differ
// along the way, but an addition's NaN is its first NaN operand's, so the sign that survives
// is the same. 4 MiB of f16 per device x 8 ranks, as above: 52 ms with SumF16, 4.0-5.6 ms
// with this (jax.lax.psum 26-32 ms).
struct F16Avx2 {
  LIBRA_AVX2 static __m256 Widen(__m128i half) { return _mm256_cvtph_ps(half); }
  LIBRA_AVX2 static __m256 Accumulate(__m256 sum, __m256 input) {
    asm("vaddps %2, %1, %0" : "=x"(sum) : "x"(sum), "x"(input));  // sum + input, sum's NaN
    return _mm256_cvtph_ps(_mm256_cvtps_ph(sum, _MM_FROUND_TO_NEAREST_INT));
  }
  LIBRA_AVX2 static __m128i Round(__m256 sum) {
    const __m128i h = _mm256_cvtps_ph(sum, _MM_FROUND_TO_NEAREST_INT);  // exact: f16 values
    const __m128i nan = _mm_cmpgt_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7fff)),
                                        _mm_set1_epi16(0x7c00));
    const __m128i canonical = _mm_or_si128(
        _mm_and_si128(h, _mm_set1_epi16(static_cast<int16_t>(0x8000))), _mm_set1_epi16(0x7e00));
    return _mm_blendv_epi8(h, canonical, nan);
  }
  LIBRA_AVX2 static __m256i Narrow(const __m256 (&sum)[2]) {
    return _mm256_set_m128i(Round(sum[1]), Round(sum[0]));
  }
};

// Steps of 16 elements; the rest element by element (`rest`, the 16-bit kernel of the format).
template <typename Format>
LIBRA_AVX2 void SumHalfAvx2(const void* const* inputs, void* const* outputs, int n, int m,
                            std::size_t begin, std::size_t end,
                            void (*rest)(const void* const*, void* const*, int, int,
                                         std::size_t, std::size_t)) {
  constexpr std::size_t kStep = 16;
  std::size_t i = begin;
  for (; i + kStep <= end; i += kStep) {
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int r = 0; r < n; ++r) {
      const uint16_t* x = static_cast<const uint16_t*>(inputs[r]) + i;
      for (int k = 0; k < 2; ++k) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * k));
        sum[k] = Format::Accumulate(sum[k], Format::Widen(half));
      }
    }
    const __m256i result = Format::Narrow(sum);
    for (int r = 0; r < m; ++r) {
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(static_cast<uint16_t*>(outputs[r]) + i), result);
    }
  }
  if (i < end) rest(inputs, outputs, n, m, i, end);
}

LIBRA_AVX2 void SumBf16Avx2(const void* const* inputs, void* const* outputs, int n, int m,
                            std::size_t begin, std::size_t end) {
  SumHalfAvx2<Bf16Avx2>(inputs, outputs, n, m, begin, end, SumBf16);
}
LIBRA_AVX2 void SumF16Avx2(const void* const* inputs, void* const* outputs, int n, int m,
                           std::size_t begin, std::size_t end) {
  SumHalfAvx2<F16Avx2>(inputs, outputs, n, m, begin, end, SumF16);
}
#undef LIBRA_AVX2
#else
// Without the wide kernels VectorBytes() is 16: these stand-ins are never chosen.
template <typename T, typename V, typename Add, typename Add256>
void SumVectorsAvx2(const void* const* inputs, void* const* outputs, int n, int m,
                    std::size_t begin, std::size_t end, bool stream, Add add,
                    Add256 add256);  // Not defined.
using InputFirstF32x8 = void;
using InputFirstF64x4 = void;
using WrappingU32x8 = void;
using WrappingU64x4 = void;
constexpr auto SumBf16Avx2 = SumBf16;
constexpr auto SumF16Avx2 = SumF16;
#endif

// f32, f64, s32 or s64 with 32-byte vectors (`wide`) or 16-byte ones.
template <typename T, typename V, typename Add, typename Add256>
void SumAtWidth(bool wide, const void* const* inputs, void* const* outputs, int n, int m,
                std::size_t begin, std::size_t end, bool stream) {
  if constexpr (!std::is_void_v<Add256>) {
    if (wide) {
      return SumVectorsAvx2<T, V>(inputs, outputs, n, m, begin, end, stream, Add{}, Add256{});
    }
  }
  SumVectors<T, V>(inputs, outputs, n, m, begin, end, stream, Add{});
}

// Sums elements [begin, end) of inputs[0..n) into outputs[0..m) (m <= n; output r is in
// place where it is inputs[r]): ReduceRange's and ReduceRangeTo's one body.
void SumRange(DType dtype, const void* const* inputs, void* const* outputs, int n, int m,
              std::size_t begin, std::size_t end, bool streaming_stores) {
  // Streaming stores need aligned steps (16 or 32 bytes, the vectors' width): every output
  // (XLA's are 64-byte aligned) and `begin` (chunks start on cache lines).
  const int width = VectorBytes().load(std::memory_order_relaxed);
  bool stream = streaming_stores;
  for (int r = 0; r < m && stream; ++r) {
    stream = (reinterpret_cast<uintptr_t>(outputs[r]) + begin * SizeOf(dtype)) % width == 0;
  }
  const bool wide = width == 32;
  switch (dtype) {
    case DType::kF32:
      return SumAtWidth<float, F32x4, InputFirst, InputFirstF32x8>(wide, inputs, outputs, n, m,
                                                                   begin, end, stream);
    case DType::kF64:
      return SumAtWidth<double, F64x2, InputFirst, InputFirstF64x4>(wide, inputs, outputs, n,
                                                                    m, begin, end, stream);
    case DType::kS32:
      return SumAtWidth<uint32_t, U32x4, Wrapping, WrappingU32x8>(wide, inputs, outputs, n, m,
                                                                  begin, end, stream);
    case DType::kS64:
      return SumAtWidth<uint64_t, U64x2, Wrapping, WrappingU64x4>(wide, inputs, outputs, n, m,
                                                                  begin, end, stream);
    case DType::kBF16:
      return (wide ? SumBf16Avx2 : SumBf16)(inputs, outputs, n, m, begin, end);
    case DType::kF16:
      return (wide ? SumF16Avx2 : SumF16)(inputs, outputs, n, m, begin, end);
    case DType::kBytes:
      break;  // Never summed: ValidateSpec refuses a reduction of bytes before any call.
  }
}

// The n input pointers advanced by `offset` bytes (on the stack for the usual team sizes).
class ShiftedInputs {
 public:
  ShiftedInputs(const void* const* inputs, int n, std::size_t offset) {
    const void** out = n <= kOnStack ? small_ : (large_.resize(n), large_.data());
    for (int r = 0; r < n; ++r) out[r] = static_cast<const char*>(inputs[r]) + offset;
    data_ = out;
  }
  const void* const* data() const { return data_; }

 private:
  static constexpr int kOnStack = 16;
  const void* small_[kOnStack];
  std::vector<const void*> large_;
  const void* const* data_;
};

// Copies `bytes` from `src` to `out` (which do not overlap). `stream`: past the caches where
// `out` is 16-byte aligned (see StoreStep); the caller fences (StreamFence) after its last.
void CopyRun(char* out, const char* src, std::size_t bytes, bool stream) {
  std::size_t done = 0;
#if defined(__x86_64__)
  if (stream && reinterpret_cast<uintptr_t>(out) % 16 == 0) {
    for (; done + kStepBytes <= bytes; done += kStepBytes) {
      for (int k = 0; k < 4; ++k) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(out + done) + k,
                         _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + done) + k));
      }
    }
  }
#else
  (void)stream;
#endif
  std::memcpy(out + done, src + done, bytes - done);
}

// Copies `bytes` from `src` to each of outputs[0..m) at `offset`: an all-gather's run. An
// output that is `src` itself (an in-place all-gather's own shard) is already there.
// `stream`: past the caches where an output is 16-byte aligned there (see StoreStep).
void CopyToAll(const void* src, void* const* outputs, int m, std::size_t offset,
               std::size_t bytes, bool stream) {
  for (int r = 0; r < m; ++r) {
    char* out = static_cast<char*>(outputs[r]) + offset;
    if (out == src) continue;
    CopyRun(out, static_cast<const char*>(src), bytes, stream);
  }
  if (stream) StreamFence();
}

// ---------------------------------------------------------------------------
// Splitting a buffer into worker tasks.

// A job's element range is cut into pieces that its tasks claim in turn, so
// that a task whose thread runs late (woken late, or sharing its core with
// XLA's threads) leaves its share to the others instead of holding the call up.
// Measured at 1 MiB x 8 ranks, 2 tasks, in XLA's calls on the 2-core VM (3 runs
// each of 60 calls interleaved with jax.lax.psum, median last arrival to
// reduction done): one half per task 737-807 us, 8 pieces per task 494-576 us.
inline constexpr int kPiecesPerTask = 8;

struct Chunking {
  int tasks = 0;                // Worker tasks (EffectiveBlocks).
  std::size_t per_piece = 0;    // Elements per piece (the last may have fewer).
  std::size_t pieces = 0;
};

Chunking Split(std::size_t count, DType dtype, int blocks) {
  if (count == 0) return {};
  const std::size_t esize = SizeOf(dtype);
  const std::size_t align = 64 / esize;  // Pieces start on cache lines.
  auto cut = [&](std::size_t parts) {
    std::size_t per = (count + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    return std::pair<std::size_t, std::size_t>{per, (count + per - 1) / per};
  };
  const std::size_t bytes = count * esize;
  const std::size_t by_size = std::max<std::size_t>(1, (bytes + kMinChunkBytes - 1) / kMinChunkBytes);
  const std::size_t tasks = cut(std::min<std::size_t>(std::max(blocks, 1), by_size)).second;
  const auto [per_piece, pieces] = cut(std::min<std::size_t>(tasks * kPiecesPerTask, by_size));
  return {static_cast<int>(tasks), per_piece, pieces};
}

// ---------------------------------------------------------------------------
// Debug log

int64_t MicrosSinceStart(Clock::time_point t) {
  static const Clock::time_point start = Clock::now();
  return std::chrono::duration_cast<std::chrono::microseconds>(t - start).count();
}

// ---------------------------------------------------------------------------
// One reduction in flight: the buffers of all ranks and their callbacks.

struct Job {
  std::string label;
  CallSpec spec;  // rank unused; members filled in (Normalized)
  int caller = -1;  // The rank whose thread runs task 0 (reduce_on_caller), or -1.
  int64_t iteration = 0;
  // Member m's buffer of rank r at [m * world + r]: each member's world pointers in a row, as
  // the kinds' pieces read them (Part).
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  std::vector<std::size_t> offsets;  // Member m's elements at [offsets[m], offsets[m + 1]).
  std::vector<DoneCallback> done;
  Chunking chunking;
  std::atomic<int> remaining{0};       // Tasks still running.
  std::atomic<std::size_t> next_piece{0};  // The next piece to claim.
  Clock::time_point first_arrival, start;
};

// Each callback on a completion thread of its own: for callers told from a
// thread that must not run their continuations (an arrival, the watchdog).
void CompleteAll(std::vector<DoneCallback> callbacks, const Status& status) {
  for (DoneCallback& done : callbacks) {
    if (!done) continue;
    ThreadPool::Completion().Schedule(
        [done = std::move(done), status] { done(status); });
  }
}

// The callbacks of a finished job, run in rank order by the reduce thread that
// finished it, with one helper on the completion pool standing by: the helper
// takes the next callback when the running one takes long (a continuation
// that computes, or waits for another device) and leaves a new helper standing
// by while more remain. So short continuations run back to back on a thread
// already awake, and a long one delays the others by one wake-up, as when each
// had its own thread. 1 MiB x 8 ranks in XLA's calls on the 2-core VM (median
// of 10): the last callback returned 196 us after the reduction with one
// thread each, 56-120 us run back to back.
struct Completions {
  std::vector<DoneCallback> callbacks;
  Status status;
  std::atomic<std::size_t> next{0};
  std::atomic<bool> helper_standing_by{false};
};

void RunCompletions(const std::shared_ptr<Completions>& c) {
  const std::size_t n = c->callbacks.size();
  for (;;) {
    const std::size_t i = c->next.fetch_add(1, std::memory_order_relaxed);
    if (i >= n) return;
    if (i + 1 < n && !c->helper_standing_by.exchange(true, std::memory_order_relaxed)) {
      ThreadPool::Completion().Schedule([c] {
        c->helper_standing_by.store(false, std::memory_order_relaxed);
        RunCompletions(c);
      });
    }
    DoneCallback done = std::move(c->callbacks[i]);  // This thread's alone: it claimed i.
    if (done) done(c->status);
  }
}

// Bounded in-memory log of completed calls (off unless SetCallRecording).
struct CallLog {
  std::mutex mu;
  std::size_t capacity = 0;
  std::deque<CallRecord> records;
};

CallLog& GetCallLog() {
  static NoDestructor<CallLog> log;
  return *log;
}

void Record(const Job& job, Clock::time_point end) {
  CallLog& log = GetCallLog();
  std::lock_guard<std::mutex> lock(log.mu);
  if (log.capacity == 0) return;
  CallRecord r;
  r.label = job.label;
  r.group = job.spec.group;
  r.iteration = job.iteration;
  r.world = job.spec.world;
  r.collective = job.spec.collective;
  r.dtype = job.spec.dtype;
  r.bytes = job.spec.count * SizeOf(job.spec.dtype);
  r.blocks = job.spec.blocks;
  r.tasks = job.chunking.tasks;
  r.first_arrival_us = MicrosSinceStart(job.first_arrival);
  r.start_us = MicrosSinceStart(job.start);
  r.end_us = MicrosSinceStart(end);
  log.records.push_back(std::move(r));
  while (log.records.size() > log.capacity) log.records.pop_front();
}

// The thread that finishes a job: an arrival's, inside its Arrive (a job with nothing to
// reduce), the caller's that ran a task (reduce_on_caller), or a reduce pool thread's.
enum class FinishedOn { kArrival, kCaller, kReduceTask };

void FinishJob(const std::shared_ptr<Job>& job, FinishedOn on) {
  Record(*job, Clock::now());
  if (DebugLoggingEnabled()) {
    const Clock::time_point end = Clock::now();
    std::fprintf(stderr,
                 "[libra_jax] site=%s kind=%s group=%lld iter=%lld world=%d dtype=%s "
                 "bytes=%zu blocks=%d tasks=%d first_arrival_us=%lld "
                 "start_us=%lld end_us=%lld wait_us=%lld reduce_us=%lld\n",
                 job->label.c_str(), Name(job->spec.collective),
                 static_cast<long long>(job->spec.group),
                 static_cast<long long>(job->iteration), job->spec.world,
                 Name(job->spec.dtype), job->spec.count * SizeOf(job->spec.dtype),
                 job->spec.blocks, job->chunking.tasks,
                 static_cast<long long>(MicrosSinceStart(job->first_arrival)),
                 static_cast<long long>(MicrosSinceStart(job->start)),
                 static_cast<long long>(MicrosSinceStart(end)),
                 static_cast<long long>(MicrosSinceStart(job->start) - MicrosSinceStart(job->first_arrival)),
                 static_cast<long long>(MicrosSinceStart(end) - MicrosSinceStart(job->start)));
  }
  switch (on) {
    case FinishedOn::kArrival:
      return CompleteAll(std::move(job->done), Status::Ok());
    case FinishedOn::kCaller: {
      DoneCallback own = std::move(job->done[job->caller]);
      CompleteAll(std::move(job->done), Status::Ok());
      if (own) own(Status::Ok());
      return;
    }
    case FinishedOn::kReduceTask: {
      // Continuations may run long here: the reduce pool may start another thread meanwhile.
      ThreadPool::Reduce().ReleaseCurrentThread();
      auto completions = std::make_shared<Completions>();
      completions->callbacks = std::move(job->done);
      completions->status = Status::Ok();
      return RunCompletions(completions);
    }
  }
}

// A large output XLA has just allocated is usually a fresh mapping (glibc maps
// every block above its mmap threshold anew, and XLA:CPU frees outputs it no
// longer holds), so each of its 4 KiB pages costs a trap on the first store.
// One MADV_POPULATE_WRITE over the range (Linux >= 5.14) allocates the same
// pages without a trap each: 64 MiB x 8 ranks into fresh mappings, 2 tasks,
// engine alone 141-145 -> 115-120 ms on the 2-core VM. A range whose first page
// is already resident (a reused buffer) is left alone: populating resident
// pages still walks them (16 MiB x 8 warm: 5.3 -> 8.1 ms when not skipped).
// Only a hint: without the kernel's support the stores fault as before.
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
void PopulateIfFresh(void* data, std::size_t bytes) {
  static std::atomic<bool> unsupported{false};
  if (unsupported.load(std::memory_order_relaxed)) return;
  const uintptr_t page = 4096;
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(data) + page - 1) & ~(page - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(page - 1);
  if (hi <= lo) return;
  unsigned char resident = 0;
  if (mincore(reinterpret_cast<void*>(lo), page, &resident) != 0 || (resident & 1)) return;
  if (madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_POPULATE_WRITE) != 0 && errno == EINVAL) {
    unsupported.store(true, std::memory_order_relaxed);
  }
}

// ---------------------------------------------------------------------------
// The collective kinds (engine.h: Collective): how a piece [begin, end) of the full
// buffer's range is done. Everything else (rendezvous, pool, pieces, timeouts, records)
// is the same for every kind.

// One member of a job, as a kind's piece works on it: its dtype, shards and buffers (one per
// rank, in rank order).
struct Part {
  DType dtype;
  int world;
  std::size_t segment;
  const void* const* inputs;
  void* const* outputs;
};

// Calls fn(rank, at, from, length) for each run of one rank's shard within [begin, end):
// elements [from, from + length) of the full buffer, at `at` in shard `rank`.
template <typename Fn>
void ForEachRun(const Part& spec, std::size_t begin, std::size_t end, Fn fn) {
  const std::size_t segment = spec.segment, period = segment * spec.world;
  for (std::size_t i = begin; i < end;) {
    const std::size_t row = i / period, within = i % period;
    const std::size_t j = within % segment;
    const std::size_t length = std::min(segment - j, end - i);
    fn(static_cast<int>(within / segment), row * segment + j, i, length);
    i += length;
  }
}

// `large`: the call writes at least kStreamingOutputBytes, so its outputs are written past
// the caches, and populated first where fresh (PopulateIfFresh).
void AllReducePiece(const Part& job, std::size_t begin, std::size_t end, bool large) {
  const std::size_t elem = SizeOf(job.dtype);
  for (int r = 0; large && r < job.world; ++r) {
    if (job.outputs[r] == job.inputs[r]) continue;
    PopulateIfFresh(static_cast<char*>(job.outputs[r]) + begin * elem, (end - begin) * elem);
  }
  ReduceRange(job.dtype, job.inputs, job.outputs, job.world, begin, end, large);
}

// Each run summed over every input, written to its shard's owner alone.
void ReduceScatterPiece(const Part& job, std::size_t begin, std::size_t end, bool large) {
  const std::size_t elem = SizeOf(job.dtype);
  ForEachRun(job, begin, end, [&](int rank, std::size_t at, std::size_t from,
                                  std::size_t length) {
    char* out = static_cast<char*>(job.outputs[rank]) + at * elem;
    if (large) PopulateIfFresh(out, length * elem);
    ReduceRangeTo(job.dtype, job.inputs, job.world, from, from + length, out, large);
  });
}

// Each run copied from its shard's owner to every output.
void AllGatherPiece(const Part& job, std::size_t begin, std::size_t end, bool large) {
  const std::size_t elem = SizeOf(job.dtype);
  for (int r = 0; large && r < job.world; ++r) {
    PopulateIfFresh(static_cast<char*>(job.outputs[r]) + begin * elem, (end - begin) * elem);
  }
  ForEachRun(job, begin, end, [&](int rank, std::size_t at, std::size_t from,
                                  std::size_t length) {
    CopyToAll(static_cast<const char*>(job.inputs[rank]) + at * elem, job.outputs, job.world,
              from * elem, length * elem, large);
  });
}

// Output positions [begin, end) of every rank's output: run `at` of output d's segment s (in
// its row) is input s's segment d of the same row, copied by its bytes. Every rank's output
// gets the piece's whole range, each run from one input (no sum, any dtype: DType::kBytes).
// Never in place (CheckNotAliased): a piece reads segments that another piece of the same
// call writes on other ranks.
void AllToAllPiece(const Part& job, std::size_t begin, std::size_t end, bool large) {
  const std::size_t elem = SizeOf(job.dtype);
  for (int d = 0; large && d < job.world; ++d) {
    PopulateIfFresh(static_cast<char*>(job.outputs[d]) + begin * elem, (end - begin) * elem);
  }
  const std::size_t segment = job.segment;
  ForEachRun(job, begin, end, [&](int source, std::size_t /*at*/, std::size_t from,
                                  std::size_t length) {
    // Output position `from` of rank d is row * period + source * segment + j; its element
    // is input `source`'s at row * period + d * segment + j.
    const char* in =
        static_cast<const char*>(job.inputs[source]) + (from - source * segment) * elem;
    for (int d = 0; d < job.world; ++d) {
      CopyRun(static_cast<char*>(job.outputs[d]) + from * elem, in + d * segment * elem,
              length * elem, large);
    }
  });
  if (large) StreamFence();
}

// A kind's shapes are its row of libra/dtype.h (LayoutOf): sums (not for DType::kBytes),
// segmented (rows of world segments of CallSpec::segment elements: the sharded kinds' shards,
// the all-to-all's exchanged segments), and every output (each element goes to every rank's
// output, else to its owner's) where no rank keeps a shard.
struct CollectiveKind {
  void (*piece)(const Part& part, std::size_t begin, std::size_t end, bool large);
};

// Indexed by Collective, as libra/dtype.h's kLayouts.
constexpr CollectiveKind kKinds[] = {
    {AllReducePiece}, {ReduceScatterPiece}, {AllGatherPiece}, {AllToAllPiece}};
static_assert(std::size(kKinds) == static_cast<std::size_t>(kNumCollectives),
              "one engine row per collective kind of libra/dtype.h");

bool KnownKind(Collective collective) { return KnownCollective(collective); }
const CollectiveKind& KindOf(Collective collective) {
  return kKinds[static_cast<int>(collective)];
}

// A piece of the members' ranges laid end to end: the part of each member it covers, done as
// that member's own call would do it.
void RunPiece(const Job& job, std::size_t piece) {
  const std::size_t begin = piece * job.chunking.per_piece;
  const std::size_t end = std::min(job.spec.count, begin + job.chunking.per_piece);
  // Bytes written in all: `count` per rank (all-reduce, all-gather, all-to-all), or one
  // shard per rank (the reduce-scatter: count in all).
  const bool every_output = !LayoutOf(job.spec.collective).shard_out;
  const std::size_t written = job.spec.count * SizeOf(job.spec.dtype) *
                              (every_output ? job.spec.world : 1);
  const auto& piece_of = KindOf(job.spec.collective).piece;
  const int world = job.spec.world;
  const std::size_t members = job.spec.members.size();
  // The last member that starts at or before `begin` (empty members before it hold nothing).
  std::size_t m = static_cast<std::size_t>(
      std::upper_bound(job.offsets.begin(), job.offsets.end() - 1, begin) - job.offsets.begin());
  for (m = m > 0 ? m - 1 : 0; m < members && job.offsets[m] < end; ++m) {
    const std::size_t lo = std::max(begin, job.offsets[m]) - job.offsets[m];
    const std::size_t hi = std::min(end, job.offsets[m + 1]) - job.offsets[m];
    if (lo >= hi) continue;
    const Part part{job.spec.dtype, world, job.spec.members[m].segment,
                    job.inputs.data() + m * world, job.outputs.data() + m * world};
    piece_of(part, lo, hi, written >= kStreamingOutputBytes);
  }
}

// One worker task: reduces pieces until none is left; the last task to stop finishes the job
// (every piece claimed has then been reduced).
void RunTask(const std::shared_ptr<Job>& job, bool on_caller) {
  for (;;) {
    const std::size_t piece = job->next_piece.fetch_add(1, std::memory_order_relaxed);
    if (piece >= job->chunking.pieces) break;
    RunPiece(*job, piece);
  }
  if (job->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    FinishJob(job, on_caller ? FinishedOn::kCaller : FinishedOn::kReduceTask);
  }
}

// Starts the reduction: one task per block, on the reduce pool except one
// when the caller (the last arrival) reduces on its own thread; whoever
// finishes last runs the callbacks (FinishJob).
void StartJob(std::shared_ptr<Job> job) {
  job->start = Clock::now();
  job->chunking = Split(job->spec.count, job->spec.dtype, job->spec.blocks);
  if (job->chunking.tasks == 0) {
    FinishJob(job, job->caller >= 0 ? FinishedOn::kCaller : FinishedOn::kArrival);
    return;
  }
  job->remaining.store(job->chunking.tasks);
  const int first_pooled = job->caller >= 0 ? 1 : 0;
  for (int task = first_pooled; task < job->chunking.tasks; ++task) {
    ThreadPool::Reduce().Schedule([job] { RunTask(job, false); });
  }
  if (first_pooled == 1) RunTask(job, true);
}

Status Invalid(std::string message) {
  return {Status::Code::kInvalidArgument, std::move(message)};
}

// `spec` with its members filled in (one of `count` elements where it names none; `count`
// their total) and their segments (a segmented kind's 0: count / world, one row); `segment`
// the first member's.
CallSpec Normalized(CallSpec spec) {
  if (spec.members.empty()) spec.members.push_back({spec.count, spec.segment});
  const bool segmented = KnownKind(spec.collective) && LayoutOf(spec.collective).segmented();
  spec.count = 0;
  for (Member& member : spec.members) {
    if (segmented && member.segment == 0 && spec.world > 0) {
      member.segment = member.count / spec.world;
    }
    spec.count += member.count;
  }
  spec.segment = spec.members.front().segment;
  return spec;
}

Status ValidateSpec(const CallSpec& spec) {
  if (!KnownKind(spec.collective)) {
    return Invalid("unknown collective kind " + std::to_string(static_cast<int>(spec.collective)));
  }
  if (spec.world < 1) return Invalid("world size must be >= 1, got " + std::to_string(spec.world));
  if (spec.rank < 0 || spec.rank >= spec.world) {
    return Invalid("rank " + std::to_string(spec.rank) + " is outside [0, " +
                   std::to_string(spec.world) + ")");
  }
  if (spec.blocks < 1 || spec.blocks > kMaxBlocks) {
    return Invalid("block count " + std::to_string(spec.blocks) + " is outside [1, " +
                   std::to_string(kMaxBlocks) + "]");
  }
  const Layout& kind = LayoutOf(spec.collective);
  if (kind.sums && spec.dtype == DType::kBytes) {
    return Invalid(std::string("a ") + kind.name + " sums numbers: it cannot take raw bytes");
  }
  // A segmented kind's rows: a sharded kind's shards, the all-to-all's exchanged segments.
  for (std::size_t m = 0; m < spec.members.size() && kind.segmented(); ++m) {
    const Member& member = spec.members[m];
    if (member.count > 0 &&
        (member.segment == 0 || member.count % (member.segment * spec.world) != 0)) {
      const std::string which =
          spec.members.size() > 1 ? "member " + std::to_string(m) + ": " : "";
      if (kind.exchanges) {
        return Invalid(which + std::to_string(member.count) + " elements are not whole rows of " +
                       std::to_string(spec.world) + " ranks x segment " +
                       std::to_string(member.segment) + " (each rank's segment d goes to rank d)");
      }
      return Invalid(which + std::to_string(member.count) + " elements are not whole shards of " +
                     std::to_string(spec.world) + " ranks x " + std::to_string(member.segment) +
                     " elements per run");
    }
  }
  return Status::Ok();
}

// An exchanging kind (the all-to-all) is never in place: its pieces run at once on several
// threads, and each reads segments of every input that another piece writes in some output.
// So no output of a member may overlap any input of it (any rank's: the buffers of one
// process's ranks may be views of one array); the other kinds' in-place forms are engine.h's.
Status CheckNotAliased(const CallSpec& spec, const std::vector<const void*>& inputs,
                       const std::vector<void*>& outputs,
                       const std::vector<std::size_t>& offsets) {
  if (!KnownKind(spec.collective) || !LayoutOf(spec.collective).exchanges) return Status::Ok();
  const std::size_t world = static_cast<std::size_t>(spec.world);
  const std::size_t elem = SizeOf(spec.dtype);
  for (std::size_t m = 0; m + 1 < offsets.size(); ++m) {
    const std::size_t bytes = (offsets[m + 1] - offsets[m]) * elem;
    if (bytes == 0) continue;
    for (std::size_t d = 0; d < world; ++d) {
      const uintptr_t out = reinterpret_cast<uintptr_t>(outputs[m * world + d]);
      for (std::size_t s = 0; s < world; ++s) {
        const uintptr_t in = reinterpret_cast<uintptr_t>(inputs[m * world + s]);
        if (out < in + bytes && in < out + bytes) {
          return Invalid((offsets.size() > 2 ? "member " + std::to_string(m) + ": " : "") +
                         "the output of rank " + std::to_string(d) +
                         " overlaps the input of rank " + std::to_string(s) + ": a " +
                         LayoutOf(spec.collective).name + " is not done in place");
        }
      }
    }
  }
  return Status::Ok();
}

std::string RankList(const std::vector<int>& ranks) {
  std::ostringstream out;
  out << '[';
  for (std::size_t i = 0; i < ranks.size(); ++i) out << (i ? ", " : "") << ranks[i];
  out << ']';
  return out.str();
}

}  // namespace

// ---------------------------------------------------------------------------

int EffectiveBlocks(std::size_t count, DType dtype, int blocks) {
  return Split(count, dtype, blocks).tasks;
}

void ReduceRange(DType dtype, const void* const* inputs, void* const* outputs,
                 int n, std::size_t begin, std::size_t end, bool streaming_stores) {
  SumRange(dtype, inputs, outputs, n, n, begin, end, streaming_stores);
}

void ReduceRangeTo(DType dtype, const void* const* inputs, int n, std::size_t begin,
                   std::size_t end, void* out, bool streaming_stores) {
  // The kernels write element i of the range to outputs[..] + i: shift the inputs instead,
  // so that the one output starts at the range's first element.
  const std::size_t offset = begin * SizeOf(dtype);
  ShiftedInputs shifted(inputs, n, offset);
  SumRange(dtype, shifted.data(), &out, n, 1, 0, end - begin, streaming_stores);
}

int ReduceVectorBytes() { return VectorBytes().load(std::memory_order_relaxed); }

bool SetReduceVectorBytes(int bytes) {
  if (bytes != 16 && !(bytes == 32 && CpuHasWideVectors())) return false;
  VectorBytes().store(bytes, std::memory_order_relaxed);
  return true;
}

Status AllReduce(DType dtype, const std::vector<const void*>& inputs,
                 const std::vector<void*>& outputs, std::size_t count, int blocks) {
  return RunCollective(Collective::kAllReduce, dtype, inputs, outputs, count, 0, blocks);
}

Status RunCollective(Collective collective, DType dtype, const std::vector<const void*>& inputs,
                     const std::vector<void*>& outputs, std::size_t count, std::size_t segment,
                     int blocks) {
  const int n = static_cast<int>(inputs.size());
  if (n < 1 || outputs.size() != inputs.size()) {
    return Invalid("need as many outputs as inputs, and at least one");
  }
  CallSpec spec;
  spec.collective = collective;
  spec.world = n;
  spec.dtype = dtype;
  spec.count = count;
  spec.segment = segment;
  spec.blocks = blocks;
  spec = Normalized(spec);
  if (Status s = ValidateSpec(spec); !s.ok()) return s;

  std::mutex mu;
  std::condition_variable cv;
  int pending = n;
  auto job = std::make_shared<Job>();
  job->label = "engine";
  job->spec = spec;
  job->inputs = inputs;
  job->outputs = outputs;
  job->offsets = {0, spec.count};
  if (Status s = CheckNotAliased(spec, job->inputs, job->outputs, job->offsets); !s.ok()) {
    return s;
  }
  for (int r = 0; r < n; ++r) {
    job->done.emplace_back([&](const Status&) {
      std::lock_guard<std::mutex> lock(mu);
      if (--pending == 0) cv.notify_all();
    });
  }
  job->first_arrival = Clock::now();
  job->caller = 0;  // This thread waits anyway: it runs a task too.
  StartJob(std::move(job));
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return pending == 0; });
  return Status::Ok();
}

void SetCallRecording(std::size_t capacity) {
  CallLog& log = GetCallLog();
  std::lock_guard<std::mutex> lock(log.mu);
  log.capacity = capacity;
  if (capacity == 0) log.records.clear();
}

std::vector<CallRecord> TakeCallRecords() {
  CallLog& log = GetCallLog();
  std::lock_guard<std::mutex> lock(log.mu);
  std::vector<CallRecord> out(std::make_move_iterator(log.records.begin()),
                              std::make_move_iterator(log.records.end()));
  log.records.clear();
  return out;
}

int64_t NowMicros() { return MicrosSinceStart(Clock::now()); }

bool DebugLoggingEnabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("LIBRA_JAX_DEBUG");
    return value != nullptr && *value != '\0' && std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

// ---------------------------------------------------------------------------
// Rendezvous

namespace {

struct RoundKey {
  int64_t group, run_id, iteration;
  bool operator<(const RoundKey& o) const {
    return std::tie(group, run_id, iteration) < std::tie(o.group, o.run_id, o.iteration);
  }
};

struct Round {
  RoundKey key;
  CallSpec spec;  // Of the first arrival; everyone must agree (except rank).
  std::vector<const void*> inputs;  // [member * world + rank], as Job's
  std::vector<void*> outputs;
  std::vector<DoneCallback> done;
  std::vector<bool> present;
  int arrived = 0;
  Clock::time_point first_arrival;
  uint64_t watch_id = 0;  // Watchdog entry, 0 if none.
};

}  // namespace

struct Rendezvous::State {
  std::string label;
  std::mutex mu;
  std::map<RoundKey, std::shared_ptr<Round>> rounds;
  // (group, rank) -> arrivals at this site in each of the last few runs.
  // Runs normally follow one another; keeping several is cheap insurance.
  std::map<std::pair<int64_t, int>, std::deque<std::pair<int64_t, int64_t>>> arrivals;
  // Rounds that failed; a late participant of one is turned away, never
  // paired with a later round. Bounded: the oldest are forgotten.
  std::set<RoundKey> failed;
  std::deque<RoundKey> failed_order;

  int64_t NextIteration(const CallSpec& spec) {
    auto& runs = arrivals[{spec.group, spec.rank}];
    for (auto& [run_id, calls] : runs) {
      if (run_id == spec.run_id) return calls++;
    }
    runs.emplace_back(spec.run_id, 1);
    if (runs.size() > 16) runs.pop_front();
    return 0;
  }

  void MarkFailed(const RoundKey& key) {
    if (failed.insert(key).second) failed_order.push_back(key);
    while (failed_order.size() > 4096) {
      failed.erase(failed_order.front());
      failed_order.pop_front();
    }
  }

  // Removes `round` (if still pending) and fails everyone in it. Returns the
  // callbacks to run, outside the lock.
  std::vector<DoneCallback> AbortLocked(const std::shared_ptr<Round>& round) {
    auto it = rounds.find(round->key);
    if (it == rounds.end() || it->second != round) return {};
    rounds.erase(it);
    MarkFailed(round->key);
    return std::move(round->done);
  }
};

namespace {

// One thread for the whole process that fails rounds whose absent ranks did
// not arrive in time. Rounds that complete cancel their entry.
class Watchdog {
 public:
  uint64_t Watch(Clock::time_point deadline, std::weak_ptr<Rendezvous::State> state,
                 std::weak_ptr<Round> round) {
    std::lock_guard<std::mutex> lock(shared_->mu);
    const uint64_t id = ++shared_->last_id;
    shared_->deadlines.emplace(deadline, id);
    shared_->entries.emplace(id, Entry{deadline, std::move(state), std::move(round)});
    if (!shared_->started) {
      shared_->started = true;
      std::thread(Loop, shared_).detach();
    }
    // Woken only for a deadline before the one it sleeps to: the next round's deadline is
    // usually later, so a loop of calls does not wake it (and take a core) at every call.
    if (deadline < shared_->wakes_at) shared_->cv.notify_one();
    return id;
  }

  void Cancel(uint64_t id) {
    std::lock_guard<std::mutex> lock(shared_->mu);
    auto it = shared_->entries.find(id);
    if (it == shared_->entries.end()) return;
    shared_->deadlines.erase({it->second.deadline, id});
    shared_->entries.erase(it);
  }

  void ResetAfterFork() {
    Graveyard().push_back(std::move(shared_));
    shared_ = std::make_shared<Shared>();
  }

  static Watchdog& Get() {
    static NoDestructor<Watchdog> watchdog;
    return *watchdog;
  }

 private:
  struct Entry {
    Clock::time_point deadline;
    std::weak_ptr<Rendezvous::State> state;
    std::weak_ptr<Round> round;
  };
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    std::set<std::pair<Clock::time_point, uint64_t>> deadlines;
    std::map<uint64_t, Entry> entries;
    uint64_t last_id = 0;
    bool started = false;
    // When the watchdog will look at the deadlines next: min() while it is awake (it looks
    // before it sleeps), max() while it waits for a first entry.
    Clock::time_point wakes_at = Clock::time_point::min();
  };

  static std::vector<std::shared_ptr<Shared>>& Graveyard() {
    static NoDestructor<std::vector<std::shared_ptr<Shared>>> graveyard;
    return *graveyard;
  }

  static void Loop(std::shared_ptr<Shared> shared) {
    pthread_setname_np(pthread_self(), "libra-watchdog");
    std::unique_lock<std::mutex> lock(shared->mu);
    for (;;) {
      if (shared->deadlines.empty()) {
        shared->wakes_at = Clock::time_point::max();
        shared->cv.wait(lock);
        shared->wakes_at = Clock::time_point::min();
        continue;
      }
      const auto [deadline, id] = *shared->deadlines.begin();
      if (Clock::now() < deadline) {
        shared->wakes_at = deadline;
        shared->cv.wait_until(lock, deadline);
        shared->wakes_at = Clock::time_point::min();
        continue;
      }
      shared->deadlines.erase(shared->deadlines.begin());
      auto it = shared->entries.find(id);
      Entry entry = std::move(it->second);
      shared->entries.erase(it);
      lock.unlock();
      Expire(entry);
      lock.lock();
    }
  }

  static void Expire(const Entry& entry) {
    std::shared_ptr<Rendezvous::State> state = entry.state.lock();
    std::shared_ptr<Round> round = entry.round.lock();
    if (!state || !round) return;
    std::vector<DoneCallback> callbacks;
    std::vector<int> missing, arrived;
    {
      std::lock_guard<std::mutex> lock(state->mu);
      for (int r = 0; r < round->spec.world; ++r) {
        (round->present[r] ? arrived : missing).push_back(r);
      }
      callbacks = state->AbortLocked(round);
    }
    if (callbacks.empty()) return;  // Completed (or failed) meanwhile.
    std::ostringstream message;
    message << "libra_jax " << Name(round->spec.collective) << " '" << state->label
            << "' timed out after "
            << round->spec.timeout_ms / 1000.0 << " s waiting for ranks "
            << RankList(missing) << " of " << round->spec.world << " (replica group "
            << round->key.group << ", call " << round->key.iteration
            << " of this run); ranks " << RankList(arrived)
            << " arrived. Every participant must reach the same collective; "
               "if the program is only slow, raise LIBRA_JAX_TIMEOUT_S.";
    CompleteAll(std::move(callbacks), {Status::Code::kDeadlineExceeded, message.str()});
  }

  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
};

}  // namespace

void ResetWatchdogAfterFork() { Watchdog::Get().ResetAfterFork(); }

Rendezvous::Rendezvous(std::string label) : state_(std::make_shared<State>()) {
  state_->label = std::move(label);
}

Rendezvous::~Rendezvous() {
  std::vector<std::shared_ptr<Round>> pending;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    for (auto& [key, round] : state_->rounds) pending.push_back(round);
    state_->rounds.clear();
  }
  for (const std::shared_ptr<Round>& round : pending) {
    CompleteAll(std::move(round->done),
                {Status::Code::kCancelled, std::string("libra_jax ") +
                                               Name(round->spec.collective) + " '" +
                                               state_->label +
                                               "' was destroyed before all ranks arrived"});
  }
}

void Rendezvous::Arrive(const CallSpec& call, const void* input, void* output,
                        DoneCallback done) {
  Arrive(call, std::vector<const void*>{input}, std::vector<void*>{output}, std::move(done));
}

void Rendezvous::Arrive(const CallSpec& call, std::vector<const void*> inputs,
                        std::vector<void*> outputs, DoneCallback done) {
  const CallSpec spec = Normalized(call);
  const std::string what = std::string("libra_jax ") + Name(spec.collective) + " '";
  Status s = ValidateSpec(spec);
  if (s.ok() && (inputs.size() != spec.members.size() || outputs.size() != inputs.size())) {
    s = Invalid(std::to_string(inputs.size()) + " inputs and " + std::to_string(outputs.size()) +
                " outputs for " + std::to_string(spec.members.size()) +
                " members: one of each per member");
  }
  if (!s.ok()) {
    s.message = what + state_->label + "': " + s.message;
    done(s);
    return;
  }
  const std::size_t members = spec.members.size();
  State& st = *state_;
  std::unique_lock<std::mutex> lock(st.mu);
  const RoundKey key{spec.group, spec.run_id, st.NextIteration(spec)};

  if (st.failed.count(key)) {
    lock.unlock();
    done({Status::Code::kDeadlineExceeded,
          what + st.label + "': rank " + std::to_string(spec.rank) +
              " arrived after its round had already failed (timed out or mismatched)"});
    return;
  }

  std::shared_ptr<Round>& slot = st.rounds[key];
  if (!slot) {
    slot = std::make_shared<Round>();
    slot->key = key;
    slot->spec = spec;
    slot->inputs.assign(members * spec.world, nullptr);
    slot->outputs.assign(members * spec.world, nullptr);
    slot->done.resize(spec.world);
    slot->present.assign(spec.world, false);
    slot->first_arrival = Clock::now();
    if (spec.timeout_ms > 0) {
      slot->watch_id = Watchdog::Get().Watch(slot->first_arrival + std::chrono::milliseconds(spec.timeout_ms),
                            state_, slot);
    }
  }
  std::shared_ptr<Round> round = slot;

  const CallSpec& first = round->spec;
  std::string mismatch;
  if (spec.collective != first.collective || spec.world != first.world ||
      spec.dtype != first.dtype || spec.count != first.count || spec.segment != first.segment ||
      spec.blocks != first.blocks || spec.members != first.members) {
    std::ostringstream m;
    m << "participants disagree: rank " << spec.rank << " brings " << Name(spec.collective)
      << " world=" << spec.world << " dtype=" << Name(spec.dtype) << " count=" << spec.count
      << " segment=" << spec.segment << " blocks=" << spec.blocks
      << " members=" << spec.members.size() << ", rank " << first.rank
      << " brought " << Name(first.collective) << " world=" << first.world
      << " dtype=" << Name(first.dtype) << " count=" << first.count
      << " segment=" << first.segment << " blocks=" << first.blocks
      << " members=" << first.members.size();
    if (spec.members.size() == first.members.size()) {
      for (std::size_t k = 0; k < members; ++k) {
        if (spec.members[k] == first.members[k]) continue;
        m << "; member " << k << ": count=" << spec.members[k].count << " segment="
          << spec.members[k].segment << " against count=" << first.members[k].count
          << " segment=" << first.members[k].segment;
        break;
      }
    }
    mismatch = m.str();
  } else if (round->present[spec.rank]) {
    mismatch = "rank " + std::to_string(spec.rank) + " arrived twice in one round";
  }
  if (!mismatch.empty()) {
    std::vector<DoneCallback> callbacks = st.AbortLocked(round);
    lock.unlock();
    if (round->watch_id) Watchdog::Get().Cancel(round->watch_id);
    callbacks.push_back(std::move(done));
    CompleteAll(std::move(callbacks),
                Invalid(what + st.label + "': " + mismatch));
    return;
  }

  for (std::size_t m = 0; m < members; ++m) {
    round->inputs[m * spec.world + spec.rank] = inputs[m];
    round->outputs[m * spec.world + spec.rank] = outputs[m];
  }
  round->done[spec.rank] = std::move(done);
  round->present[spec.rank] = true;
  if (++round->arrived < spec.world) return;

  st.rounds.erase(key);
  lock.unlock();
  if (round->watch_id) Watchdog::Get().Cancel(round->watch_id);

  auto job = std::make_shared<Job>();
  job->label = st.label;
  job->spec = first;
  job->iteration = key.iteration;
  job->inputs = std::move(round->inputs);
  job->outputs = std::move(round->outputs);
  job->offsets.assign(1, 0);
  for (const Member& member : first.members) job->offsets.push_back(job->offsets.back() + member.count);
  job->done = std::move(round->done);
  job->first_arrival = round->first_arrival;
  if (Status s = CheckNotAliased(first, job->inputs, job->outputs, job->offsets); !s.ok()) {
    // Only now are every rank's buffers known: every participant is told.
    s.message = what + st.label + "': " + s.message;
    CompleteAll(std::move(job->done), s);
    return;
  }
  if (spec.reduce_on_caller) job->caller = spec.rank;
  StartJob(std::move(job));
}

Status StagingBytes(const char* raw, std::size_t default_bytes, std::size_t* bytes) {
  if (raw == nullptr || *raw == '\0') {
    *bytes = default_bytes;
    return Status::Ok();
  }
  char* end = nullptr;
  const double mib = std::strtod(raw, &end);
  while (end != nullptr && *end == ' ') ++end;
  // NaN fails both comparisons; inf and 1e30 fail the second.
  if (end == raw || *end != '\0' || !(mib > 0) || !(mib <= kMaxStagingMib)) {
    return Status{Status::Code::kInvalidArgument,
                  std::string("LIBRA_JAX_CUDA_STAGING_MIB must be a number of MiB in (0, ") +
                      std::to_string(static_cast<int>(kMaxStagingMib)) + "], got '" + raw + "'"};
  }
  const std::size_t vectors = static_cast<std::size_t>(mib * (1 << 20)) / 16;
  *bytes = (vectors > 0 ? vectors : 1) * 16;
  return Status::Ok();
}

}  // namespace libra
