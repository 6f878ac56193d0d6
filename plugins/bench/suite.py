"""Training benchmark: Hugging Face BERT and GPT-2 under PyTorch eager, ``torch.compile`` and ortcore.

Every (model, mode) pair runs in a fresh worker process (``python -m ortcore_plugins.bench.suite --worker MODEL MODE ...``) so that
peak memory, compile caches and OpenMP settings of one run cannot leak into another. The worker writes its
measurements as JSON to a file named by the parent; the parent (:func:`run_bench`) collects them, adds ratios to
eager and can render a ``rich`` table (:func:`results_table`). :func:`run_suite` runs several configurations
(:data:`PRESETS`) and, on request, one more worker per model that explains where the time goes (the ``op_profiler``
plugin). A :class:`BenchSuite` saves to JSON and loads back (:meth:`BenchSuite.from_json`) with everything the tables
show, and :func:`plot_suite` draws it. Nothing in this module prints except the worker's own error report on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import attrs

from ortcore.api import atomic_writer
from ortcore_plugins.services.example_models import (  # noqa: F401 (PRESETS and preset: the command line's)
    MODELS,
    PRESETS,
    BenchConfig,
    build_model,
    make_batches,
    preset,
)
from ortcore_plugins.services.machine import (  # noqa: F401 (OthersCPU: the bench's API)
    BUSY_PCT,
    LOW_PRECISION_UNITS,
    OthersCPU,
    describe_machine,
    machine_line,
)

#: "ortcore-cached" is ortcore in a second process on the same export cache (the first one, a one-step run, fills
#: it): what a restarted job sees. Its first step is the one the export cache and ORT's cached session graph make.
#: The "ortcore-dynamo" pair is the same on the dynamo exporter (torch.export + onnxscript).
#: "compile-ortcore" is torch.compile with ortcore's backend (backend="ortcore": each captured graph in ORT);
#: "compile-ortcore-aot" the same with design="aot_autograd" (PyTorch's derivatives, forward and backward graphs each
#: an ORT inference graph).
MODES: tuple[str, ...] = (
    "eager",
    "compile",
    "compile-ortcore",
    "compile-ortcore-aot",
    "ortcore",
    "ortcore-cached",
    "ortcore-dynamo",
    "ortcore-dynamo-cached",
)

#: The modes of ``--quick``, a smoke run: every engine once; torch.compile's cold compile and the cached modes' second
#: processes, most of a full run's time, only when named.
QUICK_MODES: tuple[str, ...] = ("eager", "ortcore", "ortcore-dynamo")

#: The exporter each ortcore mode runs on, set in its worker's environment (ORTCORE_EXPORTER) and passed to ORTModule.
ORTCORE_EXPORTERS: dict[str, str] = {
    "ortcore": "torchscript",
    "ortcore-cached": "torchscript",
    "ortcore-dynamo": "dynamo",
    "ortcore-dynamo-cached": "dynamo",
}
_CACHED_SUFFIX = "-cached"

#: ``--amp``: the autocast dtype each setting adds rows for ("off": float32 rows only). An autocast row,
#: ``<mode>-bf16`` or ``<mode>-fp16``, trains its base mode with the forward under
#: ``torch.autocast("cpu", dtype=...)`` (backward and optimizer outside it, as autocast's recipe has it), in the same
#: run as the float32 rows, each right after its float32 twin, from the same seeded weights and batches.
AMP_DTYPES: dict[str, str] = {"bf16": "bfloat16", "fp16": "float16"}
AMP_CHOICES: tuple[str, ...] = ("off", *AMP_DTYPES)
#: The modes that get an autocast twin under ``--amp``.
AMP_BASE_MODES: tuple[str, ...] = ("eager", "compile", "ortcore")
AMP_MODES: tuple[str, ...] = tuple(f"{mode}-{amp}" for amp in AMP_DTYPES for mode in AMP_BASE_MODES)
#: Every mode a worker runs, in the order tables and plots list them.
ALL_MODES: tuple[str, ...] = MODES + AMP_MODES


def split_mode(mode: str) -> tuple[str, str | None]:
    """``("ortcore", "bf16")`` for ``"ortcore-bf16"``; ``(mode, None)`` for a float32 mode (or an unknown name)."""
    for amp in AMP_DTYPES:
        base = mode.removesuffix(f"-{amp}")
        if base != mode and base in AMP_BASE_MODES:
            return base, amp
    return mode, None


def with_amp(modes: Sequence[str], amp: str) -> list[str]:
    """``modes`` with, under ``amp`` (``bf16``, ``fp16``), each base mode's autocast twin right after it."""
    if amp not in AMP_CHOICES:
        raise ValueError(f"unknown amp setting {amp!r}; allowed: {', '.join(AMP_CHOICES)}")
    out: list[str] = []
    for mode in modes:
        out.append(mode)
        if amp != "off" and mode in AMP_BASE_MODES:
            out.append(f"{mode}-{amp}")
    return out


#: Set in every worker's environment, so it is in place before torch (and libgomp) load. libgomp's default lets
#: torch's idle OpenMP workers spin long after each parallel region, stealing the second core from ORT's kernels
#: (ENGINE-NOTES); 10000 removes that penalty and leaves eager unchanged.
WORKER_ENV: dict[str, str] = {"GOMP_SPINCOUNT": "10000"}

_MIB = 1024 * 1024


