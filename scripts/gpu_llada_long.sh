#!/usr/bin/env bash
# Longer LLaDA demo recipes on a lent GPU (second device run; see docs/training.md).
set -u
# The lent machine has torch/transformers/safetensors but not uuid6: carry its wheel in .whl/.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
python3 scripts/recipe_sweep.py --out /tmp/sweep --device cuda --deadline "${SWEEP_SECONDS:-290}" \
  --only gpu-llada-d192x6 gpu-llada-d256x6 gpu-llada-d128x6 > "$OUT/sweep_long.log" 2>&1
cp /tmp/sweep/sweep.json "$OUT/sweep_long.json"
cat "$OUT/sweep_long.log"
for name in gpu-llada-d192x6 gpu-llada-d256x6 gpu-llada-d128x6; do
  [ -f "/tmp/sweep/$name/model.safetensors" ] && tar czf "$OUT/$name.tar.gz" -C /tmp/sweep "$name"
done
ls -la "$OUT"
