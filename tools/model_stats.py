"""Evidence that a shipped tiny MoE is trained and that its routing is worth caching.

Dev-only (torch + transformers). For a model folder exported by
tools/train_tiny.py this script, all in float32 from the bf16 weights:

* writes `heldout.txt` (a few KB of a held-out file) and `ref.json` (a
  held-out prompt and its 64-token greedy continuation);
* measures held-out NLL per token against a unigram baseline (training-split
  unigram frequencies, add-one smoothed; the counts are shipped as
  `unigram_counts.json` so tests can recompute the baseline);
* measures routing: per-token router entropy vs log(E), expert usage entropy,
  reuse of the top-k between consecutive tokens vs k/E, and the hit rate of a
  per-layer LRU cache holding half the experts vs the uniform expectation 0.5;
* writes `stats.json` and `MODEL_CARD.md`.

    python tools/model_stats.py assets/tiny-moe --data scratch/tiny-data
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_corpus  # noqa: E402

HELDOUT_FILE = "json/encoder.py"  # held out by the hash split (checked below)
HELDOUT_CHARS = 8000
PROMPT_FILES = ["gzip.py", "ftplib.py", "ipaddress.py", "contextvars.py", "importlib/util.py", "asyncio/runners.py"]
PROMPT_TOKENS = 32
GEN_TOKENS = 64
STAT_WINDOW = 512


def load_fp32(path: Path):
    """The shipped bf16 weights upcast to float32 (the numerical oracle setting)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    m.eval()
    return m


def cut_lines(text: str, n: int) -> str:
    """The first ~n characters of text, ending at a line break."""
    if len(text) <= n:
        return text
    return text[: text.rfind("\n", 0, n) + 1]


@torch.no_grad()
def nll_and_routing(model, ids: list[int], window: int = STAT_WINDOW, starts=None):
    """Teacher-forced NLL per token and per-layer router logits over windows of ids.

    Windows are consecutive unless `starts` is given; the router rows of all
    windows are concatenated in order (one stream for the cache replay).
    """
    nll_sum, n, logits_by_layer = 0.0, 0, None
    for s in (range(0, len(ids) - 1, window) if starts is None else starts):
        chunk = ids[s : s + window + 1]
        if len(chunk) < 2:
            break
        x = torch.tensor([chunk])
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        lp = torch.log_softmax(out.logits[0, :-1].double(), -1)
        nll_sum += float(-lp.gather(1, x[0, 1:, None]).sum())
        n += len(chunk) - 1
        rl = [r[: len(chunk) - 1].float().numpy() for r in out.router_logits]  # drop the last row: not scored
        logits_by_layer = rl if logits_by_layer is None else [np.concatenate([a, b]) for a, b in zip(logits_by_layer, rl)]
    return nll_sum / n, n, logits_by_layer


def unigram_ce(counts: np.ndarray, ids: list[int]) -> float:
    """Cross-entropy (nats/token) of ids under add-one smoothed unigram counts."""
    p = (counts + 1.0) / (counts.sum() + len(counts))
    return float(-np.log(p[np.asarray(ids)]).mean())


