# The namespaces of the data-path measurements in integration/bench, put before the script that
# uses them (`cargo xtask bench datapath` does; by hand, `cat` this file before the script):
# make_nodes adds one client namespace (dp-client) and one server namespace (dp-server), and
# between them three node namespaces (node-k, node-n, node-r), each with a veth to both, so that
# a path through one node walks no other node's rules. Node i (0, 1, 2) has the client's link
# 10.250.i.0/24 and the server's 10.251.i.0/24, .1 on both, forwards, and routes the cluster
# CIDR 10.244.0.0/16 to the server. The script defines IP (iproute2's ip) and fail first.
make_nodes() {
  for ns in dp-client dp-server node-k node-n node-r; do
    $IP netns add $ns && $IP -n $ns link set lo up || fail "namespace $ns"
  done
  i=0
  for node in node-k node-n node-r; do
    $IP -n $node link add c$i type veth peer name n$i netns dp-client &&
    $IP -n $node link add s$i type veth peer name n$i netns dp-server &&
    $IP -n $node addr add 10.250.$i.1/24 dev c$i && $IP -n $node link set c$i up &&
    $IP -n $node addr add 10.251.$i.1/24 dev s$i && $IP -n $node link set s$i up &&
    $IP -n dp-client addr add 10.250.$i.2/24 dev n$i && $IP -n dp-client link set n$i up &&
    $IP -n dp-server addr add 10.251.$i.2/24 dev n$i && $IP -n dp-server link set n$i up &&
    $IP -n dp-server route add 10.250.$i.0/24 via 10.251.$i.1 &&
    $IP -n $node route add 10.244.0.0/16 via 10.251.$i.2 &&
    $IP netns exec $node sh -c 'echo 1 > /proc/sys/net/ipv4/ip_forward' || fail "$node's links"
    i=$((i + 1))
  done
}
