#!/usr/bin/env bash
# Every runtime check this project makes on a lent GPU, in one run of under 8 minutes
# (docs/benchmarks.md, "GPU checks"), most important first:
#   1. benchmarks/gpu_llada8b.py: LLaDA-8B-shaped forward latency vs the weight-read floor
#      (targets: batch-1 cached block step <= 5 ms, batch 16 <= 15 ms);
#   2. the GPU-marked tests (tests/gpu: CUDA paths, a one-rank NCCL group and the vocab-parallel
#      sampler on CUDA; tests/unit/engine/test_engine_cuda_graphs.py:
#      captured graphs of mixed rows == eager tokens in every mode);
#   3. benchmarks/engine_overhead.py on the 8B-shaped random model (target ratio >= 0.9),
#      without and with the prefix KV cache (with CUDA graphs), and on LLaDA2.0-mini's shape
#      at batch 1 (MoE block-diffusion decode; target >= 250 answer tokens/s);
#   4. benchmarks/gpu_profile_step.py: kernels per cached step and the top kernels;
#   5. benchmarks/gpu_moe_layer.py: LLaDA2.0-mini's MoE layer, grouped GEMMs vs one by one;
#   6. benchmarks/graph_coverage.py --device cuda: decode forwards of staggered mixed traffic
#      that replay a captured graph, per decoding mode (target >= 90 %).
# Usage (on the GPU machine, repo root): OUT=/some/dir bash scripts/gpu_session.sh
# The lent machine returns at most 8 files from $OUT, so every result and log goes into one
# archive, $OUT/gpu_session.tgz, re-packed after each step (a step killed by its timeout
# keeps what the earlier ones wrote), beside the whole console log in $OUT/session.log.
set -u
# The lent machine has torch/transformers/safetensors but not uuid6 nor llguidance (the
# structured-output GPU tests skip without it): carry their wheels in .whl/
# (pip download uuid6 llguidance --no-deps -d .whl).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
# Without uuid6 every step below fails: stop now, before any device time is spent on it.
python3 -c "import uuid6" || {
  echo "uuid6 is missing: run 'pip download uuid6 llguidance --no-deps -d .whl' here, then carry .whl" >&2
  exit 1
}
export OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
RES=$(mktemp -d)
exec > >(tee -a "$OUT/session.log") 2>&1
pack() { tar czf "$OUT/gpu_session.tgz" -C "$RES" . ; }
nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"

timeout 80 python3 benchmarks/gpu_llada8b.py --max-seconds 55 --out "$RES/gpu_llada8b.json" \
  2>&1 | tee "$RES/gpu_llada8b.log"
pack
# Only the files that hold GPU-marked tests: the machine has no fastapi, pydantic, uvicorn or
# openai, so collecting the whole tree would stop at the API tests' imports and run nothing;
# nor pytest-xdist, so pyproject's addopts (which spread the suite over workers) are cleared.
gpu_files=$(grep -rlE "mark\.gpu\b" tests | sort)
timeout 90 python3 -m pytest $gpu_files -m gpu -q -rs -p no:cacheprovider -o addopts= 2>&1 \
  | tee "$RES/gpu_tests.log"
pack
# 16 rows of at most 32 tokens: graphs up to 512 tokens (fewer captures at start-up).
timeout 60 python3 benchmarks/engine_overhead.py --random-8b --device cuda --repeat 3 \
  --cuda-graph-max-tokens 512 --out "$RES/engine_overhead_8b.json" 2>&1 | tee "$RES/engine_overhead_8b.log"
pack
# The prefix cache's cached steps replay CUDA graphs (gpu_llada8b.py above times the eager
# forward beside the replay).
timeout 50 python3 benchmarks/engine_overhead.py --random-8b --device cuda --repeat 3 \
  --cuda-graph-max-tokens 512 --kv-cache prefix --gen-length 64 --steps 64 --block-length 32 \
  --out "$RES/engine_overhead_8b_prefix.json" 2>&1 | tee "$RES/engine_overhead_8b_prefix.log"
pack
# LLaDA2.0-mini-shaped MoE block diffusion at batch 1 (target >= 250 answer tokens/s): random
# weights commit what the schedule says, 8 steps per 32-token block = 4 tokens a forward.
timeout 70 python3 benchmarks/engine_overhead.py --random-llada2-mini --device cuda --repeat 2 \
  --cuda-graph-max-tokens 128 --requests 1 --gen-length 64 --steps 8 --out "$RES/llada2_mini_decode.json" 2>&1 \
  | tee "$RES/llada2_mini_decode.log"
pack
timeout 30 python3 benchmarks/gpu_profile_step.py --out "$RES/gpu_profile_step.json" 2>&1 \
  | grep -v "^USDT" | tee "$RES/gpu_profile_step.log"
pack
timeout 25 python3 benchmarks/gpu_moe_layer.py --out "$RES/gpu_moe_layer.json" 2>&1 \
  | tee "$RES/gpu_moe_layer.log"
pack
timeout 50 python3 benchmarks/graph_coverage.py --device cuda --out "$RES/graph_coverage_cuda.json" \
  2>&1 | tee "$RES/graph_coverage_cuda.log"
pack
echo "== summary"; grep -hE "^batch|ratio|tokens:|passed|failed|error|graphable" "$RES"/*.log
sleep 1  # let the console tee flush session.log
