# The agent's startup on an empty node at N Services x E endpoints, with the ClusterIPs made
# local by address on kube-ipvs0 (the default, as kube-proxy's IPVS mode) and by local route
# (--service-address-binding=route), each in a fresh network namespace (its own IPVS table,
# no destination trash), then the same node moved from addresses to routes by a restart with
# the flag:
#   cargo xtask bench binding [--sizes N,..] [--endpoints E]
# (which builds the release kube-ipvs and runs this in a 6 GiB guest), or by hand:
#   cargo build --release -p kube-ipvs --bin kube-ipvs
#   cargo xtask vm-run --timeout 3600 --mem 6144 --exe target/release/kube-ipvs \
#     "SIZES=10000 ENDPOINTS=10; $(cat integration/bench/binding-startup.sh)"
# The agent reads manifests (`run --manifests`, every endpoint on another node) with
# --no-masquerade, so the startup is the listing, the diff, the binds and the IPVS requests.
# Each STARTUP line: from the agent's start to its log's "startup sync: applied" line, that
# line's own time (the apply), and what the kernel then holds; each MOVE line the same for the
# restart that moves the addresses. docs/benchmarks.md has the figures.
IP=/usr/sbin/ip; K=/usr/local/bin/kube-ipvs
SIZES=${SIZES:-10000,50000}; ENDPOINTS=${ENDPOINTS:-10}
fail() { echo "binding-startup: $*"; exit 1; }
now() { cut -d' ' -f1 /proc/uptime; }
secs() { awk -v a=$1 -v b=$2 'BEGIN{printf "%.2f", b - a}'; }
uname -r
M=/tmp/manifests
# Starts the agent in namespace $1 with flags $3.., logging to $2; waits for its startup sync.
start() {
  ns=$1; log=$2; shift 2
  t0=$(now)
  $IP netns exec $ns $K run --manifests $M --hostname-override node-1 \
    --cluster-cidr 10.244.0.0/16 --no-masquerade "$@" > $log 2>&1 &
  AGENT=$!
  until grep -q "startup sync: applied" $log; do
    kill -0 $AGENT 2>/dev/null || { tail -20 $log; fail "the agent exited"; }
    sleep 0.2
  done
  t1=$(now)
  ELAPSED=$(secs $t0 $t1)
  APPLY=$(grep -o "startup sync: applied .*" $log | head -1)
}
stop() { kill $AGENT; wait $AGENT; }
held() {
  echo "addresses=$($IP -n $1 -o -4 addr show dev kube-ipvs0 | wc -l) routes=$($IP -n $1 route show table local proto 124 | wc -l) virtual_servers=$($IP netns exec $1 ipvsadm -Ln | grep -c '^TCP')"
}
for N in $(echo $SIZES | tr , ' '); do
  rm -rf $M; mkdir -p $M
  printf 'apiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nstatus:\n  addresses:\n  - {type: InternalIP, address: 10.251.0.1}\n' > $M/node.yaml
  # ClusterIP i: 10.(96 + i / 65536).(i / 256 % 256).(i % 256); endpoint j of Service i:
  # 10.(128 + j).(i / 256 % 256).(i % 256), on node-2.
  awk -v n=$N -v e=$ENDPOINTS 'BEGIN{for(i=0;i<n;i++){a=sprintf("%d.%d.%d", 96 + int(i/65536), int(i/256)%256, i%256);
    b=sprintf("%d.%d", int(i/256)%256, i%256);
    printf "---\napiVersion: v1\nkind: Service\nmetadata: {name: s%d, namespace: default}\nspec:\n  type: ClusterIP\n  clusterIP: 10.%s\n  clusterIPs: [10.%s]\n  ports:\n  - {name: http, port: 80, protocol: TCP, targetPort: 8080}\n", i, a, a;
    printf "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: s%d-1\n  namespace: default\n  labels: {kubernetes.io/service-name: s%d}\naddressType: IPv4\nendpoints:\n", i, i;
    for(j=0;j<e;j++) printf "- addresses: [10.%d.%s]\n  conditions: {ready: true, serving: true, terminating: false}\n  nodeName: node-2\n", 128 + j, b;
    printf "ports:\n- {name: http, port: 8080, protocol: TCP}\n"}}' > $M/services.yaml
  for binding in route address; do
    ns=b-$binding-$N
    $IP netns add $ns && $IP -n $ns link set lo up || fail "namespace $ns"
    start $ns /tmp/$ns.log --service-address-binding=$binding
    echo "STARTUP n=$N endpoints=$ENDPOINTS binding=$binding seconds=$ELAPSED $(held $ns) | $APPLY"
    grep -o "applied [0-9,]* address binds.*" /tmp/$ns.log | head -1 | sed "s/^/STARTUP-APPLY n=$N binding=$binding /"
    stop
  done
  # The node of addresses moved to routes by a restart with the flag.
  ns=b-address-$N
  start $ns /tmp/$ns-move.log --service-address-binding=route
  MOVED=$(grep -o "moved [0-9]* service addresses.*" /tmp/$ns-move.log | head -1)
  echo "MOVE n=$N seconds=$ELAPSED $(held $ns) | $MOVED | $APPLY"
  stop
  for binding in route address; do $IP netns del b-$binding-$N; done
done
echo done
