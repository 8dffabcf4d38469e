//! `cargo xtask demo`: the README's first command. It boots the test guest, turns it into one
//! node of the example cluster in `examples/cluster/` (pods as network namespaces answering with
//! their names), runs `kube-ipvs run` on it, sends traffic through the Services, and prints the
//! `kube-ipvs dump` table and which backend answered how often.
//!
//! Everything happens inside the guest: the cluster addresses (10.96.x, 10.244.x, the node's
//! 192.168.56.10) exist only there.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::util;
use crate::vm::{self, GuestFile, Job};
use crate::vmtest::cargo_executables;

/// The guest-side script. It only uses names and addresses written here and in the shipped
/// example manifests; nothing in it comes from outside the repository.
const SCRIPT: &str = r#"
set -u
IP=/usr/sbin/ip
K=/usr/local/bin/kube-ipvs
M=/demo/cluster
echo 1 > /proc/sys/net/ipv4/ip_forward

# The node's InternalIP (examples/cluster/node.yaml), where NodePorts listen.
$IP link add node0 type dummy && $IP link set node0 up && $IP addr add 192.168.56.10/32 dev node0

# One network namespace per host: a veth to the node, whose end holds the gateway address.
n=0
netns() { # name address
    n=$((n + 1))
    $IP netns add "$1"
    $IP link add "h$n" type veth peer name "p$n"
    $IP link set "p$n" netns "$1"
    $IP -n "$1" link set lo up
    $IP -n "$1" link set "p$n" up
    $IP -n "$1" addr add "$2/32" dev "p$n"
    $IP -n "$1" route add 169.254.1.1 dev "p$n"
    $IP -n "$1" route add default via 169.254.1.1 dev "p$n"
    $IP link set "h$n" up
    $IP addr add 169.254.1.1/32 dev "h$n"
    $IP route add "$2/32" dev "h$n"
}
# Pods answer every connection with their name.
pod() { # name address port
    netns "$1" "$2"
    $IP netns exec "$1" socat "TCP-LISTEN:$3,fork,reuseaddr" "SYSTEM:echo $1" &
}
# The client sits outside the cluster CIDR, like a user of a NodePort.
netns client 192.168.56.100
pod web-1 10.244.1.10 8080
pod web-2 10.244.2.10 8080
pod web-3 10.244.3.10 8080
pod sticky-1 10.244.1.20 8443
pod sticky-2 10.244.2.20 8443
pod shop-1 10.244.1.30 8080
pod shop-2 10.244.2.30 8080

echo "== kube-ipvs run --manifests $M (node-1)"
$K run --manifests $M --hostname-override node-1 --cluster-cidr 10.244.0.0/16 \
    --healthz-bind-address 127.0.0.1:10256 --metrics-bind-address 127.0.0.1:10249 \
    > /tmp/agent.log 2>&1 &
AGENT=$!

# Converged when `check` says the kernel matches the manifests.
tries=0
until $K check --manifests $M --hostname-override node-1 > /tmp/check.log 2>&1; do
    tries=$((tries + 1))
    if [ $tries -gt 120 ] || ! kill -0 $AGENT 2>/dev/null; then
        echo "the agent did not converge:"; cat /tmp/agent.log /tmp/check.log; exit 1
    fi
    sleep 0.5
done
echo "converged: kube-ipvs check exits 0"


hit() { # label address:port count
    echo
    echo "== $3 connections from the client (192.168.56.100) to $1 ($2): answers per backend"
    i=0
    while [ $i -lt "$3" ]; do
        $IP netns exec client socat -T 2 - "TCP:$2,connect-timeout=2" < /dev/null 2>/dev/null \
            || echo "(no answer)"
        i=$((i + 1))
    done | sort | uniq -c
}
hit "web, ClusterIP, rr" 10.96.0.10:80 30
hit "sticky, ClientIP affinity" 10.96.0.20:443 10
hit "shop, NodePort on the node's address, externalTrafficPolicy Local" 192.168.56.10:30080 10

echo
echo "== kube-ipvs dump -n (after the traffic; closed connections count as InActConn)"
$K dump -n

kill -TERM $AGENT
wait $AGENT
echo
echo "agent stopped with SIGTERM (exit $?); the kernel keeps its rules:"
$IPVSADM -Ln | head -4
"#;

pub(crate) fn command(args: &[String]) -> Result<()> {
    if let Some(extra) = args.first() {
        bail!("cargo xtask demo takes no arguments (got {extra:?})");
    }
    let root = util::workspace_root();
    let built = cargo_executables(&["build", "-p", "kube-ipvs", "--bin", "kube-ipvs"], |m| {
        m["target"]["name"] == "kube-ipvs"
    })?;
    let (_, daemon) = built
        .into_iter()
        .next()
        .context("cargo build produced no kube-ipvs executable")?;
    let mut job = Job::new("demo", SCRIPT.to_owned());
    job.executables.push(GuestFile {
        host: daemon,
        guest: PathBuf::from("/usr/local/bin/kube-ipvs"),
    });
    job.data = example_manifests(&root.join("examples/cluster"))?;
    job.timeout = Duration::from_secs(600);
    let outcome = vm::run(&job)?;
    eprintln!("xtask: console log in {}", outcome.log.display());
    if let Some(why) = outcome.failure() {
        bail!("demo: {why}");
    }
    match outcome.guest_rc {
        Some(0) => Ok(()),
        rc => bail!("demo: the guest script exited with {rc:?}"),
    }
}

/// The example cluster's YAML files, to be placed under `/demo/cluster/` in the guest.
fn example_manifests(dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "yaml") {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .context("example file name is not UTF-8")?;
            let bytes =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            files.push((format!("/demo/cluster/{name}"), bytes));
        }
    }
    if files.is_empty() {
        bail!("no example manifests in {}", dir.display());
    }
    files.sort();
    Ok(files)
}
