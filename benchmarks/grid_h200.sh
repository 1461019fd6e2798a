#!/usr/bin/env bash
# Issue 20's grid on one GPU machine, resumable across calls: every shard's finished cells come from
# docs/bench/grid-h200/SHARD/results.jsonl.gz (copied to RUNS once), new cells are appended there, and the whole RUNS
# folder is packed into $OUT/grid-h200.tgz at the end (unpack it over docs/bench/grid-h200 with benchmarks/grid_h200.sh
# unpack TGZ on the development machine).  The model and the haystack must be in place (SEKV_HOME, HAYSTACK).
#
#   LIMIT=580 JOBS=16 HAYSTACK=/var/tmp/hay bash benchmarks/grid_h200.sh run      # on the GPU machine
#   bash benchmarks/grid_h200.sh unpack /path/to/grid-h200.tgz                      # here: refresh docs/bench/grid-h200
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd)
DOCS=$R/docs/bench/grid-h200
# The first calls ran one shard per task and length (vt:4K:0-19 ...); their folders keep those names. What was left
# is split into shards of 1-3 seeds, longest first, so that all --jobs processes stay busy to the end; a seed those
# first shards had started is finished in their folder (the fourth field).
SHARDS="mk_niah:8K:2 mk_niah:8K:3 mk_niah:4K:3
vt:8K:6-7 vt:8K:8-9 vt:8K:10-11 vt:8K:12-13 vt:8K:14-15 vt:8K:16-17 vt:8K:18-19
cwe:8K:9-11 cwe:8K:12-14 cwe:8K:15-17 cwe:8K:18-19
mv_niah:8K:7-8 mv_niah:8K:9-10 mv_niah:8K:11-12 mv_niah:8K:13-14 mv_niah:8K:15-16 mv_niah:8K:17-18 mv_niah:8K:19
vt:4K:7-8 vt:4K:9-10 vt:4K:11-12 vt:4K:13-14 vt:4K:15-16 vt:4K:17-18 vt:4K:19
cwe:4K:10-12 cwe:4K:13-15 cwe:4K:16-18 cwe:4K:19
mv_niah:4K:8-9 mv_niah:4K:10-11 mv_niah:4K:12-13 mv_niah:4K:14-15 mv_niah:4K:16-17 mv_niah:4K:18-19
mk_niah:4K:2:mk_niah-4K-s0-3 mk_niah:8K:1:mk_niah-8K-s0-3 vt:4K:6:vt-4K-s0-19 vt:8K:5:vt-8K-s0-19
cwe:4K:9:cwe-4K-s0-19 cwe:8K:8:cwe-8K-s0-19 mv_niah:4K:7:mv_niah-4K-s0-19 mv_niah:8K:6:mv_niah-8K-s0-19
niah:16K:2 niah:4K,8K:1 niah:4K,8K:2 niah:16K:0 niah:16K:1 niah:4K,8K:0 qa:4K:0 qa_heldout:4K:0"
case "${1:-run}" in
run)
  RUNS=${RUNS:-/var/tmp/runs}
  mkdir -p "$RUNS"
  for d in "$DOCS"/*/; do
    n=$(basename "$d")
    [ -f "$RUNS/$n/results.jsonl" ] || { mkdir -p "$RUNS/$n"; gzip -dc "$d/results.jsonl.gz" > "$RUNS/$n/results.jsonl"; }
  done
  cd "$R"
  python3 -m benchmarks.grid_shards --root "$RUNS" --jobs "${JOBS:-16}" --time-limit "${LIMIT:-580}" \
    --methods full,sekv,kvzip,snapkv,streamingllm,sentencekv,depthweave,rag --budgets 0.05,0.1,0.2 \
    --model qwen2.5-0.5b --device cuda --haystack "${HAYSTACK:?folder of the haystack essays}" $SHARDS | tail -20
  wc -l "$RUNS"/*/results.jsonl | tail -1
  tar czf "${OUT:?}/grid-h200.tgz" -C "$RUNS" --exclude='*.log' .
  ;;
unpack)
  T=$(mktemp -d); tar xzf "$2" -C "$T"
  for d in "$T"/*/; do n=$(basename "$d"); mkdir -p "$DOCS/$n"; gzip -9 -c "$d/results.jsonl" > "$DOCS/$n/results.jsonl.gz"; done
  rm -rf "$T"
  ;;
*) echo "usage: $0 run|unpack TGZ" >&2; exit 2 ;;
esac
