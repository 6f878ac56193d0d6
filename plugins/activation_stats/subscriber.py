"""The statistics subscriber and its record format: the one definition the readers (merge, divergence) use.

Layout (format 1, see docs/plugins/activation_stats.md): ``<output_dir>/meta.json`` and, per step,
``<output_dir>/step_<step>/records.jsonl`` (one record a line, written when the step is over), or with
``one_file_per_activation=True`` ``<output_dir>/step_<step>/<order:05d>_<kind>_<safe name>.json``.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import math
import os
import re
import shutil
from typing import Any

import torch

from ortcore.api import SubscriberBase, atomic_write

from .records import FORMAT, KINDS, META_FILE, RECORD_FIELDS, RECORDS_FILE, STEP_DIR_PREFIX  # noqa: F401

logger = logging.getLogger("ortcore.activation_stats")

# -- the record format (records.py: one definition, light enough for the tools to import without torch) -----------
SAMPLES = 8
NAME_LIMIT = 120
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str) -> str:
    """``name`` with characters outside ``[A-Za-z0-9._-]`` replaced by ``_``, at most 120 characters."""
    return _UNSAFE.sub("_", name)[:NAME_LIMIT]


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _json_number(value: float) -> float | str:
    """Strict JSON has no NaN/Inf: non-finite samples are written as the strings "nan", "inf", "-inf"."""
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _write_json(path: str, data: dict[str, Any]) -> None:
    """Write one JSON object atomically (``json.dumps``: the C encoder; ``json.dump`` encodes in Python)."""
    atomic_write(path, json.dumps(data, allow_nan=False))


def _sums(x: torch.Tensor) -> torch.Tensor:
    """min, max, sum, sum of squares, sum of absolute values and zero count of a 1-D floating tensor, in float64.

    Compiled, this is one pass over the tensor (the reductions fuse into one loop, accumulating in float64 without
    a float64 copy); eager, six.
    """
    wide = x.to(torch.float64)
    return torch.stack(
        [
            x.amin().to(torch.float64),
            x.amax().to(torch.float64),
            wide.sum(),
            (wide * wide).sum(),
            wide.abs().sum(),
            (x == 0).sum().to(torch.float64),
        ]
    )


class _Reducer:
    """:func:`_sums`, compiled once per process where a C++ compiler exists, else (or if compiling fails) eager."""

    def __init__(self) -> None:
        self._compiled: Any = None
        self._tried = False

    @property
    def fused(self) -> bool:
        """Whether the compiled kernel is in use."""
        return self._compiled is not None

    def _compile(self) -> None:
        self._tried = True
        if shutil.which(os.environ.get("CXX", "c++")) is None:
            logger.info("activation_stats: no C++ compiler (CXX or c++) found; statistics are computed eagerly")
            return
        try:
            compiled = torch.compile(_sums, dynamic=True)
            probe = torch.tensor([0.0, -2.0, 3.0])
            if compiled(probe).tolist() != [-2.0, 3.0, 1.0, 13.0, 5.0, 1.0]:
                raise RuntimeError("the compiled statistics kernel computed wrong values")
        except Exception as e:  # noqa: BLE001 - any compile failure leaves the eager path, which is correct
            logger.warning("activation_stats: compiling the statistics kernel failed (%s); computing eagerly", e)
            return
        self._compiled = compiled

    def __call__(self, chunk: torch.Tensor, fused: bool) -> list[float]:
        if fused and not self._tried:
            self._compile()
        if fused and self._compiled is not None and chunk.dtype in (torch.float32, torch.float16, torch.bfloat16):
            return self._compiled(chunk).tolist()
        return _sums(chunk).tolist()


_reducer = _Reducer()


def statistics_kernel_fused() -> bool:
    """Whether this process computes statistics with the compiled one-pass kernel (after the first record)."""
    return _reducer.fused


@functools.lru_cache(maxsize=256)
def _sample_indices(numel: int, device: torch.device) -> torch.Tensor:
    """``round(linspace(0, numel - 1, 8))``: evenly spaced flat indices (the same on both sides of a comparison)."""
    return torch.linspace(0, numel - 1, min(SAMPLES, numel)).round().long().to(device)


def tensor_statistics(
    tensor: torch.Tensor, bucket_size: int = 1024**3, run_on_cpu: bool = False, fused: bool = True
) -> dict[str, Any]:
    """Statistics of ``tensor``, accumulated in float64 over chunks of ``bucket_size`` elements.

    min/max/mean/std/abs_mean are over finite values (``None`` if there are none; std needs two, and uses
    torch's default correction of 1); NaN and Inf are counted separately. Non-floating tensors get counts and
    min/max only. A chunk whose min and max are finite holds no NaN or Inf; such chunks (nearly all) take one
    fused pass when ``fused`` (see :class:`_Reducer`).
    """
    if bucket_size < 1:
        raise ValueError(f"bucket_size={bucket_size} must be >= 1")
    flat = tensor.detach().reshape(-1)
    if run_on_cpu:
        flat = flat.cpu()
    numel = flat.numel()
    floating = flat.is_floating_point()
    count, total, total_sq, abs_sum = 0, 0.0, 0.0, 0.0
    zeros = nans = infs = 0
    low: float | None = None
    high: float | None = None
    for start in range(0, numel, bucket_size):
        chunk = flat[start : start + bucket_size]
        if not floating:
            zeros += chunk.numel() - int(torch.count_nonzero(chunk))
            if chunk.is_complex():
                continue
            chunk_low, chunk_high = (v.item() for v in torch.aminmax(chunk.to(torch.int64)))
        else:
            chunk_low, chunk_high, chunk_sum, chunk_sq, chunk_abs, chunk_zeros = _reducer(chunk, fused)
            zeros += int(chunk_zeros)
            if not (math.isfinite(chunk_low) and math.isfinite(chunk_high)):
                nan_mask, inf_mask = torch.isnan(chunk), torch.isinf(chunk)
                nans += int(nan_mask.sum())
                infs += int(inf_mask.sum())
                chunk = chunk[~(nan_mask | inf_mask)]
                if chunk.numel() == 0:
                    continue
                chunk_low, chunk_high, chunk_sum, chunk_sq, chunk_abs, _ = _sums(chunk).tolist()
            total += chunk_sum
            total_sq += chunk_sq
            abs_sum += chunk_abs
            count += chunk.numel()
        low = chunk_low if low is None else min(low, chunk_low)
        high = chunk_high if high is None else max(high, chunk_high)
    mean = std = abs_mean = None
    if floating and count:
        mean = total / count
        abs_mean = abs_sum / count
        if count > 1:
            std = math.sqrt(max(total_sq - total * mean, 0.0) / (count - 1))
    if numel:
        samples = [_json_number(v) if floating else v for v in flat[_sample_indices(numel, flat.device)].tolist()]
    else:
        samples = []
    return {
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "numel": numel,
        "min": low,
        "max": high,
        "mean": mean,
        "std": std,
        "abs_mean": abs_mean,
        "zeros": zeros,
        "nans": nans,
        "infs": infs,
        "samples": samples,
    }


class StatisticsSubscriber(SubscriberBase):
    """Write statistics of every activation and gradient of the subscribed model, one JSON file each.

    Args:
        output_dir: where the records go (per rank, give each rank its own directory).
        start_step: the first step recorded (default: 0).
        end_step: the step at which recording stops, exclusive (default: never).
        override_output_dir: allow a non-empty ``output_dir``; its previous ``step_*`` folders are removed.
            Without it a non-empty ``output_dir`` raises FileExistsError and nothing is deleted.
        run_on_cpu: compute statistics on a CPU copy (a last resort when the device runs out of memory).
        bucket_size: elements per chunk of the float64 computation (bounds its extra memory).
        one_file_per_activation: write each record as its own file as soon as it is computed, instead of one
            ``records.jsonl`` per step when the step is over (one file creation per step, not one per activation:
            on a slow file system that is most of the cost of recording).

    A step's ``records.jsonl`` is written when the next step starts, at ``GlobalSubscriberManager.unsubscribe``,
    at :meth:`flush`, or at interpreter exit.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike,
        start_step: int | None = None,
        end_step: int | None = None,
        override_output_dir: bool = False,
        run_on_cpu: bool = False,
        bucket_size: int = 1024 * 1024 * 1024,
        one_file_per_activation: bool = False,
    ):
        super().__init__(start_step, end_step)
        self.one_file_per_activation = one_file_per_activation
        self._pending: dict[int, list[str]] = {}  # step -> its records as JSON lines, until the step is over
        atexit.register(self.flush)
        if bucket_size < 1:
            raise ValueError(f"bucket_size={bucket_size} must be >= 1")
        self.output_dir = os.fspath(output_dir)
        self.run_on_cpu = run_on_cpu
        self.bucket_size = bucket_size
        self.rank, self.world_size = _rank_and_world()
        self._model: torch.nn.Module | None = None
        self._last: tuple[tuple, torch.Tensor, dict[str, Any]] | None = None
        if os.path.isdir(self.output_dir) and os.listdir(self.output_dir):
            if not override_output_dir:
                raise FileExistsError(
                    f"output_dir {self.output_dir!r} exists and is not empty; pass override_output_dir=True to "
                    "replace its step_* folders, or choose another directory"
                )
            for entry in os.listdir(self.output_dir):
                path = os.path.join(self.output_dir, entry)
                if entry.startswith(STEP_DIR_PREFIX) and os.path.isdir(path):
                    shutil.rmtree(path)
        os.makedirs(self.output_dir, exist_ok=True)

    def on_subscribe(self, model: torch.nn.Module) -> None:
        if self._model is not None and self._model is not model:
            raise ValueError("a StatisticsSubscriber records one model: the records of two would collide")
        self._model = model
        self._write_meta()

    def _write_meta(self) -> None:
        meta = {
            "format": FORMAT,
            "source": self.engine,
            "rank": self.rank,
            "world_size": self.world_size,
            "model": type(self._model).__name__,
        }
        _write_json(os.path.join(self.output_dir, META_FILE), meta)
        self._meta_source = self.engine

    def on_step_end(self, step: int) -> None:
        self._last = None
        self._flush_step(step)

    def flush(self) -> None:
        """Write the records of every step delivered so far (the current step's too; later records of that step
        then rewrite its file)."""
        for step in list(self._pending):
            self._flush_step(step, keep=True)

    def _flush_step(self, step: int, keep: bool = False) -> None:
        lines = self._pending.get(step) if keep else self._pending.pop(step, None)
        if lines:
            atomic_write(os.path.join(self._step_dir(step), RECORDS_FILE), "\n".join(lines) + "\n")

    def on_step_start(self, step: int) -> None:
        if self.engine != self._meta_source:  # the model was wrapped in ORTModule (or unwrapped) after subscribing
            self._write_meta()
        os.makedirs(self._step_dir(step), exist_ok=True)

    def on_forward(self, step: int, order: int, name: str, tensor: torch.Tensor) -> None:
        self._write(step, order, "forward", name, tensor)

    def on_backward(self, step: int, order: int, name: str, grad: torch.Tensor) -> None:
        self._write(step, order, "backward", name, grad)

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.output_dir, f"{STEP_DIR_PREFIX}{step}")

    def _write(self, step: int, order: int, kind: str, name: str, tensor: torch.Tensor) -> None:
        record = {"format": FORMAT, "name": name, "kind": kind, "step": step, "order": order, "rank": self.rank}
        # Several modules often return one tensor, one after the other (a zero-rate dropout's input, a block's
        # output as its parent's): its statistics are computed once. The last tensor is held, so its memory cannot
        # be reused by another tensor of the same layout; the version counter tells an in-place change apart.
        key = (kind, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype, tensor._version)
        if self._last is None or self._last[0] != key:
            self._last = (key, tensor, tensor_statistics(tensor, self.bucket_size, self.run_on_cpu))
        record.update(self._last[2])
        folder = self._step_dir(step)
        os.makedirs(folder, exist_ok=True)
        if self.one_file_per_activation:
            _write_json(os.path.join(folder, f"{order:05d}_{kind}_{safe_name(name)}.json"), record)
        else:
            self._pending.setdefault(step, []).append(json.dumps(record, allow_nan=False))
