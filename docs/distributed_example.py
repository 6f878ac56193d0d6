"""Data-parallel training of an ORTModule with torchrun: DistributedDataParallel, FusedAdam, load-balanced batches.

    torchrun --standalone --nproc_per_node 2 docs/distributed_example.py --out /tmp/ddp_run [--steps 14] [--seed 0]
    torchrun --standalone --nproc_per_node 2 docs/distributed_example.py --out /tmp/ddp_run2 --steps 20 \
        --resume /tmp/ddp_run/checkpoint.pt

A small text classifier (embedding, two self-attention blocks, mean pooling over the real tokens) learns to tell
whether a sequence holds more low than high token ids. Sequences are 4 to 64 tokens long. The load-balancing sampler
deals every rank samples of the same lengths, sorted by length within groups of ``--group-size`` samples of the
epoch's random order; each rank cuts its share into batches of at most ``--max-tokens`` tokens (padding included).
So a batch holds many short or few long sequences, little padding, and every rank does about the same work per step
(docs/distributed.md has the numbers and how to run this on several machines).

Each rank writes ``<out>/rank<r>.pt``: the dataset indices of each of its batches, its losses, its final parameters
and its logits on the first ``PROBE_SAMPLES`` samples. Rank 0 also writes ``<out>/checkpoint.pt``, atomically:
``model`` (the state_dict a plain :class:`TextClassifier` loads), ``optimizer``, ``config``, and where training
stopped (``step``, ``epoch``, ``batches_done``), from which ``--resume`` continues.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ortcore import ORTModule
from ortcore.files import atomic_writer
from ortcore.optim import AdamWMode, FusedAdam
from ortcore.utils.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

MODEL_CONFIG = {"vocab": 64, "dim": 32, "heads": 2, "layers": 2, "max_len": 64, "classes": 2}
PROBE_SAMPLES = 16  # the trained model's logits on the first samples are saved, for comparing a restored model
OPTIMIZER_CONFIG = {"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-6, "weight_decay": 0.01}


class Block(torch.nn.Module):
    """Pre-norm self-attention and MLP; ``bias`` is 0 for real tokens and -1e9 for padding (keys only)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5 + bias[:, None, None, :]
        attended = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(attended)
        return x + self.mlp(self.norm2(x))


