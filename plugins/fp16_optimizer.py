"""fp16_optimizer: ``FP16_Optimizer``, which makes a DeepSpeed mixed-precision optimizer's overflow check and
gradient-norm clipping multi-tensor.

Offered under ``ortcore.optim`` through the ``ortcore_optimizers`` hook::

    model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    from ortcore.optim import FP16_Optimizer
    optimizer = FP16_Optimizer(optimizer)

``FP16_Optimizer(optimizer)`` returns the same object. For the optimizer types below, DeepSpeed's inf/NaN check of
the gradients (one reduction per tensor, and in the FP16 optimizers one host synchronisation per tensor) becomes one
``torch._amp_foreach_non_finite_check_and_unscale_`` call per device, and its gradient norms and clipping become
``torch._foreach_*`` calls (on CPU, where torch has no multi-tensor norm kernel, a loop without host
synchronisation), on this instance only. The results are DeepSpeed's to the last bit: each norm is accumulated in
DeepSpeed's type and the norms are combined in its order, so the same steps are skipped and clipped, and the loss
scale moves the same way.

* ``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer`` (ZeRO 1 and 2): its methods
  ``has_overflow_serial``, ``has_overflow_partitioned_grads_serial`` and ``get_grad_norm_direct``.
* ``deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer``: its overflow checker's ``has_overflow_serial`` (the norm
  is already taken over one flat fp32 gradient per group).
* ``deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer``: the overflow check, the per-group norm
  (DeepSpeed's module function ``get_weight_norm``, swapped for this optimizer's ``step`` only) and
  ``unscale_and_clip_grads``.
* ``deepspeed.runtime.bf16_optimizer.BF16_Optimizer``: the norm and the clipping (DeepSpeed's module functions
  ``get_global_norm_of_tensors`` and ``clip_tensors_by_global_norm``, swapped for this optimizer's ``step`` only).
* Hugging Face accelerate's ``DeepSpeedOptimizerWrapper``: the DeepSpeed optimizer it wraps.

Any other type is returned unchanged with a warning naming it and these. Wrapping twice changes nothing.
"""

from __future__ import annotations

import functools
import importlib
import math
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ortcore.api import hookimpl

NAME = "fp16_optimizer"

# Read from the source by ortcore.optim when this plugin is disabled, to name it in the error.
OPTIMIZERS = ("FP16_Optimizer",)

# DeepSpeed versions whose methods the replacements were written against (their return types changed before 0.19).
DEEPSPEED_VERSIONS = ((0, 19), (0, 20))

ZERO = "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer"
FUSED = "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer"
UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer"
BF16 = "deepspeed.runtime.bf16_optimizer.BF16_Optimizer"
ACCELERATE = "accelerate.utils.deepspeed.DeepSpeedOptimizerWrapper"

_MARK = "_ortcore_fp16_optimizer"


# -- multi-tensor primitives ---------------------------------------------------------------------------------------