@dataclass
class RunResult:
    """What one worker measured (times in seconds, memory in MiB), or why it failed."""

    model: str
    mode: str
    ok: bool = False
    error: str | None = None
    setup_s: float | None = None  # torch.compile(...) / ORTModule(...) call itself; both defer the real work
    first_step_s: float | None = None  # setup + step 1: export + build + step, or compile + step
    steady_step_s: float | None = None  # median of the steps after warmup
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    final_loss: float | None = None
    rss_baseline_mib: float | None = None  # after model, optimizer and batches exist, before any step
    rss_peak_mib: float | None = None  # highest RSS from the start of training to its end
    rss_peak_above_baseline_mib: float | None = None
    peak_method: str | None = None
    n_params: int | None = None
    details: dict[str, Any] = field(default_factory=dict)  # mode-specific: ortcore counters, graph breaks, ...
    environment: dict[str, Any] = field(default_factory=dict)  # as seen inside the worker
    wall_s: float | None = None  # whole worker process, imports included (measured by the parent)
    others_cpu_pct: float | None = None  # share of the machine's CPU other processes used during the run
    vs_eager: dict[str, float | None] = field(default_factory=dict)  # to eager of the same precision
    vs_eager_fp32: dict[str, float | None] = field(default_factory=dict)  # autocast rows: to float32 eager too
    config: str = ""  # name of the configuration (preset) the run belongs to, set by the parent

    @property
    def fell_back(self) -> bool:
        """True if ortcore ran the model in PyTorch: its numbers would then be eager's, not ortcore's. Under
        torch.compile's backend, when every captured graph ran in PyTorch (some of them doing so is how the backend
        trains every model: the notes count them)."""
        if split_mode(self.mode)[0].startswith("compile-ortcore"):
            graphs = self.details.get("graphs") or 0
            return graphs > 0 and (self.details.get("fallbacks") or 0) >= graphs
        return bool(self.details.get("fallbacks")) or bool(self.details.get("fallback_reason"))


# -- memory ------------------------------------------------------------------------------------------------------
def read_vm_hwm() -> int | None:
    """The kernel's high-water mark of this process's RSS in bytes (Linux), or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark to the current RSS (Linux ``/proc/self/clear_refs``); False if unavailable."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The peak RSS since start or since :func:`reset_peak_rss`: VmHWM, else ``ru_maxrss`` (never reset)."""
    peak = read_vm_hwm()
    if peak is not None:
        return peak
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakRSS:
    """Peak resident memory between :meth:`start` and :meth:`stop`.

    On Linux the kernel's own high-water mark is reset at ``start`` (``/proc/self/clear_refs``) and read at
    ``stop``: exact, and it costs the timed steps nothing. ``ru_maxrss`` is not used: it also counts the parent's
    RSS at the moment of the fork. Where the reset is unavailable a sampling thread takes the maximum instead.
    """

    def __init__(self, interval_s: float = 0.005):
        import psutil

        self._process = psutil.Process()
        self._interval_s = interval_s
        self._sampled = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.method = ""

    def current_bytes(self) -> int:
        return self._process.memory_info().rss

    def start(self) -> None:
        if reset_peak_rss() and read_vm_hwm() is not None:
            self.method = "kernel high-water mark (VmHWM, reset at start of training)"
            return
        self.method = f"psutil sampling every {self._interval_s * 1e3:.0f} ms"
        self._sampled = self.current_bytes()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sampled = max(self._sampled, self.current_bytes())

    def stop(self) -> int:
        """Stop measuring; return the peak in bytes."""
        if self._thread is None:
            return max(read_vm_hwm() or 0, self.current_bytes())
        self._stop.set()
        self._thread.join()
        return max(self._sampled, self.current_bytes())


# -- the worker --------------------------------------------------------------------------------------------------
def _graph_breaks() -> dict[str, Any]:
    """What torch.compile's dynamo counted: its graph breaks."""
    try:
        from torch._dynamo.utils import counters

        return {"graph_breaks": sum(counters["graph_break"].values())}
    except Exception:  # private API: its absence must not lose the measurements
        return {}


def _wrap(model: Any, mode: str) -> tuple[Any, Callable[[], dict[str, Any]]]:
    """Return the callable to train under ``mode`` and a function reporting what the mode did."""
    if mode == "eager":
        return model, dict
    if mode == "compile":
        import torch

        compiled = torch.compile(model)  # default backend (inductor); compiles lazily, on the first call
        return compiled, _graph_breaks
    if mode in ("compile-ortcore", "compile-ortcore-aot"):
        import torch

        options = {"design": "aot_autograd"} if mode == "compile-ortcore-aot" else {}
        compiled = torch.compile(model, backend="ortcore", options=options)

        def compile_ortcore_details() -> dict[str, Any]:
            # The backend's module as torch loaded it (its entry point); a plugin does not import another plugin.
            backend = sys.modules.get("ortcore_plugins.compile_backend")
            details = _graph_breaks()
            graphs = backend.compiled_graphs() if backend is not None else []
            details["graphs"] = len(graphs)
            details["exports"] = sum(g.ortmodule.state_machine.counters.exports for g in graphs)
            details["fallbacks"] = sum(1 for g in graphs if g.reason_in_pytorch)
            reasons = [g.reason_in_pytorch for g in graphs if g.reason_in_pytorch]
            if reasons:
                details["fallback_reason"] = f"graph in PyTorch: {reasons[0]}"
            return details

        return compiled, compile_ortcore_details
    if mode in ORTCORE_EXPORTERS:  # the cache directory comes from the worker's environment
        from ortcore.api import ORTModule

        wrapped = ORTModule(model, exporter=ORTCORE_EXPORTERS[mode])

        def ortcore_details() -> dict[str, Any]:
            c = wrapped.state_machine.counters
            return {
                "exports": c.exports,
                "cache_loads": c.cache_loads,
                "builds": c.builds,
                "reuses": c.reuses,
                "fallbacks": c.fallbacks,
                "fallback_reason": wrapped.fallback_reason,
                "exporter": getattr(getattr(wrapped._ortcore, "exporter", None), "name", None),
            }

        return wrapped, ortcore_details
    raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")


def _environment() -> dict[str, Any]:
    import onnxruntime
    import torch
    import transformers

    return {
        "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "hardware": describe_machine(),
    }


