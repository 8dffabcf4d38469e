# A new connection through kube-ipvs's IPVS against the same through kube-proxy's nftables mode
# and reduced nftables and iptables rules, in one guest, each connection of one client in turn
# (so a slow moment of the host or the guest falls on every path alike):
#   cargo xtask bench datapath [--size N] [--count N] [--no-perf]
# (which builds the release kube-ipvs and e2e-bench, runs this in a 3 GiB guest with the host's
# perf, and sums up each block's ratios), or by hand:
#   cargo build --release -p kube-ipvs --bin kube-ipvs -p kube-ipvs-integration --example e2e-bench
#   cargo xtask vm-run --timeout 3600 --mem 3072 --exe target/release/examples/e2e-bench \
#     --exe target/release/kube-ipvs --exe /usr/bin/perf \
#     "$(cat integration/bench/nodes.sh integration/bench/datapath-cost.sh)"
#
# Three nodes, each a network namespace of its own between one client namespace and one server
# namespace (nodes.sh's make_nodes), so that no path walks another proxy's rules, as on real nodes:
#   node-k   kube-ipvs's node: first IPVS alone, then the agent
#   node-n   kube-proxy's nftables mode: its table as kube-proxy v1.37 writes it for SIZE ClusterIP
#            Services of one endpoint each (the same chains, sets, maps and rules: filter-hook
#            checks, the services verdict map, one chain per Service with its DNAT, masquerade
#            fully-random), written by this script, not by kube-proxy
#   node-r   the reductions of the earlier runs: one nftables map lookup and DNAT (nftables-min)
#            and kube-proxy's iptables mode reduced to one rule per Service walked in order
# The server holds every endpoint address and answers each connection with one byte. Paths:
#   direct-k, direct-n, direct-r  an endpoint through each node, not through a Service (it still
#               passes that node's own rules)
#   ipvs-alone  (node-k, before the agent) IPVS with kube-ipvs's sysctls, one masquerading virtual
#               server on a dummy interface, masqueraded by one nftables rule
#   kube-ipvs   (node-k) a ClusterIP of the agent (`run --manifests`, as `cargo xtask demo` runs
#               it) with SIZE Services in all (one endpoint each, the others on another node),
#               once `kube-ipvs check` says the kernel is in sync
#   nftables    (node-n) the last of SIZE ClusterIPs of the kube-proxy table
#   nftables-min, iptables (node-r) the last of SIZE ClusterIPs of each reduction
# The client outside the cluster CIDR, so every ClusterIP path masquerades. Blocks: two before the
# agent (IPVS alone, one virtual server), two with SIZE virtual servers in IPVS alone's table,
# two with the agent running and two with it stopped (SIGSTOP: with --manifests it reads its
# files every second, and its reconcile reads the kernel every 30 s), two stopped with the
# kernel's IPVS rate estimator off (net.ipv4.vs.run_estimation=0); then, with perf in the guest,
# each rule path sampled once (the busiest kernel symbols); then two blocks each with the agent
# running and stopped after a restart with --service-address-binding=route, and its path
# sampled. The routes blocks are the ones that compare as separate nodes would: on 6.1 the
# agent's SIZE addresses lengthen the address hash every namespace's source check walks (rp_filter
# off), so they slow the peers' paths too (source-check-cost.sh). docs/benchmarks.md has the
# figures.
IP=/usr/sbin/ip; E=/usr/local/bin/e2e-bench; PERF=/usr/local/bin/perf; K=/usr/local/bin/kube-ipvs
COUNT=${COUNT:-3000}; SIZE=${SIZE:-10000}; PORT=8080
DIRECT_K=10.244.0.10; DIRECT_N=10.244.0.20; DIRECT_R=10.244.0.30
IPVS_EP=10.244.0.11; NFT_EP=10.244.0.12; IPT_EP=10.244.0.13; RAW_EP=10.244.0.14; MIN_EP=10.244.0.15
IPVS_VIP=10.96.0.10; RAW_VIP=10.100.0.10
last=$((SIZE - 1)); L="$((last / 256 % 256)).$((last % 256))"
NFT_VIP=10.98.$L; IPT_VIP=10.99.$L; MIN_VIP=10.102.$L
fail() { echo "datapath-cost: $*"; exit 1; }
k() { $IP netns exec node-k "$@"; }
n() { $IP netns exec node-n "$@"; }
r() { $IP netns exec node-r "$@"; }
uname -r
echo "PATH direct-k $DIRECT_K:$PORT"; echo "PATH direct-n $DIRECT_N:$PORT"; echo "PATH direct-r $DIRECT_R:$PORT"
echo "PATH kube-ipvs $IPVS_VIP:80"; echo "PATH ipvs-alone $RAW_VIP:80"; echo "PATH nftables $NFT_VIP:80"
echo "PATH nftables-min $MIN_VIP:80"; echo "PATH iptables $IPT_VIP:80"
echo -1 > /proc/sys/kernel/perf_event_paranoid; echo 0 > /proc/sys/kernel/kptr_restrict
make_nodes
for a in $DIRECT_K $DIRECT_N $DIRECT_R $IPVS_EP $NFT_EP $IPT_EP $RAW_EP $MIN_EP; do
  $IP -n dp-server addr add $a/32 dev lo || fail "endpoint $a"
