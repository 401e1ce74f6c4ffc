"""The OpenAI API's shapes for `microgpt serve`: a request body read into a `Spec` (every field checked, a 4xx
`ApiError` naming the field otherwise), and the JSON of errors, answers and streamed chunks.

Read: model (required, the run's name), messages (chat: roles system, developer (as system), user, assistant;
content a string or a list of text parts) or prompt (completions: a string, or a list of one), max_tokens (or
max_completion_tokens), temperature (0..2, default 1), top_p (0..1), top_k (an extension, as vLLM's and llama.cpp's),
n (1..--max-batch), stop (a string or a list of up to 4), seed, stream, stream_options.include_usage, echo
(completions). The fields that would change the answer and are not implemented are refused unless at their neutral
value (NEUTRAL); any other field is ignored (user, metadata, store, ...), as clients send fields a server lacks.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from microgpt import config
from microgpt.data.chatml import Message, prompt_text
from microgpt.data.tokenizer import EOT
from microgpt.errors import InputError, check_number
from microgpt.httpd import Answer
from microgpt.use.chat import STOPS
from microgpt.use.sample import Sampling

MAX_STOPS = 4  # as OpenAI's API
MAX_STOP_CHARS = 256
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# field: the values that mean "off", where the feature is not implemented here
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"), "logprobs": (None, False),
    "top_logprobs": (None, 0), "logit_bias": (None, {}), "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "response_format": (None, {"type": "text"}), "suffix": (None, ""), "best_of": (None, 1),
}  # fmt: skip
ERROR_TYPES = {429: "requests", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the API refuses: the HTTP code and OpenAI's error fields."""

    def __init__(self, code: int, message: str, param: str | None = None, kind: str | None = None,
                 err: str | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.code, self.message, self.param, self.err = code, message, param, err
        self.kind = kind or ERROR_TYPES.get(code, "invalid_request_error")

    def answer(self, **headers: str) -> Answer:
        return json_answer({"error": self.body()}, self.code, **headers)

    def body(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.err}


class FieldError(InputError):
    """check_number's error for a request field (becomes a 400 naming it)."""


def json_answer(obj: Any, code: int = 200, **headers: str) -> Answer:
    data = json.dumps(obj, ensure_ascii=False, allow_nan=False).encode()
    return Answer(code, {"Content-Type": "application/json", **headers}, data)


def api_error(code: int, message: str = "", **headers: str) -> Answer:
    """The transport's own errors (httpd.py: malformed head, body too large, ...) in OpenAI's error body."""
    return ApiError(code, message).answer(**headers)


def sse(obj: Any) -> bytes:
    """One server-sent event of JSON data."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, allow_nan=False).encode() + b"\n\n"


@dataclass(frozen=True)
class Spec:
    """A completion request, checked: its prompt's ids and how to continue it."""

    chat: bool
    prompt: list[int]
    n: int
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]  # the request's stop strings and the model's own (<|im_end|> in chat, <|endoftext|>)
    seed: int | None
    stream: bool
    include_usage: bool
    echo: str  # completions' echo: the prompt text, put before each choice's text ("" otherwise)


def parse_body(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        raise ApiError(400, "the request body is not valid JSON", err="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(obj).__name__}", err="invalid_json")
    return obj


def number(obj: dict[str, Any], name: str, default: Any, lo: float, hi: float, integer: bool = False) -> Any:
    """A numeric field (null or absent: default), checked by errors.check_number."""
    value = obj.get(name)
    if value is None:
        return default
    try:
        return check_number(value, name, lo, hi, integer=integer, error=FieldError)
    except FieldError as e:
        raise ApiError(400, str(e), name, err="invalid_value") from None


def typed(obj: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise ApiError(400, f"{name} must be {kind.__name__}, got {type(value).__name__}", name, err="invalid_type")
    return value


def messages_of(obj: dict[str, Any]) -> list[Message]:
    """Chat messages as data/chat.py renders them; content parts of type text are joined."""
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages", err="invalid_type")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            role = m.get("role") if isinstance(m, dict) else None
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}"[:300], f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # parts: text only (no images, audio, files)
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
                content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": ROLES[m["role"]], "content": content})
    return out


def prompt_of(obj: dict[str, Any]) -> str:
    raw = obj.get("prompt")
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if not isinstance(raw, str):
        raise ApiError(400, "prompt must be a string (or a list of one string)", "prompt", err="invalid_type")
    return raw


def stops_of(obj: dict[str, Any]) -> tuple[str, ...]:
    raw = obj.get("stop")
    stops = [] if raw is None else [raw] if isinstance(raw, str) else raw
    bad = not isinstance(stops, list) or len(stops) > MAX_STOPS
    if bad or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                       f"{MAX_STOP_CHARS} characters", "stop", err="invalid_value")  # fmt: skip
    return tuple(stops)


