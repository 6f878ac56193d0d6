"""fsdp2: PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``) over an ORTModule, parameters sharded across ranks.

FSDP2 shards every parameter of a module it is applied to (a ``DTensor`` shard per rank between steps) and gathers
them in forward hooks of that module: a module's pre-forward hook all-gathers its group and registers the
unsharded parameters on the module, its post-forward hook may reshard them, and a callback at the end of autograd's
backward reduce-scatters each group's gradients into the shards and reshards. An ORTModule runs the whole forward as
one ONNX Runtime graph: the hooks of the submodules inside it never fire. This plugin serves FSDP2 the way the graph
needs it (docs/distributed.md, "FSDP2"):

- **order**: ``fully_shard`` on the blocks of the model, then ``fully_shard(ORTModule(model))`` (the root). The root's
  hooks run around the ORTModule's call, so FSDP2's own root logic (lazy initialisation, the root's all-gather,
  the end-of-backward callback that reduce-scatters every group) runs as in eager. ``ORTModule`` over a model
  whose root is already sharded is refused, naming this order: FSDP2's root hooks would be the model's, which
  ORT never calls.
- **each call** (``pre_call``, before the step reads the model's parameters): the groups of the sharded blocks are
  unsharded (``FSDPModule.unshard()``, FSDP2's public call; the root's is by then), so the graph is fed the
  unsharded parameters. The gradients reach them through autograd; FSDP2's end-of-backward callback then
  reduce-scatters every group and reshards it, as it does for groups whose forward did not run in eager. A call
  without a backward reshards the blocks after ORT's forward.
- **export and the gradient audit** see the model as it is without FSDP2: unsharded parameters, FSDP2's module and
  state-dict hooks set aside, and the blocks' classes the model's own for the time (FSDP2's classes refuse the
  deep copy ortcore traces).

The graph holds the whole model's unsharded parameters from ORT's forward to the end of its backward: FSDP2's
``reshard_after_forward`` has no effect while ORT runs (ORT's backward reads the values its forward was fed; the
plugin sets it to False on the root, FSDP2's default there); the numbers are FSDP2's either way. With the plugin switched off (``[plugins] fsdp2 = false``) a sharded model cannot be
exported (FSDP2 refuses the deep copy ortcore traces) and the fallback policy applies.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from ortcore.api import (
    Config,
    RuntimeInspector,
    UnsupportedModelError,
    hook_defined_in,
    hookimpl,
    hooks_set_aside,
)

NAME = "fsdp2"
logger = logging.getLogger("ortcore.fsdp2")

ORDER = (
    "apply fully_shard to the blocks of the model, then to the ORTModule: "
    "for block in model.blocks: fully_shard(block); model = fully_shard(ORTModule(model))"
)


def _fsdp_module_class() -> type | None:
    """FSDP2's module class, once the user's code imported FSDP2 (a model cannot be sharded before); importing it
    here would pull in torch.distributed's tensor machinery (sympy) for every model."""
    module = sys.modules.get("torch.distributed.fsdp")
    return getattr(module, "FSDPModule", None)


