"""Loading a Hugging Face fast tokenizer, from a model directory / hub id or from a GGUF file.

Owns: turning GGUF tokenizer metadata into a `PreTrainedTokenizerFast` that encodes exactly like
transformers' own GGUF loader. Must never import torch: transformers'
`from_pretrained(gguf_file=...)` reads the file through a torch-based reader, so we read the
metadata with the `gguf` package and call only transformers' torch-free converter.
"""

from __future__ import annotations

import logging
import os
from typing import Any


class _NoTorchAdvisory(logging.Filter):
    """Drops the one line transformers logs on import when torch is missing ("PyTorch was not
    found. Models won't be available..."): jaxllm uses only its tokenizers, which need no torch."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("PyTorch was not found.")


# On transformers' own logger, where that line is logged, and before the first import.
logging.getLogger("transformers").addFilter(_NoTorchAdvisory())

import transformers  # noqa: E402


# Gemma's chat turns, for Gemma GGUF files that carry no template (the Gemma 3 270M one does
# not; llama.cpp falls back to the same format): a system message opens the first user turn
# (Gemma has no system role), the assistant's turns are "model" turns.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') "
    "| join('\n\n') -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = content | trim + '\n\n' -%}"
    "{%- else -%}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role'])"
    " + '\n' + ns.system + content | trim + '<end_of_turn>\n' }}"
    "{%- set ns.system = '' -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
_FALLBACK_CHAT_TEMPLATES = {"gemma": GEMMA_CHAT_TEMPLATE, "gemma2": GEMMA_CHAT_TEMPLATE,
                            "gemma3": GEMMA_CHAT_TEMPLATE}


def get_tokenizer(path_or_id: str | os.PathLike, *, gguf_file: str | os.PathLike | None = None,
                  trust_remote_code: bool = False) -> transformers.PreTrainedTokenizerFast:
    """The tokenizer of a model.

    gguf_file: a GGUF file name, absolute or relative to `path_or_id`; when given, the tokenizer
    is built from the file's metadata. Otherwise `path_or_id` is a directory or hub id for
    `AutoTokenizer`. A `path_or_id` that is itself a `.gguf` file is accepted too.
    """
    path = os.fspath(path_or_id)
    if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
        return tokenizer_from_gguf(path)
    if gguf_file is not None:
        gguf_path = os.fspath(gguf_file)
        if not os.path.isabs(gguf_path):
            gguf_path = os.path.join(path, gguf_path)
        return tokenizer_from_gguf(gguf_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        path, trust_remote_code=trust_remote_code)
    if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
        raise ValueError(f"{path!r} has no fast tokenizer (got {type(tokenizer).__name__}); "
                         "jaxllm's detokenizer needs one.")
    return tokenizer


def saved_tokenizer(directory: str) -> transformers.PreTrainedTokenizerFast:
    """A fast tokenizer jaxllm saved itself (a converted GGUF's copy), loaded directly:
    AutoTokenizer's path imports torch when it is installed (transformers'
    configuration_utils), about 300 MiB of memory jaxllm never uses."""
    return transformers.PreTrainedTokenizerFast.from_pretrained(directory)


def tokenizer_from_gguf(gguf_path: str, reader: Any = None) -> transformers.PreTrainedTokenizerFast:
    """Build the fast tokenizer a GGUF file describes (no torch).

    reader: the same file already open (models/gguf.py `open_gguf`), to share with the weight
    loader.
    """
    # Imported here: the converter module pulls in several tokenizer classes we only need for GGUF.
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    architecture, tokenizer_dict, tokenizer_config = read_gguf_tokenizer_metadata(gguf_path, reader)
    backend, extra_kwargs = convert_gguf_tokenizer(architecture, tokenizer_dict)
    kwargs = {key: value for key, value in tokenizer_config.items() if value is not None}
    kwargs.update(extra_kwargs)
    # add_bos_token/add_eos_token are passed explicitly (False when the file is silent), so the
    # post-processor is rebuilt to match them instead of keeping whatever the converter left.
    kwargs.setdefault("add_bos_token", False)
    kwargs.setdefault("add_eos_token", False)
    if "chat_template" not in kwargs and architecture in _FALLBACK_CHAT_TEMPLATES:
        kwargs["chat_template"] = _FALLBACK_CHAT_TEMPLATES[architecture]
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)


def read_gguf_tokenizer_metadata(
        gguf_path: str, reader: Any = None) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, tokenizer_dict, tokenizer_config) in the layout transformers' converter takes.

    Mirrors transformers' `get_gguf_tokenizer`, which we cannot call (its reader imports torch):
    the same key renames (we import transformers' table so both stay in sync), the same default
    for old sentencepiece files, and special tokens given as strings.
    """
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING

    from jaxllm.models.gguf import open_gguf  # noqa: PLC0415  (heavy; only for GGUF files)

    if reader is None:
        reader = open_gguf(gguf_path)  # a corrupt file raises an error that names it

    value = reader.get

    architecture = value("general.architecture")
    grouped: dict[str, dict[str, Any]] = {}
    for group, renames in GGUF_TOKENIZER_MAPPING.items():
        grouped[group] = {}
        for key, name in renames.items():
            found = value(f"tokenizer.{key}")
            if found is not None:
                grouped[group][name] = found
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"{gguf_path} has no tokenizer.ggml.tokens: it carries no tokenizer.")

    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary whose file does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        # The reference tokenizer adds no BOS here: the chat template writes it (transformers does
        # the same override).
        tokenizer_config["add_bos_token"] = False

    tokens = tokenizer_dict["tokens"]
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = value(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokens[token_id] if token_id is not None else None
    return architecture, tokenizer_dict, tokenizer_config
