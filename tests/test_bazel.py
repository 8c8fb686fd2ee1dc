"""The Bazel-built FFI library (docs/bazel.md), used from Python.

Builds //:libra_jax_ffi.so with Bazel against this interpreter's jaxlib (or
takes the library that LIBRA_JAX_FFI_LIBRARY already names) and runs
libra_jax.psum from it in a subprocess, bitwise against jax.lax.psum. Skips when
neither Bazel nor a prebuilt library is at hand.

LIBRA_JAX_BAZEL_OUTPUT_USER_ROOT, if set, is passed to Bazel as
--output_user_root (CI keeps it in a temporary directory it deletes).

The Bazel server the build starts (a JVM of about 220 MB, which would otherwise idle for 3 h)
is shut down after the module's tests (`bazel shutdown`, same startup options), and the
teardown checks that no server for that output base remains. Under pytest-xdist each worker
that runs these tests builds (a cached no-op after the first) and shuts down; a lock keeps one
worker's shutdown and check apart from another's build.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import jax
from jax.sharding import PartitionSpec as P

import libra_jax
from libra_jax import _ffi, _libra_ffi, collectives
from libra_jax.rewrite import optimize
from libra_jax.config import xla_flags

from conftest import mesh_of, mlp_step

REPO = Path(__file__).resolve().parents[1]


def _startup() -> list[str]:
    """Bazel's startup options: the output root CI names, else Bazel's default."""
    root = os.environ.get("LIBRA_JAX_BAZEL_OUTPUT_USER_ROOT")
    return [f"--output_user_root={root}"] if root else []


@contextlib.contextmanager
def _bazel_lock() -> Iterator[None]:
    """One process at a time builds, or shuts down and checks, this checkout's Bazel server
    (pytest-xdist workers each set the module's fixture up)."""
    key = hashlib.md5(str(REPO).encode()).hexdigest()
    with open(Path(tempfile.gettempdir()) / f"libra_jax_bazel_{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def bazel_servers(output_base: str) -> list[int]:
    """Pids of the Bazel servers of `output_base` (the server's command line names it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if f"--output_base={output_base}".encode() in args:
            found.append(int(proc.name))
    return found


def stop_bazel(bazel: str, output_base: str | None) -> list[int]:
    """`bazel shutdown` for this checkout (a no-op without a server); the servers of
    `output_base` still running after it (waited for up to 30 s): none, normally."""
    subprocess.run([bazel, *_startup(), "shutdown"], cwd=REPO, capture_output=True, text=True,
                   timeout=120)
    if output_base is None:
        return []
    deadline = time.monotonic() + 30
    while (left := bazel_servers(output_base)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@dataclasses.dataclass
class BazelBuild:
    library: Path  # the built //:libra_jax_ffi.so (a file under the output base)
    output_base: str
    servers: list[int]  # the output base's servers right after the build (its own, normally)
    left: list[int] | None = None  # those still running after the shutdown


@contextlib.contextmanager
def bazel_built_library(bazel: str) -> Iterator[BazelBuild]:
    """Build //:libra_jax_ffi.so with Bazel; on leaving, shut the Bazel server down (it idles
    3 h otherwise) and record in `BazelBuild.left` the servers still running."""
    cmd = [bazel, *_startup(), "build", f"--repo_env=XLA_FFI_INCLUDE_DIR={jax.ffi.include_dir()}",
           "//:libra_jax_ffi.so"]
    output_base = None
    try:
        with _bazel_lock():
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
            info = subprocess.run([bazel, *_startup(), "info", "output_base"], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
            output_base = info.stdout.strip() or None
            servers = bazel_servers(output_base) if output_base else []
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr[-6000:]}"
        assert output_base, f"bazel info output_base failed: {info.stderr[-2000:]}"
        library = REPO / "bazel-bin" / "libra_jax_ffi.so"
        assert library.is_file(), proc.stderr[-3000:]
        build = BazelBuild(library.resolve(), output_base, servers)
        yield build
    finally:
        with _bazel_lock():
            left = stop_bazel(bazel, output_base)
    build.left = left


def _bazel() -> str:
    """The bazel command; skips where there is none or no checkout to build."""
    bazel = shutil.which("bazel")
    if bazel is None:
        pytest.skip("bazel is not installed (Debian: apt-get install bazel-bootstrap)")
    if not (REPO / "WORKSPACE").is_file():
        pytest.skip("not in a source checkout")
    return bazel


@pytest.fixture(scope="module")
def ffi_library() -> Iterator[Path]:
    prebuilt = os.environ.get(_ffi.FFI_LIBRARY_ENV)
    if prebuilt:
        yield Path(prebuilt).resolve()
        return
    with bazel_built_library(_bazel()) as build:
        # The tests read the library's file, not the server.
        yield build.library
    assert not build.left, f"Bazel servers of {build.output_base} still running: {build.left}"


def test_the_bazel_server_the_build_starts_is_stopped(ffi_library):
    """The module's build and teardown, run here again (a cached build): a server of the
    output base runs after the build (so the check can fail) and none after leaving."""
    if os.environ.get(_ffi.FFI_LIBRARY_ENV):
        pytest.skip("a prebuilt library: no Bazel server is started")
    with bazel_built_library(_bazel()) as build:
        assert build.library == ffi_library
    assert build.servers, f"no server found for {build.output_base} after the build"
    assert build.left == [], f"Bazel servers of {build.output_base} still running: {build.left}"


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
    env = {**os.environ, "XLA_FLAGS": xla_flags(None), _ffi.FFI_LIBRARY_ENV: str(ffi_library)}
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
                       "LibraFfiRegistry", "kCpuAllReduceDone", "kCpuAllReduceExecute", "kCpuAllReduceInstantiate",
                       "kCpuAllReduceStart", "kCpuAllReduceStartInstantiate"], symbols


@pytest.mark.parametrize("library", ["missing", "module"])
def test_bad_library_is_a_clear_error(monkeypatch, tmp_path, library):
    # The pip-built module is a shared library without the C symbols.
    path = tmp_path / "missing.so" if library == "missing" else Path(_libra_ffi.__file__)
    monkeypatch.setenv(_ffi.FFI_LIBRARY_ENV, str(path))
    with pytest.raises(RuntimeError, match="LIBRA_JAX_FFI_LIBRARY=.*not a libra_jax FFI library"):
        _ffi._cpu_handlers()


# --- The one registration table (xla_ffi/registry.cc) -----------------------

def test_library_and_module_tables_name_the_same_targets(ffi_library):
    targets, types = _ffi.library_registry(str(ffi_library))
    module = _libra_ffi.registry()
    named = [(t["role"], t["name"], t["platform"]) for t in targets]
    assert named == [(t["role"], t["name"], t["platform"]) for t in module]
    assert [t["name"] for t in types] == list(_libra_ffi.types())
    assert all(t["type_id"] and t["type_info"] for t in types)
    stages = {t["name"]: t["stages"] for t in module}
    for t in targets:
        # The CPU targets have the same stages in both; the Bazel library has no CUDA.
        assert t["stages"] == (stages[t["name"]] if t["platform"] == "cpu" else []), t
        assert set(t["handlers"]) == set(t["stages"])
    # The module registers exactly the table's built targets, under the table's names.
    built = {t["name"] for t in module if t["stages"]}
    assert set(_libra_ffi.registrations()) | set(_libra_ffi.cuda_registrations()) == built
    assert {t["name"] for t in module if t["platform"] == "cpu"} == set(_libra_ffi.registrations())
    # Registering from the library gives the same names and stages as from the module.
    os.environ[_ffi.FFI_LIBRARY_ENV] = str(ffi_library)
    try:
        lib_types, lib_targets = _ffi._cpu_handlers()
    finally:
        del os.environ[_ffi.FFI_LIBRARY_ENV]
    mod_types, mod_targets = _libra_ffi.types(), _libra_ffi.registrations()
    assert list(lib_types) == list(mod_types)
    assert {n: sorted(v) if isinstance(v, dict) else None for n, v in lib_targets.items()} == \
           {n: sorted(v) if isinstance(v, dict) else None for n, v in mod_targets.items()}


def test_python_target_names_come_from_the_table():
    table = {t["role"]: t["name"] for t in _libra_ffi.registry()}
    assert _ffi.TARGETS == _libra_ffi.TARGETS == table
    assert set(table) == {"cpu", "cpu_start", "cpu_done", "cpu_reduce_scatter", "cpu_all_gather",
                          "cpu_all_to_all",
                          "cpu_reduce_scatter_start", "cpu_all_gather_start",
                          "cuda", "cuda_start", "cuda_done", "nccl", "nccl_start",
                          "nccl_reduce_scatter", "nccl_reduce_scatter_start", "nccl_all_gather",
                          "nccl_all_gather_start", "nccl_all_to_all"}
    # Every registered role and name follows from a collective's row by one rule
    # (libra_jax.collectives), which _ffi.target looks up; nothing else names a target.
    derived = {row.role(engine, phase): row.target(engine, phase) for row in collectives.ROWS
               for engine in collectives.ENGINES for phase in collectives.PHASES}
    assert table.items() <= derived.items(), set(table.items()) - set(derived.items())
    for role, name in table.items():
        engine, *rest = role.split("_")
        phase = rest[-1] if rest and rest[-1] in ("start", "done") else ""
        kind = next(r.kind for r in collectives.ROWS if r.role(engine, phase) == role)
        assert _ffi.target(kind, engine, phase) == name
    with pytest.raises(RuntimeError, match="no reduce-scatter target for cuda"):
        _ffi.target("reduce-scatter", "cuda")  # libra's P2P kernels are all-reduces
    package = Path(libra_jax.__file__).parent
    literal = re.compile(r"""["']libra_\w+_(cpu|cuda|nccl)(_start|_done)?["']""")
    assert not [p for p in package.rglob("*.py") if literal.search(p.read_text())]


@pytest.mark.usefixtures("jax_8")
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_every_target_python_lowers_to_is_in_the_table(monkeypatch, platform):
    monkeypatch.setenv("LIBRA_JAX_CUDA", "p2p")  # libra's kernels on cuda, not XLA's all-reduce
    table = set(_libra_ffi.TARGETS.values())
    mesh = mesh_of((8,), ("x",))
    step, (params, x) = mlp_step(sizes=(16, 32, 32, 8))
    psum = jax.shard_map(lambda v: libra_jax.psum(v, "x", blocks=2), mesh=mesh,
                         in_specs=P("x"), out_specs=P())
    called = set()
    for f, args in ((psum, (x,)), (optimize(step, fusion=False, overlap="start-done"), (params, x))):
        text = jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()
        called |= set(re.findall(r"custom_call @(libra_\w+)\(", text))
    assert called <= table, called - table
    if platform == "cpu" or _ffi.HAS_CUDA:  # without CUDA the cuda lowering is XLA's psum
        kind = "cpu" if platform == "cpu" else "cuda"
        assert called == {_ffi.TARGETS[kind], _ffi.TARGETS[kind + "_start"],
                          _ffi.TARGETS[kind + "_done"]}, called
