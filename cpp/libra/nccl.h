// libra NCCL: an all-reduce, reduce-scatter, all-gather or all-to-all over NCCL (in one
// process or across processes, every GPU one rank), with the call's block count
// as NCCL's CTA limit. Framework-free and CUDA-free: NCCL is resolved at
// run time (dlopen/dlsym) and streams are opaque pointers, so the control path
// (library loading, the version switch, the communicator cache, CTA limits)
// builds and is tested without a GPU, against a stub library in host memory
// (tests/nccl_stub.cc).
//
// Which NCCL: an explicit path if given ($LIBRA_JAX_NCCL_LIBRARY, e.g. the
// nvidia-nccl-cu13 wheel's lib/libnccl.so.2); else the libnccl.so.2 already in
// the process (XLA:GPU loads its own, and one NCCL per process is what NCCL
// expects), found with RTLD_NOLOAD; else the loader's search for it.
//
// How the CTA limit reaches NCCL, by version (ncclGetVersion):
//   >= 2.31    per collective: ncclAllReduceConfig (ncclReduceScatterConfig,
//              ncclAllGatherConfig, ncclAlltoAllConfig) with an ncclCollConfig_t
//              whose minCTAs = maxCTAs = the call's blocks; one communicator
//              per group, made with minCTAs = maxCTAs = CommCtas(version), so
//              that it has the channels every per-call limit up to that asks
//              for (a collective never runs on more CTAs than its
//              communicator's channels: a larger limit would be clipped);
//   2.17-2.30  per communicator: a communicator whose ncclConfig_t has
//              minCTAs = maxCTAs = blocks, one per (group, block count), made
//              only for the counts plans use. From 2.18 the group's first one
//              is made from its unique id and the others are split from it
//              (ncclCommSplit, splitShare = 1): they share its proxy, stream
//              and per-channel buffers (NCCL allocates a channel's once for
//              all of them), so the group's memory is that of its largest
//              block count, not the sum. On 2.17 each is a communicator of its
//              own (its own unique id and buffers);
//   older      none: the config has no CTA fields (they arrived in
//              ncclConfig_v21700), so the block count cannot be honoured.
// Either route may be asked for instead when NCCL is opened (RouteRequest, from
// $LIBRA_JAX_NCCL_CTA_ROUTE, read by libra_jax.config): per communicator on every NCCL from
// 2.17 (on >= 2.31 too: pinned communicators and the plain entry points, as 2.18-2.30 run),
// per collective only where the version has it. Why both: NCCL >= 2.32 launches a call
// with a per-call CTA configuration apart from the rest of its group (its aggregation
// isolation, ncclCollConfigNeedAggIsolate), so a bucket's group may cost a kernel per member
// on the per-collective route and one on the per-communicator route; unmeasured, so the
// default (auto: the version's route) is unchanged until a GPU run times both
// (benchmarks/gpu_nccl_check.py).
// The communicator's config is passed in the 2.31 layout with version 2.31
// (NCCL's configs are append-only; NCCL copies a config up to its own size and
// resets the fields its `version` predates), the collective's in its only one.
// A limit above the version's channel maximum (MaxCtas) is an error.
//
// The all-to-all is NCCL's ncclAlltoAll from 2.28 (ncclAlltoAllConfig on the per-collective
// route); an older NCCL (2.18-2.27), or one without the symbol, does it as NCCL 2.28 itself
// lowers it: one group of an ncclSend to and an ncclRecv from every rank (itself included),
// under the communicator's CTA configuration as NCCL applies it to point-to-point calls.
//
// Several communicators on one GPU (one per block count on 2.17-2.30, and
// XLA's own) need one launch order (libra/streams.h): libra issues its calls on
// one stream per GPU in program order, and asks NCCL for implicit launch order
// (the communicator's launchOrderImplicit, read from 2.31; from 2.26 to 2.30
// NCCL_LAUNCH_ORDER_IMPLICIT=1 in the environment, which libra_jax sets).
//
// Timeouts (LIBRA_JAX_TIMEOUT_S): communicators are non-blocking, so creation,
// splits and an enqueue still in progress are polled and aborted after the
// timeout; a collective enqueued on the GPU whose peer never comes is ended by
// the watchdog thread (Communicators::Watch), which aborts the group's
// communicators on that rank.
//
// Unique ids travel between processes outside this file (libra_jax._nccl uses
// JAX's distributed key-value store) and are registered here under a
// process-local communicator id.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "libra/dtype.h"
#include "libra/status.h"
#include "libra/streams.h"

