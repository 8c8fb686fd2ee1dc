// The nanobind module `libra_jax._libra_ffi`: exports the FFI handlers and
// types as PyCapsules (registered from Python, lazily, once the CPU backend
// exists) and a few engine facts and entry points for tests and benchmarks.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "libra/engine.h"
#include "libra/nccl.h"
#include "libra/thread_pool.h"
#include "xla_ffi/handlers.h"
#include "xla_ffi/registry.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// A target's handlers as jax.ffi.register_ffi_target takes them: a bare
// capsule for an execute-only target, else {stage: capsule}.
nb::object TargetHandlers(const LibraFfiTarget& target) {
  if (!target.instantiate && !target.prepare && !target.initialize) {
    return EncapsulateFfiHandler(target.execute);
  }
  nb::dict stages;
  if (target.instantiate) stages["instantiate"] = EncapsulateFfiHandler(target.instantiate);
  if (target.prepare) stages["prepare"] = EncapsulateFfiHandler(target.prepare);
  if (target.initialize) stages["initialize"] = EncapsulateFfiHandler(target.initialize);
  stages["execute"] = EncapsulateFfiHandler(target.execute);
  return stages;
}

const LibraFfiTable& Table() {
  const LibraFfiTable* table = LibraFfiRegistry();
  if (table == nullptr || table->version != kLibraFfiRegistryVersion) {
    throw std::runtime_error("libra_jax: no FFI registration table of version " +
                             std::to_string(kLibraFfiRegistryVersion));
  }
  return *table;
}

// The table's targets of `platform` that this build has (name -> handlers).
nb::dict Registrations(const char* platform) {
  const LibraFfiTable& table = Table();
  nb::dict registrations;
  for (int i = 0; i < table.num_targets; ++i) {
    const LibraFfiTarget& target = table.targets[i];
    if (target.execute == nullptr || std::strcmp(target.platform, platform) != 0) continue;
    registrations[target.name] = TargetHandlers(target);
  }
  return registrations;
}

// Each target's handler traits (XLA_FFI_Handler_Traits bits), as XLA reads
// them: the handler called with the metadata extension (no execution).
nb::dict HandlerTraits() {
  const LibraFfiTable& table = Table();
  nb::dict traits;
  for (int i = 0; i < table.num_targets; ++i) {
    const LibraFfiTarget& target = table.targets[i];
    if (target.execute == nullptr) continue;
    XLA_FFI_Metadata metadata = {};
    metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
    XLA_FFI_Metadata_Extension extension = {};
    extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
    extension.extension_base.type = XLA_FFI_Extension_Metadata;
    extension.metadata = &metadata;
    XLA_FFI_CallFrame frame = {};
    frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
    frame.extension_start = &extension.extension_base;
    if (target.execute(&frame) != nullptr) {  // only on a struct-size mismatch
      throw std::runtime_error(std::string("libra_jax: no metadata from ") + target.name);
    }
    traits[target.name] = static_cast<uint32_t>(metadata.traits);
  }
  return traits;
}

nb::dict Types() {
  const LibraFfiTable& table = Table();
  nb::dict types;
  for (int i = 0; i < table.num_types; ++i) {
    const LibraFfiType& type = table.types[i];
    nb::dict capsules;
    capsules["type_id"] = nb::capsule(reinterpret_cast<void*>(type.type_id()));
    capsules["type_info"] =
        nb::capsule(reinterpret_cast<void*>(const_cast<XLA_FFI_TypeInfo*>(type.type_info())));
    types[type.name] = capsules;
  }
  return types;
}

// The table as Python data: one dict per target (role, name, platform, and the
// stages this build has a handler for), in the table's order.
nb::list Registry() {
  const LibraFfiTable& table = Table();
  nb::list targets;
  for (int i = 0; i < table.num_targets; ++i) {
    const LibraFfiTarget& target = table.targets[i];
    nb::list stages;
    if (target.instantiate) stages.append("instantiate");
    if (target.prepare) stages.append("prepare");
    if (target.initialize) stages.append("initialize");
    if (target.execute) stages.append("execute");
    nb::dict entry;
    entry["role"] = target.role;
    entry["name"] = target.name;
    entry["platform"] = target.platform;
    entry["stages"] = stages;
    targets.append(entry);
  }
  return targets;
}

