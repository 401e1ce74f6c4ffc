"""The dashboard in headless Chromium with a 200,000-step history (ANDREA-120M's length), from the real server.

What makes the first draw fast is asserted, not its time (no timing in an assertion): the server sends at most
2*width + 2 points per series, min/max per pixel column, so a planted one-step spike is still drawn. The time
from navigation to the first loss curve is measured, printed and kept in test-artifacts/dashboard-200k.json.
While the page is open the run advances (the proxy's own writer appends steps): the poll moves only the new
points. Hover reads every series at one step; a drag zooms every chart and fetches the zoomed steps in detail.
Screenshots: test-artifacts/dashboard-200k*.png, dashboard-runs.png.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from microgpt.proxy.dashboard import DashboardServer
from microgpt.proxy.runfiles import LossHistory
from tests.proxy._cdp import Chromium
from tests.proxy.test_dashboard_browser import ARTIFACTS

pytestmark = pytest.mark.slow  # a 30 MB history written, parsed and drawn: about 10 s on a 2-core machine

SPIKE = 123_457
T0 = 1.7e9


def rows(first: int, last: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed + first)
    out = []
    for s in range(first, last + 1):
        loss = 50.0 if s == SPIKE else 2.5 + 8 / (1 + s / 2000) + rng.gauss(0, 0.05)
        out.append(
            {
                "step": s,
                "loss": loss,
                "lr": 6e-4 * min(1, s / 2000),
                "grad_norm": 0.3 + abs(rng.gauss(0, 0.2)),
                "tokens_per_s": 5e5 + rng.gauss(0, 5e3),
                "dt_ms": 262.0,
                "tokens": 131072,
                "phase": "main",
                "time": T0 + s * 0.26,
                "elapsed_s": s * 0.26,
            }
        )
    return out


def write_run(folder: Path, run: str, steps: int, seed: int = 0) -> LossHistory:
    """A run folder as the proxy leaves it mid-run, written with the proxy's own classes."""
    folder.mkdir(parents=True, exist_ok=True)
    hist = LossHistory(folder / f"{run}.loss.json", run)
    config = {"model": {"n_layer": 12, "d_model": 768, "seq_len": 1024}, "train": {"precision": "bf16", "grad_clip": 1}}
    hist.set_meta(
        {
            "n_params": 124_000_000,
            "device": "NVIDIA H200",
            "world_size": 1,
            "config": config,
            "flops_per_token": 6 * 124_000_000 + 12 * 12 * 1024 * 768,
            "peak_flops": 989e12,
        }
    )
    hist.data["train"] = rows(1, steps, seed)
    hist.data["val"] = [
        {"step": s, "val_loss": 2.6 + 8 / (1 + s / 2000), "phase": "main", "time": T0 + s * 0.26}
        for s in range(1000, steps + 1, 1000)
    ]
    hist.mark("phase", 0, phase="main")
    for kind in ("stop", "resume"):  # two marks at one step: one merged label, not two printed over each other
        hist.mark(kind, steps // 2)
    hist.flush()
    state = {
        "format": "microgpt-proxy-state-1",
        "run": run,
        "status": "running",
        "phase": "main",
        "step": steps,
        "target_step": 250_000,
        "restarts": 0,
    }
    (folder / f"{run}.state.json").write_text(json.dumps(state))
    samples = [
        {"step": s, "phase": "main", "prompt": "def ", "temperature": 0.8, "text": f"f{s}():<|im_end|>x"}
        for s in (1000, 2000)
    ]
    samples.append(
        {
            "step": 2000,
            "phase": "main",
            "prompt": [{"role": "user", "content": "Say hi."}],
            "temperature": 0.8,
            "text": "Hi there!<|im_end|>\n<|im_start|>user\nmore",
        }
    )
    (folder / f"{run}.samples.json").write_text(json.dumps({"format": "microgpt-samples-1", "samples": samples}))
    return hist


def chart_box(chrome: Chromium, chart: str = "c-loss") -> dict:
    return chrome.eval(
        f"(() => {{ const r = charts['{chart}'].over.getBoundingClientRect(); "
        "return {x: r.x, y: r.y, w: r.width, h: r.height}; })()"
    )


def mark_pixels_left_of_the_plot(chrome: Chromium) -> int:
    """Pixels in the phase marks' color in the loss chart's y axis area (short of the plot's edge, where a mark line at
    the first step is antialiased), in the rows the mark labels take: a label drawn there (right-aligned on its x)
    would overprint the axis's top tick."""
    return chrome.eval("""(() => {
      const u = charts['c-loss'], b = u.bbox, dpr = devicePixelRatio || 1;
      const px = u.ctx.getImageData(0, b.top, b.left - Math.round(3 * dpr), Math.round(16 * dpr)).data;
      let n = 0;
      for (let i = 0; i < px.length; i += 4) {  // --phase, #5c7cfa
        const off = Math.abs(px[i] - 0x5c) + Math.abs(px[i + 1] - 0x7c) + Math.abs(px[i + 2] - 0xfa);
        if (off < 90 && px[i + 3] > 128) n++;
      }
      return n; })()""")


def api_requests(server: DashboardServer) -> list[dict]:
    return list(server.httpd.requests)


def test_a_200k_step_history(tmp_path: Path, browser: Chromium) -> None:  # noqa: F811
    hist = write_run(tmp_path, "big", 200_000)
    size_mb = (tmp_path / "big.loss.json").stat().st_size / 1e6
    server = DashboardServer(tmp_path, "big", 0)
    server.start()  # parses the history in the background; the first page waits for that parse
    try:
        page = f"{server.url}live-loss-dashboard.html?run=big&interval=300"
        browser.open(page)
        ds = browser.wait_dataset(lambda ds: ds.get("firstDrawMs") and ds.get("lastStep") == "200000", "first draw")
        cold_ms = float(ds["firstDrawMs"])
        browser.open(page)  # a second page: the server holds the parsed history
        ds = browser.wait_dataset(lambda ds: ds.get("firstDrawMs") and ds.get("lastStep") == "200000", "first draw")
        first_draw_ms = float(ds["firstDrawMs"])
        first = [r for r in api_requests(server) if r["since"] is None][-1]
        width = int(ds["chartWidth"])
        assert f"width={width}" in first["path"] and 600 <= width <= 1280  # the chart's own width, in CSS pixels
        assert first["max_points"] <= 2 * width + 2 and first["bytes"] < 1_000_000  # against 30+ MB for the file
        assert ds["lossRows"] == "200000" and int(ds["trainPoints"]) <= 2 * width + 2
        held = browser.eval("runs[0].d.series.loss.y[runs[0].d.series.loss.step.indexOf(%d)]" % SPIKE)
        assert held == 50.0  # the one-step spike survived downsampling
        assert browser.eval("charts['c-loss'].data.some((col, i) => i > 0 && col.includes(50))")  # and is drawn
        assert ds["markLabels"] == "main|stop, resume"  # two marks at one step: one label
        assert mark_pixels_left_of_the_plot(browser) == 0  # the first step's "main" stays off the y axis's ticks
        ticks = [float(t) for t in ds["xTicks"].split(",")]
        gaps = {b - a for a, b in zip(ticks, ticks[1:])}
        assert len(gaps) == 1 and str(int(gaps.pop())).strip("0") in ("1", "2", "25", "5"), ticks  # round steps
        assert all(t == int(t) for t in ticks) and ticks[-1] == 200_000
        assert browser.eval("document.getElementById('mfu').textContent").startswith("MFU ")
        assert browser.eval("document.getElementById('eta').textContent") not in ("", "-")
        report = {
            "rows": 200_000,
            "file_mb": round(size_mb, 1),
            "first_draw_ms_server_cold": cold_ms,
            "first_draw_ms": first_draw_ms,
            "first_answer_bytes": first["bytes"],
            "chart_width": width,
            "max_points_per_series": first["max_points"],
        }
        print(f"\n200K-step history: {report}")
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "dashboard-200k.json").write_text(json.dumps(report, indent=1) + "\n")
        browser.screenshot(ARTIFACTS / "dashboard-200k.png")

        # The run advances while the page is open: 50 steps appended by the proxy's writer (atomic replace).
        before = len(api_requests(server))
        for r in rows(200_001, 200_050):
            hist.add("train", r)
        hist.flush()
        browser.wait_dataset(lambda ds: ds.get("lastStep") == "200050", "the 50 new steps")
        polls = [r for r in api_requests(server)[before:] if r["since"] is not None]
        new = [r for r in polls if r["points"]]
        assert new and all(r["since"] == 200_000 and r["points"] == 4 * 50 and r["bytes"] < 20_000 for r in new)
        assert all(r["since"] is not None for r in api_requests(server)[before:])  # never the whole history again
        assert browser.eval("runs[0].d.series.loss.step.slice(-1)[0]") == 200_050

        # Hover: the readout and every legend read one step.
        box = chart_box(browser)
        browser.mouse("mouseMoved", box["x"] + box["w"] * 0.5, box["y"] + box["h"] * 0.5)
        ds = browser.wait_dataset(lambda ds: ds.get("hoverStep"), "a hovered step")
        assert 90_000 <= int(ds["hoverStep"]) <= 110_000
        assert browser.eval("document.getElementById('readout').textContent").startswith(
            f"step {int(ds['hoverStep']):,}"
        )
        legends = browser.eval("[...document.querySelectorAll('.u-legend')].map((l) => l.textContent)")
        assert all("step" in t for t in legends[:4]) and all(any(c.isdigit() for c in t) for t in legends[:4]), legends
        browser.screenshot(ARTIFACTS / "dashboard-200k-hover.png")

        # Zoom: a drag over a tenth of the loss chart zooms every chart and fetches those steps in detail.
        y = box["y"] + box["h"] * 0.5
        x0, x1 = box["x"] + box["w"] * 0.60, box["x"] + box["w"] * 0.62
        browser.mouse("mousePressed", x0, y, button="left", buttons=1, clickCount=1)
        browser.mouse("mouseMoved", (x0 + x1) / 2, y, button="left", buttons=1)
        browser.mouse("mouseMoved", x1, y, button="left", buttons=1)
        browser.mouse("mouseReleased", x1, y, button="left", buttons=0, clickCount=1)
        ds = browser.wait_dataset(lambda ds: ds.get("zoomFetches") and ds.get("zoomLo"), "a zoom and its detail")
        lo, hi = float(ds["zoomLo"]), float(ds["zoomHi"])
        assert 115_000 < lo < hi < 130_000, (lo, hi)
        assert browser.eval(
            "Object.values(charts).every((u) => u.scales.x.min === %r && u.scales.x.max === %r)" % (lo, hi)
        )
        zoom = [r for r in api_requests(server) if "from=" in r["path"]][-1]
        assert zoom["max_points"] <= 2 * width + 2
        shown = browser.eval("charts['c-loss'].data[0].filter((x) => x >= %r && x <= %r).length" % (lo, hi))
        assert shown > (hi - lo) / 200_000 * 2 * width * 2  # much more detail than the whole-history view had
        assert browser.eval("charts['c-loss'].data.some((col, i) => i > 0 && col.includes(50))")  # spike in range
        browser.screenshot(ARTIFACTS / "dashboard-200k-zoom.png")
        browser.mouse("mousePressed", x0, y, button="left", buttons=1, clickCount=2)
        browser.mouse("mouseReleased", x0, y, button="left", buttons=0, clickCount=2)
        browser.call(
            "Runtime.evaluate", {"expression": "charts['c-loss'].over.dispatchEvent(new MouseEvent('dblclick'))"}
        )
        browser.wait_dataset(lambda ds: ds.get("zoomLo") == "", "the zoom reset by a double-click")
        browser.mouse("mouseWheel", box["x"] + box["w"] * 0.5, y, deltaX=0, deltaY=-300)  # wheel in: zoom around
        ds = browser.wait_dataset(lambda ds: ds.get("zoomLo"), "a wheel zoom")
        lo, hi = float(ds["zoomLo"]), float(ds["zoomHi"])
        assert 0 < lo < 100_000 < hi < 200_050 and hi - lo < 0.9 * 200_050
        shift = 8  # CDP modifier bit: shift+drag pans
        browser.mouse("mousePressed", x0, y, button="left", buttons=1, clickCount=1, modifiers=shift)
        browser.mouse("mouseMoved", x0 - 100, y, button="left", buttons=1, modifiers=shift)
        browser.mouse("mouseReleased", x0 - 100, y, button="left", buttons=0, clickCount=1, modifiers=shift)
        ds = browser.wait_dataset(lambda ds: ds.get("zoomLo") and float(ds["zoomLo"]) > lo, "a pan to later steps")
        assert float(ds["zoomHi"]) - float(ds["zoomLo"]) == pytest.approx(hi - lo)  # the same width, moved

        # Samples over time: pick a step; special tokens are tokens.
        assert browser.eval("document.getElementById('sample-step').options.length") == 3  # latest, 1000, 2000
        browser.eval(
            "(() => { const s = document.getElementById('sample-step'); s.value = '1000';"
            "s.dispatchEvent(new Event('input')); })()"
        )
        ds = browser.wait_dataset(lambda ds: ds.get("sampleStep") == "1000", "the samples of step 1000")
        assert browser.eval("[...document.querySelectorAll('#sample-list .tok')].map((t) => t.title)") == ["<|im_end|>"]
        assert "f1000()" in browser.eval("document.getElementById('sample-list').textContent")
    finally:
        server.close()


