"""FIREHOSE on the test's three synthetic sources (a repeating pattern, uniform noise, a copy of the pattern):
the noise source's weight under each reward, and with EXP3's importance weighting. docs/FIREHOSE-BANDIT.md
quotes the output. Run with one BLAS thread: OMP_NUM_THREADS=1 .venv/bin/python dev/firehose_synthetic.py"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import config  # noqa: E402
from microgpt.run.trainer import Trainer  # noqa: E402
from tests.data.test_mixing import FIREHOSE, experiment, write_sources  # noqa: E402

VARIANTS = {
    "improvement": {},
    "loss": {"reward": "loss"},
    "excess": {"reward": "excess"},
    "improvement + importance weighting": {"importance_weighting": True},
}
STEPS, SHOW = 150, (10, 25, 50, 75, 100, 125, 150)


def main() -> None:
    root = write_sources(Path(tempfile.mkdtemp()) / "src")
    print("| variant | noise weight at step " + " / ".join(map(str, SHOW)) + " | pattern val loss |\n|---|---|---:|")
    for name, extra in VARIANTS.items():
        exp = config.from_dict(experiment(root, {**FIREHOSE, **extra}, steps=STEPS))
        tr = Trainer(exp, root.parent / "run")
        noise = [tr.train_step()["mixture"]["b-noise"] for _ in range(STEPS)]
        val = tr.evaluate()["source_val_loss"]["a-pattern"]
        print(f"| {name} | " + " / ".join(f"{noise[s - 1]:.2f}" for s in SHOW) + f" | {val:.3f} |")


if __name__ == "__main__":
    main()
