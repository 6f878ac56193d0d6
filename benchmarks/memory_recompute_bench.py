"""Peak memory of GPT-2 training in PyTorch and in ortcore at each memory_recompute level.

``python benchmarks/memory_recompute_bench.py [--settings torch,0,1,2] [--n-layer 6 ...]``

Each setting runs in its own process (a peak RSS cannot be shared), with the same model, data and seed. Prints the
peak RSS of the steps after the first, its ratio to PyTorch's, the peak up to the end of the first step, step times
and the loss.
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

import ortcore_plugins.memory_recompute as plugin
from ortcore.tables import format_table
from ortcore_plugins.bench.suite import peak_rss_bytes, reset_peak_rss

BENCH_CONFIG = {"n_embd": 256, "n_layer": 6, "n_head": 8, "vocab_size": 2048, "batch": 8, "seq": 256, "steps": 3}
# "torch" (PyTorch eager) and the plugin's recompute levels.
BENCH_SETTINGS = ("torch", *(str(level) for level in sorted(plugin.LEVELS)))


def _bench_worker(setting: str, spec: Mapping[str, int]) -> dict[str, Any]:
    """One measurement, in a fresh process: peak RSS of training steps for ``setting`` ("torch" or a level).

    ORT keeps its arena after the first step, so the steady-state peak of an ortcore run is at least its RSS then.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    from ortcore import ORTModule
    from ortcore.testing import make_host

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=spec["vocab_size"],
        n_embd=spec["n_embd"],
        n_layer=spec["n_layer"],
        n_head=spec["n_head"],
        n_positions=spec["seq"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).train()
    if setting != "torch":
        table = {"plugins": {plugin.NAME: {"level": int(setting)}}}
        host = make_host({plugin.NAME: plugin}, table=table)
        model = ORTModule(model, host=host, fallback_policy="FALLBACK_DISABLE")
    ids = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["seq"]))

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return float(loss)

    first = time.perf_counter()
    loss = step()  # export, build, and the first step: not part of the steady peak
    first = time.perf_counter() - first
    first_peak = peak_rss_bytes()  # model, export, session builds and the first step
    reset = reset_peak_rss()
    start = time.perf_counter()
    for _ in range(spec["steps"]):
        step()
    seconds = (time.perf_counter() - start) / spec["steps"]
    return {
        "setting": setting,
        "loss": loss,
        "first_step_s": round(first, 2),
        "step_s": round(seconds, 3),
        "first_peak_rss_mib": round(first_peak / 2**20, 1),
        "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "peak_is_steady_state": reset,
    }


def bench_memory_recompute(
    settings: Sequence[str] = BENCH_SETTINGS, spec: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """Peak memory of GPT-2 training steps in PyTorch and in ortcore at each recompute level.

    Each setting runs in its own process (a peak RSS cannot be shared), with the same model, data and seed.
    Returns one dict per setting: loss, first-step and steady step time, the peak RSS up to the end of the first step
    (model, export, session builds) and the peak RSS of the steps after it (on Linux, where the peak can be reset).
    """
    spec = {**BENCH_CONFIG, **(spec or {})}
    unknown = [s for s in settings if s not in BENCH_SETTINGS]
    if unknown:
        raise ValueError(f"unknown benchmark setting(s) {unknown}; allowed: {', '.join(BENCH_SETTINGS)}")
    results = []
    for setting in settings:
        cmd = [sys.executable, os.path.abspath(__file__), "--bench-worker", setting, json.dumps(spec)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"benchmark setting {setting} failed:\n{done.stderr[-4000:]}")
        results.append(json.loads(lines[-1]))
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/memory_recompute_bench.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--settings", default=",".join(BENCH_SETTINGS), help="comma list of 'torch' and levels (default: all)"
    )
    for key, value in BENCH_CONFIG.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
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
            parser.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be at least 1")
    spec = {key: getattr(args, key) for key in BENCH_CONFIG}
    print("GPT-2 " + ", ".join(f"{k}={v}" for k, v in spec.items()), flush=True)
    results = bench_memory_recompute(args.settings.split(","), spec)
    torch_peak = next((r["peak_rss_mib"] for r in results if r["setting"] == "torch"), None)
    rows = []
    for r in results:
        name = "PyTorch eager" if r["setting"] == "torch" else f"ortcore, level {r['setting']}"
        ratio = f"{r['peak_rss_mib'] / torch_peak:.2f}" if torch_peak else "-"
        rows.append(
            (
                name,
                r["peak_rss_mib"],
                ratio,
                r["first_peak_rss_mib"],
                r["step_s"],
                r["first_step_s"],
                f"{r['loss']:.5f}",
            )
        )
    header = ("setting", "peak RSS MiB", "vs torch", "peak to 1st step MiB", "step s", "1st step s", "loss")
    print(format_table(header, rows))
    if not all(r["peak_is_steady_state"] for r in results):
        print("  (the peak could not be reset here: 'peak RSS' includes export and the first step)")


if __name__ == "__main__":
    main()
