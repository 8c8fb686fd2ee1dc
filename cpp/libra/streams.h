// libra's own stream on each GPU, beside XLA's compute stream: where every
// libra GPU all-reduce that may overlap compute is issued (the P2P kernels'
// start, every NCCL call), and the hand-off between the two streams.
//
// Why one stream per GPU, and not XLA's: NCCL's rule for several
// communicators on one GPU (libra's, one per block count on NCCL 2.17-2.30,
// and XLA's own). Before 2.26 their operations must follow one total order
// (stream dependencies); from 2.26 NCCL derives the order from the host's
// launch order when NCCL_LAUNCH_ORDER_IMPLICIT=1 (2.31: the communicator's
// launchOrderImplicit). Issued on one stream per GPU, from the device's
// thread (XLA runs each device's program on its own thread), in program
// order, libra's calls have that order on every rank. And NCCL makes the
// launching stream wait for the communicator's own stream, so a call issued
// on XLA's stream would hold compute behind an all-reduce in flight.
//
// CUDA-free: streams and events are opaque pointers and the runtime calls are
// a table of functions (StreamOps: CUDA's in the handlers, recording fakes in
// cpp/tests/nccl_test.cc), so the ordering logic builds and is tested without
// a GPU.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <utility>

#include "libra/status.h"

namespace libra {

// The runtime calls SideStreams needs.
struct StreamOps {
  // A new non-blocking stream on `device`.
  Status (*create)(int device, void** stream) = nullptr;
  // An event recorded on `stream` now (the work queued on it so far).
  Status (*record)(void* stream, void** event) = nullptr;
  // Makes `stream` wait for `event`, then releases the event.
  Status (*wait)(void* stream, void* event) = nullptr;
  // Whether the work before `event` is done: 1 done, 0 not yet, -1 an error (the NCCL
  // watchdog's poll, libra/nccl.h).
  int (*query)(void* event) = nullptr;
  // Releases an event nobody waits for.
  void (*release)(void* event) = nullptr;
};

class SideStreams {
 public:
  explicit SideStreams(StreamOps ops) : ops_(ops) {}
  SideStreams(const SideStreams&) = delete;
  SideStreams& operator=(const SideStreams&) = delete;

  // Issues `issue(side)` on libra's stream of `device` after the work queued on
  // `xla` so far (its inputs are ready there) and keeps the end of it under
  // (device, call_id) for Done. A call id still pending is an error, unless that
  // call is stale: its work has ended and its done has not come within
  // `expire_ms` (an execution that failed between its start and its done; 0, no
  // timeout: as soon as its work has ended). Stale entries of other calls are
  // dropped too (where they have an expiry), so none outlives a failed execution.
  Status Start(int device, int64_t call_id, void* xla,
               const std::function<Status(void* side)>& issue, int64_t expire_ms = 0);
  // Makes `xla` wait for the end of call (device, call_id).
  Status Done(int device, int64_t call_id, void* xla);
  // Start and Done at once: one call that runs on libra's stream while XLA's
  // stream waits for it (a synchronous call, still ordered with libra's others).
  Status Call(int device, void* xla, const std::function<Status(void* side)>& issue);

  // libra's stream on `device`, created on first use and never destroyed.
  Status Stream(int device, void** stream);
  // Calls started and not yet done (stale ones until a later start drops them), and
  // how many stale ones were dropped so far.
  std::size_t pending();
  std::size_t expired();

 private:
  Status Issue(int device, void* xla, const std::function<Status(void*)>& issue, void** end);

  struct Pending {
    void* end;  // the call's end event
    std::chrono::steady_clock::time_point started;
    int64_t expire_ms;
  };
  // Whether `p`'s work has ended and its done is overdue (mu_ held).
  bool Stale(const Pending& p, std::chrono::steady_clock::time_point now, bool same_id) const;

  const StreamOps ops_;
  std::mutex mu_;
  std::map<int, void*> streams_;                           // per GPU
  std::map<std::pair<int, int64_t>, Pending> pending_;     // (GPU, call id)
  std::size_t expired_ = 0;
};

}  // namespace libra