def run_worker(model_name: str, mode: str, cfg: BenchConfig) -> RunResult:
    """Train one model under one mode in this process and measure it. Meant to run in a fresh process."""
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; allowed: {', '.join(MODELS)}")
    if mode not in ALL_MODES:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(ALL_MODES)}")
    import torch
    import transformers

    base_mode, amp = split_mode(mode)

    transformers.logging.set_verbosity_error()  # config notices would bury the worker's real errors
    result = RunResult(model=model_name, mode=mode, environment=_environment())
    torch.manual_seed(cfg.seed)  # same seed in every worker: identical initial weights across modes
    model = build_model(model_name, cfg)
    model.train()
    result.details["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    if amp:
        result.details["autocast"] = f"cpu {AMP_DTYPES[amp]}"
    result.n_params = sum(p.numel() for p in model.parameters())
    batches = make_batches(model_name, cfg)
    # Wrappers share the model's parameters, so the optimizer can be built on the bare model.
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    rss = PeakRSS()
    result.rss_baseline_mib = rss.current_bytes() / _MIB
    rss.start()
    start = time.perf_counter()
    runner, details = _wrap(model, base_mode)
    result.setup_s = time.perf_counter() - start
    dtype = getattr(torch, AMP_DTYPES[amp]) if amp else None
    for batch in batches:
        start = time.perf_counter()
        # Only the forward under autocast: its backward runs in the types the forward chose.
        with torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext():
            loss = runner(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        result.step_times_s.append(time.perf_counter() - start)
        result.losses.append(loss.item())
    peak = rss.stop()
    result.peak_method = rss.method
    result.rss_peak_mib = peak / _MIB
    result.rss_peak_above_baseline_mib = result.rss_peak_mib - result.rss_baseline_mib
    result.first_step_s = result.setup_s + result.step_times_s[0]
    result.steady_step_s = statistics.median(result.step_times_s[cfg.warmup :])
    result.final_loss = result.losses[-1]
    result.details.update(details())
    result.ok = not result.fell_back
    if result.fell_back:
        result.error = f"ortcore fell back to PyTorch: {result.details.get('fallback_reason')}"
    return result


def _write_json_atomic(path: str, payload: Any) -> None:
    """Write JSON to ``path`` atomically (ortcore.files)."""
    with atomic_writer(path) as f:
        json.dump(payload, f, indent=2, allow_nan=True)
        f.write("\n")


#: The plugin whose ``explain_bench(model_name, cfg, steps=3, warmup=2) -> dict`` and ``render_explain(data)`` serve
#: ``ortcore bench --explain``; under ``--amp`` it is called with ``amp=`` the autocast dtype's name (``"bfloat16"``).
EXPLAIN_PLUGIN = "op_profiler"
EXPLAIN_MODULE = f"ortcore_plugins.{EXPLAIN_PLUGIN}"


def run_explain_worker(model_name: str, cfg: BenchConfig, amp: str = "off") -> dict[str, Any]:
    """Where one training step of ``model_name`` spends its time, from the op_profiler plugin (JSON-able); under
    ``amp`` (``bf16``, ``fp16``) the step whose forward runs under autocast."""
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; allowed: {', '.join(MODELS)}")
    if amp not in AMP_CHOICES:
        raise ValueError(f"unknown amp setting {amp!r}; allowed: {', '.join(AMP_CHOICES)}")
    import importlib

    explain_bench = importlib.import_module(EXPLAIN_MODULE).explain_bench
    if amp == "off":  # no keyword: a plugin written before autocast serves float32 as before
        return explain_bench(model_name, cfg)
    return explain_bench(model_name, cfg, amp=AMP_DTYPES[amp])


def _worker_main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``python -m ortcore_plugins.bench.suite (--worker MODEL MODE | --explain MODEL) --config JSON --out PATH``."""
    parser = argparse.ArgumentParser(prog="python -m ortcore_plugins.bench.suite", description="ortcore bench worker (internal)")
    task = parser.add_mutually_exclusive_group(required=True)
    task.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help="train and measure MODEL under MODE")
    task.add_argument("--explain", metavar="MODEL", help="explain MODEL's step through the op_profiler plugin")
    parser.add_argument("--config", required=True, help="BenchConfig as JSON")
    parser.add_argument("--out", required=True, help="where to write the result JSON")
    parser.add_argument("--amp", choices=AMP_CHOICES, default="off", help="with --explain: the autocast step")
    args = parser.parse_args(argv)
    if args.explain is not None:
        try:
            cfg = BenchConfig(**json.loads(args.config))
            payload = {"ok": True, "data": run_explain_worker(args.explain, cfg, args.amp)}
        except Exception as e:
            traceback.print_exc()
            payload = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _write_json_atomic(args.out, payload)
        return 0 if payload["ok"] else 1
    model_name, mode = args.worker
    try:
        cfg = BenchConfig(**json.loads(args.config))
        result = run_worker(model_name, mode, cfg)
    except Exception as e:
        # Report in the result, so the parent can show the error in the table row instead of a bare exit code.
        traceback.print_exc()
        result = RunResult(model=model_name, mode=mode, error=f"{type(e).__name__}: {e}")
    _write_json_atomic(args.out, asdict(result))
    return 0 if result.ok else 1


# -- the parent --------------------------------------------------------------------------------------------------
def _tail(text: str, lines: int = 5) -> str:
    return "\n".join(line for line in text.strip().splitlines()[-lines:])


def _spawn(
    task: list[str], cfg: BenchConfig, timeout_s: float, extra_env: dict[str, str] | None = None
) -> tuple[Any, str, float]:
    """Run ``python -m ortcore_plugins.bench.suite TASK --config ... --out ...`` in a fresh process with :data:`WORKER_ENV`.

    Returns the JSON the worker wrote (None if it wrote none), why it wrote none, and the process's wall time.
    """
    with tempfile.TemporaryDirectory(prefix="ortcore-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        env.update(WORKER_ENV)
        env.update(extra_env or {})
        # A fresh inductor cache per run: a warm on-disk cache from an earlier run would hide the compile cost.
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor")
        env["HF_HUB_OFFLINE"] = "1"  # models are built from configs; never reach for the network
        # The worker must run this very ortcore: our package root goes first on its path, and it runs in the empty
        # temporary directory so that no `ortcore` folder in the caller's working directory shadows it.
        import ortcore.api

        root = os.path.dirname(os.path.dirname(os.path.abspath(ortcore.api.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "ortcore_plugins.bench.suite", *task, "--config", json.dumps(cfg.to_dict()), "--out", out]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout_s:.0f} s", time.perf_counter() - start
        wall = time.perf_counter() - start
        try:
            with open(out) as f:
                return json.load(f), "", wall
        except (OSError, ValueError):
            return None, f"worker exited with {proc.returncode}: {_tail(proc.stderr) or 'no output'}", wall


def run_isolated(model_name: str, mode: str, cfg: BenchConfig, timeout_s: float = 1800.0) -> RunResult:
    """Run :func:`run_worker` in a fresh Python process with :data:`WORKER_ENV` and return its result.

    Never raises for a failed run: a crash, a timeout or an exception inside the worker becomes ``ok=False`` with
    ``error`` set.
    """
    base = split_mode(mode)[0]
    env = {"ORTCORE_EXPORTER": ORTCORE_EXPORTERS[base]} if base in ORTCORE_EXPORTERS else {}
    if mode in ORTCORE_EXPORTERS and mode.endswith(_CACHED_SUFFIX):
        with tempfile.TemporaryDirectory(prefix="ortcore-bench-cache-") as cache:
            env["ORTMODULE_CACHE_DIR"] = cache
            one_step = BenchConfig(**{**cfg.to_dict(), "steps": 1, "warmup": 0})
            cold = mode.removesuffix(_CACHED_SUFFIX)  # the same exporter without the cache: it fills the cache
            filled, why, _ = _spawn(["--worker", model_name, cold], one_step, timeout_s, env)
            if filled is None or not filled.get("ok"):
                why = why or (filled or {}).get("error") or "failed"
                return RunResult(
                    model=model_name, mode=mode, error=f"the run that fills the export cache failed: {why}"
                )
            data, why, wall = _spawn(["--worker", model_name, mode], cfg, timeout_s, env)
    else:
        data, why, wall = _spawn(["--worker", model_name, mode], cfg, timeout_s, env)
    try:
        result = RunResult(**data) if data is not None else RunResult(model=model_name, mode=mode, error=why)
    except TypeError:
        result = RunResult(model=model_name, mode=mode, error=f"worker wrote an unexpected result: {_short(str(data))}")
    result.wall_s = wall
    return result


def explain_isolated(
    model_name: str, cfg: BenchConfig, timeout_s: float = 1800.0, amp: str = "off"
) -> tuple[dict | None, str | None]:
    """Run :func:`run_explain_worker` in a fresh process: (the plugin's dict, None) or (None, why it failed)."""
    data, why, _ = _spawn(["--explain", model_name, *(["--amp", amp] if amp != "off" else [])], cfg, timeout_s)
    if data is None:
        return None, why
    return (data["data"], None) if data.get("ok") else (None, data.get("error") or "failed")


#: Above this share of the CPU taken by other processes during a run, its times are flagged as unreliable.
BUSY_WARNING_PCT = BUSY_PCT


def add_ratios(results: Sequence[RunResult]) -> None:
    """Fill ``vs_eager`` of every successful run with its ratio to the eager run of the same model and precision
    (``ortcore-bf16`` to ``eager-bf16``), and ``vs_eager_fp32`` of every autocast run with its ratio to float32
    eager."""
    eager = {(r.model, split_mode(r.mode)[1]): r for r in results if split_mode(r.mode)[0] == "eager" and r.ok}
    for r in results:
        amp = split_mode(r.mode)[1]
        r.vs_eager = _ratios(r, eager.get((r.model, amp)))
        r.vs_eager_fp32 = _ratios(r, eager.get((r.model, None))) if amp else {}


def _ratios(r: RunResult, base: RunResult | None) -> dict[str, float | None]:
    if base is None or not r.ok:
        return {}
    ratios: dict[str, float | None] = {}
    for key in ("first_step_s", "steady_step_s", "rss_peak_mib", "rss_peak_above_baseline_mib"):
        a, b = getattr(r, key), getattr(base, key)
        ratios[key] = a / b if a is not None and b else None
    ratios["final_loss_rel_diff"] = _rel_diff(r.final_loss, base.final_loss)
    # The whole curve, not only the last value: two runs can drift apart and meet again by chance.
    diffs = [_rel_diff(a, b) for a, b in zip(r.losses, base.losses)]
    ratios["max_loss_rel_diff"] = max((d for d in diffs if d is not None), default=None)
    return ratios


def _rel_diff(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale else 0.0


#: Version of the JSON layout :meth:`BenchSuite.to_json` writes; :meth:`BenchSuite.from_json` also reads files
#: without one (a single configuration, written before presets existed).
JSON_FORMAT = "ortcore-bench/2"


@dataclass
class BenchReport:
    """All runs of one configuration and the settings they ran with."""

    config: BenchConfig
    results: list[RunResult]
    worker_env: dict[str, str]
    wall_s: float
    name: str = "default"  # the preset the configuration started from
    overrides: dict[str, int] = field(default_factory=dict)  # settings given on the command line
    explain: dict[str, dict[str, Any]] = field(default_factory=dict)  # model -> op_profiler's explain_bench dict
    explain_errors: dict[str, str] = field(default_factory=dict)  # model -> why its explain worker failed
    amp: str = "off"  # --amp: which autocast rows ran beside the float32 ones (and what --explain profiled)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results) and not self.explain_errors

    @property
    def low_precision_units(self) -> dict[str, str | None] | None:
        """The CPU's bfloat16/float16 matrix units (AMX-BF16, AVX512-BF16, ...) as the workers saw them, or None
        for results written before the machine service named them."""
        for r in self.results:
            units = (r.environment.get("hardware") or {}).get("low_precision_units")
            if units is not None:
                return units
        return None

    @property
    def n_params(self) -> dict[str, int]:
        """Parameter count of each model, from any of its runs that got as far as building it."""
        return {r.model: r.n_params for r in self.results if r.n_params is not None}

    def to_json(self) -> dict[str, Any]:
        """The whole report as one suite (see :meth:`BenchSuite.to_json`)."""
        return BenchSuite([self], {}, self.wall_s).to_json()

    def config_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "overrides": self.overrides,
            **self.config.to_dict(),
            "heads": self.config.heads,
            "n_params": self.n_params,
            "steady_step": f"median of steps {self.config.warmup + 1}..{self.config.steps}",
            "wall_s": self.wall_s,
            "explain": self.explain,
            "explain_errors": self.explain_errors,
            "amp": self.amp,
            "amp_dtype": AMP_DTYPES.get(self.amp),
            "low_precision_units": self.low_precision_units,
            "summary": summary_lines(self) if self.results else [],  # the lines printed under the table
        }


def _run_result(data: dict[str, Any]) -> RunResult:
    known = {f.name for f in fields(RunResult)}
    return RunResult(**{k: v for k, v in data.items() if k in known})


@dataclass
class BenchSuite:
    """The reports of one ``ortcore bench`` command, one per configuration, and where they ran."""

    reports: list[BenchReport]
    environment: dict[str, Any]  # the parent's view: platform, cores, Python; each run has the worker's view
    wall_s: float

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports)

    def to_json(self) -> dict[str, Any]:
        """Everything the tables, the summaries and the plot show, and the raw measurements behind them."""
        worker_env = next((r.worker_env for r in self.reports), dict(WORKER_ENV))
        results = []
        for report in self.reports:
            footnotes = _failure_index(report)
            for i, r in enumerate(report.results):
                # notes: the table's notes cell as shown (derived from details, errors and others_cpu_pct)
                results.append({**asdict(r), "config": report.name, "notes": _notes(r, footnotes.get(i))})
        return {
            "format": JSON_FORMAT,
            "settings": {
                "optimizer": "AdamW",
                "dropout": 0.0,
                "worker_env": worker_env,
                "isolation": "one fresh subprocess per (model, mode); fresh inductor cache dir per run",
                "first_step": "setup call + step 1 (ortcore: export + build + step; compile: compile + step)",
                "steady_step": "median of the step times after the warmup steps",
                "rss": "rss_peak_mib is the peak during training; baseline is after model creation",
                "busy_warning_pct": BUSY_WARNING_PCT,
            },
            "environment": self.environment,
            "configs": [r.config_json() for r in self.reports],
            "results": results,
            "wall_s": self.wall_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BenchSuite:
        """The suite :meth:`to_json` wrote; raises ``ValueError`` naming what is missing."""
        if data.get("format", JSON_FORMAT) != JSON_FORMAT:
            raise ValueError(f"format {data['format']!r}; this ortcore reads {JSON_FORMAT!r}")
        try:
            settings = data["settings"]
            worker_env = dict(settings.get("worker_env") or {})
            if "configs" not in data:  # a single configuration, its settings inline
                known = {f.name for f in attrs.fields(BenchConfig)}
                cfg = BenchConfig(**{k: v for k, v in settings.items() if k in known})
                results = [_run_result(r) for r in data["results"]]
                report = BenchReport(cfg, results, worker_env, data.get("wall_s") or 0.0)
                return cls([report], data.get("environment") or {}, data.get("wall_s") or 0.0)
            reports = []
            for c in data["configs"]:
                known = {f.name for f in attrs.fields(BenchConfig)}
                cfg = BenchConfig(**{k: v for k, v in c.items() if k in known})
                results = [_run_result(r) for r in data["results"] if r.get("config") == c["name"]]
                reports.append(
                    BenchReport(
                        cfg,
                        results,
                        worker_env,
                        c.get("wall_s") or 0.0,
                        name=c["name"],
                        overrides=dict(c.get("overrides") or {}),
                        explain=dict(c.get("explain") or {}),
                        explain_errors=dict(c.get("explain_errors") or {}),
                        amp=c.get("amp") or "off",
                    )
                )
            return cls(reports, data.get("environment") or {}, data.get("wall_s") or 0.0)
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"not an ortcore bench result file ({type(e).__name__}: {e})") from None


def load_suite(path: str) -> BenchSuite:
    """Read a file written by :func:`write_json`; raises ``ValueError`` naming the file if it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read {path!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"{path!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path!r}: not an ortcore bench result file (top level is not an object)")
    try:
        return BenchSuite.from_json(data)
    except ValueError as e:
        raise ValueError(f"{path!r}: {e}") from None


def host_environment() -> dict[str, Any]:
    """The parent's platform, cores and Python (versions of torch and the rest are in each run's environment)."""
    import platform

    from ortcore.api import ORTCORE_VERSION as __version__

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "ortcore": __version__,
        "hardware": describe_machine(),
    }


def run_bench(
    models: Sequence[str],
    modes: Sequence[str],
    cfg: BenchConfig,
    on_start: Callable[[str, str, int, int], None] | None = None,
    on_done: Callable[[RunResult, int, int], None] | None = None,
    timeout_s: float = 1800.0,
    name: str = "default",
    amp: str = "off",
) -> BenchReport:
    """Run every (model, mode) pair, one after the other, each in its own process.

    Runs are sequential on purpose: two at once would share the cores and spoil each other's times.
    ``on_start(model, mode, index, total)`` and ``on_done(result, index, total)`` report progress.
    """
    cfg.validate()
    _check_names(models, modes)
    # Eager (and its autocast twin) first within each model, so that a partial run still has the baselines for
    # ratios; an autocast row right after its float32 twin.
    ordered = sorted(modes, key=lambda m: split_mode(m)[0] != "eager")
    pairs = [(model, mode) for model in models for mode in ordered]
    start = time.perf_counter()
    results = []
    for i, (model, mode) in enumerate(pairs, 1):
        if on_start is not None:
            on_start(model, mode, i, len(pairs))
        others = OthersCPU()
        result = run_isolated(model, mode, cfg, timeout_s=timeout_s)
        result.others_cpu_pct = others.stop()
        result.config = name
        results.append(result)
        if on_done is not None:
            on_done(result, i, len(pairs))
    add_ratios(results)
    return BenchReport(cfg, results, dict(WORKER_ENV), time.perf_counter() - start, name=name, amp=amp)


def _check_names(models: Sequence[str], modes: Sequence[str]) -> None:
    for m in models:
        if m not in MODELS:
            raise ValueError(f"unknown model {m!r}; allowed: {', '.join(MODELS)}")
    for m in modes:
        if m not in ALL_MODES:
            raise ValueError(f"unknown mode {m!r}; allowed: {', '.join(ALL_MODES)}")


def run_suite(
    models: Sequence[str],
    modes: Sequence[str],
    configs: dict[str, BenchConfig],
    *,
    overrides: dict[str, int] | None = None,
    explain: bool = False,
    on_start: Callable[[str, int, int], None] | None = None,
    on_done: Callable[[bool, float, str, int, int], None] | None = None,
    timeout_s: float = 1800.0,
    amp: str = "off",
) -> BenchSuite:
    """:func:`run_bench` for each named configuration, in order; with ``explain``, after each configuration's runs,
    one more fresh worker per model calls the op_profiler plugin's ``explain_bench``. ``amp`` (``bf16``, ``fp16``)
    adds each of ``eager``, ``compile`` and ``ortcore`` that ``modes`` names again under autocast
    (:func:`with_amp`), and ``explain`` then profiles the autocast step.

    ``on_start(label, index, total)`` and ``on_done(ok, wall_s, what, index, total)`` report progress, where ``label``
    names the task (``"quick: gpt2 / ortcore"``) and ``what`` sums up its outcome in one line.
    """
    for cfg in configs.values():
        cfg.validate()
    modes = with_amp(modes, amp)
    _check_names(models, modes)
    total = len(configs) * len(models) * (len(modes) + bool(explain))
    done = 0
    start = time.perf_counter()
    reports = []
    for name, cfg in configs.items():

        def started(model: str, mode: str, i: int, n: int, name: str = name, offset: int = done) -> None:
            if on_start is not None:
                on_start(f"{name}: {model} / {mode}", offset + i, total)

        def finished(r: RunResult, i: int, n: int, offset: int = done) -> None:
            if on_done is not None:
                on_done(r.ok, r.wall_s or 0.0, _run_outcome(r), offset + i, total)

        report = run_bench(models, modes, cfg, started, finished, timeout_s, name=name, amp=amp)
        done += len(report.results)
        report.overrides = dict(overrides or {})
        if explain:
            explain_start = time.perf_counter()
            for model in models:
                done += 1
                if on_start is not None:
                    what = EXPLAIN_PLUGIN if amp == "off" else f"{EXPLAIN_PLUGIN}, autocast {AMP_DTYPES[amp]}"
                    on_start(f"{name}: {model} / explain ({what})", done, total)
                t0 = time.perf_counter()
                data, error = explain_isolated(model, cfg, timeout_s=timeout_s, amp=amp)
                if data is not None:
                    report.explain[model] = data
                else:
                    report.explain_errors[model] = error or "failed"
                if on_done is not None:
                    what = "explained" if data is not None else f"failed: {_first_line(error)}"
                    on_done(data is not None, time.perf_counter() - t0, what, done, total)
            report.wall_s += time.perf_counter() - explain_start
        reports.append(report)
    return BenchSuite(reports, host_environment(), time.perf_counter() - start)


def _first_line(text: str | None) -> str:
    return ((text or "").strip() or "failed").splitlines()[0][:200]


def _run_outcome(r: RunResult) -> str:
    if r.ok:
        return f"first step {r.first_step_s:.2f} s, steady {r.steady_step_s * 1e3:.1f} ms"
    return f"failed: {_first_line(r.error)}"


def write_json(report: BenchReport | BenchSuite, path: str) -> None:
    """Write the whole suite (or one report) as JSON, atomically (a reader never sees a half-written file)."""
    _write_json_atomic(path, report.to_json())


# -- presentation ------------------------------------------------------------------------------------------------
def _ratio(value: float | None) -> str:
    return "" if value is None or not math.isfinite(value) else f" ({value:.2f}×)"


def _ratio_cell(r: RunResult, key: str) -> str:
    """`` (0.91×)``: the ratio to eager of the row's precision; an autocast row adds its ratio to float32 eager,
    `` (0.91×; 0.62× fp32)``."""
    parts = [
        f"{value:.2f}×{suffix}"
        for value, suffix in ((r.vs_eager.get(key), ""), (r.vs_eager_fp32.get(key), " fp32"))
        if value is not None and math.isfinite(value)
    ]
    return f" ({'; '.join(parts)})" if parts else ""


def amp_line(report: BenchReport) -> str | None:
    """What the autocast rows of ``report`` ran under, and whether this CPU multiplies that dtype natively (AMX,
    AVX512-BF16, ...): None when ``--amp`` was off."""
    dtype = AMP_DTYPES.get(report.amp)
    if dtype is None:
        return None
    head = f'{report.amp} rows: forward under torch.autocast("cpu", dtype=torch.{dtype}); '
    units = report.low_precision_units
    if units is None:
        return head + "the CPU's low-precision units are not recorded in these results"
    candidates = [unit for d, unit, _ in LOW_PRECISION_UNITS if d == dtype]
    unit = units.get(dtype)
    if unit:
        return head + f"this CPU's {dtype} matrix unit: {unit} (best of {', '.join(candidates)})"
    return head + (
        f"this CPU has no {dtype} matrix unit (no {', no '.join(candidates)}): oneDNN emulates {dtype}, slower than "
        "float32"
    )


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1_000_000 else f"{n / 1e3:.0f}k"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _failure_index(report: BenchReport) -> dict[int, int]:
    """Footnote number of each failed run, keyed by its position in ``report.results``."""
    failed = [i for i, r in enumerate(report.results) if not r.ok]
    return {i: n for n, i in enumerate(failed, 1)}


def _notes(r: RunResult, footnote: int | None) -> str:
    if footnote is not None:
        return f"fell back to PyTorch, see [{footnote}]" if r.fell_back else f"FAILED, see [{footnote}]"
    notes = _mode_notes(r)
    if (r.others_cpu_pct or 0) > BUSY_WARNING_PCT:
        notes = ", ".join(n for n in (notes, f"others used {r.others_cpu_pct:.0f}% CPU") if n)
    return notes


def _mode_notes(r: RunResult) -> str:
    d = r.details
    mode = split_mode(r.mode)[0]
    if mode in ORTCORE_EXPORTERS:
        loads, exports = d.get("cache_loads") or 0, d.get("exports")
        if loads:  # a graph the export cache served is not an export: say which the row measured
            fresh = (exports or 0) - loads
            graphs = f"graphs from the export cache {loads}" + (f", exports {fresh}" if fresh else " (no export)")
        else:
            graphs = f"exports {exports}" + (" (the export cache missed)" if mode.endswith(_CACHED_SUFFIX) else "")
        notes = f"{graphs}, builds {d.get('builds')}, fallbacks {d.get('fallbacks')}"
        ran = d.get("exporter")
        # The exporter a plugin (ortcore_exporter) chose instead of the mode's would make the row another mode's.
        return notes if ran in (None, ORTCORE_EXPORTERS[mode]) else f"{notes}, ran on exporter {ran!r}"
    if mode.startswith("compile-ortcore") and "graphs" in d:
        return (
            f"graph breaks {d.get('graph_breaks', '?')}, ORT graphs {d['graphs']}, exports {d.get('exports')}, "
            f"in PyTorch {d.get('fallbacks')}"
        )
    if mode == "compile" and "graph_breaks" in d:
        return f"graph breaks {d['graph_breaks']}"
    return ""


#: What a table or plot says of results read from a file written before runs recorded their machine.
NO_MACHINE = "a machine these results do not name (written by an older ortcore)"


def results_table(report: BenchReport) -> Any:
    """A ``rich.table.Table`` of the report: one row per (model, mode), ratios to eager in parentheses."""
    from rich.table import Table

    cfg = report.config
    env = next((r.environment for r in report.results if r.environment), {})
    settings = ", ".join(f"{k}={v}" for k, v in report.worker_env.items())
    params = ", ".join(f"{m} {_millions(n)}" for m, n in report.n_params.items())
    machine = machine_line(env["hardware"]) if env.get("hardware") else NO_MACHINE
    amp = amp_line(report)
    title = (
        f"ortcore bench on {machine}\n"
        + (f"{amp}\n" if amp else "")
        + f"config {report.name!r}: {cfg.steps} AdamW steps, batch {cfg.batch} × seq {cfg.seq}, "
        f"hidden {cfg.hidden}, {_plural(cfg.layers, 'layer')}, {_plural(cfg.heads, 'head')}, vocab {cfg.vocab}, "
        f"dropout 0{f'; parameters: {params}' if params else ''}\n"
        f"worker env: {settings} (set before torch is imported), torch threads {env.get('torch_threads', '?')}; "
        f"one fresh process per row, cold inductor cache"
    )
    caption = (
        f"first step = setup + step 1 (ortcore: export + build + step; compile: compile + step). "
        f"steady = median of steps {cfg.warmup + 1}..{cfg.steps}. "
        "base = RSS after model creation; peak = highest RSS during training; "
        "the memory ratio (×eager) is of peak − base, i.e. memory training added. "
        f"torch {env.get('torch', '?')}, onnxruntime {env.get('onnxruntime', '?')}, "
        f"transformers {env.get('transformers', '?')}."
        + (
            f" -{report.amp} rows: ratios to eager-{report.amp}, then to float32 eager (× fp32)."
            if report.amp in AMP_DTYPES
            else ""
        )
    )
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    table.add_column("model")
    table.add_column("mode")
    table.add_column("first step s", justify="right")
    table.add_column("steady step ms", justify="right")
    table.add_column("base MiB", justify="right")
    table.add_column("peak MiB", justify="right")
    table.add_column("peak − base MiB", justify="right")
    table.add_column("final loss", justify="right")
    table.add_column("notes")
    footnotes = _failure_index(report)
    previous = None
    for i, r in enumerate(report.results):
        if previous is not None and r.model != previous:
            table.add_section()
        previous = r.model
        if r.first_step_s is None:  # the run produced no measurements at all
            table.add_row(r.model, r.mode, *(["—"] * 6), _notes(r, footnotes.get(i)), style="red")
            continue
        table.add_row(
            r.model,
            r.mode,
            f"{r.first_step_s:.2f}{_ratio_cell(r, 'first_step_s')}",
            f"{r.steady_step_s * 1e3:.1f}{_ratio_cell(r, 'steady_step_s')}",
            f"{r.rss_baseline_mib:.0f}",
            f"{r.rss_peak_mib:.0f}",
            f"{r.rss_peak_above_baseline_mib:.0f}{_ratio_cell(r, 'rss_peak_above_baseline_mib')}",
            f"{r.final_loss:.6f}",
            _notes(r, footnotes.get(i)),
            style=None if r.ok else "red",
        )
    return table


def summary_lines(report: BenchReport) -> list[str]:
    """Short conclusions under the table: loss agreement, the failures the table points to, the slowest step."""
    lines = []
    for amp in (None, *AMP_DTYPES):
        compared = [
            r
            for r in report.results
            if r.ok
            and split_mode(r.mode)[1] == amp
            and split_mode(r.mode)[0] != "eager"
            and r.vs_eager.get("max_loss_rel_diff") is not None
        ]
        if compared:
            worst = max(compared, key=lambda r: r.vs_eager["max_loss_rel_diff"])
            what = "loss curves vs eager" if amp is None else f"{amp} loss curves vs eager-{amp}"
            lines.append(
                f"{what}: max relative difference {worst.vs_eager['max_loss_rel_diff']:.1e} "
                f"over all {report.config.steps} steps ({worst.model}/{worst.mode})"
            )
        if amp is None:
            continue
        # How far autocast itself moves eager's curve: the scale the autocast rows' agreement is read against.
        own = [r for r in report.results if r.ok and r.mode == f"eager-{amp}" and r.vs_eager_fp32.get("max_loss_rel_diff") is not None]  # fmt: skip
        if own:
            worst = max(own, key=lambda r: r.vs_eager_fp32["max_loss_rel_diff"])
            lines.append(
                f"eager-{amp} vs eager (float32): max relative difference "
                f"{worst.vs_eager_fp32['max_loss_rel_diff']:.1e} ({worst.model}): {AMP_DTYPES[amp]}'s own rounding"
            )
    for i, n in _failure_index(report).items():
        r = report.results[i]
        lines.append(f"[{n}] {r.model}/{r.mode}: {_short(r.error or 'failed', 600)}")
    busy = [r for r in report.results if (r.others_cpu_pct or 0) > BUSY_WARNING_PCT]
    if busy:
        worst = max(r.others_cpu_pct or 0 for r in busy)
        lines.append(
            f"warning: other processes took CPU during {len(busy)} run(s) (up to {worst:.0f}% of the machine); "
            "their times are inflated (see notes), rerun on an idle machine"
        )
    timed = [r for r in report.results if r.first_step_s is not None]
    if timed:
        slow = max(timed, key=lambda r: r.first_step_s)
        lines.append(f"slowest first step: {slow.model}/{slow.mode} {slow.first_step_s:.1f} s")
    lines.append(f"total wall time {report.wall_s:.0f} s (imports and model creation included)")
    return lines


# -- plot --------------------------------------------------------------------------------------------------------
#: What each panel of :func:`plot_suite` shows: title, RunResult field, scale to the unit shown, unit.
PLOT_PANELS: tuple[tuple[str, str, float, str], ...] = (
    ("steady step", "steady_step_s", 1e3, "ms"),
    ("memory added (peak − base RSS)", "rss_peak_above_baseline_mib", 1.0, "MiB"),
)
PLOT_SIZE_IN: tuple[float, float] = (12.0, 5.0)
PLOT_DPI = 100
_MODE_COLORS = {
    "eager": "tab:gray",
    "compile": "tab:orange",
    "compile-ortcore": "tab:purple",
    "compile-ortcore-aot": "tab:pink",
    "ortcore": "tab:blue",
    "ortcore-cached": "tab:cyan",
    "ortcore-dynamo": "tab:green",
    "ortcore-dynamo-cached": "tab:olive",
    "eager-bf16": "black",
    "compile-bf16": "gold",
    "ortcore-bf16": "navy",
    "eager-fp16": "dimgray",
    "compile-fp16": "darkgoldenrod",
    "ortcore-fp16": "royalblue",
}
_MODEL_STYLES = {"bert": ("o", "-"), "gpt2": ("s", "--")}


def _plot_points(suite: BenchSuite) -> dict[tuple[str, str], list[tuple[str, int, RunResult]]]:
    """(model, mode) -> [(config name, parameter count, run)] of the successful runs, smallest model first."""
    points: dict[tuple[str, str], list[tuple[str, int, RunResult]]] = {}
    for report in suite.reports:
        n_params = report.n_params
        for r in report.results:
            if r.ok and r.model in n_params:
                points.setdefault((r.model, r.mode), []).append((report.name, n_params[r.model], r))
    for series in points.values():
        series.sort(key=lambda p: p[1])
    return points


def plot_suite(suite: BenchSuite, path: str) -> None:
    """Draw steady step time and memory added for every model and mode into a PNG at ``path``, atomically.

    Several configurations: one line per (model, mode) against the parameter count. One configuration: bars. Every
    point but eager's is annotated with its ratio to eager. Needs matplotlib; uses its Agg canvas, so no display.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    points = _plot_points(suite)
    if not points:
        raise ValueError("nothing to plot: no successful run in the results")
    configs = [r.name for r in suite.reports if any(c == r.name for s in points.values() for c, _, _ in s)]
    fig = Figure(figsize=PLOT_SIZE_IN, dpi=PLOT_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PLOT_PANELS))
    for ax, (title, key, scale, unit) in zip(axes, PLOT_PANELS):
        if len(configs) == 1:
            _bars(ax, points, key, scale)
        else:
            _lines(ax, points, key, scale)
        ax.set_title(f"{title}, {unit}")
        ax.set_ylabel(unit)
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend(fontsize="small")
    machine = next((r.environment.get("hardware") for rep in suite.reports for r in rep.results if r.environment), None)
    amps = sorted({split_mode(mode)[1] for _, mode in points} - {None})
    to_eager = "ratio to eager" + "".join(f", -{a} rows to eager-{a}" for a in amps)
    fig.suptitle(f"ortcore bench: eager vs torch.compile vs ortcore (config{'s' if len(configs) > 1 else ''} "
                 f"{', '.join(configs)}); ×: {to_eager}\n"
                 f"on {machine_line(machine) if machine else NO_MACHINE}")  # fmt: skip
    with atomic_writer(path, "wb") as f:
        fig.savefig(f, format="png", dpi=PLOT_DPI)


