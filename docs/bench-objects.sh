#!/usr/bin/env bash
# What the master's object table costs: fills a master with N tiny objects
# (30-byte keys, 64-byte values, batches of 4096, `tidepool bench fill`),
# reads its resident memory before and after, then kills it (SIGKILL) and
# times its restart until it serves them all again. N = 1 Mi, then 4 Mi.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=/usr/bin/python3
work=$(mktemp -d -p "${TMPDIR:-/var/tmp}")
pids=()
cleanup() { for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "building tidepool" >&2
go build -o "$work/tidepool" ./cmd/tidepool
tp="$work/tidepool"
masters=127.0.0.1:55401
mhttp=127.0.0.1:55403
start_master() {
	"$tp" master --id m1 --dir "$work/m1" --listen "$masters" --raft 127.0.0.1:55402 --http "$mhttp" --log-level warn &
	master=$!
	pids+=("$master")
}
# metric prints a sample of the master's /metrics as an integer.
metric() { curl -sf "http://$mhttp/metrics" | awk -v m="$1" '$1 == m {printf "%.0f\n", $2}'; }
ready() { curl -sf "http://$mhttp/readyz" >/dev/null 2>&1; }

start_master
for _ in $(seq 100); do ready && break; sleep 0.1; done
"$tp" store --id s1 --masters "$masters" --listen 127.0.0.1:55404 --http 127.0.0.1:55405 --tier dram:2GiB --prefault=false --log-level warn & pids+=($!)
for _ in $(seq 100); do "$tp" status --masters "$masters" 2>/dev/null | grep -q alive && break; sleep 0.1; done
base=$(metric process_resident_memory_bytes)
echo "| objects | fill keys/s | master RSS | RSS per object | restart s | restart s per million |"
echo "|---|---|---|---|---|---|"
total=0
for n in 1048576 3145728; do
	out=$("$tp" bench fill --masters "$masters" --count "$n" --prefix "f$total/" 2>/dev/null)
	total=$((total + n))
	rate=$(echo "$out" | awk '{print $(NF-1)}')
	rss=$(metric process_resident_memory_bytes)
	kill -9 "$master"; wait "$master" 2>/dev/null || true
	t0=$($PY -c 'import time; print(time.time())')
	start_master
	until ready && [ "$(metric 'tidepool_master_objects{state="complete"}')" = "$total" ]; do sleep 0.05; done
	t1=$($PY -c 'import time; print(time.time())')
	$PY -c 'import sys; base, rss, total, t0, t1, rate = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]), sys.argv[6]
print(f"| {total} | {rate} | {rss/2**20:.0f} MiB | {(rss-base)/total:.0f} B | {t1-t0:.2f} | {(t1-t0)/(total/1e6):.2f} |")' \
		"$base" "$rss" "$total" "$t0" "$t1" "$rate"
done
