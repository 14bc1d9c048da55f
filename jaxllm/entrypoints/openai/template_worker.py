"""The process that renders request-supplied chat templates (template_sandbox.py starts it).

Owns the bounded Jinja environment those templates run in and the loop that serves them:
one JSON line in ({"template", "variables"}), one JSON line out ({"text"} or {"error"}). The
environment is the one Hugging Face chat templates expect (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape HTML, the
`{% generation %}` tag), inside Jinja's immutable sandbox, with bounds on:

    loop iterations and macro calls   a counter ticked at the top of every loop body and
                                      macro (and `{% call %}`) body, inserted into the parsed
                                      template
    `*` and `**`                      refused before they run when the result would be too
                                      big (`'ab' * 10000000` never allocates)
    output                            counted as it is generated
    memory                            RLIMIT_AS of this process: anything else that grows
                                      too big (a doubling loop, a huge join) is a MemoryError

Wall-clock time is bounded by the parent, which kills this process. Runs by path with
`python -I`: imports nothing of jaxllm and nothing beyond the standard library and jinja2.
Never sees the engine, the tokenizer, or anything but the template and its variables.
"""

from __future__ import annotations

import json
import resource
import sys
from datetime import datetime

from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_TICK = "_jaxllm_tick"  # the step counter's name inside templates
_MAX_POWER_BITS = 4096  # `a ** b` may build an integer of at most this many bits


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it):
    renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _Steps:
    """Loop iterations and macro calls of one render."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def __call__(self) -> str:
        self.count += 1
        if self.count > self.limit:
            raise SecurityError(f"the template ran more than {self.limit} loop iterations "
                                "and macro calls")
        return ""


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_chars: int, max_steps: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[loopcontrols, _GenerationTag])
        self.max_chars, self.max_steps = max_chars, max_steps
        self.filters["tojson"] = _tojson
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)

    def _parse(self, source, name, filename):
        if _TICK in source:  # a template that rebinds the counter would escape it
            raise SecurityError(f"a template may not use the name {_TICK!r}")
        tree = super()._parse(source, name, filename)
        for node in list(tree.find_all((nodes.For, nodes.Macro, nodes.CallBlock))):
            tick = nodes.ExprStmt(nodes.Call(nodes.Name(_TICK, "load"), [], [], None, None))
            node.body.insert(0, tick.set_lineno(node.lineno))
        return tree

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(n, int) and hasattr(seq, "__len__") and \
                        len(seq) * n > self.max_chars:
                    raise SecurityError(f"'*' would build {len(seq) * n} items; the limit is "
                                        f"{self.max_chars}")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and \
                max(left.bit_length(), 1) * abs(right) > _MAX_POWER_BITS:
            raise SecurityError(f"'**' would build an integer of more than {_MAX_POWER_BITS} "
                                "bits")
        return super().call_binop(context, operator, left, right)

    def render(self, template: str, variables: dict) -> str:
        compiled = self.from_string(template)
        parts, size = [], 0
        for part in compiled.generate(**variables, **{_TICK: _Steps(self.max_steps)}):
            size += len(part)
            if size > self.max_chars:
                raise SecurityError(f"the template's output passed {self.max_chars} "
                                    "characters")
            parts.append(part)
        return "".join(parts)


def _raise_exception(message):
    raise TemplateError(message)


def _strftime_now(format):
    return datetime.now().strftime(format)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers' chat templates expect: no HTML escaping, and json.dumps' options.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def serve(limits: dict, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Answer render requests until stdin closes (the parent went away)."""
    env = BoundedEnvironment(limits["max_chars"], limits["max_steps"])
    for line in stdin:
        try:
            request = json.loads(line)
            reply = {"text": env.render(request["template"], request["variables"])}
        except Exception as e:  # MemoryError and RecursionError too: the answer is an error
            reply = {"error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


if __name__ == "__main__":
    _limits = json.loads(sys.argv[1])
    _memory = _limits["max_memory_bytes"]
    resource.setrlimit(resource.RLIMIT_AS, (_memory, _memory))
    serve(_limits)
