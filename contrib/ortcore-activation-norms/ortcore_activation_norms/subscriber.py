"""NormSubscriber: the L2 norm, RMS and max-abs of every activation and gradient, one CSV row each.

The CSV (columns :data:`COLUMNS`) is started with its header when the subscriber is created. A step's rows are kept
in memory and appended when the step is over, in **one** ``write`` call on a file opened with ``O_APPEND``: a
process that dies (an exception, ``kill -9``, the OOM killer) leaves whole rows of whole steps behind, never half
a row. A short write (a full disk) is undone by truncating the file to its previous length before the error is
raised. A step is over when the next step starts, at ``GlobalSubscriberManager.unsubscribe``, at
:meth:`NormSubscriber.flush`, or at interpreter exit, whichever comes first.
"""

from __future__ import annotations

import atexit
import csv
import io
import math
import os
import weakref
from typing import Any

import torch

from ortcore.api import SubscriberBase, recorder_of

COLUMNS = ("step", "order", "kind", "name", "numel", "l2", "rms", "max_abs")
KINDS = ("forward", "backward")


def _step_argument(value: Any, what: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{what}={value!r} is not allowed; allowed: None or an integer >= {minimum}")
    return value


def tensor_norms(tensor: torch.Tensor) -> tuple[float, float, float]:
    """``(l2, rms, max_abs)`` of ``tensor``, computed in float64 (complex128 for complex tensors).

    NaN and Inf propagate (a NaN element makes all three NaN). An empty tensor has ``l2 = 0`` and NaN RMS and
    max-abs (there is no element to average or to take the maximum of).
    """
    t = tensor.detach()
    t = t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)
    numel = t.numel()
    if numel == 0:
        return 0.0, math.nan, math.nan
    l2, max_abs = torch.stack([torch.linalg.vector_norm(t), t.abs().max()]).tolist()  # one device sync, not two
    return l2, l2 / math.sqrt(numel), max_abs


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


# Subscribers whose rows are not written yet; flushed at interpreter exit (a weak set: it keeps nobody alive).
_pending: weakref.WeakSet[NormSubscriber] = weakref.WeakSet()
# Which model writes each file, so that two subscribed models never interleave their rows in one CSV.
_writers: dict[str, weakref.ref] = {}


def _writer_of(path: str) -> torch.nn.Module | None:
    """The model whose rows go to ``path``, if it is still subscribed."""
    writer = _writers.get(path)
    model = writer() if writer is not None else None
    return model if model is not None and recorder_of(model) is not None else None


@atexit.register
def _flush_at_exit() -> None:
    for subscriber in list(_pending):
        subscriber.flush()


