"""The README's flow end to end, as a new user runs it: the seed's `make train EXP=... RUN=...` -> `microgpt run EXP
--dashboard --steps N` -> `make train` (docs/GUIDE.md section 3), with the real Makefile, the real CLI, the proxy's real
HTTP server and headless Chromium; then `make train` as it is (the modern recipe) and the README's "Next" sections
command by command, read from the README itself: your own text, using the model (sample, eval, export to
transformers), and the seed's chat fine-tune (its `make train`, prep, train, chat, serve with the README's request,
export to GGUF), every output inside runs/ and data/. The recipes keep their shapes and are made small with --set (a
small corpus, few steps), so CI stays fast.

Checked: every exit code; the URL the README documents keeps its parameters through `/`; the page's elapsed time
is the run's training time (the log's and the proxy's elapsed_s, across the two commands), never the Unix epoch;
the page keeps the finished run's final state after `run` exits; `make train` after the longer proxy run says the
run is complete and exits 0. Screenshots go to test-artifacts/ (git-ignored).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from microgpt import runlog
from tests.conftest import REPO
from tests.proxy._cdp import Chromium
from tests.proxy._helpers import ENV, ProxyRun
from tests.proxy.test_dashboard_browser import ARTIFACTS

EXP = (
    "experiments/ANDREA-tiny-TRAIN.json"  # the seed's recipe: its schedule ends at min_lr 3e-4, so --steps N trains on
)
SETS = ["--set", "data.max_bytes=200000", "--set", "model.vocab_size=512", "--set", "train.micro_batch=4",
        "--set", "train.steps=8", "--set", "train.eval_every=4", "--set", "train.ckpt_every=4"]  # fmt: skip
PROXY_STEPS = 60


def hms(seconds: float) -> str:
    """The page's hms(): minutes and seconds below an hour."""
    s = int(seconds)
    return f"{s // 3600}h {s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m {s % 60:02d}s"


def make_train(venv: Path, run: Path, env: dict) -> subprocess.CompletedProcess:
    flags = [f"EXP={EXP}", f"VENV={venv}", f"RUN={run}", f"TRAIN_FLAGS={' '.join(SETS)}", "SAMPLE_TOKENS=16"]
    return subprocess.run(
        ["make", "-C", str(REPO), "train", *flags], capture_output=True, text=True, env=env, timeout=600
    )


