// XLA FFI handlers: the CPU collectives' custom calls over the libra engine (the
// all-reduce, its start/done pair, the reduce-scatter, the all-gather and the all-to-all).
//
// One custom call site in one executable gets one CpuAllReduceSite, created at
// the instantiate stage and shared by every device of the executable (XLA:CPU
// instantiates once per call site per executable): it is the meeting point of
// that site's participants. The execute stage never blocks: it registers the
// device's buffers and returns a future that the engine completes once the
// last participant has arrived and the reduction is done (a blocking
// rendezvous deadlocks XLA's intra-op pool when a program has many
// independent all-reduces).
#include "xla_ffi/handlers.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "libra/engine.h"
#include "libra/thread_pool.h"
#include "xla_ffi/registry.h"  // the state type's C accessors

namespace libra_ffi {
namespace {

struct CpuAllReduceSite {
  static ffi::TypeId id;
  explicit CpuAllReduceSite(std::string label) : rendezvous(std::move(label)) {}
  libra::Rendezvous rendezvous;
};
ffi::TypeId CpuAllReduceSite::id = {};

// Every CPU target's call site: one rendezvous. The attributes every target's site carries
// (the starts add call_id): a label, the group size, the block count, the timeout and one
// segment per member (a sharded kind's run of one shard in elements, the all-to-all's
// exchanged segment; 0 for the all-reduce, and 0 for count / world).
ffi::ErrorOr<std::unique_ptr<CpuAllReduceSite>> Instantiate(
    std::string_view label, int64_t /*world*/, int64_t /*blocks*/, int64_t /*timeout_ms*/,
    ffi::Span<const int64_t> /*segments*/) {
  return std::make_unique<CpuAllReduceSite>(std::string(label));
}

ffi::ErrorOr<std::unique_ptr<CpuAllReduceSite>> InstantiateStart(
    std::string_view label, int64_t world, int64_t blocks, int64_t timeout_ms,
    ffi::Span<const int64_t> segments, int64_t /*call_id*/) {
  return Instantiate(label, world, blocks, timeout_ms, segments);
}

ffi::Error InvalidCall(libra::Collective kind, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string("libra_jax ") + libra::Name(kind) + ": " +
                                     message);
}

// One member of a call as its buffers have it: the element type, the full (unsharded)
// buffer's elements and bytes, and one rank's share in elements (the full buffer is the
// input, or for an all-gather the output; an all-reduce's and an all-to-all's share is the
// whole: each rank brings and gets `count` elements).
struct MemberBuffers {
  ffi::DataType type;
  std::size_t full = 0, share = 0, full_bytes = 0;
};

// The engine's call of kind `kind` over `members` (one buffer each per rank, all of one element
// type, member i in runs of segments[i] elements), or what is wrong with it.
ffi::ErrorOr<libra::CallSpec> MakeCallSpec(libra::Collective kind, ffi::RunId run_id,
                                           const std::vector<MemberBuffers>& members,
                                           ffi::Span<const int64_t> segments,
                                           ffi::Buffer<ffi::S32> rank_group, int64_t world,
                                           int64_t blocks, int64_t timeout_ms) {
  auto invalid = [&](const std::string& message) {
    return ffi::Unexpected(InvalidCall(kind, message));
  };
  if (world < 1) return invalid("world must be positive");
  if (rank_group.element_count() != 2) return invalid("the rank operand must hold (rank, group)");
  if (segments.size() != members.size()) {
    return invalid(std::to_string(segments.size()) + " segments for " +
                   std::to_string(members.size()) + " members: one per member");
  }
  const libra::Layout& layout = libra::LayoutOf(kind);
  libra::CallSpec spec;
  spec.collective = kind;
  std::size_t width = 1;  // Bytes per element where a copy moves bytes (DType::kBytes).
  if (!members.empty()) {
    const ffi::DataType type = members.front().type;
    ffi::ErrorOr<libra::DType> dtype = ToEngineDType(type);
    if (dtype.has_value()) {
      spec.dtype = *dtype;
    } else if (!layout.sums) {
      // A copy (the all-gather, the all-to-all) serves any element type of whole bytes (bool,
      // s8, fp8, u32, c64 ...) as bytes; its segments are then counted in bytes too.
      spec.dtype = libra::DType::kBytes;
      for (const MemberBuffers& m : members) {
        if (m.full == 0) continue;
        if (m.full_bytes % m.full != 0 || m.full_bytes < m.full) return ffi::Unexpected(dtype.error());
        width = m.full_bytes / m.full;
        break;
      }
    } else {
      return ffi::Unexpected(dtype.error());
    }
    for (std::size_t i = 0; i < members.size(); ++i) {
      const MemberBuffers& m = members[i];
      const std::string which = members.size() > 1 ? "member " + std::to_string(i) + ": " : "";
      if (m.type != type) return invalid(which + "every member must have the first's element type");
      if (segments[i] < 0) return invalid(which + "segment must not be negative");
      if (m.share * (layout.sharded() ? static_cast<std::size_t>(world) : 1) != m.full) {
        return invalid(which + (layout.sharded() ? "the full buffer must hold world shards"
                                                  : "output must match the input's size"));
      }
      spec.members.push_back({m.full * width, static_cast<std::size_t>(segments[i]) * width});
    }
  }
  spec.rank = rank_group.typed_data()[0];
  spec.group = rank_group.typed_data()[1];
  spec.run_id = run_id.run_id;
  spec.world = static_cast<int>(world);
  spec.blocks = static_cast<int>(blocks);
  spec.timeout_ms = timeout_ms;
  return spec;
}

// The operands and results of a call over members: operands [0, count) of `args` and results
// [0, count) of `rets`, member by member, as the engine call sees them (MemberBuffers).
struct CallBuffers {
  std::vector<ffi::AnyBuffer> in;
  std::vector<ffi::Result<ffi::AnyBuffer>> out;
  std::vector<MemberBuffers> members;
};

ffi::ErrorOr<CallBuffers> Members(libra::Collective kind, const ffi::RemainingArgs& args,
                                  const ffi::RemainingRets& rets, std::size_t count) {
  if (args.size() < count || rets.size() < count) {
    return ffi::Unexpected(InvalidCall(kind, "one operand and one result per member"));
  }
  const bool gathers = libra::LayoutOf(kind).shard_in;
  CallBuffers call;
  for (std::size_t i = 0; i < count; ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> x = args.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return ffi::Unexpected(x.error());
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = rets.get<ffi::AnyBuffer>(i);
    if (!out.has_value()) return ffi::Unexpected(out.error());
    if ((*out)->element_type() != x->element_type()) {
      return ffi::Unexpected(InvalidCall(kind, "output must have the input's element type"));
    }
    const ffi::AnyBuffer full = gathers ? **out : *x;
    call.members.push_back({x->element_type(), full.element_count(),
                            (gathers ? *x : **out).element_count(), full.size_bytes()});
    call.in.push_back(*x);
    call.out.push_back(*out);
  }
  return call;
}

// A started call (a start's round), from its start to the end of its round.
using RoundWaiter = std::function<void(const libra::Status&)>;
struct InFlight {
  std::mutex mu;
  bool finished = false;
  std::chrono::steady_clock::time_point finished_at;
  libra::Status status;
  std::vector<RoundWaiter> waiters;  // run, outside `mu`, with the round's status at its end