done
# The client reaches each path through its node.
for via in "10.250.0.1 $DIRECT_K/32 10.96.0.0/16 10.97.0.0/16 10.100.0.0/16" \
  "10.250.1.1 $DIRECT_N/32 10.98.0.0/16" "10.250.2.1 $DIRECT_R/32 10.99.0.0/16 10.102.0.0/16"; do
  set -- $via; gw=$1; shift
  for dst in "$@"; do $IP -n dp-client route add $dst via $gw || fail "client route $dst"; done
done
$IP netns exec dp-server $E serve --port $PORT &
i=0; while ! $IP netns exec dp-client $E connect --targets $DIRECT_K:$PORT,$DIRECT_N:$PORT,$DIRECT_R:$PORT --count 1 | grep 'failed=0' > /dev/null; do
  i=$((i+1)); [ $i -gt 100 ] && fail "the server never answered"; sleep 0.2
done

# node-n: kube-proxy's nftables table for SIZE ClusterIP Services of one endpoint each (the last
# is measured; its endpoint is on this node, the others on another), cluster CIDR 10.244.0.0/16,
# service CIDR 10.98.0.0/16, node address 10.251.1.1, masquerade bit 0x4000 (kube-proxy's
# default).
{
  echo 'table ip kube-proxy {'
  echo '  set cluster-ips { type ipv4_addr; elements = {'
  awk -v n=$SIZE 'BEGIN{for(i=0;i<n;i++) printf "    10.98.%d.%d%s\n", int(i/256)%256, i%256, (i<n-1 ? "," : "")}'
  echo '  } }'
  echo '  set nodeport-ips { type ipv4_addr; elements = { 10.251.1.1 } }'
  echo "  set hairpin-connections { type ipv4_addr . ipv4_addr . inet_proto . inet_service; elements = { $NFT_EP . $NFT_EP . tcp . $PORT } }"
  echo '  map firewall-ips { type ipv4_addr . inet_proto . inet_service : verdict; }'
  echo '  map no-endpoint-nodeports { type inet_proto . inet_service : verdict; }'
  echo '  map no-endpoint-services { type ipv4_addr . inet_proto . inet_service : verdict; }'
  echo '  map service-nodeports { type inet_proto . inet_service : verdict; }'
  awk -v n=$SIZE -v ep=$NFT_EP -v port=$PORT 'BEGIN{for(i=0;i<n;i++){t=(i==n-1) ? ep : sprintf("10.245.%d.%d", int(i/256)%256, i%256);
    printf "  chain service-%d { meta l4proto tcp dnat to %s:%d; }\n", i, t, port}}'
  echo '  map service-ips { type ipv4_addr . inet_proto . inet_service : verdict; elements = {'
  awk -v n=$SIZE 'BEGIN{for(i=0;i<n;i++) printf "    10.98.%d.%d . tcp . 80 : goto service-%d%s\n", int(i/256)%256, i%256, i, (i<n-1 ? "," : "")}'
  echo '  } }'
  cat <<'NFT'
  chain cluster-ips-check {
    ip daddr @cluster-ips reject
    ip daddr { 10.98.0.0/16 } drop
  }
  chain firewall-check { ip daddr . meta l4proto . th dport vmap @firewall-ips; }
  chain masquerading {
    mark and 0x4000 != 0 mark set mark xor 0x4000 masquerade fully-random
    ct status dnat ip saddr . ip daddr . meta l4proto . th dport @hairpin-connections masquerade fully-random
  }
  chain nodeport-endpoints-check { ip daddr @nodeport-ips meta l4proto . th dport vmap @no-endpoint-nodeports; }
  chain reject-chain { reject; }
  chain service-endpoints-check { ip daddr . meta l4proto . th dport vmap @no-endpoint-services; }
  chain services {
    ip daddr @cluster-ips ip saddr != 10.244.0.0/16 mark set mark or 0x4000
    ip daddr . meta l4proto . th dport vmap @service-ips
    ip daddr @nodeport-ips meta l4proto . th dport vmap @service-nodeports
  }
  chain filter-prerouting-pre-dnat { type filter hook prerouting priority -110; ct state new jump firewall-check; }
  chain filter-output-pre-dnat { type filter hook output priority -110; ct state new jump firewall-check; }
  chain filter-forward {
    type filter hook forward priority 0;
    ct state new jump service-endpoints-check
    ct state new jump cluster-ips-check
  }
  chain filter-input {
    type filter hook input priority 0;
    ct state new jump nodeport-endpoints-check
    ct state new jump service-endpoints-check
  }
  chain filter-output {
    type filter hook output priority 0;
    ct state new jump service-endpoints-check
    ct state new jump cluster-ips-check
  }
  chain nat-prerouting { type nat hook prerouting priority -100; jump services; }
  chain nat-output { type nat hook output priority -100; jump services; }
  chain nat-postrouting { type nat hook postrouting priority 100; jump masquerading; }
}
NFT
} > /tmp/kube-proxy.nft
n nft -f /tmp/kube-proxy.nft || fail "nft refused kube-proxy's table"
# node-r: the reduction of kube-proxy's nftables mode to a ClusterIP's path (SIZE entries in one
# map, DNAT, masquerade mark for a client outside the cluster CIDR) ...
{
  echo 'table ip emu-nftables {'
  echo '  map services { type ipv4_addr . inet_service : ipv4_addr . inet_service; elements = {'
  awk -v n=$SIZE -v ep=$MIN_EP 'BEGIN{for(i=0;i<n;i++){a=sprintf("%d.%d", int(i/256)%256, i%256);
    t=(i==n-1) ? ep " . 8080" : "10.245." a " . 8080"; printf "    10.102.%s . 80 : %s%s\n", a, t, (i<n-1 ? "," : "")}}'
  echo '  } }'
  echo '  chain pre { type nat hook prerouting priority dstnat;'
  echo '    ip daddr 10.102.0.0/16 ip saddr != 10.244.0.0/16 meta mark set meta mark | 0x10000'
  echo '    ip daddr 10.102.0.0/16 dnat ip to ip daddr . tcp dport map @services'
  echo '  }'
  echo '  chain post { type nat hook postrouting priority srcnat; meta mark & 0x10000 == 0x10000 masquerade
  }'
  echo '}'
} > /tmp/emu.nft
r nft -f /tmp/emu.nft || fail "nft refused the reduced rules"
# ... and of kube-proxy's iptables mode: one rule per Service, walked in order, to the Service's
# chain.
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
r iptables-restore --noflush < /tmp/emu.iptables || fail "iptables-restore refused the reduced rules"
emulated() {
  echo "emulated: $(n nft list map ip kube-proxy service-ips | grep -c ' \. tcp \. 80 : goto') kube-proxy Services, $(r nft list map ip emu-nftables services | grep -c ' \. 80 : ') reduced nftables map entries, $(r iptables -t nat -S EMU-SERVICES | grep -c '^-A') iptables Services"
}
emulated

