"""The wide zoo: a second catalog of models none of which is in ``catalog`` (the main zoo), chosen for variety of ops.

Hugging Face families the main zoo leaves out (FFT mixing, sliding-window and LSH attention, reversible layers,
state-space and recurrent language models, window shifts, average pooling, speech front ends, mixtures of experts),
more torchvision classifiers (grouped and depthwise convolutions, channel shuffles, dense blocks) and plain-torch
patterns (unrolled recurrent cells, parametrizations, complex tensors, scatter/index ops, unusual pooling,
normalisations and activations, sampling grids). Same conventions as ``catalog``: tiny configs, random weights, every
dropout and stochastic-depth rate at 0, a batch and a loss per model, no downloads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .catalog import (
    BATCH,
    SEQ,
    VOCAB,
    Batch,
    ZooModel,
    _ids,
    _padding_mask,
    causal_lm_batch,
    classification_batch,
    ctc_batch,
    image_batch,
    logits_cross_entropy,
    masked_lm_batch,
    mean_squares,
    own_loss,
    seq2seq_batch,
    torchvision_batch,
    torchvision_model,
)

# -- Hugging Face --------------------------------------------------------------------------------------------------

# Config keys that add randomness in training. The main catalog's list plus stochastic depth ("drop_path_rate",
# on by default in BEiT, Swin, ConvNeXt-V2, ...) and the remaining spellings of dropout rates.
_RANDOM_KEYS = (
    "dropout",
    "layerdrop",
    "pdrop",
    "mask_time_prob",
    "mask_feature_prob",
    "jitter_noise",
    "drop_path",
    "drop_rate",
    "dropout_prob",
    "attention_drop",
)


def _no_randomness(config: Any) -> None:
    from transformers import PretrainedConfig

    for key, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            _no_randomness(value)
        elif any(k in key for k in _RANDOM_KEYS):
            if isinstance(value, float | int) and not isinstance(value, bool) and value:
                setattr(config, key, 0.0)
            elif isinstance(value, list | tuple) and all(isinstance(v, float | int) for v in value):
                setattr(config, key, type(value)(0.0 for _ in value))


def hf(config_class: str, model_class: str, **settings: Any) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model_class>(<config_class>(**settings))`` with every random rate at 0."""

    def build() -> nn.Module:
        import transformers

        transformers.logging.set_verbosity_error()
        config = getattr(transformers, config_class)(**settings)
        _no_randomness(config)
        return getattr(transformers, model_class)(config)

    return build


def unmasked_classification_batch(gen: torch.Generator) -> Batch:
    """Text and one class label per row, without padding or attention mask (FNet has no attention to mask)."""
    return {"input_ids": _ids(gen), "labels": torch.randint(0, 3, (BATCH,), generator=gen)}


def long_classification_batch(gen: torch.Generator) -> Batch:
    """Padded text of 16 tokens (a multiple of the attention windows and block sizes below) and a label per row."""
    mask = _padding_mask(seq=16)
    return {
        "input_ids": _ids(gen, seq=16) * mask,
        "attention_mask": mask,
        "labels": torch.randint(0, 3, (BATCH,), generator=gen),
    }


def long_seq2seq_batch(gen: torch.Generator) -> Batch:
    mask = _padding_mask(seq=16)
    return {"input_ids": _ids(gen, seq=16) * mask, "attention_mask": mask, "labels": _ids(gen, seq=8)}


def long_lm_batch(gen: torch.Generator) -> Batch:
    ids = _ids(gen, seq=16)
    return {"input_ids": ids, "labels": ids.clone()}


def segmentation_batch(gen: torch.Generator) -> Batch:
    """32x32 images and a class per pixel (the model upsamples its logits to the labels' size)."""
    return {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 4, (BATCH, 32, 32), generator=gen),
    }


def speech_features_batch(gen: torch.Generator) -> Batch:
    """Speech2Text: 24 frames of 16 filterbank features, target text."""
    return {"input_features": torch.randn(BATCH, 24, 16, generator=gen), "labels": _ids(gen, seq=8)}


def spectrogram_batch(gen: torch.Generator) -> Batch:
    """AST: 32 frames of 16 mel bins, a class per row."""
    return {"input_values": torch.randn(BATCH, 32, 16, generator=gen), "labels": torch.randint(0, 5, (BATCH,))}


def depth_batch(gen: torch.Generator) -> Batch:
    return {"pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen)}


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
_SEQ2SEQ = dict(
    vocab_size=VOCAB,
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=2,
)
_VIT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32, patch_size=8
)
# A 2-layer wav2vec2-style feature encoder on 1600 samples (159 frames), as the main zoo's wav2vec2_ctc.
_AUDIO = dict(
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
)


def _hf(name: str, description: str, build: Callable[[], nn.Module], batch: Callable, **kw: Any) -> ZooModel:
    return ZooModel(name, "transformers", description, build, batch, own_loss, **kw)


