"""Qwen3.5 / Qwen3.6 MoE (`qwen3_5_moe`): hybrid Gated DeltaNet + gated attention.

Three of every four layers mix with Gated DeltaNet, the fourth with gated
softmax attention (or as `layer_types` says); every layer has 256 routed
experts plus a sigmoid-gated shared expert, and all norms but the DeltaNet
output norm are zero-centred (`x_hat * (1 + w)`).
"""

from __future__ import annotations

from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.config import ModelConfig
from tierlab.engine.models.attention import Attention
from tierlab.engine.models.deltanet import GatedDeltaNet


def build_mixer(ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> Attention | GatedDeltaNet:
    if cfg.layer_types[layer] == "linear_attention":
        return GatedDeltaNet(ckpt, cfg, layer)
    return Attention(ckpt, cfg, layer)
