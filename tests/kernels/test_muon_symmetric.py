"""kernels/symmetric.py's tile, Newton-Schulz's A = X X^T and B = b A + c A A on their upper tiles, against torch in
float64 on random batches whose sizes the tiles do not divide: within the dtype's rounding, and exactly symmetric
(the mirrored half the same bits). Then the GEMM router's addmm over it: the warm-up times it beside the reference,
records the fastest that agrees with the reference on the probe rows, and a later process reuses the record.
The whole Muon step runs through the tile in tests/kernels/test_muon.py (the interpreter takes it for A and B; on
the GPU, MICROGPT_TEST_GPU=1, each way the tuner may choose is forced in turn)."""

from __future__ import annotations

import json

import pytest
import torch

from microgpt.kernels import gemm as kgemm
from microgpt.kernels import tuning
from microgpt.kernels.gemm import Gemm
from microgpt.kernels.symmetric import symmetric_addmm
from microgpt.ops.muon import NS_COEFFS

from ._kutil import DEVICE, ON_GPU

_, B_COEF, C_COEF = NS_COEFFS
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])  # bf16 loads: GPU only
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}  # relative to the product's norm
SHAPES = [(3, 40, 72), (2, 130, 130), (1, 7, 3)]  # (k, R, Cw): R straddles the tiles (the interpreter's 32, 128)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def batch(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gram_and_polynomial_match_torch_and_are_symmetric(shape, dtype) -> None:
    """A = X X^T (beta 0: the NaN in A's buffer, which is also c, is never read), then B = b A + c A A into a
    NaN-filled buffer: both within the dtype's rounding of float64's, both exactly symmetric, no NaN left."""
    x = batch(shape, dtype, 53)
    gram = torch.full(shape[:1] + shape[1:2] * 2, float("nan"), device=DEVICE, dtype=dtype)
    symmetric_addmm(gram, gram, x, x.mT, 0.0, 1.0)
    want = x.double() @ x.double().mT
    assert torch.equal(gram, gram.mT), "A is not exactly symmetric"
    assert relative(gram, want) < TOL[dtype], relative(gram, want)
    poly = torch.full_like(gram, float("nan"))
    symmetric_addmm(poly, gram, gram, gram, B_COEF, C_COEF)
    a = gram.double()
    want = B_COEF * a + C_COEF * (a @ a)
    assert torch.equal(poly, poly.mT), "B is not exactly symmetric"
    assert relative(poly, want) < TOL[dtype], relative(poly, want)
    assert not poly.isnan().any()


def test_one_matrix_and_a_strided_batch() -> None:
    """A 2D product, and a batch whose operand is a view with padded rows (any strides are read as they lie); c apart
    from out, read at its own strides."""
    x = batch((70, 50), torch.float32, 54)
    out = torch.empty(70, 70, device=DEVICE)
    symmetric_addmm(out, out, x, x.t(), 0.0, 2.0)
    torch.testing.assert_close(out.double(), 2.0 * (x.double() @ x.double().t()), rtol=1e-5, atol=1e-5)
    wide = batch((2, 33, 48), torch.float32, 55)[:, :, :40]  # rows 48 apart, 40 used
    c = batch((2, 33, 33), torch.float32, 56)
    c = c + c.mT
    out = torch.empty(2, 33, 33, device=DEVICE)
    symmetric_addmm(out, c, wide, wide.mT, 0.5, -1.5)
    want = 0.5 * c.double() - 1.5 * (wide.double() @ wide.double().mT)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, out.mT)


def test_shapes_that_do_not_chain_are_refused() -> None:
    x = torch.empty(2, 8, 5, device=DEVICE)
    with pytest.raises(ValueError, match="symmetric product"):
        symmetric_addmm(torch.empty(2, 8, 9, device=DEVICE), torch.empty(2, 8, 9, device=DEVICE), x, x.mT, 0.0, 1.0)
    out = torch.empty(2, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="c's rows"):
        symmetric_addmm(out, out.mT, x, x.mT, 1.0, 1.0)


