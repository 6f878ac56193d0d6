"""Per-rank memory and step time of sharded training (DeepSpeed ZeRO-3, PyTorch FSDP2) over an ORTModule and over
the plain model, and of DDP.

    python benchmarks/sharding_bench.py [--layers 8] [--hidden 512] [--steps 6] [--runs ...] [--json out.json]

Every run trains the same GPT-2 built from a config (nothing is downloaded; tens of millions of parameters, so
that parameters, gradients and Adam's state dominate the memory) on 2 processes (gloo, DeepSpeed's CPU accelerator),
with ortcore's FusedAdam (DDP, ZeRO-3) or torch's AdamW (FSDP2: its parameters are DTensors); each run is a fresh
pair of processes. Runs:

- ``ddp``: torch DDP over the plain model (no sharding), the baseline;
- ``zero3``: DeepSpeed ZeRO-3 over the plain model;
- ``zero3_ort``: DeepSpeed ZeRO-3 over ``ORTModule(model)`` (the ``zero_stage3`` plugin);
- ``fsdp2``: ``fully_shard`` on each GPT-2 block and on the model;
- ``fsdp2_ort``: ``fully_shard`` on each block and on ``ORTModule(model)`` (the ``fsdp2`` plugin).

Per rank it reports the peak RSS (``ru_maxrss``) and its increase over the RSS after the model was built, the
bytes of parameters, gradients and optimizer state the rank holds between steps, and the median step time of the
steps after the first (the first exports and builds the ORT session).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

RUNS = ("ddp", "zero3", "zero3_ort", "fsdp2", "fsdp2_ort")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _worker(run: str, layers: int, hidden: int, steps: int) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import GPT2Config, GPT2LMHeadModel

    from ortcore import ORTModule
    from ortcore.optim import AdamWMode, FusedAdam

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=8192, n_positions=128, n_embd=hidden, n_layer=layers, n_head=8,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    model.config.use_cache = False
    n_params = sum(p.numel() for p in model.parameters())
    base = _rss()
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, config.vocab_size, (4, 128), generator=gen) for _ in range(2)]

    fsdp = run.startswith("fsdp2")
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
    wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE") if run.endswith("_ort") else model
    grad_bytes_in_step = 0
    if fsdp:
        engine = fully_shard(wrapped)
        optimizer = torch.optim.AdamW(engine.parameters(), lr=1e-4, weight_decay=0.01)
    else:
        optimizer = FusedAdam(wrapped.parameters(), lr=1e-4, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)
    if run == "ddp":
        engine = torch.nn.parallel.DistributedDataParallel(wrapped)
    elif not fsdp:
        ds_config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
        }
        engine, optimizer, _, _ = deepspeed.initialize(
            model=wrapped, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
    times, losses = [], []
    for step in range(steps):
        ids = batches[step % 2]
        start = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        if run == "ddp" or fsdp:
            loss.backward()
            if fsdp:  # the gradient shards FSDP2's reduce-scatter left on the rank
                grad_bytes_in_step = _tensor_bytes(p.grad.to_local() for p in engine.parameters() if p.grad is not None)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            engine.backward(loss)
            engine.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())

    params = list(model.parameters())
    if fsdp:
        param_bytes = _tensor_bytes(p.to_local() for p in engine.parameters())
        inner = optimizer
        master_bytes = 0
    elif run == "ddp":
        param_bytes = _tensor_bytes(p.data for p in params)
        grad_bytes_in_step = _tensor_bytes(p.data for p in params)  # every gradient whole, freed by zero_grad
        inner = optimizer
        master_bytes = 0
    else:
        param_bytes = _tensor_bytes([p.ds_tensor for p in params]) + _tensor_bytes(p.data for p in params)
        grad_bytes_in_step = _tensor_bytes([getattr(optimizer, "grad_partitions_flat_buffer", None)])  # the shards
        inner = optimizer.optimizer
        master_bytes = _tensor_bytes(getattr(optimizer, "fp32_partitioned_groups_flat", []))
    state_bytes = _tensor_bytes(
        t.to_local() if hasattr(t, "to_local") else t for s in inner.state.values() for t in s.values() if torch.is_tensor(t)
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result = dict(
        run=run,
        rank=rank,
        parameters=n_params,
        peak_rss=peak,
        peak_over_model=peak - base,
        param_bytes=param_bytes,
        grad_bytes=grad_bytes_in_step,
        optimizer_state_bytes=state_bytes,
        fp32_master_bytes=master_bytes,
        step_seconds=statistics.median(times[1:]) if len(times) > 1 else times[0],
        first_step_seconds=times[0],
        losses=losses,
    )
    if run.endswith("_ort"):
        counters = wrapped.state_machine.counters
        result["ort"] = dict(exports=counters.exports, fallbacks=counters.fallbacks, fallback=wrapped.fallback_reason)
    print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(run: str, args: argparse.Namespace) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
        env.update(LOCAL_RANK=str(rank), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
        command = [
            sys.executable,
            __file__,
            "--worker",
            run,
            "--layers",
            str(args.layers),
            "--hidden",
            str(args.hidden),
        ]
        command += ["--steps", str(args.steps)]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"{run} failed (exit {proc.returncode}):\n{out[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.layers, args.hidden, args.steps)
        return
    results = {run: launch(run, args) for run in args.runs.split(",")}
    mib = 2.0**20
    print(f"GPT-2, {results[next(iter(results))][0]['parameters'] / 1e6:.1f}M parameters, 2 processes (gloo)")
    header = "run        rank  peak RSS  peak-model  params  grads  Adam state  fp32 master  step s  first step s"
    print(header)
    for run, ranks in results.items():
        for r in ranks:
            print(
                f"{run:<10} {r['rank']:>4} {r['peak_rss'] / mib:>8.0f}M {r['peak_over_model'] / mib:>10.0f}M "
                f"{r['param_bytes'] / mib:>6.0f}M {r['grad_bytes'] / mib:>5.0f}M {r['optimizer_state_bytes'] / mib:>10.0f}M "
                f"{r['fp32_master_bytes'] / mib:>11.0f}M {r['step_seconds']:>7.2f} {r['first_step_seconds']:>12.2f}"
            )
        if run.endswith("_ort"):
            print(f"           ORT: {ranks[0].get('ort')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
