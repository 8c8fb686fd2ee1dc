// Tests of libra's NCCL control path (libra/nccl.h) against the host-memory
// stub (nccl_stub.cc, whose path is argv[1]); run under ASan and TSan in CI.
// Ranks are threads of this process.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <dlfcn.h>
#include <unistd.h>

#include "libra/nccl.h"
#include "libra/streams.h"
#include "check.h"

namespace {

namespace nccl = libra::nccl;
std::string stub_path;

void TestVersions() {
  CHECK(nccl::VersionString(23100) == "2.31.0");
  CHECK(nccl::VersionString(22704) == "2.27.4");
  CHECK(nccl::VersionString(2804) == "2.8.4");
  CHECK(nccl::RouteFor(23100, true) == nccl::CtaRoute::kPerCollective);
  CHECK(nccl::RouteFor(23100, false) == nccl::CtaRoute::kPerCommunicator);
  CHECK(nccl::RouteFor(22999, true) == nccl::CtaRoute::kPerCommunicator);
  CHECK(nccl::RouteFor(21700, false) == nccl::CtaRoute::kPerCommunicator);
  CHECK(nccl::RouteFor(21699, true) == nccl::CtaRoute::kNone);
  CHECK(nccl::MaxCtas(21400) == 0 && nccl::MaxCtas(21700) == 32 && nccl::MaxCtas(22499) == 32);
  CHECK(nccl::MaxCtas(22500) == 64 && nccl::MaxCtas(23100) == 64);
}

// The route asked for when NCCL is opened: auto is the version's (RouteFor); per-communicator
// on every NCCL with CTA limits (2.31 and 2.32 included); per-collective only where there is
// a per-call limit. A request a version cannot take is refused, naming the library, its version
// and what it lacks; a name that is no route is refused, naming it.
void TestRouteRequests() {
  using nccl::CtaRoute;
  using nccl::RouteRequest;
  struct Case {
    int version;
    bool has_entry;
    RouteRequest request;
    CtaRoute route;  // kNone with `refused`: no route
    const char* refused;
  };
  const Case cases[] = {
      {23100, true, RouteRequest::kAuto, CtaRoute::kPerCollective, nullptr},
      {23200, true, RouteRequest::kAuto, CtaRoute::kPerCollective, nullptr},
      {22800, false, RouteRequest::kAuto, CtaRoute::kPerCommunicator, nullptr},
      {21600, false, RouteRequest::kAuto, CtaRoute::kNone, nullptr},
      {23100, true, RouteRequest::kPerCommunicator, CtaRoute::kPerCommunicator, nullptr},
      {23200, true, RouteRequest::kPerCommunicator, CtaRoute::kPerCommunicator, nullptr},
      {21700, false, RouteRequest::kPerCommunicator, CtaRoute::kPerCommunicator, nullptr},
      {23200, true, RouteRequest::kPerCollective, CtaRoute::kPerCollective, nullptr},
      {22800, false, RouteRequest::kPerCollective, CtaRoute::kNone,
       "LIBRA_JAX_NCCL_CTA_ROUTE=per-collective, but lib.so (NCCL 2.28.0) has no "
       "ncclAllReduceConfig (NCCL >= 2.31 has)"},
      {23100, false, RouteRequest::kPerCollective, CtaRoute::kNone, "has no ncclAllReduceConfig"},
      {21600, false, RouteRequest::kPerCommunicator, CtaRoute::kNone,
       "LIBRA_JAX_NCCL_CTA_ROUTE=per-communicator, but lib.so (NCCL 2.16.0) has no CTA limit"},
  };
  for (const Case& c : cases) {
    CtaRoute route = CtaRoute::kNone;
    const libra::Status s = nccl::ChooseRoute(c.version, c.has_entry, c.request, "lib.so", &route);
    if (c.refused == nullptr) {
      CHECK(s.ok() && route == c.route);
    } else {
      CHECK(s.code == libra::Status::Code::kInvalidArgument &&
            s.message.find(c.refused) != std::string::npos);
    }
  }
  for (const RouteRequest request : {RouteRequest::kAuto, RouteRequest::kPerCollective,
                                     RouteRequest::kPerCommunicator}) {
    RouteRequest parsed = RouteRequest::kAuto;
    CHECK(nccl::ParseRouteRequest(nccl::Name(request), &parsed).ok() && parsed == request);
  }
  CHECK(std::string(nccl::Name(RouteRequest::kPerCommunicator)) ==
        nccl::Name(CtaRoute::kPerCommunicator));
  RouteRequest parsed = RouteRequest::kAuto;
  const libra::Status bad = nccl::ParseRouteRequest("per-call", &parsed);
  CHECK(!bad.ok() && bad.message.find("got 'per-call'") != std::string::npos);
}

// Every kind of dtype.h's table has its own NCCL launch; one past the table has none and
// is refused by name, never launched as the all-reduce.
void TestEveryKindHasItsLaunch() {
  for (int k = 0; k < libra::kNumCollectives; ++k) {
    CHECK(nccl::Library::Launches(static_cast<libra::Collective>(k)));
  }
  CHECK(!nccl::Library::Launches(static_cast<libra::Collective>(libra::kNumCollectives)));
}

// NCCL's count of each kind, from its buffers' sizes by its row (libra/dtype.h counts_in,
// counts_out), as the FFI handlers and the host entry point size their calls: on 4 ranks an
// all-to-all of 12 elements in and out sends 3 to each peer. Sizes that do not fit are
// refused, naming the kind.
void TestCountsByKind() {
  using libra::Collective;
  struct Case {
    Collective kind;
    std::size_t input, output, count;
  };
  const Case cases[] = {{Collective::kAllReduce, 12, 12, 12},
                        {Collective::kReduceScatter, 12, 3, 3},
                        {Collective::kAllGather, 3, 12, 3},
                        {Collective::kAllToAll, 12, 12, 3}};
  static_assert(std::size(cases) == libra::kNumCollectives, "a case per kind");
  for (const Case& c : cases) {
    std::size_t count = 0;
    CHECK(nccl::CountOf(c.kind, c.input, c.output, 4, &count).ok() && count == c.count);
  }
  std::size_t count = 0;
  libra::Status s = nccl::CountOf(Collective::kAllToAll, 12, 3, 4, &count);
  CHECK(!s.ok() && s.message.find("NCCL all-to-all: 12 in and 3 out do not fit 4 ranks") !=
                       std::string::npos);
  CHECK(!nccl::CountOf(Collective::kAllToAll, 10, 10, 4, &count).ok());
  CHECK(!nccl::CountOf(Collective::kReduceScatter, 12, 12, 4, &count).ok());
  CHECK(!nccl::CountOf(Collective::kAllGather, 3, 3, 4, &count).ok());
  CHECK(!nccl::CountOf(Collective::kAllReduce, 12, 12, 0, &count).ok());
  s = nccl::CountOf(static_cast<Collective>(libra::kNumCollectives), 12, 12, 4, &count);
  CHECK(!s.ok() && s.message.find("unknown collective kind") != std::string::npos);
}

void TestOpen() {
  std::unique_ptr<nccl::Library> lib;
  libra::Status s = nccl::Library::Open("/nonexistent/libnccl.so.2", &lib);
  CHECK(!s.ok() && s.message.find("cannot load /nonexistent/libnccl.so.2") != std::string::npos);
  CHECK(lib == nullptr);
  setenv("NCCL_STUB_VERSION", "22700", 1);
  s = nccl::Library::Open(stub_path, &lib);
  CHECK(s.ok() && lib->version() == 22700 && lib->route() == nccl::CtaRoute::kPerCommunicator);
  setenv("NCCL_STUB_VERSION", "23100", 1);
  s = nccl::Library::Open(stub_path, &lib);
  CHECK(s.ok() && lib->route() == nccl::CtaRoute::kPerCollective);
  void* comm = nullptr;
  nccl::UniqueId id{};
  CHECK(!lib->InitRank(id, 2, 2, 0, &comm).ok());  // rank out of range
}

std::string ReadFile(const std::string& path) {
  std::string text;
  if (FILE* f = std::fopen(path.c_str(), "r")) {
    char buffer[4096];
    std::size_t n;
    while ((n = std::fread(buffer, 1, sizeof buffer, f)) > 0) text.append(buffer, n);
    std::fclose(f);
  }
  return text;
}

// Points the stub's log at `name` in the test directory; returns its path.
std::string StubLog(const char* name) {
  const std::string log = std::string(std::getenv("NCCL_STUB_DIR")) + "/" + name;
  setenv("NCCL_STUB_LOG", log.c_str(), 1);
  return log;
}

// The process's communicator cache, its library opened on the stub.
nccl::Communicators& StubCommunicators(const nccl::Library** lib) {
  nccl::Communicators& comms = nccl::Communicators::Get();
  CHECK(comms.Open(stub_path, lib).ok() && *lib != nullptr);
  return comms;
}

// The communicator cache on the stub at 2.31, with a fresh unique id registered as
// `comm_id`: what an FFI handler's call goes through.
nccl::Communicators& CachedCommunicators(int64_t comm_id) {
  setenv("NCCL_STUB_VERSION", "23100", 1);
  const nccl::Library* cached = nullptr;
  nccl::Communicators& comms = StubCommunicators(&cached);
  nccl::UniqueId id{};
  CHECK(cached->GetUniqueId(&id).ok() && comms.RegisterId(comm_id, id).ok());
  return comms;
}

// What reaches the stub (which keeps NCCL's version rules): the CTA fields of a
// pinned communicator on 2.17-2.30, the channel maximum, no limit below 2.17.
void TestCtaLimitsReachNccl() {
  const std::string log = StubLog("cta.log");
  std::unique_ptr<nccl::Library> lib;
  const std::pair<const char*, int> versions[] = {{"21700", 32}, {"22400", 32}, {"23000", 64}};
  for (const auto& [version, most] : versions) {
    setenv("NCCL_STUB_VERSION", version, 1);
    CHECK(nccl::Library::Open(stub_path, &lib).ok());
    CHECK(lib->route() == nccl::CtaRoute::kPerCommunicator && lib->max_ctas() == most);
    nccl::UniqueId id{};
    CHECK(lib->GetUniqueId(&id).ok());
    void* comm = nullptr;
    CHECK(lib->InitRank(id, 1, 0, 4, &comm).ok());
    lib->Destroy(comm);
    CHECK(ReadFile(log).find("minCTAs=4 maxCTAs=4 channels=4") != std::string::npos);
    std::remove(log.c_str());
    CHECK(!lib->InitRank(id, 1, 0, most + 1, &comm).ok());  // above the channel maximum
  }
  setenv("NCCL_STUB_VERSION", "22500", 1);
  CHECK(nccl::Library::Open(stub_path, &lib).ok() && lib->max_ctas() == 64);
  setenv("NCCL_STUB_VERSION", "23100", 1);
  CHECK(nccl::Library::Open(stub_path, &lib).ok() && lib->max_ctas() == nccl::kCommCtas);
  setenv("NCCL_STUB_VERSION", "21600", 1);
  CHECK(nccl::Library::Open(stub_path, &lib).ok());
  CHECK(lib->route() == nccl::CtaRoute::kNone && lib->max_ctas() == 0);
  unsetenv("NCCL_STUB_LOG");
  setenv("NCCL_STUB_VERSION", "23100", 1);
}

// A rank that never joins: creation is non-blocking, so it fails after the timeout with
// kDeadlineExceeded and the communicator is aborted (the stub logs it), never a hang; the
// cache forgets it.
void TestMissingRankTimesOut() {
  const std::string log = StubLog("timeout.log");
  const nccl::Library* lib = nullptr;
  nccl::Communicators& comms = StubCommunicators(&lib);
  nccl::UniqueId id{};
  CHECK(lib->GetUniqueId(&id).ok());
  CHECK(comms.RegisterId(9, id).ok());
  std::vector<float> data(8, 1.0f);
  const libra::Status s = comms.AllReduce(9, 2, 0, 2, data.data(), data.data(), data.size(),
                                          libra::DType::kF32, nullptr, /*timeout_ms=*/200);
  // libra's timeout (the stub's own, 30 s, would be an internal "remote error").
  CHECK(s.code == libra::Status::Code::kDeadlineExceeded);
  CHECK(s.message.find("not every rank arrived within 200 ms") != std::string::npos);
  CHECK(ReadFile(log).find("abort rank=0") != std::string::npos);
  unsetenv("NCCL_STUB_LOG");
}

// Four ranks (threads), 20 calls each with block counts that change per call,
// through the process's communicator cache (per-collective route).
void TestCommunicatorsConcurrently() {
  constexpr int kRanks = 4, kCalls = 20;
  const nccl::Library* lib = nullptr;
  nccl::Communicators& comms = StubCommunicators(&lib);
  nccl::UniqueId id{};
  CHECK(lib->GetUniqueId(&id).ok());
  CHECK(comms.RegisterId(5, id).ok());
  CHECK(comms.RegisterId(5, id).ok());  // the same id again is fine
  nccl::UniqueId other = id;
  other[0] ^= 1;
  CHECK(!comms.RegisterId(5, other).ok());

  std::vector<int> wrong(kRanks, 0);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kRanks; ++rank) {
    threads.emplace_back([&, rank] {
      for (int call = 0; call < kCalls; ++call) {
        std::vector<float> data(1000, static_cast<float>(rank + call));
        const int ctas = 1 + call % 5;
        const libra::Status s = comms.AllReduce(5, kRanks, rank, ctas, data.data(), data.data(),
                                                data.size(), libra::DType::kF32, nullptr);
        const float expected = 6.0f + 4.0f * call;  // sum over ranks of rank + call
        if (!s.ok() || data.front() != expected || data.back() != expected) ++wrong[rank];
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int rank = 0; rank < kRanks; ++rank) CHECK(wrong[rank] == 0);
  CHECK(comms.size() == kRanks);  // one communicator per rank, whatever the block count
  std::vector<float> one(4, 1.0f);
  const libra::Status s = comms.AllReduce(6, 1, 0, 1, one.data(), one.data(), one.size(),
                                          libra::DType::kF32, nullptr);
  CHECK(!s.ok() && s.message.find("has no unique id") != std::string::npos);
}

// --- libra's streams (libra/streams.h) with a recording fake of the runtime ----
//
// Streams are numbered 100 + device; events count up from 1 and remember the
// stream they were recorded on. The record of operations is what a GPU run
// would do, in order: "record S -> E", "wait S E".
struct FakeRuntime {
  std::mutex mu;
  std::vector<std::string> ops;
  uintptr_t next_event = 1;
  int created = 0;
  bool work_ended = false;  // what query says of every event
  int released = 0;
};
FakeRuntime fake;

void* AsPointer(uintptr_t v) { return reinterpret_cast<void*>(v); }
uintptr_t AsNumber(void* p) { return reinterpret_cast<uintptr_t>(p); }
void* XlaStream(int device) { return AsPointer(10 + device); }

libra::StreamOps FakeOps() {
  libra::StreamOps ops;
  ops.create = [](int device, void** stream) {
    std::lock_guard<std::mutex> lock(fake.mu);
    ++fake.created;
    *stream = AsPointer(100 + device);
    return libra::Status::Ok();
  };
  ops.record = [](void* stream, void** event) {
    std::lock_guard<std::mutex> lock(fake.mu);
    *event = AsPointer(fake.next_event++);
    fake.ops.push_back("record " + std::to_string(AsNumber(stream)) + " -> " +
                       std::to_string(AsNumber(*event)));
    return libra::Status::Ok();
  };
  ops.wait = [](void* stream, void* event) {
    std::lock_guard<std::mutex> lock(fake.mu);
    fake.ops.push_back("wait " + std::to_string(AsNumber(stream)) + " " +
                       std::to_string(AsNumber(event)));
    return libra::Status::Ok();
  };
  ops.query = [](void*) {
    std::lock_guard<std::mutex> lock(fake.mu);
    return fake.work_ended ? 1 : 0;
  };
  ops.release = [](void*) {
    std::lock_guard<std::mutex> lock(fake.mu);
    ++fake.released;
  };
  return ops;
}

// Start issues on libra's stream after XLA's, done makes XLA's stream wait for its end;
// the one-call form does both; ids pair starts with dones, and errors name the call.
void TestSideStreams() {
  fake.ops.clear();
  fake.next_event = 1;
  fake.created = 0;
  libra::SideStreams side(FakeOps());
  std::vector<uintptr_t> issued_on;
  auto issue = [&](void* s) {
    issued_on.push_back(AsNumber(s));
    return libra::Status::Ok();
  };
  CHECK(side.Start(0, 7, XlaStream(0), issue).ok());
  CHECK(side.pending() == 1);
  const libra::Status again = side.Start(0, 7, XlaStream(0), issue);
  CHECK(again.code == libra::Status::Code::kFailedPrecondition);
  CHECK(again.message.find("call 7 on GPU 0 started again") != std::string::npos);
  CHECK(side.Start(1, 7, XlaStream(1), issue).ok());  // the same id on another GPU
  CHECK(side.Done(0, 7, XlaStream(0)).ok());
  const libra::Status lone = side.Done(0, 7, XlaStream(0));
  CHECK(lone.code == libra::Status::Code::kFailedPrecondition);
  CHECK(lone.message.find("without its start") != std::string::npos);
  CHECK(side.Done(1, 7, XlaStream(1)).ok() && side.pending() == 0);
  CHECK(side.Call(0, XlaStream(0), issue).ok());
  CHECK((issued_on == std::vector<uintptr_t>{100, 101, 100}));  // libra's stream, never XLA's
  CHECK(fake.created == 2);  // one stream per GPU, reused
  // The refused start queues nothing: its id is checked first.
  const std::vector<std::string> expected = {
      "record 10 -> 1", "wait 100 1", "record 100 -> 2",   // start on GPU 0
      "record 11 -> 3", "wait 101 3", "record 101 -> 4",   // start on GPU 1
      "wait 10 2",                                         // done on GPU 0
      "wait 11 4",                                         // done on GPU 1
      "record 10 -> 5", "wait 100 5", "record 100 -> 6", "wait 10 6",  // one call
  };
  CHECK(fake.ops == expected);
  const libra::Status failed = side.Start(0, 8, XlaStream(0), [](void*) {
    return libra::Status::Error(libra::Status::Code::kInternal, "no");
  });
  CHECK(!failed.ok() && side.pending() == 0);  // a failed issue leaves nothing pending
}

// A start whose execution failed before its done (the done never comes) leaves its entry.
// A later start of the same call drops it once its work has ended and its done is overdue
// (the call's timeout; at once without one), and other calls' overdue entries go too; one
// whose work is still running is kept (the same program twice at once is still refused).
void TestStaleStartsExpire() {
  fake.ops.clear();
  fake.work_ended = false;
  fake.released = 0;
  libra::SideStreams side(FakeOps());
  auto issue = [](void*) { return libra::Status::Ok(); };
  CHECK(side.Start(0, 1, XlaStream(0), issue, /*expire_ms=*/50).ok());
  CHECK(side.Start(0, 2, XlaStream(0), issue, 50).ok());   // its done never comes either
  CHECK(side.Start(1, 3, XlaStream(1), issue, 0).ok());    // no timeout
  CHECK(side.pending() == 3);
  // Running, or not yet overdue: refused, nothing dropped.
  CHECK(side.Start(0, 1, XlaStream(0), issue, 50).code ==
        libra::Status::Code::kFailedPrecondition);
  fake.work_ended = true;
  CHECK(side.Start(0, 1, XlaStream(0), issue, 50).code ==
        libra::Status::Code::kFailedPrecondition);  // ended, but its done may still come
  CHECK(side.expired() == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(80));
  CHECK(side.Start(0, 1, XlaStream(0), issue, 50).ok());  // overdue: dropped, started anew
  CHECK(side.expired() == 2 && fake.released == 2);       // calls 1 and 2 (3 has no timeout)
  CHECK(side.pending() == 2);
  CHECK(side.Start(1, 3, XlaStream(1), issue, 0).ok());   // no timeout: dropped once ended
  CHECK(side.expired() == 3 && side.pending() == 2);
  CHECK(side.Done(0, 1, XlaStream(0)).ok() && side.Done(1, 3, XlaStream(1)).ok());
  CHECK(side.pending() == 0);
  CHECK(side.Done(0, 2, XlaStream(0)).code == libra::Status::Code::kFailedPrecondition);
  fake.work_ended = false;
}

// Per-thread counts of failures, checked on the main thread (CHECK is not thread-safe).
struct RankOutcome {
  int wrong = 0;
  std::string error;
};

// The stub opened as NCCL `version`, and in `id` a unique id for a communicator of it.
std::unique_ptr<nccl::Library> StubAt(const char* version, nccl::UniqueId* id) {
  setenv("NCCL_STUB_VERSION", version, 1);
  std::unique_ptr<nccl::Library> lib;
  CHECK(nccl::Library::Open(stub_path, &lib).ok() && lib != nullptr);
  CHECK(lib->GetUniqueId(id).ok());
  return lib;
}

// Runs `body(rank, outcome)` for two ranks, each on a thread of its own (the ranks of one
// communicator), and returns what each found.
std::vector<RankOutcome> OnTwoRanks(const std::function<void(int, RankOutcome&)>& body) {
  std::vector<RankOutcome> outcomes(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] { body(rank, outcomes[rank]); });
  }
  for (std::thread& t : threads) t.join();
  return outcomes;
}

// Several communicators on the same GPUs need one launch order (NCCL's rule, which the
// stub keeps). Two ranks (threads, one per "GPU") run a program of four all-reduces on
// two communicators, A B A B, as 2.17-2.30 do (one communicator per block count):
// issued straight on two different streams, the stub refuses the second communicator's
// launch; through libra's side streams (one per GPU) it is ordered on every version, and
// NCCL_LAUNCH_ORDER_IMPLICIT (2.26+) orders it without that.
void TestLaunchOrder() {
  struct Case {
    const char* version;
    bool side_streams;
    bool implicit_env;
    bool ordered;
  };
  const Case cases[] = {
      {"22400", false, false, false}, {"22400", true, false, true},
      {"22600", false, false, false}, {"22600", false, true, true},
      {"22600", true, false, true},   {"22400", false, true, false},  // 2.24 has no env
  };
  for (const Case& c : cases) {
    setenv("NCCL_STUB_VERSION", c.version, 1);
    if (c.implicit_env) setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", 1);
    std::unique_ptr<nccl::Library> lib;
    CHECK(nccl::Library::Open(stub_path, &lib).ok());
    nccl::UniqueId ids[2];
    CHECK(lib->GetUniqueId(&ids[0]).ok() && lib->GetUniqueId(&ids[1]).ok());
    libra::SideStreams side(FakeOps());
    std::vector<RankOutcome> outcomes(2);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        void* comms[2] = {nullptr, nullptr};
        for (int k = 0; k < 2; ++k) {
          const libra::Status made = lib->InitRank(ids[k], 2, rank, 2 + 2 * k, &comms[k], 10000);
          if (!made.ok()) outcomes[rank].error = made.message;
        }
        if (!outcomes[rank].error.empty()) return;
        for (int call = 0; call < 4; ++call) {
          const int k = call % 2;
          std::vector<float> data(16, 1.0f);
          auto issue = [&](void* stream) {
            return lib->AllReduce(data.data(), data.data(), data.size(), libra::DType::kF32,
                                  comms[k], 0, stream);
          };
          // Straight: communicator k's calls on a stream of its own (k + 1).
          const libra::Status s = c.side_streams ? side.Call(rank, XlaStream(rank), issue)
                                                 : issue(AsPointer(1 + k));
          if (!s.ok()) {
            outcomes[rank].error = s.message;
            break;
          }
          if (data[0] != 2.0f) ++outcomes[rank].wrong;
        }
        for (void* comm : comms) lib->Abort(comm);
      });
    }
    for (std::thread& t : threads) t.join();
    for (const RankOutcome& o : outcomes) {
      CHECK(o.wrong == 0);
      CHECK(o.error.empty() == c.ordered);
      if (!c.ordered) CHECK(o.error.find("invalid usage") != std::string::npos);
    }
    unsetenv("NCCL_LAUNCH_ORDER_IMPLICIT");
  }
  setenv("NCCL_STUB_VERSION", "23100", 1);
}

