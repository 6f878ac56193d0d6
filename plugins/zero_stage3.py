"""zero_stage3: DeepSpeed ZeRO stage 3 over an ORTModule, its parameters partitioned across ranks between steps.

Under ZeRO stage 3 every parameter of the model is a shard between steps (``param.data`` empty, ``param.ds_tensor``
this rank's piece); DeepSpeed gathers a submodule's parameters in a forward pre-hook and releases them in its
forward hook. An ORTModule runs the whole forward as one ONNX Runtime graph, so those per-submodule hooks never
fire while ORT computes. This plugin serves ZeRO-3 the way the graph needs it (docs/deepspeed.md, "ZeRO stage 3"):

- **export**: around the trace (``ortcore_export_context``) the partitioned parameters are gathered (DeepSpeed's
  coalesced ``all_gather``) and DeepSpeed's module hooks are set aside, so the exporter sees the model as it is
  without DeepSpeed (whole parameters, no hooks); the graph takes the parameters as inputs, as every ortcore graph
  does. They are partitioned again after the trace.
- **each step** (a runtime inspector): before ORT's forward the parameters still partitioned are gathered, in one
  coalesced all-gather; they are fed to the graph, and partitioned again right after ORT's backward (after the
  forward, for a call without a backward). The gradients reach each parameter through autograd, so the hooks
  DeepSpeed's stage-3 optimizer registered (``register_post_accumulate_grad_hook``) reduce and partition them as
  they do for the model without ortcore. Parameters DeepSpeed keeps whole (``stage3_param_persistence_threshold``,
  ``ds_persist``) are left alone.
- **the gradient audit** of the first step runs with the parameters gathered and DeepSpeed's hooks set aside.

Detection needs nothing: a parameter with DeepSpeed's ``ds_id``/``ds_status`` is a ZeRO-3 parameter.
``ORTMODULE_ENABLE_ZERO_STAGE3=1`` says the model is meant to be one (a note when none is found); ``=0`` refuses a
ZeRO-3 model with an error naming the variable instead of a failure deep inside the export.

Options (``[plugins.zero_stage3]`` in ortcore.toml, or the environment; the environment wins)::

    [plugins.zero_stage3]
    enable = "auto"   # env ORTMODULE_ENABLE_ZERO_STAGE3: 1 (expect ZeRO-3), 0 (refuse it), auto (detect)
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from ortcore.api import (
    Config,
    OptionError,
    RuntimeInspector,
    UnsupportedModelError,
    hook_defined_in,
    hookimpl,
    hooks_set_aside,
    option,
)

NAME = "zero_stage3"
ENV = "ORTMODULE_ENABLE_ZERO_STAGE3"
logger = logging.getLogger("ortcore.zero_stage3")

_ON = {"1", "true", "on", "yes"}
_OFF = {"0", "false", "off", "no"}


def parse_enable(value: Any, source: str) -> str:
    """``auto``, ``on`` (1/true) or ``off`` (0/false)."""
    text = str(value).strip().lower()
    if isinstance(value, bool):
        return "on" if value else "off"
    if text in _ON:
        return "on"
    if text in _OFF:
        return "off"
    if text == "auto":
        return "auto"
    raise OptionError(f"{source}={value!r} is not allowed; allowed: 1 (on), 0 (off), auto")


@attrs.frozen
class ZeroStage3Options:
    """Options of the ``zero_stage3`` plugin."""

    enable: str = option(
        "auto",
        parse_enable,
        "DeepSpeed ZeRO stage 3: 1 expects partitioned parameters, 0 refuses them, auto detects them",
        ENV,
    )


@hookimpl
def ortcore_options_class() -> type:
    return ZeroStage3Options


# -- what DeepSpeed left on the model ------------------------------------------------------------------------------
def is_zero3_param(param: torch.Tensor) -> bool:
    """A parameter DeepSpeed's ZeRO stage 3 partitions (``zero.Init`` or ``deepspeed.initialize`` with stage 3)."""
    return hasattr(param, "ds_id") and hasattr(param, "ds_status")


