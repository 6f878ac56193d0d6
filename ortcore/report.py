"""What ``ortcore plugins``, ``ortcore config`` and ``ortcore doctor`` report, as plain data (the CLI prints it)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import attrs

from .config import Config, CoreOptions
from .plugins import PluginHost


@attrs.frozen
class PluginRow:
    name: str
    version: str
    source: str  # "built-in" or the distribution
    enabled: str  # "yes", "no (disabled)", "failed: ..."
    hooks: tuple[str, ...]
    options: tuple[str, ...]


def plugin_rows(host: PluginHost) -> list[PluginRow]:
    rows = []
    for name, record in sorted(host.records.items()):
        if name == "core":
            continue
        if record.status == "loaded":
            enabled = "yes"
        elif record.status == "disabled":
            enabled = "no (disabled)"
        else:
            enabled = f"failed: {record.error}"
        options = ()
        if record.options_class is not None:
            values = host.config.plugin_options(name)
            options = tuple(f"{f.name}={getattr(values, f.name)!r}" for f in attrs.fields(record.options_class))
        rows.append(
            PluginRow(
                name=name,
                version=record.version,
                source="built-in" if record.builtin else record.distribution,
                enabled=enabled,
                hooks=tuple(h for h in host.hooks_of(name)),
                options=options,
            )
        )
    return rows


@attrs.frozen
class ConfigRow:
    key: str
    value: str
    source: str
    env: str
    doc: str


def config_rows(host: PluginHost) -> list[ConfigRow]:
    """Every effective option, where it came from, and its environment variable."""
    config = host.config
    rows = []

    def add(prefix: str, cls: type, values: Any) -> None:
        for f in attrs.fields(cls):
            key = f"{prefix}{f.name}"
            rows.append(
                ConfigRow(
                    key=key,
                    value=_show(getattr(values, f.name)),
                    source=config.sources.get(key, "default"),
                    env=f.metadata.get("env") or "",
                    doc=f.metadata.get("doc", ""),
                )
            )

    add("core.", CoreOptions, config.core)
    for name, record in sorted(host.records.items()):
        if record.options_class is not None and record.enabled:
            add(f"plugins.{name}.", record.options_class, config.plugin_options(name))
    return rows


def _show(value: Any) -> str:
    name = getattr(value, "name", None)
    return name if isinstance(name, str) and not isinstance(value, str) else repr(value)


@attrs.frozen
class Finding:
    level: str  # "ok", "warning", "error"
    what: str
    fix: str = ""


def doctor(host: PluginHost | None, load_error: Exception | None = None, env: Mapping[str, str] | None = None) -> list[Finding]:
    """Versions, bindings, environment and plugin problems, each with a fix."""
    env = os.environ if env is None else env
    findings: list[Finding] = []
    import onnx
    import torch

    findings.append(Finding("ok", f"python {sys.version.split()[0]}, torch {torch.__version__}, onnx {onnx.__version__}"))
    try:
        import onnxruntime
        from onnxruntime.capi import _pybind_state as C
    except ImportError as e:
        findings.append(Finding("error", f"onnxruntime does not import: {e}", "pip install onnxruntime-training-cpu==1.19.2"))
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
        findings.append(Finding("ok", f"onnxruntime {onnxruntime.__version__} with training bindings, providers {onnxruntime.get_available_providers()}"))
    wheels = [d for d in ("onnxruntime", "onnxruntime-training", "onnxruntime-training-cpu", "onnxruntime-gpu") if _installed(d)]
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
            Finding("warning", "torch sees a GPU but onnxruntime has no CUDA provider", "pip install 'ortcore[cuda]' (onnxruntime-training)")
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
        for var, suggestion in host.unread_env_vars(env):
            findings.append(
                Finding(
                    "warning",
                    f"{var} is set but nothing reads it",
                    f"did you mean {suggestion}?" if suggestion else "unset it (see docs/options.md for the variables)",
                )
            )
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


def _gradient_audit_finding(host: PluginHost | None) -> Finding:
    """Whether new graphs are audited against PyTorch (on by default): a note, not a problem, when switched off."""
    if host is not None and host.config.core.verify_gradients:
        source = host.config.sources.get("core.verify_gradients", "default")
        return Finding("ok", f"gradient audit on (verify_gradients, from {source}): each new training graph is checked once")
    source = host.config.sources.get("core.verify_gradients", "default") if host is not None else "default"
    return Finding(
        "ok",
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

    from .module import ORTModule

    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
        reference = copy.deepcopy(model)
        wrapped = ORTModule(model, fallback_policy="FALLBACK_DISABLE")
        x = torch.randn(3, 4)
        wrapped(x).square().sum().backward()
        reference(x).square().sum().backward()
        worst = max((a.grad - b.grad).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    except Exception as e:  # the doctor reports any failure instead of crashing
        return Finding("error", f"a one-step training smoke test failed: {type(e).__name__}: {e}", "run with ORTMODULE_LOG_LEVEL=INFO for details")
    level = "ok" if worst < 1e-5 else "error"
    return Finding(level, f"one training step in ONNX Runtime matches torch (max gradient difference {worst:.1e})")


def load_host() -> tuple[PluginHost | None, Exception | None]:
    """The host as an ORTModule would build it, or the configuration error that prevents it."""
    try:
        return PluginHost(Config.load()), None
    except Exception as e:  # reported by the caller, naming the problem
        return None, e
