"""qkrope pair (QK-norm per head, then rotary embedding, in place) against torch autograd, written as Hugging Face's
Llama writes RoPE (rotate_half with the cos and sin tables repeated over both halves), on q and k views strided
inside a projection buffer."""

import numpy as np
import pytest
import torch

from microgpt.ops.qkrope import EPS, qkrope_backward, qkrope_forward, rope_tables
from microgpt.ops.rows import Rows

from ._util import F32_TOL, F64_TOL, check, tt

# (b, t, H, D, pos): one row; odd t; one head of two lanes; three heads; D 128 at positions past 0; D 12
SHAPES = [(1, 1, 1, 2, 0), (2, 7, 3, 8, 0), (3, 5, 1, 8, 4), (1, 9, 2, 128, 0), (2, 3, 3, 128, 17), (2, 4, 2, 2, 1),
          (2, 3, 3, 12, 0)]  # fmt: skip


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def torch_qkrope(x: torch.Tensor, rope: np.ndarray, pos: int, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, rstd) of x (b, t, C), float64: RMSNorm per head, then RoPE at positions pos .. pos + t - 1."""
    b, t, C = x.shape
    xh = x.view(b, t, n_head, C // n_head)
    rstd = torch.rsqrt(xh.pow(2).mean(-1, keepdim=True) + EPS)
    xh = xh * rstd
    cos, sin = (torch.from_numpy(rope[i, pos : pos + t]).double().repeat(1, 2)[None, :, None, :] for i in (0, 1))
    return (xh * cos + rotate_half(xh) * sin).reshape(b, t, C), rstd.reshape(b * t, n_head)


def views(rng: np.random.Generator, b: int, t: int, C: int, dtype, interleaved: bool) -> tuple[np.ndarray, ...]:
    """(buffer, q, k): q and k (b, t, C) views of a random projection buffer, as the model hands them in: the
    (3, N, C) buffer's [0] and [1], or (interleaved) the columns of a (b, t, 3C) buffer, rows 3C apart."""
    if interleaved:
        buf = (rng.standard_normal((b, t, 3 * C)) * 1.5 + 0.3).astype(dtype)
        return buf, buf[:, :, :C], buf[:, :, C : 2 * C]
    buf = (rng.standard_normal((3, b * t, C)) * 1.5 + 0.3).astype(dtype)
    return buf, buf[0].reshape(b, t, C), buf[1].reshape(b, t, C)


def test_rope_tables() -> None:
    """cos and sin of p * base^(-2i/D), float32, against torch in float64 (as Hugging Face's inverse frequencies);
    an odd head size is refused."""
    T, D = 50, 16
    got = rope_tables(T, D)
    assert got.shape == (2, T, D // 2) and got.dtype == np.float32
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    a = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    np.testing.assert_allclose(got[0], torch.cos(a).numpy(), rtol=0, atol=1e-7)
    np.testing.assert_allclose(got[1], torch.sin(a).numpy(), rtol=0, atol=1e-7)
    assert (got[:, 0] == np.array([[1.0], [0.0]], np.float32)).all()  # position 0: no rotation
    with pytest.raises(ValueError, match="must be even"):
        rope_tables(4, 7)


def run(
    rng: np.random.Generator,
    b: int,
    t: int,
    H: int,
    D: int,
    pos: int,
    dtype,
    interleaved: bool,
    rows: Rows | None = None,
) -> dict:
    """Forward at pos, then (at pos 0) backward, on NumPy views; what the NumPy pair gave and torch's reference."""
    C = H * D
    rope = rope_tables(pos + t + 3, D)
    buf, q, k = views(rng, b, t, C, np.float64, interleaved)
    dout = {n: rng.standard_normal((b, t, C)) for n in ("dq", "dk")}
    ref = {}
    for name, x in (("q", q), ("k", k)):
        leaf = tt(x)
        out, r = torch_qkrope(leaf, rope, pos, H)
        (out * torch.from_numpy(dout["d" + name])).sum().backward()
        ref |= {name: out, "rstd_" + name: r, "d" + name: leaf.grad}
    buf = buf.astype(dtype)
    q, k = (buf[:, :, :C], buf[:, :, C : 2 * C]) if interleaved else (buf[0].reshape(b, t, C), buf[1].reshape(b, t, C))
    rstd = np.full((2, b * t, H), np.nan, dtype)
    kw = {} if rows is None else {"rows": rows}
    untouched = buf[2].copy() if not interleaved else buf[:, :, 2 * C :].copy()
    qkrope_forward(q, k, rstd, rope, n_head=H, pos=pos, **kw)
    got = {"q": q.copy(), "k": k.copy(), "rstd_q": rstd[0], "rstd_k": rstd[1]}
    rest = buf[2] if not interleaved else buf[:, :, 2 * C :]
    np.testing.assert_array_equal(rest, untouched, err_msg="v is not the op's")
    if pos == 0:
        dq, dk = (dout[n].astype(dtype) for n in ("dq", "dk"))
        qkrope_backward(dq, dk, q, k, rstd, rope, n_head=H, **kw)
        got |= {"dq": dq, "dk": dk}
    else:
        ref = {n: x for n, x in ref.items() if n not in ("dq", "dk")}
    return {"got": got, "ref": ref}


@pytest.mark.parametrize("interleaved", [False, True], ids=["qkv-3NC", "rows-3C"])
@pytest.mark.parametrize("b,t,H,D,pos", SHAPES)
def test_qkrope_float64(b: int, t: int, H: int, D: int, pos: int, interleaved: bool) -> None:
    r = run(np.random.default_rng(b * 100 + t * 10 + H + D + pos), b, t, H, D, pos, np.float64, interleaved)
    assert r["got"].keys() == r["ref"].keys()
    for name in r["ref"]:
        check(name, r["got"][name], r["ref"][name], F64_TOL)


@pytest.mark.parametrize("b,t,H,D,pos", SHAPES)
def test_qkrope_float32(b: int, t: int, H: int, D: int, pos: int) -> None:
    r = run(np.random.default_rng(7 + b * t * H * D + pos), b, t, H, D, pos, np.float32, False)
    for name in r["ref"]:
        check(name, r["got"][name], r["ref"][name], F32_TOL)


def test_the_same_bits_on_any_number_of_threads() -> None:
    """Ranges of rows that cut through batch elements (3 threads over 3 x 5 rows) give the serial run's bits."""
    runs = [
        run(np.random.default_rng(3), 3, 5, 2, 8, 0, np.float32, True, rows)["got"]
        for rows in (None, Rows.make(3, chunk=16), Rows.make(2))
    ]
    for other in runs[1:]:
        for name, x in runs[0].items():
            np.testing.assert_array_equal(other[name], x, err_msg=name)


def test_positions_past_the_table_are_refused() -> None:
    q = np.ones((1, 3, 8))
    with pytest.raises(ValueError, match="past the rope table"):
        qkrope_forward(q, q.copy(), np.empty((2, 3, 2)), rope_tables(4, 4), n_head=2, pos=2)