namespace libra::nccl {

inline constexpr std::size_t kUniqueIdBytes = 128;  // NCCL_UNIQUE_ID_BYTES
using UniqueId = std::array<char, kUniqueIdBytes>;

// NCCL_VERSION(2, 31, 0): the first NCCL with per-collective CTA limits.
inline constexpr int kPerCollectiveVersion = 23100;
// NCCL_VERSION(2, 17, 0): the first ncclConfig_t with minCTAs/maxCTAs.
inline constexpr int kCtaConfigVersion = 21700;
// NCCL_VERSION(2, 18, 0): ncclCommSplit, with splitShare (shared resources).
inline constexpr int kSplitShareVersion = 21800;
// NCCL_VERSION(2, 25, 0): MAXCHANNELS grew from 32 to 64.
inline constexpr int kWideChannelsVersion = 22500;
// NCCL_VERSION(2, 28, 0): the first NCCL with ncclAlltoAll (older: ncclSend/ncclRecv).
inline constexpr int kAlltoAllVersion = 22800;
// The channels a per-collective communicator is made with (and so the largest
// per-call limit it honours): NCCL allocates buffers per channel, so this
// bounds each communicator's memory; libra's GPU profiles use up to 32.
inline constexpr int kCommCtas = 32;

enum class CtaRoute : int { kPerCollective = 0, kPerCommunicator = 1, kNone = 2 };
const char* Name(CtaRoute route);

// The route asked for when NCCL is opened: the version's own (kAuto: RouteFor), or one
// forced (A/B runs, and the per-communicator route's group aggregation on NCCL >= 2.32).
enum class RouteRequest : int { kAuto = 0, kPerCollective = 1, kPerCommunicator = 2 };
// "auto", or the forced route's Name.
const char* Name(RouteRequest request);
// The request `name` names (Name's words, as libra_jax.config.NCCL_CTA_ROUTES spells them);
// InvalidArgument naming the value otherwise.
Status ParseRouteRequest(const std::string& name, RouteRequest* request);

// "2.31.0" for 23100 (and "2.8.4" for the old encoding 2804).
std::string VersionString(int code);

// The route for a library of `version` that does (or does not) export
// ncclAllReduceConfig.
CtaRoute RouteFor(int version, bool has_per_collective_entry);

// The route such a library takes when `request` is asked of it: RouteFor's on kAuto; a
// forced route where the library has it (per-collective: NCCL >= 2.31 and
// ncclAllReduceConfig; per-communicator: any NCCL with CTA limits, >= 2.17), else
// InvalidArgument naming `library`, its version and what it lacks.
Status ChooseRoute(int version, bool has_per_collective_entry, RouteRequest request,
                   const std::string& library, CtaRoute* route);

// The most CTAs (channels) one collective of NCCL `version` may run on: 0 below
// 2.17 (no CTA limit at all), 32 up to 2.24, 64 from 2.25.
int MaxCtas(int version);

// The largest per-call limit libra asks of NCCL `version` on `route`.
int CallCtasLimit(int version, CtaRoute route);

// NCCL's count of one rank's `kind` call (elements per call, or bytes for DType::kBytes) whose
// input holds `input` units and output `output` (the same units) on `nranks` ranks, by the
// kind's row (libra/dtype.h: Layout::counts_in, counts_out): an all-reduce's buffer, a
// reduce-scatter's output, an all-gather's input, an all-to-all's segment per peer (its
// input / nranks). InvalidArgument naming the kind where the sizes do not fit. The FFI
// handlers (xla_ffi/cuda_collectives.cc) and the host entry point (xla_ffi/module.cc) size
// their calls here.
Status CountOf(libra::Collective kind, std::size_t input, std::size_t output, int nranks,
               std::size_t* count);

// The NCCL entry points libra uses, resolved from one shared library.
class Library {
 public:
  // Opens `path`, or (empty) the libnccl.so.2 already loaded, else the
  // loader's, on the route `request` asks for (ChooseRoute). Fails with a message naming the
  // library and the missing symbol, or the route it cannot take.
  static Status Open(const std::string& path, RouteRequest request,
                     std::unique_ptr<Library>* library);
  static Status Open(const std::string& path, std::unique_ptr<Library>* library) {
    return Open(path, RouteRequest::kAuto, library);
  }
  ~Library();
  Library(const Library&) = delete;
  Library& operator=(const Library&) = delete;

