"""Headless Chromium driven over the DevTools protocol, for tests that look at a page as a
person would. Only the Debian `chromium` package and `websockets` (a Prefect dependency)
are needed: no browser download, no driver.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from websockets.sync.client import connect

# Flags that work on these machines: the background-networking ones stop Chromium from
# calling Google's hosts, which a closed network refuses many times over.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-address=127.0.0.1",
    "--remote-debugging-port=0",
    "--window-size=1280,2000",
]


def chromium_binary() -> str | None:
    """The Chromium executable on PATH, if any."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Page:
    """One browser tab: navigate, read its text, take a screenshot."""

    def __init__(self, ws_url: str) -> None:
        self._ws = connect(ws_url, max_size=None, open_timeout=10)
        self._ids = itertools.count(1)

    def call(self, method: str, timeout_s: float = 30.0, **params) -> dict:
        """Send one DevTools command and return its result (events are skipped)."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout_s
        while True:
            reply = json.loads(self._ws.recv(timeout=max(deadline - time.monotonic(), 0.1)))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def goto(self, url: str) -> None:
        """Load `url` (the page's own scripts go on running afterwards)."""
        self.call("Page.enable")
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        """The page's visible text."""
        result = self.call(
            "Runtime.evaluate", expression="document.body ? document.body.innerText : ''"
        )
        return result["result"].get("value", "")

    def wait_for_text(self, *needles: str, timeout_s: float = 60.0) -> str:
        """Wait until every needle is on the page; returns the text (raises with it)."""
        deadline = time.monotonic() + timeout_s
        while True:
            text = self.text()
            if all(n in text for n in needles) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        missing = [n for n in needles if n not in text]
        if missing:
            raise AssertionError(f"not on the page after {timeout_s:.0f}s: {missing}\n{text}")
        return text

    def screenshot(self, path: Path) -> Path:
        """Save a PNG of the whole page."""
        path.parent.mkdir(parents=True, exist_ok=True)
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        """Close the connection to the tab."""
        self._ws.close()


@contextlib.contextmanager
def headless_chromium(profile: Path, binary: str) -> Iterator[Page]:
    """A fresh headless Chromium (its own profile directory) and its first tab."""
    profile.mkdir(parents=True, exist_ok=True)
    log = (profile / "chromium.log").open("w")
    proc = subprocess.Popen(
        [binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    page = None
    try:
        port = _devtools_port(profile, proc)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
            targets = json.load(resp)
        tab = next(t for t in targets if t["type"] == "page")
        page = Page(tab["webSocketDebuggerUrl"])
        yield page
    finally:
        if page is not None:
            with contextlib.suppress(Exception):
                page.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
        # Renderer and helper processes share the group; none may outlive the test.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()


def _devtools_port(profile: Path, proc: subprocess.Popen, timeout_s: float = 30.0) -> int:
    # Chromium writes the port it chose (port 0 = any free one) to this file.
    marker = profile / "DevToolsActivePort"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited {proc.returncode}: see {profile}/chromium.log")
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.1)
    raise AssertionError(f"chromium opened no DevTools port in {timeout_s:.0f}s")
