"""docs/ANDREA.md states numbers: each parameter count and memory plan there must be what the code computes for
the committed experiments, so the page cannot drift from experiments/*.json."""

from __future__ import annotations

import pytest

from microgpt import config, memory
from tests.conftest import REPO

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
    assert cells[6] == f"{memory.n_params(m):,}", (cells[6], memory.n_params(m))
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
    plan = memory.format_plan(memory.plan(m, t, rows), t.precision)  # without the backend's own rows
    assert plan in DOC, f"docs/ANDREA.md lacks the memory plan the engine prints for ANDREA-{name}:\n{plan}"