// Role -> target name, for every target of the table (built or not).
nb::dict TargetNames() {
  const LibraFfiTable& table = Table();
  nb::dict names;
  for (int i = 0; i < table.num_targets; ++i) names[table.targets[i].role] = table.targets[i].name;
  return names;
}

using F32Array = nb::ndarray<float, nb::c_contig, nb::device::cpu>;

// Sums float32 buffers in place with the engine alone (no XLA): for tests of
// the engine's pool from Python (fork) and engine-only benchmarks.
void EngineAllReduceF32(std::vector<F32Array> buffers, int blocks) {
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (F32Array& b : buffers) {
    if (b.size() != buffers.front().size()) throw nb::value_error("buffers differ in size");
    inputs.push_back(b.data());
    outputs.push_back(b.data());
  }
  if (buffers.empty()) throw nb::value_error("need at least one buffer");
  libra::Status status;
  {
    nb::gil_scoped_release release;
    status = libra::AllReduce(libra::DType::kF32, inputs, outputs, buffers.front().size(), blocks);
  }
  if (!status.ok()) throw nb::value_error(status.message.c_str());
}

// --- NCCL's control path (libra/nccl.h): usable from Python without a GPU,
// against any library with NCCL's entry points (tests use a host-memory stub).

// The process's NCCL, opened on the CTA route `request` asks for the first time; auto (the
// entry points below but nccl_open) takes whatever route it was opened on.
const libra::nccl::Library& OpenNccl(
    libra::nccl::RouteRequest request = libra::nccl::RouteRequest::kAuto) {
  const libra::nccl::Library* library = nullptr;
  const libra::Status status = libra::nccl::Communicators::Get().Open("", request, &library);
  if (!status.ok()) throw std::runtime_error(status.message);
  return *library;
}

libra::nccl::UniqueId ToUniqueId(const nb::bytes& raw) {
  libra::nccl::UniqueId id{};
  if (raw.size() != id.size()) {
    throw nb::value_error(("an NCCL unique id has " + std::to_string(id.size()) +
                           " bytes, got " + std::to_string(raw.size())).c_str());
  }
  std::memcpy(id.data(), raw.c_str(), id.size());
  return id;
}

using HostArray = nb::ndarray<nb::c_contig, nb::device::cpu>;

libra::DType HostDType(const HostArray& a) {
  const nb::dlpack::dtype t = a.dtype();
  if (t == nb::dtype<float>()) return libra::DType::kF32;
  if (t == nb::dtype<double>()) return libra::DType::kF64;
  if (t == nb::dtype<int32_t>()) return libra::DType::kS32;
  if (t == nb::dtype<int64_t>()) return libra::DType::kS64;
  throw nb::type_error("nccl_allreduce_host: float32, float64, int32 or int64 arrays only");
}

// One rank's all-reduce, in place on a host array, through the communicator
// cache (the stream is null: a host-memory library completes the call).
void NcclAllReduceHost(int64_t comm_id, int nranks, int rank, int ctas, HostArray a,
                       int64_t timeout_ms) {
  OpenNccl();
  const libra::DType dtype = HostDType(a);
  libra::Status status;
  {
    nb::gil_scoped_release release;
    status = libra::nccl::Communicators::Get().AllReduce(comm_id, nranks, rank, ctas, a.data(),
                                                         a.data(), a.size(), dtype, nullptr,
                                                         timeout_ms);
  }
  if (!status.ok()) throw std::runtime_error(status.message);
}

