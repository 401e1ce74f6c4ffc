"""`microgpt train` on a GPU with the process's CUDA memory capped as a smaller card's would be.

    python3 dev/capped_train.py GIB train EXPERIMENT [microgpt train's flags ...]

torch.cuda.set_per_process_memory_fraction(GIB / the card's total) is set before the engine starts, so the
caching allocator refuses anything past GIB and the runtime reads the cap as the card's room for the plan
(kernels/runtime.Runtime.memory_bytes): with `--micro-batch auto` the plan is chosen to fit GIB less
train.memory_margin. The engine's output is its own (JSON lines on stdout, progress and the plan on stderr); at the
end one JSON line on stderr gives the cap and the allocator's peaks (`torch.cuda.max_memory_allocated` and
`max_memory_reserved`), which must stay within the cap from step 1 on.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from microgpt import cli  # noqa: E402


def main(argv: list[str]) -> int:
    cap = float(argv[0]) * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    try:
        return cli.main(argv[1:])
    finally:
        peak = {
            "cap_gib": float(argv[0]),
            "peak_allocated": torch.cuda.max_memory_allocated(),
            "peak_reserved": torch.cuda.max_memory_reserved(),
        }
        print(json.dumps({"event": "capped", **peak, "within": peak["peak_reserved"] <= cap}), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