def sharded_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` (itself included) that ``fully_shard`` was applied to, in module order."""
    fsdp = _fsdp_module_class()
    if fsdp is None or "_modules" not in vars(model):  # being restored (deepcopy, unpickling)
        return []
    return [m for m in model.modules() if isinstance(m, fsdp)]


def _original_class(module: torch.nn.Module) -> type:
    """The model's own class of a module ``fully_shard`` gave a class of its own (``FSDP<Class>``)."""
    fsdp = _fsdp_module_class()
    mro = type(module).__mro__
    return mro[mro.index(fsdp) + 1]


def _composable_state_keys() -> tuple[str, ...]:
    """The keys under which ``fully_shard`` (a composable API) keeps its state in a module's ``__dict__``."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY

    return (STATE_KEY, REGISTRY_KEY)


@contextlib.contextmanager
def plain_modules(modules: list[torch.nn.Module]) -> Iterator[None]:
    """The modules as the model's own for the time: their own classes (FSDP2's refuse ``copy.deepcopy``) and without
    the FSDP2 state kept in their ``__dict__`` (it holds the process group, which cannot be copied); put back after.
    """
    keys = _composable_state_keys()
    saved = [(m, type(m), {k: m.__dict__.pop(k) for k in keys if k in m.__dict__}) for m in modules]
    for module, _, _ in saved:
        module.__class__ = _original_class(module)
    try:
        yield
    finally:
        for module, cls, state in saved:
            module.__class__ = cls
            module.__dict__.update(state)


def unshard(modules: list[torch.nn.Module]) -> None:
    """All-gather each module's group (a no-op for one that is unsharded already), all started before any wait."""
    handles = [m.unshard(async_op=True) for m in modules]
    for handle in handles:
        if handle is not None:
            handle.wait()


#: FSDP2's module hooks: they gather and free parameters around each forward, never change what it computes.
FSDP_HOOKS = hook_defined_in("torch.distributed.fsdp")


@contextlib.contextmanager
def whole(model: torch.nn.Module) -> Iterator[None]:
    """The model as it is without FSDP2: parameters unsharded, FSDP2's hooks set aside, the model's own classes."""
    modules = sharded_modules(model)
    if not modules:
        yield
        return
    unshard(modules)
    with hooks_set_aside(model, FSDP_HOOKS), plain_modules(modules):
        yield


def check_model(config: Config, model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sharded modules of the wrapped model; a model whose root is sharded is refused."""
    modules = sharded_modules(model)
    if modules and modules[0] is model:
        raise UnsupportedModelError(
            f"ORTModule over {type(model).__name__} to which fully_shard was applied: FSDP2's root hooks would be the "
            f"model's, which ONNX Runtime never calls, so gradients would never be reduced; {ORDER}"
        )
    return modules


class FSDP2(RuntimeInspector):
    """Unshards the sharded blocks before the step reads the parameters; FSDP2's own callback reshards them."""


    def __init__(self, model: torch.nn.Module) -> None:
        # FSDP2's state in the sharded modules' __dict__ (process group, all-gather buffers, per-step flags):
        # bookkeeping the forward never reads, not part of the graph's identity.
        self.untraced_attributes = frozenset(_composable_state_keys())
        # FSDP2's module hooks (the export sets them aside): in the fingerprint by their code, not their state.
        self.untraced_hooks = FSDP_HOOKS
        self._model = weakref.ref(model)
        self._unsharded: list[torch.nn.Module] = []
        self._backward_follows = False

    @property
    def shards_parameters(self) -> bool:
        """A model with sharded blocks: a first-step check differentiates PyTorch's side while they are whole."""
        model = self._model()
        return model is not None and bool(sharded_modules(model))

    def pre_call(self, step: int, module: Any) -> None:
        model = self._model()
        if model is None:
            return
        root = _fsdp_module_class()
        if root is None:
            return
        blocks = check_model(None, model)
        if isinstance(module, root):
            # ORT's backward reads the parameters its forward was fed: the root's group (the root's post-forward
            # hook runs when the call returns) must not be resharded in between, whatever reshard_after_forward
            # says (FSDP2's own default for the root; the blocks' post-forward hooks never run).
            module.set_reshard_after_forward(False, recurse=False)
        if not blocks:
            self._unsharded = []
            return
        if not isinstance(module, root):
            raise UnsupportedModelError(
                f"{type(model).__name__} has submodules to which fully_shard was applied but its ORTModule has not "
                f"been: FSDP2's root logic (which reduces the gradients after the backward) would never run; {ORDER}"
            )
        unshard(blocks)
        self._unsharded = blocks
        self._backward_follows = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())

    def post_forward(self, step: int, outputs: list[Any]) -> None:
        if not self._backward_follows and self._unsharded:
            blocks, self._unsharded = self._unsharded, []
            for block in blocks:
                block.reshard()


@hookimpl
def ortcore_runtime_inspectors(config: Config, module: torch.nn.Module) -> list[Any]:
    check_model(config, module)
    return [FSDP2(module)]


@hookimpl
def ortcore_export_context(config: Config, module: torch.nn.Module) -> Any:
    return whole(module) if check_model(config, module) else None


@hookimpl(wrapper=True)
def ortcore_check_first_step(step: Any) -> Any:
    with whole(step.model):  # nothing to do for a model without sharded modules
        return (yield)
