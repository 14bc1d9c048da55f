"""The llama.cpp peer of benchmarks/throughput.py: greedy batched generation through
llama-cpp-python's low-level API (the C functions), every sequence in one llama_batch.

Owns: turning (prompt token ids, output lengths) into llama.cpp decode calls, and timing them.
Never imported by jaxllm, and not needed by CI: llama-cpp-python builds llama.cpp from source
(`pip install llama-cpp-python`, several minutes).

One run: a fresh context holding every sequence (unified KV cache, n_seq_max = prompts);
prompts go in as chunks of up to `n_batch` tokens (several sequences per chunk, logits only
for each prompt's last token), then each step decodes one token for every unfinished
sequence in one batch. The argmax is taken in numpy over llama.cpp's float32 logits.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np


def _vocab_size(llama_cpp, model) -> int:
    if hasattr(llama_cpp, "llama_model_get_vocab"):
        return llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    return llama_cpp.llama_n_vocab(model)


def _load_model(llama_cpp, path: str):
    params = llama_cpp.llama_model_default_params()
    load = getattr(llama_cpp, "llama_model_load_from_file", None) or \
        llama_cpp.llama_load_model_from_file
    model = load(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


def _new_context(llama_cpp, model, n_ctx: int, n_seqs: int, n_batch: int, threads: int):
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = n_seqs
    params.n_threads = threads
    params.n_threads_batch = threads
    new = getattr(llama_cpp, "llama_init_from_model", None) or \
        llama_cpp.llama_new_context_with_model
    ctx = new(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    return ctx


class _Batch:
    """A llama_batch filled from Python lists."""

    def __init__(self, llama_cpp, capacity: int, n_seqs: int):
        self.llama_cpp = llama_cpp
        self.batch = llama_cpp.llama_batch_init(capacity, 0, n_seqs)
        self.capacity = capacity

    def fill(self, rows: list[tuple[int, int, int, bool]]) -> None:
        """rows: (token, position, sequence id, wants logits)."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(rows):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(rows)

    def free(self) -> None:
        self.llama_cpp.llama_batch_free(self.batch)


def _generate_once(llama_cpp, model, prompts, outs, vocab: int, threads: int,
                   n_batch: int) -> list[list[int]]:
    n = len(prompts)
    n_ctx = sum(len(p) + o for p, o in zip(prompts, outs)) + 16 * n
    ctx = _new_context(llama_cpp, model, n_ctx, n, n_batch, threads)
    batch = _Batch(llama_cpp, max(n_batch, n), n)
    try:
        def decode(rows):
            batch.fill(rows)
            if llama_cpp.llama_decode(ctx, batch.batch) != 0:
                raise RuntimeError("llama_decode failed")

        def argmax(index: int) -> int:
            ptr = llama_cpp.llama_get_logits_ith(ctx, index)
            logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                           shape=(vocab,))
            return int(np.argmax(logits))

        generated: list[list[int]] = [[] for _ in prompts]
        # Prefill: prompt tokens packed into chunks of n_batch; logits at each prompt's end.
        pending, chunk = [], []
        for seq, prompt in enumerate(prompts):
            for pos, token in enumerate(prompt):
                last = pos == len(prompt) - 1
                chunk.append((token, pos, seq, last))
                if last:
                    pending.append((seq, len(chunk) - 1))
                if len(chunk) == n_batch:
                    decode(chunk)
                    for s, i in pending:
                        generated[s].append(argmax(i))
                    chunk, pending = [], []
        if chunk:
            decode(chunk)
            for s, i in pending:
                generated[s].append(argmax(i))
        # Decode: one token for every sequence that still wants one, all in one batch.
        while True:
            live = [s for s in range(n) if len(generated[s]) < outs[s]]
            if not live:
                break
            decode([(generated[s][-1], len(prompts[s]) + len(generated[s]) - 1, s, True)
                    for s in live])
            for i, s in enumerate(live):
                generated[s].append(argmax(i))
        return generated
    finally:
        batch.free()
        llama_cpp.llama_free(ctx)


def generate_batched(gguf_path: str, prompts: list[list[int]], outs: list[int], *,
                     repeats: int, threads: int, n_batch: int = 512
                     ) -> tuple[list[float], list[list[int]]]:
    """(wall seconds of each run, greedy tokens of the last run)."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    model = _load_model(llama_cpp, gguf_path)
    vocab = _vocab_size(llama_cpp, model)
    times, tokens = [], None
    try:
        _generate_once(llama_cpp, model, [p[:8] for p in prompts[:2]], [2, 2], vocab,
                       threads, n_batch)  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            tokens = _generate_once(llama_cpp, model, prompts, outs, vocab, threads, n_batch)
            times.append(time.perf_counter() - t0)
    finally:
        free = getattr(llama_cpp, "llama_model_free", None) or llama_cpp.llama_free_model
        free(model)
    return times, tokens
