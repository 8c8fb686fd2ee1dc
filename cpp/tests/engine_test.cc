// Unit tests of the framework-free engine (run under ASan and TSan in CI).
// A tiny harness: no test framework download at build time.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <memory>
#include <thread>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include "libra/engine.h"
#include "check.h"

namespace {

using libra::DType;

// Waits for n callbacks and records their statuses.
class Latch {
 public:
  explicit Latch(int n) : pending_(n) {}
  libra::DoneCallback Callback() {
    return [this](const libra::Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      statuses_.push_back(s);
      if (--pending_ == 0) cv_.notify_all();
    };
  }
  bool Wait(std::chrono::milliseconds limit = std::chrono::seconds(30)) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return pending_ == 0; });
  }
  std::vector<libra::Status> statuses() {
    std::lock_guard<std::mutex> lock(mu_);
    return statuses_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int pending_;
  std::vector<libra::Status> statuses_;
};


template <typename T>
void TestPlainSum(DType dtype, int n, std::size_t count, int blocks, bool in_place) {
  std::mt19937_64 rng(n * 1000 + count + blocks);
  std::vector<std::vector<T>> in(n, std::vector<T>(count));
  // Magnitudes 2^-20..2^20 apart, so that the sum's rounding depends on the order: only the
  // rank-order sum matches `expected` bit for bit.
  for (auto& v : in) {
    for (auto& x : v) {
      x = std::ldexp(static_cast<T>(static_cast<int64_t>(rng() % 2001) - 1000) / T(8),
                     static_cast<int>(rng() % 41) - 20);
    }
  }
  std::vector<T> expected(count);
  for (std::size_t i = 0; i < count; ++i) {
    T acc = T(0) + in[0][i];
    for (int r = 1; r < n; ++r) acc += in[r][i];
    expected[i] = acc;
  }
  std::vector<std::vector<T>> out(n, std::vector<T>(count));
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (int r = 0; r < n; ++r) {
    ins.push_back(in[r].data());
    outs.push_back(in_place ? static_cast<void*>(in[r].data()) : out[r].data());
  }
  libra::Status s = libra::AllReduce(dtype, ins, outs, count, blocks);
  CHECK(s.ok());
  for (int r = 0; r < n; ++r) {
    const T* got = static_cast<const T*>(outs[r]);
    CHECK(std::memcmp(got, expected.data(), count * sizeof(T)) == 0);
  }
}

void TestSums() {
  // Rank counts past 8 too (9, 11, 17): every count gives the rank-order sum.
  for (int n : {1, 2, 3, 5, 8, 9, 11, 17}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4097},
                              std::size_t{100003}}) {
      for (int blocks : {1, 2, 3, libra::kMaxBlocks}) {
        for (bool in_place : {false, true}) {
          TestPlainSum<float>(DType::kF32, n, count, blocks, in_place);
          TestPlainSum<double>(DType::kF64, n, count, blocks, in_place);
        }
      }
    }
  }
  // Outputs totalling kStreamingOutputBytes or more take streaming stores: the same bits.
  const std::size_t streamed = libra::kStreamingOutputBytes / (3 * sizeof(float)) + 21;
  for (bool in_place : {false, true}) TestPlainSum<float>(DType::kF32, 3, streamed, 2, in_place);
  TestPlainSum<int64_t>(DType::kS64, 2, libra::kStreamingOutputBytes / 16 + 3, 3, false);
  {
    // An output that is not 16-byte aligned takes plain stores, and one in place beside
    // others that are not: still the rank-order sum everywhere.
    const std::size_t count = streamed;
    std::vector<float> a(count, 1.5f), b(count, 2.25f), c(count, -0.75f);
    std::vector<float> oa(count + 1), ob(count + 1);
    std::vector<const void*> ins = {a.data(), b.data(), c.data()};
    for (int misaligned : {0, 1}) {
      std::vector<void*> outs = {oa.data() + misaligned, ob.data(), c.data()};
      CHECK(libra::AllReduce(DType::kF32, ins, outs, count, 2).ok());
      for (void* o : outs) {
        const float* got = static_cast<const float*>(o);
        CHECK(got[0] == 3.0f && got[count / 2] == 3.0f && got[count - 1] == 3.0f);
      }
      std::fill(c.begin(), c.end(), -0.75f);
    }
  }
  {
    // Large outputs in fresh mappings are populated before the stores (PopulateIfFresh):
    // one never touched, starting 64 bytes into its mapping as malloc's do, one whose first
    // pages were written (left to fault), one in place. The sum lands in all of them.
    const std::size_t count = streamed, bytes = count * sizeof(float) + 8192;
    std::vector<float> a(count, 1.5f), b(count, 2.25f), c(count, -0.75f);
    char* fresh[2];
    for (char*& m : fresh) {
      m = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                                  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      CHECK(m != MAP_FAILED);
    }
    std::memset(fresh[1], 0x7f, 3 * 4096);
    std::vector<const void*> ins = {a.data(), b.data(), c.data()};
    std::vector<void*> outs = {fresh[0] + 64, fresh[1] + 64, c.data()};
    CHECK(libra::AllReduce(DType::kF32, ins, outs, count, 3).ok());
    for (void* o : outs) {
      const float* got = static_cast<const float*>(o);
      bool all = true;
      for (std::size_t i = 0; i < count; ++i) all = all && got[i] == 3.0f;
      CHECK(all);
    }
    CHECK(a[0] == 1.5f && a[count - 1] == 1.5f && b[count - 1] == 2.25f);
    for (char* m : fresh) munmap(m, bytes);
  }
  // Integers wrap instead of overflowing.
  std::vector<int32_t> a = {INT32_MAX, -5}, b = {1, 3};
  std::vector<const void*> ins = {a.data(), b.data()};
  std::vector<void*> outs = {a.data(), b.data()};
  CHECK(libra::AllReduce(DType::kS32, ins, outs, 2, 1).ok());
  CHECK(a[0] == INT32_MIN && b[0] == INT32_MIN && a[1] == -2 && b[1] == -2);
  // The sum starts from +0, as XLA:CPU's: -0 + -0 gives +0.
  std::vector<float> z1 = {-0.0f}, z2 = {-0.0f};
  CHECK(libra::AllReduce(DType::kF32, {z1.data(), z2.data()}, {z1.data(), z2.data()}, 1, 1).ok());
  CHECK(!std::signbit(z1[0]));
}

uint16_t Bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

void TestSixteenBit() {
  // bf16: 1 + 2^-8 + 2^-8 accumulates in f32 (1 + 2^-7 exactly, representable).
  std::vector<uint16_t> a = {Bf16(1.0f)}, b = {Bf16(1.0f / 256)}, c = {Bf16(1.0f / 256)};
  std::vector<uint16_t> o1(1), o2(1), o3(1);
  CHECK(libra::AllReduce(DType::kBF16, {a.data(), b.data(), c.data()},
                         {o1.data(), o2.data(), o3.data()}, 1, 1).ok());
  CHECK(o1[0] == Bf16(1.0f + 1.0f / 128));
  // f16: rounding after every addition: 2048 + 1 = 2048 (ties to even), twice.
  const uint16_t h2048 = 0x6800, h1 = 0x3c00;
  std::vector<uint16_t> x = {h2048}, y = {h1}, z = {h1};
  CHECK(libra::AllReduce(DType::kF16, {x.data(), y.data(), z.data()},
                         {o1.data(), o2.data(), o3.data()}, 1, 1).ok());
  CHECK(o1[0] == h2048 && o3[0] == h2048);
  // f16 overflow to infinity, and subnormals survive.
  std::vector<uint16_t> big = {0x7bff}, sub = {0x0001};
  CHECK(libra::AllReduce(DType::kF16, {big.data(), big.data()}, {o1.data(), o2.data()}, 1, 1).ok());
  CHECK(o1[0] == 0x7c00);
  CHECK(libra::AllReduce(DType::kF16, {sub.data(), sub.data()}, {o1.data(), o2.data()}, 1, 1).ok());
  CHECK(o1[0] == 0x0002);
}