def zero3_params(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's ZeRO-3 parameters; none while the module is still being restored (a deep copy or unpickling of
    an ORTModule whose model refers back to it builds the wrapper's runtime before the model's own state is set: the
    export context checks again)."""
    if "_parameters" not in vars(module):
        return []
    return [p for p in module.parameters() if is_zero3_param(p)]


def _not_available(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters that are shards now (neither gathered nor kept whole by DeepSpeed)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    inflight = [p for p in params if p.ds_status == ZeroParamStatus.INFLIGHT]
    if inflight:
        for p in inflight:  # a prefetch DeepSpeed started: wait for it, as its coordinator would
            handle = getattr(p, "ds_all_gather_handle", None) or getattr(p, "_ds_all_gather_handle", None)
            if handle is not None:
                handle.wait()
    return [p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def gather(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Gather the partitioned ones among ``params`` (one coalesced all-gather); returns those to partition again."""
    missing = _not_available(params)
    if missing:
        missing[0].all_gather(param_list=missing)
    # Those DeepSpeed keeps whole once gathered (below stage3_param_persistence_threshold) stay whole, as they do
    # under DeepSpeed's own hooks.
    return [p for p in missing if not getattr(p, "ds_persist", False)]


def release(params: list[torch.Tensor]) -> None:
    """Partition ``params`` again (their values were not changed: the shards stay as they are)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    live = [p for p in params if p.ds_status == ZeroParamStatus.AVAILABLE]
    if live:
        live[0].partition(param_list=live, has_been_updated=False)


#: What the plugin adds to a parameter's ``ds_active_sub_modules`` while the ORT graph holds it.
GRAPH_USER = "ortcore graph"


def without_deepspeed_hooks(module: torch.nn.Module) -> contextlib.AbstractContextManager:
    """DeepSpeed's module hooks set aside (every submodule of ``module``), restored after."""
    return hooks_set_aside(module, hook_defined_in("deepspeed"))


@contextlib.contextmanager
def whole(module: torch.nn.Module) -> Iterator[None]:
    """The model as it is without DeepSpeed: partitioned parameters gathered, DeepSpeed's hooks set aside."""
    params = zero3_params(module)
    if not params:
        yield
        return
    gathered = gather(params)
    try:
        with without_deepspeed_hooks(module):
            yield
    finally:
        release(gathered)


# -- checks --------------------------------------------------------------------------------------------------------
def check_model(config: Config, module: torch.nn.Module) -> bool:
    """Refuse a ZeRO-3 model when the plugin is switched off; True when the model has ZeRO-3 parameters now. (An
    ORTModule over a DeepSpeed engine is refused by the core, which names the order that works.)"""
    options = config.plugin_options(NAME)
    found = bool(zero3_params(module))
    if found and options is not None and options.enable == "off":
        raise UnsupportedModelError(
            f"{type(module).__name__} has DeepSpeed ZeRO stage 3 parameters (partitioned by zero.Init or "
            f"deepspeed.initialize with stage 3) but {ENV}=0 ([plugins.{NAME}] enable = off) turns off the plugin "
            f"that serves them; unset it or set {ENV}=1 (or use ZeRO stage 1 or 2)"
        )
    return found


def _forget_reads_outside_forward(module: torch.nn.Module) -> None:
    """DeepSpeed registers a partitioned parameter read while the engine's forward runs but outside a submodule's
    forward as an "external parameter" of the innermost module running, to gather it with that module from then on.
    ortcore reads some (the graph fingerprint prints the model: ``LayerNorm.extra_repr`` reads ``bias``) before ORT
    runs, inside the root module, whose registrations DeepSpeed keeps on the wrapped model (the ORTModule passes
    attributes on). The graph's parameters are gathered here anyway: those registrations, and the root's use of the
    parameters it gathered for them, are dropped, so the parameters are released with the others."""
    external = getattr(module, "_external_params", None)
    if not external:
        return
    root = getattr(module, "ds_id", None)
    for param in list(external.values()):
        if root is not None and hasattr(param, "ds_active_sub_modules"):
            param.ds_active_sub_modules.discard(root)
    external.clear()


