#!/bin/bash
# Two replicas of the default model behind `sieve router` (round robin, through `sieve bench balance`), with a KV tier
# shared through Redis ("shared") or without ("alone"): a conversation's next turn lands on the other replica, which
# loads the turns before from the shared tier or computes them again (docs/benchmarks.md, KV tiers).
#   scripts/bench_replicas_router.sh shared|alone OUT_DIR
# Each replica is pinned to one core (taskset) with one thread; needs redis-server (the Makefile installs it).
set -u
cd "$(dirname "$0")/.."
mode=$1
out=$2
S=.venv/bin/sieve
mkdir -p "$out"
key=$(mktemp -d)/secret.key
head -c 32 /dev/urandom | xxd -p -c 64 > "$key" && chmod 600 "$key"
redis-server --port 6399 --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
redis=$!
sleep 1
extra=""
[ "$mode" = shared ] && extra="--kv-cache-remote redis://127.0.0.1:6399/0 --kv-cache-secret-file $key"
taskset -c 0 $S serve --port 8101 --num-threads 1 $extra > "$out/replica-a-$mode.log" 2>&1 &
a=$!
taskset -c 1 $S serve --port 8102 --num-threads 1 $extra > "$out/replica-b-$mode.log" 2>&1 &
b=$!
for port in 8101 8102; do
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 1; done
done
$S bench balance --replica http://127.0.0.1:8101 --replica http://127.0.0.1:8102 --policies round_robin --dataset multi-turn \
  --num-prompts 8 --turns 3 --input-len 400:500 --output-len 16:16 --concurrency 1 --output-json "$out/balance-$mode.json"
for port in 8101 8102; do
  curl -s "http://127.0.0.1:$port/metrics" | grep -E "^sieve:kv_tier_hits_total|^sieve:prefix_cache_hits_total"
done
kill $a $b $redis
wait $a $b $redis 2>/dev/null
