#!/usr/bin/env bash
# The numerics check of the recipes: the 142M Llama on the embedded corpus, 1000 steps each, same seed and data.
#   bash benchmarks/loss_curves.sh OUT_DIR [recipes...]     -> OUT_DIR/loss_<recipe>.jsonl and OUT_DIR/loss_curves.png
set -u
out=${1:?usage: loss_curves.sh OUT_DIR [recipes...]}
shift
recipes=${*:-bf16 fp8_rowwise mxfp8}
mkdir -p "$out"
for r in $recipes; do
  rm -rf "/tmp/lc_$r"
  python3 -m mx_jax.train --config configs/llama3_140m.yaml quant.recipe="$r" run_dir="/tmp/lc_$r" log.progress=false ${EXTRA:-} \
    | grep -E "first step|step +1000|error" || echo "recipe $r failed"
  cp "/tmp/lc_$r/metrics.jsonl" "$out/loss_$r.jsonl"
done
python3 benchmarks/plot_loss.py --out "$out/loss_curves.png" "$out"/loss_*.jsonl
