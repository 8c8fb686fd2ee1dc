// Test and timing harness for the libra CUDA all-reduce kernels, with N
// virtual ranks on one GPU (N buffers on the same device, all ranks launched
// as one cooperative grid so that they are co-resident).
//
//   libra_cuda_harness check  [--ranks 2,4,8] [--csv FILE]
//   libra_cuda_harness bench  [--ranks 2,4,8] [--min-bytes 64K] [--max-bytes 1G]
//                             [--blocks 1,2,4,8,16,32,64] [--budget-s 120] [--csv FILE]
//   libra_cuda_harness contend [--ranks 8] [--bytes 64M] [--blocks 1,2,4,8,16,32,64]
//                             [--csv FILE]
//   libra_cuda_harness selftest   (host-only checks; runs without a GPU)
//
// --csv FILE appends, so every mode's lines can go to one file (gpu_check.sh).
//
// check: random data, outputs poisoned first, every dtype and algorithm,
// chunked rounds (small staging), in place, block counts changing from call
// to call, CUDA-graph replays, and a rank that never arrives (the timeout
// record, then a working team). Results vs a float64 reference within
// tolerance (integers exact); all ranks bitwise identical; bitwise
// independent of block count and algorithm. Prints one CSV line per case and
// exits non-zero on any failure.
// bench: median time per all-reduce vs bytes per rank x blocks.
// contend: the contention curves (see contention.h): for a GEMM and a
// memory-bound triad beside one rank's share of an all-reduce with k blocks,
// the compute's slowdown (all-reduce running throughout) and the all-reduce's
// (compute running throughout), each against its time alone; medians of 5.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "libra/cuda/allreduce.h"
#include "tools/contention.h"

namespace lc = libra::cuda;

namespace {

FILE* g_csv = nullptr;
int g_failures = 0;

void Emit(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  if (g_csv) {
    std::fprintf(g_csv, "%s\n", line.c_str());
    std::fflush(g_csv);
  }
}

#define CHECK_CUDA(expr)                                                             \
  do {                                                                               \
    const cudaError_t err_ = (expr);                                                 \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr,             \
                   cudaGetErrorString(err_));                                        \
      std::exit(2);                                                                  \
    }                                                                                \
  } while (0)

std::vector<int> ParseInts(const std::string& s) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t comma = s.find(',', pos);
    out.push_back(std::atoi(s.substr(pos, comma - pos).c_str()));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

std::size_t ParseBytes(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  switch (end && *end ? *end : ' ') {
    case 'K': case 'k': v *= 1 << 10; break;
    case 'M': case 'm': v *= 1 << 20; break;
    case 'G': case 'g': v *= 1 << 30; break;
    default: break;
  }
  return static_cast<std::size_t>(v);
}

// --- Host element conversions ------------------------------------------------

double ToDouble(lc::DType t, const unsigned char* p) {
  switch (t) {
    case lc::DType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case lc::DType::kF64: { double v; std::memcpy(&v, p, 8); return v; }
    case lc::DType::kBF16: { uint16_t b; std::memcpy(&b, p, 2); uint32_t u = uint32_t{b} << 16;
                             float v; std::memcpy(&v, &u, 4); return v; }
    case lc::DType::kF16: { __half h; std::memcpy(&h, p, 2); return __half2float(h); }
    case lc::DType::kS32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case lc::DType::kS64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
  }
  return 0;
}

void FromDouble(lc::DType t, double x, unsigned char* p) {
  switch (t) {
    case lc::DType::kF32: { float v = static_cast<float>(x); std::memcpy(p, &v, 4); break; }
    case lc::DType::kF64: std::memcpy(p, &x, 8); break;
    case lc::DType::kBF16: { __nv_bfloat16 b = __float2bfloat16_rn(static_cast<float>(x));
                             std::memcpy(p, &b, 2); break; }
    case lc::DType::kF16: { __half h = __float2half_rn(static_cast<float>(x)); std::memcpy(p, &h, 2); break; }
    case lc::DType::kS32: { int32_t v = static_cast<int32_t>(x); std::memcpy(p, &v, 4); break; }
    case lc::DType::kS64: { int64_t v = static_cast<int64_t>(x); std::memcpy(p, &v, 8); break; }
  }
}

// Random inputs: mixed magnitudes for floats (f16 kept in range), large
// integers whose sums wrap.
void Fill(lc::DType t, std::vector<unsigned char>& buf, std::mt19937_64& rng) {
  const std::size_t size = lc::SizeOf(t);
  std::normal_distribution<double> normal;
  std::uniform_real_distribution<double> expo(t == lc::DType::kF16 ? -3.0 : -6.0, 3.0);
  std::uniform_int_distribution<int32_t> ints(INT32_MIN / 2, INT32_MAX / 2);
  for (std::size_t i = 0; i < buf.size() / size; ++i) {
    if (t == lc::DType::kS32) {
      const int32_t v = ints(rng);
      std::memcpy(&buf[i * size], &v, 4);
    } else {
      FromDouble(t, normal(rng) * std::exp(expo(rng)), &buf[i * size]);
    }
  }
}

