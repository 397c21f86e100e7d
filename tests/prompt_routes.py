"""What two runs of a prompt must agree on: each token's routing records, layer by layer."""

from __future__ import annotations

from pathlib import Path

from tierlab import ASSETS_DIR
from tierlab.engine.container import convert

SHIPPED = ASSETS_DIR / "tiny-moe"  # 32 experts, top-4, 8 layers


def shipped_and_int4(tmp_dir: Path) -> dict:
    """The shipped model as it ships (bf16 safetensors) and as an int4 container in tmp_dir."""
    out = tmp_dir / "tiny-moe-q4"
    convert(SHIPPED, out, bits=4)
    return {"safetensors": SHIPPED, "int4": out}


def routes_of(events) -> list:
    """What each token's routing decided and met, layer by layer."""
    return [[(r.chosen.tolist(), r.level.tolist(), r.ram_hits, r.ram_misses, r.shadow_ram_hits,
              r.shadow_ram_misses, r.swaps) for r in e.layers] for e in events]