def check_neutral(obj: dict[str, Any]) -> None:
    for name, off in NEUTRAL.items():
        if name in obj and obj[name] not in off:
            raise ApiError(400, f"{name} is not supported by this server (leave it out)", name, err="unsupported")


def parse(obj: dict[str, Any], chat: bool, encode: Any, seq_len: int, max_n: int) -> Spec:
    """A chat (messages) or completions (prompt) request body as a Spec; ApiError naming the field otherwise."""
    check_neutral(obj)
    text = prompt_text(messages_of(obj)) if chat else prompt_of(obj)
    n = number(obj, "n", 1, 1, max_n, integer=True)
    limit = number(obj, "max_completion_tokens", config.MAX_TOKENS if chat else 16, 1, config.MAX_TOKENS, True)
    spec = Spec(
        chat=chat, prompt=[], n=n, max_tokens=number(obj, "max_tokens", limit, 1, config.MAX_TOKENS, integer=True),
        sampling=Sampling(number(obj, "temperature", 1.0, 0, 2), number(obj, "top_k", 0, 0, config.INT_MAX, True),
                          number(obj, "top_p", 1.0, 0, 1)),
        stops=stops_of(obj) + (STOPS if chat else (EOT,)),
        seed=number(obj, "seed", None, 0, config.SEED_MAX - n + 1, integer=True),
        stream=typed(obj, "stream", bool, False),
        include_usage=typed(typed(obj, "stream_options", dict, {}), "include_usage", bool, False),
        echo=text if not chat and typed(obj, "echo", bool, False) else "",
    )  # fmt: skip
    ids = encode(text)
    if len(ids) > seq_len:
        what = "messages take" if chat else "prompt takes"
        raise ApiError(400, f"this model's context is {seq_len} tokens; the {what} {len(ids)}",
                       "messages" if chat else "prompt", err="context_length_exceeded")  # fmt: skip
    return dataclasses.replace(spec, prompt=ids)


@dataclass(frozen=True)
class Reply:
    """What every answer and chunk of one request share: its id, time, model and object names."""

    id: str
    model: str
    chat: bool
    created: int = 0

    @classmethod
    def make(cls, rid: str, model: str, chat: bool) -> Reply:
        return cls(("chatcmpl-" if chat else "cmpl-") + rid, model, chat, int(time.time()))

    def head(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def choice(self, index: int, text: str, finish: str | None, chunk: bool = False, role: bool = False) -> dict:
        """One choice: a whole one, or a chunk's delta (the first of a chat choice carries the role)."""
        if not self.chat:
            return {"text": text, "index": index, "logprobs": None, "finish_reason": finish}
        body = {"role": "assistant", "content": text} if (role or not chunk) else {"content": text} if text else {}
        return {"index": index, ("delta" if chunk else "message"): body, "logprobs": None, "finish_reason": finish}


def sse_text(head: dict[str, Any], reply: Reply) -> Callable[[int, str], bytes]:
    """(index, text) -> the event sse({**head, "choices": [reply.choice(index, text, None, chunk=True)]}), the same
    bytes, for a text that is not empty: the JSON around the text is encoded once a choice, not once a token."""
    mark = json.dumps("\x00").encode()  # a JSON string no head holds around the text's place
    around: dict[int, list[bytes]] = {}

    def event(index: int, text: str) -> bytes:
        parts = around.get(index)
        if parts is None:
            parts = around[index] = sse({**head, "choices": [reply.choice(index, "\x00", None, chunk=True)]}).split(
                mark
            )
        if len(parts) != 2:  # the model's name holds the mark: encode the whole event
            return sse({**head, "choices": [reply.choice(index, text, None, chunk=True)]})
        return parts[0] + json.dumps(text, ensure_ascii=False).encode() + parts[1]

    return event


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