// Checks `out` against the float64 sum of `ins`. Returns the worst error as a
// multiple of the tolerance (<= 1 passes).
double Verify(lc::DType t, const std::vector<std::vector<unsigned char>>& ins,
              const std::vector<unsigned char>& out, std::string* what) {
  const std::size_t size = lc::SizeOf(t);
  const int n = static_cast<int>(ins.size());
  double worst = 0;
  const double unit = t == lc::DType::kF64 ? std::ldexp(1.0, -52) : std::ldexp(1.0, -23);
  const double round = t == lc::DType::kBF16 ? std::ldexp(1.0, -8)
                       : t == lc::DType::kF16 ? std::ldexp(1.0, -11) : 0.0;
  for (std::size_t i = 0; i < out.size() / size; ++i) {
    const unsigned char* o = &out[i * size];
    if (t == lc::DType::kS32) {
      uint32_t sum = 0;
      for (int r = 0; r < n; ++r) {
        int32_t v; std::memcpy(&v, &ins[r][i * size], 4); sum += static_cast<uint32_t>(v);
      }
      int32_t got; std::memcpy(&got, o, 4);
      if (static_cast<uint32_t>(got) != sum) {
        *what = "element " + std::to_string(i) + ": " + std::to_string(got) + " != " +
                std::to_string(static_cast<int32_t>(sum));
        return 1e30;
      }
      continue;
    }
    double sum = 0, abs_sum = 0;
    for (int r = 0; r < n; ++r) {
      const double v = ToDouble(t, &ins[r][i * size]);
      sum += v;
      abs_sum += std::fabs(v);
    }
    const double got = ToDouble(t, o);
    const double tol = n * unit * abs_sum + round * std::fabs(sum) + 1e-30;
    const double err = std::isfinite(got) ? std::fabs(got - sum) / tol : 1e30;
    if (err > worst) {
      worst = err;
      if (err > 1) {
        *what = "element " + std::to_string(i) + ": got " + std::to_string(got) + ", want " +
                std::to_string(sum) + " (tol " + std::to_string(tol) + ")";
      }
    }
  }
  return worst;
}

// A virtual team with device buffers for every rank.
struct Setup {
  std::unique_ptr<lc::Team> team;
  std::vector<void*> in, out;
  std::size_t bytes = 0;
  cudaStream_t stream = nullptr;

