"""Headless Chromium driven over the DevTools protocol on a pipe (stdlib only: no websocket
client, no browser download). Used by the report's browser test, its screenshots and its
page-size benchmark.

    with Chromium() as b:
        page = b.load("/tmp/gpt2.html")     # file URL, network off, waits for the charts
        page.errors, page.requests, page.render_ms, page.charts
        b.screenshot_element("#memory", "memory.png")

The network is switched off (`Network.emulateNetworkConditions` offline) before the page
loads, and every request that is not a file URL is recorded: a self-contained page makes none.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BINARIES = ("chromium", "chromium-browser", "google-chrome", "chrome")

# per chart: its div, whether plotly drew its SVG, and its traces' data as drawn
CHARTS_JS = """JSON.stringify(Array.from(document.querySelectorAll('.chart')).map(function(d){
return {id: d.id, svg: d.querySelectorAll('.main-svg').length, draw_ms: d.dataset.drawMs ?
Number(d.dataset.drawMs) : null, first: d.dataset.first === '1', traces: (d.data || []).map(
function(t){return {name: t.name, type: t.type, x: t.x, y: t.y, values: t.values,
ids: t.ids};})};}))"""

# the page's marks on <body> (ms from navigation) and its first contentful paint
MARKS_JS = """(function(b){if(!b)return null;var p=performance.getEntriesByName(
'first-contentful-paint')[0],d=b.dataset;return {rendered: d.rendered || null, errors:
d.errors || null, render_ms: d.renderMs || null, scripts_ms: d.scriptsMs || null, first:
d.firstMs || null, first_ms: d.firstMs || null, paint_ms: p ? Math.round(p.startTime) : null
};})(document.body)"""


def find_chromium() -> str | None:
    """The path of a Chromium (or Chrome) binary, or None."""
    for name in (os.environ.get("GOBRRR_CHROMIUM"), *BINARIES):
        if name and (path := shutil.which(name)):
            return path
    return None


@dataclass
class Page:
    """What loading one page showed: script errors and console errors, requests that were
    not file URLs, the page's own marks (ms from navigation: its text first painted, plotly.js
    run, the first screen drawn, every chart drawn), the number of charts the page says it
    drew, and each chart's data as drawn (and its own drawing time, `draw_ms`)."""

    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    render_ms: float | None = None
    scripts_ms: float | None = None
    first_ms: float | None = None
    paint_ms: float | None = None
    rendered: int | None = None
    load_s: float = 0.0
    charts: list[dict[str, Any]] = field(default_factory=list)


