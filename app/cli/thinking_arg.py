"""`--thinking on|off`: Qwen3.x's `enable_thinking` for the chat template."""

from __future__ import annotations

from tierlab.engine.errors import TierlabError

CHOICES = {"on": True, "off": False}


def add_thinking_arg(parser) -> None:
    parser.add_argument("--thinking", choices=tuple(CHOICES), default=None,
                        help="the chat template's enable_thinking (Qwen3.x); default: as the template has it")


def thinking_from_args(args, chat: bool = True) -> bool | None:
    """The setting the flag asks for (None: the template's default); refuses it outside a chat."""
    if args.thinking is None:
        return None
    if not chat:
        raise TierlabError("--thinking needs --chat (it is a setting of the chat template)")
    return CHOICES[args.thinking]


def thinking_notice(tokenizer, enable_thinking: bool | None) -> str | None:
    """A line for the user when the flag has nothing to switch."""
    if enable_thinking is not None and tokenizer.thinking_default() is None:
        return "--thinking: this model's chat template has no thinking switch (the flag changes nothing)"
    return None
