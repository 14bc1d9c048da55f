"""The multi-process executor's protocol, with a recording runner and an in-memory channel
(no jax.distributed): what the leader sends, in which messages, and what a follower replays."""

from __future__ import annotations

import logging

import pytest

from jaxllm.distributed.executor import DistributedExecutor, follow


class Runner:
    """Records calls; dispatch of an "empty" step returns None, as the ModelRunner's does."""

    def __init__(self, fail_on=()):
        self.calls = []
        self.fail_on = fail_on

    def _call(self, name, *args):
        self.calls.append((name, *args))
        if (name, *args) in self.fail_on:
            raise RuntimeError(f"{name} failed")

    def dispatch(self, so):
        self._call("dispatch", so)
        return None if so == "empty" else f"pending:{so}"

    def fetch(self, pending):
        self._call("fetch", pending)
        return f"output:{pending}"

    def execute_model(self, so):
        self._call("execute_model", so)
        return f"output:{so}"

    def reset_device_state(self):
        self._call("reset_device_state")

    def device_state_ok(self):
        return True


class Channel:
    def __init__(self, messages=()):
        self.sent = []
        self.inbox = list(messages)
        self.num_processes = 2

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        return self.inbox.pop(0)


def test_the_leader_sends_each_call_first_and_fetches_ride_with_the_next_message():
    runner, channel = Runner(), Channel()
    ex = DistributedExecutor(runner, channel)
    p0 = ex.dispatch("so0")
    assert channel.sent == [[("dispatch", 0, "so0")]]
    p1 = ex.dispatch("so1")
    assert ex.fetch(p0) == "output:pending:so0"
    assert len(channel.sent) == 2  # the fetch waits for the next message
    assert ex.dispatch("empty") is None
    assert ex.fetch(p1) == "output:pending:so1"
    assert ex.execute_model("so3") == "output:so3"
    ex.reset_device_state()
    assert ex.device_state_ok()
    ex.shutdown()
    ex.shutdown()  # once
    assert channel.sent == [
        [("dispatch", 0, "so0")],
        [("dispatch", 1, "so1")],
        [("fetch", 0), ("dispatch", 2, "empty")],
        [("fetch", 1), ("execute_model", "so3")],
        [("reset_device_state",)],
        [("shutdown",)],
    ]
    assert runner.calls == [("dispatch", "so0"), ("dispatch", "so1"),
                            ("fetch", "pending:so0"), ("dispatch", "empty"),
                            ("fetch", "pending:so1"), ("execute_model", "so3"),
                            ("reset_device_state",)]
    with pytest.raises(RuntimeError, match="has been shut down"):
        ex.dispatch("so4")


def test_a_follower_replays_in_order_drops_unfetched_steps_and_stops():
    runner = Runner()
    messages = [
        [("dispatch", 0, "a")],
        [("dispatch", 1, "b")],
        [("dispatch", 2, "empty")],  # nothing to run: no pending step 2
        [("dispatch", 3, "c")],
        [("fetch", 3), ("execute_model", "d")],  # the leader never fetched 0 and 1
        [("reset_device_state",), ("shutdown",)],
        [("dispatch", 4, "never")],
    ]
    channel = Channel(messages)
    assert follow(runner, channel) == 4  # a, b, c, d ran on the device
    assert runner.calls == [("dispatch", "a"), ("dispatch", "b"), ("dispatch", "empty"),
                            ("dispatch", "c"), ("fetch", "pending:c"),
                            ("execute_model", "d"), ("reset_device_state",)]
    assert channel.inbox == [[("dispatch", 4, "never")]]


def test_a_call_that_fails_on_a_follower_is_logged_and_the_follower_goes_on(caplog):
    runner = Runner(fail_on=[("dispatch", "bad")])
    channel = Channel([[("dispatch", 0, "bad")], [("fetch", 0)], [("dispatch", 1, "ok")],
                       [("bogus",), ("shutdown",)]])
    with caplog.at_level(logging.ERROR, logger="jaxllm.distributed.executor"):
        assert follow(runner, channel) == 1
    assert [r.getMessage() for r in caplog.records] == [
        "replaying dispatch failed (as it will have on the leader)",
        "replaying fetch failed (as it will have on the leader)",
        "replaying bogus failed (as it will have on the leader)"]
    assert runner.calls == [("dispatch", "bad"), ("dispatch", "ok")]
