"""The PyTorch twin of the modern recipe (issue 46; benchmark only, never the engine): the modern block as an
nn.Module, Muon on the block matrices and AdamW on the embedding and the head, trained by torch.compile. Side (c) of
bench/ttl.py; written from the recipe, as bench/torch_gpt.py is for GPT-2.

    x0 = rmsnorm(wte[tokens])                                    no position table
    per layer: x = x + skip_w[j] * kept_j  where the layer is L-1-j for skip j (model.skips: kept_j, x after layer j)
               q, k, v = rmsnorm(x) @ w_q, w_k, w_v;  q, k = rope(rmsnorm_head(q)), rope(rmsnorm_head(k))
               v = v + ve_j[tokens]  where the layer has a value embedding (model.value_embeds)
               x = x + causal_attention(q, k, v) @ w_o;  x = x + relu(rmsnorm(x) @ w_1)^2 @ w_2
               (with model.attn_window, train.attn_window_start or model.doc_mask: SDPA under an explicit mask,
               query i seeing key j iff j <= i, i - j < the step's window and j >= its document's start)
    loss = cross_entropy(softcap * tanh(rmsnorm(x) @ lm_head.T / softcap), targets)

RMSNorm has no weight (eps 1e-6; QK-norm over each head's D); RoPE is the rotate-half convention over each head's two
halves at base model.rope_base; attention scales by 1/sqrt(D); no biases; w_o, w_2 and lm_head start at zero. The block
matrices are stored stacked, as torch's [out, in] (qkvo (L, 4, C, C), fc (L, 4C, C), proj (L, C, 4C)), so each
same-shaped group is one Muon batch and its gradient comes stacked; `slot` maps microgpt's names onto them.

Muon (docs/ANDREA.md section 9): G' = the clipped mean gradient; M += (1 - mu)(G' - M); U = G' + mu (M - G');
X = U / (|U|_F + 1e-7) in bf16 (a tall matrix as its transpose); train.muon_ns_steps (5) Newton-Schulz steps
A = X X^T, B = b A + c A A, X = a X + B X; then W = W (1 - lr wd) - lr sqrt(max(1, fan_out / fan_in)) X. AdamW
(torch's, fused) keeps wte (and the value embeddings, stacked as ve (k, V, C)) at train.lr and lm_head at train.head_lr
(0: train.lr), both decayed by train.weight_decay (microgpt decays matrices and embeddings), and the skips' scalars
skip_w at train.head_lr, not decayed (microgpt decays no vector). The global grad norm is clipped at train.grad_clip
before both optimizers, as microgpt's step does.

Data, initial weights, schedule and timing are microgpt's: the batches of (step, micro) and the validation windows
come from microgpt.data.make_loaders of the same experiment (a batch warmup's fewer micro-batches in its first steps,
data.MicroSchedule, each step's loss the mean over the micro-batches it read), the weights from engine/params.py's
init, every group's lr and Muon's momentum from engine/optim.py (lr_at, group_lrs, muon_momentum) over the run's steps
from its first, and a step's time (dt_ms) is the host clock from before its batches are read to after its loss is
read back, as run/trainer.py counts it. Records are microgpt's JSON lines (start, step, eval, done) on stdout. On
CUDA: bf16 autocast and torch.compile; on the CPU (the smoke test): fp32, eager.

    python3 bench/torch_modern.py experiments/ANDREA-120M-MODERN-TRAIN.json --set data.path=data/ttl-120m \\
        --budget-s 200 --eval-s 10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.ttl_results import plan, scaled_warmup  # noqa: E402
from microgpt import config, data  # noqa: E402
from microgpt.config import Experiment, ModelConfig, TrainConfig  # noqa: E402
from microgpt.engine import params  # noqa: E402
from microgpt.engine.memory import window_planned  # noqa: E402
from microgpt.engine.optim import attn_window_at, group_lrs, lr_at, muon_momentum  # noqa: E402
from microgpt.errors import exit_on_input_error  # noqa: E402

EPS = 1e-6  # RMSNorm's
NS_COEFFS = (3.4445, -4.7750, 2.0315)  # Newton-Schulz's quintic (a, b, c)
NORM_EPS = 1e-7


def initial_weights(m: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """name -> fp32 array: microgpt's initial weights of the modern block from the run's seed (engine/params.py), in
    its canonical order and [in, out] layout."""
    return {k: np.array(v) for k, v in params.named(params.init_weights(m, seed), m).items()}


# --- the model -----------------------------------------------------------------------------------------------------
def rmsnorm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.size(-1),), eps=EPS)


def rope_tables(T: int, D: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D/2) of the angles p * base^(-2i/D), in float64 (rope casts them to its input's dtype)."""
    inv = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    return angles.cos(), angles.sin()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, T, H, D) rotated by halves: y1 = x1 cos - x2 sin, y2 = x2 cos + x1 sin; cos, sin (T, D/2)."""
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def attention_mask(m: ModelConfig, idx: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """(B, 1, T, T) bool, True where query i attends key j: j <= i, i - j < window (None: no window) and j at or
    after the last <|endoftext|> (model.doc_mask) at or before i; None where neither narrows the causal mask (SDPA's
    causal kernel then)."""
    if window is None and m.doc_mask < 0:
        return None
    T = idx.shape[1]
    pos = torch.arange(T, device=idx.device)
    i, j = pos[:, None], pos[None, :]
    mask = (j <= i)[None]
    if window is not None:
        mask = mask & (i - j < window)[None]
    if m.doc_mask >= 0:
        start = torch.where(idx == m.doc_mask, pos, 0).cummax(dim=1).values  # each position's document start
        mask = mask & (j[None] >= start[:, :, None])
    return mask[:, None]


class Modern(nn.Module):
    def __init__(self, m: ModelConfig) -> None:
        super().__init__()
        V, C, L = m.vocab_size, m.d_model, m.n_layer
        self.n_head, self.head_dim, self.softcap = m.n_head, m.head_dim, float(m.softcap)
        self.wte = nn.Parameter(torch.empty(V, C))
        self.qkvo = nn.Parameter(torch.empty(L, 4, C, C))  # w_q^T, w_k^T, w_v^T, w_o^T per layer
        self.fc = nn.Parameter(torch.empty(L, 4 * C, C))  # w_1^T
        self.proj = nn.Parameter(torch.empty(L, C, 4 * C))  # w_2^T
        self.lm_head = nn.Parameter(torch.empty(V, C))
        self.ve = nn.Parameter(torch.empty(m.value_embeds, V, C))  # value embeddings; (0, V, C) without
        self.ve_of = [params.value_embed(m, layer) for layer in range(L)]  # layer -> "ve{j}" or None
        self.skip_w = nn.Parameter(torch.empty(m.skips))  # the skips' scalars; (0,) without
        self.skip_of = [params.skip_into(m, layer) for layer in range(L)]  # layer -> the skip j it receives, or None
        cos, sin = rope_tables(m.seq_len, self.head_dim, float(m.rope_base))
        self.register_buffer("cos", cos, persistent=False)  # float64; rope rounds them to its input's dtype
        self.register_buffer("sin", sin, persistent=False)

    def slot(self, name: str) -> torch.Tensor:
        """The tensor holding microgpt's parameter `name` (a block matrix transposed: [out, in] here, [in, out] there):
        the one place the two layouts meet."""
        block, _, leaf = name.rpartition(".")
        if not block:
            if leaf.startswith("ve"):
                return self.ve[int(leaf[2:])]
            return {"wte": self.wte, "lm_head": self.lm_head, "skip_w": self.skip_w}[leaf]
        i = int(block[1:])
        return {
            "w_q": self.qkvo[i, 0],
            "w_k": self.qkvo[i, 1],
            "w_v": self.qkvo[i, 2],
            "w_o": self.qkvo[i, 3],
            "w_1": self.fc[i],
            "w_2": self.proj[i],
        }[leaf]

    @torch.no_grad()
    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        for name, w in weights.items():
            src = torch.from_numpy(w)
            self.slot(name).copy_(src.t() if "." in name else src)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss; mask: attention_mask's (None: causal)."""
        B, T = idx.shape
        H, D = self.n_head, self.head_dim
        C = H * D
        cos, sin = self.cos[:T], self.sin[:T]
        x = rmsnorm(F.embedding(idx, self.wte))
        kept = []
        for i in range(self.qkvo.shape[0]):
            if (j := self.skip_of[i]) is not None:
                x = x + self.skip_w[j] * kept[j]
            q, k, v = F.linear(rmsnorm(x), self.qkvo[i, :3].reshape(3 * C, C)).view(B, T, 3, H, D).unbind(2)
            if self.ve_of[i] is not None:
                v = v + F.embedding(idx, self.slot(self.ve_of[i])).view(B, T, H, D)
            q, k = rope(rmsnorm(q), cos, sin), rope(rmsnorm(k), cos, sin)
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
            if mask is None:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + F.linear(y.transpose(1, 2).reshape(B, T, C), self.qkvo[i, 3])
            x = x + F.linear(F.relu(F.linear(rmsnorm(x), self.fc[i])).square(), self.proj[i])
            if i < self.skip_w.numel():
                kept.append(x)
        logits = F.linear(rmsnorm(x), self.lm_head)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 logits: the loss in fp32
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


