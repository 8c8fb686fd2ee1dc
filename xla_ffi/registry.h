// The one table of libra_jax's XLA FFI targets and types: for each target its
// name, its platform and its handler per execution stage; for each type its
// name and its id and info. The only place their names are written
// (registry.cc). Both builds export it: the nanobind module builds
// registrations(), cuda_registrations(), types() and TARGETS from it
// (xla_ffi/module.cc), and the Bazel library libra_jax_ffi.so exports
// LibraFfiRegistry(), which libra_jax/_ffi.py walks with ctypes.
//
// Plain C structs (read through ctypes): change their layout only together
// with kLibraFfiRegistryVersion and the ctypes mirror in libra_jax/_ffi.py.
#pragma once

#include "xla/ffi/api/c_api.h"

// Platforms as jax.ffi.register_ffi_target/register_ffi_type name them.
inline constexpr char kLibraFfiPlatformCpu[] = "cpu";
inline constexpr char kLibraFfiPlatformCuda[] = "CUDA";

// The layout of the structs below; LibraFfiTable::version.
inline constexpr int kLibraFfiRegistryVersion = 1;

extern "C" {

// One FFI target. A stage without a handler is null. `execute` is null for a
// target this build lacks (the CUDA ones without nvcc, which defines
// LIBRA_WITH_CUDA): its name is still the one Python lowers to.
struct LibraFfiTarget {
  const char* role;      // the short name Python knows it by: "cpu", "cpu_start", ...
  const char* name;      // the custom call's target name
  const char* platform;  // kLibraFfiPlatformCpu or kLibraFfiPlatformCuda
  XLA_FFI_Handler* instantiate;
  XLA_FFI_Handler* prepare;
  XLA_FFI_Handler* initialize;
  XLA_FFI_Handler* execute;
};

// One FFI type, registered before the targets that use it.
struct LibraFfiType {
  const char* name;
  const char* platform;
  XLA_FFI_TypeId* (*type_id)();
  const XLA_FFI_TypeInfo* (*type_info)();
};

struct LibraFfiTable {
  int version;  // kLibraFfiRegistryVersion
  int num_targets;
  const LibraFfiTarget* targets;
  int num_types;
  const LibraFfiType* types;
};

// The table (static, never null, never freed).
const LibraFfiTable* LibraFfiRegistry();

// The call-site state type as C functions (cpu_collectives.cc), for the table.
XLA_FFI_TypeId* LibraCpuAllReduceSiteTypeId();
const XLA_FFI_TypeInfo* LibraCpuAllReduceSiteTypeInfo();

}  // extern "C"
