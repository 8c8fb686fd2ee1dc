"""Tests of libra_jax.config: every LIBRA_JAX_* setting read in one place, and a bad value is a
ValueError naming its variable (the timeout's end-to-end effects: tests/test_allreduce.py)."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from libra_jax import config

PACKAGE = Path(config.__file__).parent


def test_only_config_reads_libra_settings_from_the_environment():
    # One home: a module other than config that reads a LIBRA_JAX_* variable would be a second
    # place its parsing and its error live (the libraries' paths are read where they load).
    allowed = {"config.py": None, "_ffi.py": {"LIBRA_JAX_FFI_LIBRARY"},
               "_nccl.py": {"LIBRA_JAX_NCCL_LIBRARY"}}
    found = {}
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if "os.environ" not in text and "getenv" not in text:
            continue
        names = set(re.findall(r'"(LIBRA_JAX_[A-Z_]+)"', text))
        rel = str(path.relative_to(PACKAGE))
        if rel in allowed and (allowed[rel] is None or names <= allowed[rel]):
            continue
        if names:
            found[rel] = sorted(names)
    assert not found, found


@pytest.mark.parametrize("raw, seconds", [("", 300.0), ("2.5", 2.5), ("0", math.inf),
                                          ("inf", math.inf), ("1e7", 1e7), (" 3 ", 3.0)])
def test_timeout_seconds(monkeypatch, raw, seconds):
    monkeypatch.setenv(config.TIMEOUT_ENV, raw)
    assert config.timeout_s() == seconds


@pytest.mark.parametrize("seconds, ms", [(0.0004, 1), (1.0005, 1001), (300, 300_000),
                                         (1e7, 2**31 - 1), (math.inf, 2**31 - 1)])
def test_key_value_waits_are_whole_milliseconds_a_c_int_holds(seconds, ms):
    assert config.kv_wait_ms(seconds) == ms


@pytest.mark.parametrize("name, read, raw", [
    (config.CUDA_PATH_ENV, config.cuda_path, "nvlink"),
    (config.CUDA_ALGORITHM_ENV, config.cuda_algorithm, "threeshot"),
    (config.OVERLAP_ENV, lambda: config.overlap_mode(None), "later"),
    (config.TIMEOUT_ENV, config.timeout_s, "soon"),
    (config.NCCL_CTA_ROUTE_ENV, config.nccl_cta_route, "per-call"),
])
def test_a_bad_value_names_its_variable(monkeypatch, name, read, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(ValueError, match=re.escape(name)):
        read()


def test_choices_and_their_defaults(monkeypatch):
    for name in (config.CUDA_PATH_ENV, config.CUDA_ALGORITHM_ENV, config.OVERLAP_ENV,
                 config.DISABLE_ENV, config.NO_PROFILE_BROADCAST_ENV):
        monkeypatch.delenv(name, raising=False)
    assert config.cuda_path() == "xla"
    assert config.cuda_algorithm() == 0
    assert config.overlap_mode(None) == "auto"
    assert config.overlap_mode("sync") == "sync"
    assert not config.optimize_disabled() and config.profile_broadcast()
    monkeypatch.setenv(config.CUDA_PATH_ENV, " P2P ")
    monkeypatch.setenv(config.CUDA_ALGORITHM_ENV, "twoshot")
    monkeypatch.setenv(config.DISABLE_ENV, "1")
    monkeypatch.setenv(config.NO_PROFILE_BROADCAST_ENV, "1")
    assert config.cuda_path() == "p2p" and config.cuda_algorithm() == 2
    assert config.optimize_disabled() and not config.profile_broadcast()
    monkeypatch.setenv(config.DISABLE_ENV, "0")
    assert not config.optimize_disabled()
    with pytest.raises(ValueError, match="overlap must be one of"):
        config.overlap_mode("later")


@pytest.mark.parametrize("raw, route", [(None, "auto"), ("", "auto"), (" AUTO ", "auto"),
                                        ("per-collective", "per-collective"),
                                        (" Per-Communicator ", "per-communicator")])
def test_nccl_cta_route(monkeypatch, raw, route):
    # auto (the loaded NCCL's own route) unless one is forced; the extension checks the version.
    if raw is None:
        monkeypatch.delenv(config.NCCL_CTA_ROUTE_ENV, raising=False)
    else:
        monkeypatch.setenv(config.NCCL_CTA_ROUTE_ENV, raw)
    assert config.nccl_cta_route() == route
    assert route in config.NCCL_CTA_ROUTES


def test_calibrated_profile_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(config.PROFILE_DIR_ENV, str(tmp_path))
    assert config.calibrated_profile_dir() == tmp_path
    monkeypatch.delenv(config.PROFILE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert config.calibrated_profile_dir() == tmp_path / "cache" / "libra_jax" / "profiles"


def test_config_is_read_when_used_not_at_import():
    code = ("import os; from libra_jax import config; os.environ['LIBRA_JAX_TIMEOUT_S'] = '7'; "
            "print(config.timeout_ms())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "7000"


def test_xla_flags_keeps_the_callers_flags_and_adds_a_device_count_only_if_missing():
    isa = "--xla_cpu_max_isa=AVX2"
    count = "--xla_force_host_platform_device_count"
    assert config.xla_flags(8, "") == f"{count}=8"
    assert config.xla_flags(8, isa) == f"{isa} {count}=8"  # setdefault dropped the count
    assert config.xla_flags(8, f"{count}=4 {isa}") == f"{count}=4 {isa}"  # theirs, kept
    assert config.xla_flags(None, f"{count}=8 {isa}") == isa  # ="" dropped the ISA limit
    assert config.xla_flags(2, config.xla_flags(None, f"{count}=8 {isa}")) == f"{isa} {count}=2"
    for bad in (0, -1, True, 2.0, "8"):
        with pytest.raises(ValueError, match="host_devices must be a positive int"):
            config.xla_flags(bad, "")


def test_the_suite_adds_its_devices_to_the_callers_xla_flags():
    # CI's --xla_cpu_max_isa runs: conftest (setdefault before) kept the ISA limit and lost
    # the 8 devices; a subprocess test's XLA_FLAGS="" then dropped the ISA limit.
    script = ("import os, sys; sys.path.insert(0, sys.argv[1]); import conftest; "
              "print(os.environ['XLA_FLAGS'])")
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_max_isa=AVX"}
    out = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["--xla_cpu_max_isa=AVX", "--xla_force_host_platform_device_count=8"]
