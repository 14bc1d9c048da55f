"""StructuredOutputsParams and StructuredOutputsConfig: vLLM's form, exactly one constraint,
and bad input as ValueErrors naming the field (no engine)."""

from __future__ import annotations

import pytest

import jaxllm
import jaxllm.sampling_params
from jaxllm import SamplingParams, StructuredOutputsParams
from jaxllm.config import EngineConfig
from jaxllm.structured_outputs import StructuredOutputsConfig


def test_exported_where_vllm_exports_it():
    assert jaxllm.StructuredOutputsParams is StructuredOutputsParams
    assert jaxllm.sampling_params.StructuredOutputsParams is StructuredOutputsParams


@pytest.mark.parametrize("kwargs, kind", [
    (dict(json={"type": "object"}), "json"),
    (dict(json='{"type": "integer"}'), "json"),
    (dict(regex="[a-z]+"), "regex"),
    (dict(choice=["a", "b"]), "choice"),
    (dict(grammar='start: "x"'), "grammar"),
    (dict(json_object=True), "json_object"),
])
def test_one_constraint(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="only use one kind.*'json', 'regex'"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams(disable_any_whitespace=True)


@pytest.mark.parametrize("kwargs, match", [
    (dict(regex=""), r"structured_outputs.regex must be a non-empty string"),
    (dict(regex=3), r"structured_outputs.regex must be"),
    (dict(choice=[]), r"structured_outputs.choice must be a non-empty list of strings"),
    (dict(choice=["a", 1]), r"structured_outputs.choice must be"),
    (dict(choice="ab"), r"structured_outputs.choice must be"),
    (dict(grammar="  "), r"structured_outputs.grammar must be a non-empty string"),
    (dict(json_object=False), r"structured_outputs.json_object must be True"),
    (dict(json=[1]), r"structured_outputs.json must be a JSON schema"),
    (dict(json="{not json"), r"structured_outputs.json is not valid JSON"),
    (dict(structural_tag="{}"), r"structured_outputs.structural_tag is not supported"),
    (dict(regex="a", disable_any_whitespace=1),
     r"structured_outputs.disable_any_whitespace must be a bool"),
    (dict(json_object=True, whitespace_pattern=3),
     r"structured_outputs.whitespace_pattern must be a string"),
])
def test_bad_params_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_field():
    params = SamplingParams(structured_outputs={"regex": "[0-9]+"})
    assert params.structured_outputs == StructuredOutputsParams(regex="[0-9]+")
    with pytest.raises(ValueError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="[0-9]+")
    with pytest.raises(ValueError, match="only use one kind"):
        SamplingParams(structured_outputs={"regex": "a", "choice": ["a"]})
    # Mutated after construction: checked again when admitted.
    params.structured_outputs.choice = ["x"]
    with pytest.raises(ValueError, match="only use one kind"):
        params.checked_clone()


def test_key_equal_for_equal_schemas():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    b = StructuredOutputsParams(json='{"a": 2, "b": 1}')
    assert a.key == b.key
    assert a.key != StructuredOutputsParams(json={"a": 2, "b": 1},
                                            disable_any_whitespace=True).key


def test_engine_config_backend():
    assert EngineConfig().structured_outputs_config == StructuredOutputsConfig("auto")
    assert EngineConfig(structured_outputs_config={"backend": "guidance"}
                        ).structured_outputs_config.backend == "guidance"
    with pytest.raises(ValueError, match=r"structured_outputs_config.backend must be one of "
                                         r"\('auto', 'guidance'\), got 'xgrammar'"):
        EngineConfig(structured_outputs_config={"backend": "xgrammar"})
    with pytest.raises(ValueError, match="structured_outputs_config accepts the key 'backend'"):
        EngineConfig(structured_outputs_config={"backend": "auto", "other": 1})
    with pytest.raises(ValueError, match="structured_outputs_config must be"):
        EngineConfig(structured_outputs_config="guidance")
