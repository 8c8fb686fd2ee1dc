"""The package as pip installs it: the installed metadata (PEP 639 license, classifiers, the
tested jax range), the vendored XLA FFI headers (third_party/xla_ffi), and the README's install
commands (the ordinary `pip install .` on CPU; the CUDA build's pinned wheels, as CI installs
them). In `.ci/run`'s wheel stage these tests read the metadata of the built wheel."""
from __future__ import annotations

import hashlib
import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

import libra_jax

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "third_party" / "xla_ffi"
HEADERS = ("api.h", "c_api.h", "ffi.h")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _oldest_jax() -> str:
    deps = _pyproject()["project"]["dependencies"]
    pin, = [d for d in deps if re.match(r"jax\b", d)]
    return re.fullmatch(r"jax>=([\d.]+)", pin).group(1)


def test_installed_metadata_has_an_spdx_license_and_the_tested_range():
    meta = importlib.metadata.metadata("libra_jax")
    assert meta["Version"] == libra_jax.__version__
    # PEP 639: an SPDX expression, not the license's text in a License: field.
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get("License") is None
    assert set(meta.get_all("License-File")) == {"LICENSE", "third_party/xla_ffi/LICENSE"}
    assert float(meta["Metadata-Version"]) >= 2.4
    classifiers = set(meta.get_all("Classifier"))
    tested_pythons = {"3.11", "3.12"}  # .ci/run's legs
    assert {c.rsplit(" :: ", 1)[1] for c in classifiers
            if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)} == tested_pythons
    assert not any("License ::" in c for c in classifiers)  # PEP 639 forbids both
    # The lower end of the tested jax range is the vendored headers' jaxlib.
    requires = meta.get_all("Requires-Dist")
    assert f"jax>={_oldest_jax()}" in requires
    assert meta["Requires-Python"] == ">=3.11"
    scripts = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="console_scripts")
               if ep.dist is not None and ep.dist.name == "libra_jax"}
    assert scripts == {"libra-jax": "libra_jax.cli:main"}


def test_vendored_ffi_headers_are_the_oldest_supported_jaxlibs():
    """third_party/xla_ffi holds jaxlib <oldest>'s headers, unmodified (the hashes its README
    records), and the build reads them, not the installed jaxlib's."""
    readme = (VENDORED / "README.md").read_text()
    assert f"**jaxlib {_oldest_jax()}**" in readme
    for name in HEADERS:
        digest = hashlib.sha256((VENDORED / "xla" / "ffi" / "api" / name).read_bytes()).hexdigest()
        assert f"{digest}  {name}" in readme, name
    assert "Apache License" in (VENDORED / "LICENSE").read_text()
    build = _pyproject()["build-system"]["requires"]
    assert not any(r.startswith(("jax", "jaxlib")) for r in build), build
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert "third_party/xla_ffi" in cmake and "import jaxlib" not in cmake


def test_vendored_headers_equal_the_installed_jaxlibs_where_it_is_the_oldest():
    import jaxlib

    if jaxlib.__version__ != _oldest_jax():
        pytest.skip(f"jaxlib {jaxlib.__version__} is not the oldest supported ({_oldest_jax()})")
    installed = Path(jaxlib.__file__).parent / "include" / "xla" / "ffi" / "api"
    for name in HEADERS:
        assert (installed / name).read_bytes() == (VENDORED / "xla" / "ffi" / "api" / name).read_bytes()


def _readme_command(marker: str) -> str:
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- {marker} -->\n```\n(.+?)\n```", text, re.S)
    assert found, marker
    return found.group(1)


def test_readme_cpu_install_is_the_ordinary_one():
    for marker in ("demo-command", "test-command"):
        command = _readme_command(marker)
        assert "--no-build-isolation" not in command and "pip install" in command, command
        assert "scikit-build-core" not in command  # the isolated build fetches it


