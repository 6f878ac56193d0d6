"""Peak memory of BERT training with and without reentrant activation checkpointing, in PyTorch and in ortcore.

``python benchmarks/checkpointing_bench.py [--settings torch,torch-ckpt,ort,ort-ckpt,ort-inline-l1] [--layers 6 ...]``

Settings: ``torch`` / ``torch-ckpt`` are PyTorch eager without / with Hugging Face's gradient checkpointing
(``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``); ``ort`` / ``ort-ckpt``
are the same two models under ORTModule (checkpointed layers run as recompute regions, the default);
``ort-inline-l1`` is the checkpointed model with ``ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT=inline`` and
``ORTMODULE_MEMORY_OPT_LEVEL=1`` (the layers exported into the graph, ORT's layer-wise recompute: upstream's recipe).

Each setting runs in its own process (a peak RSS cannot be shared) with the same model, data and seed; dropout is
off so that every setting computes the same loss. Prints the peak RSS of the steps after the first (the kernel's
peak is reset after it: ORT keeps its arena, so an ortcore peak is at least the RSS the first step left), the RSS
before the first step (the model and its data, no activation yet), their difference (what training added:
activations, gradients, optimizer-free), step times and the loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ortcore.tables import format_table
from ortcore_plugins.bench.suite import peak_rss_bytes, reset_peak_rss

BENCH_CONFIG = {"hidden": 256, "layers": 6, "heads": 4, "batch": 8, "seq": 512, "steps": 3}
BENCH_SETTINGS = ("torch", "torch-ckpt", "ort", "ort-ckpt", "ort-inline-l1")


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _bench_worker(setting: str, spec: Mapping[str, int]) -> dict[str, Any]:
    """One measurement, in a fresh process."""
    if setting == "ort-inline-l1":
        os.environ["ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT"] = "inline"
        os.environ["ORTMODULE_MEMORY_OPT_LEVEL"] = "1"
    from transformers import BertConfig, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    from ortcore import ORTModule

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=4096,
        hidden_size=spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        intermediate_size=4 * spec["hidden"],
        max_position_embeddings=spec["seq"],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    model = BertForSequenceClassification(config).train()
    if setting.endswith("ckpt") or setting == "ort-inline-l1":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if setting.startswith("ort"):
        model = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (spec["batch"], spec["seq"]), generator=gen)
    labels = torch.randint(0, 3, (spec["batch"],), generator=gen)

    def step() -> float:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return float(loss)

    before = _current_rss_bytes()
    first = time.perf_counter()
    loss = step()  # export, build, and the first step: not part of the steady peak
    first = time.perf_counter() - first
    reset = reset_peak_rss()
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    seconds = (time.perf_counter() - start) / spec["steps"]
    peak = peak_rss_bytes()
    return {
        "setting": setting,
        "loss": loss,
        "first_step_s": round(first, 2),
        "step_s": round(seconds, 3),
        "rss_before_mib": round(before / 2**20, 1),
        "peak_rss_mib": round(peak / 2**20, 1),
        "peak_is_steady_state": reset,
    }


def bench_checkpointing(
    settings: Sequence[str] = BENCH_SETTINGS, spec: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """One dict per setting (see the module's doc), each measured in a process of its own."""
    spec = {**BENCH_CONFIG, **(spec or {})}
    unknown = [s for s in settings if s not in BENCH_SETTINGS]
    if unknown:
        raise ValueError(f"unknown benchmark setting(s) {unknown}; allowed: {', '.join(BENCH_SETTINGS)}")
    results = []
    env = {k: v for k, v in os.environ.items() if k not in ("ORTMODULE_ALLOW_AUTOGRAD_CHECKPOINT",)}
    for setting in settings:
        cmd = [sys.executable, os.path.abspath(__file__), "--bench-worker", setting, json.dumps(spec)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"benchmark setting {setting} failed:\n{done.stderr[-4000:]}")
        results.append(json.loads(lines[-1]))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/checkpointing_bench.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--settings", default=",".join(BENCH_SETTINGS), help="comma list (default: all)")
    for key, value in BENCH_CONFIG.items():
        parser.add_argument(f"--{key}", type=int, default=value)
    parser.add_argument("--bench-worker", nargs=2, metavar=("SETTING", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bench_worker:
        setting, spec = args.bench_worker
        print(json.dumps(_bench_worker(setting, json.loads(spec))), flush=True)
        return
    unknown = [s for s in args.settings.split(",") if s not in BENCH_SETTINGS]
    if unknown:
        parser.error(f"--settings {args.settings!r}: unknown {unknown}; allowed: {', '.join(BENCH_SETTINGS)}")
    for key in BENCH_CONFIG:
        if getattr(args, key) < 1:
            parser.error(f"--{key} {getattr(args, key)}: must be at least 1")
    spec = {key: getattr(args, key) for key in BENCH_CONFIG}
    print("BERT " + ", ".join(f"{k}={v}" for k, v in spec.items()), flush=True)
    results = bench_checkpointing(args.settings.split(","), spec)
    rows = [
        (
            r["setting"],
            r["peak_rss_mib"],
            r["rss_before_mib"],
            round(r["peak_rss_mib"] - r["rss_before_mib"], 1),
            r["step_s"],
            r["first_step_s"],
            f"{r['loss']:.5f}",
        )
        for r in results
    ]
    header = ("setting", "peak RSS MiB", "RSS before MiB", "added MiB", "step s", "1st step s", "loss")
    print(format_table(header, rows))
    if not all(r["peak_is_steady_state"] for r in results):
        print("  (the peak could not be reset here: 'peak RSS' includes export and the first step)")


if __name__ == "__main__":
    main()
