#!/usr/bin/env bash
# Reproduces the TLS table of docs/benchmarks.md in one run on this host:
# gets over TCP (the rails, --no-shm) from `tidepool up`, from
# `tidepool up --secure` (TLS 1.3 on the master's port and the rails, a
# token on every call) and from `tidepool up --secure --plain-rails` (the
# same, but bytes over the rails in the clear, each transfer authorized by
# its ticket alone), run alternately ROUNDS times each so that the
# shared machine's drift falls on both alike, next to one-stream iperf3 on
# loopback. Needs Debian's iperf3.
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-3s}
ROUNDS=${ROUNDS:-3}
command -v iperf3 >/dev/null || { echo "bench-tls.sh: iperf3 not found (apt-get install -y iperf3)" >&2; exit 1; }
PY=/usr/bin/python3
work=$(mktemp -d -p "${TMPDIR:-/var/tmp}")
pids=()
cleanup() { for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[i]}" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

echo "building tidepool" >&2
go build -o "$work/tidepool" ./cmd/tidepool
tp="$work/tidepool"
. docs/iperf.sh
iperf_servers 55401
iperf1=$(iperf_one 55401)

# run MODE: one `up` (plain or secure) and its get rows, as JSON lines.
run() {
	local mode=$1 dir="$work/up-$1" flags=()
	[ "$mode" != plain ] && flags=(--secure)
	[ "$mode" = tickets ] && flags+=(--plain-rails)
	rm -rf "$dir"
	"$tp" up --dir "$dir" --dram 2GiB --ssd 0 --listen 127.0.0.1:55403 --raft 127.0.0.1:55404 \
		--engine 127.0.0.1:55405 --http 127.0.0.1:55406 --log-level warn "${flags[@]}" & local up=$!
	local creds=()
	[ "$mode" != plain ] && creds=(--tls-ca "$dir/certs/ca.crt" --token-file "$dir/certs/client.token")
	[ "$mode" = tickets ] && creds+=(--plain-rails)
	for _ in $(seq 100); do curl -sf http://127.0.0.1:55406/readyz >/dev/null 2>&1 && break; sleep 0.1; done
	"$tp" bench --masters 127.0.0.1:55403 "${creds[@]}" --no-shm --duration "$DURATION" --json \
		--ops get --sizes 1MiB,4MiB --concurrency 1,4 | sed "s/^{/{\"mode\":\"$mode\",/"
	kill "$up"; wait "$up" 2>/dev/null || true
}
for i in $(seq "$ROUNDS"); do
	echo "round $i of $ROUNDS: plain, secure, secure with plaintext rails" >&2
	run plain >>"$work/rows.json"
	run secure >>"$work/rows.json"
	run tickets >>"$work/rows.json"
done
iperf1b=$(iperf_one 55401)

$PY - "$work/rows.json" "$iperf1" "$iperf1b" "$ROUNDS" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
iperf = max(float(sys.argv[2]), float(sys.argv[3]))
print(f"Baseline: one-stream iperf3 on loopback {iperf:.2f} GB/s (the higher of {float(sys.argv[2]):.2f} before and {float(sys.argv[3]):.2f} after); "
      f"{sys.argv[4]} alternating rounds of each mode, medians\n")
print("| size | conc | plain GB/s | vs iperf3 | TLS GB/s | vs iperf3 | TLS / plain | TLS, plaintext rails GB/s | / plain |")
print("|---|---|---|---|---|---|---|---|---|")
shapes = sorted({(r["size"], r["concurrency"]) for r in rows})
def ratio(a, b):  # the median of the rounds' ratios, and their range
    rs = [y / x for x, y in zip(a, b)]
    return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"
for size, conc in shapes:
    got = {m: [r["gbps"] for r in rows if r["mode"] == m and r["size"] == size and r["concurrency"] == conc] for m in ("plain", "secure", "tickets")}
    p, s, k = (statistics.median(got[m]) for m in ("plain", "secure", "tickets"))
    print(f"| {size >> 20} MiB | {conc} | {p:.2f} | {p/iperf:.0%} | {s:.2f} | {s/iperf:.0%} | {ratio(got['plain'], got['secure'])} | {k:.2f} | {ratio(got['plain'], got['tickets'])} |")
PYEOF