// Where two NaNs meet, the result is XLA's psum's (tests/test_allreduce.py measures XLA):
// the later rank's NaN for f32, f64 and bf16, the earlier rank's for f16. Both in a vector
// step and in the element-wise tail (19 elements: one step of 16, 3 left).
void TestWhichNaNWins() {
#if defined(__x86_64__)
  auto check_f32 = [](uint32_t first, uint32_t second, uint32_t want) {
    std::vector<uint32_t> a(19, first), b(19, second), o1(19), o2(19);
    CHECK(libra::AllReduce(DType::kF32, {a.data(), b.data()}, {o1.data(), o2.data()}, 19, 1).ok());
    for (uint32_t v : o2) CHECK(v == want);
  };
  check_f32(0x7fc00001, 0x7fc00002, 0x7fc00002);
  check_f32(0xffc00003, 0x7fc00001, 0x7fc00001);
  std::vector<uint64_t> d1(11, 0x7ff8000000000001), d2(11, 0x7ff8000000000002), q1(11), q2(11);
  CHECK(libra::AllReduce(DType::kF64, {d1.data(), d2.data()}, {q1.data(), q2.data()}, 11, 1).ok());
  for (uint64_t v : q1) CHECK(v == 0x7ff8000000000002);
  // 16-bit results keep only the sign of a NaN: bf16's is the later rank's, f16's the earlier.
  std::vector<uint16_t> neg(19, 0xffc3), pos(19, 0x7fc1), h1(19), h2(19);
  CHECK(libra::AllReduce(DType::kBF16, {neg.data(), pos.data()}, {h1.data(), h2.data()}, 19, 1).ok());
  for (uint16_t v : h1) CHECK(v == 0x7fc0);
  std::vector<uint16_t> hneg(19, 0xfe00), hpos(19, 0x7e00);
  CHECK(libra::AllReduce(DType::kF16, {hneg.data(), hpos.data()}, {h1.data(), h2.data()}, 19, 1).ok());
  for (uint16_t v : h1) CHECK(v == 0xfe00);
#endif
}

// The widths ReduceRange can sum with on this CPU (16 always, 32 with AVX2 and F16C).
std::vector<int> VectorWidths() {
  std::vector<int> widths = {16};
  const int initial = libra::ReduceVectorBytes();
  if (libra::SetReduceVectorBytes(32)) widths.push_back(32);
  CHECK(libra::SetReduceVectorBytes(initial));
  return widths;
}

// Each test of the sums' bits, at every vector width: the one XLA's tests see is the
// CPU's widest, so the others are checked here alone.
template <void (*Test)()>
void AtEveryWidth() {
  const int initial = libra::ReduceVectorBytes();
  for (int width : VectorWidths()) {
    CHECK(libra::SetReduceVectorBytes(width));
    Test();
  }
  CHECK(libra::SetReduceVectorBytes(initial));
}

// Arbitrary bit patterns and `specials` among them (NaN payloads of both signs, infinities,
// subnormals, -0), at both widths, with and without streaming stores: the same bytes in every
// output.
template <typename T>
void CompareWidths(DType dtype, const std::vector<T>& specials) {
  const int initial = libra::ReduceVectorBytes();
  const std::vector<int> widths = VectorWidths();
  std::mt19937_64 rng(static_cast<uint64_t>(dtype) + 7);
  for (int n : {1, 2, 3, 8}) {
    for (std::size_t count : {std::size_t{5}, std::size_t{67}, std::size_t{4099}}) {
      std::vector<std::vector<T>> in(n, std::vector<T>(count));
      for (auto& v : in) {
        for (auto& x : v) {
          x = rng() % 4 == 0 ? specials[rng() % specials.size()] : static_cast<T>(rng());
        }
      }
      std::vector<const void*> ins;
      for (auto& v : in) ins.push_back(v.data());
      std::vector<std::vector<std::vector<T>>> results;
      for (int width : widths) {
        CHECK(libra::SetReduceVectorBytes(width));
        for (bool stream : {false, true}) {
          // 64-byte aligned outputs, as XLA's are, so that streaming stores are taken.
          std::vector<std::vector<T>> out(n, std::vector<T>(count + 64));
          std::vector<void*> outs;
          for (auto& v : out) {
            void* p = v.data();
            std::size_t space = v.size() * sizeof(T);
            outs.push_back(std::align(64, count * sizeof(T), p, space));
          }
          libra::ReduceRange(dtype, ins.data(), outs.data(), n, 0, count, stream);
          std::vector<std::vector<T>> got;
          for (void* o : outs) {
            got.emplace_back(static_cast<const T*>(o), static_cast<const T*>(o) + count);
          }
          results.push_back(std::move(got));
        }
      }
      for (const auto& result : results) {
        for (int r = 0; r < n; ++r) CHECK(result[r] == results[0][0]);
      }
    }
  }
  CHECK(libra::SetReduceVectorBytes(initial));
}

void TestVectorWidths() {
  CHECK(!libra::SetReduceVectorBytes(8) && !libra::SetReduceVectorBytes(64));
  CompareWidths<uint32_t>(DType::kF32, {0x7fc00001u, 0xffc00002u, 0x7f800001u, 0x7f800000u,
                                        0xff800000u, 0x80000000u, 0x00000001u, 0x7f7fffffu});
  CompareWidths<uint64_t>(DType::kF64, {0x7ff8000000000003ull, 0xfff0000000000001ull,
                                        0x7ff0000000000000ull, 0x8000000000000000ull,
                                        0x0000000000000001ull});
  CompareWidths<uint32_t>(DType::kS32, {0x7fffffffu, 0x80000000u, 0xffffffffu});
  CompareWidths<uint64_t>(DType::kS64, {0x7fffffffffffffffull, 0x8000000000000000ull});
  // f16: quiet and signalling NaNs with payloads, infinities, the largest finite (sums
  // overflow), subnormals of both signs, -0, and values whose sums round (ties to even).
  CompareWidths<uint16_t>(DType::kF16, {0x7e01, 0xfe00, 0x7d00, 0xfc01, 0x7c00, 0xfc00, 0x7bff,
                                        0xfbff, 0x0001, 0x8001, 0x03ff, 0x8000, 0x6800, 0x3c00,
                                        0x0400});
  // bf16: NaNs of both signs with payloads (sums of them made canonical), infinities, the
  // largest finite, subnormals, -0, and sums that round (ties to even).
  CompareWidths<uint16_t>(DType::kBF16, {0x7fc1, 0xffc3, 0x7f81, 0x7f80, 0xff80, 0x7f7f,
                                         0xff7f, 0x0001, 0x8001, 0x8000, 0x3f80, 0x3b80,
                                         0x3b81});
  std::printf("  vector widths:");
  for (int width : VectorWidths()) std::printf(" %d", width);
  std::printf(" bytes\n");
}

