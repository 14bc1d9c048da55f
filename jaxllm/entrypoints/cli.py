"""The `jaxllm` console script: `jaxllm serve [MODEL] [--flags]`, as `vllm serve`.

Owns the command line: the server's flags, one flag per engine argument (generated from
EngineConfig's fields, so every argument `LLM(...)` takes is a flag), and `--config
config.yaml` whose keys are flag names (dashes or underscores); flags given on the command
line win over the file. A bool flag alone means true (`--disable-log-stats`, as vLLM's), or
takes a value (`--enable-prefix-caching false`). Unlike `LLM(...)`, the server logs a stats
line every 10 s unless `--disable-log-stats` (vLLM's defaults for both). Never builds
responses: it starts uvicorn on api_server's app (openai/launcher.py).

Several nodes (jaxllm/distributed/): every node runs the same command with its own
`--node-rank`; node 0 serves the API, the others add `--headless` and only replay its steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import logging
import os
import sys
import typing

from jaxllm.config import EngineConfig
from jaxllm.entrypoints.openai.tool_parsers import ToolParserManager
from jaxllm.entrypoints.vllm_flags import GROUPS, VLLM_FLAGS, apply

SERVER_DEFAULTS = dict(host="0.0.0.0", port=8000, api_key=None, served_model_name=None,
                       chat_template=None, uvicorn_log_level="info", headless=False,
                       trust_request_chat_template=False, max_completion_prompts=1024,
                       enable_auto_tool_choice=False, tool_call_parser=None,
                       enable_request_id_headers=False, enable_server_load_tracking=False,
                       enable_tokenizer_info_endpoint=False, enable_sleep_mode=False,
                       return_tokens_as_token_ids=False, enable_prompt_embeds=False,
                       shutdown_timeout=None, disable_uvicorn_access_log=False, uds=None,
                       root_path=None, ssl_keyfile=None, ssl_certfile=None, ssl_ca_certs=None,
                       ssl_cert_reqs=0, ssl_ciphers=None, allowed_origins=None,
                       allowed_methods=None, allowed_headers=None, allow_credentials=False,
                       disable_fastapi_docs=False, h11_max_incomplete_event_size=None,
                       lora_modules=None)


def _flag_bool(s: str) -> bool:
    return {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}[
        s.lower()]


class _Bool(argparse.Action):
    """`--x` (true), `--x VALUE` (true/false/1/0/yes/no) and, where vLLM has it, `--no-x`."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.setdefault("metavar", "BOOL")
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            value = True if values is None else _flag_bool(values)
        except KeyError:
            raise argparse.ArgumentError(self, f"expected true or false, got {values!r} (a "
                                               "model goes first: jaxllm serve MODEL --flags)")
        setattr(namespace, self.dest, not value if option_string.startswith("--no-") else value)


