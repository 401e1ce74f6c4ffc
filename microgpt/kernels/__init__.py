"""The triton backend's halves: one module per op pair (k_<op>_fwd / k_<op>_bwd and their launchers, named as the
NumPy reference's functions), the step's helpers (gradclip, adamw), the device runtime (runtime.py) and the
once-per-GPU choices (tuning.py). Modules here import nothing of the project above kernels/: microgpt/engine/backend.py
builds the backend from them through the op registry. Launchers write into the buffers they are given and never
allocate. What a launcher takes beyond the spec's arguments it gets as a keyword argument, bound by the backend
with the arena: planned scratch (runtime.Runtime.scratch: embedding, LayerNorm and attention backward), the
runtime's tuner (runtime.TUNER_TAKERS), and the precision's Matmul (`mm`: linear.Matmul, fp8.Matmul), which holds
the GEMM router (gemm.py) and, in fp8, the casts' planned scratch (the casts: fp8_cast.py). No module here keeps
mutable state: the choices, plans and handles belong to the runtime's Tuner, Gemm and CublasLt
(tests/kernels/test_module_state.py). check/ (catalogue.py, targets.py) is the check of the others against each
GPU architecture, which the engine never runs: every launch captured, and compiled ahead of time for sm_80,
sm_86, sm_89 and sm_90 on any machine.
"""
