#include "libra/nccl.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <thread>
#include <vector>

namespace libra::nccl {
namespace {

// NCCL's ABI, as much of it as libra uses (nccl.h is not needed to build).
constexpr unsigned kApiMagic = 0xcafebeef;   // NCCL_API_MAGIC
constexpr int kUndefInt = INT_MIN;           // NCCL_CONFIG_UNDEF_INT
constexpr int kSuccess = 0;                  // ncclSuccess
constexpr int kInProgress = 7;               // ncclInProgress (non-blocking communicators)
constexpr int kSum = 0;                      // ncclSum
constexpr int kInvalidArgument = 4;          // ncclInvalidArgument

struct RawUniqueId {
  char internal[kUniqueIdBytes];
};

// ncclConfig_t as of NCCL 2.31 (ncclConfig_v23100), up to launchOrderImplicit,
// the last field libra sets (offsets checked against the nvidia-nccl-cu12
// 2.31.2 wheel's nccl.h). NCCL copies a config up to its own size and resets
// the fields its `version` predates (minCTAs/maxCTAs below 2.17), so this one
// layout, with version 2.31, serves every NCCL from 2.17 on: an older NCCL
// reads the fields it knows and ignores the rest. Unset fields are
// NCCL_CONFIG_UNDEF_INT / NULL, as NCCL_CONFIG_INITIALIZER leaves them.
struct CommConfigV23100 {
  std::size_t size;
  unsigned magic;
  unsigned version;
  int blocking;
  int cga_cluster_size;
  int min_ctas;             // 2.17
  int max_ctas;             // 2.17
  const char* net_name;     // 2.17
  int split_share;          // 2.18
  int traffic_class;        // 2.25
  const char* comm_name;
  int collnet_enable;       // 2.27
  int cta_policy;
  int shrink_share;
  int nvls_ctas;
  int channels_per_net_peer;  // 2.28
  int nvlink_centric_sched;
  int graph_usage_mode;     // 2.29
  int num_rma_ctx;
  int max_p2p_peers;        // 2.30
  int graph_stream_ordering;  // 2.30.5
  int launch_order_implicit;  // 2.31
};
static_assert(offsetof(CommConfigV23100, split_share) == 40, "ncclConfig_t.splitShare");
static_assert(offsetof(CommConfigV23100, launch_order_implicit) == 96,
              "ncclConfig_t.launchOrderImplicit (nccl.h 2.31.2)");
constexpr unsigned kCommConfigVersion = kPerCollectiveVersion;

// ncclCollConfig_t as of NCCL 2.31 (64 bytes, the smallest 2.31 accepts).
struct CollConfigV23100 {
  std::size_t size;
  unsigned magic;
  unsigned version;
  void* ext;
  int min_ctas;
  int max_ctas;
  int nvls_ctas;
  int cga_cluster_size;
  const char* alg_selection;
  int force_alg_selection;
  int cta_policy;
  uint64_t user_profiler_tag;
};
static_assert(sizeof(CollConfigV23100) == 64, "ncclCollConfig_t v2.31 is 64 bytes");

CommConfigV23100 UnsetCommConfig() {
  CommConfigV23100 config;
  std::memset(&config, 0, sizeof config);  // pointers NULL (NCCL_CONFIG_UNDEF_PTR)
  config.size = sizeof config;
  config.magic = kApiMagic;
  config.version = kCommConfigVersion;
  int* const ints[] = {&config.blocking, &config.cga_cluster_size, &config.min_ctas,
                       &config.max_ctas, &config.split_share, &config.traffic_class,
                       &config.collnet_enable, &config.cta_policy, &config.shrink_share,
                       &config.nvls_ctas, &config.channels_per_net_peer,
                       &config.nvlink_centric_sched, &config.graph_usage_mode,
                       &config.num_rma_ctx, &config.max_p2p_peers,
                       &config.graph_stream_ordering, &config.launch_order_implicit};
  for (int* field : ints) *field = kUndefInt;
  return config;
}

int ToNcclDataType(DType dtype) {
  switch (dtype) {
    case DType::kS32: return 2;   // ncclInt32
    case DType::kS64: return 4;   // ncclInt64
    case DType::kF16: return 6;   // ncclFloat16
    case DType::kF32: return 7;   // ncclFloat32
    case DType::kF64: return 8;   // ncclFloat64
    case DType::kBF16: return 9;  // ncclBfloat16
    case DType::kBytes: return 1;  // ncclUint8: copies only (Library::Collective refuses a sum)
  }
  return -1;
}

// Result slots of splits abandoned mid-way, which NCCL's thread may still write: kept for
// the life of the process (reachable, so not a leak), never read.
class Slots {
 public:
  void Keep(void** slot) {
    std::lock_guard<std::mutex> lock(mu_);
    slots_.emplace_back(slot);
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<void*>> slots_;
};

Slots& AbandonedSlots() {
  static Slots* slots = new Slots();  // never destroyed
  return *slots;
}

Status Error(Status::Code code, std::string message) {
  Status status;
  status.code = code;
  status.message = "libra NCCL: " + std::move(message);
  return status;
}

}  // namespace

struct Library::Api {
  using GetVersion = int (*)(int*);
  using GetUniqueId = int (*)(RawUniqueId*);
  using CommInitRankConfig = int (*)(void**, int, RawUniqueId, int, CommConfigV23100*);
  // A summing kind's entry points (ncclAllReduce, ncclReduceScatter: count, datatype, op) and
  // a copying kind's (ncclAllGather, ncclAlltoAll: no operator), plain and with a per-call
  // config (NCCL >= 2.31); the count is the kind's as libra/dtype.h's Layout::counts_in says.
  using Sums = int (*)(const void*, void*, std::size_t, int, int, void*, void*);
  using SumsConfig = int (*)(const void*, void*, std::size_t, int, int, void*, void*,
                             const CollConfigV23100*);
  using Copies = int (*)(const void*, void*, std::size_t, int, void*, void*);
  using CopiesConfig = int (*)(const void*, void*, std::size_t, int, void*, void*,
                               const CollConfigV23100*);
  // ncclSend(sendbuff, count, datatype, peer, comm, stream); ncclRecv likewise.
  using Send = int (*)(const void*, std::size_t, int, int, void*, void*);
  using Recv = int (*)(void*, std::size_t, int, int, void*, void*);
  using CommCount = int (*)(const void*, int*);
  using CommDestroy = int (*)(void*);
  using CommAbort = int (*)(void*);
  using CommGetAsyncError = int (*)(void*, int*);
  using CommSplit = int (*)(void*, int, int, void**, CommConfigV23100*);
  using GetErrorString = const char* (*)(int);
  using Group = int (*)();

