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

ffi::ErrorOr<std::unique_ptr<CpuAllReduceSite>> Instantiate(
    std::string_view label, int64_t /*world*/, int64_t /*blocks*/,
    int64_t /*timeout_ms*/) {
  return std::make_unique<CpuAllReduceSite>(std::string(label));
}

// start's call sites carry one more attribute (call_id) and are instantiated alike.
ffi::ErrorOr<std::unique_ptr<CpuAllReduceSite>> InstantiateStart(
    std::string_view label, int64_t world, int64_t blocks, int64_t timeout_ms,
    int64_t /*call_id*/) {
  return Instantiate(label, world, blocks, timeout_ms);
}


ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

// The engine's call of kind `kind` over a full buffer of `full` elements (`full_bytes`
// bytes) of `type`, in shards of `shard` (`full` for an all-reduce), or what is wrong with it.
// `segment` (sharded kinds) is one shard's run, in elements.
ffi::ErrorOr<libra::CallSpec> MakeCallSpec(libra::Collective kind, ffi::RunId run_id,
                                           ffi::DataType type, std::size_t full,
                                           std::size_t shard, std::size_t full_bytes,
                                           ffi::Buffer<ffi::S32> rank_group, int64_t world,
                                           int64_t blocks, int64_t timeout_ms, int64_t segment) {
  const std::string what = std::string("libra_jax ") + libra::Name(kind) + ": ";
  auto invalid = [&](const std::string& message) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(what + message));
  };
  if (world < 1 || segment < 0) return invalid("world and segment must be positive");
  const bool sharded = libra::LayoutOf(kind).sharded();
  if (shard * (sharded ? static_cast<std::size_t>(world) : 1) != full) {
    return invalid(sharded ? "the full buffer must hold world shards"
                           : "output must match the input's size");
  }
  if (rank_group.element_count() != 2) return invalid("the rank operand must hold (rank, group)");
  libra::CallSpec spec;
  spec.collective = kind;
  spec.count = full;
  spec.segment = static_cast<std::size_t>(segment);
  ffi::ErrorOr<libra::DType> dtype = ToEngineDType(type);
  const bool gathers = libra::LayoutOf(kind).shard_in;
  if (dtype.has_value()) {
    spec.dtype = *dtype;
  } else if (gathers && full > 0 && full_bytes % full == 0 && full_bytes >= full) {
    // A copy serves any element type of whole bytes (bool, s8, fp8, u32, c64 ...) as bytes.
    const std::size_t width = full_bytes / full;
    spec.dtype = libra::DType::kBytes;
    spec.count = full_bytes;
    spec.segment *= width;
  } else if (gathers && full == 0) {
    spec.dtype = libra::DType::kBytes;
  } else {
    return ffi::Unexpected(dtype.error());
  }
  spec.rank = rank_group.typed_data()[0];
  spec.group = rank_group.typed_data()[1];
  spec.run_id = run_id.run_id;
  spec.world = static_cast<int>(world);
  spec.blocks = static_cast<int>(blocks);
  spec.timeout_ms = timeout_ms;
  return spec;
}

// The call of kind `kind` for one device's input `x` and output `out` (the full buffer is
// the input, or for an all-gather the output), or what is wrong with them.
ffi::ErrorOr<libra::CallSpec> MakeSpec(libra::Collective kind, ffi::RunId run_id,
                                       ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_group,
                                       ffi::Result<ffi::AnyBuffer>& out, int64_t world,
                                       int64_t blocks, int64_t timeout_ms, int64_t segment = 0) {
  if (out->element_type() != x.element_type()) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        std::string("libra_jax ") + libra::Name(kind) +
        ": output must have the input's element type"));
  }
  const bool gathers = libra::LayoutOf(kind).shard_in;
  return MakeCallSpec(kind, run_id, x.element_type(),
                      gathers ? out->element_count() : x.element_count(),
                      gathers ? x.element_count() : out->element_count(),
                      gathers ? out->size_bytes() : x.size_bytes(), rank_group, world, blocks,
                      timeout_ms, segment);
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

