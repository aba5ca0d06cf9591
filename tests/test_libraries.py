"""Libraries that branch on whether their tensors are fake take, in the trace, the branch the
GPU's run takes (gobrrr.capture.libraries): a Hugging Face Llama with gradient checkpointing
(use_cache=False) and no padding passes is_causal=True to SDPA as it does eagerly; with a
padded batch it passes its explicit mask, as it does eagerly."""

import pytest
import torch
import torch.nn.functional as F

import gobrrr
from gobrrr.capture import capture

T = pytest.importorskip("transformers", exc_type=ImportError)


def _calls(run) -> list[tuple[bool, bool]]:
    """(mask given, is_causal) of every SDPA call run() makes."""
    calls, orig = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is not None, bool(is_causal)))
        return orig(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    F.scaled_dot_product_attention = spy
    try:
        run()
    finally:
        F.scaled_dot_product_attention = orig
    return calls


def _llama():
    cfg = T.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
    )
    model = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").train()
    model.gradient_checkpointing_enable()
    return model


@pytest.mark.parametrize("padded", [False, True])
def test_traced_attention_takes_the_eager_branch(padded):
    torch.manual_seed(0)
    model = _llama()
    ids = torch.randint(0, 100, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    if padded:
        mask = torch.ones(2, 16, dtype=torch.long)
        mask[1, 12:] = 0
        batch["attention_mask"] = mask
    eager = _calls(lambda: model(**batch).loss.backward())
    traced = _calls(lambda: capture(gobrrr.Workload(model, batch)))
    assert eager and set(traced) == set(eager)
    assert set(eager) == ({(True, False)} if padded else {(False, True)})
