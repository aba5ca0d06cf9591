"""Closed-form counts from the literature: parameters, activation memory, model FLOPs, MFU.

Each function names its source. They are the yardsticks the traced step graph is held
against, and what a user can check a number with on the back of an envelope.
"""

from __future__ import annotations


def transformer_params(
    L: int,
    d: int,
    V: int,
    ffn: int | None = None,
    kv_heads: int | None = None,
    heads: int | None = None,
    tied: bool = True,
    gated: bool = False,
    bias: bool = False,
    positions: int = 0,
) -> int:
    """Exact parameter count (number of scalars) of a pre-norm decoder-only transformer.

    Covers our GPT-2 (Radford et al. 2019: bias=True, LayerNorm with bias, ffn=4d, learned
    positions, tied head) and Llama 3 (Grattafiori et al. 2024: no biases, RMSNorm weight only,
    gated SwiGLU MLP, grouped-query attention, tied head only for 1B/3B).

    Args:
        L: layers. d: hidden size. V: vocabulary size.
        ffn: MLP inner size (default 4·d).
        kv_heads, heads: key/value and query heads; K and V projections have
            d·kv_heads/heads outputs (default: kv_heads = heads, plain multi-head attention).
        tied: the output head shares the token embedding.
        gated: three MLP matrices (gate, up, down) instead of two.
        bias: biases on every Linear and on every norm (LayerNorm); without it a norm has a
            weight only (RMSNorm, or LayerNorm(bias=False)).
        positions: rows of a learned position table (0 for RoPE).
    """
    ffn = 4 * d if ffn is None else ffn
    kv_dim = d if heads is None or kv_heads is None else d * kv_heads // heads
    attn = 2 * d * d + 2 * d * kv_dim + (2 * d + 2 * kv_dim if bias else 0)
    mlp = (3 if gated else 2) * d * ffn + ((2 if gated else 1) * ffn + d if bias else 0)
    norm = 2 * d if bias else d
    per_layer = attn + mlp + 2 * norm
    embed = V * d + positions * d + (0 if tied else V * d)
    return L * per_layer + norm + embed


def textbook_params(L: int, d: int, V: int) -> int:
    """The textbook estimate 12·d²·L + 2·d·V (scalars), e.g. Kaplan et al. 2020, Table 1.

    12·d² per layer is 4·d² for Q, K, V, O plus 8·d² for a 4·d MLP. It differs from the exact
    count (`transformer_params`) by: biases and norm parameters (ignored here), grouped-query
    attention (K, V are smaller than d×d), a gated MLP (three matrices, ffn not 4·d), the
    position table, and the head: 2·d·V counts an untied head; a tied model has only V·d.
    """
    return 12 * d * d * L + 2 * d * V


def activation_bytes_per_sequence(
    L: int, d: int, T: int, heads: int, V: int, bytes_per_elem: int = 2
) -> int:
    """Activations saved for backward by one sequence, in bytes (the lecture's estimate).

    The count in elements is 12·L·d·T + L·heads·T² + V·T: about 12·d values per token per layer
    (inputs of the matmuls, norms and the nonlinearity), one T×T attention matrix per head per
    layer (eager attention; flash attention stores none), and the logits. The result is that
    element count times `bytes_per_elem` (2 for bf16/fp16, 4 for fp32).
    """
    elements = 12 * L * d * T + L * heads * T * T + V * T
    return elements * bytes_per_elem


def megatron_activation_bytes(
    s: int, b: int, h: int, a: int, L: int = 1, recompute: str = "none"
) -> float:
    """Activation memory of L transformer layers in bytes (Korthikanti et al. 2022, Sec. 4).

    With 16-bit activations, no tensor/sequence parallelism and dropout masks counted, one
    layer stores s·b·h·(34 + 5·a·s/h) bytes, s = sequence length, b = micro-batch, h = hidden,
    a = heads. `recompute` picks the variant:
        "none": the formula above.
        "selective": recompute the attention core (softmax, dropout, QK^T, ·V): 34·s·b·h.
        "flash": flash attention never stores the s² terms, so also 34·s·b·h.
        "full": recompute every layer from its input: 2·s·b·h (the input alone).
    Embeddings, the final norm and the logits are not included.
    """
    per_layer = {
        "none": s * b * h * (34 + 5 * a * s / h),
        "selective": 34 * s * b * h,
        "flash": 34 * s * b * h,
        "full": 2 * s * b * h,
    }
    if recompute not in per_layer:
        raise ValueError(f"recompute={recompute!r}: use one of {sorted(per_layer)}")
    return L * per_layer[recompute]


def model_flops_per_token(
    n_params_nonembed: int, L: int, d: int, S: int, causal: bool = True
) -> float:
    """Training FLOPs per token (forward + backward): 6·N + 12·L·d·S (Kaplan et al. 2020;
    PaLM, Chowdhery et al. 2022, App. B).

    N counts the parameters that take part in a matmul per token (no embedding lookups; an
    output head does count). The attention term 12·L·d·S is for the full S×S score matrix; a
    causal mask needs only half of it, so with `causal=True` the term is 6·L·d·S (the
    FlashAttention convention). MFU figures must say which one they use.
    """
    attention = 12 * L * d * S
    return 6 * n_params_nonembed + (attention / 2 if causal else attention)


def mfu(tokens_per_s: float, flops_per_token: float, peak: float) -> float:
    """Model FLOPs utilization, a fraction in [0, 1]: tokens/s × FLOPs/token ÷ peak FLOP/s.

    `peak` is the dense (non-sparse) tensor-core peak of the GPU in FLOP/s.
    """
    if peak <= 0:
        raise ValueError(f"peak={peak}: give the GPU's dense peak in FLOP/s (> 0)")
    return tokens_per_s * flops_per_token / peak


def textbook_param_gap(
    L: int, d: int, V: int, params: list[tuple[str, tuple[int, ...]]]
) -> list[tuple[str, int]]:
    """Why a model's real parameter count differs from the textbook 12·d²·L + 2·d·V.

    `params`: (name, shape) of every parameter, each once (tied ones once). Each parameter
    falls in exactly one group, so textbook + the deltas = the real count exactly:
        "head tied": the V×d tables (embedding, head) beyond the two that 2·d·V counts: −V·d
            when the head is tied to the embedding;
        "layer matrices": the matrices inside the numbered layers beyond 12·d² per layer
            (grouped-query K and V, a gated MLP, an MLP not 4·d wide);
        "other matrices": those outside the layers (a learned position table, ...);
        "biases and norms": the 1-D parameters (biases, norm weights), which 12·d²·L omits.
    Returns (what, delta in scalars) pairs, zero deltas left out.
    """
    tables = layer = other = vectors = 0
    for name, shape in params:
        n = 1
        for s in shape:
            n *= s
        if len(shape) <= 1:
            vectors += n
        elif len(shape) == 2 and V in shape and d in shape:
            tables += n
        elif len(shape) == 2 and any(part.isdigit() for part in name.split(".")):
            layer += n
        else:
            other += n
    gap = [
        (
            "head tied to the embedding (one V×d table, not two)"
            if tables < 2 * V * d
            else "V×d tables beyond an embedding and a head",
            tables - 2 * V * d,
        ),
        (
            "layer matrices beyond 12·d² per layer (grouped K/V, gated or resized MLP)",
            layer - 12 * d * d * L,
        ),
        ("matrices outside the layers (e.g. a position table)", other),
        ("biases and norm weights (1-D), left out of 12·d²·L", vectors),
    ]
    return [(what, delta) for what, delta in gap if delta]
