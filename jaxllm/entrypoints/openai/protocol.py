"""The OpenAI wire format: request bodies (pydantic) and how they become SamplingParams.

Owns the field names and defaults of `/v1/completions` and `/v1/chat/completions` bodies:
every field of vLLM 0.32's CompletionRequest and ChatCompletionRequest (OpenAI's
response_format, tools and tool_choice shapes included; prompt_embeds is refused by
frontend.py), vLLM's rules across fields (request_rules.py, run before parsing), and
the error body `{"error": {message, type, param, code}}`. Unknown fields are refused.
Never touches the engine: range checks are SamplingParams' (one place), and their ValueError
becomes a 400 in api_server.py. Two checks belong to the wire itself: every string of a body
must be valid Unicode (a lone surrogate such as "\\ud800" reaches no tokenizer), and seeds
and priorities are int64, as in vLLM's server.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from jaxllm.engine.request import CACHE_SALT_KEY
from jaxllm.entrypoints.openai.request_rules import check_body
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
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    # usage on every chunk too (each choice's counts so far)
    continuous_usage_stats: bool | None = False


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
    """Fields both endpoints share: OpenAI's, then vLLM's extras (request_rules.py says
    which vLLM fields are accepted without effect, or refused unless off)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    prompt_logprobs: int | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    priority: int = Field(0, ge=INT64_MIN, le=INT64_MAX)
    request_id: str | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    # vLLM's StructuredOutputsParams fields, as a dict (structured_request.py reads it).
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    # Accepted as vLLM accepts them, each with its rule in request_fields.py.
    watermarking: bool | None = None
    logprob_token_ids: list[int] | None = None
    session_id: str | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)
    return_token_offsets: bool | None = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, str | int | float | list[str | int | float]] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    stream_interval: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _vllm_rules(cls, data: Any) -> Any:
        return check_body(cls.__name__, data)

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        structured_outputs: StructuredOutputsParams | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The SamplingParams of this body; ValueError (-> 400) on any bad value.
        structured_outputs: the constraint the server built from the body's fields;
        prompt_logprobs: the body's, or what echo asks for."""
        defaults = SamplingParams()
        extra = {}
        if structured_outputs is not None:
            extra["structured_outputs"] = structured_outputs
        if self.bad_words:
            extra["bad_words"] = self.bad_words
        if self.allowed_token_ids is not None:
            extra["allowed_token_ids"] = self.allowed_token_ids
        if self.logit_bias:
            extra["logit_bias"] = self.logit_bias
        extra_args = dict(self.vllm_xargs or {})
        if self.cache_salt is not None:
            extra_args[CACHE_SALT_KEY] = self.cache_salt
        if extra_args:
            extra["extra_args"] = extra_args

        def given(name):
            value = getattr(self, name)
            return getattr(defaults, name) if value is None else value

        return SamplingParams(
            n=self.n, temperature=given("temperature"), top_p=given("top_p"),
            top_k=given("top_k"), min_p=given("min_p"),
            repetition_penalty=given("repetition_penalty"),
            presence_penalty=given("presence_penalty"),
            frequency_penalty=given("frequency_penalty"),
            stop=self.stop, stop_token_ids=self.stop_token_ids, seed=self.seed,
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
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
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _prompt_given(self):
        if self.prompt is None and self.prompt_embeds is None:
            raise ValueError("Either prompt or prompt_embeds must be provided and non-empty.")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None  # None: the rest of the context
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0  # -1: the whole vocabulary (vLLM)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    add_special_tokens: bool = False  # the chat template holds the special tokens
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    return_prompt_text: bool | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
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



