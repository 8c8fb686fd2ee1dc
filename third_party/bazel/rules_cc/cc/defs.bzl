"""Pass-throughs to Bazel's native C++ rules, standing in for @rules_cc.

Bazel 4's @bazel_tools (and libra_jax's BUILD files) load the C++ rules from
@rules_cc//cc:defs.bzl; the real rules_cc would be downloaded, and Debian's
packaged one needs a newer Bazel. Bazel 4 still has every rule natively.
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def fdo_prefetch_hints(**kwargs):
    native.fdo_prefetch_hints(**kwargs)

def fdo_profile(**kwargs):
    native.fdo_profile(**kwargs)

def objc_import(**kwargs):
    native.objc_import(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)
