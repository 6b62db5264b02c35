"""The other two buckets: ops torch's own decomposition expands into ops we lower, and ops that
always run eagerly, each with its reason."""

from __future__ import annotations

from gac_torch.legalize.registry import COLLECTIVE, aten, decompose, fallback, namespace_overloads

# Decompose: torch's decomposition (torch._decomp, or the op's CompositeImplicit kernel) gives
# only ops we lower, and a dedicated lowering would not be simpler.
decompose(
    # activations
    aten.hardswish.default, aten.hardsigmoid.default, aten.softplus.default, aten.mish.default,
    aten.celu.default, aten.selu.default, aten.relu6.default, aten.hardshrink.default,
    aten.softshrink.default, aten.threshold.default, aten.glu.default, aten.logit.default,
    aten.log_sigmoid_forward.default, aten.prelu.default, aten._prelu_kernel.default,
    # pointwise math
    aten.clamp_min.default, aten.clamp_min.Tensor, aten.clamp_max.default, aten.clamp_max.Tensor,
    aten.frac.default, aten.floor_divide.default, aten.floor_divide.Scalar, aten.nan_to_num.default,
    aten.square.default, aten.isposinf.default, aten.isneginf.default, aten.xlogy.Tensor,
    aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self, aten.logaddexp.default, aten.logaddexp2.default,
    aten.rad2deg.default, aten.deg2rad.default, aten.sinc.default, aten.heaviside.default,
    aten.addcmul.default, aten.addcdiv.default, aten.true_divide.Tensor, aten.float_power.Tensor_Tensor,
    aten.float_power.Tensor_Scalar, aten.float_power.Scalar,
    # reductions
    aten.logsumexp.default, aten.std_mean.correction, aten.count_nonzero.dim_IntList,
    aten.count_nonzero.default, aten.aminmax.default, aten.trace.default, aten.norm.ScalarOpt_dim,
    aten.norm.Scalar, aten.nansum.default, aten.softmax.int, aten.log_softmax.int,
    # matrix products
    aten.mv.default, aten.dot.default, aten.outer.default, aten.matmul.default, aten.linear.default,
    # data movement
    aten.unbind.int, aten.tril.default, aten.triu.default, aten.tile.default, aten.narrow.default,
    aten.take_along_dim.default, aten.take.default, aten.diag_embed.default, aten.index_add.default,
    aten.index_fill.int_Tensor, aten.index_fill.int_Scalar, aten.index_copy.default,
    aten.pixel_shuffle.default, aten.pixel_unshuffle.default, aten.channel_shuffle.default,
    aten.im2col.default, aten.rot90.default, aten.movedim.int, aten.repeat_interleave.self_int,
    # constructors
    aten.linspace.default, aten.logspace.default, aten.new_zeros.default,
    aten.new_ones.default, aten.new_full.default, aten.new_empty.default, aten.empty_like.default,
    aten.zero.default,
    # resampling and pooling
    aten.upsample_nearest1d.vec, aten.upsample_nearest1d.default, aten.upsample_linear1d.vec,
    aten.upsample_linear1d.default, aten._upsample_nearest_exact2d.vec,
    aten._upsample_nearest_exact2d.default, aten.upsample_bicubic2d.vec,
    aten.upsample_bicubic2d.default, aten.avg_pool1d.default, aten.max_pool1d.default,
    aten.max_pool2d.default, aten.adaptive_avg_pool1d.default, aten.pad.default,
    # losses
    aten.mse_loss.default, aten.l1_loss.default, aten.huber_loss.default, aten.smooth_l1_loss.default,
    aten.nll_loss_forward.default, aten.binary_cross_entropy.default, aten.soft_margin_loss.default,
)

fallback("random numbers: eager's generator state decides them",
         aten.rand.default, aten.randn.default, aten.randperm.default, aten.rand_like.default,
         aten.randn_like.default, aten.randint.low, aten.randint_like.default, aten.bernoulli.default,
         aten.bernoulli.p, aten.normal.Tensor_Tensor, aten.uniform.default, aten.exponential.default,
         aten.multinomial.default)
fallback("data-dependent output shape", aten.nonzero.default, aten.masked_select.default,
         aten.unique_consecutive.default, aten._unique2.default, aten.repeat_interleave.Tensor)
fallback("reads a tensor value on the host (data-dependent control flow)", aten._local_scalar_dense.default)
fallback("symbolic shape query (dynamic shapes)", aten.sym_size.int, aten.sym_stride.int,
         aten.sym_numel.default, aten.sym_storage_offset.default,
         # newer torch only
         *[p.default for p in (getattr(aten, "sym_is_contiguous", None),) if p is not None])
fallback("in-place resize: functional graphs never contain it", aten.resize_.default)
fallback("complex numbers (FFT)", aten._fft_r2c.default, aten._fft_c2r.default, aten._fft_c2c.default)
fallback("backward op: training graphs run it in eager",
         aten.convolution_backward.default, aten.embedding_dense_backward.default,
         aten.max_pool2d_with_indices_backward.default, aten.avg_pool2d_backward.default,
         aten._adaptive_avg_pool2d_backward.default, aten.native_layer_norm_backward.default,
         aten.native_group_norm_backward.default)
fallback("3-d pooling (gac.pool lowers 1-d and 2-d windows)", aten.avg_pool3d.default,
         aten.max_pool3d_with_indices.default, aten._adaptive_avg_pool3d.default)
fallback("a view of raw storage: a functional graph has no storage to stride over",
         aten.as_strided.default)
fallback("out= variant: functional graphs never write into an argument", aten.atan2.out)
fallback("bags with data-dependent offsets", aten._embedding_bag.default)
fallback("scatter-add of overlapping patches (fold)", aten.col2im.default)
fallback("torch's decomposition disagrees with the kernel when a target row has -1 before its end",
         aten.multilabel_margin_loss_forward.default)
# Communication stays torch's own NCCL/gloo call: gac compiles the local compute around it.
fallback(COLLECTIVE, *namespace_overloads("_c10d_functional", "_c10d_functional_autograd"))