_SERVER_FLAGS = {  # the server's own flags (dest -> argparse options); bools are _Bool
    "host": {}, "port": dict(type=int), "uds": dict(help="a Unix socket path to serve on"),
    "api_key": dict(nargs="+", help="require one of these keys on /v1 (or set "
                                    "JAXLLM_API_KEY)"),
    "served_model_name": dict(nargs="+", help="the model names clients use (the first one "
                                              "is reported)"),
    "chat_template": dict(help="a Jinja template, or a file holding one"),
    "trust_request_chat_template": dict(help="accept a chat_template in chat requests "
                                             "(rendered in a bounded sandbox process)"),
    "max_completion_prompts": dict(type=int, help="the most prompts one /v1/completions "
                                                  "request may hold (1024)"),
    "enable_auto_tool_choice": dict(help='tool_choice="auto": the model decides when to '
                                         "call tools (needs --tool-call-parser)"),
    "tool_call_parser": dict(help='the parser that reads tool calls out of "auto" outputs: '
                                  "one of " + ", ".join(ToolParserManager.names())),
    "uvicorn_log_level": {},
    "headless": dict(help="a follower node (--node-rank > 0): no API server, it replays the "
                          "leader's steps until the leader shuts down"),
    "config": dict(help="a YAML file of flag: value pairs"),
    "enable_request_id_headers": dict(help="answer with an X-Request-Id header"),
    "enable_server_load_tracking": dict(help="count requests in flight, served on /load"),
    "enable_tokenizer_info_endpoint": dict(help="serve /tokenizer_info"),
    "enable_sleep_mode": dict(help="serve /sleep, /wake_up and /is_sleeping"),
    "return_tokens_as_token_ids": dict(help="logprob tokens as 'token_id:N' by default"),
    "enable_prompt_embeds": dict(help="accept prompt_embeds (a torch.save payload is refused "
                                      "with a 400: jaxllm cannot unpickle it safely)"),
    "shutdown_timeout": dict(type=float, help="seconds to let requests finish on SIGTERM "
                                              "(default 30; 0 aborts them)"),
    "disable_uvicorn_access_log": {}, "root_path": {}, "ssl_keyfile": {}, "ssl_certfile": {},
    "ssl_ca_certs": {}, "ssl_cert_reqs": dict(type=int), "ssl_ciphers": {},
    "allowed_origins": dict(type=json.loads), "allowed_methods": dict(type=json.loads),
    "allowed_headers": dict(type=json.loads), "allow_credentials": {},
    "disable_fastapi_docs": {}, "h11_max_incomplete_event_size": dict(type=int),
    "lora_modules": dict(nargs="+", help='LoRA adapters served by name: name=path, or JSON '
                                         '{"name", "path", "base_model_name"} (needs '
                                         "--enable-lora)"),
}
_SERVER_BOOLS = {k for k, v in SERVER_DEFAULTS.items() if isinstance(v, bool)}


def _engine_flag_type(field: dataclasses.Field):
    hint = typing.get_type_hints(EngineConfig)[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    kind = args[0]
    if kind is bool:
        return _flag_bool
    return kind if kind in (int, float, str) else str


def _own_flag(dest: str) -> dict:
    """argparse options of a flag jaxllm implements (server or engine)."""
    if dest in _SERVER_FLAGS:
        options = dict(_SERVER_FLAGS[dest])
        if dest in _SERVER_BOOLS:
            options["action"] = _Bool
        return options
    field = {f.name: f for f in dataclasses.fields(EngineConfig)}[dest]
    kind = _engine_flag_type(field)
    return dict(action=_Bool) if kind is _flag_bool else dict(type=kind)


@functools.cache  # parsing never changes the parser: built once per process
def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxllm", description="jaxllm: vLLM on JAX/XLA")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="Start the OpenAI-compatible server",
                           usage="jaxllm serve [model_tag] [options]",
                           argument_default=argparse.SUPPRESS)
    serve.add_argument("model_tag", nargs="?",
                       help="HF dir, hub id, .gguf, or a directory LLM.save_sharded_state "
                            "wrote (default: the embedded SmolLM2-135M-Instruct)")
    # Every vLLM flag, in vLLM's groups (vllm_flags.py says what each does here).
    groups = {name: serve.add_argument_group(name) for name in GROUPS if name != "options"}
    groups["options"] = serve  # vLLM's ungrouped flags: argparse's own "options"
    seen = set()
    for flag in VLLM_FLAGS:
        if flag.kind == "impl":
            seen.add(flag.dest)
            options = _own_flag(flag.dest)
        elif flag.arity == "bool":
            options = dict(action=_Bool, help=flag.help)
        else:
            options = dict(nargs="+" if flag.arity == "list" else None, help=flag.help)
        groups[flag.group].add_argument(*flag.option_strings, dest=flag.dest, **options)
    own = serve.add_argument_group("jaxllm", "jaxllm's own settings")
    for dest in [*_SERVER_FLAGS, *(f.name for f in dataclasses.fields(EngineConfig))]:
        if dest not in seen:
            own.add_argument("--" + dest.replace("_", "-"), dest=dest, **_own_flag(dest))
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
    notes = apply(values)  # vLLM's flags jaxllm accepts without effect (or refuses)
    engine_fields = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = set(values) - engine_fields - set(SERVER_DEFAULTS)
    if unknown:
        raise SystemExit(f"jaxllm serve: unknown settings {sorted(unknown)}")
    server = {k: values.get(k, v) for k, v in SERVER_DEFAULTS.items()}
    server["notes"] = notes
    server["api_key"] = _as_list(server["api_key"] or os.environ.get("JAXLLM_API_KEY"))
    server["served_model_name"] = _as_list(server["served_model_name"])
    if server["h11_max_incomplete_event_size"] is None:
        server.pop("h11_max_incomplete_event_size")  # uvicorn's own default
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


