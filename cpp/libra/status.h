// The outcome of a libra call: a code and, for an error, a message naming the
// problem. Shared by the engine, NCCL's control path and the FFI handlers
// (which turn it into an XLA error); no dependencies beyond the standard library.
#pragma once

#include <string>
#include <utility>

namespace libra {

struct Status {
  enum class Code {
    kOk,
    kInvalidArgument,
    kFailedPrecondition,  // a call out of order (a done without its start)
    kDeadlineExceeded,
    kCancelled,
    kInternal,
  };
  Code code = Code::kOk;
  std::string message;

  static Status Ok() { return {}; }
  static Status Error(Code code, std::string message) { return {code, std::move(message)}; }
  bool ok() const { return code == Code::kOk; }
};

}  // namespace libra