def tuned_gemm(folder, monkeypatch: pytest.MonkeyPatch, times: dict[str, float], ran: list[str]) -> Gemm:
    """A router on a tuner whose cache lives in folder, each way's time the figure in `times` (no GPU in CI); every
    way it runs is recorded in `ran` and runs for real (torch's addmm, the symmetric tile)."""
    monkeypatch.setenv("MICROGPT_CACHE", str(folder))
    tuner = tuning.Tuner("test-device")
    monkeypatch.setattr(tuner, "_time", lambda fn: fn())
    tuner.set_probe(torch.zeros(2 * kgemm.PROBE_ROWS * 130, device=DEVICE))
    gemm = Gemm(tuner, None)
    real = gemm._addmm_run

    def run(way: str, *args) -> float:
        ran.append(way)
        real(way, *args)
        return times[way]

    monkeypatch.setattr(gemm, "_addmm_run", run)
    return gemm


def test_the_warm_up_records_the_symmetric_way_and_a_later_process_reuses_it(tmp_path, monkeypatch) -> None:
    """Without cuBLASLt the ways of a symmetric product are torch's addmm (the reference) and the tile. The warm-up
    runs both, compares the tile's probe rows with the reference's, times both and records the faster (the tile);
    after it the product runs the tile, choosing nothing again. A new router on a new tuner (a resumed run) reads
    the record: the tile, untimed. The non-symmetric product Y = a X + B X has the reference alone."""
    ran: list[str] = []
    gemm = tuned_gemm(tmp_path, monkeypatch, {"cublas": 2.0, "sym": 1.0}, ran)
    x = batch((2, 130, 130), torch.float32, 57)
    gram = torch.full((2, 130, 130), float("nan"), device=DEVICE)
    with gemm.tuner.window():
        gemm._addmm_tuned(gram, gram, x, x.mT, 0.0, 1.0, True)
    assert ran[:2] == ["cublas", "sym"] and ran[-1] == "sym"
    (key,) = gemm.choices()
    assert key.startswith("addmm_sym:") and gemm.choices() == {key: "sym"}
    assert json.loads(gemm.tuner.path.read_text())["gemm"] == {key: "sym"}
    want = x.double() @ x.double().mT
    torch.testing.assert_close(gram.double(), want, rtol=1e-5, atol=1e-5)
    gram.fill_(float("nan"))
    gemm._addmm_tuned(gram, gram, x, x.mT, 0.0, 1.0, True)
    assert ran[-1] == "sym" and torch.equal(gram, gram.mT)

    later: list[str] = []
    again = tuned_gemm(tmp_path, monkeypatch, {"cublas": 2.0, "sym": 1.0}, later)
    gram.fill_(float("nan"))
    again._addmm_tuned(gram, gram, x, x.mT, 0.0, 1.0, True)
    assert later == ["sym"] and again.choices() == {key: "sym"}
    torch.testing.assert_close(gram.double(), want, rtol=1e-5, atol=1e-5)
    y = torch.empty_like(x)
    with again.tuner.window():
        again._addmm_tuned(y, x, gram, x, 3.0, 1.0, False)
    assert later[-1] == "cublas" and sorted(again.choices().values()) == ["cublas", "sym"]
    torch.testing.assert_close(y.double(), 3.0 * x.double() + gram.double() @ x.double(), rtol=1e-5, atol=1e-5)


def test_a_way_that_disagrees_with_the_reference_is_not_offered(tmp_path, monkeypatch) -> None:
    """The fastest way is not taken where its probe rows differ from the reference's (here a tile that writes
    zeros): the reference is recorded."""
    ran: list[str] = []
    gemm = tuned_gemm(tmp_path, monkeypatch, {"cublas": 2.0, "sym": 1.0}, ran)
    monkeypatch.setattr(kgemm, "symmetric_addmm", lambda out, *args: out.zero_())
    x = batch((2, 40, 72), torch.float32, 58)
    gram = torch.empty(2, 40, 40, device=DEVICE)
    with gemm.tuner.window():
        gemm._addmm_tuned(gram, gram, x, x.mT, 0.0, 1.0, True)
    assert list(gemm.choices().values()) == ["cublas"]
    torch.testing.assert_close(gram.double(), x.double() @ x.double().mT, rtol=1e-5, atol=1e-5)
