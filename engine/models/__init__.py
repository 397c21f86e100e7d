"""One module per architecture; each exposes build_mixer(ckpt, cfg, layer)."""

from tierlab.engine.config import QWEN3_5_MOE, QWEN3_MOE
from tierlab.engine.models import qwen3_5_moe, qwen3_moe

ARCHITECTURES = {QWEN3_MOE: qwen3_moe, QWEN3_5_MOE: qwen3_5_moe}
