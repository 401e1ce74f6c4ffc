"""The triton backend's halves: one module per op pair (k_<op>_fwd / k_<op>_bwd and their launchers, named as the
NumPy reference's functions), the step's helpers (gradclip, adamw), the device runtime (runtime.py) and the
once-per-GPU choices (tuning.py). Modules here import nothing of the project above kernels/: microgpt/backend.py
builds the backend from them through the op registry. Launchers write into the buffers they are given and never
allocate; the three that need scratch beyond the spec's arguments take it as a keyword argument, planned in the
memory plan's "kernel" rows (runtime.Runtime.scratch).
"""
