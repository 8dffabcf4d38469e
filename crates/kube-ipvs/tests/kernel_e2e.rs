//! End-to-end traffic tests (run in the VM by `cargo xtask vm-test kube-ipvs/kernel_e2e`):
//! the real agent `kube-ipvs run --manifests DIR` programs this test's network namespace (the
//! node), pods and a client are network namespaces of their own behind a veth each, and every
//! assertion is about which backend answered real TCP or UDP traffic and which peer it saw.
//!
//! The topology follows `cargo xtask demo`: each namespace's veth end on the node holds
//! 169.254.1.1/32 as the gateway, and the node routes each host's /32 to its veth. Pods answer
//! every connection with `$SOCAT_SOCKADDR $SOCAT_PEERADDR` (their own address and the client
//! address they see), a fixed shell literal, so no data ever reaches a shell. Namespace names are
//! global to the guest, so each test prefixes its own and deletes them when it ends.
//!
//! Waits poll a condition until a deadline (a server listening, `kube-ipvs check` exiting 0,
//! a new backend answering); nothing sleeps for a fixed time to synchronise.
#![cfg(feature = "kernel-tests")]

use std::collections::BTreeMap;
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const IP: &str = "/usr/sbin/ip";
const GATEWAY: &str = "169.254.1.1";
const GATEWAY6: &str = "fe80::1";
const CLIENT: &str = "192.168.56.100";
const NODE_IP: &str = "192.168.56.10";

/// What every TCP pod server runs per connection: its own address, then the peer it sees. A
/// fixed literal; socat sets both variables.
const ANSWER: &str = "SYSTEM:echo $SOCAT_SOCKADDR $SOCAT_PEERADDR";

/// The same for UDP, where socat does not set `SOCAT_SOCKADDR`: the pod's address comes from
/// the environment the test gives the server (`E2E_POD`), so it still never enters the script.
const UDP_ANSWER: &str = "SYSTEM:echo $E2E_POD $SOCAT_PEERADDR";

fn kube_ipvs_bin() -> String {
    std::env::var("KUBE_IPVS_BIN").unwrap_or_else(|_| "/usr/local/bin/kube-ipvs".into())
}

fn run(bin: &str, args: &[&str]) -> Output {
    let out = Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running {bin} {args:?}: {e}"));
    if !out.status.success() {
        println!(
            "$ {bin} {}\n{}{}(exit {:?})",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            out.status.code()
        );
    }
    out
}

fn ok(bin: &str, args: &[&str]) {
    assert!(run(bin, args).status.success(), "{bin} {args:?} failed");
}

/// Polls `cond` every 100 ms until it holds or `limit` passes.
fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A port nothing listens on in this namespace right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// The pods, the client and their servers of one test; everything is removed on drop.
struct Lab {
    tag: &'static str,
    namespaces: Vec<String>,
    servers: Vec<Child>,
    links: usize,
}

impl Lab {
    /// `tag` names this test's namespaces and veths (at most 6 characters: link names are
    /// limited to 15).
    fn new(tag: &'static str) -> Lab {
        assert!(tag.len() <= 6, "tag {tag} too long for link names");
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1\n").expect("ip_forward");
        Lab {
            tag,
            namespaces: Vec::new(),
            servers: Vec::new(),
            links: 0,
        }
    }

    fn ns(&self, name: &str) -> String {
        format!("e2e-{}-{name}", self.tag)
    }

