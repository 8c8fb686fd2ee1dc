"""The Bazel-built FFI library (docs/bazel.md), used from Python.

Builds //:libra_jax_ffi.so with Bazel against this interpreter's jaxlib (or
takes the library that LIBRA_JAX_FFI_LIBRARY already names) and runs
libra_jax.psum from it in a subprocess, bitwise against jax.lax.psum. Skips when
neither Bazel nor a prebuilt library is at hand.

LIBRA_JAX_BAZEL_OUTPUT_USER_ROOT, if set, is passed to Bazel as
--output_user_root (CI keeps it in a temporary directory it deletes).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import jax
from libra_jax import _ffi, _libra_ffi

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ffi_library() -> Path:
    prebuilt = os.environ.get(_ffi.FFI_LIBRARY_ENV)
    if prebuilt:
        return Path(prebuilt).resolve()
    bazel = shutil.which("bazel")
    if bazel is None:
        pytest.skip("bazel is not installed (Debian: apt-get install bazel-bootstrap)")
    if not (REPO / "WORKSPACE").is_file():
        pytest.skip("not in a source checkout")
    startup = []
    if os.environ.get("LIBRA_JAX_BAZEL_OUTPUT_USER_ROOT"):
        startup.append(f"--output_user_root={os.environ['LIBRA_JAX_BAZEL_OUTPUT_USER_ROOT']}")
    cmd = [bazel, *startup, "build", f"--repo_env=XLA_FFI_INCLUDE_DIR={jax.ffi.include_dir()}",
           "//:libra_jax_ffi.so"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-6000:]}"
    library = REPO / "bazel-bin" / "libra_jax_ffi.so"
    assert library.is_file(), proc.stderr[-3000:]
    return library.resolve()


SCRIPT = textwrap.dedent("""
    import functools, os
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_num_cpu_devices", 4)
    from jax.sharding import NamedSharding, PartitionSpec as P
    import libra_jax

    mesh = jax.make_mesh((4,), ("x",))
    def make(psum):
        return jax.jit(jax.shard_map(lambda v: psum(v, "x"), mesh=mesh, in_specs=P("x"),
                                     out_specs=P()))
    rng = np.random.default_rng(0)
    for dtype in (np.float32, jnp.bfloat16, np.int32):
        for blocks in (1, 3):
            x = (rng.standard_normal((4, 40000)) * 100).astype(dtype)
            x = jax.device_put(x, NamedSharding(mesh, P("x")))
            ours = make(functools.partial(libra_jax.psum, blocks=blocks))
            assert "libra_allreduce_cpu" in ours.lower(x).as_text()
            got, want = np.asarray(ours(x)), np.asarray(make(jax.lax.psum)(x))
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (dtype, blocks)
            print("ok", np.dtype(dtype).name, blocks)
    library = os.path.realpath(os.environ["LIBRA_JAX_FFI_LIBRARY"])
    print("mapped", library in open("/proc/self/maps").read())
""")


def test_allreduce_from_bazel_library(ffi_library):
    env = {**os.environ, "XLA_FLAGS": "", _ffi.FFI_LIBRARY_ENV: str(ffi_library)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok ") == 6, proc.stdout
    assert "mapped True" in proc.stdout, proc.stdout


def test_library_exports_only_the_ffi_symbols(ffi_library):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm")
    out = subprocess.run([nm, "-D", "--defined-only", str(ffi_library)], capture_output=True,
                         text=True, check=True).stdout
    symbols = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert symbols == ["LibraCpuAllReduceSiteTypeId", "LibraCpuAllReduceSiteTypeInfo",
                       "kCpuAllReduceDone", "kCpuAllReduceExecute", "kCpuAllReduceInstantiate",
                       "kCpuAllReduceStart", "kCpuAllReduceStartInstantiate"], symbols


@pytest.mark.parametrize("library", ["missing", "module"])
def test_bad_library_is_a_clear_error(monkeypatch, tmp_path, library):
    # The pip-built module is a shared library without the C symbols.
    path = tmp_path / "missing.so" if library == "missing" else Path(_libra_ffi.__file__)
    monkeypatch.setenv(_ffi.FFI_LIBRARY_ENV, str(path))
    with pytest.raises(RuntimeError, match="LIBRA_JAX_FFI_LIBRARY=.*not a libra_jax FFI library"):
        _ffi._cpu_handlers()