def routing_stats(router_logits: list[np.ndarray], k: int) -> dict:
    """Routing structure per layer from [T, E] router logits (softmax, then top-k)."""
    per = []
    for z in router_logits:
        T, E = z.shape
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        ent = float((-(p * np.log(np.clip(p, 1e-30, None))).sum(1)).mean())
        top = np.argsort(-z, axis=1, kind="stable")[:, :k]
        usage = np.bincount(top.ravel(), minlength=E) / top.size
        use_ent = float(-(usage[usage > 0] * np.log(usage[usage > 0])).sum())
        reuse = float(np.mean([len(set(top[t]) & set(top[t - 1])) / k for t in range(1, T)]))
        per.append({"router_entropy": ent, "usage_entropy": use_ent, "reuse": reuse,
                    "lru_half_hit": lru_hit_rate(top, E // 2), "experts_used": int((usage > 0).sum()),
                    "max_usage_share": float(usage.max())})
    E = router_logits[0].shape[1]
    mean = {key: float(np.mean([d[key] for d in per])) for key in ("router_entropy", "usage_entropy", "reuse", "lru_half_hit")}
    return {"num_experts": E, "top_k": k, "log_E": math.log(E), "uniform_reuse": k / E, "uniform_lru_half_hit": 0.5,
            "mean": mean, "per_layer": per}


def lru_hit_rate(top: np.ndarray, capacity: int) -> float:
    """Hit rate of an LRU cache of `capacity` experts replaying one layer's top-k requests."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = total = 0
    for row in top:
        for e in row.tolist():
            total += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total


@torch.no_grad()
def greedy_ref(model, tok, eos_ids: set[int]):
    """A held-out prompt and its greedy continuation, with a margin check.

    Prompts are tried in a fixed order; the first whose 64 greedy steps never
    emit an end token and never have a top-2 logit gap under 1e-2 is kept, so
    an engine that is right to float32 rounding reproduces every token.
    """
    root = tiny_corpus.stdlib_dir()
    for name in PROMPT_FILES:
        assert tiny_corpus.is_heldout(name), name
        text = tiny_corpus.read_text(root / name)
        ids = tok.encode(text).ids
        for start in (0, 200, 400):
            prompt = ids[start : start + PROMPT_TOKENS]
            x = torch.tensor([prompt])
            out = model.generate(x, do_sample=False, max_new_tokens=GEN_TOKENS, min_new_tokens=GEN_TOKENS,
                                 output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=None)
            full = out.sequences[0].tolist()
            gen = full[len(prompt):]
            lg = torch.stack(out.logits)[:, 0]  # raw logits per step
            top2 = lg.topk(2, -1).values
            margin = float((top2[:, 0] - top2[:, 1]).min())
            if eos_ids.intersection(gen) or margin < 1e-2 or lg.argmax(-1).tolist() != gen:
                continue
            return {"prompt_ids": prompt, "full_ids": full}, {"file": name, "token_offset": start,
                                                              "min_top2_margin": margin}
    raise RuntimeError("no held-out prompt with a clear greedy continuation")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="exported model folder (assets/tiny-moe)")
    ap.add_argument("--data", default="scratch/tiny-data", help="tokenizer and token streams of train_tiny.py")
    ap.add_argument("--heldout-tokens", type=int, default=16384, help="held-out tokens for the card's stats")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    from tokenizers import Tokenizer

    dst, data = Path(args.model), Path(args.data)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    model = load_fp32(dst)
    cfg = model.config
    k, E = cfg.num_experts_per_tok, cfg.num_experts

    # Unigram counts of the training split (shipped for the tests).
    train_ids = np.load(data / "train_ids.npy").astype(np.int64)
    counts = np.bincount(train_ids, minlength=cfg.vocab_size)
    (dst / "unigram_counts.json").write_text(json.dumps({"source": "training split token counts",
                                                         "counts": counts.tolist()}) + "\n")

    # heldout.txt: a sample of one held-out file.
    assert tiny_corpus.is_heldout(HELDOUT_FILE)
    sample = cut_lines(tiny_corpus.read_text(tiny_corpus.stdlib_dir() / HELDOUT_FILE), HELDOUT_CHARS)
    (dst / "heldout.txt").write_text(sample)

    ref, ref_info = greedy_ref(model, tok, {tok.token_to_id("<|im_end|>"), tok.token_to_id(tiny_corpus.EOS)})
    (dst / "ref.json").write_text(json.dumps(ref) + "\n")

    # Stats over evenly spaced windows of the whole held-out stream (all held-out files).
    held = np.load(data / "heldout_ids.npy").astype(np.int64).tolist()
    n_win = max(1, args.heldout_tokens // STAT_WINDOW)
    starts = np.linspace(0, len(held) - STAT_WINDOW - 1, n_win).astype(int).tolist()
    nll, n, rl = nll_and_routing(model, held, starts=starts)
    # Both figures are over the scored tokens (each window but its first token).
    uni = unigram_ce(counts, [t for s in starts for t in held[s + 1 : s + STAT_WINDOW + 1]])
    route = routing_stats(rl, k)
    s_ids = tok.encode(sample).ids
    s_nll, s_n, _ = nll_and_routing(model, s_ids)
    stats = {"heldout_nll": nll, "heldout_ppl": math.exp(nll), "heldout_tokens": n, "unigram_ce": uni,
             "heldout_txt_nll": s_nll, "heldout_txt_tokens": s_n, "heldout_txt_unigram_ce": unigram_ce(counts, s_ids[1:]),
             "routing": route, "ref": ref_info}
    (dst / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
    write_card(dst, cfg, stats)
    print(json.dumps({key: v for key, v in stats.items() if key != "routing"} | {"routing_mean": route["mean"]}, indent=1))


def write_card(dst: Path, cfg, st: dict):
    tr = json.loads((dst / "training.json").read_text())
    r = st["routing"]
    size = sum(f.stat().st_size for f in dst.iterdir() if f.is_file())
    wall, prev = 0.0, 0.0  # a log's clock may restart at a resume (sec drops): sum the segments
    for rec in tr["log"]:
        wall += rec["sec"] - prev if rec["sec"] >= prev else rec["sec"]
        prev = rec["sec"]
    rows = "\n".join(
        f"| {i} | {cfg.layer_types[i]} | {d['router_entropy']:.3f} | {d['usage_entropy']:.3f} | {d['reuse']:.3f} "
        f"| {d['lru_half_hit']:.3f} | {d['experts_used']}/{r['num_experts']} |"
        for i, d in enumerate(r["per_layer"]))
    curve = "\n".join(f"| {x['step']} | {x['loss_ema']:.3f} | {x['heldout']:.3f} |" for x in tr["log"] if "heldout" in x)
    c = tr["config"]
    per_layer = tr.get("per_layer_aux_loss") or 0.0
    balance = (f", plus a load-balancing loss taken in each layer on its own (`--aux-loss {per_layer:g}`, "
               "`per_layer_balance_loss`)") if per_layer else ""
    decorrelate = tr.get("decorrelate") or 0.0
    if decorrelate:
        balance += (f", and a penalty on the router probability consecutive positions share above 1/E, in each "
                    f"layer (`--decorrelate {decorrelate:g}`, `consecutive_overlap_loss`)")
    usage_note = ("uniform: log E; the per-layer loss balances every layer" if per_layer else
                  "transformers' aux loss balances the usage summed over all layers, not each layer, "
                  "so single layers can be skewed")
    resumed = ("" if not tr.get("resumed", True) else
               " The run was stopped and resumed with\n  `--resume`, with `--steps` changed only while the learning "
               "rate was still constant, which by construction\n  (fixed batches per step, schedule independent of "
               "`--steps` before the decay) is the run of the command above.")
    text = f"""# {dst.name}: a tiny trained Qwen3.6-architecture MoE

A genuine Hugging Face checkpoint of `Qwen3_5MoeForCausalLM` (`model_type: {cfg.model_type}`, the
Qwen3.5/Qwen3.6 MoE architecture), trained from scratch on the CPU by `tools/train_tiny.py` so that
tierlab has a real MoE with trained routing to run without downloading anything. It writes Python-ish
text and docstrings; it is a test subject for caches and routing, not a useful assistant.

## Corpus and license
- Text: the Python {tr['python']} standard library source (`Lib/*.py` of the interpreter, tests,
  `site-packages`, `encodings/` and `ensurepip/` excluded), plus chat exchanges built from the training
  files' docstrings ("What does the function X do?" -> its docstring) to teach the ChatML format.
  The Python standard library is distributed under the PSF License Agreement, which permits
  derivative works; this model is such a derivative. Copyright (c) 2001-2023 Python Software Foundation.
- Split by file (sha1 of the relative path, 1 bucket in {tiny_corpus.HELDOUT_BUCKETS}): {tr['train_stream_tokens']:,} training
  tokens, {tr['heldout_stream_tokens']:,} held-out tokens; the tokenizer and the model never saw the held-out files.
- Tokenizer: byte-level BPE (`tokenizers`), vocabulary {tr['vocab_size']}, special tokens `<|endoftext|>`,
  `<|im_start|>`, `<|im_end|>`; Qwen-style chat template in `tokenizer_config.json`.

## Architecture
| | |
|---|---|
| layers | {cfg.num_hidden_layers}: {', '.join(cfg.layer_types)} |
| hidden | {cfg.hidden_size}, vocab {cfg.vocab_size}, untied embeddings |
| experts | {cfg.num_experts} per layer, top-{cfg.num_experts_per_tok} (softmax, renormalised), moe_intermediate {cfg.moe_intermediate_size} |
| shared expert | intermediate {cfg.shared_expert_intermediate_size}, sigmoid gate |
| attention | {cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv heads, head_dim {cfg.head_dim}, output gate, rope theta {cfg.rope_parameters['rope_theta']:g}, partial rotary {cfg.rope_parameters.get('partial_rotary_factor')} |
| Gated DeltaNet | {cfg.linear_num_key_heads} key / {cfg.linear_num_value_heads} value heads of dim {cfg.linear_key_head_dim}/{cfg.linear_value_head_dim}, conv kernel {cfg.linear_conv_kernel_dim} |
| parameters | {tr['params']:,} (bf16 on disk; folder {size / 1e6:.1f} MB) |

## Training
- Command: `{tr['command']}` then `python tools/train_tiny.py --out <run> --export {dst.as_posix()}` and
  `python tools/model_stats.py {dst.as_posix()}` (torch {tr['torch']}, transformers {tr['transformers']}, seed {tr['seed']}, CPU).
- {tr['steps']} steps of {tr['batch']} x {tr['seq']} tokens = {tr['tokens_seen']:,} tokens seen
  (~{tr['tokens_seen'] / tr['train_stream_tokens']:.1f} passes over the training split); AdamW (0.9, 0.95), peak lr {tr['lr']},
  warm-up {tr['warmup']}, constant, linear decay to 10% over the last {tr['decay_steps']} steps; weight decay {tr['weight_decay']};
  grad clip 1.0; router load-balancing loss on (`output_router_logits=True`, `router_aux_loss_coef={tr['router_aux_loss_coef']}`){balance}.
- Wall time {wall / 60:.0f} min on a shared 2-vCPU machine (under `nice`).{resumed}
- Final training loss (EMA) {tr['final_train_loss_ema']:.3f} nats/token; held-out loss at the end of training
  {tr['final_heldout_loss']:.3f} (16 fixed windows).

| step | train loss (EMA) | held-out loss |
|---|---|---|
{curve}

## Evidence (float32 from the bf16 weights, `tools/model_stats.py`)
- Held-out NLL: **{st['heldout_nll']:.3f} nats/token** (ppl {st['heldout_ppl']:.1f}) over {st['heldout_tokens']:,} held-out tokens ({STAT_WINDOW}-token windows spread over all held-out files),
  vs **{st['unigram_ce']:.3f}** for the unigram baseline (held-out tokens under training-split unigram frequencies, add-one smoothed).
  On `heldout.txt` ({st['heldout_txt_tokens']} tokens): {st['heldout_txt_nll']:.3f} vs unigram {st['heldout_txt_unigram_ce']:.3f}.
- Routing over the same held-out tokens (means over layers; uniform routing in brackets):
  per-token router entropy {r['mean']['router_entropy']:.3f} (log E = {r['log_E']:.3f});
  entropy of the expert usage (top-k counts) {r['mean']['usage_entropy']:.3f} ({usage_note});
  top-k reuse between consecutive tokens {r['mean']['reuse']:.3f} ({r['uniform_reuse']:.3f});
  hit rate of a per-layer LRU cache of {r['num_experts'] // 2} experts {r['mean']['lru_half_hit']:.3f} ({r['uniform_lru_half_hit']:.3f}).

| layer | type | router entropy | usage entropy | reuse | LRU half hit | experts used |
|---|---|---|---|---|---|---|
{rows}

## Files
`config.json`, `model.safetensors` (bf16), `generation_config.json`, `tokenizer.json`, `tokenizer_config.json`;
`ref.json` (prompt from the held-out file `{st['ref']['file']}` and its {GEN_TOKENS}-token greedy continuation from transformers
in float32; smallest top-2 logit gap {st['ref']['min_top2_margin']:.3f}); `heldout.txt` (first {len((dst / 'heldout.txt').read_text())} characters
of the held-out `{HELDOUT_FILE}`); `unigram_counts.json` (training-split token counts, for the baseline);
`training.json` (settings and loss curve); `stats.json` (the figures above).
"""
    (dst / "MODEL_CARD.md").write_text(text)


if __name__ == "__main__":
    main()
