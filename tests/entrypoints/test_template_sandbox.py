"""Request-supplied chat templates render in a bounded process: the same text as
transformers for a real template, and a clear error (never a hang, never the server's
memory) for hostile ones. No engine here: the tokenizer is only the template's source."""

from __future__ import annotations

import asyncio
import time

import pytest

from jaxllm.entrypoints.openai.template_sandbox import TemplateSandbox

from engine_e2e.tiny_model import smollm2_tokenizer

pytestmark = pytest.mark.serial  # wall-clock limits of the render worker: alone

MAX_CHARS = 1000
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How"}]


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


@pytest.fixture(scope="module")
def sandbox():
    sandbox = TemplateSandbox(MAX_CHARS, max_steps=1000)
    yield sandbox
    sandbox.close()


def render(sandbox, template, messages=CHAT, **kwargs):
    options = dict(special_tokens={"bos_token": "<s>"}, add_generation_prompt=False,
                   continue_final_message=False, chat_template_kwargs=None)
    return asyncio.run(sandbox.render(template, messages, **{**options, **kwargs}))


@pytest.mark.parametrize("add_generation_prompt, continue_final_message",
                         [(True, False), (False, False), (False, True)])
def test_a_real_template_renders_as_transformers_does(sandbox, tokenizer,
                                                      add_generation_prompt,
                                                      continue_final_message):
    expected = tokenizer.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message)
    assert render(sandbox, tokenizer.chat_template,
                  special_tokens=tokenizer.special_tokens_map,
                  add_generation_prompt=add_generation_prompt,
                  continue_final_message=continue_final_message) == expected
    assert expected.endswith("Hello! How" if continue_final_message else "")


def test_variables_and_helpers_reach_the_template(sandbox):
    template = ("{{ bos_token }}{{ flavour }}{% generation %}{{ messages|length }}"
                "{% endgeneration %}{{ {'a': '<b>'}|tojson }}{{ tools }}")
    assert render(sandbox, template, chat_template_kwargs={"flavour": "x"}) == \
        '<s>x3{"a": "<b>"}None'


@pytest.mark.parametrize("template, error", [
    # Issue 15's repro: 50 bytes that used to block the server for 58 s.
    ("{{ 'ab' * 10000000 }}", "SecurityError: '*' would build 20000000 items; the limit is "
                              "1000"),
    ("{{ 7 ** 100000 }}", "SecurityError: '**' would build an integer of more than 4096 bits"),
    ("{% for i in range(100) %}{% for j in range(100) %}{% endfor %}{% endfor %}",
     "SecurityError: the template ran more than 1000 loop iterations and macro calls"),
    ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
     "{{ f(30) }}", "SecurityError: the template ran more than 1000 loop iterations and "
                    "macro calls"),
    ("{% for i in range(999) %}xy{% endfor %}",
     "SecurityError: the template's output passed 1000 characters"),
    ("{% set _jaxllm_tick = namespace %}", "SecurityError: a template may not use the name "
                                          "'_jaxllm_tick'"),
    ("{{ raise_exception('no system messages') }}", "TemplateError: no system messages"),
    ("{% for %}", "TemplateSyntaxError: Expected an expression, got 'end of statement block'"),
])
def test_a_hostile_template_fails_fast_with_its_reason(sandbox, template, error):
    t0 = time.perf_counter()
    with pytest.raises(ValueError) as info:
        render(sandbox, template)
    assert str(info.value) == f"the chat template failed: {error}"
    assert time.perf_counter() - t0 < 5


def test_memory_is_bounded_by_the_worker_s_address_space():
    sandbox = TemplateSandbox(1 << 40, max_memory_bytes=256 << 20)
    doubling = ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}")
    try:
        with pytest.raises(ValueError, match="^the chat template failed: MemoryError"):
            render(sandbox, doubling)
        assert render(sandbox, "ok") == "ok"  # the same worker goes on
    finally:
        sandbox.close()


def test_a_render_past_its_time_limit_kills_the_worker_and_the_next_one_works():
    sandbox = TemplateSandbox(MAX_CHARS, timeout_s=0.5)
    slow = "{% for i in range(100000) %}{% set n = range(100000)|list|length %}{% endfor %}"
    try:
        with pytest.raises(ValueError) as info:
            render(sandbox, slow)
        assert str(info.value) == "the chat template did not finish rendering within 0.5 s"
        assert sandbox._proc is None
        assert render(sandbox, "{{ messages[1].content }}") == "Hi"
    finally:
        sandbox.close()


TOOL_TEMPLATE = ("{% for m in messages %}{{ m.role }}:{{ m.content }}"
                 "{% for c in m.tool_calls or [] %}[{{ c.function.name }} "
                 "{{ c.function.arguments|tojson }}]{% endfor %}{{ m.tool_call_id or '' }}|"
                 "{% endfor %}{% for t in tools or [] %}{{ t.function|tojson }}{% endfor %}")
TOOL_CHAT = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "w", "arguments": '{"city": "Oslo"}'}},
                 {"id": "c2", "type": "function", "function": {"name": "n", "arguments": ""}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "rain"}]
TOOL_DEFS = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]


def test_tools_and_tool_calls_render_alike_in_the_sandbox_and_the_processor(sandbox,
                                                                             tokenizer):
    from jaxllm.engine.chat_messages import chat_messages
    from jaxllm.engine.processor import Processor

    expected = ('user:Weather?|assistant:[w {"city": "Oslo"}][n {}]|tool:rainc1|'
                '{"name": "w", "parameters": {"type": "object"}}')
    assert render(sandbox, TOOL_TEMPLATE, chat_messages(TOOL_CHAT), tools=TOOL_DEFS) == expected
    processor = Processor(tokenizer, vocab_size=len(tokenizer), max_model_len=512,
                          max_logprobs=20, eos_token_id=tokenizer.eos_token_id,
                          extra_eos_ids=[], engine_seed=0)
    prompt, = processor.render_chat(TOOL_CHAT, TOOL_TEMPLATE, add_generation_prompt=False,
                                    tools=TOOL_DEFS)
    assert prompt.text == expected
    for arguments in ["{oops", "[" * 100_000 + "]" * 100_000]:
        with pytest.raises(ValueError, match="message 1: tool call arguments are not JSON"):
            chat_messages([TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": [
                {"function": {"name": "w", "arguments": arguments}}]}])


def test_a_tool_conversation_renders_with_smollm2_s_own_template(tokenizer):
    from jaxllm.engine.processor import Processor

    processor = Processor(tokenizer, vocab_size=len(tokenizer), max_model_len=512,
                          max_logprobs=20, eos_token_id=tokenizer.eos_token_id,
                          extra_eos_ids=[], engine_seed=0)
    prompt, = processor.render_chat(TOOL_CHAT, tools=TOOL_DEFS)
    # SmolLM2's template renders no tools and no tool calls: the assistant's turn is its
    # content, "" (vLLM's for None), and the tool's result is a turn of role "tool".
    assert prompt.text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n"
        "<|im_end|>\n<|im_start|>tool\nrain<|im_end|>\n<|im_start|>assistant\n")


def test_variables_nested_too_deeply_are_a_value_error(sandbox):
    tools = inner = {}
    for _ in range(2000):
        inner["a"] = {}
        inner = inner["a"]
    with pytest.raises(ValueError, match="nest too deeply to send to its renderer"):
        render(sandbox, "{{ tools }}", tools=[tools])
