"""The built-in example models: Hugging Face BERT (sequence classification) and GPT-2 (language modelling) built
from configs with random weights (nothing is downloaded), and seeded batches for them. ``ortcore bench``,
``ortcore explain bert`` and the op_profiler plugin's ``--explain`` train these. Importing this module imports
neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any

import attrs

MODELS: tuple[str, ...] = ("bert", "gpt2")


@attrs.frozen
class BenchConfig:
    """Model sizes and training settings shared by every run of one benchmark.

    Example::

        cfg = attrs.evolve(PRESETS["large"], steps=4)
    """

    batch: int = 8
    seq: int = 128
    hidden: int = 256
    layers: int = 4
    steps: int = 20
    warmup: int = 3
    vocab: int = 8000
    lr: float = 1e-4
    seed: int = 0

    @property
    def heads(self) -> int:
        """Attention heads: one per 64 channels as in BERT-base and GPT-2, at least one, dividing ``hidden``."""
        heads = max(1, self.hidden // 64)
        return heads if self.hidden % heads == 0 else 1

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first setting that cannot work."""
        for name in ("batch", "seq", "hidden", "layers", "steps", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps), got warmup {self.warmup} with steps {self.steps}")

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


#: Named configurations for ``ortcore bench --config NAME``; explicit flags override single values.
#: ``large`` is BERT-base/GPT-2-small sized (about 92M parameters with the 8000-word vocabulary): on 2 cores a step
#: takes 3-4 s (up to 10 s on a loaded machine) and eager GPT-2 peaks at 4.4 GiB RSS, hence batch 4 and 8 steps:
#: about 2 minutes per model. ``quick`` is a smoke run of every model and mode; torch.compile's cold compilation
#: (12-25 s per model on 2 cores) is most of its time.
PRESETS: dict[str, BenchConfig] = {
    "default": BenchConfig(),
    "large": BenchConfig(batch=4, seq=256, hidden=768, layers=12, steps=8, warmup=2),
    "quick": BenchConfig(batch=2, seq=32, hidden=64, layers=1, steps=5, warmup=2, vocab=1000),
}


def preset(name: str, **overrides: int) -> BenchConfig:
    """The preset ``name`` with ``overrides`` (settings left None keep the preset's value)."""
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; allowed: {', '.join(PRESETS)}")
    return attrs.evolve(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


def build_model(name: str, cfg: BenchConfig) -> Any:
    """A randomly initialised ``BertForSequenceClassification`` or ``GPT2LMHeadModel`` (no download), dropout 0."""
    import transformers

    if name == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=cfg.vocab,
            n_positions=max(1024, cfg.seq),
            n_embd=cfg.hidden,
            n_layer=cfg.layers,
            n_head=cfg.heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            # use_cache keeps its default (on), as most training scripts leave it: the model then also returns
            # its KV cache, and every mode pays for that alike.
            # GPT-2's default ids (50256) lie outside the small vocabulary.
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(config)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=cfg.vocab,
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            intermediate_size=4 * cfg.hidden,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            classifier_dropout=0.0,
            max_position_embeddings=max(512, cfg.seq),
            num_labels=2,
        )
        return transformers.BertForSequenceClassification(config)
    raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")


def make_batches(name: str, cfg: BenchConfig) -> list[dict[str, Any]]:
    """One seeded batch per step, identical for every mode: GPT-2 learns its own ids, BERT binary labels."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batches = []
    for _ in range(cfg.steps):
        ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
        if name == "gpt2":
            batches.append({"input_ids": ids, "labels": ids})
        else:
            batches.append({"input_ids": ids, "labels": torch.randint(0, 2, (cfg.batch,), generator=gen)})
    return batches
