// Declarations shared by the FFI handlers and the nanobind module.
#pragma once

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace libra_ffi {

XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceInstantiate);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kCpuAllReduceExecute);

// The call-site state type, registered with XLA before the handler.
const XLA_FFI_TypeInfo* CpuAllReduceSiteTypeInfo();
ffi::TypeId* CpuAllReduceSiteTypeId();

}  // namespace libra_ffi