class ZeroStage3(RuntimeInspector):
    """Gathers the partitioned parameters before ORT's forward and partitions them again after its backward."""

    # What DeepSpeed's stage-3 hooks keep on the modules they run on (the ORTModule is the root): bookkeeping the
    # model's forward never reads; applied_pre_backward_ref_cnt and ds_grads_remaining change at every step.
    untraced_attributes = frozenset(
        {
            "ds_id",
            "ds_grads_remaining",
            "applied_pre_backward_ref_cnt",
            "ds_external_parameters",
            "ds_inflight_param_registry",
            "ds_model_granularity",
            "ds_model_num_layers",
            "ds_model_num_params",
            "ds_recompute_parameters",
            "pre_bwd_fn",
            "post_bwd_fn",
            "_external_params",
        }
    )
    #: DeepSpeed's module hooks (the export sets them aside): in the fingerprint by their code, not their state.
    untraced_hooks = staticmethod(hook_defined_in("deepspeed"))

    def __init__(self, module: torch.nn.Module, expected: bool) -> None:
        self._module = weakref.ref(module)
        self._expected = expected
        self._told = False
        self._held: list[torch.Tensor] = []
        self._backward_follows = False

    @property
    def shards_parameters(self) -> bool:
        """A model with ZeRO-3 parameters: a first-step check differentiates PyTorch's side while they are whole."""
        module = self._module()
        return module is not None and bool(zero3_params(module))

    def _hold(self, params: list[torch.Tensor]) -> None:
        """Gather ``params`` and mark them in use by the graph: DeepSpeed's coordinator releases a parameter only
        when no submodule uses it (``ds_active_sub_modules``), so its own hooks (the root module's forward hook,
        which releases the parameters DeepSpeed saw read outside a submodule's forward) leave them to ORT."""
        gather(params)
        for p in params:
            p.ds_active_sub_modules.add(GRAPH_USER)
        self._held = params

    def _let_go(self) -> None:
        held, self._held = self._held, []
        for p in held:
            p.ds_active_sub_modules.discard(GRAPH_USER)
        release([p for p in held if not p.ds_active_sub_modules])

    def pre_forward(self, step: int, inputs: Any) -> None:
        module = self._module()
        if module is None:
            return
        if self._held:  # the last training forward's backward never ran: its parameters go back first
            self._let_go()
        _forget_reads_outside_forward(module)
        params = zero3_params(module)
        if not params:
            if self._expected and not self._told:
                self._told = True
                logger.warning(
                    "%s=1 but %s has no DeepSpeed ZeRO stage 3 parameter (is it under deepspeed.initialize with "
                    '"zero_optimization": {"stage": 3}?): it trains with whole parameters',
                    ENV,
                    type(module).__name__,
                )
            return
        # Those DeepSpeed keeps whole (below stage3_param_persistence_threshold) stay whole, as under its own hooks.
        self._hold([p for p in params if not getattr(p, "ds_persist", False)])
        self._backward_follows = bool(inputs.session.request.build_gradient)

    def post_forward(self, step: int, outputs: list[Any]) -> None:
        if not self._backward_follows and self._held:
            self._let_go()

    def post_backward(self, step: int) -> None:
        # ORT is done with the gathered values (its forward state is freed). The gradients are handed to torch next:
        # autograd accumulates each into its parameter's ``grad`` (which needs the parameter whole: torch makes the
        # gradient in the parameter's shape) and DeepSpeed's gradient hooks reduce it into the partitions. The
        # parameters are partitioned again when autograd's backward is over.
        if self._held:
            torch.autograd.Variable._execution_engine.queue_callback(self._let_go)


@hookimpl
def ortcore_runtime_inspectors(config: Config, module: torch.nn.Module) -> list[Any]:
    check_model(config, module)
    options = config.plugin_options(NAME)
    if options is None or options.enable == "off":
        return []
    return [ZeroStage3(module, expected=options.enable == "on")]


@hookimpl
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any:
    if not check_model(config, module):
        return None
    return whole(module)


@hookimpl(wrapper=True)
def ortcore_check_first_step(step: Any) -> Any:
    model = step.model
    if not zero3_params(model):
        return (yield)
    with whole(model):
        return (yield)