  // Runs `waiter` at the end of the round: now (on this thread) if it is over.
  void OnEnd(RoundWaiter waiter) {
    std::unique_lock<std::mutex> lock(mu);
    if (!finished) {
      waiters.push_back(std::move(waiter));
      return;
    }
    const libra::Status ended = status;
    lock.unlock();
    waiter(ended);
  }

  // The round's callback: records its end, then tells the waiters.
  void End(const libra::Status& ended) {
    std::vector<RoundWaiter> told;
    {
      std::lock_guard<std::mutex> lock(mu);
      finished = true;
      finished_at = std::chrono::steady_clock::now();
      status = ended;
      told.swap(waiters);
    }
    for (RoundWaiter& waiter : told) waiter(ended);
  }
};

// Started calls by (call id, run, group, rank), oldest first.
//
// An execution that fails between a start and its done (another all-reduce timed out, an
// error in between) never runs that done, and the FFI call cannot see the execution end. So
// an entry is dropped, at a later start, once its round is over and its done has not come
// for longer than the timeout: an execution still running would have reached its done by
// then, as its other ranks' next all-reduce would otherwise have timed out. (Its round is
// over, so no buffer pointer of it is held.) `Pending` counts entries, for tests.
class InFlightCalls {
 public:
  using Key = std::tuple<int64_t, int64_t, int64_t, int>;

