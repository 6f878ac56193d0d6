"""What ``ortcore doctor`` checks: versions, ONNX Runtime's training bindings, the environment, the plugins, and one
training step of a tiny model against PyTorch. Plain data (:class:`Finding`); :mod:`.commands` prints it."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from ortcore_plugins.services.machine import describe_machine, machine_line


@attrs.frozen
class Finding:
    """One check's result. A finding with a fix to suggest found something to fix: it is a warning or an error,
    never "ok" (``ortcore doctor`` would print "ok" and then "fix:" for the same check)."""

    level: str = attrs.field(validator=attrs.validators.in_(("ok", "warning", "error")))
    what: str
    fix: str = ""

    def __attrs_post_init__(self) -> None:
        if self.level == "ok" and self.fix:
            raise ValueError(f"an 'ok' finding suggests no fix: {self.what!r} has fix {self.fix!r}")


def doctor(host: Any, load_error: Exception | None = None, env: Mapping[str, str] | None = None) -> list[Finding]:
    """Versions, bindings, environment and plugin problems, each with a fix."""
    env = os.environ if env is None else env
    findings: list[Finding] = []
    import onnx
    import torch

    findings.append(
        Finding("ok", f"python {sys.version.split()[0]}, torch {torch.__version__}, onnx {onnx.__version__}")
    )
    # Speed depends on the CPU more than on anything else: every number should say where it was measured.
    findings.append(Finding("ok", f"machine: {machine_line(describe_machine())}"))
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state as C
    except ImportError as e:
        findings.append(
            Finding("error", f"onnxruntime does not import: {e}", "pip install onnxruntime-training-cpu==1.19.2")
        )
        return findings
    missing = [n for n in ("OrtModuleGraphBuilder", "TrainingAgent", "PartialGraphExecutionState") if not hasattr(C, n)]
    if missing:
        findings.append(
            Finding(
                "error",
                f"onnxruntime {onnxruntime.__version__} has no training bindings ({', '.join(missing)} missing)",
                "pip uninstall -y onnxruntime && pip install onnxruntime-training-cpu==1.19.2 (or onnxruntime-training for CUDA)",
            )
        )
    else:
        findings.append(
            Finding(
                "ok",
                f"onnxruntime {onnxruntime.__version__} with training bindings, providers {onnxruntime.get_available_providers()}",
            )
        )
    wheels = [
        d
        for d in ("onnxruntime", "onnxruntime-training", "onnxruntime-training-cpu", "onnxruntime-gpu")
        if _installed(d)
    ]
    if len(wheels) > 1:
        findings.append(
            Finding(
                "warning",
                f"several onnxruntime wheels are installed ({', '.join(wheels)}); they overwrite each other's files",
                "keep one: pip uninstall " + " ".join(w for w in wheels if "training" not in w),
            )
        )
    if torch.cuda.is_available() and "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        findings.append(
            Finding(
                "warning",
                "torch sees a GPU but onnxruntime has no CUDA provider",
                "pip install 'ortcore[cuda]' (onnxruntime-training)",
            )
        )
    if "GOMP_SPINCOUNT" not in env and "OMP_WAIT_POLICY" not in env:
        findings.append(
            Finding(
                "warning",
                "GOMP_SPINCOUNT is not set: torch's OpenMP threads spin after each op and steal the cores ORT's kernels "
                "need (ortcore then runs PyTorch's kernels inside ORT single-threaded, which recovers most of it)",
                "export GOMP_SPINCOUNT=10000 before starting Python (or import ortcore before torch, which sets it)",
            )
        )
    if load_error is not None:
        findings.append(Finding("error", f"configuration: {load_error}", "fix the named key or variable"))
    findings.append(_gradient_audit_finding(host))
    if host is not None:
        for unread in host.unread_env_vars(env):  # a typo, or the variable of a plugin that is off
            findings.append(Finding("warning", unread.problem, unread.fix))
        for name, record in sorted(host.records.items()):
            if record.status == "failed":
                findings.append(
                    Finding(
                        "error",
                        f"plugin {name!r} from {record.distribution!r} failed to import: {record.error}",
                        f"reinstall {record.distribution}, or add it to [plugins] disable in ortcore.toml",
                    )
                )
    return findings


def _gradient_audit_finding(host: Any) -> Finding:
    """Whether new graphs are audited against PyTorch (on by default); switched off, a warning with the way back on
    (a wrong gradient then goes unnoticed and unrepaired)."""
    if host is not None and host.config.core.verify_gradients:
        source = host.config.sources.get("core.verify_gradients", "default")
        return Finding(
            "ok", f"gradient audit on (verify_gradients, from {source}): each new training graph is checked once"
        )
    source = host.config.sources.get("core.verify_gradients", "default") if host is not None else "default"
    return Finding(
        "warning",
        f"gradient audit off (verify_gradients, from {source}): new graphs are not checked against PyTorch, and a "
        "graph ORT computes wrongly is not repaired",
        "unset ORTCORE_VERIFY_GRADIENTS (or verify_gradients = true in ortcore.toml) for a model's first runs; see "
        "docs/gradient_audit.md",
    )


def _installed(distribution: str) -> bool:
    import importlib.metadata

    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def smoke_test() -> Finding:
    """Train one step of a tiny model in ORT and compare with torch."""
    import copy

    import torch

    from ortcore.api import ORTModule

    try:
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2)
        )
        reference = copy.deepcopy(model)
        wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
        x = torch.randn(3, 4)
        wrapped(x).square().sum().backward()
        reference(x).square().sum().backward()
        worst = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    except Exception as e:  # the doctor reports any failure instead of crashing
        return Finding(
            "error",
            f"a one-step training smoke test failed: {type(e).__name__}: {e}",
            "run with ORTMODULE_LOG_LEVEL=INFO for details",
        )
    level = "ok" if worst < 1e-5 else "error"
    return Finding(level, f"one training step in ONNX Runtime matches torch (max gradient difference {worst:.1e})")
