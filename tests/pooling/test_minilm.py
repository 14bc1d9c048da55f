"""The default pooling model, all-MiniLM-L6-v2 (the packaged zip), against sentence-transformers
on the same files: embeddings, normalize off, truncation, score pairing, and the refusals.

One engine for the package (conftest.py); sentence-transformers runs in
float32 on torch CPU, as jaxllm does here.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxllm import LLM, EmbeddingRequestOutput, PoolingParams, ScoringRequestOutput
from jaxllm.models.resolve import DEFAULT_POOLING_MODEL
from jaxllm.pooling.config import runner_and_convert

WORDS = ("the quick brown fox jumps over a lazy dog while seven tired sailors sing about "
         "distant harbours, old lanterns and rain falling on quiet northern hills").split()
# 64 sentences of 3..30 words (about 5..40 tokens), different lengths in every step.
SENTENCES = [" ".join(WORDS[(i * 7) % 11:(i * 7) % 11 + 3 + (i * 5) % 20]).capitalize() + "."
             for i in range(64)]


@pytest.fixture(scope="module")
def llm(minilm):
    return minilm


@pytest.fixture(scope="module")
def st_model(llm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(llm.llm_engine.resolved_model.path, device="cpu")


def cosines(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_default_is_the_packaged_minilm(llm):
    engine = llm.llm_engine
    assert engine.resolved_model.name == DEFAULT_POOLING_MODEL
    assert engine.model_config.architecture == "BertModel"
    cfg = engine.pooler_config
    assert (cfg.task, cfg.pooling_type, cfg.normalize) == ("embed", "MEAN", True)
    assert runner_and_convert("embed", "auto", "auto") == ("pooling", "embed")


def test_embeddings_equal_sentence_transformers(llm, st_model):
    outs = llm.embed(SENTENCES)
    assert all(isinstance(o, EmbeddingRequestOutput) for o in outs)
    ours = np.array([o.outputs.embedding for o in outs])
    ref = st_model.encode(SENTENCES, batch_size=64)
    assert ours.shape == ref.shape == (64, 384)
    assert cosines(ours, ref).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    # Token ids give the same rows as the text they came from.
    ids = [o.prompt_token_ids for o in outs[:3]]
    again = llm.embed(ids)
    np.testing.assert_allclose([o.outputs.embedding for o in again], ours[:3], atol=1e-6)
    # Every bucket was compiled at start-up, and serving compiled nothing more.
    runner = llm.llm_engine.runner
    assert runner.num_compiles == len(runner.buckets.token_buckets) == 5


def test_normalize_off_is_the_mean_pooled_row(llm, st_model):
    from sentence_transformers import SentenceTransformer

    unnormalized = SentenceTransformer(modules=[st_model[0], st_model[1]], device="cpu")
    ours = llm.embed(SENTENCES[:5], pooling_params=PoolingParams(normalize=False))
    ref = unnormalized.encode(SENTENCES[:5])
    np.testing.assert_allclose([o.outputs.embedding for o in ours], ref, atol=1e-5, rtol=1e-5)
    assert np.linalg.norm(ref, axis=1).min() > 1.5  # the test would see a normalized row


def test_truncate_prompt_tokens_matches_truncation_in_sentence_transformers(llm, st_model):
    long_text = " ".join(WORDS * 8)  # ~200 tokens
    with pytest.raises(ValueError, match="longer than the model's maximum context length"):
        llm.embed(long_text)
    out = llm.embed(long_text, pooling_params=PoolingParams(truncate_prompt_tokens=20))[0]
    assert len(out.prompt_token_ids) == 20 and out.prompt_token_ids[-1] == 102  # [SEP] kept
    st_model.max_seq_length = 20
    try:
        ref = st_model.encode([long_text])[0]
    finally:
        st_model.max_seq_length = 256
    assert cosines(out.outputs.embedding, ref) >= 0.99999


def test_score_pairs_as_vllm(llm):
    texts = SENTENCES[:4]
    embs = np.array([o.outputs.embedding for o in llm.embed(texts)])
    one_to_n = llm.score(texts[0], texts[1:])
    assert all(isinstance(s, ScoringRequestOutput) for s in one_to_n)
    np.testing.assert_allclose([s.outputs.score for s in one_to_n],
                               cosines(embs[0], embs[1:]), atol=1e-6)
    n_to_n = llm.score(texts[:2], texts[2:])
    np.testing.assert_allclose([s.outputs.score for s in n_to_n],
                               cosines(embs[:2], embs[2:]), atol=1e-6)
    assert len(llm.score(texts[0], texts[1])) == 1
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(texts[:2], texts[:3])


def test_refusals(llm):
    with pytest.raises(ValueError, match=r"LLM.generate\(\) is only supported for generative"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed("hello", pooling_params=PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="Classification API is not supported by this model"):
        llm.classify("hello")
    with pytest.raises(ValueError, match="pooling_task is required"):
        llm.encode("hello")
    with pytest.raises(ValueError, match=r"Unsupported task: 'encode' Supported tasks: "
                                         r"\['token_embed', 'embed'\]"):
        llm.encode("hello", pooling_task="encode")
    with pytest.raises(ValueError, match="this engine pools 'embed'; for 'token_embed', try "
                                         "switching the model's pooling_task via pooler_config"):
        llm.encode("hello", pooling_task="token_embed")
    with pytest.raises(ValueError, match=r"pooler_config fields \['dimensions'\] are not "
                                         r"supported"):
        LLM(runner="pooling", pooler_config={"dimensions": 8})
    with pytest.raises(ValueError, match="pooler_config applies to pooling models"):
        LLM(pooler_config={"task": "embed"})  # the default model generates
    with pytest.raises(ValueError, match="at least one prompt"):
        llm.embed([])
    with pytest.raises(ValueError, match="runner must be one of"):
        LLM(runner="encoder")


def test_token_embed_is_every_token_normalized(minilm_tokens, st_model):
    """pooler_config={"task": "token_embed"} (vLLM's): each token's last hidden state,
    L2-normalized (sentence-transformers' token_embeddings, unnormalized, are the reference);
    that engine's "embed" is refused, as vLLM refuses it."""
    texts = SENTENCES[:6]
    tokens = minilm_tokens.encode(texts, pooling_task="token_embed")
    ref = st_model.encode(texts, output_value="token_embeddings")
    for out, r in zip(tokens, ref):
        r = r.numpy().astype(np.float64)
        assert out.outputs.data.shape == r.shape == (len(out.prompt_token_ids), 384)
        np.testing.assert_allclose(out.outputs.data, r / np.linalg.norm(r, axis=1)[:, None],
                                   atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="this engine pools 'token_embed'; for 'embed'"):
        minilm_tokens.embed(texts)
