"""TEMPORARY (lead's placeholder until the rope branch lands): the rotary tables only."""

import numpy as np


def rope_tables(T: int, D: int, base: float) -> np.ndarray:
    inv = base ** (-np.arange(0, D, 2, dtype=np.float64) / D)
    ang = np.arange(T, dtype=np.float64)[:, None] * inv[None, :]
    return np.stack([np.cos(ang), np.sin(ang)]).astype(np.float32)
