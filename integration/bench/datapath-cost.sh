# A new connection through kube-ipvs's IPVS against the same through kube-proxy-like nftables
# and iptables rules, in one guest, each connection of one client in turn (so a slow moment of
# the host or the guest falls on every path alike):
#   cargo xtask bench datapath [--size N] [--count N] [--no-perf]
# (which builds the release kube-ipvs and e2e-bench, runs this in a 3 GiB guest with the host's
# perf, and sums up each block's ratios), or by hand:
#   cargo build --release -p kube-ipvs --bin kube-ipvs -p kube-ipvs-integration --example e2e-bench
#   cargo xtask vm-run --timeout 3600 --mem 3072 --exe target/release/examples/e2e-bench \
#     --exe target/release/kube-ipvs --exe /usr/bin/perf "$(cat integration/bench/datapath-cost.sh)"
# The two namespaces of `bench e2e`'s data path (datapath.rs): a client outside the cluster CIDR
# routed through the root namespace, a server answering one byte per connection on one endpoint
# address per path. Five paths:
#   direct      the endpoint itself, through nothing of any proxy's (the baseline)
#   nftables    the last of SIZE ClusterIPs through a reduction of kube-proxy's nftables mode:
#               one lookup of address and port in a map, DNAT, masquerade for a client outside
#               the cluster CIDR (kube-proxy's verdict map, per-Service and endpoint chains and
#               filter-hook checks are left out, so this is a lower bound of its path)
#   iptables    the last of SIZE ClusterIPs through a reduction of kube-proxy's iptables mode:
#               one rule per Service in a chain walked in order, each jumping to the Service's
#               chain (masquerade mark for a client outside the cluster CIDR, DNAT)
#   ipvs-alone  before the agent runs: IPVS with kube-ipvs's sysctls, one masquerading virtual
#               server on a dummy interface, masqueraded by one nftables rule; no rule of the
#               agent's exists yet
#   kube-ipvs   a ClusterIP of the agent itself (`run --manifests`, as `cargo xtask demo` runs
#               it) with SIZE Services in all (one endpoint each, the others on another node),
#               once `kube-ipvs check` says the kernel is in sync (the IPVS-alone entry deleted
#               before, since the agent owns the table)
# The emulated peers' rules only see traffic to their own ranges (10.98/16 and 10.99/16), so the
# IPVS paths do not walk them; once the agent runs, every path walks its rules. Blocks: two
# before the agent (direct, nftables, iptables, ipvs-alone), two more with SIZE virtual servers
# in IPVS alone's table (the table's size without the agent), two with it running and two with it
# stopped (SIGSTOP: with --manifests it reads its files every second, and its reconcile reads
# the kernel every 30 s), two with it stopped and the kernel's IPVS rate estimator off
# (net.ipv4.vs.run_estimation=0); then, with perf in the guest, each path sampled once (the busiest
# kernel symbols); then two blocks each with the agent running and stopped after a restart with
# --service-address-binding=route, and its path sampled. docs/benchmarks.md has the figures.
IP=/usr/sbin/ip; E=/usr/local/bin/e2e-bench; PERF=/usr/local/bin/perf; K=/usr/local/bin/kube-ipvs
COUNT=${COUNT:-3000}; SIZE=${SIZE:-10000}; PORT=8080
DIRECT=10.244.0.10; IPVS_EP=10.244.0.11; NFT_EP=10.244.0.12; IPT_EP=10.244.0.13; RAW_EP=10.244.0.14
IPVS_VIP=10.96.0.10; RAW_VIP=10.100.0.10
last=$((SIZE - 1)); L="$((last / 256 % 256)).$((last % 256))"
NFT_VIP=10.98.$L; IPT_VIP=10.99.$L
fail() { echo "datapath-cost: $*"; exit 1; }
uname -r
echo "PATH direct $DIRECT:$PORT"; echo "PATH kube-ipvs $IPVS_VIP:80"; echo "PATH nftables $NFT_VIP:80"
echo "PATH iptables $IPT_VIP:80"; echo "PATH ipvs-alone $RAW_VIP:80"
echo -1 > /proc/sys/kernel/perf_event_paranoid; echo 0 > /proc/sys/kernel/kptr_restrict
echo 1 > /proc/sys/net/ipv4/ip_forward
for x in "dp-client dpc0 dpc1 10.250.0.1 10.250.0.2" "dp-server dps0 dps1 10.251.0.1 10.251.0.2"; do
  set -- $x
  $IP netns add $1 && $IP -n $1 link set lo up &&
  $IP link add $2 type veth peer name $3 netns $1 &&
  $IP addr add $4/24 dev $2 && $IP link set $2 up &&
  $IP -n $1 addr add $5/24 dev $3 && $IP -n $1 link set $3 up &&
  $IP -n $1 route add default via $4 || fail "namespace $1"
