"""A jinja2 sandbox whose renders have a budget: loop steps, operations and characters.

A chat template ships with an untrusted checkpoint and is code: beyond the
sandbox's walls (no Python internals), it can loop 10**30 times, multiply a
string to a terabyte or recurse without end. Every render here counts what
it does, deterministically, and stops with TemplateBudgetError the moment a
count passes its cap, so a bad template is refused quickly on any machine:

- loop steps: every item any `{% for %}` takes (all loops of the render together);
- operations: every call, attribute and item lookup;
- characters: every piece of output (also inside macros and `{% set %}` blocks), and the size
  of each string or list that `*`, `+`, `~`, `**` and the width-taking filters build, which
  is checked before it is built where its size can be known.

The counts are kept per thread, so two renders never share one.
"""

from __future__ import annotations

import re
import threading

from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_LOOP_STEPS = 200_000
"""Items all loops of one render may take together: a long chat takes a few per message."""
MAX_OPERATIONS = 2_000_000
"""Calls, attribute and item lookups per render."""
MAX_CHARS = 4_000_000
"""Characters of output per render, and the largest string or list one expression may build."""
MAX_POWER_BITS = 4096
"""The largest integer `**` may build, in bits."""

MAX_LIPSUM = 1000
"""The most paragraphs, and words a paragraph, `lipsum` may make."""

WIDTH_FILTERS = ("center", "indent", "wordwrap", "truncate", "batch", "slice", "filesizeformat", "round", "tojson")
"""Filters whose numeric arguments set a size: none above MAX_CHARS."""


#: A width or precision in a %-format or str.format spec (`%1000000d`, `{:>1000000}`, `%*d`).
_FORMAT_SIZE = re.compile(r"[%:][^\d{}*]{0,3}(\d{8,}|\*|\{)|\.(\d{8,})")


class TemplateBudgetError(Exception):
    """A render went past one of its caps."""


class _Counts(threading.local):
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loop_steps = 0
        self.operations = 0
        self.chars = 0


