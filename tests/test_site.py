"""The built documentation site as a reader's browser lays it out: no code block is cut at the
right edge. Every page of the site (mkdocs build, or the one built at ``$LIBRA_JAX_SITE``:
.ci/run's docs stage) is opened in headless Chromium at 1280 px and at 390 px (a phone), and
every ``pre`` and ``pre > code`` must fit its box (``scrollWidth <= clientWidth``: nothing to
scroll to sideways). docs/stylesheets/extra.css wraps long code lines to make it so.

Chromium is driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``: JSON
messages, NUL-terminated, on file descriptors 3 and 4), so nothing beyond the standard library
is needed. Skipped, saying why, where Chromium (Debian: ``apt-get install chromium``) or the
site (mkdocs: ``pip install -r docs/requirements.txt``) is missing.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WIDTHS = (1280, 390)
HEIGHT = 900

#: The measurement, run in each page at each width: every pre and pre > code that scrolls.
MEASURE = """(() => {
  const cut = [];
  const els = document.querySelectorAll('pre, pre > code');
  for (const el of els) {
    if (el.scrollWidth > el.clientWidth) {
      cut.push(`${el.tagName.toLowerCase()} scrollWidth ${el.scrollWidth} > clientWidth ` +
               `${el.clientWidth}: ${el.textContent.trim().split('\\n')[0].slice(0, 70)}`);
    }
  }
  return {pre: document.querySelectorAll('pre').length, cut: cut,
          width: document.documentElement.clientWidth};
})()"""


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: ``$LIBRA_JAX_SITE`` if set (it must hold a build), else built here with
    mkdocs --strict."""
    given = os.environ.get("LIBRA_JAX_SITE")
    if given:
        path = Path(given)
        assert (path / "index.html").is_file(), f"LIBRA_JAX_SITE={given} holds no built site"
        return path
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.is_file():
        pytest.skip("no built site: mkdocs is not installed (pip install -r "
                    "docs/requirements.txt), and LIBRA_JAX_SITE is not set")
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run([str(mkdocs), "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _above_4(fd: int) -> int:
    """`fd` moved to 10 or above: the redirections to fds 3 and 4 cannot overwrite it."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Browser:
    """Headless Chromium over the DevTools pipe: one tab, commands answered in order."""

    def __init__(self, exe: str):
        self.profile = tempfile.mkdtemp(prefix="libra-site-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        to_browser_r, from_browser_w = _above_4(to_browser_r), _above_4(from_browser_w)
        # The pipe's ends as the browser's fds 3 (commands) and 4 (replies), set by bash.
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}', exe,
             "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--mute-audio",
             "--hide-scrollbars", f"--user-data-dir={self.profile}", "--remote-debugging-pipe",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next = 0
        try:
            target = self.call("Target.createTarget", url="about:blank")["targetId"]
            self.session = self.call("Target.attachToTarget", targetId=target,
                                     flatten=True)["sessionId"]
            self.call("Page.enable", session=True)
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError("no answer from Chromium")
            ready, _, _ = select.select([self._from_browser], [], [], 0.5)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("Chromium closed its DevTools pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, session: bool = False, **params) -> int:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        return self._next

    def call(self, method: str, session: bool = False, timeout: float = 30, **params) -> dict:
        sent = self.send(method, session, **params)
        while True:
            message = self._read(timeout)
            if message.get("id") == sent:
                assert "error" not in message, (method, message["error"])
                return message["result"]

    def open(self, url: str, timeout: float = 30) -> None:
        """Navigates the tab to `url` and waits for its load event."""
        sent = self.send("Page.navigate", session=True, url=url)
        loaded = answered = False
        while not (loaded and answered):
            message = self._read(timeout)
            if message.get("id") == sent:
                assert "error" not in message and "errorText" not in message["result"], message
                answered = True
            elif message.get("method") == "Page.loadEventFired":
                loaded = answered  # a load event before the answer is the page before
        self.evaluate("document.fonts.ready.then(() => true)")

    def resize(self, width: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                  height=HEIGHT, deviceScaleFactor=1, mobile=False)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, result
        return result["result"]["value"]

    def close(self) -> None:
        try:
            self.send("Browser.close")
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)
        shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium to lay the site out (Debian: apt-get install chromium)")
    b = Browser(exe)
    yield b
    b.close()


def pages(site: Path) -> list[Path]:
    found = sorted(p for p in site.rglob("*.html") if p.name != "404.html")
    assert len(found) >= 20, found  # every page of the nav, the API pages included
    return found


def test_no_code_block_is_cut_at_the_right_edge(site, browser):
    """Every built page at 1280 and 390 px: no pre (or its code) scrolls sideways."""
    cut, measured = [], 0
    for page in pages(site):
        browser.resize(WIDTHS[0])
        browser.open(page.as_uri())
        for width in WIDTHS:
            browser.resize(width)
            found = browser.evaluate(MEASURE)
            assert found["width"] <= width, (page, width, found["width"])
            measured += found["pre"]
            cut += [f"{page.relative_to(site)} at {width} px: {c}" for c in found["cut"]]
    assert measured >= 50, measured  # the pages' code blocks were there to measure
    assert not cut, "code cut at the right edge:\n" + "\n".join(cut)


def test_the_stylesheet_wraps_code():
    """The rule that makes code fit, in the stylesheet mkdocs.yml loads (the browser check
    above measures what it does)."""
    css = (ROOT / "docs" / "stylesheets" / "extra.css").read_text()
    rule = re.search(r"\.md-typeset pre > code \{([^}]*)\}", css)
    assert rule and "white-space: pre-wrap" in rule.group(1), css
    assert "overflow-wrap: anywhere" in rule.group(1), css
    assert "stylesheets/extra.css" in (ROOT / "mkdocs.yml").read_text()