// One rank's collective (`kind`: "all-reduce", "reduce-scatter", "all-gather" or "all-to-all")
// from one host array into another (the same memory, or views of one buffer, for NCCL's
// in-place forms; never for the all-to-all), through the communicator cache; `count` is
// NCCL's (libra::nccl::CountOf: the output's elements for a reduce-scatter, the input's for an
// all-gather, the elements sent to each peer for an all-to-all: the input's / nranks).
// The collective `kind` names (its model's name, libra/dtype.h's kLayouts); `who` names the
// entry point in the error.
libra::Collective HostKind(const std::string& kind, const char* who) {
  int index = 0;
  while (index < libra::kNumCollectives && kind != libra::kLayouts[index].name) ++index;
  if (index == libra::kNumCollectives) {
    throw nb::value_error((std::string(who) + ": unknown collective '" + kind + "'").c_str());
  }
  return static_cast<libra::Collective>(index);
}

// One member's call between host arrays: NCCL's count and the dtype, checked as `who`.
libra::nccl::Library::Member HostMember(libra::Collective collective, HostArray& input,
                                        HostArray& output, int nranks, const char* who) {
  const libra::DType dtype = HostDType(input);
  if (HostDType(output) != dtype) {
    throw nb::type_error((std::string(who) + ": dtypes differ").c_str());
  }
  if (nranks < 1) throw nb::value_error((std::string(who) + ": nranks must be positive").c_str());
  std::size_t count = 0;  // NCCL's, by the kind's row (the FFI handlers' rule)
  if (!libra::nccl::CountOf(collective, input.size(), output.size(), nranks, &count).ok()) {
    throw nb::value_error(
        (std::string(who) + ": sizes do not fit the collective and nranks").c_str());
  }
  return {input.data(), output.data(), count, dtype};
}

void NcclCollectiveHost(const std::string& kind, int64_t comm_id, int nranks, int rank, int ctas,
                        HostArray input, HostArray output, int64_t timeout_ms) {
  OpenNccl();
  const libra::Collective collective = HostKind(kind, "nccl_collective_host");
  const libra::nccl::Library::Member member =
      HostMember(collective, input, output, nranks, "nccl_collective_host");
  const libra::DType dtype = member.dtype;
  const std::size_t count = member.count;
  libra::Status status;
  {
    nb::gil_scoped_release release;
    status = libra::nccl::Communicators::Get().Call(collective, comm_id, nranks, rank, ctas,
                                                    input.data(), output.data(), count, dtype,
                                                    nullptr, timeout_ms);
  }
  if (!status.ok()) throw std::runtime_error(status.message);
}

// One rank's bucket (`inputs[i]` into `outputs[i]`, each member as NcclCollectiveHost takes
// its arrays) as one NCCL group through the communicator cache (Communicators::CallGroup, what
// the start and one-call handlers issue): the host-side check of what each CTA route issues
// for a bucket.
void NcclCollectiveGroupHost(const std::string& kind, int64_t comm_id, int nranks, int rank,
                             int ctas, std::vector<HostArray> inputs,
                             std::vector<HostArray> outputs, int64_t timeout_ms) {
  OpenNccl();
  constexpr const char* kWho = "nccl_collective_group_host";
  const libra::Collective collective = HostKind(kind, kWho);
  if (inputs.empty() || inputs.size() != outputs.size()) {
    throw nb::value_error("nccl_collective_group_host: as many outputs as inputs, at least one");
  }
  std::vector<libra::nccl::Library::Member> members;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    members.push_back(HostMember(collective, inputs[i], outputs[i], nranks, kWho));
  }
  libra::Status status;
  {
    nb::gil_scoped_release release;
    status = libra::nccl::Communicators::Get().CallGroup(collective, comm_id, nranks, rank, ctas,
                                                         members, nullptr, timeout_ms);
  }
  if (!status.ok()) throw std::runtime_error(status.message);
}

}  // namespace

