"""A hypothesis state machine over the scheduler and KV cache manager with prefix caching.

Rules add requests (with shared prefixes, n > 1 groups, prompt-logprobs requests), run
engine steps (sync or async: the async loop keeps one step in flight, as EngineCore does),
abort and stop requests from outside, fail a step (its requests finish with an error, as in
EngineCore._fail with the device intact), lose the device (fail everything in flight,
preempt_all), and reset the prefix cache.

The fake runner keeps its own state built only from SchedulerOutput messages, samples a
token that depends only on the tokens so far (so equal prompts give equal outputs, and
output blocks can be shared too), and keeps a shadow of the KV cache: for every (block,
slot) it writes, the exact token prefix whose K/V the slot now holds. After every rule:

  * no block is leaked or freed twice: each usable block is either in the free queue with
    ref_cnt 0, or held with ref_cnt == the number of requests holding it;
  * no block is shared when it should not be: every full block a request holds (up to its
    computed tokens) holds the K/V of exactly that request's prefix;
  * every cached block is indexed under its own hash, and that hash is the chained hash of
    the prefix whose K/V the block holds;
  * every live request's block hashes are those of its known tokens.

Some machines run with a sliding window (KVCacheManager gives back blocks before it): the
fake runner then checks only the positions a query's window reads, which must still hold the
request's own prefix, so a block given back too soon fails.

At the end everything drains, every block is free, and every request that ran to its
length produced exactly the tokens the fake model gives.
"""

from __future__ import annotations

import collections
import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxllm.engine.block_hash import ROOT_HASH, hash_block_tokens, hash_prefix
from jaxllm.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.engine.scheduler import Scheduler
from jaxllm.messages import ModelRunnerOutput, SchedulerOutput
from jaxllm.sampling_params import SamplingParams

VOCAB = 5
EOS = VOCAB + 1  # never sampled: requests end by length, abort, stop or error
PREFIXES = [[(7 * i + 3) % VOCAB for i in range(40)], [(i * i + 1) % VOCAB for i in range(40)]]


def next_token(tokens: list[int]) -> int:
    """The fake model: a function of the whole prefix."""
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + len(tokens)) % VOCAB


def reference(prompt: list[int], max_tokens: int, max_model_len: int) -> list[int]:
    """What a request runs to (one token at least, then the length caps of check_stop)."""
    tokens = list(prompt)
    while True:
        tokens.append(next_token(tokens))
        if len(tokens) - len(prompt) >= max_tokens or len(tokens) >= max_model_len:
            return tokens[len(prompt):]