  int version() const { return version_; }
  CtaRoute route() const { return route_; }
  // The largest per-call CTA limit this library honours (0: none).
  int max_ctas() const { return CallCtasLimit(version_, route_); }
  // Whether per-block-count communicators are split from one per group with shared
  // resources (ncclCommSplit with splitShare: NCCL >= 2.18 and the symbol).
  bool splits() const { return splits_; }
  // How this library does an all-to-all: NCCL's own ncclAlltoAll (NCCL >= 2.28 and the
  // symbol), else a group of ncclSend/ncclRecv with every rank (where it has them).
  bool direct_all_to_all() const;
  const std::string& path() const { return path_; }

  Status GetUniqueId(UniqueId* id) const;
  // ctas > 0 pins the communicator to that many CTAs (minCTAs = maxCTAs);
  // an error above MaxCtas(version). The communicator is non-blocking: if not
  // every rank has joined within timeout_ms (0: wait forever), it is aborted
  // and the result is kDeadlineExceeded.
  Status InitRank(const UniqueId& id, int nranks, int rank, int ctas, void** comm,
                  int64_t timeout_ms = 0) const;
  // A child of `parent` (this rank's; every rank splits, in the same order) pinned to
  // `ctas` CTAs and sharing the parent's resources (splitShare = 1): its proxy, stream and
  // per-channel buffers, so a block count costs only the channels the group lacked.
  // kDeadlineExceeded (the child aborted) if not every rank splits within timeout_ms.
  Status Split(void* parent, int rank, int ctas, void** child, int64_t timeout_ms = 0) const;
  // One rank's part of collective `kind`: an all-reduce (sum) of `count` elements, a
  // reduce-scatter (sum) whose output is `count` elements (NCCL's recvcount; the input is
  // nranks times that), or an all-gather whose input is `count` elements (NCCL's sendcount;
  // the output nranks times that; any dtype, kBytes as bytes), or an all-to-all whose input
  // and output are nranks times `count` elements, `count` going to each rank (NCCL's count:
  // block j of the input to rank j, block i of the output from rank i; any dtype). In place
  // as NCCL defines it: a reduce-scatter's output at input + rank * count, an all-gather's
  // input at output + rank * count; an all-to-all never (NCCL has no in-place form: output ==
  // input is refused). ctas > 0 limits this call (per-collective route only). Where NCCL is still
  // enqueueing it (ncclInProgress), waits at most timeout_ms, then aborts. `aborted`
  // (optional) says whether it aborted the communicator.
  Status Collective(libra::Collective kind, const void* input, void* output, std::size_t count,
                    DType dtype, void* comm, int ctas, void* stream, int64_t timeout_ms = 0,
                    bool* aborted = nullptr) const;
  Status AllReduce(const void* input, void* output, std::size_t count, DType dtype,
                   void* comm, int ctas, void* stream, int64_t timeout_ms = 0,
                   bool* aborted = nullptr) const {
    return Collective(libra::Collective::kAllReduce, input, output, count, dtype, comm, ctas,
                      stream, timeout_ms, aborted);
  }
  // One member of a grouped call: its buffers, count and type as Collective takes them.
  struct Member {
    const void* input;
    void* output;
    std::size_t count;
    DType dtype;
  };
  // Collective `kind` of several members (a bucket's buffers, where XLA keeps them) as one
  // NCCL group (ncclGroupStart, a call per member, ncclGroupEnd): NCCL launches them as one
  // operation, each with the call's CTA limit, and no member waits for another's launch.
  // Every member is checked before the group opens, and an opened group is always closed.
  // An enqueue still in progress at the group's end is waited for as Collective waits.
  Status CollectiveGroup(libra::Collective kind, const std::vector<Member>& members,
                         void* comm, int ctas, void* stream, int64_t timeout_ms = 0,
                         bool* aborted = nullptr) const;
  void Destroy(void* comm) const;
  void Abort(void* comm) const;
  // The communicator's asynchronous error as a message ("" while none).
  std::string AsyncError(void* comm) const;

