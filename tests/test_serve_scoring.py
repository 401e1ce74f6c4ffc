"""A loglikelihood client against serve: HellaSwag scored through /v1/completions with echo and logprobs, as
lm-evaluation-harness's local-completions model asks (token-id prompts in one batch, max_tokens 1, logprobs 1, echo,
the continuation's logprobs summed from token_logprobs[ctxlen:-1], greediness from top_logprobs), equals `microgpt
eval --hellaswag`'s own numbers for the same examples: every ending's sum of token logprobs to 1e-4, and the accuracy
the CLI prints, on examples whose context is cut to fit or whose ending cannot be scored. tests/test_lm_eval.py runs
lm-evaluation-harness itself; here the openai client sends what it sends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from microgpt.data import hellaswag_file
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine.trained import load_trained
from microgpt.use import evaluate, hellaswag
from tests.conftest import cli, json_lines
from tests.ops._util import check
from tests.test_hellaswag import EXAMPLES, write_examples
from tests.test_serve import served


def test_hellaswag_through_the_api_is_microgpt_evals(run_256: Path, tmp_path: Path) -> None:
    path = write_examples(tmp_path / "hs.jsonl", EXAMPLES)
    res = cli("eval", str(run_256), "--hellaswag", str(path), "--backend", "numpy", "--json")
    assert res.returncode == 0, res.stderr
    (want,) = json_lines(res.stdout)
    ld = load_trained(run_256)
    items = hellaswag_file.tokenize(
        hellaswag_file.read(path, "--hellaswag"), load_tokenizer(ld.side["tokenizer"]), ld.exp.model.seq_len
    )
    sums = hellaswag.ending_losses(evaluate.scorer(ld, evaluate.eval_backend(ld, "numpy", None)), items)

    prompts = [seq for it in items for seq in it.seqs]
    with served(run_256, "--max-batch", "4", "--queue", "32") as (a, client, _):
        res = client.completions.create(
            model=a.name, prompt=prompts, max_tokens=1, logprobs=1, echo=True, temperature=0, seed=1234
        )
    got = np.full((len(items), 4), np.nan)
    for choice in sorted(res.choices, key=lambda c: c.index):
        item, r = divmod(choice.index, 4)
        lp = choice.logprobs
        ctxlen = len(prompts[choice.index]) - items[item].n_end[r]
        assert len(lp.token_logprobs) == len(prompts[choice.index]) + 1 and lp.token_logprobs[0] is None
        cont, tops = lp.token_logprobs[ctxlen:-1], lp.top_logprobs[ctxlen:-1]
        assert all(max(top.values()) >= t - 1e-9 for t, top in zip(cont, tops))  # lm-eval's is_greedy reads these
        if items[item].judged:
            got[item, r] = -sum(cont)
    judged = np.array([it.judged for it in items])
    check("each ending's loss through the API", got[judged], sums[judged], 1e-4)
    acc = hellaswag.accuracy(hellaswag.counts(items, np.where(np.isnan(got), sums, got)))
    assert (acc["acc"], acc["acc_norm"]) == (want["acc"], want["acc_norm"])
    assert res.usage.prompt_tokens == sum(map(len, prompts))


def joined(chunks: list, index: int) -> tuple[str, dict[str, list]]:
    """A streamed choice's text and its chunks' logprobs joined, field by field."""
    mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in mine:
        for k in out:
            out[k] += getattr(ch.logprobs, k) if ch.logprobs is not None else []
    return "".join(ch.text for ch in mine), out


@pytest.mark.parametrize("echo", [False, True])
def test_a_streamed_completions_logprobs_join_into_the_whole_answers(run_256: Path, echo: bool) -> None:
    """Streamed with logprobs, each choice's chunks carry every token's logprobs once and their text_offset runs on
    from chunk to chunk (from 0 at the choice's first token: the echoed prompt's, or the first drawn), as the whole
    answer's do: joined, they are the answer's; the tokens behind text a stop string held back come with the finish
    chunk. Two prompts (one not ASCII: a token's text is not always a character of the text) x n 2, sampled."""
    prompts = ["def add(a, b):", "caf\u00e9 = 1"]
    kw = {"prompt": prompts, "n": 2, "max_tokens": 24, "temperature": 0.8, "seed": 5, "logprobs": 2, "echo": echo}
    with served(run_256, "--max-batch", "4", "--queue", "4") as (a, client, _):
        first = client.completions.create(model=a.name, **kw)
        drawn = first.choices[0].text[len(prompts[0]) if echo else 0 :]
        stop = drawn[6:8]
        assert len(stop) == 2
        whole = client.completions.create(model=a.name, stop=[stop], **kw)
        chunks = list(client.completions.create(model=a.name, stop=[stop], stream=True, **kw))
    assert whole.choices[0].finish_reason == "stop"
    for choice in whole.choices:
        lp = choice.logprobs
        assert lp.text_offset == [sum(map(len, lp.tokens[:k])) for k in range(len(lp.tokens))]
        text, lps = joined(chunks, choice.index)
        assert text == choice.text
        assert lps["tokens"] == lp.tokens and lps["text_offset"] == lp.text_offset
        assert lps["top_logprobs"][0] is None if echo else lps["top_logprobs"][0].keys() == lp.top_logprobs[0].keys()
        got = [v for v in lps["token_logprobs"] if v is not None]
        check(f"choice {choice.index}'s streamed logprobs", np.array(got), np.array(lp.token_logprobs[echo:]), 1e-5)
    tail = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == 0][-1]
    assert tail.finish_reason == "stop" and tail.text == "" and tail.logprobs.tokens  # the stop string's tokens
