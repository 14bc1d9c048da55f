"""The OpenAI wire format: request bodies (pydantic) and how they become SamplingParams.

Owns the field names and defaults of `/v1/completions` and `/v1/chat/completions` bodies
(OpenAI's response_format, tools and tool_choice shapes included), vLLM's sampling extras on
them, and the error body `{"error": {message, type, param, code}}`.
Never touches the engine: range checks are SamplingParams' (one place), and their ValueError
becomes a 400 in api_server.py. Two checks belong to the wire itself: every string of a body
must be valid Unicode (a lone surrogate such as "\\ud800" reaches no tokenizer), and seeds
and priorities are int64, as in vLLM's server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from jaxllm.sampling_params import RequestOutputKind, SamplingParams
from jaxllm.structured_outputs import StructuredOutputsParams
from jaxllm.unicode_text import check_json_text, check_text
from jaxllm.value_ranges import INT64_MAX, INT64_MIN


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    """OpenAI's error body, as a JSON response or an SSE event carries it (the one place
    either is built)."""
    # A message quoting the client's text could hold a lone surrogate, which no JSON
    # response can encode: escape it rather than fail while reporting an error.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param,
                                         code=status)).model_dump()


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaResponseFormat(BaseModel):
    """response_format.json_schema: `schema` is the JSON schema the output follows."""

    model_config = ConfigDict(populate_by_name=True)

    name: str
    description: str | None = None
    # `schema` would shadow pydantic's BaseModel.schema: stored as json_schema.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaResponseFormat | None = None


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class _Body(BaseModel):
    """A request body: unknown fields are refused, and every string in it, at any depth, must
    be valid Unicode (checked before any field is parsed, naming the field)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, value in data.items():
                if isinstance(key, str):
                    check_text(key, "a field name")
                    check_json_text(value, key)
        return data


class _SamplingFields(_Body):
    """Fields both endpoints share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None
    # vLLM's StructuredOutputsParams fields, as a dict (structured_request.py reads it).
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """The SamplingParams of this body; ValueError (-> 400) on any bad value.
        structured_outputs: the constraint the server built from the body's fields."""
        defaults = SamplingParams()
        extra = {}
        if structured_outputs is not None:
            extra["structured_outputs"] = structured_outputs
        if self.bad_words is not None:
            extra["bad_words"] = self.bad_words
        if self.allowed_token_ids is not None:
            extra["allowed_token_ids"] = self.allowed_token_ids
        return SamplingParams(
            n=self.n,
            temperature=defaults.temperature if self.temperature is None else self.temperature,
            top_p=defaults.top_p if self.top_p is None else self.top_p,
            top_k=defaults.top_k if self.top_k is None else self.top_k,
            min_p=defaults.min_p if self.min_p is None else self.min_p,
            repetition_penalty=(defaults.repetition_penalty if self.repetition_penalty is None
                                else self.repetition_penalty),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            **extra)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's base64 torch.save tensors: refused by the server (entrypoints/openai/frontend.py)
    prompt_embeds: str | list[str] | None = None
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _prompt_given(self):
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # None: the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    logit_bias: dict[str, float] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    # None: "auto" when tools are given, else "none" (OpenAI's and vLLM's default).
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam \
        | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _one_tool_choice(cls, value: Any) -> Any:
        """One error naming `tool_choice` (not one per member of its union)."""
        if value is None or value in ("none", "auto", "required"):
            return value
        if isinstance(value, dict):
            try:
                return ChatCompletionNamedToolChoiceParam.model_validate(value)
            except ValidationError:
                pass
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": '
                         f'"function", "function": {{"name": ...}}}}, got {value!r:.80}')


class TokenizeRequest(_Body):
    """vLLM's TokenizeCompletionRequest (prompt) and TokenizeChatRequest (messages) in one:
    exactly one of the two is given. add_special_tokens: None is vLLM's default of each,
    true for a prompt and false for messages (the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

