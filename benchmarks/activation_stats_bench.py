"""The cost of recording activation statistics: ``python benchmarks/activation_stats_bench.py [--engines ...]``.

GPT-2 from a config (the built-in example model and batches, ``ortcore_plugins.services.example_models``), trained with AdamW twice from the same weights in one
process, once with a :class:`StatisticsSubscriber` and once without, alternating step by step so both see the same
machine load. One process per engine (PyTorch eager, ortcore). Reported: median step time of each, their ratio, and
the disk written per recorded step. Medians and the ratio of the fastest steps (steadier on a busy machine).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

ENGINES = ("eager", "ortcore")


def _disk_bytes(path: str) -> tuple[int, int]:
    size = files = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            size += os.path.getsize(os.path.join(root, name))
            files += 1
    return size, files


def _worker(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ortcore import ORTModule
    from ortcore.hooks import GlobalSubscriberManager
    from ortcore_plugins.activation_stats import StatisticsSubscriber, statistics_kernel_fused
    from ortcore_plugins.services.example_models import BenchConfig, build_model, make_batches

    cfg = BenchConfig(**spec)
    torch.manual_seed(cfg.seed)
    base = build_model("gpt2", cfg)
    models = {"off": copy.deepcopy(base), "on": copy.deepcopy(base)}
    if engine == "ortcore":
        models = {k: ORTModule(m) for k, m in models.items()}
    out_dir = tempfile.mkdtemp(prefix="ortcore-stats-bench-")
    GlobalSubscriberManager.subscribe(models["on"], [StatisticsSubscriber(out_dir, override_output_dir=True)])
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    times: dict[str, list[float]] = {"off": [], "on": []}
    losses: dict[str, list[float]] = {"off": [], "on": []}
    for batch in make_batches("gpt2", cfg):
        for key in ("off", "on"):
            start = time.perf_counter()
            loss = models[key](**batch).loss
            loss.backward()
            optimizers[key].step()
            optimizers[key].zero_grad()
            times[key].append(time.perf_counter() - start)
            losses[key].append(loss.item())
    GlobalSubscriberManager.unsubscribe(models["on"])
    size, files = _disk_bytes(out_dir)
    shutil.rmtree(out_dir)
    steady = slice(2, None)  # the first two steps export, build and compile
    return {
        "engine": engine,
        "step_off_s": statistics.median(times["off"][steady]),
        "step_on_s": statistics.median(times["on"][steady]),
        "fastest_off_s": min(times["off"][steady]),
        "fastest_on_s": min(times["on"][steady]),
        "first_off_s": times["off"][0],
        "first_on_s": times["on"][0],
        "disk_bytes_per_step": size / cfg.steps,
        "files_per_step": files / cfg.steps,
        "fused_kernel": statistics_kernel_fused(),
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["off"], losses["on"])),
    }


def run(engines: Sequence[str], spec: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    env = {**os.environ, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000")}
    for engine in engines:
        cmd = [sys.executable, os.path.abspath(__file__), "--bench-worker", engine, json.dumps(spec)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"benchmark of {engine} failed:\n{done.stderr[-4000:]}")
        results.append(json.loads(lines[-1]))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    from ortcore.argtypes import positive_int

    parser = argparse.ArgumentParser(
        prog="python benchmarks/activation_stats_bench.py",
        description="Step time and disk use of training with and without a StatisticsSubscriber.",
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    for name, default in (("steps", 12), ("batch", 8), ("seq", 128), ("hidden", 256), ("layers", 4)):
        parser.add_argument(f"--{name}", type=positive_int, default=default)
    parser.add_argument("--bench-worker", nargs=2, metavar=("ENGINE", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bench_worker:
        engine, spec = args.bench_worker
        print(json.dumps(_worker(engine, json.loads(spec))), flush=True)
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        parser.error(f"--engines {args.engines!r}: unknown {unknown or 'empty'}; allowed: {', '.join(ENGINES)}")
    spec = {k: getattr(args, k) for k in ("steps", "batch", "seq", "hidden", "layers")}
    if spec["steps"] < 3:
        parser.error(f"--steps {spec['steps']}: at least 3 (the first two steps are not timed)")
    print("GPT-2 " + ", ".join(f"{k}={v}" for k, v in spec.items()), flush=True)
    from ortcore.tables import format_table

    rows = []
    for r in run(engines, spec):
        rows.append(
            (
                r["engine"],
                f"{1000 * r['step_off_s']:.1f}",
                f"{1000 * r['step_on_s']:.1f}",
                f"{r['step_on_s'] / r['step_off_s']:.2f}",
                f"{r['fastest_on_s'] / r['fastest_off_s']:.2f}",
                f"{r['first_on_s'] - r['first_off_s']:.1f}",
                f"{r['disk_bytes_per_step'] / 1024:.0f}",
                f"{r['files_per_step']:.0f}",
                "yes" if r["fused_kernel"] else "no",
                f"{r['max_loss_diff']:.1e}",
            )
        )
    header = ("engine", "step ms off", "step ms on", "on/off", "fastest on/off", "1st step +s", "KiB/step", "files/step", "fused",
              "loss diff")  # fmt: skip
    print(format_table(header, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
