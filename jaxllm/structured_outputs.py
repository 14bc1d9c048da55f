"""What a user may ask to constrain an output to, and the engine's structured-outputs setting.

Owns `StructuredOutputsParams` (vLLM's current form: exactly one of json, regex, choice,
grammar, json_object, structural_tag, plus the JSON options) and `StructuredOutputsConfig`
(the engine's backend). Checks shapes and types only: whether a schema, regex or grammar
compiles is the backend's question (jaxllm/engine/structured_output.py), asked at admission.
Imports no layer and never compiles anything.
"""

from __future__ import annotations

import dataclasses
import json as json_module
from typing import Any

# The backends an engine may be asked for: "auto" picks "guidance" (llguidance), the only one.
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance")
# The constraint kinds, in vLLM's order; exactly one is set.
CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclasses.dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's StructuredOutputsParams).

    json: a JSON schema (a dict, or its JSON text); regex: a pattern the whole output
    matches (Rust regex syntax); choice: the output is one of these strings; grammar: a Lark
    or GBNF grammar; json_object=True: any JSON object. disable_any_whitespace: JSON with no
    whitespace between tokens; disable_additional_properties: objects of a schema that does
    not say otherwise get no keys beyond their `properties`; whitespace_pattern: the regex
    of the whitespace JSON may hold. structural_tag is vLLM's field, refused here (the
    guidance backend in jaxllm does not implement it)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_kinds = [k for k in CONSTRAINT_KINDS if getattr(self, k) is not None]
        if len(set_kinds) > 1:
            raise ValueError("You can only use one kind of structured outputs constraint but "
                             f"multiple are specified: {set_kinds}")
        if not set_kinds:
            raise ValueError("You must use one kind of structured outputs constraint but none "
                             f"are specified: set one of {CONSTRAINT_KINDS}")
        for name in ("disable_fallback", "disable_any_whitespace",
                     "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs.{name} must be a bool, got "
                                 f"{type(getattr(self, name)).__name__}")
        if isinstance(self.choice, tuple):
            self.choice = list(self.choice)
        checks = {
            "json": lambda v: isinstance(v, (str, dict)),
            "regex": lambda v: isinstance(v, str) and v != "",
            "choice": lambda v: isinstance(v, list) and v and all(
                isinstance(c, str) for c in v),
            "grammar": lambda v: isinstance(v, str) and v.strip() != "",
            "json_object": lambda v: v is True,
            "structural_tag": lambda v: isinstance(v, str),
        }
        allowed = {"json": "a JSON schema (dict or JSON text)", "regex": "a non-empty string",
                   "choice": "a non-empty list of strings", "grammar": "a non-empty string",
                   "json_object": "True", "structural_tag": "a string"}
        kind = set_kinds[0]
        if not checks[kind](getattr(self, kind)):
            raise ValueError(f"structured_outputs.{kind} must be {allowed[kind]}, got "
                             f"{getattr(self, kind)!r:.80}")
        if self.whitespace_pattern is not None and not isinstance(self.whitespace_pattern, str):
            raise ValueError("structured_outputs.whitespace_pattern must be a string or None, "
                             f"got {type(self.whitespace_pattern).__name__}")
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported; allowed "
                             "constraints: json, regex, choice, grammar, json_object")
        if isinstance(self.json, str):
            try:
                json_module.loads(self.json)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise ValueError(f"structured_outputs.json is not valid JSON: "
                                 f"{type(e).__name__}: {e}") from None

    @property
    def kind(self) -> str:
        """Which constraint is set: one of CONSTRAINT_KINDS."""
        return next(k for k in CONSTRAINT_KINDS if getattr(self, k) is not None)

    @property
    def key(self) -> tuple:
        """(kind, spec, options): equal for constraints that compile to the same grammar."""
        spec: Any = getattr(self, self.kind)
        if isinstance(spec, (dict, list)) or self.kind == "json":
            spec = json_module.dumps(spec if not isinstance(spec, str)
                                     else json_module.loads(spec), sort_keys=True)
        return (self.kind, spec, self.disable_any_whitespace,
                self.disable_additional_properties, self.whitespace_pattern)


@dataclasses.dataclass(frozen=True)
class StructuredOutputsConfig:
    """The engine's structured outputs (vLLM's StructuredOutputsConfig): which backend
    compiles and fills the masks."""

    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of "
                             f"{STRUCTURED_OUTPUTS_BACKENDS}, got {self.backend!r}")


__all__ = ["StructuredOutputsParams", "StructuredOutputsConfig", "STRUCTURED_OUTPUTS_BACKENDS"]