# --- the optimizers ------------------------------------------------------------------------------------------------
def muon_update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    hyper: torch.Tensor,
    scale: float,
    tall: bool,
    dtype: torch.dtype,
    ns_steps: int,
) -> None:
    """One Muon step on a stack p, g, m (k, rows, cols) in torch's [out, in] layout; hyper = (lr, mu, wd) on p's device
    (a tensor, so a compiled update is not recompiled when they change); ns_steps Newton-Schulz steps (fixed for a
    run: train.muon_ns_steps)."""
    lr, mu, wd = hyper[0], hyper[1], hyper[2]
    m.lerp_(g, 1 - mu)
    x = g.lerp(m, mu)
    x = x.to(dtype).mT if tall else x.to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + NORM_EPS)
    a, b, c = NS_COEFFS
    for _ in range(ns_steps):
        A = x @ x.mT
        x = a * x + (b * A + c * (A @ A)) @ x
    x = x.mT if tall else x
    p.mul_(1 - lr * wd).sub_(lr * scale * x.to(p.dtype))


class Muon:
    """Section 9's Muon over the model's stacked block matrices: one batched update per stored shape. The
    orthogonalisation runs in `dtype` (bf16 on the GPU, as microgpt's; the CPU smoke test and the tests use fp32), over
    ns_steps Newton-Schulz steps (train.muon_ns_steps)."""

    def __init__(
        self,
        model: Modern,
        compiled: bool,
        dtype: torch.dtype = torch.bfloat16,
        ns_steps: int = TrainConfig.muon_ns_steps,
    ) -> None:
        L, C = model.qkvo.shape[0], model.qkvo.shape[-1]
        # each parameter as a stack of (rows, cols) matrices, torch's [out, in]: rows = fan_out, cols = fan_in
        self.groups = [(model.qkvo, (4 * L, C, C)), (model.fc, (L, 4 * C, C)), (model.proj, (L, C, 4 * C))]
        self.momentum = [torch.zeros_like(p) for p, _ in self.groups]
        self.hyper = torch.zeros(3, dtype=model.qkvo.dtype, device=model.qkvo.device)  # lr, mu, wd
        self.dtype, self.ns_steps = dtype, ns_steps
        self.update = torch.compile(muon_update, dynamic=False) if compiled else muon_update

    @torch.no_grad()
    def step(self, lr: float, mu: float, wd: float) -> None:
        self.hyper.copy_(torch.tensor([lr, mu, wd], dtype=torch.float64))
        for (p, shape), m in zip(self.groups, self.momentum):
            _, rows, cols = shape
            scale = math.sqrt(max(1.0, rows / cols))  # sqrt(max(1, fan_out / fan_in))
            self.update(
                p.view(shape),
                p.grad.view(shape),
                m.view(shape),
                self.hyper,
                scale,
                rows > cols,
                self.dtype,
                self.ns_steps,
            )