  void Push(const Key& key, std::shared_ptr<InFlight> call, int64_t timeout_ms) {
    std::lock_guard<std::mutex> lock(mu_);
    ExpireLocked(timeout_ms);
    calls_[key].push_back(std::move(call));
  }

  std::size_t Pending() {
    std::lock_guard<std::mutex> lock(mu_);
    std::size_t n = 0;
    for (const auto& [key, calls] : calls_) n += calls.size();
    return n;
  }

  // The started calls of run `run_id` (every device's) whose done has not come and whose
  // round has not ended: the rounds whose engine workers may still write a buffer of
  // that execution that XLA would free if the execution ended now.
  std::vector<std::shared_ptr<InFlight>> Unfinished(int64_t run_id) {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<InFlight>> unfinished;
    // Keys sort by call id first: every entry is looked at (a handful in flight).
    for (const auto& [key, calls] : calls_) {
      if (std::get<1>(key) != run_id) continue;
      for (const std::shared_ptr<InFlight>& call : calls) {
        std::lock_guard<std::mutex> call_lock(call->mu);
        if (!call->finished) unfinished.push_back(call);
      }
    }
    return unfinished;
  }

  std::shared_ptr<InFlight> Pop(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(key);
    if (it == calls_.end()) return nullptr;
    std::shared_ptr<InFlight> call = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) calls_.erase(it);
    return call;
  }

  static InFlightCalls& Get() {
    static libra::NoDestructor<InFlightCalls> calls;  // XLA threads may outlive statics
    return *calls;
  }

 private:
  void ExpireLocked(int64_t timeout_ms) {
    if (timeout_ms <= 0) return;  // no timeout: nothing is known to have failed
    const auto now = std::chrono::steady_clock::now();
    const auto limit = std::chrono::milliseconds(timeout_ms);
    for (auto it = calls_.begin(); it != calls_.end();) {
      auto& calls = it->second;
      while (!calls.empty()) {
        std::lock_guard<std::mutex> lock(calls.front()->mu);
        if (!calls.front()->finished || now - calls.front()->finished_at < limit) break;
        if (libra::DebugLoggingEnabled()) {  // a bounded leak, said: one entry, no buffer
          const auto& [call_id, run_id, group, rank] = it->first;
          std::fprintf(stderr,
                       "libra_jax: dropped started call %lld (run %lld, group %lld, rank %d): its "
                       "round ended over %lld ms ago and its done never came (an execution "
                       "that failed between them)\n",
                       static_cast<long long>(call_id), static_cast<long long>(run_id),
                       static_cast<long long>(group), rank, static_cast<long long>(timeout_ms));
        }
        calls.pop_front();  // abandoned by a failed execution
      }
      it = calls.empty() ? calls_.erase(it) : std::next(it);
    }
  }

  std::mutex mu_;
  std::map<Key, std::deque<std::shared_ptr<InFlight>>> calls_;
};


