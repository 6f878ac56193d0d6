"""Peak RSS above the pre-wrap baseline, eager against ortcore under several ORT memory settings.

    python benchmarks/memory_probe.py [bert|gpt2]

Each setting runs in a fresh process (``ortcore bench``'s model and batches at the default config, 8 AdamW steps);
the table shows the peak above the baseline and the RSS after steps 1, 2 and 8.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

#: Session option overrides per setting (None: eager PyTorch).
SETTINGS: dict[str, dict[str, bool] | None] = {
    "eager": None,
    "ortcore": {},
    "ortcore, no CPU arena": {"enable_cpu_mem_arena": False},
    "ortcore, memory reuse": {"enable_mem_reuse": True},
    "ortcore, memory reuse, no CPU arena": {"enable_mem_reuse": True, "enable_cpu_mem_arena": False},
    "ortcore, memory reuse + pattern": {"enable_mem_reuse": True, "enable_mem_pattern": True},
}


def _worker(model_name: str, setting: str) -> dict:
    import torch

    from ortcore_plugins.bench.suite import PeakRSS
    from ortcore_plugins.services.example_models import BenchConfig, build_model, make_batches

    cfg = BenchConfig()
    torch.manual_seed(cfg.seed)
    model = build_model(model_name, cfg)
    model.train()
    batches = make_batches(model_name, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    rss = PeakRSS()
    base = rss.current_bytes()
    rss.start()
    runner = model
    overrides = SETTINGS[setting]
    if overrides is not None:
        from ortcore import ORTModule
        from ortcore.hookspecs import hookimpl
        from ortcore.host import PluginHost

        class Overrides:
            @hookimpl
            def ortcore_session_plan(self, plan):
                plan.set_session_options(
                    lambda session_options: [setattr(session_options, k, v) for k, v in overrides.items()]
                )

        runner = ORTModule(model, host=PluginHost(plugins={"overrides": Overrides()}))
    after = []
    for batch in batches[:8]:
        loss = runner(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        del loss
        after.append((rss.current_bytes() - base) / 2**20)
    peak = rss.stop()
    return {"peak": (peak - base) / 2**20, "after": [after[0], after[1], after[-1]]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="bert", choices=("bert", "gpt2"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--settings", nargs="*", choices=list(SETTINGS), help="default: all")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(_worker(args.model, args.worker)))
        return 0
    from ortcore.tables import format_table

    rows = []
    for setting in args.settings or SETTINGS:
        out = subprocess.run(
            [sys.executable, __file__, args.model, "--worker", setting], capture_output=True, text=True, check=True
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((setting, f"{result['peak']:.0f}", *(f"{v:.0f}" for v in result["after"])))
    header = ("setting", "peak - base MiB", "after step 1", "after step 2", "after step 8")
    print(format_table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