def make_adamw(model: Modern, t: TrainConfig) -> torch.optim.AdamW:
    """AdamW on wte (with the value embeddings), lm_head and the skips' scalars (undecayed), each group named as
    engine/optim.py's group_lrs names its lr."""
    embeddings = [model.wte, model.ve] if model.ve.numel() else [model.wte]
    groups = [{"params": embeddings, "name": "adamw"}, {"params": [model.lm_head], "name": "head"}]
    if model.skip_w.numel():
        groups.append({"params": [model.skip_w], "name": "head", "weight_decay": 0.0})
    return torch.optim.AdamW(
        groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, weight_decay=t.weight_decay, fused=model.wte.is_cuda
    )


def schedule(t: TrainConfig, steps: int) -> TrainConfig:
    """t with its lr schedule over `steps` steps from the twin's first (engine/optim.py's lr_at reads train.steps; a
    phase's schedule_start or a schedule_steps of the experiment do not apply to a fresh run of the twin)."""
    return dataclasses.replace(t, steps=steps, schedule_start=0, schedule_steps=0)


# --- the run -------------------------------------------------------------------------------------------------------
class Run:
    """The twin's training run over microgpt's data: step() and evaluate() timed and recorded as run/trainer.py does."""

    def __init__(self, exp: Experiment, device: str, compiled: bool) -> None:
        self.exp, self.m, self.t, self.device = exp, exp.model, exp.train, device
        self.model = Modern(self.m).to(device)
        self.weights = initial_weights(self.m, self.t.seed)
        # evaluation runs this same module with autograd on and no backward: one compiled graph, not a second one
        self.fwd = torch.compile(self.model) if compiled else self.model
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.muon = Muon(self.model, compiled, dtype, self.t.muon_ns_steps)
        self.train_data, val = data.make_loaders(exp, self.t.micro_batch)
        self.micro = data.MicroSchedule.of(self.t)
        (self.val,) = val.sources.values()
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")
        self.reset()

    def reset(self) -> None:
        """The initial weights and fresh optimizer state (after calibration's steps)."""
        self.model.load_weights(self.weights)
        self.model.zero_grad(set_to_none=True)
        self.adamw = make_adamw(self.model, self.t)
        for m in self.muon.momentum:
            m.zero_()

    def tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64)).to(self.device)

    def mask(self, idx: torch.Tensor, step: int) -> torch.Tensor | None:
        """Attention's mask at 0-based step `step` (microgpt's window schedule, optim.attn_window_at)."""
        window = attn_window_at(step, self.m, self.t) if window_planned(self.m, self.t) else None
        return attention_mask(self.m, idx, window)

    def step(self, s: int, t: TrainConfig) -> dict[str, Any]:
        """Optimizer step s (0-based) on t's schedule (`schedule`); its record (dt_ms: batches read to loss back)."""
        t0 = time.perf_counter()
        batches = [self.train_data.batch(s, micro) for micro in range(self.micro.count(s))]
        lr = lr_at(s, t)
        lrs = group_lrs(lr, t)
        for group in self.adamw.param_groups:
            group["lr"] = lrs[group["name"]]
        total = torch.zeros((), device=self.device)
        for x, y in batches:
            idx = self.tensor(x)
            with self.autocast:
                loss = self.fwd(idx, self.tensor(y), self.mask(idx, s)) / len(batches)
            loss.backward()
            total += loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        self.adamw.step()
        self.muon.step(lrs["muon"], muon_momentum(s, t), t.muon_weight_decay)
        self.model.zero_grad(set_to_none=True)
        loss, norm = total.item(), norm.item()
        dt = time.perf_counter() - t0
        tokens = len(batches) * t.micro_batch * self.m.seq_len
        return {
            "event": "step",
            "step": s + 1,
            "loss": loss,
            "lr": lr,
            "grad_norm": norm,
            "tokens_per_s": tokens / dt,
            "dt_ms": 1000 * dt,
            "tokens": tokens,
        }

    def evaluate(self, step: int) -> float:
        """The mean loss over the target tokens of val windows 0 .. eval_batches x micro_batch - 1 (microgpt's), after
        `step` steps (attention under the last one's window, as microgpt's evaluation)."""
        total, count = 0.0, 0
        for i in range(self.t.eval_batches):
            x, y = self.val.val_batch(i)
            idx = self.tensor(x)
            with self.autocast:
                loss = self.fwd(idx, self.tensor(y), self.mask(idx, max(0, step - 1)))
            n = int((y != -1).sum())
            total, count = total + loss.item() * n, count + n
        return total / max(1, count)

    def calibrate(self, warm: int, calib: int) -> float:
        """The median seconds of a whole step (n_micro micro-batches: the steps after a batch warmup's, their data
        read from there) over calib of them after `warm` (which compile), then reset()."""
        t, first = schedule(self.t, 1 << 30), self.micro.warmup_steps
        times = [self.step(first + s, t)["dt_ms"] / 1000 for s in range(warm + calib)]
        self.reset()
        return statistics.median(times[warm:])

    def train(self, steps: int, eval_every: int) -> int:
        """Steps 0 .. steps-1, an evaluation after every eval_every-th and the last; 3 on a non-finite loss."""
        t = schedule(self.t, steps)
        for s in range(steps):
            rec = emit(self.step(s, t))
            if not math.isfinite(rec["loss"]):
                print(f"error: loss is {rec['loss']} at step {s + 1}; stopping", file=sys.stderr)
                return 3
            if (s + 1) % eval_every == 0 or s + 1 == steps:
                val = emit({"event": "eval", "step": s + 1, "val_loss": self.evaluate(s + 1)})["val_loss"]
                print(
                    f"step {s + 1}/{steps} | loss {rec['loss']:.4f} | val_loss {val:.4f} | "
                    f"{rec['tokens_per_s']:,.0f} tok/s",
                    file=sys.stderr,
                    flush=True,
                )
        return 0


