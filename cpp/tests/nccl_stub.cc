// A stand-in for libnccl.so.2 in host memory, for testing libra's NCCL
// control path (library loading, the version switch, unique ids, the
// communicator cache, CTA limits) where NCCL cannot run: no GPU, or one.
//
// Ranks meet through files in $NCCL_STUB_DIR, so they may be threads of one
// process or separate processes. Buffers are host memory and the stream is
// ignored (calls complete before they return). Every communicator creation and
// collective appends one line to $NCCL_STUB_LOG:
//   init rank=R nranks=N minCTAs=A maxCTAs=B channels=H blocking=0|1 implicit=0|1 mem=M id=ID
//   split rank=R parent=ID minCTAs=A maxCTAs=B channels=H share=0|1 implicit=0|1 mem=M id=ID
//   allreduce rank=R count=C dtype=D ctas=K asked=Q config=0|1 stream=S id=ID
//   reducescatter|allgather|alltoall rank=R count=C dtype=D ctas=K asked=Q config=0|1
//                 inplace=0|1 stream=S id=ID   (count: NCCL's, the recvcount, the sendcount
//                 or the count per peer)
//   send|recv rank=R peer=P count=C dtype=D stream=S id=ID
// ($NCCL_STUB_VERSION sets ncclGetVersion, default 23100 = 2.31.0.)
//
// It keeps NCCL's rules that libra must get right (NCCL 2.17-2.31 docs and
// headers), so that a test against it fails where NCCL would ignore a limit:
// - minCTAs/maxCTAs are read only from a config of version >= 21700 and by a
//   library >= 2.17 (older ones reset or lack them: logged as undefined);
// - a communicator's channels are the topology's ($NCCL_STUB_CHANNELS, default
//   2, as on a PCIe machine) raised to minCTAs and cut to maxCTAs and to the
//   version's MAXCHANNELS (32 up to 2.24, 64 from 2.25);
// - a collective runs on at most its communicator's channels: a larger
//   per-call limit is clipped (`ctas` is what ran, `asked` what was asked);
// - ncclAllReduceConfig (and ncclReduceScatterConfig, ncclAllGatherConfig,
//   ncclAlltoAllConfig) exist from 2.31 only, ncclAlltoAll from 2.28 only (ncclInvalidUsage
//   before: the version, $NCCL_STUB_VERSION, picks libra's all-to-all route);
// - in place only as NCCL places it: a reduce-scatter's output at input + rank x recvcount, an
//   all-gather's input at output + rank x sendcount, an all-to-all never; other overlaps are
//   refused;
// - ncclSend/ncclRecv pair by order per (sender, receiver) and must agree on the byte count
//   (else ncclInvalidArgument); a send publishes its bytes when it runs, a receive waits for
//   its peer's; in a group every send runs before any receive (NCCL runs them at once), so a
//   group of sends and receives with every peer never waits on itself;
// - a non-blocking config (blocking = 0) makes creation return ncclInProgress
//   and complete in the background; ncclCommGetAsyncError reports its state,
//   ncclCommAbort stops it (logged: abort rank=R id=ID);
// - ncclCommSplit from 2.18 only; with splitShare a child shares its parent's
//   per-channel buffers (logged mem=: the channels it added) and abort flag;
// - every rank of a communicator asks for the same CTA configuration (else
//   creation fails, logged: mismatch ...);
// - with $NCCL_STUB_ASYNC=1 collectives are enqueued and run on their stream's
//   worker thread (ncclStubStreamPending counts them), as kernels on a GPU;
// - launches on several communicators of one device need one order (Ordered
//   below: the same stream, or implicit launch order where the version has it);
//   a launch without one fails (logged: hazard ...), where NCCL might hang;
// - ncclGroupStart/End nest per thread: a collective inside a group is checked and logged
//   when called but runs only when the outermost group ends (logged: group rank=R
//   calls=N launches=L), in the order called; a group end without a start is
//   ncclInvalidUsage. L counts the group's kernel launches as NCCL plans them: its calls
//   aggregated into one, except from 2.32 a call with a per-call CTA configuration, which
//   NCCL isolates from aggregation (ncclCollConfigNeedAggIsolate, src/config/collconfig.cc:
//   any minCTAs/maxCTAs set) and launches alone. A model of NCCL's planner, not its whole
//   rule (NCCL also splits a group whose calls' sizes differ by more than 4x): what differs
//   between libra's CTA routes, unmeasured on a GPU.
// Build: g++ -std=c++17 -shared -fPIC -o libnccl_stub.so nccl_stub.cc
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr int kSuccess = 0, kSystemError = 2, kInvalidArgument = 4, kInvalidUsage = 5,
              kRemoteError = 6, kInProgress = 7;