// --- A failed call waits for its run's rounds in flight ---------------------------------
//
// A CPU start returns before its round has written the device's buffers (StartCall). When an
// execution fails between a start and its done, XLA ends the execution and frees its buffers
// as soon as no thunk of it is pending, while the engine's workers may still write the
// started round's buffers: heap corruption (issue 68: SIGSEGV, "malloc_consolidate():
// unaligned fastbin chunk detected"). So a libra call that fails (a done without its start,
// a round that timed out or was mismatched, bad arguments) does not complete its future with
// the error at once: it completes it once every started call of the same run (any device of
// the execution: a run id is shared by them all) whose done has not come has ended its round,
// by success or by the engine's timeout (engine.cc: a round with absent ranks is aborted at
// its deadline and no worker ever touches its buffers; a complete round's callbacks run after
// its last piece is written). Nothing blocks: the error is chained onto those rounds' ends.
// A wait is bounded by the timeout (a round in flight ends by then), and costs nothing on
// the success path.
//
// A failure outside libra between a start and its done (a callback raising, another custom
// call's error) is covered by the start's future itself: it stays pending until its round ends
// (StartCall), and XLA's executor does not end a failing execution while a thunk of it is
// pending.

// Completes `promise` with `error`: at once if it is a success or no started call of `run_id`
// is in flight, else once they have all ended (whatever their own status).
void CompleteAfterRounds(int64_t run_id, ffi::Promise promise, ffi::Error error) {
  if (error.success()) {
    promise.SetAvailable();
    return;
  }
  struct Pending {
    std::atomic<std::size_t> left{1};  // the rounds not ended, + 1 while they are chained
    ffi::Promise promise;
    ffi::Error error;
    void Release() {
      if (left.fetch_sub(1, std::memory_order_acq_rel) == 1) promise.SetError(std::move(error));
    }
  };
  auto pending = std::make_shared<Pending>();
  pending->promise = std::move(promise);
  pending->error = std::move(error);
  std::vector<std::shared_ptr<InFlight>> unfinished = InFlightCalls::Get().Unfinished(run_id);
  if (!unfinished.empty() && libra::DebugLoggingEnabled()) {
    std::fprintf(stderr,
                 "libra_jax: a failed call of run %lld waits for %zu started round(s) of its "
                 "run still in flight before it reports its error\n",
                 static_cast<long long>(run_id), unfinished.size());
  }
  pending->left.fetch_add(unfinished.size(), std::memory_order_relaxed);
  for (const std::shared_ptr<InFlight>& call : unfinished) {
    call->OnEnd([pending](const libra::Status&) { pending->Release(); });
  }
  pending->Release();
}

ffi::Future FailAfterRounds(ffi::RunId run_id, ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  CompleteAfterRounds(run_id.run_id, std::move(promise), std::move(error));
  return future;
}

// One call of kind kKind over a bucket's members where XLA keeps them: operand i is member i's
// input, result i its output (aliased to the operand where the all-reduce is in place). The
// device's buffers join the site's round, one pointer per member; the future completes when
// the engine has written every output of the round (or fails with its error).
template <libra::Collective kKind>
ffi::Future Execute(ffi::RunId run_id, CpuAllReduceSite* site, ffi::Buffer<ffi::S32> rank_group,
                    ffi::RemainingArgs args, ffi::RemainingRets rets, std::string_view /*label*/,
                    int64_t world, int64_t blocks, int64_t timeout_ms,
                    ffi::Span<const int64_t> segments) {
  if (site == nullptr) return FailAfterRounds(run_id, InvalidCall(kKind, "no call-site state"));
  if (args.size() != rets.size()) {
    return FailAfterRounds(run_id, InvalidCall(kKind, "as many results as operands: one of each per member"));
  }
  ffi::ErrorOr<CallBuffers> call = Members(kKind, args, rets, args.size());
  if (!call.has_value()) return FailAfterRounds(run_id, call.error());
  ffi::ErrorOr<libra::CallSpec> spec =
      MakeCallSpec(kKind, run_id, call->members, segments, rank_group, world, blocks, timeout_ms);
  if (!spec.has_value()) return FailAfterRounds(run_id, spec.error());
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (std::size_t i = 0; i < call->in.size(); ++i) {
    inputs.push_back(call->in[i].untyped_data());
    outputs.push_back(call->out[i]->untyped_data());
  }
  // reduce_on_caller stays off: the chunk would hold this XLA thread, which otherwise runs
  // the step's independent compute while the pool reduces. Measured on the MLP example's
  // optimized step (benchmarks/end_to_end.py --only mlp, 3 paired runs, 2-core VM): 0.90-1.00x
  // plain with it, 0.81-0.93x without; it gains only in an isolated psum (1 MiB: 0.67 against
  // 0.82 ms).
  ffi::Promise promise;
  ffi::Future future(promise);
  site->rendezvous.Arrive(*spec, std::move(inputs), std::move(outputs),
                          [promise, run = run_id.run_id](const libra::Status& status) mutable {
                            // A timeout or a mismatch: the run's started rounds end first.
                            CompleteAfterRounds(run, std::move(promise), ToFfiError(status));
                          });
  return future;
}

