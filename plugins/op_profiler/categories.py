"""Op categories both sides share: an ONNX Runtime op type, an ATen node's operator and an eager aten op or autograd
node all map to one of :data:`CATEGORIES`, so ortcore's kernels and PyTorch eager's can be compared row by row.

No torch here: the table is plain data.
"""

from __future__ import annotations

import re

from ortcore.api import aten_kind

#: In the order tables list them.
CATEGORIES: tuple[str, ...] = (
    "matmul/gemm",
    "attention",
    "layer_norm",
    "gelu",
    "softmax",
    "embedding/gather",
    "cross_entropy",
    "elementwise",
    "reduce",
    "copy/reshape/transpose",
    "shape",
    "optimizer",
    "other",
)

# ONNX Runtime op types (any domain), forward and gradient ops alike.
_ORT: dict[str, str] = {}
for _category, _ops in {
    "matmul/gemm": "MatMul FusedMatMul Gemm FusedGemm MatMulInteger QLinearMatMul MatMulBnb4 MatMulNBits",
    "attention": "Attention MultiHeadAttention PackedAttention",
    "layer_norm": "LayerNormalization SimplifiedLayerNormalization SkipLayerNormalization "
    "SkipSimplifiedLayerNormalization LayerNormalizationGrad SimplifiedLayerNormalizationGrad "
    "InvertibleLayerNormalizationGrad",
    "gelu": "Gelu FastGelu BiasGelu GeluGrad FastGeluGrad BiasGeluGrad_dX BiasFastGeluGrad_dX QuickGelu QuickGeluGrad",
    "softmax": "Softmax SoftmaxGrad SoftmaxGrad_13 LogSoftmax LogSoftmaxGrad LogSoftmaxGrad_13",
    "embedding/gather": "Gather GatherGrad GatherElements GatherElementsGrad GatherND GatherNDGrad "
    "PadAndUnflatten FlattenAndUnpad ScatterElements ScatterND",
    "cross_entropy": "SoftmaxCrossEntropyLoss SoftmaxCrossEntropyLossGrad SoftmaxCrossEntropyLossInternal "
    "SoftmaxCrossEntropyLossInternalGrad NegativeLogLikelihoodLoss NegativeLogLikelihoodLossGrad "
    "SoftmaxCrossEntropy SoftmaxCrossEntropyGrad SparseSoftmaxCrossEntropy SparseSoftmaxCrossEntropyGrad",
    "elementwise": "Add Sub Mul Div Pow Sqrt Reciprocal Neg Abs Exp Log Erf Tanh Sigmoid Relu LeakyRelu Where Not And "
    "Or Xor Equal Less LessOrEqual Greater GreaterOrEqual Max Min Sum Clip IsNaN IsInf Dropout BitmaskDropout "
    "BiasDropout BitmaskBiasDropout DropoutGrad BitmaskDropoutGrad TanhGrad SigmoidGrad ReluGrad FastReluGrad "
    "SoftplusGrad Softplus Mod Floor Ceil Round Sign Trilu BiasSoftmax BiasSoftmaxDropout",
    "reduce": "ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL2 ReduceLogSumExp ReduceSumSquare "
    "ReduceSumTraining ReduceAllL2 ArgMax ArgMin CumSum",
    "copy/reshape/transpose": "Reshape Transpose Squeeze Unsqueeze Flatten Expand Concat ConcatTraining Split "
    "SplitTraining Slice SliceGrad Identity Cast Tile Pad MemcpyFromHost MemcpyToHost Copy",
    "shape": "Shape Size ConstantOfShape Range BroadcastGradientArgs NonZero",
}.items():
    _ORT.update(dict.fromkeys(_ops.split(), _category))

# aten ops by name (no ``aten::``, no ``_backward``, no trailing ``_`` of in-place ops).
_ATEN: dict[str, str] = {}
for _category, _ops in {
    "matmul/gemm": "mm addmm bmm baddbmm matmul linear linear_no_bias t_mm dot mv addmv einsum",
    "attention": "scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu "
    "scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_attention_math "
    "scaled_dot_product_efficient_attention _scaled_dot_product_efficient_attention",
    "layer_norm": "layer_norm native_layer_norm rms_norm _fused_rms_norm group_norm native_group_norm",
    "gelu": "gelu",
    "softmax": "softmax _softmax safe_softmax _safe_softmax",
    "embedding/gather": "embedding embedding_dense embedding_renorm index_select gather index take",
    # torch's cross_entropy is log_softmax + nll_loss; ONNX Runtime runs them as one kernel.
    "cross_entropy": "cross_entropy cross_entropy_loss nll_loss nll_loss_nd nll_loss2d log_softmax _log_softmax",
    "elementwise": "add sub rsub mul div pow sqrt rsqrt reciprocal neg abs exp log erf tanh sigmoid relu where "
    "masked_fill eq ne lt le gt ge maximum minimum clamp clamp_min clamp_max dropout native_dropout "
    "fill zero lerp addcmul addcdiv bitwise_not logical_not",
    "reduce": "sum mean max min amax amin prod norm linalg_vector_norm argmax argmin cumsum var std",
    "copy/reshape/transpose": "view reshape _reshape_alias transpose t permute contiguous clone copy _to_copy to "
    "expand expand_as squeeze unsqueeze flatten unflatten cat stack split chunk slice select narrow as_strided "
    "unbind detach alias type_as repeat _unsafe_view unsafe_view to_copy view_as",
    "shape": "empty empty_like empty_strided zeros zeros_like ones ones_like full full_like arange resize "
    "resolve_conj resolve_neg lift_fresh scalar_tensor item _local_scalar_dense size",
}.items():
    _ATEN.update(dict.fromkeys(_ops.split(), _category))


def ort_category(op_type: str) -> str:
    """The category of an ONNX Runtime kernel by its op type (``FusedMatMul``, ``LayerNormalizationGrad``)."""
    return _ORT.get(op_type, "other")


def aten_base(name: str) -> str:
    """An aten op's or an ATen node's operator's base name: ``aten::native_layer_norm_backward`` ->
    ``native_layer_norm``, ``ortcore_aten::layer_norm_backward_input`` -> ``layer_norm``, ``aten::add_`` -> ``add``,
    ``aten::_log_softmax_backward_data`` -> ``_log_softmax``."""
    name = name.removeprefix("aten::")
    if "::" in name:
        return aten_kind(name)
    name = re.sub(r"_backward(_data|_input|_weight|_bias)?$", "", name)
    if name.endswith("_") and not name.startswith("_"):
        name = name[:-1]
    return name


def aten_category(name: str) -> str:
    """The category of an aten op (``aten::addmm``, ``native_layer_norm_backward``) or ATen node operator."""
    base = aten_base(name)
    return _ATEN.get(base) or _ATEN.get(base.lstrip("_")) or _ATEN.get(aten_kind(base), "other")


def autograd_node_op(node: str) -> str:
    """The aten op an autograd node differentiates: ``NativeLayerNormBackward0`` -> ``native_layer_norm``,
    ``torch::autograd::AccumulateGrad`` -> ``accumulate_grad``."""
    name = node.rpartition("::")[2]
    name = re.sub(r"Backward\d*$", "", name)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