done
for a in $DIRECT $IPVS_EP $NFT_EP $IPT_EP $RAW_EP; do
  $IP -n dp-server addr add $a/32 dev dps1 && $IP route add $a/32 via 10.251.0.2 || fail "endpoint $a"
done
$IP netns exec dp-server $E serve --port $PORT &
i=0; while ! $IP netns exec dp-client $E connect --targets $DIRECT:$PORT --count 1 | grep -q 'failed=0'; do
  i=$((i+1)); [ $i -gt 100 ] && fail "the server never answered"; sleep 0.2
done

# kube-proxy's nftables mode, reduced to a ClusterIP's path: SIZE entries in one map.
{
  echo 'table ip emu-nftables {'
  echo '  map services { type ipv4_addr . inet_service : ipv4_addr . inet_service; elements = {'
  awk -v n=$SIZE -v ep=$NFT_EP 'BEGIN{for(i=0;i<n;i++){a=sprintf("%d.%d", int(i/256)%256, i%256);
    t=(i==n-1) ? ep " . 8080" : "10.245." a " . 8080"; printf "    10.98.%s . 80 : %s%s\n", a, t, (i<n-1 ? "," : "")}}'
  echo '  } }'
  echo '  chain pre { type nat hook prerouting priority dstnat;'
  echo '    ip daddr 10.98.0.0/16 ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x10000'
  echo '    ip daddr 10.98.0.0/16 dnat ip to ip daddr . tcp dport map @services'
  echo '  }'
  echo '  chain post { type nat hook postrouting priority srcnat; meta mark & 0x10000 == 0x10000 masquerade
  }'
  echo '}'
} > /tmp/emu.nft
nft -f /tmp/emu.nft || fail "nft refused the emulated rules"
# kube-proxy's iptables mode, reduced the same way: one rule per Service, walked in order, to the
# Service's chain.
{
  echo '*nat'
  echo ':EMU-SERVICES - [0:0]'
  awk -v n=$SIZE 'BEGIN{for(i=0;i<n;i++) printf ":EMU-SVC-%d - [0:0]\n", i}'
  echo '-A PREROUTING -d 10.99.0.0/16 -j EMU-SERVICES'
  echo '-A POSTROUTING -m mark --mark 0x20000/0x20000 -j MASQUERADE'
  awk -v n=$SIZE -v ep=$IPT_EP 'BEGIN{for(i=0;i<n;i++){a=sprintf("%d.%d", int(i/256)%256, i%256);
    t=(i==n-1) ? ep ":8080" : "10.245." a ":8080";
    printf "-A EMU-SERVICES -d 10.99.%s/32 -p tcp --dport 80 -j EMU-SVC-%d\n", a, i;
    printf "-A EMU-SVC-%d ! -s 10.244.0.0/16 -j MARK --or-mark 0x20000\n", i;
    printf "-A EMU-SVC-%d -p tcp -j DNAT --to-destination %s\n", i, t}}'
  echo 'COMMIT'
} > /tmp/emu.iptables
iptables-restore --noflush < /tmp/emu.iptables || fail "iptables-restore refused the emulated rules"
emulated() {
  echo "emulated: $(nft list map ip emu-nftables services | grep -c ' \. 80 : ') nftables map entries, $(iptables -t nat -S EMU-SERVICES | grep -c '^-A') iptables Services"
}
emulated