// --- Start/done (libra_jax.ops.start_done) ------------------------------------------
//
// start registers the device's buffer with its round and returns without blocking:
// its future completes when the round ends, and XLA's program goes on meanwhile with
// everything that does not read start's results; the reduction runs when the last
// rank arrives. done, which the rewrite places after the backward pass, returns
// a future for the end of that round (a failed call's, "A failed call waits" above). start's output aliases its input (the
// packed bucket, reduced in place) and done's aliases that, so XLA keeps the
// buffer alive, and neither reads nor reuses it, until done. start also writes
// a token, which its done reads (then the latest start's): they order done by
// data. done has a side effect, so XLA never removes it (libra_jax.ops.start_done).

// Whether a CPU start's future stays pending until its round ends (the default) rather than
// completing at once. LIBRA_JAX_CPU_START_RETURNS=1 (read once) restores the old behaviour,
// for measuring what the wait costs (docs/architecture.md, "Failed calls"); it gives up the
// guarantee for failures outside libra between a start and its done.
bool StartWaitsForRound() {
  static const bool waits = [] {
    const char* raw = std::getenv("LIBRA_JAX_CPU_START_RETURNS");
    return raw == nullptr || std::string_view(raw) != "1";
  }();
  return waits;
}

// Joins `spec`'s round with `inputs` and `outputs`; the round's end is recorded under
// (call id, run, group, rank) for done. The returned future completes when the round ends:
// XLA goes on meanwhile with whatever does not read start's results (the backward pass; done
// reads them), and an execution that fails in between (a callback raising) is not ended, nor
// its buffers freed, while a worker may still write them. `token` is zeroed: it only orders
// done after this start (by data).
ffi::Future StartCall(CpuAllReduceSite* site, const libra::CallSpec& spec,
                      std::vector<const void*> inputs, std::vector<void*> outputs,
                      ffi::Result<ffi::Buffer<ffi::S32>>& token, int64_t timeout_ms,
                      int64_t call_id) {
  for (std::size_t i = 0; i < token->element_count(); ++i) token->typed_data()[i] = 0;
  auto call = std::make_shared<InFlight>();
  ffi::Promise promise;
  ffi::Future future(promise);
  if (StartWaitsForRound()) {
    // Nobody else holds `call` yet: the first waiter, told before done's.
    call->waiters.push_back([promise, run = spec.run_id](const libra::Status& status) mutable {
      CompleteAfterRounds(run, std::move(promise), ToFfiError(status));
    });
  } else {
    promise.SetAvailable();
  }
  InFlightCalls::Get().Push({call_id, spec.run_id, spec.group, spec.rank}, call, timeout_ms);
  site->rendezvous.Arrive(spec, std::move(inputs), std::move(outputs),
                          [call](const libra::Status& status) { call->End(status); });
  return future;
}