def test_a_folder_of_runs_is_overlaid(tmp_path: Path, browser: Chromium) -> None:  # noqa: F811
    for i, name in enumerate(("lr-3e-4", "lr-6e-4")):
        write_run(tmp_path / name, "andrea", 3000, seed=i)
    server = DashboardServer(tmp_path, None, 0)
    server.start()
    try:
        browser.open(f"{server.url}")  # the root: every run of the folder
        browser.wait_dataset(lambda ds: ds.get("runs") == "2" and ds.get("lastStep") == "3000", "two runs")
        assert browser.eval("document.querySelectorAll('#heads .runhead').length") == 2  # a header per run
        heads = browser.eval("[...document.querySelectorAll('#heads .runhead .name')].map((e) => e.textContent)")
        assert heads == ["lr-3e-4/andrea", "lr-6e-4/andrea"]
        ds = browser.dataset()
        assert ds["markLabels"] == "main|stop, resume"  # both runs' marks at one step: one line, one label each
        left, right = map(int, ds["plotBox"].split(":"))
        boxes = [tuple(map(int, b.split(":"))) for b in ds["markBoxes"].split("|")]
        assert all(left <= a < b <= right for a, b, _ in boxes)  # inside the chart: nothing cut at its edge
        assert all(b1 <= a2 for (a1, b1, r1), (a2, b2, r2) in zip(boxes, boxes[1:]) if r1 == r2)  # none overprints
        chat = browser.eval("[...document.querySelectorAll('#sample-list .turn')].map((t) => t.textContent)")
        assert chat == ["userSay hi.", "assistantHi there!"]  # turns; the reply stopped at <|im_end|>
        labels = browser.eval("charts['c-loss'].series.map((s) => s.label)")
        assert {"lr-3e-4/andrea train", "lr-6e-4/andrea train", "lr-3e-4/andrea val"} <= set(labels), labels
        assert browser.eval("document.querySelectorAll('#run-picker input:checked').length") == 2
        browser.screenshot(ARTIFACTS / "dashboard-runs.png")
        browser.open(f"{server.url}live-loss-dashboard.html?run=lr-6e-4/andrea&x=tokens")  # one run, tokens as x
        browser.wait_dataset(lambda ds: ds.get("runs") == "1" and ds.get("lastStep") == "3000", "one run")
        assert browser.eval("charts['c-loss'].scales.x.max") == pytest.approx(3000 * 131072, rel=0.01)
        browser.eval(
            "(() => { const s = document.getElementById('xmode'); s.value = 'time';"
            "s.dispatchEvent(new Event('input')); })()"
        )
        assert browser.eval("location.search").endswith("x=time")
        assert browser.eval("document.body.dataset.timeUnit") == "min"  # 13 minutes of training: in minutes
        assert browser.eval("charts['c-loss'].scales.x.max") == pytest.approx(3000 * 0.26 / 60, rel=0.01)
    finally:
        server.close()
