"""Tool-call parsers for `tool_choice="auto"`, by the name `--tool-call-parser` takes.

Importing the package registers every parser with ToolParserManager.
"""

from jaxllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    DeltaMessage, DeltaToolCall, ExtractedToolCallInformation, FunctionCall, ToolParser,
    ToolParserManager)
from jaxllm.entrypoints.openai.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from jaxllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from jaxllm.entrypoints.openai.tool_parsers.pythonic_tool_parser import PythonicToolParser

__all__ = ["DeltaMessage", "DeltaToolCall", "ExtractedToolCallInformation", "FunctionCall",
           "Hermes2ProToolParser", "Llama3JsonToolParser", "PythonicToolParser", "ToolParser",
           "ToolParserManager"]
