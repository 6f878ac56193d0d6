"""Why a zoo model failed, as a cause shared by other models: the categories under docs/models.md's table.

A category is matched against the failure's exception type, first line, message and traceback (in that order of
``Category.patterns``); the first category whose pattern matches wins, and a failure no pattern matches is
``other``. Each category carries a short label for the table cell, a sentence on the cause and, where one exists,
the smallest program that shows the same error without the zoo (``repro``), for whoever fixes the exporter.

    python -m tests.zoo.failures    # run each repro on the dynamo route: does it still fail as described?
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Category:
    """One cause of failure: ``key`` (stable, recorded in the results), a short ``label`` for the table, the
    ``cause`` in a sentence or two, and a minimal ``repro`` (Python source) if there is one."""

    key: str
    label: str
    cause: str
    patterns: tuple[str, ...]
    repro: str = ""

    def matches(self, text: str) -> bool:
        return any(re.search(p, text) for p in self.patterns)


_DATA_DEPENDENT_REPRO = """\
# ORTMODULE_FALLBACK_POLICY=FALLBACK_DISABLE python repro.py  (else ortcore falls back to PyTorch with a warning)
import os

# By default the dynamo route repeats the capture with torch.export.draft_export and takes the branch this batch
# takes (one WARNING names it), and a capture that still fails is repaired with the TorchScript exporter; with both
# off it refuses as torch.export does.
os.environ["ORTCORE_DYNAMO_VALUE_BRANCHES"] = "0"
os.environ["ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR"] = "0"

import torch
import torch.nn.functional as F
from ortcore import ORTModule

class M(torch.nn.Module):  # DebertaV2ForSequenceClassification's loss, shortened
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, labels):
        logits = self.lin(x)
        index = (labels >= 0).nonzero()  # its size is known only at run time: torch.export's unbacked symbol u0
        if index.size(0) > 0:
            return F.cross_entropy(logits, labels)
        return logits.sum() * 0

