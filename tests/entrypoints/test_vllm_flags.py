"""Every `vllm serve` flag (vLLM 0.32's parser, held as data in jaxllm/entrypoints/
vllm_flags.py) is accepted by `jaxllm serve`: implemented, a logged no-op, or refused with a
clear error naming the flag, its value and why. No server is started here."""

from __future__ import annotations

import contextlib
import io

import pytest

from jaxllm.entrypoints.cli import make_parser, resolve_args
from jaxllm.entrypoints.vllm_flags import GROUPS, VLLM_FLAGS

# The flags the issue named: they exited with "unrecognized arguments" before.
ISSUE_FLAGS = [
    ["--enable-lora", "false"], ["--max-lora-rank", "64"], ["--max-cpu-loras", "2"],
    ["--disable-frontend-multiprocessing"], ["--enable-tokenizer-info-endpoint"],
    ["--enable-chunked-prefill"], ["--show-hidden-metrics-for-version", "0.31"],
    ["--return-tokens-as-token-ids"], ["--enable-request-id-headers"],
    ["--enable-server-load-tracking"], ["--shutdown-timeout", "5"],
    ["--api-server-count", "1"], ["--enable-sleep-mode"], ["--enable-prompt-embeds"],
]


def _sample(flag) -> list[str]:
    """The flag with a value it accepts."""
    name = flag.option_strings[0]
    if flag.kind == "only":
        return [name] if flag.accepted == "true" else [name, flag.accepted]
    return [name] if flag.arity == "bool" else [name, "1"]


def test_the_table_is_vllms_parser_in_its_groups():
    # vLLM 0.32's `vllm serve` parser has 316 flags besides --help; jaxllm keeps one more,
    # --disable-frontend-multiprocessing, which earlier vLLM scripts still pass.
    assert len(VLLM_FLAGS) == 317
    assert GROUPS[:3] == ["options", "Frontend", "ModelConfig"] and "LoRAConfig" in GROUPS
    names = [n for f in VLLM_FLAGS for n in f.option_strings]
    assert len(names) == len(set(names))
    counts = {kind: sum(f.kind == kind for f in VLLM_FLAGS) for kind in ("impl", "noop", "only")}
    refused_always = sum(f.kind == "only" and f.accepted == "" for f in VLLM_FLAGS)
    assert counts == {"impl": 69, "noop": 153, "only": 95}, counts
    assert refused_always == 46


def test_every_unimplemented_flag_is_accepted_with_a_note_or_refused():
    for flag in VLLM_FLAGS:
        name = flag.option_strings[0]
        if flag.kind == "impl":
            continue
        if flag.kind == "only" and flag.accepted == "":
            value = "true" if flag.arity == "bool" else "x"
            with pytest.raises(SystemExit, match=f"jaxllm serve: {name} {value}: "):
                resolve_args([name] if flag.arity == "bool" else [name, "x"])
            continue
        server, _ = resolve_args(_sample(flag))
        assert len(server["notes"]) == 1, name
        assert server["notes"][0].startswith(name + " ")
        assert "accepted, no effect" in server["notes"][0] and flag.why in server["notes"][0]


@pytest.mark.parametrize("args", ISSUE_FLAGS, ids=lambda a: a[0])
def test_the_flags_the_issue_named_start_the_server(args):
    resolve_args(args)  # no "unrecognized arguments"


def test_refusals_name_the_flag_the_value_and_why():
    with pytest.raises(SystemExit, match=r"--api-server-count 2: jaxllm runs one API server "
                                         r"process \(only 1 is accepted\)"):
        resolve_args(["--api-server-count", "2"])
    with pytest.raises(SystemExit, match=r"--lora-target-modules x: not supported: an "
                                         r"adapter applies to every module it targets"):
        resolve_args(["--lora-target-modules", "x"])
    with pytest.raises(SystemExit, match=r"--no-enable-chunked-prefill|--enable-chunked-"
                                         r"prefill false: prefill is always chunked"):
        resolve_args(["--no-enable-chunked-prefill"])
    with pytest.raises(SystemExit, match=r"--pipeline-parallel-size 2: only tensor and data"):
        resolve_args(["-pp", "2"])


def test_a_bool_flag_followed_by_a_word_says_what_it_expected(capsys):
    with pytest.raises(SystemExit):
        resolve_args(["--enable-sleep-mode", "some-model"])
    assert "expected true or false, got 'some-model'" in capsys.readouterr().err


def test_implemented_flags_and_vllm_spellings():
    server, engine = resolve_args([
        "--no-enable-prefix-caching", "-tp", "1", "--served-model-name", "a", "b",
        "--api-key", "k1", "k2", "--enable-sleep-mode", "--shutdown-timeout", "0",
        "--return-tokens-as-token-ids", "--enable-request-id-headers",
        "--allowed-origins", '["http://x"]', "--device-memory-utilization", "0.5",
        "--runner", "pooling", "--convert", "embed"])
    assert engine.enable_prefix_caching is False and engine.gpu_memory_utilization == 0.5
    assert (engine.runner, engine.convert) == ("pooling", "embed")
    assert server["served_model_name"] == ["a", "b"] and server["api_key"] == ["k1", "k2"]
    assert (server["enable_sleep_mode"], server["shutdown_timeout"],
            server["return_tokens_as_token_ids"], server["enable_request_id_headers"],
            server["allowed_origins"]) == (True, 0.0, True, True, ["http://x"])
    assert server["notes"] == []


