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
