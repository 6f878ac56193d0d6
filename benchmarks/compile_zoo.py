"""The model zoo under ``torch.compile(backend="ortcore")``: does each model train, with eager's numbers, and how fast.

    python benchmarks/compile_zoo.py [--models bert,gpt2,...] [--modes compile-ortcore,compile,ortcore] [--json r.json]

Each (model, mode) runs in a fresh process (dynamo's caches, ORT's sessions and a crash stay there): the zoo's model
(``tests/zoo/catalog.py``: tiny configs, random weights, dropout off) trains 8 AdamW steps under the mode and in eager
PyTorch from the same weights. Reported: ``pass`` when every step's loss agrees with eager's within rtol 1e-3 and
every parameter's gradient after the first step within 1e-3 of the model's largest gradient (``pytorch`` for compile-ortcore
when that holds but no captured graph ran in ORT) (the zoo harness' float64 reference
and perturbed spreads are stricter: ``pytest -m slow tests/zoo``); ``mismatch`` otherwise; ``error`` with the
exception. Modes: ``compile-ortcore`` (torch.compile, backend="ortcore": each captured graph an ORTModule),
``compile-ortcore-aot`` (the same with ``design="aot_autograd"``: AOTAutograd's forward and backward graphs each an
ORT inference graph), ``compile`` (torch.compile, inductor), ``ortcore`` (ORTModule around the whole model, fallback
disabled). Every row also times eager beside the mode. Also the
graphs dynamo captured, its graph breaks, how many graphs fell back to PyTorch (compile-ortcore), the first step and
the median of steps 4-8 against eager's. The machine is named in the output.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("compile-ortcore", "compile-ortcore-aot", "compile", "ortcore")
STEPS = 8  # losses compared at every step; the step time is the median of steps 4-8 (recompiles settle first)
RTOL = 1e-3


def _wrap(model: Any, mode: str) -> Any:
    import torch

    if mode == "compile-ortcore":
        return torch.compile(model, backend="ortcore")
    if mode == "compile-ortcore-aot":
        return torch.compile(model, backend="ortcore", options={"design": "aot_autograd"})
    if mode == "compile":
        return torch.compile(model)
    from ortcore import ORTModule

    return ORTModule(model, fallback_policy="FALLBACK_DISABLE")


def worker(name: str, mode: str) -> dict[str, Any]:
    import torch

    from tests.zoo.catalogs import models
    from tests.zoo.run_model import BATCH_SEED, LR, SEED

    spec = models("main")[name]
    torch.manual_seed(SEED)
    model = spec.build().train()
    ref = copy.deepcopy(model)
    batch = spec.batch(torch.Generator().manual_seed(BATCH_SEED))
    wrapped = _wrap(model, mode)
    lr = spec.lr or LR
    opt, opt_ref = torch.optim.AdamW(model.parameters(), lr=lr), torch.optim.AdamW(ref.parameters(), lr=lr)
    result: dict[str, Any] = {"model": name, "mode": mode, "status": "pass", "problems": []}
    times, times_ref = [], []
    for step in range(STEPS):
        for side, fn, optimizer, bucket in ((ref, ref, opt_ref, times_ref), (model, wrapped, opt, times)):
            optimizer.zero_grad()
            start = time.perf_counter()
            loss = spec.loss(fn(**spec.inputs(batch)), batch)
            loss.backward()
            optimizer.step() if step else None  # the first step's gradients are compared before any update
            bucket.append(time.perf_counter() - start)
            if side is ref:
                loss_ref = loss.item()
            else:
                loss_mode = loss.item()
        if abs(loss_mode - loss_ref) > RTOL * max(abs(loss_ref), 1e-6):
            result["problems"].append(f"step {step} loss {loss_mode:.6g} vs eager {loss_ref:.6g}")
        if step == 0:
            # Relative to the model's largest gradient: a gradient that is zero in exact arithmetic (a key bias before
            # a softmax, a bias before a batch norm) is rounding noise on both sides, not a scale of its own.
            scale = max((q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None), default=1.0)
            for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
                if (p.grad is None) != (q.grad is None):
                    result["problems"].append(f"gradient of {pname}: {p.grad is None} vs eager {q.grad is None}")
                elif p.grad is not None:
                    err = (p.grad - q.grad).abs().max().item() / max(scale, 1e-8)
                    if err > RTOL:
                        result["problems"].append(f"gradient of {pname}: {err:.2e} of the largest gradient")
            opt.step()
            opt_ref.step()
    if result["problems"]:
        result["status"] = "mismatch"
    result["first_step_s"] = times[0]
    result["steady_ms"] = statistics.median(times[3:]) * 1e3
    result["eager_steady_ms"] = statistics.median(times_ref[3:]) * 1e3
    try:
        from torch._dynamo.utils import counters

        result["graph_breaks"] = sum(counters["graph_break"].values())
    except Exception:
        pass
    if mode.startswith("compile-ortcore"):
        from ortcore_plugins.compile_backend import compiled_graphs

        graphs = compiled_graphs()
        result["graphs"] = len(graphs)
        result["graphs_in_pytorch"] = sum(1 for g in graphs if g.reason_in_pytorch)
        if result["status"] == "pass" and result["graphs"] == result["graphs_in_pytorch"]:
            result["status"] = "pytorch"  # right numbers, but nothing ran in ORT (dynamo captured no graph, say)
    return result


def run(name: str, mode: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    # torchvision's models import it from .zoo-deps themselves (tests/zoo/deps.py): on the path it breaks transformers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("GOMP_SPINCOUNT", "10000")
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, mode]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"model": name, "mode": mode, "status": "timeout", "problems": [f"no result in {timeout:.0f} s"]}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"model": name, "mode": mode, "status": "error", "problems": tail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated zoo models (default: the main zoo)")
    parser.add_argument("--modes", default="compile-ortcore", help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        sys.path.insert(0, str(ROOT))
        try:
            result = worker(*args.worker)
        except Exception as e:
            first = str(e).splitlines()[0][:300] if str(e) else ""
            result = {
                "model": args.worker[0],
                "mode": args.worker[1],
                "status": "error",
                "problems": [f"{type(e).__name__}: {first}"],
            }
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"--modes {bad[0]!r}; allowed: {', '.join(MODES)}")
    sys.path.insert(0, str(ROOT))
    from tests.zoo.catalogs import models

    names = args.models.split(",") if args.models else list(models("main"))
    results = []
    from ortcore_plugins.services.machine import describe_machine, machine_line

    machine = describe_machine()
    print(f"on {machine_line(machine)}", flush=True)
    for name in names:
        for mode in modes:
            r = run(name, mode, args.timeout)
            results.append(r)
            extra = ""
            if "steady_ms" in r:
                extra = (
                    f" first {r['first_step_s']:.2f} s, step {r['steady_ms']:.1f} ms (eager {r['eager_steady_ms']:.1f}),"
                    f" breaks {r.get('graph_breaks', '?')}"
                    + (f", graphs {r['graphs']} ({r['graphs_in_pytorch']} in PyTorch)" if "graphs" in r else "")
                )
            problems = f"  {'; '.join(r['problems'])[:200]}" if r["problems"] else ""
            print(f"{name:28} {mode:16} {r['status']:9}{extra}{problems}", flush=True)
    for mode in modes:
        passed = sum(1 for r in results if r["mode"] == mode and r["status"] == "pass")
        print(f"{mode}: {passed} of {len(names)} pass")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
