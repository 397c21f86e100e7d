"""Qwen3-MoE (`qwen3_moe`, e.g. Qwen3-30B-A3B): every layer is full attention.

Plain RMSNorm (`w * x_hat`), no attention output gate, no shared expert;
layers named in `mlp_only_layers` carry a dense SwiGLU instead of experts.
"""

from __future__ import annotations

from tierlab.engine.checkpoint import Checkpoint
from tierlab.engine.config import ModelConfig
from tierlab.engine.models.attention import Attention


def build_mixer(ckpt: Checkpoint, cfg: ModelConfig, layer: int) -> Attention:
    return Attention(ckpt, cfg, layer)