class TextClassifier(torch.nn.Module):
    """Token and position embeddings, ``layers`` blocks, mean over the real tokens, a linear head.

    ``forward(ids, mask)`` takes right-padded ``ids`` [batch, length] and ``mask`` [batch, length] (1.0 for real
    tokens, 0.0 for padding) and returns logits [batch, classes]; a sequence's logits do not depend on how much
    padding its batch has.
    """

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int, classes: int):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(vocab, dim), torch.nn.Embedding(max_len, dim)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(dim), torch.nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(positions)[None]
        bias = (1.0 - mask) * -1e9
        for block in self.blocks:
            x = block(x, bias)
        pooled = (self.norm(x) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return self.head(pooled)


def build_model(seed: int) -> TextClassifier:
    """The model every rank (and a single-process reference) starts from."""
    torch.manual_seed(seed)
    return TextClassifier(**MODEL_CONFIG)


class SequenceDataset(torch.utils.data.Dataset):
    """``size`` sequences of 4..``max_len`` token ids; the label is 1 when most ids are below ``vocab // 2``."""

    def __init__(
        self, size: int, seed: int, vocab: int = MODEL_CONFIG["vocab"], max_len: int = MODEL_CONFIG["max_len"]
    ):
        gen = torch.Generator().manual_seed(seed)
        lengths = torch.randint(4, max_len + 1, (size,), generator=gen).tolist()
        self.sequences = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
        self.labels = [int((s < vocab // 2).sum() * 2 > len(s)) for s in self.sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.sequences[index], self.labels[index]


def sequence_length(sample: tuple[torch.Tensor, int]) -> int:
    """The sampler's complexity of a sample: its number of tokens."""
    return len(sample[0])


def token_budget_batches(dataset: SequenceDataset, max_tokens: int) -> Callable[[Sequence[int]], list[list[int]]]:
    """A ``batch_fn``: consecutive indices (sorted by length within the sampler's groups) grouped so that
    ``batch size * longest sequence`` stays within ``max_tokens``."""

    def batch_fn(indices: Sequence[int]) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for index in indices:
            n = len(dataset.sequences[index])
            if current and max(longest, n) * (len(current) + 1) > max_tokens:
                batches.append(current)
                current, longest = [], 0
            current.append(index)
            longest = max(longest, n)
        if current:
            batches.append(current)
        return batches

    return batch_fn


def collate(samples: Sequence[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    """Right-pad a batch: ``ids`` [batch, longest], ``mask`` (1.0 real, 0.0 padding), ``labels`` [batch]."""
    longest = max(len(ids) for ids, _ in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest)
    for row, (sequence, _) in enumerate(samples):
        ids[row, : len(sequence)] = sequence
        mask[row, : len(sequence)] = 1.0
    return {"ids": ids, "mask": mask, "labels": torch.tensor([label for _, label in samples])}


def make_batch_sampler(
    dataset: SequenceDataset, world_size: int, rank: int, seed: int, max_tokens: int, group_size: int | None
) -> LoadBalancingDistributedBatchSampler:
    """The batch sampler of ``rank``: rank ``r`` of ``world_size`` gets the same batches in any process."""
    sampler = LoadBalancingDistributedSampler(
        dataset,
        complexity_fn=sequence_length,
        world_size=world_size,
        rank=rank,
        shuffle=True,
        group_size=group_size,
        seed=seed,
    )
    return LoadBalancingDistributedBatchSampler(sampler, batch_fn=token_budget_batches(dataset, max_tokens))


def make_optimizer(parameters) -> FusedAdam:
    """FusedAdam with torch's AdamW formula (``torch.optim.AdamW`` with the same arguments computes the same)."""
    return FusedAdam(parameters, adam_w_mode=AdamWMode.ADAMW_TORCH, **OPTIMIZER_CONFIG)


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    rank, world_size = dist.get_rank(), dist.get_world_size()
    os.makedirs(args.out, exist_ok=True)

    dataset = SequenceDataset(args.samples, seed=args.seed)
    batch_sampler = make_batch_sampler(dataset, world_size, rank, args.seed, args.max_tokens, args.group_size)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=collate)

    plain = build_model(args.seed)
    # Every rank loads the checkpoint: DDP would broadcast rank 0's parameters, but not the optimizer's state.
    checkpoint = torch.load(args.resume) if args.resume else None
    if checkpoint is not None:
        plain.load_state_dict(checkpoint["model"])
    model = ORTModule(plain)  # every rank exports its own graph (or loads it from the export cache)
    ddp = DistributedDataParallel(model)  # broadcasts rank 0's parameters, then averages gradients every step
    optimizer = make_optimizer(ddp.parameters())
    step, epoch, done = 0, 0, 0  # done: batches of this epoch already trained on
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        step, epoch, done = checkpoint["step"], checkpoint["epoch"], checkpoint["batches_done"]

    batches: list[list[int]] = []
    losses: list[float] = []
    started = time.perf_counter()
    while step < args.steps:
        batch_sampler.set_epoch(epoch)
        # The loader iterates the same batch sampler: zip pairs each batch with its dataset indices.
        for position, (indices, batch) in enumerate(zip(batch_sampler, loader)):
            if position < done:
                continue
            loss = torch.nn.functional.cross_entropy(ddp(batch["ids"], batch["mask"]), batch["labels"])
            loss.backward()  # DDP all-reduces the gradients: each parameter gets the mean over the ranks
            optimizer.step()
            optimizer.zero_grad()
            batches.append(list(indices))
            losses.append(loss.item())
            step, done = step + 1, position + 1
            if rank == 0:
                print(
                    f"step {step:3d}  epoch {epoch}  loss {loss.item():.5f}  batch {tuple(batch['ids'].shape)}  "
                    f"{time.perf_counter() - started:.2f}s",
                    flush=True,
                )
            if step == args.steps:
                break
        else:
            epoch, done = epoch + 1, 0

    state = {name: value.detach().clone() for name, value in model.state_dict().items()}
    counters = attrs.asdict(model.state_machine.counters)  # exports, session builds and reuses while training
    model.eval()  # ORT runs an inference graph (exported at this first call in eval mode)
    with torch.no_grad():
        probe = collate([dataset[i] for i in range(PROBE_SAMPLES)])
        logits = model(probe["ids"], probe["mask"])
    with atomic_writer(os.path.join(args.out, f"rank{rank}.pt"), "wb") as f:
        torch.save(
            {
                "batches": batches,
                "losses": losses,
                "logits": logits,
                "state": state,
                "world_size": world_size,
                "counters": counters,
                "fallback_reason": model.fallback_reason,
                "seconds": time.perf_counter() - started,
            },
            f,
        )
    if rank == 0:
        # ddp.module is the ORTModule; its state_dict has the plain model's keys.
        checkpoint = {
            "model": ddp.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "config": MODEL_CONFIG,
            "step": step,
            "epoch": epoch,
            "batches_done": done,
        }
        with atomic_writer(os.path.join(args.out, "checkpoint.pt"), "wb") as f:
            torch.save(checkpoint, f)
        print(f"saved {os.path.join(args.out, 'checkpoint.pt')}", flush=True)
    # Every rank finishes its last collective before any tears the process group down (gloo aborts otherwise).
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for rank<r>.pt and checkpoint.pt")
    parser.add_argument("--steps", type=int, default=14, help="train until this many optimizer steps (across epochs)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the data and the sampler")
    parser.add_argument("--samples", type=int, default=256, help="dataset size")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per batch, padding included")
    parser.add_argument("--resume", help="a checkpoint.pt to continue from (its step, epoch and batch)")
    parser.add_argument(
        "--group-size", type=int, default=128, help="the sampler sorts by length within groups of this many samples"
    )
    train(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
