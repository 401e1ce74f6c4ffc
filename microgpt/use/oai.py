"""The OpenAI API's shapes for `microgpt serve`: a request body read into a `Spec` (every field checked, a 4xx
`ApiError` naming the field otherwise), and the JSON of errors, answers and streamed chunks.

Read: model (required, the run's name), messages (chat: roles system, developer (as system), user, assistant; content a
string or a list of text parts) or prompt (completions: a string, a list of strings, a list of token ids, or a list of
such lists: one choice set per prompt, as OpenAI's batched prompts), max_tokens (or max_completion_tokens; completions
with echo may ask 0: the prompt scored, nothing drawn), temperature (0..2, default 1), top_p (0..1), top_k (an
extension, as vLLM's and llama.cpp's), n (1..--max-batch), stop (a string or a list of up to MAX_STOPS), seed, stream,
stream_options.include_usage, echo and logprobs (completions: 0..5, each token's logprob and the likeliest alternatives;
with echo the prompt's tokens too, as loglikelihood clients such as lm-evaluation-harness score), truncate_prompt_tokens
(an extension, as vLLM's: keep a prompt's last N tokens instead of refusing one longer than the context), ignore_eos (an
extension, as vLLM's: <|endoftext|> does not end a choice; benchmarks). Text must be UTF-8 (JSON can carry a lone
surrogate, which no tokenizer takes: 400 naming the field). The fields that would change the answer and are not
implemented are refused unless at their neutral value (NEUTRAL); any other field is ignored (user, metadata, store,
...), as clients send fields a server lacks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from microgpt import config
from microgpt.data.chatml import Message, prompt_text
from microgpt.data.tokenizer import EOT
from microgpt.errors import InputError, check_number
from microgpt.httpd import Answer
from microgpt.use.chat import STOPS
from microgpt.use.sample import Sampling

# stop strings a request may name: OpenAI's API takes 4, vLLM any number, and lm-evaluation-harness's generation
# tasks send their own list and the end-of-text string (5 or more); each push of a choice's text seeks every stop
# and holds back a prefix of each (chat.held_prefix), so the bound keeps that check small beside the push's decode
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 5  # completions' logprobs, as OpenAI's API
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# field: the values that mean "off", where the feature is not implemented here (chat: logprobs too)
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"), "logit_bias": (None, {}),
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "response_format": (None, {"type": "text"}),
    "suffix": (None, ""), "best_of": (None, 1),
}  # fmt: skip
CHAT_NEUTRAL = {"logprobs": (None, False), "top_logprobs": (None, 0)}
ERROR_TYPES = {429: "requests", 500: "server_error", 503: "server_error"}


class ApiError(Exception):
    """A request the API refuses: the HTTP code and OpenAI's error fields."""

    def __init__(
        self, code: int, message: str, param: str | None = None, kind: str | None = None, err: str | None = None
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.err = code, message, param, err
        self.kind = kind or ERROR_TYPES.get(code, "invalid_request_error")

    def answer(self, **headers: str) -> Answer:
        return json_answer({"error": self.body()}, self.code, **headers)

    def body(self) -> dict[str, Any]:
        return {"message": self.message, "type": self.kind, "param": self.param, "code": self.err}


class FieldError(InputError):
    """check_number's error for a request field (becomes a 400 naming it)."""


def dumps(obj: Any) -> bytes:
    """JSON as UTF-8; a lone surrogate that slipped into a message (an echoed name) becomes U+FFFD, never a 500."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False).encode("utf-8", "replace")


def json_answer(obj: Any, code: int = 200, **headers: str) -> Answer:
    return Answer(code, {"Content-Type": "application/json", **headers}, dumps(obj))


def api_error(code: int, message: str = "", **headers: str) -> Answer:
    """The transport's own errors (httpd.py: malformed head, body too large, ...) in OpenAI's error body."""
    return ApiError(code, message).answer(**headers)


def sse(obj: Any) -> bytes:
    """One server-sent event of JSON data."""
    return b"data: " + dumps(obj) + b"\n\n"


@dataclass(frozen=True)
class Spec:
    """A completion request, checked: its prompts' ids and how to continue them. Choice i * n + j continues prompt i
    (its j-th draw), as OpenAI numbers the choices of batched prompts."""

    chat: bool
    prompts: list[list[int]]
    texts: list[str]  # each prompt as text (echo puts it before each of its choices' text)
    n: int
    max_tokens: int
    sampling: Sampling
    stops: tuple[str, ...]  # the request's stop strings and the model's own (<|im_end|> in chat, <|endoftext|>)
    seed: int | None
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None  # completions: each token's logprob and this many alternatives; None: not asked
    ignore_eos: bool = False  # the end of document does not end a choice (an extension, as vLLM's: benchmarks)

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n


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


def utf8(text: str, where: str) -> str:
    """text, if it is UTF-8 text: JSON's \\ud800 escapes make a lone surrogate, which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(
            400, f"{where} is not UTF-8 text (a lone surrogate at character {e.start})", where, err="invalid_value"
        ) from None
    return text


