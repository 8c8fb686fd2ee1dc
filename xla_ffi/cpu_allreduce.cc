// XLA FFI handlers: the CPU collectives' custom calls over the libra engine (the
// all-reduce, its start/done pair, the reduce-scatter and the all-gather).
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

#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
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
// segment per member (a sharded kind's run of one shard in elements; 0 for the all-reduce).
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

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

ffi::Error InvalidCall(libra::Collective kind, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string("libra_jax ") + libra::Name(kind) + ": " +
                                     message);
}

// One member of a call as its buffers have it: the element type, the full (unsharded)
// buffer's elements and bytes, and one rank's share in elements (the full buffer is the
// input, or for an all-gather the output; an all-reduce's share is the whole).
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
    } else if (layout.shard_in) {
      // A copy serves any element type of whole bytes (bool, s8, fp8, u32, c64 ...) as bytes.
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

ffi::Future Completed(const libra::Status& status) {
  ffi::Promise promise;
  ffi::Future future(promise);
  if (status.ok()) {
    promise.SetAvailable();
  } else {
    promise.SetError(ToFfiError(status));
  }
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
  if (site == nullptr) return Failed(InvalidCall(kKind, "no call-site state"));
  if (args.size() != rets.size()) {
    return Failed(InvalidCall(kKind, "as many results as operands: one of each per member"));
  }
  ffi::ErrorOr<CallBuffers> call = Members(kKind, args, rets, args.size());
  if (!call.has_value()) return Failed(call.error());
  ffi::ErrorOr<libra::CallSpec> spec =
      MakeCallSpec(kKind, run_id, call->members, segments, rank_group, world, blocks, timeout_ms);
  if (!spec.has_value()) return Failed(spec.error());
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
                          [promise](const libra::Status& status) mutable {
                            if (status.ok()) {
                              promise.SetAvailable();
                            } else {
                              promise.SetError(ToFfiError(status));
                            }
                          });
  return future;
}

// --- Start/done (libra_jax.ops.start_done) ------------------------------------------
//
// start registers the device's buffer with its round and returns at once, so
// XLA's program goes on with nothing pending; the reduction runs when the last
// rank arrives. done, which the rewrite places after the backward pass, returns
// a future for the end of that round. start's output aliases its input (the
// packed bucket, reduced in place) and done's aliases that, so XLA keeps the
// buffer alive, and neither reads nor reuses it, until done. start also writes
// a token, which its done reads (then the latest start's): they order done by
// data. done has a side effect, so XLA never removes it (libra_jax.ops.start_done).

struct InFlight {
  std::mutex mu;
  bool finished = false;
  std::chrono::steady_clock::time_point finished_at;
  libra::Status status;
  std::vector<ffi::Promise> waiters;
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

// Joins `spec`'s round with `inputs` and `outputs` and returns at once; the round's end is
// recorded under (call id, run, group, rank) for done. `token` is zeroed: it only orders done
// after this start (by data).
ffi::Future StartCall(CpuAllReduceSite* site, const libra::CallSpec& spec,
                      std::vector<const void*> inputs, std::vector<void*> outputs,
                      ffi::Result<ffi::Buffer<ffi::S32>>& token, int64_t timeout_ms,
                      int64_t call_id) {
  for (std::size_t i = 0; i < token->element_count(); ++i) token->typed_data()[i] = 0;
  auto call = std::make_shared<InFlight>();
  InFlightCalls::Get().Push({call_id, spec.run_id, spec.group, spec.rank}, call, timeout_ms);
  site->rendezvous.Arrive(spec, std::move(inputs), std::move(outputs),
                          [call](const libra::Status& status) {
                            std::vector<ffi::Promise> waiters;
                            {
                              std::lock_guard<std::mutex> lock(call->mu);
                              call->finished = true;
                              call->finished_at = std::chrono::steady_clock::now();
                              call->status = status;
                              waiters.swap(call->waiters);
                            }
                            for (ffi::Promise& waiter : waiters) {
                              if (status.ok()) {
                                waiter.SetAvailable();
                              } else {
                                waiter.SetError(ToFfiError(status));
                              }
                            }
                          });
  return Completed(libra::Status::Ok());
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
  if (site == nullptr) return Failed(InvalidCall(kKind, "no call-site state"));
  if (rets.size() < 1) return Failed(InvalidCall(kKind, "a start's last result is its token"));
  const std::size_t count = rets.size() - 1;
  ffi::ErrorOr<ffi::Result<ffi::Buffer<ffi::S32>>> token = rets.get<ffi::Buffer<ffi::S32>>(count);
  if (!token.has_value()) return Failed(token.error());
  const libra::Layout& layout = libra::LayoutOf(kKind);
  ffi::ErrorOr<CallBuffers> call = Members(kKind, args, rets, count);
  if (!call.has_value()) return Failed(call.error());
  // Start's buffer is the full buffer: the all-gather's one rank's share is the operand.
  for (std::size_t i = 0; i < count; ++i) {
    if (call->out[i]->size_bytes() !=
        call->in[i].size_bytes() * (layout.shard_in ? static_cast<std::size_t>(world) : 1)) {
      return Failed(InvalidCall(kKind, layout.shard_in ? "output must hold world inputs"
                                                       : "output must be the input"));
    }
    if (!layout.shard_in) call->members[i].share = call->members[i].full / (
        layout.shard_out && world > 0 ? static_cast<std::size_t>(world) : 1);
  }
  ffi::ErrorOr<libra::CallSpec> spec =
      MakeCallSpec(kKind, run_id, call->members, segments, rank_group, world, blocks, timeout_ms);
  if (!spec.has_value()) return Failed(spec.error());
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (std::size_t i = 0; i < count; ++i) {
    const libra::Member& member = spec->members[i];
    if (layout.sharded() && member.segment != 0 && member.segment * spec->world != member.count) {
      return Failed(InvalidCall(kKind, "a start's buffer is one row of shards"));
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
    return Failed(ffi::Error::InvalidArgument(
        "libra_jax done: the rank operand must hold (rank, group)"));
  }
  const int32_t* rg = rank_group.typed_data();
  std::shared_ptr<InFlight> call =
      InFlightCalls::Get().Pop({call_id, run_id.run_id, rg[1], rg[0]});
  if (call == nullptr) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "libra_jax done: done of call " + std::to_string(call_id) +
                                 " without its start"));
  }
  std::lock_guard<std::mutex> lock(call->mu);
  if (call->finished) return Completed(call->status);
  ffi::Promise promise;
  ffi::Future future(promise);
  call->waiters.push_back(std::move(promise));
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