  Setup(int device, int n, std::size_t capacity, std::size_t nbytes) : bytes(nbytes) {
    std::string message;
    if (lc::Team::CreateVirtual(device, n, capacity, &team, &message) != cudaSuccess) {
      std::fprintf(stderr, "team: %s\n", message.c_str());
      std::exit(2);
    }
    in.resize(n);
    out.resize(n);
    for (int r = 0; r < n; ++r) {
      CHECK_CUDA(cudaMalloc(&in[r], std::max<std::size_t>(bytes, 16)));
      CHECK_CUDA(cudaMalloc(&out[r], std::max<std::size_t>(bytes, 16)));
    }
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  ~Setup() {
    cudaStreamSynchronize(stream);
    for (void* p : in) cudaFree(p);
    for (void* p : out) cudaFree(p);
    cudaStreamDestroy(stream);
  }
  void Poison() {
    for (void* p : out) CHECK_CUDA(cudaMemsetAsync(p, 0xff, bytes, stream));
  }
  // Each rank's buffer as `parts` members (a bucket's tensors, whole vectors), listed last
  // piece first, so that a member table that read them in memory order would be caught.
  std::vector<std::vector<lc::Buffer>> Members(int parts, bool in_place) const {
    const std::size_t vectors = bytes / lc::kVectorBytes;
    std::vector<std::vector<lc::Buffer>> members(in.size());
    for (std::size_t r = 0; r < in.size(); ++r) {
      char* output = static_cast<char*>(in_place ? in[r] : out[r]);
      for (int m = parts - 1; m >= 0; --m) {
        const std::size_t begin = vectors * m / parts * lc::kVectorBytes;
        const std::size_t end = m + 1 == parts ? bytes : vectors * (m + 1) / parts * lc::kVectorBytes;
        members[r].push_back({static_cast<const char*>(in[r]) + begin, output + begin, end - begin});
      }
    }
    return members;
  }
  cudaError_t Run(lc::DType t, int blocks, lc::Algorithm a, bool in_place = false,
                  uint64_t timeout_ns = 10'000'000'000ull, int parts = 1) {
    lc::CallArgs call;
    call.dtype = t;
    call.blocks = blocks;
    call.algorithm = a;
    call.timeout_ns = timeout_ns;
    std::string message;
    const cudaError_t err =
        lc::LaunchVirtualAllReduce(*team, call, Members(parts, in_place), stream, &message);
    if (err != cudaSuccess && err != cudaErrorCooperativeLaunchTooLarge) {
      std::fprintf(stderr, "launch: %s\n", message.c_str());
    }
    return err;
  }
};

// --- check -------------------------------------------------------------------

struct CaseResult {
  bool ok = true;
  std::string note;
  bool skipped = false;  // not run (the reason in `note`): neither a pass nor a failure
};

CaseResult Skipped(std::string why) { return {true, std::move(why), true}; }

const char* Status(const CaseResult& r) { return !r.ok ? "FAIL" : r.skipped ? "SKIP" : "PASS"; }

void Report(const std::string& name, int n, lc::DType t, lc::Algorithm a, std::size_t bytes,
            int blocks, const CaseResult& r, double worst) {
  if (!r.ok) ++g_failures;
  const char* status = Status(r);
  char line[1024];
  std::snprintf(line, sizeof line, "check,%s,%d,%s,%s,%zu,%d,%s,%.3g,%s", name.c_str(), n,
                lc::Name(t), lc::Name(a), bytes, blocks, status, worst, r.note.c_str());
  Emit(line);
}

CaseResult CheckOutputs(Setup& s, lc::DType t, bool in_place,
                        const std::vector<std::vector<unsigned char>>& host_in,
                        std::vector<unsigned char>* expect, double* worst);

// A graph capture (or its instantiation) that failed: the case is skipped, with why.
CaseResult CaptureSkipped(cudaError_t launch, cudaError_t end, cudaError_t instantiate) {
  return Skipped(std::string("graph capture failed: launch ") + cudaGetErrorName(launch) +
                 ", end capture " + cudaGetErrorName(end) + ", instantiate " +
                 cudaGetErrorName(instantiate));
}

// Runs one all-reduce and checks it. `expect` (if not empty) is the result
// the same inputs gave before: must match bitwise.
CaseResult RunAndCheck(Setup& s, lc::DType t, int blocks, lc::Algorithm a, bool in_place,
                       const std::vector<std::vector<unsigned char>>& host_in,
                       std::vector<unsigned char>* expect, double* worst, int parts = 1) {
  const int n = s.team->nranks();
  for (int r = 0; r < n; ++r) {
    CHECK_CUDA(cudaMemcpyAsync(s.in[r], host_in[r].data(), s.bytes, cudaMemcpyHostToDevice,
                               s.stream));
  }
  s.Poison();
  const cudaError_t err = s.Run(t, blocks, a, in_place, 10'000'000'000ull, parts);
  if (err == cudaErrorCooperativeLaunchTooLarge) return Skipped("not co-resident");
  CHECK_CUDA(err);
  return CheckOutputs(s, t, in_place, host_in, expect, worst);
}

// Waits for the stream, then checks every rank's output.
CaseResult CheckOutputs(Setup& s, lc::DType t, bool in_place,
                        const std::vector<std::vector<unsigned char>>& host_in,
                        std::vector<unsigned char>* expect, double* worst) {
  CaseResult res;
  const int n = s.team->nranks();
  CHECK_CUDA(cudaStreamSynchronize(s.stream));
  const std::string timeout = s.team->TakeError();
  if (!timeout.empty()) return {false, "timeout: " + timeout};
  std::vector<std::vector<unsigned char>> got(n, std::vector<unsigned char>(s.bytes));
  for (int r = 0; r < n; ++r) {
    CHECK_CUDA(cudaMemcpy(got[r].data(), in_place ? s.in[r] : s.out[r], s.bytes,
                          cudaMemcpyDeviceToHost));
  }
  for (int r = 1; r < n; ++r) {
    if (got[r] != got[0]) return {false, "rank " + std::to_string(r) + " differs from rank 0"};
  }
  std::string what;
  *worst = Verify(t, host_in, got[0], &what);
  if (*worst > 1) return {false, what};
  if (expect->empty()) {
    *expect = got[0];
  } else if (*expect != got[0]) {
    return {false, "not bitwise equal to the other block counts / algorithms"};
  }
  return res;
}

void CheckAll(int device, const std::vector<int>& ranks) {
  const lc::DType dtypes[] = {lc::DType::kF32, lc::DType::kBF16, lc::DType::kF16,
                              lc::DType::kF64, lc::DType::kS32};
  const lc::Algorithm algos[] = {lc::Algorithm::kOneShot, lc::Algorithm::kTwoShot};
  std::mt19937_64 rng(1234);
  const std::size_t capacity = 256 << 10;  // small: several rounds per call
  Emit("check_header,case,ranks,dtype,algorithm,bytes,blocks,status,worst_err_over_tol,note");
  for (int n : ranks) {
    // Sizes: one vector, a partial tile, several rounds with a partial last one.
    for (std::size_t bytes : {std::size_t{16}, std::size_t{4096 + 48},
                              std::size_t{(1 << 20) + 4096 + 16}}) {
      Setup s(device, n, capacity, bytes);
      for (lc::DType t : dtypes) {
        if (bytes % lc::SizeOf(t)) continue;
        std::vector<std::vector<unsigned char>> host_in(n, std::vector<unsigned char>(bytes));
        for (auto& b : host_in) Fill(t, b, rng);
        std::vector<unsigned char> expect;
        // Block counts change from call to call on the same team.
        for (lc::Algorithm a : algos) {
          for (int blocks : {1, 3, 64, 2}) {
            double worst = 0;
            const CaseResult r = RunAndCheck(s, t, blocks, a, false, host_in, &expect, &worst);
            Report("sum", n, t, a, bytes, blocks, r, worst);
          }
        }
        double worst = 0;
        const CaseResult r =
            RunAndCheck(s, t, 5, lc::Algorithm::kAuto, true, host_in, &expect, &worst);
        Report("in_place", n, t, lc::Algorithm::kAuto, bytes, 5, r, worst);
        // The buffer as a bucket's members in one launch (the kernels' table): 3 members
        // one-shot, and 8 in place two-shot (two cases, to keep the step's time):
        // bitwise the one buffer's sums.
        if (bytes >= lc::kMaxVirtualMembers * lc::kVectorBytes) {
          for (bool in_place : {false, true}) {
            const lc::Algorithm a = in_place ? lc::Algorithm::kTwoShot : lc::Algorithm::kOneShot;
            const int parts = in_place ? lc::kMaxVirtualMembers : 3;
            const CaseResult m =
                RunAndCheck(s, t, 4, a, in_place, host_in, &expect, &worst, parts);
            Report(in_place ? "members_in_place" : "members", n, t, a, bytes, 4, m, worst);
          }
        }
      }
    }
  }

  // CUDA graph: three calls with different block counts and algorithms,
  // captured once, replayed; device-side round counters keep ranks in step.
  for (int n : ranks) {
    const std::size_t bytes = (512 << 10) + 32;
    Setup s(device, n, capacity, bytes);
    const lc::DType t = lc::DType::kF32;
    std::vector<std::vector<unsigned char>> host_in(n, std::vector<unsigned char>(bytes));
    for (auto& b : host_in) Fill(t, b, rng);
    for (int r = 0; r < n; ++r) {
      CHECK_CUDA(cudaMemcpy(s.in[r], host_in[r].data(), bytes, cudaMemcpyHostToDevice));
    }
    // Each call once before capturing (the calls are kernel parameters: nothing to upload).
    CHECK_CUDA(s.Run(t, 1, lc::Algorithm::kOneShot));
    CHECK_CUDA(s.Run(t, 64, lc::Algorithm::kTwoShot));
    CHECK_CUDA(s.Run(t, 3, lc::Algorithm::kOneShot));
    CHECK_CUDA(cudaStreamSynchronize(s.stream));
    CaseResult res;
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CHECK_CUDA(cudaStreamBeginCapture(s.stream, cudaStreamCaptureModeThreadLocal));
    cudaError_t err = s.Run(t, 1, lc::Algorithm::kOneShot);
    if (err == cudaSuccess) err = s.Run(t, 64, lc::Algorithm::kTwoShot);
    if (err == cudaSuccess) err = s.Run(t, 3, lc::Algorithm::kOneShot);
    const cudaError_t end = cudaStreamEndCapture(s.stream, &graph);
    const cudaError_t inst =
        err == cudaSuccess && end == cudaSuccess ? cudaGraphInstantiate(&exec, graph, 0) : err;
    if (err != cudaSuccess || end != cudaSuccess || inst != cudaSuccess) {
      cudaGetLastError();
      if (graph != nullptr) cudaGraphDestroy(graph);
      // Not run: a SKIP with the reason, never a PASS.
      Report("graph", n, t, lc::Algorithm::kOneShot, bytes, 1, CaptureSkipped(err, end, inst), 0);
      continue;
    }
    std::vector<unsigned char> expect;
    double worst = 0;
    for (int replay = 0; replay < 5 && res.ok; ++replay) {
      s.Poison();
      CHECK_CUDA(cudaGraphLaunch(exec, s.stream));
      res = CheckOutputs(s, t, false, host_in, &expect, &worst);
      // An eager call between replays, with another block count: rounds advance.
      if (res.ok) res = RunAndCheck(s, t, 7, lc::Algorithm::kTwoShot, false, host_in, &expect, &worst);
    }
    Report("graph", n, t, lc::Algorithm::kOneShot, bytes, 1, res, worst);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }

  // A rank that never arrives: only rank 0 of a 2-rank team is launched.
  {
    std::string message;
    std::unique_ptr<lc::Team> team;
    CHECK_CUDA(lc::Team::Create({device}, capacity, &team, &message));  // sanity: 1 rank
    std::unique_ptr<lc::Team> pair;
    CHECK_CUDA(lc::Team::CreateVirtual(device, 2, capacity, &pair, &message));
    void* buf = nullptr;
    CHECK_CUDA(cudaMalloc(&buf, 4096));
    lc::CallArgs call;
    call.members = {{buf, buf, 4096}};
    call.blocks = 2;
    call.timeout_ns = 50'000'000;  // 50 ms
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_CUDA(lc::LaunchAllReduce(pair->View(0), call, nullptr, &message));
    const cudaError_t sync = cudaDeviceSynchronize();
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const std::string error = pair->TakeError();
    CaseResult res;
    res.ok = sync == cudaSuccess && !error.empty() && ms < 5000;
    res.note = "sync=" + std::string(cudaGetErrorName(sync)) + " after " +
               std::to_string(static_cast<int>(ms)) + " ms; record: " +
               (error.empty() ? "none" : error);
    // The context still works: a fresh 1-rank call succeeds.
    CHECK_CUDA(lc::LaunchAllReduce(team->View(0), call, nullptr, &message));
    res.ok = res.ok && cudaDeviceSynchronize() == cudaSuccess && team->TakeError().empty();
    Report("timeout", 2, lc::DType::kF32, lc::Algorithm::kAuto, 4096, 2, res, 0);
    pair->Abandon();
    cudaFree(buf);
  }
}

// --- bench -------------------------------------------------------------------

void Bench(int device, const std::vector<int>& ranks, std::size_t min_bytes,
           std::size_t max_bytes, const std::vector<int>& block_list, double budget_s) {
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int co_resident = 0;  // the virtual-rank kernel's (1 block a SM)
  CHECK_CUDA(lc::MaxCoResidentBlocks(&co_resident, /*virtual_team=*/true));
  Emit("bench_header,ranks,algorithm,bytes,blocks,effective_blocks,median_us,algbw_GBps,iters");
  Emit("bench_members_header,ranks,bytes,members,blocks,one_buffer_median_us,members_median_us");
  const lc::Algorithm algos[] = {lc::Algorithm::kOneShot, lc::Algorithm::kTwoShot};
  for (int n : ranks) {
    std::size_t top = max_bytes;
    std::size_t free_bytes = 0, total = 0;
    CHECK_CUDA(cudaMemGetInfo(&free_bytes, &total));
    while (top > min_bytes && 2 * n * top + (std::size_t{1} << 30) > free_bytes) top /= 2;
    Setup s(device, n, lc::kDefaultCapacityBytes, top);
    for (void* p : s.in) CHECK_CUDA(cudaMemset(p, 0, top));
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    for (std::size_t bytes = min_bytes; bytes <= top; bytes *= 4) {
      for (lc::Algorithm a : algos) {
        for (int blocks : block_list) {
          if (elapsed() > budget_s) {
            Emit("bench_skipped,budget," + std::to_string(n) + "," + std::to_string(bytes));
            goto next_rank;
          }
          const int eff = lc::EffectiveBlocks(bytes, n, a, blocks, lc::kDefaultCapacityBytes);
          char line[256];
          if (n * eff > co_resident) {
            std::snprintf(line, sizeof line, "bench,%d,%s,%zu,%d,%d,,,not co-resident", n,
                          lc::Name(a), bytes, blocks, eff);
            Emit(line);
            continue;
          }
          s.bytes = bytes;
          CHECK_CUDA(s.Run(lc::DType::kF32, blocks, a));  // warm-up
          std::vector<float> times;
          double total_ms = 0;
          while ((times.size() < 3 || total_ms < 20) && times.size() < 200) {
            CHECK_CUDA(cudaEventRecord(e0, s.stream));
            CHECK_CUDA(s.Run(lc::DType::kF32, blocks, a));
            CHECK_CUDA(cudaEventRecord(e1, s.stream));
            CHECK_CUDA(cudaEventSynchronize(e1));
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
            times.push_back(ms);
            total_ms += ms;
          }
          const std::string error = s.team->TakeError();
          if (!error.empty()) {
            ++g_failures;
            Emit("bench_error," + error);
          }
          std::sort(times.begin(), times.end());
          const double us = times[times.size() / 2] * 1000.0;
          std::snprintf(line, sizeof line, "bench,%d,%s,%zu,%d,%d,%.2f,%.2f,%zu", n, lc::Name(a),
                        bytes, blocks, eff, us, bytes / us / 1000.0, times.size());
          Emit(line);
        }
      }
    }
    {
      // A bucket of kMaxVirtualMembers members against the same bytes as one buffer, in one
      // launch each, interleaved: what the member table costs (ForPieces).
      const std::size_t bytes = std::min<std::size_t>(top, std::size_t{8} << 20);
      s.bytes = bytes;
      for (int blocks : block_list) {
        if (elapsed() > budget_s) break;
        const int eff =
            lc::EffectiveBlocks(bytes, n, lc::Algorithm::kAuto, blocks, lc::kDefaultCapacityBytes);
        if (n * eff > co_resident) continue;
        std::vector<float> one, members;
        for (int i = 0; i < 21; ++i) {
          for (int parts : {1, lc::kMaxVirtualMembers}) {
            CHECK_CUDA(cudaEventRecord(e0, s.stream));
            CHECK_CUDA(s.Run(lc::DType::kF32, blocks, lc::Algorithm::kAuto, false,
                             10'000'000'000ull, parts));
            CHECK_CUDA(cudaEventRecord(e1, s.stream));
            CHECK_CUDA(cudaEventSynchronize(e1));
            float ms = 0;
            CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
            (parts == 1 ? one : members).push_back(ms);
          }
        }
        std::sort(one.begin(), one.end());
        std::sort(members.begin(), members.end());
        char line[256];
        std::snprintf(line, sizeof line, "bench_members,%d,%zu,%d,%d,%.2f,%.2f", n, bytes,
                      lc::kMaxVirtualMembers, blocks, one[one.size() / 2] * 1000.0,
                      members[members.size() / 2] * 1000.0);
        Emit(line);
      }
    }
  next_rank:
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
}

// --- contend -----------------------------------------------------------------

// Median GPU time (ms) of `launch` on `stream`, over `reps` runs.
template <typename Launch>
float MedianMs(cudaStream_t stream, int reps, Launch launch) {
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> times;
  for (int i = 0; i < reps; ++i) {
    CHECK_CUDA(cudaEventRecord(e0, stream));
    launch();
    CHECK_CUDA(cudaEventRecord(e1, stream));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
    times.push_back(ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Runs `fg_reps` launches of `fg` on stream `fg_stream` beside `bg_reps`
// launches of `bg` on `bg_stream`, both released together by one spin
// kernel; returns the foreground's elapsed GPU time (ms).
template <typename Fg, typename Bg>
float Beside(cudaStream_t fg_stream, int fg_reps, Fg fg, cudaStream_t bg_stream, int bg_reps,
             Bg bg) {
  cudaEvent_t go, e0, e1;
  CHECK_CUDA(cudaEventCreateWithFlags(&go, cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  CHECK_CUDA(lc::LaunchSpin(200, fg_stream));
  CHECK_CUDA(cudaEventRecord(go, fg_stream));
  CHECK_CUDA(cudaStreamWaitEvent(bg_stream, go, 0));
  for (int i = 0; i < bg_reps; ++i) bg();
  CHECK_CUDA(cudaEventRecord(e0, fg_stream));
  for (int i = 0; i < fg_reps; ++i) fg();
  CHECK_CUDA(cudaEventRecord(e1, fg_stream));
  CHECK_CUDA(cudaDeviceSynchronize());
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
  cudaEventDestroy(go);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ms;
}

template <typename T>
void Allocate(T** p, std::size_t bytes) {
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(p), bytes));
  CHECK_CUDA(cudaMemset(*p, 0, bytes));
}

void Contend(int n, std::size_t bytes, const std::vector<int>& block_list) {
  bytes -= bytes % lc::kVectorBytes;
  const int gemm_n = 4096;
  const std::size_t gemm_bytes = std::size_t{4} * gemm_n * gemm_n;
  const std::size_t triad_count = std::size_t{64} << 20;  // 256 MiB per array
  std::vector<float*> inputs(n);
  for (float*& p : inputs) Allocate(&p, bytes);
  float **d_inputs = nullptr, *out = nullptr, *ga = nullptr, *gb = nullptr, *gc = nullptr;
  float *ta = nullptr, *tb = nullptr, *tc = nullptr;
  Allocate(&d_inputs, n * sizeof(float*));
  CHECK_CUDA(cudaMemcpy(d_inputs, inputs.data(), n * sizeof(float*), cudaMemcpyHostToDevice));
  Allocate(&out, bytes);
  for (float** p : {&ga, &gb, &gc}) Allocate(p, gemm_bytes);
  for (float** p : {&ta, &tb, &tc}) Allocate(p, triad_count * 4);
  cudaStream_t compute_stream, comm_stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&compute_stream, cudaStreamNonBlocking));
  CHECK_CUDA(cudaStreamCreateWithFlags(&comm_stream, cudaStreamNonBlocking));
  struct Workload {
    const char* name;
    std::function<void()> launch;
  };
  const Workload workloads[] = {
      {"gemm", [&] { CHECK_CUDA(lc::LaunchGemm(ga, gb, gc, gemm_n, compute_stream)); }},
      {"triad", [&] { CHECK_CUDA(lc::LaunchTriad(ta, tb, tc, triad_count, compute_stream)); }},
  };
  Emit("contend_header,workload,ranks,bytes,blocks,compute_alone_us,compute_slowdown,"
       "allreduce_alone_us,allreduce_slowdown");
  for (const Workload& w : workloads) {
    w.launch();  // warm-up
    const float compute_ms = MedianMs(compute_stream, 5, w.launch);
    for (int blocks : block_list) {
      auto share = [&] {
        CHECK_CUDA(lc::LaunchRankShare(d_inputs, n, out, bytes, blocks, comm_stream));
      };
      share();
      const float share_ms = MedianMs(comm_stream, 5, share);
      // Compute slowdown: ~20 ms of compute inside ~30 ms of all-reduces.
      const int c_reps = std::max(1, static_cast<int>(20.0f / compute_ms));
      const int s_cover = std::max(1, static_cast<int>(30.0f / share_ms) + 1);
      std::vector<float> slow_c, slow_s;
      for (int rep = 0; rep < 5; ++rep) {
        slow_c.push_back(Beside(compute_stream, c_reps, w.launch, comm_stream, s_cover, share) /
                         (c_reps * compute_ms));
        // All-reduce slowdown: ~20 ms of all-reduces inside ~30 ms of compute.
        const int s_reps = std::max(1, static_cast<int>(20.0f / share_ms));
        const int c_cover = std::max(1, static_cast<int>(30.0f / compute_ms) + 1);
        slow_s.push_back(Beside(comm_stream, s_reps, share, compute_stream, c_cover, w.launch) /
                         (s_reps * share_ms));
      }
      std::sort(slow_c.begin(), slow_c.end());
      std::sort(slow_s.begin(), slow_s.end());
      char line[256];
      std::snprintf(line, sizeof line, "contend,%s,%d,%zu,%d,%.2f,%.4f,%.2f,%.4f", w.name, n,
                    bytes, blocks, compute_ms * 1000.0, slow_c[2], share_ms * 1000.0, slow_s[2]);
      Emit(line);
    }
  }
  for (float* p : inputs) cudaFree(p);
  for (float* p : {out, ga, gb, gc, ta, tb, tc}) cudaFree(p);
  cudaFree(d_inputs);
  cudaStreamDestroy(compute_stream);
  cudaStreamDestroy(comm_stream);
}

// --- selftest (no GPU needed) ------------------------------------------------

// 0, or 1 after saying which selftest check failed.
int Expect(bool ok, const char* what) {
  if (!ok) std::printf("selftest FAIL: %s\n", what);
  return ok ? 0 : 1;
}

// CUDA's launch and last-error slot, emulated: a failed launch records its error in the
// thread's slot, as CUDA does; cudaGetLastError returns the slot and clears it.
thread_local cudaError_t g_fake_slot = cudaSuccess;
thread_local cudaError_t g_fake_launch_result = cudaSuccess;
cudaError_t FakeLaunch(const void*, dim3, dim3, void**, std::size_t, cudaStream_t) {
  if (g_fake_launch_result != cudaSuccess) g_fake_slot = g_fake_launch_result;
  return g_fake_launch_result;
}
cudaError_t FakeGetLastError() {
  const cudaError_t err = g_fake_slot;
  g_fake_slot = cudaSuccess;
  return err;
}

// lc::LaunchKernel judges a launch by its own result and leaves no failed launch's error
// behind (harness check exited midway: a cooperative grid too large to be co-resident was a
// SKIP, but its error stayed in the slot and the next LaunchAllReduce read it as its own).
int LaunchSelfTest() {
  int bad = 0;
  auto expect = [&bad](bool ok, const char* what) { bad += Expect(ok, what); };
  const lc::LaunchApi fake = {FakeLaunch, FakeLaunch, FakeGetLastError};
  const lc::LaunchApi real = lc::SetLaunchApiForTesting(&fake);
  int kernel = 0;  // never called: the fake launch does not run it
  g_fake_slot = cudaSuccess;
  g_fake_launch_result = cudaErrorCooperativeLaunchTooLarge;
  expect(lc::LaunchKernel(true, &kernel, dim3(8 * 64), nullptr, nullptr) ==
             cudaErrorCooperativeLaunchTooLarge, "a failed launch returns its error");
  expect(g_fake_slot == cudaSuccess, "a failed launch's error is cleared from the slot");
  g_fake_launch_result = cudaSuccess;
  expect(lc::LaunchKernel(false, &kernel, dim3(4), nullptr, nullptr) == cudaSuccess,
         "the next launch succeeds");
  g_fake_slot = cudaErrorInvalidValue;  // a stale error someone else left
  expect(lc::LaunchKernel(false, &kernel, dim3(4), nullptr, nullptr) == cudaSuccess,
         "a launch is judged by its own result, not a stale error in the slot");
  expect(g_fake_slot == cudaErrorInvalidValue, "another call's error is left for its owner");
  g_fake_slot = cudaSuccess;
  lc::SetLaunchApiForTesting(&real);
  return bad;
}

// libra's stream is created at the device's greatest priority (CUDA's numbers: lower is
// higher; it was created at the default priority, behind compute's waiting blocks).
int g_fake_priority = 1;
int StreamSelfTest() {
  int bad = 0;
  lc::LaunchApi fake = {FakeLaunch, FakeLaunch, FakeGetLastError};
  fake.stream_priority_range = [](int* least, int* greatest) {
    *least = 0;
    *greatest = -5;
    return cudaSuccess;
  };
  fake.create_stream = [](cudaStream_t* stream, unsigned int flags, int priority) {
    g_fake_priority = flags == cudaStreamNonBlocking ? priority : 1;
    *stream = nullptr;
    return cudaSuccess;
  };
  const lc::LaunchApi real = lc::SetLaunchApiForTesting(&fake);
  cudaStream_t stream;
  std::string message;
  bad += Expect(lc::CreatePriorityStream(&stream, &message) == cudaSuccess && g_fake_priority == -5,
                "libra's stream: non-blocking, at the greatest priority");
  lc::SetLaunchApiForTesting(&real);
  return bad;
}

int SelfTest() {
  int bad = 0;
  auto expect = [&bad](bool ok, const char* what) { bad += Expect(ok, what); };
  const std::size_t cap = lc::kDefaultCapacityBytes;
  expect(lc::EffectiveBlocks(16, 2, lc::Algorithm::kOneShot, 64, cap) == 1, "one vector: 1 block");
  expect(lc::EffectiveBlocks(std::size_t{1} << 30, 8, lc::Algorithm::kTwoShot, 64, cap) == 64,
         "1 GiB: all blocks");
  expect(lc::EffectiveBlocks(std::size_t{1} << 30, 8, lc::Algorithm::kTwoShot, 100, cap) ==
             lc::kMaxBlocks, "clamped to kMaxBlocks");
  expect(lc::EffectiveBlocks(64 << 10, 2, lc::Algorithm::kOneShot, 64, cap) == 8,
         "64 KiB one-shot: 8 tiles");
  expect(lc::EffectiveBlocks(64 << 10, 8, lc::Algorithm::kTwoShot, 64, cap) == 1,
         "64 KiB two-shot over 8: 1 tile");
  expect(lc::ChooseAlgorithm(1 << 20, 2) == lc::Algorithm::kOneShot, "2 ranks: one-shot");
  expect(lc::ChooseAlgorithm(1 << 20, 8) == lc::Algorithm::kTwoShot, "8 ranks, 1 MiB: two-shot");
  expect(lc::ChooseAlgorithm(64 << 10, 8) == lc::Algorithm::kOneShot, "8 ranks, 64 KiB: one-shot");
  std::vector<std::vector<unsigned char>> ins(2, std::vector<unsigned char>(8));
  std::vector<unsigned char> out(8);
  FromDouble(lc::DType::kF32, 1.5, &ins[0][0]);
  FromDouble(lc::DType::kF32, 2.25, &ins[1][0]);
  FromDouble(lc::DType::kF32, 3.75, &out[0]);
  std::string what;
  expect(Verify(lc::DType::kF32, ins, out, &what) <= 1, "verify accepts the exact sum");
  FromDouble(lc::DType::kF32, 3.5, &out[0]);
  expect(Verify(lc::DType::kF32, ins, out, &what) > 1, "verify rejects a wrong sum");
  // A case that could not run is a SKIP with its reason, not a PASS (a failed graph capture
  // was reported PASS) and not a failure.
  const CaseResult capture = CaptureSkipped(cudaErrorStreamCaptureUnsupported, cudaSuccess,
                                            cudaSuccess);
  expect(std::string(Status(capture)) == "SKIP" && capture.note.find("graph capture failed") == 0 &&
             capture.note.find("cudaErrorStreamCaptureUnsupported") != std::string::npos,
         "a failed graph capture is a SKIP naming the error");
  expect(std::string(Status(Skipped("not co-resident"))) == "SKIP", "not co-resident: SKIP");
  expect(std::string(Status(CaseResult{})) == "PASS", "a run case: PASS");
  expect(std::string(Status(CaseResult{false, "x"})) == "FAIL", "a failed case: FAIL");
  bad += LaunchSelfTest();
  bad += StreamSelfTest();
  std::printf("selftest: %s\n", bad ? "FAIL" : "PASS");
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s check|bench|selftest [options]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  std::vector<int> ranks = {2, 4, 8};
  std::vector<int> blocks = {1, 2, 4, 8, 16, 32, 64};
  std::size_t min_bytes = 64 << 10, max_bytes = std::size_t{1} << 30;
  std::size_t contend_bytes = std::size_t{64} << 20;
  double budget_s = 120;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string key = argv[i], value = argv[i + 1];
    if (key == "--ranks") ranks = ParseInts(value);
    else if (key == "--blocks") blocks = ParseInts(value);
    else if (key == "--min-bytes") min_bytes = ParseBytes(value);
    else if (key == "--max-bytes") max_bytes = ParseBytes(value);
    else if (key == "--bytes") contend_bytes = ParseBytes(value);
    else if (key == "--budget-s") budget_s = std::atof(value.c_str());
    else if (key == "--csv") g_csv = std::fopen(value.c_str(), "a");  // one file, all modes
    else {
      std::fprintf(stderr, "unknown option %s\n", key.c_str());
      return 2;
    }
  }
  if (mode == "selftest") return SelfTest();
  int device = 0;
  CHECK_CUDA(cudaSetDevice(device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  int co_resident = 0, virtual_co_resident = 0;
  CHECK_CUDA(lc::MaxCoResidentBlocks(&co_resident));
  CHECK_CUDA(lc::MaxCoResidentBlocks(&virtual_co_resident, /*virtual_team=*/true));
  char line[1024];
  std::snprintf(line, sizeof line,
                "device,%s,sm_%d%d,%d SMs,%d co-resident blocks,%d of the virtual-rank kernel",
                prop.name, prop.major, prop.minor, prop.multiProcessorCount, co_resident,
                virtual_co_resident);
  Emit(line);
  if (mode == "check") {
    CheckAll(device, ranks);
  } else if (mode == "bench") {
    Bench(device, ranks, min_bytes, max_bytes, blocks, budget_s);
  } else if (mode == "contend") {
    Contend(ranks.front(), contend_bytes, blocks);
  } else {
    std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  Emit(std::string("summary,") + mode + "," + (g_failures ? "FAIL" : "PASS") + "," +
       std::to_string(g_failures) + " failures");
  if (g_csv) std::fclose(g_csv);
  return g_failures ? 1 : 0;
}
