"""The ``aten_fallback`` plugin's options, shared by its features: which ops run on PyTorch's kernels
(:mod:`.kernel_routing`) and which unexportable ops become ATen nodes (:mod:`.unexportable_ops`)."""

from __future__ import annotations

import difflib

import attrs
import torch

from ortcore.api import Config, OptionError, option
from ortcore_plugins.services.torch_kernels import ROUTABLE_OPS

NAME = "aten_fallback"
ENV = "ORTCORE_TORCH_KERNELS"
FALLBACK_ENV = "ORTCORE_ATEN_FALLBACK_OPS"
MEASURE_ENV = "ORTCORE_KERNEL_MEASURE"

# Ops routed by default, of the ones this plugin can route (ROUTABLE_OPS, the torch_kernels service's).
DEFAULT_OPS: tuple[str, ...] = ("embedding", "gelu", "layer_norm", "cross_entropy")

AUTO = "auto"
ALL = "all"
# When torch_kernels = "auto" measures a case no earlier measurement on this machine decided: "later" (the graph starts
# on the default list and the case is timed before training step MEASURE_AT_STEP; the model is exported again if a
# measurement changes the choice), "export" (timed during the export, which waits for it), "off" (never timed: the
# default list decides what no earlier measurement did).
MEASURE_MODES = ("later", "export", "off")
_ALLOWED = f"{', '.join(ROUTABLE_OPS)}, or one of 'auto', 'all', 'none'"


def parse_ops(value: object, source: str) -> tuple[str, ...]:
    """A list of op names, or a comma-separated string; ``""`` and ``"none"`` mean no op, ``"all"`` every routable
    op, ``"auto"`` the ops measured faster in PyTorch (returned as ``("auto",)``)."""
    if isinstance(value, str):
        items = [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",")]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise OptionError(
            f"{source}={value!r} must be a list of op names (or a comma-separated string); allowed: {_ALLOWED}"
        )
    lowered = [item.lower() for item in items]
    if lowered == ["none"]:
        items = []
    elif lowered == [AUTO]:
        return (AUTO,)
    elif lowered == [ALL]:
        return ROUTABLE_OPS
    for item in items:
        if item.lower() in (AUTO, ALL, "none"):
            raise OptionError(f"{source}={value!r}: {item!r} cannot be combined with op names; allowed: {_ALLOWED}")
        if item not in ROUTABLE_OPS:
            close = difflib.get_close_matches(item, ROUTABLE_OPS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise OptionError(f"{source}={value!r}: unknown op {item!r}; allowed: {_ALLOWED}.{hint}")
    return tuple(dict.fromkeys(items))  # ordered, without duplicates


def parse_measure(value: object, source: str) -> str:
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in MEASURE_MODES:
        raise OptionError(
            f"{source}={value!r} is not allowed; allowed: later (start on the default list, measure on a later step), "
            "export (measure while exporting) or off (never measure)"
        )
    return text


def parse_fallback_ops(value: object, source: str) -> tuple[str, ...]:
    """ATen op names (``cummax`` or ``aten::cummax``) and/or ``auto``, as a list or a comma-separated string."""
    if isinstance(value, str):
        items = [] if value.strip().lower() in ("", "none") else [v.strip() for v in value.split(",")]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        items = [v.strip() for v in value]
    else:
        raise OptionError(f"{source}={value!r} must be a list of ATen op names, 'auto' or 'none'")
    if [item.lower() for item in items] == ["none"]:
        items = []
    names = []
    for item in items:
        if item.lower() == AUTO:
            names.append(AUTO)
            continue
        namespace, _, name = item.rpartition("::")
        if namespace not in ("", "aten") or not name.isidentifier():
            raise OptionError(
                f"{source}={value!r}: {item!r} is not an ATen op name (such as 'cummax' or 'aten::cummax')"
            )
        if not hasattr(torch.ops.aten, name):
            raise OptionError(f"{source}={value!r}: PyTorch has no op aten::{name}")
        names.append(f"aten::{name}")
    return tuple(dict.fromkeys(names))


@attrs.frozen
class AtenFallbackOptions:
    """Options of the ``aten_fallback`` plugin (``[plugins.aten_fallback]`` in ortcore.toml)."""

    torch_kernels: tuple[str, ...] = option(
        (AUTO,),
        parse_ops,
        "ops run with PyTorch's kernels inside the ORT graph: a list of "
        f"{', '.join(ROUTABLE_OPS)}; or 'auto' (each op where it measured faster on the model's shapes), 'all', "
        "'none'",
        env=ENV,
    )
    fallback_ops: tuple[str, ...] = option(
        (),
        parse_fallback_ops,
        "ops the exporter cannot express, exported as ATen nodes run by PyTorch (forward and backward): ATen op "
        "names, and/or 'auto' for every op the exporter reports unsupported",
        env=FALLBACK_ENV,
    )
    measure: str = option(
        "later",
        parse_measure,
        "with torch_kernels = 'auto', when a case no earlier measurement decided is timed: later (the first steps run "
        "on the default list, the case is timed before training step 2, the model exported again if that changes "
        "the choice), export (the export waits for it) or off (the default list decides)",
        env=MEASURE_ENV,
    )


def is_auto(config: Config) -> bool:
    """Is ``torch_kernels`` ``auto`` (each op routed where PyTorch measured faster)?"""
    if config.env.get(ENV) is not None and config.env[ENV].strip() == "":
        return False
    options = config.plugin_options(NAME)
    return options is not None and options.torch_kernels == (AUTO,)


def measure_mode(config: Config) -> str:
    """``measure``: when ``auto`` times a case no earlier measurement decided (``later``, ``export``, ``off``)."""
    options = config.plugin_options(NAME)
    return options.measure if options is not None else "off"


def routed_ops(config: Config) -> frozenset[str]:
    """The ops routed to PyTorch under ``config``; with ``auto``, the ops that may be (every routable op).

    An empty ``ORTCORE_TORCH_KERNELS`` means "none" here, although the core's option loader treats an empty
    variable as unset: for this switch, ``ORTCORE_TORCH_KERNELS= python train.py`` must turn routing off.
    """
    if config.env.get(ENV) is not None and config.env[ENV].strip() == "":
        return frozenset()
    if is_auto(config):
        return frozenset(ROUTABLE_OPS)
    options = config.plugin_options(NAME)
    return frozenset(options.torch_kernels if options is not None else DEFAULT_OPS)


def fallback_ops(config: Config) -> tuple[str, ...]:
    """The ``fallback_ops`` option: ``aten::<name>`` entries and possibly ``"auto"``."""
    options = config.plugin_options(NAME)
    return options.fallback_ops if options is not None else ()