HF_TEXT = [
    _hf(
        "roberta_prelayernorm",
        "RobertaPreLayerNormForMaskedLM (layer norm before each sublayer)",
        hf("RobertaPreLayerNormConfig", "RobertaPreLayerNormForMaskedLM", **_ENCODER_POS, pad_token_id=1),
        masked_lm_batch,
    ),
    _hf(
        "xlm",
        "XLMWithLMHeadModel (sinusoidal positions off, language embeddings)",
        hf(
            "XLMConfig",
            "XLMWithLMHeadModel",
            vocab_size=VOCAB,
            emb_dim=64,
            n_layers=2,
            n_heads=2,
            max_position_embeddings=64,
            n_langs=2,
            use_lang_emb=True,
        ),
        masked_lm_batch,
    ),
    _hf(
        "fnet",
        "FNetForSequenceClassification (token mixing by torch.fft.fftn, real part)",
        hf(
            "FNetConfig",
            "FNetForSequenceClassification",
            **{k: v for k, v in _ENCODER_POS.items() if k != "num_attention_heads"},
            use_tpu_fourier_optimizations=False,
            num_labels=3,
        ),
        unmasked_classification_batch,
    ),
    _hf(
        "funnel",
        "FunnelForSequenceClassification (mean-pooling between blocks, relative-shift attention)",
        hf(
            "FunnelConfig",
            "FunnelForSequenceClassification",
            vocab_size=VOCAB,
            block_sizes=[1, 1],
            d_model=64,
            n_head=2,
            d_head=32,
            d_inner=128,
            num_labels=3,
        ),
        classification_batch,
    ),
    _hf(
        "mpnet",
        "MPNetForMaskedLM (relative position buckets)",
        hf("MPNetConfig", "MPNetForMaskedLM", **_ENCODER_POS, pad_token_id=1),
        masked_lm_batch,
    ),
    _hf(
        "longformer",
        "LongformerForSequenceClassification (sliding-window chunks via as_strided, global CLS attention)",
        hf(
            "LongformerConfig",
            "LongformerForSequenceClassification",
            **_ENCODER_POS,
            attention_window=4,
            pad_token_id=1,
            num_labels=3,
        ),
        long_classification_batch,
    ),
    _hf(
        "reformer",
        "ReformerModelWithLMHead (local + LSH attention, reversible layers as autograd Functions, axial positions)",
        hf(
            "ReformerConfig",
            "ReformerModelWithLMHead",
            vocab_size=VOCAB,
            hidden_size=64,
            attention_head_size=32,
            num_attention_heads=2,
            attn_layers=["local", "lsh"],
            axial_pos_shape=[4, 4],
            axial_pos_embds_dim=[32, 32],
            feed_forward_size=128,
            is_decoder=True,
            local_attn_chunk_length=4,
            lsh_attn_chunk_length=4,
            num_buckets=4,
            num_hashes=1,
            hash_seed=0,
            max_position_embeddings=16,
            pad_token_id=0,
            # Its cache (ReformerDynamicCache, a class ortcore cannot pass through a graph) is no training output.
            use_cache=False,
        ),
        long_lm_batch,
    ),
    _hf(
        "canine",
        "CanineForSequenceClassification (hashed character embeddings, strided downsampling conv)",
        hf(
            "CanineConfig",
            "CanineForSequenceClassification",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=128,
            max_position_embeddings=64,
            downsampling_rate=2,
            upsampling_kernel_size=2,
            num_hash_functions=4,
            num_hash_buckets=64,
            local_transformer_stride=4,
            num_labels=3,
        ),
        long_classification_batch,
    ),
    _hf(
        "perceiver",
        "PerceiverForSequenceClassification (cross-attention from 8 latents to the text)",
        hf(
            "PerceiverConfig",
            "PerceiverForSequenceClassification",
            vocab_size=VOCAB,
            max_position_embeddings=16,
            num_latents=8,
            d_latents=32,
            d_model=32,
            num_blocks=1,
            num_self_attends_per_block=2,
            num_self_attention_heads=2,
            num_cross_attention_heads=1,
            num_labels=3,
        ),
        classification_batch,
    ),
    _hf(
        "convbert",
        "ConvBertForSequenceClassification (span-based dynamic convolution: unfold, separable Conv1d)",
        hf(
            "ConvBertConfig",
            "ConvBertForSequenceClassification",
            **_ENCODER_POS,
            embedding_size=64,
            head_ratio=2,
            conv_kernel_size=3,
            num_labels=3,
        ),
        classification_batch,
    ),
    _hf(
        "squeezebert",
        "SqueezeBertForSequenceClassification (grouped pointwise Conv1d instead of Linear)",
        hf(
            "SqueezeBertConfig",
            "SqueezeBertForSequenceClassification",
            **_ENCODER_POS,
            embedding_size=64,
            q_groups=2,
            k_groups=2,
            v_groups=2,
            post_attention_groups=2,
            intermediate_groups=4,
            output_groups=4,
            num_labels=3,
        ),
        classification_batch,
    ),
    _hf(
        "yoso",
        "YosoForSequenceClassification (LSH-expectation attention as a custom autograd Function)",
        hf("YosoConfig", "YosoForSequenceClassification", **_ENCODER_POS, num_labels=3),
        long_classification_batch,
    ),
    _hf(
        "nystromformer",
        "NystromformerForSequenceClassification (landmark attention, iterative pseudo-inverse, depthwise conv)",
        hf(
            "NystromformerConfig",
            "NystromformerForSequenceClassification",
            **_ENCODER_POS,
            num_landmarks=4,
            segment_means_seq_len=16,
            conv_kernel_size=3,
            num_labels=3,
        ),
        # Its landmark attention takes no attention mask (the mask's shape no longer matches the landmarks').
        lambda gen: {k: v for k, v in long_classification_batch(gen).items() if k != "attention_mask"},
    ),
    _hf(
        "mobilebert",
        "MobileBertForSequenceClassification (bottlenecks, NoNorm, stacked feed-forwards)",
        hf(
            "MobileBertConfig",
            "MobileBertForSequenceClassification",
            vocab_size=VOCAB,
            hidden_size=64,
            embedding_size=32,
            true_hidden_size=32,
            intra_bottleneck_size=32,
            intermediate_size=64,
            num_feedforward_networks=2,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=64,
            num_labels=3,
        ),
        classification_batch,
    ),
    _hf(
        "xlnet",
        "XLNetLMHeadModel (two-stream relative attention written with einsum, rel_shift)",
        hf("XLNetConfig", "XLNetLMHeadModel", vocab_size=VOCAB, d_model=64, n_layer=2, n_head=2, d_inner=128),
        causal_lm_batch,
    ),
    _hf(
        "roformer",
        "RoFormerForMaskedLM (sinusoidal rotary embeddings)",
        hf("RoFormerConfig", "RoFormerForMaskedLM", **_ENCODER_POS, embedding_size=64),
        masked_lm_batch,
    ),
]

