# The kernel's cost of making N ClusterIPs local, run in the guest: cargo xtask vm-run
# --timeout 1400 --mem 4096 "$(cat integration/bench/binds-cost.sh)". Each way in a fresh network
# namespace: N /32 addresses on a down dummy kube-ipvs0 (what kube-ipvs and kube-proxy's IPVS
# mode do; the kernel walks the interface's address list on every add), and N local routes in
# the local table (dev lo, then dev kube-ipvs0 down), each with `ip -batch`. docs/benchmarks.md
# has the figures.
IP=/usr/sbin/ip; [ -x $IP ] || IP=/sbin/ip; [ -x $IP ] || IP=/bin/ip
uname -r; $IP -V
now() { cat /proc/uptime | cut -d' ' -f1; }
gen() { awk -v n=$1 -v fmt="$2" 'BEGIN{for(i=0;i<n;i++) printf fmt "\n", 96+int(i/65536), int(i/256)%256, i%256}'; }
for N in 10000 50000; do
  gen $N 'addr add 10.%d.%d.%d/32 dev kube-ipvs0' > /tmp/a$N
  gen $N 'route add local 10.%d.%d.%d/32 dev lo table local proto 200' > /tmp/r$N
  gen $N 'route add local 10.%d.%d.%d/32 dev kube-ipvs0 table local proto 200' > /tmp/k$N
  $IP netns add a$N; $IP -n a$N link add kube-ipvs0 type dummy
  t0=$(now); $IP -n a$N -batch /tmp/a$N; t1=$(now)
  echo "BINDS n=$N addresses_on_kube-ipvs0_down: $(awk -v a=$t0 -v b=$t1 'BEGIN{print b-a}') s; count $($IP -n a$N -o addr show dev kube-ipvs0 | wc -l)"
  $IP netns add r$N; $IP -n r$N link set lo up
  t0=$(now); $IP -n r$N -batch /tmp/r$N; t1=$(now)
  echo "BINDS n=$N local_routes_dev_lo: $(awk -v a=$t0 -v b=$t1 'BEGIN{print b-a}') s; count $($IP -n r$N route show table local proto 200 | wc -l)"
  $IP -n r$N route get 10.96.0.5
  $IP netns add k$N; $IP -n k$N link add kube-ipvs0 type dummy
  t0=$(now); $IP -n k$N -batch /tmp/k$N 2>&1 | head -2; t1=$(now)
  echo "BINDS n=$N local_routes_dev_kube-ipvs0_down: $(awk -v a=$t0 -v b=$t1 'BEGIN{print b-a}') s; count $($IP -n k$N route show table local proto 200 | wc -l)"
  t0=$(now); $IP -n a$N link del kube-ipvs0; t1=$(now)
  echo "BINDS n=$N delete_kube-ipvs0_with_addresses: $(awk -v a=$t0 -v b=$t1 'BEGIN{print b-a}') s"
  for ns in a$N r$N k$N; do $IP netns del $ns; done
done
