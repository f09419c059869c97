"""Headless Chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`): no extra package.

    with Chromium.start(find_chromium()) as browser:   # find_chromium(): None when not installed
        page = browser.open("file:///.../report.html")
        page.errors                              # uncaught exceptions and console errors, as text
        page.evaluate("document.querySelectorAll('#findings-table tbody tr').length")
        page.screenshot(path)                    # PNG of the whole page

The protocol runs over file descriptors 3 (to the browser) and 4 (from it), one JSON message per
NUL-terminated chunk; a page is a target we attach to with a flat session.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    # this machine's network is closed: without these the browser's own connections are refused
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Page:
    def __init__(self, browser: Chromium, session: str):
        self.browser, self.session = browser, session
        self.errors: list[str] = []
        self.requests: list[str] = []  # every URL the page asked for, its own included

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.browser.call(method, params, session=self.session)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"evaluate failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, width: int = 1280) -> None:
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


class Chromium:
    def __init__(self, proc: subprocess.Popen, to_browser: int, from_browser: int, profile_dir: str):
        self.proc, self.profile_dir = proc, profile_dir
        self._out = os.fdopen(to_browser, "wb", buffering=0)
        self._in = os.fdopen(from_browser, "rb", buffering=0)
        self._buf = b""
        self._next_id = 0
        self.pages: dict[str, Page] = {}

    @classmethod
    def start(cls, executable: str) -> Chromium:
        profile_dir = tempfile.mkdtemp(prefix="opadvisor-chromium-")
        # the browser reads commands on its fd 3 and writes replies on its fd 4
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        os.set_inheritable(cmd_r, True)
        os.set_inheritable(res_w, True)

        def child_fds() -> None:
            # copies first: one of the ends may itself sit on 3 or 4
            cmd, res = os.dup(cmd_r), os.dup(res_w)
            os.dup2(cmd, 3)
            os.dup2(res, 4)

        proc = subprocess.Popen(
            [executable, *FLAGS, f"--user-data-dir={profile_dir}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_fds,
            pass_fds=(3, 4),  # kept open after preexec_fn put the pipe ends there
        )
        os.close(cmd_r)
        os.close(res_w)
        return cls(proc, cmd_w, res_r, profile_dir)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.call("Browser.close", {}, timeout=5)
        except Exception:  # noqa: BLE001 - closing anyway
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._out.close()
        self._in.close()
        shutil.rmtree(self.profile_dir, ignore_errors=True)

    # ---- protocol ----------------------------------------------------------------------------------
    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._in.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError(f"Chromium closed the pipe (exit code {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        page = self.pages.get(msg.get("sessionId", ""))
        if method == "Runtime.exceptionThrown" and page is not None:
            details = params["exceptionDetails"]
            page.errors.append(details.get("exception", {}).get("description") or details.get("text", ""))
        elif method == "Runtime.consoleAPICalled" and page is not None and params.get("type") == "error":
            page.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Log.entryAdded" and page is not None and params["entry"]["level"] == "error":
            page.errors.append(params["entry"]["text"])
        elif method == "Network.requestWillBeSent" and page is not None:
            page.requests.append(params["request"]["url"])

    def call(
        self, method: str, params: dict[str, Any], session: str | None = None, timeout: float = 30
    ) -> dict[str, Any]:
        self._next_id += 1
        msg: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self._out.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._dispatch(reply)

    def wait_for(self, method: str, session: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            msg = self._read_message(deadline)
            self._dispatch(msg)
            if msg.get("method") == method and msg.get("sessionId") == session:
                return

    def open(self, url: str) -> Page:
        """A new tab at `url`, after its load event, with error collection on from the start."""
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        page = self.pages[session] = Page(self, session)
        for domain in ("Page", "Runtime", "Log", "Network"):
            page.call(f"{domain}.enable")
        page.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired", session)
        return page