def _sized(value):
    return len(value) if isinstance(value, (str, list, tuple)) else 0


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, counting each render against the caps above."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self.counts = _Counts()
        self.filters = {name: self._width_checked(name, f) if name in WIDTH_FILTERS else f
                        for name, f in self.filters.items()}
        self.filters["replace"] = self._checked_replace(self.filters["replace"])
        self.filters["join"] = self._checked_join(self.filters["join"])
        self.filters["format"] = self._checked_format(self.filters["format"])
        self.globals["range"] = self.budget_range
        self.globals["lipsum"] = self._checked_lipsum(self.globals["lipsum"])

    # -- the render -----------------------------------------------------------

    def render_budgeted(self, template, **variables) -> str:
        """Render with fresh counts; output is counted as it is produced."""
        self.counts.reset()
        parts = []
        for piece in template.generate(**variables):
            parts.append(piece)
        return "".join(parts)

    def budget_source(self, source: str) -> nodes.Template:
        """Parse `source` and route its loops, output and concatenations through the counters."""
        tree = self.parse(source)
        for loop in tree.find_all(nodes.For):
            loop.iter = self._counted("budget_loop", loop.iter)
        for output in tree.find_all(nodes.Output):
            output.nodes = [self._counted("budget_output", nodes.Const(n.data) if isinstance(n, nodes.TemplateData) else n)
                            for n in output.nodes]
        for parent in list(tree.find_all(nodes.Node)):
            for field in parent.fields:
                if field == "filter" and isinstance(parent, (nodes.FilterBlock, nodes.AssignBlock)):
                    continue  # a block's filter is applied by the block, not an expression
                child = getattr(parent, field, None)
                if isinstance(child, (nodes.Concat, nodes.Filter)):
                    setattr(parent, field, self._counted("budget_size", child))
                elif isinstance(child, list):
                    setattr(parent, field, [self._counted("budget_size", c) if isinstance(c, (nodes.Concat, nodes.Filter))
                                            else c for c in child])
        return tree

    @staticmethod
    def _counted(hook: str, node: nodes.Expr) -> nodes.Expr:
        call = nodes.Call(nodes.EnvironmentAttribute(hook), [node], [], None, None)
        call.set_lineno(node.lineno or 1)
        return call

    # -- the counters -----------------------------------------------------------

    def _step(self) -> None:
        self.counts.operations += 1
        if self.counts.operations > MAX_OPERATIONS:
            raise TemplateBudgetError(f"more than {MAX_OPERATIONS:,} operations")

    def _check_size(self, size: int) -> None:
        if size > MAX_CHARS:
            raise TemplateBudgetError(f"a string or list of {size:,} items (the cap is {MAX_CHARS:,})")

    def budget_loop(self, iterable):
        counts = self.counts
        for item in iterable:
            counts.loop_steps += 1
            if counts.loop_steps > MAX_LOOP_STEPS:
                raise TemplateBudgetError(f"more than {MAX_LOOP_STEPS:,} loop steps")
            yield item

    def budget_range(self, *args):
        """`range`, refused before it starts when it is longer than the loop budget."""
        try:
            rng = range(*args)
            size = len(rng)
        except OverflowError:
            size = MAX_LOOP_STEPS + 1
        if size > MAX_LOOP_STEPS:
            raise TemplateBudgetError(f"a range longer than {MAX_LOOP_STEPS:,} loop steps")
        return rng

    def _check_format(self, fmt, args) -> None:
        """A format string may not pad to more than the cap, nor take its width from an argument
        (`%*d`) that is larger."""
        if not isinstance(fmt, str):
            return
        for match in _FORMAT_SIZE.finditer(fmt):
            digits = match.group(1) or match.group(2)
            if digits in ("*", "{"):
                if any(isinstance(a, int) and abs(a) > MAX_CHARS for a in args):
                    raise TemplateBudgetError(f"a format whose width is over {MAX_CHARS:,}")
            elif digits is not None and int(digits) > MAX_CHARS:
                raise TemplateBudgetError(f"a format width of {int(digits):,}")

    def _join_size(self, items, sep) -> int:
        if not isinstance(items, (list, tuple, str)):
            return 0  # a generator: counted as it is consumed, by the size check of the result
        self._check_size(len(items))
        sep_len = len(sep) if isinstance(sep, str) else 0
        return sum(len(x) if isinstance(x, str) else 0 for x in items) + max(len(items) - 1, 0) * sep_len

    def budget_output(self, value):
        text = value if isinstance(value, str) else str(value)
        self.counts.chars += len(text)
        if self.counts.chars > MAX_CHARS:
            raise TemplateBudgetError(f"more than {MAX_CHARS:,} characters of output")
        return value

    def budget_size(self, value):
        self._check_size(_sized(value))
        return value

    # -- the sandbox's hooks ----------------------------------------------------

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self._step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple)):
            __self._check_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        self._step()
        value = super().getattr(obj, attribute)
        if isinstance(obj, str) and attribute in ("format", "format_map") and callable(value):
            return self._format_checked(obj, value)
        return value

    def _format_checked(self, fmt: str, method):
        """`str.format` as the sandbox wraps it, checked for widths over the cap first."""
        def checked(*args, **kwargs):
            self._check_format(fmt, (*args, *kwargs.values(), *_mapping_values(args)))
            return method(*args, **kwargs)

        return checked

    def getitem(self, obj, argument):
        self._step()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator_name: str, left, right):
        self._step()
        if operator_name == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(times, int) and isinstance(seq, (str, list, tuple)):
                    self._check_size(len(seq) * max(times, 0))
        elif operator_name == "+":
            self._check_size(_sized(left) + _sized(right))
        elif operator_name == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise TemplateBudgetError(f"an integer power of more than {MAX_POWER_BITS} bits")
        elif operator_name == "%" and isinstance(left, str):
            self._check_format(left, right if isinstance(right, tuple) else (right,))
        result = super().call_binop(context, operator_name, left, right)
        if operator_name == "%":
            self._check_size(_sized(result))
        return result

    def _check_method(self, owner, name: str, args, kwargs) -> None:
        """Methods of strings and lists that build by size (`center`, `zfill`, `format`, `join`)."""
        values = (*args, *kwargs.values())
        if name in ("format", "format_map"):
            self._check_format(owner, values)
        elif name == "join" and args:
            self._check_size(self._join_size(args[0], owner))
        elif name == "replace" and len(args) >= 2 and isinstance(owner, str):
            old, new = args[0], args[1]
            if isinstance(old, str) and isinstance(new, str):
                count = owner.count(old) if old else len(owner) + 1
                self._check_size(len(owner) + count * max(len(new) - len(old), 0))
        elif any(isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS for v in values):
            raise TemplateBudgetError(f"{name} with a size over {MAX_CHARS:,}")

    # -- filters that build by size ---------------------------------------------

    def _width_checked(self, name: str, func):
        def checked(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
                    raise TemplateBudgetError(f"filter {name} with a size of {value:,}")
            return func(*args, **kwargs)

        return _same_pass_arg(checked, func)

    def _checked_replace(self, func):
        def checked(*args, **kwargs):
            strings = [a for a in args if isinstance(a, str)]
            if len(strings) >= 3:
                s, old, new = strings[-3:]
                count = s.count(old) if old else len(s) + 1
                self._check_size(len(s) + count * max(len(new) - len(old), 0))
            return func(*args, **kwargs)

        return _same_pass_arg(checked, func)


    @staticmethod
    def _checked_lipsum(func):
        """`lipsum(n, html, min, max)`: at most MAX_LIPSUM paragraphs of at most MAX_LIPSUM words."""
        def checked(n=5, html=True, min=20, max=100):  # noqa: A002 (jinja's names)
            if any(isinstance(v, int) and v > MAX_LIPSUM for v in (n, min, max)):
                raise TemplateBudgetError(f"lipsum over {MAX_LIPSUM:,} paragraphs or words")
            return func(n, html, min, max)

        return checked

    def _checked_join(self, func):
        def checked(*args, **kwargs):
            values = [a for a in args if not hasattr(a, "environment")]  # past the eval context
            if values:
                sep = values[1] if len(values) > 1 else kwargs.get("d", "")
                if isinstance(values[0], (list, tuple, str)):
                    self._check_size(self._join_size(values[0], sep))
            return func(*args, **kwargs)

        return _same_pass_arg(checked, func)

    def _checked_format(self, func):
        def checked(value, *args, **kwargs):
            self._check_format(value, (*args, *kwargs.values()))
            return func(value, *args, **kwargs)

        return _same_pass_arg(checked, func)


def _mapping_values(args) -> tuple:
    return tuple(v for a in args if isinstance(a, dict) for v in a.values())


def _same_pass_arg(wrapper, func):
    """Keep jinja's pass_eval_context/pass_environment mark, so the filter gets the same arguments."""
    for attr in ("jinja_pass_arg",):
        if hasattr(func, attr):
            setattr(wrapper, attr, getattr(func, attr))
    return wrapper


