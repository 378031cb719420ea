"""A minimal headless-Chromium driver over the DevTools protocol (no Selenium, no Playwright).

Launches Debian's ``chromium`` with ``--remote-debugging-port=0``, reads the port it chose
from stderr, and speaks CDP to the first page over the websocket (``websockets``, which
uvicorn already installs): navigate, type, evaluate, screenshot.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class Browser:
    def __init__(self, binary: str, width: int = 1280, height: int = 900) -> None:
        self._profile = tempfile.mkdtemp(prefix="chromium-")
        self._proc = subprocess.Popen(
            [
                binary,
                "--headless=new",
                "--no-sandbox",  # CI runs as root in a container
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--remote-debugging-port=0",
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        port = self._devtools_port(deadline=time.monotonic() + 30)
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json()]
        page = next(t for t in pages if t["type"] == "page")
        self._stack = contextlib.ExitStack()
        self._ws = self._stack.enter_context(
            connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        )
        self._ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")

    def _devtools_port(self, deadline: float) -> int:
        assert self._proc.stderr is not None
        seen = []
        while time.monotonic() < deadline:
            line = self._proc.stderr.readline()
            if not line and self._proc.poll() is not None:
                break
            seen.append(line)
            if match := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(match.group(1))
        self.close()
        raise RuntimeError("chromium did not start:\n" + "".join(seen[-20:]))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One CDP command; events that arrive meanwhile are dropped."""
        msg_id = next(self._ids)
        self._ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self._ws.recv(timeout=60))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def goto(self, url: str, ready: str, timeout: float = 30) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for(ready, timeout)

    def wait_for(self, expression: str, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"waited {timeout}s for {expression!r}")

    def set_viewport(self, width: int, height: int) -> None:
        """Make the page's viewport exactly ``width`` x ``height`` CSS pixels (the window's
        size includes the browser's own frame), as the screen a test reasons about."""
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def type_into(self, selector: str, text: str) -> None:
        """Focus ``selector`` and type ``text`` as keyboard input."""
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        stack = getattr(self, "_stack", None)
        if stack is not None:
            stack.close()
        self._proc.kill()
        self._proc.wait(timeout=10)
        shutil.rmtree(self._profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def browser_required() -> bool:
    """CI sets DLLM_REQUIRE_BROWSER=1: there a missing Chromium fails instead of skipping."""
    return os.environ.get("DLLM_REQUIRE_BROWSER") == "1"
