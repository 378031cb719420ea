#!/usr/bin/env bash
# Everything this project checks on a lent GPU, in one run (see docs/benchmarks.md):
#   1. benchmarks/gpu_llada8b.py alone on the GPU (timings);
#   2. the CUDA tests (tests/gpu) and the demo-recipe sweep side by side.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash scripts/gpu_session.sh
set -u
# The lent machine has torch/transformers/safetensors but not uuid6: carry its wheel in .whl/.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH="$PWD/src:/tmp/site" PYTHONUNBUFFERED=1
export OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
nvidia-smi -L; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name())"
timeout 130 python3 benchmarks/gpu_llada8b.py --max-seconds 80 2>&1 | tee "$OUT/gpu_llada8b.log"
cp benchmarks/results/gpu_llada8b.json benchmarks/results/gpu_llada8b.png "$OUT/" 2>/dev/null
python3 scripts/recipe_sweep.py --out /tmp/sweep --device cuda --deadline "${SWEEP_SECONDS:-400}" \
  > "$OUT/sweep.log" 2>&1 &
sweep=$!
timeout 300 python3 -m pytest tests/gpu -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
wait "$sweep"
cp /tmp/sweep/sweep.json "$OUT/"
tail -20 "$OUT/sweep.log"
# The best run of each family comes back as a candidate checkpoint.
python3 - <<'PY'
import json, os, tarfile
out, res = os.environ["OUT"], json.load(open("/tmp/sweep/sweep.json"))
for fam in ("llada", "idlm"):
    def score(item):
        r = item[1]
        if r["report"]:
            return r["report"]["held_out_exact_match"]["addition"]
        return r["evals"][-1][1] if r["evals"] else -1
    runs = sorted((i for i in res.items() if i[0].startswith(fam)), key=score, reverse=True)
    if runs:
        name = runs[0][0]
        with tarfile.open(f"{out}/best_{fam}.tar.gz", "w:gz") as tar:
            tar.add(f"/tmp/sweep/{name}", arcname=name)
        print("best", fam, name, score(runs[0]))
PY
