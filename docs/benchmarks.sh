#!/usr/bin/env bash
# Reproduces the tables in docs/benchmarks.md: the loopback limit (iperf3),
# Redis (redis-benchmark) and `tidepool bench`, all in one run on this host,
# so the ratios hold even on a noisy machine.
# Needs Debian's iperf3, redis-server, redis-tools and fio (apt-get install -y ...).
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-3s}
for cmd in iperf3 redis-server redis-cli redis-benchmark fio; do
	command -v "$cmd" >/dev/null || { echo "benchmarks.sh: $cmd not found (apt-get install -y iperf3 redis-server redis-tools fio)" >&2; exit 1; }
done
PY=/usr/bin/python3
work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "building tidepool" >&2
go build -o "$work/tidepool" ./cmd/tidepool

# iperf3 with one stream, and two iperf3 pairs at once. The engine moves a
# value over several pooled connections from several threads; Debian 12's
# iperf3 (3.12) runs all of -P's streams in one thread, so -P 4 is still one
# core's worth, and two processes are the loopback limit of two cores.
. docs/iperf.sh
iperf_servers 55201 55207
iperf1=$(iperf_one 55201)
iperf2=$(iperf_two 55201 55207)

echo "redis-benchmark, 4 MiB values" >&2
redis-server --port 55202 --save '' --appendonly no >/dev/null 2>&1 & pids+=($!)
for _ in $(seq 50); do redis-cli -p 55202 ping >/dev/null 2>&1 && break; sleep 0.1; done
redis-benchmark -p 55202 -d 4194304 -t set,get -n 1000 -c 4 --csv >"$work/redis.csv" 2>/dev/null
redis_rate() { awk -F'"' -v t="$1" '$2==t {printf "%.2f", $4*4194304/1e9}' "$work/redis.csv"; }
redis_set=$(redis_rate SET)
redis_get=$(redis_rate GET)

echo "tidepool up + bench (each row $DURATION)" >&2
# --promote-after 0: the SSD rows below read SSD, not a DRAM copy promoted by the repeated gets.
"$work/tidepool" up --dir "$work/data" --dram 4GiB --promote-after 0 --listen 127.0.0.1:55203 --raft 127.0.0.1:55204 \
	--engine 127.0.0.1:55205 --http 127.0.0.1:55206 --log-level warn & pids+=($!)
for _ in $(seq 100); do "$work/tidepool" status --masters 127.0.0.1:55203 2>/dev/null | grep -q alive && break; sleep 0.1; done
# --no-shm: the client is on the store's host, and this table is about the network path.
"$work/tidepool" bench --masters 127.0.0.1:55203 --no-shm --duration "$DURATION" --json >"$work/bench.json"
"$work/tidepool" bench --masters 127.0.0.1:55203 --ops get --sizes 4MiB --concurrency 1,4 --duration "$DURATION" --json >"$work/shm.json"

echo "SSD tier: fio O_DIRECT sequential read, then tidepool get of 4 MiB values on the SSD tier" >&2
fio --name=seqread --filename="$work/fio.dat" --size=512M --bs=4M --direct=1 --rw=read --ioengine=psync \
	--runtime=5 --time_based --output-format=json >"$work/fio.json" 2>/dev/null
rm -f "$work/fio.dat"
fio_gbps=$($PY -c 'import json,sys; print("%.3f" % (json.load(open(sys.argv[1]))["jobs"][0]["read"]["bw_bytes"]/1e9))' "$work/fio.json")
"$work/tidepool" bench --masters 127.0.0.1:55203 --tier ssd --ops get --sizes 4MiB --concurrency 1,4 --duration "$DURATION" --json >"$work/ssd.json"

echo "prefix lookup: redis EXISTS of 1024 keys, then tidepool bench lookup" >&2
keys=$($PY -c 'print(" ".join("kv/xxh3-64/m/t/%016x" % i for i in range(1024)))')
# shellcheck disable=SC2086 # one argument per key
redis-cli -p 55202 MSET $(for k in $keys; do echo "$k 1"; done) >/dev/null
redis_exists() { redis-benchmark -p 55202 -n 5000 -c "$1" --csv EXISTS $keys 2>/dev/null | tail -1 | awk -F'","' '{print $2}'; }
redis_exists1=$(redis_exists 1)
redis_exists4=$(redis_exists 4)
"$work/tidepool" bench lookup --masters 127.0.0.1:55203 --chain 1024,8192 --hit 1,0.5,0 --concurrency 1,4,16 \
	--duration "$DURATION" --json >"$work/lookup.json"

