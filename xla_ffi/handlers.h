// Declarations shared by the FFI handlers and the nanobind module.
#pragma once

#include <cstddef>

#include <string>
#include <vector>

#include "libra/dtype.h"
#include "libra/status.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace libra_ffi {

// A libra outcome as XLA's error (the same codes; kOk is success).
inline ffi::Error ToFfiError(const libra::Status& status) {
  using Code = libra::Status::Code;
  switch (status.code) {
    case Code::kOk: return ffi::Error::Success();
    case Code::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, status.message);
    case Code::kFailedPrecondition:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, status.message);
    case Code::kDeadlineExceeded:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message);
    case Code::kCancelled: return ffi::Error(ffi::ErrorCode::kCancelled, status.message);
    case Code::kInternal: break;
  }
  return ffi::Error(ffi::ErrorCode::kInternal, status.message);
}

// The engine's element type of an XLA buffer type; InvalidArgument for others.
inline ffi::ErrorOr<libra::DType> ToEngineDType(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::F32: return libra::DType::kF32;
    case ffi::DataType::F64: return libra::DType::kF64;
    case ffi::DataType::BF16: return libra::DType::kBF16;
    case ffi::DataType::F16: return libra::DType::kF16;
    case ffi::DataType::S32: return libra::DType::kS32;
    case ffi::DataType::S64: return libra::DType::kS64;
    default:
      return ffi::Unexpected(ffi::Error::InvalidArgument(
          "libra_jax: the engine sums f32, f64, bf16, f16, s32 and s64, not element type " +
          std::to_string(static_cast<int>(dtype))));
  }
}

// The CPU engine's calls (xla_ffi/cpu_collectives.cc), each over a bucket's members as separate
// operands and results: one call of each kind (libra::Collective), one instantiate for all.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuReduceScatterExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllGatherExecute);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllToAllExecute);
// The same calls split in two (libra_jax.ops.start_done): a start arrives and returns at
// once; the one done (every kind's) waits for the round's end. One instantiate for the starts.
// (The all-to-all has no start yet: it is one call.)
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceStartInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuReduceScatterStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllGatherStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceDone);

// The call-site state type, registered with XLA before the handler.
const XLA_FFI_TypeInfo* CpuAllReduceSiteTypeInfo();
ffi::TypeId* CpuAllReduceSiteTypeId();

// CPU starts whose done has not come yet (entries of the in-flight map, cpu_collectives.cc).
std::size_t CpuPendingStarts();

// The CUDA all-reduce (xla_ffi/cuda_collectives.cc; built when nvcc is found,
// which defines LIBRA_WITH_CUDA).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaAllReduce);
// The same kernel on libra's own stream: start launches, done joins XLA's stream.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaAllReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaAllReduceDone);
// NCCL with a per-call CTA limit on libra's stream (same file), as one call and
// as a start (done is kCudaAllReduceDone); each makes its communicator when XLA
// initialises the program (the initialize stage).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllReduce);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllReduceInitialize);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllReduceStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllReduceStartInitialize);
// NCCL's reduce-scatter and all-gather, as one call and as a start (in place in one flat row
// of shards; done is kCudaAllReduceDone); their initialize stages are the all-reduce's.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclReduceScatter);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllGather);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclReduceScatterStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllGatherStart);
// NCCL's all-to-all, one call (never in place, no start yet): each member's x and result hold
// a segment per rank, in rank order; its initialize stage is the all-reduce's.
XLA_FFI_DECLARE_HANDLER_SYMBOL(kNcclAllToAll);
// CUDA (and NCCL) starts whose done has not come yet (libra's streams' pending map).
std::size_t CudaPendingStarts();
// Blocks the CUDA kernel uses for a call (see libra::cuda::EffectiveBlocks).
int CudaEffectiveBlocks(std::size_t bytes, int nranks, int algorithm, int blocks);
// 1 if every pair of `devices` has peer access, 0 if a pair has not, -1 if
// CUDA cannot say (no GPU, a bad ordinal): the P2P path's lowering check.
int CudaPeerAccess(const std::vector<int>& devices);
// The largest team the CUDA kernels serve.
inline constexpr int kCudaMaxRanks = 8;

}  // namespace libra_ffi
