// XLA FFI handler: the CPU all-reduce custom call over the libra engine.
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

#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "libra/engine.h"

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

ffi::Error ToFfiError(const libra::Status& status) {
  using Code = libra::Status::Code;
  switch (status.code) {
    case Code::kOk: return ffi::Error::Success();
    case Code::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, status.message);
    case Code::kDeadlineExceeded: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, status.message);
    case Code::kCancelled: return ffi::Error(ffi::ErrorCode::kCancelled, status.message);
    case Code::kInternal: break;
  }
  return ffi::Error(ffi::ErrorCode::kInternal, status.message);
}

ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  ffi::Future future(promise);
  promise.SetError(std::move(error));
  return future;
}

ffi::Future Execute(ffi::RunId run_id, CpuAllReduceSite* site, ffi::AnyBuffer x,
                    ffi::Buffer<ffi::S32> rank_group, ffi::Result<ffi::AnyBuffer> out,
                    std::string_view label, int64_t world, int64_t blocks,
                    int64_t timeout_ms) {
  if (site == nullptr) {
    return Failed(ffi::Error::Internal("libra_jax all-reduce: no call-site state"));
  }
  ffi::ErrorOr<libra::DType> dtype = ToEngineDType(x.element_type());
  if (!dtype.has_value()) return Failed(dtype.error());
  if (out->element_type() != x.element_type() || out->size_bytes() != x.size_bytes()) {
    return Failed(ffi::Error::InvalidArgument(
        "libra_jax all-reduce: output must match the input's type and size"));
  }
  if (rank_group.element_count() != 2) {
    return Failed(ffi::Error::InvalidArgument(
        "libra_jax all-reduce: the rank operand must hold (rank, group)"));
  }
  libra::CallSpec spec;
  spec.rank = rank_group.typed_data()[0];
  spec.group = rank_group.typed_data()[1];
  spec.run_id = run_id.run_id;
  spec.world = static_cast<int>(world);
  spec.dtype = *dtype;
  spec.count = x.element_count();
  spec.blocks = static_cast<int>(blocks);
  spec.timeout_ms = timeout_ms;

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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceInstantiate, Instantiate,
                              ffi::Ffi::BindInstantiate()
                                  .Attr<std::string_view>("label")
                                  .Attr<int64_t>("world")
                                  .Attr<int64_t>("blocks")
                                  .Attr<int64_t>("timeout_ms"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(kCpuAllReduceExecute, Execute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::RunId>()
                                  .Ctx<ffi::State<CpuAllReduceSite>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<std::string_view>("label")
                                  .Attr<int64_t>("world")
                                  .Attr<int64_t>("blocks")
                                  .Attr<int64_t>("timeout_ms"));

const XLA_FFI_TypeInfo* CpuAllReduceSiteTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<CpuAllReduceSite>();
  return &info;
}

ffi::TypeId* CpuAllReduceSiteTypeId() { return &CpuAllReduceSite::id; }

}  // namespace libra_ffi

// The state type as C symbols, for a plain shared library loaded with ctypes
// (the Bazel build; LIBRA_JAX_FFI_LIBRARY in libra_jax/_ffi.py).
extern "C" XLA_FFI_TypeId* LibraCpuAllReduceSiteTypeId() {
  return libra_ffi::CpuAllReduceSiteTypeId();
}

extern "C" const XLA_FFI_TypeInfo* LibraCpuAllReduceSiteTypeInfo() {
  return libra_ffi::CpuAllReduceSiteTypeInfo();
}