HF_SEQ2SEQ = [
    _hf(
        "led",
        "LEDForConditionalGeneration (Longformer encoder: sliding window + global attention)",
        hf(
            "LEDConfig",
            "LEDForConditionalGeneration",
            **{k: v for k, v in _SEQ2SEQ.items() if k != "max_position_embeddings"},
            max_encoder_position_embeddings=64,
            max_decoder_position_embeddings=64,
            attention_window=4,
        ),
        long_seq2seq_batch,
    ),
    _hf(
        "pegasus",
        "PegasusForConditionalGeneration (sinusoidal positions, pre-LN)",
        hf("PegasusConfig", "PegasusForConditionalGeneration", **_SEQ2SEQ),
        seq2seq_batch,
    ),
    _hf(
        "mbart",
        "MBartForConditionalGeneration (labels shifted by gathering each row's last token)",
        hf("MBartConfig", "MBartForConditionalGeneration", **_SEQ2SEQ),
        seq2seq_batch,
    ),
    _hf(
        "prophetnet",
        "ProphetNetForConditionalGeneration (n-gram streams, relative buckets, n-gram loss)",
        hf(
            "ProphetNetConfig",
            "ProphetNetForConditionalGeneration",
            vocab_size=VOCAB,
            hidden_size=64,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            num_encoder_layers=2,
            num_decoder_layers=2,
            num_encoder_attention_heads=2,
            num_decoder_attention_heads=2,
            max_position_embeddings=64,
            ngram=2,
            num_buckets=8,
            relative_max_distance=16,
        ),
        seq2seq_batch,
    ),
    _hf(
        "blenderbot",
        "BlenderbotForConditionalGeneration",
        hf("BlenderbotConfig", "BlenderbotForConditionalGeneration", **_SEQ2SEQ),
        seq2seq_batch,
    ),
    _hf(
        "m2m100",
        "M2M100ForConditionalGeneration (sinusoidal positions from a cumsum over the padding mask)",
        hf("M2M100Config", "M2M100ForConditionalGeneration", **_SEQ2SEQ),
        seq2seq_batch,
    ),
    _hf(
        "switch_transformers",
        "SwitchTransformersForConditionalGeneration (top-1 expert routing: argmax, one_hot, index writes)",
        hf(
            "SwitchTransformersConfig",
            "SwitchTransformersForConditionalGeneration",
            vocab_size=VOCAB,
            d_model=64,
            d_kv=32,
            d_ff=128,
            expert_capacity=16,
            num_layers=2,
            num_sparse_encoder_layers=1,
            num_decoder_layers=2,
            num_sparse_decoder_layers=1,
            num_heads=2,
            num_experts=4,
            relative_attention_num_buckets=8,
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        ),
        seq2seq_batch,
    ),
]

HF_DECODERS = [
    _hf(
        "gpt_neo",
        "GPTNeoForCausalLM (alternating global and local windowed attention)",
        hf(
            "GPTNeoConfig",
            "GPTNeoForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            attention_types=[[["global", "local"], 1]],
            window_size=4,
            max_position_embeddings=64,
        ),
        causal_lm_batch,
    ),
    _hf(
        "gptj",
        "GPTJForCausalLM (interleaved rotary on part of each head, parallel block)",
        hf(
            "GPTJConfig",
            "GPTJForCausalLM",
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            rotary_dim=8,
            n_positions=64,
        ),
        causal_lm_batch,
    ),
    _hf(
        "codegen",
        "CodeGenForCausalLM (fused qkv split in model-parallel blocks, rotary)",
        hf(
            "CodeGenConfig",
            "CodeGenForCausalLM",
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            rotary_dim=8,
            n_positions=64,
            n_ctx=64,
        ),
        causal_lm_batch,
    ),
    _hf(
        "gemma",
        "GemmaForCausalLM (RMSNorm with 1 + weight, tanh GELU, scaled embeddings)",
        hf("GemmaConfig", "GemmaForCausalLM", **_DECODER, head_dim=16),
        causal_lm_batch,
    ),
    _hf(
        "gemma2",
        "Gemma2ForCausalLM (logit soft-capping, sliding-window layers)",
        hf("Gemma2Config", "Gemma2ForCausalLM", **_DECODER, head_dim=16, sliding_window=4),
        causal_lm_batch,
    ),
    _hf(
        "stablelm",
        "StableLmForCausalLM (partial rotary, LayerNorm)",
        hf("StableLmConfig", "StableLmForCausalLM", **_DECODER, partial_rotary_factor=0.25),
        causal_lm_batch,
    ),
    _hf(
        "gpt_bigcode",
        "GPTBigCodeForCausalLM (multi-query attention)",
        hf(
            "GPTBigCodeConfig",
            "GPTBigCodeForCausalLM",
            vocab_size=VOCAB,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            multi_query=True,
        ),
        causal_lm_batch,
    ),
    _hf(
        "mamba",
        "MambaForCausalLM (selective scan unrolled over the sequence, causal depthwise Conv1d)",
        hf(
            "MambaConfig",
            "MambaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            state_size=8,
            num_hidden_layers=2,
            expand=2,
            conv_kernel=4,
            use_associative_scan=False,
        ),
        causal_lm_batch,
    ),
    _hf(
        "rwkv",
        "RwkvForCausalLM (WKV recurrence in a Python loop, token shift by ZeroPad2d)",
        hf(
            "RwkvConfig",
            "RwkvForCausalLM",
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            attention_hidden_size=32,
            intermediate_size=64,
            context_length=64,
        ),
        causal_lm_batch,
    ),
    _hf(
        "mpt",
        "MptForCausalLM (ALiBi, no biases)",
        hf(
            "MptConfig",
            "MptForCausalLM",
            vocab_size=VOCAB,
            d_model=64,
            n_heads=4,
            n_layers=2,
            expansion_ratio=2,
            max_seq_len=64,
        ),
        causal_lm_batch,
    ),
    _hf(
        "qwen2_moe",
        "Qwen2MoeForCausalLM (4 experts top-2 plus a sigmoid-gated shared expert)",
        hf(
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            **_DECODER,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
        ),
        causal_lm_batch,
    ),
    _hf(
        "recurrent_gemma",
        "RecurrentGemmaForCausalLM (RG-LRU recurrence, causal Conv1d, local attention)",
        hf(
            "RecurrentGemmaConfig",
            "RecurrentGemmaForCausalLM",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            lru_width=64,
            attention_window_size=8,
            block_types=["recurrent", "attention"],
        ),
        causal_lm_batch,
    ),
]

