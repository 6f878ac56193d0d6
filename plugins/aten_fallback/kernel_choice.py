"""Kernel choice by measurement: with ``torch_kernels = "auto"`` an op runs on PyTorch's kernel only where PyTorch
measured faster, on the model's own shapes.

While a model is exported, each routable call (embedding, GELU, LayerNorm, cross-entropy, linear/addmm) is described
by a :class:`Case`: the op, the sizes of its tensor inputs as traced (the real ones, not the dynamic axes), dtype,
device and the arguments that change the kernels (GELU's ``approximate``, a reduction, a bias). :class:`KernelChooser`
answers each case once per machine: from memory, else from its JSON file, else by measuring both sides
(:func:`.measurement.measure_case`) and keeping the faster. A measurement builds two one-op graphs through the
core (``ortcore.api.measurement_session``): ORT's node (``Gather``, ``Gelu``, ``LayerNormalization``,
``SoftmaxCrossEntropyLoss``, ``Gemm``/``MatMul``) and the ATen node the routed symbolic emits, whose forward and
gradient run the same ATen kernels through the executor; then it times forward + backward of both, interleaved, and
takes the medians (:mod:`.measurement`).

Decisions are keyed by :meth:`Case.key` plus :func:`environment` (threads, torch and ORT versions, the CPU), and
stored in ``kernel_choice.json`` in the export cache directory (``ORTMODULE_CACHE_DIR``) or ``~/.cache/ortcore``
(:func:`cache_path`), written with :func:`ortcore.files.atomic_writer`. A corrupt file is a warning and the cases
are measured again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import onnx
import onnxruntime
import torch

from ortcore.api import Config, atomic_writer, format_table
from ortcore_plugins.services import kernel_measurement
from ortcore_plugins.services.machine import OthersCPU, loaded

from .measurement import TORCH_TYPES, measure_case

logger = logging.getLogger("ortcore.aten_fallback")

CACHE_FILE = "kernel_choice.json"
FILE_FORMAT = 1
PYTORCH, ORT = "PyTorch", "ORT"
MEASURED, CACHED, REQUIRED, UNMEASURED = "measured", "cached", "required", "unmeasured"
# Measured while other processes took more than BUSY_PCT of the CPU: held for this process only, never written to the
# file, so the next process measures the case again (a loaded machine favours whichever side suffers less from it).
PROVISIONAL = "provisional"
# Not measured on this machine yet (measure = "later"): the default list decided for now, the case is timed before
# training step MEASURE_AT_STEP. A graph holding a deferred or provisional decision is marked (PROVISIONAL_METADATA):
# the export cache keeps it under that state, and serves a final graph instead once one is on file.
DEFERRED = "deferred"
MEASURE_AT_STEP = 2
# Within this fraction of ORT's time, ORT keeps the op: a graph without an ATen node for no measurable gain. 10%: the
# spread of identical timings on a loaded 2-core VM, and an ATen node's own cost inside ORT's graph that a one-op
# measurement does not see (its callback, about 0.07 ms, and inputs arriving cold from ORT's threads: LayerNorm 0.26
# ms in the graph against 0.10 ms run again at once). A GPT-2 addmm measured 10.1 vs 10.6 ms, a 5% "win" that cost a
# second export.
TIE = 0.10
# Per export: once measuring has taken this long, the remaining new cases keep the default list (not cached).
EXPORT_BUDGET_SECONDS = 3.0


# -- cases and decisions ----------------------------------------------------------------------------------------


@attrs.frozen
class Case:
    """One routable call as traced: ``op`` (an option name: embedding, gelu, layer_norm, cross_entropy, linear),
    ``form`` (which of the op's graphs: ``linear``, ``addmm``...), the tensor inputs' ``shapes``, ``dtype``,
    ``device``, and ``params``: the arguments that change the kernels, including which inputs need a gradient."""

    op: str
    shapes: tuple[tuple[int, ...], ...]
    dtype: str = "float32"
    device: str = "cpu"
    params: tuple[tuple[str, Any], ...] = ()
    form: str = ""

    @property
    def param(self) -> dict[str, Any]:
        return dict(self.params)

    def key(self) -> str:
        """The case as a stable string (the file cache adds :func:`environment`)."""
        return json.dumps(
            {
                "op": self.op,
                "form": self.form or self.op,
                "shapes": [list(s) for s in self.shapes],
                "dtype": self.dtype,
                "device": self.device,
                "params": {k: v for k, v in self.params},
            },
            sort_keys=True,
        )

    def describe(self) -> str:
        shapes = ", ".join("×".join(map(str, s)) or "scalar" for s in self.shapes)
        extra = "".join(f" {k}={v}" for k, v in self.params if not k.startswith("grad_"))
        return f"{self.form or self.op}({shapes}) {self.dtype}{extra}"


@attrs.frozen
class Decision:
    """Where a :class:`Case` runs: ``side`` is ``"PyTorch"`` or ``"ORT"``; ``source`` is ``"measured"`` (now),
    ``"cached"`` (an earlier measurement, this process or the file), ``"provisional"`` (measured while other
    processes loaded the CPU: this process only), ``"required"`` (only one side computes torch's result) or
    ``"unmeasured"`` (no measurement possible: the fixed default list decided). ``others_pct``: the share of the
    CPU other processes took while it was measured."""

    case: Case
    side: str
    source: str
    ort_ms: float | None = None
    torch_ms: float | None = None
    note: str = ""
    others_pct: float | None = None

    @property
    def routed(self) -> bool:
        return self.side == PYTORCH

    def reason(self) -> str:
        if self.ort_ms is not None and self.torch_ms is not None:
            faster = "faster" if self.routed else "not faster"
            return (
                f"PyTorch's kernel {faster} on {self.case.describe()}: {self.torch_ms:.2f} ms vs ORT "
                f"{self.ort_ms:.2f} ms forward+backward ({self.source}"
                + (
                    f": other processes took {self.others_pct:.0f}% of the CPU, measured again on a later step or "
                    "by the next process)"
                    if self.source == PROVISIONAL and self.others_pct is not None
                    else ")"
                )
            )
        return f"{self.note} ({self.case.describe()})"

    def to_json(self) -> dict[str, Any]:
        return {
            "case": json.loads(self.case.key()),
            "side": self.side,
            "source": self.source,
            "ort_ms": self.ort_ms,
            "torch_ms": self.torch_ms,
            "note": self.note,
            "others_pct": self.others_pct,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Decision:
        c = data["case"]
        case = Case(
            op=c["op"],
            shapes=tuple(tuple(int(d) for d in s) for s in c["shapes"]),
            dtype=c["dtype"],
            device=c["device"],
            params=tuple(sorted((k, v) for k, v in c["params"].items())),
            form="" if c["form"] == c["op"] else c["form"],
        )
        side = data["side"]
        if side not in (PYTORCH, ORT):
            raise ValueError(f"side {side!r}")
        ort_ms, torch_ms, others = data.get("ort_ms"), data.get("torch_ms"), data.get("others_pct")
        return cls(
            case,
            side,
            data["source"],
            None if ort_ms is None else float(ort_ms),
            None if torch_ms is None else float(torch_ms),
            str(data.get("note", "")),
            None if others is None else float(others),
        )


def choose(ort_ms: float, torch_ms: float, tie: float = TIE) -> str:
    """The side to run: PyTorch only when it is faster than ORT by more than ``tie`` (a fraction of ORT's time)."""
    return PYTORCH if torch_ms < ort_ms * (1.0 - tie) else ORT


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """What besides the case decides which side is faster: torch's thread count, the CPU, the library versions."""
    return {
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "cpu": _cpu_name(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
    }


def environment_key() -> str:
    return json.dumps(environment(), sort_keys=True)


# -- the cache -------------------------------------------------------------------------------------------------


def cache_path(config: Config | None = None) -> Path:
    """Where decisions are kept: the export cache directory if one is set (``[plugins.export_cache] dir`` or
    ``ORTMODULE_CACHE_DIR``), else ``$XDG_CACHE_HOME/ortcore`` (``~/.cache/ortcore``)."""
    env = config.env if config is not None else os.environ
    directory = ""
    if config is not None:
        options = config.plugin_options("export_cache")
        directory = getattr(options, "dir", "") or ""
    directory = directory or env.get("ORTMODULE_CACHE_DIR", "").strip()
    if not directory:
        # XDG_CACHE_HOME is the user's, not an ortcore setting: a host configured from another mapping still honours it
        xdg = env.get("XDG_CACHE_HOME", "").strip() or os.environ.get("XDG_CACHE_HOME", "").strip()
        base = xdg or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "ortcore")
    return Path(os.path.abspath(os.path.expanduser(directory))) / CACHE_FILE


Timer = Callable[[Case], tuple[float, float]]


class KernelChooser:
    """Decides cases, each once per machine: memory, then the JSON file at ``path``, then ``timer`` (``case ->
    (ort_ms, torch_ms)``, :func:`measure_case` by default). ``measurements`` counts the cases timed.

    Example::

        chooser = KernelChooser(cache_path())
        decision = chooser.decide(Case("gelu", ((8, 128, 1024),), params=(("approximate", "none"),)))
    """

    def __init__(self, path: Path | None, timer: Timer | None = None, tie: float = TIE):
        self.path = path
        self.timer = timer or measure_case
        self.tie = tie
        self.measurements = 0
        self.seconds = 0.0  # time spent measuring
        self._memory: dict[str, Decision] = {}
        self._loaded = False
        self._lock = threading.RLock()
        self._logged: set[str] = set()

    def _full_key(self, case: Case) -> str:
        return f"{environment_key()}|{case.key()}"

    def _read_file(self) -> dict[str, Any]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            if (
                not isinstance(data, dict)
                or data.get("format") != FILE_FORMAT
                or not isinstance(data.get("entries"), dict)
            ):
                raise ValueError(f"not a kernel-choice file of format {FILE_FORMAT}")
            return data["entries"]
        except (OSError, ValueError) as e:
            logger.warning("kernel choice cache %s is unusable (%s): measuring again", self.path, e)
            return {}

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        for key, value in self._read_file().items():
            try:
                self._memory.setdefault(key, attrs.evolve(Decision.from_json(value), source=CACHED))
            except (KeyError, TypeError, ValueError) as e:
                logger.warning("kernel choice cache %s: entry skipped (%s: %s)", self.path, type(e).__name__, e)

    def _store(self, key: str, decision: Decision) -> None:
        if self.path is None:
            return
        try:
            entries = self._read_file()  # merge what other processes wrote since
            entries[key] = decision.to_json()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_writer(self.path) as f:
                json.dump({"format": FILE_FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
        except OSError as e:
            logger.warning(
                "kernel choice cache %s cannot be written (%s); the choice holds for this process", self.path, e
            )

    def cached(self, case: Case) -> Decision | None:
        """The known decision of ``case`` (memory or file), or None."""
        with self._lock:
            self._load()
            return self._memory.get(self._full_key(case))

    def decide(self, case: Case, *, again_if_provisional: bool = False) -> Decision:
        """The side ``case`` runs on, measuring it if no decision is known (or, with ``again_if_provisional``, if the
        known one was measured under load); logged once per case at INFO."""
        with self._lock:
            key = self._full_key(case)
            known = self.cached(case)
            if known is not None and again_if_provisional and known.source == PROVISIONAL:
                known = None
            if known is not None:
                decision = attrs.evolve(
                    known, source=known.source if known.source == PROVISIONAL else CACHED, case=case
                )
            else:
                start = time.perf_counter()
                others = OthersCPU()
                ort_ms, torch_ms = self.timer(case)
                others_pct = others.stop()
                self.seconds += time.perf_counter() - start
                self.measurements += 1
                busy = loaded(others, others_pct)
                decision = Decision(
                    case,
                    choose(ort_ms, torch_ms, self.tie),
                    PROVISIONAL if busy else MEASURED,
                    ort_ms,
                    torch_ms,
                    others_pct=others_pct,
                )
                if busy:
                    self._memory[key] = decision
                else:
                    self._memory[key] = attrs.evolve(decision, source=CACHED)
                    self._store(key, decision)
            self.log(decision)
            return decision

    def log(self, decision: Decision) -> None:
        key = decision.case.key()
        if key in self._logged:
            return
        self._logged.add(key)
        if decision.ort_ms is not None and decision.torch_ms is not None:
            logger.info(
                "kernel choice %s: ORT %.2f ms, PyTorch %.2f ms -> %s (%s)",
                decision.case.describe(),
                decision.ort_ms,
                decision.torch_ms,
                decision.side,
                decision.source,
            )
        else:
            logger.info(
                "kernel choice %s: %s (%s: %s)", decision.case.describe(), decision.side, decision.source, decision.note
            )


_choosers: dict[Path, KernelChooser] = {}
_choosers_lock = threading.Lock()


def chooser_for(config: Config) -> KernelChooser:
    """The process-wide chooser of ``config``'s cache file (one per file, so a second model measures nothing)."""
    path = cache_path(config)
    with _choosers_lock:
        if path not in _choosers:
            _choosers[path] = KernelChooser(path)
        return _choosers[path]


# -- what an export decided: recorded in the graph ----------------------------------------------------------------

CHOICE_METADATA_PREFIX = "ortcore.kernel_choice::"
_pending: list[Decision] = []
_pending_lock = threading.Lock()


def note(decision: Decision) -> None:
    """Remember a decision of the export under way (the metadata pass writes them into the graph)."""
    with _pending_lock:
        if all(d.case != decision.case for d in _pending):
            _pending.append(decision)


_export_seconds = [0.0]  # measuring time of the export under way


def take_pending() -> list[Decision]:
    with _pending_lock:
        _export_seconds[0] = 0.0
        taken = list(_pending)
        _pending.clear()
        return taken


#: The ONNX op types ORT's graph holds for an op kept on its kernels, for ``model.explain()``'s "why" column.
ORT_OP_TYPES: dict[str, tuple[str, ...]] = {
    "embedding": ("Gather",),
    "gelu": ("Gelu", "FastGelu", "BiasGelu", "com.microsoft::Gelu", "com.microsoft::FastGelu"),
    "layer_norm": ("LayerNormalization",),
    "cross_entropy": ("SoftmaxCrossEntropyLoss", "com.microsoft::SoftmaxCrossEntropyLossInternal"),
    "linear": ("Gemm", "MatMul"),
}


def record(model: onnx.ModelProto, decisions: Sequence[Decision]) -> None:
    """Write ``decisions`` into ``model``'s metadata: ``ortcore.kernel_choice::<op>`` (JSON, every decision); for
    the ops routed, ``ortcore.routed::<op>`` (the reason ``model.explain()`` shows), replacing a generic reason; for
    the ops kept on ORT's kernels, ``ortcore.kept::<ONNX op type>`` (shown beside those kernels)."""
    from ortcore.api import KEPT_METADATA_PREFIX, ROUTED_METADATA_PREFIX

    by_op: dict[str, list[Decision]] = {}
    for d in decisions:
        by_op.setdefault(d.case.op, []).append(d)
    props = {p.key: p for p in model.metadata_props}
    for op, ds in sorted(by_op.items()):
        entries = [d.to_json() for d in ds]
        key = CHOICE_METADATA_PREFIX + op
        if key in props:
            entries = json.loads(props[key].value) + [e for e in entries if e not in json.loads(props[key].value)]
            props[key].value = json.dumps(entries)
        else:
            props[key] = model.metadata_props.add(key=key, value=json.dumps(entries))
        kept = [d.reason() for d in ds if not d.routed]
        for op_type in ORT_OP_TYPES.get(op, ()) if kept else ():
            key = KEPT_METADATA_PREFIX + op_type
            text = "; ".join(dict.fromkeys(kept))
            if key in props:
                props[key].value = "; ".join(dict.fromkeys([props[key].value, text]))
            else:
                props[key] = model.metadata_props.add(key=key, value=text)
        routed = [d.reason() for d in ds if d.routed]
        if routed:
            reason = "; ".join(dict.fromkeys(routed))
            if ROUTED_METADATA_PREFIX + op in props:
                props[ROUTED_METADATA_PREFIX + op].value = reason
            else:
                props[ROUTED_METADATA_PREFIX + op] = model.metadata_props.add(
                    key=ROUTED_METADATA_PREFIX + op, value=reason
                )


def kernel_choices(model: Any) -> list[Decision]:
    """The kernel decisions recorded in a graph: an ``onnx.ModelProto``, an ``ExportedGraph`` or an ORTModule (its
    current graph; empty before the first call)."""
    if hasattr(model, "state_machine"):
        current = model.state_machine.current
        if current is None:
            return []
        model = current[0]
    if hasattr(model, "model") and not isinstance(model, onnx.ModelProto):
        model = model.model
    result = []
    for p in model.metadata_props:
        if p.key.startswith(CHOICE_METADATA_PREFIX):
            result.extend(Decision.from_json(e) for e in json.loads(p.value))
    return result


def explain_kernel_choices(model: Any) -> str:
    """A table of :func:`kernel_choices`: op, shapes, ORT ms, PyTorch ms, chosen side, and how it was decided."""
    rows = []
    for d in kernel_choices(model):
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append((d.case.op, d.case.describe(), fmt(d.ort_ms), fmt(d.torch_ms), d.side, d.source or d.note))
    if not rows:
        return "no kernel choice recorded (torch_kernels is not 'auto', or no graph yet)"
    return format_table(("op", "call", "ORT ms", "PyTorch ms", "runs on", "decided"), rows, indent="")


# -- cases from traced calls ---------------------------------------------------------------------------------------

_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16"}


def _traced(value: Any) -> tuple[tuple[int, ...], str, str] | None:
    """Sizes, dtype and device of a traced value as the tracer saw them (the real input's), or None if unknown."""
    try:
        t = value.type()
        sizes = t.varyingSizes()
        if sizes is None or any(s is None for s in sizes):
            return None
        device = t.device()
        return (
            tuple(int(s) for s in sizes),
            _DTYPES.get(t.scalarType(), str(t.scalarType())),
            (device.type if device is not None else "cpu"),
        )
    except (AttributeError, RuntimeError):
        return None


def _flag(value: Any) -> bool:
    """Does the traced value need a gradient (unknown: yes)?"""
    from ortcore_plugins.services.aten_nodes import requires_grad

    return requires_grad(value) is not False


def _is_bias_add(value: Any) -> bool:
    """Is ``value`` an Add with a 1-D parameter (a Linear's bias, which ORT fuses into BiasGelu)?"""
    node = value.node()
    if node.kind() != "onnx::Add":
        return False
    for operand in node.inputs():
        sizes = operand.type().varyingSizes() if operand.type().kind() == "TensorType" else None
        if operand.node().kind() == "prim::Param" and sizes is not None and len(sizes) == 1:
            return True
    return False


def case_of_call(op: str, g: Any, args: tuple) -> Case | Decision | None:
    """The :class:`Case` of a routable call being exported (sizes from the traced call), a :class:`Decision` when
    only PyTorch computes torch's result (a padding row, label smoothing), or None when the routed symbolic would not
    route this call anyway."""
    from torch.onnx import symbolic_helper as sh

    from ortcore_plugins.services.aten_nodes import is_none

    traced = [_traced(v) for v in g.original_node.inputs()]
    # A graph input has dynamic sizes by now; the traced output keeps the real ones, from which its sizes follow.
    out = _traced(next(iter(g.original_node.outputs())))
    params: dict[str, Any] = {}
    shapes: list[Any] = []
    form = ""
    if op == "embedding":
        weight, indices, padding_idx, scale_grad_by_freq = args[:4]
        if traced[1] is None and out is not None:
            traced[1] = (out[0][:-1], "int64", out[2])
        shapes = [traced[0], traced[1]]
        pad = sh._get_const(padding_idx, "i", "padding_idx")
        scale = bool(sh._get_const(scale_grad_by_freq, "b", "scale_grad_by_freq"))
        params = {"padding_idx": -1}
        if pad >= 0 or scale:
            case = Case(
                op,
                tuple(t[0] for t in shapes if t),
                shapes[0][1] if shapes[0] else "unknown",
                params=(("padding_idx", pad), ("scale", scale)),
            )
            return Decision(
                case, PYTORCH, REQUIRED, note="ORT's Gather gradient ignores padding_idx and scale_grad_by_freq"
            )
    elif op == "gelu":
        self, approximate = args
        if not isinstance(approximate, str):
            approximate = sh._get_const(approximate, "s", "approximate")
        shapes = [traced[0] or out]
        params = {"approximate": approximate, "bias": _is_bias_add(self)}
    elif op == "layer_norm":
        from ortcore_plugins.services.torch_kernels import gradient_reaches_first_input

        input, normalized_shape, weight, bias, eps = args[:5]
        if not gradient_reaches_first_input(input, weight, bias):
            return None
        normalized = tuple(sh._get_const(normalized_shape, "is", "normalized_shape"))
        traced[0] = traced[0] or out
        shapes = [traced[0], None if traced[0] is None else (normalized, traced[0][1], traced[0][2])]
        params = {
            "eps": float(sh._get_const(eps, "f", "eps")),
            "grad_weight": not is_none(weight) and _flag(weight),
            "grad_bias": not is_none(bias) and _flag(bias),
        }
    elif op == "cross_entropy":
        self, target, weight, reduction, ignore_index, label_smoothing = args
        if target.type().scalarType() in _DTYPES:
            return None  # class probabilities: not the routed op's formula
        if traced[1] is None and traced[0] is not None:  # the labels, a graph input: the logits without classes
            logits = traced[0][0]
            traced[1] = (logits[:1] + logits[2:] if len(logits) >= 2 else (), "int64", traced[0][2])
        shapes = [traced[0], traced[1]] + ([traced[2]] if not is_none(weight) else [])
        params = {
            "reduction": int(sh._get_const(reduction, "i", "reduction")),
            "ignore_index": int(sh._get_const(ignore_index, "i", "ignore_index")),
        }
        smoothing = sh._maybe_get_const(label_smoothing, "f")
        if smoothing:
            case = Case(op, tuple(t[0] for t in shapes if t), params=tuple(sorted(params.items())))
            return Decision(case, PYTORCH, REQUIRED, note="ONNX's export of cross-entropy has no label smoothing")
    elif op == "linear":
        from ortcore_plugins.services.torch_kernels import gradient_reaches_first_input

        input, weight, bias = args
        if not gradient_reaches_first_input(input, weight, bias):
            return None
        if traced[0] is None and out is not None and traced[1] is not None:
            traced[0] = ((*out[0][:-1], traced[1][0][1]), out[1], out[2])
        shapes = [traced[0], traced[1]] + ([traced[2]] if not is_none(bias) else [])
        params = {
            "grad_input": _flag(input),
            "grad_weight": _flag(weight),
            "grad_bias": not is_none(bias) and _flag(bias),
        }
    elif op == "addmm":
        from ortcore_plugins.services.torch_kernels import gradient_reaches_first_input

        self, mat1, mat2, beta, alpha = args
        if not gradient_reaches_first_input(self, mat1, mat2):
            return None
        scales = [sh._maybe_get_const(v, "f") for v in (beta, alpha)]
        if any(sh._is_value(s) for s in scales):
            return None
        op, form = "linear", "addmm"
        if traced[1] is None and out is not None and traced[2] is not None:
            traced[1] = ((out[0][0], traced[2][0][0]), out[1], out[2])
        shapes = [traced[0], traced[1], traced[2]]
        params = {
            "beta": float(scales[0]),
            "alpha": float(scales[1]),
            "grad_bias": _flag(self),
            "grad_mat1": _flag(mat1),
            "grad_mat2": _flag(mat2),
        }
    else:
        raise ValueError(f"no kernel choice for op {op!r}")
    known = all(t is not None for t in shapes)
    dtype = shapes[0][1] if shapes and shapes[0] is not None else "unknown"
    device = shapes[0][2] if shapes and shapes[0] is not None else "unknown"
    return Case(
        op,
        tuple(t[0] for t in shapes) if known else (),
        dtype=dtype,
        device=device,
        params=tuple(sorted(params.items())),
        form=form,
    )


def decide_call(config: Config, op: str, g: Any, args: tuple) -> Decision | None:
    """The decision for a routable call being exported (None: the routed symbolic would not route it)."""
    found = case_of_call(op, g, args)
    if found is None or isinstance(found, Decision):
        return found
    return decide_case(config, found)


def default_side(case: Case) -> str:
    """Where the fixed default list runs ``case``'s op."""
    from .options import DEFAULT_OPS

    return PYTORCH if case.op in DEFAULT_OPS else ORT


# Types ORT's CPU provider has (almost) no kernels for: such calls run on PyTorch's kernel, unmeasured.
LOW_PRECISION = frozenset({"bfloat16", "float16"})
MATRIX_PRODUCTS = frozenset({"linear", "addmm"})


def decide_case(config: Config, case: Case) -> Decision:
    """The decision for ``case``: measured or cached where measuring is possible, else the default list's; with
    ``measure = "later"`` a case not measured yet takes the default list's side for now (``deferred``)."""
    from .options import measure_mode

    fallback = default_side(case)
    if not case.shapes:
        return Decision(case, fallback, UNMEASURED, note="sizes unknown at export: the default list decided")
    if case.device != "cpu" or case.dtype not in TORCH_TYPES:
        return Decision(case, fallback, UNMEASURED, note="measured on CPU floats only: the default list decided")
    if case.dtype in LOW_PRECISION:
        # ORT's CPU provider has no kernel in these types to time: its side would be a float32 kernel with casts
        # around it, PyTorch's is the kernel eager autocast runs. Matrix products are left as ONNX's Gemm/MatMul,
        # which the mixed_precision plugin places (its `matmul` option can force either side).
        if case.op in MATRIX_PRODUCTS:
            return Decision(case, fallback, UNMEASURED, note=f"{case.dtype}: placed by the mixed_precision plugin")
        return Decision(
            case, PYTORCH, UNMEASURED, note=f"{case.dtype}: PyTorch's kernel (ORT's CPU provider has none in this type)"
        )
    chooser = chooser_for(config)
    mode = measure_mode(config)
    known = chooser.cached(case)
    if mode != "export" and known is None:
        if mode == "off":
            return Decision(case, fallback, UNMEASURED, note="not measured on this machine (measure = off)")
        return Decision(
            case,
            fallback,
            DEFERRED,
            note=f"not measured on this machine yet: the default list decides until training step {MEASURE_AT_STEP}",
        )
    if known is None and _export_seconds[0] > EXPORT_BUDGET_SECONDS:
        return Decision(
            case, fallback, UNMEASURED, note="the export's measuring budget is spent: the default list decided"
        )
    try:
        before = chooser.seconds
        try:
            return chooser.decide(case)
        finally:
            _export_seconds[0] += chooser.seconds - before
    except Exception as e:  # a failed measurement must not fail the export: the default list decides
        logger.warning(
            "kernel choice: measuring %s failed (%s: %s); the default list decides",
            case.describe(),
            type(e).__name__,
            e,
        )
        return Decision(case, fallback, UNMEASURED, note=f"measurement failed ({type(e).__name__})")


def tanh_gelu_route(config: Config, model: onnx.ModelProto, sizes: list[Any]) -> Callable[[int], bool]:
    """For the tanh-GELU pass: route the formula around the ``k``-th Tanh node? ``sizes`` are the traced sizes of the
    export's tanh calls in order; if they do not line up with the graph's Tanh nodes, only a single size serves."""
    count = sum(1 for n in model.graph.node if n.op_type == "Tanh")
    distinct = set(sizes)

    def route(k: int) -> bool:
        traced = sizes[k] if len(sizes) == count else (next(iter(distinct)) if len(distinct) == 1 else None)
        if traced is None:
            case = Case("gelu", (), params=(("approximate", "tanh"), ("bias", False)))
        else:
            case = Case("gelu", (traced[0],), traced[1], traced[2], params=(("approximate", "tanh"), ("bias", False)))
        decision = decide_case(config, case)
        note(decision)
        return decision.routed

    return route


# -- measure = "later": the cases a graph started on the default list for, timed on a later step --------------------

#: Measuring on later steps, in a whole process, stops starting cases once it has taken this long or
#: :data:`MEASURE_BUDGET_FRACTION` of the wall time since the process's first training step, whichever is larger. A
#: case already begun finishes (two one-op session builds, a warm-up each and at most
#: :data:`.measurement.BUDGET_SECONDS` of timed runs), and a case is not begun if the average case so far would not
#: fit. Cases left over wait for a later step, when the fraction has grown.
MEASURE_BUDGET_SECONDS = 1.0
MEASURE_BUDGET_FRACTION = 0.05
#: The old name of the per-step limit; the process-wide budget above bounds a step's measuring too.
STEP_BUDGET_SECONDS = MEASURE_BUDGET_SECONDS
#: A case is measured on later steps at most this often: once, and once more if the first measurement was taken on a
#: busy machine (provisional). After that the default list keeps it for this process; the next process measures it.
MAX_ATTEMPTS = 2
#: A measured choice replaces the running graph only if it saves at least this much a step (forward + backward, each
#: case once): an export, build and audit cost about 1-2 s, repaid after about a thousand steps. Smaller gains are on
#: file for the next process, which starts on them at no extra cost.
MIN_SWITCH_GAIN_MS = 1.0


@attrs.frozen
class MeasurementEvent:
    """One look at a session's waiting cases on a later step: ``step``, the cases ``measured`` (their count),
    ``seconds`` spent, and ``why``: the first measurement, a retake (and why), or why nothing was measured."""

    step: int
    measured: int
    seconds: float
    why: str


class MeasurementRecord:
    """What kernel measurement cost this process (``measure = "later"``): every look at waiting cases, and the
    process-wide budget (:data:`MEASURE_BUDGET_SECONDS`, :data:`MEASURE_BUDGET_FRACTION`)."""

    def __init__(self) -> None:
        self.events: list[MeasurementEvent] = []
        self.seconds = 0.0
        self.measurements = 0
        self.first_step: float | None = None
        self._lock = threading.Lock()

    def started(self, now: float) -> None:
        with self._lock:
            if self.first_step is None:
                self.first_step = now

    def budget(self, now: float) -> float:
        """Seconds of measuring still allowed now."""
        elapsed = 0.0 if self.first_step is None else now - self.first_step
        return max(MEASURE_BUDGET_SECONDS, MEASURE_BUDGET_FRACTION * elapsed) - self.seconds

    def add(self, event: MeasurementEvent) -> None:
        with self._lock:
            self.events.append(event)
            self.seconds += event.seconds
            self.measurements += event.measured

    def summary(self) -> str:
        """One line of totals, then one line per look (``step N: ...``)."""
        retaken = sum(1 for e in self.events if e.measured and e.why.startswith("retaken"))
        lines = [
            f"kernel measurement: {self.measurements} case(s) measured on later steps in {self.seconds:.2f} s "
            f"({len([e for e in self.events if e.measured])} step(s) measured, {retaken} retaken); budget "
            f"max({MEASURE_BUDGET_SECONDS:g} s, {MEASURE_BUDGET_FRACTION:.0%} of the run), each case at most "
            f"{MAX_ATTEMPTS} times"
        ]
        lines += [
            f"  step {e.step}: {e.measured} case(s), {e.seconds:.2f} s: {e.why}"
            if e.measured
            else f"  step {e.step}: {e.why}"
            for e in self.events
        ]
        return "\n".join(lines)


#: This process's record (what ``ortcore explain`` and ``ortcore demo`` print).
measurement_record = MeasurementRecord()


def measurement_summary() -> str:
    """What kernel measurement cost this process: on later steps (:data:`measurement_record`) and during exports
    (``measure = "export"``, at most :data:`EXPORT_BUDGET_SECONDS` an export)."""
    total = sum(c.measurements for c in list(_choosers.values()))
    seconds = sum(c.seconds for c in list(_choosers.values()))
    at_export = total - measurement_record.measurements
    text = measurement_record.summary()
    if at_export > 0:
        spent = max(0.0, seconds - measurement_record.seconds)
        text += f"\nkernel measurement during exports: {at_export} case(s) in {spent:.2f} s (the first step waits)"
    return text


def waiting_cases(model: Any) -> list[Decision]:
    """The decisions of a graph taken for now only: ``deferred`` (not measured yet) and ``provisional``."""
    if model is None:
        return []
    return [d for d in kernel_choices(model) if d.source in (DEFERRED, PROVISIONAL)]


def measure_waiting(
    config: Config, waiting: Sequence[Decision], budget_s: float = STEP_BUDGET_SECONDS
) -> list[Decision]:
    """Time the waiting cases (a provisional one again) within ``budget_s``: a case is begun only while the time so
    far plus the average case's (this process's measurements so far) fits; the first always is. Returns the new
    decisions, one per case measured (fewer than ``waiting`` when the budget ran out)."""
    chooser = chooser_for(config)
    start = time.perf_counter()
    done: list[Decision] = []
    for old in waiting:
        spent = time.perf_counter() - start
        average = chooser.seconds / chooser.measurements if chooser.measurements else 0.0
        if done and spent + average > budget_s:
            break
        try:
            done.append(chooser.decide(old.case, again_if_provisional=True))
        except Exception as e:  # a failed measurement keeps the graph as it is: the default list decided
            logger.warning(
                "kernel choice: measuring %s failed (%s: %s); the default list decides",
                old.case.describe(),
                type(e).__name__,
                e,
            )
            done.append(Decision(old.case, old.side, UNMEASURED, note=f"measurement failed ({type(e).__name__})"))
    return done


@attrs.define
class _SessionPlan:
    """A session's waiting cases: when to look next, the machine since the last look, attempts and final decisions."""

    at: int
    watch: Any
    attempts: dict[Case, int] = attrs.field(factory=dict)
    final: dict[Case, Decision] = attrs.field(factory=dict)
    provisional: dict[Case, float | None] = attrs.field(factory=dict)  # the others' share of the last busy measurement


class LaterMeasurement:
    """A runtime inspector (``measure = "later"``): the cases a session's graph decided by the default list (or on
    a busy machine) are timed before training step :data:`MEASURE_AT_STEP`, and if the measurements put cases on
    the other side the module is exported again (``ortcore.api.export_again``), once.

    Measuring never shows as repeated stalls:

    * it is done only if the machine was not busy since the last look (:class:`OthersCPU` from the first training
      step on): on a busy machine a measurement would be provisional anyway, so it is postponed, costing nothing,
      and looked at again at twice the step (4, 8, 16, ...);
    * a case is measured at most :data:`MAX_ATTEMPTS` times (once more only if the first was taken under load);
      then the default list keeps it for this process, and the next process measures it;
    * all measuring of the process stays within max(:data:`MEASURE_BUDGET_SECONDS`, :data:`MEASURE_BUDGET_FRACTION`
      of the run) (:class:`MeasurementRecord`, which ``ortcore explain`` prints).

    A module is exported again for its kernel choice once per process, when no case of the graph waits any more:
    a model whose input sizes change gets graphs exported at other sizes, whose calls are other cases (measured
    too, for the next process, but not worth an export each)."""

    def __init__(self, config: Config, module: torch.nn.Module):
        import weakref

        self.config = config
        self.module = weakref.ref(module)
        # per session: its plan; a finished session maps to None
        self.plan: weakref.WeakKeyDictionary[Any, _SessionPlan | None] = weakref.WeakKeyDictionary()
        self.exported_again = False
        self.record = measurement_record

    def pre_forward(self, step: int, inputs: Any) -> None:
        session = inputs.session
        if session is None or not getattr(session.request, "build_gradient", False):
            return
        self.record.started(time.perf_counter())
        if session not in self.plan:
            # a session that starts later (another input size) is looked at after as many steps again: long enough
            # a stretch to tell whether the machine is busy
            at = MEASURE_AT_STEP if step < MEASURE_AT_STEP else 2 * step
            self.plan[session] = _SessionPlan(at=at, watch=OthersCPU())
        plan = self.plan[session]
        if plan is None or step < plan.at:
            return
        waiting = waiting_cases(getattr(session, "model", None))
        chooser = chooser_for(self.config)
        for d in waiting:
            if d.source == PROVISIONAL and d.case not in plan.attempts:  # measured under load by the export: once more
                plan.attempts[d.case] = 1
                plan.provisional[d.case] = d.others_pct
        for d in waiting:  # decided meanwhile (another session, another process's file): no time
            known = chooser.cached(d.case)
            if d.case not in plan.final and known is not None and known.source != PROVISIONAL:
                plan.final[d.case] = chooser.decide(d.case)
        todo = [d for d in waiting if d.case not in plan.final and plan.attempts.get(d.case, 0) < MAX_ATTEMPTS]
        if todo:
            self._measure(step, plan, todo)
        left = [d for d in waiting if d.case not in plan.final and plan.attempts.get(d.case, 0) < MAX_ATTEMPTS]
        if left:
            plan.at = 2 * step  # the load may pass, the budget grows with the run
            return
        self.plan[session] = None
        given_up = [d for d in waiting if d.case not in plan.final]
        if given_up:
            self.record.add(
                MeasurementEvent(
                    step,
                    0,
                    0.0,
                    f"{len(given_up)} case(s) kept on the default list for this process: measured under load "
                    f"{MAX_ATTEMPTS} times (the next process measures them)",
                )
            )
        self._switch(waiting, list(plan.final.values()))

    def _measure(self, step: int, plan: _SessionPlan, todo: list[Decision]) -> None:
        others_pct = plan.watch.stop()
        now = time.perf_counter()
        if loaded(plan.watch, others_pct):
            plan.watch = OthersCPU()
            self.record.add(
                MeasurementEvent(
                    step,
                    0,
                    0.0,
                    f"postponed: other processes took {others_pct:.0f}% of the CPU since the last look (a "
                    f"measurement now would not be final); looking again at step {2 * step}",
                )
            )
            return
        budget = self.record.budget(now)
        if budget <= 0:
            plan.watch = OthersCPU()
            self.record.add(
                MeasurementEvent(
                    step,
                    0,
                    0.0,
                    f"postponed: the measuring budget is spent ({self.record.seconds:.2f} s); looking again at step "
                    f"{2 * step}",
                )
            )
            return
        retakes = [d for d in todo if plan.attempts.get(d.case, 0)]
        measured = measure_waiting(self.config, todo, budget)
        seconds = time.perf_counter() - now
        for d in measured:
            plan.attempts[d.case] = plan.attempts.get(d.case, 0) + 1
            if d.source == PROVISIONAL:
                plan.provisional[d.case] = d.others_pct
            else:
                plan.final[d.case] = d
        if retakes:
            pcts = [plan.provisional.get(d.case) for d in retakes]
            known = [p for p in pcts if p is not None]
            why = f"retaken: {len(retakes)} case(s) measured while other processes took " + (
                f"up to {max(known):.0f}% of the CPU" if known else "the CPU"
            )
        else:
            why = "first measurement"
        busy_now = [d for d in measured if d.source == PROVISIONAL]
        if busy_now:
            why += f"; {len(busy_now)} case(s) measured under load (provisional)"
        if len(measured) < len(todo):
            why += (
                f"; {len(todo) - len(measured)} case(s) wait for the budget (max({MEASURE_BUDGET_SECONDS:g} s, "
                f"{MEASURE_BUDGET_FRACTION:.0%} of the run))"
            )
        self.record.add(MeasurementEvent(step, len(measured), seconds, why))
        plan.watch = OthersCPU()

    def _switch(self, waiting: list[Decision], measured: list[Decision]) -> None:
        switched = worth_switching(measured, {d.case: d.side for d in waiting})
        module = self.module()
        if not switched and any(d.side != _side_in_graph(waiting, d.case) for d in measured if d.source != PROVISIONAL):
            logger.info(
                "kernel choice: calls measured faster on the other side save less than %.1f ms a step together; the "
                "graph stays, graphs exported later (another input size, the next process without a cached graph) "
                "start on the measured choice",
                MIN_SWITCH_GAIN_MS,
            )
        if switched and self.exported_again:
            logger.info(
                "kernel choice: %d call(s) measured faster on the other side; the graph stays (the module was exported "
                "again for its kernel choice once already), the next process starts on them",
                len(switched),
            )
        elif switched and module is not None:
            from ortcore.api import export_again

            self.exported_again = True

            reason = "kernel choice measured on this machine: " + "; ".join(
                f"{d.case.describe()} on {d.side} ({d.torch_ms:.2f} ms PyTorch, {d.ort_ms:.2f} ms ORT)"
                if d.torch_ms is not None and d.ort_ms is not None
                else f"{d.case.describe()} on {d.side}"
                for d in switched
            )
            logger.info("%s: exporting again", reason)
            export_again(module, reason)


def worth_switching(measured: Sequence[Decision], in_graph: dict[Case, str], tie: float = TIE) -> list[Decision]:
    """The measured decisions worth an export: final (not provisional) ones whose side beats the side the graph runs
    by more than ``tie``, provided they save at least :data:`MIN_SWITCH_GAIN_MS` a step together (each case counted
    once, however many layers call it)."""
    better, gain = [], 0.0
    for d in measured:
        side = in_graph.get(d.case)
        if d.source == PROVISIONAL or side is None or d.side == side or d.ort_ms is None or d.torch_ms is None:
            continue
        now, other = (d.torch_ms, d.ort_ms) if side == PYTORCH else (d.ort_ms, d.torch_ms)
        if other < now * (1.0 - tie):
            better.append(d)
            gain += now - other
    return better if gain >= MIN_SWITCH_GAIN_MS else []


def _side_in_graph(decisions: Sequence[Decision], case: Case) -> str:
    return next(d.side for d in decisions if d.case == case)


kernel_measurement.publish(record=lambda: measurement_record, summary=measurement_summary)
