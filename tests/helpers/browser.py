"""Headless Chromium (Debian's ``chromium``) driven over the DevTools protocol: open a page, wait
until its rendered text says what a person would look for, read it, count the images that
really decoded, take a screenshot. The Prefect UI is a single-page app that fetches after load,
so reading the DOM once at load time (``--dump-dom``) sees only its frame."""

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CHROMIUM = "chromium"


class Browser:
    def __init__(self, width: int = 1440, height: int = 1000):
        if shutil.which(CHROMIUM) is None:
            raise RuntimeError("chromium is not installed (make chromium)")
        self.profile = Path(tempfile.mkdtemp(prefix="ckptops-chromium-"))
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        port = self._port(timeout=30)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
            page = next(t for t in json.loads(reply.read()) if t["type"] == "page")
        self.socket = connect(page["webSocketDebuggerUrl"], max_size=64 << 20, open_timeout=10)
        self.ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")

    def _port(self, timeout: float) -> int:
        """Chromium writes the port it chose into DevToolsActivePort."""
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while not marker.exists() or not marker.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.1)
        return int(marker.read_text().split()[0])

    def call(self, method: str, timeout: float = 30, **params) -> dict:
        """One DevTools command and its result (events arriving meanwhile are skipped)."""
        number = next(self.ids)
        self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            message = json.loads(self.socket.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def open(self, url: str, until: list[str], timeout: float = 60) -> str:
        """Navigate and wait until the page's rendered text holds every string of ``until``;
        the text. Bounded: a page that never shows them fails with what it did show."""
        self.call("Page.navigate", url=url)
        try:
            return self.open_text(until, timeout)
        except AssertionError as e:
            raise AssertionError(f"{url}: {e}") from None

    def open_text(self, until: list[str], timeout: float = 60) -> str:
        """Wait, on the page already open (after a click), until its text holds ``until``."""
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.evaluate("document.body ? document.body.innerText : ''") or ""
            if all(s in text for s in until):
                return text
            time.sleep(0.25)
        missing = [s for s in until if s not in text]
        raise AssertionError(f"{missing} not shown within {timeout:.0f}s; the page shows: {text[:1500]!r}")

    def wait_images(self, count: int, timeout: float = 30) -> None:
        """Until ``count`` images have decoded (a plot renders after its markdown)."""
        deadline = time.monotonic() + timeout
        while self.decoded_images() < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.decoded_images()} images decoded, expected {count}")
            time.sleep(0.25)

    def decoded_images(self) -> int:
        """Images on the page that really decoded (a broken data: URI has no natural width)."""
        return self.evaluate(
            "Array.from(document.images).filter(i => i.complete && i.naturalWidth > 0).length"
        )

    def click_text(self, text: str) -> None:
        """Click the first button, tab or link whose own text is ``text`` (Prefect's tabs are
        ``li.p-tab``)."""
        found = self.evaluate(
            "(() => { const e = Array.from(document.querySelectorAll('button, a, [role=tab], li.p-tab'))"
            f".find(e => e.innerText.trim() === {json.dumps(text)}); if (e) {{ e.click(); return true; }}"
            " return false; })()"
        )
        if not found:
            raise AssertionError(f"no button, tab or link reads {text!r}")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.socket.close()
        finally:
            self.process.kill()
            self.process.wait(timeout=30)
            shutil.rmtree(self.profile, ignore_errors=True)