HF_VISION = [
    _hf(
        "deit",
        "DeiTForImageClassification (CLS and distillation tokens)",
        hf("DeiTConfig", "DeiTForImageClassification", **_VIT, num_labels=5),
        image_batch,
    ),
    _hf(
        "beit",
        "BeitForImageClassification (relative position bias table, layer scale, mean pooling)",
        hf(
            "BeitConfig",
            "BeitForImageClassification",
            **_VIT,
            use_relative_position_bias=True,
            use_mean_pooling=True,
            num_labels=5,
        ),
        image_batch,
    ),
    _hf(
        "swin",
        "SwinForImageClassification (shifted windows: torch.roll, window partition, patch merging)",
        hf(
            "SwinConfig",
            "SwinForImageClassification",
            image_size=32,
            patch_size=2,
            embed_dim=16,
            depths=[2, 2],
            num_heads=[2, 2],
            window_size=4,
            num_labels=5,
        ),
        image_batch,
    ),
    _hf(
        "convnextv2",
        "ConvNextV2ForImageClassification (global response normalisation)",
        hf(
            "ConvNextV2Config",
            "ConvNextV2ForImageClassification",
            num_stages=2,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            num_labels=5,
        ),
        image_batch,
    ),
    _hf(
        "resnet_hf",
        "ResNetForImageClassification (Hugging Face's, bottleneck layers, batch norm)",
        hf(
            "ResNetConfig",
            "ResNetForImageClassification",
            embedding_size=16,
            hidden_sizes=[32, 64],
            depths=[1, 1],
            layer_type="bottleneck",
            num_labels=5,
        ),
        lambda gen: image_batch(gen, size=64),
    ),
    _hf(
        "regnet_hf",
        "RegNetForImageClassification (Hugging Face's, grouped convs, squeeze-excitation, batch norm)",
        hf(
            "RegNetConfig",
            "RegNetForImageClassification",
            embedding_size=16,
            hidden_sizes=[16, 32],
            depths=[1, 1],
            groups_width=8,
            layer_type="y",
            num_labels=5,
        ),
        lambda gen: image_batch(gen, size=64),
    ),
    _hf(
        "poolformer",
        "PoolFormerForImageClassification (AvgPool2d token mixer without padding counts, GroupNorm(1))",
        hf(
            "PoolFormerConfig",
            "PoolFormerForImageClassification",
            num_encoder_blocks=2,
            depths=[1, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            padding=[2, 1],
            mlp_ratio=2.0,
            num_labels=5,
        ),
        image_batch,
    ),
    _hf(
        "segformer",
        "SegformerForSemanticSegmentation (reduced-key attention, Mix-FFN, bilinear upsampled loss)",
        hf(
            "SegformerConfig",
            "SegformerForSemanticSegmentation",
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[7, 3],
            strides=[4, 2],
            num_attention_heads=[1, 2],
            mlp_ratios=[2, 2],
            decoder_hidden_size=32,
            num_labels=4,
        ),
        segmentation_batch,
    ),
    _hf(
        "mobilevit",
        "MobileViTForImageClassification (unfold to patches, transformer, fold back; batch norm)",
        hf(
            "MobileViTConfig",
            "MobileViTForImageClassification",
            image_size=64,
            hidden_sizes=[16, 24, 32],
            neck_hidden_sizes=[8, 8, 16, 16, 24, 32, 64],
            num_attention_heads=2,
            expand_ratio=2.0,
            num_labels=5,
        ),
        lambda gen: image_batch(gen, size=64),
    ),
    _hf(
        "levit",
        "LevitForImageClassification (attention bias gathered by index, BatchNorm'd linears, subsampling)",
        hf(
            "LevitConfig",
            "LevitForImageClassification",
            image_size=64,
            hidden_sizes=[32, 48],
            num_attention_heads=[2, 2],
            depths=[1, 1],
            key_dim=[8, 8],
            mlp_ratio=[2, 2],
            attention_ratio=[2, 2],
            down_ops=[["Subsample", 8, 2, 2, 2, 2]],
            num_labels=5,
        ),
        lambda gen: image_batch(gen, size=64),
    ),
    _hf(
        "cvt",
        "CvtForImageClassification (depthwise-conv + batch-norm q/k/v projections)",
        hf(
            "CvtConfig",
            "CvtForImageClassification",
            patch_sizes=[7, 3],
            patch_stride=[4, 2],
            patch_padding=[2, 1],
            embed_dim=[16, 32],
            num_heads=[1, 2],
            depth=[1, 2],  # Cvt indexes stage i's drop-path rates by i: stage 1 needs 2 layers
            mlp_ratio=[2.0, 2.0],
            attention_drop_rate=[0.0, 0.0],
            drop_rate=[0.0, 0.0],
            drop_path_rate=[0.0, 0.0],
            qkv_bias=[True, True],
            cls_token=[False, True],
            qkv_projection_method=["dw_bn", "dw_bn"],
            kernel_qkv=[3, 3],
            padding_kv=[1, 1],
            stride_kv=[2, 2],
            padding_q=[1, 1],
            stride_q=[1, 1],
            num_labels=5,
        ),
        image_batch,
    ),
    ZooModel(
        "dpt",
        "transformers",
        "DPTForDepthEstimation (ViT reassembled at 4 scales: ConvTranspose2d, bilinear fusion)",
        hf(
            "DPTConfig",
            "DPTForDepthEstimation",
            **dict(_VIT, num_hidden_layers=4),
            backbone_out_indices=[0, 1, 2, 3],
            neck_hidden_sizes=[8, 16, 32, 32],
            fusion_hidden_size=16,
            head_in_index=-1,
        ),
        depth_batch,
        mean_squares,
    ),
    _hf(
        "dinov2",
        "Dinov2ForImageClassification (bicubic interpolation of position embeddings, layer scale)",
        hf("Dinov2Config", "Dinov2ForImageClassification", **_VIT, num_labels=5),
        image_batch,
    ),
    _hf(
        "bit",
        "BitForImageClassification (weight-standardised convs, GroupNorm, pre-activation)",
        hf(
            "BitConfig",
            "BitForImageClassification",
            embedding_size=16,
            hidden_sizes=[32, 64],
            depths=[1, 1],
            num_groups=8,
            layer_type="preactivation",
            num_labels=5,
        ),
        image_batch,
    ),
]

HF_SPEECH = [
    _hf(
        "data2vec_audio",
        "Data2VecAudioForCTC (layer-normed conv feature encoder, conv position stack)",
        hf("Data2VecAudioConfig", "Data2VecAudioForCTC", **_AUDIO),
        ctc_batch,
    ),
    _hf("hubert", "HubertForCTC", hf("HubertConfig", "HubertForCTC", **_AUDIO), ctc_batch),
    _hf(
        "sew",
        "SEWForCTC (squeezed sequence: pooled before the transformer, upsampled after)",
        hf("SEWConfig", "SEWForCTC", **_AUDIO, squeeze_factor=2),
        ctc_batch,
    ),
    _hf("unispeech", "UniSpeechForCTC", hf("UniSpeechConfig", "UniSpeechForCTC", **_AUDIO), ctc_batch),
    _hf(
        "wavlm",
        "WavLMForCTC (gated relative position bias)",
        hf("WavLMConfig", "WavLMForCTC", **_AUDIO, num_buckets=16, max_bucket_distance=32),
        ctc_batch,
    ),
    _hf(
        "speech2text",
        "Speech2TextForConditionalGeneration (Conv1d subsampler with GLU, sinusoidal positions)",
        hf(
            "Speech2TextConfig",
            "Speech2TextForConditionalGeneration",
            **{k: v for k, v in _SEQ2SEQ.items() if k != "max_position_embeddings"},
            max_source_positions=64,
            max_target_positions=64,
            conv_channels=32,
            input_feat_per_channel=16,
        ),
        speech_features_batch,
    ),
    _hf(
        "ast",
        "ASTForAudioClassification (spectrogram patches, CLS and distillation tokens)",
        hf(
            "ASTConfig",
            "ASTForAudioClassification",
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            patch_size=8,
            num_mel_bins=16,
            max_length=32,
            frequency_stride=4,
            time_stride=4,
            num_labels=5,
        ),
        spectrogram_batch,
    ),
]

# -- torchvision ---------------------------------------------------------------------------------------------------


def _tv(name: str, description: str, build: Callable[[], nn.Module], **kw: Any) -> ZooModel:
    return ZooModel(name, "torchvision", description, build, torchvision_batch, logits_cross_entropy, ("target",), **kw)


def small_vit() -> nn.Module:
    """torchvision's VisionTransformer at 96x96, patch 16, 2 layers of width 64 (its presets need 224x224)."""
    from .deps import import_torchvision

    vit = import_torchvision().models.vision_transformer.VisionTransformer
    return vit(image_size=96, patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10)


def small_swin() -> nn.Module:
    """torchvision's SwinTransformer (v1 blocks) with 2 stages of width 24/48 and 4x4 windows."""
    from .deps import import_torchvision

    swin = import_torchvision().models.swin_transformer
    return swin.SwinTransformer(
        patch_size=[4, 4],
        embed_dim=24,
        depths=[2, 2],
        num_heads=[2, 4],
        window_size=[4, 4],
        stochastic_depth_prob=0.0,
        num_classes=10,
    )


TORCHVISION_MODELS = [
    _tv(
        "squeezenet1_1",
        "squeezenet1_1 (fire modules, ceil-mode MaxPool, AdaptiveAvgPool)",
        torchvision_model("squeezenet1_1", dropout=0.0),
    ),
    _tv(
        "shufflenet_v2_x0_5",
        "shufflenet_v2_x0_5 (channel shuffle by reshape/transpose, chunk)",
        torchvision_model("shufflenet_v2_x0_5"),
    ),
    _tv("mnasnet0_5", "mnasnet0_5 (inverted residuals, 5x5 depthwise)", torchvision_model("mnasnet0_5", dropout=0.0)),
    _tv(
        "googlenet",
        "googlenet (inception branches concatenated, aux classifiers off)",
        torchvision_model("googlenet", aux_logits=False, init_weights=True, dropout=0.0, transform_input=False),
    ),
    _tv(
        "densenet121",
        "densenet121 (dense blocks: concatenation, AvgPool2d transitions)",
        torchvision_model("densenet121"),
    ),
    _tv("regnet_y_400mf", "regnet_y_400mf (grouped convs, squeeze-excitation)", torchvision_model("regnet_y_400mf")),
    _tv("mobilenet_v2", "mobilenet_v2 (ReLU6, inverted residuals)", torchvision_model("mobilenet_v2", dropout=0.0)),
    _tv("vit_small_tv", "torchvision VisionTransformer (2 layers, width 64, 96x96)", small_vit),
    _tv("swin_tv", "torchvision SwinTransformer (2 stages, shifted 4x4 windows, relative bias)", small_swin),
]


# -- plain torch ---------------------------------------------------------------------------------------------------


class CellLoop(nn.Module):
    """An LSTMCell or GRUCell unrolled over the sequence in a Python loop, then a Linear head on the last state."""

    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.cell = cell(16, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 32)
        state: Any = (h, h) if isinstance(self.cell, nn.LSTMCell) else h
        outputs = []
        for t in range(x.shape[1]):
            state = self.cell(x[:, t], state)
            outputs.append(state[0] if isinstance(state, tuple) else state)
        return self.head(torch.stack(outputs, 1))


class SimpleRNN(nn.Module):
    """2-layer unidirectional tanh nn.RNN (or an LSTM with proj_size), then a Linear head on every step."""

    def __init__(self, kind: str):
        super().__init__()
        if kind == "rnn":
            self.rnn = nn.RNN(16, 32, num_layers=2, batch_first=True)
            width = 32
        else:
            self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True, proj_size=12)
            width = 12
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


