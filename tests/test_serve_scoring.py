"""A loglikelihood client against serve: HellaSwag scored through /v1/completions with echo and logprobs, as
lm-evaluation-harness's local-completions model asks (token-id prompts in one batch, max_tokens 1, logprobs 1, echo,
the continuation's logprobs summed from token_logprobs[ctxlen:-1], greediness from top_logprobs), equals `microgpt
eval --hellaswag`'s own numbers for the same examples: every ending's sum of token logprobs to 1e-4, and the accuracy
the CLI prints, on examples whose context is cut to fit or whose ending cannot be scored. tests/test_lm_eval.py runs
lm-evaluation-harness itself; here the openai client sends what it sends."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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
