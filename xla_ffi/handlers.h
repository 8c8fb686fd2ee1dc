// Declarations shared by the FFI handlers and the nanobind module.
#pragma once

#include <cstddef>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace libra_ffi {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceExecute);

// The call-site state type, registered with XLA before the handler.
const XLA_FFI_TypeInfo* CpuAllReduceSiteTypeInfo();
ffi::TypeId* CpuAllReduceSiteTypeId();

// The CUDA all-reduce (xla_ffi/cuda_allreduce.cc; built when nvcc is found,
// which defines LIBRA_WITH_CUDA).
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCudaAllReduce);
// Blocks the CUDA kernel uses for a call (see libra::cuda::EffectiveBlocks).
int CudaEffectiveBlocks(std::size_t bytes, int nranks, int algorithm, int blocks);
// The largest team the CUDA kernels serve.
inline constexpr int kCudaMaxRanks = 8;

}  // namespace libra_ffi