  // Whether libra's NCCL path has a launch for `kind` (its row of nccl.cc's kLaunches names an
  // entry point); a kind without one is refused by name ("no NCCL launch for the ..."), never
  // launched as another kind. (A kind of dtype.h without a row in kLaunches does not compile.)
  static bool Launches(libra::Collective kind);

 private:
  Library() = default;
  Status Check(int result, const char* what) const;
  // Whether this library has `kind`'s plain entry point (its row's, from its NCCL version).
  bool Direct(libra::Collective kind) const;
  // The checks of one member's call: its kind, its dtype, the route's entry point, its
  // buffers (an all-to-all is never in place).
  Status Checked(libra::Collective kind, DType dtype, int ctas, const void* input,
                 const void* output) const;
  // The all-to-all as NCCL 2.28 lowers it, for a library without ncclAlltoAll: one group of a
  // send to and a receive from every rank (`count` each); returns NCCL's result, `what` the
  // failed entry point's name.
  int SendRecvAllToAll(const void* input, void* output, std::size_t count, DType dtype,
                       void* comm, void* stream, const char** what) const;
  // Issues one member's call on NCCL's entry point for its kind and route (checked first);
  // returns NCCL's result and names the entry point in `what`.
  int Launch(libra::Collective kind, const void* input, void* output, std::size_t count,
             DType dtype, void* comm, int ctas, void* stream, const char** what) const;
  // Polls the communicator's async state until it is not in progress; after
  // timeout_ms (> 0) aborts it and fails with kDeadlineExceeded naming `what`.
  Status Wait(void* comm, int64_t timeout_ms, const std::string& what) const;

  void* handle_ = nullptr;
  std::string path_;
  int version_ = 0;
  CtaRoute route_ = CtaRoute::kPerCommunicator;
  bool splits_ = false;
  struct Api;
  std::unique_ptr<Api> api_;
};

// The process's NCCL: its library, the registered unique ids and the
// communicators, created on first use and kept for the life of the process.
// Thread-safe; never destroyed (XLA's threads may call it during exit).
class Communicators {
 public:
  static Communicators& Get();

  // Opens the library once, on the route `request` asks for (later calls return the first
  // outcome: the route is chosen once per process). A later forced request the open library's
  // route is not is an error (kFailedPrecondition naming both), never a silent other route.
  // `path` empty: $LIBRA_JAX_NCCL_LIBRARY if set, else the default search.
  Status Open(const std::string& path, RouteRequest request, const Library** library);
  Status Open(const std::string& path, const Library** library) {
    return Open(path, RouteRequest::kAuto, library);
  }

  // The unique id of communicator `comm_id` (made by one process, passed to
  // the others). Registering an id twice is an error unless it is the same.
  Status RegisterId(int64_t comm_id, const UniqueId& id);

  // Creates this rank's communicator `comm_id` if it does not exist yet (a
  // collective call: every rank makes it, in the same order of communicators),
  // with the CTA configuration of `ctas` on its route (below). The FFI
  // handlers call it when XLA initialises a program, so that communicators
  // are made before the program runs, not in the middle of it.
  Status Prepare(int64_t comm_id, int nranks, int rank, int ctas, int64_t timeout_ms = 0);

