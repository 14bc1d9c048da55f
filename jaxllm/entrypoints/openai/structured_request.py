"""Which constraint a request body asks for: response_format, structured_outputs, tool_choice.

Owns the mapping of the OpenAI fields (and vLLM's `structured_outputs` extra) onto one
`StructuredOutputsParams`, vLLM's rules on `tools` and `tool_choice`, the JSON schema that
`tool_choice="required"` constrains to, and the name of the field each error is about
(`ParameterError.param`, the `param` of the 400). Checks shapes and conflicts only: whether a
schema, regex or grammar compiles is asked by the processor at admission (on the input
thread), and `errors_named` renames its error after the field the constraint came from.
Never touches the engine and never builds a response (tool_calls.py does).

    both endpoints (as vLLM's):
    response_format   {"type": "text"}          -> no constraint
                      {"type": "json_object"}   -> json_object=True
                      {"type": "json_schema"}   -> json=json_schema.schema
    structured_outputs {...}                    -> StructuredOutputsParams(**...)
    chat only:
    tool_choice       "none" (or no tools)      -> no constraint; tools still rendered
                      "auto" (default w/ tools) -> no constraint; needs the server's
                                                   --enable-auto-tool-choice
                      "required"                -> json: [{"name", "parameters"}, ...]
                      {"function": {"name"}}    -> json: that tool's parameters

At most one of these may constrain a request: two are a 400 (vLLM refuses conflicting
constraints rather than pick one).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

from jaxllm.entrypoints.openai.protocol import (ChatCompletionNamedToolChoiceParam,
                                                ChatCompletionRequest,
                                                ChatCompletionToolsParam, CompletionRequest)
from jaxllm.structured_outputs import StructuredOutputsParams
from jaxllm.value_ranges import ParameterError

# The parameters of a tool that declares none: any object (as vLLM).
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

AUTO_TOOL_CHOICE_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                                '--tool-call-parser to be set')


@dataclasses.dataclass(frozen=True)
class RequestConstraint:
    """What a body constrains its output to, and how its output is read back.

    params: the constraint (None: free text); param: the request field it came from, which
    names its errors; tool_choice: "none", "auto", "required" or "named"; tool_name: the
    tool of a named choice."""

    params: StructuredOutputsParams | None = None
    param: str | None = None
    tool_choice: str = "none"
    tool_name: str | None = None

    @property
    def makes_tool_calls(self) -> bool:
        """The output is read back as tool calls (named or required), not as content."""
        return self.tool_choice in ("named", "required")


def structured_outputs_of(body_field: dict | None) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` extra field -> its params; a 400 naming the field."""
    if body_field is None:
        return None
    try:
        return StructuredOutputsParams(**body_field)
    except TypeError as e:  # a key that is no field of StructuredOutputsParams
        known = [f.name for f in dataclasses.fields(StructuredOutputsParams)]
        raise ParameterError(f"structured_outputs has an unknown field ({e}); its fields "
                             f"are {known}", "structured_outputs") from None
    except ValueError as e:
        raise ParameterError(str(e), "structured_outputs") from None


def completion_constraint(req: CompletionRequest) -> RequestConstraint:
    """The constraint of a completion body (structured_outputs or response_format, as
    vLLM's); ParameterError (a 400 naming the field) when both are given."""
    params, param = _one_of(_asked(req))
    return RequestConstraint(params, param)


def chat_constraint(req: ChatCompletionRequest, enable_auto_tools: bool) -> RequestConstraint:
    """The constraint of a chat body; ParameterError (a 400 naming the field) when its
    fields are inconsistent."""
    asked = _asked(req)
    tool_choice, tool_name, tool_params = _tool_choice(req, enable_auto_tools)
    if tool_params is not None:
        asked.append((tool_params, "tool_choice"))
    params, param = _one_of(asked)
    if param == "tool_choice":
        param = "tools"  # a schema that does not compile is a tool's parameters
    return RequestConstraint(params, param, tool_choice, tool_name)


def _asked(req) -> list[tuple[StructuredOutputsParams, str]]:
    """(params, field) of each of structured_outputs and response_format that constrains."""
    asked = []
    so = structured_outputs_of(req.structured_outputs)
    if so is not None:
        asked.append((so, "structured_outputs"))
    rf = _response_format(req)
    if rf is not None:
        asked.append((rf, "response_format"))
    return asked


def _one_of(asked: list) -> tuple[StructuredOutputsParams | None, str | None]:
    if len(asked) > 1:
        fields = [field for _, field in asked]
        raise ParameterError(f"{' and '.join(fields)} each constrain the output; give only "
                             "one of them", fields[-1])
    return asked[0] if asked else (None, None)


@contextlib.contextmanager
def errors_named(constraint: RequestConstraint):
    """Admission's ParameterError about the constraint ("structured_outputs.json is
    invalid: ...") renamed after the request field the constraint came from."""
    try:
        yield
    except ParameterError as e:
        if (constraint.param is None or constraint.param == "structured_outputs"
                or not e.param.startswith("structured_outputs.")):
            raise
        raise ParameterError(f"{constraint.param}: {e}", constraint.param) from None


def _response_format(req) -> StructuredOutputsParams | None:
    rf = req.response_format
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise ParameterError('response_format of type "json_schema" needs '
                             "json_schema.schema", "response_format")
    return StructuredOutputsParams(json=rf.json_schema.json_schema)


def _tool_choice(req: ChatCompletionRequest, enable_auto_tools: bool):
    """-> (tool_choice, tool name or None, params or None), by vLLM's rules."""
    choice, tools = req.tool_choice, req.tools
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none", None, None
    if tools is None:
        raise ParameterError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if choice == "auto":
        if not enable_auto_tools:
            raise ParameterError(AUTO_TOOL_CHOICE_NEEDS_FLAGS, "tool_choice")
        return "auto", None, None
    if choice == "required":
        if not tools:  # vLLM: required over no tools is none
            return "none", None, None
        try:
            schema = required_schema(tools)
        except RecursionError:  # copying them
            raise ParameterError("the tools' parameters nest too deeply", "tools") from None
        return "required", None, StructuredOutputsParams(json=schema)
    assert isinstance(choice, ChatCompletionNamedToolChoiceParam)
    name = choice.function.name
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        raise ParameterError(f"The tool specified in `tool_choice` ({name!r}) does not match "
                             "any of the specified `tools`", "tool_choice")
    return "named", name, StructuredOutputsParams(json=tool.function.parameters
                                                  or EMPTY_PARAMETERS)


def required_schema(tools: list[ChatCompletionToolsParam]) -> dict:
    """tool_choice="required": a non-empty array of calls, each {"name": one tool's name,
    "parameters": that tool's parameters}. Each tool's `$defs` move to the root (a `$ref`
    is read from the root of the whole schema); two tools defining one name differently
    are a 400. Unlike vLLM, a call may hold no other keys (additionalProperties false)."""
    defs: dict = {}
    calls = []
    for tool in tools:
        parameters = copy.deepcopy(tool.function.parameters or EMPTY_PARAMETERS)
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise ParameterError(f"tools define $defs {key!r} differently", "tools")
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string",
                                              "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    return schema


__all__ = ["RequestConstraint", "chat_constraint", "completion_constraint", "errors_named",
           "required_schema", "AUTO_TOOL_CHOICE_NEEDS_FLAGS"]
