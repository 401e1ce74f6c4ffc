"""Unigram baseline: cross-entropy of the val split under the train split's token frequencies (add-one).

python dev/unigram_baseline.py data/builtin/v2048-761473a3
"""

import sys

import numpy as np

from microgpt.data import shards

d = sys.argv[1]
tr = shards.read_tokens(shards.list_shards(d, "train")).astype(np.int64)
va = shards.read_tokens(shards.list_shards(d, "val")).astype(np.int64)
V = int(max(tr.max(), va.max())) + 1
c = np.bincount(tr, minlength=V).astype(np.float64) + 1
p = c / c.sum()
print(f"train {tr.size} val {va.size} tokens; unigram val cross-entropy {-np.log(p[va]).mean():.4f} nats")