  GetVersion get_version = nullptr;
  GetUniqueId get_unique_id = nullptr;
  CommInitRankConfig comm_init_rank_config = nullptr;
  // Each kind's entry points, by libra::Collective (kLaunches' symbols): null where this
  // library lacks one (ncclAlltoAll before 2.28, every config form before 2.31).
  void* plain[libra::kNumCollectives] = {};
  void* configured[libra::kNumCollectives] = {};
  Send send = nullptr;                           // the all-to-all's route before 2.28
  Recv recv = nullptr;
  CommCount comm_count = nullptr;
  CommSplit comm_split = nullptr;                // NCCL >= 2.18 only
  CommDestroy comm_destroy = nullptr;
  CommAbort comm_abort = nullptr;
  CommGetAsyncError comm_get_async_error = nullptr;
  GetErrorString get_error_string = nullptr;
  Group group_start = nullptr;
  Group group_end = nullptr;
};

namespace {

// NCCL's launch of each collective kind: one row per kind, indexed by libra::Collective as
// libra/dtype.h's kLayouts (NCCL's src/graph/tuning.cc style: a table, read by one formula in
// Library::Launch). A kind whose layout row sums is issued with ncclSum (Api::Sums), the
// others copy (Api::Copies); `count` is NCCL's (Layout::counts_in). Where the library lacks
// `plain` (older than `since`), a `by_sends` kind (an exchanging one) runs as one group of
// ncclSend/ncclRecv with every rank; others are refused. A kind without a row does not
// compile (the static_assert below); a row without `plain` is refused by name (Checked).
struct NcclLaunch {
  const char* plain;       // NCCL's entry point; null: libra's NCCL path has none
  const char* configured;  // its per-call-config form (NCCL >= 2.31)
  int since;               // the first NCCL with `plain` (0: any libra loads, 2.14 on)
  bool by_sends;           // before `since`: `count` sent to and received from every rank
};
constexpr NcclLaunch kLaunches[] = {
    {"ncclAllReduce", "ncclAllReduceConfig", 0, false},
    {"ncclReduceScatter", "ncclReduceScatterConfig", 0, false},
    {"ncclAllGather", "ncclAllGatherConfig", 0, false},
    {"ncclAlltoAll", "ncclAlltoAllConfig", kAlltoAllVersion, true},
};
static_assert(std::size(kLaunches) == static_cast<std::size_t>(libra::kNumCollectives),
              "one NCCL launch per collective kind of libra/dtype.h: a new kind needs its row");

// Sends and receives stand for an exchange only (block d to rank d, block s from rank s).
constexpr bool SendsOnlyExchange() {
  for (int k = 0; k < libra::kNumCollectives; ++k) {
    if (kLaunches[k].by_sends && !libra::kLayouts[k].exchanges) return false;
  }
  return true;
}
static_assert(SendsOnlyExchange(), "ncclSend/ncclRecv stand for an exchanging kind only");

const NcclLaunch& LaunchOf(libra::Collective kind) { return kLaunches[static_cast<int>(kind)]; }

}  // namespace

const char* Name(CtaRoute route) {
  switch (route) {
    case CtaRoute::kPerCollective: return "per-collective";
    case CtaRoute::kPerCommunicator: return "per-communicator";
    case CtaRoute::kNone: return "none";
  }
  return "none";
}

const char* Name(RouteRequest request) {
  switch (request) {
    case RouteRequest::kAuto: return "auto";
    case RouteRequest::kPerCollective: return Name(CtaRoute::kPerCollective);
    case RouteRequest::kPerCommunicator: return Name(CtaRoute::kPerCommunicator);
  }
  return "auto";
}

Status ParseRouteRequest(const std::string& name, RouteRequest* request) {
  for (const RouteRequest known : {RouteRequest::kAuto, RouteRequest::kPerCollective,
                                   RouteRequest::kPerCommunicator}) {
    if (name == Name(known)) {
      *request = known;
      return Status::Ok();
    }
  }
  return Error(Status::Code::kInvalidArgument,
               "LIBRA_JAX_NCCL_CTA_ROUTE must be auto, per-collective or per-communicator, "
               "got '" + name + "'");
}

int MaxCtas(int version) {
  if (version < kCtaConfigVersion) return 0;
  return version < kWideChannelsVersion ? 32 : 64;
}

int CallCtasLimit(int version, CtaRoute route) {
  switch (route) {
    case CtaRoute::kPerCollective: return std::min(kCommCtas, MaxCtas(version));
    case CtaRoute::kPerCommunicator: return MaxCtas(version);
    case CtaRoute::kNone: return 0;
  }
  return 0;
}

std::string VersionString(int code) {
  // NCCL_VERSION(X, Y, Z): X*1000 + Y*100 + Z up to 2.8, X*10000 + Y*100 + Z after.
  const int major = code >= 10000 ? code / 10000 : code / 1000;
  const int minor = code >= 10000 ? code / 100 % 100 : code / 100 % 10;
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(code % 100);
}

CtaRoute RouteFor(int version, bool has_per_collective_entry) {
  if (version < kCtaConfigVersion) return CtaRoute::kNone;
  return version >= kPerCollectiveVersion && has_per_collective_entry
             ? CtaRoute::kPerCollective
             : CtaRoute::kPerCommunicator;
}

Status ChooseRoute(int version, bool has_per_collective_entry, RouteRequest request,
                   const std::string& library, CtaRoute* route) {
  const CtaRoute own = RouteFor(version, has_per_collective_entry);
  // The messages name the setting the request comes from (libra_jax.config reads it).
  const std::string asked = std::string("LIBRA_JAX_NCCL_CTA_ROUTE=") + Name(request) +
                            ", but " + library + " (NCCL " + VersionString(version) + ")";
  switch (request) {
    case RouteRequest::kAuto:
      *route = own;
      return Status::Ok();
    case RouteRequest::kPerCommunicator:  // a pinned communicator: every NCCL with CTA fields
      if (own == CtaRoute::kNone) {
        return Error(Status::Code::kInvalidArgument,
                     asked + " has no CTA limit (NCCL >= 2.17 has)");
      }
      *route = CtaRoute::kPerCommunicator;
      return Status::Ok();
    case RouteRequest::kPerCollective:
      if (own != CtaRoute::kPerCollective) {
        return Error(Status::Code::kInvalidArgument,
                     asked + " has no ncclAllReduceConfig (NCCL >= 2.31 has)");
      }
      *route = CtaRoute::kPerCollective;
      return Status::Ok();
  }
  return Error(Status::Code::kInvalidArgument,
               "unknown CTA route request " + std::to_string(static_cast<int>(request)));
}

Status CountOf(libra::Collective kind, std::size_t input, std::size_t output, int nranks,
               std::size_t* count) {
  if (!libra::KnownCollective(kind)) {
    return Error(Status::Code::kInvalidArgument,
                 "unknown collective kind " + std::to_string(static_cast<int>(kind)));
  }
  const libra::Layout& layout = libra::LayoutOf(kind);
  const std::size_t n = nranks > 0 ? static_cast<std::size_t>(nranks) : 0;
  const std::size_t in_counts = layout.counts_in(n), out_counts = layout.counts_out(n);
  if (n == 0 || input % in_counts != 0 || output != input / in_counts * out_counts) {
    return Error(Status::Code::kInvalidArgument,
                 std::string("NCCL ") + layout.name + ": " + std::to_string(input) + " in and " +
                     std::to_string(output) + " out do not fit " + std::to_string(nranks) +
                     " ranks");
  }
  *count = input / in_counts;
  return Status::Ok();
}

Status Library::Open(const std::string& path, RouteRequest request,
                     std::unique_ptr<Library>* library) {
  void* handle = nullptr;
  std::string name = path;
  if (path.empty()) {
    name = "libnccl.so.2";
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_NOLOAD);  // XLA's, if loaded
    if (handle == nullptr) handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  } else {
    handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  if (handle == nullptr) {
    const char* why = dlerror();
    return Error(Status::Code::kInternal,
                 "cannot load " + name + ": " + (why ? why : "unknown error") +
                     " (install nvidia-nccl-cu13 or set LIBRA_JAX_NCCL_LIBRARY)");
  }
  std::unique_ptr<Library> lib(new Library());  // private constructor: no make_unique
  lib->handle_ = handle;
  lib->path_ = name;
  lib->api_ = std::make_unique<Api>();
  Api& api = *lib->api_;
  struct Entry {
    const char* symbol;
    void** slot;
    bool required;
  };
  const Entry entries[] = {
      {"ncclGetVersion", reinterpret_cast<void**>(&api.get_version), true},
      {"ncclGetUniqueId", reinterpret_cast<void**>(&api.get_unique_id), true},
      {"ncclCommInitRankConfig", reinterpret_cast<void**>(&api.comm_init_rank_config), true},
      {"ncclCommDestroy", reinterpret_cast<void**>(&api.comm_destroy), true},
      {"ncclCommAbort", reinterpret_cast<void**>(&api.comm_abort), true},
      {"ncclCommGetAsyncError", reinterpret_cast<void**>(&api.comm_get_async_error), true},
      {"ncclGetErrorString", reinterpret_cast<void**>(&api.get_error_string), true},
      {"ncclGroupStart", reinterpret_cast<void**>(&api.group_start), true},
      {"ncclGroupEnd", reinterpret_cast<void**>(&api.group_end), true},
      {"ncclSend", reinterpret_cast<void**>(&api.send), false},
      {"ncclRecv", reinterpret_cast<void**>(&api.recv), false},
      {"ncclCommCount", reinterpret_cast<void**>(&api.comm_count), false},
      {"ncclCommSplit", reinterpret_cast<void**>(&api.comm_split), false},
  };
  for (const Entry& entry : entries) {
    *entry.slot = dlsym(handle, entry.symbol);
    if (*entry.slot == nullptr && entry.required) {
      return Error(Status::Code::kInternal, name + " has no " + entry.symbol +
                                                " (NCCL >= 2.14 is needed)");
    }
  }
  for (int k = 0; k < libra::kNumCollectives; ++k) {  // each kind's, from its row
    const NcclLaunch& launch = kLaunches[k];
    if (launch.plain != nullptr) api.plain[k] = dlsym(handle, launch.plain);
    if (launch.configured != nullptr) api.configured[k] = dlsym(handle, launch.configured);
    if (launch.plain != nullptr && launch.since == 0 && api.plain[k] == nullptr) {
      return Error(Status::Code::kInternal, name + " has no " + launch.plain +
                                                " (NCCL >= 2.14 is needed)");
    }
  }
  Status status = lib->Check(api.get_version(&lib->version_), "ncclGetVersion");
  if (!status.ok()) return status;
  status = ChooseRoute(
      lib->version_,
      api.configured[static_cast<int>(libra::Collective::kAllReduce)] != nullptr, request,
      name, &lib->route_);
  if (!status.ok()) return status;
  lib->splits_ = lib->version_ >= kSplitShareVersion && api.comm_split != nullptr;
  *library = std::move(lib);
  return Status::Ok();
}

Library::~Library() {
  if (handle_ != nullptr) dlclose(handle_);
}

Status Library::Check(int result, const char* what) const {
  if (result == kSuccess) return Status::Ok();
  const char* text = api_->get_error_string ? api_->get_error_string(result) : nullptr;
  return Error(Status::Code::kInternal, std::string(what) + " failed: " +
                                            (text ? text : "error " + std::to_string(result)));
}

Status Library::GetUniqueId(UniqueId* id) const {
  RawUniqueId raw{};
  Status status = Check(api_->get_unique_id(&raw), "ncclGetUniqueId");
  if (status.ok()) std::memcpy(id->data(), raw.internal, kUniqueIdBytes);
  return status;
}

Status Library::InitRank(const UniqueId& id, int nranks, int rank, int ctas, void** comm,
                         int64_t timeout_ms) const {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    return Error(Status::Code::kInvalidArgument, "rank " + std::to_string(rank) + " of " +
                                                     std::to_string(nranks) + " ranks");
  }
  if (ctas > 0 && ctas > MaxCtas(version_)) {
    return Error(Status::Code::kInvalidArgument,
                 std::to_string(ctas) + " CTAs: NCCL " + VersionString(version_) +
                     (MaxCtas(version_) == 0 ? " has no CTA limit (NCCL >= 2.17 has)"
                                             : " runs a collective on at most " +
                                                   std::to_string(MaxCtas(version_))));
  }
  // Non-blocking (blocking = 0): creation returns at once and completes as the ranks arrive,
  // so a rank that never does turns into an error after the timeout instead of a hang.
  CommConfigV23100 config = UnsetCommConfig();
  config.blocking = 0;
  if (ctas > 0) config.min_ctas = config.max_ctas = ctas;
  // NCCL >= 2.31 orders this communicator's kernels after those of the GPU's other
  // communicators in host launch order (libra issues in program order, see
  // libra/streams.h); older ones ignore the field (NCCL_LAUNCH_ORDER_IMPLICIT instead).
  config.launch_order_implicit = 1;
  RawUniqueId raw;
  std::memcpy(raw.internal, id.data(), kUniqueIdBytes);
  *comm = nullptr;
  const int started = api_->comm_init_rank_config(comm, nranks, raw, rank, &config);
  if (started != kSuccess && started != kInProgress) {
    if (*comm != nullptr) api_->comm_abort(*comm);
    *comm = nullptr;
    return Check(started, "ncclCommInitRankConfig");
  }
  const Status status = Wait(*comm, timeout_ms,
                             "creating the communicator of rank " + std::to_string(rank) +
                                 " of " + std::to_string(nranks));
  if (!status.ok()) *comm = nullptr;  // aborted by Wait
  return status;
}

Status Library::Split(void* parent, int rank, int ctas, void** child,
                      int64_t timeout_ms) const {
  if (!splits_) {
    return Error(Status::Code::kInvalidArgument,
                 "NCCL " + VersionString(version_) + " has no ncclCommSplit with shared "
                 "resources (NCCL >= 2.18 has)");
  }
  if (ctas < 1 || ctas > MaxCtas(version_)) {
    return Error(Status::Code::kInvalidArgument,
                 std::to_string(ctas) + " CTAs: NCCL " + VersionString(version_) +
                     " runs a collective on 1 to " + std::to_string(MaxCtas(version_)));
  }
  CommConfigV23100 config = UnsetCommConfig();
  config.blocking = 0;
  config.min_ctas = config.max_ctas = ctas;
  config.split_share = 1;  // the parent's buffers, proxy and stream: memory of one communicator
  config.launch_order_implicit = 1;
  // Every rank of the parent splits, in the same order, with one color: the child has the
  // parent's ranks. A non-blocking split sets *child when it completes; its progress and
  // errors show on the parent (NCCL: "a split may be stopped by aborting the parent").
  // NCCL's thread stores the child there when the split completes, maybe after a timeout
  // here: the slot lives on the heap and is kept (8 bytes, in AbandonedSlots) unless the
  // split is over.
  void** made = new void*(nullptr);
  const int started = api_->comm_split(parent, 0, rank, made, &config);
  if (started != kSuccess && started != kInProgress) {
    delete made;
    return Check(started, "ncclCommSplit");
  }
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto pause = std::chrono::microseconds(50);
  const std::string what = "splitting the communicator of rank " + std::to_string(rank) +
                           " for " + std::to_string(ctas) + " CTAs";
  for (;;) {
    void* const ready = __atomic_load_n(made, __ATOMIC_ACQUIRE);
    int state = kInProgress;
    if (ready != nullptr) {
      const int queried = api_->comm_get_async_error(ready, &state);
      if (queried != kSuccess) state = queried;
      if (state == kSuccess) {
        *child = ready;
        delete made;
        return Status::Ok();
      }
    } else {
      const int queried = api_->comm_get_async_error(parent, &state);
      if (queried != kSuccess) state = queried;
      if (state == kSuccess) state = kInProgress;  // the parent is fine: the child is coming
    }
    if (state != kInProgress) {
      if (ready != nullptr) {
        api_->comm_abort(ready);
        delete made;  // set: the split is over
      }
      return Check(state, what.c_str());
    }
    if (timeout_ms > 0 && Clock::now() >= deadline) {
      if (ready != nullptr) {
        api_->comm_abort(ready);
        delete made;
      } else {
        AbandonedSlots().Keep(made);  // NCCL may still write it
      }
      return Error(Status::Code::kDeadlineExceeded,
                   what + ": not every rank arrived within " + std::to_string(timeout_ms) +
                       " ms (LIBRA_JAX_TIMEOUT_S); the group's communicator was aborted");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

Status Library::Wait(void* comm, int64_t timeout_ms, const std::string& what) const {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  auto pause = std::chrono::microseconds(50);
  for (;;) {
    int state = kInProgress;
    const int queried = api_->comm_get_async_error(comm, &state);
    if (queried != kSuccess) state = queried;
    if (state == kSuccess) return Status::Ok();
    if (state != kInProgress) {
      const Status failed = Check(state, what.c_str());
      api_->comm_abort(comm);
      return failed;
    }
    if (timeout_ms > 0 && Clock::now() >= deadline) {
      api_->comm_abort(comm);  // frees NCCL's resources; the communicator is gone
      return Error(Status::Code::kDeadlineExceeded,
                   what + ": not every rank arrived within " + std::to_string(timeout_ms) +
                       " ms (LIBRA_JAX_TIMEOUT_S); the communicator was aborted");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(20000));
  }
}

bool Library::Direct(libra::Collective kind) const {
  const NcclLaunch& launch = LaunchOf(kind);
  return version_ >= launch.since && api_->plain[static_cast<int>(kind)] != nullptr;
}

bool Library::direct_all_to_all() const { return Direct(libra::Collective::kAllToAll); }

Status Library::Checked(libra::Collective kind, DType dtype, int ctas, const void* input,
                        const void* output) const {
  if (!libra::KnownCollective(kind)) {
    return Error(Status::Code::kInvalidArgument,
                 "unknown collective kind " + std::to_string(static_cast<int>(kind)));
  }
  if (!Launches(kind)) {
    return Error(Status::Code::kInvalidArgument,
                 std::string("libra's NCCL path has no NCCL launch for the ") +
                     libra::Name(kind));
  }
  const libra::Layout& layout = libra::LayoutOf(kind);
  const NcclLaunch& launch = LaunchOf(kind);
  const int nccl_dtype = ToNcclDataType(dtype);
  if (nccl_dtype < 0 || (dtype == DType::kBytes && layout.sums)) {
    return Error(Status::Code::kInvalidArgument,
                 std::string("NCCL ") + libra::Name(kind) + " of " + Name(dtype) +
                     " is not served (bytes are only copied: gathered or exchanged)");
  }
  if (layout.exchanges && input == output && input != nullptr) {
    return Error(Status::Code::kInvalidArgument,
                 std::string("an ") + libra::Name(kind) +
                     " is never in place (NCCL has no in-place all-to-all): output == input");
  }
  const bool configured = ctas > 0 && route_ == CtaRoute::kPerCollective;
  if (configured && api_->configured[static_cast<int>(kind)] == nullptr) {
    return Error(Status::Code::kInternal, path_ + " has no per-call config entry (" +
                                              launch.configured + ") for its " +
                                              libra::Name(kind));
  }
  const bool by_sends = launch.by_sends && api_->send != nullptr && api_->recv != nullptr &&
                        api_->comm_count != nullptr;
  if (!configured && !Direct(kind) && !by_sends) {
    return Error(Status::Code::kInternal,
                 path_ + " (NCCL " + VersionString(version_) + ") has no " + launch.plain +
                     " (NCCL >= " + VersionString(launch.since) + ")" +
                     (launch.by_sends ? " nor ncclSend/ncclRecv/ncclCommCount" : "") +
                     " for its " + libra::Name(kind));
  }
  return Status::Ok();
}

int Library::SendRecvAllToAll(const void* input, void* output, std::size_t count, DType dtype,
                              void* comm, void* stream, const char** what) const {
  const int nccl_dtype = ToNcclDataType(dtype);
  int nranks = 0;
  *what = "ncclCommCount";
  int result = api_->comm_count(comm, &nranks);
  if (result != kSuccess) return result;
  const std::size_t bytes = count * SizeOf(dtype);
  // One group: NCCL runs every send and receive at once (alone, a send waits for its
  // receiver). Nested in a bucket's group (CollectiveGroup), it joins that one.
  *what = "ncclGroupStart";
  if ((result = api_->group_start()) != kSuccess) return result;
  int failed = kSuccess;
  for (int peer = 0; peer < nranks && failed == kSuccess; ++peer) {
    const int sent = api_->send(static_cast<const char*>(input) + peer * bytes, count, nccl_dtype,
                                peer, comm, stream);
    if (sent != kSuccess && sent != kInProgress) {
      *what = "ncclSend";
      failed = sent;
      break;
    }
    const int received = api_->recv(static_cast<char*>(output) + peer * bytes, count,
                                    nccl_dtype, peer, comm, stream);
    if (received != kSuccess && received != kInProgress) {
      *what = "ncclRecv";
      failed = received;
    }
  }
  // Always closed (NCCL's groups nest per thread: one left open would swallow later calls).
  const int ended = api_->group_end();
  if (failed != kSuccess) return failed;
  *what = "ncclGroupEnd";
  return ended;
}

int Library::Launch(libra::Collective kind, const void* input, void* output, std::size_t count,
                    DType dtype, void* comm, int ctas, void* stream, const char** what) const {
  // The kind's row (kLaunches, Checked first) and one formula: its per-call-config entry
  // where the call has a limit on the per-collective route, else the plain one, else (an
  // exchange on an NCCL before ncclAlltoAll) sends and receives; with ncclSum where it sums.
  const int k = static_cast<int>(kind);
  const NcclLaunch& launch = kLaunches[k];
  const bool configured = ctas > 0 && route_ == CtaRoute::kPerCollective;
  if (!configured && !Direct(kind)) {
    return SendRecvAllToAll(input, output, count, dtype, comm, stream, what);
  }
  const int nccl_dtype = ToNcclDataType(dtype);
  const CollConfigV23100 config{sizeof(CollConfigV23100), kApiMagic, kPerCollectiveVersion,
                                nullptr, ctas, ctas, kUndefInt, kUndefInt, nullptr, 1,
                                kUndefInt, 0};
  void* const entry = configured ? api_->configured[k] : api_->plain[k];
  *what = configured ? launch.configured : launch.plain;
  if (libra::LayoutOf(kind).sums) {
    return configured ? reinterpret_cast<Api::SumsConfig>(entry)(input, output, count,
                                                                 nccl_dtype, kSum, comm,
                                                                 stream, &config)
                      : reinterpret_cast<Api::Sums>(entry)(input, output, count, nccl_dtype,
                                                           kSum, comm, stream);
  }
  return configured ? reinterpret_cast<Api::CopiesConfig>(entry)(input, output, count,
                                                                 nccl_dtype, comm, stream,
                                                                 &config)
                    : reinterpret_cast<Api::Copies>(entry)(input, output, count, nccl_dtype,
                                                           comm, stream);
}

bool Library::Launches(libra::Collective kind) {
  return libra::KnownCollective(kind) && LaunchOf(kind).plain != nullptr;
}

Status Library::Collective(libra::Collective kind, const void* input, void* output,
                           std::size_t count, DType dtype, void* comm, int ctas, void* stream,
                           int64_t timeout_ms, bool* aborted) const {
  if (aborted != nullptr) *aborted = false;
  if (Status checked = Checked(kind, dtype, ctas, input, output); !checked.ok()) return checked;
  const char* what = "";
  const int result = Launch(kind, input, output, count, dtype, comm, ctas, stream, &what);
  // On a non-blocking communicator the call may still be enqueueing: wait for that, bounded
  // (Wait aborts the communicator where it fails).
  if (result != kInProgress) return Check(result, what);
  const Status status = Wait(comm, timeout_ms, what);
  if (aborted != nullptr) *aborted = !status.ok();
  return status;
}

Status Library::CollectiveGroup(libra::Collective kind, const std::vector<Member>& members,
                                void* comm, int ctas, void* stream, int64_t timeout_ms,
                                bool* aborted) const {
  if (aborted != nullptr) *aborted = false;
  for (const Member& member : members) {
    if (Status checked = Checked(kind, member.dtype, ctas, member.input, member.output);
        !checked.ok()) {
      return checked;
    }
  }
  if (Status opened = Check(api_->group_start(), "ncclGroupStart"); !opened.ok()) return opened;
  Status launched = Status::Ok();
  for (const Member& member : members) {
    const char* what = "";
    const int result = Launch(kind, member.input, member.output, member.count, member.dtype,
                              comm, ctas, stream, &what);
    if (result != kSuccess && result != kInProgress) {  // the rest is not launched
      launched = Check(result, what);
      break;
    }
  }
  // Always closed (NCCL's groups nest per thread: one left open would swallow later calls).
  const int ended = api_->group_end();
  if (!launched.ok()) return launched;
  if (ended != kInProgress) return Check(ended, "ncclGroupEnd");
  const Status status = Wait(comm, timeout_ms, "ncclGroupEnd");
  if (aborted != nullptr) *aborted = !status.ok();
  return status;
}

std::string Library::AsyncError(void* comm) const {
  int state = kSuccess;
  const int queried = api_->comm_get_async_error(comm, &state);
  if (queried != kSuccess) state = queried;
  if (state == kSuccess || state == kInProgress) return "";
  const char* text = api_->get_error_string ? api_->get_error_string(state) : nullptr;
  return std::string("NCCL reported an asynchronous error: ") +
         (text ? text : "error " + std::to_string(state));
}

void Library::Destroy(void* comm) const {
  if (comm != nullptr) api_->comm_destroy(comm);
}

void Library::Abort(void* comm) const {
  if (comm != nullptr) api_->comm_abort(comm);
}

Communicators& Communicators::Get() {
  static Communicators* communicators = new Communicators();  // never destroyed
  return *communicators;
}

Status Communicators::Open(const std::string& path, RouteRequest request,
                           const Library** library) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!opened_) {
    std::string chosen = path;
    if (chosen.empty()) {
      const char* env = std::getenv("LIBRA_JAX_NCCL_LIBRARY");
      if (env != nullptr) chosen = env;
    }
    open_status_ = Library::Open(chosen, request, &library_);
    opened_ = true;
  } else if (open_status_.ok() && request != RouteRequest::kAuto &&
             std::string(Name(request)) != Name(library_->route())) {
    // The communicators already made are the open route's: another cannot start midway.
    if (library != nullptr) *library = nullptr;
    return Error(Status::Code::kFailedPrecondition,
                 std::string("LIBRA_JAX_NCCL_CTA_ROUTE=") + Name(request) + ", but NCCL " +
                     VersionString(library_->version()) + " is already open on the " +
                     Name(library_->route()) + " route (the route is chosen once, when the "
                     "process first opens NCCL: set it before)");
  }
  if (library != nullptr) *library = library_.get();
  return open_status_;
}

Status Communicators::RegisterId(int64_t comm_id, const UniqueId& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto [it, inserted] = ids_.emplace(comm_id, id);
  if (!inserted && it->second != id) {
    return Error(Status::Code::kInvalidArgument,
                 "communicator " + std::to_string(comm_id) + " already has another unique id");
  }
  return Status::Ok();
}

Status Communicators::Prepare(int64_t comm_id, int nranks, int rank, int ctas,
                              int64_t timeout_ms, std::shared_ptr<Comm>* made, void** handle,
                              const Library** opened) {
  const Library* library = nullptr;
  Status status = Open("", &library);
  if (!status.ok()) return status;
  UniqueId id;
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = ids_.find(comm_id);
    if (found == ids_.end()) {
      return Error(Status::Code::kInvalidArgument,
                   "communicator " + std::to_string(comm_id) + " has no unique id");
    }
    id = found->second;
    std::shared_ptr<Comm>& slot = comms_[{comm_id, rank}];
    if (!slot) slot = std::make_shared<Comm>();
    comm = slot;
  }
  const CtaRoute route = library->route();
  if (route == CtaRoute::kNone) ctas = 0;  // cannot be honoured (libra_jax says so once)
  if (ctas > library->max_ctas()) {
    return Error(Status::Code::kInvalidArgument,
                 "communicator " + std::to_string(comm_id) + ": " + std::to_string(ctas) +
                     " CTAs, above the " + std::to_string(library->max_ctas()) + " that NCCL " +
                     VersionString(library->version()) + " is asked for on the " + Name(route) +
                     " route");
  }
  // Per collective: the group's communicator has the channels of the largest limit, so
  // every call's limit fits in it. Per communicator: it is pinned to the first call's CTAs;
  // without splits (2.17) that is all (libra_jax gives each block count its own id), from
  // 2.18 each other block count gets a child split from it that shares its resources (NCCL
  // allocates a channel's buffers once for the group: its memory is that of the largest
  // block count used, not the sum).
  const bool pinned = route == CtaRoute::kPerCommunicator && !library->splits();
  const bool split = route == CtaRoute::kPerCommunicator && library->splits();
  const int comm_ctas = route == CtaRoute::kPerCollective ? library->max_ctas() : ctas;
  // Creation waits until every rank joins, so it holds this rank's slot only: other ranks
  // of the process create theirs meanwhile.
  std::lock_guard<std::mutex> lock(comm->mu);
  if (!comm->failed.empty()) return Error(Status::Code::kDeadlineExceeded, comm->failed);
  if (comm->handle == nullptr) {
    status = library->InitRank(id, nranks, rank, comm_ctas, &comm->handle, timeout_ms);
    if (!status.ok()) {
      comm->handle = nullptr;
      return status;
    }
    comm->nranks = nranks;
    comm->ctas = comm_ctas;
  }
  if (comm->nranks != nranks || (pinned && comm->ctas != ctas)) {
    return Error(Status::Code::kInvalidArgument,
                 "communicator " + std::to_string(comm_id) + " was created for " +
                     std::to_string(comm->nranks) + " ranks and " +
                     std::to_string(comm->ctas) + " CTAs, called with " +
                     std::to_string(nranks) + " and " + std::to_string(ctas));
  }
  void* chosen = comm->handle;
  if (split && ctas > 0 && ctas != comm->ctas) {
    void*& child = comm->children[ctas];
    if (child == nullptr) {
      status = library->Split(comm->handle, rank, ctas, &child, timeout_ms);
      if (!status.ok()) {
        child = nullptr;
        Forget(*library, comm.get());  // the split may have stopped half-way on some ranks
        return status;
      }
    }
    chosen = child;
  }
  if (handle != nullptr) *handle = chosen;
  if (made != nullptr) *made = std::move(comm);
  if (opened != nullptr) *opened = library;
  return Status::Ok();
}

void Communicators::Forget(const Library& library, Comm* comm) {
  for (auto& [ctas, child] : comm->children) library.Abort(child);
  comm->children.clear();
  library.Abort(comm->handle);
  comm->handle = nullptr;
}

Status Communicators::Prepare(int64_t comm_id, int nranks, int rank, int ctas,
                              int64_t timeout_ms) {
  return Prepare(comm_id, nranks, rank, ctas, timeout_ms, nullptr, nullptr, nullptr);
}

template <typename IssueFn>
Status Communicators::Issue(int64_t comm_id, int nranks, int rank, int ctas, int64_t timeout_ms,
                            IssueFn issue) {
  std::shared_ptr<Comm> comm;
  const Library* library = nullptr;
  void* handle = nullptr;
  const Status status =
      Prepare(comm_id, nranks, rank, ctas, timeout_ms, &comm, &handle, &library);
  if (!status.ok()) return status;
  if (library->route() == CtaRoute::kNone) ctas = 0;
  bool aborted = false;
  const Status done = issue(*library, handle, ctas, &aborted);
  if (aborted) {  // that communicator is gone: forget the group's (its children share it)
    std::lock_guard<std::mutex> lock(comm->mu);
    if (handle != comm->handle) library->Abort(comm->handle);
    for (auto& [n, child] : comm->children) {
      if (child != handle) library->Abort(child);
    }
    comm->children.clear();
    comm->handle = nullptr;
  }
  return done;
}

Status Communicators::Call(libra::Collective kind, int64_t comm_id, int nranks, int rank,
                           int ctas, const void* input, void* output, std::size_t count,
                           DType dtype, void* stream, int64_t timeout_ms) {
  return Issue(comm_id, nranks, rank, ctas, timeout_ms,
               [&](const Library& library, void* handle, int limit, bool* aborted) {
                 return library.Collective(kind, input, output, count, dtype, handle, limit,
                                           stream, timeout_ms, aborted);
               });
}

Status Communicators::CallGroup(libra::Collective kind, int64_t comm_id, int nranks, int rank,
                                int ctas, const std::vector<Library::Member>& members,
                                void* stream, int64_t timeout_ms) {
  return Issue(comm_id, nranks, rank, ctas, timeout_ms,
               [&](const Library& library, void* handle, int limit, bool* aborted) {
                 return library.CollectiveGroup(kind, members, handle, limit, stream,
                                                timeout_ms, aborted);
               });
}

Status Communicators::Watch(int64_t comm_id, int rank, void* stream, int64_t timeout_ms,
                            const StreamOps& ops) {
  if (timeout_ms <= 0) return Status::Ok();
  std::shared_ptr<Comm> comm;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = comms_.find({comm_id, rank});
    if (it == comms_.end()) return Status::Ok();
    comm = it->second;
  }
  void* handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    handle = comm->handle;
  }
  if (handle == nullptr) return Status::Ok();
  void* event = nullptr;
  const Status recorded = ops.record(stream, &event);
  if (!recorded.ok()) return recorded;
  std::lock_guard<std::mutex> lock(watch_mu_);
  if (!watching_) {
    watching_ = true;
    std::thread([this] { WatchLoop(); }).detach();  // lives as long as the process
  }
  watched_.push_back({std::move(comm), handle, event, ops,
                      std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms),
                      timeout_ms,
                      "communicator " + std::to_string(comm_id) + ", rank " +
                          std::to_string(rank)});
  watch_cv_.notify_one();
  return Status::Ok();
}