def test_speculative_config_flag():
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    _, engine = resolve_args(["-sc", spec, "--no-async-scheduling"])
    c = engine.speculative_config
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 3, 4, 4)
    with pytest.raises(ValueError, match="async_scheduling=True cannot run with ngram"):
        resolve_args(["--speculative-config", spec, "--async-scheduling"])
    assert resolve_args(["--speculative-config", spec])[1].async_scheduling is False
    with pytest.raises(ValueError, match="must be a JSON object"):
        resolve_args(["--speculative-config", "{ngram", "--no-async-scheduling"])


def test_a_config_file_takes_vllm_keys_too(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("api-server-count: 1\nenable-chunked-prefill: true\n"
                      "enable_sleep_mode: true\n")
    server, _ = resolve_args(["--config", str(config)])
    assert server["enable_sleep_mode"] is True and len(server["notes"]) == 2
    config.write_text("api-server-count: 2\n")
    with pytest.raises(SystemExit, match="--api-server-count 2: jaxllm runs one"):
        resolve_args(["--config", str(config)])


def test_lora_flags_reach_the_engine_and_the_server():
    server, engine = resolve_args([
        "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8",
        "--lora-dtype", "bfloat16", "--lora-modules", "a=/p",
        '{"name": "b", "path": "/q", "base_model_name": "m"}'])
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank, engine.max_cpu_loras,
            engine.lora_dtype) == (True, 4, 64, 8, "bfloat16")
    assert server["lora_modules"] == ["a=/p", '{"name": "b", "path": "/q", '
                                              '"base_model_name": "m"}']
    assert server["notes"] == []


def test_help_lists_the_flags_in_vllms_groups():
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        make_parser().parse_args(["serve", "--help"])
    text = out.getvalue()
    for group in GROUPS[1:] + ["jaxllm"]:
        assert f"\n{group}:" in text, group
    lora = text[text.index("\nLoRAConfig:"):]
    assert lora.index("--enable-lora") < lora.index("--max-loras") < lora.index("\n\n")
    assert "--max-completion-prompts" in text[text.index("\njaxllm:"):]


def test_serve_hands_the_flags_to_the_app_and_uvicorn(monkeypatch, caplog):
    """`jaxllm serve` with the flags vLLM's entrypoint tests start their servers with: the
    no-ops are logged once each, the rest reach build_app and uvicorn (no engine is built)."""
    import jaxllm.async_llm
    from jaxllm.entrypoints import cli
    from jaxllm.entrypoints.openai import api_server, launcher

    seen = {}
    monkeypatch.setattr(jaxllm.async_llm, "AsyncLLM", lambda config, use_tqdm: "ENGINE")
    monkeypatch.setattr(api_server, "build_app", lambda engine, **kw: seen.update(app=kw))
    monkeypatch.setattr(launcher, "serve_http", lambda app, **kw: seen.update(run=kw) or 0)
    monkeypatch.setattr(cli, "_log_to_stderr", lambda: None)
    monkeypatch.setattr(cli.gc, "freeze", lambda: None)
    caplog.set_level("INFO", logger="jaxllm.serve")
    cli.serve(["m", "--served-model-name", "a", "b", "--api-key", "k",
               "--disable-frontend-multiprocessing", "--api-server-count", "1",
               "--enable-chunked-prefill", "--show-hidden-metrics-for-version", "0.31",
               "--enable-sleep-mode", "--enable-server-load-tracking",
               "--enable-tokenizer-info-endpoint", "--enable-request-id-headers",
               "--return-tokens-as-token-ids", "--enable-prompt-embeds",
               "--shutdown-timeout", "0", "--disable-uvicorn-access-log",
               "--root-path", "/llm", "--disable-fastapi-docs"])
    assert sorted(r.getMessage().split(":")[0] for r in caplog.records) == [
        "--api-server-count 1", "--disable-frontend-multiprocessing true",
        "--enable-chunked-prefill true", "--show-hidden-metrics-for-version 0.31"]
    app = seen["app"]
    assert (app["served_model_names"], app["api_key"]) == (["a", "b"], ["k"])
    frontend = app["frontend"]
    assert (frontend.enable_sleep_mode, frontend.enable_server_load_tracking,
            frontend.enable_tokenizer_info_endpoint, frontend.enable_request_id_headers,
            frontend.return_tokens_as_token_ids, frontend.enable_prompt_embeds,
            frontend.disable_fastapi_docs) == (True,) * 7
    run = seen["run"]
    assert (run["timeout_graceful_shutdown"], run["access_log"], run["root_path"]) == (
        0.0, False, "/llm")
