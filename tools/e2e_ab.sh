#!/bin/bash
# Issue 23 on a GPU host, this code against an earlier one in the same call (docs/loadtest.md, "Thirty-ninth session").
# Here: python tools/e2e_bench.py pack; git archive --prefix=base/ REV | gzip > .e2e/base.tar.gz
# There, carry [".e2e"]: bash tools/e2e_ab.sh STEP... with STEP one of new-redis, base-redis, new-sqlite1,
# base-sqlite1, new-sqlite12, base-sqlite12, r-new, r-base, s-new, s-base, s30-new, cpu-gpu, nocache; results under $OUT (all.tgz at the end).
R=$PWD
python3 -m pip install -q --no-index --no-deps --target .e2e/site .e2e/whl/*.whl && tar -xzf .e2e/jieba.tgz -C .e2e/site || exit 3
if [ ! -d /tmp/base ]; then mkdir -p /tmp/bx && tar -xzf .e2e/base.tar.gz -C /tmp/bx && mv /tmp/bx/base /tmp/base && ln -sfn $R/.e2e /tmp/base/.e2e && rm -rf /tmp/base/engines && ln -sfn $R/engines /tmp/base/engines; fi
one() { # code-dir tag layouts rates processes [more arguments of e2e_bench.py run]
  (cd $1 && PYTHONPATH=$R/.e2e/site:$1 timeout ${T:-560} python3 tools/e2e_bench.py run --out $OUT/$2 --layouts $3 --rates $4 \
     --seconds 10 --warmup 2 --generators 8 --processes $5 ${@:6} > $OUT/$2.stdout 2>&1; echo "$2 exit $?")
  grep -h "answered\|ready in\|not ready\|skipped" $OUT/$2/e2e.log 2>/dev/null | cut -c1-400
  python3 -c "
import json,sys
d=json.load(open('$OUT/$2/e2e.json'))
for n,l in d['layouts'].items():
  for s in l.get('steps',[]): print(n, s['offered_rps'], 'errors', s['errors'], s.get('errors_by_kind'), 'loop', s.get('event_loop_cpu_ms_per_msg'))
" 2>&1 | tail -5
  grep -h "Traceback\|Error\|error" $OUT/$2/serve-*.log 2>/dev/null | sort | uniq -c | sort -rn | head -5
}
N=0
for step in "$@"; do
  case $step in
    new-redis) one $R new-redis gpu-redis 5200,5200 12 ;;
    base-redis) one /tmp/base base-redis gpu-redis 5200,5200 12 ;;
    new-sqlite1) one $R new-sqlite1 gpu 400,800 1 ;;
    base-sqlite1) one /tmp/base base-sqlite1 gpu 400,800 1 ;;
    new-sqlite12) one $R new-sqlite12 gpu 2000 12 ;;
    base-sqlite12) one /tmp/base base-sqlite12 gpu 2000 12 ;;
    r-new) one $R r-new-$((++N)) gpu-redis 5200 12 ;;
    r-base) one /tmp/base r-base-$((++N)) gpu-redis 5200 12 ;;
    s-new) one $R s-new-$((++N)) gpu 400 1 ;;
    s-base) one /tmp/base s-base-$((++N)) gpu 400 1 ;;
    # issue 23's "GPU layout >= 3x the CPU layout, same host, same call": ONNX Runtime in each of 12 front ends
    cpu-gpu) one $R cpu-gpu cpu-redis,gpu-redis 5200 12 --cpu-rates 1000,1700 ;;
    # one SQLite front end for 30 s a step: the caches a fresh process fills (repeated questions, follow-up
    # readings) weigh less than in a 10 s step
    s30-new) one $R s30-new-$((++N)) gpu 400 1 --seconds 30 ;;
    # every message encoded: the CPU layout at its ceiling, the GPU's rate stepped up to find its own
    nocache) one $R nocache cpu-redis-nocache,gpu-redis-nocache 2700,3600,4500 12 --cpu-rates 900 ;;
  esac
done
tar -czf $OUT/all.tgz -C $OUT --exclude=all.tgz . 2>/dev/null; ls -la $OUT/all.tgz
