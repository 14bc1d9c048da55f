"""Tiny random classification heads and a decoder turned embedding model, against HF
transformers: BertForSequenceClassification (classify with softmax; the cross-encoder form of
score with sigmoid), Qwen3ForSequenceClassification (last-token pooling, softmax), and
Qwen3ForCausalLM with convert="embed" (last-token pooling, normalized).

The models borrow the packaged MiniLM's BERT tokenizer (vocab 30522). Each engine serves
prompts of at most 32 tokens, compiling only the buckets used (the BERT classifier fills
128-row steps, where attention runs in tiles).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from hf_random import tiny_hf_model
from jaxllm import LLM, ClassificationRequestOutput
from jaxllm.models.packaged_hf import packaged_hf_dir
from jaxllm.models.resolve import DEFAULT_POOLING_MODEL

TEXTS = ["a cat sat on the mat", "rain again today", "the quick brown fox jumps over it",
         "ok"]
QUERIES = ["what is the weather", "what is the weather", "who sat on the mat"]
DOCS = ["rain again today", "the quick brown fox", "a cat sat on the mat"]
LIMITS = dict(max_model_len=32, max_num_batched_tokens=128, max_num_seqs=32, dtype="float32",
              enforce_eager=True,  # compiles only the buckets a test uses
              linear_backend="xla")  # no GEMM packing to compile (the MiniLM tests run it)
# Enough prompts to fill 128-row steps: their attention runs in tiles of 32 rows.
MANY = [f"{t} {i}" for i in range(8) for t in TEXTS]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save(model, path):
    model.save_pretrained(path)
    source = packaged_hf_dir(DEFAULT_POOLING_MODEL)
    for name in TOKENIZER_FILES:
        shutil.copy(f"{source}/{name}", path / name)
    return str(path)


def tokenizer(path):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


BERT = dict(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=64)
QWEN3 = dict(vocab_size=30522, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             max_position_embeddings=64, pad_token_id=0)


def hf_logits(model, tok, *texts):
    import torch

    with torch.no_grad():
        return model(**tok(*texts, return_tensors="pt")).logits[0].double().numpy()


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def hf_token_probs(base, head, tok, text):
    """token_classify's reference: the classifier on every token's hidden state, softmax."""
    import torch

    with torch.no_grad():
        hidden = base(**tok(text, return_tensors="pt")).last_hidden_state
        return softmax(head(hidden)[0].double().numpy())


def test_bert_classifier_softmax(tmp_path):
    hf = tiny_hf_model("BertConfig", "BertForSequenceClassification", 1, num_labels=3, **BERT)
    path = save(hf, tmp_path)
    llm = LLM(path, **LIMITS)
    outs = llm.classify(MANY)
    assert all(isinstance(o, ClassificationRequestOutput) for o in outs)
    tok = tokenizer(path)
    for text, out in zip(MANY, outs):
        logits = hf_logits(hf, tok, text)
        ref = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(out.outputs.probs, ref, atol=1e-4, rtol=0)
    raw = llm.classify(TEXTS[:1], pooling_params=__import__("jaxllm").PoolingParams(
        use_activation=False))[0].outputs.probs
    np.testing.assert_allclose(raw, hf_logits(hf, tok, TEXTS[0]), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="num_labels == 1"):
        llm.score(QUERIES[0], DOCS)
    # token_classify: the classifier alone on every token (not BERT's [CLS] pooler)
    del llm
    llm = LLM(path, pooler_config={"task": "token_classify"}, **LIMITS)
    tokens = llm.encode(TEXTS, pooling_task="token_classify")
    for text, out in zip(TEXTS, tokens):
        ref = hf_token_probs(hf.bert, hf.classifier, tok, text)
        assert out.outputs.data.shape == ref.shape == (len(out.prompt_token_ids), 3)
        np.testing.assert_allclose(out.outputs.data, ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="Embedding API is not supported by this model"):
        llm.encode(TEXTS, pooling_task="token_embed")


def test_bert_cross_encoder_score(tmp_path):
    hf = tiny_hf_model("BertConfig", "BertForSequenceClassification", 2, num_labels=1, **BERT)
    path = save(hf, tmp_path)
    llm = LLM(path, **LIMITS)
    tok = tokenizer(path)
    scores = [s.outputs.score for s in llm.score(QUERIES, DOCS)]
    ref = [1 / (1 + np.exp(-hf_logits(hf, tok, q, d)[0])) for q, d in zip(QUERIES, DOCS)]
    np.testing.assert_allclose(scores, ref, atol=1e-4, rtol=0)
    # The pair's token types reach the model: the pair alone differs from the concatenation.
    joined = llm.classify([f"{QUERIES[0]} [SEP] {DOCS[0]}"])[0].outputs.probs[0]
    assert abs(joined - scores[0]) > 1e-4


def test_qwen3_classifier_last_token(tmp_path):
    hf = tiny_hf_model("Qwen3Config", "Qwen3ForSequenceClassification", 3, num_labels=2,
                       **QWEN3)
    path = save(hf, tmp_path)
    llm = LLM(path, **LIMITS)
    tok = tokenizer(path)
    for text, out in zip(TEXTS, llm.classify(TEXTS)):
        logits = hf_logits(hf, tok, text)
        ref = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        np.testing.assert_allclose(out.outputs.probs, ref, atol=1e-4, rtol=0)
    del llm
    llm = LLM(path, pooler_config={"task": "token_classify"}, **LIMITS)
    for text, out in zip(TEXTS, llm.encode(TEXTS, pooling_task="token_classify")):
        ref = hf_token_probs(hf.model, hf.score, tok, text)
        np.testing.assert_allclose(out.outputs.data, ref, atol=1e-4, rtol=0)


def test_qwen3_causal_lm_converted_to_embeddings(tmp_path):
    import torch

    hf = tiny_hf_model("Qwen3Config", "Qwen3ForCausalLM", 4, **QWEN3)
    path = save(hf, tmp_path)
    generative = LLM(path, **LIMITS)
    with pytest.raises(ValueError, match=r"LLM.embed\(\) is only supported for pooling"):
        generative.embed(TEXTS)
    del generative
    llm = LLM(path, convert="embed", **LIMITS)
    assert llm.llm_engine.pooler_config.pooling_type == "LAST"
    tok = tokenizer(path)
    for text, out in zip(TEXTS, llm.embed(TEXTS)):  # causal tiles: test_attention.py
        with torch.no_grad():
            last = hf.model(**tok(text, return_tensors="pt")).last_hidden_state[0, -1]
        ref = last.double().numpy() / np.linalg.norm(last.double().numpy())
        np.testing.assert_allclose(out.outputs.embedding, ref, atol=1e-5, rtol=0)
