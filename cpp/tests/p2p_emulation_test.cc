// The P2P kernels' protocol (libra/cuda/protocol.h: the same functions the
// kernels run) emulated on the CPU: one std::thread per block per rank, each
// rank's streams as threads that run their calls in order, the flags as
// 32-bit words under the __atomic builtins (std::atomic's operations) with
// the kernels' acquire/release orders, the staging data as plain memory, so
// that ThreadSanitizer (CI's "thread" stage) finds any read of a peer's
// staging that the protocol does not order after its write. It checks the
// C++ memory model, not PTX's: the kernels' st.release.sys, fences and L2-only
// peer loads across GPUs need hardware.
//
// Sums are of s32 (wrapping, exact), so every element of every rank's output
// is checked against the sum of every rank's input.
//
// `p2p_emulation_test --shared-team` runs two streams per rank on one team
// (what the handler did before each stream had its own: it hangs until the
// timeout or gives wrong sums, with TSan reports); it reports, asserts nothing.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "libra/cuda/protocol.h"
#include "check.h"

namespace lc = libra::cuda;

namespace {

struct alignas(16) Vec {
  uint32_t w[4];
};
static_assert(sizeof(Vec) == lc::kVectorBytes);

// The host's memory operations for the protocol: a block is one thread that
// does the work of all kThreads lanes.
struct HostOps {
  using Vec = ::Vec;
  using Acc = ::Vec;
  static constexpr int kLanes = 1;
  static constexpr uint32_t kPollEvery = 16;  // spinning threads yield every spin

  int FirstLane() const { return 0; }
  void SyncBlock() const {}
  // The release store below orders this thread's earlier writes (C++'s model
  // has no separate fence for it here).
  void FenceSystem() const {}
  void Pause() const { std::this_thread::yield(); }
  void StoreRelease(uint32_t* p, uint32_t v) const { __atomic_store_n(p, v, __ATOMIC_RELEASE); }
  uint32_t LoadAcquire(const uint32_t* p) const { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
  uint64_t NowNs() const {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
  }
  Vec LoadInput(const Vec* p) const { return *p; }
  Vec LoadPeer(const Vec* p) const { return *p; }
  void Store(Vec* p, Vec v) const { *p = v; }
  uint32_t Load(const uint32_t* p) const { return *p; }
  void Store(uint32_t* p, uint32_t v) const { *p = v; }
  Acc Zero() const { return Vec{{0, 0, 0, 0}}; }
  void Add(Acc& acc, Vec v) const {
    for (int e = 0; e < 4; ++e) acc.w[e] += v.w[e];
  }
  Vec Finish(const Acc& acc) const { return acc; }
  uint32_t LoadCounter(uint32_t* c) const { return __atomic_load_n(&c[0], __ATOMIC_ACQUIRE); }
  bool ArriveDone(uint32_t* c, int blocks) const {
    if (__atomic_fetch_add(&c[1], 1u, __ATOMIC_ACQ_REL) != static_cast<uint32_t>(blocks) - 1) {
      return false;
    }
    __atomic_store_n(&c[1], 0u, __ATOMIC_RELAXED);
    return true;
  }
  void PublishRound(uint32_t* c, uint32_t round) const {
    __atomic_store_n(&c[0], round, __ATOMIC_RELEASE);
  }
  uint32_t ErrorCode(const lc::ErrorRecord* e) const {
    return __atomic_load_n(&e->code, __ATOMIC_ACQUIRE);
  }
  bool ClaimError(lc::ErrorRecord* e) const {
    uint32_t expected = 0;
    return __atomic_compare_exchange_n(&e->code, &expected, 2u, false, __ATOMIC_ACQ_REL,
                                       __ATOMIC_ACQUIRE);
  }
  void PublishError(lc::ErrorRecord* e) const { __atomic_store_n(&e->code, 1u, __ATOMIC_RELEASE); }
};

// A team's memory on the host, as Team::Allocate lays it out on the GPUs.
struct EmulatedTeam {
  EmulatedTeam(int n, std::size_t capacity_bytes, uint32_t first_round = 0)
      : nranks(n), capacity(lc::CapacityVectors(capacity_bytes, n)) {
    const std::size_t staging = 2 * (capacity + capacity / n);
    for (int r = 0; r < n; ++r) {
      staging_[r].assign(staging, Vec{});
      flags_[r].assign(lc::kFlagWords, 0);
      // Flags as if `first_round` rounds had run (the wrap-around check).
      for (std::size_t i = 0; i < 2 * lc::kMaxBlocks * lc::kMaxRanks; ++i) {
        flags_[r][i] = first_round;
      }
      counters_[r].assign(4, 0);
      counters_[r][0] = first_round;
    }
    std::memset(static_cast<void*>(&error), 0, sizeof error);
  }
  lc::TeamView View(int rank) {
    lc::TeamView v;
    v.nranks = nranks;
    v.rank = rank;
    v.capacity_vectors = capacity;
    for (int r = 0; r < nranks; ++r) {
      v.member[r].staging = staging_[r].data();
      v.member[r].flags = flags_[r].data();
      v.member[r].counters = counters_[r].data();
    }
    v.error = &error;
    return v;
  }
  bool Failed() const { return __atomic_load_n(&error.code, __ATOMIC_ACQUIRE) != 0; }
  // What Team::Failure says: the record's kind once it is written (code 1), else that it
  // is being written (its fields are the claimer's until then).
  std::string Failure() const {
    switch (__atomic_load_n(&error.code, __ATOMIC_ACQUIRE)) {
      case 0: return {};
      case 1: return error.kind == 1 ? "a peer in another call" : "timed out";
      default: return "being written";
    }
  }

