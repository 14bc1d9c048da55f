"""Request-supplied chat templates: rendered in a separate, bounded process.

A chat template a request brings (`chat_template`, allowed only with the server's
`--trust-request-chat-template`) is code from a client. It renders in a worker process
(template_worker.py: Jinja's sandbox with bounded loop iterations, `*` and `**`, output size,
and an address-space limit), which this module starts, talks to over a pipe (one JSON line
each way) and kills when a render outlives its time limit, so that no template can block
the server's event loop, hold its GIL, or take its memory. The worker is started on first
use and again after it is killed or dies.

Owns the variables a template sees (as transformers' `apply_chat_template` gives them: the
messages without None values, the tokenizer's special tokens, add_generation_prompt,
the request's tools, its documents (None unless its chat_template_kwargs hold them), the
request's chat_template_kwargs) and
`continue_final_message`.
Never tokenizes (the processor does) and never renders the server's own template.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
import threading
from typing import Any

_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "template_worker.py")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # marks where a continued message ends


class TemplateSandbox:
    def __init__(self, max_chars: int, *, max_steps: int = 100_000, timeout_s: float = 10.0,
                 max_memory_bytes: int = 1 << 30):
        """max_chars: the longest output (and the largest `*` result) a template may build;
        max_steps: loop iterations plus macro calls (Jinja's sandbox caps range() at 100,000
        too); timeout_s: wall-clock time of one render before the worker is killed."""
        self.limits = {"max_chars": max_chars, "max_steps": max_steps,
                       "max_memory_bytes": max_memory_bytes}
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # one render at a time per worker
        self._proc: subprocess.Popen | None = None

    async def render(self, template: str, messages: list[dict], *,
                     special_tokens: dict[str, Any], add_generation_prompt: bool,
                     continue_final_message: bool,
                     chat_template_kwargs: dict[str, Any] | None,
                     tools: list[dict] | None = None) -> str:
        """The rendered conversation; ValueError saying why it could not be. tools:
        OpenAI's tool definitions, the template's `tools`."""
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        final = None
        if continue_final_message:
            if add_generation_prompt:
                raise ValueError("continue_final_message and add_generation_prompt cannot "
                                 "both be true")
            final = messages[-1].get("content")
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a final message with text "
                                 "content")
            messages[-1] = {**messages[-1], "content": final + _CONTINUE_TAG}
        variables = {**special_tokens, "documents": None, **(chat_template_kwargs or {}),
                     "messages": messages, "tools": tools,
                     "add_generation_prompt": add_generation_prompt}
        text = await asyncio.to_thread(self._render, template, variables)
        if final is not None:
            if _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message is set but the chat template does "
                                 "not render the final message")
            text = text[:text.rindex(_CONTINUE_TAG.strip())]
        return text

    def _render(self, template: str, variables: dict) -> str:
        try:
            request = json.dumps({"template": template, "variables": variables}) + "\n"
        except RecursionError:  # a message or tool nested deeper than json can write
            raise ValueError("the chat template's variables (messages, tools) nest too deeply "
                             "to send to its renderer") from None
        with self._lock:
            proc = self._worker()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
                line = proc.stdout.readline() if ready else None
            except OSError:  # the worker died (a broken pipe)
                line = ""
            if not line:
                self._stop()
                if line is None:
                    raise ValueError(f"the chat template did not finish rendering within "
                                     f"{self.timeout_s:g} s")
                raise ValueError("the chat template's renderer stopped while rendering it")
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(f"the chat template failed: {reply['error']}")
        return reply["text"]

    def _worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # -I: the standard library and jinja2 only; none of the server's path or state.
            self._proc = subprocess.Popen(
                [sys.executable, "-I", _WORKER, json.dumps(self.limits)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, encoding="utf-8")
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
            self._proc = None

    def close(self) -> None:
        """Stop the worker (it is started again if render is called later)."""
        with self._lock:
            self._stop()
