// Tests of libra's NCCL control path (libra/nccl.h) against the host-memory
// stub (nccl_stub.cc, whose path is argv[1]); run under ASan and TSan in CI.
// Ranks are threads of this process.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <unistd.h>

#include "libra/nccl.h"
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

void TestHierarchicalSlices() {
  // Slices tile the buffer in order, whatever the count.
  for (std::size_t count : {0, 1, 7, 8, 9, 1000}) {
    for (int parts : {1, 2, 3, 4, 8}) {
      std::size_t next = 0;
      for (int j = 0; j < parts; ++j) {
        const auto [offset, n] = nccl::HierarchicalSlice(count, parts, j);
        CHECK(offset == next);
        next = offset + n;
      }
      CHECK(next == count);
    }
  }
  CHECK(nccl::HierarchicalSlice(10, 4, 3) == std::make_pair(std::size_t{9}, std::size_t{1}));
  CHECK(nccl::HierarchicalSlice(10, 4, 4) == std::make_pair(std::size_t{0}, std::size_t{0}));
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

// What reaches the stub (which keeps NCCL's version rules): the CTA fields of a
// pinned communicator on 2.17-2.30, the channel maximum, no limit below 2.17.
void TestCtaLimitsReachNccl() {
  const std::string log = std::string(std::getenv("NCCL_STUB_DIR")) + "/cta.log";
  setenv("NCCL_STUB_LOG", log.c_str(), 1);
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
  const std::string log = std::string(std::getenv("NCCL_STUB_DIR")) + "/timeout.log";
  setenv("NCCL_STUB_LOG", log.c_str(), 1);
  const nccl::Library* lib = nullptr;
  nccl::Communicators& comms = nccl::Communicators::Get();
  CHECK(comms.Open(stub_path, &lib).ok() && lib != nullptr);
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
  nccl::Communicators& comms = nccl::Communicators::Get();
  CHECK(comms.Open(stub_path, &lib).ok() && lib != nullptr);
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
      {"hierarchical_slices", TestHierarchicalSlices},
      {"open", TestOpen},
      {"cta_limits_reach_nccl", TestCtaLimitsReachNccl},
      {"communicators", TestCommunicatorsConcurrently},
      {"missing_rank_times_out", TestMissingRankTimesOut},
  });
  std::string cleanup = std::string("rm -rf ") + dir;
  if (std::system(cleanup.c_str()) != 0) std::fprintf(stderr, "could not remove %s\n", dir);
  return status;
}
