"""Hypothesis hunts for invariant breaks in the scheduler over random request mixes.

The engine loop is simulated with a fake runner that keeps its own per-request state built
*only* from SchedulerOutput messages (as the real runner must), and samples a deterministic
token for each request whose prefill is complete. After every step we check block ownership,
the budget and seat caps, and that the runner's view matches the scheduler's. At the end every
request must have finished, with exactly the tokens and finish reason a reference model gives.

Half the scenarios use the "priority" scheduling policy (so a preemption victim may be a
request already scheduled in the same step), and half run the async loop: step N+1 is scheduled and executed before step N's
output is folded back, so requests carry output placeholders and preemption makes in-flight
tokens stale. The fake runner then feeds placeholder rows from its own last samples, as the
device does.
"""

import dataclasses
import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxllm.engine.kv_cache_manager import KVCacheManager, cdiv
from jaxllm.sampling_params import SamplingParams
from jaxllm.engine.request import Request, RequestStatus
from jaxllm.messages import ModelRunnerOutput, SchedulerOutput
from jaxllm.engine.scheduler import Scheduler

EOS = 0
VOCAB = 23


# The real SamplingParams (pure Python); a short max_tokens keeps the runs small.
Params = functools.partial(SamplingParams, max_tokens=16)


@dataclasses.dataclass
class Spec:
    arrival_step: int
    prompt_len: int
    params: Params
    abort_step: int | None  # abort before schedule() of this step
    abort_mid_step: bool  # if aborting, do it between schedule() and update_from_output()
    priority: int = 0  # read only with the "priority" scheduling policy


def token_at(req_id: str, position: int) -> int:
    """The fake model: the token sampled at `position` depends only on the request and position."""
    return (int(req_id) * 7919 + position * 104729) % VOCAB


def reference_completion(req_id: str, spec: Spec, max_model_len: int) -> tuple[list[int], str]:
    p = spec.params
    out: list[int] = []
    while True:
        token = token_at(req_id, spec.prompt_len + len(out))
        out.append(token)
        if len(out) >= p.min_tokens and not p.ignore_eos and token == EOS:
            return out, "stop"
        if len(out) >= p.min_tokens and token in p.stop_token_ids:
            return out, "stop"
        if len(out) >= p.max_tokens or spec.prompt_len + len(out) >= max_model_len:
            return out, "length"


@dataclasses.dataclass
class RunnerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeRunner:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.states: dict[str, RunnerState] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids | out.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = RunnerState(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids),
                new.num_computed_tokens)
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids += cached.new_block_ids
        assert len(out.scheduled_new_reqs) + len(out.scheduled_cached_reqs) == len(
            out.num_scheduled_tokens)
        sampled = []
        for req_id, n in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            state.num_computed_tokens += n
            # Placeholder rows read the token this runner sampled last step, never a guess.
            assert state.num_computed_tokens <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= state.num_computed_tokens
            if state.num_computed_tokens == len(state.token_ids):
                token = token_at(req_id, len(state.token_ids))
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(list(out.num_scheduled_tokens), sampled)


def check_blocks(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    held = [b for blocks in kv.req_to_blocks.values() for b in blocks]
    held_ids = [b.block_id for b in held]
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    assert len(free_ids) == pool.num_free_blocks
    assert sorted(held_ids + free_ids) == list(range(1, pool.num_blocks))  # no leak, no dup
    assert all(b.ref_cnt == 1 for b in held) and all(b.ref_cnt == 0 for b in free)
    assert pool.null_block.ref_cnt == 0 and pool.null_block not in free
    # Only running requests hold blocks, and each holds enough for what it computed.
    assert set(kv.req_to_blocks) <= {r.request_id for r in sched.running}
    for req in sched.running:
        assert len(kv.get_block_ids(req.request_id)) * kv.block_size >= req.num_computed_tokens
    for req in sched.waiting:
        assert req.num_computed_tokens == 0 and req.request_id not in kv.req_to_blocks


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    max_model_len = draw(st.integers(4, 32))
    # Tiny caches: from "one max-length request fits" to a little more.
    num_blocks = cdiv(max_model_len, block_size) + 1 + draw(st.integers(0, 6))
    config = dict(
        block_size=block_size, max_model_len=max_model_len, num_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 5)),
        max_num_batched_tokens=draw(st.integers(1, 24)),
        async_scheduling=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )
    specs = []
    for _ in range(draw(st.integers(1, 10))):
        max_tokens = draw(st.integers(1, 12))
        params = Params(
            max_tokens=max_tokens,
            min_tokens=draw(st.integers(0, max_tokens)),
            ignore_eos=draw(st.booleans()),
            stop_token_ids=draw(st.lists(st.integers(1, VOCAB - 1), max_size=2)),
        )
        aborts = draw(st.booleans()) and draw(st.booleans())
        specs.append(Spec(
            arrival_step=draw(st.integers(0, 15)),
            prompt_len=draw(st.integers(1, max_model_len)),
            params=params,
            abort_step=draw(st.integers(0, 40)) if aborts else None,
            abort_mid_step=draw(st.booleans()),
            priority=draw(st.integers(-1, 1)),
        ))
    return config, specs