def _value(r: RunResult, key: str, scale: float) -> float | None:
    v = getattr(r, key)
    return None if v is None or not math.isfinite(v) else v * scale


def _lines(ax: Any, points: dict, key: str, scale: float) -> None:
    order = {m: i for i, m in enumerate(ALL_MODES)}
    for (model, mode), series in sorted(points.items(), key=lambda item: (item[0][0], order.get(item[0][1], 9))):
        xs = [n / 1e6 for _, n, r in series if _value(r, key, scale) is not None]
        ys = [_value(r, key, scale) for _, _, r in series if _value(r, key, scale) is not None]
        marker, style = _MODEL_STYLES.get(model, ("^", ":"))
        ax.plot(xs, ys, marker=marker, linestyle=style, color=_MODE_COLORS.get(mode), label=f"{model} / {mode}")
        if split_mode(mode)[0] == "eager":
            continue
        for _, n, r in series:
            ratio, y = r.vs_eager.get(key), _value(r, key, scale)
            if ratio is not None and y is not None:
                # compile's ratio above its point, ortcore's below: the two lines often run close together
                offset = (4, 5) if mode == "compile" else (4, -11)
                ax.annotate(f"{ratio:.2f}×", (n / 1e6, y), textcoords="offset points", xytext=offset, fontsize=7,
                            color=_MODE_COLORS.get(mode))  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters (millions)")


def _bars(ax: Any, points: dict, key: str, scale: float) -> None:
    models = list(dict.fromkeys(model for model, _ in sorted(points)))
    modes = [m for m in ALL_MODES if any(mode == m for _, mode in points)]
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        for i, model in enumerate(models):
            series = points.get((model, mode))
            y = _value(series[0][2], key, scale) if series else None
            if y is None:
                continue
            x = i + (j - (len(modes) - 1) / 2) * width
            ax.bar(x, y, width, color=_MODE_COLORS.get(mode), label=mode if i == 0 else None)
            ratio = series[0][2].vs_eager.get(key)
            if split_mode(mode)[0] != "eager" and ratio is not None:
                ax.annotate(f"{ratio:.2f}×", (x, y), textcoords="offset points", xytext=(0, 2), ha="center",
                            fontsize=8)  # fmt: skip
    params = {model: series[0][1] for (model, _), series in points.items()}
    ax.set_xticks(range(len(models)), [f"{m}\n{_millions(params[m])} parameters" for m in models])


if __name__ == "__main__":
    sys.exit(_worker_main())