constexpr int kCtaConfigVersion = 21700, kSplitVersion = 21800, kWideChannelsVersion = 22500,
              kImplicitOrderVersion = 22600, kPerCollectiveVersion = 23100,
              kAggIsolateVersion = 23200;
constexpr unsigned kMagic = 0xcafebeef;

struct UniqueId {
  char internal[128];
};

struct CommConfig {  // ncclConfig_t (2.31) up to launchOrderImplicit; read up to `size`
  size_t size;
  unsigned magic;
  unsigned version;
  int blocking;
  int cga_cluster_size;
  int min_ctas;  // 2.17
  int max_ctas;
  const char* net_name;
  int split_share;  // 2.18
  int traffic_class;
  const char* comm_name;
  int unread[10];   // 2.27-2.30.5
  int launch_order_implicit;  // 2.31
};
static_assert(offsetof(CommConfig, launch_order_implicit) == 96, "ncclConfig_t 2.31 layout");

struct CollConfig {  // ncclCollConfig_t's leading fields (NCCL 2.31)
  size_t size;
  unsigned magic;
  unsigned version;
  void* ext;
  int min_ctas;
  int max_ctas;
};

struct Comm {
  std::string id;
  int rank = 0;
  int nranks = 0;
  int min_ctas = INT_MIN;
  int max_ctas = INT_MIN;
  int channels = 0;  // what a collective on it may run on
  bool launch_order_implicit = false;
  bool blocking = true;
  int splits = 0;  // children split from it so far
  std::map<int, long> sent, received;  // point-to-point calls so far, per peer
  // Channels whose buffers exist, shared by a communicator and the children that share its
  // resources (NCCL allocates a channel's once for all of them).
  std::shared_ptr<std::atomic<int>> allocated = std::make_shared<std::atomic<int>>(0);
  long sequence = 0;
  // Shared with a non-blocking creation's thread, which may outlive an aborted Comm.
  std::shared_ptr<std::atomic<int>> state = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<std::atomic<bool>> aborted = std::make_shared<std::atomic<bool>>(false);
};

std::string Env(const char* name, const char* fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : fallback;
}

int Version() { return std::atoi(Env("NCCL_STUB_VERSION", "23100").c_str()); }

int MaxChannels() { return Version() < kWideChannelsVersion ? 32 : 64; }

void Log(const std::string& line) {
  const std::string path = Env("NCCL_STUB_LOG", "");
  if (path.empty()) return;
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return;
  const std::string text = line + "\n";
  if (write(fd, text.data(), text.size()) < 0) { /* best effort */ }
  close(fd);
}

std::string Path(const Comm& comm, const std::string& what, int rank) {
  return Env("NCCL_STUB_DIR", "/tmp") + "/" + comm.id + "." + what + "." + std::to_string(rank);
}