void TestEffectiveBlocks() {
  CHECK(libra::EffectiveBlocks(0, DType::kF32, 8) == 0);
  CHECK(libra::EffectiveBlocks(256, DType::kF32, 8) == 1);            // 1 KiB
  CHECK(libra::EffectiveBlocks(1 << 20, DType::kF32, 8) == 8);        // 4 MiB
  CHECK(libra::EffectiveBlocks(1 << 20, DType::kF32, 3) == 3);
  CHECK(libra::EffectiveBlocks(8192, DType::kF32, 64) == 2);          // 32 KiB
}

void TestBadArguments() {
  std::vector<float> a(4), b(4);
  CHECK(!libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data(), b.data()}, 4, 0).ok());
  CHECK(!libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data(), b.data()}, 4,
                          libra::kMaxBlocks + 1).ok());
  CHECK(!libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data()}, 4, 1).ok());
}

libra::CallSpec Spec(int rank, int world, std::size_t count, int64_t run = 1) {
  libra::CallSpec spec;
  spec.rank = rank;
  spec.world = world;
  spec.count = count;
  spec.run_id = run;
  spec.blocks = 2;
  spec.timeout_ms = 20000;
  return spec;
}

// Rank `r` of `n` arrives at `site` with its buffers of every member of a bucket
// (in[m][r], out[m][r]: member m's), as one call of `kind` at `blocks`.
template <typename T>
void ArriveMembers(libra::Rendezvous& site, int r, int n, libra::Collective kind, DType dtype,
                   int blocks, const std::vector<libra::Member>& members,
                   std::vector<std::vector<std::vector<T>>>& in,
                   std::vector<std::vector<std::vector<T>>>& out, Latch& latch) {
  libra::CallSpec spec = Spec(r, n, 0);
  spec.collective = kind;
  spec.dtype = dtype;
  spec.blocks = blocks;
  spec.members = members;
  std::vector<const void*> ins;
  std::vector<void*> outs;
  for (std::size_t m = 0; m < members.size(); ++m) {
    ins.push_back(in[m][r].data());
    outs.push_back(out[m][r].data());
  }
  site.Arrive(spec, ins, outs, latch.Callback());
}

// Many threads arrive in random order, over several rounds (loop iterations)
// and runs: every round pairs the right buffers.
void TestRendezvousRounds() {
  constexpr int kWorld = 6, kIters = 20, kCount = 5000;
  libra::Rendezvous site("rounds");
  for (int64_t run = 1; run <= 3; ++run) {
    std::vector<std::vector<float>> data(kWorld * kIters, std::vector<float>(kCount));
    for (int r = 0; r < kWorld; ++r)
      for (int it = 0; it < kIters; ++it)
        for (auto& x : data[r * kIters + it]) x = static_cast<float>(r + 100 * it);
    Latch latch(kWorld * kIters);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        for (int it = 0; it < kIters; ++it) {
          float* buf = data[r * kIters + it].data();
          site.Arrive(Spec(r, kWorld, kCount, run), buf, buf, latch.Callback());
          if ((r + it) % 3 == 0) std::this_thread::yield();
        }
      });
    }
    for (auto& t : threads) t.join();
    CHECK(latch.Wait());
    for (auto& s : latch.statuses()) CHECK(s.ok());
    for (int r = 0; r < kWorld; ++r)
      for (int it = 0; it < kIters; ++it)
        CHECK(data[r * kIters + it][kCount - 1] == 15.0f + 600.0f * it);
  }
}