def _by_device(tensors: Iterable[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    """The non-empty tensors by device, detached; a sparse tensor is represented by its values (to read only)."""
    buckets: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        t = t.detach()
        if t.is_sparse:
            t = t.coalesce()._values()
        if t.numel():
            buckets.setdefault(t.device, []).append(t)
    return buckets


def has_non_finite(tensors: Iterable[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Whether any of ``tensors`` holds an inf or NaN: a bool tensor of shape ``[1]`` on ``device``.

    One ``torch._amp_foreach_non_finite_check_and_unscale_`` call per device (with an unscale factor of 1, which
    leaves every value as it is) instead of a reduction and a host synchronisation per tensor.
    """
    found_any = None
    for dev, bucket in _by_device(tensors).items():
        found = torch.zeros(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(bucket, found, torch.ones(1, dtype=torch.float32, device=dev))
        found = found.to(device) if device is not None else found
        found_any = found if found_any is None else found_any + found.to(found_any.device)
    if found_any is None:
        found_any = torch.zeros(1, dtype=torch.float32, device=device)
    return found_any.bool()


def tensor_norms(tensors: Iterable[torch.Tensor], norm_type: float, dtype: torch.dtype) -> list[torch.Tensor]:
    """``||t||_p`` of each tensor (empty ones left out), accumulated in ``dtype``, each on its tensor's device.

    Pass the accumulation type DeepSpeed uses at that call (float64 in ZeRO, float32 elsewhere): over a 38M-value
    tensor float32 accumulation is off by 3e-3 relative, and a different type would change which steps are clipped.
    No host synchronisation per tensor. On CUDA the norms of a device come from one ``torch._foreach_norm``. On CPU
    torch has no multi-tensor norm kernel (``_foreach_norm`` loops over the tensors, measured 15% slower than calling
    ``torch.linalg.vector_norm`` per tensor), so the loop is ours.
    """
    norms: list[torch.Tensor] = []
    for device, bucket in _by_device(tensors).items():
        if device.type == "cpu":
            norms += [torch.linalg.vector_norm(t, norm_type, dtype=dtype) for t in bucket]
        else:
            norms += torch._foreach_norm(bucket, norm_type, dtype=dtype)
    return norms


def norm_power_sum(
    tensors: Iterable[torch.Tensor], norm_type: float, device: torch.device | str, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``sum(||t||_p ** p)`` over ``tensors``, or ``max |t|`` when ``p`` is inf: a float32 scalar on ``device``.

    DeepSpeed's combination (``torch.stack(norms).pow(p).sum().float()``) of ``tensor_norms(tensors, p, dtype)``.
    """
    norms = tensor_norms(tensors, norm_type, dtype)
    if not norms:
        return torch.zeros((), dtype=torch.float32, device=device)
    stacked = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max().float()
    return stacked.pow(norm_type).sum().float()


def _scale_(tensors: Iterable[torch.Tensor], factor: float | torch.Tensor) -> None:
    """``t.mul_(factor)`` for every tensor, one ``torch._foreach_mul_`` per device (sparse ones one by one)."""
    dense = []
    for t in tensors:
        if t.is_sparse:
            t.detach().mul_(factor)
        else:
            dense.append(t)
    for bucket in _by_device(dense).values():
        torch._foreach_mul_(bucket, factor)


# -- DeepSpeed ZeRO 1 and 2 ----------------------------------------------------------------------------------------


def _zero_has_overflow_serial(self: Any, params: Iterable[torch.Tensor]) -> torch.Tensor:
    from deepspeed.accelerator import get_accelerator

    grads = [p.grad for p in params if p.grad is not None]
    return has_non_finite(grads, get_accelerator().current_device_name())


def _zero_has_overflow_partitioned_grads_serial(self: Any) -> torch.Tensor:
    from deepspeed.accelerator import get_accelerator

    grads = [g for i in range(len(self.bit16_groups)) for g in self.averaged_gradients[i] if g is not None]
    return has_non_finite(grads, get_accelerator().current_device_name())


def _zero_get_grad_norm_direct(self: Any, gradients: Sequence[torch.Tensor], params: Sequence[Any], norm_type=2):
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter, mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype

    device, dtype = get_accelerator().current_device_name(), get_norm_dtype()
    norm_type = float(norm_type)
    if math.isinf(norm_type):
        total_norm = norm_power_sum(list(gradients), norm_type, device, dtype)
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.MAX)
    else:
        selected = []
        # The same filter as DeepSpeed: no padding, no pipeline replica, tensor-parallel duplicates counted once.
        param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
        for g, p in zip(param_gradients, params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or self.model_parallel_rank == 0:
                selected.append(g)
        total_norm = norm_power_sum(selected, norm_type, device if selected else self.device, dtype)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(1.0 / norm_type)
    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)
    return total_norm


def _patch_zero(optimizer: Any) -> None:
    optimizer.has_overflow_serial = types.MethodType(_zero_has_overflow_serial, optimizer)
    optimizer.has_overflow_partitioned_grads_serial = types.MethodType(
        _zero_has_overflow_partitioned_grads_serial, optimizer
    )
    optimizer.get_grad_norm_direct = types.MethodType(_zero_get_grad_norm_direct, optimizer)


# -- DeepSpeed FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer -----------------------------------------------


def _checker_has_overflow_serial(self: Any, params: Iterable[torch.Tensor]) -> bool:
    return bool(has_non_finite([p.grad for p in params if p.grad is not None]).item())


def _patch_overflow_checker(optimizer: Any) -> None:
    checker = optimizer.overflow_checker
    checker.has_overflow_serial = types.MethodType(_checker_has_overflow_serial, checker)


def _swap_during_step(optimizer: Any, module_name: str, replacements: dict[str, Callable[..., Any]]) -> None:
    """Run ``optimizer.step`` with the module functions ``replacements`` in place of DeepSpeed's.

    The functions are called from inside the class's ``step``, so they cannot be replaced on the instance; they are
    put back when the step returns. Another optimizer stepping in another thread at that moment gets the same
    values from the replacements.
    """
    module = importlib.import_module(module_name)
    step = optimizer.step

    @functools.wraps(step)
    def step_with_multi_tensor_norms(*args: Any, **kwargs: Any) -> Any:
        saved = {name: getattr(module, name) for name in replacements}
        for name, function in replacements.items():
            setattr(module, name, function)
        try:
            return step(*args, **kwargs)
        finally:
            for name, function in saved.items():
                setattr(module, name, function)

    optimizer.step = step_with_multi_tensor_norms


def _weight_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's ``get_weight_norm`` (a python float, -1 when inf/NaN) for one process group; else ``original``."""
    from deepspeed.runtime.constants import PIPE_REPLICATED

    def get_weight_norm(parameters: Any, norm_type: float = 2, mpu: Any = None) -> float:
        if mpu is not None:
            return original(parameters, norm_type=norm_type, mpu=mpu)
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        norm_type = float(norm_type)
        tensors = [p for p in parameters if not (hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated)]
        norms = tensor_norms(tensors, norm_type, torch.float32)
        if math.isinf(norm_type):
            total = torch.stack([n.to(norms[0].device) for n in norms]).max().item() if norms else 0.0
        else:
            total = 0.0
            for norm in norms:  # DeepSpeed's order and float32 arithmetic: the same sum to the last bit
                total += norm**norm_type
            total = float(total) ** (1.0 / norm_type)
        return -1 if math.isinf(total) or math.isnan(total) else total

    return get_weight_norm


def _unfused_unscale_and_clip_grads(self: Any, total_norm: float, apply_scale: bool = True) -> float:
    combined_scale = self.loss_scale_config.cur_scale
    if self.clip_grad > 0.0:
        clip = ((total_norm / self.loss_scale_config.cur_scale) + 1e-6) / self.clip_grad
        if clip > 1:
            combined_scale = clip * self.loss_scale_config.cur_scale
    if apply_scale:
        _scale_([p.grad for group in self.fp32_groups for p in group if p.grad is not None], 1.0 / combined_scale)
    return combined_scale


def _patch_unfused(optimizer: Any) -> None:
    _patch_overflow_checker(optimizer)
    optimizer.unscale_and_clip_grads = types.MethodType(_unfused_unscale_and_clip_grads, optimizer)
    module = "deepspeed.runtime.fp16.unfused_optimizer"
    original = importlib.import_module(module).get_weight_norm
    _swap_during_step(optimizer, module, {"get_weight_norm": _weight_norm(original)})


def _global_norm_of_tensors(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's ``get_global_norm_of_tensors`` (a float32 tensor, -1 when inf/NaN) for one process group."""
    from deepspeed.runtime.utils import mask_nan_or_inf_with_val_inplace

    def get_global_norm_of_tensors(input_tensors, norm_type=2, mpu=None, moe_ep_group=None):
        if mpu is not None or moe_ep_group is not None or not input_tensors:
            return original(input_tensors, norm_type=norm_type, mpu=mpu, moe_ep_group=moe_ep_group)
        norm_type = float(norm_type)
        total = norm_power_sum(input_tensors, norm_type, input_tensors[0].device)
        total = total if math.isinf(norm_type) else total.pow(1.0 / norm_type)
        mask_nan_or_inf_with_val_inplace(total, device=total.device)
        return total

    return get_global_norm_of_tensors


def _clip_tensors_by_global_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed's ``clip_tensors_by_global_norm`` with one ``_foreach_mul_`` per device when the norm is given."""

    def clip_tensors_by_global_norm(input_tensors, max_norm=1.0, global_norm=None, mpu=None, eps=1e-6):
        if global_norm is None:
            return original(input_tensors, max_norm=max_norm, global_norm=global_norm, mpu=mpu, eps=eps)
        clip_coef = max_norm / (global_norm + eps)
        if clip_coef < 1:
            _scale_(input_tensors, clip_coef)
        return global_norm

    return clip_tensors_by_global_norm


def _patch_bf16(optimizer: Any) -> None:
    module_name = "deepspeed.runtime.bf16_optimizer"
    module = importlib.import_module(module_name)
    replacements = {
        "get_global_norm_of_tensors": _global_norm_of_tensors(module.get_global_norm_of_tensors),
        "clip_tensors_by_global_norm": _clip_tensors_by_global_norm(module.clip_tensors_by_global_norm),
    }
    _swap_during_step(optimizer, module_name, replacements)


# What each supported type needs (checked before anything is replaced) and how it is modified.
_SUPPORTED: dict[str, tuple[tuple[str, ...], Callable[[Any], None]]] = {
    ZERO: (("has_overflow_serial", "has_overflow_partitioned_grads_serial", "get_grad_norm_direct"), _patch_zero),
    FUSED: (("overflow_checker",), _patch_overflow_checker),
    UNFUSED: (("overflow_checker", "unscale_and_clip_grads", "fp32_groups", "loss_scale_config"), _patch_unfused),
    BF16: (("step",), _patch_bf16),
}


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _supported_type(optimizer: Any) -> str | None:
    """The supported DeepSpeed class ``optimizer`` is an instance of (a subclass counts), or None."""
    for cls in type(optimizer).__mro__:
        if _qualified_name(cls) in _SUPPORTED:
            return _qualified_name(cls)
    return None


def _skip(optimizer: Any, reason: str) -> Any:
    warnings.warn(f"FP16_Optimizer: {reason}; the optimizer is returned unchanged", UserWarning, stacklevel=3)
    return optimizer


def FP16_Optimizer(optimizer: Any, **kwargs: Any) -> Any:  # noqa: N802 (upstream's name)
    """Make ``optimizer``'s overflow check and gradient-norm clipping multi-tensor; return the same object.

    Args:
        optimizer: the optimizer ``deepspeed.initialize`` returned (or accelerate's wrapper of it); see the module
            docstring for the supported types. Another type is returned unchanged, with a warning naming it.
        kwargs: none is accepted (upstream's ``get_horizontal_model_parallel_*`` are Megatron-LM options).

    Example::

        model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        optimizer = FP16_Optimizer(optimizer)
        model.backward(loss)
        model.step()
    """
    if kwargs:
        raise TypeError(
            f"FP16_Optimizer: unexpected option(s) {sorted(kwargs)}; it takes none "
            "(upstream's get_horizontal_model_parallel_rank/group are for Megatron-LM, which is not supported)"
        )
    if getattr(optimizer, _MARK, False):
        return optimizer
    if _qualified_name(type(optimizer)) == ACCELERATE and hasattr(optimizer, "optimizer"):
        FP16_Optimizer(optimizer.optimizer)
        setattr(optimizer, _MARK, getattr(optimizer.optimizer, _MARK, False))
        return optimizer
    name = _supported_type(optimizer)
    if name is None:
        supported = ", ".join([*_SUPPORTED, ACCELERATE])
        return _skip(
            optimizer, f"optimizer type {_qualified_name(type(optimizer))} is not supported (supported: {supported})"
        )
    import deepspeed

    version = tuple(int(part) for part in deepspeed.__version__.split(".")[:2])
    if not DEEPSPEED_VERSIONS[0] <= version < DEEPSPEED_VERSIONS[1]:
        low, high = (".".join(map(str, v)) for v in DEEPSPEED_VERSIONS)
        return _skip(optimizer, f"DeepSpeed {deepspeed.__version__} is not supported (supported: >={low}, <{high})")
    required, patch = _SUPPORTED[name]
    missing = [attribute for attribute in required if not hasattr(optimizer, attribute)]
    if missing:
        return _skip(optimizer, f"{name} has no {', '.join(missing)} (DeepSpeed changed it)")
    patch(optimizer)
    setattr(optimizer, _MARK, True)
    return optimizer


@hookimpl
def ortcore_register(register: Any) -> None:
    register.optimizer("FP16_Optimizer", FP16_Optimizer)