void Communicators::WatchLoop() {
  const Library* library = nullptr;
  Open("", &library);  // opened already: a Watch follows a call
  std::unique_lock<std::mutex> lock(watch_mu_);
  for (;;) {
    watch_cv_.wait_for(lock, std::chrono::milliseconds(10));
    const auto now = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < watched_.size();) {
      Watched& w = watched_[i];
      const int done = w.ops.query(w.event);
      std::string failed;
      if (done == 0 && now >= w.deadline) {
        failed = "libra NCCL: " + w.what + ": an all-reduce enqueued on the GPU did not end "
                 "within " + std::to_string(w.timeout_ms) +
                 " ms (LIBRA_JAX_TIMEOUT_S): a peer never reached it; libra's watchdog aborted "
                 "the group's communicators on this GPU (restart the job to use them again)";
      } else if (done == 0 && library != nullptr) {
        // Busy (a communicator of the group being made): look again next round.
        std::unique_lock<std::mutex> comm_lock(w.comm->mu, std::try_to_lock);
        if (!comm_lock.owns_lock()) {
          ++i;
          continue;
        }
        bool live = w.comm->handle == w.handle;
        for (const auto& [ctas, child] : w.comm->children) live = live || child == w.handle;
        if (!live) {  // aborted meanwhile (a failed call): nothing left to watch
          w.ops.release(w.event);
          watched_.erase(watched_.begin() + static_cast<std::ptrdiff_t>(i));
          continue;
        }
        failed = library->AsyncError(w.handle);
        if (!failed.empty()) failed = "libra NCCL: " + w.what + ": " + failed;
      } else if (done < 0) {
        failed = "libra NCCL: " + w.what + ": the GPU reported an error for an all-reduce";
      }
      if (done == 0 && failed.empty()) {
        ++i;
        continue;
      }
      if (!failed.empty() && library != nullptr) {
        std::lock_guard<std::mutex> comm_lock(w.comm->mu);
        if (w.comm->failed.empty()) {
          w.comm->failed = failed;
          if (w.comm->handle != nullptr) Forget(*library, w.comm.get());
        }
      }
      w.ops.release(w.event);  // an aborted kernel ends too: the event completes
      watched_.erase(watched_.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
}

std::size_t Communicators::watched() {
  std::lock_guard<std::mutex> lock(watch_mu_);
  return watched_.size();
}

std::size_t Communicators::size() {
  std::lock_guard<std::mutex> lock(mu_);
  std::size_t created = 0;
  for (auto& [key, comm] : comms_) {
    std::lock_guard<std::mutex> comm_lock(comm->mu);
    created += (comm->handle != nullptr) + comm->children.size();
  }
  return created;
}

}  // namespace libra::nccl