    /// A host `name` holding `addr`/32 (or /128), reached from the node through a veth whose node end is
    /// the gateway.
    fn host(&mut self, name: &str, addr: &str) {
        let ns = self.ns(name);
        let _ = run(IP, &["netns", "del", &ns]);
        ok(IP, &["netns", "add", &ns]);
        self.namespaces.push(ns.clone());
        self.links += 1;
        let node_end = format!("{}h{}", self.tag, self.links);
        let host_end = format!("{}p{}", self.tag, self.links);
        ok(
            IP,
            &[
                "link", "add", &node_end, "type", "veth", "peer", "name", &host_end,
            ],
        );
        ok(IP, &["link", "set", &host_end, "netns", &ns]);
        ok(IP, &["-n", &ns, "link", "set", "lo", "up"]);
        ok(IP, &["-n", &ns, "link", "set", &host_end, "up"]);
        if addr.contains(':') {
            return self.host_v6(&ns, addr, &node_end, &host_end);
        }
        let host_addr = format!("{addr}/32");
        ok(
            IP,
            &["-n", &ns, "addr", "add", &host_addr, "dev", &host_end],
        );
        ok(IP, &["-n", &ns, "route", "add", GATEWAY, "dev", &host_end]);
        ok(
            IP,
            &[
                "-n", &ns, "route", "add", "default", "via", GATEWAY, "dev", &host_end,
            ],
        );
        ok(IP, &["link", "set", &node_end, "up"]);
        let gateway = format!("{GATEWAY}/32");
        ok(IP, &["addr", "add", &gateway, "dev", &node_end]);
        ok(IP, &["route", "add", &host_addr, "dev", &node_end]);
    }

    /// The IPv6 half of [`Lab::host`]: the node end holds the link-local gateway fe80::1, and
    /// addresses skip duplicate detection so they are usable at once.
    fn host_v6(&mut self, ns: &str, addr: &str, node_end: &str, host_end: &str) {
        std::fs::write("/proc/sys/net/ipv6/conf/all/forwarding", "1\n").expect("forwarding");
        let host_addr = format!("{addr}/128");
        ok(
            IP,
            &[
                "-n", ns, "-6", "addr", "add", &host_addr, "dev", host_end, "nodad",
            ],
        );
        ok(
            IP,
            &[
                "-n", ns, "-6", "route", "add", "default", "via", GATEWAY6, "dev", host_end,
            ],
        );
        ok(
            IP,
            &["-6", "addr", "add", "fe80::1/64", "dev", node_end, "nodad"],
        );
        ok(IP, &["link", "set", node_end, "up"]);
        ok(IP, &["-6", "route", "add", &host_addr, "dev", node_end]);
    }

    /// A pod `name` at `addr` with a TCP server on `port`, listening when this returns.
    fn pod(&mut self, name: &str, addr: &str, port: u16) {
        self.pod_answering(name, addr, port, ANSWER);
    }

    /// A pod whose TCP server runs `script` (a fixed literal) per connection.
    fn pod_answering(&mut self, name: &str, addr: &str, port: u16, script: &str) {
        self.host(name, addr);
        let v6 = addr.contains(':');
        let listen = if v6 {
            format!("TCP6-LISTEN:{port},fork,reuseaddr")
        } else {
            format!("TCP-LISTEN:{port},fork,reuseaddr")
        };
        self.spawn_server(name, addr, &listen, script);
        let target: SocketAddr = if v6 {
            format!("[{addr}]:{port}")
        } else {
            format!("{addr}:{port}")
        }
        .parse()
        .expect("pod address");
        // The node reaches the pod directly (not through IPVS), so this probe moves no
        // scheduler state.
        wait_for(
            &format!("pod {name} to listen"),
            Duration::from_secs(20),
            || TcpStream::connect_timeout(&target, Duration::from_secs(1)).is_ok(),
        );
    }

    /// A UDP server on `port` in pod `name`, answering each datagram like the TCP servers.
    fn udp_server(&mut self, name: &str, addr: &str, port: u16) {
        let listen = format!("UDP-RECVFROM:{port},fork");
        self.spawn_server(name, addr, &listen, UDP_ANSWER);
    }

