# Loopback baselines for the benchmark scripts, sourced by them: they set
# work (a scratch folder), PY and pids (what their cleanup kills).
# iperf_servers PORT...: start iperf3 servers (call it directly, not in $()).
# iperf_one PORT: one iperf3 stream for 5 s, in GB/s.
# iperf_two PORT1 PORT2: two iperf3 client/server pairs at once, the sum.
iperf_servers() {
	for p in "$@"; do
		iperf3 -s -p "$p" >/dev/null 2>&1 &
		pids+=($!)
	done
}
iperf_run() { # port out
	for _ in $(seq 50); do
		iperf3 -c 127.0.0.1 -p "$1" -t 5 -J >"$2" 2>/dev/null && grep -q sum_received "$2" && return
		sleep 0.2
	done
}
iperf_gbps() { $PY -c 'import json,sys; print("%.2f" % sum(json.load(open(f))["end"]["sum_received"]["bits_per_second"]/8e9 for f in sys.argv[1:]))' "$@"; }
iperf_one() {
	echo "iperf3 loopback, 5 s, one stream" >&2
	iperf_run "$1" "$work/iperf1.json"
	iperf_gbps "$work/iperf1.json"
}
iperf_two() {
	echo "iperf3 loopback, 5 s, two pairs at once" >&2
	iperf_run "$1" "$work/iperf2a.json" & local a=$!
	iperf_run "$2" "$work/iperf2b.json"
	wait "$a"
	iperf_gbps "$work/iperf2a.json" "$work/iperf2b.json"
}
