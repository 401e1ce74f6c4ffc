"""The greedy pick's kernel (kernels/argmax.py) against its NumPy twin (ops/argmax.py): the same index for every row,
ties, -inf, NaN and rows longer than one step of the loop included, from a row-strided view as next_logits[:b] of a
larger plan is (and a stride past the row). (tests/kernels/test_decode.py: the decode step's next_ids on both
backends.)"""

import numpy as np
import pytest
import torch

from microgpt.kernels import argmax as ka
from microgpt.ops import argmax as ref
from tests.ops.test_argmax import rows

from ._kutil import DEVICE, DTYPES


@pytest.mark.parametrize("b,V", [(1, 1), (5, 8), (6, 1000), (2, 3 * ka.BLOCK + 5), (3, 50304)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pad", [0, 3])
def test_argmax_rows(b: int, V: int, dtype: torch.dtype, pad: int) -> None:
    x = torch.from_numpy(rows(b, V, b + V)).to(dtype)  # rounded first: ties that rounding makes count too
    want = np.full(b, -1, np.int32)
    ref.argmax_rows(want, x.double().numpy())
    store = torch.full((b + 1, V + pad), 5.0, dtype=dtype, device=DEVICE)
    store[:b, :V] = x.to(DEVICE)
    out = torch.full((b + 2,), -7, dtype=torch.int32, device=DEVICE)
    ka.argmax_rows(out[:b], store[:b, :V])
    np.testing.assert_array_equal(out[:b].cpu().numpy(), want)
    assert out[b:].tolist() == [-7, -7], "nothing past the b rows is written"
