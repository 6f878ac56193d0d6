"""The gradient audit's one-time cost: first step, steady step and peak memory with the audit on and off.

    python benchmarks/audit_cost.py [--config default|large|quick] [--rounds 2] [--models bert gpt2] [--out F.json]

Each run is ``ortcore bench``'s worker (a fresh process: the model of the preset, AdamW, the preset's steps) with
``ORTCORE_VERIFY_GRADIENTS`` set to 0 or 1; the two settings alternate within each round, so a machine whose load
changes affects both alike. Reports the median over rounds of each, the difference (what the audit costs, once per
new graph) and the ratio, naming the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="default", help="ortcore bench preset (default, large, quick)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2"])
    parser.add_argument("--steps", type=int, default=None, help="override the preset's steps")
    parser.add_argument("--out", default=None, help="write the runs as JSON here")
    args = parser.parse_args(argv)

    from ortcore_plugins.bench.suite import preset, run_isolated

    cfg = preset(args.config, steps=args.steps, warmup=min(2, (args.steps or 3) - 1) if args.steps else None)
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for model in args.models:
            for verify in ("0", "1"):
                os.environ["ORTCORE_VERIFY_GRADIENTS"] = verify
                result = run_isolated(model, "ortcore", cfg)
                runs.append(
                    {
                        "round": round_,
                        "model": model,
                        "audit": verify == "1",
                        "ok": result.ok,
                        "error": result.error,
                        "first_step_s": result.first_step_s,
                        "steady_step_s": result.steady_step_s,
                        "peak_rss_mib": result.rss_peak_above_baseline_mib,
                    }
                )
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    print(f"gradient audit cost, preset {args.config!r}, {cpu_name()}, {os.cpu_count()} cores, {args.rounds} rounds")
    print(f"{'model':<6} {'':<9} {'first step s':>13} {'steady ms':>10} {'peak MiB':>9}")
    for model in args.models:
        medians = {}
        for audit in (False, True):
            ok = [r for r in runs if r["model"] == model and r["audit"] == audit and r["ok"]]
            if not ok:
                print(f"{model:<6} {'audit' if audit else 'no audit':<9} failed: {runs[-1]['error']}")
                continue
            medians[audit] = {k: statistics.median(r[k] for r in ok) for k in ("first_step_s", "steady_step_s", "peak_rss_mib")}
            m = medians[audit]
            label = "audit" if audit else "no audit"
            print(f"{model:<6} {label:<9} {m['first_step_s']:13.2f} {m['steady_step_s'] * 1e3:10.0f} {m['peak_rss_mib']:9.0f}")
        if len(medians) == 2:
            on, off = medians[True], medians[False]
            print(
                f"{model:<6} {'cost':<9} {on['first_step_s'] - off['first_step_s']:+13.2f} "
                f"{(on['steady_step_s'] - off['steady_step_s']) * 1e3:+10.0f} {on['peak_rss_mib'] - off['peak_rss_mib']:+9.0f}"
                f"   (first step x{on['first_step_s'] / off['first_step_s']:.2f}, peak x{on['peak_rss_mib'] / max(off['peak_rss_mib'], 1):.2f})"
            )
    if args.out:
        from ortcore.files import atomic_writer

        with atomic_writer(args.out) as f:
            json.dump({"cpu": cpu_name(), "cores": os.cpu_count(), "config": args.config, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