RULES=$DIRECT_N:$PORT,$NFT_VIP:80,$DIRECT_R:$PORT,$MIN_VIP:80,$IPT_VIP:80
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

# node-k: IPVS alone, before the agent has made any rule (the masquerade fully random, as the
# agent's and kube-proxy's).
k ipvsadm -Ln > /dev/null || fail "ipvsadm"
for s in vs/conntrack=1 vs/expire_nodest_conn=1 vs/expire_quiescent_template=1; do
  k sh -c "echo ${s#*=} > /proc/sys/net/ipv4/${s%=*}" || fail "sysctl $s"
done
k $IP link add raw-ipvs0 type dummy && k $IP addr add $RAW_VIP/32 dev raw-ipvs0 &&
  k ipvsadm -A -t $RAW_VIP:80 -s rr && k ipvsadm -a -t $RAW_VIP:80 -r $RAW_EP:$PORT -m &&
  k nft add table ip raw-ipvs &&
  k nft add chain ip raw-ipvs post '{ type nat hook postrouting priority srcnat; }' &&
  k nft add rule ip raw-ipvs post ip saddr 10.250.0.0/24 ip daddr $RAW_EP masquerade fully-random || fail "IPVS alone"
TARGETS=$DIRECT_K:$PORT,$RAW_VIP:80,$RULES
measure before-agent
measure before-agent-again
profile ipvs-alone $RAW_VIP:80
# The same IPVS with SIZE - 1 more virtual servers (one real server each, never connected to),
# as many as the agent's table holds below: what the table's size costs a new connection.
awk -v n=$SIZE 'BEGIN{for(i=0;i<n;i++){if(i==10)continue; a=sprintf("%d.%d", int(i/256)%256, i%256);
  printf "-A -t 10.100.%s:80 -s rr\n-a -t 10.100.%s:80 -r 10.245.%s:8080 -m\n", a, a, a}}' > /tmp/raw.ipvs