def messages_of(obj: dict[str, Any]) -> list[Message]:
    """Chat messages as data/chat.py renders them; content parts of type text are joined."""
    raw = obj.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages", err="invalid_type")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            shown = role if isinstance(role, str) else type(role).__name__
            raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {shown!r}"[:300], f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):  # parts: text only (no images, audio, files)
            texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
                content = "".join(texts)
        if not isinstance(content, str):
            raise ApiError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        out.append({"role": ROLES[role], "content": utf8(content, f"{where}.content")})
    return out


def prompts_of(obj: dict[str, Any], vocab: int) -> list[str | list[int]]:
    """Completions' prompt as a list of prompts, each text or token ids (ints in [0, vocab))."""
    raw = obj.get("prompt")
    if isinstance(raw, str) or (isinstance(raw, list) and raw and all(isinstance(t, int) for t in raw)):
        raw = [raw]
    bad = ApiError(
        400,
        "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
        "prompt",
        err="invalid_type",
    )
    if not isinstance(raw, list) or not raw:
        raise bad
    out: list[str | list[int]] = []
    for i, p in enumerate(raw):
        if isinstance(p, str):
            out.append(utf8(p, "prompt" if len(raw) == 1 else f"prompt[{i}]"))
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if not all(0 <= t < vocab for t in p):
                raise ApiError(400, f"prompt token ids must be in [0, {vocab})", "prompt", err="invalid_value")
            out.append(list(p))
        else:
            raise bad
    return out


def token_ids(obj: dict[str, Any], name: str, vocab: int) -> list[int]:
    """A field that must be a list of token ids, each in [0, vocab)."""
    ids = obj.get(name)
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ApiError(400, f"{name} must be a list of token ids", name, err="invalid_type")
    if not all(0 <= t < vocab for t in ids):
        raise ApiError(400, f"{name}: token ids must be in [0, {vocab})", name, err="invalid_value")
    return ids


def tokenize_text(obj: dict[str, Any]) -> str:
    """vLLM's /tokenize body: the text of its "prompt", or of its chat "messages" as /v1/chat/completions renders
    them (ChatML, the assistant's turn opened). add_special_tokens, where sent, must be a bool: this tokenizer adds
    none either way (a document starts after <|endoftext|> only where the text says so)."""
    typed(obj, "add_special_tokens", bool, False)
    if "messages" in obj:
        return prompt_text(messages_of(obj))
    prompt = obj.get("prompt")
    if not isinstance(prompt, str):
        shown = type(prompt).__name__ if "prompt" in obj else "nothing"
        raise ApiError(400, f"prompt must be a string (or send messages), got {shown}", "prompt", err="invalid_type")
    return utf8(prompt, "prompt")


def stops_of(obj: dict[str, Any]) -> tuple[str, ...]:
    raw = obj.get("stop")
    stops = [] if raw is None else [raw] if isinstance(raw, str) else raw
    bad = not isinstance(stops, list) or len(stops) > MAX_STOPS
    if bad or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(
            400,
            f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
            f"{MAX_STOP_CHARS} characters",
            "stop",
            err="invalid_value",
        )
    return tuple(utf8(s, "stop") for s in stops)


def check_neutral(obj: dict[str, Any], chat: bool) -> None:
    for name, off in (NEUTRAL | CHAT_NEUTRAL if chat else NEUTRAL).items():
        value = obj.get(name)
        if name in obj and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in off):
            raise ApiError(400, f"{name} is not supported by this server (leave it out)", name, err="unsupported")


@dataclass(frozen=True)
class Model:
    """What parsing needs of the model: its context, its vocabulary, its tokenizer's encode and decode, and the
    batch and queue a request's choices must fit."""

    seq_len: int
    vocab: int
    encode: Callable[[str], list[int]]  # text -> ids; "" -> a new document (<|endoftext|>)
    decode: Callable[[Sequence[int]], str]
    max_batch: int
    max_rows: int  # max_batch + the queue: the rows one request may hold