  // One rank's part of a collective on communicator `comm_id`, issued on
  // `stream`; the communicator is prepared first (made where Prepare has not
  // made it yet). On the per-communicator route the group's communicator is
  // pinned to its first call's `ctas`; a call with other ctas runs on a child
  // split from it (2.18+), and is an error on 2.17 (where the caller gives
  // each block count its own comm_id).
  // timeout_ms bounds the communicator's creation (and an enqueue still in
  // progress): a rank that never joins turns into kDeadlineExceeded, and the
  // communicator is aborted and forgotten (0: wait forever).
  // `kind` and `count` as Library::Collective has them.
  Status Call(libra::Collective kind, int64_t comm_id, int nranks, int rank, int ctas,
              const void* input, void* output, std::size_t count, DType dtype, void* stream,
              int64_t timeout_ms = 0);
  Status AllReduce(int64_t comm_id, int nranks, int rank, int ctas, const void* input,
                   void* output, std::size_t count, DType dtype, void* stream,
                   int64_t timeout_ms = 0) {
    return Call(libra::Collective::kAllReduce, comm_id, nranks, rank, ctas, input, output,
                count, dtype, stream, timeout_ms);
  }
  // Call of several members as one NCCL group (Library::CollectiveGroup): a bucket's
  // buffers, one launch, the call's CTA limit for each.
  Status CallGroup(libra::Collective kind, int64_t comm_id, int nranks, int rank, int ctas,
                   const std::vector<Library::Member>& members, void* stream,
                   int64_t timeout_ms = 0);

  // Watches the call just issued on `stream` by this rank of `comm_id`: a collective
  // enqueued on the GPU whose peer never comes would spin there for ever, so the
  // process's watchdog thread polls its end (an event recorded now with `ops`) and, after
  // timeout_ms, aborts the group's communicators on this rank (NCCL's kernels see the abort
  // flag and return) and every later call on them fails with kDeadlineExceeded naming it.
  // An asynchronous NCCL error (ncclCommGetAsyncError) aborts them alike. timeout_ms 0:
  // not watched.
  Status Watch(int64_t comm_id, int rank, void* stream, int64_t timeout_ms,
               const StreamOps& ops);
  // Calls being watched (for tests and diagnostics).
  std::size_t watched();

  // Communicators created so far (for tests and diagnostics).
  std::size_t size();

 private:
  Communicators() = default;
  struct Comm {
    std::mutex mu;  // held while the communicator (or a child) is created
    void* handle = nullptr;
    int nranks = 0;
    int ctas = 0;
    std::map<int, void*> children;  // per other block count, split from handle (2.18-2.30)
    std::string failed;  // set when the watchdog aborted them: every later call fails
  };
  struct Watched {
    std::shared_ptr<Comm> comm;
    void* handle;
    void* event;
    StreamOps ops;
    std::chrono::steady_clock::time_point deadline;
    int64_t timeout_ms;
    std::string what;
  };
  // The watchdog thread's loop (started on the first Watch, never stopped).
  void WatchLoop();

  // Prepare, giving the group's communicator, the handle a call of `ctas` runs on (the
  // group's or a child's) and the library.
  Status Prepare(int64_t comm_id, int nranks, int rank, int ctas, int64_t timeout_ms,
                 std::shared_ptr<Comm>* comm, void** handle, const Library** library);
  // Aborts a group's communicator and its children (comm->mu held).
  static void Forget(const Library& library, Comm* comm);
  // Prepares `comm_id` and runs `issue(library, handle, ctas, &aborted)` on it (Call's and
  // CallGroup's body); where the handle was aborted, forgets the group's communicators.
  template <typename IssueFn>
  Status Issue(int64_t comm_id, int nranks, int rank, int ctas, int64_t timeout_ms,
               IssueFn issue);

  std::mutex mu_;
  bool opened_ = false;
  Status open_status_;
  std::unique_ptr<Library> library_;
  std::map<int64_t, UniqueId> ids_;
  std::map<std::pair<int64_t, int>, std::shared_ptr<Comm>> comms_;  // (comm_id, rank)
  std::mutex watch_mu_;
  std::condition_variable watch_cv_;
  std::vector<Watched> watched_;
  bool watching_ = false;
};

}  // namespace libra::nccl