// Registers one device's buffers with the call site's rendezvous; the future completes when
// the engine has written every output of the round (or fails with its error).
ffi::Future Arrive(CpuAllReduceSite* site, const libra::CallSpec& spec, ffi::AnyBuffer x,
                   ffi::Result<ffi::AnyBuffer>& out) {
  // reduce_on_caller stays off: the chunk would hold this XLA thread, which otherwise runs
  // the step's independent compute while the pool reduces. Measured on the MLP example's
  // optimized step (benchmarks/end_to_end.py --only mlp, 3 paired runs, 2-core VM): 0.90-1.00x
  // plain with it, 0.81-0.93x without; it gains only in an isolated psum (1 MiB: 0.67 against
  // 0.82 ms).
  ffi::Promise promise;
  ffi::Future future(promise);
  site->rendezvous.Arrive(spec, x.untyped_data(), out->untyped_data(),
                          [promise](const libra::Status& status) mutable {
                            if (status.ok()) {
                              promise.SetAvailable();
                            } else {
                              promise.SetError(ToFfiError(status));
                            }
                          });
  return future;
}

ffi::Future Execute(ffi::RunId run_id, CpuAllReduceSite* site, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::S32> rank_group, ffi::Result<ffi::AnyBuffer> out,
                    std::string_view /*label*/, int64_t world, int64_t blocks,
                    int64_t timeout_ms) {
  if (site == nullptr) {
    return Failed(ffi::Error::Internal("libra_jax all-reduce: no call-site state"));
  }
  ffi::ErrorOr<libra::CallSpec> spec = MakeSpec(libra::Collective::kAllReduce, run_id, x,
                                                rank_group, out, world, blocks, timeout_ms);
  if (!spec.has_value()) return Failed(spec.error());
  return Arrive(site, *spec, x, out);
}

// The reduce-scatter and the all-gather (libra_jax.ops.reduce_scatter, .all_gather): the
// engine call above with the kind's row and one more attribute, `segment` (one shard's run
// in elements: the buffer is [outer][world][segment], engine.h). Their sites are the same
// type, instantiated alike.
ffi::ErrorOr<std::unique_ptr<CpuAllReduceSite>> InstantiateSharded(
    std::string_view label, int64_t world, int64_t blocks, int64_t timeout_ms,
    int64_t /*segment*/) {
  return Instantiate(label, world, blocks, timeout_ms);
}

ffi::ErrorOr<std::unique_ptr<CpuAllReduceSite>> InstantiateShardedStart(
    std::string_view label, int64_t world, int64_t blocks, int64_t timeout_ms,
    int64_t /*segment*/, int64_t /*call_id*/) {
  return Instantiate(label, world, blocks, timeout_ms);
}

