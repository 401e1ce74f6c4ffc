"""The wire between serve's two processes (serve.py, the HTTP side; scheduler.py, the engine): framed messages over
one end each of a Unix socket pair, neither side ever blocked by the other.

A frame is a 4-byte little-endian length and a pickled tuple whose first item names the message. Sending appends the
frame to an outbox and writes what the socket takes now; the rest waits for the next flush (the engine flushes once a
step, the HTTP side's event loop when the socket is writable), so a side that reads slowly holds the other's bytes in
its outbox, never its loop. Receiving reads what has arrived and returns the whole frames in it. Pickle is safe here:
both ends are this package's own processes, started together, and the socket pair is theirs alone.

    HTTP side -> engine   ("start",)                   begin stepping (requests submitted before wait until then)
                          ("submit", rid, [RowSpec])   a request's rows, one per choice
                          ("cancel", rid, index)       a choice (index -1: every choice of rid) leaves its row
                          ("stats",)                   ask for the engine's counters
                          ("stop",)                    end the loop; the process exits
    engine -> HTTP side   ("ready", info, loaded) / ("fail", message)   once, after loading the model: info
                                                       the device's (/stats shows it), loaded {"path", "step",
                                                       "side"} the checkpoint read and its sidecar (serve reads no
                                                       checkpoint itself); fail: why not, one line
                          ("tokens", rids, indices, tokens, codes, lps)  a pass's new tokens (int32 arrays), their
                                                       finish codes (FINISH) and, where asked, their logprobs:
                                                       [(rid, index, token, logprob, {id: logprob})]
                          ("echo", rid, index, lps)    a prompt's own logprobs, [(logprob, {id: logprob})] for
                                                       every token after the first (echo)
                          ("error", rid, message)      a request the engine could not finish
                          ("stats", counters)
"""

from __future__ import annotations

import pickle
import select
import socket
import struct
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("<I")
BUFFER = 4 << 20  # bytes of socket buffer each way: a burst of steps or prompts waits in the kernel, not in Python
FINISH = {0: None, 1: "stop", 2: "length"}  # a token's code: 1 a stop token (not text), 2 max_tokens or the context


@dataclass(frozen=True)
class RowSpec:
    """One choice as the engine receives it: its prompt's ids and how to continue it."""

    index: int
    prompt: bytes  # int32 ids
    max_tokens: int  # 0: none (echo with logprobs only)
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_ids: tuple[int, ...]
    logprobs: int  # -1: none; k >= 0: each drawn token's logprob and the k likeliest
    echo: bool  # the prompt's own logprobs too


class Channel:
    """One end of the socket pair: send() queues and writes what the socket takes, receive() returns whole frames."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER)
        self.outbox = bytearray()
        self.inbox = bytearray()
        self.closed = False  # the other end has gone

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, *msg: Any) -> None:
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        self.outbox += HEADER.pack(len(data)) + data
        self.flush()

    def flush(self) -> bool:
        """Write what the socket takes now; True when nothing is left."""
        while self.outbox and not self.closed:
            try:
                sent = self.sock.send(self.outbox)
            except BlockingIOError:
                return False
            except OSError:  # the other end has gone: nothing more will be read
                self.closed = True
                self.outbox.clear()
                return True
            del self.outbox[:sent]
        return not self.outbox

    def receive(self) -> list[tuple[Any, ...]]:
        """The whole messages that have arrived (none: []); `closed` once the other end has gone."""
        while not self.closed:
            try:
                data = self.sock.recv(BUFFER)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:
                self.closed = True
                break
            self.inbox += data
        out, at = [], 0
        while len(self.inbox) - at >= HEADER.size:
            (n,) = HEADER.unpack_from(self.inbox, at)
            if len(self.inbox) - at - HEADER.size < n:
                break
            out.append(pickle.loads(self.inbox[at + HEADER.size : at + HEADER.size + n]))
            at += HEADER.size + n
        del self.inbox[:at]
        return out

    def wait(self, timeout: float | None) -> None:
        """Until something arrives (or the outbox can be written), at most timeout seconds (None: no bound)."""
        writable = [self.sock] if self.outbox else []
        select.select([self.sock], writable, [], timeout)