def _as_list(value) -> list | None:
    return [value] if isinstance(value, str) else value


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
    from jaxllm.async_llm import AsyncLLM
    from jaxllm.entrypoints.openai.api_server import build_app
    from jaxllm.entrypoints.openai.frontend import FrontendOptions
    from jaxllm.entrypoints.openai.launcher import serve_http
    from jaxllm.models.resolve import DEFAULT_MODEL

    server, config = resolve_args(argv)
    _log_to_stderr()
    if server["headless"]:
        from jaxllm.llm_engine import LLMEngine

        LLMEngine(config, use_tqdm=True)  # returns once the leader has shut down
        return
    for note in server["notes"]:
        logging.getLogger("jaxllm.serve").info("%s", note)
    names = server["served_model_name"] or [config.model or DEFAULT_MODEL]
    app = _pooling_app(config, server) or build_app(
        AsyncLLM(config, use_tqdm=True), served_model_names=names, api_key=server["api_key"],
        chat_template=_chat_template(server["chat_template"]),
        trust_request_chat_template=server["trust_request_chat_template"],
        max_completion_prompts=server["max_completion_prompts"],
        enable_auto_tools=server["enable_auto_tool_choice"],
        tool_parser=server["tool_call_parser"],
        frontend=FrontendOptions.from_settings(server), lora_modules=server["lora_modules"])
    # What startup built (weights, compiled steps, tokenizer: a large heap that lives as
    # long as the server) leaves the collector's view: otherwise every oldest-generation
    # collection walks all of it, a pause of hundreds of milliseconds on the event loop
    # and the engine thread alike. vLLM freezes its API server and engine core the same way.
    gc.collect()
    gc.freeze()
    # SIGINT / SIGTERM: stop accepting, finish in-flight responses (for --shutdown-timeout
    # seconds, 30 by default), then the app's lifespan shuts the engine down; the engine
    # dying stops the server the same way, with exit status 1 (launcher.py).
    timeout = server["shutdown_timeout"]
    status = serve_http(
        app, host=server["host"], port=server["port"], uds=server["uds"],
        log_level=server["uvicorn_log_level"], access_log=not server["disable_uvicorn_access_log"],
        timeout_graceful_shutdown=30 if timeout is None else timeout,
        root_path=server["root_path"] or "", ssl_keyfile=server["ssl_keyfile"],
        ssl_certfile=server["ssl_certfile"], ssl_ca_certs=server["ssl_ca_certs"],
        ssl_cert_reqs=server["ssl_cert_reqs"],
        **({"ssl_ciphers": server["ssl_ciphers"]} if server["ssl_ciphers"] else {}),
        **{k: server[k] for k in ("h11_max_incomplete_event_size",) if k in server})
    if status:
        sys.exit(status)


def _pooling_app(config, server: dict):
    """The pooling server's app when the model is a pooling one (vLLM's runner "auto" reads
    the checkpoint's architecture; --runner pooling / --convert ask for it), else None. Of
    the server's flags it reads the names and API keys; the rest are the generative app's."""
    from jaxllm.pooling.config import wants_pooling_runner

    if not wants_pooling_runner(config.model, config.runner, config.convert):
        return None
    from jaxllm.entrypoints.openai.pooling_server import build_pooling_app
    from jaxllm.models.resolve import DEFAULT_POOLING_MODEL
    from jaxllm.pooling.engine import PoolingEngine

    names = server["served_model_name"] or [config.model or DEFAULT_POOLING_MODEL]
    return build_pooling_app(PoolingEngine(config), served_model_names=names,
                             api_key=server["api_key"])


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


if __name__ == "__main__":
    main()
