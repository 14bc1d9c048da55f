"""The sampler's static widths and the per-request rules sized by them, shared by the front
end (which rejects what does not fit, at admission) and the runner (which lays requests out in
those widths).

Owns: the fixed widths of the per-row tables the jitted step reads, the padding token, the
min_tokens ban list and a request's default seed. Imports no layer (neither engine/ nor
runner/) and never touches a device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxllm.sampling_params import SamplingParams

# Width of the per-row list of token ids banned while a request is below `min_tokens`
# (its EOS ids + stop_token_ids). A fixed width keeps one compiled shape per bucket; the
# engine rejects requests that would need more at admission.
MAX_MIN_TOKENS_STOP_IDS = 32
# Out of range for any vocabulary: scatters drop it. (-1 would wrap to the last token.)
NO_TOKEN = np.iinfo(np.int32).max
# bad_words: at most B token sequences (a word counts once or twice: with and without a
# leading space) of at most G tokens per request, rejected beyond at admission.
MAX_BAD_WORDS = 32
MAX_BAD_WORD_TOKENS = 16


def request_seed(engine_seed: int, request_index: int) -> int:
    """A 64-bit seed for a request without its own, reproducible from the engine seed and the
    request's arrival index (so the whole run is reproducible, whatever the batching)."""
    entropy = (engine_seed % 2**64, request_index % 2**64)
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def banned_until_min_tokens(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The ids masked while a request is below min_tokens: EOS ids (even with ignore_eos, as
    vLLM does) and stop_token_ids. Raises ValueError past MAX_MIN_TOKENS_STOP_IDS."""
    if params.min_tokens == 0:
        return []
    banned = list(dict.fromkeys([*eos_token_ids, *params.stop_token_ids]))
    if len(banned) > MAX_MIN_TOKENS_STOP_IDS:
        raise ValueError(f"min_tokens supports at most {MAX_MIN_TOKENS_STOP_IDS} EOS + "
                         f"stop_token_ids, got {len(banned)}.")
    return banned