k ipvsadm -R < /tmp/raw.ipvs || fail "ipvsadm -R refused the extra virtual servers"
echo "ipvs-alone-full: $(k ipvsadm -Ln | grep -c '^TCP') virtual servers"
measure ipvs-alone-full
measure ipvs-alone-full-again
k ipvsadm -C && k $IP link del raw-ipvs0 && k nft delete table ip raw-ipvs || fail "removing IPVS alone"

# kube-ipvs on SIZE Services in node-k; the first is the measured one.
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
# Starts the agent in node-k with flags "$@" and waits until `check` says the kernel is in sync.
start_agent() {
  GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=131072 \
    $IP netns exec node-k $K run --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 \
    --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 "$@" >> /tmp/agent.log 2>&1 &
  AGENT=$!
  tries=0
  until k $K check --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 > /tmp/check.log 2>&1; do
    tries=$((tries + 1))
    [ $tries -gt $((240 + SIZE / 25)) ] && { tail -20 /tmp/agent.log /tmp/check.log; fail "the agent did not converge"; }
    sleep 0.5
  done
}
start_agent
echo "kube-ipvs: in sync, $(k ipvsadm -Ln | grep -c '^TCP') virtual servers, $(k iptables-save | grep -cE '^-A KUBE-|-j KUBE-') iptables rules of its own"
emulated
TARGETS=$DIRECT_K:$PORT,$IPVS_VIP:80,$RULES
measure agent-running
measure agent-running-again
kill -STOP $AGENT
measure agent-stopped
measure agent-stopped-again
# The kernel's rate estimator off (before 6.2 a timer walks every virtual and real server's
# counters every 2 s under one lock, in softirq), the agent still stopped.
k sh -c 'echo 0 > /proc/sys/net/ipv4/vs/run_estimation' || fail "run_estimation"
measure no-estimator
measure no-estimator-again
k sh -c 'echo 1 > /proc/sys/net/ipv4/vs/run_estimation'
profile kube-ipvs $IPVS_VIP:80
profile nftables $NFT_VIP:80
profile nftables-min $MIN_VIP:80
profile iptables $IPT_VIP:80
kill -CONT $AGENT
# The agent restarted with the ClusterIPs as local routes instead of addresses on kube-ipvs0
# (--service-address-binding=route; the restart moves them): the same paths without SIZE more
# addresses in the kernel's address hash.
kill $AGENT; wait $AGENT
start_agent --service-address-binding=route
echo "kube-ipvs with routes: $(k $IP -o -4 addr show dev kube-ipvs0 | wc -l) addresses on kube-ipvs0, $(k $IP route show table local proto 124 | wc -l) local routes of its own"
measure routes-running
measure routes-running-again
kill -STOP $AGENT
measure routes-stopped
measure routes-stopped-again
profile kube-ipvs-routes $IPVS_VIP:80
kill -CONT $AGENT
echo done