template <libra::Collective kKind>
ffi::Future ExecuteSharded(ffi::RunId run_id, CpuAllReduceSite* site, ffi::AnyBuffer x,
                           ffi::Buffer<ffi::S32> rank_group, ffi::Result<ffi::AnyBuffer> out,
                           std::string_view /*label*/, int64_t world, int64_t blocks,
                           int64_t timeout_ms, int64_t segment) {
  if (site == nullptr) {
    return Failed(ffi::Error::Internal(std::string("libra_jax ") + libra::Name(kKind) +
                                       ": no call-site state"));
  }
  ffi::ErrorOr<libra::CallSpec> spec =
      MakeSpec(kKind, run_id, x, rank_group, out, world, blocks, timeout_ms, segment);
  if (!spec.has_value()) return Failed(spec.error());
  return Arrive(site, *spec, x, out);
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

// Joins `spec`'s round with `input` and `output` and returns at once; the round's end is
// recorded under (call id, run, group, rank) for done. `token` is zeroed: it only orders done
// after this start (by data).
ffi::Future StartCall(CpuAllReduceSite* site, const libra::CallSpec& spec, const void* input,
                      void* output, ffi::Result<ffi::Buffer<ffi::S32>>& token,
                      int64_t timeout_ms, int64_t call_id) {
  for (std::size_t i = 0; i < token->element_count(); ++i) token->typed_data()[i] = 0;
  auto call = std::make_shared<InFlight>();
  InFlightCalls::Get().Push({call_id, spec.run_id, spec.group, spec.rank}, call, timeout_ms);
  site->rendezvous.Arrive(spec, input, output,
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

ffi::Future ExecuteStart(ffi::RunId run_id, CpuAllReduceSite* site, ffi::AnyBuffer x,
                         ffi::Buffer<ffi::S32> rank_group, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::S32>> token, std::string_view /*label*/,
                         int64_t world, int64_t blocks, int64_t timeout_ms, int64_t call_id) {
  if (site == nullptr) {
    return Failed(ffi::Error::Internal("libra_jax all-reduce: no call-site state"));
  }
  ffi::ErrorOr<libra::CallSpec> spec = MakeSpec(libra::Collective::kAllReduce, run_id, x,
                                                rank_group, out, world, blocks, timeout_ms);
  if (!spec.has_value()) return Failed(spec.error());
  return StartCall(site, *spec, x.untyped_data(), out->untyped_data(), token, timeout_ms,
                   call_id);
}

// The sharded kinds' starts, in place in one flat buffer per device (engine.h: "In place"):
//  - reduce-scatter: the output is the full input itself (aliased); rank r's shard of the sum
//    is written over it at offset r * shard, which done then slices;
//  - all-gather: the output is the full buffer, allocated by XLA as start's result; start
//    first copies the device's shard to offset r * shard in it, so the round reads the shards
//    from the outputs themselves and the input need not live until done.
// Done is the all-reduce's (`libra_allreduce_cpu_done`): it waits for the round's end.
template <libra::Collective kKind>
ffi::Future ExecuteShardedStart(ffi::RunId run_id, CpuAllReduceSite* site, ffi::AnyBuffer x,
                                ffi::Buffer<ffi::S32> rank_group, ffi::RemainingArgs /*after*/,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::S32>> token,
                                std::string_view /*label*/, int64_t world, int64_t blocks,
                                int64_t timeout_ms, int64_t segment, int64_t call_id) {
  const std::string what = std::string("libra_jax ") + libra::Name(kKind) + " start: ";
  if (site == nullptr) return Failed(ffi::Error::Internal(what + "no call-site state"));
  const bool gathers = libra::LayoutOf(kKind).shard_in;
  if (out->element_type() != x.element_type() ||
      out->size_bytes() != x.size_bytes() * (gathers ? static_cast<std::size_t>(world) : 1)) {
    return Failed(ffi::Error::InvalidArgument(
        what + (gathers ? "output must hold world inputs" : "output must be the input")));
  }
  const std::size_t full = out->element_count();
  ffi::ErrorOr<libra::CallSpec> spec =
      MakeCallSpec(kKind, run_id, x.element_type(), full, world > 0 ? full / world : 0,
                   out->size_bytes(), rank_group, world, blocks, timeout_ms, segment);
  if (!spec.has_value()) return Failed(spec.error());
  if (spec->segment != 0 && spec->segment * spec->world != spec->count) {
    return Failed(ffi::Error::InvalidArgument(what + "a start's buffer is one row of shards"));
  }
  char* buffer = static_cast<char*>(out->untyped_data());
  char* own = buffer + static_cast<std::size_t>(spec->rank) * (out->size_bytes() / world);
  if (gathers) {
    std::memcpy(own, x.untyped_data(), x.size_bytes());
    return StartCall(site, *spec, own, buffer, token, timeout_ms, call_id);
  }
  if (x.untyped_data() != buffer) std::memcpy(buffer, x.untyped_data(), x.size_bytes());
  return StartCall(site, *spec, buffer, own, token, timeout_ms, call_id);
}

// Done's operands after its own start's token (`/*after*/`): values it must not run before,
// read by nothing (the latest start's token: optimize orders every done after the last start).
ffi::Future ExecuteDone(ffi::RunId run_id, ffi::AnyBuffer /*started*/,
                        ffi::Buffer<ffi::S32> rank_group, ffi::AnyBuffer /*token*/,
                        ffi::RemainingArgs /*after*/, ffi::Result<ffi::AnyBuffer> /*out*/,
                        int64_t call_id) {
  if (rank_group.element_count() != 2) {
    return Failed(ffi::Error::InvalidArgument(
        "libra_jax all-reduce: the rank operand must hold (rank, group)"));
  }
  const int32_t* rg = rank_group.typed_data();
  std::shared_ptr<InFlight> call =
      InFlightCalls::Get().Pop({call_id, run_id.run_id, rg[1], rg[0]});
  if (call == nullptr) {
    return Failed(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                             "libra_jax all-reduce: done of call " + std::to_string(call_id) +
                                 " without its start"));
  }
  std::lock_guard<std::mutex> lock(call->mu);
  if (call->finished) return Completed(call->status);
  ffi::Promise promise;
  ffi::Future future(promise);
  call->waiters.push_back(std::move(promise));
  return future;
}

// The attributes of a call site, shared by the one-call target and start.
template <typename Binding>
auto BindSiteAttrs(Binding binding) {
  return std::move(binding)
      .template Attr<std::string_view>("label")
      .template Attr<int64_t>("world")
      .template Attr<int64_t>("blocks")
      .template Attr<int64_t>("timeout_ms");
}

// The engine call's context, operands and result: the one-call targets'; the starts add a
// token result (and attributes: a call id, and the sharded kinds' segment).
auto EngineBuffers() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::RunId>()
      .Ctx<ffi::State<CpuAllReduceSite>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::AnyBuffer>();
}

auto BindEngineCall() { return BindSiteAttrs(EngineBuffers()); }

// The sharded starts' signature: start's operands, then any number of values it must not run
// before (read by nothing: XLA orders by data only, and drops an optimization barrier on CPU,
// so `optimize` orders an all-gather issued ahead by passing it the result it waits for), its
// results, then segment and call id.
auto BindShardedStart() {
  return BindSiteAttrs(ffi::Ffi::Bind()
                           .Ctx<ffi::RunId>()
                           .Ctx<ffi::State<CpuAllReduceSite>>()
                           .Arg<ffi::AnyBuffer>()
                           .Arg<ffi::Buffer<ffi::S32>>()
                           .RemainingArgs()
                           .Ret<ffi::AnyBuffer>()
                           .Ret<ffi::Buffer<ffi::S32>>())
      .Attr<int64_t>("segment")
      .Attr<int64_t>("call_id");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceInstantiate, Instantiate, BindSiteAttrs(
                                  ffi::Ffi::BindInstantiate()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceExecute, Execute, BindEngineCall());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuShardedInstantiate, InstantiateSharded,
                              BindSiteAttrs(ffi::Ffi::BindInstantiate()).Attr<int64_t>("segment"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuReduceScatterExecute,
                              ExecuteSharded<libra::Collective::kReduceScatter>,
                              BindEngineCall().Attr<int64_t>("segment"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllGatherExecute, ExecuteSharded<libra::Collective::kAllGather>,
                              BindEngineCall().Attr<int64_t>("segment"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceStartInstantiate, InstantiateStart,
                              BindSiteAttrs(ffi::Ffi::BindInstantiate()).Attr<int64_t>("call_id"));

// Start: the engine call's operands, its result (in place) and a token for done.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceStart, ExecuteStart,
                              BindSiteAttrs(EngineBuffers().Ret<ffi::Buffer<ffi::S32>>())
                                  .Attr<int64_t>("call_id"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuShardedStartInstantiate, InstantiateShardedStart,
                              BindSiteAttrs(ffi::Ffi::BindInstantiate())
                                  .Attr<int64_t>("segment")
                                  .Attr<int64_t>("call_id"));

// The sharded starts: start's signature with the segment attribute.
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuReduceScatterStart,
                              ExecuteShardedStart<libra::Collective::kReduceScatter>,
                              BindShardedStart());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllGatherStart,
                              ExecuteShardedStart<libra::Collective::kAllGather>,
                              BindShardedStart());

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceDone, ExecuteDone,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::AnyBuffer>()
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
