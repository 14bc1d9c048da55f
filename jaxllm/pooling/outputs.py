"""What LLM.encode / embed / classify / score hand back (vLLM's classes, names and fields).

Plain containers; `data` is a float32 numpy array (vLLM's is a torch tensor: jaxllm never
imports torch at run time).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np


@dataclasses.dataclass
class PoolingOutput:
    data: np.ndarray


@dataclasses.dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    num_cached_tokens: int = 0
    finished: bool = True


@dataclasses.dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "EmbeddingOutput":
        if output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D embedding vector")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass
class ClassificationOutput:
    probs: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> "ClassificationOutput":
        if output.data.ndim != 1:
            raise ValueError("pooled_data should be a 1-D probability vector")
        return ClassificationOutput(output.data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> "ScoringOutput":
        if output.data.ndim != 0 and output.data.size != 1:
            raise ValueError("pooled_data should be a scalar score")
        return ScoringOutput(float(output.data.reshape(-1)[0]))


class EmbeddingRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return EmbeddingRequestOutput(**_fields(request_output, EmbeddingOutput))


class ClassificationRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return ClassificationRequestOutput(**_fields(request_output, ClassificationOutput))


class ScoringRequestOutput(PoolingRequestOutput):
    @staticmethod
    def from_base(request_output: PoolingRequestOutput) -> "ScoringRequestOutput":
        return ScoringRequestOutput(**_fields(request_output, ScoringOutput))


def _fields(request_output: PoolingRequestOutput, kind) -> dict:
    """The request output's fields, its PoolingOutput read as `kind`."""
    fields = {f.name: getattr(request_output, f.name)
              for f in dataclasses.fields(PoolingRequestOutput)}
    return dict(fields, outputs=kind.from_base(request_output.outputs))


__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "PoolingOutput", "PoolingRequestOutput", "ScoringOutput",
           "ScoringRequestOutput"]