measure() {
  $IP netns exec dp-client $E connect --targets $TARGETS --count 300 >/dev/null
  $IP netns exec dp-client $E connect --targets $TARGETS --count $COUNT | sed "s/^/STEP $1 /"
}
profile() {
  [ -x $PERF ] || return 0
  $PERF record -q -e cpu-clock -a -g -o /tmp/$1.data -- $IP netns exec dp-client $E connect --targets $2 --count $COUNT >/dev/null 2>&1
  $PERF report -q -i /tmp/$1.data --no-children --sort comm --stdio -g none 2>/dev/null | grep -v '^$' | head -6 | sed "s/^/PROFILE $1 comm /"
  $PERF report -q -i /tmp/$1.data --no-children --sort sym --stdio -g none 2>/dev/null | grep -v '^$' | head -25 | sed "s/^/PROFILE $1 /"
  rm -f /tmp/$1.data
}

# IPVS alone, before the agent has made any rule.
for s in vs/conntrack=1 vs/expire_nodest_conn=1 vs/expire_quiescent_template=1; do
  echo ${s#*=} > /proc/sys/net/ipv4/${s%=*} || fail "sysctl $s"
done
$IP link add raw-ipvs0 type dummy && $IP addr add $RAW_VIP/32 dev raw-ipvs0 &&
  ipvsadm -A -t $RAW_VIP:80 -s rr && ipvsadm -a -t $RAW_VIP:80 -r $RAW_EP:$PORT -m &&
  nft add table ip raw-ipvs &&
  nft add chain ip raw-ipvs post '{ type nat hook postrouting priority srcnat; }' &&
  nft add rule ip raw-ipvs post ip saddr 10.250.0.0/24 ip daddr $RAW_EP masquerade || fail "IPVS alone"
TARGETS=$DIRECT:$PORT,$NFT_VIP:80,$IPT_VIP:80,$RAW_VIP:80
measure before-agent
measure before-agent-again
profile ipvs-alone $RAW_VIP:80
# The same IPVS with SIZE - 1 more virtual servers (one real server each, never connected to),
# as many as the agent's table holds below: what the table's size costs a new connection.
awk -v n=$SIZE 'BEGIN{for(i=0;i<n;i++){if(i==10)continue; a=sprintf("%d.%d", int(i/256)%256, i%256);
  printf "-A -t 10.100.%s:80 -s rr\n-a -t 10.100.%s:80 -r 10.245.%s:8080 -m\n", a, a, a}}' > /tmp/raw.ipvs
ipvsadm -R < /tmp/raw.ipvs || fail "ipvsadm -R refused the extra virtual servers"
echo "ipvs-alone-full: $(ipvsadm -Ln | grep -c '^TCP') virtual servers"
measure ipvs-alone-full
measure ipvs-alone-full-again
ipvsadm -C && $IP link del raw-ipvs0 && nft delete table ip raw-ipvs || fail "removing IPVS alone"

# kube-ipvs on SIZE Services; the first is the measured one.
M=/tmp/manifests; mkdir -p $M
cat > $M/node.yaml <<'YAML'
apiVersion: v1
kind: Node
metadata: {name: node-1}
status:
  addresses:
  - {type: InternalIP, address: 10.251.0.1}