def parse(obj: dict[str, Any], chat: bool, model: Model) -> Spec:
    """A chat (messages) or completions (prompt) request body as a Spec; ApiError naming the field otherwise."""
    check_neutral(obj, chat)
    raw = [prompt_text(messages_of(obj))] if chat else prompts_of(obj, model.vocab)
    n = number(obj, "n", 1, 1, model.max_batch, integer=True)
    if len(raw) * n > model.max_rows:
        raise ApiError(
            400,
            f"{len(raw)} prompts x n {n} choices: this server holds at most {model.max_rows} at once",
            "prompt",
            err="invalid_value",
        )
    echo = not chat and typed(obj, "echo", bool, False)
    ignore_eos = typed(obj, "ignore_eos", bool, False)
    logprobs = None if chat else number(obj, "logprobs", None, 0, MAX_LOGPROBS, integer=True)
    least = 0 if echo else 1  # echo with max_tokens 0: the prompt alone, scored
    limit = number(obj, "max_completion_tokens", config.MAX_TOKENS if chat else 16, least, config.MAX_TOKENS, True)
    max_tokens = number(obj, "max_tokens", limit, least, config.MAX_TOKENS, integer=True)
    # a prompt scored and not continued (echo, max_tokens 0) may hold one token more than the context: its last
    # token is only predicted, never fed (lm-evaluation-harness sends max_length + 1 tokens)
    fits = model.seq_len + (echo and max_tokens == 0)
    keep = number(obj, "truncate_prompt_tokens", None, 1, fits, integer=True)
    ids = [model.encode(p) if isinstance(p, str) else p for p in raw]
    texts = [p if isinstance(p, str) else model.decode(p) for p in raw]
    for i, p in enumerate(ids):
        if keep is not None and len(p) > keep:
            ids[i] = p = p[-keep:]
            texts[i] = model.decode(p)
        if len(p) > fits:
            what = "messages take" if chat else "prompt takes" if len(ids) == 1 else f"prompt[{i}] takes"
            raise ApiError(
                400,
                f"this model's context is {model.seq_len} tokens; the {what} {len(p)} (send "
                "truncate_prompt_tokens to keep a prompt's last tokens)",
                "messages" if chat else "prompt",
                err="context_length_exceeded",
            )
    return Spec(
        chat=chat,
        prompts=ids,
        texts=texts,
        n=n,
        max_tokens=max_tokens,
        sampling=Sampling(
            number(obj, "temperature", 1.0, 0, 2),
            number(obj, "top_k", 0, 0, config.INT_MAX, True),
            number(obj, "top_p", 1.0, 0, 1),
        ),
        stops=stops_of(obj) + tuple(s for s in (STOPS if chat else (EOT,)) if not (ignore_eos and s == EOT)),
        seed=number(obj, "seed", None, 0, config.SEED_MAX - len(ids) * n + 1, integer=True),
        stream=typed(obj, "stream", bool, False),
        include_usage=typed(typed(obj, "stream_options", dict, {}), "include_usage", bool, False),
        echo=echo,
        logprobs=logprobs,
        ignore_eos=ignore_eos,
    )


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

    def choice(
        self,
        index: int,
        text: str,
        finish: str | None,
        chunk: bool = False,
        role: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict:
        """One choice: a whole one, or a chunk's delta (the first of a chat choice carries the role)."""
        if not self.chat:
            return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}
        body = {"role": "assistant", "content": text} if (role or not chunk) else {"content": text} if text else {}
        return {"index": index, ("delta" if chunk else "message"): body, "logprobs": None, "finish_reason": finish}


def completion_logprobs(
    entries: list[tuple[int, float | None, dict[int, float] | None]],
    decode: Callable[[Sequence[int]], str],
    offset: int = 0,
) -> dict[str, Any]:
    """Completions' logprobs object for (token, logprob, {id: logprob of the likeliest}) entries, as OpenAI's: tokens
    (each id's own text), token_logprobs, top_logprobs ({text: logprob}; None where the logprob is, the prompt's first
    token) and text_offset (the characters of the tokens before it, from `offset`)."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, lp, top in entries:
        text = decode([token])
        tokens.append(text)
        lps.append(lp)
        tops.append(None if top is None else {decode([i]): v for i, v in top.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


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
        return parts[0] + dumps(text) + parts[1]

    return event


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
