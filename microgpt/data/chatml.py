"""ChatML rendering and conversation validation.

A conversation is a list of messages {"role": system|user|assistant|tool, "content": str}. Rendered:

    <|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\nHello!<|im_end|>\\n                  (one string; broken here for width)

render() also returns the character spans the loss mask keeps: each assistant message's content
and its closing <|im_end|> (so the model learns to stop), never the prompt or the role header.
ShareGPT ({"from": human|gpt|system|tool, "value"}) and OpenAI ({"role", "content"}) records are
validated here, so pull-hermes3 and prep skip malformed records for the same reasons.
"""

from __future__ import annotations

from microgpt.data.tokenizer import IM_END, IM_START

SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant", "tool": "tool"}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
Message = dict[str, str]


def render(messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """ChatML text and the [start, end) character spans of assistant content + <|im_end|>."""
    parts: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for m in messages:
        head = f"{IM_START}{m['role']}\n"
        body = m["content"] + IM_END
        if m["role"] == "assistant":
            spans.append((pos + len(head), pos + len(head) + len(body)))
        piece = head + body + "\n"
        parts.append(piece)
        pos += len(piece)
    return "".join(parts), spans


def prompt_text(prompt: str | list[Message]) -> str:
    """A sampling prompt as text: a string as it is, chat messages rendered and ended by an open assistant turn (so
    the model writes the assistant's reply, up to its <|im_end|>)."""
    if isinstance(prompt, str):
        return prompt
    return render(prompt)[0] + f"{IM_START}assistant\n"


def parse_record(record: object) -> list[Message] | str:
    """A ShareGPT or OpenAI-messages record -> messages, or the reason it is skipped."""
    if not isinstance(record, dict):
        return "not an object"
    if "conversations" in record:
        turns, key_role, key_text, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
    elif "messages" in record:
        turns, key_role, key_text, roles = record["messages"], "role", "content", OPENAI_ROLES
    else:
        return "missing conversations"
    if not isinstance(turns, list):
        return "missing conversations"
    if not turns:
        return "empty conversations"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get(key_role), str):
            return "bad turn"
        if not isinstance(turn.get(key_text), str):
            return "bad turn"
        if turn[key_role] not in roles:
            return "unknown role"
        role = roles[turn[key_role]]
        if role != "system" and not turn[key_text].strip():
            return "empty value"
        messages.append({"role": role, "content": turn[key_text]})
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return messages


def to_sharegpt(messages: list[Message]) -> dict:
    """The normalized record pull-hermes3 writes: ShareGPT keys, canonical role names."""
    back = {v: k for k, v in SHAREGPT_ROLES.items()}
    return {"conversations": [{"from": back[m["role"]], "value": m["content"]} for m in messages]}
