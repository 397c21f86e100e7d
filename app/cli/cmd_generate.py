"""`tierlab generate`: stream a completion (or a chat reply) to stdout."""

from __future__ import annotations

import json
import sys
from typing import Callable

from tierlab.app.cli.log_args import add_log_args, check_log_target
from tierlab.app.cli.signals import sigterm_exits
from tierlab.app.cli.thinking_arg import add_thinking_arg, thinking_from_args, thinking_notice
from tierlab.app.cli.engine_options import (add_knobs_at_arg, add_model_args, knob_steps_from_args, open_engine,
                                            print_notices)
from tierlab.app.lab.knob_script import ScriptedRun
from tierlab.engine.errors import ModelError
from tierlab.engine.meters import METER_BY_KEY, meters_json
from tierlab.engine.routing import format_footer
from tierlab.engine.sampling import check_settings
from tierlab.engine.session import EngineLog


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate text from a prompt, streaming to stdout")
    add_model_args(p)
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("-n", "--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_thinking_arg(p)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and meters")
    add_log_args(p)
    add_knobs_at_arg(p)
    p.set_defaults(run=run)


def run(args) -> int:
    check_settings(args.temperature, args.top_p, args.seed, names=("--temperature", "--top-p", "--seed"))
    thinking_from_args(args, chat=args.chat)
    steps = knob_steps_from_args(args)
    check_log_target(args)
    with sigterm_exits():
        engine = open_engine(args)
        try:
            report = _generate(args, engine, steps)
        finally:
            engine.close()  # writes HEAT_FILE on every way out: done, an error, ctrl+c, SIGTERM
    print_notices(engine)
    report()
    return 0


def _generate(args, engine, steps) -> Callable[[], None]:
    """Stream the completion; returns what prints the result once the engine is closed."""
    tok = engine.tokenizer
    if tok is None:
        raise ModelError("no tokenizer.json: generate needs a tokenizer (use `tierlab ref --prompt-ids`)", args.model)
    thinking = thinking_from_args(args, chat=args.chat)
    notice = thinking_notice(tok, thinking)
    if notice:
        engine.notice(notice)
    text = (tok.render_chat([{"role": "user", "content": args.prompt}], enable_thinking=thinking) if args.chat
            else args.prompt)
    prompt_ids = tok.encode(text)
    if not prompt_ids:
        raise ModelError("the prompt encodes to no tokens")
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": 0, "seed": args.seed}
    log = EngineLog(engine, args.log, append=args.append, sampling=sampling) if args.log else None
    out_ids: list[int] = []
    printed = ""
    eos = set(engine.eos_ids())
    script = ScriptedRun(engine, steps)
    try:
        for token in engine.generate(prompt_ids, args.max_tokens, args.temperature, args.top_p, args.seed):
            if token in eos:
                break
            out_ids.append(token)
            text_so_far = tok.decode(out_ids)
            if not args.json and not text_so_far.endswith("\ufffd"):
                sys.stdout.write(text_so_far[len(printed):])
                sys.stdout.flush()
                printed = text_so_far
            script.before(len(out_ids))  # the pass that predicts the next token runs with these knobs
    except BaseException:
        if log is not None:
            log.close({"generated": len(out_ids), "aborted": True}, stream=(prompt_ids, out_ids))
        raise
    meters = engine.meters()
    segments = script.finish(len(out_ids))
    if log is not None:
        log.close({"generated": len(out_ids)}, stream=(prompt_ids, out_ids))

    def report() -> None:
        if args.json:
            print(json.dumps({"prompt_ids": prompt_ids, "ids": out_ids, "text": tok.decode(out_ids),
                              **meters_json(meters), "segments": segments}))
        else:
            sys.stdout.write(tok.decode(out_ids)[len(printed):] + "\n")
            footer = [f"Expert cache hit rate: {METER_BY_KEY['ram_hit'].show(meters['ram_hit'])} "
                      f"(hit={meters['ram_hits']} miss={meters['ram_misses']})",
                      *format_footer(engine.knobs.snapshot(), meters),
                      f"{METER_BY_KEY['tok_s'].show(meters['tok_s'], 'panel').strip()} tok/s"]
            print("\n".join(footer), file=sys.stderr)

    return report