class NormSubscriber(SubscriberBase):
    """Append the L2 norm, RMS and max-abs of every forward output and gradient to one CSV file per model.

    One row per activation and step: ``step, order, kind, name, numel, l2, rms, max_abs`` (``kind`` is
    ``forward`` or ``backward``; ``step``, ``order`` and ``name`` as :class:`ortcore.hooks.SubscriberBase`
    numbers and names them). On an :class:`ortcore.ORTModule` the tensors are ONNX Runtime's own.

    Example::

        from ortcore.hooks import GlobalSubscriberManager, NormSubscriber
        GlobalSubscriberManager.subscribe(model, [NormSubscriber("norms.csv", every=10)])

    Args:
        output_path: the CSV file; ``{rank}`` in it is replaced by the process's rank (0 without
            ``torch.distributed``). Missing parent directories are created.
        start_step: the first step recorded (default: 0).
        end_step: the step at which recording stops, exclusive (default: never).
        every: record every ``every``-th step from ``start_step`` (default: each step).
        overwrite: replace an existing non-empty file; without it such a file raises FileExistsError and is left
            as it is.
    """

    def __init__(
        self,
        output_path: str | os.PathLike,
        start_step: int | None = None,
        end_step: int | None = None,
        every: int = 1,
        *,
        overwrite: bool = False,
    ):
        start_step = _step_argument(start_step, "start_step", 0)
        end_step = _step_argument(end_step, "end_step", 1)
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} is not allowed; allowed: an integer >= 1")
        super().__init__(start_step, end_step)
        self.every = every
        if not isinstance(output_path, str | os.PathLike):
            raise TypeError(f"output_path={output_path!r} is not allowed; allowed: a str or os.PathLike file path")
        path = os.fspath(output_path)
        if not path:
            raise ValueError("output_path='' is not allowed; allowed: a file path such as 'norms.csv'")
        self.path = os.path.abspath(path.replace("{rank}", str(_rank())))
        if os.path.isdir(self.path):
            raise IsADirectoryError(f"output_path={path!r} is a directory; allowed: a file path such as 'norms.csv'")
        other = _writer_of(self.path)
        if other is not None:
            raise ValueError(
                f"output_path {self.path!r} is being written for a subscribed model ({type(other).__name__}); "
                "give each NormSubscriber its own file"
            )
        if os.path.exists(self.path) and os.path.getsize(self.path) > 0 and not overwrite:
            raise FileExistsError(
                f"output_path {self.path!r} exists and is not empty; pass overwrite=True (or overwrite = true in "
                "[plugins.activation_norms]) to replace it, or choose another path"
            )
        self._model: weakref.ref | None = None
        self._rows: list[tuple] = []
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        with open(self.path, "w", newline="") as f:
            csv.writer(f, lineterminator="\n").writerow(COLUMNS)

    def __deepcopy__(self, memo: dict) -> NormSubscriber:
        # A subscriber is where rows go: a copy of the model (ortcore copies it to export) still reports here.
        return self

    def is_active(self, step: int) -> bool:
        return super().is_active(step) and (step - (self.start_step or 0)) % self.every == 0

    def on_subscribe(self, model: torch.nn.Module) -> None:
        previous = self._model() if self._model is not None else None
        if previous is not None and previous is not model:
            raise ValueError(
                f"a NormSubscriber records one model; {self.path!r} already has {type(previous).__name__}'s rows"
            )
        other = _writer_of(self.path)
        if other is not None and other is not model:
            raise ValueError(
                f"output_path {self.path!r} is being written for another subscribed model ({type(other).__name__}); "
                "give each model its own file"
            )
        self._model = _writers[self.path] = weakref.ref(model)

    def on_forward(self, step: int, order: int, name: str, tensor: torch.Tensor) -> None:
        self._add(step, order, "forward", name, tensor)

    def on_backward(self, step: int, order: int, name: str, grad: torch.Tensor) -> None:
        self._add(step, order, "backward", name, grad)

    def on_step_end(self, step: int) -> None:
        self.flush()

    def _add(self, step: int, order: int, kind: str, name: str, tensor: torch.Tensor) -> None:
        l2, rms, max_abs = tensor_norms(tensor)
        # repr() round-trips a float exactly; NaN and Inf come out as nan, inf, -inf, which float() reads back.
        self._rows.append((step, order, kind, name, tensor.numel(), repr(l2), repr(rms), repr(max_abs)))
        _pending.add(self)

    def flush(self) -> None:
        """Append the rows not written yet (a gradient arriving after its step ended goes with the next flush)."""
        if not self._rows:
            return
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows(self._rows)
        self._rows.clear()
        _pending.discard(self)
        append_whole(self.path, text.getvalue().encode())


def append_whole(path: str, data: bytes) -> None:
    """Append ``data`` to ``path`` in one ``write``; if the system writes less, cut the file back and raise."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        size = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
        except BaseException:
            os.ftruncate(fd, size)
            raise
        if written != len(data):
            os.ftruncate(fd, size)
            raise OSError(f"{path}: wrote {written} of {len(data)} bytes (disk full?); the step's rows were not kept")
    finally:
        os.close(fd)