// Publishes `bytes` as this rank's part of step `what`, then reads every rank's.
int Exchange(const Comm& comm, const std::string& what, const std::string& bytes,
             std::vector<std::string>* all) {
  const std::atomic<bool>& aborted = *comm.aborted;
  const std::string mine = Path(comm, what, comm.rank);
  {
    std::ofstream out(mine + ".tmp", std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) return kSystemError;
  }
  if (std::rename((mine + ".tmp").c_str(), mine.c_str()) != 0) return kSystemError;
  const double timeout_s = std::atof(Env("NCCL_STUB_TIMEOUT_S", "30").c_str());
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<long>(timeout_s * 1000));
  all->assign(comm.nranks, std::string());
  for (int r = 0; r < comm.nranks; ++r) {
    std::ifstream in;
    while (!(in = std::ifstream(Path(comm, what, r), std::ios::binary))) {
      if (std::chrono::steady_clock::now() > deadline || aborted.load()) return kRemoteError;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    (*all)[r].assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return kSuccess;
}

template <typename T>
void SumInRankOrder(const std::vector<std::string>& parts, size_t count, void* out) {
  std::vector<T> sum(count, T(0));
  for (const std::string& part : parts) {
    const T* values = reinterpret_cast<const T*>(part.data());
    for (size_t i = 0; i < count; ++i) sum[i] += values[i];
  }
  std::memcpy(out, sum.data(), count * sizeof(T));
}

// NCCL's rule for several communicators on one device ("Using multiple NCCL
// communicators concurrently"): their launches need one order. Before 2.26
// only a stream dependency gives it (here: the same stream as the device's
// previous launch on another communicator); from 2.26 NCCL_LAUNCH_ORDER_IMPLICIT=1
// makes host launch order it, from 2.31 also both communicators'
// launchOrderImplicit. A device is a host thread here (one thread per device,
// as XLA runs them). A launch without an order is refused, where NCCL might hang.
struct LastLaunch {
  std::string id;
  void* stream = nullptr;
  bool implicit = false;
};
thread_local LastLaunch last_launch;

// This thread's open NCCL groups (ncclGroupStart/End nest) and the collectives called in
// them, each with its rank, run when the outermost one ends.
struct GroupCall {
  int rank;
  std::function<int()> run;
  bool publishes = false;  // a send: run before the group's other calls (it never waits)
  bool isolated = false;   // launched alone (a per-call CTA configuration, NCCL >= 2.32)
};
thread_local int group_depth = 0;
thread_local std::vector<GroupCall> group_calls;

bool Ordered(const Comm& comm, void* stream) {
  const LastLaunch& last = last_launch;
  if (last.id.empty() || last.id == comm.id || last.stream == stream) return true;
  if (Version() >= kImplicitOrderVersion && Env("NCCL_LAUNCH_ORDER_IMPLICIT", "0") == "1") {
    return true;
  }
  return Version() >= kPerCollectiveVersion && comm.launch_order_implicit && last.implicit;
}

// $NCCL_STUB_ASYNC=1: a collective is enqueued, as on a GPU: it returns at once and runs on
// its stream's worker thread, in order (a "kernel"); ncclStubStreamPending(stream) counts
// what is still running there (the tests' stand-in for cudaEventQuery). An aborted
// communicator makes its collective in flight return. Workers live as long as the process.
struct Worker {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> tasks;
  int pending = 0;
};

std::mutex workers_mu;
std::map<void*, Worker*>* workers = new std::map<void*, Worker*>();  // never destroyed

Worker& WorkerOf(void* stream) {
  std::lock_guard<std::mutex> lock(workers_mu);
  Worker*& worker = (*workers)[stream];
  if (worker == nullptr) {
    worker = new Worker();
    std::thread([w = worker] {
      for (;;) {
        std::function<void()> task;
        {
          std::unique_lock<std::mutex> lock(w->mu);
          w->cv.wait(lock, [w] { return !w->tasks.empty(); });
          task = std::move(w->tasks.front());
          w->tasks.pop_front();
        }
        task();
        std::lock_guard<std::mutex> lock(w->mu);
        --w->pending;
      }
    }).detach();
  }
  return *worker;
}

// The launch-order check of every call: another communicator's launch on another stream
// before this one, with no order NCCL guarantees, is a hazard (logged, refused); else this
// call is the thread's last launch.
bool Launched(const Comm& comm, void* stream) {
  if (!Ordered(comm, stream)) {
    Log("hazard rank=" + std::to_string(comm.rank) + " id=" + comm.id +
        " after=" + last_launch.id + " (another communicator on another stream, no launch order)");
    return false;
  }
  last_launch = {comm.id, stream, comm.launch_order_implicit};
  return true;
}

// A call's `run` as NCCL issues it: kept for the end of the outermost open group; else run
// now, or (NCCL_STUB_ASYNC=1) on its stream's worker. `publishes`: a send, `isolated`: a
// kernel of its own in a group (`GroupCall`).
int Issue(const Comm& comm, void* stream, const std::function<int()>& run, bool publishes,
          bool isolated = false) {
  if (group_depth > 0) {  // runs when the outermost group ends (ncclGroupEnd)
    group_calls.push_back({comm.rank, run, publishes, isolated});
    return kSuccess;
  }
  if (Env("NCCL_STUB_ASYNC", "0") != "1") return run();
  Worker& worker = WorkerOf(stream);
  std::lock_guard<std::mutex> lock(worker.mu);
  ++worker.pending;
  worker.tasks.push_back([run, comm_id = comm.id] {
    if (run() != kSuccess) Log("failed id=" + comm_id + " (aborted, or a peer never came)");
  });
  worker.cv.notify_one();
  return kSuccess;
}

enum Kind { kAllReduceKind, kReduceScatterKind, kAllGatherKind, kAllToAllKind };
const char* const kKindNames[] = {"allreduce", "reducescatter", "allgather", "alltoall"};
constexpr int kAlltoAllVersion = 22800;

size_t ItemSize(int dtype) {
  switch (dtype) {
    case 1: return 1;  // uint8 (gathered only)
    case 2: return 4;  // int32
    case 4: return 8;  // int64
    case 7: return 4;  // float32
    case 8: return 8;  // float64
    default: return 0;
  }
}

template <typename T>
void SumSlices(const std::vector<std::string>& parts, size_t offset, size_t count, void* out) {
  std::vector<std::string> slices;
  for (const std::string& part : parts) slices.push_back(part.substr(offset * sizeof(T), count * sizeof(T)));
  SumInRankOrder<T>(slices, count, out);
}

// One rank's collective: an all-reduce of `count` elements, a reduce-scatter whose output is
// `count` (its input nranks x count), an all-gather whose input is `count` (its output
// nranks x count), an all-to-all of `count` per peer (input and output nranks x count), as
// NCCL counts them. NCCL's in-place rule: a reduce-scatter is in place where out == in +
// rank * count, an all-gather where in == out + rank * count (an all-reduce where out == in),
// an all-to-all never; buffers that overlap otherwise are refused (logged: overlap ...).
int Collective(Kind kind, const void* in, void* out, size_t count, int dtype, int op,
               Comm* comm, void* stream, int asked, bool configured) {
  const size_t itemsize = ItemSize(dtype);
  const bool copies = kind == kAllGatherKind || kind == kAllToAllKind;
  if (itemsize == 0 || (dtype == 1 && !copies)) return kInvalidArgument;
  if (op != 0 || comm == nullptr) return kInvalidArgument;
  const bool exchanges = kind == kAllToAllKind;
  const size_t in_bytes =
      count * itemsize * (kind == kReduceScatterKind || exchanges ? comm->nranks : 1);
  const size_t out_bytes =
      count * itemsize * (kind == kAllGatherKind || exchanges ? comm->nranks : 1);
  const char* in_lo = static_cast<const char*>(in);
  const char* out_lo = static_cast<const char*>(out);
  const size_t shard = count * itemsize * comm->rank;
  const bool in_place = kind == kReduceScatterKind ? out_lo == in_lo + shard
                        : kind == kAllGatherKind   ? in_lo == out_lo + shard
                        : exchanges                ? false
                                                   : out_lo == in_lo;
  if (!in_place && in_lo < out_lo + out_bytes && out_lo < in_lo + in_bytes) {
    Log("overlap rank=" + std::to_string(comm->rank) + " id=" + comm->id +
        " (input and output overlap, and not as NCCL's in-place rule places them)");
    return kInvalidArgument;
  }
  if (!Launched(*comm, stream)) return kInvalidUsage;
  const int ctas = asked > 0 ? std::min(asked, comm->channels) : comm->channels;
  Log(std::string(kKindNames[kind]) + " rank=" + std::to_string(comm->rank) +
      " count=" + std::to_string(count) + " dtype=" + std::to_string(dtype) +
      " ctas=" + std::to_string(ctas) + " asked=" + std::to_string(asked) +
      " config=" + std::to_string(configured ? 1 : 0) +
      (kind == kAllReduceKind ? "" : " inplace=" + std::to_string(in_place ? 1 : 0)) +
      " stream=" + std::to_string(reinterpret_cast<uintptr_t>(stream)) + " id=" + comm->id);
  // What runs "on the GPU": a copy of the communicator's identity (an aborted Comm is freed).
  auto run = [copy = *comm, step = comm->sequence++, kind, in, out, count, dtype, itemsize,
              in_bytes, out_bytes] {
    std::vector<std::string> parts;
    const int result = Exchange(copy, "step" + std::to_string(step),
                                std::string(static_cast<const char*>(in), in_bytes), &parts);
    if (result != kSuccess) return result;
    if (kind == kAllGatherKind) {
      std::string all;
      for (const std::string& part : parts) all += part;
      std::memcpy(out, all.data(), out_bytes);
      return kSuccess;
    }
    if (kind == kAllToAllKind) {  // block i of the output: block `rank` of rank i's input
      const size_t block = count * itemsize;
      for (size_t i = 0; i < parts.size(); ++i) {
        std::memcpy(static_cast<char*>(out) + i * block, parts[i].data() + copy.rank * block,
                    block);
      }
      return kSuccess;
    }
    const size_t offset = kind == kReduceScatterKind ? count * copy.rank : 0;
    switch (dtype) {
      case 2: SumSlices<int32_t>(parts, offset, count, out); break;
      case 4: SumSlices<int64_t>(parts, offset, count, out); break;
      case 7: SumSlices<float>(parts, offset, count, out); break;
      case 8: SumSlices<double>(parts, offset, count, out); break;
    }
    return kSuccess;
  };
  return Issue(*comm, stream, run, false, configured && Version() >= kAggIsolateVersion);
}

// A point-to-point file: the `seq`th message from rank `from` to rank `to` of `comm`.
std::string P2pPath(const Comm& comm, int from, int to, long seq) {
  return Env("NCCL_STUB_DIR", "/tmp") + "/" + comm.id + ".p2p" + std::to_string(seq) + "." +
         std::to_string(from) + "to" + std::to_string(to);
}

// ncclSend (`send`) or ncclRecv of `count` elements with rank `peer`. A send publishes its
// bytes when it runs (a file); a receive waits for its peer's, as NCCL's pair by order.
int PointToPoint(bool send, void* buffer, size_t count, int dtype, int peer, Comm* comm,
                 void* stream) {
  const size_t itemsize = ItemSize(dtype);
  if (itemsize == 0 || comm == nullptr || peer < 0 || peer >= comm->nranks) {
    return kInvalidArgument;
  }
  if (!Launched(*comm, stream)) return kInvalidUsage;
  Log(std::string(send ? "send" : "recv") + " rank=" + std::to_string(comm->rank) +
      " peer=" + std::to_string(peer) + " count=" + std::to_string(count) +
      " dtype=" + std::to_string(dtype) +
      " stream=" + std::to_string(reinterpret_cast<uintptr_t>(stream)) + " id=" + comm->id);
  const long seq = send ? comm->sent[peer]++ : comm->received[peer]++;
  const std::string path = send ? P2pPath(*comm, comm->rank, peer, seq)
                                : P2pPath(*comm, peer, comm->rank, seq);
  const size_t bytes = count * itemsize;
  auto run = [send, buffer, bytes, path, aborted = comm->aborted] {
    if (send) {
      {
        std::ofstream out(path + ".tmp", std::ios::binary);
        out.write(static_cast<const char*>(buffer), static_cast<std::streamsize>(bytes));
        if (!out) return kSystemError;
      }
      return std::rename((path + ".tmp").c_str(), path.c_str()) == 0 ? kSuccess : kSystemError;
    }
    const double timeout_s = std::atof(Env("NCCL_STUB_TIMEOUT_S", "30").c_str());
    const auto deadline = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<long>(timeout_s * 1000));
    std::ifstream in;
    while (!(in = std::ifstream(path, std::ios::binary))) {
      if (std::chrono::steady_clock::now() > deadline || aborted->load()) return kRemoteError;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const std::string got{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    if (got.size() != bytes) return kInvalidArgument;  // the peers disagree on the count
    std::memcpy(buffer, got.data(), bytes);
    return kSuccess;
  };
  return Issue(*comm, stream, run, send);
}

// A per-call config (ncclCollConfig_t, 2.31+): its CTA limit, or an error code (< 0 means
// none: not in this NCCL, or a bad config).
int CallCtas(const CollConfig* config) {
  if (Version() < kPerCollectiveVersion) return -kInvalidUsage;  // not in this NCCL
  if (config == nullptr || config->magic != kMagic || config->size < 64) return -kInvalidArgument;
  if (config->min_ctas != config->max_ctas) return -kInvalidArgument;
  return config->max_ctas;
}

// Creation: every rank must ask for the same configuration (NCCL builds one set
// of channels for the communicator); a rank that asked for another is refused.
int Join(const Comm& comm) {
  const std::string mine = std::to_string(comm.min_ctas) + "/" + std::to_string(comm.max_ctas) +
                           "/" + std::to_string(comm.launch_order_implicit);
  std::vector<std::string> all;
  const int result = Exchange(comm, "init", mine, &all);
  if (result != kSuccess) return result;
  for (int r = 0; r < comm.nranks; ++r) {
    if (all[r] != mine) {
      Log("mismatch rank=" + std::to_string(comm.rank) + " config=" + mine + " rank" +
          std::to_string(r) + "=" + all[r] + " id=" + comm.id);
      return kInvalidUsage;
    }
  }
  return kSuccess;
}

// Reads a config as NCCL does (by size and version) into `comm`: CTA range, launch order;
// its channels: the topology's ($NCCL_STUB_CHANNELS) raised to minCTAs, cut to maxCTAs and
// to the version's MAXCHANNELS. Returns whether it asks to share its parent's resources.
bool ReadConfig(const CommConfig* config, Comm* comm) {
  bool share = false;
  if (config != nullptr) {
    if (config->version >= kCtaConfigVersion && Version() >= kCtaConfigVersion) {
      comm->min_ctas = config->min_ctas;
      comm->max_ctas = config->max_ctas;
    }  // else NCCL resets (or has no) minCTAs/maxCTAs
    if (Version() >= kPerCollectiveVersion && config->version >= kPerCollectiveVersion &&
        config->size >= offsetof(CommConfig, launch_order_implicit) + sizeof(int)) {
      comm->launch_order_implicit = config->launch_order_implicit == 1;
    }
    share = Version() >= kSplitVersion &&
            config->size >= offsetof(CommConfig, split_share) + sizeof(int) &&
            config->split_share == 1;
    comm->blocking = config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT (INT_MIN): blocking
  }
  int channels = std::atoi(Env("NCCL_STUB_CHANNELS", "2").c_str());
  if (comm->min_ctas != INT_MIN) channels = std::max(channels, comm->min_ctas);
  if (comm->max_ctas != INT_MIN) channels = std::min(channels, comm->max_ctas);
  comm->channels = std::max(1, std::min(channels, MaxChannels()));
  return share;
}

}  // namespace

extern "C" {

int ncclGroupStart() {
  ++group_depth;
  return kSuccess;
}

int ncclGroupEnd() {
  if (group_depth == 0) return kInvalidUsage;
  if (--group_depth > 0) return kSuccess;
  std::vector<GroupCall> calls;
  calls.swap(group_calls);
  // Kernel launches: one per isolated call, one for the aggregated rest (if any).
  const auto isolated = std::count_if(calls.begin(), calls.end(),
                                      [](const GroupCall& call) { return call.isolated; });
  const std::size_t launches =
      static_cast<std::size_t>(isolated) + (calls.size() > static_cast<std::size_t>(isolated));
  Log("group rank=" + std::to_string(calls.empty() ? -1 : calls.front().rank) +
      " calls=" + std::to_string(calls.size()) + " launches=" + std::to_string(launches));
  // Sends first: they never wait, so no receive of the group waits on a send behind it.
  std::stable_partition(calls.begin(), calls.end(),
                        [](const GroupCall& call) { return call.publishes; });
  int result = kSuccess;
  for (const GroupCall& call : calls) {
    const int one = call.run();
    if (result == kSuccess) result = one;
  }
  return result;
}

int ncclGetVersion(int* version) {
  *version = Version();
  return kSuccess;
}

int ncclGetUniqueId(UniqueId* id) {
  std::memset(id->internal, 0, sizeof(id->internal));
  std::random_device device;
  std::snprintf(id->internal, sizeof(id->internal), "stub%08x%08x", device(), device());
  return kSuccess;
}

int ncclCommInitRankConfig(Comm** comm, int nranks, UniqueId id, int rank, CommConfig* config) {
  if (config == nullptr || config->magic != kMagic || nranks < 1 || rank < 0 || rank >= nranks) {
    return kInvalidArgument;
  }
  auto created = new Comm();  // a C API hands out raw handles
  created->id.assign(id.internal, strnlen(id.internal, sizeof(id.internal)));
  created->rank = rank;
  created->nranks = nranks;
  ReadConfig(config, created);
  created->allocated->store(created->channels);
  const bool blocking = created->blocking;
  // mem: the channels whose buffers this communicator allocates (NCCL allocates per channel).
  Log("init rank=" + std::to_string(rank) + " nranks=" + std::to_string(nranks) +
      " minCTAs=" + std::to_string(created->min_ctas) +
      " maxCTAs=" + std::to_string(created->max_ctas) +
      " channels=" + std::to_string(created->channels) +
      " blocking=" + std::to_string(blocking ? 1 : 0) +
      " implicit=" + std::to_string(created->launch_order_implicit ? 1 : 0) +
      " mem=" + std::to_string(created->channels) + " id=" + created->id);
  if (!blocking) {  // complete in the background, as NCCL's non-blocking init does
    created->state->store(kInProgress);
    std::thread([copy = *created] { copy.state->store(Join(copy)); }).detach();
    *comm = created;
    return kInProgress;
  }
  const int result = Join(*created);
  if (result != kSuccess) {
    delete created;
    return result;
  }
  *comm = created;
  return kSuccess;
}

int ncclAllReduce(const void* in, void* out, size_t count, int dtype, int op, Comm* comm,
                  void* stream) {
  return Collective(kAllReduceKind, in, out, count, dtype, op, comm, stream, 0, false);
}

int ncclAllReduceConfig(const void* in, void* out, size_t count, int dtype, int op, Comm* comm,
                        void* stream, const CollConfig* config) {
  const int ctas = CallCtas(config);
  if (ctas < 0) return -ctas;
  return Collective(kAllReduceKind, in, out, count, dtype, op, comm, stream, ctas, true);
}

int ncclReduceScatter(const void* in, void* out, size_t recvcount, int dtype, int op,
                      Comm* comm, void* stream) {
  return Collective(kReduceScatterKind, in, out, recvcount, dtype, op, comm, stream, 0, false);
}

int ncclReduceScatterConfig(const void* in, void* out, size_t recvcount, int dtype, int op,
                            Comm* comm, void* stream, const CollConfig* config) {
  const int ctas = CallCtas(config);
  if (ctas < 0) return -ctas;
  return Collective(kReduceScatterKind, in, out, recvcount, dtype, op, comm, stream, ctas, true);
}

int ncclAllGather(const void* in, void* out, size_t sendcount, int dtype, Comm* comm,
                  void* stream) {
  return Collective(kAllGatherKind, in, out, sendcount, dtype, 0, comm, stream, 0, false);
}

int ncclAllGatherConfig(const void* in, void* out, size_t sendcount, int dtype, Comm* comm,
                        void* stream, const CollConfig* config) {
  const int ctas = CallCtas(config);
  if (ctas < 0) return -ctas;
  return Collective(kAllGatherKind, in, out, sendcount, dtype, 0, comm, stream, ctas, true);
}

int ncclAlltoAll(const void* in, void* out, size_t count, int dtype, Comm* comm, void* stream) {
  if (Version() < kAlltoAllVersion) return kInvalidUsage;  // not in this NCCL
  return Collective(kAllToAllKind, in, out, count, dtype, 0, comm, stream, 0, false);
}

int ncclAlltoAllConfig(const void* in, void* out, size_t count, int dtype, Comm* comm,
                       void* stream, const CollConfig* config) {
  const int ctas = CallCtas(config);
  if (ctas < 0) return -ctas;
  return Collective(kAllToAllKind, in, out, count, dtype, 0, comm, stream, ctas, true);
}

int ncclSend(const void* in, size_t count, int dtype, int peer, Comm* comm, void* stream) {
  return PointToPoint(true, const_cast<void*>(in), count, dtype, peer, comm, stream);
}

int ncclRecv(void* out, size_t count, int dtype, int peer, Comm* comm, void* stream) {
  return PointToPoint(false, out, count, dtype, peer, comm, stream);
}

int ncclCommCount(const Comm* comm, int* count) {
  if (comm == nullptr || count == nullptr) return kInvalidArgument;
  *count = comm->nranks;
  return kSuccess;
}

// ncclCommSplit (2.18+), every rank with color 0: a child with the parent's ranks. With
// splitShare = 1 it shares the parent's resources: its per-channel buffers (a child
// allocates only the channels the group has not: mem=), and its abort flag. Non-blocking (the
// parent's mode or the config's): returns ncclInProgress, *newcomm is set when the split
// completes, and a failure shows on the parent's async state.
int ncclCommSplit(Comm* parent, int color, int key, Comm** newcomm, CommConfig* config) {
  if (Version() < kSplitVersion) return kInvalidUsage;  // not in this NCCL
  if (parent == nullptr || newcomm == nullptr || color != 0) return kInvalidArgument;
  if (config != nullptr && config->magic != kMagic) return kInvalidArgument;
  *newcomm = nullptr;
  auto child = std::make_unique<Comm>();
  child->id = parent->id + ".split" + std::to_string(++parent->splits);
  child->rank = key;
  child->nranks = parent->nranks;
  child->blocking = parent->blocking;
  const bool share = ReadConfig(config, child.get());
  int mem = child->channels;
  if (share) {
    child->aborted = parent->aborted;
    child->allocated = parent->allocated;
    const int had = child->allocated->load();
    mem = std::max(0, child->channels - had);
    child->allocated->store(std::max(had, child->channels));
  } else {
    child->allocated->store(child->channels);
  }
  Log("split rank=" + std::to_string(child->rank) + " parent=" + parent->id +
      " minCTAs=" + std::to_string(child->min_ctas) +
      " maxCTAs=" + std::to_string(child->max_ctas) +
      " channels=" + std::to_string(child->channels) + " share=" + std::to_string(share) +
      " implicit=" + std::to_string(child->launch_order_implicit ? 1 : 0) +
      " mem=" + std::to_string(mem) + " id=" + child->id);
  if (child->blocking) {
    const int result = Join(*child);
    if (result != kSuccess) return result;
    *newcomm = child.release();
    return kSuccess;
  }
  std::thread([made = child.release(), newcomm, state = parent->state] {
    const int result = Join(*made);
    if (result == kSuccess) {
      __atomic_store_n(newcomm, made, __ATOMIC_RELEASE);
    } else {
      state->store(result);
      delete made;
    }
  }).detach();
  return kInProgress;
}

int ncclCommDestroy(Comm* comm) {
  delete comm;
  return kSuccess;
}

int ncclCommGetAsyncError(Comm* comm, int* state) {
  if (comm == nullptr || state == nullptr) return kInvalidArgument;
  *state = comm->state->load();
  return kSuccess;
}

int ncclCommAbort(Comm* comm) {
  if (comm == nullptr) return kSuccess;
  Log("abort rank=" + std::to_string(comm->rank) + " id=" + comm->id);
  comm->aborted->store(true);
  delete comm;
  return kSuccess;
}

// The stub's own: collectives still running on `stream` (NCCL_STUB_ASYNC=1).
int ncclStubStreamPending(void* stream) {
  Worker& worker = WorkerOf(stream);
  std::lock_guard<std::mutex> lock(worker.mu);
  return worker.pending;
}

const char* ncclGetErrorString(int result) {
  switch (result) {
    case kSuccess: return "no error";
    case kSystemError: return "unhandled system error (stub)";
    case kInvalidArgument: return "invalid argument (stub)";
    case kInvalidUsage: return "invalid usage (stub: not in this NCCL version)";
    case kRemoteError: return "remote process exited or there was a network error (stub timeout)";
    default: return "unknown result (stub)";
  }
}

}  // extern "C"
