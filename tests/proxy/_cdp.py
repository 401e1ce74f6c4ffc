"""Headless Chromium driven through the Chrome DevTools Protocol over --remote-debugging-pipe.

With that flag Chromium reads protocol messages from fd 3 and writes replies and events to fd 4, each a JSON
object ended by a NUL byte: no websocket client, no npm, no downloaded browser, only Debian's `chromium`.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-pipe", "--window-size=1280,1500", "--hide-scrollbars"]  # fmt: skip


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    def __init__(self, profile: Path, binary: str):
        to_chrome_r, self._w = os.pipe()  # we write commands, Chromium reads them on fd 3
        self._r, from_chrome_w = os.pipe()  # Chromium writes replies on fd 4
        script = f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}'
        cmd = ["bash", "-c", script, binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"]
        self.log = profile.parent / "chromium.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                pass_fds=(to_chrome_r, from_chrome_w),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.replies: dict[int, queue.Queue] = {}
        self.next_id = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        self.session: str | None = None

    def _read(self) -> None:
        buf = b""
        while chunk := os.read(self._r, 1 << 16):
            buf += chunk
            *msgs, buf = buf.split(b"\0")
            for raw in msgs:
                msg = json.loads(raw)
                if "id" in msg and msg["id"] in self.replies:
                    self.replies[msg["id"]].put(msg)

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 30, **kw: Any) -> dict:
        with self.lock:
            self.next_id += 1
            mid = self.next_id
            self.replies[mid] = queue.Queue()
        msg = {"id": mid, "method": method, "params": params or {}}
        session = kw.get("session", self.session)
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        try:
            reply = self.replies[mid].get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no reply to {method} in {timeout} s; {self.log.read_text()[-2000:]}") from None
        if "error" in reply:
            raise AssertionError(f"{method}: {reply['error']}")
        return reply["result"]

    def open(self, url: str) -> None:
        """A new page at url; later calls go to it."""
        target = self.call("Target.createTarget", {"url": url}, session=None)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True}, session=None)[
            "sessionId"
        ]

    def eval(self, expression: str) -> Any:
        res = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in res:
            raise AssertionError(f"{expression}: {res['exceptionDetails']}")
        return res["result"].get("value")

    def dataset(self) -> dict[str, str]:
        return self.eval("document.body ? {...document.body.dataset} : {}") or {}

    def wait_dataset(self, check: Any, what: str, timeout: float = 30) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ds = self.dataset()
            if check(ds):
                return ds
            time.sleep(0.05)
        raise AssertionError(f"page never showed {what}; last data-*: {ds}")

    def set_files(self, selector: str, paths: list[Path], timeout: float = 30) -> None:
        """Give the file input `selector` these files. A page still loading can replace its document between
        getDocument and querySelector (the node ids then belong to the old one): ask again until it holds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                root = self.call("DOM.getDocument")["root"]["nodeId"]
                node = self.call("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
                self.call("DOM.setFileInputFiles", {"nodeId": node, "files": [str(p) for p in paths]})
                return
            except AssertionError as e:
                if "Could not find node" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def mouse(self, kind: str, x: float, y: float, **kw: Any) -> None:
        """A mouse event at CSS pixel (x, y): kind is mouseMoved, mousePressed, mouseReleased or mouseWheel."""
        self.call("Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, **kw})

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close", session=None, timeout=5)
        except (AssertionError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
