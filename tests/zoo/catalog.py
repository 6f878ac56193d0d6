"""The zoo's models: tiny configs with random weights (no downloads), every dropout off, and a batch and loss each.

A model is called as ``model(**batch)``; its loss is the model's own (``labels=...``) where it has one, else a fixed
reduction computed outside the model (cross-entropy for torchvision classifiers, the mean of squares of every
floating output for plain torch modules). Builders are deterministic given ``torch.manual_seed``; batches are drawn
from the generator they are given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
BATCH = 4
SEQ = 12

Batch = dict[str, Any]


@dataclass(frozen=True)
class ZooModel:
    """One zoo entry: how to build the model, draw its batch and compute its loss."""

    name: str
    family: str  # "transformers", "torchvision" or "torch"
    description: str
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Batch]
    loss: Callable[[Any, Batch], torch.Tensor]
    targets: tuple[str, ...] = ()  # batch entries only the loss reads
    # AdamW learning rate for the 3-step curve; None is the zoo's default (tests.zoo.run_model.LR). Set only where
    # float32 eager itself disagrees with float64 at the default (the comparison would then judge rounding luck).
    lr: float | None = None

    def __post_init__(self) -> None:
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"zoo model {self.name!r}: lr must be a positive float or None, got {self.lr!r}")

    def inputs(self, batch: Batch) -> Batch:
        """The model's keyword arguments: the batch without the loss-only entries."""
        return {k: v for k, v in batch.items() if k not in self.targets}


# -- losses --------------------------------------------------------------------------------------------------------


def own_loss(output: Any, batch: Batch) -> torch.Tensor:
    """The loss the model computed from ``labels``."""
    return output.loss


