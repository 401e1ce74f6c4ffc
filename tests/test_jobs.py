"""serve's HTTP side of the engine (microgpt/use/jobs.py): the engine's messages read over the real wire (a socket
pair, wire.py) into a job's events. The engine process itself is not started: these are its messages, sent from the
other end, as scheduler.py sends them."""

from __future__ import annotations

import socket
import threading

import numpy as np

from microgpt.data.tokenizer import ByteTokenizer
from microgpt.use.chat import Stream
from microgpt.use.jobs import Choice, Engine, Job
from microgpt.use.oai import Spec
from microgpt.use.sample import Sampling
from microgpt.use.wire import Channel


def engine_side() -> tuple[Engine, Channel]:
    """An Engine (as serve's HTTP side holds it, with no engine process) and the engine's end of its wire."""
    ours, theirs = socket.socketpair()
    eng = object.__new__(Engine)
    eng.chan, eng.lock, eng.jobs, eng.tok, eng.gone, eng.loop = (
        Channel(ours),
        threading.Lock(),
        {},
        ByteTokenizer(),
        "",
        None,
    )
    return eng, Channel(theirs)


def job(rid: int, n: int = 1, stops: tuple[str, ...] = ("\x00",), logprobs: int | None = None) -> Job:
    spec = Spec(False, [[1]] * n, ["a"] * n, 1, 10, Sampling(0.0), stops, None, True, False, False, logprobs)
    j = Job(spec, [Choice(i, [1], Stream(ByteTokenizer().decode, spec.stops)) for i in range(n)])
    j.rid = rid
    return j


def tokens(rid: list[int], index: list[int], token: list[int], code: list[int]) -> tuple:
    return ("tokens", *(np.array(a, np.int32).tobytes() for a in (rid, index, token, code)), [])


def test_the_passes_that_came_since_the_last_read_make_one_event_a_choice() -> None:
    """Three passes of tokens for two jobs, read at once (this side fell behind the engine): each choice gets one event
    with all its text, in order, so the work per token falls as the engine outpaces this side; the finish comes with
    the text of the pass that ended it; a job's pass after another message still reads in order."""
    eng, wire = engine_side()
    a, b = job(0), job(1, n=2)
    eng.jobs = {0: a, 1: b}
    wire.send(*tokens([0, 1, 1], [0, 0, 1], [104, 120, 121], [0, 0, 0]))
    wire.send(*tokens([0, 1], [0, 0], [105, 122], [0, 0]))
    wire.send(*tokens([0, 1], [0, 1], [33, 119], [2, 0]))
    eng._readable()
    got = {(j.rid, e.index): (e.text, e.finish) for j in (a, b) for e in j.take()}
    assert got == {(0, 0): ("hi!", "length"), (1, 0): ("xz", None), (1, 1): ("yw", None)}
    assert a.left == 0 and a.choices[0].drawn == 3 and b.choices[0].drawn == 2
    wire.send(*tokens([1], [1], [118], [0]))
    wire.send("error", 1, "the engine failed")
    wire.send(*tokens([1], [0], [117], [2]))
    eng._readable()
    assert [(e.index, e.text, e.finish) for e in b.take()] == [(1, "v", None), (-1, "the engine failed", "error")] + [
        (0, "u", "length")
    ]


def test_a_stop_string_in_passes_read_together_ends_the_text_and_the_usage_where_it_completes() -> None:
    """ "ab" then "c!" then a stop token, read at once, with the stop string "bc": the text is "a", the finish "stop",
    and usage counts the three tokens up to the one that completed it, not the ones the engine drew after it."""
    eng, wire = engine_side()
    a = job(0, stops=("bc",))
    eng.jobs = {0: a}
    wire.send(*tokens([0], [0], [97], [0]))
    wire.send(*tokens([0], [0], [98], [0]))
    wire.send(*tokens([0], [0], [99], [0]))
    wire.send(*tokens([0], [0], [33], [0]))
    wire.send(*tokens([0], [0], [0], [1]))
    eng._readable()
    assert [(e.text, e.finish) for e in a.take()] == [("a", "stop")] and a.choices[0].drawn == 3


