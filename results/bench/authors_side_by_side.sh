#!/bin/bash
# Session 15: side by side on 2 threads, nothing else running (a background training job was paused with
# kill -STOP for the whole script): the authors' code, the session-14 code and this code, K = 5 and K = 1,
# 16 pairs, batch 32, fp32, each variant twice, alternating. Output: authors_side_by_side_n16_b32.jsonl.
#   AUTHORS: a checkout of github.com/yurakuratov/gradmem with transformers 4.53 installed (README)
#   S14:     a work tree of this repo at commit e4d9f67 (git worktree add /tmp/s14code e4d9f67); skipped if absent
#   ROUNDS, KS, ONLY (session 18): the rounds and K values to run (default "1 2" and "5 1"), and if set, only these
#            variants, e.g. ROUNDS="3 4" KS=5 ONLY="authors compile compile_accum2" for two more K = 5 rounds
AUTHORS=${AUTHORS:-/tmp/authors}; PY_AUTHORS=${PY_AUTHORS:-python}; S14=${S14:-/tmp/s14code}; OUT=$1
ROUNDS=${ROUNDS:-1 2}; KS=${KS:-5 1}; ONLY=${ONLY:-}
cd "$(dirname "$0")/../.."
run() {  # variant dir cmd...
  v=$1; d=$2; shift 2
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $v "* ]] && return
  echo "{\"variant\": \"$v\", \"round\": $r, \"d\": $(cd $d && "$@" 2>/dev/null | tail -1)}" >> $OUT
}
here=$PWD
for K in $KS; do
  if [ $K = 5 ]; then N=5; else N=8; fi
  for r in $ROUNDS; do
    run authors $here $PY_AUTHORS results/bench/bench_authors.py --repo $AUTHORS --K $K --steps $N
    [ -d "$S14" ] && run s14_compile $S14 python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N --compile
    run compile $here python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N --compile
    run eager_hvp $here python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N
    if [ $K = 5 ]; then
      run compile_accum2 $here python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N --compile --grad_accum 2
    fi
  done
done
