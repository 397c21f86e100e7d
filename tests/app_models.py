"""Qwen3-MoE checkpoints of any layer and expert count at tiny widths, for the app at real scale.

A 40-layer × 256-expert model (the routing shape of Qwen3.6-35B-A3B) with a
hidden width of 32 loads in seconds, so the app's views can be tested and
timed at the size people run, with a real engine streaming tokens. Written
with tierlab's own safetensors writer; byte-level tokenizer and ChatML.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tierlab.engine.safetensors_file import TensorSpec, write_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_wide_moe(folder: Path, layers: int = 40, experts: int = 256, top_k: int = 8, hidden: int = 32,
                   inter: int = 16, heads: int = 2, kv_heads: int = 1, head_dim: int = 16, vocab: int = 260,
                   seed: int = 0) -> Path:
    """Write config, weights and tokenizer of a deterministic random Qwen3-MoE into `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shapes: list[tuple[str, tuple[int, ...], float]] = [
        ("model.embed_tokens.weight", (vocab, hidden), 0.5),
        ("model.norm.weight", (hidden,), 0.0),
        ("lm_head.weight", (vocab, hidden), 0.3),
    ]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,), 0.0),
            (p + "post_attention_layernorm.weight", (hidden,), 0.0),
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden), 0.08),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), 0.08),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), 0.08),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim), 0.08),
            (p + "self_attn.q_norm.weight", (head_dim,), 0.0),
            (p + "self_attn.k_norm.weight", (head_dim,), 0.0),
            (p + "mlp.gate.weight", (experts, hidden), 0.6),
        ]
        for e in range(experts):
            shapes += [
                (p + f"mlp.experts.{e}.gate_proj.weight", (inter, hidden), 0.08),
                (p + f"mlp.experts.{e}.up_proj.weight", (inter, hidden), 0.08),
                (p + f"mlp.experts.{e}.down_proj.weight", (hidden, inter), 0.08),
            ]

    def arrays():
        for _, shape, scale in shapes:
            if scale == 0.0:  # norms
                yield np.ones(shape, np.float32)
            else:
                yield (rng.standard_normal(shape) * scale).astype(np.float32)

    specs = [TensorSpec(name, "F32", shape) for name, shape, _ in shapes]
    write_file(folder / "model.safetensors", specs, arrays())
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "moe_intermediate_size": inter, "num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": True,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 512,
        "bos_token_id": 256, "eos_token_id": 258,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    return folder
