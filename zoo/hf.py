"""Hugging Face transformers workloads, built from configs with random weights.

Each builder takes (batch, seq, **config) and returns a gobrrr.Workload whose batch is a dict
passed as model(**batch); the model computes its own loss from `labels=` (for LMs, the logits
upcast to fp32 inside the library's loss), as the library's users train it.
"""

from __future__ import annotations

from typing import Any

import torch

import gobrrr
from zoo.common import mlm_labels, padded_mask, require


def _model(auto: str, config_cls: str, attn: str | None = None, **config: Any):
    """`transformers.<auto>.from_config(<config_cls>(**config))`, in train mode."""
    tf = require("transformers")
    cfg = getattr(tf, config_cls)(**config)
    kwargs = {"attn_implementation": attn} if attn else {}
    model = getattr(tf, auto).from_config(cfg, **kwargs)
    return model.train()


def _info(cfg) -> dict[str, Any]:
    """The transformer facts gobrrr's closed-form formulas read, where the config has them."""
    keys = {
        "layers": "num_hidden_layers",
        "hidden": "hidden_size",
        "heads": "num_attention_heads",
        "vocab": "vocab_size",
    }
    return {k: getattr(cfg, v) for k, v in keys.items() if getattr(cfg, v, None) is not None}


def causal_lm(
    batch: int,
    seq: int,
    *,
    config_cls: str,
    pad: bool = False,
    grad_ckpt: bool = False,
    **config: Any,
) -> gobrrr.Workload:
    """A decoder LM's pre-training step: random token ids, labels = ids (shifted inside the
    model). pad: every other row's last 25% padded, attention mask 0 and labels -100 there.
    grad_ckpt: the library's own `model.gradient_checkpointing_enable()`."""
    model = _model("AutoModelForCausalLM", config_cls, **config)
    if grad_ckpt:
        model.gradient_checkpointing_enable()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    inputs = {"input_ids": ids, "labels": ids}
    if pad:
        mask = padded_mask(batch, seq)
        inputs = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.masked_fill(mask == 0, -100),
        }
    return gobrrr.Workload(
        model=model,
        batch=inputs,
        seq_len=seq,
        tokens=batch * seq,
        name=config_cls.removesuffix("Config").lower(),
        info=_info(model.config),
    )


def masked_lm(
    batch: int, seq: int, *, config_cls: str, pad: bool = False, **config: Any
) -> gobrrr.Workload:
    """An encoder's masked-LM step: 15% of positions predicted; pad as in `causal_lm`."""
    model = _model("AutoModelForMaskedLM", config_cls, **config)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    labels = mlm_labels(ids)
    inputs = {"input_ids": ids, "labels": labels}
    if pad:
        mask = padded_mask(batch, seq)
        inputs = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels.masked_fill(mask == 0, -100),
        }
    return gobrrr.Workload(
        model=model,
        batch=inputs,
        seq_len=seq,
        tokens=batch * seq,
        name=config_cls.removesuffix("Config").lower(),
        info=_info(model.config),
    )


def seq2seq(
    batch: int, seq: int, *, config_cls: str, target_len: int = 128, **config: Any
) -> gobrrr.Workload:
    """A text encoder-decoder's step: `seq` source tokens, `target_len` label tokens (the
    decoder inputs are the labels shifted right, inside the model)."""
    model = _model("AutoModelForSeq2SeqLM", config_cls, **config)
    vocab = model.config.vocab_size
    inputs = {
        "input_ids": torch.randint(0, vocab, (batch, seq)),
        "labels": torch.randint(0, vocab, (batch, target_len)),
    }
    return gobrrr.Workload(
        model=model,
        batch=inputs,
        seq_len=seq,
        tokens=batch * seq,
        name=config_cls.removesuffix("Config").lower(),
    )


def whisper(batch: int, seq: int, *, target_len: int = 128, **config: Any) -> gobrrr.Workload:
    """Whisper's step: log-mel input features (batch, mel bins, 2 x source positions, i.e. 30 s
    of audio) and `target_len` decoder label tokens. `seq` is the label length."""
    model = _model("AutoModelForSpeechSeq2Seq", "WhisperConfig", **config)
    cfg = model.config
    feats = torch.randn(batch, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    labels = torch.randint(0, cfg.vocab_size, (batch, seq or target_len))
    return gobrrr.Workload(
        model=model,
        batch={"input_features": feats, "labels": labels},
        seq_len=seq,
        tokens=labels.numel(),
        name="whisper",
    )


def wav2vec2_ctc(
    batch: int, seq: int, *, label_len: int = 100, freeze_features: bool = True, **config: Any
) -> gobrrr.Workload:
    """Wav2Vec2 fine-tuned with CTC on raw 16 kHz audio, `seq` samples per clip, the way the
    library's speech-recognition recipe does it: convolutional feature encoder frozen
    (`freeze_feature_encoder()`), SpecAugment time masking on, labels in 1..vocab-1."""
    model = _model("AutoModelForCTC", "Wav2Vec2Config", **config)
    if freeze_features:
        model.freeze_feature_encoder()
    audio = torch.randn(batch, seq)
    labels = torch.randint(1, model.config.vocab_size, (batch, label_len))
    return gobrrr.Workload(
        model=model, batch={"input_values": audio, "labels": labels}, tokens=batch, name="wav2vec2"
    )


def vit(batch: int, seq: int | None, **config: Any) -> gobrrr.Workload:
    """HF ViT image classification: 224x224 images, 1000 classes, loss through `labels=`."""
    model = _model("AutoModelForImageClassification", "ViTConfig", **config)
    cfg = model.config
    pixels = torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size)
    labels = torch.randint(0, cfg.num_labels, (batch,))
    return gobrrr.Workload(
        model=model, batch={"pixel_values": pixels, "labels": labels}, tokens=batch, name="vit"
    )
