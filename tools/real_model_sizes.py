"""Sizes on disk of the real Qwen3.6-35B-A3B and Qwen3-30B-A3B, from their shapes.

The expert blobs come from engine/blob_layout.py (the container's one layout,
blobs aligned as experts.bin stores them); dense tensors are counted from the
architectures' tensor shapes (docs/model.md): bf16 as released, or int4/int8
with one float32 scale per 64 weights (`--dense-bits`; the router, embedding
and norms stay bf16). Prints the sizes, then the RAM cache slots per layer
that `--ram-gb` budgets leave (engine/budget.py's own arithmetic, at its
default 4,096-token context) for docs/real-model.md.

    python tools/real_model_sizes.py
"""

from __future__ import annotations

from tierlab.engine.blob_layout import BLOB_ALIGN, GROUP, BlobLayout

GIB = 1024 ** 3

MODELS = {
    "Qwen3.6-35B-A3B": dict(layers=40, attention_every=4, hidden=2048, vocab=248320, experts=256, inter=512,
                            heads=16, kv_heads=2, head_dim=256, gated=True, lin_k_heads=16, lin_v_heads=32,
                            lin_dim=128, shared=512),
    "Qwen3-30B-A3B": dict(layers=48, attention_every=1, hidden=2048, vocab=151936, experts=128, inter=768,
                          heads=32, kv_heads=4, head_dim=128, gated=False, lin_k_heads=0, lin_v_heads=0,
                          lin_dim=0, shared=0),
}


def dense_matrices(m: dict) -> tuple[int, int]:
    """(weights of the projections `--dense-bits` quantises, weights that stay bf16)."""
    H = m["hidden"]
    quantised = kept = 0
    for layer in range(m["layers"]):
        if (layer + 1) % m["attention_every"] == 0:
            q_rows = m["heads"] * m["head_dim"] * (2 if m["gated"] else 1)
            quantised += (q_rows + 2 * m["kv_heads"] * m["head_dim"]) * H + H * m["heads"] * m["head_dim"]
            kept += 2 * m["head_dim"]
        else:
            C = 2 * m["lin_k_heads"] * m["lin_dim"] + m["lin_v_heads"] * m["lin_dim"]
            v = m["lin_v_heads"] * m["lin_dim"]
            quantised += (C + v + 2 * m["lin_v_heads"]) * H + H * v
            kept += C * 4 + 2 * m["lin_v_heads"] + m["lin_dim"]
        quantised += 3 * H * m["shared"]
        kept += m["experts"] * H + (H if m["shared"] else 0) + 2 * H
    quantised += m["vocab"] * H  # lm_head
    kept += m["vocab"] * H + H  # embedding, final norm
    return quantised, kept


def quantised_bytes(weights: int, bits: int) -> int:
    return weights * bits // 8 + (weights // GROUP) * 4


def sizes(m: dict) -> dict[str, float]:
    n_experts = m["layers"] * m["experts"]
    expert_weights = n_experts * 3 * m["hidden"] * m["inter"]
    quantised, kept = dense_matrices(m)
    out = {"params_b": (expert_weights + quantised + kept) / 1e9,
           "bf16_gib": 2 * (expert_weights + quantised + kept) / GIB}
    for bits in (4, 8):
        blob = BlobLayout(f"int{bits}", m["hidden"], m["inter"]).nbytes
        stride = -(-blob // BLOB_ALIGN) * BLOB_ALIGN
        experts = n_experts * stride
        out[f"int{bits}_experts_gib"] = experts / GIB
        out[f"int{bits}_gib"] = (experts + 2 * (quantised + kept)) / GIB
        out[f"int{bits}_dense{bits}_gib"] = (experts + quantised_bytes(quantised, bits) + 2 * kept) / GIB
        out[f"int{bits}_blob_mib"] = blob / 2 ** 20
    out["dense_bf16_gib"] = 2 * (quantised + kept) / GIB
    out["dense_int4_gib"] = (quantised_bytes(quantised, 4) + 2 * kept) / GIB
    return out


ARCH = {"Qwen3.6-35B-A3B": "qwen3_5_moe", "Qwen3-30B-A3B": "qwen3_moe"}
BUDGETS_GB = (4, 8, 16, 24)


def slots_left(name: str, m: dict, dense_bits: int, ram_gb: int) -> str:
    """What `plan_budget` gives this model at `ram_gb`: 'all', 'N of E', or 'refused'."""
    from pathlib import Path

    from tierlab.engine.budget import Footprint, plan_budget
    from tierlab.engine.config import parse_config
    from tierlab.engine.errors import ModelError
    from tierlab.engine.synthetic import config_json, real_shape

    shape = real_shape(ARCH[name], m["layers"], m["experts"], vocab=m["vocab"])
    cfg = parse_config(config_json(shape), Path("config.json"))
    quantised, kept = dense_matrices(m)
    dense = 2 * (quantised + kept) if dense_bits == 0 else quantised_bytes(quantised, dense_bits) + 2 * kept
    blob = BlobLayout("int4", m["hidden"], m["inter"]).nbytes
    try:
        plan = plan_budget(cfg, Footprint(dense, blob, sum(cfg.moe_layers)), ram_gb * GIB, "--ram-gb")
    except ModelError:
        return "refused"
    return "all" if plan.slots == cfg.n_experts else f"{plan.slots} of {cfg.n_experts}"


def budget_table() -> list[str]:
    lines = ["| `--ram-gb` | " + " | ".join(f"{n.split('-A3B')[0]}, dense {d}" for n in MODELS for d in ("int4", "bf16"))
             + " |", "|---:|" + "---:|" * 4]
    for gb in BUDGETS_GB:
        cells = [slots_left(n, m, bits, gb) for n, m in MODELS.items() for bits in (4, 0)]
        lines.append(f"| {gb} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    for name, m in MODELS.items():
        s = sizes(m)
        print(f"{name}: {s['params_b']:.1f} B parameters (text model), bf16 {s['bf16_gib']:.1f} GiB")
        print(f"  int4 container: experts {s['int4_experts_gib']:.1f} GiB ({s['int4_blob_mib']:.2f} MiB per expert), "
              f"total {s['int4_gib']:.1f} GiB with bf16 dense ({s['dense_bf16_gib']:.1f} GiB), "
              f"{s['int4_dense4_gib']:.1f} GiB with --dense-bits 4 (dense {s['dense_int4_gib']:.1f} GiB)")
        print(f"  int8 container: experts {s['int8_experts_gib']:.1f} GiB, total {s['int8_gib']:.1f} GiB, "
              f"{s['int8_dense8_gib']:.1f} GiB with --dense-bits 8")
    print()
    print("RAM cache slots per layer an int4 container gets (4,096-token context):")
    print("\n".join(budget_table()))


if __name__ == "__main__":
    main()
