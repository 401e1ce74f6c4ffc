"""Token + position embedding; the position table is optional (the modern block has none, issue 46).

    out[b, t, :] = wte[tokens[b, t], :] + wpe[t, :]        (without wpe: wte[tokens[b, t], :])

embedding_add_forward adds a table's rows to a buffer instead (the modern block's value embeddings, added to a
layer's values): out[n, :] += table[tokens[n], :]. Its backward is embedding_backward without wpe (the same scatter
of dout, which the add passes through unchanged, into the table's gradient).

Shapes: tokens (B,T) int32, wte (V,C), wpe (Tmax,C) with T <= Tmax or None, out (B,T,C).
Forward saves nothing: backward needs only the token ids, which the caller keeps anyway.

Backward scatters dout back into the rows that were gathered:

    dwte[tokens[b, t], :] += dout[b, t, :]      (several positions may hit one row)
    dwpe[t, :]            += sum_b dout[b, t, :]   (skipped where dwpe is None)

np.add.at applies the updates one after another in the order of the flattened indices, so repeated
tokens are summed in a fixed order and the result is bitwise reproducible.
"""

import numpy as np
from numpy.typing import NDArray


def embedding_forward(out: NDArray, tokens: NDArray, wte: NDArray, wpe: NDArray | None = None) -> None:
    """out (B,T,C) = wte[tokens] + wpe[:T] (wpe None: wte[tokens])."""
    T = tokens.shape[1]
    np.take(wte, tokens, axis=0, out=out)  # gather rows straight into out
    if wpe is not None:
        out += wpe[:T]  # broadcasts over the batch axis


def embedding_backward(
    dwte: NDArray, dwpe: NDArray | None, dout: NDArray, tokens: NDArray, sorted_before: bool = False
) -> None:
    """dwte (V,C) += scatter of dout by token id; dwpe[:T] (T,C) += dout summed over the batch (dwpe None: no
    position table). sorted_before: an earlier call of this backward scattered the same tokens (the GPU keeps its
    sort of them; here there is none to keep)."""
    T, C = dout.shape[1], dout.shape[2]
    np.add.at(dwte, tokens.reshape(-1), dout.reshape(-1, C))  # unbuffered: repeated ids all count
    if dwpe is not None:
        dwpe[:T] += dout.sum(axis=0)


def embedding_add_forward(out: NDArray, tokens: NDArray, table: NDArray) -> None:
    """out (N,C) or (B,T,C) += table[tokens] for tokens of N ids (any shape)."""
    C = table.shape[1]
    out.reshape(-1, C)[...] += np.take(table, tokens.reshape(-1), axis=0)
