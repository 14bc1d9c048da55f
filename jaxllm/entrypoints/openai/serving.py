"""Completions and chat completions: the server's state both endpoints share.

Owns the server's options (the chat template, whether request templates are trusted and
the sandbox that renders them, the cap on prompts per request, the tool-call parser, the
defaults of return_tokens_as_token_ids and of stating cached prompt tokens), vLLM's server
rule that a prompt plus max_tokens must fit the context, and usage as responses state it.
Each endpoint's flow is its own module: serving_completion.py and serving_chat.py (beam
search: beam_serving.py). Never touches HTTP (api_server.py does), never tokenizes or
renders on the event loop (AsyncLLM's input thread does), and never runs the engine loop.

Every request is admitted (tokenized, checked, its ids reserved) before a response starts,
so bad input is a 400 even for a stream. After that a stream always ends with
`data: [DONE]`, after an error event (errors.py) if its request failed or the engine died.

Every request asks the engine for DELTA outputs when streaming and FINAL_ONLY otherwise, so
the stream's chunks concatenate to exactly the non-streaming result.
"""

from __future__ import annotations

from jaxllm.async_llm import AsyncLLM
from jaxllm.engine.processor import ProcessedRequest
from jaxllm.entrypoints.openai import serving_chat, serving_completion
from jaxllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from jaxllm.entrypoints.openai.template_sandbox import TemplateSandbox
from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager
from jaxllm.entrypoints.openai.usage import usage
from jaxllm.value_ranges import ParameterError

# vLLM's VLLM_MAX_COMPLETION_PROMPTS default: prompts in one /v1/completions request.
DEFAULT_MAX_COMPLETION_PROMPTS = 1024


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, model_names: list[str], chat_template: str | None,
                 *, trust_request_chat_template: bool = False,
                 max_completion_prompts: int = DEFAULT_MAX_COMPLETION_PROMPTS,
                 enable_auto_tools: bool = False, tool_parser: str | None = None,
                 return_tokens_as_token_ids: bool = False,
                 enable_prompt_tokens_details: bool = True):
        """trust_request_chat_template: accept a `chat_template` in chat requests (vLLM's
        --trust-request-chat-template); max_completion_prompts: the most prompts one
        /v1/completions request may hold; enable_auto_tools, tool_parser: vLLM's
        --enable-auto-tool-choice and --tool-call-parser (tool_choice="auto");
        return_tokens_as_token_ids: the default of the request field (vLLM's
        --return-tokens-as-token-ids); enable_prompt_tokens_details: usage states the
        prompt's cached tokens (vLLM's --enable-prompt-tokens-details; on by default here,
        so that the flag is an accepted no-op)."""
        if enable_auto_tools and tool_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.enable_auto_tools = enable_auto_tools
        self.tool_parser = tool_parser
        # An unknown name is refused at start-up, not at the first "auto" request.
        self.tool_parser_cls = (ToolParserManager.get_tool_parser(tool_parser)
                                if tool_parser is not None else None)
        self.engine = engine
        self.model_names = model_names
        self.chat_template = chat_template
        self.max_model_len = engine.engine.config.max_model_len
        self.max_completion_prompts = max_completion_prompts
        self.return_tokens_as_token_ids = return_tokens_as_token_ids
        self.enable_prompt_tokens_details = enable_prompt_tokens_details
        processor = engine.engine.processor
        # Request templates render in their own bounded process; nothing they build may
        # exceed what a prompt can be.
        self.template_sandbox = (TemplateSandbox(processor.max_prompt_chars)
                                 if trust_request_chat_template else None)

    def close(self) -> None:
        if self.template_sandbox is not None:
            self.template_sandbox.close()

    def lora_request(self, model: str):
        """The LoRA adapter a request's `model` names (None: a base model name)."""
        return self.engine.engine.lora_manager.get_lora(model)

    def check_completion(self, req: CompletionRequest):
        """What a completion body can be refused for before tokenizing (a ValueError)."""
        return serving_completion.check_completion(self, req)

    def check_chat(self, req: ChatCompletionRequest):
        """What a chat body can be refused for before rendering (a ValueError)."""
        return serving_chat.check_chat(self, req)

    async def create_completion(self, req: CompletionRequest, model: str):
        return await serving_completion.create_completion(self, req, model)

    async def create_chat_completion(self, req: ChatCompletionRequest, model: str):
        return await serving_chat.create_chat_completion(self, req, model)

    async def chat_prompt(self, req, template: str | None):
        """A conversation rendered and tokenized without special tokens (/tokenize's
        messages, as a chat completion's are), off the event loop."""
        return await serving_chat.render(self, req, template)

    def as_token_ids(self, req) -> bool:
        """return_tokens_as_token_ids: the request's, else the server's."""
        given = req.return_tokens_as_token_ids
        return self.return_tokens_as_token_ids if given is None else given

    def usage(self, prompt_tokens: int, completion_tokens: int,
              cached_tokens: int | None = None) -> dict:
        return usage(prompt_tokens, completion_tokens,
                     cached_tokens if self.enable_prompt_tokens_details else None)

    def check_fits_context(self, request: ProcessedRequest, param: str) -> None:
        """vLLM's server refuses a request whose prompt plus max_tokens exceeds the context
        (offline, LLM.generate stops at max_model_len instead). Runs as add_requests' check:
        on the input thread, once the prompt is tokenized and before anything is queued."""
        prompt_len, max_tokens = len(request.prompt_token_ids), request.params.max_tokens
        room = self.max_model_len - prompt_len
        if max_tokens > room:
            raise ParameterError(f"{param}={max_tokens} does not fit: the prompt has "
                                 f"{prompt_len} tokens and the model's maximum context length "
                                 f"is {self.max_model_len}, so {param} must be at most {room}.",
                                 param)
