"""`tierlab chat`: a conversation on the command line, one user turn per input line.

Each turn renders the whole conversation through the chat template and
prefills only what the engine does not already hold (engine/conversation.py);
`--reprefill` prefills the whole conversation every turn instead, to compare.
"""

from __future__ import annotations

import sys
import time

from tierlab.app.cli.engine_options import add_model_args, open_engine, print_notices
from tierlab.app.cli.signals import sigterm_exits
from tierlab.app.cli.thinking_arg import add_thinking_arg, thinking_from_args, thinking_notice
from tierlab.engine.conversation import Conversation
from tierlab.engine.errors import ModelError
from tierlab.engine.sampling import check_settings


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("chat", help="chat on the command line: each input line is a user turn")
    add_model_args(p)
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens per reply at most (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_thinking_arg(p)
    p.add_argument("--reprefill", action="store_true",
                   help="prefill the whole conversation every turn (no reuse of the sequence state)")
    p.add_argument("--stats", action="store_true",
                   help="after each reply, print to stderr the tokens reused and prefilled and the seconds to the first token")
    p.set_defaults(run=run)


def run(args) -> int:
    check_settings(args.temperature, args.top_p, args.seed, names=("--temperature", "--top-p", "--seed"))
    thinking = thinking_from_args(args)
    with sigterm_exits():
        engine = open_engine(args)
        try:
            _chat(args, engine, thinking)
        finally:
            engine.close()
    print_notices(engine)
    return 0


def _chat(args, engine, thinking) -> None:
    tok = engine.tokenizer
    if tok is None or tok.chat_template is None:
        raise ModelError("chat needs tokenizer.json and a chat template (use `tierlab generate` for raw text)",
                         args.model)
    notice = thinking_notice(tok, thinking)
    if notice:
        engine.notice(notice)
    print_notices(engine)
    conversation = Conversation(engine)
    eos = set(engine.eos_ids())
    messages: list[dict] = []
    for turn, line in enumerate(sys.stdin):
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        prompt_ids = tok.encode(tok.render_chat(messages, enable_thinking=thinking))
        if args.reprefill:
            conversation.forget()
        started = time.perf_counter()
        first_token_s = None
        reply: list[int] = []
        for token in conversation.generate(prompt_ids, args.max_tokens, args.temperature, args.top_p,
                                           args.seed + turn):
            if first_token_s is None:
                first_token_s = time.perf_counter() - started
            if token in eos:
                break
            reply.append(token)
        answer = tok.decode(reply, skip_special=True)
        print(answer, flush=True)
        messages.append({"role": "assistant", "content": answer})
        if args.stats:
            print(f"turn {len(messages) // 2}: prompt {len(prompt_ids)} tokens, reused {conversation.reused}, "
                  f"prefilled {conversation.prefilled}, first token {first_token_s or 0.0:.3f} s",
                  file=sys.stderr, flush=True)
