# A new connection through kube-ipvs's IPVS against the same through kube-proxy's nftables and
# iptables rules, in one guest, each connection of one client in turn (so a slow moment of the
# host or the guest falls on every path alike):
#   cargo xtask bench datapath [--size N] [--count N] [--no-perf]
# (which builds the release kube-ipvs and e2e-bench, runs this in a 3 GiB guest with the host's
# perf, and sums up each block's ratios), or by hand:
#   cargo build --release -p kube-ipvs --bin kube-ipvs -p kube-ipvs-integration --example e2e-bench
#   cargo xtask vm-run --timeout 1800 --mem 3072 --exe target/release/examples/e2e-bench \
#     --exe target/release/kube-ipvs --exe /usr/bin/perf "$(cat integration/bench/datapath-cost.sh)"
# The two namespaces of `bench e2e`'s data path (datapath.rs): a client outside the cluster CIDR
# routed through the root namespace, a server answering one byte per connection on one endpoint
# address per path. Four targets:
#   direct     the endpoint itself, through nothing of any proxy's (the baseline)
#   kube-ipvs  a ClusterIP of the agent itself (`run --manifests`, as `cargo xtask demo` runs
#              it) with SIZE Services in all (one endpoint each, the others on another node)
#   nftables   the last of SIZE ClusterIPs as kube-proxy's nftables mode matches them: one
#              lookup of address and port in a map, DNAT, masquerade for a client outside the
#              cluster CIDR
#   iptables   the last of SIZE ClusterIPs as kube-proxy's iptables mode matches them: a chain
#              of one rule per Service, walked in order, DNAT, masquerade as above
#   ipvs       (with the agent stopped) IPVS alone: a virtual server of its own, outside the
#              agent's sets and interface, masqueraded by one nftables rule
# The emulated peers' rules only see traffic to their own ranges (10.98/16 and 10.99/16), so
# kube-ipvs's path does not walk them; every path walks the agent's few rules. Measured with the
# agent running, then again with it stopped (its reconcile reads the kernel every 30 s), and
# (with perf in the guest) sampled once per path: idle share and the busiest kernel symbols.
# docs/benchmarks.md has the figures.
IP=/usr/sbin/ip; E=/usr/local/bin/e2e-bench; PERF=/usr/local/bin/perf; K=/usr/local/bin/kube-ipvs
COUNT=${COUNT:-3000}; SIZE=${SIZE:-10000}; PORT=8080
DIRECT=10.244.0.10; IPVS_EP=10.244.0.11; NFT_EP=10.244.0.12; IPT_EP=10.244.0.13; RAW_EP=10.244.0.14
IPVS_VIP=10.96.0.10; RAW_VIP=10.100.0.10
last=$((SIZE - 1)); L="$((last / 256 % 256)).$((last % 256))"
NFT_VIP=10.98.$L; IPT_VIP=10.99.$L
uname -r
echo "PATH direct $DIRECT:$PORT"; echo "PATH kube-ipvs $IPVS_VIP:80"; echo "PATH nftables $NFT_VIP:80"
echo "PATH iptables $IPT_VIP:80"; echo "PATH ipvs-alone $RAW_VIP:80"
echo -1 > /proc/sys/kernel/perf_event_paranoid; echo 0 > /proc/sys/kernel/kptr_restrict
echo 1 > /proc/sys/net/ipv4/ip_forward
for x in "dp-client dpc0 dpc1 10.250.0.1 10.250.0.2" "dp-server dps0 dps1 10.251.0.1 10.251.0.2"; do
  set -- $x
  $IP netns add $1; $IP -n $1 link set lo up
  $IP link add $2 type veth peer name $3 netns $1
  $IP addr add $4/24 dev $2; $IP link set $2 up
  $IP -n $1 addr add $5/24 dev $3; $IP -n $1 link set $3 up
  $IP -n $1 route add default via $4
done
for a in $DIRECT $IPVS_EP $NFT_EP $IPT_EP $RAW_EP; do
  $IP -n dp-server addr add $a/32 dev dps1
  $IP route add $a/32 via 10.251.0.2
