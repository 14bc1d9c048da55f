"""The `jaxllm` console script: `jaxllm serve [MODEL] [--flags]`, as `vllm serve`.

Owns the command line: the server's flags, one flag per engine argument (generated from
EngineConfig's fields, so every argument `LLM(...)` takes is a flag), and `--config
config.yaml` whose keys are flag names (dashes or underscores); flags given on the command
line win over the file. A bool flag alone means true (`--disable-log-stats`, as vLLM's), or
takes a value (`--enable-prefix-caching false`). Unlike `LLM(...)`, the server logs a stats
line every 10 s unless `--disable-log-stats` (vLLM's defaults for both). Never builds
responses: it starts uvicorn on api_server's app.

Several nodes (jaxllm/distributed/): every node runs the same command with its own
`--node-rank`; node 0 serves the API, the others add `--headless` and only replay its steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys
import typing

from jaxllm.config import EngineConfig
from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager

SERVER_DEFAULTS = dict(host="0.0.0.0", port=8000, api_key=None, served_model_name=None,
                       chat_template=None, uvicorn_log_level="info", headless=False,
                       trust_request_chat_template=False, max_completion_prompts=1024,
                       enable_auto_tool_choice=False, tool_call_parser=None)


def _flag_bool(s: str) -> bool:
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[
        s.lower()]


def _engine_flag_type(field: dataclasses.Field):
    hint = typing.get_type_hints(EngineConfig)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = args[0]
    if kind is bool:
        return _flag_bool
    return kind if kind in (int, float, str) else str


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="jaxllm: vLLM on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Start the OpenAI-compatible server",
                           argument_default=argparse.SUPPRESS)
    serve.add_argument("model_tag", nargs="?",
                       help="HF dir, hub id, .gguf, or a directory LLM.save_sharded_state "
                            "wrote (default: the embedded SmolLM2-135M-Instruct)")
    serve.add_argument("--config", help="a YAML file of flag: value pairs")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--api-key", help="require this key (or set JAXLLM_API_KEY)")
    serve.add_argument("--served-model-name", help="the model name clients use")
    serve.add_argument("--chat-template", help="a Jinja template, or a file holding one")
    serve.add_argument("--trust-request-chat-template", type=_flag_bool, nargs="?",
                       const=True, help="accept a chat_template in chat requests (rendered "
                                        "in a bounded sandbox process); refused otherwise")
    serve.add_argument("--max-completion-prompts", type=int,
                       help="the most prompts one /v1/completions request may hold (1024)")
    serve.add_argument("--enable-auto-tool-choice", type=_flag_bool, nargs="?", const=True,
                       help='tool_choice="auto": the model decides when to call tools (needs '
                            "--tool-call-parser)")
    serve.add_argument("--tool-call-parser",
                       help='the parser that reads tool calls out of "auto" outputs: one of '
                            + ", ".join(ToolParserManager.names()))
    serve.add_argument("--uvicorn-log-level")
    serve.add_argument("--headless", action="store_true",
                       help="a follower node (--node-rank > 0): no API server, it replays the "
                            "leader's steps until the leader shuts down")
    for field in dataclasses.fields(EngineConfig):
        kind = _engine_flag_type(field)
        bare = dict(nargs="?", const=True) if field.type in (bool, "bool") else {}
        serve.add_argument("--" + field.name.replace("_", "-"), type=kind, dest=field.name,
                           **bare)
    return parser


def resolve_args(argv: list[str]) -> tuple[dict, EngineConfig]:
    """`serve` arguments (after the word serve) -> (server settings, engine config):
    defaults < config file < command line."""
    parsed = vars(make_parser().parse_args(["serve", *argv]))
    values: dict = {"disable_log_stats": False}  # the EngineConfig default, stated here
    if "config" in parsed:
        values.update(_read_config(parsed.pop("config")))
    parsed.pop("command")
    if "model_tag" in parsed:
        parsed["model"] = parsed.pop("model_tag")
    values.update(parsed)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = set(values) - engine_fields - set(SERVER_DEFAULTS)
    if unknown:
        raise SystemExit(f"jaxllm serve: unknown settings {sorted(unknown)}")
    server = {k: values.get(k, v) for k, v in SERVER_DEFAULTS.items()}
    server["api_key"] = server["api_key"] or os.environ.get("JAXLLM_API_KEY")
    config = EngineConfig(**{k: v for k, v in values.items() if k in engine_fields})
    # As vLLM's: the leader serves the API, every other node runs headless.
    if server["headless"] and config.node_rank == 0:
        raise SystemExit("jaxllm serve: --headless is for the followers (--node-rank > 0); "
                         "node 0 serves the API")
    if server["enable_auto_tool_choice"] and server["tool_call_parser"] is None:
        raise SystemExit("jaxllm serve: --enable-auto-tool-choice needs --tool-call-parser")
    if server["tool_call_parser"] is not None:
        try:
            ToolParserManager.get_tool_parser(server["tool_call_parser"])
        except ValueError as e:
            raise SystemExit(f"jaxllm serve: {e}") from None
    if config.node_rank > 0 and not server["headless"]:
        raise SystemExit(f"jaxllm serve: --node-rank {config.node_rank} serves no API; add "
                         "--headless")
    return server, config


def _read_config(path: str) -> dict:
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise SystemExit(f"jaxllm serve: {path} must hold a mapping of flag: value pairs")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def _chat_template(value: str | None) -> str | None:
    if value is not None and os.path.isfile(value):
        with open(value) as f:
            return f.read()
    return value


def serve(argv: list[str]) -> None:
    import uvicorn

    from jaxllm.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app
    from jaxllm.models.resolve import DEFAULT_MODEL

    server, config = resolve_args(argv)
    _log_to_stderr()
    if server["headless"]:
        from jaxllm.llm_engine import LLMEngine

        LLMEngine(config, use_tqdm=True)  # returns once the leader has shut down
        return
    engine = AsyncLLM(config, use_tqdm=True)
    name = server["served_model_name"] or config.model or DEFAULT_MODEL
    app = build_app(engine, served_model_names=[name], api_key=server["api_key"],
                    chat_template=_chat_template(server["chat_template"]),
                    trust_request_chat_template=server["trust_request_chat_template"],
                    max_completion_prompts=server["max_completion_prompts"],
                    enable_auto_tools=server["enable_auto_tool_choice"],
                    tool_parser=server["tool_call_parser"])
    # What startup built (weights, compiled steps, tokenizer: a large heap that lives as
    # long as the server) leaves the collector's view: otherwise every oldest-generation
    # collection walks all of it, a pause of hundreds of milliseconds on the event loop
    # and the engine thread alike. vLLM freezes its API server and engine core the same way.
    gc.collect()
    gc.freeze()
    # uvicorn handles SIGINT / SIGTERM: stop accepting, finish in-flight responses, then the
    # app's lifespan shuts the engine down.
    uvicorn.run(app, host=server["host"], port=server["port"],
                log_level=server["uvicorn_log_level"], timeout_graceful_shutdown=30)


def _log_to_stderr() -> None:
    """jaxllm's INFO lines (model load, the stats line) on stderr, as vLLM's server shows
    its own; left alone if the user configured the "jaxllm" logger."""
    jaxllm_logger = logging.getLogger("jaxllm")
    if not jaxllm_logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        jaxllm_logger.addHandler(handler)
        jaxllm_logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        serve(argv[1:])
    else:
        make_parser().parse_args(argv)  # prints usage / errors


__all__ = ["main", "resolve_args"]