YAML
cat > $M/target.yaml <<'YAML'
apiVersion: v1
kind: Service
metadata: {name: target, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.10
  clusterIPs: [10.96.0.10]
  ports:
  - {name: http, port: 80, protocol: TCP, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: target-1
  namespace: default
  labels: {kubernetes.io/service-name: target}
addressType: IPv4
endpoints:
- addresses: [10.244.0.11]
  conditions: {ready: true, serving: true, terminating: false}
  nodeName: node-1
ports:
- {name: http, port: 8080, protocol: TCP}
YAML
awk -v n=$SIZE 'BEGIN{for(i=1;i<n;i++){a=sprintf("%d.%d", int(i/256)%256, i%256);
  printf "---\napiVersion: v1\nkind: Service\nmetadata: {name: s%d, namespace: default}\nspec:\n  type: ClusterIP\n  clusterIP: 10.97.%s\n  clusterIPs: [10.97.%s]\n  ports:\n  - {name: http, port: 80, protocol: TCP, targetPort: 8080}\n", i, a, a;
  printf "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: s%d-1\n  namespace: default\n  labels: {kubernetes.io/service-name: s%d}\naddressType: IPv4\nendpoints:\n- addresses: [10.245.%s]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: node-2\nports:\n- {name: http, port: 8080, protocol: TCP}\n", i, i, a}}' > $M/others.yaml
# Starts the agent with flags "$@" and waits until `check` says the kernel is in sync.
start_agent() {
  GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=131072 \
    $K run --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 \
    --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 "$@" >> /tmp/agent.log 2>&1 &
  AGENT=$!
  tries=0
  until $K check --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 > /tmp/check.log 2>&1; do
    tries=$((tries + 1))
    [ $tries -gt $((240 + SIZE / 25)) ] && { tail -20 /tmp/agent.log /tmp/check.log; fail "the agent did not converge"; }
    sleep 0.5
  done
}
start_agent
echo "kube-ipvs: in sync, $(ipvsadm -Ln | grep -c '^TCP') virtual servers, $(iptables-save | grep -cE '^-A KUBE-|-j KUBE-') iptables rules of its own"
emulated
TARGETS=$DIRECT:$PORT,$IPVS_VIP:80,$NFT_VIP:80,$IPT_VIP:80
measure agent-running
measure agent-running-again
kill -STOP $AGENT
measure agent-stopped
measure agent-stopped-again
# The kernel's rate estimator off (before 6.2 a timer walks every virtual and real server's
# counters every 2 s under one lock, in softirq), the agent still stopped.
echo 0 > /proc/sys/net/ipv4/vs/run_estimation || fail "run_estimation"
measure no-estimator
measure no-estimator-again
echo 1 > /proc/sys/net/ipv4/vs/run_estimation
profile kube-ipvs $IPVS_VIP:80
if [ -x $PERF ]; then
  $PERF record -q -e cpu-clock -a -g -o /tmp/callers.data -- $IP netns exec dp-client $E connect --targets $IPVS_VIP:80 --count 1000 >/dev/null 2>&1
  $PERF report -q -i /tmp/callers.data --no-children -S inet_lookup_ifaddr_rcu -g caller --stdio 2>/dev/null | grep -v '^$' | head -80 | sed "s/^/PROFILE callers /"
fi
profile nftables $NFT_VIP:80
profile iptables $IPT_VIP:80
kill -CONT $AGENT
# The agent restarted with the ClusterIPs as local routes instead of addresses on kube-ipvs0
# (--service-address-binding=route; the restart moves them): the same paths without SIZE more
# addresses in the kernel's address hash.
kill $AGENT; wait $AGENT
start_agent --service-address-binding=route
echo "kube-ipvs with routes: $($IP -o -4 addr show dev kube-ipvs0 | wc -l) addresses on kube-ipvs0, $($IP route show table local proto 124 | wc -l) local routes of its own"
measure routes-running
measure routes-running-again
kill -STOP $AGENT
measure routes-stopped
measure routes-stopped-again
profile kube-ipvs-routes $IPVS_VIP:80
kill -CONT $AGENT
echo done
