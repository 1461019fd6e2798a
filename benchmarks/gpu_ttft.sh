#!/usr/bin/env bash
# Issue 16's open cells through the CLI on one GPU, in one device call, most important first, within BUDGET_S:
#   1. the real qwen2.5-0.5b at 16K and 30K, sekv then full: a 2-question `sekv chat` per pack (TTFT of the
#      process's first question and of the second), after `sekv ingest` (ingest / prefill ratio);
#   2. the Llama-3-8B-shaped random model saved as a local model directory (benchmarks/gpu_cli.py random-model),
#      sekv at 128K then 32K (ingest / prefill ratio, TTFT, decode);
#   3. with what is left: the 0.5B at 4K (sekv, full), then full on the 8B shape at 32K and 128K.
# A cell is not started when the one before says it would end past the budget (gpu_cli --budget-s), and each run
# is cut at what is left overall (its finished cells are already in its JSON).  Expect about 5 minutes for 1-2
# (each process spends ~9 s importing, the 8B model ~1 min to save); BUDGET_S=600 runs all of it.
# Every number lands in $OUT/*.json (gpu_cli's records) and the tables in $OUT/*.txt.
#
# Before the device call, here (the documents travel with the tree as untracked files, ~1 MB):
#   python -m benchmarks.gpu_cli docs --model qwen2.5-0.5b --lengths 16384,30720,4096 --out bench_docs
#   python -m benchmarks.gpu_cli docs --model qwen2.5-0.5b --lengths 131072,32768 --out bench_docs_8b
# On the device (the real model already installed under $SEKV_HOME):
#   SEKV_HOME=/var/tmp/sekv BUDGET_S=290 bash benchmarks/gpu_ttft.sh
#
# Python's bytecode is cached under /var/tmp/pyc (the image sets PYTHONDONTWRITEBYTECODE): every process after the
# first imports torch and transformers from .pyc, as a `pip install` leaves them.  That changes only the import
# columns; TTFT, scout, decode, ingest and prefill are timed inside the process.
set -u
OUT=${OUT:-/var/tmp/gpu_ttft}
BUDGET_S=${BUDGET_S:-290}
RAND=${RAND_MODEL:-/var/tmp/rand8b}
PY=${PY:-python3}
export SEKV_HOME=${SEKV_HOME:-/var/tmp/sekv} PYTHONPYCACHEPREFIX=/var/tmp/pyc
unset PYTHONDONTWRITEBYTECODE
mkdir -p "$OUT"
T0=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - T0))); }
run() {  # run NAME BUDGET ARGS...: one gpu_cli run, its own budget and a hard timeout at what is left overall
  local name=$1 budget=$2; shift 2
  local l; l=$(left)
  if [ "$l" -le 10 ]; then echo "skip $name: budget spent"; return; fi
  [ "$budget" -gt "$l" ] && budget=$l
  echo "== $name (budget ${budget}s, ${l}s left)"
  timeout "$l" $PY -m benchmarks.gpu_cli run --no-ask --chat 2 --max-new-tokens 16 --budget-s "$budget" --out "$OUT/$name.json" "$@" \
    | tee "$OUT/$name.txt" | tail -n 12
}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

# 1. the real 0.5B at 16K and 30K (at most 40 % of the budget)
run qwen05b $((BUDGET_S * 2 / 5)) --docs bench_docs --lengths 16384,30720 --methods sekv,full --workdir /var/tmp/packs_ttft

# 2. the 8B shape: weights drawn on the GPU, saved once (16 GB), their fingerprint computed once outside the cells
if [ ! -f "$RAND/config.json" ] && [ "$(left)" -gt 120 ]; then
  ts=$(date +%s)
  timeout "$(left)" $PY -m benchmarks.gpu_cli random-model --shape 8b --out "$RAND" --device cuda
  timeout "$(left)" $PY -c "import sys; from pathlib import Path; from sekv_core import models; models._weights_fingerprint(Path(sys.argv[1]))" "$RAND"
  echo "random 8B model saved and fingerprinted in $(($(date +%s) - ts)) s" | tee "$OUT/rand8b_model.txt"
fi
if [ -f "$RAND/config.json" ]; then
  run rand8b_sekv "$(left)" --docs bench_docs_8b --model "$RAND" --lengths 131072,32768 --methods sekv --workdir /var/tmp/packs8b
fi

# 3. what time is left: the 0.5B at 4K, then full on the 8B shape (decode and memory against sekv)
run qwen05b_4k "$(left)" --docs bench_docs --lengths 4096 --methods sekv,full --workdir /var/tmp/packs_ttft
if [ -f "$RAND/config.json" ]; then
  run rand8b_full "$(left)" --docs bench_docs_8b --model "$RAND" --lengths 32768,131072 --methods full --workdir /var/tmp/packs8b
fi
rm -rf /var/tmp/packs_ttft /var/tmp/packs8b
echo "done in $(($(date +%s) - T0)) s"