// A start of kind kKind over a bucket's members, each in place in one flat buffer per device
// that stays in flight until done (engine.h: "In place"): operands are (rank, group), the
// members, then any values it must not run before (read by nothing: XLA orders by data only,
// and drops an optimization barrier on CPU, so `optimize` orders a start issued ahead by
// passing it the result it waits for); results are one buffer per member and done's token.
//  - all-reduce: member i's buffer is its input (aliased), summed in place;
//  - reduce-scatter: the buffer is the full input itself (aliased); rank r's shard of the sum
//    is written over it at offset r * shard, which done then slices;
//  - all-gather: the buffer is the full result, allocated by XLA; start first copies the
//    device's shard to offset r * shard in it, so the round reads the shards from the outputs
//    themselves and the input need not live until done.
// A buffer that is not its operand (XLA did not alias them) gets the operand's bytes first.
template <libra::Collective kKind>
ffi::Future ExecuteStart(ffi::RunId run_id, CpuAllReduceSite* site,
                         ffi::Buffer<ffi::S32> rank_group, ffi::RemainingArgs args,
                         ffi::RemainingRets rets, std::string_view /*label*/, int64_t world,
                         int64_t blocks, int64_t timeout_ms, ffi::Span<const int64_t> segments,
                         int64_t call_id) {
  if (site == nullptr) return FailAfterRounds(run_id, InvalidCall(kKind, "no call-site state"));
  if (rets.size() < 1) return FailAfterRounds(run_id, InvalidCall(kKind, "a start's last result is its token"));
  const std::size_t count = rets.size() - 1;
  ffi::ErrorOr<ffi::Result<ffi::Buffer<ffi::S32>>> token = rets.get<ffi::Buffer<ffi::S32>>(count);
  if (!token.has_value()) return FailAfterRounds(run_id, token.error());
  const libra::Layout& layout = libra::LayoutOf(kKind);
  ffi::ErrorOr<CallBuffers> call = Members(kKind, args, rets, count);
  if (!call.has_value()) return FailAfterRounds(run_id, call.error());
  // Start's buffer is the full buffer: the all-gather's one rank's share is the operand.
  for (std::size_t i = 0; i < count; ++i) {
    if (call->out[i]->size_bytes() !=
        call->in[i].size_bytes() * (layout.shard_in ? static_cast<std::size_t>(world) : 1)) {
      return FailAfterRounds(run_id, InvalidCall(kKind, layout.shard_in ? "output must hold world inputs"
                                                       : "output must be the input"));
    }
    if (!layout.shard_in) call->members[i].share = call->members[i].full / (
        layout.shard_out && world > 0 ? static_cast<std::size_t>(world) : 1);
  }
  ffi::ErrorOr<libra::CallSpec> spec =
      MakeCallSpec(kKind, run_id, call->members, segments, rank_group, world, blocks, timeout_ms);
  if (!spec.has_value()) return FailAfterRounds(run_id, spec.error());
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (std::size_t i = 0; i < count; ++i) {
    const libra::Member& member = spec->members[i];
    if (layout.sharded() && member.segment != 0 && member.segment * spec->world != member.count) {
      return FailAfterRounds(run_id, InvalidCall(kKind, "a start's buffer is one row of shards"));
    }
    char* buffer = static_cast<char*>(call->out[i]->untyped_data());
    const void* x = call->in[i].untyped_data();
    const std::size_t bytes = call->in[i].size_bytes();
    char* own = buffer + static_cast<std::size_t>(spec->rank) *
                             (call->out[i]->size_bytes() / static_cast<std::size_t>(world));
    if (layout.shard_in) {
      if (bytes > 0) std::memcpy(own, x, bytes);
      inputs.push_back(own);
      outputs.push_back(buffer);
      continue;
    }
    if (x != buffer && bytes > 0) std::memcpy(buffer, x, bytes);
    inputs.push_back(buffer);
    outputs.push_back(layout.shard_out ? own : buffer);
  }
  return StartCall(site, *spec, std::move(inputs), std::move(outputs), *token, timeout_ms,
                   call_id);
}

