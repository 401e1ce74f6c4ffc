"""Property tests of the readers of hostile files: experiments, checkpoints with their sidecars, token shards and
the proxy's run files; since issue 35 also numbers written as text, the dashboard's answers to any query, history
and request head, HellaSwag lines, the engine's log as `run` adopts it, and pulled JSON Lines. Thousands of random
mutations of a valid file (a JSON value replaced, deleted or added; a key doubled; bytes flipped, cut or inserted;
a float set to NaN, inf or a negative number) must give a valid result or an InputError (the CLI's one `error:`
line, exit 2), never another exception. The readers run in this process, so thousands of examples take seconds; a
few subprocess checks at the end cover the CLI wrapper.

Deterministic: the hypothesis profile in tests/conftest.py (derandomize, no database, no deadline).
"""

from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from microgpt import checkpoint, config, data, errors, httpd
from microgpt.data import hellaswag_file as hellaswag
from microgpt.data import shards
from microgpt.data.sources import iter_records
from microgpt.engine import params
from microgpt.engine.backend import numpy_backend
from microgpt.engine.state import make_state
from microgpt.engine.trained import load_trained
from microgpt.errors import InputError
from microgpt.proxy import dashboard, phases
from microgpt.proxy.runfiles import LOSS_FORMAT, SAMPLES_FORMAT, STATE_FORMAT, JsonDoc, LossHistory, replay_engine_log
from microgpt.use import sample
from tests.conftest import TINY, cli

# --- mutations ---------------------------------------------------------------------------------------------------
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, -1, 2**31, 2**63, 10**30])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
JSON_VALUES = st.recursive(
    LEAVES,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=6,
)


