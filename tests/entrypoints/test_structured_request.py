"""Request bodies -> constraints (structured_request.py), without a model: each
response_format, structured_outputs and tool_choice form, vLLM's tool_choice rules, the
"required" schema, and the field each refusal names."""

from __future__ import annotations

import pytest

from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxllm.entrypoints.openai.structured_request import (RequestConstraint, chat_constraint,
                                                          completion_constraint, errors_named,
                                                          required_schema)
from jaxllm.structured_outputs import StructuredOutputsParams
from jaxllm.value_ranges import ParameterError

ASK = [{"role": "user", "content": "hi"}]
P = {"type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
     "$defs": {"X": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": P}},
         {"type": "function", "function": {"name": "g"}}]


def chat(auto: bool = False, **body) -> RequestConstraint:
    return chat_constraint(ChatCompletionRequest(messages=ASK, **body), auto)


def refusal(param: str, **body) -> str:
    with pytest.raises(ParameterError) as info:
        chat(**body)
    assert info.value.param == param
    return str(info.value)


def test_response_format_and_structured_outputs_map_to_params():
    assert chat() == RequestConstraint()
    assert chat(response_format={"type": "text"}) == RequestConstraint()
    assert chat(response_format={"type": "json_object"}) == RequestConstraint(
        StructuredOutputsParams(json_object=True), "response_format")
    schema = {"type": "object"}
    assert chat(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": schema, "strict": True}}) == RequestConstraint(
        StructuredOutputsParams(json=schema), "response_format")
    so = {"regex": "a+", "disable_any_whitespace": True}
    assert chat(structured_outputs=so) == RequestConstraint(
        StructuredOutputsParams(**so), "structured_outputs")
    assert completion_constraint(CompletionRequest(prompt="x", structured_outputs=so)) == \
        RequestConstraint(StructuredOutputsParams(**so), "structured_outputs")
    assert completion_constraint(CompletionRequest(prompt="x")) == RequestConstraint()
    assert completion_constraint(CompletionRequest(prompt="x", response_format={
        "type": "json_object"})) == RequestConstraint(StructuredOutputsParams(json_object=True),
                                                       "response_format")
    with pytest.raises(ParameterError, match="structured_outputs and response_format each "
                                             "constrain the output") as info:
        completion_constraint(CompletionRequest(prompt="x", structured_outputs=so,
                                                response_format={"type": "json_object"}))
    assert info.value.param == "response_format"


def test_tool_choices():
    assert chat(tools=TOOLS, tool_choice="none") == RequestConstraint()
    assert chat(tool_choice="none") == RequestConstraint()  # no tools needed (recent vLLM)
    assert chat(True, tools=TOOLS) == RequestConstraint(tool_choice="auto")
    assert chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}) == \
        RequestConstraint(StructuredOutputsParams(json={"type": "object", "properties": {}}),
                          "tools", "named", "g")
    required = chat(tools=TOOLS, tool_choice="required")
    assert required == RequestConstraint(StructuredOutputsParams(json=required_schema(
        chat_request_tools())), "tools", "required")
    assert required.makes_tool_calls and not chat(True, tools=TOOLS).makes_tool_calls
    with pytest.raises(ValueError, match="`tools` must not be an empty array"):  # vLLM 0.32
        chat(tools=[], tool_choice="required")


def chat_request_tools():
    return ChatCompletionRequest(messages=ASK, tools=TOOLS).tools


def test_required_schema_hoists_defs():
    call = {"type": "object", "required": ["name", "parameters"],
            "additionalProperties": False}
    assert required_schema(chat_request_tools()) == {
        "type": "array", "minItems": 1, "items": {"anyOf": [
            {**call, "properties": {"name": {"type": "string", "enum": ["f"]}, "parameters": {
                "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}}}},
            {**call, "properties": {"name": {"type": "string", "enum": ["g"]},
                                    "parameters": {"type": "object", "properties": {}}}}]},
        "$defs": {"X": {"type": "integer"}}}
    assert TOOLS[0]["function"]["parameters"] == P  # the request's schema is left alone
    clash = {**P, "$defs": {"X": {"type": "string"}}}
    with pytest.raises(ParameterError, match="tools define \\$defs 'X' differently") as info:
        required_schema(ChatCompletionRequest(messages=ASK, tools=[
            *TOOLS, {"type": "function", "function": {"name": "h", "parameters": clash}}]
        ).tools)
    assert info.value.param == "tools"


def test_refusals_name_their_field():
    assert refusal("tool_choice", tool_choice="required") == \
        "When using `tool_choice`, `tools` must be set."
    assert refusal("tool_choice", tool_choice="auto").startswith("When using `tool_choice`")
    assert refusal("tool_choice", tools=TOOLS) == (
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
        "set")
    assert "('h') does not match any of the specified `tools`" in refusal(
        "tool_choice", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}})
    assert refusal("response_format", response_format={"type": "json_schema", "json_schema": {
        "name": "n"}}) == 'response_format of type "json_schema" needs json_schema.schema'
    assert refusal("response_format", structured_outputs={"regex": "a"},
                   response_format={"type": "json_object"}) == (
        "structured_outputs and response_format each constrain the output; give only one of "
        "them")
    assert refusal("tool_choice", tools=TOOLS, tool_choice="required",
                   structured_outputs={"regex": "a"}).startswith(
        "structured_outputs and tool_choice each constrain")
    assert refusal("structured_outputs", structured_outputs={"nope": 1}).startswith(
        "structured_outputs has an unknown field")
    assert refusal("structured_outputs", structured_outputs={
        "json": "[" * 100_000 + "]" * 100_000}).startswith(
        "structured_outputs.json is not valid JSON: RecursionError")
    assert refusal("structured_outputs", structured_outputs={}).startswith(
        "You must use one kind of structured outputs constraint")


def test_admission_errors_are_renamed_after_the_request_field():
    error = ParameterError("structured_outputs.json is invalid: x", "structured_outputs.json")
    for source, param in [("response_format", "response_format"), ("tools", "tools"),
                          ("structured_outputs", "structured_outputs.json")]:
        with pytest.raises(ParameterError) as info:
            with errors_named(RequestConstraint(StructuredOutputsParams(json={}), source)):
                raise error
        assert info.value.param == param
        assert str(info.value) == (str(error) if source == "structured_outputs"
                                   else f"{source}: {error}")
    with pytest.raises(ParameterError) as info:  # another field's error: untouched
        with errors_named(RequestConstraint(StructuredOutputsParams(json={}), "tools")):
            raise ParameterError("max_tokens=9 does not fit", "max_tokens")
    assert info.value.param == "max_tokens"


def test_parameters_nested_too_deeply_are_a_400_naming_tools():
    parameters = inner = {}
    for _ in range(2000):
        inner["properties"] = {"a": {}}
        inner = inner["properties"]["a"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    assert refusal("tools", tools=tools, tool_choice="required") == \
        "the tools' parameters nest too deeply"