// Every CPU start's done: operands (rank, group), its own start's token, then its start's
// buffers (one per member, each aliased to one result) and any values it must not run before
// (the latest start's token: optimize orders every done after the last start), read by
// nothing. It waits for the round's end.
ffi::Future ExecuteDone(ffi::RunId run_id, ffi::Buffer<ffi::S32> rank_group,
                        ffi::AnyBuffer /*token*/, ffi::RemainingArgs /*started_then_after*/,
                        ffi::RemainingRets /*buffers*/, int64_t call_id) {
  if (rank_group.element_count() != 2) {
    return FailAfterRounds(run_id, ffi::Error::InvalidArgument(
        "libra_jax done: the rank operand must hold (rank, group)"));
  }
  const int32_t* rg = rank_group.typed_data();
  std::shared_ptr<InFlight> call =
      InFlightCalls::Get().Pop({call_id, run_id.run_id, rg[1], rg[0]});
  if (call == nullptr) {
    return FailAfterRounds(run_id, ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                              "libra_jax done: done of call " +
                                                  std::to_string(call_id) + " without its start"));
  }
  ffi::Promise promise;
  ffi::Future future(promise);
  call->OnEnd([promise, run = run_id.run_id](const libra::Status& status) mutable {
    // A round that failed: the run's other started rounds end first.
    CompleteAfterRounds(run, std::move(promise), ToFfiError(status));
  });
  return future;
}

// The attributes of a call site, shared by the one-call targets and the starts.
template <typename Binding>
auto BindSiteAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("label")
      .template Attr<int64_t>("world")
      .template Attr<int64_t>("blocks")
      .template Attr<int64_t>("timeout_ms")
      .template Attr<ffi::Span<const int64_t>>("segments");
}

// Every call's context and operands: (rank, group), then the members (and a start's values it
// must not run before), then the results.
auto EngineCall() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Ctx<ffi::State<CpuAllReduceSite>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .RemainingArgs()
      .RemainingRets();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceInstantiate, Instantiate, BindSiteAttrs(
                                  ffi::Ffi::BindInstantiate()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceExecute, Execute<libra::Collective::kAllReduce>,
                              BindSiteAttrs(EngineCall()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuReduceScatterExecute,
                              Execute<libra::Collective::kReduceScatter>,
                              BindSiteAttrs(EngineCall()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllGatherExecute, Execute<libra::Collective::kAllGather>,
                              BindSiteAttrs(EngineCall()));
// Operand i + 1 and result i are member i's input and output, of the same shape (each rank
// brings and gets `count` elements), never aliased (the engine refuses an output over an
// input); segments[i] is its exchanged segment in elements (0: count / world).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllToAllExecute, Execute<libra::Collective::kAllToAll>,
                              BindSiteAttrs(EngineCall()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceStartInstantiate, InstantiateStart,
                              BindSiteAttrs(ffi::Ffi::BindInstantiate()).Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceStart, ExecuteStart<libra::Collective::kAllReduce>,
                              BindSiteAttrs(EngineCall()).Attr<int64_t>("call_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuReduceScatterStart,
                              ExecuteStart<libra::Collective::kReduceScatter>,
                              BindSiteAttrs(EngineCall()).Attr<int64_t>("call_id"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllGatherStart, ExecuteStart<libra::Collective::kAllGather>,
                              BindSiteAttrs(EngineCall()).Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceDone, ExecuteDone,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<int64_t>("call_id"));

const XLA_FFI_TypeInfo* CpuAllReduceSiteTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<CpuAllReduceSite>();
  return &info;
}

ffi::TypeId* CpuAllReduceSiteTypeId() { return &CpuAllReduceSite::id; }

std::size_t CpuPendingStarts() { return InFlightCalls::Get().Pending(); }

}  // namespace libra_ffi

// The state type as C symbols: the registration table's (registry.cc), and
// exported by the Bazel library libra_jax_ffi.so as they were before the table.
extern "C" XLA_FFI_TypeId* LibraCpuAllReduceSiteTypeId() {
  return libra_ffi::CpuAllReduceSiteTypeId();
}

extern "C" const XLA_FFI_TypeInfo* LibraCpuAllReduceSiteTypeInfo() {
  return libra_ffi::CpuAllReduceSiteTypeInfo();
}
