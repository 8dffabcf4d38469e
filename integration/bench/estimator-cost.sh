# What the kernel's IPVS rate estimator costs at a table's size, in one guest:
#   cargo xtask bench estimator [--services N] [--endpoints E] [--probes N]
# (which runs this in a 3 GiB guest with the release e2e-bench), or by hand:
#   cargo build --release -p kube-ipvs-integration --example e2e-bench
#   cargo xtask vm-run --timeout 1800 --mem 3072 --exe target/release/examples/e2e-bench \
#     "$(cat integration/bench/estimator-cost.sh)"
# Before kernel 6.2 the estimator is one timer that walks every virtual and real server's
# counters every 2 s under one lock (ipvs->est_lock), in softirq; every IPVS add and delete of
# a virtual or real server takes that lock. The script builds SERVICES virtual servers with
# ENDPOINTS real servers each (ipvsadm -R), then
#   WALK   times the timer's walks for 20 s with ftrace's function_graph tracer;
#   BLOCK  times PROBES single requests (one real server added and deleted in turn, each
#          from its send to the kernel's acknowledgement: e2e-bench ipvs-probe), with
#          net.ipv4.vs.run_estimation 1 and 0 in turn, three times.
# docs/benchmarks.md has the figures.
SERVICES=${SERVICES:-10000}; ENDPOINTS=${ENDPOINTS:-10}; PROBES=${PROBES:-100000}
E=/usr/local/bin/e2e-bench
fail() { echo "estimator-cost: $*"; exit 1; }
echo "KERNEL $(uname -r)"
[ -e /proc/sys/net/ipv4/vs/run_estimation ] || fail "no net.ipv4.vs.run_estimation (kernel before 5.12)"
awk -v n=$SERVICES -v e=$ENDPOINTS 'BEGIN{for(i=0;i<n;i++){vip=sprintf("10.97.%d.%d",int(i/256)%256,i%256);
  printf "-A -t %s:80 -s rr\n", vip;
  for(j=1;j<=e;j++) printf "-a -t %s:80 -r 10.%d.%d.%d:8080 -m\n", vip, 128+int(j/256), j%256, i%256}}' > /tmp/rules
ipvsadm -R < /tmp/rules || fail "ipvsadm -R"
echo "TABLE $(ipvsadm -Ln | grep -c '^TCP') virtual servers, $(ipvsadm -Ln | grep -c -- '-> [0-9]') real servers"
T=/sys/kernel/tracing
mount -t tracefs nodev $T 2>/dev/null
# Kernels from 6.2 have no estimation_timer (kernel threads do the estimating): no WALK then.
if echo estimation_timer > $T/set_ftrace_filter 2>/dev/null; then
  echo 1 > $T/max_graph_depth && echo function_graph > $T/current_tracer || fail "ftrace's function_graph tracer"
  echo > $T/trace; echo 1 > $T/tracing_on
  sleep 20
  echo 0 > $T/tracing_on
  # function_graph prints each call's duration before "us |" (read before the tracer is
  # switched off, which empties the buffer).
  grep -a 'estimation_timer' $T/trace > /tmp/walks; echo nop > $T/current_tracer
  awk '{for(i=1;i<=NF;i++) if ($i=="us") print $(i-1)}' /tmp/walks | sort -n |
    awk '{v[NR]=$1} END {if (NR == 0) {print "WALK none traced"; exit}
      printf "WALK walks=%d in 20 s: min %.1f ms, median %.1f ms, max %.1f ms\n", NR, v[1]/1000, v[int((NR+1)/2)]/1000, v[NR]/1000}'
else
  echo "WALK no estimation_timer to trace in this kernel"
fi
$E ipvs-probe --count 2000 > /dev/null || fail "ipvs-probe"
for b in 1 2 3; do
  for est in 1 0; do
    echo $est > /proc/sys/net/ipv4/vs/run_estimation
    r=$($E ipvs-probe --count $PROBES) || fail "ipvs-probe (block $b, run_estimation=$est)"
    echo "BLOCK $b run_estimation=$est $r"
  done
done
echo 1 > /proc/sys/net/ipv4/vs/run_estimation
echo done