// reduce_on_caller: the last arrival reduces on its own thread; with one block its callback
// has run when Arrive returns, on that thread, and everyone else's through the pool.
void TestReduceOnCaller() {
  for (int blocks : {1, 4}) {
    constexpr int kWorld = 3;
    constexpr std::size_t kCount = 1 << 16;  // 256 KiB: up to 4 tasks
    libra::Rendezvous site("caller");
    std::vector<std::vector<float>> data(kWorld, std::vector<float>(kCount));
    for (int r = 0; r < kWorld; ++r) std::fill(data[r].begin(), data[r].end(), float(r + 1));
    Latch latch(kWorld - 1);
    // Written by whichever thread completes the caller (CHECK is not thread-safe), read
    // after own_done.
    std::atomic<bool> own_done{false};
    bool own_ok = false;
    std::thread::id own_thread;
    for (int r = 0; r < kWorld; ++r) {
      libra::CallSpec spec = Spec(r, kWorld, kCount);
      spec.blocks = blocks;
      spec.reduce_on_caller = true;
      libra::DoneCallback done = latch.Callback();
      if (r == kWorld - 1) {
        done = [&](const libra::Status& s) {
          own_ok = s.ok();
          own_thread = std::this_thread::get_id();
          own_done.store(true);
        };
      }
      site.Arrive(spec, data[r].data(), data[r].data(), std::move(done));
    }
    CHECK(latch.Wait());
    for (auto& s : latch.statuses()) CHECK(s.ok());
    if (blocks == 1) CHECK(own_done.load() && own_thread == std::this_thread::get_id());
    for (int i = 0; i < 200 && !own_done.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK(own_done.load() && own_ok);
    for (auto& v : data) CHECK(v.front() == 6.0f && v.back() == 6.0f);
  }
}

// What callbacks that wait for each other share; held by each callback, so that a failing
// test (one timed out) leaves nothing dangling.
struct WaitingCallbacks {
  std::mutex mu;
  std::condition_variable cv;
  int started = 0, met = 0, finished = 0;
  bool last_done = false;
};

// Callbacks run back to back on the thread that finished the reduction, but one that waits
// (a continuation waiting for another device) does not hold the others up: here each waits
// until all of them have started, which only a helper taking the next one allows.
void TestCallbacksThatWait() {
  constexpr int kWorld = 8;
  constexpr std::size_t kCount = 1 << 14;
  libra::Rendezvous site("waiting callbacks");
  auto data = std::make_shared<std::vector<std::vector<float>>>(
      kWorld, std::vector<float>(kCount, 1.0f));
  auto shared = std::make_shared<WaitingCallbacks>();
  for (int r = 0; r < kWorld; ++r) {
    site.Arrive(Spec(r, kWorld, kCount), (*data)[r].data(), (*data)[r].data(),
                [shared, data](const libra::Status& status) {
                  std::unique_lock<std::mutex> lock(shared->mu);
                  ++shared->started;
                  shared->cv.notify_all();
                  if (shared->cv.wait_for(lock, std::chrono::seconds(5),
                                          [&] { return shared->started == kWorld; }) &&
                      status.ok()) {
                    ++shared->met;
                  }
                  ++shared->finished;
                  shared->cv.notify_all();
                });
  }
  std::unique_lock<std::mutex> lock(shared->mu);
  CHECK(shared->cv.wait_for(lock, std::chrono::seconds(60),
                            [&] { return shared->finished == kWorld; }));
  CHECK(shared->met == kWorld);
  for (auto& v : *data) CHECK(v.front() == 8.0f && v.back() == 8.0f);
}

// A reduce thread that runs callbacks is released from the pool's count: with as many
// callbacks waiting as the pool has threads, a further all-reduce (the one they wait for)
// still gets a thread and completes.
void TestReduceThreadsReleased() {
  libra::Rendezvous site("released");
  constexpr int kHeld = libra::kMaxBlocks;
  auto data = std::make_shared<std::vector<std::vector<float>>>(kHeld + 1,
                                                                std::vector<float>(16, 1.0f));
  auto shared = std::make_shared<WaitingCallbacks>();
  libra::CallSpec spec = Spec(0, 1, 16);
  spec.blocks = 1;
  for (int i = 0; i < kHeld; ++i) {
    site.Arrive(spec, (*data)[i].data(), (*data)[i].data(), [shared, data](const libra::Status&) {
      std::unique_lock<std::mutex> lock(shared->mu);
      // 60 s: on a loaded 2-core VM (Bazel's test beside the Python suite) 20 s ran out.
      if (shared->cv.wait_for(lock, std::chrono::seconds(60), [&] { return shared->last_done; })) {
        ++shared->met;
      }
      ++shared->finished;
      shared->cv.notify_all();
    });
  }
  site.Arrive(spec, (*data)[kHeld].data(), (*data)[kHeld].data(),
              [shared, data](const libra::Status&) {
                std::lock_guard<std::mutex> lock(shared->mu);
                shared->last_done = true;
                shared->cv.notify_all();
              });
  std::unique_lock<std::mutex> lock(shared->mu);
  CHECK(shared->cv.wait_for(lock, std::chrono::seconds(120),
                            [&] { return shared->finished == kHeld; }));
  CHECK(shared->last_done && shared->met == kHeld);
}

// A rank that never arrives: the others fail with a message naming it, late
// arrivals are turned away, and the next run works.
void TestTimeout() {
  libra::Rendezvous site("timeout");
  std::vector<float> a(10, 1.0f), b(10, 2.0f), c(10, 3.0f);
  Latch latch(2);
  libra::CallSpec s0 = Spec(0, 3, 10), s1 = Spec(1, 3, 10);
  s0.timeout_ms = s1.timeout_ms = 200;
  site.Arrive(s0, a.data(), a.data(), latch.Callback());
  site.Arrive(s1, b.data(), b.data(), latch.Callback());
  CHECK(latch.Wait(std::chrono::seconds(10)));
  for (auto& st : latch.statuses()) {
    CHECK(st.code == libra::Status::Code::kDeadlineExceeded);
    CHECK(st.message.find("waiting for ranks [2] of 3") != std::string::npos);
  }
  Latch late(1);
  libra::CallSpec s2 = Spec(2, 3, 10);
  site.Arrive(s2, c.data(), c.data(), late.Callback());
  CHECK(late.Wait());
  CHECK(late.statuses()[0].code == libra::Status::Code::kDeadlineExceeded);
  CHECK(late.statuses()[0].message.find("already failed") != std::string::npos);

  Latch next(3);
  site.Arrive(Spec(0, 3, 10, 2), a.data(), a.data(), next.Callback());
  site.Arrive(Spec(2, 3, 10, 2), c.data(), c.data(), next.Callback());
  site.Arrive(Spec(1, 3, 10, 2), b.data(), b.data(), next.Callback());
  CHECK(next.Wait());
  for (auto& st : next.statuses()) CHECK(st.ok());
  CHECK(a[0] == 6.0f && b[9] == 6.0f && c[5] == 6.0f);

  // The watchdog sleeps to the earliest deadline and is woken only for an earlier one: a
  // round with a short timeout, registered while it sleeps to a long one, still expires on
  // time; the long one then completes.
  libra::Rendezvous slow("slow"), quick("quick");
  Latch long_round(2), short_round(1);
  libra::CallSpec l0 = Spec(0, 2, 10), l1 = Spec(1, 2, 10), q0 = Spec(0, 2, 10);
  l0.timeout_ms = l1.timeout_ms = 600000;
  q0.timeout_ms = 200;
  slow.Arrive(l0, a.data(), a.data(), long_round.Callback());
  std::this_thread::sleep_for(std::chrono::milliseconds(20));  // Asleep to the long deadline.
  quick.Arrive(q0, c.data(), c.data(), short_round.Callback());
  CHECK(short_round.Wait(std::chrono::seconds(10)));
  CHECK(short_round.statuses()[0].code == libra::Status::Code::kDeadlineExceeded);
  slow.Arrive(l1, b.data(), b.data(), long_round.Callback());
  CHECK(long_round.Wait());
  for (auto& st : long_round.statuses()) CHECK(st.ok());
}

void TestMismatch() {
  libra::Rendezvous site("mismatch");
  std::vector<float> a(10), b(20);
  Latch latch(2);
  site.Arrive(Spec(0, 2, 10), a.data(), a.data(), latch.Callback());
  site.Arrive(Spec(1, 2, 20), b.data(), b.data(), latch.Callback());
  CHECK(latch.Wait());
  for (auto& st : latch.statuses()) {
    CHECK(st.code == libra::Status::Code::kInvalidArgument);
    CHECK(st.message.find("disagree") != std::string::npos);
  }
  Latch bad(1);
  site.Arrive(Spec(5, 2, 10), a.data(), a.data(), bad.Callback());
  CHECK(bad.Wait());
  CHECK(bad.statuses()[0].message.find("rank 5 is outside [0, 2)") != std::string::npos);
}

// Destroying a site with a pending round cancels it instead of leaking.
void TestDestroyPending() {
  std::vector<float> a(10);
  Latch latch(1);
  {
    libra::Rendezvous site("destroyed");
    site.Arrive(Spec(0, 2, 10), a.data(), a.data(), latch.Callback());
  }
  CHECK(latch.Wait());
  CHECK(latch.statuses()[0].code == libra::Status::Code::kCancelled);
}

// The pools keep working in a fork child, and in the parent afterwards.
void TestFork() {
  std::vector<float> a(100000, 1.0f), b(100000, 2.0f);
  CHECK(libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data(), b.data()}, a.size(), 4).ok());
  pid_t pid = fork();
  if (pid == 0) {
    std::vector<float> x(100000, 1.0f), y(100000, 2.0f);
    libra::Status s = libra::AllReduce(DType::kF32, {x.data(), y.data()}, {x.data(), y.data()}, x.size(), 4);
    _exit(s.ok() && x[99999] == 3.0f ? 0 : 1);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  CHECK(libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data(), b.data()}, a.size(), 4).ok());
  CHECK(a[0] == 6.0f);
}

// A buffer of `count` doubles per rank whose rank-order sum depends on the order (as
// TestPlainSum's), and the all-reduce's result: reduce-scatter shards must be its slices.
std::vector<std::vector<double>> OrderSensitive(int n, std::size_t count, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<double>> in(n, std::vector<double>(count));
  for (auto& v : in) {
    for (auto& x : v) {
      x = std::ldexp(static_cast<double>(static_cast<int64_t>(rng() % 2001) - 1000) / 8.0,
                     static_cast<int>(rng() % 81) - 40);
    }
  }
  return in;
}

