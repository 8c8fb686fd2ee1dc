#include "libra/streams.h"

#include <string>

namespace libra {
namespace {

Status Failed(Status status, const char* what) {
  status.message = std::string("libra side stream: ") + what + ": " + status.message;
  return status;
}

}  // namespace

Status SideStreams::Stream(int device, void** stream) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = streams_.find(device);
  if (it != streams_.end()) {
    *stream = it->second;
    return Status::Ok();
  }
  const Status created = ops_.create(device, stream);
  if (!created.ok()) return Failed(created, "creating libra's stream");
  streams_.emplace(device, *stream);
  return Status::Ok();
}

Status SideStreams::Issue(int device, void* xla, const std::function<Status(void*)>& issue,
                          void** end) {
  void* side = nullptr;
  Status status = Stream(device, &side);
  if (!status.ok()) return status;
  // libra's stream waits for XLA's: the inputs are ready there.
  void* ready = nullptr;
  status = ops_.record(xla, &ready);
  if (status.ok()) status = ops_.wait(side, ready);
  if (!status.ok()) return Failed(status, "ordering libra's stream after XLA's");
  status = issue(side);
  if (!status.ok()) return status;
  status = ops_.record(side, end);
  return status.ok() ? status : Failed(status, "recording the call's end");
}

bool SideStreams::Stale(const Pending& p, std::chrono::steady_clock::time_point now,
                        bool same_id) const {
  const bool overdue = p.expire_ms > 0 ? now - p.started > std::chrono::milliseconds(p.expire_ms)
                                       : same_id;
  return overdue && ops_.query != nullptr && ops_.query(p.end) == 1;
}

Status SideStreams::Start(int device, int64_t call_id, void* xla,
                          const std::function<Status(void*)>& issue, int64_t expire_ms) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = std::chrono::steady_clock::now();
    for (auto it = pending_.begin(); it != pending_.end();) {
      const bool same = it->first == std::make_pair(device, call_id);
      if (Stale(it->second, now, same)) {  // its execution failed before its done
        if (ops_.release != nullptr) ops_.release(it->second.end);
        it = pending_.erase(it);
        ++expired_;
      } else {
        ++it;
      }
    }
    if (pending_.count({device, call_id})) {
      return Status::Error(Status::Code::kFailedPrecondition,
                           "call " + std::to_string(call_id) + " on GPU " +
                               std::to_string(device) +
                               " started again before its done (the same program running "
                               "twice at once?)");
    }
  }
  void* end = nullptr;
  const Status status = Issue(device, xla, issue, &end);
  if (!status.ok()) return status;
  std::lock_guard<std::mutex> lock(mu_);
  pending_[{device, call_id}] = {end, std::chrono::steady_clock::now(), expire_ms};
  return Status::Ok();
}

Status SideStreams::Done(int device, int64_t call_id, void* xla) {
  void* end = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = pending_.find({device, call_id});
    if (it == pending_.end()) {
      return Status::Error(Status::Code::kFailedPrecondition,
                           "done of call " + std::to_string(call_id) + " on GPU " +
                               std::to_string(device) + " without its start");
    }
    end = it->second.end;
    pending_.erase(it);
  }
  const Status status = ops_.wait(xla, end);
  return status.ok() ? status : Failed(status, "making XLA's stream wait for the call");
}

Status SideStreams::Call(int device, void* xla, const std::function<Status(void*)>& issue) {
  void* end = nullptr;
  Status status = Issue(device, xla, issue, &end);
  if (!status.ok()) return status;
  status = ops_.wait(xla, end);
  return status.ok() ? status : Failed(status, "making XLA's stream wait for the call");
}

std::size_t SideStreams::pending() {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_.size();
}

std::size_t SideStreams::expired() {
  std::lock_guard<std::mutex> lock(mu_);
  return expired_;
}

}  // namespace libra
