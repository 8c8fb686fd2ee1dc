"""bzlmod extension for MODULE.bazel (Bazel 7+; untested, see docs/bazel.md).

Kept apart from jaxlib.bzl because Bazel 4 (the WORKSPACE build tested here)
has no `module_extension`.
"""

load(":jaxlib.bzl", "jaxlib_ffi_headers")

def _jaxlib_impl(module_ctx):
    jaxlib_ffi_headers(name = "xla_ffi_headers")

jaxlib = module_extension(
    implementation = _jaxlib_impl,
    doc = "Creates @xla_ffi_headers from the installed jaxlib (XLA_FFI_INCLUDE_DIR / PYTHON_BIN_PATH).",
)
