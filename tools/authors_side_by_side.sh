#!/bin/bash
# The authors' GradMem training step beside this code's, on 2 threads with nothing else running: K = 5 and K = 1,
# 16 pairs, batch 32, fp32, each variant in its own process, the variants of a round one after the other, rounds
# alternating. Appends one JSON line per variant and round to OUT. Run from the repo root:
#   AUTHORS=/path/to/gradmem PY_AUTHORS=/path/to/venv/bin/python bash tools/authors_side_by_side.sh OUT.jsonl
#   AUTHORS:    a checkout of github.com/yurakuratov/gradmem (files and patch: tools/bench_authors.py's docstring)
#   PY_AUTHORS: a Python with torch and transformers 4.53 (their pin) for their code (default: python)
#   S14:        optional work tree of another commit of this repo, timed as variant s14_compile (skipped if absent)
#   ROUNDS, KS: the rounds and K values to run (default "1 2" and "5 1")
#   ONLY:       if set, only these variants, e.g. ROUNDS="3 4" KS=5 ONLY="authors compile compile_accum2"
# Variants: authors, compile (--compile), eager_hvp (the default eager step), compile_accum2 (K = 5 only,
# --compile --grad_accum 2). Results: results/bench/authors_side_by_side_{intel_amx,amd_epyc,intel_noamx}.jsonl.
AUTHORS=${AUTHORS:-/tmp/authors}; PY_AUTHORS=${PY_AUTHORS:-python}; S14=${S14:-/tmp/s14code}; OUT=$1
ROUNDS=${ROUNDS:-1 2}; KS=${KS:-5 1}; ONLY=${ONLY:-}
cd "$(dirname "$0")/.."
run() {  # variant dir cmd...
  v=$1; d=$2; shift 2
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $v "* ]] && return
  echo "{\"variant\": \"$v\", \"round\": $r, \"d\": $(cd $d && "$@" 2>/dev/null | tail -1)}" >> $OUT
}
here=$PWD
for K in $KS; do
  if [ $K = 5 ]; then N=5; else N=8; fi
  for r in $ROUNDS; do
    run authors $here $PY_AUTHORS tools/bench_authors.py --repo $AUTHORS --K $K --steps $N
    [ -d "$S14" ] && run s14_compile $S14 python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N --compile
    run compile $here python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N --compile
    run eager_hvp $here python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N
    if [ $K = 5 ]; then
      run compile_accum2 $here python train.py --pairs 16 --K $K --batch_size 32 --queries 1 --bench $N --compile --grad_accum 2
    fi
  done
done
