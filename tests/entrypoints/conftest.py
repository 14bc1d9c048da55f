"""The in-process server that the in-process test modules share (test_bad_requests.py,
test_generated_bodies.py, test_vllm_fields.py, test_vllm_ports.py): one engine for all of
them, since an engine compiles its own steps, which is most of what such a module costs.

Its settings: request chat templates trusted (rendered in the sandbox), so that what a
template renders reaches the checks and the template fields can be read back; cached prompt
tokens stated in usage (vLLM's --enable-prompt-tokens-details); LoRA enabled (two adapter
slots) for test_lora_server.py, which registers its adapters on its own apps over this engine
and removes them again. Every test that uses it leaves it idle (InProcessApp.assert_idle).
"""

from __future__ import annotations

import pytest

from engine_e2e.tiny_model import build_tiny_llama_dir

from inprocess_app import InProcessApp


@pytest.fixture(scope="session")
def inprocess_server(tmp_path_factory):
    app = InProcessApp(build_tiny_llama_dir(str(tmp_path_factory.mktemp("tiny_inprocess"))),
                       dict(enable_lora=True, max_loras=2),
                       trust_request_chat_template=True, enable_prompt_tokens_details=True)
    yield app
    app.shutdown()
