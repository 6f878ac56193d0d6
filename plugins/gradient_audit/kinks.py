"""Is a difference from PyTorch float32 rounding at a ReLU kink? Test the hypothesis in float64.

A ReLU input within rounding of zero lands on either side of the kink depending on how float32 computed it (another
summation order in a batch norm is enough). In a batch-norm network that one element's gradient then spreads over its
whole channel through batch norm's backward and moves weight gradients by percent, while every float32 run is right:
which side PyTorch's float32 took and which side ONNX Runtime's took is chance. Measured on torchvision's densenet121
(96x96, batch 4): moving the input by one ulp moves eager float32 between 0 and 278 of its 364 gradients beyond 1% of
a float64 run.

:func:`explain_by_kinks` reruns the float64 reference with such elements taken on the other side of the kink (the
ReLU's output mask flipped there), one candidate at a time, nearest to zero first, keeping each flip that brings the
float64 run clearly closer to the float32 result under test. The difference is explained when, with the flips kept,
every value is within its allowed distance. A real error (a wrong formula, a lost accumulation) does not go away by
flipping a handful of elements that are each within a few units in the last place of zero.

Used by the gradient audit (:mod:`.audit`) and by the model zoo's judge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ortcore.api import current_tapper

# The ReLU spellings models use; each reaches __torch_function__ as one of these.
RELUS = frozenset({F.relu, torch.relu, torch.relu_, torch.Tensor.relu, torch.Tensor.relu_})
#: "Within rounding of zero": an input this close to zero, relative to the largest input of its call (64 float32 ulp:
#: seventeen blocks of a MobileNetV2 backbone move an input of a DeepLab head's ReLU by 38 ulp of that call's largest).
BAND = 64 * torch.finfo(torch.float32).eps
#: Float64 forward-and-backward runs the search may spend, at most.
MAX_CANDIDATES = 24
#: A flip is kept only when it cuts the summed excess over what each value is allowed by this share.
MIN_GAIN = 0.05


class _NumberedRelus(TorchFunctionMode):
    """Numbers the ReLU calls of a run (from 0, in call order: every mode below numbers them alike) and hands each to
    :meth:`relu`; any other call runs as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in RELUS:
            return func(*args, **kwargs)
        call, self.calls = self.calls, self.calls + 1
        return self.relu(call, func, args, kwargs)

    def relu(self, call: int, func: Any, args: tuple, kwargs: dict) -> Any:
        return func(*args, **kwargs)


