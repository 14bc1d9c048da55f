"""The vLLM peer of benchmarks/throughput.py: vLLM's offline `LLM.generate` on the same
workload, run by the python that has vLLM (its own venv: vLLM pins its own torch).

Owns: finding that python, the environment of vLLM's CPU layouts, and the subprocess that
runs vLLM and writes back times, tokens and peak RSS. The parent side never imports vllm;
only this file run as a script does (`python vllm_peer.py WORK.json RESULT.json`). Never
imported by jaxllm or by tests.

Layouts (vLLM's CPU backend reads them when its engine starts):
  best      every core computes: VLLM_CPU_OMP_THREADS_BIND=<all usable cores>,
            VLLM_CPU_NUM_OF_RESERVED_CPU=0 (vLLM warns that it wants one core reserved)
  default   vLLM's own choice: neither variable set, so it keeps a core for its scheduler
            process, which does not sleep when idle (vLLM 0.32), and computes on the rest
Both set VLLM_CPU_KVCACHE_SPACE=2 (GiB of KV cache). Which layout is faster depends on the
machine and the load beside it, so both are measured, in both dtypes.

Timing: a 2-request warm-up after the load, `warmup_runs` untimed runs of the whole
workload, then the whole workload `repeats` times, each
one LLM.generate call timed around itself (generation only; the load is not timed).
Peak RSS: vLLM v1 runs its engine in child processes (on the CPU backend of 0.32: EngineCore,
and its Worker, which holds the weights and the KV cache). After the timed runs and before
shutdown, the script reads VmHWM (the kernel's peak RSS of a process) from /proc/<pid>/status
of every descendant; the engine's figure is their sum (pages they share, such as libtorch's
code, are counted in each), listed per process in "info". The front end (the
process that called LLM(), holding the tokenizer) is reported apart and not counted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# peer name -> (vLLM dtype, layout)
VLLM_PEERS = {"vllm-f32": ("float32", "best"), "vllm-bf16": ("bfloat16", "best"),
              "vllm-f32-default": ("float32", "default"),
              "vllm-bf16-default": ("bfloat16", "default")}


def find_python(vllm_python: str | None) -> tuple[str | None, str]:
    """(the python to run vLLM with, or None; what was found or why not)."""
    if vllm_python is None:
        if importlib.util.find_spec("vllm") is None:
            return None, "vllm is not importable here and no --vllm-python was given"
        vllm_python = sys.executable
    probe = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{vllm_python} cannot import vllm ({tail})"
    return vllm_python, f"vllm {probe.stdout.strip()} ({vllm_python})"


def cpu_list(cpus: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND's syntax: "0-3" for a contiguous range, else "0,2,5"."""
    cpus = sorted(cpus)
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def layout_env(layout: str, base: dict[str, str], cpus: list[int]) -> dict[str, str]:
    env = {k: v for k, v in base.items()
           if k not in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
    env["VLLM_CPU_KVCACHE_SPACE"] = "2"
    if layout == "best":
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_list(cpus)
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return env


def run_vllm(python: str, peer: str, model_dir: str, prompts: list[list[int]],
             outs: list[int], *, repeats: int, max_num_seqs: int, max_model_len: int,
             ld_preload: str | None = None, warmup_runs: int = 0) -> dict:
    """One vLLM peer in a subprocess: {"times", "tokens", "peak_rss_mib", "info"}.
    ld_preload: LD_PRELOAD for vLLM alone (its docs ask for tcmalloc and Intel's OpenMP)."""
    dtype, layout = VLLM_PEERS[peer]
    work = {"model": model_dir, "dtype": dtype, "prompts": prompts, "outs": outs,
            "repeats": repeats, "max_num_seqs": max_num_seqs, "max_model_len": max_model_len,
            "warmup_runs": warmup_runs}
    env = layout_env(layout, dict(os.environ), sorted(os.sched_getaffinity(0)))
    if ld_preload:
        env["LD_PRELOAD"] = ld_preload
    with tempfile.TemporaryDirectory(prefix="vllm_peer_") as d:
        work_path, result_path = os.path.join(d, "work.json"), os.path.join(d, "result.json")
        with open(work_path, "w") as f:
            json.dump(work, f)
        run = subprocess.run([python, os.path.abspath(__file__), work_path, result_path],
                             env=env, cwd=d, capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"{peer} failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
        with open(result_path) as f:
            result = json.load(f)
    bind = {k: env[k] for k in env if k.startswith("VLLM_CPU_") or k == "LD_PRELOAD"}
    # vLLM logs (to stdout) the cores its OpenMP threads are bound to.
    cores = re.findall(r"core ids=(\[[^\]]*\])", run.stdout + run.stderr)
    result["info"] += f"; {layout} layout {bind}, compute cores {', '.join(cores) or '?'}"
    return result


def _vm_hwm_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _engine_peaks() -> dict[str, int]:
    """VmHWM in KiB of every live descendant, by "name pid"."""
    peaks = {}
    for pid in _descendants(os.getpid()):
        kib = _vm_hwm_kib(pid)
        try:
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        if kib is not None:
            peaks[f"{name} {pid}"] = kib
    return peaks


def _child(work_path: str, result_path: str) -> None:
    with open(work_path) as f:
        work = json.load(f)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=work["model"], dtype=work["dtype"], max_num_seqs=work["max_num_seqs"],
              max_model_len=work["max_model_len"], seed=0)
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=o)
              for o in work["outs"]]
    warmup = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)
    llm.generate(prompts[:2], [warmup, warmup], use_tqdm=False)
    for _ in range(work.get("warmup_runs", 0)):  # whole-workload runs, not timed
        llm.generate(prompts, params, use_tqdm=False)
    times, outputs = [], None
    for _ in range(work["repeats"]):
        llm.reset_prefix_cache()  # every run computes its prompts, as jaxllm's do
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    peaks = _engine_peaks()
    scheduler = llm.llm_engine.vllm_config.scheduler_config
    breakdown = ", ".join(f"{k} {v / 1024:.0f}" for k, v in peaks.items())
    info = (f"LLM() {load_s:.1f} s, max_num_batched_tokens {scheduler.max_num_batched_tokens}; "
            f"peak RSS MiB: engine processes {breakdown}; front end (not counted) "
            f"{_vm_hwm_kib(os.getpid()) / 1024:.0f}")
    with open(result_path, "w") as f:
        json.dump({"times": times, "tokens": tokens, "info": info,
                   "peak_rss_mib": sum(peaks.values()) / 1024}, f)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