// Reduce-scatter over [outer][world][segment] layouts: shard r is rows r of the all-reduce's
// result, bit for bit, and nothing outside each rank's exactly sized output is written
// (ASan would see it). All-gather: every output is the shards interleaved the same way.
void TestReduceScatterAndAllGather() {
  for (int n : {1, 2, 3, 8, 9}) {
    for (auto [outer, segment] : {std::pair<std::size_t, std::size_t>{1, 0}, {1, 1}, {1, 7},
                                  {1, 4099}, {3, 1}, {5, 17}, {2, 20000}}) {
      for (int blocks : {1, 3, libra::kMaxBlocks}) {
        const std::size_t count = outer * n * segment, shard = outer * segment;
        auto in = OrderSensitive(n, count, n * 7919 + count + blocks);
        std::vector<std::vector<double>> sum(n, std::vector<double>(count));
        std::vector<const void*> ins;
        std::vector<void*> sums;
        for (int r = 0; r < n; ++r) {
          ins.push_back(in[r].data());
          sums.push_back(sum[r].data());
        }
        CHECK(libra::AllReduce(DType::kF64, ins, sums, count, 1).ok());
        std::vector<std::vector<double>> out(n, std::vector<double>(shard, -1.0));
        std::vector<void*> outs;
        for (auto& o : out) outs.push_back(o.data());
        CHECK(libra::RunCollective(libra::Collective::kReduceScatter, DType::kF64, ins, outs,
                                   count, segment, blocks).ok());
        for (int r = 0; r < n; ++r) {
          for (std::size_t row = 0; row < outer; ++row) {
            CHECK(std::memcmp(out[r].data() + row * segment,
                              sum[0].data() + (row * n + r) * segment,
                              segment * sizeof(double)) == 0);
          }
        }
        // Gathering the shards back gives the sum on every rank, as raw bytes too.
        for (DType dtype : {DType::kF64, DType::kBytes}) {
          const std::size_t scale = dtype == DType::kBytes ? sizeof(double) : 1;
          std::vector<std::vector<double>> gathered(n, std::vector<double>(count, -1.0));
          std::vector<const void*> shards;
          std::vector<void*> full;
          for (int r = 0; r < n; ++r) {
            shards.push_back(out[r].data());
            full.push_back(gathered[r].data());
          }
          CHECK(libra::RunCollective(libra::Collective::kAllGather, dtype, shards, full,
                                     count * scale, segment * scale, blocks).ok());
          for (int r = 0; r < n; ++r) {
            CHECK(std::memcmp(gathered[r].data(), sum[0].data(), count * sizeof(double)) == 0);
          }
        }
      }
    }
  }
  // Every summed dtype's kernel serves a reduce-scatter's runs, at both vector widths: f32
  // and bf16 shards against the all-reduce's (odd segments: element-wise tails and starts).
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kS32, DType::kS64}) {
    const int n = 4;
    const std::size_t segment = 1031, count = 2 * n * segment, esize = libra::SizeOf(dtype);
    std::mt19937 rng(static_cast<unsigned>(dtype) + 1);
    std::vector<std::vector<unsigned char>> in(n, std::vector<unsigned char>(count * esize));
    for (auto& v : in) {
      for (std::size_t i = 0; i < v.size(); i += 2) v[i] = rng() & 0xff, v[i + 1] = rng() & 0x3f;
    }
    std::vector<std::vector<unsigned char>> sum(n, std::vector<unsigned char>(count * esize));
    std::vector<std::vector<unsigned char>> out(n, std::vector<unsigned char>(count / n * esize));
    std::vector<const void*> ins;
    std::vector<void*> sums, outs;
    for (int r = 0; r < n; ++r) {
      ins.push_back(in[r].data());
      sums.push_back(sum[r].data());
      outs.push_back(out[r].data());
    }
    CHECK(libra::AllReduce(dtype, ins, sums, count, 2).ok());
    CHECK(libra::RunCollective(libra::Collective::kReduceScatter, dtype, ins, outs, count,
                               segment, 2).ok());
    for (int r = 0; r < n; ++r) {
      for (std::size_t row = 0; row < 2; ++row) {
        CHECK(std::memcmp(out[r].data() + row * segment * esize,
                          sum[0].data() + (row * n + r) * segment * esize,
                          segment * esize) == 0);
      }
    }
  }
}

// A call with several members (a bucket's buffers, each where its caller keeps it) gives each
// member, bit for bit, what a call of that member alone gives, for every kind: members of odd
// sizes (pieces cross their boundaries), an empty one, sharded ones with their own segments
// and rows; every rank arrives with its own pointers, in random order.
void TestMembers() {
  const int n = 3;
  // (count, segment) of each member; a sharded kind's count is rows * n * segment.
  const std::vector<libra::Member> shapes = {{n * 5, 5}, {0, 0}, {2 * n * 4099, 4099},
                                             {n * 1, 1}, {n * 20000, 20000}};
  for (libra::Collective kind : {libra::Collective::kAllReduce, libra::Collective::kReduceScatter,
                                 libra::Collective::kAllGather, libra::Collective::kAllToAll}) {
    const bool shard_in = libra::LayoutOf(kind).shard_in, shard_out = libra::LayoutOf(kind).shard_out;
    for (int blocks : {1, 3, libra::kMaxBlocks}) {
      std::vector<libra::Member> members = shapes;
      if (kind == libra::Collective::kAllReduce) {
        for (auto& m : members) m.segment = 0;
      }
      // in[m][r], out[m][r]: rank r's buffers of member m; expected[m][r] from m's own call.
      std::vector<std::vector<std::vector<double>>> in, out, expected;
      for (std::size_t m = 0; m < members.size(); ++m) {
        const std::size_t full = members[m].count;
        in.push_back(OrderSensitive(n, shard_in ? full / n : full, 31 * m + blocks));
        out.emplace_back(n, std::vector<double>(shard_out ? full / n : full, -1.0));
        expected.push_back(out.back());
        std::vector<const void*> ins;
        std::vector<void*> outs;
        for (int r = 0; r < n; ++r) {
          ins.push_back(in[m][r].data());
          outs.push_back(expected[m][r].data());
        }
        CHECK(libra::RunCollective(kind, DType::kF64, ins, outs, full, members[m].segment, 1)
                  .ok());
      }
      libra::Rendezvous site("members");
      Latch latch(n);
      std::vector<int> order = {2, 0, 1};
      for (int r : order) {
        ArriveMembers(site, r, n, kind, DType::kF64, blocks, members, in, out, latch);
      }
      CHECK(latch.Wait());
      for (const auto& status : latch.statuses()) CHECK(status.ok());
      for (std::size_t m = 0; m < members.size(); ++m) {
        for (int r = 0; r < n; ++r) {
          CHECK(out[m][r].empty() ||
                std::memcmp(out[m][r].data(), expected[m][r].data(),
                            out[m][r].size() * sizeof(double)) == 0);
        }
      }
    }
  }
  // Ranks that bring other members, or not one buffer per member, are told so.
  libra::Rendezvous site("members-mismatch");
  std::vector<double> a(8), b(8), c(8);
  Latch latch(2);
  libra::CallSpec s0 = Spec(0, 2, 0), s1 = Spec(1, 2, 0);
  s0.members = {{4, 0}, {4, 0}};
  s1.members = {{2, 0}, {6, 0}};
  site.Arrive(s0, {a.data(), a.data() + 4}, {a.data(), a.data() + 4}, latch.Callback());
  site.Arrive(s1, {b.data(), b.data() + 2}, {b.data(), b.data() + 2}, latch.Callback());
  CHECK(latch.Wait());
  for (const auto& status : latch.statuses()) {
    CHECK(!status.ok() && status.message.find("member 0") != std::string::npos);
  }
  Latch one(1);
  site.Arrive(s0, {c.data()}, {c.data()}, one.Callback());
  CHECK(one.Wait());
  CHECK(!one.statuses()[0].ok() &&
        one.statuses()[0].message.find("one of each per member") != std::string::npos);
}

