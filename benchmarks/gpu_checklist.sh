#!/usr/bin/env bash
# The GPU checklist (../shared/GPU.md, issue 41) as one script for a lent GPU machine, run from the repository root:
#
#   bash benchmarks/gpu_checklist.sh OUT_DIR PART...
#
# PARTs, each under its own time limit, results written to OUT_DIR as they come (a part cut short keeps its log):
#   gpu-tests  the tests that run only where a GPU is (tests/checkpoint/test_cuda.py and the CUDA tests beside others)
#   ckpt       benchmarks/bench_cuda_ckpt.py: save / async_save / load of ~8 GiB of CUDA tensors against torch DCP
#   runtime    benchmarks/runtime_step.py --orig-params at ~1B parameters, SHARD_GRAD_OP and NO_SHARD against FSDP2
#   suite      the whole test suite (pytest-xdist over the machine's cores), what the machine has installed
#
# The machine has torch, safetensors, fsspec, numpy, tqdm, pytest and hypothesis; crc32c and zstandard travel as
# wheels in .whl/ (see the device tool's README): they are installed first, with the package itself.
set -u
out=${1:?usage: gpu_checklist.sh OUT_DIR PART...}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
site=/tmp/site
if [ ! -d "$site/shardckpt" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl || exit 1
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$site" . || exit 1
fi
export PYTHONPATH="$site"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  df -h /tmp | tail -1; nproc; free -g | head -2; } > "$out/env.txt" 2>&1

for part in "$@"; do
    echo "=== $part $(date +%T)"
    case $part in
    gpu-tests)
        timeout 150 python3 -m pytest -q -p no:cacheprovider -rs --junitxml="$out/junit_gpu.xml" \
            tests/checkpoint/test_cuda.py \
            tests/state_dict/test_orig_params_state.py::test_on_cuda_with_nccl \
            tests/formats/test_safetensors_reader.py::test_reads_into_a_gpu_buffer > "$out/gpu_tests.log" 2>&1
        tail -5 "$out/gpu_tests.log" ;;
    ckpt)
        timeout "${CKPT_S:-330}" python3 benchmarks/bench_cuda_ckpt.py --gib "${GIB:-8}" --repeats "${REPEATS:-3}" --dir /tmp \
            --json "$out/bench_cuda.json" > "$out/bench_cuda.log" 2>&1
        tail -12 "$out/bench_cuda.log" ;;
    runtime)
        for strategy in SHARD_GRAD_OP NO_SHARD; do
            timeout 90 python3 benchmarks/runtime_step.py --orig-params --config 1b --strategy $strategy --steps 8 \
                --warmup 3 2>&1 | grep -v Warning
        done > "$out/runtime.log" 2>&1
        cat "$out/runtime.log" ;;
    suite)
        # -v: every result is a line with its test's name, so that a run cut short still names its failures.
        timeout "${SUITE_S:-200}" python3 -m pytest -v -p no:cacheprovider -n 12 --continue-on-collection-errors \
            -W ignore::DeprecationWarning --junitxml="$out/junit_suite.xml" > "$out/suite.log" 2>&1
        grep -E " (FAILED|ERROR) " "$out/suite.log" | head -40
        grep -cE " PASSED " "$out/suite.log"
        tail -3 "$out/suite.log" ;;
    *) echo "unknown part $part" ;;
    esac
done
echo "=== done $(date +%T)"
