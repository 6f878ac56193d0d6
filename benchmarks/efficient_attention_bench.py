"""Step time and peak memory of GPT-2 training with and without the efficient_attention plugin.

``python benchmarks/efficient_attention_bench.py [--settings torch,off,on] [--attn eager,sdpa] [--n-layer 4 ...]``

GPT-2 from a config, trained with AdamW in PyTorch ("torch") and in ortcore with the plugin "off" and "on" (with
aten_fallback's default routing, as an installed ortcore runs). Step times come from one process per attention
implementation running the settings interleaved; peak RSS from one fresh process per setting. Prints a table with the
ratios to the plugin off.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

import ortcore_plugins.efficient_attention as plugin
from ortcore.tables import format_table
from ortcore_plugins.bench.suite import peak_rss_bytes, reset_peak_rss
from ortcore_plugins.efficient_attention import ENV

BENCH_CONFIG = {"n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 8000, "batch": 4, "seq": 512, "steps": 10}
BENCH_SETTINGS = ("torch", "off", "on")
BENCH_ATTENTION = ("eager", "sdpa")  # Hugging Face attention implementations that run on CPU
SETTING_LABELS = {"torch": "PyTorch eager", "off": "ortcore, plugin off", "on": "ortcore, plugin on"}


def _bench_model(setting: str, attn: str, spec: Mapping[str, int]) -> tuple[torch.nn.Module, Callable[[], float]]:
    """GPT-2 from a config, in PyTorch ("torch") or in ortcore with this plugin "off" or "on" (with aten_fallback's
    default routing, as an installed ortcore runs), and one AdamW training step on a fixed batch."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import ortcore_plugins.aten_fallback as aten_fallback
    import ortcore_plugins.efficient_attention as plugin
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
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation=attn,
    )
    model = GPT2LMHeadModel(config).train()
    if setting != "torch":
        table = {"plugins": {plugin.NAME: {"enable": setting == "on"}}}
        host = make_host({"aten_fallback": aten_fallback, plugin.NAME: plugin}, table=table)
        model = ORTModule(model, host=host, fallback_policy="FALLBACK_DISABLE")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, spec["vocab_size"], (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1))

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss)

    return model, step


def _replaced(setting: str) -> int | None:
    if setting == "torch":
        return None
    report = plugin.last_report()
    return report.replaced if report is not None else 0


def _memory_worker(setting: str, attn: str, spec: Mapping[str, int]) -> dict[str, Any]:
    """Peak RSS of one setting, alone in a fresh process: up to the end of the first step, and of the steps after."""
    _, step = _bench_model(setting, attn, spec)
    start = time.perf_counter()
    step()  # export, build and the first step
    first = time.perf_counter() - start
    replaced = _replaced(setting)
    first_peak = peak_rss_bytes()
    step()
    reset = reset_peak_rss()
    for _ in range(3):
        loss = step()
    return {
        "setting": setting,
        "attn": attn,
        "replaced": replaced,
        "loss": loss,
        "first_step_s": round(first, 2),
        "first_peak_rss_mib": round(first_peak / 2**20, 1),
        "peak_rss_mib": round(peak_rss_bytes() / 2**20, 1),
        "peak_is_steady_state": reset,
    }


def _time_worker(settings: Sequence[str], attn: str, spec: Mapping[str, int]) -> dict[str, dict[str, list[float]]]:
    """Step times of every setting in one process, interleaved: one step of each in turn, the order reversed every
    round, so that a busy spell of a shared machine falls on all of them alike. Wall-clock seconds and the process's
    CPU seconds (all threads) per step: on a machine shared with other jobs the CPU time is the steadier measure of
    the work a step does."""
    steps = {setting: _bench_model(setting, attn, spec)[1] for setting in settings}
    for step in steps.values():
        step()  # export, build and the first step
        step()
    times: dict[str, dict[str, list[float]]] = {setting: {"wall": [], "cpu": []} for setting in settings}
    for round_ in range(spec["steps"]):
        for setting in settings if round_ % 2 == 0 else list(reversed(settings)):
            wall, cpu = time.perf_counter(), time.process_time()
            steps[setting]()
            times[setting]["cpu"].append(time.process_time() - cpu)
            times[setting]["wall"].append(time.perf_counter() - wall)
    return times


def _run_worker(*args: str) -> Any:
    env = {**os.environ, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "10000")}
    env.pop(ENV, None)  # the settings choose; a switch in the caller's environment must not
    done = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--bench-worker", *args],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(("{", "["))]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"benchmark worker {args[:3]} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1])