// Calls large enough for streaming stores (>= kStreamingOutputBytes written): the same bits.
void TestLargeShardedCalls() {
  const int n = 2;
  const std::size_t count = libra::kStreamingOutputBytes / sizeof(float) + 32;  // unaligned
  std::vector<std::vector<float>> in(n, std::vector<float>(count));
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < count; ++i) in[r][i] = static_cast<float>(i % 1000) * (r + 1);
  }
  std::vector<std::vector<float>> out(n, std::vector<float>(count / n));
  std::vector<const void*> ins{in[0].data(), in[1].data()};
  std::vector<void*> outs{out[0].data(), out[1].data()};
  CHECK(libra::RunCollective(libra::Collective::kReduceScatter, DType::kF32, ins, outs, count, 0,
                             4).ok());
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < count / n; i += 997) {
      CHECK(out[r][i] == static_cast<float>((r * count / n + i) % 1000) * 3.0f);
    }
  }
  std::vector<std::vector<float>> full(n, std::vector<float>(count));
  std::vector<const void*> shards{out[0].data(), out[1].data()};
  std::vector<void*> fulls{full[0].data(), full[1].data()};
  CHECK(libra::RunCollective(libra::Collective::kAllGather, DType::kF32, shards, fulls, count, 0,
                             4).ok());
  for (int r = 0; r < n; ++r) {
    for (std::size_t i = 0; i < count; i += 997) {
      CHECK(full[r][i] == static_cast<float>(i % 1000) * 3.0f);
    }
  }
}

void TestShardedBadArguments() {
  std::vector<float> a(6), b(6);
  std::vector<const void*> ins{a.data(), b.data()};
  std::vector<void*> outs{a.data(), b.data()};
  // 7 elements are not whole shards of 2 ranks; 6 are not of 2 x 2-element runs (8 per row).
  libra::Status s = libra::RunCollective(libra::Collective::kReduceScatter, DType::kF32, ins,
                                         outs, 7, 0, 1);
  CHECK(!s.ok() && s.message.find("not whole shards") != std::string::npos);
  CHECK(!libra::RunCollective(libra::Collective::kAllGather, DType::kF32, ins, outs, 6, 2, 1).ok());
  s = libra::RunCollective(libra::Collective::kReduceScatter, DType::kBytes, ins, outs, 8, 0, 1);
  CHECK(!s.ok() && s.message.find("raw bytes") != std::string::npos);
  CHECK(!libra::RunCollective(static_cast<libra::Collective>(7), DType::kF32, ins, outs, 4, 0, 1)
             .ok());
  CHECK(std::string(libra::Name(libra::Collective::kReduceScatter)) == "reduce-scatter");
}

// A missing participant of a reduce-scatter: the others fail naming it and the kind, and
// the next run works. Participants that disagree on the kind are a mismatch.
void TestShardedTimeoutAndMismatch() {
  libra::Rendezvous site("sharded");
  std::vector<float> a(6, 1.0f), b(6, 2.0f), c(6, 3.0f), oa(2), ob(2), oc(2);
  Latch latch(2);
  libra::CallSpec s0 = Spec(0, 3, 6), s1 = Spec(1, 3, 6);
  s0.collective = s1.collective = libra::Collective::kReduceScatter;
  s0.timeout_ms = s1.timeout_ms = 200;
  site.Arrive(s0, a.data(), oa.data(), latch.Callback());
  site.Arrive(s1, b.data(), ob.data(), latch.Callback());
  CHECK(latch.Wait(std::chrono::seconds(10)));
  for (auto& st : latch.statuses()) {
    CHECK(st.code == libra::Status::Code::kDeadlineExceeded);
    CHECK(st.message.find("reduce-scatter 'sharded' timed out") != std::string::npos);
    CHECK(st.message.find("waiting for ranks [2] of 3") != std::string::npos);
  }
  Latch next(3);
  for (int r : {2, 0, 1}) {
    libra::CallSpec spec = Spec(r, 3, 6, 2);
    spec.collective = libra::Collective::kReduceScatter;
    std::vector<float>* in[] = {&a, &b, &c};
    std::vector<float>* out[] = {&oa, &ob, &oc};
    site.Arrive(spec, in[r]->data(), out[r]->data(), next.Callback());
  }
  CHECK(next.Wait());
  for (auto& st : next.statuses()) CHECK(st.ok());
  CHECK(oa[0] == 6.0f && ob[1] == 6.0f && oc[0] == 6.0f);

  libra::Rendezvous other("kinds");
  Latch mixed(2);
  libra::CallSpec g = Spec(0, 2, 6);
  g.collective = libra::Collective::kAllGather;
  other.Arrive(g, oa.data(), a.data(), mixed.Callback());
  other.Arrive(Spec(1, 2, 6), b.data(), b.data(), mixed.Callback());
  CHECK(mixed.Wait());
  for (auto& st : mixed.statuses()) {
    CHECK(st.code == libra::Status::Code::kInvalidArgument);
    CHECK(st.message.find("disagree") != std::string::npos);
    CHECK(st.message.find("all-gather") != std::string::npos);
  }
}

// In place, as the start/done pairs call them (engine.h, "In place"): a reduce-scatter whose
// output is its own input at rank x shard, an all-gather whose input is its own output there.
// The same bits as out of place; under ASan, no overlapping copy of a shard onto itself.
void TestInPlaceSharded() {
  for (int n : {1, 2, 5, 8}) {
    for (std::size_t shard : {std::size_t{1}, std::size_t{33}, std::size_t{70001}}) {
      const std::size_t count = n * shard;
      auto in = OrderSensitive(n, count, n * 31 + shard);
      std::vector<std::vector<double>> sum(n, std::vector<double>(count));
      std::vector<const void*> ins, bufs_in;
      std::vector<void*> sums, outs;
      for (int r = 0; r < n; ++r) {
        ins.push_back(in[r].data());
        sums.push_back(sum[r].data());
      }
      CHECK(libra::AllReduce(DType::kF64, ins, sums, count, 1).ok());
      auto buffers = in;  // each rank's own copy, reduce-scattered in place
      for (int r = 0; r < n; ++r) {
        bufs_in.push_back(buffers[r].data());
        outs.push_back(buffers[r].data() + r * shard);
      }
      CHECK(libra::RunCollective(libra::Collective::kReduceScatter, DType::kF64, bufs_in, outs,
                                 count, 0, 3).ok());
      for (int r = 0; r < n; ++r) {
        CHECK(std::memcmp(buffers[r].data() + r * shard, sum[0].data() + r * shard,
                          shard * sizeof(double)) == 0);
      }
      // All-gather in place: each rank's shard already at its offset of its own output.
      std::vector<std::vector<double>> full(n, std::vector<double>(count, -7.0));
      std::vector<const void*> own;
      std::vector<void*> fulls;
      for (int r = 0; r < n; ++r) {
        std::memcpy(full[r].data() + r * shard, sum[0].data() + r * shard, shard * sizeof(double));
        own.push_back(full[r].data() + r * shard);
        fulls.push_back(full[r].data());
      }
      CHECK(libra::RunCollective(libra::Collective::kAllGather, DType::kBytes, own, fulls,
                                 count * sizeof(double), 0, 3).ok());
      for (int r = 0; r < n; ++r) {
        CHECK(std::memcmp(full[r].data(), sum[0].data(), count * sizeof(double)) == 0);
      }
    }
  }
}

