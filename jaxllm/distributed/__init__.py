"""Several processes (nodes) as one engine, on JAX's own runtime: `jax.distributed`.

One mesh spans the devices of every process; process 0 (the leader) schedules, and every
process runs the same jitted steps in the same order (executor.py), so their collectives
meet. launch.py starts the runtime, channel.py carries the leader's calls to the followers.

How a user starts the followers: every process constructs the same engine with the same
arguments, only `node_rank` differs:

    LLM(model, tensor_parallel_size=16, nnodes=2, node_rank=R, master_addr="10.0.0.1")

On node_rank 0 this is an ordinary `LLM`. On node_rank > 0 the constructor loads the model,
builds the runner and compiles exactly as the leader does, then replays the leader's steps
until the leader shuts down (at its exit, or `llm.llm_engine.shutdown()`), and returns an
engine that refuses requests. `jaxllm serve ... --nnodes 2 --node-rank 1 --headless` is the
same thing without an API server.

Why the same constructor rather than a separate worker function: a follower must hold the
same parameters, the same KV cache shape and the same compiled buckets as the leader, and
the surest way to get them is to build them from the same arguments through the same code;
a worker entry point would repeat the whole argument list and drift from it. It is also how
JAX programs run on several hosts: one program, started once per process.

Left out: Ray (vLLM's `--distributed-executor-backend ray`: start the processes with any
launcher instead, jax.distributed needs nothing else), pipeline parallelism, and data
parallelism across nodes (`data_parallel_size > 1` with `nnodes > 1` is refused).
"""
