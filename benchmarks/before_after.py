"""ortcore at two commits, side by side on this machine: first step and steady step of the same models, interleaved.

    git worktree add /tmp/ortcore-before <commit>
    python benchmarks/before_after.py --before /tmp/ortcore-before [--models bert,gpt2] [--rounds 3] [--steps 20]

Each (round, side, model) is a fresh process that imports ortcore from that side's tree (``PYTHONPATH``; the
built-in plugin package ``ortcore_plugins`` is that tree's ``plugins/``, through a link in a temporary directory) and
registers that tree's built-in plugins (``ortcore.host.builtin_plugins()``, less ``export_cache``: every first step exports and
builds) on a host of its own, so the installed entry points do not mix the two. Both sides run the same worker code below: a model built from a Hugging Face config with fixed
seeds, AdamW, the same batches. Rounds alternate the order of the sides, so drift in the machine's load falls on
both. Reported per model and side: the first step (export, build, and what else the first call does, such as the
gradient audit) and the steady step (median and minimum over ``--steps`` after 3 warm-up steps), and the ratio
after/before. The CPU is named in the output.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- the worker: one side, one model ---------------------------------------------------------------------------------


def _model(name: str):
    import torch
    import transformers

    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=8000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024
        )
        model = transformers.BertForSequenceClassification(config)
        ids = torch.randint(0, 8000, (8, 128), generator=torch.Generator().manual_seed(1))
        labels = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(2))
        return model, {"input_ids": ids, "labels": labels}
    if name == "gpt2":
        config = transformers.GPT2Config(vocab_size=8000, n_embd=256, n_layer=4, n_head=4, n_positions=256)
        model = transformers.GPT2LMHeadModel(config)
        ids = torch.randint(0, 8000, (8, 128), generator=torch.Generator().manual_seed(1))
        return model, {"input_ids": ids, "labels": ids}
    raise SystemExit(f"unknown model {name!r}; known: bert, gpt2")


def worker(model_name: str, steps: int) -> None:
    import importlib

    import attrs
    import torch

    import ortcore
    import ortcore_plugins
    from ortcore import ORTModule
    from ortcore.testing import make_host

    # The tree's plugin host module (ortcore.plugins in older trees) and built-in plugins: a list in older trees, the
    # installed entry points' in newer ones. Asked of the tree's files: an installed editable finder answers imports
    # of submodules for its own tree, whatever the package's path.
    newer = (Path(ortcore.__file__).parent / "host.py").exists()
    host_module = importlib.import_module("ortcore.host" if newer else "ortcore.plugins")
    names = getattr(host_module, "BUILTIN_PLUGINS", None) or host_module.builtin_plugins()
    # No export cache: a graph cached by an earlier run would make the first step a cache read.
    # The installed entry points may name plugins the other tree does not have (bench, say): only this tree's count.
    tree_plugins = Path(ortcore_plugins.__file__).parent
    plugins = {
        n: importlib.import_module(f"ortcore_plugins.{n}")
        for n in names
        if n != "export_cache" and ((tree_plugins / n).is_dir() or (tree_plugins / f"{n}.py").exists())
    }
    env = dict(os.environ)  # the environment, as ORTModule reads it
    # make_host, a test helper, turns the kernel choice's timing off (a test's graph must not depend on the machine's
    # speed); a benchmark runs what the tree does by default.
    options_class = getattr(plugins.get("aten_fallback"), "AtenFallbackOptions", None)
    if options_class is not None and "measure" in attrs.fields_dict(options_class):
        env.setdefault("ORTCORE_KERNEL_MEASURE", options_class().measure)
    host = make_host(plugins, env=env)
    model, batch = _model(model_name)
    model.train()
    wrapped = ORTModule(model, host=host)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)

    def step() -> float:
        start = time.perf_counter()
        loss = wrapped(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - start

    first = step()
    for _ in range(3):
        step()
    times = [step() for _ in range(steps)]
    print(
        "RESULT "
        + json.dumps(
            {
                "first_step_s": first,
                "steady_ms": statistics.median(times) * 1e3,
                "min_ms": min(times) * 1e3,
                "fallbacks": wrapped.state_machine.counters.fallbacks,
            }
        ),
        flush=True,
    )


# -- the driver ------------------------------------------------------------------------------------------------------


def run_side(tree: Path, model: str, steps: int, shim: Path, extra_env: dict[str, str] | None = None) -> dict:
    link = shim / tree.name / "ortcore_plugins"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(tree / "plugins")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(link.parent)])
    env.setdefault("GOMP_SPINCOUNT", "10000")
    env.update(extra_env or {})
    done = subprocess.run(
        [sys.executable, __file__, "--worker", model, "--steps", str(steps)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tempfile.gettempdir(),  # not a tree's root: its ortcore must come from PYTHONPATH alone
        timeout=1800,
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"{tree} {model}: exit {done.returncode}: {done.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout of the earlier commit (git worktree add)")
    parser.add_argument("--after", type=Path, default=ROOT, help="the later tree (default: this checkout)")
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="set in both sides' workers (repeatable)"
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    if args.before is None:
        parser.error("--before is required")
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    bad = [e for e in args.env if "=" not in e]
    if bad:
        parser.error(f"--env {bad[0]!r} is not NAME=VALUE")
    extra_env = dict(e.split("=", 1) for e in args.env)
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as shim:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for model in args.models.split(","):
                for side in order:
                    got = run_side(sides[side], model, args.steps, Path(shim), extra_env)
                    results.setdefault(model, {}).setdefault(side, []).append(got)
                    print(f"round {r} {model:5} {side:6} {json.dumps(got)}", flush=True)
    print(f"\nCPU: {cpu_name()}, {os.cpu_count()} logical cores")
    print(f"{'model':6} {'side':6} {'first step s':>12} {'steady ms':>10} {'min ms':>8}")
    summary = {}
    for model, by_side in results.items():
        for side, runs in by_side.items():
            first = min(x["first_step_s"] for x in runs)
            steady = statistics.median(x["steady_ms"] for x in runs)
            low = min(x["min_ms"] for x in runs)
            summary.setdefault(model, {})[side] = {"first_step_s": first, "steady_ms": steady, "min_ms": low}
            print(f"{model:6} {side:6} {first:12.2f} {steady:10.1f} {low:8.1f}")
        b, a = summary[model]["before"], summary[model]["after"]
        print(
            f"{model:6} after/before: first step x{a['first_step_s'] / b['first_step_s']:.2f}, "
            f"steady x{a['steady_ms'] / b['steady_ms']:.3f}, min x{a['min_ms'] / b['min_ms']:.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"cpu": cpu_name(), "results": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