// On 2.31 libra asks every communicator for implicit launch order (launchOrderImplicit),
// so even two streams are ordered; Prepare makes the communicator before the first call,
// which then makes none.
void TestPrepareThenCall() {
  const std::string log = StubLog("prepare.log");
  const nccl::Library* lib = nullptr;
  nccl::Communicators& comms = StubCommunicators(&lib);
  CHECK(lib->version() == 23100);
  nccl::UniqueId a{}, b{};
  CHECK(lib->GetUniqueId(&a).ok() && lib->GetUniqueId(&b).ok());
  CHECK(comms.RegisterId(21, a).ok() && comms.RegisterId(22, b).ok());
  std::vector<RankOutcome> outcomes(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      for (int64_t id : {21, 22}) {
        const libra::Status s = comms.Prepare(id, 2, rank, 4, 10000);
        if (!s.ok()) outcomes[rank].error = s.message;
      }
      for (int call = 0; call < 4; ++call) {
        std::vector<float> data(8, 1.0f + rank);
        const libra::Status s =
            comms.AllReduce(21 + call % 2, 2, rank, 4, data.data(), data.data(), data.size(),
                            libra::DType::kF32, AsPointer(1 + call % 2), 10000);
        if (!s.ok()) outcomes[rank].error = s.message;
        if (data[7] != 3.0f) ++outcomes[rank].wrong;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const RankOutcome& o : outcomes) CHECK(o.error.empty() && o.wrong == 0);
  const std::string text = ReadFile(log);
  std::size_t inits = 0, implicit = 0;
  for (std::size_t at = text.find("init "); at != std::string::npos; at = text.find("init ", at + 1)) {
    ++inits;
    const std::size_t end = text.find('\n', at);
    implicit += text.substr(at, end - at).find("implicit=1") != std::string::npos;
  }
  CHECK(inits == 4 && implicit == 4);  // made by Prepare only, all with implicit order
  CHECK(text.find("hazard") == std::string::npos);
  unsetenv("NCCL_STUB_LOG");
}

// A bucket's members as one NCCL group (Communicators::CallGroup): each rank opens one group
// (the stub logs "group rank=R calls=3"), every member runs with the call's CTA limit, the
// sums are right for each member and each dtype; a reduce-scatter's members likewise. A
// member NCCL does not serve is refused before the group opens, and no group is left open
// (a plain call after it runs at once). On the per-communicator route (2.24) the same.
void TestGroupedCall() {
  for (const char* version : {"23100", "22400"}) {
    const std::string log = StubLog(version[1] == '3' ? "group.log" : "group_old.log");
    nccl::UniqueId id{};
    const std::unique_ptr<nccl::Library> lib = StubAt(version, &id);
    const std::vector<RankOutcome> outcomes = OnTwoRanks([&](int rank, RankOutcome& o) {
      void* comm = nullptr;
      if (libra::Status s = lib->InitRank(id, 2, rank, 4, &comm, 10000); !s.ok()) {
        o.error = s.message;
        return;
      }
      std::vector<float> a(8, 1.0f + rank), b(3, 10.0f * (rank + 1));
      std::vector<int32_t> c(5, 100 + rank);
      const std::vector<nccl::Library::Member> bucket = {
          {a.data(), a.data(), a.size(), libra::DType::kF32},
          {b.data(), b.data(), b.size(), libra::DType::kF32},
          {c.data(), c.data(), c.size(), libra::DType::kS32}};
      libra::Status s = lib->CollectiveGroup(libra::Collective::kAllReduce, bucket, comm, 4,
                                             AsPointer(1), 10000);
      if (!s.ok()) o.error = s.message;
      o.wrong += a[7] != 3.0f || b[2] != 30.0f || c[4] != 201;
      // Reduce-scatters: each member's input two rows, rank r keeps row r's sums.
      std::vector<float> x(4, 1.0f + rank), y(6, 2.0f + rank), x_out(2), y_out(3);
      s = lib->CollectiveGroup(libra::Collective::kReduceScatter,
                               {{x.data(), x_out.data(), 2, libra::DType::kF32},
                                {y.data(), y_out.data(), 3, libra::DType::kF32}},
                               comm, 4, AsPointer(1), 10000);
      if (!s.ok()) o.error = s.message;
      o.wrong += x_out[1] != 3.0f || y_out[2] != 5.0f;
      // Refused before the group opens: bytes are only gathered.
      std::vector<uint8_t> bytes(4);
      s = lib->CollectiveGroup(libra::Collective::kAllReduce,
                               {{a.data(), a.data(), a.size(), libra::DType::kF32},
                                {bytes.data(), bytes.data(), 4, libra::DType::kBytes}},
                               comm, 4, AsPointer(1), 10000);
      o.wrong += s.ok() || s.message.find("not served") == std::string::npos;
      std::vector<float> after(2, 1.0f);  // runs at once: no group was left open
      s = lib->AllReduce(after.data(), after.data(), 2, libra::DType::kF32, comm, 4,
                         AsPointer(1), 10000);
      if (!s.ok()) o.error = s.message;
      o.wrong += after[1] != 2.0f;
      lib->Destroy(comm);
    });
    for (const RankOutcome& o : outcomes) CHECK(o.error.empty() && o.wrong == 0);
    const std::string text = ReadFile(log);
    for (const char* line : {"group rank=0 calls=3", "group rank=1 calls=3",
                             "group rank=0 calls=2", "group rank=1 calls=2"}) {
      CHECK(text.find(line) != std::string::npos);
    }
    const bool per_call = std::string(version) == "23100";
    CHECK(text.find(per_call ? "ctas=4 asked=4 config=1" : "ctas=4 asked=0 config=0") !=
          std::string::npos);
    CHECK(text.find("hazard") == std::string::npos);
    unsetenv("NCCL_STUB_LOG");
  }
  // Through the communicator cache, as the FFI handlers call it.
  nccl::Communicators& comms = CachedCommunicators(61);
  const std::vector<RankOutcome> outcomes = OnTwoRanks([&](int rank, RankOutcome& o) {
    std::vector<float> a(4, 1.0f + rank), b(2, 5.0f);
    const libra::Status s = comms.CallGroup(
        libra::Collective::kAllReduce, 61, 2, rank, 4,
        {{a.data(), a.data(), 4, libra::DType::kF32}, {b.data(), b.data(), 2, libra::DType::kF32}},
        AsPointer(1), 10000);
    if (!s.ok()) o.error = s.message;
    o.wrong += a[3] != 3.0f || b[1] != 10.0f;
  });
  for (const RankOutcome& o : outcomes) CHECK(o.error.empty() && o.wrong == 0);
}

// The per-communicator route forced on NCCL 2.31 and 2.32 (which have per-call limits): a
// bucket as one group on communicators pinned by their config (the first block count's made
// with minCTAs = maxCTAs = 2, another's split from it with 4, sharing its buffers), every member
// of each kind issued on the plain entry points (ncclAllReduce, ncclReduceScatter,
// ncclAllGather, ncclAlltoAll: config=0, no *Config call), as 2.18-2.30 run; in the stub's model
// of NCCL's planner the group is one launch. On 2.32's own route (per collective) the same
// bucket's members each carry a per-call config, which 2.32 isolates from aggregation: a launch
// per member. Sums, shards and exchanges are right on both.
void TestForcedPerCommunicatorRoute() {
  struct Case {
    const char* version;
    nccl::RouteRequest request;
    const char* launches;  // of the all-reduce bucket's group, in the stub's log
  };
  const Case cases[] = {
      {"23100", nccl::RouteRequest::kPerCommunicator, "group rank=0 calls=3 launches=1"},
      {"23200", nccl::RouteRequest::kPerCommunicator, "group rank=0 calls=3 launches=1"},
      {"23200", nccl::RouteRequest::kAuto, "group rank=0 calls=3 launches=3"},
  };
  for (const Case& c : cases) {
    const bool pinned = c.request == nccl::RouteRequest::kPerCommunicator;
    const std::string log = StubLog((std::string("forced_") + c.version +
                                     (pinned ? "_pinned" : "_auto") + ".log").c_str());
    setenv("NCCL_STUB_VERSION", c.version, 1);
    std::unique_ptr<nccl::Library> lib;
    CHECK(nccl::Library::Open(stub_path, c.request, &lib).ok() && lib != nullptr);
    CHECK(lib->route() == (pinned ? nccl::CtaRoute::kPerCommunicator
                                  : nccl::CtaRoute::kPerCollective));
    CHECK(lib->max_ctas() == (pinned ? 64 : nccl::kCommCtas) && lib->splits());
    nccl::UniqueId id{};
    CHECK(lib->GetUniqueId(&id).ok());
    const std::vector<RankOutcome> outcomes = OnTwoRanks([&](int rank, RankOutcome& o) {
      // As Communicators::Prepare makes them on this route: pinned to the first block count
      // (2), then a child for 4; per collective one communicator with kCommCtas channels.
      void* group = nullptr;
      void* comm = nullptr;
      if (libra::Status s = lib->InitRank(id, 2, rank, pinned ? 2 : nccl::kCommCtas, &group,
                                          10000);
          !s.ok()) {
        o.error = s.message;
        return;
      }
      comm = group;
      if (pinned) {
        if (libra::Status s = lib->Split(group, rank, 4, &comm, 10000); !s.ok()) {
          o.error = s.message;
          lib->Abort(group);
          return;
        }
      }
      auto check = [&](const libra::Status& s) {
        if (!s.ok()) o.error = s.message;
      };
      std::vector<float> a(8, 1.0f + rank), b(3, 10.0f * (rank + 1));
      std::vector<int32_t> c32(5, 100 + rank);
      check(lib->CollectiveGroup(libra::Collective::kAllReduce,
                                 {{a.data(), a.data(), a.size(), libra::DType::kF32},
                                  {b.data(), b.data(), b.size(), libra::DType::kF32},
                                  {c32.data(), c32.data(), c32.size(), libra::DType::kS32}},
                                 comm, 4, AsPointer(1), 10000));
      o.wrong += a[7] != 3.0f || b[2] != 30.0f || c32[4] != 201;
      std::vector<float> x(4, 1.0f + rank), x_out(2), y(2, 5.0f + rank), y_out(4);
      check(lib->CollectiveGroup(libra::Collective::kReduceScatter,
                                 {{x.data(), x_out.data(), 2, libra::DType::kF32}}, comm, 4,
                                 AsPointer(1), 10000));
      check(lib->CollectiveGroup(libra::Collective::kAllGather,
                                 {{y.data(), y_out.data(), 2, libra::DType::kF32}}, comm, 4,
                                 AsPointer(1), 10000));
      std::vector<double> in = {1.0 + rank, 2.0 + rank}, out(2);
      check(lib->CollectiveGroup(libra::Collective::kAllToAll,
                                 {{in.data(), out.data(), 1, libra::DType::kF64}}, comm, 4,
                                 AsPointer(1), 10000));
      o.wrong += x_out[1] != 3.0f || y_out[0] != 5.0f || y_out[3] != 6.0f;
      o.wrong += out[0] != 1.0 + rank || out[1] != 2.0 + rank;
      if (comm != group) lib->Destroy(comm);
      lib->Destroy(group);
    });
    for (const RankOutcome& o : outcomes) CHECK(o.error.empty() && o.wrong == 0);
    const std::string text = ReadFile(log);
    CHECK(text.find(c.launches) != std::string::npos);
    CHECK(text.find("hazard") == std::string::npos);
    if (pinned) {
      CHECK(text.find("init rank=0 nranks=2 minCTAs=2 maxCTAs=2 channels=2") !=
            std::string::npos);
      CHECK(text.find("minCTAs=4 maxCTAs=4 channels=4 share=1") != std::string::npos);
      CHECK(text.find("config=1") == std::string::npos);  // no *Config entry point
      for (const char* plain : {"allreduce rank=0 count=8 dtype=7 ctas=4 asked=0 config=0",
                                "reducescatter rank=0 count=2 dtype=7 ctas=4 asked=0 config=0",
                                "allgather rank=0 count=2 dtype=7 ctas=4 asked=0 config=0",
                                "alltoall rank=0 count=1 dtype=8 ctas=4 asked=0 config=0"}) {
        CHECK(text.find(plain) != std::string::npos);
      }
    } else {
      CHECK(text.find("allreduce rank=0 count=8 dtype=7 ctas=4 asked=4 config=1") !=
            std::string::npos);
      CHECK(text.find("config=0") == std::string::npos);
    }
    unsetenv("NCCL_STUB_LOG");
  }
  setenv("NCCL_STUB_VERSION", "23100", 1);
}

// The process's route is chosen when it first opens NCCL: a later forced request for the
// other route is refused by name (its communicators are the open route's), the same route or
// auto is the open library.
void TestOpenedRouteIsKept() {
  const nccl::Library* lib = nullptr;
  nccl::Communicators& comms = StubCommunicators(&lib);
  const bool per_call = lib->route() == nccl::CtaRoute::kPerCollective;
  const nccl::RouteRequest same = per_call ? nccl::RouteRequest::kPerCollective
                                           : nccl::RouteRequest::kPerCommunicator;
  const nccl::RouteRequest other = per_call ? nccl::RouteRequest::kPerCommunicator
                                            : nccl::RouteRequest::kPerCollective;
  const nccl::Library* again = nullptr;
  CHECK(comms.Open(stub_path, same, &again).ok() && again == lib);
  CHECK(comms.Open(stub_path, nccl::RouteRequest::kAuto, &again).ok() && again == lib);
  const libra::Status s = comms.Open(stub_path, other, &again);
  CHECK(s.code == libra::Status::Code::kFailedPrecondition && again == nullptr);
  CHECK(s.message.find(std::string("is already open on the ") + nccl::Name(lib->route()) +
                       " route") != std::string::npos);
}

// The all-to-all on two ranks through each route, as the stub's version picks it: 2.31 with
// a per-call limit (ncclAlltoAllConfig), 2.28 on the per-communicator route (ncclAlltoAll),
// 2.27 and 2.24 (no ncclAlltoAll: one group of ncclSend/ncclRecv with every rank). Rank s
// sends block d of its input to rank d, which keeps it as block s: f32 and bytes, one call and
// a bucket of two members (one NCCL group; the sends and receives nest in it). An all-to-all
// in place is refused by name before NCCL sees it.
void TestAllToAllRoutes() {
  struct Route {
    const char* version;
    bool direct;
    const char* seen;  // what the stub logs of the route's calls
  };
  const Route routes[] = {
      {"23100", true, "alltoall rank=0 count=3 dtype=7 ctas=4 asked=4 config=1"},
      {"22800", true, "alltoall rank=0 count=3 dtype=7 ctas=4 asked=0 config=0"},
      {"22700", false, "send rank=0 peer=1 count=3 dtype=7"},
      {"22400", false, "recv rank=1 peer=0 count=5 dtype=1"}};
  for (const Route& route : routes) {
    const std::string log = StubLog((std::string("alltoall_") + route.version + ".log").c_str());
    nccl::UniqueId id{};
    const std::unique_ptr<nccl::Library> lib = StubAt(route.version, &id);
    CHECK(lib->direct_all_to_all() == route.direct);
    const std::vector<RankOutcome> outcomes = OnTwoRanks([&](int rank, RankOutcome& o) {
      void* comm = nullptr;
      if (libra::Status s = lib->InitRank(id, 2, rank, 4, &comm, 10000); !s.ok()) {
        o.error = s.message;
        return;
      }
      // Input element i of rank r: 100 r + i; output block s of rank d: rank s's block d.
      std::vector<float> in(6), out(6, -1.0f);
      for (int i = 0; i < 6; ++i) in[i] = 100.0f * rank + i;
      std::size_t count = 0;  // per peer, from the full buffers (as the FFI handler sizes it)
      libra::Status s = nccl::CountOf(libra::Collective::kAllToAll, in.size(), out.size(), 2,
                                      &count);
      o.wrong += !s.ok() || count != 3;
      s = lib->Collective(libra::Collective::kAllToAll, in.data(), out.data(), count,
                          libra::DType::kF32, comm, 4, AsPointer(1), 10000);
      if (!s.ok()) o.error = s.message;
      for (int src = 0; src < 2; ++src) {
        for (int j = 0; j < 3; ++j) o.wrong += out[src * 3 + j] != 100.0f * src + rank * 3 + j;
      }
      // A bucket: bytes (5 per peer) and s64 (1 per peer), one group.
      std::vector<uint8_t> bytes(10), bytes_out(10);
      for (int i = 0; i < 10; ++i) bytes[i] = static_cast<uint8_t>(16 * rank + i);
      std::vector<int64_t> wide = {10 * rank, 10 * rank + 1}, wide_out(2, -1);
      s = lib->CollectiveGroup(libra::Collective::kAllToAll,
                               {{bytes.data(), bytes_out.data(), 5, libra::DType::kBytes},
                                {wide.data(), wide_out.data(), 1, libra::DType::kS64}},
                               comm, 4, AsPointer(1), 10000);
      if (!s.ok()) o.error = s.message;
      for (int src = 0; src < 2; ++src) {
        for (int j = 0; j < 5; ++j) o.wrong += bytes_out[src * 5 + j] != 16 * src + rank * 5 + j;
        o.wrong += wide_out[src] != 10 * src + rank;
      }
      // Never in place: refused before NCCL, naming the kind (nothing reaches the stub).
      s = lib->Collective(libra::Collective::kAllToAll, in.data(), in.data(), 3,
                          libra::DType::kF32, comm, 4, AsPointer(1), 10000);
      o.wrong += s.ok() || s.message.find("all-to-all is never in place") == std::string::npos;
      lib->Destroy(comm);
    });
    for (const RankOutcome& o : outcomes) {
      CHECK(o.error.empty());
      CHECK(o.wrong == 0);
    }
    const std::string text = ReadFile(log);
    CHECK(text.find(route.seen) != std::string::npos);
    CHECK((text.find("alltoall rank=") != std::string::npos) == route.direct);
    CHECK((text.find("send rank=") != std::string::npos) == !route.direct);
    CHECK(text.find("group rank=0 calls=2") != std::string::npos || !route.direct);
    CHECK(text.find("overlap") == std::string::npos && text.find("hazard") == std::string::npos);
    unsetenv("NCCL_STUB_LOG");
  }
  // Through the communicator cache, as the FFI handlers call it.
  nccl::Communicators& comms = CachedCommunicators(71);
  const std::vector<RankOutcome> outcomes = OnTwoRanks([&](int rank, RankOutcome& o) {
    std::vector<double> in = {1.0 + rank, 2.0 + rank}, out(2);
    const libra::Status s = comms.Call(libra::Collective::kAllToAll, 71, 2, rank, 2, in.data(),
                                       out.data(), 1, libra::DType::kF64, AsPointer(1), 10000);
    if (!s.ok()) o.error = s.message;
    o.wrong += out[0] != 1.0 + rank || out[1] != 2.0 + rank;
  });
  for (const RankOutcome& o : outcomes) CHECK(o.error.empty() && o.wrong == 0);
}

// Every rank must ask for the same CTA configuration: the stub refuses a communicator
// whose ranks disagree, as a mismatch NCCL would turn into a hang or a wrong channel count.
void TestSameConfigOnEveryRank() {
  nccl::UniqueId id{};
  const std::unique_ptr<nccl::Library> lib = StubAt("22400", &id);
  const std::vector<RankOutcome> outcomes = OnTwoRanks([&](int rank, RankOutcome& o) {
    void* comm = nullptr;
    const libra::Status s = lib->InitRank(id, 2, rank, rank == 0 ? 2 : 4, &comm, 10000);
    if (!s.ok()) o.error = s.message;
  });
  for (const RankOutcome& o : outcomes) CHECK(o.error.find("invalid usage") != std::string::npos);
  setenv("NCCL_STUB_VERSION", "23100", 1);
}

// 2.18-2.30: a group's communicators per block count are split from its first one with
// shared resources; the stub counts the channels whose buffers each adds (mem=): the
// largest count's, not the sum. A rank that never splits is kDeadlineExceeded, not a hang.
void TestSplitSharesResources() {
  const std::string log = StubLog("split.log");
  setenv("NCCL_STUB_VERSION", "22700", 1);
  std::unique_ptr<nccl::Library> lib;
  CHECK(nccl::Library::Open(stub_path, &lib).ok() && lib->splits());
  nccl::UniqueId id{};
  CHECK(lib->GetUniqueId(&id).ok());
  std::vector<RankOutcome> outcomes(2);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      void* parent = nullptr;
      libra::Status s = lib->InitRank(id, 2, rank, 4, &parent, 10000);
      std::vector<void*> children;
      for (int ctas : {2, 8, 1}) {
        void* child = nullptr;
        if (s.ok()) s = lib->Split(parent, rank, ctas, &child, 10000);
        children.push_back(child);
      }
      for (void* comm : children) {
        std::vector<float> data(4, 1.0f);
        if (s.ok()) s = lib->AllReduce(data.data(), data.data(), 4, libra::DType::kF32, comm, 0,
                                       AsPointer(7));
        if (s.ok() && data[3] != 2.0f) ++outcomes[rank].wrong;
      }
      if (!s.ok()) outcomes[rank].error = s.message;
      // Rank 1 never makes a fourth split: rank 0's times out.
      if (rank == 0 && s.ok()) {
        void* child = nullptr;
        const libra::Status late = lib->Split(parent, rank, 16, &child, 200);
        if (late.code != libra::Status::Code::kDeadlineExceeded) outcomes[0].error = "no timeout";
        if (late.message.find("splitting the communicator of rank 0 for 16 CTAs") ==
            std::string::npos) {
          outcomes[0].error = late.message;
        }
      }
      for (void* comm : children) lib->Abort(comm);
      lib->Abort(parent);
    });
  }
  for (std::thread& t : threads) t.join();
  for (const RankOutcome& o : outcomes) CHECK(o.error.empty() && o.wrong == 0);
  const std::string text = ReadFile(log);
  int mem = 0, shared = 0;
  for (std::size_t at = text.find(" mem="); at != std::string::npos;
       at = text.find(" mem=", at + 1)) {
    mem += std::atoi(text.c_str() + at + 5);
  }
  for (std::size_t at = text.find("share=1"); at != std::string::npos;
       at = text.find("share=1", at + 1)) {
    ++shared;
  }
  CHECK(shared == 2 * 3 + 1);  // every split shares (the late one of rank 0 too)
  CHECK(mem == 2 * 16 - 8);    // per rank: 4, +4 for 8 CTAs, 0, 0 for 1; rank 0: +8 for 16
  unsetenv("NCCL_STUB_LOG");
  setenv("NCCL_STUB_VERSION", "23100", 1);
}

