"""Where a cold first training step goes: import, plugin host, fingerprint, export, gradient build, session, audit.

    python benchmarks/first_step_breakdown.py [bert|gpt2]            # this process: one first step, by stage
    python benchmarks/first_step_breakdown.py --compare --rounds 3   # fresh processes, interleaved (see below)

Builds the model of ``ortcore bench``'s default config, wraps it in ``ORTModule`` and times one AdamW step, with the
build pipeline's stages and the gradient audit timed separately (each stage's function is wrapped with a timer for
this process only). The environment decides the rest: ``ORTCORE_VERIFY_GRADIENTS=0`` switches the audit off,
``ORTMODULE_CACHE_DIR`` makes a second run warm (export cache and recorded audit verdict).

``--compare`` runs each (model, variant) in a fresh child process whose environment it sets explicitly, the variants
interleaved within each round (the order rotating from round to round, so a machine whose load changes affects all
alike): ``eager`` (PyTorch alone), ``off``/``on`` cold (the audit off/on, an empty cache directory each) and then
``off``/``on`` warm (a second process on the directory the cold run filled), and ``on-warm-reaudit``, a warm process
that audits again (the recorded verdict removed first; it records it again). It prints the median wall and CPU
seconds of each first step, the ratios to the audit-off run of the same round, the load and the CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (module[:class], function, label): the stages timed, each by wrapping the function that does it.
STAGES = (
    ("ortcore.pipeline", "graph_description", "fingerprint (module digest included)"),
    ("torch.onnx", "export", "torch.onnx.export"),
    ("ortcore.pipeline", "export_graph", "export (torch.onnx.export + graph passes)"),
    ("ortcore.pipeline", "build_graph", "ORT gradient build"),
    ("ortcore.pipeline:Pipeline", "_run_gradient_graph_passes", "gradient-graph passes"),
    ("ortcore.pipeline:Pipeline", "_plan", "session plan"),
    ("ortcore.pipeline:Pipeline", "_create", "session creation"),
    ("ortcore_plugins.gradient_audit.audit", "audit_with_verdicts", "gradient audit (or its recorded verdict)"),
    # The audit of the user's own step (gradient_audit.own_step): the three parts add to the audit's total.
    ("ortcore_plugins.gradient_audit.own_step", "start", "gradient audit (or its recorded verdict)"),
    ("ortcore_plugins.gradient_audit.own_step:OwnStep", "outputs", "gradient audit (or its recorded verdict)"),
    ("ortcore_plugins.gradient_audit.own_step:OwnStep", "gradients", "gradient audit (or its recorded verdict)"),
    ("ortcore_plugins.gradient_audit.own_step", "start", "  audit, the step itself: PyTorch's forward"),
    ("ortcore_plugins.gradient_audit.own_step:OwnStep", "outputs", "  audit, the step itself: outputs compared"),
    ("ortcore_plugins.gradient_audit.own_step:OwnStep", "gradients", "  audit, the step itself: backward, comparison"),
    ("ortcore_plugins.gradient_audit.audit", "_run_torch", "  audit: PyTorch's forward and backward"),
    ("ortcore_plugins.gradient_audit.audit", "_run_ort", "  audit: ONNX Runtime's forward and backward"),
    ("ortcore_plugins.gradient_audit.audit", "_compare_sides", "  audit: comparison"),
    ("ortcore_plugins.gradient_audit.audit", "_judged_against_float64", "  audit: float64 and rounding runs"),
    ("ortcore_plugins.gradient_audit.verdicts", "verdict_key", "  audit: verdict key"),
)

VARIANTS = ("eager", "off", "on", "off-warm", "on-warm", "on-warm-reaudit")


def stage_owner(path: str) -> Any:
    """``module`` or ``module:Class`` as the object whose attribute is wrapped."""
    import importlib

    module, _, cls = path.partition(":")
    owner = importlib.import_module(module)
    return getattr(owner, cls) if cls else owner


def _timed(owner: Any, attribute: str, label: str, into: dict[str, float]) -> None:
    function: Callable[..., Any] = getattr(owner, attribute)

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            into[label] = into.get(label, 0.0) + time.perf_counter() - start

    setattr(owner, attribute, timed)


def cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in info.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"


def one_step(model_name: str, eager: bool) -> dict[str, Any]:
    """One cold first step in this process; the times in seconds."""
    import torch

    from ortcore_plugins.services.example_models import BenchConfig, build_model, make_batches

    cfg = BenchConfig()
    torch.manual_seed(cfg.seed)
    model = build_model(model_name, cfg)
    model.train()
    batch = make_batches(model_name, cfg)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)

    cpu0 = time.process_time()
    start = time.perf_counter()
    stages: dict[str, float] = {}
    if not eager:
        import torch.onnx  # noqa: F401

        import ortcore.pipeline  # noqa: F401

        for owner, attribute, label in STAGES:
            _timed(stage_owner(owner), attribute, label, stages)
    imported = time.perf_counter() - start

    t0 = time.perf_counter()
    wrapped = model
    if not eager:
        from ortcore import ORTModule

        wrapped = ORTModule(model)
    t1 = time.perf_counter()
    loss = wrapped(**batch).loss
    t2 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    t3 = time.perf_counter()
    opt.step()
    t4 = time.perf_counter()
    cpu = time.process_time() - cpu0
    audits = [r.message() for r in getattr(wrapped, "gradient_audits", [])]
    return {
        "model": model_name,
        "first_step_s": imported + t4 - t0,
        "cpu_s": cpu,
        "import_s": imported,
        "host_s": t1 - t0,
        "forward_s": t2 - t1,
        "backward_s": t3 - t2,
        "optimizer_s": t4 - t3,
        "stages_s": stages,
        "audits": audits,
    }


def report(result: dict[str, Any]) -> None:
    ms = 1e3
    print(
        f"{result['model']}: cold first step {result['first_step_s'] * ms:.0f} ms (CPU {result['cpu_s'] * ms:.0f} ms)"
    )
    print(f"  import of the export stack          {result['import_s'] * ms:7.0f} ms")
    print(f"  ORTModule() (plugin host)           {result['host_s'] * ms:7.0f} ms")
    print(f"  first forward                       {result['forward_s'] * ms:7.0f} ms, of which:")
    for label, seconds in result["stages_s"].items():
        print(f"    {label:<44}{seconds * ms:7.0f} ms")
    print(f"  first backward                      {result['backward_s'] * ms:7.0f} ms")
    print(f"  optimizer step                      {result['optimizer_s'] * ms:7.0f} ms")
    for message in result["audits"]:
        print(f"  {message[:160]}")


def _child_env(variant: str, cache: str) -> dict[str, str]:
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "VIRTUAL_ENV", "PYTHONPATH", "TMPDIR", "USER")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env["ORTCORE_VERIFY_GRADIENTS"] = "1" if variant.startswith("on") else "0"
    env["ORTMODULE_CACHE_DIR"] = cache
    return env


def _run_child(model: str, variant: str, cache: str) -> dict[str, Any]:
    if variant == "on-warm-reaudit":  # the warm process as it was before verdicts were recorded
        shutil.rmtree(cache + ".audit-verdicts", ignore_errors=True)
    argv = [sys.executable, __file__, model, "--json"] + (["--eager"] if variant == "eager" else [])
    done = subprocess.run(argv, env=_child_env(variant, cache), capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"{model} {variant} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(models: list[str], rounds: int, out: str | None) -> int:
    print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; load before: {os.getloadavg()}")
    runs: list[dict[str, Any]] = []
    for round_ in range(rounds):
        for model in models:
            with tempfile.TemporaryDirectory(prefix="first-step-") as tmp:
                caches = {"off": os.path.join(tmp, "off"), "on": os.path.join(tmp, "on")}
                cold = ["eager", "off", "on"]
                cold = cold[round_ % 3 :] + cold[: round_ % 3]
                warm = ["off-warm", "on-warm", "on-warm-reaudit"]
                warm = warm[round_ % 3 :] + warm[: round_ % 3]
                for variant in cold + warm:
                    cache = caches.get(variant.split("-")[0], os.path.join(tmp, "eager"))
                    result = _run_child(model, variant, cache)
                    result.update(round=round_, variant=variant, load=os.getloadavg()[0])
                    runs.append(result)
                    print(
                        f"  round {round_} {model:5} {variant:9} first step {result['first_step_s']:6.2f} s, "
                        f"CPU {result['cpu_s']:6.2f} s, audit "
                        f"{result['stages_s'].get('gradient audit (or its recorded verdict)', 0.0):5.2f} s, "
                        f"load {result['load']:.2f}",
                        flush=True,
                    )
    print(f"load after: {os.getloadavg()}")
    print("median over rounds (ratio: to the audit-off cold run of the same round, median of the rounds' ratios)")
    print(f"{'model':6} {'variant':9} {'wall s':>7} {'CPU s':>7} {'audit s':>8} {'wall/off':>9} {'CPU/off':>8}")
    for model in models:
        base = {r["round"]: r for r in runs if r["model"] == model and r["variant"] == "off"}
        for variant in VARIANTS:
            mine = [r for r in runs if r["model"] == model and r["variant"] == variant]
            if not mine:
                continue
            wall = statistics.median(r["first_step_s"] for r in mine)
            cpu = statistics.median(r["cpu_s"] for r in mine)
            audit = statistics.median(r["stages_s"].get("gradient audit (or its recorded verdict)", 0.0) for r in mine)
            ratio = statistics.median(r["first_step_s"] / base[r["round"]]["first_step_s"] for r in mine)
            cratio = statistics.median(r["cpu_s"] / base[r["round"]]["cpu_s"] for r in mine)
            print(f"{model:6} {variant:9} {wall:7.2f} {cpu:7.2f} {audit:8.2f} {ratio:9.2f} {cratio:8.2f}")
    if out:
        Path(out).write_text(json.dumps({"cpu": cpu_name(), "runs": runs}, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="bert", choices=("bert", "gpt2"))
    parser.add_argument("--eager", action="store_true", help="PyTorch alone (no ORTModule), for reference")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--compare", action="store_true", help="fresh processes: eager, audit off/on, cold/warm")
    parser.add_argument("--models", nargs="+", default=["bert", "gpt2"], choices=("bert", "gpt2"))
    parser.add_argument("--rounds", type=int, default=3, help="rounds of --compare (default 3)")
    parser.add_argument("--out", default=None, help="--compare: write every run as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: allowed: an integer >= 1")
    if args.compare:
        return compare(args.models, args.rounds, args.out)
    result = one_step(args.model, args.eager)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
