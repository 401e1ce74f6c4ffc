"""docs/ANDREA.md states numbers: each parameter count and memory plan there must be what the code computes for
the committed experiments, and the LayerNorm eps, the lr table, the manifest's fields, the ANDREA-12M epochs, the
dashboard's tunnel port and section 9's constants and defaults (the RMSNorm eps, rotary's base, Muon's, the schedule's
worked example) what the code uses, so the page cannot drift from the code."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from microgpt import config
from microgpt.engine import memory, optim, params, precision
from tests.conftest import REPO, cli

DOC = (REPO / "docs" / "ANDREA.md").read_text()


@pytest.mark.parametrize("name", ["tiny", "12M", "120M"])
def test_doc_matches_the_experiment(name: str) -> None:
    exp = config.load(REPO / "experiments" / f"ANDREA-{name}-TRAIN.json")
    m, t = exp.model, exp.train
    row = next((line for line in DOC.splitlines() if line.startswith(f"| ANDREA-{name} |")), None)
    assert row is not None, f"no family-table row for ANDREA-{name}"
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].split()[0] == f"{m.vocab_size:,}", (cells[1], m.vocab_size)
    assert cells[2:6] == [str(m.d_model), str(m.n_layer), str(m.n_head), f"{m.seq_len:,}"], cells
    assert cells[6] == f"{params.n_params(m):,}", (cells[6], params.n_params(m))
    assert cells[7:10] == [
        f"{t.micro_batch} x {t.n_micro}",
        f"{t.micro_batch * t.n_micro * m.seq_len:,}",
        f"{t.steps:,}",
    ]
    assert cells[10].startswith(t.precision) and t.backend in cells[10], cells[10]
    itemsize = 4 if t.precision == "fp32" else 2  # the triton backend sizes its logits chunk in the compute dtype
    if t.backend == "triton":
        rows = memory.gpu_logits_rows(m, t.micro_batch, itemsize)
    else:
        rows = memory.cpu_logits_rows(m, t.micro_batch)
    prec = precision.make(t.precision, t.backend)
    plan = memory.format_plan(memory.plan(m, t, prec, rows), prec)  # without the backend's own rows
    assert plan in DOC, f"docs/ANDREA.md lacks the memory plan the engine prints for ANDREA-{name}:\n{plan}"


def test_layernorm_eps_is_the_code_s() -> None:
    from microgpt.ops import layernorm

    stated = re.search(r"\*\*LayerNorm\*\*.*?eps = ([0-9.e-]+),", DOC, re.S)
    assert stated is not None, "docs/ANDREA.md no longer states the LayerNorm eps"
    assert float(stated.group(1)) == layernorm.EPS


def test_lr_table_is_lr_at() -> None:
    """The table of lr(s) for ANDREA-tiny (and with --steps 10, shorter than its warmup) is what the trainer uses."""
    header = next(line for line in DOC.splitlines() if line.startswith("  | s | "))
    values = next(line for line in DOC.splitlines() if line.startswith("  | lr(s) | "))
    h = [c.strip() for c in header.strip(" |").split("|")]
    v = [c.strip() for c in values.strip(" |").split("|")]
    split = h.index("s (`--steps 10`)")
    t = config.load(REPO / "experiments" / "ANDREA-tiny-TRAIN.json").train
    short = dataclasses.replace(t, steps=10)
    assert short.steps < t.warmup_steps
    for cols, train in ((range(1, split), t), (range(split + 1, len(h)), short)):
        for i in cols:
            assert v[i] == f"{optim.lr_at(int(h[i]), train):.4e}", (h[i], v[i])


def test_manifest_fields_are_what_prep_writes(tmp_path) -> None:
    """The manifest table lists exactly the fields `microgpt prep` writes, and the sources row each source's."""
    (tmp_path / "a.txt").write_text("one small document\n" * 50)
    (tmp_path / "b.txt").write_text("another one\n" * 50)
    r = cli("prep", "--source", str(tmp_path), "--tokenizer", "bytes", "--out", str(tmp_path / "out"), "--quiet")
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    section = DOC.split("The manifest's fields:")[1].split("\n\n")[1]
    fields = [line.split("|")[1].strip().strip("`") for line in section.splitlines()[2:]]
    assert fields == list(manifest)
    sources_row = next(line for line in section.splitlines() if line.startswith("| `sources` |"))
    assert re.findall(r"`(\w+)`", sources_row.split("|")[2]) == list(manifest["sources"][0])
    layout = manifest["shard_layout"]
    assert f'{layout["magic"]}, {layout["version"]}, `"{layout["dtype"]}"`' in section


