#!/bin/bash
# Table 2 (bAbI rows) at CPU scale: from-scratch models of the KV model's size on generated bAbI stories, one thread,
# one cell after another, each stopped after MINUTES (SIGTERM: train.py writes ckpt.pt) or at 100 % held-out EM.
# Each cell is then scored on test stories generated from another seed (eval_seed 777), which no checkpoint was
# picked on, and its log, config and scores are copied to results/table2/<cell>/.
#   usage: tools/table2_cpu.sh MINUTES MODEL:QA:SIZE:K[:ALPHA] ...      e.g. gradmem:1:10k:1 gradmem:1:10k:3:0.2 rmt:1:10k:1
#          tools/table2_cpu.sh MINUTES --finish MODEL:QA:SIZE:K   (score and copy a cell whose training has ended)
set -u
minutes=$1; shift
finish_only=0
[ "${1:-}" = --finish ] && { finish_only=1; shift; }
export OMP_NUM_THREADS=1
for cell in "$@"; do
  IFS=: read -r model qa size K alpha <<< "$cell"
  name=${model}_K${K}_qa${qa}_${size}
  out=out/table2/$name
  extra=()
  [ "$model" = rmt ] || [ "$model" = armt ] && extra=(--rope_theta 10000 --no-rope_llama3)   # as in Table 1
  [ -n "$alpha" ] && extra+=(--alpha "$alpha")
  cmd=(python train.py --task babi --qa "$qa" --babi_size "$size" --model "$model" --K "$K" --n_mem 8 "${extra[@]}"
       --batch_size 64 --max_steps 100000 --eval_interval 250 --log_interval 50 --target_em 1.0 --out_dir "$out")
  [ $finish_only = 1 ] || timeout -s TERM "${minutes}m" "${cmd[@]}" > "/tmp/log_$name" 2>&1
  python eval.py "$out/ckpt.pt" --weights ema --eval_seed 777 --K_eval "$K" --out "$out/eval_seed777.json" --overwrite >> "/tmp/log_$name" 2>&1
  mkdir -p "results/table2/$name"
  cp "$out/log.jsonl" "$out/config.json" "$out/eval_seed777.json" "results/table2/$name/"
  { echo "OMP_NUM_THREADS=1 timeout -s TERM ${minutes}m ${cmd[*]}"
    echo "python eval.py $out/ckpt.pt --weights ema --eval_seed 777 --K_eval $K --out $out/eval_seed777.json"; } > "results/table2/$name/command.txt"
done
