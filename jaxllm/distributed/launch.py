"""Process groups: one process (the default), or several processes on JAX's own runtime.

Owns `jax.distributed.initialize` (with vLLM's names: nnodes, node_rank, master_addr,
master_port) and what differs between one process and several, as two small objects the
engine asks instead of branching:

                     SingleProcess          MultiProcess (nnodes > 1)
    executor(runner) the runner itself      leader: DistributedExecutor; followers: runner
    agree_min(n)     n                      the smallest n of all processes
    follow(runner)   returns at once        leader: returns at once; followers: replay the
                                            leader's steps until it shuts down
    shutdown()       nothing                leader: tell the followers to stop

Never builds a model or a runner, and never schedules.
"""

from __future__ import annotations

import atexit
import itertools
import logging

import jax

from jaxllm.config import EngineConfig
from jaxllm.distributed.channel import Channel
from jaxllm.distributed.executor import DistributedExecutor, follow

logger = logging.getLogger(__name__)

# Every process must reach start-up's agreement points within this time: the slowest one
# may still be loading a large checkpoint from network storage.
START_TIMEOUT_S = 600
# Engines built in this process (all processes build them in the same order): a prefix that
# keeps the keys of a second multi-process engine apart from the first's.
_ENGINE_NUMBERS = itertools.count()


class SingleProcess:
    is_leader = True

    def executor(self, runner):
        return runner

    def agree_min(self, name: str, value: int) -> int:
        return value

    def follow(self, runner) -> None:
        pass

    def check_leader(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class MultiProcess:
    def __init__(self, config: EngineConfig):
        initialize(config)
        self.rank, self.nnodes = config.node_rank, config.nnodes
        self.is_leader = self.rank == 0
        self.address = f"{config.master_addr}:{config.master_port}"
        if config.tensor_parallel_size != jax.device_count():
            raise ValueError(
                f"with nnodes={self.nnodes}, tensor_parallel_size must span the devices of "
                f"every node together ({jax.device_count()}: {jax.local_device_count()} in "
                f"this process), got {config.tensor_parallel_size}")
        self.channel = Channel(f"jaxllm/engine{next(_ENGINE_NUMBERS)}", self.rank, self.nnodes)
        self._executor: DistributedExecutor | None = None

    def executor(self, runner):
        if not self.is_leader:
            return runner  # a follower's engine core never steps
        self._executor = DistributedExecutor(runner, self.channel)
        # Before the interpreter's own teardown: a leader that exits without telling the
        # followers would wait at JAX's shutdown barrier for processes still in follow().
        atexit.register(self.shutdown)
        return self._executor

    def agree_min(self, name: str, value: int) -> int:
        return self.channel.agree_min(name, value, START_TIMEOUT_S)

    def follow(self, runner) -> None:
        if self.is_leader:
            return
        logger.info("node %d of %d: following the leader at %s until it shuts down",
                    self.rank, self.nnodes, self.address)
        steps = follow(runner, self.channel)
        logger.info("node %d: the leader has shut down after %d steps", self.rank, steps)

    def check_leader(self) -> None:
        if not self.is_leader:
            raise RuntimeError(f"node_rank {self.rank} is a follower: requests go to the "
                               "leader (node_rank 0); this engine only replayed its steps")

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()


def process_group(config: EngineConfig) -> SingleProcess | MultiProcess:
    """The engine's process group; with nnodes > 1 this initializes jax.distributed, so it
    must come before anything starts jax's backends."""
    return MultiProcess(config) if config.nnodes > 1 else SingleProcess()


def initialize(config: EngineConfig) -> None:
    """jax.distributed.initialize for this node, or a check that the user's call agrees."""
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (config.nnodes, config.node_rank):
            raise ValueError(
                f"jax.distributed already runs {jax.process_count()} processes with this one "
                f"as {jax.process_index()}, but nnodes={config.nnodes}, "
                f"node_rank={config.node_rank}")
        return
    # CPU devices of several processes reach each other through gloo (JAX's default is
    # none); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"{config.master_addr}:{config.master_port}",
                               num_processes=config.nnodes, process_id=config.node_rank)