def this_venv(tmp_path: Path) -> Path:
    """The Makefile's .venv, set up already: this interpreter's microgpt, and the stamp newer than pyproject.toml."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "bin" / "microgpt").symlink_to(Path(sys.executable).parent / "microgpt")
    (venv / ".installed").touch()
    return venv


def redirect(url: str) -> str:
    """The Location of a GET that answers 302 (not followed)."""

    class Keep(urllib.request.HTTPRedirectHandler):
        def redirect_request(self, *args: object, **kw: object) -> None:
            return None

    try:
        urllib.request.build_opener(Keep).open(url, timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 302, e.code
        return e.headers["Location"]
    raise AssertionError(f"{url}: no redirect")


def elapsed_shown(chrome: Chromium) -> tuple[str, float]:
    return chrome.eval("document.getElementById('elapsed').textContent"), float(chrome.dataset()["elapsedS"])


def test_make_train_then_run_with_the_dashboard_then_make_train(tmp_path: Path, browser: Chromium) -> None:  # noqa: F811
    t_start = time.time()
    env = {**ENV, "MICROGPT_DATA_DIR": str(tmp_path / "cache")}
    venv, run_dir = this_venv(tmp_path), tmp_path / "runs" / "ANDREA-tiny"
    first = make_train(venv, run_dir, env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("--- sample: ") == 3 and "report card: " in first.stderr
    log = runlog.read_log(run_dir / "train.jsonl")
    assert [e["step"] for e in log if e["event"] == "step"] == list(range(1, 9))

    proxy = ProxyRun(REPO / EXP, run_dir, "--dashboard", "0", "--steps", str(PROXY_STEPS), *SETS, run="ANDREA-tiny")
    engine = None
    try:
        url = proxy.wait_for(lambda: proxy.file("state")["dashboard"], "the dashboard URL")
        engine = proxy.engine_pid()
        proxy.wait_for(lambda: len(proxy.steps()) >= 12, "the proxy's engine past step 12")
        os.kill(engine, signal.SIGSTOP)  # hold the run while the page is looked at
        time.sleep(0.3)  # the proxy flushes its history at most every flush_s
        assert redirect(f"{url}?x=time&interval=200") == "/live-loss-dashboard.html?run=ANDREA-tiny&x=time&interval=200"
        browser.open(f"{url}?x=time&interval=200")  # the URL the CLI prints, with the README's parameters
        loss = proxy.file("loss")
        last = loss["train"][-1]
        ds = browser.wait_dataset(lambda d: d.get("lastStep") == str(last["step"]), f"step {last['step']} drawn")
        assert browser.eval("location.search") == "?run=ANDREA-tiny&x=time&interval=200"
        assert browser.eval("document.getElementById('xmode').value") == "time" and ds["timeUnit"] == "s"
        text, shown = elapsed_shown(browser)
        assert shown == last["elapsed_s"] and text == hms(last["elapsed_s"])
        assert 0 < shown < time.time() - t_start  # training time of both commands: never since the epoch
        assert loss["train"][0]["elapsed_s"] > 0 and all(r["time"] > t_start for r in loss["train"])
        browser.screenshot(ARTIFACTS / "readme-flow-1-run-dashboard.png")
        # A zoom on the steps past make train's schedule (lr at min_lr) refits every chart's y axis to them.
        full = browser.eval("charts['c-lr'].scales.y.max")
        t10 = next(r["elapsed_s"] for r in loss["train"] if r["step"] == 10)
        browser.eval(f"charts['c-loss'].setScale('x', {{min: {t10}, max: {last['elapsed_s']}}})")
        ds = browser.wait_dataset(lambda d: d.get("zoomLo"), "the zoom")
        assert full >= 3e-3 > 1e-3 > browser.eval("charts['c-lr'].scales.y.max")  # 3e-4 shown, not 0..3e-3
        browser.eval("unzoom()")
        os.kill(engine, signal.SIGCONT)
        assert proxy.wait(300) == 0, proxy.output()
    finally:
        if engine is not None and proxy.proc.poll() is None:
            os.kill(engine, signal.SIGCONT)
        proxy.kill()
    # The server went with the run; the page keeps the finished run's final state.
    final = proxy.file("loss")["train"][-1]
    ds = browser.wait_dataset(lambda d: d.get("offline") == "ended", "the final state kept", timeout=30)
    assert ds["status"] == "done" and ds["lastStep"] == str(PROXY_STEPS) == str(final["step"])
    assert elapsed_shown(browser) == (hms(final["elapsed_s"]), final["elapsed_s"])
    x_max = browser.eval("charts['c-loss'].scales.x.max")  # the whole run is drawn, to its last step's time
    assert abs(x_max - final["elapsed_s"]) < 0.05 * final["elapsed_s"], (x_max, final["elapsed_s"])
    browser.screenshot(ARTIFACTS / "readme-flow-2-finished.png")

    again = make_train(venv, run_dir, env)  # the README: `make train` after the proxy run
    assert again.returncode == 0, again.stderr[-3000:]
    assert re.search(rf"already complete: .*step-000000{PROXY_STEPS}\.bin is at step {PROXY_STEPS}, past", again.stderr)
    served = subprocess.Popen(
        [sys.executable, "-m", "microgpt.proxy.dashboard", str(run_dir), "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )
    try:
        line = served.stderr.readline()
        page = re.search(r"http://127\.0\.0\.1:\d+/", line).group(0)
        browser.open(f"{page}?x=time")
        ds = browser.wait_dataset(
            lambda d: d.get("lastStep") == str(PROXY_STEPS) and d.get("status") == "done",
            "the finished run served again",
        )
        browser.screenshot(ARTIFACTS / "readme-flow-3-served-again.png")
    finally:
        served.send_signal(signal.SIGINT)
        _, err = served.communicate(timeout=30)
    assert err.strip() == "", err  # quiet: no line per request
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


# --- the README's "Next" sections, as written ---------------------------------------------------------------------
FAST = {"train": ["--set", "data.max_bytes=200000", "--set", "train.micro_batch=4", "--set", "train.steps=6",
                  "--set", "train.eval_every=3", "--set", "train.ckpt_every=3"],
        "sample": ["--tokens", "8"], "chat": ["--tokens", "8"], "eval": ["--windows", "4"]}  # fmt: skip


def readme_commands(section: str) -> list[list[str]]:
    """The `.venv/bin/microgpt` commands of the README's code blocks under `### section`, as argument lists (backslash
    continuations joined, comments dropped), `.venv/bin/microgpt` left out."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n### {section}\n", 1)[1].split("\n#", 1)[0]
    lines = [
        line for block in re.findall(r"```\n(.*?)```", body, re.S) for line in block.replace("\\\n", " ").splitlines()
    ]
    return [shlex.split(line.split("  #")[0])[1:] for line in lines if line.startswith(".venv/bin/microgpt ")]


