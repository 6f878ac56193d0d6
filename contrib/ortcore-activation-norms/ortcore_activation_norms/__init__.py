"""activation_norms: the L2 norm, RMS and max-abs of every activation and gradient per step, in one CSV file.

An out-of-tree ortcore subscriber plugin. It offers :class:`NormSubscriber` to ``ortcore.hooks``::

    from ortcore.hooks import GlobalSubscriberManager, NormSubscriber
    GlobalSubscriberManager.subscribe(model, [NormSubscriber("norms.csv", every=10)])

and, switched on in ``ortcore.toml``, gives every subscribed model one without code changes::

    [plugins.activation_norms]
    enabled = true
    output_path = "norms.csv"   # env ORTCORE_ACTIVATION_NORMS_OUTPUT_PATH
    every = 10

``python -m ortcore_activation_norms plot norms.csv -o norms.png`` plots the L2 norms over steps.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch

from ortcore.api import OptionError, hookimpl, int_at_least, option, parse_bool, recorder_of

from .subscriber import COLUMNS, NormSubscriber, tensor_norms

__all__ = ["COLUMNS", "NormSubscriber", "NormsOptions", "tensor_norms"]
__version__ = "0.1.0"

NAME = "activation_norms"


def _parse_path(value: object, source: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise OptionError(f"{source}={value!r} is not allowed; allowed: a non-empty file path such as 'norms.csv'")
    return value


def _check_steps(options: NormsOptions, _attribute: Any, end_step: int | None) -> None:
    if end_step is not None and options.start_step is not None and end_step <= options.start_step:
        raise OptionError(
            f"plugins.{NAME}.end_step={end_step} is not allowed; allowed: an integer greater than "
            f"start_step={options.start_step}"
        )


@attrs.frozen
class NormsOptions:
    """``[plugins.activation_norms]`` in ortcore.toml; each field's environment variable overrides it."""

    enabled: bool = option(
        False, parse_bool, "give every subscribed model a NormSubscriber", "ORTCORE_ACTIVATION_NORMS_ENABLED"
    )
    output_path: str = option(
        "activation_norms.csv",
        _parse_path,
        "the CSV file ({rank} is replaced by the rank)",
        "ORTCORE_ACTIVATION_NORMS_OUTPUT_PATH",
    )
    start_step: int | None = option(None, int_at_least(0), "first step recorded", "ORTCORE_ACTIVATION_NORMS_START_STEP")
    # attrs.field rather than option(): the one field with a validator (it needs start_step).
    end_step: int | None = attrs.field(
        default=None,
        validator=_check_steps,
        metadata={
            "parse": int_at_least(1),
            "doc": "step at which recording stops, exclusive",
            "env": "ORTCORE_ACTIVATION_NORMS_END_STEP",
        },
    )
    every: int = option(1, int_at_least(1), "record every n-th step", "ORTCORE_ACTIVATION_NORMS_EVERY")
    overwrite: bool = option(False, parse_bool, "replace an existing CSV file", "ORTCORE_ACTIVATION_NORMS_OVERWRITE")


# The subscriber the configuration gave each model: subscribing a model again does not add a second one.
_from_config: weakref.WeakKeyDictionary[torch.nn.Module, NormSubscriber] = weakref.WeakKeyDictionary()


@hookimpl
def ortcore_options_class() -> type:
    return NormsOptions


@hookimpl
def ortcore_register(register) -> None:
    register.subscriber_class("NormSubscriber", NormSubscriber)


@hookimpl
def ortcore_activation_subscribers(config, module: torch.nn.Module) -> list[NormSubscriber]:
    options: NormsOptions | None = config.plugin_options(NAME)
    if options is None or not options.enabled:
        return []
    if module in _from_config and recorder_of(module) is not None:
        return []
    subscriber = NormSubscriber(
        options.output_path, options.start_step, options.end_step, options.every, overwrite=options.overwrite
    )
    _from_config[module] = subscriber
    return [subscriber]
