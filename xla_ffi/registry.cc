// The table of FFI targets and types (registry.h): the only place their names
// are written.
#include "xla_ffi/registry.h"

#include <iterator>

#include "xla_ffi/handlers.h"

namespace {

namespace lf = libra_ffi;  // the handler symbols (handlers.h)

// A CUDA handler, or null in a build without CUDA (the target keeps its name).
#ifdef LIBRA_WITH_CUDA
#define LIBRA_CUDA_HANDLER(handler) handler
#else
#define LIBRA_CUDA_HANDLER(handler) nullptr
#endif

constexpr LibraFfiTarget kTargets[] = {
    // role, name, platform, instantiate, prepare, initialize, execute
    {"cpu", "libra_allreduce_cpu", kLibraFfiPlatformCpu, lf::kCpuAllReduceInstantiate, nullptr,
     nullptr, lf::kCpuAllReduceExecute},
    // The same call split in two (libra_jax.ops.start_done): start arrives, done waits.
    // Every CPU call and start takes a bucket's members as separate operands and results.
    {"cpu_start", "libra_allreduce_cpu_start", kLibraFfiPlatformCpu,
     lf::kCpuAllReduceStartInstantiate, nullptr, nullptr, lf::kCpuAllReduceStart},
    {"cpu_done", "libra_allreduce_cpu_done", kLibraFfiPlatformCpu, nullptr, nullptr, nullptr,
     lf::kCpuAllReduceDone},
    // The engine's other collective kinds (libra::Collective), each one call.
    {"cpu_reduce_scatter", "libra_reduce_scatter_cpu", kLibraFfiPlatformCpu,
     lf::kCpuAllReduceInstantiate, nullptr, nullptr, lf::kCpuReduceScatterExecute},
    {"cpu_all_gather", "libra_all_gather_cpu", kLibraFfiPlatformCpu, lf::kCpuAllReduceInstantiate,
     nullptr, nullptr, lf::kCpuAllGatherExecute},
    {"cpu_all_to_all", "libra_all_to_all_cpu", kLibraFfiPlatformCpu, lf::kCpuAllReduceInstantiate,
     nullptr, nullptr, lf::kCpuAllToAllExecute},
    // The sharded kinds' starts (in place, a flat buffer per member); their done is cpu_done.
    // (The all-to-all has none: never in place, its overlap is not planned yet.)
    {"cpu_reduce_scatter_start", "libra_reduce_scatter_cpu_start", kLibraFfiPlatformCpu,
     lf::kCpuAllReduceStartInstantiate, nullptr, nullptr, lf::kCpuReduceScatterStart},
    {"cpu_all_gather_start", "libra_all_gather_cpu_start", kLibraFfiPlatformCpu,
     lf::kCpuAllReduceStartInstantiate, nullptr, nullptr, lf::kCpuAllGatherStart},
    {"cuda", "libra_allreduce_cuda", kLibraFfiPlatformCuda, nullptr, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kCudaAllReduce)},
    // The same kernel on libra's own stream, and the wait for it (libra_jax.ops.start_done).
    {"cuda_start", "libra_allreduce_cuda_start", kLibraFfiPlatformCuda, nullptr, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kCudaAllReduceStart)},
    {"cuda_done", "libra_allreduce_cuda_done", kLibraFfiPlatformCuda, nullptr, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kCudaAllReduceDone)},
    // NCCL with a per-call CTA limit (cpp/libra/nccl.h) on libra's stream, as one call
    // and as a start (its done is cuda_done); communicators made at initialization.
    {"nccl", "libra_allreduce_nccl", kLibraFfiPlatformCuda, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kNcclAllReduceInitialize), LIBRA_CUDA_HANDLER(lf::kNcclAllReduce)},
    {"nccl_start", "libra_allreduce_nccl_start", kLibraFfiPlatformCuda, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kNcclAllReduceStartInitialize),
     LIBRA_CUDA_HANDLER(lf::kNcclAllReduceStart)},
    // NCCL's reduce-scatter and all-gather: one call, and a start (their done is cuda_done);
    // communicators made at initialization, as the all-reduce's.
    {"nccl_reduce_scatter", "libra_reduce_scatter_nccl", kLibraFfiPlatformCuda, nullptr,
     nullptr, LIBRA_CUDA_HANDLER(lf::kNcclAllReduceInitialize),
     LIBRA_CUDA_HANDLER(lf::kNcclReduceScatter)},
    {"nccl_all_gather", "libra_all_gather_nccl", kLibraFfiPlatformCuda, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kNcclAllReduceInitialize), LIBRA_CUDA_HANDLER(lf::kNcclAllGather)},
    // NCCL's all-to-all: one call (ncclAlltoAll from 2.28, a group of ncclSend/ncclRecv
    // before; never in place, no start yet), communicators made at initialization.
    {"nccl_all_to_all", "libra_all_to_all_nccl", kLibraFfiPlatformCuda, nullptr, nullptr,
     LIBRA_CUDA_HANDLER(lf::kNcclAllReduceInitialize), LIBRA_CUDA_HANDLER(lf::kNcclAllToAll)},
    {"nccl_reduce_scatter_start", "libra_reduce_scatter_nccl_start", kLibraFfiPlatformCuda,
     nullptr, nullptr, LIBRA_CUDA_HANDLER(lf::kNcclAllReduceStartInitialize),
     LIBRA_CUDA_HANDLER(lf::kNcclReduceScatterStart)},
    {"nccl_all_gather_start", "libra_all_gather_nccl_start", kLibraFfiPlatformCuda, nullptr,
     nullptr, LIBRA_CUDA_HANDLER(lf::kNcclAllReduceStartInitialize),
     LIBRA_CUDA_HANDLER(lf::kNcclAllGatherStart)},
};

#undef LIBRA_CUDA_HANDLER

constexpr LibraFfiType kTypes[] = {
    {"libra_allreduce_cpu_site", kLibraFfiPlatformCpu, LibraCpuAllReduceSiteTypeId,
     LibraCpuAllReduceSiteTypeInfo},
};

constexpr LibraFfiTable kTable = {
    kLibraFfiRegistryVersion,
    static_cast<int>(std::size(kTargets)), kTargets,
    static_cast<int>(std::size(kTypes)), kTypes,
};

}  // namespace

extern "C" const LibraFfiTable* LibraFfiRegistry() { return &kTable; }
