"""microgpt chat and sample --chat: ChatML history within the context, KV cache reuse, streaming, stops."""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint
from microgpt.data.tokenizer import IM_END, ByteTokenizer, train_bpe
from microgpt.use import chat, sample
from tests.conftest import cli
from tests.test_cli import one_line_error

GREEDY = ["--temperature", "0", "--tokens", "8"]


@pytest.fixture
def run_dir(run_256: Path) -> Path:
    return run_256


def flags(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"tokens": 8, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0, **kw})


def test_fit_history_drops_oldest_turns_keeps_system() -> None:
    msgs = [{"role": "system", "content": "Be brief."}]
    for i in range(3):
        msgs += [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
    msgs.append({"role": "user", "content": "last"})
    enc = ByteTokenizer().encode
    kept, ids = chat.fit_history(msgs, enc, 10_000)
    assert kept == msgs and ids == enc(chat.prompt_text(msgs))
    budget = len(enc(chat.prompt_text([msgs[0], *msgs[3:]])))  # room for system + the newest two turns
    kept, ids = chat.fit_history(msgs, enc, budget)
    assert kept == [msgs[0], *msgs[3:]] and len(ids) == budget
    kept, ids = chat.fit_history(msgs, enc, 5)  # even system + last do not fit: the prompt's tail
    assert kept == [msgs[0], msgs[-1]] and ids == enc(chat.prompt_text(kept))[-5:]


def test_second_turn_prompt_holds_first_turn_and_reply(run_dir: Path) -> None:
    gen, tok, _ = sample.load(str(run_dir))
    c = chat.Chat(gen, tok, flags(), system="Be brief.")
    first = c.turn("hi", io.StringIO())
    calls = []
    feed = gen.feed
    gen.feed = lambda ids: calls.extend(ids) or feed(ids)  # type: ignore[method-assign]
    c.turn("more", io.StringIO())
    seen = tok.decode(c.fed)
    history = c.messages[:3]
    assert [m["content"] for m in history] == ["Be brief.", "hi", first]
    assert seen.startswith(chat.prompt_text(history)[: -len("<|im_start|>assistant\n")] + "<|im_start|>user\nmore")
    assert len(calls) < len(c.fed) // 2  # the cache kept the first turn: only the new tokens ran


def test_a_long_conversation_stays_within_the_context(run_dir: Path) -> None:
    gen, tok, _ = sample.load(str(run_dir))
    c = chat.Chat(gen, tok, flags(), system="Be brief.")
    for i in range(8):  # ~45 byte tokens a turn: the 256-token context holds about five
        c.turn(f"question number {i}", io.StringIO())
        assert len(c.fed) <= gen.m.seq_len and c.messages[0]["content"] == "Be brief."
    assert c.messages[1]["content"] != "question number 0" and c.messages[-2]["content"] == "question number 7"


class Scripted:
    """A stand-in for sample.Generator whose greedy continuation is a fixed byte string."""

    def __init__(self, text: str, seq_len: int = 4096):
        self.script, self.m, self.pos, self.n = list(text.encode()), argparse.Namespace(seq_len=seq_len), 0, 0

    def feed(self, ids: list[int]) -> np.ndarray:
        """The script's byte at the count of tokens fed so far (n counts them, from where the test set it)."""
        self.pos += len(ids)
        self.n += len(ids)
        logits = np.zeros(256, np.float32)
        logits[self.script[min(max(self.n - 1, 0), len(self.script) - 1)]] = 1.0
        return logits


class Pieces(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[str] = []

    def write(self, s: str) -> int:
        self.pieces.append(s)
        return super().write(s)


def test_reply_stops_at_im_end_and_streams_whole_characters() -> None:
    kv = Scripted(f"Oké 😀 ok{IM_END}\nnever printed")
    c = chat.Chat(kv, ByteTokenizer(), flags(tokens=100))  # type: ignore[arg-type]
    kv.n = -len(ByteTokenizer().encode(chat.prompt_text([{"role": "user", "content": "x"}]))) + 1
    out = Pieces()
    assert c.turn("x", out) == "Oké 😀 ok"
    assert out.getvalue() == "Oké 😀 ok\n"  # the stop string is never printed
    assert not any("\ufffd" in p or "<" in p for p in out.pieces)  # no broken character, no partial stop
    assert len([p for p in out.pieces if p]) > 3  # streamed, not printed at the end


def test_reply_ends_at_token_limit() -> None:
    kv = Scripted("abcdefghijkl")
    c = chat.Chat(kv, ByteTokenizer(), flags(tokens=4))  # type: ignore[arg-type]
    kv.n = -len(ByteTokenizer().encode(chat.prompt_text([{"role": "user", "content": "x"}]))) + 1
    out = io.StringIO()
    assert c.turn("x", out) == "abcd" and out.getvalue() == "abcd\n"


def test_chat_through_a_pipe(run_dir: Path) -> None:
    two = cli("chat", str(run_dir), *GREEDY, input="hi\n\nmore\n")
    assert two.returncode == 0, two.stderr
    assert two.stdout == cli("chat", str(run_dir), *GREEDY, input="hi\n\nmore\n").stdout  # deterministic
    assert "> " not in two.stdout[:2]  # no prompt marker when stdin is not a terminal
    one = cli("chat", str(run_dir), *GREEDY, input="hi\n")
    assert one.returncode == 0 and two.stdout.startswith(one.stdout) and len(two.stdout) > len(one.stdout)
    assert IM_END not in two.stdout
    res = cli("sample", str(run_dir), "--chat", "--prompt", "hi", *GREEDY)
    assert res.returncode == 0, res.stderr
    assert res.stdout == one.stdout  # the same prompt format, the same reply
    rec = json.loads(cli("sample", str(run_dir), "--chat", "--prompt", "hi", "--json", *GREEDY).stdout)
    assert rec["text"] + "\n" == one.stdout and rec["chat"] is True


def test_bad_input_one_line_exit_2(run_dir: Path, tmp_path: Path) -> None:
    one_line_error(cli("chat", str(run_dir), "--tokens", "-1", input=""), "--tokens")
    one_line_error(cli("chat", str(run_dir), "--temperature", "nan", input=""), "--temperature")
    one_line_error(cli("sample", str(run_dir), "--chat", "--temperature", "-1"), "--temperature")
    ck = checkpoint.latest_valid_checkpoint(run_dir / "ckpt")
    junk = tmp_path / "junk" / ck.name  # the run's sidecar, a truncated .bin
    junk.parent.mkdir()
    junk.write_bytes(b"\x00\x01")
    shutil.copy(checkpoint.sidecar_path(ck), checkpoint.sidecar_path(junk))
    one_line_error(cli("chat", str(junk), input="hi\n"), str(junk), "truncated")
    other = tmp_path / ck.name
    shutil.copy(ck, other)
    side = json.loads(checkpoint.sidecar_path(ck).read_text())
    side["config"]["model"]["d_model"] = 64  # a sidecar for another model: the weights do not fit it
    checkpoint.sidecar_path(other).write_text(json.dumps(side))
    one_line_error(cli("chat", str(other), input="hi\n"), str(other).removesuffix(".bin"), "another model")


def test_bpe_special_tokens_frame_the_turn_and_stop_the_reply() -> None:
    tok = train_bpe(["hello world ok fine"] * 50, 300)
    assert tok.encode(chat.prompt_text([{"role": "user", "content": "hi"}]))[0] == tok.im_start_id  # one token
    assert chat.Stream(tok.decode).push([*tok.encode("ok fine"), tok.im_end_id, *tok.encode("x")]) == ("ok fine", True)


def whole_stream(decode, stops):
    """Stream as it was before pushes became incremental: the whole reply decoded at each push (the reference)."""
    shown = 0

    def push(ids: list[int], last: bool = False) -> tuple[str, bool]:
        nonlocal shown
        text = decode(ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
        elif not last:
            text = text.rstrip("\ufffd")
            for s in stops:
                for n in range(len(s) - 1, 0, -1):
                    if text.endswith(s[:n]):
                        text = text[:-n]
                        break
        new, shown = text[shown:], max(shown, len(text))
        return new, cut >= 0

    return push


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_an_incremental_stream_streams_what_decoding_it_whole_does(kind: str) -> None:
    """Random replies rich in what a push must get right: characters of 2 to 4 bytes split across tokens, bytes that
    are no UTF-8 at all, U+FFFD itself, stop strings arriving token by token (a user's, one that is a prefix of
    another, ChatML's) and special tokens: every push returns what the whole reply decoded at each push returns."""
    text = "ab <|im_end|> é€😀 abc\ufffd x<|im" * 3
    if kind == "bytes":
        tok = ByteTokenizer()
        pool = [*tok.encode(text), 0xFF, 0x80, 0xC3, 0xF0, 0x9F]
    else:
        tok = train_bpe(["héllo wörld € 😀 ok fine <tag> ab abc"] * 50, 330)
        pool = list(range(tok.vocab_size)) + tok.encode(text)
    stops = ("abc", "ab c", IM_END, "<|endoftext|>", "€😀")
    rng, encoded = np.random.default_rng(0), tok.encode(text)
    for trial in range(300):
        ids = []  # pieces of the text (its stops and characters arrive whole or split), and random ids between
        while len(ids) < 40:
            at = int(rng.integers(len(encoded)))
            ids += encoded[at : at + int(rng.integers(1, 12))] if rng.random() < 0.7 else [int(rng.choice(pool))]
        inc, ref = chat.Stream(tok.decode, stops), whole_stream(tok.decode, stops)
        for n in range(1, len(ids) + 1):
            last = n == len(ids)
            got = inc.push(ids[:n], last)
            assert got == ref(ids[:n], last), (trial, ids[:n])
            if got[1]:
                break
