"""Data parallel training's collectives: N processes, each a whole replica (its own arena), summing gradients
every step.

How the processes start and join a job: run/launch.py. On GPUs each rank's whole optimizer step, NCCL
all-reduces included, is one CUDA graph (microgpt/engine/step.py): a rank replays it once per step.

One step on every rank:
  rank r reads rows [r*b, (r+1)*b) of the global micro-batch of N*b rows (data.Loader's shard), for each micro
  forward + backward as usual; during the last micro-batch's backward, each layer's grads are summed over ranks
  (one all-reduce per layer, started beside the attention backward of the layer below, overlapping the layers
  below: GradReduce and model.gpt_backward),
  then the embedding's -> scale by 1/(count*N), count the step's micro-batches (gscale) -> grad norm, clip, AdamW.
The summed grads are bit-identical on every rank (NCCL's and gloo's ring and tree all-reduces reduce each
element in one place, then copy it; the replica check below catches one that would not), so norm, clip and
AdamW do the same arithmetic everywhere and the weights stay bit-identical with no further traffic. N processes
with micro-batch b therefore train the model that one process with micro-batch N*b trains, up to the summation
order of the gradients (fp32 rounding).
With data.loss_mask, each rank's micro-batch loss is the mean over ITS valid tokens, and ranks weigh equally
(torch DDP does the same); without masking every rank has the same token count and the runs coincide.

Why all-reduce and not ZeRO-1 (reduce-scatter, AdamW on a 1/N shard, all-gather of the weights):
- sizes: ANDREA-120M's fp32 weights, grads, m and v are ~2 GB; ZeRO-1 would save ~1.5 GB per GPU on a
  141 GB H200 (and on an 8 GB card of the reproduction target it is activations that bind, not m and v);
- the bytes on the wire are the same (an all-reduce IS a reduce-scatter plus an all-gather);
- simplicity: grad norm, clipping and AdamW stay one call each over the flat arrays, unchanged; ZeRO-1 needs a
  sharded norm (an extra all-reduce of partial sums) and a weight all-gather before the next forward;
- weights that are bit-identical by construction, so a checkpoint is any rank's state: rank 0 writes the seed
  format alone, same layout as one process, and a run resumes with any process count.
Buckets are layers (ANDREA-120M: 7.1M grads, 28 MB each), big enough for full-bandwidth all-reduces and early
enough that only the embedding's bucket (wte + wpe, the last to finish) waits at the end of backward. With gloo
the NumPy engine's backward overlaps the sums too: gloo runs them on its own threads.

Control traffic (host scalars) goes through a gloo group: the step's loss, the signal flags and, every
CHECK_EVERY steps and before each checkpoint, checksums of weights, m and v that must agree on every rank
(DivergenceError otherwise). Signals: the launcher forwards SIGTERM/SIGINT/SIGUSR1 to every rank; a rank only
notes a signal, and at the end of each step the ranks exchange what they noted, so all of them handle it after
the same step: rank 0 writes the checkpoint, SIGTERM then exits 0 everywhere.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from microgpt.config import ModelConfig
from microgpt.engine import params

CHECK_EVERY = 100  # steps between replica checks (plus the first step and every checkpoint)


class DivergenceError(RuntimeError):
    """The replicas' weights or optimizer state differ: the run is no longer one model; stop it."""


