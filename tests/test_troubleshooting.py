"""Every notice libra_jax prints has a stable id, given literally where it is said
(`libra_jax.ops.base.warn_once`, `libra_jax.config.notice`), and an entry in
docs/troubleshooting.md anchored at that id; the text a user sees ends with the pointer to it."""
from __future__ import annotations

import ast
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import libra_jax
from libra_jax import config

PACKAGE = Path(libra_jax.__file__).parent
PAGE = PACKAGE.parent / config.TROUBLESHOOTING_PAGE
KEBAB = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
#: The functions that say a notice, and the only places `warnings.warn` may be called from.
SAYERS = {"warn_once", "notice"}
WARNERS = {("config.py", "notice"), ("ops/base.py", "warn_once")}


def _name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _literal_ids(node: ast.expr | None) -> list[str] | None:
    """The ids a call's first argument can be: a string literal, or a conditional between
    literals (`"gspmd-step" if gspmd else "no-psum"`); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        body, orelse = _literal_ids(node.body), _literal_ids(node.orelse)
        return None if body is None or orelse is None else body + orelse
    return None


def _sites() -> tuple[list[tuple[str, str]], list[str], list[str]]:
    """((id, where) per id at each notice call, call sites without literal ids, calls of
    `warnings.warn` outside the two functions that say notices)."""
    ids: list[tuple[str, str]] = []
    no_id: list[str] = []
    plain: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text())
        allowed: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and (rel, node.name) in WARNERS:
                allowed.update(id(n) for n in ast.walk(node))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            where = f"libra_jax/{rel}:{node.lineno}"
            name = _name(node.func)
            if name in SAYERS:
                first = node.args[0] if node.args else next(
                    (k.value for k in node.keywords if k.arg == "notice_id"), None)
                found = _literal_ids(first)
                if found is None:
                    no_id.append(where)
                else:
                    ids.extend((notice_id, where) for notice_id in found)
            elif (name == "warn" and isinstance(node.func, ast.Attribute)
                  and isinstance(node.func.value, ast.Name) and node.func.value.id == "warnings"
                  and id(node) not in allowed):
                plain.append(where)
    return ids, no_id, plain


def _anchors() -> list[str]:
    """The ids of docs/troubleshooting.md's entries: headings ``### `id` {#id}`` under their
    group's ``##`` heading."""
    anchors = []
    for line in PAGE.read_text().splitlines():
        if line.startswith("#") and "{#" in line:
            match = re.fullmatch(r"### `([^`]+)` \{#([^}]+)\}", line)
            assert match and match[1] == match[2], f"an entry's heading is ### `id` {{#id}}: {line}"
            anchors.append(match[2])
    return anchors


def test_every_notice_has_a_literal_kebab_case_id_of_its_own():
    ids, no_id, plain = _sites()
    assert len(ids) >= 10, ids  # the scan sees the call sites
    assert not no_id, f"notices without a literal id: {no_id}"
    assert not plain, f"warnings.warn without a notice id (use config.notice or warn_once): {plain}"
    bad = [(i, where) for i, where in ids if not KEBAB.fullmatch(i)]
    assert not bad, f"ids are kebab-case: {bad}"
    where: dict[str, list[str]] = {}
    for notice_id, site in ids:
        where.setdefault(notice_id, []).append(site)
    shared = {i: sites for i, sites in where.items() if len(sites) > 1}
    assert not shared, f"one id per situation, each said at one call site: {shared}"


def test_every_notice_has_an_entry_and_every_entry_a_notice():
    used = {i for i, _ in _sites()[0]}
    anchors = _anchors()
    assert len(anchors) == len(set(anchors)), anchors
    assert not used - set(anchors), f"notices without an entry in {PAGE.name}: {used - set(anchors)}"
    assert not set(anchors) - used, f"entries no notice uses: {set(anchors) - used}"


def test_the_pointer_format():
    text = config.notice_text("no-psum", "libra_jax.optimize: something")
    assert text == ("libra_jax.optimize: something "
                    "[libra_jax notice no-psum: docs/troubleshooting.md#no-psum]")
    with pytest.raises(ValueError, match="kebab-case"):
        config.notice_text("No_Psum", "x")


def _pointer(notice_id: str) -> str:
    return f" [libra_jax notice {notice_id}: docs/troubleshooting.md#{notice_id}]"


def test_a_notice_is_said_once_with_its_pointer(monkeypatch):
    import jax

    monkeypatch.setattr("libra_jax.ops.base._warned", set())
    x = np.ones(4, np.float32)
    with pytest.warns(UserWarning, match="the step has no psum and no jax.shard_map") as caught:
        libra_jax.optimize(lambda v: v * 2.0)(x)
    said = [str(w.message) for w in caught if "libra_jax notice" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(_pointer("no-psum")), said
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same message again: not said
        libra_jax.optimize(lambda v: v * 3.0)(x)
    # The other branch of the same call site: a step traced under a mesh is a GSPMD step.
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices("cpu")[:8])
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match="traced under the mesh") as caught:
        jax.jit(libra_jax.optimize(lambda v: v * 2.0))(x)
    said = [str(w.message) for w in caught if "libra_jax notice" in str(w.message)]
    assert len(said) == 1 and said[0].endswith(_pointer("gspmd-step")), said


def test_a_plain_notice_keeps_its_category_and_carries_its_pointer(monkeypatch, tmp_path):
    from libra_jax import model

    monkeypatch.setenv(config.PROFILE_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(model.read, "_warned_profiles", set())
    (tmp_path / "cpu.json").write_text("{not json")
    with pytest.warns(RuntimeWarning, match="ignoring the calibrated profile") as caught:
        assert model.default_profile("cpu") == "cpu-host"
    assert str(caught[0].message).endswith(_pointer("profile-ignored"))
    assert caught[0].filename == __file__  # stacklevel: the caller of default_profile
