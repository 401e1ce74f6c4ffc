"""Small Hermes-format files (ShareGPT `conversations: [{from, value}]`), good and broken, with the exact
counts the pipeline must report. Built in each test's tmp folder: no network, no downloads."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def turn(role: str, value: object, **extra: object) -> dict:
    return {"from": role, "value": value, **extra}


GOOD_JSONL = [
    {"conversations": [turn("system", "You are terse."), turn("human", "Hi there"), turn("gpt", "Hello.")]},
    {"conversations": [turn("human", "2+2?"), turn("gpt", "Four."), turn("human", "And 3+3?"), turn("gpt", "Six.")]},
    # extra keys (an id, per-turn weights) are dropped by normalization
    {"id": "x1", "conversations": [turn("human", "Ünïcödé ✓ 猫", weight=0), turn("gpt", "Ça va 😀", weight=1)]},
    {
        "conversations": [
            turn("human", "Weather?"),
            turn("gpt", "Calling."),
            turn("tool", "sunny"),
            turn("gpt", "Sunny."),
        ]
    },
]

# (raw line bytes, reason); the line numbers follow from the order in write_jsonl
BAD_JSONL = [
    (b'{"conversations": [{"from": "human", "value": "cut', "invalid json"),
    (b'{"conversations": []}', "empty conversations"),
    (b'{"conversations": [{"from": "bot", "value": "hi"}, {"from": "gpt", "value": "x"}]}', "unknown role"),
    (b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "x"}]}', "invalid utf-8"),
    (b'{"convs": []}', "missing conversations"),
    (b"[1, 2]", "not an object"),
    (b'{"conversations": [{"from": "human", "value": 5}, {"from": "gpt", "value": "x"}]}', "bad turn"),
    (b'{"conversations": [{"from": "human", "value": "only a question"}]}', "no assistant turn"),
    (b'{"conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "x"}]}', "empty value"),
]

GOOD_JSON = [
    {"conversations": [turn("human", "Name a colour."), turn("gpt", "Blue.")]},
    {"conversations": [turn("human", "Name a fruit."), turn("gpt", "Pear.")]},
]
BAD_JSON = [{"conversations": [turn("user", "wrong role name for ShareGPT"), turn("gpt", "x")]}]  # unknown role

GOOD_PARQUET = [
    {"conversations": [turn("human", "Capital of France?"), turn("gpt", "Paris.")]},
    {"conversations": [turn("system", ""), turn("human", "Say hi."), turn("gpt", "Hi!")]},
    {"conversations": [turn("human", "Count to 3."), turn("gpt", "1, 2, 3.")]},
]
BAD_PARQUET = [{"conversations": []}]  # empty conversations


def write_jsonl(path: Path) -> dict[str, list[int]]:
    """Good and bad lines interleaved (plus one blank line, which is not a record). Returns reason -> lines."""
    lines: list[bytes] = []
    where: dict[str, list[int]] = {}
    bad = list(BAD_JSONL)
    for record in GOOD_JSONL:
        lines.append(json.dumps(record, ensure_ascii=False).encode())
        for _ in range(2 if bad else 0):
            if bad:
                raw, reason = bad.pop(0)
                lines.append(raw)
                where.setdefault(reason, []).append(len(lines))
    for raw, reason in bad:
        lines.append(raw)
        where.setdefault(reason, []).append(len(lines))
    lines.append(b"")  # a blank line: skipped silently, not counted
    path.write_bytes(b"\n".join(lines) + b"\n")
    return where


def write_parquet(path: Path, records: list[dict]) -> None:
    pq.write_table(pa.Table.from_pylist(records), path)


def write_hermes_folder(folder: Path) -> dict:
    """A folder with every kind of input. Returns the exact expected report."""
    folder.mkdir(parents=True, exist_ok=True)
    where = write_jsonl(folder / "a.jsonl")
    (folder / "b.json").write_text(json.dumps(GOOD_JSON + BAD_JSON))
    write_parquet(folder / "c.parquet", GOOD_PARQUET + BAD_PARQUET)
    write_parquet(folder / "d.parquet", GOOD_PARQUET)
    data = (folder / "d.parquet").read_bytes()
    (folder / "d.parquet").write_bytes(data[: len(data) // 2])  # truncated: no footer
    skipped: dict[str, int] = {}
    for _, reason in BAD_JSONL:
        skipped[reason] = skipped.get(reason, 0) + 1
    skipped["unknown role"] += 1  # b.json
    skipped["empty conversations"] += 1  # c.parquet
    return {
        "kept": len(GOOD_JSONL) + len(GOOD_JSON) + len(GOOD_PARQUET),
        "skipped_by_reason": dict(sorted(skipped.items())),
        "jsonl_lines": where,
        "good": GOOD_JSONL + GOOD_JSON + GOOD_PARQUET,
    }


def normalized(record: dict) -> dict:
    return {"conversations": [{"from": t["from"], "value": t["value"]} for t in record["conversations"]]}
