"""Rows (microgpt/ops/rows.py): every range of rows is run once, and every op that runs over ranges of rows gives
the same bits for any thread count and any cut as over its whole arrays at once (the reference as it was written
before it had ranges), so the NumPy backend's results do not depend on the machine's cores."""

import os
import subprocess
import sys

import numpy as np
import pytest

from microgpt.ops import adamw, attention, crossentropy, gelu, layernorm, relu2, rmsnorm
from microgpt.ops.linear import Matmul
from microgpt.ops.rows import CHUNK, Rows, cpu_threads

WHOLE = Rows(chunk=1 << 40)  # one range over all rows: each op's passes over its whole arrays, one thread
CUTS = {  # (threads, elements a range)
    "one-row-ranges-3-threads": (3, 1),
    "7-element-ranges-2-threads": (2, 7),
    "default-ranges-4-threads": (4, CHUNK),
    "default-ranges-1-thread": (1, CHUNK),
}


@pytest.fixture(params=list(CUTS.values()), ids=list(CUTS))
def rows(request) -> Rows:
    return Rows.make(*request.param)


@pytest.mark.parametrize(
    "n, width, threads, chunk",
    [(0, 5, 2, 8), (1, 5, 4, 8), (10, 1, 3, 3), (10, 4, 2, 9), (37, 3, 4, 1), (5, 100, 8, 1 << 15)],
)
def test_every_row_once(n: int, width: int, threads: int, chunk: int) -> None:
    for per_thread in (False, True):
        seen: list[tuple[int, int]] = []
        Rows.make(threads, chunk).run(lambda i, j: seen.append((i, j)), n, width, per_thread)  # append is atomic
        assert sorted(r for i, j in seen for r in range(i, j)) == list(range(n))
        most = -(-n // threads) if per_thread else max(1, chunk // width)
        assert all(0 < j - i <= most for i, j in seen)
        assert not per_thread or len(seen) == min(n, threads)


def test_an_error_in_a_worker_reaches_the_caller_after_every_range_ran() -> None:
    ran: list[int] = []

    def fn(i: int, j: int) -> None:
        ran.append(i)
        if i == 9:
            raise ValueError("range 9")

    with pytest.raises(ValueError, match="range 9"):
        Rows.make(2, chunk=1).run(fn, 10)
    assert sorted(ran) == list(range(10))


def test_threads_follow_the_blas_variables() -> None:
    assert cpu_threads({"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}) == 3
    assert cpu_threads({"OMP_NUM_THREADS": "5"}) == 5
    assert cpu_threads({"OPENBLAS_NUM_THREADS": "0", "OMP_NUM_THREADS": " 2 "}) == 2
    assert cpu_threads({"OPENBLAS_NUM_THREADS": "many"}) == cpu_threads({}) >= 1


def test_openblas_idle_threads_sleep_soon_unless_the_user_says() -> None:
    """microgpt sets OpenBLAS's thread timeout when it is imported, before NumPy loads (ops/rows.py says why)."""
    code = "import microgpt, os, sys; assert 'numpy' not in sys.modules; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for user, seen in ((None, "18"), ("7", "7")):
        run_env = env if user is None else {**env, "OPENBLAS_THREAD_TIMEOUT": user}
        out = subprocess.run([sys.executable, "-c", code], env=run_env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == seen


def test_blas_runs_on_one_thread_inside_the_spans_and_as_before_after() -> None:
    rows = Rows.make(2, chunk=1)
    if rows.blas is None:
        pytest.skip("NumPy's BLAS here is not OpenBLAS")
    get, set_threads = rows.blas
    before = get()
    set_threads(2)
    seen: list[int] = []
    rows.run(lambda i, j: seen.append(get()), 4)
    assert seen == [1, 1, 1, 1] and get() == 2
    set_threads(before)


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert a.tobytes() == b.tobytes()


def _runs(run, rows: Rows, arrays: dict[str, np.ndarray]) -> None:
    """run(arrays, rows) on copies, once over the whole arrays and once with `rows`: the same bytes everywhere."""
    whole = {k: v.copy() for k, v in arrays.items()}
    cut = {k: v.copy() for k, v in arrays.items()}
    run(whole, WHOLE)
    run(cut, rows)
    for k in arrays:
        _same(cut[k], whole[k])


def _rand(rng: np.random.Generator, *shape: int, dtype=np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_and_its_backward(rows: Rows, dtype) -> None:
    rng = np.random.default_rng(0)
    arrays = {
        "h": 3 * _rand(rng, 67, 96, dtype=dtype),
        "out": np.zeros((67, 96), dtype),
        "dh": _rand(rng, 67, 96, dtype=dtype),
    }

    def run(a, r):
        gelu.gelu(a["out"], a["h"], r)
        gelu.gelu_backward(a["dh"], a["h"], r)

    _runs(run, rows, arrays)


def test_relu2_pair(rows: Rows) -> None:
    rng = np.random.default_rng(6)
    arrays = {"h": _rand(rng, 67, 96), "a": np.zeros((67, 96), np.float32), "dh": _rand(rng, 67, 96)}

    def run(a, r):
        relu2.relu2_forward(a["a"], a["h"], rows=r)
        relu2.relu2_backward(a["dh"], a["a"], rows=r)

    _runs(run, rows, arrays)


def test_layernorm_pairs(rows: Rows) -> None:
    rng = np.random.default_rng(1)
    N, C = 45, 40
    names = ["x", "y", "s", "out", "mean", "rstd", "dout", "dx", "dw", "db", "w", "b"]
    shapes = {"mean": (N,), "rstd": (N,), "dw": (C,), "db": (C,), "w": (C,), "b": (C,)}
    arrays = {k: _rand(rng, *shapes.get(k, (N, C))) for k in names}

    def run(a, r):
        layernorm.layernorm_forward(a["out"], a["mean"], a["rstd"], a["x"], a["w"], a["b"], rows=r)
        layernorm.residual_layernorm_forward(
            a["s"], a["out"], a["mean"], a["rstd"], a["x"], a["y"], a["w"], a["b"], rows=r
        )
        layernorm.layernorm_backward(a["dx"], a["dw"], a["db"], a["dout"], a["s"], a["w"], a["mean"], a["rstd"], rows=r)

    _runs(run, rows, arrays)


def test_rmsnorm_pair(rows: Rows) -> None:
    rng = np.random.default_rng(5)
    N, C = 45, 37
    arrays = {k: _rand(rng, N, C) for k in ["x", "y", "s", "out", "dout", "dx"]} | {"rstd": _rand(rng, N)}

    def run(a, r):
        rmsnorm.rmsnorm_forward(a["out"], a["rstd"], a["x"], rows=r)
        rmsnorm.residual_rmsnorm_forward(a["s"], a["out"], a["rstd"], a["x"], a["y"], rows=r)
        rmsnorm.rmsnorm_backward(a["dx"], a["dout"], a["s"], a["rstd"], rows=r)

    _runs(run, rows, arrays)


def test_attention_pair(rows: Rows) -> None:
    rng = np.random.default_rng(2)
    B, T, C, H = 5, 9, 12, 3
    arrays = {k: _rand(rng, B, T, C) for k in ["q", "k", "v", "dout", "out", "dq", "dk", "dv"]}
    arrays["lse"] = np.zeros((B, H, T), np.float32)

    def run(a, r):
        attention.attention_forward(a["out"], a["lse"], a["q"], a["k"], a["v"], H, rows=r)
        attention.attention_backward(
            a["dq"], a["dk"], a["dv"], a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"], H, rows=r
        )

    _runs(run, rows, arrays)


@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("R", [64, 20])  # one logits chunk, or several with a short last one
def test_crossentropy_head(rows: Rows, R: int, softcap: float) -> None:
    rng = np.random.default_rng(3)
    N, C, V = 50, 16, 70
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[[3, 17]] = -1  # ignored tokens
    arrays = {
        "x": _rand(rng, N, C),
        "wte": _rand(rng, V, C),
        "logits": np.zeros((R, V), np.float32),
        "dl": np.abs(_rand(rng, N)),
        "targets": targets,
    }
    arrays.update(
        {
            k: np.zeros(shape, np.float32)
            for k, shape in [
                ("losses", (N,)),
                ("lse", (N,)),
                ("dx", (N, C)),
                ("dwte", (V, C)),
                ("losses2", (N,)),
                ("dx2", (N, C)),
                ("dwte2", (V, C)),
            ]
        }
    )

    def run(a, r):
        mm = Matmul()
        crossentropy.crossentropy_forward(
            a["losses"], a["lse"], a["x"], a["wte"], a["targets"], a["logits"], mm=mm, rows=r, softcap=softcap
        )
        crossentropy.crossentropy_backward(
            a["dx"],
            a["dwte"],
            a["dl"],
            a["x"],
            a["wte"],
            a["targets"],
            a["lse"],
            a["logits"],
            mm=mm,
            rows=r,
            softcap=softcap,
        )
        crossentropy.crossentropy_forward_backward(
            a["losses2"],
            a["lse"],
            a["dx2"],
            a["dwte2"],
            a["dl"],
            a["x"],
            a["wte"],
            a["targets"],
            a["logits"],
            mm=mm,
            rows=r,
            softcap=softcap,
        )

    _runs(run, rows, arrays)


@pytest.mark.parametrize("norm", [0.5, 30.0, np.inf])  # unclipped, clipped, and a non-finite norm (nothing moves)
def test_adamw(rows: Rows, norm: float) -> None:
    rng = np.random.default_rng(4)
    n = 100_003
    arrays = {
        "p": _rand(rng, n),
        "g": _rand(rng, n),
        "m": _rand(rng, n),
        "v": np.abs(_rand(rng, n)),
        "mask": (rng.random(n) < 0.7).astype(np.float32),
        "pc": np.zeros(n, np.float32),
    }
    hyper = np.array([3e-3, 1 - 0.9**7, 1 - 0.95**7, 0.5], np.float32)

    def run(a, r):
        adamw.adamw_step(
            a["p"],
            a["g"],
            a["m"],
            a["v"],
            a["mask"],
            a["pc"],
            hyper,
            np.array([norm], np.float32),
            0.9,
            0.95,
            1e-8,
            0.1,
            1.0,
            rows=r,
        )

    _runs(run, rows, arrays)