    fn spawn_server(&mut self, name: &str, addr: &str, listen: &str, answer: &str) {
        let ns = self.ns(name);
        let child = Command::new(IP)
            .args(["netns", "exec", &ns, "socat", listen, answer])
            .env("E2E_POD", addr)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("starting socat in {ns}: {e}"));
        self.servers.push(child);
    }

    /// One TCP connection from host `from` to `target`: the answering pod's (address, peer).
    fn connect(&self, from: &str, target: &str) -> Option<(String, String)> {
        let ns = self.ns(from);
        let remote = format!("TCP:{target},connect-timeout=3");
        let out = run(
            IP,
            &[
                "netns", "exec", &ns, "socat", "-T", "5", "-u", &remote, "STDOUT",
            ],
        );
        answer(&out)
    }

    /// A TCP connection from host `from` to `target` left open: the client process and the
    /// answering pod's address (the pods of the `lc` test keep connections open).
    fn hold(&self, from: &str, target: &str) -> (Child, String) {
        use std::io::BufRead as _;
        let ns = self.ns(from);
        let remote = format!("TCP:{target},connect-timeout=3");
        let mut child = Command::new(IP)
            .args(["netns", "exec", &ns, "socat", "-u", &remote, "STDOUT"])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start socat client");
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            let _ = std::io::BufReader::new(out).read_line(&mut line);
        }
        let addr = line
            .split_whitespace()
            .next()
            .map_or_else(|| "none".to_owned(), normalise);
        (child, addr)
    }

    /// One UDP datagram from host `from` to `target`: the answering pod's (address, peer).
    fn datagram(&self, from: &str, target: &str) -> Option<(String, String)> {
        let ns = self.ns(from);
        let remote = format!("UDP:{target}");
        // After stdin ends socat waits up to -t seconds for the answer, then exits.
        let mut child = Command::new(IP)
            .args(["netns", "exec", &ns, "socat", "-t", "2", "-", &remote])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start socat UDP client");
        if let Some(mut stdin) = child.stdin.take() {
            stdin.write_all(b"ping\n").expect("write the datagram");
        }
        let out = child.wait_with_output().expect("socat UDP client");
        answer(&out)
    }

    /// `count` TCP connections from `from` to `target`: answers per backend address
    /// (`"none"` for a failed connection).
    fn spread(&self, from: &str, target: &str, count: usize) -> BTreeMap<String, usize> {
        let mut seen = BTreeMap::new();
        for _ in 0..count {
            let who = self
                .connect(from, target)
                .map_or_else(|| "none".to_owned(), |(addr, _)| addr);
            *seen.entry(who).or_insert(0) += 1;
        }
        println!("{count} connections from {from} to {target}: {seen:?}");
        seen
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for server in &mut self.servers {
            let _ = server.kill();
            let _ = server.wait();
        }
        for ns in &self.namespaces {
            let _ = run(IP, &["netns", "del", ns]);
        }
    }
}

/// The first line of a pod's answer split into its address and the peer it saw.
fn answer(out: &Output) -> Option<(String, String)> {
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace().map(normalise);
    let addr = words.next()?;
    let peer = words.next()?;
    Some((addr, peer))
}

/// socat prints IPv6 addresses bracketed and fully expanded; this gives the short form.
fn normalise(word: &str) -> String {
    let bare = word.trim_start_matches('[').trim_end_matches(']');
    bare.parse::<std::net::IpAddr>()
        .map_or_else(|_| word.to_owned(), |a| a.to_string())
}

/// One endpoint of a slice: address, node, ready.
struct Ep(&'static str, &'static str, bool);

/// The YAML of a Service and its EndpointSlice. `spec_extra` is spliced into the Service spec
/// (type, affinity, policy); `ports` are (name, protocol, port, targetPort, nodePort).
fn service_yaml(
    name: &str,
    cluster_ip: &str,
    spec_extra: &str,
    ports: &[(&str, &str, u16, u16, Option<u16>)],
    endpoints: &[Ep],
) -> String {
    let family = if cluster_ip.contains(':') {
        "IPv6"
    } else {
        "IPv4"
    };
    let mut y = format!(
        "apiVersion: v1\nkind: Service\nmetadata: {{name: {name}, namespace: default}}\nspec:\n  \
         clusterIP: {cluster_ip}\n  clusterIPs: [{cluster_ip}]\n{spec_extra}  ports:\n"
    );
    for (pname, proto, port, target, node_port) in ports {
        let np = node_port.map_or_else(String::new, |p| format!(", nodePort: {p}"));
        y.push_str(&format!(
            "  - {{name: {pname}, port: {port}, protocol: {proto}, targetPort: {target}{np}}}\n"
        ));
    }
    y.push_str(&format!(
        "---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: {name}-e2e\n  \
         namespace: default\n  labels: {{kubernetes.io/service-name: {name}}}\naddressType: {family}\n\
         endpoints:\n"
    ));
    for Ep(addr, node, ready) in endpoints {
        y.push_str(&format!(
            "- addresses: [\"{addr}\"]\n  conditions: {{ready: {ready}, serving: {ready}, \
             terminating: false}}\n  nodeName: {node}\n"
        ));
    }
    y.push_str("ports:\n");
    for (pname, proto, _, target, _) in ports {
        y.push_str(&format!(
            "- {{name: {pname}, port: {target}, protocol: {proto}}}\n"
        ));
    }
    y
}

