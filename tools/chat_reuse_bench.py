"""Turn-N latency of a chat: the new turn prefilled on the kept state vs the whole conversation.

A conversation of about --history tokens (turns cut from the model's heldout
text, else from a fixed sentence) goes through the chat template; the state
holds it up to the last reply. The next user turn is then timed two ways, in
alternation: `Conversation.prefill` (only the new tokens) and `Engine.prefill`
of the whole rendered conversation. The time is to the next-token logits,
i.e. to the first token of the reply. Medians over --repeats.

    python tools/chat_reuse_bench.py --model assets/tiny-moe --history 1000 --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tierlab.engine.conversation import Conversation
from tierlab.engine.model import load_engine

FILLER = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. "


def conversation_of(tok, model: Path, history: int) -> list[dict]:
    heldout = model / "heldout.txt"
    text = heldout.read_text(encoding="utf-8") if heldout.exists() else FILLER * 400
    words = text.split()
    messages: list[dict] = []
    at = 0
    while len(tok.encode(tok.render_chat(messages, add_generation_prompt=False))) < history:
        for role in ("user", "assistant"):
            chunk = words[at % len(words):at % len(words) + 40] or words[:40]
            at += 40
            messages.append({"role": role, "content": " ".join(chunk)})
    return messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--history", type=int, default=1000, help="tokens of conversation before the timed turn")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    engine = load_engine(args.model)
    tok = engine.tokenizer
    messages = conversation_of(tok, args.model, args.history)
    held = tok.encode(tok.render_chat(messages, add_generation_prompt=False))
    turn = messages + [{"role": "user", "content": "And what happened after that?"}]
    ids = tok.encode(tok.render_chat(turn))
    reuse_s, full_s, reused = [], [], 0
    for _ in range(args.repeats):
        conversation = Conversation(engine)
        conversation.prefill(held)  # the conversation so far, as the last turn left it
        t0 = time.perf_counter()
        conversation.prefill(ids)
        reuse_s.append(time.perf_counter() - t0)
        reused = conversation.reused
        t0 = time.perf_counter()
        engine.prefill(ids)
        full_s.append(time.perf_counter() - t0)
    engine.close()
    full, reuse = statistics.median(full_s), statistics.median(reuse_s)
    print(f"{args.model.name}: turn of {len(ids)} tokens ({reused} kept, {len(ids) - reused} new): "
          f"full re-prefill {full:.3f} s, reusing the state {reuse:.3f} s ({full / reuse:.0f}x), "
          f"medians of {args.repeats}")


if __name__ == "__main__":
    main()
