"""The machine a number was measured on: CPU model, cores, instruction-set level, and the GEMM code each engine runs.

Step times depend on the CPU more than on anything ortcore does: on one 2-core machine ONNX Runtime's GEMMs beat
PyTorch's by 2x, on another they tie. Every speed number ortcore prints (``ortcore bench``: table, JSON, plot;
``ortcore doctor``) carries :func:`describe_machine`'s answer, so that a number is never read as if it held
elsewhere.

The instruction-set level is read from the CPU's flags (``/proc/cpuinfo`` on Linux): AMX, AVX-512, AVX2, AVX or
baseline. Which GEMM each side runs follows from it: PyTorch's float32 matmul goes to its BLAS (MKL, OpenBLAS, ...,
as ``torch.__config__.show()`` reports, with oneDNN for some ops) at the ISA torch reports
(``torch.backends.cpu.get_cpu_capability()``); ONNX Runtime's CPU provider runs its own MLAS, whose float32 GEMM
kernel is chosen by ISA the same way (AVX-512F, else FMA3/AVX2, else AVX, else SSE).

:class:`OthersCPU` measures how much of the machine other processes took while something was timed: the bench flags
rows above :data:`BUSY_PCT`, and the kernel choice keeps such a measurement for its process only (provisional).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import time
from pathlib import Path
from typing import Any

#: ISA levels, best first: (name, the CPU flags that make it).
ISA_LEVELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("AMX", ("amx_tile", "amx_bf16")),
    ("AVX-512", ("avx512f", "avx512bw", "avx512vl")),
    ("AVX2", ("avx2", "fma")),
    ("AVX", ("avx",)),
)

#: MLAS's float32 GEMM kernel for each ISA level (onnxruntime/core/mlas/lib/platform.cpp picks it at start-up).
MLAS_SGEMM = {"AMX": "AVX-512F", "AVX-512": "AVX-512F", "AVX2": "FMA3 (AVX2)", "AVX": "AVX", "baseline": "SSE2"}


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return fields
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor's block is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def isa_level(flags: set[str]) -> str:
    """The best ISA level all of whose flags the CPU has, or ``"baseline"``."""
    for name, needed in ISA_LEVELS:
        if all(f in flags for f in needed):
            return name
    return "baseline"


#: The CPU's units for low-precision matrix products, best first: (dtype, unit, the CPU flags that make it).
LOW_PRECISION_UNITS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("bfloat16", "AMX-BF16", ("amx_tile", "amx_bf16")),
    ("bfloat16", "AVX512-BF16", ("avx512_bf16",)),
    ("float16", "AMX-FP16", ("amx_tile", "amx_fp16")),
    ("float16", "AVX512-FP16", ("avx512_fp16",)),
)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo().get("flags", "").split())


def low_precision_units(flags: frozenset[str] | set[str] | None = None) -> dict[str, str | None]:
    """Per low-precision dtype (``bfloat16``, ``float16``), the best unit of this CPU that multiplies it natively
    (``AMX-BF16``, ``AVX512-BF16``, ...), or None: PyTorch's oneDNN kernels then emulate it, slower than float32.
    ``flags`` default to this CPU's (read once per process)."""
    if flags is None:
        flags = _cpu_flags()
    found: dict[str, str | None] = {"bfloat16": None, "float16": None}
    for dtype, unit, needed in LOW_PRECISION_UNITS:
        if found[dtype] is None and all(f in flags for f in needed):
            found[dtype] = unit
    return found


def _torch_blas() -> str:
    """PyTorch's BLAS and oneDNN, as its build configuration names them."""
    try:
        import torch
    except ImportError:
        return "torch not installed"
    config = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=(\w+)", config)
    onednn = re.search(r"MKL-DNN v([\d.]+)", config)
    parts = [blas.group(1) if blas else "unknown BLAS"]
    if onednn:
        parts.append(f"oneDNN {onednn.group(1)}")
    return " + ".join(parts)


def describe_machine(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """What a measurement on this machine should name: ``cpu``, ``cores`` (logical, and those this process may
    use), ``isa``, ``torch_cpu_capability``, ``torch_gemm`` and ``ort_gemm``."""
    info = _cpuinfo(cpuinfo)
    flags = set(info.get("flags", "").split())
    isa = isa_level(flags) if flags else "unknown"
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        capability = "unknown"
    name = info.get("model name") or platform.processor() or platform.machine()
    if not re.search(r"\d", name) and "cpu family" in info:  # a virtual machine's bare "AMD EPYC": say which one
        name = f"{name} (family {info['cpu family']}, model {info.get('model', '?')})"
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "isa": isa,
        "torch_cpu_capability": capability,
        "torch_gemm": _torch_blas(),
        "ort_gemm": f"MLAS, {MLAS_SGEMM.get(isa, 'kernel chosen by ISA')} float32 kernel",
        "low_precision_units": low_precision_units(flags),
    }


def machine_line(machine: dict[str, Any]) -> str:
    """One line naming the machine, for a table's title or a plot's."""
    cores = machine.get("cores")
    usable = machine.get("usable_cores")
    core_text = f"{cores} cores" if usable in (None, cores) else f"{usable} of {cores} cores"
    return (
        f"{machine.get('cpu', '?')}, {core_text}, {machine.get('isa', '?')}; GEMMs: torch "
        f"{machine.get('torch_gemm', '?')} at {machine.get('torch_cpu_capability', '?')}, ORT {machine.get('ort_gemm', '?')}"
    )


class OthersCPU:
    """CPU share that processes other than this one and its children used between creation and :meth:`stop`.

    Other work on the machine inflates step times (two cores are easily taken); this makes that visible instead of
    leaving it to be guessed from odd numbers. Machine-wide busy time (stolen time included, as the hypervisor's
    other tenants count too) minus our own and our finished children's CPU time, over the wall time × cores.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            import resource

            import psutil

            t = psutil.cpu_times()
            busy = sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))
            own = sum(
                r.ru_utime + r.ru_stime
                for r in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN))
            )
            return busy, own, time.monotonic()
        except Exception:  # only a warning depends on it
            return None

    def stop(self) -> float | None:
        """Others' share of the whole machine in percent (0 = we had it to ourselves), or None if unknown."""
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        import psutil

        cores = psutil.cpu_count() or 1
        others = (end[0] - self._start[0]) - (end[1] - self._start[1])
        capacity = (end[2] - self._start[2]) * cores
        # The machine's busy time is counted in clock ticks (10 ms each, per core): a short window is read +-1 tick.
        self.uncertain_pct = 100.0 * TICK_S * cores / capacity
        return max(0.0, min(100.0, 100.0 * others / capacity))

    uncertain_pct = 0.0  # set by stop(): how far the share may be off from the counters' resolution alone


def loaded(others: OthersCPU, pct: float | None, threshold: float | None = None) -> bool:
    """Were other processes above ``threshold`` percent (:data:`BUSY_PCT`) of the machine while ``others`` watched,
    beyond what the counters' resolution can explain? ``pct`` is what ``others.stop()`` returned."""
    if pct is None:
        return False
    return pct > (BUSY_PCT if threshold is None else threshold) + getattr(others, "uncertain_pct", 0.0)


#: The resolution of the machine's busy time (/proc/stat counts USER_HZ ticks).
TICK_S = 0.01


#: Above this share of the CPU taken by other processes during a measurement, it is not trusted as final.
BUSY_PCT = 10.0