ORTModule(M(), exporter="dynamo")(torch.randn(2, 4), torch.tensor([0, 2])).backward()
# ... GuardOnDataDependentSymNode: Could not guard on data-dependent expression u0 > 0
"""

CATEGORIES: tuple[Category, ...] = (
    Category(
        key="non_persistent_buffer",
        label="non-persistent buffer becomes a graph input",
        cause=(
            "A buffer registered with `persistent=False` (BERT-style `position_ids`/`token_type_ids`, rotary "
            "`inv_freq`) is not in `state_dict()`, so the dynamo exporter does not pass it as a named state input; "
            "`torch.export` lifts it into a graph input anyway, under its module path, and ortcore refuses an "
            "input it cannot feed. Fixed in the dynamo exporter at db6d06d (such buffers become initializers); "
            "kept so that a return of the error is named."
        ),
        patterns=(r"exported graph has inputs that are neither arguments nor state",),
    ),
    Category(
        key="custom_autograd_function",
        label="custom autograd Function refused",
        cause=(
            "The model calls a `torch.autograd.Function` (BLOOM's `GeLUFunction`) and no plugin runs it on the dynamo "
            "route, which refuses it rather than let ORT differentiate its forward. Since the autograd_function "
            "plugin runs each Function as a PythonOp on this route too (as on the torchscript route), only a model "
            "with that plugin disabled meets this; kept so that a return of the error is named."
        ),
        patterns=(r"calls the custom autograd Function",),
    ),
    Category(
        key="data_dependent_guard",
        label="torch.export: data-dependent control flow",
        cause=(
            "The model branches on a value read from a tensor; in the zoo, in the loss code: DeBERTa-v2's "
            "classification loss tests `(labels >= 0).nonzero().size(0) > 0` (`u0 > 0`), Wav2Vec2ForCTC tests "
            "`labels.max() >= vocab_size` (`Eq(u0, 1)`). `torch.export` cannot decide such a branch for every "
            "input (`GuardOnDataDependentSymNode`). By default the dynamo route captures again with "
            "`torch.export.draft_export` and takes the branch the first batch takes (one WARNING names each "
            "decision), and a capture that still fails is repaired with the TorchScript exporter; a model lands here only "
            "with both off (`ORTCORE_DYNAMO_VALUE_BRANCHES=0`, `ORTCORE_DYNAMO_TORCHSCRIPT_REPAIR=0`: the repro), and "
            "the error names the model's file and line. Written as "
            "`torch.cond`, the branch trains (the control_flow plugin runs it with PyTorch); the TorchScript exporter "
            "traces the branch the example takes."
        ),
        patterns=(r"GuardOnDataDependentSymNode", r"[Cc]ould not guard on data-dependent expression"),
        repro=_DATA_DEPENDENT_REPRO,
    ),
    Category(
        key="op_not_routed",
        label="ORT cannot train an op the routes miss",
        cause=(
            "The graph holds an op ORT 1.19.2 cannot train: no gradient builder, no CPU kernel for its gradient or a "
            "kernel that rejects the case. The op_routing plugin runs the known ones (HardSwish, Einsum, GroupNorm, "
            "ConvTranspose and Resize gradients, bidirectional GRU/LSTM, ...) on PyTorch's kernels on both routes "
            "(on the dynamo route since e9e4f80); an op that meets this is one its routes do not cover yet."
        ),
        patterns=(
            r"gradient builder has not been registered",
            r"[Cc]ould not find an implementation for \w+Grad",
            r"kernel only supports the forward direction",
        ),
    ),
    Category(
        key="no_onnx_function",
        label="no ONNX function for an op",
        cause=(
            "The exported program calls an operator (a library's custom op or an ATen op) that the dynamo "
            "exporter's ONNX registry has no function for (`DispatchError`). Such ops run on PyTorch's kernels "
            "inside the graph on both routes (op_routing and aten_fallback; Mixtral's "
            "`transformers::grouped_mm_fallback` on the dynamo route since e9e4f80); kept so that a return is named."
        ),
        patterns=(r"No ONNX function found for", r"DispatchError"),
    ),
    Category(
        key="duplicate_gradient",
        label="ORT's gradient graph defines a gradient twice",
        cause=(
            "ORT's gradient builder names the gradient of a tensor `<tensor>_grad`; when one tensor reaches a node "
            "by two paths (the same input twice, `x` in `einsum('bsi,ikj,bsj->bsk', x, w, x)`; a shared "
            "`ConstantOfShape`, `Expand` or weight-standardisation `Constant`), it defines that name twice and "
            "refuses its own graph (`Duplicate definition of name`)."
        ),
        patterns=(r"Duplicate definition of name",),
    ),
    Category(
        key="gradient_audit",
        label="gradient audit: ORT differs from PyTorch",
        cause=(
            "ortcore's gradient audit (on by default) compared the first step's outputs and gradients with "
            "PyTorch's, found a difference beyond its tolerance (1e-3 of each tensor's largest value, plus 1e-6) "
            "and no repair removed it, so the step raised. The first difference names the module: a wrong output "
            "(a real bug) or a gradient off by float32 rounding that batch norm amplifies (the zoo itself judges "
            "such a gradient against float64)."
        ),
        patterns=(r"gradient audit: ONNX Runtime differs from PyTorch",),
    ),
    Category(
        key="complex_tensors",
        label="TorchScript exporter: complex tensors",
        cause=(
            "The model computes with complex tensors (`torch.view_as_complex`, `torch.fft.rfft`, `torch.polar`); "
            "ONNX has no complex type and the TorchScript exporter stops at the first one (`ScalarType "
            "ComplexFloat is an unexpected tensor scalar type`). Here the complex code is in the model's own "
            "`forward`, so there is no module smaller than the whole model to run in PyTorch; the error says to move "
            "it into a submodule, which then runs in PyTorch as one node of the ORT graph (as FNet-like models' "
            "filters do: `tests/test_repair.py`)."
        ),
        patterns=(r"ScalarType ComplexFloat is an unexpected", r"ScalarType Complex\w+ is an unexpected"),
    ),
)

OTHER = Category(
    key="other",
    label="other",
    cause="No shared cause recognised; see the model's first error line.",
    patterns=(),
)

MISMATCH = Category(
    key="mismatch",
    label="trains, but not like PyTorch",
    cause="The step ran in ONNX Runtime, but the loss, a gradient or the AdamW loss curve is outside the tolerance.",
    patterns=(),
)

CRASH = Category(
    key="crash",
    label="process killed by a signal",
    cause=(
        "The model's process died (a segmentation fault or an abort) before writing a result; its stderr, with "
        "faulthandler's Python stack, is the first error line's source."
    ),
    patterns=(),
)

TIMEOUT = Category(
    key="timeout",
    label="no result in time",
    cause="The model's process wrote no result before the zoo's per-model timeout and was killed.",
    patterns=(),
)

MOSTLY_PYTORCH = Category(
    key="pytorch",
    label="PyTorch's gradients, but mostly run in PyTorch",
    cause=(
        "The model trains like PyTorch, but less than half of its training graph's nodes, or of its parameters, are "
        "ONNX Runtime's: repairs moved the failing part into a region that holds most of the model."
    ),
    patterns=(),
)

BY_KEY = {c.key: c for c in (*CATEGORIES, OTHER, MISMATCH, CRASH, TIMEOUT, MOSTLY_PYTORCH)}


def categorize(result: dict[str, Any]) -> Category | None:
    """The category of a failed result (None for a pass)."""
    if result["status"] == "pass":
        return None
    special = {"mismatch": MISMATCH, "crash": CRASH, "timeout": TIMEOUT, "pytorch": MOSTLY_PYTORCH}
    if result["status"] in special:
        return special[result["status"]]
    err = result.get("error") or {}
    text = "\n".join(str(err.get(k) or "") for k in ("type", "first_line", "message", "traceback"))
    return next((c for c in CATEGORIES if c.matches(text)), OTHER)


def failure_op(result: dict[str, Any]) -> str | None:
    """The operator a failure names, shortened to what a reader recognises (``aten::foo``, ``transformers.x``)."""
    err = result.get("error") or {}
    text = "\n".join(str(err.get(k) or "") for k in ("first_line", "message"))
    match = (
        re.search(r"OpOverload\(op='([\w.:]+)'", text)
        or re.search(r"(aten::[\w.]+)", text)
        or re.search(r"(\w+?)(?:Training)? and \w+Grad kernel", text)
    )
    return match.group(1) if match else err.get("op")


def run_repro(category: Category, timeout: float = 300) -> tuple[bool, str]:
    """Run ``category.repro`` in its own process; return whether it still fails with the category's error, and the
    last line of its stderr."""
    import subprocess
    import sys

    from .harness import REPO, child_env

    done = subprocess.run(
        [sys.executable, "-c", category.repro],
        cwd=REPO,
        env=child_env("dynamo"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return done.returncode != 0 and category.matches(done.stderr), lines[-1] if lines else ""


def main() -> int:
    """Run every category's repro on the dynamo route: which causes still fail as described."""
    for category in CATEGORIES:
        if category.repro:
            still, last = run_repro(category)
            print(f"{category.key:24s} {'still fails' if still else 'NO LONGER FAILS AS DESCRIBED'}: {last[:200]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
