"""Sampling during training: when a checkpoint is sampled, and what text a prompt becomes."""

from __future__ import annotations

import threading
from pathlib import Path

from microgpt.proxy.phases import ProxySettings
from microgpt.proxy.runfiles import JsonDoc
from microgpt.proxy.sampler import Sampler, prompt_text, sample_cmd


def test_prompts_are_text_or_chat_messages_ending_in_an_open_assistant_turn() -> None:
    assert prompt_text("def ") == "def "
    text = prompt_text([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_sample_command_is_reproducible_from_its_record() -> None:
    cmd = sample_cmd("r/ckpt/step-00000100.bin", "def ", ProxySettings(sample_tokens=9, temperature=0.5), 100)
    assert cmd[-11:] == [
        "sample",
        "r/ckpt/step-00000100.bin",
        "--prompt",
        "def ",
        "--json",
        "--seed",
        "100",
        "--tokens",
        "9",
        "--temperature",
        "0.5",
    ]


def test_cadence_first_checkpoint_past_each_multiple_and_every_final(tmp_path: Path) -> None:
    doc = JsonDoc(tmp_path / "r.samples.json", "microgpt-samples-1", {"samples": []})
    sampler = Sampler(doc, ProxySettings(sample_every=100, prompts=[]), threading.Lock(), print)
    sampler.settings.prompts = ["x"]
    taken = []
    for step, reason in [
        (30, "periodic"),
        (90, "periodic"),
        (120, "SIGUSR1"),
        (150, "periodic"),
        (200, "periodic"),
        (200, "final"),
        (230, "final"),
        (260, "periodic"),
        (310, "periodic"),
    ]:
        if sampler.wants(step, reason):
            sampler.last_step = step
            taken.append(step)
    assert taken == [120, 200, 230, 310]
    sampler.settings.sample_every = 0
    assert not sampler.wants(1000, "final")
    sampler.close()
