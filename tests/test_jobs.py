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


def job(rid: int, n: int = 1) -> Job:
    spec = Spec(False, [[1]] * n, ["a"] * n, 1, 10, Sampling(0.0), ("\x00",), None, True, False, False, None)
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
