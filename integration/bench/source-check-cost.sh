# What the kernel's check of each packet's source costs when a node makes many addresses local,
# run in the guest: cargo xtask vm-run --timeout 1200 --mem 3072 --exe
# target/release/examples/e2e-bench
# "$(cat integration/bench/nodes.sh integration/bench/source-check-cost.sh)".
# With rp_filter off, the routing of a packet in (forwarded or delivered) checks only that its
# source is not a local address of the namespace: one lookup in the IPv4 address hash, which
# before the kernel's per-namespace table (Debian 12's 6.1 included) is one 256-bucket hash for
# every namespace of the machine. Once any local route has been added by hand (rtnetlink, as
# `--service-address-binding=route` does) the kernel sets the namespace's
# fib_has_custom_local_routes and does the full reverse-path lookup for every such packet
# instead, as it does for every packet when rp_filter is 1 or 2.
# Three node namespaces between one client namespace and one server namespace (nodes.sh's
# make_nodes, as in datapath-cost.sh, without any proxy), and one client connecting through each
# node in turn.
# Blocks: the base; one local route of ours in node-r, then 10,000; 10,000 /32 addresses on a
# dummy in node-k (what address binding does); rp_filter=2 in node-n, then in every namespace;
# the addresses removed; rp_filter back to 0 everywhere. docs/benchmarks.md has the figures.
IP=/usr/sbin/ip; E=/usr/local/bin/e2e-bench; PORT=8080; COUNT=${COUNT:-3000}
fail() { echo "source-check-cost: $*"; exit 1; }
uname -r
make_nodes
# The endpoint 10.244.0.(10i+10) on the server, reached through node i.
i=0
for node in node-k node-n node-r; do
  ep=10.244.0.$((10 * i + 10))
  $IP -n dp-server addr add $ep/32 dev lo && $IP -n dp-client route add $ep/32 via 10.250.$i.1 ||
    fail "the endpoint through $node"
  echo "PATH direct-$(echo $node | cut -c6) $ep:$PORT"
  i=$((i + 1))
done
rp_filter() {
  for ns in "$@"; do $IP netns exec $ns sh -c "echo $RPF > /proc/sys/net/ipv4/conf/all/rp_filter" || fail "rp_filter in $ns"; done
}
RPF=0; rp_filter dp-client dp-server node-k node-n node-r
$IP netns exec dp-server $E serve --port $PORT &
TARGETS=10.244.0.10:$PORT,10.244.0.20:$PORT,10.244.0.30:$PORT
i=0; while ! $IP netns exec dp-client $E connect --targets $TARGETS --count 1 | grep 'failed=0' > /dev/null; do
  i=$((i + 1)); [ $i -gt 100 ] && fail "the server never answered"; sleep 0.2
done
measure() {
  $IP netns exec dp-client $E connect --targets $TARGETS --count 300 >/dev/null
  for b in $1 $1-again; do
    $IP netns exec dp-client $E connect --targets $TARGETS --count $COUNT | sed "s/^/STEP $b /"
  done
}
measure base
$IP -n node-r route add local 10.103.39.15 dev lo table local proto 124 scope host || fail "a local route"
measure r-one-local-route
awk 'BEGIN{for(i=0;i<9999;i++) printf "route add local 10.103.%d.%d dev lo table local proto 124 scope host\n", int(i/256)%256, i%256}' > /tmp/routes
$IP -n node-r -batch /tmp/routes || fail "the local routes"
echo "node-r: $($IP -n node-r route show table local proto 124 | wc -l) local routes of proto 124"
measure r-10k-local-routes
awk 'BEGIN{for(i=0;i<10000;i++) printf "address add 10.97.%d.%d/32 dev kube-ipvs0\n", int(i/256)%256, i%256}' > /tmp/addrs
$IP -n node-k link add kube-ipvs0 type dummy && $IP -n node-k -batch /tmp/addrs || fail "the addresses"
echo "node-k: $($IP -n node-k -o -4 addr show dev kube-ipvs0 | wc -l) addresses on kube-ipvs0"
measure k-10k-addresses
RPF=2; rp_filter node-n
measure n-rp-filter-2
rp_filter dp-client dp-server node-k node-r
measure all-rp-filter-2
$IP -n node-k link del kube-ipvs0 || fail "removing the addresses"
measure addresses-gone-rp-filter-2
RPF=0; rp_filter dp-client dp-server node-k node-n node-r
measure addresses-gone-rp-filter-0
echo done