done
$IP netns exec dp-server $E serve --port $PORT &
i=0; while ! $IP netns exec dp-client $E connect --targets $DIRECT:$PORT --count 1 | grep -q 'failed=0'; do
  i=$((i+1)); [ $i -gt 100 ] && { echo "the server never answered"; exit 1; }; sleep 0.2
done

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
GLIBC_TUNABLES=glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=131072 \
  $K run --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 \
  --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 > /tmp/agent.log 2>&1 &
AGENT=$!
tries=0
until $K check --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 > /tmp/check.log 2>&1; do
  tries=$((tries + 1))
  [ $tries -gt 600 ] && { echo "the agent did not converge"; tail -20 /tmp/agent.log /tmp/check.log; exit 1; }
  sleep 0.5
done
echo "kube-ipvs: in sync, $(ipvsadm -Ln | grep -c '^TCP') virtual servers, $(iptables-save | grep -c '^-A') iptables rules of its own"

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
nft -f /tmp/emu.nft || { echo "nft refused the emulated rules"; exit 1; }
# kube-proxy's iptables mode, reduced the same way: SIZE rules walked in order.
{
  echo '*nat'
  echo ':EMU-IPTABLES - [0:0]'
  echo '-A PREROUTING -d 10.99.0.0/16 -j EMU-IPTABLES'
  echo '-A POSTROUTING -m mark --mark 0x20000/0x20000 -j MASQUERADE'
  awk -v n=$SIZE -v ep=$IPT_EP 'BEGIN{for(i=0;i<n;i++){a=sprintf("%d.%d", int(i/256)%256, i%256);
    t=(i==n-1) ? ep ":8080" : "10.245." a ":8080";
    printf "-A EMU-IPTABLES -d 10.99.%s/32 -p tcp --dport 80 ! -s 10.244.0.0/16 -j MARK --or-mark 0x20000\n", a;
    printf "-A EMU-IPTABLES -d 10.99.%s/32 -p tcp --dport 80 -j DNAT --to-destination %s\n", a, t}}'
  echo 'COMMIT'
} > /tmp/emu.iptables
iptables-restore --noflush < /tmp/emu.iptables || { echo "iptables-restore refused the emulated rules"; exit 1; }
echo "emulated: $(nft list map ip emu-nftables services | grep -c ' \. 80 : ') nftables map entries, $(iptables -t nat -S EMU-IPTABLES | grep -c '^-A') iptables rules"

TARGETS=$DIRECT:$PORT,$IPVS_VIP:80,$NFT_VIP:80,$IPT_VIP:80
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
measure agent-running
measure agent-running-again
# With the agent stopped (it would delete an IPVS entry it does not know), a fifth path: IPVS
# alone, a virtual server outside the agent's sets on a dummy interface of its own, masqueraded
# by an nftables rule; it walks the agent's rules as the others do but matches none of them.
kill -STOP $AGENT
$IP link add raw-ipvs0 type dummy
$IP addr add $RAW_VIP/32 dev raw-ipvs0
ipvsadm -A -t $RAW_VIP:80 -s rr
ipvsadm -a -t $RAW_VIP:80 -r $RAW_EP:$PORT -m
nft add table ip raw-ipvs
nft add chain ip raw-ipvs post '{ type nat hook postrouting priority srcnat; }'
nft add rule ip raw-ipvs post ip saddr 10.250.0.0/24 ip daddr $RAW_EP masquerade
TARGETS=$TARGETS,$RAW_VIP:80
measure agent-stopped
measure agent-stopped-again
profile kube-ipvs $IPVS_VIP:80
if [ -x $PERF ]; then
  $PERF record -q -e cpu-clock -a -g -o /tmp/callers.data -- $IP netns exec dp-client $E connect --targets $IPVS_VIP:80 --count 1000 >/dev/null 2>&1
  $PERF report -q -i /tmp/callers.data --no-children -S inet_lookup_ifaddr_rcu -g caller --stdio 2>/dev/null | grep -v '^$' | head -80 | sed "s/^/PROFILE callers /"
fi
profile nftables $NFT_VIP:80
profile iptables $IPT_VIP:80
kill -CONT $AGENT
echo done
