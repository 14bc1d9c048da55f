"""2,000+ generated malformed bodies against the server's app, in-process on the tiny model:
no response is a 500, every refusal is OpenAI's error JSON (400; 404 for an unknown model),
every accepted request completes (a stream ends with `data: [DONE]`), and afterwards the
engine is idle, every KV block free, and a good request still gets its tokens.

The bodies come from a seeded generator, one class of malformation at a time (`CLASSES`);
JSON is written as text, so NaN, Infinity and integers of any size reach the server as a
client can send them. Run with -s for the counts of statuses per class.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import time

import pytest


from inprocess_app import error_of

SEED = 15
PER_CLASS = 250
CONCURRENCY = 16
V = "__VALUE__"  # where a generated JSON literal goes in a body

COMPLETION = {"prompt": "Hi there", "max_tokens": 2, "temperature": 0.0}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0.0}
NUMBER_FIELDS = ["temperature", "top_p", "top_k", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "seed", "max_tokens",
                 "min_tokens", "prompt_logprobs", "priority", "truncate_prompt_tokens"]
COMPLETION_NUMBERS = NUMBER_FIELDS + ["logprobs", "best_of"]
CHAT_NUMBERS = NUMBER_FIELDS + ["top_logprobs", "max_completion_tokens"]
NUMBERS = ["0", "-1", "1", "2", "2147483647", "2147483648", "-2147483649",
           "9223372036854775807", "9223372036854775808", "-9223372036854775809",
           "18446744073709551616", "1" + "0" * 400, "1" + "0" * 5000, "NaN", "Infinity",
           "-Infinity", "5e-324", "1e-300", "1e-46", "1.401298464324817e-45", "1.17549435e-38",
           "3.4028234663852886e38", "3.5e38", "1e308", "1e400", "-0.0", "0.5", "2.5", "-2.0",
           "49151", "49152", "true", "null", '"1"']
# n is bounded by the engine's max_n_sequences (16384 here, vLLM's default): past it, a 400
# before anything is queued (an accepted n of 2^31 would fan out 2^31 requests).
N_VALUES = ["0", "-1", "1", "2", "3", "2.0", "NaN", "Infinity", "1e400", "5e-324", "true",
            "null", '"2"', "[2]", "16385", "2147483647", "2147483648", "9223372036854775808",
            "1" + "0" * 400]
WRONG_TYPES = ['"x"', '""', "[]", "{}", '[1, "a"]', '{"a": 1}', "true", "null", "[[[]]]",
               "-1.5", '"\\u0000"', '["\\n"]']
SURROGATES = ['"\\ud800"', '"ab\\udfffcd"', '"\\udc00\\ud800"', '"ok \\ud83d"']


def literal(rng) -> str:
    return rng.choice(NUMBERS)


def put(base: dict, path: list, value: str) -> str:
    """base as JSON text with the literal `value` at `path` (keys and list indices)."""
    body = json.loads(json.dumps(base))
    *outer, last = path
    target = body
    for step in outer:
        target = target[step]
    target[last] = V
    return json.dumps(body).replace(json.dumps(V), value)


def numbers_completion(rng):
    field = rng.choice(COMPLETION_NUMBERS + ["n", "stop_token_ids", "allowed_token_ids",
                                             "logit_bias", "prompt"])
    base = {**COMPLETION, "stream": rng.random() < 0.25}
    if field == "n":
        return "/v1/completions", put({**base, "temperature": 1.0}, ["n"], rng.choice(N_VALUES))
    if field in ("stop_token_ids", "allowed_token_ids", "prompt"):
        return "/v1/completions", put({**base, field: [7, 0]}, [field, 1], literal(rng))
    if field == "logit_bias":
        return "/v1/completions", put({**base, field: {"5": 0}}, [field, "5"], literal(rng))
    return "/v1/completions", put(base, [field], literal(rng))


def numbers_chat(rng):
    field = rng.choice(CHAT_NUMBERS + ["n"])
    base = {**CHAT, "stream": rng.random() < 0.25, "logprobs": rng.random() < 0.5}
    values = N_VALUES if field == "n" else NUMBERS
    return "/v1/chat/completions", put({**base, "temperature": 1.0} if field == "n" else base,
                                       [field], rng.choice(values))


def wrong_types(rng):
    path, base = rng.choice([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
    fields = ["model", "stop", "stream", "stream_options", "user", "ignore_eos", "bad_words",
              "skip_special_tokens", "include_stop_str_in_output", "echo", "suffix",
              "messages", "prompt", "chat_template", "chat_template_kwargs", "tools",
              "response_format", "add_generation_prompt", "continue_final_message", "n",
              "tool_choice", "structured_outputs",
              "temperature", "stop_token_ids", "logit_bias", "request_id"]
    field = rng.choice(fields)
    value = rng.choice(WRONG_TYPES)
    if field == "request_id" and value.startswith('"'):
        value = "[]"  # a repeated id is another test's subject (streams that collide)
    return path, put(base, [field], value)


def surrogates(rng):
    s = rng.choice(SURROGATES)
    chat_message = {"role": "user", "content": "Hi", "name": "bob"}
    choice = rng.randrange(12)
    if choice == 0:
        return "/v1/completions", put(COMPLETION, ["prompt"], s)
    if choice == 1:
        return "/v1/completions", put({**COMPLETION, "prompt": ["a", "b"]}, ["prompt", 1], s)
    if choice == 2:
        field = rng.choice(["stop", "user", "request_id", "model", "suffix"])
        return "/v1/completions", put(COMPLETION, [field], s)
    if choice == 3:
        return "/v1/completions", put({**COMPLETION, "bad_words": ["x"]}, ["bad_words", 0], s)
    if choice == 4:
        key = rng.choice(["content", "role", "name"])
        return "/v1/chat/completions", put({**CHAT, "messages": [chat_message]},
                                           ["messages", 0, key], s)
    if choice == 5:
        parts = {"role": "user", "content": [{"type": "text", "text": "a"}]}
        return "/v1/chat/completions", put({**CHAT, "messages": [parts]},
                                           ["messages", 0, "content", 0, "text"], s)
    if choice == 6:
        return "/v1/chat/completions", put(CHAT, ["chat_template"], s)
    if choice == 7:
        return "/v1/chat/completions", put({**CHAT, "chat_template_kwargs": {"k": 1}},
                                           ["chat_template_kwargs", "k"], s)
    if choice == 8:
        return "/tokenize", put({"prompt": "a"}, ["prompt"], s)
    if choice == 9:
        return "/tokenize", put({"messages": [chat_message]}, ["messages", 0, "content"], s)
    if choice == 10:  # as a field name: the literal is spliced in as a key
        return "/v1/completions", json.dumps(COMPLETION)[:-1] + f", {s}: 1}}"
    return "/v1/chat/completions", put({**CHAT, "response_format": {"type": "x"}},
                                       ["response_format", "type"], s)


ROLES = ["user", "system", "assistant", "tool", "developer", "wizard", "", 5, None]
CONTENTS = ["hi", "", None, 5, [], [{"type": "text", "text": "a"}], [{"type": "image_url"}],
            [{"type": "text"}], {"a": 1}, [["x"]], [{"type": "text", "text": 5}]]
TEMPLATES = [None, "{% for %}", "{{ raise_exception('no') }}", "{{ x.y.z }}", "{{ messages }}",
             "{{ 1 / 0 }}", "{% if %}", "{{ messages[0]['content'] }}", "", "{{ '%c' % 55296 }}"]


TOOL_CALLS = [[], {}, 5, [5], [{}], [{"function": 5}], [{"function": {"name": "f"}}],
              [{"function": {"name": "f", "arguments": "{oops"}}],
              [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
              [{"function": {"name": 5, "arguments": [1]}}]]


def messages(rng):
    conversation = []
    for _ in range(rng.randrange(0, 4)):
        if rng.random() < 0.1:
            conversation.append(rng.choice(["hi", 5, None, [], ["user", "hi"]]))
            continue
        message = {"role": rng.choice(ROLES), "content": rng.choice(CONTENTS)}
        if rng.random() < 0.2:
            message.pop(rng.choice(["role", "content"]))
        if rng.random() < 0.2:
            message["tool_calls"] = rng.choice(TOOL_CALLS)
        conversation.append(message)
    body = {**CHAT, "messages": conversation,
            "add_generation_prompt": rng.random() < 0.7,
            "continue_final_message": rng.random() < 0.2}
    template = rng.choice(TEMPLATES)
    if template is not None:
        body["chat_template"] = template
    return "/v1/chat/completions", json.dumps(body)


PROMPTS = [[], [[]], [-1], [49152], [2**40], [2**63], [1.5], [1, "a"], [[1, 2], "a"], "", [""],
           [[1, 2], [3, -4]], [5] * 100, [[5] * 70], None, 5, {"a": 1}, [None], ["ok", ["x"]],
           [[[1]]], [[1, 2], [3]], ["a", "b"], [True]]


def prompts(rng):
    return "/v1/completions", json.dumps({**COMPLETION, "prompt": rng.choice(PROMPTS)})


BROKEN = [b"", b"{", b'{"prompt": "x",}', b"nul", b'{"prompt": "x"} trailing', b"[", b'"str"',
          b"5", b"null", b"[]", b'[{"prompt": "x"}]', b"[" * 5000 + b"]" * 5000,
          b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}", b'{"prompt": "\xff\xfe"}',
          b'\xef\xbb\xbf{"prompt": 5}', b'{"prompt": "x", "prompt": 5}',
          b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", b"\x00", b'{"prompt": "\\x"}',
          b'{"messages": [{"role": "user", "content": "hi"}]', b"{'prompt': 'x'}"]


def broken_json(rng):
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
    return path, rng.choice(BROKEN)


def unknown(rng):
    path, base = rng.choice([("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                             ("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})])
    if rng.random() < 0.5:
        return path, put(base, [rng.choice(["bogus", "Prompt", "top-k", "guided_json"])], "1")
    return path, put(base, ["model"], rng.choice(['"nope"', '"tiny "', '"TINY"', '"gpt-4"']))


def tokenize(rng):
    if rng.random() < 0.5:
        tokens = rng.choice(["[-1]", "[49152]", "[9223372036854775808]", '["a"]', "[1.5]",
                             "null", "[]", "[[1]]", "[0, 49151]", "{}"])
        return "/detokenize", put({"tokens": [1]}, ["tokens"], tokens)
    body = rng.choice([{}, {"prompt": "a", "messages": [{"role": "user", "content": "a"}]},
                       {"prompt": "a", "add_special_tokens": "maybe"}, {"messages": []},
                       {"messages": [{"role": "robot", "content": "a"}]}, {"prompt": 5},
                       {"prompt": "a", "add_generation_prompt": []}, {"prompt": ""}])
    return "/tokenize", json.dumps(body)


# class -> (generator, the statuses a body of the class may get)
CLASSES = {
    "numbers at their boundaries (completions)": (numbers_completion, {200, 400}),
    "numbers at their boundaries (chat)": (numbers_chat, {200, 400}),
    "wrong types": (wrong_types, {200, 400, 404}),  # a string model is a name: 404
    "lone surrogates": (surrogates, {400}),
    "malformed chat messages and templates": (messages, {200, 400}),
    "malformed prompts": (prompts, {200, 400}),
    "broken JSON, or not an object": (broken_json, {400}),
    "unknown fields and models": (unknown, {400, 404}),
    "tokenize and detokenize": (tokenize, {200, 400}),
}


@pytest.fixture(scope="module")
def server(inprocess_server):
    # The shared in-process server (conftest.py): request templates are trusted there.
    return inprocess_server


def check(path: str, body, response) -> None:
    """200: a complete answer (an SSE stream ends with [DONE]); otherwise the error JSON."""
    if response.status_code != 200:
        error_of(response, response.status_code)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in response.text.splitlines() if line]
        assert events[-1] == "data: [DONE]", (path, body, response.text[-500:])
        assert all(json.loads(e[6:]) for e in events[:-1])
    else:
        assert set(response.json()) & {"choices", "tokens", "prompt"}, response.text


def test_generated_malformed_bodies_never_get_a_500(server):
    good = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True}
    expected = server.post("/v1/completions", good).json()["choices"][0]["text"]
    rng = random.Random(SEED)
    cases = [(name, *generate(rng)) for name, (generate, _) in CLASSES.items()
             for _ in range(PER_CLASS)]
    rng.shuffle(cases)  # the classes interleave, as clients' requests would
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    unexpected = []

    async def send(client, case):
        name, path, body = case
        content = body if isinstance(body, bytes) else body.encode()
        response = await client.post(path, content=content,
                                     headers={"content-type": "application/json"})
        try:
            assert response.status_code in CLASSES[name][1]
            check(path, body[:300], response)
            counts[name][response.status_code] += 1
        except AssertionError:  # all of them are reported, not only the first
            counts[name][f"{response.status_code} (unexpected)"] += 1
            unexpected.append((name, path, body[:300], response.status_code,
                               response.text[-300:]))

    async def main():
        async with server.client() as client:
            for start in range(0, len(cases), CONCURRENCY):
                await asyncio.gather(*[send(client, c)
                                       for c in cases[start:start + CONCURRENCY]])

    t0 = time.perf_counter()
    asyncio.run(main())
    print(f"\n{len(cases)} generated bodies in {time.perf_counter() - t0:.1f} s, {CONCURRENCY} "
          "at a time; statuses per class:")
    for name in CLASSES:
        print(f"  {name:42s} " + ", ".join(f"{status}: {n}" for status, n in
                                           sorted(counts[name].items(), key=str)))
    assert len(cases) >= 2000
    assert unexpected == [], unexpected[:5]
    server.assert_idle()
    assert server.post("/v1/completions", good).json()["choices"][0]["text"] == expected