// --- The all-to-all -----------------------------------------------------------------------

// Random bytes for `n` ranks' buffers of `bytes` each.
std::vector<std::vector<unsigned char>> RandomBuffers(int n, std::size_t bytes, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<unsigned char>> buffers(n, std::vector<unsigned char>(bytes));
  for (auto& b : buffers) {
    for (auto& x : b) x = static_cast<unsigned char>(rng());
  }
  return buffers;
}

// jax.lax.all_to_all's result, computed here element by element (`elem` bytes each): in row
// `row`, rank d's output at s * segment + j is rank s's input at row * period + d * segment + j.
std::vector<std::vector<unsigned char>> AllToAllReference(
    const std::vector<std::vector<unsigned char>>& in, std::size_t count, std::size_t segment,
    std::size_t elem) {
  const std::size_t n = in.size(), period = segment * n;
  std::vector<std::vector<unsigned char>> out(n, std::vector<unsigned char>(count * elem));
  if (count == 0) return out;
  for (std::size_t d = 0; d < n; ++d) {
    for (std::size_t row = 0; row < count / period; ++row) {
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t j = 0; j < segment; ++j) {
          std::memcpy(&out[d][(row * period + s * segment + j) * elem],
                      &in[s][(row * period + d * segment + j) * elem], elem);
        }
      }
    }
  }
  return out;
}

// Every rank's output against the reference, for worlds of 2, 4 and 8 ranks, one row and
// several, segments of 1, 3 and 1000 elements (and 0: one row of count / world), f32, s64 and
// bytes, block counts 1, 2 and 8: every block count gives the same bytes. The inputs are left
// as they were.
void TestAllToAll() {
  const std::pair<DType, std::size_t> dtypes[] = {
      {DType::kF32, 4}, {DType::kS64, 8}, {DType::kBytes, 1}};
  for (int n : {2, 4, 8}) {
    for (std::size_t rows : {std::size_t{1}, std::size_t{3}}) {
      for (std::size_t segment : {std::size_t{1}, std::size_t{3}, std::size_t{1000}}) {
        for (const auto& [dtype, elem] : dtypes) {
          const std::size_t count = rows * n * segment;
          const auto in = RandomBuffers(n, count * elem, n * 131 + rows * 17 + segment + elem);
          const auto want = AllToAllReference(in, count, segment, elem);
          for (int blocks : {1, 2, 8}) {
            std::vector<std::vector<unsigned char>> out(
                n, std::vector<unsigned char>(count * elem, 0xa5));
            std::vector<const void*> ins;
            std::vector<void*> outs;
            for (int r = 0; r < n; ++r) {
              ins.push_back(in[r].data());
              outs.push_back(out[r].data());
            }
            // One row may leave its segment to the engine (0: count / world).
            const std::size_t asked = rows == 1 && segment == 3 ? 0 : segment;
            CHECK(libra::RunCollective(libra::Collective::kAllToAll, dtype, ins, outs, count,
                                       asked, blocks).ok());
            CHECK(out == want);
          }
          CHECK(in == RandomBuffers(n, count * elem, n * 131 + rows * 17 + segment + elem));
        }
      }
    }
  }
  // An empty call is done at once; one rank keeps its own buffer.
  CHECK(libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, {nullptr, nullptr},
                             {nullptr, nullptr}, 0, 0, 2).ok());
  std::vector<float> x = {1.5f, 2.5f}, y(2);
  CHECK(libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, {x.data()}, {y.data()}, 2,
                             1, 1).ok());
  CHECK(y == x);
}

// Outputs large enough for streaming stores (>= kStreamingOutputBytes written in all), one of
// them a fresh mapping (populated first) and one not 16-byte aligned: the reference's bytes.
void TestLargeAllToAll() {
  const int n = 2;
  const std::size_t segment = libra::kStreamingOutputBytes / (n * n * 4) + 3;  // odd: unaligned
  const std::size_t count = n * segment, bytes = count * 4;
  const auto in = RandomBuffers(n, bytes, 77);
  const auto want = AllToAllReference(in, count, segment, 4);
  const std::size_t mapped = bytes + 8192;
  char* fresh = static_cast<char*>(mmap(nullptr, mapped, PROT_READ | PROT_WRITE,
                                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  CHECK(fresh != MAP_FAILED);
  std::vector<unsigned char> other(bytes + 1);
  std::vector<const void*> ins = {in[0].data(), in[1].data()};
  std::vector<void*> outs = {fresh + 64, other.data() + 1};
  CHECK(libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, ins, outs, count, segment,
                             4).ok());
  CHECK(std::memcmp(outs[0], want[0].data(), bytes) == 0);
  CHECK(std::memcmp(outs[1], want[1].data(), bytes) == 0);
  munmap(fresh, mapped);
}

// Several members in one call through the rendezvous (a bucket: each member its own segment
// and rows, an empty one among them), ranks arriving in random order with their own
// pointers, for s64 and bytes: each member is its own all-to-all. The call is recorded as an
// all-to-all of the members' total.
void TestAllToAllMembers() {
  const int n = 4;
  const std::vector<libra::Member> members = {
      {n * 3, 3}, {0, 0}, {2 * n * 1000, 1000}, {n * 1, 1}, {3 * n * 5, 5}, {n * 7, 0}};
  for (const auto& [dtype, elem] : {std::pair<DType, std::size_t>{DType::kS64, 8},
                                    std::pair<DType, std::size_t>{DType::kBytes, 1}}) {
    for (int blocks : {1, 2, 8}) {
      std::vector<std::vector<std::vector<unsigned char>>> in, out, want;
      std::size_t total = 0;
      for (std::size_t m = 0; m < members.size(); ++m) {
        const std::size_t count = members[m].count, segment = members[m].segment;
        in.push_back(RandomBuffers(n, count * elem, static_cast<unsigned>(m * 7 + blocks)));
        out.emplace_back(n, std::vector<unsigned char>(count * elem, 0x5a));
        want.push_back(AllToAllReference(in.back(), count, segment ? segment : count / n, elem));
        total += count;
      }
      libra::SetCallRecording(4);
      libra::Rendezvous site("a2a members");
      Latch latch(n);
      std::vector<int> order = {2, 0, 3, 1};
      std::shuffle(order.begin(), order.end(), std::mt19937(blocks));
      std::vector<std::thread> threads;
      for (int r : order) {
        threads.emplace_back([&, r] {
          ArriveMembers(site, r, n, libra::Collective::kAllToAll, dtype, blocks, members, in,
                        out, latch);
        });
      }
      for (std::thread& t : threads) t.join();
      CHECK(latch.Wait());
      for (const auto& status : latch.statuses()) CHECK(status.ok());
      for (std::size_t m = 0; m < members.size(); ++m) CHECK(out[m] == want[m]);
      const std::vector<libra::CallRecord> records = libra::TakeCallRecords();
      libra::SetCallRecording(0);
      CHECK(records.size() == 1 && records[0].collective == libra::Collective::kAllToAll);
      CHECK(records.size() == 1 && records[0].bytes == total * elem && records[0].world == n);
    }
  }
  CHECK(std::string(libra::Name(libra::Collective::kAllToAll)) == "all-to-all");
}

// A count that is not whole rows of world x segment is refused, naming the kind, the member
// and the segment; so is an output over any rank's input (never in place), in a synchronous
// call and in a round (every participant told, naming the ranks). The all-to-all is not an
// all-reduce: bytes are accepted (a copy), and a kind past the table is refused by its number.
void TestAllToAllBadArguments() {
  std::vector<float> a(12), b(12), oa(12), ob(12);
  std::vector<const void*> ins{a.data(), b.data()};
  std::vector<void*> outs{oa.data(), ob.data()};
  libra::Status s =
      libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, ins, outs, 12, 4, 1);
  CHECK(!s.ok() && s.code == libra::Status::Code::kInvalidArgument);
  CHECK(s.message.find("not whole rows of 2 ranks x segment 4") != std::string::npos);
  s = libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, ins, outs, 7, 0, 1);
  CHECK(!s.ok() && s.message.find("not whole rows of 2 ranks x segment 3") != std::string::npos);
  CHECK(libra::RunCollective(libra::Collective::kAllToAll, DType::kBytes, ins, outs, 48, 12, 1)
            .ok());
  // In place, and an output over another rank's input (views of one array): refused.
  s = libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, ins,
                           {a.data(), ob.data()}, 12, 3, 1);
  CHECK(!s.ok() && s.message.find("output of rank 0 overlaps the input of rank 0") !=
                       std::string::npos);
  CHECK(s.message.find("not done in place") != std::string::npos);
  s = libra::RunCollective(libra::Collective::kAllToAll, DType::kF32, ins,
                           {oa.data(), a.data() + 6}, 12, 3, 1);
  CHECK(!s.ok() && s.message.find("output of rank 1 overlaps the input of rank 0") !=
                       std::string::npos);
  s = libra::RunCollective(static_cast<libra::Collective>(libra::kNumCollectives), DType::kF32,
                           ins, outs, 12, 3, 1);
  CHECK(!s.ok() && s.message.find("unknown collective kind " +
                                  std::to_string(libra::kNumCollectives)) != std::string::npos);

  // Through the rendezvous: a bad member's segment, then an aliased member.
  libra::Rendezvous site("a2a bad");
  Latch bad(1);
  libra::CallSpec spec = Spec(0, 2, 0);
  spec.collective = libra::Collective::kAllToAll;
  spec.members = {{4, 1}, {6, 2}};
  site.Arrive(spec, {a.data(), b.data()}, {oa.data(), ob.data()}, bad.Callback());
  CHECK(bad.Wait());
  const libra::Status named = bad.statuses()[0];
  CHECK(!named.ok() && named.message.find("libra_jax all-to-all 'a2a bad'") != std::string::npos);
  CHECK(named.message.find("member 1: 6 elements are not whole rows of 2 ranks x segment 2") !=
        std::string::npos);
  Latch aliased(2);
  for (int r : {1, 0}) {
    libra::CallSpec one = Spec(r, 2, 0);
    one.collective = libra::Collective::kAllToAll;
    one.members = {{4, 1}, {4, 2}};
    std::vector<float>& own = r == 0 ? a : b;
    std::vector<float>& got = r == 0 ? oa : ob;
    // Rank 1's second member writes over its own input.
    void* second = r == 1 ? static_cast<void*>(own.data() + 4) : got.data() + 4;
    site.Arrive(one, {own.data(), own.data() + 4}, {got.data(), second}, aliased.Callback());
  }
  CHECK(aliased.Wait());
  for (const libra::Status& st : aliased.statuses()) {
    CHECK(!st.ok() && st.code == libra::Status::Code::kInvalidArgument);
    CHECK(st.message.find("'a2a bad': member 1: the output of rank 1 overlaps the input of "
                          "rank 1") != std::string::npos);
  }
}