def bench_efficient_attention(
    settings: Sequence[str] = BENCH_SETTINGS, attn: Sequence[str] = ("eager",), spec: Mapping[str, int] | None = None
) -> list[dict[str, Any]]:
    """Step time and peak RSS of GPT-2 training in PyTorch and in ortcore with this plugin off and on.

    Per attention implementation: step times come from one process running the settings interleaved (see
    :func:`_time_worker`); peak RSS from one fresh process per setting (a peak cannot be shared). Workers run with
    ``GOMP_SPINCOUNT=10000`` (see docs/plugins/aten_fallback.md). Returns one dict per (implementation, setting)
    with the memory worker's results and ``times`` (seconds per step).
    """
    spec = {**BENCH_CONFIG, **(spec or {})}
    unknown = [s for s in settings if s not in BENCH_SETTINGS]
    if unknown:
        raise ValueError(f"unknown benchmark setting(s) {unknown}; allowed: {', '.join(BENCH_SETTINGS)}")
    results = []
    for implementation in attn:
        times = _run_worker("time", ",".join(settings), implementation, json.dumps(spec))
        for setting in settings:
            memory = _run_worker("memory", setting, implementation, json.dumps(spec))
            results.append({**memory, "times": times[setting]})
    return results


def summarize(results: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    """One row per (implementation, setting): median wall-clock and CPU time per step, peak RSS, and their ratios to
    the plugin off."""
    off = {r["attn"]: r for r in results if r["setting"] == "off"}

    def ratio(value: float, reference: float | None) -> str:
        return f"{value / reference:.2f}" if reference else "-"

    rows = []
    for r in results:
        base = off.get(r["attn"])
        wall, cpu = float(np.median(r["times"]["wall"])), float(np.median(r["times"]["cpu"]))
        rows.append(
            (
                r["attn"],
                SETTING_LABELS[r["setting"]],
                "-" if r["replaced"] is None else r["replaced"],
                f"{wall * 1000:.0f}",
                ratio(wall, float(np.median(base["times"]["wall"])) if base else None),
                f"{cpu * 1000:.0f}",
                ratio(cpu, float(np.median(base["times"]["cpu"])) if base else None),
                f"{r['peak_rss_mib']:.0f}",
                ratio(r["peak_rss_mib"], base["peak_rss_mib"] if base else None),
                f"{r['first_step_s']:.1f}",
                f"{r['loss']:.5f}",
            )
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/efficient_attention_bench.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--settings", default=",".join(BENCH_SETTINGS), help="comma list of torch, off, on")
    parser.add_argument("--attn", default="eager,sdpa", help="comma list of Hugging Face attention implementations")
    for key, value in BENCH_CONFIG.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--bench-worker", nargs=4, metavar=("KIND", "SETTING", "ATTN", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.bench_worker:
        kind, setting, attn, spec = args.bench_worker
        if kind == "time":
            result: Any = _time_worker(setting.split(","), attn, json.loads(spec))
        else:
            result = _memory_worker(setting, attn, json.loads(spec))
        print(json.dumps(result), flush=True)
        return
    for key in BENCH_CONFIG:
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} {getattr(args, key)}: must be at least 1")
    unknown = [s for s in args.settings.split(",") if s not in BENCH_SETTINGS]
    if unknown:
        parser.error(f"--settings {args.settings!r}: unknown {unknown}; allowed: {', '.join(BENCH_SETTINGS)}")
    unknown = [a for a in args.attn.split(",") if a not in BENCH_ATTENTION]
    if unknown:
        parser.error(f"--attn {args.attn!r}: unknown {unknown}; allowed: {', '.join(BENCH_ATTENTION)}")
    spec = {key: getattr(args, key) for key in BENCH_CONFIG}
    print("GPT-2 " + ", ".join(f"{k}={v}" for k, v in spec.items()), flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    results = bench_efficient_attention(args.settings.split(","), args.attn.split(","), spec)
    header = (
        "attn",
        "setting",
        "replaced",
        "step ms",
        "vs off",
        "CPU ms/step",
        "vs off",
        "peak RSS MiB",
        "vs off",
        "1st step s",
        "loss",
    )
    print(format_table(header, summarize(results)))
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"  medians of {spec['steps']} steps per setting, interleaved in one process (CPU: all threads of the process);"
    )
    print(
        f"  peak RSS of the steps after the first, one process per setting. Load average {load:.1f} before, {after:.1f} after."
    )
    if not all(r["peak_is_steady_state"] for r in results):
        print("  (the peak could not be reset here: 'peak RSS' includes export and the first step)")


if __name__ == "__main__":
    main()