def test_readme_cuda_install_pins_what_ci_builds_with():
    """The CUDA build's wheels (README) are the ones .ci/run installs for its one CUDA build,
    pinned to the GPU machine's driver's CUDA (13.0: PTX from a newer nvcc does not JIT there)."""
    command = _readme_command("cuda-build-command")
    wheels = re.compile(r"'?(nvidia-[a-z-]+==[\d.*]+)'?")
    readme_pins = set(wheels.findall(command))
    ci = (ROOT / ".ci" / "run").read_text()
    ci_pins = set(wheels.findall(ci))
    assert readme_pins and readme_pins == ci_pins, (readme_pins, ci_pins)
    assert {p.split("==")[0] for p in readme_pins} >= {
        "nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-nvvm", "nvidia-cuda-crt", "nvidia-cuda-cccl"}
    assert all(p.endswith("==13.0.*") for p in readme_pins)
    assert "--no-build-isolation" in command and "LIBRA_CUDA_FROM_WHEELS=ON" in command


def _private_jax_imports() -> set[str]:
    """What `libra_jax._compat` imports from private `jax._src` modules (lazily too)."""
    import ast

    tree = ast.parse((Path(libra_jax.__file__).parent / "_compat.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("jax._src"))
    return found


def test_install_page_counts_what_compat_imports_from_private_jax():
    text = (ROOT / "docs" / "install.md").read_text()
    count = re.search(r"imports (\d+) names from private `jax\._src` modules", text)
    assert count and int(count.group(1)) == len(_private_jax_imports()), sorted(_private_jax_imports())


def _configure(tmp_path: Path, site: Path, from_wheels: str):
    """CMake's configure step alone (no extension, no CUDA language wanted by the test)
    with a Python whose site-packages hold `site`."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("cmake") is None:
        pytest.skip("needs cmake")
    env = {k: v for k, v in os.environ.items() if k != "CUDACXX"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(tmp_path / f"build-{from_wheels}"),
         "-DLIBRA_BUILD_PYTHON=OFF", f"-DPython_EXECUTABLE={sys.executable}",
         f"-DLIBRA_CUDA_FROM_WHEELS={from_wheels}"],
        capture_output=True, text=True, env=env, timeout=300)


def test_cmake_passes_over_an_incomplete_cuda_wheel_tree_and_on_names_what_is_missing(tmp_path):
    """nvidia-cuda-nvcc without the CCCL wheel cannot compile cuda_fp16.h: AUTO must not take
    it (a build that worked with a system toolkit keeps working), ON must say what is missing."""
    tree = tmp_path / "site" / "nvidia" / "cu13"
    for part in ("bin/nvcc", "nvvm/bin/cicc", "include/cuda_runtime.h", "include/crt/host_config.h",
                 "lib/libcudart_static.a"):  # no include/cccl/nv/target
        (tree / part).parent.mkdir(parents=True, exist_ok=True)
        (tree / part).write_text("")
    (tree / "bin" / "nvcc").chmod(0o755)
    on = _configure(tmp_path, tmp_path / "site", "ON")
    assert on.returncode != 0
    assert "LIBRA_CUDA_FROM_WHEELS=ON but" in on.stderr and "include/cccl/nv/target" in on.stderr
    auto = _configure(tmp_path, tmp_path / "site", "AUTO")
    assert auto.returncode == 0, auto.stderr[-2000:]
    assert "not using the nvidia-cuda-nvcc wheel" in auto.stdout
    assert str(tree / "bin" / "nvcc") not in auto.stdout  # not the compiler CMake checked


def test_docs_requirements_are_the_docs_extra():
    """docs/requirements.txt (the README's docs build: no build of the extension) lists what
    pyproject.toml's [docs] extra does."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["docs"]
    lines = [line.strip() for line in (ROOT / "docs" / "requirements.txt").read_text().splitlines()]
    assert [line for line in lines if line and not line.startswith("#")] == extra


def test_readme_is_a_front_door():
    """At most 12 KB, set-up first: the two commands before the quickstarts that need them,
    each showing pip's progress (no -q)."""
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12_000
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "Set up" and sections[1] == "Quickstart", sections
    for marker in ("demo-command", "test-command", "cuda-build-command"):
        assert "pip install -q" not in _readme_command(marker)