echo "tidepool bench engine (each run $DURATION)" >&2
"$work/tidepool" bench engine --duration "$DURATION" --json >"$work/engine.json"

$PY - "$work/bench.json" "$iperf2" "$redis_set" "$redis_get" "$iperf1" "$work/engine.json" "$work/shm.json" "$work/ssd.json" "$fio_gbps" \
	"$work/lookup.json" "$redis_exists1" "$redis_exists4" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
engine = [json.loads(l) for l in open(sys.argv[6]) if l.strip()]
shm = [json.loads(l) for l in open(sys.argv[7]) if l.strip()]
ssd = [json.loads(l) for l in open(sys.argv[8]) if l.strip()]
fio = float(sys.argv[9])
iperf, rset, rget, iperf1 = float(sys.argv[2]), float(sys.argv[3] or 0), float(sys.argv[4] or 0), float(sys.argv[5])
def size(n):
    return f"{n>>20} MiB" if n >= 1<<20 else f"{n>>10} KiB"
print(f"Baselines: iperf3 loopback {iperf1:.2f} GB/s with one stream, {iperf:.2f} GB/s with two iperf3 pairs at once; "
      f"redis-benchmark 4 MiB values, 4 clients: SET {rset:.2f} GB/s, GET {rget:.2f} GB/s\n")
print("| op | size | conc | ops | errors | GB/s | vs 2 x iperf3 | p50 ms | p99 ms |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['op']} | {size(r['size'])} | {r['concurrency']} | {r['ops']} | {r['errors']} | {r['gbps']:.2f} | {r['gbps']/iperf:.0%} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
best = max((r for r in rows if r['op'] == 'get' and r['size'] == 4<<20), key=lambda r: r['gbps'], default=None)
if best:
    print(f"\nBest 4 MiB get: {best['gbps']:.2f} GB/s at concurrency {best['concurrency']} = {best['gbps']/iperf:.0%} of two iperf3 pairs, {best['gbps']/iperf1:.0%} of one stream"
          + (f", {best['gbps']/rget:.1f}x Redis GET" if rget else ""))

print("\nThe same cluster, get through shared memory (the CLI's client is on the store's host):\n")
print("| op | size | conc | ops | GB/s | p50 ms | p99 ms |")
print("|---|---|---|---|---|---|---|")
for r in shm:
    print(f"| {r['op']} | {size(r['size'])} | {r['concurrency']} | {r['ops']} | {r['gbps']:.2f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")

print(f"\nThe same cluster, get of values on the SSD tier (same host: pread, O_DIRECT), against fio O_DIRECT sequential 4 MiB reads on the same file system ({fio:.3f} GB/s):\n")
print("| op | size | conc | ops | GB/s | vs fio | p50 ms | p99 ms |")
print("|---|---|---|---|---|---|---|---|")
for r in ssd:
    print(f"| {r['op']} | {size(r['size'])} | {r['concurrency']} | {r['ops']} | {r['gbps']:.3f} | {r['gbps']/fio:.0%} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")

lookups = [json.loads(l) for l in open(sys.argv[10]) if l.strip()]
rex1, rex4 = float(sys.argv[11] or 0), float(sys.argv[12] or 0)
print(f"\nThe same cluster, prefix lookups (`tidepool bench lookup`: chains of tiny blocks, every lookup to the master, each answer checked), "
      f"against Redis EXISTS of 1024 keys in one command: {rex1*1024/1e6:.2f} M keys/s with one client, {rex4*1024/1e6:.2f} M with four:\n")
print("| chain | hit | conc | lookups | lookups/s | M probes/s | vs Redis EXISTS | p50 ms | p99 ms |")
print("|---|---|---|---|---|---|---|---|---|")
for r in lookups:
    base = rex1 if r['concurrency'] == 1 else rex4
    print(f"| {r['chain']} | {r['hit']:.2f} | {r['concurrency']} | {r['lookups']} | {r['lookups_per_s']:.0f} | {r['probes_per_s']/1e6:.2f} | {r['probes_per_s']/(base*1024):.2f}x | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")

print("\n### Transfer engine (`tidepool bench engine`)\n")
print("| scenario | mode | GB/s | p50 ms | p99 ms | ops | errors | note |")
print("|---|---|---|---|---|---|---|---|")
for r in engine:
    note = r.get("note", "")
    if r["scenario"] == "tcp":
        note = f"{r['gbps']/iperf:.0%} of two iperf3 pairs, {r['gbps']/iperf1:.0%} of one stream"
    print(f"| {r['scenario']} | {r['mode']} | {r['gbps']:.3f} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['ops']} | {r['errors']} | {note} |")
PYEOF
./docs/bench-mooncake.sh
