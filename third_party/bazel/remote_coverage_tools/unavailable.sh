#!/bin/sh
echo "bazel coverage is not available in libra_jax's offline Bazel 4 setup" >&2
exit 1