class FakeRunner:
    def __init__(self, block_size: int, sliding_window: int | None = None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.tokens: dict[str, list[int]] = {}  # known + sampled by this runner
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        # (block id, slot) -> the token prefix whose K/V the slot holds.
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}

    def update_states(self, out: SchedulerOutput) -> None:
        for src, dst in out.blocks_to_copy:  # cached tails, before anything is written
            for off in range(self.block_size):
                if (src, off) in self.kv:
                    self.kv[(dst, off)] = self.kv[(src, off)]
                else:
                    self.kv.pop((dst, off), None)
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            for d in (self.tokens, self.block_ids, self.num_computed):
                d.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
            self.block_ids[new.req_id] = list(new.block_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            assert self.num_computed[cached.req_id] == cached.num_computed_tokens
            self.block_ids[cached.req_id] += cached.new_block_ids

    def slot(self, req_id: str, position: int) -> tuple[int, int]:
        return (self.block_ids[req_id][position // self.block_size],
                position % self.block_size)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Every row's K/V is written before any row reads (as in the model step)."""
        self.update_states(out)
        starts = {}
        for req_id, n in out.num_scheduled_tokens.items():
            tokens, start = self.tokens[req_id], self.num_computed[req_id]
            starts[req_id] = start
            assert start + n <= len(tokens)  # placeholder rows read this runner's samples
            for p in range(start, start + n):
                self.kv[self.slot(req_id, p)] = tuple(tokens[:p + 1])
            self.num_computed[req_id] = start + n
        sampled = []
        for req_id in out.num_scheduled_tokens:
            self.check_reads(req_id, starts[req_id])
            tokens = self.tokens[req_id]
            if self.num_computed[req_id] == len(tokens):
                tokens.append(next_token(tokens))
                sampled.append([tokens[-1]])
            else:
                sampled.append([])
        return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)

    def check_reads(self, req_id: str, first_query: int) -> None:
        """Attention reads positions 0 .. num_computed - 1 (with a sliding window, from the
        first query's window on): each must hold this request's own prefix (a wrong cache
        hit, a block shared by mistake or a block the window gave back too soon fails here)."""
        tokens = self.tokens[req_id]
        first = 0 if self.sliding_window is None else max(0, first_query - self.sliding_window + 1)
        for p in range(first, self.num_computed[req_id]):
            assert self.kv.get(self.slot(req_id, p)) == tuple(tokens[:p + 1]), (req_id, p)


class PrefixCachingMachine(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]), max_model_len=st.integers(6, 28),
                extra_blocks=st.integers(0, 6), max_num_seqs=st.integers(1, 6),
                budget=st.integers(1, 24), async_scheduling=st.booleans(),
                enable_caching=st.sampled_from([True, True, True, False]),
                sliding_window=st.sampled_from([None, None, 1, 3, 6]))
    def setup(self, block_size, max_model_len, extra_blocks, max_num_seqs, budget,
              async_scheduling, enable_caching, sliding_window):
        self.block_size, self.max_model_len = block_size, max_model_len
        num_blocks = cdiv(max_model_len, block_size) + 1 + extra_blocks
        self.kv = KVCacheManager(num_blocks, block_size, max_model_len,
                                 enable_caching=enable_caching, sliding_window=sliding_window)
        self.sched = Scheduler(self.kv, max_num_seqs, budget, max_model_len)
        self.runner = FakeRunner(block_size, sliding_window)
        self.async_scheduling = async_scheduling
        self.pending: tuple[SchedulerOutput, ModelRunnerOutput] | None = None
        self.counter = itertools.count()
        self.requests: dict[str, Request] = {}
        self.emitted: dict[str, list[int]] = collections.defaultdict(list)
        self.reasons: dict[str, str] = {}

    # -- rules ------------------------------------------------------------------------------
    @rule(data=st.data(), prefix=st.sampled_from(range(len(PREFIXES))),
          n=st.sampled_from([1, 1, 1, 2, 4]), max_tokens=st.integers(1, 10),
          prompt_logprobs=st.sampled_from([None, None, None, None, 1]))
    def add(self, data, prefix, n, max_tokens, prompt_logprobs):
        prefix_len = data.draw(st.integers(0, self.max_model_len - 1), label="prefix_len")
        suffix = data.draw(st.lists(st.integers(0, VOCAB - 1),
                                    min_size=0 if prefix_len else 1,
                                    max_size=self.max_model_len - prefix_len), label="suffix")
        prompt = PREFIXES[prefix][:prefix_len] + suffix
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                prompt_logprobs=prompt_logprobs)
        parent = next(self.counter)
        for i in range(n):
            req_id = f"{i}_{parent}" if n > 1 else str(parent)
            self.requests[req_id] = Request(req_id, prompt, params.clone(), EOS, 0.0)
            self.sched.add_request(self.requests[req_id])

    @rule(n=st.integers(1, 6))
    def steps(self, n):
        for _ in range(n):
            self.step()

    def step(self):
        out = self.sched.schedule()
        runner_out = self.runner.execute(out)
        assert (out.total_num_scheduled_tokens > 0 or not self.sched.has_unfinished_requests()
                or self.pending is not None), "no progress"
        if self.async_scheduling:
            executed = (out, runner_out) if out.total_num_scheduled_tokens else None
            (out, runner_out), self.pending = self.pending or (None, None), executed
        if out is not None:
            self.fold_back(out, runner_out)

    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED,
                                                  RequestStatus.FINISHED_STOPPED]),
          now=st.integers(0, 2))
    def finish_from_outside(self, data, status, now):
        live = sorted(self.sched.requests)
        if live and not now:
            self.sched.finish_requests(data.draw(st.sampled_from(live)), status)

    # Failures end every request of a step: drawn rarely (1 in 6), or little else runs.
    @rule(now=st.integers(0, 5))
    def fail_step(self, now):
        """The next step raises in the device launch: the runner took its diffs but wrote
        nothing; its requests finish with an error (the device state survives)."""
        if now:
            return
        out = self.sched.schedule()
        self.runner.update_states(out)
        for o in self.sched.fail_requests(list(out.num_scheduled_tokens)):
            self.reasons[o.req_id] = "error"

    @rule(now=st.integers(0, 5))
    def lose_device(self, now):
        """A failed step consumed the KV cache: everything in flight fails, the rest is
        preempted to recompute, and the cache is empty again."""
        if now:
            return
        out = self.sched.schedule()
        self.runner.update_states(out)
        failed = list(out.num_scheduled_tokens)
        if self.pending is not None:
            failed += list(self.pending[0].num_scheduled_tokens)
            self.pending = None
        for o in self.sched.fail_requests(failed):
            self.reasons[o.req_id] = "error"
        self.runner.kv.clear()
        self.sched.preempt_all()
        assert not self.kv.block_pool.cached_block_hash_to_block

    @rule()
    def reset_prefix_cache(self):
        held = bool(self.kv.req_to_blocks)
        assert self.sched.reset_prefix_cache() is (not held)
        if not held:
            assert not self.kv.block_pool.cached_block_hash_to_block

    def fold_back(self, out, runner_out):
        for o in self.sched.update_from_output(out, runner_out):
            assert o.req_id not in self.reasons
            self.emitted[o.req_id] += o.new_token_ids
            if o.finished:
                self.reasons[o.req_id] = o.finish_reason

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def blocks_are_owned_exactly(self):
        if not hasattr(self, "kv"):
            return
        pool = self.kv.block_pool
        # The null block stands in for blocks a sliding window gave back.
        holders = collections.Counter(b.block_id for blocks in self.kv.req_to_blocks.values()
                                      for b in blocks if b is not pool.null_block)
        free = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
        assert len(free) == len(set(free)) == pool.num_free_blocks
        assert sorted(free + list(holders)) == list(range(1, pool.num_blocks))
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders[block.block_id], block
        assert pool.null_block.ref_cnt == 0 and pool.null_block.block_hash is None
        assert set(self.kv.req_to_blocks) <= {r.request_id for r in self.sched.running}
        for req in self.sched.waiting:
            assert req.num_computed_tokens == 0 and req.request_id not in self.kv.req_to_blocks
        for req in self.sched.running:
            assert len(self.kv.get_block_ids(req.request_id)) * self.block_size \
                >= req.num_computed_tokens

    @invariant()
    def held_blocks_hold_their_own_prefix(self):
        if not hasattr(self, "kv"):
            return
        bs = self.block_size
        for req_id, blocks in self.kv.req_to_blocks.items():
            tokens = self.runner.tokens[req_id]
            for i in range(self.sched.requests[req_id].num_computed_tokens // bs):
                if blocks[i] is self.kv.block_pool.null_block:
                    continue  # given back by the sliding window
                for off in range(bs):
                    p = i * bs + off
                    assert self.runner.kv.get((blocks[i].block_id, off)) == \
                        tuple(tokens[:p + 1]), (req_id, i, off)

    @invariant()
    def cached_blocks_match_their_contents(self):
        if not hasattr(self, "kv"):
            return
        pool, bs = self.kv.block_pool, self.block_size
        if not self.kv.enable_caching:
            assert not pool.cached_block_hash_to_block
        for block in pool.blocks:
            if block.block_hash is not None:  # indexed as a full block or as a tail
                assert block in (pool.cached_block_hash_to_block.get(block.block_hash),
                                 pool.cached_tail_to_block.get(block.block_hash))
        for block_hash, block in pool.cached_block_hash_to_block.items():
            assert block.block_hash == block_hash
            prefix = self.runner.kv[(block.block_id, bs - 1)]
            assert len(prefix) % bs == 0 and hash_prefix(prefix, bs)[-1] == block_hash
            for off in range(bs):
                assert self.runner.kv[(block.block_id, off)] == \
                    prefix[:len(prefix) - bs + off + 1]

    @invariant()
    def cached_tails_match_their_contents(self):
        if not hasattr(self, "kv"):
            return
        pool, bs = self.kv.block_pool, self.block_size
        if not self.kv.enable_caching:
            assert not pool.cached_tail_to_block
        for tail_hash, block in pool.cached_tail_to_block.items():
            assert block.block_hash == tail_hash and block.ref_cnt == 0
            # Some m < bs: slots 0..m-1 hold one prefix whose hash chain ends in tail_hash.
            matches = []
            for m in range(1, bs):
                prefix = self.runner.kv.get((block.block_id, m - 1))
                if prefix is None or len(prefix) % bs != m:
                    continue
                k = len(prefix) - m
                parent = hash_prefix(prefix[:k], bs)[-1] if k else ROOT_HASH
                if hash_block_tokens(parent, prefix[k:]) == tail_hash and all(
                        self.runner.kv.get((block.block_id, off)) == prefix[:k + off + 1]
                        for off in range(m)):
                    matches.append(m)
            assert matches, (block, tail_hash)

    @invariant()
    def request_hashes_follow_known_tokens(self):
        if not hasattr(self, "kv"):
            return
        for req in self.sched.requests.values():
            known = req.prompt_token_ids + req.output_token_ids
            expected = hash_prefix(known, self.block_size) if self.kv.enable_caching else []
            assert req.block_hashes == expected, req

    # -- the end ------------------------------------------------------------------------------
    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for _ in range(2000):
            if not self.sched.has_unfinished_requests() and self.pending is None:
                break
            self.step()
            self.blocks_are_owned_exactly()
            self.held_blocks_hold_their_own_prefix()
            self.cached_blocks_match_their_contents()
            self.cached_tails_match_their_contents()
        else:
            raise AssertionError(f"not drained: {self.sched.requests}")
        assert self.kv.num_free_blocks == self.kv.num_blocks - 1 and self.kv.usage == 0.0
        assert self.sched.reset_prefix_cache()
        assert not self.kv.block_pool.cached_block_hash_to_block
        assert not self.kv.block_pool.cached_tail_to_block
        for req_id, req in self.requests.items():
            expected = reference(req.prompt_token_ids, req.max_tokens, self.max_model_len)
            assert self.emitted[req_id] == req.output_token_ids
            if self.reasons.get(req_id) == "length":
                assert self.emitted[req_id] == expected, req
            else:
                assert req.is_finished() and expected[:len(self.emitted[req_id])] == \
                    self.emitted[req_id], req


PrefixCachingMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
test_prefix_caching_state_machine = PrefixCachingMachine.TestCase
