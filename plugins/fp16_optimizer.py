"""fp16_optimizer: ``FP16_Optimizer``, offered under ``ortcore.optim`` (being written)."""

from __future__ import annotations

NAME = "fp16_optimizer"

# Read from the source by ortcore.optim when this plugin is disabled, to name it in the error.
OPTIMIZERS = ("FP16_Optimizer",)