NB_MODULE(_libra_ffi, m) {
  m.doc() = "XLA FFI handlers of libra_jax and the engine's constants.";
  // Everything below comes from the one table (xla_ffi/registry.cc).
  m.def("registrations", [] { return Registrations(kLibraFfiPlatformCpu); },
        "CPU FFI targets: name -> {stage: capsule}, or a capsule (execute only).");
  m.def("types", &Types, "FFI types: name -> {'type_id', 'type_info'} capsules.");
  m.def("handler_traits", &HandlerTraits,
        "Each target's XLA_FFI_Handler_Traits bits (1: command-buffer compatible), read "
        "through the FFI metadata call.");
  m.def("cuda_registrations", [] { return Registrations(kLibraFfiPlatformCuda); },
        "CUDA FFI targets: name -> capsule ({} without CUDA).");
  m.def("registry", &Registry,
        "The FFI targets' table: [{'role', 'name', 'platform', 'stages'}], stages built here.");
  m.attr("TARGETS") = TargetNames();
  m.attr("REGISTRY_VERSION") = kLibraFfiRegistryVersion;
#ifdef LIBRA_WITH_CUDA
  m.attr("HAS_CUDA") = true;
  {
    nb::dict build;
    build["cuda_compiler"] = LIBRA_BUILD_CUDA_COMPILER;
    build["cuda_version"] = LIBRA_BUILD_CUDA_VERSION;
    build["cuda_architectures"] = LIBRA_BUILD_CUDA_ARCHS;
    m.attr("CUDA_BUILD") = build;
  }
  m.attr("CUDA_MAX_RANKS") = libra_ffi::kCudaMaxRanks;
  m.def("cuda_pending_starts", &libra_ffi::CudaPendingStarts,
        "CUDA and NCCL start/done pairs started and not yet done (stale ones expire: "
        "libra/streams.h).");
  m.def("cuda_peer_access", &libra_ffi::CudaPeerAccess, nb::arg("devices"),
        "1 if every pair of these CUDA devices can access each other's memory, 0 if one "
        "cannot, -1 if CUDA cannot say (no GPU).");
  m.def("cuda_effective_blocks", &libra_ffi::CudaEffectiveBlocks, nb::arg("bytes"),
        nb::arg("nranks"), nb::arg("algorithm"), nb::arg("blocks"),
        "Blocks the CUDA kernel launches for a call (algorithm: 0 auto, 1 one-shot, "
        "2 two-shot), with this process's staging capacity.");
#else
  m.attr("HAS_CUDA") = false;
#endif
  m.attr("MAX_BLOCKS") = libra::kMaxBlocks;
  m.attr("MIN_CHUNK_BYTES") = libra::kMinChunkBytes;
  m.def("effective_blocks",
        [](std::size_t count, int itemsize, int blocks) {
          const libra::DType dtype = itemsize == 2   ? libra::DType::kF16
                                     : itemsize == 4 ? libra::DType::kF32
                                                     : libra::DType::kF64;
          return libra::EffectiveBlocks(count, dtype, blocks);
        },
        nb::arg("count"), nb::arg("itemsize"), nb::arg("blocks"),
        "Worker tasks that reduce `count` elements when `blocks` are asked for.");
  m.def("cpu_pending_starts", &libra_ffi::CpuPendingStarts,
        "CPU start/done pairs started and not yet done (abandoned ones expire: "
        "xla_ffi/cpu_collectives.cc).");
  m.def("pool_threads",
        [] {
          return std::make_pair(libra::ThreadPool::Reduce().num_threads(),
                                libra::ThreadPool::Completion().num_threads());
        },
        "Threads started by the engine's (reduce, completion) pools.");
  m.def("engine_allreduce_f32", &EngineAllReduceF32, nb::arg("buffers"), nb::arg("blocks"));
  m.def("set_call_recording", &libra::SetCallRecording, nb::arg("capacity"),
        "Keep the last `capacity` completed calls in memory (0: stop and drop).");
  m.def("take_call_records",
        [] {
          nb::list out;
          for (const libra::CallRecord& r : libra::TakeCallRecords()) {
            nb::dict d;
            d["label"] = r.label;
            d["group"] = r.group;
            d["iteration"] = r.iteration;
            d["world"] = r.world;
            d["collective"] = libra::Name(r.collective);
            d["dtype"] = libra::Name(r.dtype);
            d["bytes"] = r.bytes;
            d["blocks"] = r.blocks;
            d["tasks"] = r.tasks;
            d["first_arrival_us"] = r.first_arrival_us;
            d["start_us"] = r.start_us;
            d["end_us"] = r.end_us;
            out.append(d);
          }
          return out;
        },
        "The recorded calls (dicts, oldest first; 'collective': 'all-reduce', "
        "'reduce-scatter', 'all-gather' or 'all-to-all', 'bytes': the full buffer's), "
        "clearing them.");
  m.def("now_us", &libra::NowMicros, "Now, in microseconds on the call records' clock.");

  m.def("nccl_open",
        [](const std::string& route) {
          libra::nccl::RouteRequest request = libra::nccl::RouteRequest::kAuto;
          const libra::Status parsed = libra::nccl::ParseRouteRequest(route, &request);
          if (!parsed.ok()) throw nb::value_error(parsed.message.c_str());
          const libra::nccl::Library& lib = OpenNccl(request);
          return std::make_tuple(lib.path(), lib.version(),
                                 libra::nccl::VersionString(lib.version()),
                                 std::string(libra::nccl::Name(lib.route())), lib.max_ctas(),
                                 lib.splits());
        },
        nb::arg("route") = "auto",
        "Loads NCCL once (see libra/nccl.h), on CTA route `route` ('auto': the version's, "
        "'per-collective' or 'per-communicator'; read the first time only): (path, version "
        "code, version, CTA route, the largest per-call CTA limit it honours, 0 for none, "
        "whether per-block-count communicators are split from the group's); "
        "RuntimeError naming the problem if it cannot, or if a forced route is not the one "
        "NCCL was opened on.");
  m.def("nccl_unique_id",
        [] {
          libra::nccl::UniqueId id;
          const libra::Status status = OpenNccl().GetUniqueId(&id);
          if (!status.ok()) throw std::runtime_error(status.message);
          return nb::bytes(id.data(), id.size());
        },
        "A new NCCL unique id (bytes).");
  m.def("nccl_register_id",
        [](int64_t comm_id, const nb::bytes& raw) {
          const libra::Status status =
              libra::nccl::Communicators::Get().RegisterId(comm_id, ToUniqueId(raw));
          if (!status.ok()) throw nb::value_error(status.message.c_str());
        },
        nb::arg("comm_id"), nb::arg("unique_id"),
        "Registers the unique id of this process's communicator `comm_id`.");
  m.def("nccl_allreduce_host", &NcclAllReduceHost, nb::arg("comm_id"), nb::arg("nranks"),
        nb::arg("rank"), nb::arg("ctas"), nb::arg("array"), nb::arg("timeout_ms") = 0,
        "One rank's in-place all-reduce of a host array through the communicator cache "
        "(for tests against a host-memory NCCL).");
  m.def("nccl_collective_host", &NcclCollectiveHost, nb::arg("kind"), nb::arg("comm_id"),
        nb::arg("nranks"), nb::arg("rank"), nb::arg("ctas"), nb::arg("input"),
        nb::arg("output"), nb::arg("timeout_ms") = 0,
        "One rank's all-reduce, reduce-scatter, all-gather or all-to-all between host arrays "
        "through the communicator cache (for tests against a host-memory NCCL).");
  m.def("nccl_collective_group_host", &NcclCollectiveGroupHost, nb::arg("kind"),
        nb::arg("comm_id"), nb::arg("nranks"), nb::arg("rank"), nb::arg("ctas"),
        nb::arg("inputs"), nb::arg("outputs"), nb::arg("timeout_ms") = 0,
        "One rank's bucket of host arrays as one NCCL group through the communicator cache "
        "(for tests against a host-memory NCCL).");
  m.def("nccl_communicators", [] { return libra::nccl::Communicators::Get().size(); },
        "NCCL communicators this process has created.");
}