def test_a_choice_whose_logprobs_are_asked_gets_an_event_a_pass() -> None:
    """Its chunks, and which carries which token's logprobs, do not depend on how far behind this side read."""
    eng, wire = engine_side()
    a = job(0, logprobs=0)
    eng.jobs = {0: a}
    for token, lp in ((104, -1.0), (105, -2.0)):
        wire.send("tokens", *(np.array([v], np.int32).tobytes() for v in (0, 0, token, 0)), [(0, 0, token, lp, {})])
    eng._readable()
    assert [(e.text, e.logprobs) for e in a.take()] == [("h", [(104, -1.0, {})]), ("i", [(105, -2.0, {})])]


def test_tokens_read_together_for_many_streams_are_each_streams_in_order() -> None:
    """64 streams of 3 choices, their tokens over 40 passes in a shuffled order each pass (as the engine's batch
    places them), read at once: each choice's text, drawn count and finish are those of its own tokens taken one by
    one, in pass order (a stop token ends a choice and is no text; a token of -1 is none, as a row of max_tokens 0
    sends); a released job's tokens and those of a choice that ended here before are dropped."""
    rng = np.random.default_rng(0)
    eng, wire = engine_side()
    jobs = {r: job(r, n=3, stops=("\x01",)) for r in range(64)}
    eng.jobs = dict(jobs)
    del eng.jobs[5]  # released
    jobs[7].choices[1].finish = "stop"  # ended here (a stop string) before these passes
    want: dict[tuple[int, int], list] = {(r, i): [[], 0, 0] for r in jobs for i in range(3)}  # ids, drawn, code
    live = set(want)
    for _ in range(40):
        rows = [k for k in sorted(live) if rng.random() < 0.8]
        rng.shuffle(rows)
        token = rng.integers(2, 127, len(rows))
        code = np.where(rng.random(len(rows)) < 0.03, 1, np.where(rng.random(len(rows)) < 0.03, 2, 0))
        token[(code == 2) & (rng.random(len(rows)) < 0.5)] = -1
        for (r, i), t, cd in zip(rows, token.tolist(), code.tolist()):
            w = want[r, i]
            w[1] += t >= 0
            w[0] += [t] if t >= 0 and cd != 1 else []
            w[2] = cd
            if cd:
                live.discard((r, i))
        wire.send(*tokens([k[0] for k in rows], [k[1] for k in rows], token.tolist(), code.tolist()))
    eng._readable()
    for r, j in jobs.items():
        events = j.take()
        for i, c in enumerate(j.choices):
            got = "".join(e.text for e in events if e.index == i)
            finish = [e.finish for e in events if e.index == i and e.finish]
            ids, drawn, cd = want[r, i]
            if r == 5 or (r, i) == (7, 1):
                assert got == "" and c.drawn == 0 and c.ids == []
                continue
            assert (c.ids, c.drawn, got) == (ids, drawn, bytes(ids).decode())
            assert finish == ([] if cd == 0 else ["stop" if cd == 1 else "length"])


def test_a_streams_end_goes_in_the_write_of_its_last_text() -> None:
    """serve's stream (Api._chunks) over a job of two choices: a wake with text yields one chunk of events; the wake
    that ends the last choice yields its text, its finish, the usage and [DONE] in one chunk (one write), and the
    stream ends there. The events are sse()'s, in order."""
    import asyncio
    import dataclasses
    import json

    from microgpt.use.jobs import Event
    from microgpt.use.oai import Reply
    from microgpt.use.serve import DONE, Api

    api = object.__new__(Api)
    api.tok = ByteTokenizer()
    a = job(0, n=2)
    a.spec = dataclasses.replace(a.spec, include_usage=True)
    a.choices[0].drawn, a.choices[1].drawn = 2, 3
    reply = Reply("cmpl-x", "m", False, 1)

    async def read() -> list[bytes]:
        chunks = api._chunks(a, a.spec, reply)
        a.send(Event(0, "h"))
        a.send(Event(1, "y", "length"))
        out = [await anext(chunks)]
        a.send(Event(0, "i", "length"))
        out.append(await anext(chunks))
        out += [c async for c in chunks]
        return out

    first, last = asyncio.run(read())
    events = [json.loads(e[6:]) for e in last.split(b"\n\n") if e.startswith(b"data: {")]
    assert [(c["index"], c["text"], c["finish_reason"]) for e in events for c in e["choices"]] == [
        (0, "i", None),
        (0, "", "length"),
    ]
    assert events[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert last.endswith(b"}\n\n" + DONE) and DONE not in first
    assert [c["finish_reason"] for e in first.split(b"\n\n") if e for c in json.loads(e[6:])["choices"]] == [
        None,
        None,
        "length",
    ]