def mean_squares(output: Any, batch: Batch) -> torch.Tensor:
    """Sum over every floating tensor of the output of the mean of its squares."""
    leaves = [
        t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    return sum((t**2).mean() for t in leaves)


def logits_cross_entropy(output: Any, batch: Batch) -> torch.Tensor:
    """Cross-entropy of a classifier's logits against ``batch['target']`` (not a model input)."""
    return F.cross_entropy(output, batch["target"])


# -- Hugging Face --------------------------------------------------------------------------------------------------

# Config keys that add randomness in training: every one is set to 0 so ortcore and eager PyTorch compute the same.
_RANDOM_KEYS = ("dropout", "layerdrop", "pdrop", "mask_time_prob", "mask_feature_prob", "jitter_noise")


def _no_randomness(config: Any) -> None:
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _no_randomness(value)
        elif isinstance(value, float) and any(k in key for k in _RANDOM_KEYS):
            setattr(config, key, 0.0)


def hf(config_class: str, model_class: str, **settings: Any) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model_class>(<config_class>(**settings))`` with every dropout at 0."""

    def build() -> nn.Module:
        import transformers

        transformers.logging.set_verbosity_error()
        config = getattr(transformers, config_class)(**settings)
        _no_randomness(config)
        return getattr(transformers, model_class)(config)

    return build


def _ids(gen: torch.Generator, batch: int = BATCH, seq: int = SEQ, vocab: int = VOCAB) -> torch.Tensor:
    # Ids 0-2 are special (pad, bos, eos) in most tiny configs here: keep them out of the text.
    return torch.randint(3, vocab, (batch, seq), generator=gen)


def _padding_mask(batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    """1 for tokens, 0 for padding; row i has i * 2 padded positions at the end (row 0 none)."""
    lengths = torch.tensor([seq - 2 * i for i in range(batch)])
    return (torch.arange(seq)[None, :] < lengths[:, None]).long()


def classification_batch(gen: torch.Generator, num_labels: int = 3) -> Batch:
    """Padded text and one class label per row."""
    mask = _padding_mask()
    return {
        "input_ids": _ids(gen) * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, num_labels, (BATCH,), generator=gen),
    }


def causal_lm_batch(gen: torch.Generator) -> Batch:
    """Token ids, their own next-token labels, no attention mask (as training scripts commonly call LMs)."""
    ids = _ids(gen)
    return {"input_ids": ids, "labels": ids.clone()}


def masked_lm_batch(gen: torch.Generator) -> Batch:
    """Padded text; labels at about a quarter of the token positions, -100 elsewhere."""
    batch = classification_batch(gen)
    labels = batch["input_ids"].clone()
    chosen = (torch.rand(labels.shape, generator=gen) < 0.25) & batch["attention_mask"].bool()
    chosen[:, 1] = True  # at least one label per row
    batch["labels"] = torch.where(chosen, labels, torch.full_like(labels, -100))
    return batch


def replaced_token_batch(gen: torch.Generator) -> Batch:
    """ELECTRA discriminator: padded text and a 0/1 label per token (was it replaced)."""
    batch = classification_batch(gen)
    batch["labels"] = torch.randint(0, 2, batch["input_ids"].shape, generator=gen)
    return batch


def seq2seq_batch(gen: torch.Generator) -> Batch:
    """Padded source text and target labels (the model shifts them into decoder inputs)."""
    mask = _padding_mask()
    return {"input_ids": _ids(gen) * mask, "attention_mask": mask, "labels": _ids(gen, seq=8)}


def image_batch(gen: torch.Generator, size: int = 32, classes: int = 5, batch: int = BATCH) -> Batch:
    return {
        "pixel_values": torch.randn(batch, 3, size, size, generator=gen),
        "labels": torch.randint(0, classes, (batch,), generator=gen),
    }


def whisper_batch(gen: torch.Generator) -> Batch:
    # Whisper requires input_features of length 2 * max_source_positions (16 here).
    return {"input_features": torch.randn(BATCH, 16, 32, generator=gen), "labels": _ids(gen, seq=8)}


def ctc_batch(gen: torch.Generator) -> Batch:
    """1600 samples of audio (159 frames after the feature encoder), 6-10 target characters per row."""
    labels = torch.randint(1, 16, (BATCH, 10), generator=gen)
    for row in range(BATCH):
        labels[row, 10 - row :] = -100
    return {"input_values": torch.randn(BATCH, 1600, generator=gen), "labels": labels}


def clip_batch(gen: torch.Generator) -> Batch:
    mask = _padding_mask(seq=10)
    ids = _ids(gen, seq=10) * mask
    ids[torch.arange(BATCH), mask.sum(1) - 1] = 2  # eos ends every text
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
        "return_loss": True,
    }


_ENCODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
_ENCODER_POS = dict(_ENCODER, max_position_embeddings=64)
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)

HF_MODELS = [
    ZooModel(
        "bert",
        "transformers",
        "BertForSequenceClassification",
        hf("BertConfig", "BertForSequenceClassification", **_ENCODER_POS, num_labels=3),
        classification_batch,
        own_loss,
    ),
    ZooModel(
        "gpt2",
        "transformers",
        "GPT2LMHeadModel (tied embeddings)",
        hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "distilbert",
        "transformers",
        "DistilBertForSequenceClassification",
        hf(
            "DistilBertConfig",
            "DistilBertForSequenceClassification",
            vocab_size=VOCAB,
            dim=64,
            n_layers=2,
            n_heads=2,
            hidden_dim=128,
            max_position_embeddings=64,
            num_labels=3,
        ),
        classification_batch,
        own_loss,
    ),
    ZooModel(
        "roberta",
        "transformers",
        "RobertaForMaskedLM",
        hf("RobertaConfig", "RobertaForMaskedLM", **_ENCODER_POS, pad_token_id=1),
        masked_lm_batch,
        own_loss,
    ),
    ZooModel(
        "albert",
        "transformers",
        "AlbertForSequenceClassification (shared layers, factorized embedding)",
        hf("AlbertConfig", "AlbertForSequenceClassification", **_ENCODER_POS, embedding_size=32, num_labels=3),
        classification_batch,
        own_loss,
    ),
    ZooModel(
        "electra",
        "transformers",
        "ElectraForPreTraining (replaced-token detection)",
        hf("ElectraConfig", "ElectraForPreTraining", **_ENCODER_POS, embedding_size=32),
        replaced_token_batch,
        own_loss,
    ),
    ZooModel(
        "deberta_v2",
        "transformers",
        "DebertaV2ForSequenceClassification (relative attention c2p+p2c)",
        hf(
            "DebertaV2Config",
            "DebertaV2ForSequenceClassification",
            **_ENCODER_POS,
            relative_attention=True,
            position_buckets=16,
            pos_att_type=["p2c", "c2p"],
            num_labels=3,
        ),
        classification_batch,
        own_loss,
    ),
    ZooModel(
        "bart",
        "transformers",
        "BartForConditionalGeneration",
        hf(
            "BartConfig",
            "BartForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_position_embeddings=64,
            **_SPECIAL,
            decoder_start_token_id=2,
        ),
        seq2seq_batch,
        own_loss,
    ),
    ZooModel(
        "t5",
        "transformers",
        "T5ForConditionalGeneration",
        hf(
            "T5Config",
            "T5ForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=64,
            d_kv=32,
            d_ff=128,
            num_layers=2,
            num_heads=2,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        seq2seq_batch,
        own_loss,
    ),
    ZooModel(
        "llama",
        "transformers",
        "LlamaForCausalLM (GQA)",
        hf("LlamaConfig", "LlamaForCausalLM", **_DECODER),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "mistral",
        "transformers",
        "MistralForCausalLM",
        hf("MistralConfig", "MistralForCausalLM", **_DECODER),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "qwen2",
        "transformers",
        "Qwen2ForCausalLM",
        hf("Qwen2Config", "Qwen2ForCausalLM", **_DECODER),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "gpt_neox",
        "transformers",
        "GPTNeoXForCausalLM (partial rotary)",
        hf(
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "opt",
        "transformers",
        "OPTForCausalLM",
        hf(
            "OPTConfig",
            "OPTForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            ffn_dim=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            word_embed_proj_dim=64,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
        ),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "bloom",
        "transformers",
        "BloomForCausalLM (ALiBi)",
        hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=64, n_head=4, n_layer=2),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "falcon",
        "transformers",
        "FalconForCausalLM (multi-query, parallel attention)",
        hf(
            "FalconConfig",
            "FalconForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "phi",
        "transformers",
        "PhiForCausalLM (partial rotary, parallel block)",
        hf(
            "PhiConfig",
            "PhiForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        ),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "mixtral",
        "transformers",
        "MixtralForCausalLM (4 experts, top-2, default routing)",
        hf(
            "MixtralConfig",
            "MixtralForCausalLM",
            **dict(_DECODER, intermediate_size=64),
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
        causal_lm_batch,
        own_loss,
    ),
    ZooModel(
        "vit",
        "transformers",
        "ViTForImageClassification (32x32, patch 8)",
        hf("ViTConfig", "ViTForImageClassification", **_ENCODER, image_size=32, patch_size=8, num_labels=5),
        image_batch,
        own_loss,
    ),
    ZooModel(
        "whisper",
        "transformers",
        "WhisperForConditionalGeneration (16 mel bins, 32 frames)",
        hf(
            "WhisperConfig",
            "WhisperForConditionalGeneration",
            vocab_size=VOCAB,
            num_mel_bins=16,
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            max_source_positions=16,
            max_target_positions=32,
            **_SPECIAL,
            decoder_start_token_id=1,
            suppress_tokens=None,
            begin_suppress_tokens=None,
        ),
        whisper_batch,
        own_loss,
    ),
    ZooModel(
        "wav2vec2_ctc",
        "transformers",
        "Wav2Vec2ForCTC (2 conv layers, CTC loss)",
        hf(
            "Wav2Vec2Config",
            "Wav2Vec2ForCTC",
            vocab_size=16,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            conv_dim=(32, 32),
            conv_stride=(5, 2),
            conv_kernel=(10, 3),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            ctc_zero_infinity=True,
            ctc_loss_reduction="mean",
            pad_token_id=0,
        ),
        ctc_batch,
        own_loss,
    ),
    ZooModel(
        "clip",
        "transformers",
        "CLIPModel (contrastive loss, text + 32x32 vision)",
        hf(
            "CLIPConfig",
            "CLIPModel",
            projection_dim=32,
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=16,
                **_SPECIAL,
            ),
            vision_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=32,
                patch_size=8,
            ),
        ),
        clip_batch,
        own_loss,
    ),
]


# -- torchvision ---------------------------------------------------------------------------------------------------


def torchvision_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A builder of ``torchvision.models.<name>(weights=None, num_classes=10, **kwargs)``."""

    def build() -> nn.Module:
        from .deps import import_torchvision

        return getattr(import_torchvision().models, name)(weights=None, num_classes=10, **kwargs)

    return build


def torchvision_batch(gen: torch.Generator) -> Batch:
    # 96x96 images, batch 4: the last batch norms normalise 3x3x4 = 36 values per channel. At 32x32 they see 4,
    # where float32 rounding is amplified so much that eager float32 itself disagrees with float64.
    return {"x": torch.randn(BATCH, 3, 96, 96, generator=gen), "target": torch.randint(0, 10, (BATCH,), generator=gen)}


TORCHVISION_MODELS = [
    ZooModel(
        "resnet18",
        "torchvision",
        "resnet18 (batch norm)",
        torchvision_model("resnet18"),
        torchvision_batch,
        logits_cross_entropy,
        targets=("target",),
    ),
    ZooModel(
        "mobilenet_v3_small",
        "torchvision",
        "mobilenet_v3_small (hardswish, squeeze-excitation)",
        torchvision_model("mobilenet_v3_small", dropout=0.0),
        torchvision_batch,
        logits_cross_entropy,
        targets=("target",),
    ),
    ZooModel(
        "efficientnet_b0",
        "torchvision",
        "efficientnet_b0 (SiLU, squeeze-excitation; AdamW lr 1e-5)",
        torchvision_model("efficientnet_b0", dropout=0.0, stochastic_depth_prob=0.0),
        torchvision_batch,
        logits_cross_entropy,
        targets=("target",),
        # AdamW's first update is lr * g / (|g| + 1e-8): every element moves by about lr whatever its gradient's size,
        # so an element whose gradient is within float32 rounding of 0 (depthwise 3x3 weights: a few of 4M elements,
        # ~1e-5 against a typical 0.5) moves +lr or -lr by luck of the summation order. At lr 1e-3 the loss collapses
        # 3.66 -> 0.025 in one update, where one such flip (features.4.2.block.1.0.weight[63, 0, 1, 1]) moves the
        # loss by 3.8e-5, more than the tolerance (3.5e-5): eager float32 on the same batch in other row orders (the
        # same math) lands up to 2.4x the tolerance from float64 (0.025207 vs 0.025126). At lr 1e-5 the curve is
        # 3.66 -> 1.77 -> 0.59 -> 0.14, each loss judged mostly by rtol, and float32 eager in 8 row orders stays
        # within 0.03x the tolerance of float64 at every point.
        lr=1e-5,
    ),
    ZooModel(
        "convnext_tiny",
        "torchvision",
        "convnext_tiny (depthwise 7x7, LayerNorm2d, layer scale)",
        torchvision_model("convnext_tiny", stochastic_depth_prob=0.0),
        torchvision_batch,
        logits_cross_entropy,
        targets=("target",),
    ),
]


# -- plain torch ---------------------------------------------------------------------------------------------------


class Recurrent(nn.Module):
    """A 2-layer bidirectional GRU or LSTM over a padded-free sequence, then a linear head on every step."""

    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(16, 32, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


class Encoder(nn.Module):
    """nn.TransformerEncoder (2 layers, d_model 32, 4 heads) with a key padding mask, then a linear head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        # The encoder's output is layer-normed, so the mean of its squares is ~1 whatever the weights: a head makes
        # the loss depend on them.
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x, src_key_padding_mask=padding))


class Conv1dNet(nn.Module):
    """Conv1d with padding, stride and dilation, ReLU, then a pointwise Conv1d."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(8, 16, kernel_size=5, padding=2)
        self.c2 = nn.Conv1d(16, 16, kernel_size=3, stride=2, dilation=2)
        self.c3 = nn.Conv1d(16, 4, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c3(F.relu(self.c2(F.relu(self.c1(x)))))


class ConvTransposeNet(nn.Module):
    """Conv2d down, then ConvTranspose2d up with stride 2 and output_padding, and with groups."""

    def __init__(self):
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(8, 8, 3, stride=2, padding=1, output_padding=1)
        self.grouped = nn.ConvTranspose2d(8, 4, 4, stride=2, padding=1, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.grouped(torch.tanh(self.up(F.relu(self.down(x)))))


class UpsampleNet(nn.Module):
    """Nearest and bilinear upsampling between convolutions, and F.interpolate to a fixed size."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.nearest = nn.Upsample(scale_factor=2, mode="nearest")
        self.bilinear = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.c2(self.bilinear(self.nearest(F.relu(self.c1(x)))))
        return F.interpolate(y, size=(20, 20), mode="bilinear", align_corners=True)


class GroupNormNet(nn.Module):
    """Conv2d, GroupNorm (4 groups of 4 channels, affine), SiLU, Conv2d."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, padding=1)
        self.norm = nn.GroupNorm(4, 16)
        self.c2 = nn.Conv2d(16, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.silu(self.norm(self.c1(x))))


class OpsNet(nn.Module):
    """where, masked_fill, cumsum, argsort, topk, gather, scatter_add and einsum between learned projections."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.keys = nn.Linear(16, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)  # (b, s, 16)
        h = torch.where(h > 0, h, 0.1 * h)
        scores = torch.einsum("bsd,btd->bst", h, self.keys(x)).masked_fill(~mask[:, None, :], -1e4)
        h = torch.einsum("bst,btd->bsd", scores.softmax(-1), h)
        h = h + torch.cumsum(h, dim=1) / 4
        order = torch.argsort(h[..., 0], dim=1, descending=True)  # (b, s)
        h = torch.gather(h, 1, order[..., None].expand_as(h))
        top, index = torch.topk(h, k=4, dim=-1)  # (b, s, 4)
        spread = torch.zeros_like(h).scatter_add(-1, index, top)
        return self.out(h + spread)


def sequence_batch(gen: torch.Generator) -> Batch:
    return {"x": torch.randn(BATCH, SEQ, 16, generator=gen)}


def encoder_batch(gen: torch.Generator) -> Batch:
    return {"x": torch.randn(BATCH, SEQ, 32, generator=gen), "padding": _padding_mask() == 0}


def masked_sequence_batch(gen: torch.Generator) -> Batch:
    return {"x": torch.randn(BATCH, SEQ, 16, generator=gen), "mask": _padding_mask().bool()}


TORCH_MODELS = [
    ZooModel(
        "gru_bidirectional",
        "torch",
        "2-layer bidirectional nn.GRU + Linear",
        lambda: Recurrent(nn.GRU),
        sequence_batch,
        mean_squares,
    ),
    ZooModel(
        "lstm_bidirectional",
        "torch",
        "2-layer bidirectional nn.LSTM + Linear",
        lambda: Recurrent(nn.LSTM),
        sequence_batch,
        mean_squares,
    ),
    ZooModel(
        "transformer_encoder",
        "torch",
        "nn.TransformerEncoder (padding mask) + Linear",
        Encoder,
        encoder_batch,
        mean_squares,
    ),
    ZooModel(
        "conv1d",
        "torch",
        "Conv1d (padding, stride, dilation)",
        Conv1dNet,
        lambda gen: {"x": torch.randn(BATCH, 8, 32, generator=gen)},
        mean_squares,
    ),
    ZooModel(
        "conv_transpose2d",
        "torch",
        "ConvTranspose2d (stride 2, output_padding, groups)",
        ConvTransposeNet,
        lambda gen: {"x": torch.randn(BATCH, 3, 16, 16, generator=gen)},
        mean_squares,
    ),
    ZooModel(
        "upsample",
        "torch",
        "nearest and bilinear upsampling, interpolate",
        UpsampleNet,
        lambda gen: {"x": torch.randn(BATCH, 3, 8, 8, generator=gen)},
        mean_squares,
    ),
    ZooModel(
        "group_norm",
        "torch",
        "Conv2d + GroupNorm + SiLU",
        GroupNormNet,
        lambda gen: {"x": torch.randn(BATCH, 3, 16, 16, generator=gen)},
        mean_squares,
    ),
    ZooModel(
        "ops",
        "torch",
        "where, masked_fill, cumsum, argsort, topk, gather, scatter_add, einsum",
        OpsNet,
        masked_sequence_batch,
        mean_squares,
    ),
]

MODELS: dict[str, ZooModel] = {m.name: m for m in HF_MODELS + TORCHVISION_MODELS + TORCH_MODELS}


def get(name: str) -> ZooModel:
    """The zoo model called ``name``; an unknown name raises naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}") from None
