"""Kernel tests run the real Triton kernels. Without a GPU (CI) they run in Triton's interpreter on the CPU:
TRITON_INTERPRET must be set before triton is first imported, hence here, at collection time.
On the GPU machine, MICROGPT_TEST_GPU=1 runs the same tests on the device instead (plus the @gpu ones)."""

import os

if os.environ.get("MICROGPT_TEST_GPU") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
