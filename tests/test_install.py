"""What a user sees after installing: the clone's source tree, which has no built extension,
imported instead of the installed copy (issue 71's import trap).

README's demo installed with ``pip install '.[examples]'`` (not editable; it is editable now,
which removes the trap there, but any non-editable install beside a clone has it): Python
started in the clone (a script there, or ``python`` itself) puts the clone first on the path
and imports its ``libra_jax``, which has no ``_libra_ffi``. `import libra_jax` warns in one line naming both
folders and the fix; the pure layer and `build_info` work; the first use of the extension
raises a one-line ImportError, not a traceback from deep inside the user's tracing.

Simulated in a subprocess: a copy of the package's Python sources (no extension) as the
unbuilt clone, the current folder; a copy with the extension as the installed one, on
PYTHONPATH. An editable install's finder (scikit-build-core's, on ``sys.meta_path``) would
resolve ``libra_jax`` to the developer's checkout whatever the current folder is, so the
subprocess drops it first, as a non-editable install has none.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import libra_jax

PACKAGE = Path(libra_jax.__file__).resolve().parent

#: Run before the script: no editable finder, as after a non-editable install.
BOOT = textwrap.dedent("""
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path
                        if "_editable" not in type(f).__module__]
    sys.argv = ["script.py"]
    source = open("script.py").read()
    exec(compile(source, "script.py", "exec"), {"__name__": "__main__"})
""")

#: The user's script in the clone: the pure layer and build_info work, then a pmean inside a
#: jitted shard_map needs the extension.
SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import libra_jax
    print("FILE", libra_jax.__file__)
    import libra_jax.planner
    print("PROFILE", libra_jax.load_profile("cpu-host").name)
    print("INFO", json.dumps(libra_jax.build_info()))
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import PartitionSpec as P
    mesh = jax.sharding.Mesh(np.array(jax.devices("cpu")[:2]), ("data",))
    step = jax.jit(jax.shard_map(lambda x: libra_jax.pmean(x, "data"), mesh=mesh,
                                 in_specs=P("data"), out_specs=P("data")))
    print(step(jnp.arange(4.0)))
""")


def _copy_sources(to: Path) -> Path:
    """The package's Python sources (no extension, no caches) under `to`/libra_jax."""
    target = to / "libra_jax"
    shutil.copytree(PACKAGE, target, ignore=shutil.ignore_patterns("*.so", "*.pyd", "__pycache__"))
    return target


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    folder = tmp_path / "clone"
    folder.mkdir()
    _copy_sources(folder)
    (folder / "script.py").write_text(SCRIPT)
    return folder


@pytest.fixture
def installed(tmp_path: Path) -> Path:
    """A folder holding an installed libra_jax: the sources and the built extension (in an
    editable install the extension lives apart from the sources, in site-packages)."""
    from libra_jax import _libra_ffi

    folder = tmp_path / "site"
    folder.mkdir()
    shutil.copy2(_libra_ffi.__file__, _copy_sources(folder))
    return folder


def _run(clone: Path, pythonpath: Path | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([sys.executable, "-c", BOOT], cwd=clone, env=env, capture_output=True,
                          text=True, timeout=300)


def _check_error(proc: subprocess.CompletedProcess[str], clone: Path) -> str:
    """The run imported the clone, whose pure layer and build_info worked, and stopped at the
    pmean with a one-line ImportError raised where the user's code asked for it. Returns
    stderr's lines before the traceback."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines() if " " in line)
    assert Path(lines["FILE"]).resolve() == clone / "libra_jax" / "__init__.py", proc.stdout
    assert lines["PROFILE"] == "cpu-host"
    import json

    info = json.loads(lines["INFO"])
    assert info["extension"] is None and info["version"] == libra_jax.__version__
    assert f"not built in {clone / 'libra_jax'}" in info["runs_here"]

    stderr = proc.stderr
    assert "cannot import name '_libra_ffi'" not in stderr, stderr
    error = [line for line in stderr.splitlines() if line.startswith("ImportError")]
    assert len(error) == 1, stderr
    assert f"libra_jax: the compiled extension is not built in {clone / 'libra_jax'}" in error[0]
    assert "pip install -e ." in error[0]
    # Raised at the user's `libra_jax.pmean`, not from inside libra_jax's import chain.
    frames = [line for line in stderr.splitlines() if line.lstrip().startswith('File "')]
    assert not [f for f in frames if "importlib" in f or "_ffi.py" in f or "/ops/" in f], stderr
    assert frames[-1].strip().startswith(f'File "{clone / "libra_jax" / "__init__.py"}"'), stderr
    return stderr.split("Traceback (most recent call last)")[0]


def test_a_source_tree_shadowing_an_installed_copy_warns_and_fails_in_one_line(
        clone: Path, installed: Path) -> None:
    before = _check_error(_run(clone, installed), clone).strip().splitlines()
    assert len(before) == 1, before  # the warning, one line, at import
    warning = before[0]
    assert "SourceTreeWarning" in warning
    assert f"importing the source tree {clone / 'libra_jax'}" in warning
    assert f"not the installed copy {installed / 'libra_jax'}" in warning
    assert "run from another folder, or build the clone in place: pip install -e ." in warning


def test_a_source_tree_alone_fails_in_one_line_at_first_use(clone: Path) -> None:
    # No installed copy: nothing to warn about at import, the same one line at the pmean.
    before = _check_error(_run(clone, None), clone)
    assert before.strip() == "", before


def test_an_installed_copy_imports_without_a_warning(installed: Path, tmp_path: Path) -> None:
    # Run from another folder: the installed copy, its extension, no warning.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "script.py").write_text(
        "import libra_jax, libra_jax._ffi\nprint('FILE', libra_jax.__file__)\n"
        "print('EXT', libra_jax.build_info()['extension'])\n")
    proc = _run(other, installed)
    assert proc.returncode == 0 and "SourceTreeWarning" not in proc.stderr, proc.stderr
    out = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert Path(out["FILE"]).parent == installed / "libra_jax"
    assert Path(out["EXT"]).parent == installed / "libra_jax"


def test_the_readme_install_commands_show_the_builds_steps() -> None:
    """README says pip reports each step of the build (minutes on 2 cores). pip shows a
    PEP 517 build's output only with -v: without it, one "Building wheel ... started" line and
    "still running..." (pip/_internal/utils/subprocess.py hides it; scikit-build-core's
    build.verbose only makes the hidden output longer). With -v: scikit-build-core's
    "*** Configuring CMake...", "*** Building project with Ninja..." and ninja's "[n/24]" lines."""
    import re

    readme = (PACKAGE.parent / "README.md")
    if not readme.is_file():
        pytest.skip("not in a source checkout")
    text = readme.read_text()
    if "pip reports each step" not in text:
        pytest.skip("README no longer says pip reports each step")
    for marker in ("demo-command", "test-command"):
        found = re.search(rf"<!-- {marker} -->\n```\n(.+?)\n```", text, re.S)
        assert found, marker
        installs = re.findall(r"pip install[^&]*", found.group(1))
        assert installs and all(re.search(r"\s(-v|--verbose)\b", i) for i in installs), installs