class Chromium:
    """One headless Chromium, one tab, spoken to over --remote-debugging-pipe."""

    def __init__(self, binary: str | None = None, width: int = 1280, height: int = 900) -> None:
        binary = binary or find_chromium()
        if binary is None:
            raise FileNotFoundError("no chromium binary found (apt-get install chromium)")
        self.profile = tempfile.mkdtemp(prefix="gobrrr-chromium-")
        cmd_r, self.cmd_w = os.pipe()
        self.res_r, res_w = os.pipe()
        args = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            # a fresh browser preloads its own omnibox popup (a WebUI renderer running ~400
            # modules) while the page loads: on a small machine that is CPU the page waits for
            "--disable-features=PreloadTopChromeWebUI,WebUIOmniboxPopup,WebUIOmniboxFullPopup,"
            "WebUIOmniboxAimPopup",
            "--remote-debugging-pipe",
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
            "about:blank",
        ]

        # the protocol's pipe: Chromium reads commands on fd 3 and writes replies on fd 4
        def pipe_fds() -> None:  # in the child, before exec; dup2 leaves them inheritable
            os.dup2(cmd_r, 3)
            os.dup2(res_w, 4)

        self.proc = subprocess.Popen(
            args,
            pass_fds=(3, 4),
            preexec_fn=pipe_fds,  # noqa: PLW1509 (no threads start chromium)
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=open(os.environ.get("GOBRRR_CHROMIUM_LOG", os.devnull), "ab"),  # noqa: SIM115
        )
        os.close(cmd_r)
        os.close(res_w)
        self.buf, self.next_id, self.events = b"", 0, []
        self.width, self.height = width, height
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]
        for method in ("Runtime.enable", "Page.enable", "Log.enable", "Network.enable"):
            self.call(method, session=True)
        self.call(
            "Network.emulateNetworkConditions",
            session=True,
            offline=True,
            latency=0,
            downloadThroughput=0,
            uploadThroughput=0,
        )
        self.call(
            "Emulation.setDeviceMetricsOverride",
            session=True,
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    # -- the protocol -------------------------------------------------------------------
    def call(self, method: str, session: bool = False, timeout: float = 60, **params) -> dict:
        """Send one command and wait for its reply (events meanwhile go to `events`)."""
        self.next_id += 1
        msg: dict[str, Any] = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self.buf:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self.res_r, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium closed the pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def evaluate(self, expression: str) -> Any:
        r = self.call("Runtime.evaluate", session=True, expression=expression, returnByValue=True)
        return r.get("result", {}).get("value")

    # -- pages -----------------------------------------------------------------------------
    def load(self, path: str | Path, timeout: float = 30, until: str = "rendered") -> Page:
        """Open `path` as a file URL with the network off and wait until the page says its
        charts are drawn (`until="rendered"`), or its first screen is (`until="first"`), or
        a script error, or `timeout`."""
        self.events.clear()
        url = Path(path).resolve().as_uri()
        t0 = time.monotonic()
        self.call("Page.navigate", session=True, url=url)
        page = Page()
        deadline = t0 + timeout
        while time.monotonic() < deadline:
            state = self.evaluate(MARKS_JS)
            if state and (state[until] is not None or state["errors"] is not None):
                page.rendered = int(state["rendered"]) if state["rendered"] is not None else None
                for key in ("render_ms", "scripts_ms", "first_ms", "paint_ms"):
                    if state[key] is not None:
                        setattr(page, key, float(state[key]))
                break
            time.sleep(0.05)
        page.load_s = time.monotonic() - t0
        page.charts = json.loads(self.evaluate(CHARTS_JS) or "[]")
        page.errors = self._errors()
        page.requests = [
            e["params"]["request"]["url"]
            for e in self.events
            if e.get("method") == "Network.requestWillBeSent"
            and not e["params"]["request"]["url"].startswith(("file:", "data:", "about:"))
        ]
        return page

    def _errors(self) -> list[str]:
        out = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                out.append(d.get("exception", {}).get("description") or d.get("text", ""))
            elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append(" ".join(str(a.get("value", a.get("description"))) for a in p["args"]))
            elif m == "Log.entryAdded" and p["entry"]["level"] == "error":
                out.append(p["entry"]["text"])
        return out

    def text(self, selector: str) -> str | None:
        """The text of the first element `selector` matches (what a reader sees)."""
        return self.evaluate(
            f"(function(e){{return e ? e.textContent : null}})"
            f"(document.querySelector({json.dumps(selector)}))"
        )

    def screenshot_element(self, selector: str, out: str | Path) -> Path:
        """A PNG of the element `selector` matches, whole (below the fold too)."""
        box = self.evaluate(
            f"(function(e){{var r=e.getBoundingClientRect();return [r.left+scrollX,"
            f"r.top+scrollY,r.width,r.height]}})(document.querySelector({json.dumps(selector)}))"
        )
        x, y, w, h = box
        shot = self.call(
            "Page.captureScreenshot",
            session=True,
            format="png",
            captureBeyondViewport=True,
            clip={"x": x, "y": y, "width": w, "height": h, "scale": 1},
        )
        out = Path(out)
        out.write_bytes(base64.b64decode(shot["data"]))
        return out

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self.cmd_w, self.res_r):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
