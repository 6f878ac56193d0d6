"""Hugging Face types that ``torch.utils._pytree`` does not know out of the box (the KV caches).

A ``GPT2LMHeadModel`` in training mode returns a ``DynamicCache`` by default (``use_cache`` is on in its config).
transformers ships the pytree registration for its caches (for ``torch.export``); this adapter applies it the
first time such an object crosses ortcore, so that the cache's tensors become graph outputs like any other.
"""

from __future__ import annotations

import sys

from .schema import LEAF_ADAPTERS


def register_transformers_cache(cls: type) -> bool:
    """Register the pytree node of a transformers cache class; return False for anything else."""
    if "transformers" not in sys.modules or not cls.__module__.startswith("transformers."):
        return False
    from transformers.cache_utils import Cache, DynamicCache

    if not issubclass(cls, Cache):
        return False
    if cls is DynamicCache:
        from transformers.integrations.executorch import register_dynamic_cache_export_support

        register_dynamic_cache_export_support()
        return True
    try:
        from transformers.exporters.exporter_dynamo import register_pytree_node
    except ImportError:
        return False
    register_pytree_node(cls)
    return True


LEAF_ADAPTERS.append(register_transformers_cache)
