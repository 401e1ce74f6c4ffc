"""The phase schema: a schedule of global step ranges and the complete experiment the engine runs for each."""

from __future__ import annotations

import json

import pytest

from microgpt import config
from microgpt.config import ConfigError
from microgpt.proxy.phases import make_schedule
from tests.proxy._helpers import EXP


def exp(**sections) -> dict:
    raw = json.loads(json.dumps(EXP))
    raw.update(sections)
    return raw


def test_without_phases_the_run_is_one_phase_of_train_steps() -> None:
    schedule = make_schedule(exp(), "e.json")
    steps = exp()["train"]["steps"]
    assert [(p.name, p.start, p.end) for p in schedule.phases] == [("train", 0, steps)]
    eng = schedule.phases[0].engine
    assert eng["train"]["steps"] == steps and eng["train"]["log_every"] == 1
    assert "proxy" not in eng and "phases" not in eng
    config.from_dict(eng, "engine")  # a complete experiment the engine accepts as is


def test_phases_stack_on_the_global_step_and_override_their_sections() -> None:
    phases = [
        {"name": "pretrain", "steps": 100},
        {
            "name": "polish",
            "steps": 30,
            "lr": 1e-3,
            "min_lr": 1e-4,
            "warmup_steps": 3,
            "loss_mask": True,
            "data": {"val_fraction": 0.25},
            "train": {"eval_every": 5},
        },
    ]
    schedule = make_schedule(exp(phases=phases), "e.json", seed=5)
    assert [(p.name, p.start, p.end) for p in schedule.phases] == [("pretrain", 0, 100), ("polish", 100, 130)]
    pre, pol = (p.engine for p in schedule.phases)
    assert pre["train"]["lr"] == EXP["train"]["lr"] and pre["train"]["steps"] == 100 and pre["train"]["seed"] == 5
    t, d = pol["train"], pol["data"]
    assert (t["lr"], t["min_lr"], t["warmup_steps"], t["eval_every"], t["steps"]) == (1e-3, 1e-4, 3, 5, 130)
    assert d["loss_mask"] is True and d["val_fraction"] == 0.25 and d["max_bytes"] == EXP["data"]["max_bytes"]
    assert pol["model"] == pre["model"] and schedule.final_step == 130 and schedule.phase_at(100) == 1
    assert schedule.phase_at(99) == 0 and schedule.phase_at(130) is None


def test_steps_caps_the_run_across_phases() -> None:
    phases = [{"name": "pretrain", "steps": 100}, {"name": "polish", "steps": 30}]
    schedule = make_schedule(exp(phases=phases), "e.json", steps=50)
    assert [(p.name, p.start, p.end) for p in schedule.phases] == [("pretrain", 0, 50)]
    schedule = make_schedule(exp(phases=phases), "e.json", steps=110)
    assert [(p.name, p.end) for p in schedule.phases] == [("pretrain", 100), ("polish", 110)]
    assert make_schedule(exp(), "e.json", steps=7).phases[0].end == 7


def test_the_config_hash_follows_the_experiment_and_seed_not_the_step_cap() -> None:
    base = make_schedule(exp(), "e.json").config_hash
    assert make_schedule(exp(), "other.json", steps=9).config_hash == base
    assert make_schedule(exp(), "e.json", seed=3).config_hash != base
    assert make_schedule(exp(name="x"), "e.json").config_hash != base


def test_settings_defaults_and_sample_cadence() -> None:
    schedule = make_schedule(exp(proxy={}), "e.json")
    assert schedule.settings.sample_every == EXP["train"]["ckpt_every"] and schedule.settings.max_restarts == 5
    schedule = make_schedule(exp(proxy={"sample_every": 0, "prompts": [[{"role": "user", "content": "hi"}]]}), "e.json")
    assert schedule.settings.sample_every == 0


@pytest.mark.parametrize(
    "phases, needle",
    [
        ([], "non-empty list"),
        ({"name": "a"}, "non-empty list"),
        ([{"steps": 5}], "missing phase field 'name'"),
        ([{"name": "a"}], "missing phase field 'steps'"),
        ([{"name": "a", "steps": 0}], "steps must be > 0"),
        ([{"name": "a", "steps": 2.5}], "field 'steps' must be int"),
        ([{"name": "Bad Name", "steps": 5}], "must match"),
        ([{"name": "a", "steps": 5, "loss_mask": "yes"}], "field 'loss_mask' must be bool"),
        ([{"name": "a", "steps": 5, "data": {"sourc": "x"}}], "data: unknown field 'sourc'"),
        ([{"name": "a", "steps": 5, "lr": 2.0}], "train.lr must be in (0, 1)"),
        (["pretrain"], "a phase must be a JSON object"),
    ],
)
def test_bad_phases_name_the_file_and_the_field(phases, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_schedule(exp(phases=phases), "e.json")
    assert str(err.value).startswith("e.json") and needle in str(err.value) and "\n" not in str(err.value)


def test_set_overrides_are_part_of_the_experiment_and_backend_is_not() -> None:
    base = make_schedule(exp(), "e.json")
    schedule = make_schedule(exp(), "e.json", sets=["train.lr=0.002", "data.max_bytes=500000"], precision="fp32")
    eng = schedule.phases[0].engine
    assert eng["train"]["lr"] == 0.002 and eng["data"]["max_bytes"] == 500000 and eng["train"]["precision"] == "fp32"
    assert schedule.config_hash != base.config_hash
    assert make_schedule(exp(), "e.json", backend="triton").config_hash == base.config_hash
    with pytest.raises(ConfigError, match="--set 'lr=1'"):
        make_schedule(exp(), "e.json", sets=["lr=1"])


def test_a_bad_mixing_section_is_refused_before_any_engine_starts() -> None:
    """The data layer owns the mixing section; the proxy has it checked when it reads the experiment."""
    with pytest.raises(ConfigError, match="mixing") as err:
        make_schedule(exp(mixing={"policy": "bogus"}), "e.json")
    assert "\n" not in str(err.value) and "e.json" in str(err.value)
