"""Tiny random checkpoints built by transformers itself: the numerical oracle.

Norm weights, A_log and dt_bias are randomised so that a wrong formula
(plain vs zero-centred norm, a missing gate) cannot hide behind the
initialiser's ones and zeros.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

torch = None


def _torch():
    global torch
    if torch is None:
        import torch as _t

        torch = _t
    return torch


def qwen3_5_config(n_experts=8, top_k=2, layers=4, hidden=64, vocab=256, shared=32):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=shared, num_experts=n_experts,
        num_experts_per_tok=top_k, full_attention_interval=2, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )


def qwen3_config(n_experts=8, top_k=2, layers=3, hidden=64, vocab=256, norm_topk=True):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, moe_intermediate_size=32,
        num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=norm_topk,
        max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )


def build_model(config, seed: int = 0):
    t = _torch()
    from transformers import Qwen3_5MoeForCausalLM, Qwen3MoeForCausalLM

    t.manual_seed(seed)
    cls = Qwen3_5MoeForCausalLM if config.model_type.startswith("qwen3_5") else Qwen3MoeForCausalLM
    model = cls(config).to(t.float32).eval()
    randomise(model, 0.0 if config.model_type.startswith("qwen3_5") else 1.0)
    return model


def randomise(model, norm_centre: float, skip: str | None = None) -> None:
    """Weights at scales that keep a tiny model's routing and activations lively: norms near
    `norm_centre` (0 for the zero-centred Qwen3.5 norms), parameters whose name holds `skip` left alone."""
    t = _torch()
    with t.no_grad():
        for name, p in model.named_parameters():
            if skip is not None and skip in name:
                continue
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(t.randn_like(p) * 0.2 + norm_centre)
            elif name.endswith("A_log"):
                p.copy_(t.log(t.rand_like(p) * 8 + 0.5))
            elif name.endswith("dt_bias"):
                p.copy_(t.randn_like(p) * 0.5)
            elif "mlp.gate.weight" in name:
                p.copy_(t.randn_like(p) * 0.3)
            elif p.dim() >= 2:
                p.copy_(t.randn_like(p) * 0.08)


def save(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_fused_vl(model, folder: Path) -> Path:
    """The official release's shape: fused experts under model.language_model., nested text_config."""
    from safetensors.numpy import save_file

    t = _torch()
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    tensors = {}
    E = cfg.num_experts
    for name, p in model.state_dict().items():
        arr = p.detach().to(t.float32).numpy()
        if ".mlp.experts." in name:
            continue
        new = "lm_head.weight" if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1)
        tensors[new] = np.ascontiguousarray(arr)
    sd = model.state_dict()
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.mlp.experts."
        if pre + "gate_up_proj" in sd:
            gate_up = sd[pre + "gate_up_proj"].numpy()
            down = sd[pre + "down_proj"].numpy()
        else:
            gate_up = np.stack([np.concatenate([sd[f"{pre}{e}.gate_proj.weight"].numpy(), sd[f"{pre}{e}.up_proj.weight"].numpy()])
                                for e in range(E)])
            down = np.stack([sd[f"{pre}{e}.down_proj.weight"].numpy() for e in range(E)])
        tensors[f"model.language_model.layers.{i}.mlp.experts.gate_up_proj"] = np.ascontiguousarray(gate_up)
        tensors[f"model.language_model.layers.{i}.mlp.experts.down_proj"] = np.ascontiguousarray(down)
    # split into two shards with an index, as real releases are
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / fname))
        weight_map.update({k: fname for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = cfg.to_dict()
    text["model_type"] = "qwen3_5_moe_text"
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": False,
    }))
    return folder


def hf_logits(model, ids) -> np.ndarray:
    t = _torch()
    with t.no_grad():
        out = model(t.tensor([list(ids)]))
    return out.logits[0].to(t.float32).numpy()


def hf_greedy(model, prompt, n) -> list[int]:
    """Greedy continuation computed by re-running the whole sequence (no cache subtleties)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(hf_logits(model, ids)[-1])))
    return ids


RELEASE_SHARDS = 2
MTP_TENSORS = {  # the release's multi-token-prediction head: present in the files, unused by tierlab
    "mtp.fc.weight": lambda H: (H, 2 * H),
    "mtp.pre_fc_norm_embedding.weight": lambda H: (H,),
    "mtp.pre_fc_norm_hidden.weight": lambda H: (H,),
    "mtp.norm.weight": lambda H: (H,),
    "mtp.layers.0.input_layernorm.weight": lambda H: (H,),
    "mtp.layers.0.self_attn.o_proj.weight": lambda H: (H, H),
}


def build_release_model(vocab: int, seed: int = 4):
    """The Qwen3.6-35B-A3B release's class, tiny: Qwen3_5MoeForConditionalGeneration with a
    one-block vision tower, mRoPE settings in the text config, weights randomised as
    build_model does and rounded to bf16 (the release's dtype)."""
    t = _torch()
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = qwen3_5_config(vocab=vocab).to_dict()
    text["moe_intermediate_size"] = 64  # a multiple of 64, so `convert` can quantise it too
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                               "mrope_section": [1, 1, 0], "mrope_interleaved": True}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=text["hidden_size"], num_position_embeddings=16)
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)
    t.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(config).eval()
    randomise(model, 0.0, skip="visual")
    return model.to(t.bfloat16)


def write_release(model, folder: Path, tokenizer_dir: Path, chat_template: str) -> Path:
    """The release's folder: config.json as save_pretrained writes it (text_config nested),
    bf16 weights under their in-memory names (experts fused 3-D, `model.language_model.`,
    `model.visual.`, top-level lm_head) plus `mtp.*`, in shards with an index, and
    tokenizer.json + tokenizer_config.json carrying the chat template."""
    from safetensors.torch import save_file

    t = _torch()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    for stale in folder.glob("*.safetensors"):
        stale.unlink()
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {name: p.detach().contiguous() for name, p in model.state_dict().items()}
    H = model.config.text_config.hidden_size
    gen = t.Generator().manual_seed(9)
    for name, shape in MTP_TENSORS.items():
        tensors[name] = (t.randn(shape(H), generator=gen) * 0.05).to(t.bfloat16)
    names = sorted(tensors)
    per = -(-len(names) // RELEASE_SHARDS)
    weight_map = {}
    for i in range(RELEASE_SHARDS):
        fname = f"model-{i + 1:05d}-of-{RELEASE_SHARDS:05d}.safetensors"
        keys = names[i * per:(i + 1) * per]
        save_file({k: tensors[k] for k in keys}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    tok_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


def release_tokenizer(source: Path, folder: Path) -> int:
    """A tokenizer.json for the release folder: `source`'s, with Qwen3's `<think>` and
    `</think>` added; its vocabulary size."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return tok.get_vocab_size()
