#!/usr/bin/env bash
# Points the Bazel build at the XLA FFI headers of a Python's jaxlib, i.e. at
# `python -c "import jax; print(jax.ffi.include_dir())"`, by writing
#   build --repo_env=XLA_FFI_INCLUDE_DIR=<dir>
# to .bazelrc.user (gitignored; .bazelrc imports it). Other lines of
# .bazelrc.user are kept. Re-run it after switching to another jaxlib.
#
#   tools/bazel_configure.sh [python]        # default: python3
set -euo pipefail
python=${1:-python3}
repo=$(cd "$(dirname "$0")/.." && pwd)
include_dir=$("$python" -c 'import jax; print(jax.ffi.include_dir())')
if [ ! -f "$include_dir/xla/ffi/api/ffi.h" ]; then
  echo "bazel_configure: no XLA FFI headers under $include_dir" >&2
  exit 1
fi
rc="$repo/.bazelrc.user"
kept=$(grep -v 'XLA_FFI_INCLUDE_DIR' "$rc" 2>/dev/null || true)
{
  [ -z "$kept" ] || printf '%s\n' "$kept"
  printf '%s\n' "# XLA_FFI_INCLUDE_DIR: jaxlib's FFI headers ($python), by tools/bazel_configure.sh" \
    "build \"--repo_env=XLA_FFI_INCLUDE_DIR=$include_dir\""
} > "$rc.tmp"
mv "$rc.tmp" "$rc"
echo "bazel_configure: XLA_FFI_INCLUDE_DIR=$include_dir (in $rc)"
