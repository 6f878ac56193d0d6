"""Run one zoo model under ortcore and check that no tensor it returned changes after the call.

    python -m tests.zoo.output_integrity bert                      # readable summary
    python -m tests.zoo.output_integrity swin --catalog wide --json out.json

The model is built as ``tests.zoo.run_model`` builds it (seed, training mode, the catalog's batch and loss) and runs
``STEPS`` AdamW steps under ortcore (fallback disabled, the default gradient audit on) beside an eager copy. Every
tensor the call returned (each leaf of the output, with its path) is copied when the forward returns and compared
bitwise after ``loss.backward()`` and again after ``optimizer.step()``: after the backward none may differ; after the
step only those whose eager counterpart changed too (a returned parameter or buffer). The result also lists the
outputs each training session hands out as copies (``ortcore.api.copied_outputs``) and the bytes copied per step.

Statuses: ``pass``; ``changed`` (a returned tensor changed: the names, when, by how much); ``error`` (the model did
not run in ORT: not this check's subject, ``tests/zoo/test_zoo.py`` judges it).
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
os.environ.setdefault("ORTMODULE_FALLBACK_POLICY", "FALLBACK_DISABLE")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from tests.zoo.catalogs import DEFAULT_CATALOG, get  # noqa: E402
from tests.zoo.run_model import BATCH_SEED, LR, SEED  # noqa: E402

STEPS = 2


def returned_tensors(output: Any) -> list[tuple[str, torch.Tensor]]:
    """Every tensor leaf of a model's output, with its path (``['logits']``, ``[1]``)."""
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(output)
    return [(torch.utils._pytree.keystr(path) or "<output>", t) for path, t in leaves if isinstance(t, torch.Tensor)]


def _snapshot(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in tensors}


def _changes(tensors: list[tuple[str, torch.Tensor]], snapshot: dict[str, torch.Tensor]) -> dict[str, float]:
    """Path -> largest absolute change (inf for a changed shape or a NaN that moved) of each tensor that changed."""
    changed: dict[str, float] = {}
    for name, t in tensors:
        before, now = snapshot[name], t.detach()
        if before.shape != now.shape or before.dtype != now.dtype:
            changed[name] = float("inf")
        elif not torch.equal(before, now) and not (
            before.is_floating_point() and torch.equal(before.nan_to_num(7.0), now.nan_to_num(7.0))
        ):
            diff = (now.double() - before.double()).abs() if before.is_floating_point() else (now != before).double()
            changed[name] = float(diff.nan_to_num(float("inf")).max()) if diff.numel() else float("inf")
    return changed


def _count_copies() -> dict[str, int]:
    """Counts the bytes the sessions' forwards copy (``TrainingSession.copied_outputs``) from now on."""
    from ortcore.session import TrainingSession

    counted = {"bytes": 0, "forwards": 0}
    forward = TrainingSession._run_forward

    def run_forward(self, feeds):
        results, state = forward(self, feeds)
        counted["forwards"] += 1
        counted["bytes"] += sum(results[i].numel() * results[i].element_size() for i in self.copied_outputs)
        return results, state

    TrainingSession._run_forward = run_forward
    return counted


def run(name: str, catalog: str = DEFAULT_CATALOG) -> dict[str, Any]:
    spec = get(name, catalog)
    result: dict[str, Any] = {"model": name, "catalog": catalog, "exporter": os.environ.get("ORTCORE_EXPORTER", "")}
    import ortcore.api
    from ortcore import ORTModule

    counted = _count_copies()
    t0 = time.perf_counter()
    try:
        torch.manual_seed(SEED)
        model = spec.build().train()
        eager = copy.deepcopy(model)
        ort = ORTModule(model)
        lr = spec.lr or LR
        optimizers = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (ort, eager)]
        gen = torch.Generator().manual_seed(BATCH_SEED)
        violations: list[dict[str, Any]] = []
        returned: list[str] = []
        for step in range(STEPS):
            batch = spec.batch(gen)
            torch.manual_seed(SEED + step)
            out = ort(**spec.inputs(batch))
            torch.manual_seed(SEED + step)
            expected = eager(**spec.inputs(batch))
            mine, theirs = returned_tensors(out), returned_tensors(expected)
            returned = [n for n, _ in mine]
            before, eager_before = _snapshot(mine), _snapshot(theirs)
            spec.loss(out, batch).backward()
            spec.loss(expected, batch).backward()
            for path, by in _changes(mine, before).items():
                violations.append({"output": path, "step": step, "when": "after backward()", "max_change": by})
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
            eager_changed = _changes(theirs, eager_before)
            for path, by in _changes(mine, before).items():
                if path not in eager_changed:
                    violations.append(
                        {"output": path, "step": step, "when": "after optimizer.step()", "max_change": by}
                    )
        sessions = [s for _, s in ort.state_machine._sessions.values() if s.request.build_gradient]
        result["returned"] = returned
        result["copied"] = {k: v for s in sessions for k, v in ortcore.api.copied_outputs(s).items()}
        result["copied_bytes_per_step"] = counted["bytes"] / max(counted["forwards"], 1)
        result["violations"] = violations
        result["status"] = "changed" if violations else "pass"
        if ort.fallback_reason is not None:
            result.update(status="error", error=f"fell back to PyTorch: {ort.fallback_reason}")
    except Exception as e:  # the model did not run in ORT: judged by the zoo's own test
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        result.update(status="error", error=f"{type(e).__name__}: {first[:400]}")
    result["wall_s"] = time.perf_counter() - t0
    return result


def summary(result: dict[str, Any]) -> str:
    head = f"{result['model']} ({result['catalog']}, {result.get('exporter') or 'default route'}): {result['status']}"
    if result["status"] == "error":
        return f"{head}: {result['error']}"
    lines = [head, f"  returned: {', '.join(result['returned']) or '-'}"]
    for name, why in result["copied"].items():
        lines.append(f"  copied {name}: {why}")
    lines.append(f"  bytes copied per step: {result['copied_bytes_per_step']:.0f}")
    for v in result["violations"]:
        lines.append(f"  CHANGED {v['output']} {v['when']} (step {v['step']}, by up to {v['max_change']:.3g})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--catalog", default=DEFAULT_CATALOG)
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args(argv)
    result = run(args.model, args.catalog)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
