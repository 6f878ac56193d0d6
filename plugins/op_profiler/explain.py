"""Both sides on a benchmark model (:func:`explain_bench`) and the tables that show them (:func:`render_explain`,
:func:`render_profile`, :func:`format_profile`)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import attrs

from ortcore.api import format_table

from .categories import CATEGORIES
from .steps import StepClock, active, phase

#: The keys of :func:`explain_bench`'s result.
EXPLAIN_KEYS: tuple[str, ...] = (
    "model",
    "settings",
    "versions",
    "categories",
    "ort_ops",
    "eager_ops",
    "ort_calls",
    "outside",
    "step_ms",
    "losses",
    "placement",
)


def _bench_step(
    runner: Any, optimizer: Any, batches: list[dict[str, Any]], losses: list[float], amp: str | None = None
) -> Callable[[], None]:
    """One training step as ``the bench plugin's ``run_worker```` runs it, its phases marked, the next batch each call;
    with ``amp`` (a dtype name, ``"bfloat16"``) the forward under ``torch.autocast("cpu", dtype=...)``."""
    import torch

    batch_iter = itertools.cycle(batches)
    dtype = getattr(torch, amp) if amp else None

    def step() -> None:
        batch = next(batch_iter)
        with phase("forward"), torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = runner(**batch).loss
        with phase("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
        losses.append(loss.item())

    return step


def _evolve(cfg: Any, **changes: Any) -> Any:
    return attrs.evolve(cfg, **changes) if attrs.has(type(cfg)) else dataclasses.replace(cfg, **changes)


def _as_dict(cfg: Any) -> dict[str, Any]:
    return attrs.asdict(cfg) if attrs.has(type(cfg)) else dataclasses.asdict(cfg)


def _versions() -> dict[str, str]:
    import onnxruntime
    import torch
    import transformers

    from ortcore.api import ORTCORE_VERSION as ortcore_version

    return {
        "ortcore": ortcore_version,
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


def explain_bench(model_name: str, cfg: Any, steps: int = 3, warmup: int = 2, amp: str | None = None) -> dict[str, Any]:
    """Train a benchmark model in PyTorch eager and under ortcore in this process (same seed, same batches, AdamW
    as ``the bench plugin's ``run_worker````), profile ``steps`` steps after ``warmup`` on each side, then run ``steps``
    more unprofiled, and compare where the time goes. The two sides' steps alternate, so that a change of load on
    the machine falls on both alike.

    ``amp`` (``"bfloat16"`` or ``"float16"``; ``ortcore bench --amp``) runs both sides' forward under
    ``torch.autocast("cpu", dtype=...)``: the autocast step, profiled.

    ``cfg`` is an ``ortcore_plugins.services.example_models.BenchConfig``. Returns a JSON-able dict with the keys of :data:`EXPLAIN_KEYS`:

    - ``categories``: one row per op category: ``category``, ``runs_on`` (ortcore's kernels: ORT, PyTorch),
      ``ort_count`` (kernels per step), ``ort_fw_ms``, ``ort_bw_ms``, ``ort_total_ms``, ``eager_fw_ms``,
      ``eager_bw_ms``, ``eager_total_ms``, ``ratio`` (ortcore / eager); ms are per step. The ``optimizer`` row is the
      unprofiled wall (median over the steps) of ``optimizer.step()`` and ``zero_grad()`` on both sides;
    - ``ort_ops`` / ``eager_ops``: the rows per op kind of :func:`profile_steps` / :func:`profile_eager_steps`;
    - ``ort_calls``: per ORT call kind (forward, backward): calls, wall, kernel and outside-kernel ms per step;
    - ``outside``: ``{"ortcore": ..., "eager": ...}``, the step split (phase walls, kernels or ops, the rest);
    - ``step_ms``: ``{"ortcore"|"eager": {"profiled": [...], "unprofiled": [...]}}``;
    - ``losses``: each side's loss per step (profiling changes no numerics: they match as unprofiled runs do);
    - ``settings`` (the config, steps, warm-up, threads, ``GOMP_SPINCOUNT``, disabled plugins), ``versions``.
    """
    import torch
    import transformers

    from ortcore.api import ORTModule
    from ortcore_plugins.services.example_models import build_model, make_batches

    from .eager_side import EagerProfile
    from .ort_side import OrtProfile

    if steps < 1 or warmup < 1:
        raise ValueError(f"steps and warmup must be >= 1, got steps={steps}, warmup={warmup}")
    if amp not in (None, "bfloat16", "float16"):
        raise ValueError(f"amp must be None, 'bfloat16' or 'float16', got {amp!r}")
    transformers.logging.set_verbosity_error()
    needed = warmup + 2 * steps
    batches = make_batches(model_name, _evolve(cfg, steps=max(cfg.steps, needed)))[:needed]

    # Both sides in one process, their steps interleaved (eager, then ortcore, for each step), so that a load
    # change on a shared machine falls on both alike.
    models, optimizers, losses, steps_fn = {}, {}, {}, {}
    for side in ("eager", "ortcore"):
        torch.manual_seed(cfg.seed)  # identical initial weights on both sides
        model = build_model(model_name, cfg)
        model.train()
        optimizers[side] = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        models[side] = ORTModule(model) if side == "ortcore" else model
        losses[side] = []
        steps_fn[side] = _bench_step(models[side], optimizers[side], batches, losses[side], amp)
    eager_profile, ort_profile = EagerProfile(), OrtProfile(models["ortcore"])
    for _ in range(warmup):
        steps_fn["eager"]()
        ort_profile.warm_up(steps_fn["ortcore"])
    for _ in range(steps):
        eager_profile.step(steps_fn["eager"])
        ort_profile.step(steps_fn["ortcore"])
    clean = {side: StepClock() for side in ("eager", "ortcore")}
    for _ in range(steps):
        for side in ("eager", "ortcore"):
            with active(clean[side]), clean[side].step():
                steps_fn[side]()
    if models["ortcore"].fallback_reason:
        raise RuntimeError(f"ortcore fell back to PyTorch on {model_name}: {models['ortcore'].fallback_reason}")
    sides = {
        "eager": {"result": eager_profile.finish(), "clean": clean["eager"], "losses": losses["eager"]},
        "ortcore": {"result": ort_profile.finish(), "clean": clean["ortcore"], "losses": losses["ortcore"]},
    }

    ort, eager = sides["ortcore"]["result"], sides["eager"]["result"]
    ort_clean, eager_clean = (sides[side]["clean"].phase_ms(median=True) for side in ("ortcore", "eager"))
    rows = []
    for name in CATEGORIES:
        o, e = ort["categories"].get(name), eager["categories"].get(name)
        if name == "optimizer":
            ort_total = ort_clean.get("optimizer", 0.0) + ort_clean.get("zero_grad", 0.0)
            eager_total = eager_clean.get("optimizer", 0.0) + eager_clean.get("zero_grad", 0.0)
            row = {"category": name, "runs_on": "PyTorch", "ort_count": None, "ort_fw_ms": None, "ort_bw_ms": None}
            row.update(ort_total_ms=ort_total, eager_fw_ms=None, eager_bw_ms=None, eager_total_ms=eager_total)
        elif o is None and e is None:
            continue
        else:
            row = {
                "category": name,
                "runs_on": o["runs_on"] if o else "",
                "ort_count": o["count"] if o else 0,
                "ort_fw_ms": o["fw_ms"] if o else 0.0,
                "ort_bw_ms": o["bw_ms"] if o else 0.0,
                "ort_total_ms": o["total_ms"] if o else 0.0,
                "eager_fw_ms": e["fw_ms"] if e else 0.0,
                "eager_bw_ms": e["bw_ms"] if e else 0.0,
                "eager_total_ms": (e["fw_ms"] + e["bw_ms"]) if e else 0.0,
            }
        # A ratio of two near-zero times says nothing.
        row["ratio"] = row["ort_total_ms"] / row["eager_total_ms"] if row["eager_total_ms"] >= 0.1 else None
        rows.append(row)

    return {
        "model": model_name,
        "settings": {
            **_as_dict(cfg),
            "profiled_steps": steps,
            "warmup": warmup,
            "amp": amp,
            "torch_threads": torch.get_num_threads(),
            "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
            "ORTCORE_DISABLE_PLUGINS": os.environ.get("ORTCORE_DISABLE_PLUGINS"),
        },
        "versions": _versions(),
        "categories": rows,
        "ort_ops": ort["ops"],
        "eager_ops": eager["ops"],
        "ort_calls": ort["calls"],
        "outside": {
            "ortcore": {**ort["outside"], "phases_ms": ort["phases_ms"], "unprofiled_phases_ms": ort_clean},
            "eager": {**eager["outside"], "phases_ms": eager["phases_ms"], "unprofiled_phases_ms": eager_clean},
        },
        "step_ms": {
            side: {"profiled": sides[side]["result"]["step_ms"], "unprofiled": sides[side]["clean"].step_ms()}
            for side in ("ortcore", "eager")
        },
        "losses": {side: sides[side]["losses"] for side in ("eager", "ortcore")},
        # where each op kind runs and why (model.explain()): the reasons plugins recorded, the kernel choice's
        # measured times among them (aten_fallback's torch_kernels = "auto")
        "placement": [dict(row) for row in models["ortcore"].explain()],
    }


# -- tables ----------------------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def outside_rows(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The step split of :func:`explain_bench`'s result: ``(what, ortcore ms, eager ms)`` per step."""
    o, e = data["outside"]["ortcore"], data["outside"]["eager"]
    calls = data["ort_calls"]
    op, ep = o["phases_ms"], e["phases_ms"]
    fw_call, bw_call = calls.get("forward", {}), calls.get("backward", {})

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    rows = [
        ("step (profiled)", _ms(o["step_ms"]), _ms(e["step_ms"])),
        (
            "step (unprofiled, median)",
            _ms(_median(data["step_ms"]["ortcore"]["unprofiled"])),
            _ms(_median(data["step_ms"]["eager"]["unprofiled"])),
        ),
        ("forward: wall", _ms(op.get("forward")), _ms(ep.get("forward"))),
        ("  kernels (ORT) / op self time (eager)", _ms(fw_call.get("kernel_ms")), _ms(e["forward_op_ms"])),
        ("  in ORT's call, outside kernels", _ms(fw_call.get("outside_kernels_ms")), "—"),
        (
            "  outside ORT's call / outside ops",
            _ms(minus(op.get("forward"), fw_call.get("wall_ms"))),
            _ms(e["forward_outside_ops_ms"]),
        ),
        ("backward: wall", _ms(op.get("backward")), _ms(ep.get("backward"))),
        ("  kernels (ORT) / op self time (eager)", _ms(bw_call.get("kernel_ms")), _ms(e["backward_op_ms"])),
        ("  in ORT's call, outside kernels", _ms(bw_call.get("outside_kernels_ms")), "—"),
        (
            "  outside ORT's call / outside ops",
            _ms(minus(op.get("backward"), bw_call.get("wall_ms"))),
            _ms(e["backward_outside_ops_ms"]),
        ),
        ("optimizer.step", _ms(op.get("optimizer")), _ms(ep.get("optimizer"))),
        ("zero_grad", _ms(op.get("zero_grad")), _ms(ep.get("zero_grad"))),
        (
            "rest of the step (loss.item, Python)",
            _ms(o["step_ms"] - sum(op.values())),
            _ms(e["step_ms"] - sum(ep.values())),
        ),
        (
            "outside kernels / ops, optimizer and zero_grad aside",
            _ms(o["step_ms"] - o["kernel_ms"] - op.get("optimizer", 0.0) - op.get("zero_grad", 0.0)),
            _ms(
                e["step_ms"]
                - e["forward_op_ms"]
                - e["backward_op_ms"]
                - ep.get("optimizer", 0.0)
                - ep.get("zero_grad", 0.0)
            ),
        ),
    ]
    return rows


def render_explain(data: dict[str, Any], top: int = 15) -> Any:
    """A ``rich`` renderable of :func:`explain_bench`'s result: the categories side by side, the step split, and
    ortcore's most expensive op kinds."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    s = data["settings"]
    title = (
        f"{data['model']}: hidden {s['hidden']} × {s['layers']} layers, batch {s['batch']} × {s['seq']}, "
        f"{s['profiled_steps']} profiled steps after {s['warmup']}"
        + (f", forward under autocast {s['amp']}" if s.get("amp") else "")
        + "; ms per step"
    )
    categories = Table(title=f"{title}\nkernels per op category: ortcore vs PyTorch eager", title_justify="left")
    for name, justify in (
        ("category", "left"),
        ("ortcore runs on", "left"),
        ("kernels", "right"),
        ("ort fw", "right"),
        ("ort bw", "right"),
        ("eager fw", "right"),
        ("eager bw", "right"),
        ("ort total", "right"),
        ("eager total", "right"),
        ("ort/eager", "right"),
    ):
        categories.add_column(name, justify=justify)
    for r in data["categories"]:
        style = "red" if r["ratio"] is not None and r["ratio"] > 1.2 and r["ort_total_ms"] >= 1.0 else None
        count = r["ort_count"]
        categories.add_row(
            r["category"],
            r["runs_on"] or "—",
            "—" if count is None else f"{count:g}",
            _ms(r["ort_fw_ms"]),
            _ms(r["ort_bw_ms"]),
            _ms(r["eager_fw_ms"]),
            _ms(r["eager_bw_ms"]),
            _ms(r["ort_total_ms"]),
            _ms(r["eager_total_ms"]),
            _ratio(r["ratio"]),
            style=style,
        )
    split = Table(title="where the step goes (ms per step)", title_justify="left")
    split.add_column("")
    split.add_column("ortcore", justify="right")
    split.add_column("eager", justify="right")
    for row in outside_rows(data):
        split.add_row(*row)
    ops = Table(title=f"ortcore's {top} most expensive op kinds", title_justify="left")
    for name, justify in (
        ("op", "left"),
        ("category", "left"),
        ("runs on", "left"),
        ("per step", "right"),
        ("fw ms", "right"),
        ("bw ms", "right"),
    ):
        ops.add_column(name, justify=justify)
    for r in data["ort_ops"][:top]:
        ops.add_row(r["op"], r["category"], r["runs_on"], f"{r['count']:g}", _ms(r["fw_ms"]), _ms(r["bw_ms"]))
    v = data["versions"]
    costlier = sorted(
        (r for r in data["categories"] if r["ort_total_ms"] - r["eager_total_ms"] >= 1.0),
        key=lambda r: r["eager_total_ms"] - r["ort_total_ms"],
    )
    verdict = Text(
        "ortcore spends more than eager on: "
        + (", ".join(f"{r['category']} (+{r['ort_total_ms'] - r['eager_total_ms']:.1f} ms)" for r in costlier) or "—")
    )
    note = Text(
        f"torch {v['torch']}, onnxruntime {v['onnxruntime']}, {s['torch_threads']} torch threads, "
        f"GOMP_SPINCOUNT={s['GOMP_SPINCOUNT']}; eager times are aten self CPU times under torch.profiler; the "
        "optimizer row is the median unprofiled wall time",
        style="dim",
    )
    parts = [categories, verdict, split, ops]
    reasons = [r for r in data.get("placement", []) if r.get("reason")]
    if reasons:
        why = Table(title="where op kinds run, and why (model.explain())", title_justify="left")
        for name in ("op", "runs on", "forward", "backward", "why"):
            why.add_column(name, justify="right" if name in ("forward", "backward") else "left")
        for r in reasons:
            why.add_row(r["op"], r["runs_on"], str(r["forward"]), str(r["backward"]), r["reason"])
        parts.append(why)
    return Group(*parts, note)


def _profile_rows(result: dict[str, Any], top: int) -> tuple[tuple[str, ...], list[tuple[Any, ...]]]:
    if result["side"] == "ortcore":
        header = ("op", "category", "runs on", "per step", "fw ms", "bw ms")
        rows = [
            (r["op"], r["category"], r["runs_on"], f"{r['count']:g}", _ms(r["fw_ms"]), _ms(r["bw_ms"]))
            for r in result["ops"][:top]
        ]
    else:
        header = ("op", "category", "fw ms", "bw ms", "optimizer ms")
        rows = [
            (r["op"], r["category"], _ms(r["fw_ms"]), _ms(r["bw_ms"]), _ms(r["other_ms"])) for r in result["ops"][:top]
        ]
    return header, rows


def _split_lines(result: dict[str, Any]) -> list[str]:
    o = result["outside"]
    if result["side"] == "ortcore":
        lines = [f"step {o['step_ms']:.1f} ms: ORT calls {o['ort_calls_ms']:.1f} (kernels {o['kernel_ms']:.1f})"]
        for what, c in result["calls"].items():
            lines.append(
                f"  {what}: {c['calls']:g} call(s), {c['wall_ms']:.1f} ms, kernels {c['kernel_ms']:.1f}, "
                f"outside kernels {c['outside_kernels_ms']:.1f}"
            )
        lines.append(
            f"  optimizer {_ms(o['optimizer_ms'])}, zero_grad {_ms(o['zero_grad_ms'])}, "
            f"outside ORT's calls {o['glue_ms']:.1f} ms"
        )
    else:
        lines = [
            f"step {o['step_ms']:.1f} ms: op self time {o['op_ms']:.1f} (forward {o['forward_op_ms']:.1f}, "
            f"backward {o['backward_op_ms']:.1f}, optimizer {o['optimizer_op_ms'] + o['zero_grad_op_ms']:.1f}), "
            f"outside ops {o['outside_ops_ms']:.1f}"
        ]
    return lines


def format_profile(result: dict[str, Any], top: int = 20) -> str:
    """Plain text of one side's result (:func:`profile_steps`, :func:`profile_eager_steps`): categories, the most
    expensive op kinds, the step split; ms per step."""
    if result["side"] == "ortcore":
        cat_header = ("category", "runs on", "kernels", "fw ms", "bw ms")
        cat_rows = [
            (name, c["runs_on"], f"{c['count']:g}", _ms(c["fw_ms"]), _ms(c["bw_ms"]))
            for name, c in result["categories"].items()
        ]
    else:
        cat_header = ("category", "fw ms", "bw ms", "optimizer ms")
        cat_rows = [
            (name, _ms(c["fw_ms"]), _ms(c["bw_ms"]), _ms(c["other_ms"])) for name, c in result["categories"].items()
        ]
    header, rows = _profile_rows(result, top)
    return "\n".join([format_table(cat_header, cat_rows), "", format_table(header, rows), "", *_split_lines(result)])


def render_profile(result: dict[str, Any], top: int = 20) -> Any:
    """A ``rich`` renderable of one side's result: its op kinds table and the step split."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header, rows = _profile_rows(result, top)
    table = Table(title=f"{result['side']}: {result['steps']} profiled steps, ms per step", title_justify="left")
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < 3 and result["side"] == "ortcore" or i < 2 else "right")
    for row in rows:
        table.add_row(*(str(c) for c in row))
    return Group(table, *(Text(line) for line in _split_lines(result)))
