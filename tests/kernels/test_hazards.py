"""check/hazards.py finds a write-after-read race in a real compiled kernel, and not in its fixed twin.

The racy kernel (k_tile with ZERO) has the pattern of kernels/muon.py's normalise pass as it was when the Muon step did
not repeat on the GPU: it loads a tile of g and stores zeros over the same tile, and Triton lays the two out over
different threads; its twin stores a value computed from the load. Both are compiled for sm_90 on the CPU (as
check/targets.py compiles every kernel), in a process of their own: this folder's conftest sets TRITON_INTERPRET,
under which nothing compiles. tests/kernels/test_targets.py runs the same scan over every kernel binary CI
compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from microgpt.kernels.check.hazards import hazards
from tests.conftest import REPO

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch, triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    from microgpt.kernels.check.hazards import hazards

    @triton.jit
    def k_tile(x_ptr, g_ptr, cols, ZERO: tl.constexpr, TR: tl.constexpr, TC: tl.constexpr):
        # x = 2 g over a tile, then g overwritten: by zeros (ZERO, the racy pattern) or by g / 2 (from the load)
        r = tl.program_id(0) * TR + tl.arange(0, TR)
        c = tl.arange(0, TC)
        mask = (r[:, None] < cols) & (c[None, :] < cols)
        ptr = r[:, None].to(tl.int64) * cols + c[None, :]
        g = tl.load(g_ptr + ptr, mask=mask, other=0.0)
        tl.store(x_ptr + ptr, (g * 2.0).to(x_ptr.dtype.element_ty), mask=mask)
        if ZERO:
            tl.store(g_ptr + ptr, tl.zeros((TR, TC), dtype=g_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(g_ptr + ptr, g * 0.5, mask=mask)

    def ttgir(kernel, zero):
        backend = make_backend(GPUTarget("cuda", 90, 32))
        kw = {"ZERO": zero, "TR": 64, "TC": 64, "debug": False, "instrumentation_mode": ""}
        args = (torch.empty(4, dtype=torch.bfloat16), torch.empty(4), 768)
        bind = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, spec, opts = bind(*args, **kw)
        opts, sig, consts, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
        src = ASTSource(kernel, sig, consts, attrs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts.__dict__).asm["ttgir"]

    print(json.dumps({"k_racy": hazards(ttgir(k_tile, True)), "k_in_place": hazards(ttgir(k_tile, False))}))
    """
)


def test_the_scan_finds_the_muon_race_and_passes_its_fix(tmp_path) -> None:
    script = tmp_path / "racy.py"  # Triton reads a kernel's source from its file
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    found = json.loads(r.stdout.splitlines()[-1])
    assert len(found["k_racy"]) == 1 and found["k_racy"][0].startswith("%g_ptr: loaded in #"), found
    assert found["k_in_place"] == [], found


def test_a_store_of_a_loaded_value_is_not_a_race() -> None:
    """TTGIR as Triton prints it: g loaded in one layout and stored, converted, in another is safe (the conversion
    passes through shared memory behind a barrier); zeros stored in another layout are not; a loop-carried value is
    taken as depending on everything."""
    head = "  tt.func public @k(%g_ptr: !tt.ptr<f32>, %n: i32) {\n"
    ptr = "tensor<64x!tt.ptr<f32>, {}>"
    load = f"    %p = tt.splat %g_ptr : !tt.ptr<f32> -> {ptr.format('#a')}\n"
    load += f"    %v = tt.load %p : {ptr.format('#a')}\n"
    q = f"    %q = tt.splat %g_ptr : !tt.ptr<f32> -> {ptr.format('#b')}\n"
    safe = "    %w = ttg.convert_layout %v : tensor<64xf32, #a> -> tensor<64xf32, #b>\n"
    safe += f"    tt.store %q, %w : {ptr.format('#b')}\n"
    zero = "    %z = arith.constant dense<0.0> : tensor<64xf32, #b>\n"
    zero += f"    tt.store %q, %z : {ptr.format('#b')}\n"
    same = "    %z = arith.constant dense<0.0> : tensor<64xf32, #a>\n"
    same += f"    tt.store %p, %z : {ptr.format('#a')}\n"
    carried = f"    tt.store %q, %acc : {ptr.format('#b')}\n"
    assert hazards(head + load + q + safe) == []
    assert len(hazards(head + load + q + zero)) == 1
    assert hazards(head + load + same) == []
    assert hazards(head + load + q + carried) == []


def test_a_barrier_between_the_load_and_the_store_orders_them() -> None:
    head = "  tt.func public @k(%g_ptr: !tt.ptr<f32>) {\n"
    ptr = "tensor<64x!tt.ptr<f32>, {}>"
    body = f"    %p = tt.splat %g_ptr : !tt.ptr<f32> -> {ptr.format('#a')}\n"
    body += f"    %v = tt.load %p : {ptr.format('#a')}\n"
    body += f"    %q = tt.splat %g_ptr : !tt.ptr<f32> -> {ptr.format('#b')}\n"
    body += "    %z = arith.constant dense<0.0> : tensor<64xf32, #b>\n"
    store = f"    tt.store %q, %z : {ptr.format('#b')}\n"
    assert len(hazards(head + body + store)) == 1
    assert hazards(head + body + "    gpu.barrier\n" + store) == []
