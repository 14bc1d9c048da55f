"""Grammar bitmasks: constrained requests sample only what their grammar allows.

Owns the device half of structured outputs (the host half, grammars and filling the masks,
is jaxllm/engine/structured_output.py). One per-slot table `grammar_bitmask` [R + 1, P, N]
uint32, N = ceil(V / 32), P = 1 + K (K speculative tokens, else 0): mask 0 for the position
a sequence samples, mask 1 + j for the row that verifies its draft j (read by speculative
verification through `mask_verify_rows`); bit v % 32 of word v // 32 set when token v is
allowed; all ones (the fill value) is "unconstrained", what a request's rows are set to
when it joins and what padding sequences read in row R. Each step the scheduler sends the masks of the
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

    def __init__(self, num_slots: int, vocab_size: int, num_speculative_tokens: int = 0):
        """num_speculative_tokens: K; each slot then holds 1 + K masks (the sampled
        position's, then the K verify positions')."""
        self.vocab_size = vocab_size
        self.P = 1 + num_speculative_tokens
        self.table = DeviceRows(num_slots, (self.P, -(-vocab_size // 32)), np.uint32,
                                ALL_ALLOWED, row_buckets=row_buckets(num_slots, max_rows=64))

    def slot_rows(self) -> dict[str, DeviceRows]:
        return {"grammar_bitmask": self.table}

    def add_request(self, slot: int, new) -> None:
        self.table.set_row(slot, ALL_ALLOWED)  # until the scheduler sends its mask

    def update_states(self, so, slot_of: dict[str, int]) -> None:
        if so.grammar_bitmask is None:
            return
        masks_nPN = np.asarray(so.grammar_bitmask).view(np.uint32)
        n, P, N = masks_nPN.shape
        if P > self.P:
            raise ValueError(f"{P} grammar masks per request, the step holds {self.P}")
        padded_nPN = np.full((n, self.P, N), ALL_ALLOWED, np.uint32)
        padded_nPN[:, :P] = masks_nPN
        self.table.set_rows([slot_of[r] for r in so.structured_output_request_ids], padded_nPN)

    def transform(self, site, layer, logits_SV, hooks):
        if site != "logits":
            return logits_SV
        bits_SN = hooks.rows["grammar_bitmask"][hooks.slot_S, 0]
        return jax.lax.cond(jnp.any(bits_SN != jnp.uint32(ALL_ALLOWED)),
                            lambda x: apply_bitmask(x, bits_SN), lambda x: x, logits_SV)

    def verify_constrained(self, hooks, K: int):
        return jnp.any(self._verify_bits(hooks, K) != jnp.uint32(ALL_ALLOWED))

    def mask_verify_rows(self, hooks, K: int, x_RV):
        return apply_bitmask(x_RV, self._verify_bits(hooks, K))

    def _verify_bits(self, hooks, K: int):
        """[S * K, N]: the masks of each sequence's K verify rows."""
        bits_SKN = hooks.rows["grammar_bitmask"][hooks.slot_S, 1:1 + K]
        return bits_SKN.reshape(-1, bits_SKN.shape[-1])


def apply_bitmask(x_SV: jax.Array, bits_SN: jax.Array) -> jax.Array:
    """Tokens whose bit is clear -> -inf."""
    S, V = x_SV.shape
    shifts_32 = jnp.arange(32, dtype=jnp.uint32)
    allowed_SV = ((bits_SN[:, :, None] >> shifts_32) & 1).reshape(S, -1)[:, :V] == 1
    return jnp.where(allowed_SV, x_SV, -jnp.inf)
