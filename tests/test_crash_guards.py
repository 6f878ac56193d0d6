"""ONNX Runtime kernels that kill the process: every case trains under ORTModule in a child process and must end
with torch's values and gradients or a Python exception that says what is wrong, never with a signal.

Classes of trap reviewed (ORT 1.19.2, CPU):

* **shapes read from the graph's static shapes**, which ortcore leaves symbolic: ``AveragePoolGrad`` died of SIGFPE
  (conv -> AvgPool2d -> conv) or returned an empty gradient; average pooling, LpPool (torch writes it with
  ``avg_pool``) and adaptive pooling are now exported in forms whose gradients read shapes at run time;
* **windows fixed for the exporting call's size**: adaptive average and max pooling (the dynamo route gave another
  size the first call's output shape, silently); ``GlobalMaxPool`` has no ORT gradient at all;
* **ceil-mode pooling**: ``MaxPool`` and ``AveragePool`` with ``ceil_mode=True``, whose last window may overhang;
* **zero-size dimensions** (a batch of 0, an empty sequence): ``ConvGrad`` dies of SIGFPE, ``Gemm``'s and
  ``Reshape``'s gradients fail; a training call with an empty input runs in PyTorch, that call only;
* **empty concatenations** (``torch.cat`` with an empty slice, a legacy ``torch.empty(0)``, only empty parts);
* **Upsample/Resize** gradients (ORT has no CPU ``ResizeGrad``: the ``op_routing`` plugin runs them on PyTorch).

All cases of one exporter run in one child, one after another, each printing a JSON verdict; a child that dies of a
signal names the case it was running. Run one case by hand with ``python tests/test_crash_guards.py <case>
[torchscript|dynamo]``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

# Values and gradients against eager PyTorch: pooling written as a convolution or a matrix product sums in another
# order than torch's kernels.
RTOL, ATOL = 1e-4, 1e-5


class Sandwich(nn.Module):
    """conv -> ``body`` -> conv over ``rank`` spatial dimensions: the pooling op's input and output both need
    gradients, as in a real network."""

    def __init__(self, body: nn.Module, rank: int = 2):
        super().__init__()
        conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[rank - 1]
        self.head = conv(3, 4, 3, padding=1)
        self.body = body
        self.tail = conv(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(self.body(self.head(x)))


class Lambda(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)


class AvgPoolModes(nn.Module):
    """Every average-pooling mode torch has, side by side: padding counted or not, ceil mode, a divisor."""

    MODES = (
        dict(kernel_size=3, stride=2, padding=1),
        dict(kernel_size=3, stride=2, padding=1, count_include_pad=False),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True),
        dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False),
        dict(kernel_size=2, stride=3, ceil_mode=True),
        dict(kernel_size=(2, 3), stride=(1, 2), padding=(1, 0), divisor_override=5),
    )

    def __init__(self):
        super().__init__()
        self.head = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.head(x)
        return torch.cat([F.avg_pool2d(h, **mode).flatten(1) for mode in self.MODES], dim=1)


class Concat(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.how == "slice":
            return torch.cat([h, h[:, :0]], dim=1) * 2
        if self.how == "legacy":  # torch skips a 1-D empty tensor in cat, whatever the other ranks
            return torch.cat([h, torch.empty(0)], dim=0) * 2
        return torch.cat([h[:, :0], h[:, :0]], dim=1).sum() + h.sum()


def _with_indices(pool: Callable[..., tuple[torch.Tensor, torch.Tensor]], size: tuple[int, ...]) -> nn.Module:
    def fn(x: torch.Tensor) -> torch.Tensor:
        values, indices = pool(x, size, return_indices=True)
        return values * 2 + indices.to(values.dtype)

    return Lambda(fn)


# name -> (model factory, input shapes of the steps, expected): "ort" trains in ORT with torch's values and gradients
# (no fallback, no repair); "fallback" runs in PyTorch after one warning (with torch's values and gradients);
# "either" is one of the two; otherwise a regex the error must match.
# A training call with an empty input runs in PyTorch, that call only: torch's values and gradients, no fallback.
EMPTY = "empty call in pytorch"
CASES: dict[str, tuple[Callable[[], nn.Module], list[tuple[int, ...]], str]] = {
    # shapes from the graph's static shapes: AveragePoolGrad
    "avg_pool2d": (lambda: Sandwich(nn.AvgPool2d(2)), [(2, 3, 8, 8), (3, 3, 6, 10)], "ort"),
    "avg_pool1d": (lambda: Sandwich(nn.AvgPool1d(3, 2, 1), rank=1), [(2, 3, 8), (3, 3, 9)], "ort"),
    "avg_pool3d": (lambda: Sandwich(nn.AvgPool3d(2), rank=3), [(2, 3, 4, 4, 4), (1, 3, 6, 4, 5)], "ort"),
    "avg_pool_modes": (AvgPoolModes, [(2, 3, 8, 9), (1, 3, 7, 7)], "ort"),
    "avg_pool2d_ceil": (
        lambda: Sandwich(nn.AvgPool2d(3, 2, 1, ceil_mode=True, count_include_pad=False)),
        [(2, 3, 8, 8), (1, 3, 7, 9)],
        "ort",
    ),
    # LpPool: torch computes it with avg_pool
    "lp_pool2d": (lambda: Sandwich(nn.Sequential(nn.ReLU(), nn.LPPool2d(2, 2))), [(2, 3, 8, 8), (1, 3, 6, 6)], "ort"),
    "lp_pool1d": (
        lambda: Sandwich(nn.Sequential(nn.ReLU(), nn.LPPool1d(3, 2)), rank=1),
        [(2, 3, 8), (1, 3, 10)],
        "ort",
    ),
    # adaptive pooling: GlobalAveragePool, windows fixed for one size, GlobalMaxPool
    "adaptive_avg_to_1": (lambda: Sandwich(nn.AdaptiveAvgPool2d(1)), [(2, 3, 8, 8), (3, 3, 5, 7)], "ort"),
    "adaptive_avg_divisible": (lambda: Sandwich(nn.AdaptiveAvgPool2d(2)), [(2, 3, 8, 8), (3, 3, 6, 4)], "ort"),
    "adaptive_avg_uneven": (lambda: Sandwich(nn.AdaptiveAvgPool2d((3, 2))), [(2, 3, 8, 7), (1, 3, 5, 5)], "ort"),
    "adaptive_avg_1d": (lambda: Sandwich(nn.AdaptiveAvgPool1d(3), rank=1), [(2, 3, 8), (1, 3, 10)], "ort"),
    "adaptive_avg_3d": (
        lambda: Sandwich(nn.AdaptiveAvgPool3d((2, 3, 1)), rank=3),
        [(2, 3, 4, 6, 5), (1, 3, 5, 7, 3)],
        "ort",
    ),
    "adaptive_avg_unbatched": (
        lambda: Lambda(lambda x: F.adaptive_avg_pool2d(x, (3, 2)) * 2),
        [(3, 8, 7), (3, 5, 5)],
        "ort",
    ),
    "global_max_pool": (lambda: Sandwich(nn.AdaptiveMaxPool2d(1)), [(2, 3, 8, 8), (3, 3, 5, 7)], "ort"),
    "adaptive_max_divisible": (lambda: Sandwich(nn.AdaptiveMaxPool2d(2)), [(2, 3, 8, 8), (3, 3, 6, 4)], "ort"),
    "adaptive_max_indices": (
        lambda: _with_indices(F.adaptive_max_pool2d, (3, 2)),
        [(2, 3, 8, 7), (1, 3, 5, 5)],
        "ort",
    ),
    "adaptive_max_3d_indices": (
        lambda: _with_indices(F.adaptive_max_pool3d, (3, 2, 1)),
        [(2, 3, 4, 8, 7), (1, 3, 3, 5, 5)],
        "ort",
    ),
    # return_indices=True: max_pool<n>d_with_indices (torch's own symbolic writes MaxPoolGrad: the process died)
    "max_pool2d_indices": (lambda: _with_indices(F.max_pool2d, 2), [(2, 3, 8, 8), (1, 3, 6, 10)], "ort"),
    "max_pool1d_indices": (
        lambda: Lambda(lambda x: (lambda v, i: v * 2 + i.to(v.dtype))(*F.max_pool1d(x, 3, 2, 1, return_indices=True))),
        [(2, 3, 9), (1, 3, 7)],
        "ort",
    ),
    "max_pool3d_indices_ceil": (
        lambda: Lambda(
            lambda x: (lambda v, i: v * 2 + i.to(v.dtype))(*F.max_pool3d(x, 2, 2, 0, 1, True, return_indices=True))
        ),
        [(2, 3, 5, 4, 5), (1, 3, 3, 5, 4)],
        "ort",
    ),
    "max_unpool": (
        lambda: Lambda(lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2) * 3),
        [(2, 3, 8, 8), (1, 3, 6, 4)],
        "either",
    ),
    # ceil mode
    "max_pool2d_ceil": (lambda: Sandwich(nn.MaxPool2d(3, 2, ceil_mode=True)), [(2, 3, 8, 8), (1, 3, 7, 9)], "ort"),
    # zero-size dimensions
    "batch_0_conv": (lambda: Sandwich(nn.ReLU()), [(2, 3, 4, 4), (0, 3, 4, 4)], EMPTY),
    "batch_0_conv1d": (lambda: Sandwich(nn.ReLU(), rank=1), [(2, 3, 4), (0, 3, 4)], EMPTY),
    "batch_0_linear": (
        lambda: nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Linear(5, 2)),
        [(2, 4), (0, 4)],
        EMPTY,
    ),
    "batch_0_first_call": (lambda: Sandwich(nn.ReLU()), [(0, 3, 4, 4), (2, 3, 4, 4)], EMPTY),
    "empty_sequence": (
        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
        [(2, 3, 8), (2, 0, 8)],
        EMPTY,
    ),
    # empty concatenations
    "cat_empty_slice": (lambda: Concat("slice"), [(2, 4), (3, 4)], "ort"),
    "cat_legacy_empty": (lambda: Concat("legacy"), [(2, 4), (3, 4)], "ort"),
    # Only empty parts: on the TorchScript route ORT's ConcatTraining gradient fails its first step ("Missing Input:
    # per_input_length") and the model runs in PyTorch after one warning; the dynamo route's optimizer removes the
    # empty Concat.
    "cat_all_empty": (lambda: Concat("all"), [(2, 4), (3, 4)], "either"),
    # Resize: no CPU ResizeGrad, routed to PyTorch's kernel inside the graph
    "upsample_nearest": (lambda: Sandwich(nn.Upsample(scale_factor=2)), [(2, 3, 4, 4), (1, 3, 3, 5)], "ort"),
    "upsample_bilinear": (
        lambda: Sandwich(nn.Upsample(scale_factor=2, mode="bilinear")),
        [(2, 3, 4, 4), (1, 3, 3, 5)],
        "ort",
    ),
}


# -- the child ------------------------------------------------------------------------------------------------------


def _mismatch(what: str, actual: torch.Tensor | None, expected: torch.Tensor | None) -> str | None:
    if actual is None or expected is None:
        return None if actual is None and expected is None else f"{what}: None against a tensor"
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} against torch's {tuple(expected.shape)}"
    if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
        return f"{what}: largest difference {(actual - expected).abs().max().item():.3g}"
    return None


def run_case(name: str, exporter: str) -> dict[str, Any]:
    """Train case ``name`` for its steps beside an eager copy; the verdict as a dict."""
    from ortcore import ORTModule

    build, shapes, _ = CASES[name]
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter=exporter)
    try:
        for step, shape in enumerate(shapes):
            x = torch.randn(*shape, requires_grad=True)
            x_ref = x.detach().clone().requires_grad_()
            y, y_ref = ort(x), reference(x_ref)
            if isinstance(y, tuple):
                y, y_ref = y[0], y_ref[0]
            problem = _mismatch(f"step {step} output", y.detach(), y_ref.detach())
            if problem is None:
                weights = torch.randn_like(y_ref)
                (y * weights).sum().backward()
                (y_ref * weights).sum().backward()
                pairs = [("input", x.grad, x_ref.grad)]
                pairs += [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), reference.parameters())]
                problem = next((m for n, a, b in pairs if (m := _mismatch(f"step {step} gradient of {n}", a, b))), None)
            if problem is not None:
                return {"verdict": "mismatch", "why": problem}
            model.zero_grad()
            reference.zero_grad()
    except Exception as e:
        return {"verdict": "raised", "why": f"{type(e).__name__}: {e}"}
    counters = ort.state_machine.counters
    repairs = len(getattr(ort._ortcore, "repairs", ()))
    return {"verdict": "matched", "fallbacks": counters.fallbacks, "repairs": repairs}


def _child(names: list[str], exporter: str) -> None:
    for name in names:
        print(f"START {name}", flush=True)
        print(f"VERDICT {name} {json.dumps(run_case(name, exporter))}", flush=True)


# -- the tests ------------------------------------------------------------------------------------------------------


def _run_children(names: list[str], exporter: str) -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ORTMODULE_", "ORTCORE_"))}
    done = subprocess.run(
        [sys.executable, __file__, ",".join(names), exporter],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    verdicts = {}
    started = None
    for line in done.stdout.splitlines():
        if line.startswith("START "):
            started = line.split()[1]
        elif line.startswith("VERDICT "):
            _, name, verdict = line.split(" ", 2)
            verdicts[name] = json.loads(verdict)
            started = None
    if done.returncode != 0:
        # A negative status is a signal (SIGFPE is -8): name the case that was running.
        pytest.fail(
            f"the child ended with status {done.returncode} while running case {started!r} on the {exporter} route; "
            f"stderr: {done.stderr[-2000:]}"
        )
    return verdicts


def _check(verdicts: dict[str, dict[str, Any]], exporter: str, names: list[str]) -> None:
    failures = []
    for name in names:
        expected = CASES[name][2]
        verdict = verdicts.get(name)
        if verdict is None:
            failures.append(f"{name}: no verdict")
        elif expected == "ort":
            if verdict["verdict"] != "matched" or verdict["fallbacks"] or verdict["repairs"]:
                failures.append(f"{name}: expected to train in ORT with torch's gradients, got {verdict}")
        elif expected == "either":
            if verdict["verdict"] != "matched":
                failures.append(f"{name}: expected torch's gradients (in ORT or PyTorch), got {verdict}")
        elif expected == EMPTY:
            if verdict["verdict"] != "matched" or verdict["fallbacks"] or verdict["repairs"]:
                failures.append(f"{name}: expected the empty call in PyTorch and the others in ORT, got {verdict}")
        elif expected == "fallback":
            if verdict["verdict"] != "matched" or not verdict["fallbacks"]:
                failures.append(f"{name}: expected to fall back to PyTorch with torch's gradients, got {verdict}")
        else:
            if verdict["verdict"] != "raised" or not re.search(expected, verdict["why"]):
                failures.append(f"{name}: expected an error matching {expected!r}, got {verdict}")
    assert not failures, f"{exporter} route:\n" + "\n".join(failures)


def test_no_kernel_trap_kills_the_process_torchscript():
    _check(_run_children(list(CASES), "torchscript"), "torchscript", list(CASES))


@pytest.mark.slow  # about 90 s: each case exports through torch.export and onnxscript
def test_no_kernel_trap_kills_the_process_dynamo():
    pytest.importorskip("onnxscript")
    _check(_run_children(list(CASES), "dynamo"), "dynamo", list(CASES))


def test_dynamo_graph_of_a_ceil_mode_pooling_serves_only_sizes_its_trace_holds_for():
    """torch.export traces ceil-mode pooling under a condition on the size that is not a range (``3 * (W // 3) >=
    W``); the graph records the traced size as its only one, so another size gets a graph of its own (it got the
    first one's shapes: ORT's Reshape failed). Values and gradients against torch (rtol 1e-4, atol 1e-5)."""
    pytest.importorskip("onnxscript")
    from ortcore import ORTModule

    model = AvgPoolModes()
    reference = copy.deepcopy(model)
    ort = ORTModule(model, exporter="dynamo")
    for shape in [(2, 3, 8, 9), (1, 3, 7, 7), (3, 3, 8, 9)]:
        x = torch.randn(*shape)
        y, expected = ort(x), reference(x)
        weights = torch.randn_like(expected)
        (y * weights).sum().backward()
        (expected * weights).sum().backward()
        assert _mismatch(f"{shape} output", y.detach(), expected.detach()) is None
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert _mismatch(f"{shape} gradient of {name}", p.grad, q.grad) is None
        model.zero_grad()
        reference.zero_grad()
    # the first call's sizes; the second's, dynamic where it differs (its trace holds for 7 wide only); the third's
    assert ort.state_machine.counters.exports == 3
    assert ort.state_machine.counters.fallbacks == 0


if __name__ == "__main__":
    _child(sys.argv[1].split(","), sys.argv[2] if len(sys.argv) > 2 else "torchscript")
