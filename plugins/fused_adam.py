"""fused_adam: ``FusedAdam``, an Adam/AdamW optimizer that updates all parameters with a few multi-tensor kernels.

Offered under ``ortcore.optim`` through the ``ortcore_register`` hook::

    from ortcore.optim import AdamWMode, FusedAdam
    optimizer = FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)

Three formulas (``AdamWMode``), each equal to a reference implementation:

* ``ADAM_L2_REGULARIZATION`` (0): ``torch.optim.Adam(weight_decay=...)``: the decay is added to the gradient.
* ``ADAMW_TRANSFORMERS`` (1, the default): Hugging Face's classic ``transformers.AdamW``: the bias correction is
  folded into the step size, ``eps`` is added to ``sqrt(v)`` before it, and the decoupled decay
  ``p -= lr * weight_decay * p`` comes after the Adam update.
* ``ADAMW_TORCH`` (2): ``torch.optim.AdamW``: ``p *= 1 - lr * weight_decay`` before the Adam update.

Parameters of one group are bucketed by (device, dtype) and each bucket is updated with ``torch._foreach_*`` ops,
or, on CPU for the two torch formulas with bias correction, with torch's own fused kernels (``torch._fused_adam_``,
``torch._fused_adamw_``), whose formula is exactly theirs. fp16 and bf16 parameters keep their moments in fp32 and
are updated in fp32 math, then rounded back to their dtype once per step (no fp32 master copy is kept: that is a
mixed-precision wrapper's job).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import Any

import torch

from ortcore.api import hookimpl

NAME = "fused_adam"

# Read from the source by ortcore.optim when this plugin is disabled, to name it in the error.
OPTIMIZERS = ("FusedAdam", "AdamWMode")

LOW_PRECISION = (torch.float16, torch.bfloat16)


class AdamWMode(IntEnum):
    """Where the weight decay goes (see the module docstring)."""

    ADAM_L2_REGULARIZATION = 0  # torch.optim.Adam with weight_decay: L2 penalty added to the gradient
    ADAMW_TRANSFORMERS = 1  # Hugging Face transformers.AdamW: decoupled decay after the update
    ADAMW_TORCH = 2  # torch.optim.AdamW: decoupled decay before the update


def _check_group(group: dict[str, Any]) -> None:
    """Reject bad hyper-parameters with the value and what is allowed, as torch's optimizers do."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    if isinstance(lr, torch.Tensor) or not isinstance(lr, int | float) or not lr >= 0.0:
        raise ValueError(f"FusedAdam: lr={lr!r} is not allowed; expected a number >= 0")
    if not isinstance(eps, int | float) or not eps >= 0.0:
        raise ValueError(f"FusedAdam: eps={eps!r} is not allowed; expected a number >= 0")
    if not isinstance(weight_decay, int | float) or not weight_decay >= 0.0:
        raise ValueError(f"FusedAdam: weight_decay={weight_decay!r} is not allowed; expected a number >= 0")
    betas = group["betas"]
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"FusedAdam: betas={betas!r} is not allowed; expected a pair (beta1, beta2)")
    for i, beta in enumerate(betas):
        if not isinstance(beta, int | float) or not 0.0 <= beta < 1.0:
            raise ValueError(f"FusedAdam: betas[{i}]={beta!r} is not allowed; expected 0 <= beta < 1")
    if not isinstance(group["bias_correction"], bool):
        raise ValueError(f"FusedAdam: bias_correction={group['bias_correction']!r} is not allowed; expected a bool")
    mode = group["adam_w_mode"]
    if mode not in set(AdamWMode) or isinstance(mode, bool):
        allowed = ", ".join(f"AdamWMode.{m.name} ({m.value})" for m in AdamWMode)
        raise ValueError(f"FusedAdam: adam_w_mode={mode!r} is not allowed; allowed: {allowed}")
    # Kept as a plain int: a saved state_dict then loads with torch.load's weights_only=True, and without ortcore.
    group["adam_w_mode"] = int(mode)


