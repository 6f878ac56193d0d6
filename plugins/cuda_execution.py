"""cuda_execution: the CUDA execution provider's options, and the variables that act only on CUDA.

``ORTMODULE_ENABLE_TUNING``, ``ORTMODULE_MAX_TUNING_DURATION_MS``, ``ORTMODULE_TUNING_RESULTS_PATH`` and
``ORTMODULE_CONV_ALGO_SEARCH`` become options of ONNX Runtime's CUDA execution provider for sessions on a CUDA
device. ``ORTMODULE_USE_TRITON``, ``ORTMODULE_TRITON_CONFIG_FILE``, ``ORTMODULE_TRITON_DEBUG`` and
``ORTMODULE_USE_FLASH_ATTENTION`` need ONNX Runtime's Triton code generation, which only CUDA training builds
have. On a CPU session each set variable is reported once, at WARNING, with what it would do: never silently
ignored, never an error (the same script runs on a laptop and on a GPU node).
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import torch

from ortcore.api import OptionError, hookimpl, option, parse_bool

logger = logging.getLogger("ortcore.cuda_execution")

CONV_ALGOS = ("HEURISTIC", "EXHAUSTIVE", "DEFAULT")


def _conv_algo(value: object, source: str) -> str:
    text = str(value).strip().upper()
    if text not in CONV_ALGOS:
        raise OptionError(f"{source}={value!r} is not a cuDNN algorithm search; allowed: {', '.join(CONV_ALGOS)}")
    return text


def _non_negative_int(value: object, source: str) -> int:
    try:
        number = int(str(value).strip()) if not isinstance(value, bool) else -1
    except ValueError:
        number = -1
    if number < 0:
        raise OptionError(f"{source}={value!r} is not allowed; allowed: an integer >= 0 (milliseconds, 0 = no limit)")
    return number


def _path(value: object, source: str) -> str:
    if not isinstance(value, str):
        raise OptionError(f"{source}={value!r} must be a path string")
    return value


@attrs.frozen
class CudaExecutionOptions:
    enable_tuning: bool = option(
        False, parse_bool, "tune kernels online (CUDA EP tunable ops)", "ORTMODULE_ENABLE_TUNING"
    )
    max_tuning_duration_ms: int = option(
        0, _non_negative_int, "time limit per tuned op, ms (0 = none)", "ORTMODULE_MAX_TUNING_DURATION_MS"
    )
    tuning_results_path: str = option(
        "", _path, "where tuning results are read/written", "ORTMODULE_TUNING_RESULTS_PATH"
    )
    conv_algo_search: str = option(
        "HEURISTIC", _conv_algo, "cuDNN convolution algorithm search", "ORTMODULE_CONV_ALGO_SEARCH"
    )
    use_triton: bool = option(False, parse_bool, "Triton code generation (CUDA builds only)", "ORTMODULE_USE_TRITON")
    triton_config_file: str = option("", _path, "Triton op configuration (JSON)", "ORTMODULE_TRITON_CONFIG_FILE")
    triton_debug: bool = option(False, parse_bool, "save Triton sub-graphs and code", "ORTMODULE_TRITON_DEBUG")
    use_flash_attention: bool = option(
        False, parse_bool, "Triton flash attention (needs use_triton, sm >= 80)", "ORTMODULE_USE_FLASH_ATTENTION"
    )


def _options(config: Any) -> CudaExecutionOptions:
    return config.plugin_options("cuda_execution") or CudaExecutionOptions()


def _set_fields(options: CudaExecutionOptions) -> list[str]:
    """The options that differ from their defaults, with their variables."""
    defaults = CudaExecutionOptions()
    return [
        f"{f.name} ({f.metadata['env']})"
        for f in attrs.fields(CudaExecutionOptions)
        if getattr(options, f.name) != getattr(defaults, f.name)
    ]


_reported: set[tuple[str, ...]] = set()


@hookimpl
def ortcore_options_class() -> type:
    return CudaExecutionOptions


@hookimpl
def ortcore_configure(config: Any) -> None:
    options = _options(config)
    if options.use_flash_attention and not options.use_triton:
        raise OptionError(
            "ORTMODULE_USE_FLASH_ATTENTION=1 needs ORTMODULE_USE_TRITON=1 (flash attention is a Triton kernel)"
        )


@hookimpl
def ortcore_session_plan(config: Any, graph: Any, plan: Any) -> None:
    """The CUDA provider's options in the plan of a session on a CUDA device (on another device, a warning that
    they do nothing, once per set of options)."""
    set_provider_options(config, plan.device, plan.providers)


def set_provider_options(config: Any, device: torch.device, providers: list[tuple[str, dict[str, str]]]) -> None:
    options = _options(config)
    if device.type != "cuda":
        changed = tuple(_set_fields(options))
        if changed and changed not in _reported:
            _reported.add(changed)
            logger.warning(
                "these options act only on a CUDA device and do nothing on %s: %s", device.type, ", ".join(changed)
            )
        return
    from onnxruntime.capi import _pybind_state as C

    if (options.use_triton or options.use_flash_attention) and not getattr(C, "is_triton_enabled", lambda: False)():
        raise OptionError(
            "ORTMODULE_USE_TRITON=1: this onnxruntime build has no Triton code generation; install a CUDA "
            "onnxruntime-training build with Triton, or unset the variable"
        )
    for name, provider in providers:
        if name != "CUDAExecutionProvider":
            continue
        provider["cudnn_conv_algo_search"] = options.conv_algo_search
        if options.enable_tuning:
            provider["tunable_op_enable"] = "1"
            provider["tunable_op_tuning_enable"] = "1"
            if options.max_tuning_duration_ms:
                provider["tunable_op_max_tuning_duration_ms"] = str(options.max_tuning_duration_ms)
        elif options.tuning_results_path:
            provider["tunable_op_enable"] = "1"  # offline results are applied without tuning
