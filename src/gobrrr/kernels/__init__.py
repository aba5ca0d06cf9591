"""Fused Triton kernels for training. Needs only torch and triton.

    from gobrrr.kernels import attention, linear_cross_entropy, rms_norm, layer_norm, swiglu, gelu

Every kernel is a torch.library custom op under the `gobrrr::` namespace (with a fake
implementation for FakeTensor tracing, and autograd), so a traced step names them as single ops.
On CPU they run only under TRITON_INTERPRET=1 (for tests).
"""

# attention.py imports without triton; this binds the function over the submodule's name
from gobrrr.kernels.attention import attention
from gobrrr.kernels.linear_cross_entropy import linear_cross_entropy
from gobrrr.kernels.nn import Attention, LayerNorm, LinearCrossEntropy, RMSNorm, SwiGLU
from gobrrr.kernels.norms import layer_norm, rms_norm
from gobrrr.kernels.pointwise import gelu, swiglu

__all__ = [
    "Attention",
    "LayerNorm",
    "LinearCrossEntropy",
    "RMSNorm",
    "SwiGLU",
    "attention",
    "gelu",
    "layer_norm",
    "linear_cross_entropy",
    "rms_norm",
    "swiglu",
]
