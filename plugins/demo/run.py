"""The newcomer demo: train one small model twice, in PyTorch and with :class:`ortcore.ORTModule`, and compare.

Both runs start from the same weights, see the same batches and use the same AdamW settings, so their loss curves
should agree to float32 rounding. Nothing here prints; ``ortcore demo`` (:mod:`.commands`) formats the result.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

#: Loss curves that differ by more than this (relative) fail the demo.
DEFAULT_TOLERANCE = 1e-4


class TinyBlock(torch.nn.Module):
    """A small transformer-style encoder: embeddings, one self-attention + GELU-MLP block, a token head.

    It uses the ops real models lean on (embedding, LayerNorm, matmul attention, softmax, GELU) while staying
    small enough that both training runs finish in a few seconds on a laptop CPU.
    """

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, max_len: int = 32):
        super().__init__()
        self.heads = heads
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(max_len, dim)
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(batch, seq)`` to logits ``(batch, seq, vocab)``."""
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device)
        x = self.tok(ids) + self.pos(positions)
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        # (b, t, dim) -> (b, heads, t, dim / heads); written out rather than nn.MultiheadAttention so the demo
        # shows ordinary tensor code going through the exporter.
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.head(self.ln_f(x))


@dataclass
class DemoConfig:
    """Sizes and optimizer settings of the demo run."""

    steps: int = 20
    batch: int = 16
    seq: int = 32
    vocab: int = 64
    dim: int = 64
    heads: int = 4
    lr: float = 3e-3
    seed: int = 0
    tolerance: float = DEFAULT_TOLERANCE


@dataclass
class RunCurve:
    """One training run: the loss and the wall time of every step (forward + backward + optimizer step)."""

    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)

    @property
    def first_step_s(self) -> float:
        return self.step_times_s[0]

    @property
    def steady_step_s(self) -> float | None:
        """Median of the steps after the first (the first includes export and build for ortcore)."""
        rest = self.step_times_s[1:]
        return statistics.median(rest) if rest else None


@dataclass
class DemoResult:
    """Both runs, their agreement and what ortcore did while running."""

    config: DemoConfig
    n_params: int
    torch_run: RunCurve
    ortcore_run: RunCurve
    counters: dict[str, int]
    fallback_reason: str | None
    #: What kernel measurement (``torch_kernels = "auto"``) cost the ortcore run: its looks at waiting cases
    #: (``step``, ``measured``, ``seconds``, ``why``; ``step`` counted from 0) and the process's summary text.
    measurement: list[Any] = field(default_factory=list)
    measurement_summary: str = ""

    @property
    def rel_diffs(self) -> list[float]:
        return [relative_difference(a, b) for a, b in zip(self.torch_run.losses, self.ortcore_run.losses)]

    @property
    def max_rel_diff(self) -> float:
        return max(self.rel_diffs, default=0.0)

    @property
    def ran_in_ort(self) -> bool:
        """False if ortcore fell back to PyTorch: then the comparison proves nothing."""
        return self.fallback_reason is None and self.counters.get("fallbacks", 0) == 0

    @property
    def passed(self) -> bool:
        return self.ran_in_ort and self.max_rel_diff <= self.config.tolerance


def relative_difference(a: float, b: float) -> float:
    """``|a - b| / max(|a|, |b|)``, 0 when both are 0; inf or nan losses count as an infinite difference."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


def make_batches(cfg: DemoConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Seeded batches for a learnable toy task: predict ``(3 * token + 1) % vocab`` at every position."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batches = []
    for _ in range(cfg.steps):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        batches.append((ids, (3 * ids + 1) % cfg.vocab))
    return batches


def _train(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    cfg: DemoConfig,
    on_step: Callable[[int, float, float], None] | None,
) -> RunCurve:
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    curve = RunCurve()
    for i, (ids, target) in enumerate(batches):
        start = time.perf_counter()
        logits = model(ids)
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), target.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        curve.step_times_s.append(time.perf_counter() - start)
        curve.losses.append(loss.item())
        if on_step is not None:
            on_step(i, curve.losses[-1], curve.step_times_s[-1])
    return curve


def run_demo(
    cfg: DemoConfig | None = None,
    on_step: Callable[[str, int, float, float], None] | None = None,
) -> DemoResult:
    """Train :class:`TinyBlock` with AdamW in plain PyTorch, then with ``ORTModule``, from identical weights.

    Args:
        cfg: sizes, steps and seed (defaults: 20 steps of batch 16 × seq 32).
        on_step: called as ``on_step(run, step, loss, seconds)`` after every step, ``run`` being ``"torch"`` or
            ``"ortcore"``, so a caller can show progress.
    """
    from ortcore.api import ORTModule

    cfg = cfg or DemoConfig()
    if cfg.steps < 1:
        raise ValueError(f"steps must be at least 1, got {cfg.steps}")
    torch.manual_seed(cfg.seed)
    reference = TinyBlock(cfg.vocab, cfg.dim, cfg.heads, cfg.seq)
    batches = make_batches(cfg)

    def report(run: str) -> Callable[[int, float, float], None] | None:
        return None if on_step is None else (lambda i, loss, s: on_step(run, i, loss, s))

    # Deep copies, so both runs start from the very same tensors and neither sees the other's updates.
    torch_curve = _train(copy.deepcopy(reference), batches, cfg, report("torch"))
    wrapped = ORTModule(copy.deepcopy(reference))
    record = _measurement_record()
    seen = len(record.events) if record is not None else 0
    ort_curve = _train(wrapped, batches, cfg, report("ortcore"))
    counters = wrapped.state_machine.counters
    return DemoResult(
        config=cfg,
        n_params=sum(p.numel() for p in reference.parameters()),
        torch_run=torch_curve,
        ortcore_run=ort_curve,
        counters={k: getattr(counters, k) for k in ("exports", "builds", "reuses", "fallbacks")},
        fallback_reason=wrapped.fallback_reason,
        measurement=list(record.events[seen:]) if record is not None else [],
        measurement_summary=_measurement_summary(),
    )


def _measurement_record() -> Any:
    """The kernel-choice plugin's record of what measuring cost this process, or None without that plugin."""
    from ortcore_plugins.services import kernel_measurement

    return kernel_measurement.record()


def _measurement_summary() -> str:
    from ortcore_plugins.services import kernel_measurement

    return kernel_measurement.summary()