class DataParallel:
    """This process's place in the job and the collectives the engine calls (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, ctrl: Any):
        self.rank, self.world_size = rank, world_size
        self._ctrl = ctrl  # process group for host scalars: gloo (None = the default group, when it is gloo)
        self._signals = {"SIGTERM": 0, "SIGUSR1": 0}  # signals this rank has received, cumulative
        self._usr1_done = 0  # SIGUSR1 checkpoints taken; the same on every rank
        self._checked_step: int | None = None  # the last step whose replicas were checked (act, or a checkpoint)
        self._agreed = (False, 0)  # (SIGTERM seen by any rank, most SIGUSR1 seen by a rank), from agree()

    # --- gradients and scalars ------------------------------------------------------------------------------
    def all_reduce_async(self, g: Any) -> Any:
        """Start summing g (fp32, contiguous) over ranks, in place; returns the pending work (.wait() joins it).

        g is a CUDA tensor (NCCL: the sum runs on NCCL's stream, which waits for the work queued so far on the
        current stream, and .wait() makes the current stream wait for the sum; inside a CUDA graph capture the
        two become a fork and a join of the graph), or a CPU tensor or NumPy array (gloo: the sum runs on gloo's
        threads while this one goes on; .wait() blocks until it is done)."""
        import torch
        import torch.distributed as dist

        t = torch.from_numpy(g) if isinstance(g, np.ndarray) else g
        return _Pending(dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True), t)

    def all_reduce_max(self, x: Any) -> None:
        """x (fp32, contiguous) = its elementwise max over ranks, in place, on the stream's order (fp8's amaxes:
        every rank then keeps the same scale histories). A CUDA tensor (NCCL) or a NumPy array (gloo)."""
        import torch
        import torch.distributed as dist

        dist.all_reduce(torch.from_numpy(x) if isinstance(x, np.ndarray) else x, op=dist.ReduceOp.MAX)

    def gather(self, values: Sequence[float | int], dtype: str = "float64") -> np.ndarray:
        """(world_size, len(values)): every rank's values, on every rank (one small all-reduce on the host)."""
        import torch
        import torch.distributed as dist

        table = torch.zeros(self.world_size, len(values), dtype=getattr(torch, dtype))
        table[self.rank] = torch.tensor(values, dtype=table.dtype)
        dist.all_reduce(table, op=dist.ReduceOp.SUM, group=self._ctrl)
        return table.numpy()

    def sum_scalars(self, *values: float) -> list[float]:
        return [float(v) for v in self.gather(values).sum(axis=0)]

    # --- the step boundary -----------------------------------------------------------------------------------
    def agree(self, loss: float, received: Sequence[str]) -> float:
        """Right after each optimizer step: the step's loss averaged over ranks, with the signals this rank
        received since the last call ("SIGTERM", "SIGUSR1") counted into the agreement.

        One small all-reduce. A signal may reach the ranks on either side of a step boundary; counting signals
        per rank and taking the maximum over ranks acts on each one once, after the first step where any rank
        had seen it. `to_act` hands them out once the step's records are out.
        """
        for reason in received:
            self._signals[reason] += 1
        table = self.gather([loss, self._signals["SIGTERM"], self._signals["SIGUSR1"]])
        self._agreed = (table[:, 1].max() > 0, int(table[:, 2].max()))
        return float(table[:, 0].sum()) / self.world_size

    def to_act(self, step: int, replicas: Sequence[Any]) -> list[str]:
        """At the end of step `step`: check the replicas (weights, m, v) now and then, and return the agreed
        signals to act on now, the same list on every rank: SIGTERM (rank 0 checkpoints, every rank stops), then a
        SIGUSR1 not yet acted on (rank 0 checkpoints, the run goes on)."""
        due = self._checked_step is None or step % CHECK_EVERY == 0
        if due and self._checked_step != step:  # a checkpoint of this step checked them already
            self.check_replicas(step, replicas)
        term, usr1 = self._agreed
        out = ["SIGTERM"] if term else []
        if usr1 > self._usr1_done:
            self._usr1_done = usr1
            out.append("SIGUSR1")
        return out

    def check_replicas(self, step: int, arrays: Sequence[Any]) -> None:
        """Raise DivergenceError unless every rank holds the same bits in each of arrays (weights, m, v)."""
        self._checked_step = step
        table = self.gather([words_sum(a) for a in arrays], dtype="int64")
        bad = [r for r in range(self.world_size) if (table[r] != table[0]).any()]
        if bad:
            sums = {r: [int(x) for x in table[r]] for r in range(self.world_size)}
            raise DivergenceError(
                f"step {step}: rank(s) {bad} hold other weights/optimizer state than rank 0 "
                f"(checksums of weights, m, v by rank: {sums}); stopping the run"
            )

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self._ctrl)

    def rank0_first(self, fn: Any) -> None:
        """fn() on rank 0 while the others wait: e.g. build the data cache once, not N times at once."""
        if self.rank == 0:
            fn()
        self.barrier()

    def close(self) -> None:
        """Leave the job. On GPUs the caller first drops every CUDA graph that captured NCCL work (Step.release)."""
        import torch
        import torch.distributed as dist

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dist.destroy_process_group()


def words_sum(x: Any) -> int:
    """Sum of the array's 32-bit words as an int64: any changed bit changes it. Host or device, no host copy."""
    if isinstance(x, np.ndarray):
        return int(x.view(np.int32).sum(dtype=np.int64))
    import torch

    return int(x.view(torch.int32).sum(dtype=torch.int64).item())


class _Pending:
    """An all-reduce in flight and the tensor it works on (a NumPy array's tensor view must outlive the work)."""

    def __init__(self, work: Any, tensor: Any) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()


def grad_buckets(m: ModelConfig) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """Where backward finishes the flat gradients: ([(first, end) of layer l's grads for l in 0..L-1], the rest).

    In the canonical order (params.param_shapes) the grads are [wte, wpe | h0 | h1 | ... | h(L-1) | lnf] (modern:
    [wte, ve0 .., skip_w | h0 | ... | h(L-1) | lm_head]). The last micro-batch's backward finishes lnf (the head)
    first, then layer L-1, ..., layer 0, and the embedding (wte, also the tied head, wpe) last; so layer L-1's
    bucket runs to the end (lnf or lm_head with it), and the rest is the embedding, with the value embeddings, which
    layers at both ends of the model add into, and the skips' scalars (skip_w), whose gradients the first layers'
    backward finishes."""
    first = params.param_offsets(m)
    lead = params.family(m).block[0][0]  # each block's first parameter in the order
    starts = [first[f"h{layer}.{lead}"] for layer in range(m.n_layer)] + [params.n_params(m)]
    layers = [(starts[i], starts[i + 1]) for i in range(m.n_layer)]
    return layers, (0, starts[0])


class GradReduce:
    """The gradient all-reduce of one optimizer step, bucket by bucket: layer l's grads start their sum once the
    last micro-batch's backward has finished them (`layer_done`, called by model.gpt_backward beside the next
    attention backward), overlapping the backward of the layers below; `finish` starts the embedding's bucket
    and waits for every sum. The result is the same sum over ranks for every element as one all-reduce of the
    whole array (each element is still reduced in one place)."""

    def __init__(self, dp: DataParallel, m: ModelConfig, g: Any) -> None:
        layers, self.rest = grad_buckets(m)
        self.dp, self.g, self.layers = dp, g, layers
        self.pending: list[_Pending] = []

    def layer_done(self, layer: int) -> None:
        first, end = self.layers[layer]
        self.pending.append(self.dp.all_reduce_async(self.g[first:end]))

    def finish(self) -> None:
        first, end = self.rest
        self.pending.append(self.dp.all_reduce_async(self.g[first:end]))
        for p in self.pending:
            p.wait()
        self.pending.clear()