class Parametrized(nn.Module):
    """Layers whose weights are computed by torch.nn.utils.parametrizations at every forward."""

    def __init__(self, kind: str):
        super().__init__()
        from torch.nn.utils import parametrizations as P

        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.lin = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)
        if kind == "spectral_norm":
            # In training each forward runs a power iteration and writes the result into the u/v buffers.
            P.spectral_norm(self.conv)
            P.spectral_norm(self.lin)
        elif kind == "weight_norm":
            P.weight_norm(self.conv)
            P.weight_norm(self.lin, dim=0)
        else:
            P.orthogonal(self.lin)  # square: the matrix exponential of a skew-symmetric matrix
            P.orthogonal(self.head, orthogonal_map="householder")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x.transpose(1, 2))).transpose(1, 2)
        return self.head(torch.tanh(self.lin(h)))


class FFTFilter(nn.Module):
    """A global filter layer: rfft over the sequence, multiply by a learned complex filter, irfft back."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.filter = nn.Parameter(torch.randn(SEQ // 2 + 1, 16, 2) * 0.1)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        spectrum = torch.fft.rfft(h, dim=1, norm="ortho")
        spectrum = spectrum * torch.view_as_complex(self.filter)
        h = h + torch.fft.irfft(spectrum, n=h.shape[1], dim=1, norm="ortho")
        return self.out(F.gelu(h))


class ComplexRotary(nn.Module):
    """Self-attention with rotary embeddings applied as complex multiplication (view_as_complex / view_as_real)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 8)
        freqs = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        self.register_buffer("rot", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h, d = x.shape
        xc = torch.view_as_complex(x.reshape(b, s, h, d // 2, 2))
        return torch.view_as_real(xc * self.rot[None, :s, None, :]).flatten(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).unbind(2)
        q, k = self._rotate(q), self._rotate(k)
        att = torch.einsum("bshd,bthd->bhst", q, k).div(8**0.5).softmax(-1)
        return self.out(torch.einsum("bhst,bthd->bshd", att, v).reshape(b, s, 16))


class BagOfEmbeddings(nn.Module):
    """nn.EmbeddingBag in mean mode over ragged bags (offsets), and in sum mode with per-sample weights."""

    def __init__(self):
        super().__init__()
        self.mean_bag = nn.EmbeddingBag(VOCAB, 16, mode="mean")
        self.sum_bag = nn.EmbeddingBag(VOCAB, 16, mode="sum")
        self.head = nn.Linear(32, 4)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        a = self.mean_bag(ids, offsets)
        b = self.sum_bag(ids, offsets, per_sample_weights=weights)
        return self.head(torch.cat([a, b], -1))


def bag_batch(gen: torch.Generator) -> Batch:
    return {
        "ids": torch.randint(0, VOCAB, (20,), generator=gen),
        "offsets": torch.tensor([0, 3, 9, 10]),
        "weights": torch.rand(20, generator=gen),
    }


class MessagePassing(nn.Module):
    """Two rounds of graph message passing: messages summed into nodes with index_add_, max-pooled with
    scatter_reduce('amax'), then mean over each graph with scatter_reduce('mean')."""

    def __init__(self):
        super().__init__()
        self.msg = nn.Linear(32, 16)
        self.upd = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, edges: torch.Tensor, graph: torch.Tensor) -> torch.Tensor:
        src, dst = edges
        for _ in range(2):
            m = torch.relu(self.msg(torch.cat([x[src], x[dst]], -1)))
            summed = torch.zeros_like(x).index_add_(0, dst, m)
            biggest = torch.zeros_like(x).scatter_reduce(0, dst[:, None].expand_as(m), m, "amax", include_self=False)
            x = torch.tanh(self.upd(torch.cat([x + summed, biggest], -1)))
        pooled = x.new_zeros(4, 16).scatter_reduce(0, graph[:, None].expand_as(x), x, "mean", include_self=False)
        return self.head(pooled)


def graph_batch(gen: torch.Generator) -> Batch:
    nodes = 24
    return {
        "x": torch.randn(nodes, 16, generator=gen),
        "edges": torch.randint(0, nodes, (2, 60), generator=gen),
        "graph": torch.arange(nodes) // 6,
    }


class Pooling(nn.Module):
    """AvgPool2d (ceil mode, padding not counted), AdaptiveAvgPool2d((2, 2)) over an odd 5x5 map, LPPool2d,
    AdaptiveMaxPool2d, between convolutions."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.avg = nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
        self.c2 = nn.Conv2d(8, 8, 3)
        self.adaptive = nn.AdaptiveAvgPool2d((2, 2))
        self.lp = nn.LPPool2d(2, 2)
        self.amax = nn.AdaptiveMaxPool2d((3, 3))
        self.head = nn.Linear(8 * (4 + 4 + 9), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x))  # 16x16
        h = self.avg(h)  # 8x8
        h = torch.relu(self.c2(h))[..., :5, :5]  # 5x5
        parts = [self.adaptive(h), self.lp(h[..., :4, :4]), self.amax(h)]
        return self.head(torch.cat([p.flatten(1) for p in parts], 1))


class UnfoldFold(nn.Module):
    """Overlapping 4x4 patches with F.unfold, a Linear per patch, F.fold back (overlaps summed)."""

    def __init__(self):
        super().__init__()
        self.unfold = nn.Unfold(kernel_size=4, stride=2, padding=1)
        self.fold = nn.Fold(output_size=(16, 16), kernel_size=4, stride=2, padding=1)
        self.patch = nn.Linear(3 * 16, 4 * 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        patches = self.unfold(x).transpose(1, 2)  # (b, L, 48)
        return self.fold(torch.tanh(self.patch(patches)).transpose(1, 2))


class UnusualMaxPool(nn.Module):
    """FractionalMaxPool2d with fixed samples (deterministic), MaxPool2d with indices and MaxUnpool2d."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.MaxPool2d(2, return_indices=True)
        self.unpool = nn.MaxUnpool2d(2)
        self.c2 = nn.Conv2d(8, 4, 3, padding=1)
        self.register_buffer("samples", torch.rand(BATCH, 4, 2, generator=torch.Generator().manual_seed(3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x))
        pooled, idx = self.pool(h)
        h = self.c2(self.unpool(pooled, idx))
        return F.fractional_max_pool2d(h, 2, output_size=(11, 11), _random_samples=self.samples)


class Norms(nn.Module):
    """InstanceNorm2d (affine), LocalResponseNorm, nn.RMSNorm and a LayerNorm without affine parameters."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.lrn = nn.LocalResponseNorm(3)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1, stride=2)
        self.rms = nn.RMSNorm(64)
        self.ln = nn.LayerNorm(64, elementwise_affine=False)
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lrn(torch.relu(self.inorm(self.c1(x))))
        h = self.c2(h).flatten(2)  # (b, 8, 64)
        return self.head(self.ln(torch.relu(self.rms(h))))


class Activations(nn.Module):
    """Softplus, PReLU, Mish, SELU, CELU, GLU, Hardshrink, RReLU (evaluation mode: a fixed slope), Softsign,
    Tanhshrink, LogSigmoid, Hardtanh, ELU, each after its own Linear, summed."""

    def __init__(self):
        super().__init__()
        acts = [
            nn.Softplus(beta=2.0),
            nn.PReLU(),
            nn.Mish(),
            nn.SELU(),
            nn.CELU(0.5),
            nn.Hardshrink(0.3),
            nn.RReLU(),
            nn.Softsign(),
            nn.Tanhshrink(),
            nn.LogSigmoid(),
            nn.Hardtanh(-0.5, 0.5),
            nn.ELU(0.7),
        ]
        acts[6].eval()  # RReLU draws random slopes in training; in evaluation it is a leaky ReLU
        self.acts = nn.ModuleList(acts)
        self.lins = nn.ModuleList(nn.Linear(16, 16) for _ in acts)
        self.glu = nn.Linear(16, 32)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.glu(self.glu(x), dim=-1)
        for act, lin in zip(self.acts, self.lins):
            h = h + act(lin(h)) / len(self.acts)
        return self.head(h)

    def train(self, mode: bool = True) -> Activations:
        super().train(mode)
        self.acts[6].eval()  # keep RReLU deterministic when the model is put in training mode
        return self


class PixelShuffleNet(nn.Module):
    """PixelUnshuffle down, Conv2d, PixelShuffle up (sub-pixel convolution)."""

    def __init__(self):
        super().__init__()
        self.down = nn.PixelUnshuffle(2)
        self.conv = nn.Conv2d(12, 16, 3, padding=1)
        self.up = nn.PixelShuffle(2)
        self.out = nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.up(torch.relu(self.conv(self.down(x)))))


class SpatialTransformer(nn.Module):
    """A spatial transformer: a localisation net predicts an affine matrix, F.affine_grid + F.grid_sample warp."""

    def __init__(self):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.theta = nn.Linear(8, 6)
        with torch.no_grad():  # start near the identity, so the warp samples inside the image
            self.theta.weight.mul_(0.1)
            self.theta.bias.copy_(torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.theta(self.loc(x).flatten(1)).view(-1, 2, 3)
        grid = F.affine_grid(theta, list(x.shape), align_corners=False)
        return self.conv(F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False))


class Prototypes(nn.Module):
    """A prototype classifier: softmax over negative torch.cdist distances to learned prototypes."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.prototypes = nn.Parameter(torch.randn(5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -torch.cdist(self.embed(x), self.prototypes[None].expand(x.shape[0], -1, -1))


class EinsumHeavy(nn.Module):
    """Tensor contractions written with einsum: a bilinear form, a 3-operand contraction, a batched outer product,
    a diagonal (trace) and attention."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 8, 16) * 0.1)
        self.u = nn.Parameter(torch.randn(16, 8) * 0.1)
        self.v = nn.Parameter(torch.randn(8, 8) * 0.1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bil = torch.einsum("bsi,ikj,bsj->bsk", x, self.w, x)  # (b, s, 8)
        three = torch.einsum("bsi,ik,kl->bsl", x, self.u, self.v)
        outer = torch.einsum("bsk,bsl->bskl", bil, three)
        trace = torch.einsum("bskk->bs", outer)[..., None]
        att = torch.einsum("bsk,btk->bst", three, bil).softmax(-1)
        return self.head(torch.einsum("bst,btk->bsk", att, bil) + trace)


class StridedLocalAttention(nn.Module):
    """Sliding-window attention: keys and values of each position's 5-wide window taken with Tensor.as_strided."""

    def __init__(self, window: int = 5):
        super().__init__()
        self.window = window
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 8)

    def _windows(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        pad = self.window // 2
        t = F.pad(t, (0, 0, pad, pad)).contiguous()  # (b, s + 2 pad, d)
        return t.as_strided((b, s, self.window, d), (t.stride(0), d, d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        kw, vw = self._windows(k), self._windows(v)  # (b, s, w, d)
        att = torch.einsum("bsd,bswd->bsw", q, kw).div(4.0).softmax(-1)
        return self.out(torch.einsum("bsw,bswd->bsd", att, vw))


class MaskOps(nn.Module):
    """Masks combined with bitwise_or/and/xor, bucket ids from div(rounding_mode='floor') and remainder, looked up
    in an embedding and added to attention scores."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.bucket_bias = nn.Embedding(8, 1)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        q, k = self.proj(x).chunk(2, -1)
        pos = torch.arange(s)
        rel = pos[None, :] - pos[:, None]
        buckets = torch.div(rel + s, 4, rounding_mode="floor").remainder(8)
        causal = pos[None, :] <= pos[:, None]
        near = (rel.abs() <= 2) ^ (rel == 0)
        allowed = torch.bitwise_or(causal, near)[None] & mask[:, None, :] | torch.eye(s, dtype=torch.bool)[None]
        scores = q @ k.transpose(1, 2) / 4 + self.bucket_bias(buckets)[..., 0]
        att = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return self.out(att @ q)


class Conv3dNet(nn.Module):
    """Conv3d, BatchNorm3d, MaxPool3d, AvgPool3d on a small video clip."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv3d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm3d(8)
        self.pool = nn.MaxPool3d(2)
        self.c2 = nn.Conv3d(8, 8, (1, 3, 3), padding=(0, 1, 1))
        self.avg = nn.AvgPool3d((2, 2, 2))
        self.head = nn.Linear(8 * 2 * 2 * 2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.relu(self.bn(self.c1(x))))
        return self.head(self.avg(torch.relu(self.c2(h))).flatten(1))


class BilinearSimilarity(nn.Module):
    """nn.Bilinear, F.normalize, F.cosine_similarity and logsumexp."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.bil = nn.Bilinear(16, 16, 8)
        self.head = nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        cos = F.cosine_similarity(x, y, dim=-1)[..., None]
        b = self.bil(F.normalize(x, dim=-1), y)
        return self.head(torch.cat([b, cos], -1)).logsumexp(1)


class DecoderNet(nn.Module):
    """nn.TransformerDecoder (norm first, causal mask, memory key padding mask), then a Linear head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.decoder(x, memory, tgt_mask=causal, memory_key_padding_mask=padding))


class CrossAttention(nn.Module):
    """nn.MultiheadAttention with key/value widths unlike the query's (kdim, vdim), head-averaged weights returned."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(16, 2, kdim=24, vdim=8, batch_first=True)
        self.head = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, weights = self.mha(x, kv, kv[..., :8], need_weights=True)
        return self.head(out), weights


def sequence_batch(gen: torch.Generator) -> Batch:
    return {"x": torch.randn(BATCH, SEQ, 16, generator=gen)}


def image16_batch(gen: torch.Generator) -> Batch:
    return {"x": torch.randn(BATCH, 3, 16, 16, generator=gen)}


def _torch(name: str, description: str, build: Callable[[], nn.Module], batch: Callable, **kw: Any) -> ZooModel:
    return ZooModel(name, "torch", description, build, batch, mean_squares, **kw)


TORCH_MODELS = [
    _torch(
        "lstm_cell_loop", "nn.LSTMCell unrolled over 12 steps in Python", lambda: CellLoop(nn.LSTMCell), sequence_batch
    ),
    _torch(
        "gru_cell_loop", "nn.GRUCell unrolled over 12 steps in Python", lambda: CellLoop(nn.GRUCell), sequence_batch
    ),
    _torch("rnn_tanh", "2-layer unidirectional tanh nn.RNN", lambda: SimpleRNN("rnn"), sequence_batch),
    _torch(
        "lstm_proj",
        "2-layer nn.LSTM with proj_size (projected hidden state)",
        lambda: SimpleRNN("proj"),
        sequence_batch,
    ),
    _torch(
        "spectral_norm",
        "parametrizations.spectral_norm on Conv1d and Linear (power iteration writes buffers)",
        lambda: Parametrized("spectral_norm"),
        sequence_batch,
    ),
    _torch(
        "weight_norm",
        "parametrizations.weight_norm on Conv1d and Linear",
        lambda: Parametrized("weight_norm"),
        sequence_batch,
    ),
    _torch(
        "orthogonal",
        "parametrizations.orthogonal (matrix_exp and Householder maps)",
        lambda: Parametrized("orthogonal"),
        sequence_batch,
    ),
    _torch(
        "fft_filter",
        "global filter: torch.fft.rfft, complex multiply (view_as_complex), irfft",
        FFTFilter,
        sequence_batch,
    ),
    _torch(
        "complex_rotary",
        "rotary attention as complex multiplication (view_as_complex/view_as_real, polar)",
        ComplexRotary,
        sequence_batch,
    ),
    _torch(
        "embedding_bag", "nn.EmbeddingBag mean and weighted sum over ragged bags (offsets)", BagOfEmbeddings, bag_batch
    ),
    _torch(
        "gnn",
        "message passing: gather by edge index, index_add_, scatter_reduce amax and mean",
        MessagePassing,
        graph_batch,
    ),
    _torch(
        "pooling",
        "AvgPool2d (ceil, no pad count), AdaptiveAvgPool2d((2,2)) on 5x5, LPPool2d, AdaptiveMaxPool2d",
        Pooling,
        image16_batch,
    ),
    _torch("unfold_fold", "nn.Unfold overlapping patches, Linear, nn.Fold", UnfoldFold, image16_batch),
    _torch(
        "unusual_max_pool",
        "FractionalMaxPool2d (fixed samples), MaxPool2d indices + MaxUnpool2d",
        UnusualMaxPool,
        lambda gen: {"x": torch.randn(BATCH, 3, 24, 24, generator=gen)},
    ),
    _torch("norms", "InstanceNorm2d, LocalResponseNorm, RMSNorm, LayerNorm without affine", Norms, image16_batch),
    _torch(
        "activations",
        "Softplus, PReLU, Mish, SELU, CELU, GLU, Hardshrink, RReLU (eval), Softsign, Tanhshrink, "
        "LogSigmoid, Hardtanh, ELU",
        Activations,
        sequence_batch,
    ),
    _torch("pixel_shuffle", "PixelUnshuffle, Conv2d, PixelShuffle", PixelShuffleNet, image16_batch),
    _torch("grid_sample", "spatial transformer: affine_grid + bilinear grid_sample", SpatialTransformer, image16_batch),
    _torch("cdist", "prototype classifier on torch.cdist distances", Prototypes, sequence_batch),
    _torch(
        "einsum_heavy",
        "einsum: bilinear form, 3 operands, outer product, diagonal, attention",
        EinsumHeavy,
        sequence_batch,
    ),
    _torch(
        "strided_window_attention",
        "sliding-window attention over as_strided windows",
        StridedLocalAttention,
        sequence_batch,
    ),
    _torch(
        "mask_ops",
        "bitwise_or/and/xor masks, div(rounding_mode='floor'), remainder, bucket embedding, -inf masked softmax",
        MaskOps,
        lambda gen: {"x": torch.randn(BATCH, SEQ, 16, generator=gen), "mask": _padding_mask().bool()},
    ),
    _torch(
        "conv3d",
        "Conv3d, BatchNorm3d, MaxPool3d, AvgPool3d",
        Conv3dNet,
        lambda gen: {"x": torch.randn(BATCH, 3, 8, 8, 8, generator=gen)},
    ),
    _torch("bilinear", "nn.Bilinear, normalize, cosine_similarity, logsumexp", BilinearSimilarity, sequence_batch),
    _torch(
        "transformer_decoder",
        "nn.TransformerDecoder (norm first, causal mask, memory padding mask)",
        DecoderNet,
        lambda gen: {
            "x": torch.randn(BATCH, 8, 32, generator=gen),
            "memory": torch.randn(BATCH, SEQ, 32, generator=gen),
            "padding": _padding_mask() == 0,
        },
    ),
    _torch(
        "cross_attention",
        "nn.MultiheadAttention with kdim/vdim, averaged attention weights returned",
        CrossAttention,
        lambda gen: {"x": torch.randn(BATCH, 8, 16, generator=gen), "kv": torch.randn(BATCH, SEQ, 24, generator=gen)},
    ),
]

MODELS: dict[str, ZooModel] = {
    m.name: m for m in HF_TEXT + HF_SEQ2SEQ + HF_DECODERS + HF_VISION + HF_SPEECH + TORCHVISION_MODELS + TORCH_MODELS
}


def get(name: str) -> ZooModel:
    """The wide zoo's model called ``name``; an unknown name raises naming the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise KeyError(f"unknown wide-zoo model {name!r}; known: {', '.join(MODELS)}") from None
