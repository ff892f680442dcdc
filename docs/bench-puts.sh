#!/usr/bin/env bash
# Reproduces the put-path table of docs/benchmarks.md in one run on this
# host: the baselines (fio's fsync rate of the disk under the raft log,
# one-stream iperf3 on loopback) next to `tidepool bench` puts on one
# master (`tidepool up`) and batch puts on three masters (raft replicated,
# every entry fsynced on each), and `tidepool bench meta`. A Redis PING
# at concurrency 1 is the cost of one round trip between two processes.
# Needs Debian's iperf3, fio, redis-server and redis-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-3s}
for cmd in iperf3 fio redis-server redis-cli redis-benchmark; do
	command -v "$cmd" >/dev/null || { echo "bench-puts.sh: $cmd not found (apt-get install -y iperf3 fio redis-server redis-tools)" >&2; exit 1; }
done
PY=/usr/bin/python3
work=$(mktemp -d -p "${TMPDIR:-/var/tmp}")
pids=()
# Newest first: stores leave before the masters go.
cleanup() { for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "building tidepool" >&2
go build -o "$work/tidepool" ./cmd/tidepool
tp="$work/tidepool"

echo "fio: 4 KiB writes, each followed by fdatasync, on the file system of the raft log" >&2
fio --name=fsync --filename="$work/fio.dat" --size=64M --bs=4k --rw=write --ioengine=sync --fdatasync=1 \
	--runtime=5 --time_based --output-format=json >"$work/fio.json" 2>/dev/null
rm -f "$work/fio.dat"
fsyncs=$($PY -c 'import json,sys; print("%.0f" % json.load(open(sys.argv[1]))["jobs"][0]["write"]["iops"])' "$work/fio.json")

echo "redis-benchmark: PING, one client" >&2
redis-server --port 55308 --save '' --appendonly no >/dev/null 2>&1 & pids+=($!)
for _ in $(seq 50); do redis-cli -p 55308 ping >/dev/null 2>&1 && break; sleep 0.1; done
pings=$(redis-benchmark -p 55308 -t ping_mbulk -n 50000 -c 1 --csv 2>/dev/null | awk -F'","' 'NR==2 {print $2}')

# One stream, and two iperf3 pairs at once: a large value travels over
# the engine's pooled connections from several threads, and Debian 12's
# iperf3 (3.12) runs all of -P's streams in one thread.
. docs/iperf.sh
iperf_servers 55301 55307
iperf1=$(iperf_one 55301)
iperf2=$(iperf_two 55301 55307)

echo "tidepool up + bench (each row $DURATION)" >&2
"$tp" up --dir "$work/up" --dram 4GiB --ssd 0 --lease-ttl 2s --listen 127.0.0.1:55303 --raft 127.0.0.1:55304 \
	--engine 127.0.0.1:55305 --http 127.0.0.1:55306 --log-level info 2>"$work/up.log" & pids+=($!)
up=$!
for _ in $(seq 100); do "$tp" status --masters 127.0.0.1:55303 2>/dev/null | grep -q alive && break; sleep 0.1; done
# Its store writes its 4 GiB once at start (--prefault): wait for it.
for _ in $(seq 600); do grep -q "prefault" "$work/up.log" && break; sleep 0.1; done
m=(--masters 127.0.0.1:55303 --duration "$DURATION" --json)
# A first row puts and removes as a running system has: the measured rows
# then meet a raft log and tables with history (a fresh master's first
# row runs 5-10% faster).
"$tp" bench "${m[@]}" --ops put --sizes 64KiB --concurrency 1 >/dev/null
{
	"$tp" bench "${m[@]}" --ops put --sizes 64KiB --concurrency 1,8
	"$tp" bench "${m[@]}" --ops put --sizes 1MiB,4MiB --concurrency 1 --no-shm
	"$tp" bench "${m[@]}" --ops put --sizes 1MiB,4MiB --concurrency 1
	"$tp" bench "${m[@]}" --ops put --sizes 4KiB --batch 128 --concurrency 1,2
} >"$work/one.json"
"$tp" bench meta --masters 127.0.0.1:55303 --duration "$DURATION" --json --ops put --batch 1,128 --clients 1,2 >"$work/meta.json"
kill "$up"; wait "$up" 2>/dev/null || true
# The shared machine's loopback rate drifts: both baselines again after
# the rows, and the table divides by the higher of each pair.
iperf1b=$(iperf_one 55301)
iperf2b=$(iperf_two 55301 55307)

echo "three masters and a store, batch puts" >&2
peers=m1=127.0.0.1:55312,m2=127.0.0.1:55322,m3=127.0.0.1:55332
for i in 1 2 3; do
	"$tp" master --id "m$i" --dir "$work/m$i" --listen "127.0.0.1:553${i}1" --raft "127.0.0.1:553${i}2" \
		--http "127.0.0.1:553${i}3" --peers "$peers" --lease-ttl 2s --log-level warn & pids+=($!)
done
masters=127.0.0.1:55311,127.0.0.1:55321,127.0.0.1:55331
"$tp" store --id s1 --masters "$masters" --listen 127.0.0.1:55341 --http 127.0.0.1:55342 --tier dram:4GiB --log-level info 2>"$work/store.log" & pids+=($!)
for _ in $(seq 200); do "$tp" status --masters "$masters" 2>/dev/null | grep -q alive && break; sleep 0.1; done
# Its prefault too; then a first row, as for the one master.
for _ in $(seq 600); do grep -q "prefault" "$work/store.log" && break; sleep 0.1; done
"$tp" bench --masters "$masters" --duration "$DURATION" --json --ops put --sizes 4KiB --batch 128 --concurrency 1 >/dev/null
"$tp" bench --masters "$masters" --duration "$DURATION" --json --ops put --sizes 4KiB --batch 128 --concurrency 1,2,4,8 >"$work/three.json"

$PY - "$work/one.json" "$work/meta.json" "$work/three.json" "$fsyncs" "$iperf1" "$iperf2" "$pings" "$iperf1b" "$iperf2b" <<'PYEOF'
import json, sys
def load(p): return [json.loads(l) for l in open(p) if l.strip()]
one, meta, three = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
fsyncs, pings = float(sys.argv[4]), float(sys.argv[7])
iperf1a, iperf1b = float(sys.argv[5]), float(sys.argv[8])
iperf2a, iperf2b = float(sys.argv[6]), float(sys.argv[9])
iperf1, iperf2 = max(iperf1a, iperf1b), max(iperf2a, iperf2b)
def size(n): return f"{n>>20} MiB" if n >= 1<<20 else f"{n>>10} KiB"
# One put at a time needs at least a round trip and an fsync in series.
floor = 1 / (1 / pings + 1 / fsyncs)
print(f"Baselines: fio 4 KiB write + fdatasync {fsyncs:.0f}/s; Redis PING with one client {pings:.0f}/s ({1e6/pings:.0f} us a round trip), "
      f"so one round trip and one fsync in series {floor:.0f}/s; iperf3 loopback {iperf1:.2f} GB/s with one stream (the higher of {iperf1a:.2f} before the rows and {iperf1b:.2f} after), {iperf2:.2f} GB/s with two iperf3 pairs at once ({iperf2a:.2f} and {iperf2b:.2f})\n")
print("| masters | path | size | batch | conc | keys/s | vs fsyncs/s | GB/s | vs iperf3 | vs 2 x iperf3 | p50 ms | p99 ms |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
paths = ["shm", "shm", "tcp", "tcp", "shm", "shm", "shm", "shm"]
def row(masters, path, r):
    # Through shared memory a value is a memcpy: the network is no bound.
    net = f"{r['gbps']/iperf1:.0%} | {r['gbps']/iperf2:.0%}" if path == "tcp" else "- | -"
    print(f"| {masters} | {path} | {size(r['size'])} | {r['batch']} | {r['concurrency']} | {r['keys_per_s']:.0f} | {r['keys_per_s']/fsyncs:.2f}x | {r['gbps']:.2f} | {net} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
for r, path in zip(one, paths):
    row(1, path, r)
for r in three:
    row(3, "shm", r)
print("\n`tidepool bench meta`, put (BatchPutStart + BatchPutEnd, no data), one master:\n")
print("| batch | clients | keys/s | mean ms | p99 ms |")
print("|---|---|---|---|---|")
for r in meta:
    print(f"| {r['batch']} | {r['clients']} | {r['keys_per_s']:.0f} | {r['mean_ms']:.3f} | {r['p99_ms']:.3f} |")
PYEOF