  const int nranks;
  const std::size_t capacity;
  lc::ErrorRecord error;

 private:
  std::vector<Vec> staging_[lc::kMaxRanks];
  std::vector<uint32_t> flags_[lc::kMaxRanks];
  std::vector<uint32_t> counters_[lc::kMaxRanks];
};

// One rank's kernel: `blocks` threads running protocol::RankBody, joined
// (a kernel's end, as the next kernel on a stream sees it).
void RunKernel(const lc::RankCall& call) {
  std::vector<std::thread> blocks;
  for (int b = 0; b < call.blocks; ++b) {
    blocks.emplace_back([&call, b] {
      HostOps ops;
      volatile int aborted = 0;
      lc::protocol::RankBody<lc::kMaxRanks>(ops, call, b, &aborted);
    });
  }
  for (auto& t : blocks) t.join();
}

// The input of (call, rank, element word): distinct per call and rank.
uint32_t Input(int call, int rank, std::size_t i) {
  return static_cast<uint32_t>(call * 1000003u + rank * 7919u + i * 31u + 1u);
}

// One call of a program: its size in vectors, algorithm and block count, and
// its members' sizes (summing to `vectors`; none: one member), each its own
// buffer, every other one reduced in place.
struct Call {
  std::size_t vectors;
  lc::Algorithm algorithm;
  int blocks;
  std::vector<std::size_t> members = {};
};

// Runs `program` on `team` from rank `rank` in order, checking every output
// element; returns the wrong elements.
std::size_t RunProgram(EmulatedTeam& team, int rank, const std::vector<Call>& program,
                       int call_base, uint64_t timeout_ns) {
  std::size_t wrong = 0;
  for (std::size_t c = 0; c < program.size(); ++c) {
    const Call& call = program[c];
    const int id = call_base + static_cast<int>(c);
    const std::vector<std::size_t> sizes =
        call.members.empty() ? std::vector<std::size_t>{call.vectors} : call.members;
    std::vector<std::vector<Vec>> in(sizes.size()), out(sizes.size());
    std::vector<lc::Member> members(sizes.size());
    std::size_t at = 0;  // the member's first element word in the call
    for (std::size_t m = 0; m < sizes.size(); ++m) {
      in[m].resize(sizes[m]);
      for (std::size_t v = 0; v < sizes[m]; ++v) {
        for (int e = 0; e < 4; ++e) in[m][v].w[e] = Input(id, rank, at + v * 4 + e);
      }
      const bool in_place = m % 2 == 1;
      if (!in_place) out[m].resize(sizes[m]);
      members[m] = {in[m].data(), in_place ? in[m].data() : out[m].data(),
                    static_cast<uint32_t>(sizes[m]), 0};
      at += 4 * sizes[m];
    }
    RunKernel(lc::MakeRankCall(team.View(rank), call.algorithm, members.data(),
                               static_cast<int>(members.size()), call.blocks, timeout_ns,
                               lc::CallSignature(0, static_cast<uint32_t>(id))));
    at = 0;
    for (std::size_t m = 0; m < sizes.size(); ++m) {
      const Vec* result = static_cast<const Vec*>(members[m].output);
      for (std::size_t v = 0; v < sizes[m]; ++v) {
        for (int e = 0; e < 4; ++e) {
          uint32_t want = 0;
          for (int r = 0; r < team.nranks; ++r) want += Input(id, r, at + v * 4 + e);
          wrong += result[v].w[e] != want;
        }
      }
      at += 4 * sizes[m];
    }
  }
  return wrong;
}

// Every rank runs `program` on `team` at once; the wrong elements of all.
std::size_t RunTeam(EmulatedTeam& team, const std::vector<Call>& program, int call_base = 0,
                    uint64_t timeout_ns = 0) {
  std::vector<std::size_t> wrong(team.nranks, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < team.nranks; ++r) {
    ranks.emplace_back([&, r] { wrong[r] = RunProgram(team, r, program, call_base, timeout_ns); });
  }
  for (auto& t : ranks) t.join();
  std::size_t total = 0;
  for (std::size_t w : wrong) total += w;
  return total;
}

// A program of one-shot and two-shot calls alternating, with block counts
// changing between calls and sizes with tails: under one round, exactly one,
// one vector over, several rounds with a partial last, single vectors.
std::vector<Call> MixedProgram(std::size_t capacity) {
  const std::size_t sizes[] = {1, 3, capacity - 1, capacity, capacity + 1, 2 * capacity + 17,
                               5, 3 * capacity - 7, 777, 4 * lc::kThreads + 9};
  const int blocks[] = {1, 3, 2, 4, 1, 4, 2, 3, 4, 1};
  std::vector<Call> program;
  for (int i = 0; i < 10; ++i) {
    program.push_back({sizes[i], i % 2 ? lc::Algorithm::kTwoShot : lc::Algorithm::kOneShot,
                       blocks[i]});
  }
  program.push_back({2 * capacity, lc::Algorithm::kAuto, 4});
  return program;
}

constexpr std::size_t kCapacityBytes = std::size_t{4} * lc::kThreads * lc::kVectorBytes * 2;

void TestRanksAlgorithmsBlocksAndTails() {
  for (int n : {2, 4, 8}) {
    EmulatedTeam team(n, kCapacityBytes);
    std::vector<Call> program = MixedProgram(team.capacity);
    const std::vector<Call> once = program;
    for (int i = 0; i < 2; ++i) program.insert(program.end(), once.begin(), once.end());
    const std::size_t wrong = RunTeam(team, program);
    CHECK(wrong == 0);
    CHECK(!team.Failed());
    if (wrong) std::fprintf(stderr, "  %d ranks: %zu wrong elements\n", n, wrong);
  }
}

// A bucket's members in one call (the kernels' table, protocol::ForPieces):
// members within a round, members across rounds and segments, many small
// ones, empty ones, as many as a launch takes; one-shot and two-shot, block
// counts changing, calls of one buffer between them; every member its own
// buffer, every other one in place.
void TestMembersInOneCall() {
  for (int n : {2, 4, 8}) {
    EmulatedTeam team(n, kCapacityBytes);
    const std::size_t cap = team.capacity;
    const std::vector<std::size_t> across = {3, cap - 1, 0, cap + 5, 1, 2 * cap, 7};
    std::vector<std::size_t> many;
    for (int m = 0; m < lc::kMaxMembers; ++m) many.push_back(static_cast<std::size_t>(m % 7));
    const std::vector<std::size_t> segments = {cap / n - 1, 2, cap / n + 1, lc::kThreads + 3};
    std::vector<Call> program;
    for (const auto& members : {across, many, segments}) {
      std::size_t total = 0;
      for (std::size_t m : members) total += m;
      for (lc::Algorithm a : {lc::Algorithm::kOneShot, lc::Algorithm::kTwoShot}) {
        program.push_back({total, a, a == lc::Algorithm::kOneShot ? 3 : 2, members});
        program.push_back({cap + 1, a, 1});
      }
    }
    const std::size_t wrong = RunTeam(team, program);
    CHECK(wrong == 0);
    CHECK(!team.Failed());
    if (wrong) std::fprintf(stderr, "  %d ranks: %zu wrong elements\n", n, wrong);
  }
}

void TestManyRoundsAcrossTheCounterWrap() {
  // A small capacity: one call of 40 rounds, then calls of a few, with the
  // round counter starting just below 2^32 so that rounds wrap mid-call.
  for (int n : {2, 8}) {
    EmulatedTeam team(n, std::size_t{2} * lc::kThreads * lc::kVectorBytes, 0xFFFFFFF0u);
    std::vector<Call> program = {{40 * team.capacity + 3, lc::Algorithm::kTwoShot, 2},
                                 {5 * team.capacity, lc::Algorithm::kOneShot, 2},
                                 {7 * team.capacity - 1, lc::Algorithm::kTwoShot, 1}};
    CHECK(RunTeam(team, program) == 0);
    CHECK(!team.Failed());
  }
}

void TestSeveralTeamsInProgramOrder() {
  // Two teams over the same 4 ranks and one over ranks {0, 1}, their calls
  // interleaved in the same order on every rank (one stream each).
  EmulatedTeam a(4, kCapacityBytes), b(4, kCapacityBytes / 2), pair(2, kCapacityBytes);
  std::vector<std::size_t> wrong(4, 0);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] {
      for (int step = 0; step < 3; ++step) {
        wrong[r] += RunProgram(a, r, {{a.capacity + 5, lc::Algorithm::kTwoShot, 3}}, step, 0);
        if (r < 2) {
          wrong[r] += RunProgram(pair, r, {{900, lc::Algorithm::kOneShot, 2}}, 10 + step, 0);
        }
        wrong[r] += RunProgram(b, r, {{b.capacity * 2 + 1, lc::Algorithm::kOneShot, 4}},
                               20 + step, 0);
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (std::size_t w : wrong) CHECK(w == 0);
  CHECK(!a.Failed() && !b.Failed() && !pair.Failed());
}

// Two streams per rank (XLA's for synchronous calls, libra's for starts),
// both in flight at once; each stream gets the team the handler gives it
// (xla_ffi/cuda_collectives.cc: one per replica group and stream), or, with
// `shared`, one team for both (the defect: hangs or wrong sums).
std::size_t RunTwoStreams(int n, bool shared, uint64_t timeout_ns, bool* failed) {
  EmulatedTeam xla_team(n, kCapacityBytes), libra_team(n, kCapacityBytes);
  EmulatedTeam& second = shared ? xla_team : libra_team;
  const std::vector<Call> sync_calls = MixedProgram(xla_team.capacity);
  std::vector<Call> start_calls = MixedProgram(xla_team.capacity);
  std::reverse(start_calls.begin(), start_calls.end());
  std::vector<std::size_t> wrong(2 * n, 0);
  std::vector<std::thread> streams;
  for (int r = 0; r < n; ++r) {
    streams.emplace_back([&, r] { wrong[2 * r] = RunProgram(xla_team, r, sync_calls, 0, timeout_ns); });
    streams.emplace_back(
        [&, r] { wrong[2 * r + 1] = RunProgram(second, r, start_calls, 100, timeout_ns); });
  }
  for (auto& t : streams) t.join();
  *failed = xla_team.Failed() || second.Failed();
  std::size_t total = 0;
  for (std::size_t w : wrong) total += w;
  return total;
}

void TestTwoStreamsPerRankEachWithItsTeam() {
  for (int n : {2, 4, 8}) {
    bool failed = true;
    CHECK(RunTwoStreams(n, /*shared=*/false, 0, &failed) == 0);
    CHECK(!failed);
  }
}

// --- Abort and recovery ------------------------------------------------------
//
// The handler's per-call logic (lc::TeamSlot, which xla_ffi/cuda_collectives.cc's
// Launch calls) over emulated teams: which team generation serves a call's
// execution, or that the call fails; a team whose error record is set is
// failed and, for the executions that never met it, replaced.
class EmulatedRegistry {
 public:
  EmulatedRegistry(int n, std::size_t capacity_bytes) : n_(n), capacity_bytes_(capacity_bytes) {}

  // One call of execution `run` from `rank`. False where the call fails (XLA
  // ends the rank's execution there).
  bool Call(int64_t run, int rank, const Call& call, const Vec* in, Vec* out,
            uint64_t timeout_ns, int* generation) {
    std::shared_ptr<EmulatedTeam> team;
    uint32_t signature = 0;
    std::string message;
    const auto create = [this](std::string*) {
      return std::make_shared<EmulatedTeam>(n_, capacity_bytes_);
    };
    const auto failure = [this](const EmulatedTeam& t) {
      std::string why = t.Failure();
      if (!why.empty()) {
        std::lock_guard<std::mutex> lock(mu_);
        failures_.push_back(why);
      }
      return why;
    };
    const auto retire = [](EmulatedTeam&) {};
    if (slot_.Enter(run, rank, create, failure, retire, &team, &signature, &message) !=
        lc::TeamSlot<EmulatedTeam>::Outcome::kLaunch) {
      return false;
    }
    *generation = slot_.generation();
    RunKernel(lc::MakeRankCall(team->View(rank), call.algorithm, call.vectors * lc::kVectorBytes,
                               call.blocks, in, out, timeout_ns, signature));
    return true;
  }
  int generation() { return slot_.generation(); }
  std::vector<std::string> failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }

 private:
  const int n_;
  const std::size_t capacity_bytes_;
  lc::TeamSlot<EmulatedTeam> slot_;
  std::mutex mu_;
  std::vector<std::string> failures_;  // what each failed call found
};

// Executions 1..6 of a program of 3 calls on 4 ranks. In execution 2 rank 3
// never makes its call 1 (its execution failed before it) and ends there. Then
// either it goes on at once, and the others find its next execution's call in
// their call 1 (its signature), or it is away for `away` (longer than the
// timeout), and the others time out in call 1. Either way the team is dead;
// every execution that touched it fails, and every rank's next one runs on a
// fresh team, with right sums. Returns what the failed calls found.
// With `in_step`, every execution starts once every rank has ended the one
// before (a program that waits for each step's result); without, each rank
// runs its executions back to back (dispatch running ahead).
std::vector<std::string> AbortThenRecovery(uint64_t timeout_ns, std::chrono::milliseconds away,
                                           bool in_step) {
  const int n = 4;
  EmulatedRegistry registry(n, kCapacityBytes);
  std::mutex step_mu;
  std::condition_variable step_cv;
  int ended = 0;  // rank-executions ended
  const auto end_step = [&](int run) {
    std::unique_lock<std::mutex> lock(step_mu);
    ++ended;
    step_cv.notify_all();
    step_cv.wait(lock, [&] { return ended >= n * run; });
  };
  const std::vector<Call> program = {{700, lc::Algorithm::kOneShot, 2},
                                     {2 * lc::kThreads * 4 + 3, lc::Algorithm::kTwoShot, 3},
                                     {50, lc::Algorithm::kOneShot, 1}};
  constexpr int kRuns = 6;
  // Per rank and execution: 1 completed with right sums, 0 failed, -1 wrong sums.
  std::vector<std::vector<int>> outcome(n, std::vector<int>(kRuns + 1, 1));
  std::vector<std::vector<int>> generation(n, std::vector<int>(kRuns + 1, -1));
  std::vector<std::thread> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.emplace_back([&, r] {
      for (int run = 1; run <= kRuns; ++run) {
        for (uint32_t c = 0; c < program.size(); ++c) {
          if (run == 2 && r == 3 && c == 1) {
            outcome[r][run] = 0;
            std::this_thread::sleep_for(away);
            break;  // rank 3's execution 2 ends before its call 1
          }
          const Call& call = program[c];
          std::vector<Vec> in(call.vectors), out(call.vectors);
          const int id = run * 10 + static_cast<int>(c);
          for (std::size_t v = 0; v < call.vectors; ++v) {
            for (int e = 0; e < 4; ++e) in[v].w[e] = Input(id, r, v * 4 + e);
          }
          if (!registry.Call(run, r, call, in.data(), out.data(), timeout_ns,
                             &generation[r][run])) {
            outcome[r][run] = 0;
            break;
          }
          // The last call of an execution: its error would be the next call's.
          bool right = true;
          for (std::size_t v = 0; v < call.vectors && right; ++v) {
            for (int e = 0; e < 4; ++e) {
              uint32_t want = 0;
              for (int q = 0; q < n; ++q) want += Input(id, q, v * 4 + e);
              right = right && out[v].w[e] == want;
            }
          }
          if (!right && outcome[r][run] == 1) outcome[r][run] = -1;
        }
        if (in_step) end_step(run);
      }
    });
  }
  for (auto& t : ranks) t.join();
  CHECK(registry.generation() >= 1);  // the dead team was replaced
  for (int r = 0; r < n; ++r) {
    CHECK(outcome[r][1] == 1);  // before the failure
    CHECK(outcome[r][2] == 0);  // the failed execution fails on every rank
    // After it, every execution succeeds on every rank, on the same fresh team;
    // an execution that was in flight meanwhile may fail too, never be wrong.
    for (int run = 3; run <= kRuns; ++run) CHECK(outcome[r][run] != -1);
    CHECK(outcome[r][kRuns] == 1 && outcome[r][kRuns - 1] == 1);
    CHECK(generation[r][kRuns] == generation[0][kRuns] && generation[r][kRuns] >= 1);
    if (outcome[r][kRuns] != 1) std::fprintf(stderr, "  rank %d: last execution failed\n", r);
  }
  return registry.failures();
}

bool Found(const std::vector<std::string>& failures, const std::string& what) {
  return std::find(failures.begin(), failures.end(), what) != failures.end();
}

void TestAbortThenRecoveryOnEveryRank() {
  // 5 s: a peer in another call is found at once, long before the timeout.
  const std::vector<std::string> found = AbortThenRecovery(5'000'000'000, {}, false);
  CHECK(Found(found, "a peer in another call"));
  CHECK(!Found(found, "timed out"));
}

void TestTimeoutThenRecoveryOnEveryRank() {
  // Rank 3 away for 3 s, the others give up after 1 s; each execution waits for
  // the one before on every rank (later calls, with every rank there, are far from it).
  const std::vector<std::string> found =
      AbortThenRecovery(1'000'000'000, std::chrono::milliseconds(3000), true);
  CHECK(Found(found, "timed out"));
}

void TestTeamGenerations() {
  // The host's bookkeeping alone: executions 7 and 8 touched generation 0
  // before it failed; they fail on every later call; 9 gets generation 1.
  lc::TeamGenerations gens;
  int g = -1;
  std::string why;
  CHECK(gens.Enter(7, &g, &why) && g == 0);
  CHECK(gens.Enter(8, &g, &why) && g == 0);
  gens.Fail(0, "rank 1 timed out");
  CHECK(!gens.Enter(7, &g, &why) && why == "rank 1 timed out");
  CHECK(!gens.Enter(8, &g, &why));
  CHECK(gens.Enter(9, &g, &why) && g == 1);
  gens.Fail(0, "stale");  // a report about the old generation changes nothing
  CHECK(gens.Enter(9, &g, &why) && g == 1);
  CHECK(gens.Enter(10, &g, &why) && g == 1);
}

void TestCoResidencyBound() {
  lc::CoResidency bound;
  std::string why;
  CHECK(bound.Admit(0, /*stream=*/0, 64, 100, &why));
  CHECK(bound.Admit(0, 0, 64, 100, &why));  // the same stream: one after the other
  CHECK(bound.Admit(0, 1, 36, 100, &why));  // beside it: 64 + 36 fit
  CHECK(!bound.Admit(0, 1, 37, 100, &why));
  CHECK(why.find("exceed the 100 blocks") != std::string::npos);
  CHECK(bound.Admit(1, 1, 64, 100, &why));  // another GPU
  CHECK(!bound.Admit(0, 2, 1, 100, &why));  // a third stream: no room left
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--shared-team") {
    for (int i = 0; i < 5; ++i) {
      bool failed = false;
      const auto start = std::chrono::steady_clock::now();
      const std::size_t wrong = RunTwoStreams(4, /*shared=*/true, 2'000'000'000, &failed);
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      std::printf("shared team, 4 ranks x 2 streams: %zu wrong elements, %s, %.1f s\n", wrong,
                  failed ? "a rank gave up (timeout or another call)" : "no rank gave up", s);
    }
    return 0;
  }
  return libra_test::RunTests({
      {"ranks_algorithms_blocks_tails", TestRanksAlgorithmsBlocksAndTails},
      {"members_in_one_call", TestMembersInOneCall},
      {"many_rounds_counter_wrap", TestManyRoundsAcrossTheCounterWrap},
      {"several_teams", TestSeveralTeamsInProgramOrder},
      {"two_streams_per_rank", TestTwoStreamsPerRankEachWithItsTeam},
      {"team_generations", TestTeamGenerations},
      {"abort_then_recovery", TestAbortThenRecoveryOnEveryRank},
      {"timeout_then_recovery", TestTimeoutThenRecoveryOnEveryRank},
      {"co_residency_bound", TestCoResidencyBound},
  });
}
