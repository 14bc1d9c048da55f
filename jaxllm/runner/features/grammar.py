"""Grammar bitmasks: constrained requests sample only what their grammar allows.

Owns the device half of structured outputs (the host half, grammars and filling the masks,
is jaxllm/engine/structured_output.py). One per-slot table `grammar_bitmask` [R + 1, N]
uint32, N = ceil(V / 32), bit v % 32 of word v // 32 set when token v is allowed; all ones
(the fill value) is "unconstrained", what a request's row is set to when it joins and what
padding sequences read in row R. Each step the scheduler sends the masks of the
constrained requests that sample (SchedulerOutput.grammar_bitmask) and `update_states`
writes them into their rows: sent as whole rows, only those that changed, padded to row
buckets up to 64, so 64 constrained rows are one upload. At the "logits" point each
sequence reads its slot's row; a `lax.cond` skips unpacking when every row is all ones.
Never compiles or advances a grammar.

Why a per-slot table and not a per-step [S, N] input: a step with no constrained row then
sends nothing (an input would cost S x N x 4 bytes every step, 390 KB at S = 64 for a 49k
vocabulary), and a row whose mask did not change (a grammar in a fixed state) is not sent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.runner.device_rows import DeviceRows, row_buckets
from jaxllm.runner.step_features import StepFeature

ALL_ALLOWED = 0xFFFFFFFF


class GrammarBitmask(StepFeature):
    name = "grammar"

    def __init__(self, num_slots: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.table = DeviceRows(num_slots, (-(-vocab_size // 32),), np.uint32, ALL_ALLOWED,
                                row_buckets=row_buckets(num_slots, max_rows=64))

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {"grammar_bitmask": self.table}

    def add_request(self, slot: int, new) -> None:
        self.table.set_row(slot, ALL_ALLOWED)  # until the scheduler sends its mask

    def update_states(self, so, slot_of: dict[str, int]) -> None:
        if so.grammar_bitmask is None:
            return
        masks = np.asarray(so.grammar_bitmask).view(np.uint32)
        self.table.set_rows([slot_of[r] for r in so.structured_output_request_ids], masks)

    def transform(self, site, layer, logits_SV, hooks):
        if site != "logits":
            return logits_SV
        bits_SN = hooks.rows["grammar_bitmask"][hooks.slot_S]
        return jax.lax.cond(jnp.any(bits_SN != jnp.uint32(ALL_ALLOWED)),
                            lambda x: apply_bitmask(x, bits_SN), lambda x: x, logits_SV)


def apply_bitmask(x_SV: jax.Array, bits_SN: jax.Array) -> jax.Array:
    """Tokens whose bit is clear -> -inf."""
    S, V = x_SV.shape
    shifts_32 = jnp.arange(32, dtype=jnp.uint32)
    allowed_SV = ((bits_SN[:, :, None] >> shifts_32) & 1).reshape(S, -1)[:, :V] == 1
    return jnp.where(allowed_SV, x_SV, -jnp.inf)