/// A fresh manifest directory for one test, with `files` (name, YAML) in it.
fn manifests(test: &str, files: &[(&str, String)]) -> PathBuf {
    let dir = PathBuf::from(format!("/tmp/kube-ipvs-e2e-{test}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create manifest dir");
    for (name, text) in files {
        std::fs::write(dir.join(name), text).expect("write manifest");
    }
    dir
}

/// A running `kube-ipvs run`, killed (and its log printed) when dropped.
struct Agent {
    child: Child,
    log: PathBuf,
    dir: PathBuf,
    /// The desired-state flags `check` must be given too.
    source: Vec<String>,
}

impl Agent {
    /// Starts the agent on `dir` and waits until `kube-ipvs check` says the kernel matches.
    fn start(dir: &Path, source: &[&str]) -> Agent {
        Agent::start_with(dir, source, "10.244.0.0/16")
    }

    fn start_with(dir: &Path, source: &[&str], cluster_cidr: &str) -> Agent {
        let healthz = free_port();
        let metrics = loop {
            let p = free_port();
            if p != healthz {
                break p;
            }
        };
        let log = dir.with_extension("log");
        let file = std::fs::File::create(&log).expect("create log");
        let dir_arg = dir.to_str().expect("utf-8 path").to_owned();
        let healthz_arg = format!("127.0.0.1:{healthz}");
        let metrics_arg = format!("127.0.0.1:{metrics}");
        let mut args = vec![
            "run",
            "--manifests",
            &dir_arg,
            "--hostname-override",
            "node-1",
            "--cluster-cidr",
            cluster_cidr,
            "--healthz-bind-address",
            &healthz_arg,
            "--metrics-bind-address",
            &metrics_arg,
            "--sync-period",
            "2s",
            "--min-sync-period",
            "0s",
        ];
        args.extend_from_slice(source);
        println!("$ kube-ipvs {} &", args.join(" "));
        let child = Command::new(kube_ipvs_bin())
            .args(&args)
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .expect("start kube-ipvs run");
        let mut agent = Agent {
            child,
            log,
            dir: dir.to_owned(),
            source: source.iter().map(|s| (*s).to_owned()).collect(),
        };
        agent.wait_converged();
        agent
    }

    /// SIGKILL: no chance to clean up or to finish a sync.
    fn kill(&mut self) {
        self.child.kill().expect("SIGKILL the agent");
        let status = self.child.wait().expect("wait for the agent");
        println!("agent killed: {status}");
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `kube-ipvs check` with the agent's manifests and source flags.
    fn check(&self) -> Output {
        let dir = self.dir.to_str().expect("utf-8 path");
        let mut args = vec!["check", "--manifests", dir, "--hostname-override", "node-1"];
        args.extend(self.source.iter().map(String::as_str));
        run(&kube_ipvs_bin(), &args)
    }

    fn wait_converged(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.check().status.code() != Some(0) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("kube-ipvs run exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "not converged in 30s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        println!("--- kube-ipvs run log ---\n{}", self.log());
    }
}

/// A minimal HTTP/1.0 GET on loopback: the status, or `None` if nothing listens yet.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_whitespace().nth(1)?.parse().ok()
}

fn counts(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(a, n)| ((*a).to_owned(), *n)).collect()
}

const WEB_PORTS: &[(&str, &str, u16, u16, Option<u16>)] = &[("http", "TCP", 80, 8080, None)];

#[test]
fn cluster_ip_round_robin_spreads_connections_evenly() {
    let mut lab = Lab::new("rr");
    lab.host("client", CLIENT);
    for (name, addr) in [
        ("web1", "10.244.1.10"),
        ("web2", "10.244.2.10"),
        ("web3", "10.244.3.10"),
    ] {
        lab.pod(name, addr, 8080);
    }
    let web = service_yaml(
        "web",
        "10.96.0.10",
        "  type: ClusterIP\n",
        WEB_PORTS,
        &[
            Ep("10.244.1.10", "node-1", true),
            Ep("10.244.2.10", "node-2", true),
            Ep("10.244.3.10", "node-3", true),
        ],
    );
    let dir = manifests("rr", &[("web.yaml", web)]);
    let _agent = Agent::start(&dir, &[]);
    assert_eq!(
        lab.spread("client", "10.96.0.10:80", 30),
        counts(&[
            ("10.244.1.10", 10),
            ("10.244.2.10", 10),
            ("10.244.3.10", 10)
        ])
    );
}

#[test]
fn a_not_ready_endpoint_gets_no_connections() {
    let mut lab = Lab::new("nready");
    lab.host("client", CLIENT);
    for (name, addr) in [
        ("api1", "10.244.1.40"),
        ("api2", "10.244.2.40"),
        ("api3", "10.244.3.40"),
    ] {
        lab.pod(name, addr, 8080);
    }
    let api = service_yaml(
        "api",
        "10.96.0.40",
        "  type: ClusterIP\n",
        WEB_PORTS,
        &[
            Ep("10.244.1.40", "node-1", true),
            Ep("10.244.2.40", "node-2", false),
            Ep("10.244.3.40", "node-3", true),
        ],
    );
    let dir = manifests("nready", &[("api.yaml", api)]);
    let _agent = Agent::start(&dir, &[]);
    // The not-ready pod listens, so a connection sent to it would show in the counts.
    assert_eq!(
        lab.spread("client", "10.96.0.40:80", 20),
        counts(&[("10.244.1.40", 10), ("10.244.3.40", 10)])
    );
}

#[test]
fn an_added_endpoint_receives_traffic_within_the_sync_interval() {
    let mut lab = Lab::new("added");
    lab.host("client", CLIENT);
    for (name, addr) in [("web1", "10.244.1.10"), ("web2", "10.244.2.10")] {
        lab.pod(name, addr, 8080);
    }
    let two = [
        Ep("10.244.1.10", "node-1", true),
        Ep("10.244.2.10", "node-2", true),
    ];
    let yaml =
        |eps: &[Ep]| service_yaml("web", "10.96.0.10", "  type: ClusterIP\n", WEB_PORTS, eps);
    let dir = manifests("added", &[("web.yaml", yaml(&two))]);
    let _agent = Agent::start(&dir, &[]);
    assert_eq!(
        lab.spread("client", "10.96.0.10:80", 4),
        counts(&[("10.244.1.10", 2), ("10.244.2.10", 2)])
    );

    lab.pod("web3", "10.244.3.10", 8080);
    let three = [
        Ep("10.244.1.10", "node-1", true),
        Ep("10.244.2.10", "node-2", true),
        Ep("10.244.3.10", "node-3", true),
    ];
    let added = Instant::now();
    std::fs::write(dir.join("web.yaml"), yaml(&three)).expect("rewrite web.yaml");
    // Within two sync periods (2 s each) plus the client's own time under emulation.
    wait_for(
        "the new endpoint to answer",
        Duration::from_secs(10),
        || {
            lab.connect("client", "10.96.0.10:80")
                .is_some_and(|(addr, _)| addr == "10.244.3.10")
        },
    );
    println!(
        "the new endpoint answered {:?} after the rewrite",
        added.elapsed()
    );
}

#[test]
fn client_ip_affinity_keeps_a_client_on_one_backend() {
    let mut lab = Lab::new("sticky");
    lab.host("client", CLIENT);
    for (name, addr) in [
        ("st1", "10.244.1.20"),
        ("st2", "10.244.2.20"),
        ("st3", "10.244.3.20"),
    ] {
        lab.pod(name, addr, 8443);
    }
    let sticky = service_yaml(
        "sticky",
        "10.96.0.20",
        "  type: ClusterIP\n  sessionAffinity: ClientIP\n  sessionAffinityConfig:\n    \
         clientIP: {timeoutSeconds: 600}\n",
        &[("https", "TCP", 443, 8443, None)],
        &[
            Ep("10.244.1.20", "node-1", true),
            Ep("10.244.2.20", "node-2", true),
            Ep("10.244.3.20", "node-3", true),
        ],
    );
    let dir = manifests("sticky", &[("sticky.yaml", sticky)]);
    let _agent = Agent::start(&dir, &[]);
    let seen = lab.spread("client", "10.96.0.20:443", 10);
    assert_eq!(seen.len(), 1, "one backend for one client: {seen:?}");
    assert!(
        !seen.contains_key("none"),
        "every connection answered: {seen:?}"
    );
}

#[test]
fn node_port_answers_on_the_node_address() {
    let mut lab = Lab::new("nodep");
    ok(IP, &["link", "add", "node0", "type", "dummy"]);
    ok(IP, &["link", "set", "node0", "up"]);
    ok(IP, &["addr", "add", "192.168.56.10/32", "dev", "node0"]);
    lab.host("client", CLIENT);
    for (name, addr) in [("web1", "10.244.1.10"), ("web2", "10.244.2.10")] {
        lab.pod(name, addr, 8080);
    }
    let web = service_yaml(
        "web",
        "10.96.0.10",
        "  type: NodePort\n",
        &[("http", "TCP", 80, 8080, Some(30080))],
        &[
            Ep("10.244.1.10", "node-1", true),
            Ep("10.244.2.10", "node-2", true),
        ],
    );
    let dir = manifests("nodep", &[("web.yaml", web)]);
    let _agent = Agent::start(&dir, &["--node-ip", NODE_IP]);
    assert_eq!(
        lab.spread("client", "192.168.56.10:30080", 4),
        counts(&[("10.244.1.10", 2), ("10.244.2.10", 2)])
    );
}

#[test]
fn local_policy_reaches_local_endpoints_keeps_the_client_address_and_health_checks() {
    let mut lab = Lab::new("local");
    ok(IP, &["link", "add", "node0", "type", "dummy"]);
    ok(IP, &["link", "set", "node0", "up"]);
    ok(IP, &["addr", "add", "192.168.56.10/32", "dev", "node0"]);
    lab.host("client", CLIENT);
    for (name, addr) in [("shop1", "10.244.1.30"), ("shop2", "10.244.2.30")] {
        lab.pod(name, addr, 8080);
    }
    const SPEC: &str = "  type: NodePort\n  externalTrafficPolicy: Local\n  \
                        healthCheckNodePort: 32080\n";
    let ports = &[("http", "TCP", 80, 8080, Some(30080))];
    let ready = service_yaml(
        "shop",
        "10.96.0.30",
        SPEC,
        ports,
        &[
            Ep("10.244.1.30", "node-1", true),
            Ep("10.244.2.30", "node-2", true),
        ],
    );
    let dir = manifests("local", &[("shop.yaml", ready)]);
    let agent = Agent::start(&dir, &["--node-ip", NODE_IP]);

    let mut peers = BTreeMap::new();
    for _ in 0..6 {
        let (addr, peer) = lab
            .connect("client", "192.168.56.10:30080")
            .expect("the NodePort answers");
        *peers.entry(format!("{addr} saw {peer}")).or_insert(0) += 1;
    }
    assert_eq!(
        peers,
        counts(&[("10.244.1.30 saw 192.168.56.100", 6)]),
        "only the local endpoint, and it sees the client's own address"
    );

    wait_for("health check 200", Duration::from_secs(10), || {
        http_status(32080, "/") == Some(200)
    });
    let unready = service_yaml(
        "shop",
        "10.96.0.30",
        SPEC,
        ports,
        &[
            Ep("10.244.1.30", "node-1", false),
            Ep("10.244.2.30", "node-2", true),
        ],
    );
    std::fs::write(dir.join("shop.yaml"), unready).expect("rewrite shop.yaml");
    wait_for(
        "health check 503 without a local ready endpoint",
        Duration::from_secs(10),
        || http_status(32080, "/") == Some(503),
    );
    drop(agent);
}

#[test]
fn the_same_port_serves_tcp_and_udp() {
    let mut lab = Lab::new("dns");
    lab.host("client", CLIENT);
    for (name, addr) in [("dns1", "10.244.1.53"), ("dns2", "10.244.2.53")] {
        lab.pod(name, addr, 5353);
        lab.udp_server(name, addr, 5353);
    }
    let dns = service_yaml(
        "dns",
        "10.96.0.53",
        "  type: ClusterIP\n",
        &[
            ("dns", "UDP", 53, 5353, None),
            ("dns-tcp", "TCP", 53, 5353, None),
        ],
        &[
            Ep("10.244.1.53", "node-1", true),
            Ep("10.244.2.53", "node-2", true),
        ],
    );
    let dir = manifests("dns", &[("dns.yaml", dns)]);
    let _agent = Agent::start(&dir, &[]);
    assert_eq!(
        lab.spread("client", "10.96.0.53:53", 4),
        counts(&[("10.244.1.53", 2), ("10.244.2.53", 2)])
    );
    // The UDP servers start without a readiness probe, so the first datagram is retried until
    // one answers; after that each datagram (a new source port) is scheduled afresh.
    wait_for("a UDP answer", Duration::from_secs(20), || {
        lab.datagram("client", "10.96.0.53:53").is_some()
    });
    let mut seen = BTreeMap::new();
    for _ in 0..4 {
        let who = lab
            .datagram("client", "10.96.0.53:53")
            .map_or_else(|| "none".to_owned(), |(addr, _)| addr);
        *seen.entry(who).or_insert(0) += 1;
    }
    assert_eq!(
        seen,
        counts(&[("10.244.1.53", 2), ("10.244.2.53", 2)]),
        "UDP spread over both pods"
    );
}

/// `web` with the scheduler annotation `sched` on its Service.
fn with_scheduler(yaml: &str, sched: &str) -> String {
    yaml.replacen(
        "namespace: default}\nspec:",
        &format!("namespace: default, annotations: {{kube-ipvs.io/scheduler: {sched}}}}}\nspec:"),
        1,
    )
}

#[test]
fn source_hashing_keeps_a_client_on_one_backend_and_lc_favours_the_idle_one() {
    let mut lab = Lab::new("sched");
    lab.host("client", CLIENT);
    for (name, addr) in [
        ("sh1", "10.244.1.10"),
        ("sh2", "10.244.2.10"),
        ("sh3", "10.244.3.10"),
    ] {
        lab.pod(name, addr, 8080);
    }
    // The lc pods keep each connection open for a while after answering, so a connection
    // the client holds stays active in IPVS.
    for (name, addr) in [("lc1", "10.244.1.50"), ("lc2", "10.244.2.50")] {
        lab.pod_answering(
            name,
            addr,
            8080,
            "SYSTEM:echo $SOCAT_SOCKADDR $SOCAT_PEERADDR; sleep 20",
        );
    }
    let sh = service_yaml(
        "hashed",
        "10.96.0.10",
        "  type: ClusterIP\n",
        WEB_PORTS,
        &[
            Ep("10.244.1.10", "node-1", true),
            Ep("10.244.2.10", "node-2", true),
            Ep("10.244.3.10", "node-3", true),
        ],
    );
    let lc = service_yaml(
        "least",
        "10.96.0.50",
        "  type: ClusterIP\n",
        WEB_PORTS,
        &[
            Ep("10.244.1.50", "node-1", true),
            Ep("10.244.2.50", "node-2", true),
        ],
    );
    let dir = manifests(
        "sched",
        &[
            ("hashed.yaml", with_scheduler(&sh, "sh")),
            ("least.yaml", with_scheduler(&lc, "lc")),
        ],
    );
    let _agent = Agent::start(&dir, &[]);

    let seen = lab.spread("client", "10.96.0.10:80", 9);
    assert_eq!(seen.len(), 1, "sh: one backend for one client: {seen:?}");
    assert!(
        !seen.contains_key("none"),
        "every connection answered: {seen:?}"
    );

    let (mut held, busy) = lab.hold("client", "10.96.0.50:80");
    assert!(
        busy.starts_with("10.244."),
        "held connection answered by {busy}"
    );
    let mut others = BTreeMap::new();
    for _ in 0..4 {
        // Each of these is closed by the client once answered, so it turns inactive while
        // the held one stays active.
        let (mut c, who) = lab.hold("client", "10.96.0.50:80");
        let _ = c.kill();
        let _ = c.wait();
        *others.entry(who).or_insert(0) += 1;
    }
    let _ = held.kill();
    let _ = held.wait();
    println!("lc: held {busy}, then {others:?}");
    assert_eq!(others.len(), 1, "lc: all to one backend: {others:?}");
    assert!(
        !others.contains_key(&busy) && !others.contains_key("none"),
        "lc: new connections go to the idle backend, not {busy}: {others:?}"
    );
}

#[test]
fn an_ipv6_service_spreads_over_ipv6_pods() {
    let mut lab = Lab::new("six");
    // A client inside the Pod network, so its traffic is not masqueraded.
    lab.host("client", "fd00:244::100");
    for (name, addr) in [("web1", "fd00:244::10"), ("web2", "fd00:244::20")] {
        lab.pod(name, addr, 8080);
    }
    let web = service_yaml(
        "web6",
        "fd00:96::10",
        "  type: ClusterIP\n  ipFamilies: [IPv6]\n",
        WEB_PORTS,
        &[
            Ep("fd00:244::10", "node-1", true),
            Ep("fd00:244::20", "node-2", true),
        ],
    );
    let dir = manifests("six", &[("web6.yaml", web)]);
    let _agent = Agent::start_with(&dir, &[], "10.244.0.0/16,fd00:244::/64");
    let mut seen = BTreeMap::new();
    for _ in 0..4 {
        let got = lab.connect("client", "[fd00:96::10]:80");
        let key = got.map_or_else(|| "none".to_owned(), |(a, p)| format!("{a} saw {p}"));
        *seen.entry(key).or_insert(0) += 1;
    }
    assert_eq!(
        seen,
        counts(&[
            ("fd00:244::10 saw fd00:244::100", 2),
            ("fd00:244::20 saw fd00:244::100", 2)
        ])
    );
}

#[test]
fn a_killed_agent_leaves_services_working_and_check_reports_the_drift() {
    let mut lab = Lab::new("kill");
    lab.host("client", CLIENT);
    for (name, addr) in [
        ("web1", "10.244.1.10"),
        ("web2", "10.244.2.10"),
        ("api1", "10.244.1.40"),
    ] {
        lab.pod(name, addr, 8080);
    }
    let web = service_yaml(
        "web",
        "10.96.0.10",
        "  type: ClusterIP\n",
        WEB_PORTS,
        &[
            Ep("10.244.1.10", "node-1", true),
            Ep("10.244.2.10", "node-2", true),
        ],
    );
    let dir = manifests("kill", &[("web.yaml", web)]);
    let mut agent = Agent::start(&dir, &[]);
    agent.kill();

    assert_eq!(
        lab.spread("client", "10.96.0.10:80", 4),
        counts(&[("10.244.1.10", 2), ("10.244.2.10", 2)]),
        "the existing Service keeps working"
    );
    let api = service_yaml(
        "api",
        "10.96.0.40",
        "  type: ClusterIP\n",
        WEB_PORTS,
        &[Ep("10.244.1.40", "node-1", true)],
    );
    std::fs::write(dir.join("api.yaml"), api).expect("write api.yaml");
    assert_eq!(
        lab.connect("client", "10.96.0.40:80"),
        None,
        "no agent, no rules for the new Service"
    );
    let check = agent.check();
    let report = String::from_utf8_lossy(&check.stdout).into_owned();
    assert_eq!(
        check.status.code(),
        Some(1),
        "check reports drift:\n{report}"
    );
    assert!(
        report.contains("missing virtual server TCP 10.96.0.40:80"),
        "the drift names the new Service:\n{report}"
    );
    drop(agent);

    // A restart converges (Agent::start waits for check to exit 0) and the new Service answers.
    let _agent = Agent::start(&dir, &[]);
    assert_eq!(
        lab.connect("client", "10.96.0.40:80").map(|(a, _)| a),
        Some("10.244.1.40".to_owned())
    );
}