// The watchdog (Communicators::Watch) on collectives that are enqueued, as on a GPU
// (NCCL_STUB_ASYNC=1: the stub runs them on a worker per stream). Events are the stub's
// stream counters: done when nothing is pending on the stream.
int (*stream_pending)(void*) = nullptr;

libra::StreamOps StubEventOps() {
  libra::StreamOps ops = FakeOps();
  ops.record = [](void* stream, void** event) {
    *event = stream;  // the stream stands for its event: done when it has nothing pending
    return libra::Status::Ok();
  };
  ops.query = [](void* event) { return stream_pending(event) == 0 ? 1 : 0; };
  ops.release = [](void*) {};
  return ops;
}

bool WaitUntilUnwatched(nccl::Communicators& comms) {
  for (int i = 0; i < 500 && comms.watched() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return comms.watched() == 0;
}

// Two ranks make communicator 42 and run an all-reduce on it: watched, it ends, nothing is
// aborted. On communicator 41 rank 1 never comes to the all-reduce that rank 0 enqueued:
// after the timeout the watchdog aborts rank 0's communicator (the "kernel" returns) and
// every later call on it is kDeadlineExceeded naming what happened, not a hang.
void TestWatchdog() {
  const std::string log = StubLog("watchdog.log");
  setenv("NCCL_STUB_ASYNC", "1", 1);
  void* stub = dlopen(stub_path.c_str(), RTLD_NOW);
  CHECK(stub != nullptr);
  stream_pending = reinterpret_cast<int (*)(void*)>(dlsym(stub, "ncclStubStreamPending"));
  CHECK(stream_pending != nullptr);
  const nccl::Library* lib = nullptr;
  nccl::Communicators& comms = StubCommunicators(&lib);
  nccl::UniqueId a{}, b{};
  CHECK(lib->GetUniqueId(&a).ok() && lib->GetUniqueId(&b).ok());
  CHECK(comms.RegisterId(41, a).ok() && comms.RegisterId(42, b).ok());
  const libra::StreamOps ops = StubEventOps();
  std::vector<RankOutcome> outcomes(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(8, 1.0f));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 2; ++rank) {
    threads.emplace_back([&, rank] {
      void* stream = AsPointer(0x50 + rank);
      libra::Status s = comms.Prepare(41, 2, rank, 2, 10000);
      if (s.ok()) s = comms.AllReduce(42, 2, rank, 2, data[rank].data(), data[rank].data(), 8,
                                      libra::DType::kF32, stream, 10000);
      if (s.ok()) s = comms.Watch(42, rank, stream, 5000, ops);
      if (!s.ok()) outcomes[rank].error = s.message;
    });
  }
  for (std::thread& t : threads) t.join();
  for (const RankOutcome& o : outcomes) CHECK(o.error.empty());
  CHECK(WaitUntilUnwatched(comms));
  CHECK(data[0][7] == 2.0f && data[1][7] == 2.0f);
  CHECK(ReadFile(log).find("abort") == std::string::npos);

  std::vector<float> lone(8, 1.0f);
  void* stream = AsPointer(0x60);
  CHECK(comms.AllReduce(41, 2, 0, 2, lone.data(), lone.data(), 8, libra::DType::kF32, stream,
                        300).ok());  // enqueued: returns at once
  CHECK(comms.Watch(41, 0, stream, 300, ops).ok());
  CHECK(WaitUntilUnwatched(comms));
  CHECK(ReadFile(log).find("abort rank=0") != std::string::npos);
  for (int call = 0; call < 2; ++call) {
    const libra::Status s = comms.AllReduce(41, 2, 0, 2, lone.data(), lone.data(), 8,
                                            libra::DType::kF32, stream, 300);
    CHECK(s.code == libra::Status::Code::kDeadlineExceeded);
    CHECK(s.message.find("did not end within 300 ms") != std::string::npos);
    CHECK(s.message.find("watchdog aborted") != std::string::npos);
  }
  for (int i = 0; i < 500 && stream_pending(stream) > 0; ++i) {  // the aborted "kernel" ended
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(stream_pending(stream) == 0);
  unsetenv("NCCL_STUB_ASYNC");
  unsetenv("NCCL_STUB_LOG");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: nccl_test <path of libnccl_stub.so>\n");
    return 2;
  }
  stub_path = argv[1];
  char dir[] = "/tmp/libra_nccl_test.XXXXXX";
  if (mkdtemp(dir) == nullptr) return 2;
  setenv("NCCL_STUB_DIR", dir, 1);
  const int status = libra_test::RunTests({
      {"versions", TestVersions},
      {"route_requests", TestRouteRequests},
      {"every_kind_has_its_launch", TestEveryKindHasItsLaunch},
      {"counts_by_kind", TestCountsByKind},
      {"open", TestOpen},
      {"cta_limits_reach_nccl", TestCtaLimitsReachNccl},
      {"communicators", TestCommunicatorsConcurrently},
      {"missing_rank_times_out", TestMissingRankTimesOut},
      {"side_streams", TestSideStreams},
      {"stale_starts_expire", TestStaleStartsExpire},
      {"launch_order", TestLaunchOrder},
      {"prepare_then_call", TestPrepareThenCall},
      {"same_config_on_every_rank", TestSameConfigOnEveryRank},
      {"split_shares_resources", TestSplitSharesResources},
      {"watchdog", TestWatchdog},
      {"grouped_call", TestGroupedCall},
      {"all_to_all_routes", TestAllToAllRoutes},
      {"forced_route", TestForcedPerCommunicatorRoute},
      {"opened_route_is_kept", TestOpenedRouteIsKept},
  });
  std::string cleanup = std::string("rm -rf ") + dir;
  if (std::system(cleanup.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir);
  return status;
}