def test_andrea_12m_epochs_of_the_builtin_corpus() -> None:
    """The recipe's arithmetic: the experiment's tokens per step and steps against the stated corpus size."""
    exp = config.load(REPO / "experiments" / "ANDREA-12M-TRAIN.json")
    m, t = exp.model, exp.train
    corpus = int(re.search(r"it is ([0-9,]+) training\s+tokens", DOC).group(1).replace(",", ""))
    total = t.steps * t.n_micro * t.micro_batch * m.seq_len
    windows = (corpus - 1) // m.seq_len
    assert f"{windows:,} training windows of {m.seq_len}" in DOC
    assert f"read {total:,} tokens: about {round(total / corpus, -2):.0f} epochs" in DOC
    assert f"({round(windows / (t.n_micro * t.micro_batch))} steps an epoch)" in DOC


def test_dashboard_tunnel_uses_the_served_port() -> None:
    from microgpt.proxy import supervisor

    port = supervisor.run_parser().parse_args(["exp.json", "--dashboard"]).dashboard
    assert f"ssh -N -L {port}:127.0.0.1:{port} user@gpu-host" in DOC and f"http://127.0.0.1:{port}/" in DOC


# "Which card, which precision, which plan": the table of planned GiB by card, made here from the plan itself.
# The triton backend's own rows are those of a device of 132 SMs (the LayerNorm partials grow with them: 132 is the
# most of the cards below) with the H200's measured 32 MiB cuBLAS workspace.
CARD_GIB = {"8 GB": 8.0, "12 GB": 12.0, "16 GB": 16.0, "24 GB": 24.0, "40/48 GB": 40.0, "80 GB": 79.6, "141 GB": 140.4}
CONTEXT_GIB = 0.5  # the CUDA context and the libraries' loaded modules (an estimate: the engine reads free memory)
TABLE_RUNS = {"ANDREA-12M": (64, [8, 16, 32, 64]), "ANDREA-120M": (128, [1, 2, 4, 8, 16, 32, 64])}  # sequences a step


