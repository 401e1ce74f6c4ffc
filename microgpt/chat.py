"""ChatML rendering, conversation validation, and the synthetic conversations of the built-in corpus.

A conversation is a list of messages {"role": system|user|assistant|tool, "content": str}. Rendered:

    <|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n
    <|im_start|>assistant\\nHello!<|im_end|>\\n                  (one string; broken here for width)

render() also returns the character spans the loss mask keeps: each assistant message's content
and its closing <|im_end|> (so the model learns to stop), never the prompt or the role header.
ShareGPT ({"from": human|gpt|system|tool, "value"}) and OpenAI ({"role", "content"}) records are
validated here, so pull-hermes3 and prep skip malformed records for the same reasons.
"""

from __future__ import annotations

import numpy as np

from microgpt.tokenizer import IM_END, IM_START

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


# Synthetic conversations: small exact tasks, so the built-in corpus exercises the chat template and
# the loss mask, and a tiny model has something checkable to learn. Deterministic for a seed.
SYSTEMS = ["You are ANDREA, a small and precise assistant.", "Answer briefly.", ""]
WORDS = "apple river stone cloud maple tiger violet engine garden silver pocket lantern orbit".split()


def _task(rng: np.random.Generator) -> tuple[str, str]:
    kind = int(rng.integers(6))
    a, b = (int(x) for x in rng.integers(0, 100, size=2))
    w = WORDS[int(rng.integers(len(WORDS)))]
    nums = [int(x) for x in rng.integers(0, 50, size=int(rng.integers(3, 7)))]
    if kind == 0:
        return f"What is {a} + {b}?", f"{a} + {b} = {a + b}."
    if kind == 1:
        return f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
    if kind == 2:
        return f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 3:
        return f"Sort these numbers: {', '.join(map(str, nums))}", f"Sorted: {', '.join(map(str, sorted(nums)))}."
    if kind == 4:
        return f"How many letters are in the word '{w}'?", f"The word '{w}' has {len(w)} letters."
    return f"Write '{w}' in capital letters.", f"{w.upper()}"


def synthetic_conversations(n: int, seed: int) -> list[list[Message]]:
    rng = np.random.default_rng([seed, 0x5C4A7])
    convs = []
    for _ in range(n):
        system = SYSTEMS[int(rng.integers(len(SYSTEMS)))]
        messages = [{"role": "system", "content": system}] if system else []
        for _turn in range(int(rng.integers(1, 4))):
            question, answer = _task(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        convs.append(messages)
    return convs
