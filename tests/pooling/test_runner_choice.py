"""Which runner a model gets (vLLM's runner "auto", convert and the task alias), and which
pooling model and pooler a checkpoint becomes, from config files alone (no weights)."""

from __future__ import annotations

import json

import pytest

from jaxllm.models.resolve import DEFAULT_POOLING_MODEL
from jaxllm.pooling.config import (read_pooling_model, runner_and_convert,
                                   wants_pooling_runner)

QWEN3 = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)


def write(folder, **config):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_auto_reads_the_architecture(tmp_path):
    bert = write(tmp_path / "b", architectures=["BertForSequenceClassification"], **QWEN3)
    causal = write(tmp_path / "c", architectures=["Qwen3ForCausalLM"], **QWEN3)
    assert wants_pooling_runner(bert, "auto", "auto")
    assert not wants_pooling_runner(causal, "auto", "auto")
    assert wants_pooling_runner(causal, "auto", "embed")
    assert not wants_pooling_runner(bert, "generate", "auto")
    assert wants_pooling_runner(DEFAULT_POOLING_MODEL, "auto", "auto")
    assert not wants_pooling_runner("no/such-model-anywhere", "auto", "auto")
    assert not wants_pooling_runner(None, "auto", "auto")  # the default generative model


def test_task_alias():
    assert runner_and_convert("embed", "auto", "auto") == ("pooling", "embed")
    assert runner_and_convert("score", "auto", "auto") == ("pooling", "classify")
    assert runner_and_convert("generate", "auto", "auto") == ("generate", "auto")
    with pytest.raises(ValueError, match="task must be one of"):
        runner_and_convert("reward!", "auto", "auto")


def test_pooling_models_of_a_qwen3_checkpoint(tmp_path):
    hf = dict(architectures=["Qwen3ForCausalLM"], **QWEN3)
    cfg, pooler = read_pooling_model(str(tmp_path), hf, "embed")
    assert (cfg.architecture, cfg.qk_norm, pooler.pooling_type, pooler.normalize) == (
        "Qwen3Model", True, "LAST", True)
    cfg, pooler = read_pooling_model(
        str(tmp_path), dict(hf, architectures=["Qwen3ForSequenceClassification"],
                            id2label={"0": "no"}), "auto")
    assert (cfg.num_labels, pooler.pooling_type, pooler.activation) == (1, "LAST", "sigmoid")
    with pytest.raises(ValueError, match="not a pooling model; pass convert='embed'"):
        read_pooling_model(str(tmp_path), hf, "auto")
    with pytest.raises(ValueError, match="convert='embed' is supported for"):
        read_pooling_model(str(tmp_path), dict(hf, architectures=["GPT2LMHeadModel"]),
                           "embed")


def test_sentence_transformers_files_choose_the_pooling(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    pooling = tmp_path / "1_Pooling" / "config.json"
    pooling.write_text(json.dumps({"pooling_mode_cls_token": True}))
    hf = dict(architectures=["BertModel"], type_vocab_size=2, **QWEN3)
    _, pooler = read_pooling_model(str(tmp_path), hf, "auto")
    assert (pooler.pooling_type, pooler.normalize) == ("CLS", False)  # no Normalize module
    pooling.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_pooling_model(str(tmp_path), hf, "auto")


def test_pooler_config_overrides_as_vllm_names_them(tmp_path):
    from jaxllm.entrypoints.cli import resolve_args

    hf = dict(architectures=["Qwen3ForCausalLM"], **QWEN3)
    _, engine = resolve_args(["m", "--pooler-config",
                              '{"task": "token_embed", "pooling_type": "mean"}'])
    cfg, pooler = read_pooling_model(str(tmp_path), hf, "embed", engine.pooler_config)
    assert (pooler.pooling_task, pooler.per_token, pooler.pooling_type) == (
        "token_embed", True, "MEAN")
    _, pooler = read_pooling_model(str(tmp_path), hf, "classify", {"use_activation": False})
    assert (pooler.pooling_task, pooler.use_activation) == ("classify", False)
    with pytest.raises(ValueError, match=r"task must be one of \['token_embed', 'embed'\]"):
        read_pooling_model(str(tmp_path), hf, "embed", {"task": "classify"})
    with pytest.raises(ValueError, match="pooler_config must be a JSON object"):
        read_pooling_model(str(tmp_path), hf, "embed", "{task")