def card_table() -> str:
    from microgpt.engine.backend import triton_rows

    head = "| model | precision | micro-batch x n_micro | plan GiB | " + " | ".join(CARD_GIB) + " |"
    lines = [head, "| --- " * (4 + len(CARD_GIB)) + "|"]
    for name, (sequences, sizes) in TABLE_RUNS.items():
        exp = config.load(REPO / "experiments" / f"{name}-TRAIN.json")
        for prec_name in ("fp32", "bf16", "fp8"):
            prec = precision.make(prec_name, "triton")
            for B in sizes:
                t = dataclasses.replace(exp.train, micro_batch=B, n_micro=sequences // B, precision=prec_name)
                itemsize = memory.COMPUTE_BYTES[prec.compute]
                bufs = memory.plan(
                    exp.model,
                    t,
                    prec,
                    memory.gpu_logits_rows(exp.model, B, itemsize),
                    triton_rows(exp.model, B, 132, 32 << 20),
                )
                gib = sum(memory.role_bytes(bufs, prec).values()) / 2**30
                label = {"bf16": "bf16, fp16"}.get(prec_name, prec_name)
                fits = ["yes" if gib + CONTEXT_GIB + t.memory_margin <= card else "-" for card in CARD_GIB.values()]
                lines.append(f"| {name} | {label} | {B} x {sequences // B} | {gib:.2f} | " + " | ".join(fits) + " |")
    return "\n".join(lines)


def test_the_card_table_is_the_plan() -> None:
    table = card_table()
    assert table in DOC, f"docs/ANDREA.md's card table is not the plan's; regenerated:\n{table}"


def test_the_precision_table_is_the_checks() -> None:
    """The generations' row of docs/ANDREA.md against the capabilities the kernels check."""
    from microgpt.kernels import fp8, linear

    assert linear.BF16_CAPABILITY == (8, 0) and fp8.FP8_CAPABILITY == (8, 9)
    rows = [line for line in DOC.splitlines() if line.startswith("| sm_")]
    got = {cells[0]: cells[3] for cells in ([c.strip() for c in r.strip("|").split("|")] for r in rows)}
    assert got == {
        "sm_75": "fp32, fp16",
        "sm_80": "fp32, fp16, bf16",
        "sm_86": "fp32, fp16, bf16",
        "sm_89": "fp32, fp16, bf16, fp8",
        "sm_90": "fp32, fp16, bf16, fp8",
    }


# The reproduction table (section 5): its commands are the experiments' recipes and dev/repro_table.py's; a cell not
# measured yet says `pending` and names the command that measures it, and nothing else passes for a measurement.
def table_rows(header: str) -> list[list[str]]:
    """The cells of each row of the table under header (the rows up to the first line that is not a table's)."""
    lines = DOC.split(header + "\n", 1)[1].splitlines()[1:]
    rows = lines[: next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows]


REPRO_HEADER = "| model | data | train | steps | one GPU (wall, training) | validation loss |"


def test_the_reproduction_table_runs_the_recipes() -> None:
    import shlex

    from microgpt import cli
    from microgpt.data import recipe

    script = (REPO / "dev" / "repro_table.py").read_text()
    rows = table_rows(REPRO_HEADER)
    assert [r[0] for r in rows] == ["ANDREA-12M", "ANDREA-120M", "ANDREA-12M-MODERN", "ANDREA-120M-MODERN"]
    for name, data, train, steps, took, loss in rows:
        key = name.removeprefix("ANDREA-").lower()
        exp_path = f"experiments/{name}-TRAIN.json"
        assert data == f"`microgpt prep --experiment {exp_path}`"
        assert recipe.expand(["--experiment", str(REPO / exp_path)])[-2:] == [
            "--out",
            config.load(REPO / exp_path).data.path,
        ]
        argv = shlex.split(train.strip("`"))
        args = cli.train_parser().parse_args(argv[2:])
        exp = config.from_flags(argparse_in(args))
        assert argv[:2] == ["microgpt", "train"] and steps == f"{exp.train.steps:,}"
        assert f'"{key}": ("{name}", "{data.strip("`")}",' in script and f'"{train.strip("`")}"' in script
        pending = f"pending: `python3 dev/repro_table.py {key}`"
        assert took == pending or re.fullmatch(r"\d+m \d\ds \(\d+m \d\ds of training\)", took), took
        assert loss == pending or re.fullmatch(rf"\d\.\d{{4}} at step {steps}", loss), loss


def argparse_in(args):
    """The parsed train flags with the experiment path made absolute (the table's paths are the repository's)."""
    args.experiment = str(REPO / args.experiment)
    return args


CARD_CLASSES = {"8 GB": 8.0, "12 GB": 12.0, "24 GB": 24.0}


def test_the_card_class_plans_are_the_plan_and_the_measurements_are_recorded() -> None:
    """What --micro-batch auto picks per card class in bf16 (the largest micro-batch dividing the recipe's sequences
    whose plan fits with 1 GiB to spare: section 2's rule) and its plan; every measured figure of the row is in
    bench/RESULTS.md's capped-run table, on the line of that cap, model and choice."""
    from microgpt.engine.backend import triton_rows

    results = (REPO / "bench" / "RESULTS.md").read_text()
    header = "| model | card | `--micro-batch auto` (bf16) | plan GiB | H200 capped at | peak allocated (bytes) |"
    rows = table_rows(header + " tokens/s (H200) |")
    assert [(r[0], r[1]) for r in rows] == [(m, c) for m in ("ANDREA-12M", "ANDREA-120M") for c in CARD_CLASSES]
    prec = precision.make("bf16", "triton")
    for name, card, picks, gib, cap, peak, tokens in rows:
        exp = config.load(REPO / "experiments" / f"{name}-TRAIN.json")
        sequences = exp.train.micro_batch * exp.train.n_micro
        plans = {}
        for B in (b for b in range(sequences, 0, -1) if sequences % b == 0):
            t = dataclasses.replace(exp.train, micro_batch=B, n_micro=sequences // B)
            bufs = memory.plan(
                exp.model, t, prec, memory.gpu_logits_rows(exp.model, B, 2), triton_rows(exp.model, B, 132, 32 << 20)
            )
            plans[B] = sum(memory.role_bytes(bufs, prec).values()) / 2**30
        B = max(b for b, g in plans.items() if g + CONTEXT_GIB + exp.train.memory_margin <= CARD_CLASSES[card])
        assert (picks, gib) == (f"{B} x {sequences // B}", f"{plans[B]:.2f}"), (name, card)
        assert cap == f"{CARD_CLASSES[card] - 0.5:g} GiB"
        line = f"| {cap.removesuffix(' GiB')} | {name} | bf16 | {picks} | {gib} | {peak} |"
        assert line in results and results.split(line, 1)[1].split("\n", 1)[0].endswith(f"| yes | {tokens} |"), line


MODERN_SECTION = DOC.split('## 9. The modern family (model.block "modern")', 1)[1]


@pytest.mark.parametrize("name", ["tiny", "12M", "120M"])
def test_modern_table_matches_the_experiment(name: str) -> None:
    """Section 9's row of each modern experiment: its shape, parameter count, batch, steps and precision."""
    exp = config.load(REPO / "experiments" / f"ANDREA-{name}-MODERN-TRAIN.json")
    m, t = exp.model, exp.train
    assert (m.block, t.optimizer) == ("modern", "muon")
    row = next(
        line for line in MODERN_SECTION.splitlines() if line.startswith(f"| `ANDREA-{name}-MODERN-TRAIN.json` |")
    )
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:9] == [
        f"{m.vocab_size:,}",
        str(m.d_model),
        str(m.n_layer),
        f"{m.n_head} x {m.head_dim}",
        f"{m.seq_len:,}",
        f"{params.n_params(m):,}",
        f"{t.micro_batch} x {t.n_micro}",
        f"{t.steps:,}",
    ]
    assert cells[9].startswith(t.precision) and t.backend in cells[9], cells[9]
    assert params.n_params(m) == 2 * m.vocab_size * m.d_model + 12 * m.n_layer * m.d_model**2  # the stated formula


def test_modern_order_and_groups_are_the_code_s() -> None:
    """Section 9's parameter table is the MODERN family's canonical order (with a value embedding: ve{j}, and skips:
    skip_w), and its Muon groups at ANDREA-120M's width are engine/optim.py's."""
    m = config.load(REPO / "experiments" / "ANDREA-120M-MODERN-TRAIN.json").model
    table = MODERN_SECTION.split("| # | name | shape |")[1].split("\n\n")[0]
    names = [n for line in table.splitlines() for n in re.findall(r"`([\w{}.]+)`", line.split("|")[2])]
    want = [
        name.replace("h0.", "h{l}.").replace("ve0", "ve{j}")
        for name, _ in params.param_shapes(dataclasses.replace(m, value_embeds=1, skips=1))
        if not name.startswith("h") or name.startswith("h0.")
    ]
    assert names == want
    groups = ", ".join(f"{len(g.offsets)} of ({g.rows}, {g.cols})" for g in optim.groups(m))
    assert f"at ANDREA-120M's width {groups}" in " ".join(MODERN_SECTION.split())


# Section 9's numbers and defaults, each against the constant or config default the code runs with.
MODERN_FLAT = " ".join(MODERN_SECTION.split())  # the prose with its line breaks made spaces


def stated(pattern: str) -> re.Match:
    found = re.search(pattern, MODERN_FLAT)
    assert found is not None, f"docs/ANDREA.md section 9 no longer states {pattern!r}"
    return found


def test_modern_norms_and_rope_are_the_code_s() -> None:
    """The one RMSNorm eps (every norm of the block and QK-norm, both backends), rotary's base, the soft-cap."""
    from microgpt.kernels import qkrope as k_qkrope
    from microgpt.kernels import rmsnorm as k_rmsnorm
    from microgpt.ops import qkrope, rmsnorm

    eps = float(stated(r"rmsnorm\(z\) = z / sqrt\(mean\(z\^2\) \+ ([0-9.e-]+)\)").group(1))
    assert float(stated(r"the same eps ([0-9.e-]+) in all five places").group(1)) == eps
    assert eps == rmsnorm.EPS == qkrope.EPS == k_rmsnorm.EPS == k_qkrope.EPS
    base = float(stated(r"\(`model\.rope_base`, ([0-9]+)\)").group(1))
    assert base == config.ModelConfig().rope_base == qkrope.BASE
    assert float(stated(r"model\.softcap \(([0-9.]+); 0: none\)").group(1)) == config.ModelConfig().softcap


def test_modern_optimizer_constants_are_the_code_s() -> None:
    """Muon's Newton-Schulz steps and coefficients, its normalisation eps, the clip's eps, the shape scale of a wide
    and of a tall matrix stored [in, out]."""
    import numpy as np

    from microgpt.ops import muon
    from microgpt.ops.gradclip import clip_factor

    assert "ns times: A = X X^T" in MODERN_FLAT
    n = stated(r"ns = `train\.muon_ns_steps` \((\d+)\), an int in \[(\d+), (\d+)\], counts the Newton-Schulz steps")
    assert int(n.group(1)) == muon.NS_STEPS == config.TrainConfig().muon_ns_steps
    assert (int(n.group(2)), int(n.group(3))) == (1, config.MAX_NS_STEPS)
    coeffs = stated(r"\(a, b, c\) = \(([-0-9., ]+)\)").group(1)
    assert tuple(float(c) for c in coeffs.split(",")) == muon.NS_COEFFS
    assert float(stated(r"U / \(\|\|U\|\|_F \+ ([0-9.e-]+)\)").group(1)) == muon.NORM_EPS
    clip_eps = float(stated(r"min\(1, clip / \(norm \* gscale \+ ([0-9.e-]+)\)\)").group(1))
    assert clip_factor(np.array([3.0]), np.float64(1.0), 2.0) == 2.0 / (3.0 + clip_eps)
    C = 8
    wide, tall = muon.MuonGroup((0,), C, 4 * C), muon.MuonGroup((0,), 4 * C, C)
    scale = stated(r"w_1 \(C, 4C\) is wide, scale (\d+); w_2 \(4C, C\) is tall: .*?, scale (\d+)\.")
    assert (wide.scale, tall.scale) == (float(scale.group(1)), float(scale.group(2)))
    assert not wide.transposed and tall.transposed and tall.shape == (C, 4 * C)


def test_modern_defaults_are_the_config_s() -> None:
    """Every `train.<field>` (<number>) or (<number> by default) of section 9 is that field's default."""
    found = dict(re.findall(r"`train\.(\w+)` \(([0-9.]+)(?: by default)?\)", MODERN_FLAT))
    want = ("weight_decay", "muon_weight_decay", "muon_momentum_start", "muon_momentum", "muon_momentum_warmup")
    assert set(want) <= set(found), found
    defaults = config.TrainConfig()
    for name, value in found.items():
        assert float(value) == getattr(defaults, name), (name, value)


def test_modern_schedule_example_and_value_embeddings_are_the_code_s() -> None:
    """The warmdown's worked example on ANDREA-120M-MODERN, the momentum formula with and without warmup, and the
    value embeddings' example layers."""
    t = config.load(REPO / "experiments" / "ANDREA-120M-MODERN-TRAIN.json").train
    ex = stated(
        r"\(S = ([\d,]+), warmdown_frac ([0-9.]+), no warmup\): d = ([\d,]+), and the last step runs at "
        r"f\(([\d,]+)\) = lr / ([\d,]+)\."
    )
    S, frac, d, last, over = (float(g.replace(",", "")) for g in ex.groups())
    assert (S, frac, t.warmup_steps, last) == (t.steps, t.warmdown_frac, 0, t.steps - 1)
    assert optim.lr_at(int(d), t) == t.lr > optim.lr_at(int(d) + 1, t)
    assert optim.lr_at(int(last), t) == pytest.approx(t.lr / over, rel=1e-9)
    for W in (0, 1, 10):
        tw = dataclasses.replace(t, muon_momentum_warmup=W, schedule_start=5)
        for s in range(15):
            done = min(1, s / W) if W else 1  # the stated mu(s), W = 0: the final value
            mu = tw.muon_momentum_start + (tw.muon_momentum - tw.muon_momentum_start) * done
            assert optim.muon_momentum(5 + s, tw) == pytest.approx(mu, rel=1e-15), (W, s)
    ve = stated(r"L = (\d+), k = (\d+) gives ([\w, ]+)\)")
    m = dataclasses.replace(config.ModelConfig(block="modern"), n_layer=int(ve.group(1)), value_embeds=int(ve.group(2)))
    assert [params.value_embed(m, layer) or "none" for layer in range(m.n_layer)] == ve.group(3).split(", ")


def test_batch_warmup_example_is_the_code_s() -> None:
    """Section 9's worked batch warmup: its counts and its micro-batches before the step it names (the closed form)."""
    from microgpt.data import MicroSchedule

    ex = stated(
        r"U = (\d+) from (\d+) over W = (\d+) steps reads ([\d, ]+), then (\d+) micro-batches: (\d+) before step (\d+)"
    )
    U, u0, W, counts, last, before, step = ex.groups()
    sch = MicroSchedule(int(U), int(W), int(u0))
    assert [sch.count(s) for s in range(int(W) + 1)] == [int(c) for c in counts.split(", ")] + [int(last)]
    assert sch.before(int(step)) == int(before) == sum(sch.count(s) for s in range(int(step)))
    assert {"batch_warmup_steps", "batch_warmup_start"} <= set(
        re.findall(r"`train\.(\w+)` \([0-9.]+ by default\)", MODERN_FLAT)
    )


def test_modern_skips_are_the_code_s() -> None:
    """The skips' pairing (layer L-1-j receives skip j, at most L/2 of them: the config's bound), their scalars' init
    and optimizer row."""
    from microgpt.config import ConfigError

    bound = stated(r"Skip connections \(`model\.skips` = k, 0 by default, at most L/(\d)\)").group(1)
    m = dataclasses.replace(config.ModelConfig(block="modern"), n_layer=6, skips=6 // int(bound))
    assert [params.skip_into(m, layer) for layer in range(6)] == [None, None, None, 2, 1, 0]
    with pytest.raises(ConfigError, match="model.skips"):
        config.from_dict({"model": {**dataclasses.asdict(m), "skips": m.skips + 1}})
    init = stated(r"`skip_w` is one \(k,\) vector of learned scalars, initialised to (\d)").group(1)
    assert params.named(params.init_weights(m, 0), m)["skip_w"].tolist() == [float(init)] * 3
    assert "`skip_w` a call of its own at the head's lr" in MODERN_FLAT
    assert ("head", *[params.param_offsets(m)["skip_w"] + d for d in (0, 3)]) in optim.adamw_ranges(m)


@pytest.mark.parametrize("name", ["tiny", "12M", "120M"])
def test_modern_recipe_sentence_is_the_experiments(name: str) -> None:
    """ "All three name ...": the recipe's optimizer, lrs, schedule, AdamW's betas and eps, decay, clip and soft-cap."""
    exp = config.load(REPO / "experiments" / f"ANDREA-{name}-MODERN-TRAIN.json")
    m, t = exp.model, exp.train
    want = (
        f'All three name `"optimizer": "{t.optimizer}"`, `train.lr` {t.lr:g} (AdamW\'s embedding), `head_lr` '
        f'{t.head_lr:g}, `muon_lr` {t.muon_lr:g}, no warmup, `"schedule": "{t.schedule}"` over the last '
        f"{t.warmdown_frac:g} to `min_lr` {t.min_lr:g}, AdamW's betas ({t.beta1:g}, {t.beta2:g}) and eps {t.eps:g}, "
        f"no weight decay, `grad_clip` {t.grad_clip:.1f} and `softcap` {m.softcap:g}."
    )
    assert want in MODERN_FLAT, want
    assert (t.warmup_steps, t.weight_decay, t.muon_weight_decay) == (0, 0.0, 0.0)


def test_modern_window_schedule_example_is_the_code_s() -> None:
    """Section 9's window schedule example (w0, E, T: the windows and the steps they start at) is optim.attn_window_at,
    and the rule it states is the one config checks (a start that is a multiple of 16, below the final window)."""
    ex = stated(r"At W0 = (\d+), E = (\d+), T = (\d+) the windows are ([\d, ]+) from steps ([\d, ]+)\.")
    w0, E, T = (int(g) for g in ex.groups()[:3])
    windows, starts = ([int(x) for x in g.split(", ")] for g in ex.groups()[3:])
    m, t = config.ModelConfig(block="modern", seq_len=T), config.TrainConfig(attn_window_start=w0, attn_window_every=E)
    config.validate(config.Experiment(model=m, train=t), "<doc>")
    got = [optim.attn_window_at(s, m, t) for s in range(starts[-1] + 2 * E)]
    assert [got[s] for s in starts] == windows and got[-1] == windows[-1] == T
    assert [s for s in range(1, len(got)) if got[s] != got[s - 1]] == starts[1:]
    assert config.WINDOW_TILE == int(stated(r"w0 must be a multiple of (\d+)").group(1))