def emit(rec: dict[str, Any]) -> dict[str, Any]:
    """A record as one JSON line on stdout, stamped like microgpt's (runlog.py)."""
    rec = {**rec, "time": round(time.time(), 3)}
    print(json.dumps(rec, separators=(",", ":")), flush=True)
    return rec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench/torch_modern.py", description=__doc__.split("\n")[0])
    p.add_argument("experiment", help="an experiment of model.block 'modern' (its data, model and recipe)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    p.add_argument("--steps", type=int, help="optimizer steps (default: train.steps, or --budget-s's)")
    p.add_argument("--budget-s", type=float, help="train for about this many seconds: steps from calibration")
    p.add_argument("--eval-every", type=int, help="steps between evaluations (default: train.eval_every)")
    p.add_argument("--eval-s", type=float, default=10.0, help="with --budget-s: seconds between evaluations")
    p.add_argument("--warm", type=int, default=5, help="with --budget-s: steps not timed in calibration")
    p.add_argument("--calib", type=int, default=10, help="with --budget-s: steps timed in calibration")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when there is one")
    p.add_argument("--no-compile", action="store_true", help="eager on CUDA too (the CPU is always eager)")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    exp = config.load(args.experiment, args.set)
    if exp.model.block != "modern":
        raise config.ConfigError(f"{args.experiment}: model.block is {exp.model.block!r}; the twin trains 'modern'")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    run = Run(exp, device, compiled=device == "cuda" and not args.no_compile)
    n_params = sum(p.numel() for p in run.model.parameters())
    compiled = run.fwd is not run.model
    emit(
        {
            "event": "start",
            "run": exp.name,
            "impl": "torch",
            "device": device,
            "torch": torch.__version__,
            "compiled": compiled,
            "n_params": n_params,
            "config": exp.to_dict(),
        }
    )
    steps, eval_every = args.steps or exp.train.steps, args.eval_every or exp.train.eval_every
    if args.budget_s:
        step_s = run.calibrate(args.warm, args.calib)
        steps, eval_every = plan(args.budget_s, step_s, args.eval_s, args.warm, run.micro)
        run.t.warmup_steps = scaled_warmup(run.t, steps)  # the schedule compressed into the budget, as ttl does
        emit(
            {
                "event": "calibrated",
                "step_s": step_s,
                "steps": steps,
                "eval_every": eval_every,
                "warm": args.warm,
                "calib": args.calib,
            }
        )
    rc = run.train(steps, eval_every)
    emit({"event": "done" if rc == 0 else "failed", "step": steps})
    return rc


if __name__ == "__main__":
    sys.exit(exit_on_input_error(main, sys.argv[1:]))
