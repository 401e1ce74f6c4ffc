"""`microgpt export`: transformers (CPU) loads the folder and agrees with microgpt's own forward and sampler."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from microgpt import checkpoint, config
from microgpt.data.chatml import render
from microgpt.data.tokenizer import load_tokenizer
from microgpt.engine.trained import load_trained
from microgpt.use import sample
from microgpt.use.sample import generate
from tests.conftest import cli, write_experiment

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "<|im_start|>user\nHi<|im_end|>\n", "x"]


def train(folder: Path, vocab_size: int, steps: int = 6) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    exp = write_experiment(
        folder, model={"vocab_size": vocab_size}, train={"steps": steps}, data={"path": str(folder / "data")}
    )
    res = cli("train", str(exp), "--out", str(folder / "run"))
    assert res.returncode == 0, res.stderr
    return folder / "run"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("bpe"), 512)


@pytest.fixture(scope="module")
def hf(run: Path) -> Path:
    out = run.parent / "hf"
    res = cli("export", str(run), "--out", str(out))
    assert res.returncode == 0, res.stderr
    ck = checkpoint.resolve(run)
    assert res.stdout == f"exported {ck} (step 6) to {out}: a transformers GPT-2 folder, fp32 weights\n"
    return out


def hf_model(folder: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def test_folder_has_the_files(run: Path, hf: Path) -> None:
    names = {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    }
    assert {p.name for p in hf.iterdir()} == names
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["n_positions"] == 32 and cfg["vocab_size"] == 512
    assert cfg["activation_function"] == "gelu_new" and cfg["tie_word_embeddings"] is True
    card = (hf / "README.md").read_text()
    val = checkpoint.read_sidecar(checkpoint.resolve(run))["val_loss"]  # the run's last evaluation
    assert "steps: 6" in card and f"validation loss: {val:.4f}" in card
    assert "- data: builtin (data)\n" in card and str(run.parent) not in card  # no path of this machine
    mask = os.umask(0)
    os.umask(mask)
    assert hf.stat().st_mode & 0o777 == 0o777 & ~mask  # the mode a plain mkdir gives, not mkdtemp's 0700


def test_logits_match_microgpt(run: Path, hf: Path) -> None:
    ld, model = load_trained(run), hf_model(hf)
    tok = load_tokenizer(ld.side["tokenizer"])
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        gen = sample.load(str(run))[0]  # one position at a time: the decode step over the cache
        ours = np.stack([gen.feed([t]) for t in ids])
        np.testing.assert_allclose(hf_logits(model, ids), ours, atol=1e-4, rtol=0)


def test_greedy_generate_equals_sample(run: Path, hf: Path) -> None:
    ld, model = load_trained(run), hf_model(hf)
    tok = load_tokenizer(ld.side["tokenizer"])
    model.generation_config.eos_token_id = None  # microgpt sample does not stop at <|im_end|>: compare all tokens
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt)
        n = 32 - len(ids) - 1  # within the context: transformers' GPT-2 does not slide its window
        with torch.no_grad():
            got = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        got = got[0, len(ids) :].tolist()
        assert got == generate(sample.load(str(run))[0], ids, n, sample.Sampling(), [0])[0]
        res = cli("sample", str(run), "--prompt", prompt, "--temperature", "0", "--tokens", str(n), "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["text"] == tok.decode(got)


def test_tokenizer_round_trips_and_renders_chatml(run: Path, hf: Path) -> None:
    ours = load_tokenizer(load_trained(run).side["tokenizer"])
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    for text in [*PROMPTS, "héllo wörld ✓\n\t  spaces", ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ours.encode(text) and tok.decode(ids) == text
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    assert tok.apply_chat_template(msgs, tokenize=False) == render(msgs)[0]
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == render(msgs[:2])[0] + "<|im_start|>assistant\n"
    gen = json.loads((hf / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ours.im_end_id, ours.eot_id]


def test_bf16_weights_are_the_rounded_fp32(run: Path, hf: Path) -> None:
    out = run.parent / "hf-bf16"
    res = cli("export", str(run), "--out", str(out), "--dtype", "bf16")
    assert res.returncode == 0, res.stderr
    a, b = hf_model(hf), transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    wa, wb = a.transformer.h[0].attn.c_attn.weight, b.transformer.h[0].attn.c_attn.weight
    assert wb.dtype == torch.bfloat16 and torch.equal(wa.to(torch.bfloat16), wb)


def test_byte_model_exports(tmp_path: Path) -> None:
    run = train(tmp_path, 256, steps=2)
    res = cli("export", str(run), "--out", str(tmp_path / "hf"))
    assert res.returncode == 0, res.stderr
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "héllo\n\tx"
    assert tok.encode(text, add_special_tokens=False) == list(text.encode()) and tok.decode(list(text.encode())) == text
    gen = sample.load(str(run))[0]
    ids = list(text.encode())
    ours = np.stack([gen.feed([t]) for t in ids])
    np.testing.assert_allclose(hf_logits(hf_model(tmp_path / "hf"), ids), ours, atol=1e-4, rtol=0)


def test_the_modern_block_exports_as_nanochat(tmp_path: Path) -> None:
    """model.block "modern": transformers' NanoChatForCausalLM computes the same logits as microgpt's decode step (its
    rotation the other way round, its q and k projections' second halves negated), its greedy tokens are `microgpt
    sample`'s; GGUF refuses its soft-cap (10 here) in one line, writing nothing."""
    from tests.test_modern import MODERN_RUN

    exp = write_experiment(
        tmp_path,
        model={**MODERN_RUN["model"], "vocab_size": 512},
        train={**MODERN_RUN["train"], "steps": 6},
        data={"path": str(tmp_path / "data")},
    )
    assert cli("train", str(exp), "--out", str(tmp_path / "run")).returncode == 0
    res = cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"))
    assert res.returncode == 0 and "a transformers NanoChat folder" in res.stdout, res.stderr
    model, run = hf_model(tmp_path / "hf"), str(tmp_path / "run")
    assert type(model).__name__ == "NanoChatForCausalLM"
    tok = load_tokenizer(load_trained(run).side["tokenizer"])
    ids = tok.encode(PROMPTS[0])
    gen = sample.load(run)[0]
    np.testing.assert_allclose(hf_logits(model, ids), np.stack([gen.feed([t]) for t in ids]), atol=1e-4, rtol=0)
    model.generation_config.eos_token_id = None
    n = 32 - len(ids) - 1
    with torch.no_grad():
        got = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    assert got[0, len(ids) :].tolist() == generate(sample.load(run)[0], ids, n, sample.Sampling(), [0])[0]
    res = cli("export", run, "--out", str(tmp_path / "m.gguf"), "--format", "gguf")
    assert res.returncode == 2 and res.stderr.startswith("error: --format gguf: ") and "NanoChat" in res.stderr
    assert "model.softcap 10: " in res.stderr and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("lever, why", [({"value_embeds": 1}, "model.value_embeds 1"), ({"skips": 1}, "model.skips 1")])
def test_value_embeddings_and_skips_are_refused_in_one_line(tmp_path: Path, lever: dict, why: str) -> None:
    """model.value_embeds, model.skips: no transformers class computes them (NanoChat has neither value embeddings
    nor skips between layers), nor any llama.cpp architecture: each format refuses in one line naming the field,
    writing nothing."""
    from tests.test_modern import MODERN_RUN

    exp = write_experiment(
        tmp_path,
        model={**MODERN_RUN["model"], "vocab_size": 512, **lever},
        train={**MODERN_RUN["train"], "steps": 2},
        data={"path": str(tmp_path / "data")},
    )
    assert cli("train", str(exp), "--out", str(tmp_path / "run")).returncode == 0
    for out, fmt in (("hf", "hf"), ("m.gguf", "gguf")):
        res = cli("export", str(tmp_path / "run"), "--out", str(tmp_path / out), "--format", fmt)
        assert res.returncode == 2 and res.stderr.startswith(f"error: --format {fmt}: "), res.stderr
        assert why in res.stderr and len(res.stderr.splitlines()) == 1 and not (tmp_path / out).exists()


def test_a_window_or_document_masking_is_refused_in_one_line(tmp_path: Path) -> None:
    """model.attn_window and model.doc_mask (issue 55): both formats write a model that attends over the whole
    sequence, across documents; each refuses such a checkpoint in one line, writing nothing."""
    from microgpt.use.export import narrowed_attention
    from tests.test_modern import MODERN_RUN

    exp = write_experiment(
        tmp_path,
        model={**MODERN_RUN["model"], "attn_window": 16, "doc_mask": 0},
        train={**MODERN_RUN["train"], "steps": 2},
    )
    assert cli("train", str(exp), "--out", str(tmp_path / "run")).returncode == 0
    for out, fmt in (("hf", "hf"), ("m.gguf", "gguf")):
        res = cli("export", str(tmp_path / "run"), "--out", str(tmp_path / out), "--format", fmt)
        assert res.returncode == 2 and res.stderr.startswith(f"error: --format {fmt}: "), res.stderr
        assert "model.attn_window 16" in res.stderr and len(res.stderr.splitlines()) == 1
        assert not (tmp_path / out).exists()
    m = config.ModelConfig(block="modern", doc_mask=0)
    assert "model.doc_mask 0: the exported model would attend across <|endoftext|>" in narrowed_attention(m)
    assert narrowed_attention(config.ModelConfig(block="modern")) is None


def test_without_out_the_export_goes_beside_the_run(run: Path, tmp_path: Path) -> None:
    """No --out: RUN/export/RUN-stepN-DTYPE (a folder) or ...-DTYPE.gguf, inside the run folder (git-ignored with
    runs/), never in the directory the command runs from; the same from a checkpoint file; a second export of the
    same step and dtype is refused, the first untouched."""
    mine = tmp_path / "runs" / "mine"
    shutil.copytree(run, mine)
    work = tmp_path / "work"
    work.mkdir()
    res = cli("export", str(mine), cwd=work)
    assert res.returncode == 0, res.stderr
    folder = mine / "export" / "mine-step6-fp32"
    assert res.stdout.endswith(f" (step 6) to {folder}: a transformers GPT-2 folder, fp32 weights\n")
    assert (folder / "model.safetensors").is_file() and list(work.iterdir()) == []
    ck = checkpoint.resolve(mine)
    res = cli("export", str(ck), "--format", "gguf", "--dtype", "q8_0", cwd=work)
    assert res.returncode == 0, res.stderr
    gguf = mine / "export" / "mine-step6-q8_0.gguf"
    assert gguf.read_bytes()[:4] == b"GGUF" and list(work.iterdir()) == []
    before = gguf.read_bytes()
    again = cli("export", str(mine), "--format", "gguf", "--dtype", "q8_0", cwd=work)
    assert (
        again.returncode == 2
        and again.stderr == f"error: --out {gguf}: exists; choose a new file (nothing overwritten)\n"
    )
    assert gguf.read_bytes() == before


def test_out_not_empty_is_refused_untouched(run: Path, tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    res = cli("export", str(run), "--out", str(tmp_path))
    assert res.returncode == 2 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1
    assert "not empty" in res.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "mine"


def test_checkpoint_for_another_model_is_refused(run: Path, tmp_path: Path) -> None:
    """A .bin next to a sidecar describing another model (here: wider): one line, nothing written."""
    ck = sorted((run / "ckpt").glob("step-*.bin"))[-1]
    bad = tmp_path / "ckpt"
    bad.mkdir()
    shutil.copy(ck, bad / ck.name)
    side = json.loads(ck.with_name(ck.name.removesuffix(".bin") + ".state.json").read_text())
    side["config"]["model"]["d_model"] = 64
    (bad / ck.name.replace(".bin", ".state.json")).write_text(json.dumps(side))
    res = cli("export", str(bad / ck.name), "--out", str(tmp_path / "hf"))
    assert res.returncode == 2 and res.stderr.startswith("error: ") and len(res.stderr.splitlines()) == 1
    assert "another model" in res.stderr and not (tmp_path / "hf").exists()