void TestCallRecords() {
  std::vector<float> a(5000, 1.0f), b(5000, 2.0f);
  libra::SetCallRecording(2);
  for (int i = 0; i < 3; ++i) {
    CHECK(libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data(), b.data()}, a.size(), 2).ok());
  }
  std::vector<libra::CallRecord> records = libra::TakeCallRecords();
  CHECK(records.size() == 2);  // Bounded: the oldest is dropped.
  CHECK(records.back().bytes == 5000 * 4 && records.back().world == 2);
  CHECK(records.back().collective == libra::Collective::kAllReduce);
  CHECK(records.back().start_us <= records.back().end_us);
  CHECK(libra::TakeCallRecords().empty());
  libra::SetCallRecording(0);
  CHECK(libra::AllReduce(DType::kF32, {a.data(), b.data()}, {a.data(), b.data()}, a.size(), 2).ok());
  CHECK(libra::TakeCallRecords().empty());
}

void TestStagingBytes() {
  std::size_t bytes = 0;
  CHECK(libra::StagingBytes(nullptr, 123, &bytes).ok() && bytes == 123);
  CHECK(libra::StagingBytes("", 123, &bytes).ok() && bytes == 123);
  CHECK(libra::StagingBytes("32", 0, &bytes).ok() && bytes == (std::size_t{32} << 20));
  CHECK(libra::StagingBytes("1.5", 0, &bytes).ok() && bytes == (std::size_t{3} << 19));
  CHECK(libra::StagingBytes("1e-9", 0, &bytes).ok() && bytes == 16);  // one vector at least
  CHECK(libra::StagingBytes("65536", 0, &bytes).ok() && bytes == (std::size_t{1} << 36));
  // Each of these was a size cast out of range (undefined) or a silent default.
  for (const char* bad : {"inf", "nan", "1e30", "0", "-4", "soon", "8 MiB", "65537"}) {
    bytes = 7;
    const libra::Status s = libra::StagingBytes(bad, 123, &bytes);
    CHECK(!s.ok() && s.code == libra::Status::Code::kInvalidArgument);
    CHECK(s.message.find("LIBRA_JAX_CUDA_STAGING_MIB") != std::string::npos);
    CHECK(bytes == 7);
  }
}

}  // namespace

int main() {
  return libra_test::RunTests({
      {"sums", AtEveryWidth<TestSums>},
      {"sixteen_bit", AtEveryWidth<TestSixteenBit>},
      {"which_nan_wins", AtEveryWidth<TestWhichNaNWins>},
      {"vector_widths", TestVectorWidths},
      {"reduce_on_caller", TestReduceOnCaller},
      {"callbacks_that_wait", TestCallbacksThatWait},
      {"reduce_threads_released", TestReduceThreadsReleased},
      {"effective_blocks", TestEffectiveBlocks},
      {"bad_arguments", TestBadArguments},
      {"rendezvous_rounds", TestRendezvousRounds},
      {"timeout", TestTimeout},
      {"mismatch", TestMismatch},
      {"destroy_pending", TestDestroyPending},
      {"reduce_scatter_and_all_gather", AtEveryWidth<TestReduceScatterAndAllGather>},
      {"large_sharded_calls", TestLargeShardedCalls},
      {"in_place_sharded", AtEveryWidth<TestInPlaceSharded>},
      {"sharded_bad_arguments", TestShardedBadArguments},
      {"members", AtEveryWidth<TestMembers>},
      {"sharded_timeout_and_mismatch", TestShardedTimeoutAndMismatch},
      {"all_to_all", TestAllToAll},
      {"large_all_to_all", TestLargeAllToAll},
      {"all_to_all_members", TestAllToAllMembers},
      {"all_to_all_bad_arguments", TestAllToAllBadArguments},
      {"call_records", TestCallRecords},
      {"fork", TestFork},
      {"staging_bytes", TestStagingBytes},
  });
}