@settings(max_examples=150, deadline=None)
@given(scenarios())
def test_random_mixes_keep_invariants_and_finish(scenario):
    config, specs = scenario
    block_size, max_model_len = config["block_size"], config["max_model_len"]
    kv = KVCacheManager(config["num_blocks"], block_size, max_model_len)
    sched = Scheduler(kv, config["max_num_seqs"], config["max_num_batched_tokens"],
                      max_model_len, policy=config["policy"])
    in_flight = config["async_scheduling"]
    runner = FakeRunner(block_size)
    requests = {str(i): Request(str(i), [(i + j) % VOCAB for j in range(s.prompt_len)],
                                s.params, EOS, float(s.arrival_step), s.priority)
                for i, s in enumerate(specs)}
    specs_by_id = {str(i): s for i, s in enumerate(specs)}
    emitted: dict[str, list[int]] = {req_id: [] for req_id in requests}
    reasons: dict[str, str] = {}

    max_steps = 16 + sum(s.prompt_len + s.params.max_tokens for s in specs) * 4
    pending = None  # async: the executed step whose output is not folded back yet
    for step in range(max_steps):
        for req_id, spec in specs_by_id.items():
            if spec.arrival_step == step:
                sched.add_request(requests[req_id])
        aborts_now = [r for r, s in specs_by_id.items()
                      if s.abort_step == step and s.arrival_step <= step]
        sched.finish_requests([r for r in aborts_now if not specs_by_id[r].abort_mid_step],
                              RequestStatus.FINISHED_ABORTED)
        if step > 15 and not sched.has_unfinished_requests() and pending is None:
            break

        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= config["max_num_batched_tokens"]
        assert len(out.num_scheduled_tokens) <= config["max_num_seqs"]
        assert all(n > 0 for n in out.num_scheduled_tokens.values())
        assert not out.preempted_req_ids & set(out.num_scheduled_tokens)
        # Progress: whenever anything is unfinished, something is scheduled, unless a step
        # in flight holds the last token of everything that is left.
        assert (out.total_num_scheduled_tokens > 0 or not sched.has_unfinished_requests()
                or pending is not None)

        runner_out = runner.execute(out)
        for req_id in out.num_scheduled_tokens:
            assert runner.states[req_id].block_ids == kv.get_block_ids(req_id)
        sched.finish_requests([r for r in aborts_now if specs_by_id[r].abort_mid_step],
                              RequestStatus.FINISHED_ABORTED)
        if in_flight:
            # Keep the new step in flight and fold back the previous one; with nothing new
            # to run, the engine just waits for the step in flight.
            executed = (out, runner_out) if out.total_num_scheduled_tokens else None
            (out, runner_out), pending = (pending or (None, None)), executed
        if out is not None:
            for o in sched.update_from_output(out, runner_out):
                assert o.req_id not in reasons
                emitted[o.req_id] += o.new_token_ids
                if o.finished:
                    reasons[o.req_id] = o.finish_reason
        for req in sched.running:
            tokens = runner.states[req.request_id].token_ids
            known = req.prompt_token_ids + req.output_token_ids
            assert tokens[:len(known)] == known
            assert len(tokens) == req.num_tokens_with_placeholders
        if not in_flight:
            assert all(r.num_output_placeholders == 0 for r in sched.requests.values())
        check_blocks(sched)
    else:
        raise AssertionError(f"not finished after {max_steps} steps: {sched.requests}")

    assert kv.num_free_blocks == config["num_blocks"] - 1 and kv.usage == 0.0
    stats = sched.make_stats()
    assert (stats.num_running_reqs, stats.num_waiting_reqs) == (0, 0)
    assert stats.num_generation_tokens == sum(len(t) for t in emitted.values())
    for req_id, req in requests.items():
        assert req.is_finished()
        expected, reason = reference_completion(req_id, specs_by_id[req_id], max_model_len)
        assert emitted[req_id] == req.output_token_ids
        if req.status == RequestStatus.FINISHED_ABORTED:
            assert req_id not in reasons
            assert expected[: len(emitted[req_id])] == emitted[req_id]
        else:
            assert (emitted[req_id], reasons[req_id]) == (expected, reason)
