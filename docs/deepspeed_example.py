"""Train a small GPT-2 with ORTModule, FusedAdam and FP16_Optimizer under DeepSpeed ZeRO stage 2, on CPU.

See docs/deepspeed.md.

One process, or several through a launcher::

    python docs/deepspeed_example.py
    python docs/deepspeed_example.py --compare          # also train with stock DeepSpeed, print both curves
    python docs/deepspeed_example.py --compare --bf16   # DeepSpeed's bf16 (the model in bfloat16), both curves
    torchrun --nproc_per_node 2 docs/deepspeed_example.py --compare
    deepspeed --num_gpus 2 docs/deepspeed_example.py --compare

The model (GPT-2, 2 layers, hidden 64, vocabulary 128) is built from a config, so nothing is downloaded. It learns to
continue counting sequences (``7 8 9 10 ...`` modulo the vocabulary), so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import argparse
import os
import socket

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed picks its accelerator

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from ortcore import ORTModule  # noqa: E402
from ortcore.optim import AdamWMode, FP16_Optimizer, FusedAdam  # noqa: E402

VOCAB = 128
SEQ = 16
MICRO_BATCH = 4


def ds_config(stage: int, bf16: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        # ortcore's FusedAdam is not one of DeepSpeed's own optimizers: ZeRO refuses it without this key.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if bf16:
        config["bf16"] = {"enabled": True}  # DeepSpeed casts the model to bfloat16, fp32 master weights in ZeRO
    return config


def build_model() -> torch.nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=64,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(0)  # every rank and both runs start from the same weights
    return GPT2LMHeadModel(config)


def counting_batch(generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=generator)
    return (starts + torch.arange(SEQ)) % VOCAB


def train(use_ortcore: bool, stage: int, steps: int, bf16: bool = False) -> tuple[list[float], torch.nn.Module]:
    model = build_model()
    if use_ortcore:
        model = ORTModule(model)
    optimizer = FusedAdam(model.parameters(), lr=3e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        config=ds_config(stage, bf16),
        dist_init_required=False,
    )
    if use_ortcore:
        optimizer = FP16_Optimizer(optimizer)  # multi-tensor overflow check and gradient norm (the same object)
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its own data
    losses = []
    for _ in range(steps):
        ids = counting_batch(generator)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.module


def init_distributed() -> None:
    """Launchers (deepspeed, torchrun) set the rank variables; a plain ``python`` run is a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage")
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also train without ORTModule and FP16_Optimizer (stock DeepSpeed) and compare",
    )
    parser.add_argument("--bf16", action="store_true", help='DeepSpeed\'s "bf16": {"enabled": true}')
    parser.add_argument("--local_rank", type=int, default=None, help="set by the deepspeed launcher")
    args = parser.parse_args()

    init_distributed()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    ours, model = train(True, args.stage, args.steps, args.bf16)
    reference = train(False, args.stage, args.steps, args.bf16)[0] if args.compare else None

    if dist.get_rank() == 0:
        precision = "bf16" if args.bf16 else "fp32"
        print(f"ZeRO stage {args.stage}, {precision}, {dist.get_world_size()} process(es), rank 0's losses")
        for step, loss in enumerate(ours, 1):
            line = f"step {step:3d}  ortcore {loss:.6f}"
            if reference is not None:
                line += f"  pytorch {reference[step - 1]:.6f}  rel diff {abs(loss / reference[step - 1] - 1):.1e}"
            print(line)
        if reference is not None:
            worst = max(abs(a / b - 1) for a, b in zip(ours, reference, strict=True))
            print(f"largest relative loss difference: {worst:.1e}")
        counters = model.state_machine.counters
        where = "PyTorch (fallback: " + model.fallback_reason + ")" if model.fallback_reason else "ONNX Runtime"
        print(f"ortcore ran in {where}: exports {counters.exports}, repairs {counters.repairs}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
