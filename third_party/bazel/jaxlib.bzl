"""The XLA FFI headers that ship with the installed jaxlib, as a repository.

jaxlib's wheel carries exactly the headers of XLA's FFI API (what
`jax.ffi.include_dir()` returns: `<jaxlib>/include/xla/ffi/api/*.h`). Building
against them keeps the handlers in step with the jaxlib that will load them.
The repository takes them from, in order:

  * `XLA_FFI_INCLUDE_DIR`: the include directory itself, e.g.
    `bazel build --repo_env=XLA_FFI_INCLUDE_DIR="$(python -c 'import jax; print(jax.ffi.include_dir())')" ...`
    (tools/bazel_configure.sh writes that line to .bazelrc.user);
  * `PYTHON_BIN_PATH`: a Python with jaxlib installed, asked for the directory;
  * else `python3` on PATH.

The repository exposes `@<name>//:ffi`, a header-only cc_library whose users
`#include "xla/ffi/api/ffi.h"`.
"""

_BUILD = """\
load("@rules_cc//cc:defs.bzl", "cc_library")

# XLA's FFI API headers from jaxlib ({include_dir}).
cc_library(
    name = "ffi",
    hdrs = glob(["xla/ffi/api/*.h"]),
    includes = ["."],
    visibility = ["//visibility:public"],
)
"""

# Like CMakeLists.txt: no need to import (and initialise) jax itself.
_ASK_JAXLIB = "import jaxlib, os; print(os.path.join(os.path.dirname(jaxlib.__file__), 'include'))"

def _include_dir(rctx):
    include_dir = rctx.os.environ.get("XLA_FFI_INCLUDE_DIR", "")
    if include_dir:
        return include_dir
    python = rctx.os.environ.get("PYTHON_BIN_PATH", "") or "python3"
    if "/" not in python:
        found = rctx.which(python)
        if found == None:
            fail("libra_jax: no %s on PATH to find jaxlib's XLA FFI headers; " % python +
                 "set --repo_env=XLA_FFI_INCLUDE_DIR=... (see tools/bazel_configure.sh)")
        python = str(found)
    result = rctx.execute([python, "-c", _ASK_JAXLIB])
    if result.return_code != 0:
        fail("libra_jax: %s could not import jaxlib (%s); " % (python, result.stderr.strip()) +
             "set --repo_env=XLA_FFI_INCLUDE_DIR=... or PYTHON_BIN_PATH=... (see tools/bazel_configure.sh)")
    return result.stdout.strip()

def _jaxlib_ffi_headers_impl(rctx):
    include_dir = _include_dir(rctx)
    api = rctx.path(include_dir).get_child("xla").get_child("ffi").get_child("api")
    if not api.get_child("ffi.h").exists:
        fail("libra_jax: no XLA FFI headers (xla/ffi/api/ffi.h) under %s" % include_dir)
    for header in api.readdir():
        if header.basename.endswith(".h"):
            rctx.symlink(header, "xla/ffi/api/" + header.basename)
    rctx.file("BUILD.bazel", _BUILD.format(include_dir = include_dir))

jaxlib_ffi_headers = repository_rule(
    implementation = _jaxlib_ffi_headers_impl,
    environ = ["XLA_FFI_INCLUDE_DIR", "PYTHON_BIN_PATH"],
    # Re-read on every fetch: a reinstalled jaxlib may bring other headers.
    local = True,
    doc = "XLA FFI headers from the installed jaxlib (see the file's docstring).",
)
