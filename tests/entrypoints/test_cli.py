"""`jaxllm serve` flags: built from EngineConfig's fields (no server is started here)."""

import pytest

from jaxllm.entrypoints.cli import resolve_args


def test_server_logs_stats_unless_disable_log_stats():
    assert resolve_args([])[1].disable_log_stats is False  # vLLM's server default
    assert resolve_args(["--disable-log-stats"])[1].disable_log_stats is True
    assert resolve_args(["--disable-log-stats", "false"])[1].disable_log_stats is False


def test_scheduling_policy_flag(tmp_path):
    assert resolve_args([])[1].scheduling_policy == "fcfs"
    assert resolve_args(["--scheduling-policy", "priority"])[1].scheduling_policy == "priority"
    config = tmp_path / "c.yaml"
    config.write_text("scheduling-policy: priority\ndisable-log-stats: true\n")
    _, engine = resolve_args(["--config", str(config)])
    assert (engine.scheduling_policy, engine.disable_log_stats) == ("priority", True)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        resolve_args(["--scheduling-policy", "lifo"])


def test_bool_flags_alone_or_with_a_value():
    _, engine = resolve_args(["some-model", "--enforce-eager", "--enable-prefix-caching",
                              "false"])
    assert (engine.model, engine.enforce_eager, engine.enable_prefix_caching) == (
        "some-model", True, False)


def test_data_parallel_size_flag():
    assert resolve_args([])[1].data_parallel_size == 1
    _, engine = resolve_args(["--data-parallel-size", "2", "--tensor-parallel-size", "4"])
    assert (engine.data_parallel_size, engine.tensor_parallel_size) == (2, 4)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1, got 0"):
        resolve_args(["--data-parallel-size", "0"])


def test_multi_node_flags_and_headless_followers():
    args = ["--tensor-parallel-size", "16", "--nnodes", "2", "--master-addr", "10.0.0.1",
            "--master-port", "12345"]
    server, engine = resolve_args(args)
    assert (engine.nnodes, engine.node_rank, engine.master_addr, engine.master_port,
            server["headless"]) == (2, 0, "10.0.0.1", 12345, False)
    server, engine = resolve_args(args + ["--node-rank", "1", "--headless"])
    assert (engine.node_rank, server["headless"]) == (1, True)
    with pytest.raises(SystemExit, match="--node-rank 1 serves no API; add --headless"):
        resolve_args(args + ["--node-rank", "1"])
    with pytest.raises(SystemExit, match="--headless is for the followers"):
        resolve_args(args + ["--headless"])
    with pytest.raises(ValueError, match=r"node_rank must be in \[0, nnodes=2\), got 2"):
        resolve_args(args + ["--node-rank", "2", "--headless"])
    with pytest.raises(ValueError, match="data_parallel_size .2. > 1 with nnodes .2. > 1 is "
                                         "not supported"):
        resolve_args(args + ["--data-parallel-size", "2"])


def test_a_headless_follower_builds_the_engine_and_serves_no_api(monkeypatch):
    import uvicorn

    import jaxllm.llm_engine
    from jaxllm.entrypoints import cli
    from jaxllm.entrypoints.openai import launcher

    built = []
    monkeypatch.setattr(jaxllm.llm_engine, "LLMEngine",
                        lambda config, use_tqdm: built.append(config))
    for module, name in ((uvicorn, "run"), (uvicorn.Server, "run"), (launcher, "serve_http")):
        monkeypatch.setattr(module, name, lambda *a, **k: pytest.fail("a follower served"))
    monkeypatch.setattr(cli, "_log_to_stderr", lambda: None)  # leave the logger alone
    cli.serve(["m", "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
               "--headless"])
    assert [(c.model, c.nnodes, c.node_rank) for c in built] == [("m", 2, 1)]


def test_hardening_flags():
    server, engine = resolve_args([])
    assert (server["trust_request_chat_template"], server["max_completion_prompts"],
            engine.max_n_sequences) == (False, 1024, 16384)  # vLLM's defaults
    server, engine = resolve_args(["--trust-request-chat-template", "--max-completion-prompts",
                                   "8", "--max-n-sequences", "4"])
    assert (server["trust_request_chat_template"], server["max_completion_prompts"],
            engine.max_n_sequences) == (True, 8, 4)
    assert resolve_args(["--trust-request-chat-template", "false"])[0][
        "trust_request_chat_template"] is False
    with pytest.raises(ValueError, match="max_n_sequences must be >= 1"):
        resolve_args(["--max-n-sequences", "0"])


def test_auto_tool_choice_flags():
    server, _ = resolve_args([])
    assert (server["enable_auto_tool_choice"], server["tool_call_parser"]) == (False, None)
    server, _ = resolve_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (server["enable_auto_tool_choice"], server["tool_call_parser"]) == (True, "hermes")
    with pytest.raises(SystemExit, match="--enable-auto-tool-choice needs --tool-call-parser"):
        resolve_args(["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit) as e:
        resolve_args(["--enable-auto-tool-choice", "--tool-call-parser", "mistral"])
    assert str(e.value) == ("jaxllm serve: invalid tool_call_parser: 'mistral' (choose from "
                            "hermes, llama3_json, llama4_json, pythonic)")