def readme_make_train(section: str) -> dict[str, str]:
    """The variables of the `make train VAR=value ...` line in the README's code blocks under `### section`."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n### {section}\n", 1)[1].split("\n#", 1)[0]
    line = re.search(r"^make train (.*?)(?:  #.*)?$", "".join(re.findall(r"```\n(.*?)```", body, re.S)), re.M)
    assert line, f"no `make train` line under ### {section}"
    return dict(arg.split("=", 1) for arg in shlex.split(line[1]))


def run_as_written(work: Path, argv: list[str], env: dict, **kw) -> subprocess.CompletedProcess:
    """One README command in the user's checkout (work), with only the flags that make it small added."""
    res = subprocess.run(
        [sys.executable, "-m", "microgpt", *argv, *FAST.get(argv[0], [])],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kw,
    )
    assert res.returncode == 0, (argv, res.stderr[-3000:])
    return res


def serve_as_written(work: Path, argv: list[str], env: dict) -> None:
    """`serve`, then the README's curl request's body to it (and GET /v1/models), then Ctrl-C."""
    text = (REPO / "README.md").read_text()
    body = json.loads(re.search(r"curl http://127\.0\.0\.1:8000/v1/chat/completions .*?-d '(.*?)'", text, re.S)[1])
    proc = subprocess.Popen(
        [sys.executable, "-m", "microgpt", *argv, "--port", "0"], cwd=work, env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stderr:
            found = re.match(r"serve: (http://127\.0\.0\.1:\d+/v1) ", line)
            if found:
                break
        assert found, "serve printed no URL"
        url = found[1]
        models = json.loads(urllib.request.urlopen(f"{url}/models", timeout=30).read())
        assert [m["id"] for m in models["data"]] == [body["model"]]
        req = urllib.request.Request(
            f"{url}/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        reply = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert reply["choices"][0]["message"]["role"] == "assistant" and reply["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)


def test_the_next_sections_run_as_written(tmp_path: Path) -> None:
    """`make train` as it is trains the modern recipe into runs/ANDREA-tiny-MODERN; then your own text -> prep ->
    train -> sample; sample, eval and export on that run; the seed's `make train`, the offline fine-tune -> chat,
    serve and the GGUF export: every command of those sections, in order, as written, from a checkout where `make
    train` ran; nothing lands outside runs/ and data/ (git ignores both)."""
    work = tmp_path / "checkout"
    work.mkdir()
    for name in ("experiments", "docs", "microgpt", "README.md"):
        (work / name).symlink_to(REPO / name)
    env = {**ENV, "MICROGPT_DATA_DIR": str(tmp_path / "cache")}
    venv = this_venv(tmp_path)

    def make_train(run: str, *flags: str) -> subprocess.CompletedProcess:
        args = [f"VENV={venv}", f"RUN={work / run}", "SAMPLE_TOKENS=8", f"TRAIN_FLAGS={' '.join(FAST['train'])}"]
        made = subprocess.run(
            ["make", "-C", str(REPO), "train", *args, *flags], capture_output=True, text=True, env=env, timeout=600
        )
        assert made.returncode == 0, made.stderr[-3000:]
        assert made.stdout.count("--- sample: ") == 3
        return made

    make_train("runs/ANDREA-tiny-MODERN")  # the Makefile's own EXP: the modern recipe
    start = runlog.read_log(work / "runs" / "ANDREA-tiny-MODERN" / "train.jsonl")[0]
    assert start["config"]["name"] == "ANDREA-tiny-MODERN" and start["config"]["model"]["block"] == "modern"
    assert start["config"]["train"]["optimizer"] == "muon"

    own = readme_commands("Train on your own text")
    assert [c[0] for c in own] == ["prep", "train", "sample"]
    for argv in own:
        res = run_as_written(work, argv, env)
    assert res.stdout.startswith("The memory plan")
    start = runlog.read_log(work / "runs" / "my" / "train.jsonl")[0]
    assert start["config"]["data"] == {**start["config"]["data"], "source": "shards", "path": "data/my"}
    assert start["config"]["model"]["block"] == "modern"
    sources = json.loads((work / "data" / "my" / "manifest.json").read_text())["sources"]
    assert [s["name"] for s in sources] == ["docs", "microgpt"] and all(s["documents_read"] > 1 for s in sources)

    use = readme_commands("Use the model")
    assert [c[0] for c in use] == ["sample", "eval", "export"]
    for argv in use:
        res = run_as_written(work, argv, env)
        if argv[0] == "eval":
            assert re.search(r"^loss [\d.]+ \|.* \| unigram [\d.]+ \(the loss of these tokens' own", res.stdout)
    hf = work / "runs" / "ANDREA-tiny-MODERN" / "export" / "ANDREA-tiny-MODERN-step6-fp32"
    assert json.loads((hf / "config.json").read_text())["model_type"] == "nanochat"

    tune = "Fine-tune to chat, serve, and export to GGUF (the seed's GPT-2 recipe)"
    seed = readme_make_train(tune)
    assert seed == {"EXP": EXP, "RUN": "runs/ANDREA-tiny"}
    make_train(seed["RUN"], f"EXP={seed['EXP']}")
    chat = readme_commands(tune)
    assert [c[0] for c in chat] == ["prep", "train", "chat", "serve", "export"]
    run_as_written(work, chat[0], env)
    res = run_as_written(work, chat[1], env)
    assert "init: the weights of runs/ANDREA-tiny/ckpt/step-00000006.bin (ANDREA-tiny, step 6)" in res.stderr
    log = runlog.read_log(work / "runs" / "ANDREA-tiny-chat" / "train.jsonl")
    assert [e["step"] for e in log if e["event"] == "eval"] == [3, 6] and log[0]["config"]["data"]["loss_mask"]
    assert run_as_written(work, chat[2], env, input="What is 12 + 30?\n").stdout.strip()
    serve_as_written(work, chat[3], env)
    run_as_written(work, chat[4], env)
    gguf = work / "runs" / "ANDREA-tiny-chat" / "export" / "ANDREA-tiny-chat-step6-q8_0.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF"
    left = {p.name for p in work.iterdir()} - {"experiments", "docs", "microgpt", "README.md"}
    assert left == {"runs", "data"}, left  # what `git status` would show: nothing, .gitignore has both