class FusedAdam(torch.optim.Optimizer):
    """Adam and AdamW with multi-tensor updates: one step is a handful of kernel launches per (device, dtype).

    Args:
        params: parameters or parameter groups (dicts), as for any ``torch.optim`` optimizer.
        lr: learning rate.
        bias_correction: correct the moments' bias towards zero in early steps.
        betas: decay rates of the first and second moments.
        eps: added to the denominator, for numerical stability.
        adam_w_mode: an ``AdamWMode``: which formula applies ``weight_decay``.
        weight_decay: L2 penalty (``ADAM_L2_REGULARIZATION``) or decoupled decay rate (the AdamW modes).
        set_grad_none: ``zero_grad()`` sets gradients to None rather than filling them with zeros.

    Example::

        optimizer = FusedAdam(model.parameters(), lr=1e-3, adam_w_mode=AdamWMode.ADAMW_TORCH, weight_decay=0.01)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        adam_w_mode: AdamWMode = AdamWMode.ADAMW_TRANSFORMERS,
        weight_decay: float = 0.0,
        set_grad_none: bool = True,
    ):
        if not isinstance(set_grad_none, bool):
            raise ValueError(f"FusedAdam: set_grad_none={set_grad_none!r} is not allowed; expected a bool")
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
        )
        _check_group(dict(defaults))
        self.set_grad_none = set_grad_none
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        for p in group["params"]:
            if p.is_complex() or not p.is_floating_point():
                raise ValueError(f"FusedAdam: a parameter of dtype {p.dtype} is not allowed; expected a real float")
        _check_group(group)

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Clear the gradients: set them to None when ``set_to_none`` (default: the ``set_grad_none`` argument)."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state; fp16/bf16 parameters keep fp32 moments (torch would cast them to the parameter's dtype)."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        for p, i in zip(params, ids):
            saved = state_dict["state"].get(i)
            if saved is None or p.dtype not in LOW_PRECISION:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=torch.float32, copy=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient (the others, and their state, are left untouched)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            buckets: dict[tuple[torch.device, torch.dtype], list[list[torch.Tensor]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("FusedAdam does not support sparse gradients")
                state = self.state[p]
                if not state:
                    moment_dtype = torch.float32 if p.dtype in LOW_PRECISION else p.dtype
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=moment_dtype, memory_format=torch.preserve_format)
                bucket = buckets.setdefault((p.device, p.dtype), [[], [], [], [], []])
                for items, value in zip(bucket, (p, p.grad, state["exp_avg"], state["exp_avg_sq"], state["step"])):
                    items.append(value)
            for (device, dtype), (params, grads, exp_avgs, exp_avg_sqs, steps) in buckets.items():
                torch._foreach_add_(steps, 1.0)
                if dtype in LOW_PRECISION:  # fp32 math on fp32 copies, rounded back once
                    work = [p.float() for p in params]
                    _update(group, device, work, [g.float() for g in grads], exp_avgs, exp_avg_sqs, steps)
                    torch._foreach_copy_(params, work)
                else:
                    _update(group, device, params, grads, exp_avgs, exp_avg_sqs, steps)
        return loss


def _update(
    group: dict[str, Any],
    device: torch.device,
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """Update one bucket (one device, one dtype) of one parameter group in place; ``steps`` already counts this one."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    mode = AdamWMode(group["adam_w_mode"])
    torch_formula = mode in (AdamWMode.ADAM_L2_REGULARIZATION, AdamWMode.ADAMW_TORCH)
    if torch_formula and group["bias_correction"] and device.type == "cpu":
        fused = torch._fused_adamw_ if mode == AdamWMode.ADAMW_TORCH else torch._fused_adam_
        fused(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )
        return
    if weight_decay != 0.0:
        if mode == AdamWMode.ADAMW_TORCH:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        elif mode == AdamWMode.ADAM_L2_REGULARIZATION:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)
    counts = [step.item() for step in steps]  # one host value per tensor: a parameter may have skipped steps
    if group["bias_correction"]:
        corrections1 = [1.0 - beta1**t for t in counts]
        corrections2 = [1.0 - beta2**t for t in counts]
    else:
        corrections1 = corrections2 = [1.0] * len(counts)
    denominators = torch._foreach_sqrt(exp_avg_sqs)
    if torch_formula:
        # torch.optim.Adam/AdamW: p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        torch._foreach_div_(denominators, [math.sqrt(c) for c in corrections2])
        torch._foreach_add_(denominators, eps)
        torch._foreach_addcdiv_(params, exp_avgs, denominators, [-lr / c for c in corrections1])
        return
    # transformers.AdamW: p -= lr * sqrt(bc2) / bc1 * m / (sqrt(v) + eps); then p -= lr * weight_decay * p
    torch._foreach_add_(denominators, eps)
    torch._foreach_addcdiv_(
        params, exp_avgs, denominators, [-lr * math.sqrt(c2) / c1 for c1, c2 in zip(corrections1, corrections2)]
    )
    if weight_decay != 0.0:
        torch._foreach_add_(params, params, alpha=-lr * weight_decay)


@hookimpl
def ortcore_register(register: Any) -> None:
    register.optimizer("FusedAdam", FusedAdam)
    register.optimizer("AdamWMode", AdamWMode)
