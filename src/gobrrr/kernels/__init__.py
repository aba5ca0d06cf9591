"""Fused Triton kernels for training. Needs only torch and triton.

    from gobrrr.kernels import attention, linear_cross_entropy, rms_norm, layer_norm, swiglu, gelu
"""