def slots(obj: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a JSON value: the places a mutation can hit."""
    out, todo = [], [obj]
    while todo:
        node = todo.pop()
        keys = list(node) if isinstance(node, dict) else range(len(node)) if isinstance(node, list) else []
        for k in keys:
            out.append((node, k))
            todo.append(node[k])
    return out


@st.composite
def mutated_json(draw: st.DrawFn, valid: Any) -> str:
    """valid with 1-3 structural changes, as JSON text (NaN and Infinity allowed), maybe with a key doubled."""
    obj = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        places = slots(obj)
        op = draw(st.sampled_from(["replace", "replace", "delete", "insert", "root"]))
        if op == "root" or not places:
            obj = draw(JSON_VALUES)
            continue
        node, key = draw(st.sampled_from(places))
        if op == "replace":
            node[key] = draw(JSON_VALUES)
        elif op == "delete":
            del node[key]
        elif isinstance(node, dict):
            node[draw(st.text(max_size=8))] = draw(JSON_VALUES)
        else:
            node.insert(draw(st.integers(0, len(node))), draw(JSON_VALUES))
    text = json.dumps(obj)
    if draw(st.booleans()) and text.startswith('{"'):
        key = text[1 : text.index('"', 2) + 1]
        text = "{" + key + ": 0, " + text[1:]  # the first key twice: json.loads would keep the last silently
    return text


@st.composite
def mutated_bytes(draw: st.DrawFn, valid: bytes) -> bytes:
    """valid with 1-3 byte-level changes: flips, cuts, insertions."""
    out = bytearray(valid)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(0, len(out) - 1)))
        if op == "flip" and out:
            out[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del out[i : i + draw(st.integers(1, 64))]
        else:
            out[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(out)


def hostile_json(valid: Any) -> st.SearchStrategy[bytes]:
    text = json.dumps(valid)
    return st.one_of(mutated_json(valid).map(str.encode), mutated_bytes(text.encode()))


def valid_or_input_error(fn: Any, *args: Any) -> Any:
    """fn(*args), or None when it refuses the input with an InputError. Any other exception fails the test."""
    try:
        got = fn(*args)
    except InputError as e:
        msg = str(e)
        assert msg and "\n" not in msg, f"not one line: {msg!r}"
        event(f"{fn.__name__}: InputError")
        return None
    event(f"{fn.__name__}: valid")
    return got


# --- experiments -------------------------------------------------------------------------------------------------
EXPERIMENT = {**TINY, "phases": [{"name": "pre", "steps": 4}, {"name": "post", "steps": 2, "train": {"lr": 1e-3}}]}


@settings(max_examples=1500)
@given(raw=hostile_json(EXPERIMENT))
def test_experiment_readers(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "exp.json"
    path.write_bytes(raw)
    exp = valid_or_input_error(config.load, path)
    if exp is not None:
        valid_or_input_error(data.validate, exp, str(path))
        assert all(math.isfinite(v) for v in vars(exp.train).values() if isinstance(v, float))
    valid_or_input_error(phases.load_schedule, path)


# --- checkpoints and sidecars --------------------------------------------------------------------------------------
SMALL = {**TINY, "model": {"vocab_size": 256, "d_model": 4, "n_layer": 1, "n_head": 1, "seq_len": 4}}


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, dict]:
    """A valid checkpoint of a 1,256-parameter model, with the sidecar the trainer writes."""
    exp = config.from_dict(SMALL)
    n = params.n_params(exp.model)
    rng = np.random.default_rng(0)
    w, m, v = rng.normal(size=n), rng.normal(size=n), np.abs(rng.normal(size=n))
    meta = {
        "config": exp.to_dict(),
        "seed": 7,
        "tokenizer": {"kind": "bytes", "vocab_size": 256},
        "data": {"source": "builtin"},
        "backend": "numpy",
        "precision": "fp32",
        "reason": "final",
        "val_loss": 3.5,
        "val_step": 2,
        "loss_scale": 1.0,
        "loss_scale_good_steps": 0,
        "params": [[k, list(s)] for k, s in params.param_shapes(exp.model)],
    }
    path = checkpoint.write_checkpoint(tmp_path_factory.mktemp("ck") / "step-00000002.bin", 2, w, m, v, meta)
    side = json.loads(checkpoint.sidecar_path(path).read_text())
    return path, path.read_bytes(), side


@st.composite
def hostile_bin(draw: st.DrawFn, valid: bytes) -> bytes:
    """Byte changes, or one float of weights / m / v set to NaN, inf or a negative number."""
    if draw(st.booleans()):
        return draw(mutated_bytes(valid))
    n = (len(valid) - 8) // 12
    i = draw(st.integers(0, 3 * n - 1))
    value = draw(st.sampled_from([math.nan, math.inf, -math.inf, -1.0, -1e-30, 3e38]))
    out = bytearray(valid)
    out[8 + 4 * i : 12 + 4 * i] = struct.pack("<f", value)
    return bytes(out)


@pytest.fixture(scope="module")
def small_state() -> Any:
    exp = config.from_dict(SMALL)
    return make_state(exp.model, exp.train, numpy_backend())


def read_checkpoint_everywhere(path: Path, state: Any) -> None:
    """Every reader of a checkpoint: resume (TrainState), sample/chat/eval/export (load_trained, sample.load)."""
    n = state.n_params
    got = valid_or_input_error(checkpoint.load, path, n)
    if got is not None:
        ck, _ = got
        assert np.isfinite(ck.weights).all() and np.isfinite(ck.m).all() and (ck.v >= 0).all()
    valid_or_input_error(state.load_checkpoint, path)
    valid_or_input_error(load_trained, path)
    valid_or_input_error(sample.load, str(path))
    valid_or_input_error(checkpoint.latest_valid_checkpoint, path.parent, n)


@settings(max_examples=700)
@given(data=st.data())
def test_checkpoint_and_sidecar_readers(
    small_ckpt: tuple[Path, bytes, dict], small_state: Any, data: st.DataObject
) -> None:
    path, valid_bin, valid_side = small_ckpt
    side = checkpoint.sidecar_path(path)
    which = data.draw(st.sampled_from(["bin", "sidecar", "both"]))
    path.write_bytes(data.draw(hostile_bin(valid_bin)) if which != "sidecar" else valid_bin)
    side.write_bytes(data.draw(hostile_json(valid_side)) if which != "bin" else json.dumps(valid_side).encode())
    read_checkpoint_everywhere(path, small_state)


def test_a_valid_checkpoint_reads_everywhere(small_ckpt: tuple[Path, bytes, dict], small_state: Any) -> None:
    """The property above is not vacuous: the unmutated files pass every reader."""
    path, valid_bin, valid_side = small_ckpt
    path.write_bytes(valid_bin)
    checkpoint.sidecar_path(path).write_text(json.dumps(valid_side))
    assert checkpoint.load(path, small_state.n_params)[0].step == 2
    assert small_state.load_checkpoint(path)["step"] == 2 and load_trained(path).step == 2
    assert sample.load(str(path))[2] == 2


# --- token shards --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes, bytes]:
    folder = tmp_path_factory.mktemp("shards")
    tokens = np.arange(300) % 256
    shards.write_shard(folder / "train_000000.bin", tokens)
    shards.write_shard(shards.mask_path(folder / "train_000000.bin"), tokens % 2, kind="mask")
    return (
        folder,
        (folder / "train_000000.bin").read_bytes(),
        shards.mask_path(folder / "train_000000.bin").read_bytes(),
    )


@settings(max_examples=600)
@given(data=st.data())
def test_shard_readers(shard_dir: tuple[Path, bytes, bytes], data: st.DataObject) -> None:
    folder, tok, mask = shard_dir
    path = folder / "train_000000.bin"
    which = data.draw(st.sampled_from(["tokens", "mask"]))
    path.write_bytes(data.draw(mutated_bytes(tok)) if which == "tokens" else tok)
    shards.mask_path(path).write_bytes(data.draw(mutated_bytes(mask)) if which == "mask" else mask)
    got = valid_or_input_error(shards.open_shard, path, "tokens", 256)
    if got is not None:
        assert int(np.asarray(got).max(initial=0)) < 256
        valid_or_input_error(shards.open_mask, path, len(got))
    valid_or_input_error(shards.check_dir, folder, 256)


# --- the proxy's run files -----------------------------------------------------------------------------------------
LOSS = {"format": LOSS_FORMAT, "run": "r", "meta": {"n_params": 10},
        "train": [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "phase": "train", "time": 1.0} for s in (1, 2, 3)],
        "val": [{"step": 2, "val_loss": 3.1, "phase": "train", "time": 1.0}],
        "marks": [{"kind": "phase", "step": 0, "time": 0.0, "phase": "train"}]}  # fmt: skip
STATE = {"format": STATE_FORMAT, "run": "r", "status": "stopped", "phase": "train", "phase_index": 0, "step": 3,
         "restarts": 1, "restart_log": [{"step": 2, "reason": "killed"}],
         "skipped_checkpoints": [{"path": "ckpt/step-00000002.bin", "reason": "sha256"}], "archived": [],
         "config_hash": "abc", "engine_pid": None, "proxy_pid": 1}  # fmt: skip
SAMPLES = {"format": SAMPLES_FORMAT, "run": "r", "phase": "train", "settings": {"every": 100},
           "samples": [{"step": 2, "text": "hi"}]}  # fmt: skip


def use_loss(path: Path) -> None:
    """What the supervisor does with a loss history it finds: resume after its last step, write it again."""
    h = LossHistory(path, "r")
    h.truncate_after(min(h.last_step, 2))
    h.add("train", {"step": h.last_step + 1, "loss": 1.0})
    h.mark("resume", h.last_step)
    h.flush()


def use_doc(path: Path, fmt: str, fresh: dict) -> None:
    """What the supervisor does with a state or samples file it finds."""
    doc = JsonDoc(path, fmt, fresh)
    d = doc.data
    if fmt == STATE_FORMAT:
        d["restarts"] += 1
        d["restart_log"].append({"step": d["step"], "reason": "test"})
        assert all(isinstance(s, dict) for s in d["skipped_checkpoints"])
    else:
        d["samples"].append({"step": 1, "text": "x"})
    doc.flush()


@settings(max_examples=500)
@given(data=st.data())
def test_run_file_readers(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    folder = tmp_path_factory.getbasetemp()
    fmt, valid = data.draw(st.sampled_from([(LOSS_FORMAT, LOSS), (STATE_FORMAT, STATE), (SAMPLES_FORMAT, SAMPLES)]))
    path = folder / "r.run.json"
    path.write_bytes(data.draw(hostile_json(valid)))
    if fmt == LOSS_FORMAT:
        valid_or_input_error(use_loss, path)
    else:
        fresh = copy.deepcopy({k: v for k, v in valid.items() if k != "format"})
        valid_or_input_error(use_doc, path, fmt, fresh)


# --- the CLI wrapper: a few real subprocesses -----------------------------------------------------------------------
def exit_2_one_line(res: Any) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr


@settings(max_examples=4)
@given(raw=mutated_json(EXPERIMENT).map(str.encode))
def test_train_cli_on_hostile_experiments(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    """A mutated experiment, and a --resume file that does not exist: either way one line and exit 2."""
    folder = tmp_path_factory.mktemp("cli")
    (folder / "exp.json").write_bytes(raw)
    res = cli("train", str(folder / "exp.json"), "--out", str(folder / "run"), "--resume", str(folder / "no.bin"))
    exit_2_one_line(res)


@settings(max_examples=4)
@given(data=st.data())
def test_sample_cli_on_hostile_checkpoints(small_ckpt: tuple[Path, bytes, dict], data: st.DataObject) -> None:
    path, valid_bin, valid_side = small_ckpt
    path.write_bytes(data.draw(hostile_bin(valid_bin)))
    checkpoint.sidecar_path(path).write_bytes(data.draw(hostile_json(valid_side)))
    res = cli("sample", str(path), "--tokens", "1")
    if res.returncode != 0:
        exit_2_one_line(res)


# --- issue 35: numbers, query strings, request heads, JSON Lines, engine logs -------------------------------------
NUMBER_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "inf",
            "-inf",
            "nan",
            "1e999",
            "-1e999",
            "1e308",
            "0x10",
            "1_000",
            " 7 ",
            "+3",
            "--1",
            "1.0",
            "9" * 4400,
            "-0",
            "4.5",
            "1e3",
            "\u0663",
        ]
    ),
    st.integers(min_value=-(2**80), max_value=2**80).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@settings(max_examples=2000)
@given(text=NUMBER_TEXT, bounds=st.sampled_from([(0, 10), (-(2**53), 2**53), (1, 2**31 - 1), (None, None)]))
def test_parse_number_gives_an_int_in_range_or_one_line(text: str, bounds: tuple) -> None:
    lo, hi = bounds
    got = valid_or_input_error(lambda t: errors.parse_number(t, "since", lo, hi, integer=True), text)
    if got is not None:
        assert type(got) is int and (lo is None or lo <= got) and (hi is None or got <= hi)


@settings(max_examples=2000)
@given(value=JSON_VALUES, integer=st.booleans())
def test_check_number_gives_a_number_in_range_or_one_line(value: Any, integer: bool) -> None:
    got = valid_or_input_error(lambda v: errors.check_number(v, "field 'x'", 0, 2**31 - 1, integer=integer), value)
    if got is not None:
        assert not isinstance(got, bool) and isinstance(got, int if integer else (int, float))
        assert math.isfinite(got) and 0 <= got <= 2**31 - 1


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The dashboard's answers (no sockets), over a folder with one good run, one hostile history slot and a link."""
    root = tmp_path_factory.mktemp("site")
    (root / "r.loss.json").write_text(json.dumps(LOSS))
    (root / "h.loss.json").write_text(json.dumps(LOSS))
    (root / "r.state.json").write_text(json.dumps(STATE))
    (root / "l.loss.json").symlink_to(root / "r.loss.json")
    s = dashboard.Site(root, None, dashboard.PAGE)
    s.bind(8765)
    return s


def answer_of(site: Any, target: str) -> Any:
    ans = site.answer(httpd.Request("GET", target, {"host": "127.0.0.1:8765"}))
    if ans.file is not None:
        ans.file.close()
    assert ans.code in (200, 302, 304, 400, 404, 414, 503), (target, ans.code, ans.body)
    if ans.code == 200 and ans.file is None:
        json.loads(ans.body, parse_constant=lambda c: pytest.fail(f"{c} in an answer to {target}"))
    return ans


QUERY = st.lists(
    st.tuples(
        st.sampled_from(["run", *dashboard.QUERY_NUMBERS, "x"]),
        st.one_of(NUMBER_TEXT, st.sampled_from(["r", "h", "l", "../r", "a/r", "☃"])),
    ),
    max_size=6,
)


@settings(max_examples=1500)
@given(path=st.sampled_from(["/api/loss", "/api/state", "/api/samples", "/api/runs", "/api/x"]), query=QUERY)
def test_every_dashboard_query_is_answered(site: Any, path: str, query: list[tuple[str, str]]) -> None:
    """Any query string (numbers that overflow, names in any script, links): an answer, never a 500."""
    answer_of(site, path + "?" + urlencode(query))
    answer_of(site, path + "?" + "&".join(f"{k}={v}" for k, v in query))  # not even percent-encoded


@settings(max_examples=500)
@given(raw=hostile_json(LOSS))
def test_every_hostile_history_is_answered_with_valid_json(site: Any, raw: bytes) -> None:
    """A history another writer left (NaN, 1e999, keys twice, torn bytes): a strict-JSON 200 or a 503, never a
    dead handler. A fresh mtime each time, so every example is parsed anew."""
    path = site.folder.root / "h.loss.json"
    path.write_bytes(raw.replace(b"3.1", b"NaN").replace(b"1e-3", b"1e999"))
    site.folder.cache.clear()
    for query in ("", "&since=1", "&from=1&to=2&width=16"):
        answer_of(site, "/api/loss?run=h" + query)


@settings(max_examples=3000)
@given(
    head=st.one_of(
        st.binary(max_size=200),
        mutated_bytes(b"GET /api/loss?run=r HTTP/1.1\r\nHost: 127.0.0.1:8765\r\nIf-None-Match: x\r\n\r\n"),
    )
)
def test_every_request_head_parses_or_is_refused(site: Any, head: bytes) -> None:
    req = httpd.parse_head(head)
    if req is not None:
        assert req.target.startswith("/") and all(k == k.lower() for k in req.headers)
        answer_of(site, req.target) if req.method == "GET" else site.answer(req)


HS = {"ctx": "a man", "endings": ["runs", "sits", "eats", "b"], "label": "2"}


@settings(max_examples=800)
@given(raw=hostile_json(HS))
def test_hellaswag_lines(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "hs.jsonl"
    path.write_bytes(json.dumps(HS).encode() + b"\n" + raw + b"\n")
    got = valid_or_input_error(lambda p: hellaswag.read(p, "--hellaswag"), path)
    if got is not None:
        assert all(ex["label"] in (0, 1, 2, 3) and len(ex["endings"]) == 4 for ex in got)


STEP_EVENT = {"event": "step", "step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1e4,
              "dt_ms": 3.0, "tokens": 256}  # fmt: skip


@settings(max_examples=800)
@given(raw=hostile_json(STEP_EVENT))
def test_engine_logs(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    """train.jsonl as `run` adopts it: a step line of any shape gives a history (then used as the proxy uses one),
    the line passed over and counted where it is not a step record (runlog's one reader); the lines around it are
    kept."""
    log = tmp_path_factory.getbasetemp() / "train.jsonl"
    start = json.dumps({"event": "start", "run": "r", "step": 2}).encode()
    log.write_bytes(start + b"\n" + raw + b"\n" + json.dumps({**STEP_EVENT, "step": 4}).encode() + b"\n")
    hist, read = replay_engine_log(log, "r")
    assert all(isinstance(r["step"], int) for r in hist.data["train"])
    assert len(read.records) + read.unreadable >= 2 and read.records[0]["event"] == "start"
    assert read.records[-1] == {**STEP_EVENT, "step": 4}
    hist.truncate_after(hist.covered_step - 1)
    json.dumps(hist.data, allow_nan=False)


@settings(max_examples=800)
@given(raw=hostile_json({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}))
def test_pulled_records(tmp_path_factory: pytest.TempPathFactory, raw: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "in.jsonl"
    path.write_bytes(raw + b"\n" + b"[" * 5000 + b"]" * 5000 + b"\n")
    got = valid_or_input_error(lambda p: list(iter_records(p)), path)
    assert got is not None and got[-1][2] == "invalid json"  # a line never stops the file; the deep one is skipped