class ReluKinks(_NumberedRelus):
    """Numbers the ReLU calls of a run; records each call's inputs near zero (``record``) or flips chosen elements
    of the output mask (``flips``: call number -> flat element indices)."""

    def __init__(self, flips: Mapping[int, list[int]] | None = None, record: bool = False):
        super().__init__()
        self.flips = dict(flips or {})
        self.record = record
        self.candidates: list[tuple[float, int, int]] = []  # (|x| / max|x|, call, flat index)

    def relu(self, call: int, func: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if self.record:
            with torch.no_grad():
                a = x.detach().abs().flatten()
                top = float(a.max()) if a.numel() else 0.0
                if top > 0:
                    near = (a < BAND * top).nonzero().flatten()
                    if near.numel() > MAX_CANDIDATES:  # the call's nearest to zero
                        near = near[a[near].argsort()[:MAX_CANDIDATES]]
                    self.candidates += [(float(a[i]) / top, call, int(i)) for i in near]
        if call not in self.flips:
            return func(*args, **kwargs)
        mask = (x.detach() > 0).to(x.dtype)
        flat = mask.view(-1)
        for i in self.flips[call]:
            flat[i] = 1 - flat[i]
        return x * mask  # out of place, also for relu_: callers use the result


#: A ReLU tap's name: this prefix and the call number (:class:`ReluTaps`).
RELU_TAP = "relu call "
#: Where another run took a ReLU element on the other side of the kink, the float64 run follows it only when the
#: float64 input is this close to zero relative to the call's largest input (:class:`KinksAsTaken`): the distance
#: float32 can drift from float64 through a deep network's forward (a third of the audit's default tolerance,
#: about 2500 float32 ulp), far beyond one kernel's rounding, far below what a wrong formula moves.
TAKEN_BAND = 3e-4


class ReluTaps(TorchFunctionMode):
    """While an exporter traces: every ReLU call's output becomes a tap of ``tapper`` (None: the tapper of the export
    running on this thread, if any: an ORTModule's export for activation subscribers) named :data:`RELU_TAP` + its
    call number, so ONNX Runtime's run shows which side of each kink it took. ``changed()`` names the calls whose
    output a later in-place op overwrote (their tap holds that later value, not the ReLU's)."""

    def __init__(self, tapper: Any = None):
        super().__init__()
        self.tapper = tapper
        self.versions: dict[str, tuple[torch.Tensor, int]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tapper = self.tapper if self.tapper is not None else current_tapper()
        if func in RELUS and isinstance(out, torch.Tensor) and tapper is not None:
            # Numbered by the taps already taken: an exporter that traces twice resets the tapper, and so this.
            call = sum(1 for name in tapper.names if name.startswith(RELU_TAP))
            name = f"{RELU_TAP}{call}"
            tapper.tap(name, out)
            self.versions[name] = (out, out._version)
        return out

    def changed(self) -> set[int]:
        return {relu_call(n) for n, (t, v) in self.versions.items() if t._version != v}


def relu_call(name: str) -> int | None:
    """The call number of a :class:`ReluTaps` tap named ``name``; None for any other name."""
    return int(name[len(RELU_TAP) :]) if name.startswith(RELU_TAP) else None


class KinksAsTaken(_NumberedRelus):
    """A (float64) run that takes each ReLU element on the side another run took: ``positive`` maps a call number
    to that run's ``output > 0``. An element is moved only where its input here lies within :data:`TAKEN_BAND` of
    zero relative to the call's largest input; ``taken`` lists the moved elements, ``refused`` counts the
    disagreements beyond the band (left as this run computes them)."""

    def __init__(self, positive: Mapping[int, torch.Tensor], band: float = TAKEN_BAND):
        super().__init__()
        self.positive = dict(positive)
        self.band = band
        self.taken: list[tuple[int, int]] = []  # (call number, flat element index) of each element moved
        self.refused = 0

    def relu(self, call: int, func: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        want = self.positive.get(call)
        if want is None or tuple(want.shape) != tuple(x.shape):
            return func(*args, **kwargs)
        value = x.detach()
        here = value > 0
        differ = here != want
        if not bool(differ.any()):
            return func(*args, **kwargs)
        near = value.abs() <= self.band * value.abs().max()
        take = differ & near
        self.taken += [(call, int(i)) for i in take.flatten().nonzero().flatten()]
        self.refused += int((differ & ~near).sum())
        mask = torch.where(take, want, here).to(x.dtype)
        return x * mask  # out of place, also for relu_: callers use the result


@attrs.frozen
class KinkExplanation:
    """What :func:`explain_by_kinks` found: whether the flips explain every value, the flips kept, each value's
    distance from the float64 run with those flips, and how many candidates were tried."""

    explained: bool
    flips: tuple[tuple[int, int], ...]  # (ReLU call number, flat element index)
    distances: dict[str, float]
    candidates: int

    def describe(self) -> str:
        return (
            f"{len(self.flips)} ReLU input(s) within rounding of zero taken on the other side of the kink in float64 "
            f"{'explain' if self.explained else 'do not explain'} the difference "
            f"({', '.join(f'{n}: {d:.3g}' for n, d in self.distances.items())})"
        )


def max_distances(target: Mapping[str, torch.Tensor], values: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """``max|target[n] - values[n]|`` (in float64) for each name of ``target``."""
    return {n: float((t.detach().double() - values[n].detach().double()).abs().max()) for n, t in target.items()}


def explain_by_kinks(
    run: Callable[[ReluKinks], Mapping[str, torch.Tensor]],
    target: Mapping[str, torch.Tensor],
    allowed: Mapping[str, float],
    recorded: tuple[ReluKinks, Mapping[str, torch.Tensor]] | None = None,
) -> KinkExplanation:
    """Can flipping near-zero ReLU elements of a float64 run bring it within ``allowed[name]`` (max abs) of every
    ``target[name]``?

    ``run(mode)`` runs the float64 reference with ``mode`` active (a fresh copy of the model each time: nothing it
    does may stay) and returns its values by name (gradients, outputs), at least those of ``target``. ``recorded``:
    a run already made with ``ReluKinks(record=True)`` and its values (not made again).
    """
    names = list(target)

    def excess(d: Mapping[str, float]) -> float:  # how far beyond what is allowed, summed over the values
        return sum(max(d[n] / max(allowed[n], 1e-300) - 1.0, 0.0) for n in names)

    if recorded is None:
        recorder = ReluKinks(record=True)
        recorded = recorder, run(recorder)
    recorder, values = recorded
    best = max_distances(target, values)
    candidates = sorted(recorder.candidates)[:MAX_CANDIDATES]
    flips: dict[int, list[int]] = {}
    for _, call, index in candidates:
        if excess(best) == 0.0:
            break
        trial = {c: list(i) for c, i in flips.items()}
        trial.setdefault(call, []).append(index)
        d = max_distances(target, run(ReluKinks(flips=trial)))
        if excess(d) < (1 - MIN_GAIN) * excess(best):
            flips, best = trial, d
    return KinkExplanation(
        explained=all(best[n] <= allowed[n] for n in names),
        flips=tuple((c, i) for c, indices in sorted(flips.items()) for i in indices),
        distances=best,
        candidates=len(candidates),
    )
