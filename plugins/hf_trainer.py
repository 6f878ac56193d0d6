"""hf_trainer: Hugging Face's ``Trainer`` saving an ORTModule-wrapped model the Hugging Face way.

``transformers.Trainer(model=ORTModule(model))`` trains, evaluates and logs as with the plain model. Saving is where
it differs: ``Trainer`` writes ``config.json`` and handles tied weights only for a ``PreTrainedModel`` (or one its
accelerator unwraps from DDP, FSDP, DeepSpeed or ``torch.compile``), and an ORTModule is none of those, so
``trainer.save_model()`` wrote only ``model.safetensors`` (no ``config.json``: ``from_pretrained`` fails) and a
model with tied weights (GPT-2's LM head) cannot be written at all. :class:`ORTTrainer` is ``Trainer`` with
``save_model`` saving the wrapped model itself (the same parameters: ORTModule wraps the model, it does not copy it),
so checkpoints and ``save_model`` write what ``save_pretrained`` writes::

    from ortcore import ORTModule
    from ortcore_plugins.hf_trainer import ORTTrainer

    trainer = ORTTrainer(model=ORTModule(model), args=args, train_dataset=data)
    trainer.train()
    trainer.save_model("out")            # out/config.json, out/model.safetensors, ...
    AutoModelForCausalLM.from_pretrained("out")

Without it, ``model.save_pretrained("out")`` on the ORTModule (forwarded to the wrapped model) does the same.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["ORTTrainer"]  # noqa: F822 (built on first access, module __getattr__)


@functools.cache
def _trainer_class() -> type:
    # Built on first use: importing transformers costs a second, and this module is imported by every plugin host.
    import transformers

    from ortcore.api import ORTModule

    class ORTTrainer(transformers.Trainer):
        """``transformers.Trainer`` whose ``save_model`` (and so its checkpoints) saves an ORTModule's wrapped
        ``PreTrainedModel`` with ``save_pretrained``: ``config.json``, tied weights, the generation config."""

        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> Any:
            wrapper = self.model
            inner = wrapper.module if isinstance(wrapper, ORTModule) else None
            if not isinstance(inner, transformers.PreTrainedModel):
                return super().save_model(output_dir, _internal_call)
            self.model = inner  # saved with save_pretrained; its parameters are the wrapper's (wrapped, not copied)
            try:
                return super().save_model(output_dir, _internal_call)
            finally:
                self.model = wrapper

    ORTTrainer.__module__ = __name__
    return ORTTrainer


def __getattr__(name: str) -> Any:
    if name == "ORTTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
