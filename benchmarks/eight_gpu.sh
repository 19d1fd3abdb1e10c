#!/usr/bin/env bash
# Issue 52's runs on one host of N GPUs (default 8): the communication split at a real ring size, the straggler
# among N, the rank exchange on N real ranks, DDP's overhead. Each PART fits one 600 s device call; run them in turn
# (a results file each, under OUT_DIR, each naming the phase_timer tree on its first line).
#
#     PYTHONPATH=. benchmarks/eight_gpu.sh OUT_DIR [N] [PART ...]     PART: comm fsdp exchange overhead (default all)
#
# comm:     comm_nccl.py --launches on N ranks, a ~1B-parameter GPT (24 x 2048, 8 x 1024 tokens a rank): DDP's
#           defaults, one bucket, rank 1 slow in forward (20 ms), rank 1 slow in its data; each step of every rank
#           against the profiler's queued and blocked rules; RANK_STRAGGLER on rank zero's verdict.
# fsdp:     the same model under FSDP2 (per block and root).
# exchange: rank_exchange.py on N real processes (gloo on this host's cores): rank zero's time a window.
# overhead: distributed.py --nproc N: DDP's overhead (interleaved pairs), the syncs added (none), the slowed rank.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd); n=${2:-8}; shift $(( $# >= 2 ? 2 : 1 ))
parts=${*:-comm fsdp exchange overhead}
cd "$(dirname "$0")/.." && export PYTHONPATH=$PWD
model=(--width 2048 --depth 24 --batch 8 --seq 1024)
for part in $parts; do
  t0=$(date +%s)
  case $part in
    comm) timeout 580 torchrun --standalone --nproc_per_node "$n" benchmarks/comm_nccl.py --launches "${model[@]}" \
            --cases ddp_default,ddp_one,ddp_straggler,data_straggler --out "$out/comm_nccl_${n}.txt" > "$out/comm_nccl_${n}.log" 2>&1 ;;
    fsdp) timeout 580 torchrun --standalone --nproc_per_node "$n" benchmarks/comm_nccl.py --launches "${model[@]}" \
            --cases fsdp2 --out "$out/comm_nccl_fsdp2_${n}.txt" > "$out/comm_nccl_fsdp2_${n}.log" 2>&1 ;;
    exchange) timeout 580 python benchmarks/rank_exchange.py --ranks "$n" --scale "" --old-rev "" \
            --out "$out/rank_exchange_${n}.txt" > "$out/rank_exchange_${n}.log" 2>&1 ;;
    overhead) timeout 580 python benchmarks/distributed.py --nproc "$n" --pairs 3 \
            --out "$out/distributed_${n}.txt" > "$out/distributed_${n}.log" 2>&1 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
  echo "$part: rc=$? in $(( $(date +%s) - t0 )) s"
done
grep -hE "steps within|step > period|RANK_STRAGGLER|exchange\(\)|overhead|sync calls" "$out"/*.txt 2>/dev/null | cut -c1-240
