//! The agent against a real kube-apiserver (run in the VM by `cargo xtask vm-test
//! kube-ipvs/kernel_apiserver`; vm-test starts etcd and kube-apiserver on the host, built by
//! `cargo xtask tools`, and skips these tests, saying why, when there is no Go toolchain).
//!
//! The guest reaches the API server through QEMU's guestfwd: a socat relay in this test's
//! network namespace makes `https://127.0.0.1:PORT` the host's API server (xtask/src/vm.rs). The
//! test writes Services and EndpointSlices with the kube-rs client as `admin`; the agent runs as
//! the DaemonSet's ServiceAccount with only the RBAC of `deploy/clusterrole.yaml` (vm-test applies
//! it), so a missing permission fails these tests. What the kernel holds is read back with
//! `ipvsadm -Sn` and `kube-ipvs check`.
//!
//! Proved here: the agent converges on what exists before it starts, follows creates, endpoint
//! updates and deletes, and rides out an API server restart (SIGTERM, same store) without a
//! single change to the IPVS table, then follows changes made after it; and on a CPU without AES
//! instructions (this guest's) the API server takes ChaCha20-Poly1305 from the agent's TLS.
//!
//! Tests run one after another against one API server, so each uses a namespace of its own and
//! deletes its objects when it ends (there is no namespace controller to do it).
#![cfg(feature = "kernel-tests")]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::apiserver::{Agent, Cluster, DIR, Gate, check_exit, rs, table, wait_for_table};
use common::{ipvsadm, run, wait_for};

#[test]
fn the_agent_converges_then_follows_creates_updates_and_deletes() {
    let cluster = Cluster::new("converge");
    let web =
        cluster.create_service_with("web", 80, &[("10.244.1.10", true), ("10.244.2.10", true)]);
    let api = cluster.create_service_with("api", 8443, &[("10.244.1.20", true)]);
    let web_vip = format!("{web}:80");
    let api_vip = format!("{api}:8443");

    let starting_events = || {
        let events: kube::Api<k8s_openapi::api::events::v1::Event> =
            kube::Api::namespaced(cluster.client.clone(), "default");
        cluster
            .rt
            .block_on(events.list(&Default::default()))
            .expect("list Events")
            .items
            .iter()
            .filter(|e| {
                e.reason.as_deref() == Some("Starting")
                    && e.reporting_controller.as_deref() == Some("kube-proxy")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref())
                        == Some(common::apiserver::NODE)
            })
            .count()
    };
    let events_before = starting_events();

    let mut agent = Agent::start("converge");
    // kube-proxy's start Event on the Node, created with the DaemonSet's RBAC.
    wait_for(
        "the agent's Starting Event",
        Duration::from_secs(30),
        || starting_events() > events_before,
    );
    let converged = wait_for_table("the existing Services", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.1.10", "10.244.2.10"]))
            && t.get(&api_vip) == Some(&rs(&["10.244.1.20"]))
    });
    println!("converged: {converged:#?}");
    // The `kubernetes` Service the API server made for itself is programmed too.
    assert!(
        converged.contains_key("10.96.0.1:443"),
        "default/kubernetes is missing: {converged:#?}"
    );
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    let addrs = run("/usr/sbin/ip", &["-4", "addr", "show", "dev", "kube-ipvs0"]);
    let addrs = String::from_utf8_lossy(&addrs.stdout);
    assert!(
        addrs.contains(&format!("{web}/32")) && addrs.contains(&format!("{api}/32")),
        "ClusterIPs on kube-ipvs0:\n{addrs}"
    );

    // Created after the agent started: arrives through the watch (the sync period is 1 h).
    let db = cluster.create_service_with("db", 5432, &[("10.244.3.30", true)]);
    let db_vip = format!("{db}:5432");
    wait_for_table("the new Service", |t| {
        t.get(&db_vip) == Some(&rs(&["10.244.3.30"]))
    });

    // An endpoint added, one turned not ready.
    cluster.put_slice(
        "web",
        &[
            ("10.244.1.10", false),
            ("10.244.2.10", true),
            ("10.244.3.10", true),
        ],
        None,
    );
    wait_for_table("the endpoint update", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.2.10", "10.244.3.10"]))
    });

    // Deleted: the virtual server and its address go.
    cluster.delete_service("api");
    let after = wait_for_table("the deleted Service to go", |t| !t.contains_key(&api_vip));
    assert_eq!(after.get(&db_vip), Some(&rs(&["10.244.3.30"])));
    wait_for(
        "the deleted ClusterIP to leave kube-ipvs0",
        Duration::from_secs(30),
        || {
            let out = run("/usr/sbin/ip", &["-4", "addr", "show", "dev", "kube-ipvs0"]);
            !String::from_utf8_lossy(&out.stdout).contains(&format!("{api}/32"))
        },
    );
    wait_for(
        "check to exit 0 after the changes",
        Duration::from_secs(30),
        || check_exit() == Some(0),
    );
    agent.assert_running();
}

/// kubeadm's `config.conf` of the `kube-proxy` ConfigMap (with `mode: ipvs`).
const KUBEADM_CONFIG: &str = include_str!("fixtures/kubeadm-kube-proxy.conf");

/// kube-proxy's DaemonSets keep their `command` when only the image is swapped: the binary
/// started as `/usr/local/bin/kube-proxy` (as the image links it) with kubeadm's command line
/// and `config.conf` (every key kubeadm writes), then with a kops-style command line (flags
/// only, `--master` among them), each unchanged, programs the Service, turns healthy and exits
/// 0 on SIGTERM.
#[test]
fn kube_proxys_command_lines_run_unchanged() {
    let cluster = Cluster::new("cmdline");
    let web = cluster.create_service_with("web", 80, &[("10.244.1.10", true)]);
    let web_vip = format!("{web}:80");
    std::fs::create_dir_all("/var/lib/kube-proxy").expect("mkdir /var/lib/kube-proxy");
    std::fs::copy(
        format!("{DIR}/agent.kubeconfig"),
        "/var/lib/kube-proxy/kubeconfig.conf",
    )
    .expect("the DaemonSet's kubeconfig");
    std::fs::write("/var/lib/kube-proxy/config.conf", KUBEADM_CONFIG).expect("config.conf");
    let kubeconfig = std::fs::read_to_string(format!("{DIR}/agent.kubeconfig")).expect("read");
    let server = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("server:"))
        .map(|s| s.trim().trim_matches('"').to_owned())
        .expect("the kubeconfig's server");
    let alias_dir = std::path::Path::new("/tmp/kube-proxy-alias");
    std::fs::create_dir_all(alias_dir).expect("mkdir");
    let alias = alias_dir.join("kube-proxy");
    let _ = std::fs::remove_file(&alias);
    std::os::unix::fs::symlink(common::kube_ipvs_bin(), &alias).expect("link kube-proxy");
    let alias = alias.to_str().expect("utf-8").to_owned();

    let master = format!("--master={server}");
    let lines: [(&str, Vec<&str>); 2] = [
        (
            "kubeadm",
            vec![
                "--config=/var/lib/kube-proxy/config.conf",
                "--hostname-override=node-1",
            ],
        ),
        (
            "kops",
            vec![
                "--cluster-cidr=100.96.0.0/11",
                "--conntrack-max-per-core=131072",
                "--hostname-override=node-1",
                "--kubeconfig=/var/lib/kube-proxy/kubeconfig.conf",
                &master,
                "--oom-score-adj=-998",
                "--v=2",
                "--proxy-mode=ipvs",
                "--ipvs-scheduler=rr",
            ],
        ),
    ];
    for (who, args) in lines {
        let log = std::path::PathBuf::from(format!("/tmp/kube-proxy-{who}.log"));
        let mut agent = common::RunningAgent::spawn_program(&alias, &args, log);
        wait_for_table(&format!("the Service under {who}'s command line"), |t| {
            t.get(&web_vip) == Some(&rs(&["10.244.1.10"]))
        });
        agent.wait_healthy();
        let log = agent.log();
        println!("--- {who} ---\n{log}");
        assert_eq!(agent.terminate(), Some(0), "{who}: exit on SIGTERM");
    }
    drop(cluster);
}

#[test]
fn an_api_server_restart_leaves_the_kernel_untouched() {
    let cluster = Cluster::new("restart");
    let web =
        cluster.create_service_with("web", 80, &[("10.244.1.10", true), ("10.244.2.10", true)]);
    let web_vip = format!("{web}:80");
    let mut agent = Agent::start("restart");
    wait_for_table("the Service", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.1.10", "10.244.2.10"]))
    });
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    let before = ipvsadm(&["-Sn"]);

    // Sample the table the whole time the API server is away and while the agent's watches
    // reconnect and relist.
    let done = Arc::new(AtomicBool::new(false));
    let sampler_done = Arc::clone(&done);
    let sampler = std::thread::spawn(move || {
        let mut samples = Vec::new();
        let stop = Instant::now() + Duration::from_secs(600);
        while Instant::now() < stop && !sampler_done.load(Ordering::SeqCst) {
            let out = Command::new(common::ipvsadm_bin())
                .arg("-Sn")
                .output()
                .expect("ipvsadm -Sn");
            samples.push(String::from_utf8_lossy(&out.stdout).into_owned());
            std::thread::sleep(Duration::from_millis(100));
        }
        samples
    });
    let t0 = Instant::now();
    cluster.restart_apiserver();
    println!("kube-apiserver restarted in {:?}", t0.elapsed());

    // A change made after the restart arrives, so the agent's watches are back...
    let api = cluster.create_service_with("api", 8443, &[("10.244.1.20", true)]);
    let api_vip = format!("{api}:8443");
    wait_for_table("a Service created after the restart", |t| {
        t.contains_key(&api_vip)
    });
    done.store(true, Ordering::SeqCst);
    let samples = sampler.join().expect("sampler");

    // ...and until that change, every sample of our Service's entries was exactly the one
    // from before. (The `kubernetes` Service is left out: a stopping kube-apiserver really does
    // withdraw its own endpoint, and the agent follows that, as it should.)
    let ours = |table: &str| -> Vec<String> {
        table
            .lines()
            .filter(|l| l.contains(&format!(" {web_vip} ")) || l.ends_with(&format!(" {web_vip}")))
            .map(str::to_owned)
            .collect()
    };
    let expected = ours(&before);
    assert_eq!(
        expected.len(),
        3,
        "the virtual server and its two real servers:\n{before}"
    );
    assert!(samples.len() > 5, "the sampler ran {} times", samples.len());
    let differing: Vec<Vec<String>> = samples
        .iter()
        .map(|s| ours(s))
        .filter(|o| *o != expected)
        .collect();
    assert!(
        differing.is_empty(),
        "{web_vip} changed during the API server restart:\nbefore: {expected:#?}\ndiffering samples: {differing:#?}"
    );
    println!("{} samples of {web_vip}, all identical", samples.len());
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    agent.assert_running();
}

/// One connection of the outage test's traffic generator.
struct Try {
    phase: usize,
    /// Index into the test's targets.
    target: usize,
    answer: Option<String>,
    /// The backends valid for the target when the connection started or ended.
    allowed: std::collections::BTreeSet<String>,
}

/// Issue 18: the API server is stopped for five minutes (`cargo xtask vm-test --long`; 90 s
/// otherwise, which is what CI runs: the watches' backoff reaches its 30 s cap within it, so
/// the retries after the outage are the same) under live traffic, then started again
/// with changes the agent has not seen and etcd's history compacted, so the agent's watches
/// cannot resume (410 Gone) and must list again. Connections from a client namespace to two
/// ClusterIPs and a third Service run the whole time. While the API server is away the kernel
/// must not change and no connection may fail; after the agent is let back in it must converge
/// on the changes (an endpoint swapped, a Service deleted, one created) through a relist, with
/// only connections to the deleted Service failing. Prints the figures `docs/reliability.md`
/// shows.
#[test]
fn an_api_server_outage_with_compacted_history_costs_no_connection() {
    let outage = if std::env::var_os("KUBE_IPVS_LONG").is_some() {
        Duration::from_secs(300)
    } else {
        Duration::from_secs(90)
    };
    let cluster = Cluster::new("outage");
    let mut hosts = Hosts::new();
    hosts.host("out-client", "192.168.57.100", "outc");
    let pods = [
        ("out-web1", "10.244.7.1", "outw1"),
        ("out-web2", "10.244.7.2", "outw2"),
        ("out-web3", "10.244.7.3", "outw3"),
        ("out-api1", "10.244.7.11", "outa1"),
        ("out-gone1", "10.244.7.21", "outg1"),
    ];
    for (ns, addr, link) in pods {
        hosts.host(ns, addr, link);
        hosts.answer_server(ns, 8080);
    }
    let web = cluster.create_service_with("web", 80, &[("10.244.7.1", true), ("10.244.7.2", true)]);
    let api = cluster.create_service_with("api", 80, &[("10.244.7.11", true)]);
    let gone = cluster.create_service_with("gone", 80, &[("10.244.7.21", true)]);
    let mut gate = Gate::open(cluster.ports.apiserver);
    let kubeconfig = gate.kubeconfig("agent.kubeconfig", "/tmp/kube-ipvs-outage.kubeconfig");
    let mut agent = Agent::start_with("outage", &kubeconfig);
    let (web_vip, api_vip, gone_vip) = (
        format!("{web}:80"),
        format!("{api}:80"),
        format!("{gone}:80"),
    );
    wait_for_table("the three Services", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.7.1", "10.244.7.2"]))
            && t.get(&api_vip) == Some(&rs(&["10.244.7.11"]))
            && t.get(&gone_vip) == Some(&rs(&["10.244.7.21"]))
    });
    wait_for("check to exit 0", Duration::from_secs(30), || {
        check_exit() == Some(0)
    });
    let relists_before = agent
        .metric("kube_ipvs_watch_relists_total")
        .expect("the relist counter");

    let set = |addrs: &[&str]| -> std::collections::BTreeSet<String> {
        addrs.iter().map(|a| (*a).to_owned()).collect()
    };
    let targets = [web_vip.clone(), api_vip.clone(), gone_vip.clone()];
    let allowed = std::sync::Mutex::new([
        set(&["10.244.7.1", "10.244.7.2"]),
        set(&["10.244.7.11"]),
        set(&["10.244.7.21"]),
    ]);
    let phase = std::sync::atomic::AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let tries = std::sync::Mutex::new(Vec::<Try>::new());
    let count = || tries.lock().expect("tries").len();
    let wait_more = |n: usize| {
        let before = count();
        wait_for(
            &format!("{n} more connections"),
            Duration::from_secs(120),
            || count() >= before + n,
        );
    };
    let phases = [
        "steady",
        "API server stopped, agent cut off (90 s; 5 min with --long)",
        "API server back with changes and compacted history, agent still cut off",
        "agent let back in: watches get 410, relist, converge",
        "after convergence",
    ];
    let mut converge_s = None;
    let mut compacted_at = String::new();

    /// Stops the generator also when an assertion fails (else the scope waits forever).
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// Starts the API server again if the test fails while it is stopped, so the tests after
    /// this one in the guest still have one (starting a running one does nothing).
    struct StartOnDrop<'a>(&'a Cluster);
    impl Drop for StartOnDrop<'_> {
        fn drop(&mut self) {
            if let Err(e) = self.0.try_control("start-apiserver") {
                eprintln!("starting the API server again: {e}");
            }
        }
    }
    let _start = StartOnDrop(&cluster);

    std::thread::scope(|scope| {
        let _stop = StopOnDrop(&stop);
        scope.spawn(|| {
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let target = i % targets.len();
                i += 1;
                let mut ok_then = allowed.lock().expect("allowed")[target].clone();
                let p = phase.load(Ordering::SeqCst);
                let answer = hosts.ask("out-client", &targets[target]);
                ok_then.extend(allowed.lock().expect("allowed")[target].iter().cloned());
                tries.lock().expect("tries").push(Try {
                    phase: p,
                    target,
                    answer,
                    allowed: ok_then,
                });
            }
        });
        let begin = |p: usize| {
            phase.store(p, Ordering::SeqCst);
            println!("--- outage phase {p}: {}", phases[p]);
        };

        begin(0);
        wait_more(15);

        // 1: the agent's connections cut and the API server stopped (90 s, or five minutes
        // with --long). The kernel must not change at all meanwhile.
        begin(1);
        // The `kubernetes` Service aside: a stopping kube-apiserver withdraws its own endpoint,
        // and the agent may still hear of it before its connections close.
        let ours = || {
            let mut t = table();
            t.remove("10.96.0.1:443");
            t
        };
        let before = ours();
        gate.close();
        cluster.control("stop-apiserver");
        let stopped = Instant::now();
        let mut samples = 0;
        while stopped.elapsed() < outage {
            std::thread::sleep(Duration::from_secs(5));
            agent.assert_running();
            assert_eq!(
                ours(),
                before,
                "the kernel changed while the API server was away"
            );
            samples += 1;
        }
        println!(
            "API server away {:?}; {samples} table samples, all unchanged",
            stopped.elapsed()
        );

        // 2: back, with changes the agent cannot see yet and a compacted history.
        begin(2);
        cluster.control("start-apiserver");
        {
            let mut a = allowed.lock().expect("allowed");
            a[0] = set(&["10.244.7.1", "10.244.7.2", "10.244.7.3"]);
        }
        cluster.put_slice("web", &[("10.244.7.1", true), ("10.244.7.3", true)], None);
        cluster.delete_service("gone");
        let fresh = cluster.create_service_with("fresh", 80, &[("10.244.7.11", true)]);
        let fresh_vip = format!("{fresh}:80");
        compacted_at = cluster.control("compact-etcd");
        wait_more(6);
        assert_eq!(
            ours(),
            before,
            "the kernel changed while the agent was cut off"
        );

        // 3: the agent let back in. Its watches resume from a compacted resourceVersion and
        // must list again; only a relist can tell it that `gone` was deleted.
        begin(3);
        let reopened = Instant::now();
        gate.reopen();
        let deadline = reopened + Duration::from_secs(120);
        // A removed endpoint stays at weight 0 while its connections drain: new connections
        // go only to the real servers with a weight.
        let live = |rs: Option<&Vec<String>>| -> Vec<String> {
            rs.map(|v| v.iter().filter(|r| !r.ends_with(" w0")).cloned().collect())
                .unwrap_or_default()
        };
        loop {
            let t = table();
            if live(t.get(&web_vip)) == rs(&["10.244.7.1", "10.244.7.3"])
                && !t.contains_key(&gone_vip)
                && t.get(&fresh_vip) == Some(&rs(&["10.244.7.11"]))
            {
                break;
            }
            agent.assert_running();
            assert!(
                Instant::now() < deadline,
                "not converged 120 s after the agent was let back in: {t:#?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        converge_s = Some(reopened.elapsed().as_secs_f64());
        {
            let mut a = allowed.lock().expect("allowed");
            a[0] = set(&["10.244.7.1", "10.244.7.3"]);
            a[2] = std::collections::BTreeSet::new();
        }
        wait_for(
            "check to exit 0 after the outage",
            Duration::from_secs(60),
            || check_exit() == Some(0),
        );

        begin(4);
        wait_more(15);
        stop.store(true, Ordering::SeqCst);
    });

    let relists_after = agent
        .metric("kube_ipvs_watch_relists_total")
        .expect("the relist counter");
    let errors = agent.metric("kube_ipvs_watch_errors_total").unwrap_or(0);
    println!(
        "etcd compacted at revision {compacted_at}; relists {relists_before} -> {relists_after}; watch errors {errors}; 410s in the agent's log {}",
        agent.log().matches("too old resource version").count()
    );
    // A watch resumes without a 410 when its resourceVersion is inside the restarted API
    // server's watch cache (a bookmark just before the outage can put it there); the others
    // must have been told 410 and listed again. `gone`'s removal above needed one of the two.
    let gone_410 = agent.log().matches("too old resource version").count();
    assert!(
        gone_410 >= 1 && relists_after > relists_before,
        "no watch was told 410 and listed again ({gone_410} 410s; relists {relists_before} -> {relists_after})"
    );
    let tries = tries.into_inner().expect("tries");
    println!(
        "OUTAGE | phase | connections | failed | failed to the deleted Service | wrong backend | seconds to converge"
    );
    let mut wrong_total = 0;
    for (p, name) in phases.iter().enumerate() {
        let mine: Vec<&Try> = tries.iter().filter(|t| t.phase == p).collect();
        let failed: Vec<&&Try> = mine.iter().filter(|t| t.answer.is_none()).collect();
        let to_gone = failed.iter().filter(|t| t.target == 2).count();
        let wrong: Vec<String> = mine
            .iter()
            .filter_map(|t| {
                let got = t.answer.as_ref()?;
                (!t.allowed.contains(got)).then(|| format!("{got} from {}", targets[t.target]))
            })
            .collect();
        wrong_total += wrong.len();
        println!(
            "OUTAGE | {name} | {} | {} | {to_gone} | {} | {}",
            mine.len(),
            failed.len(),
            wrong.len(),
            if p == 3 {
                converge_s.map_or_else(|| "-".to_owned(), |s| format!("{s:.1}"))
            } else {
                "-".to_owned()
            },
        );
        if !wrong.is_empty() {
            println!("  wrong backends: {wrong:?}");
        }
        // Only connections to the Service deleted during the outage may fail, and only once
        // it was deleted.
        let may_fail = if p >= 2 { to_gone } else { 0 };
        assert_eq!(
            failed.len(),
            may_fail,
            "{name}: connections failed to Services that exist"
        );
    }
    assert_eq!(
        wrong_total, 0,
        "a connection reached a backend that was not valid"
    );
    agent.assert_running();
}

const IP: &str = "/usr/sbin/ip";
/// The pinned kube-proxy vm-test puts in the guest.
const UPSTREAM_KUBE_PROXY: &str = "/usr/local/bin/kube-proxy-upstream";

/// Network namespaces of one test: hosts behind veths whose node end is the gateway
/// 169.254.1.1, and servers in them; all removed on drop.
struct Hosts {
    namespaces: Vec<String>,
    children: Vec<std::process::Child>,
}

impl Hosts {
    fn new() -> Hosts {
        std::fs::write("/proc/sys/net/ipv4/ip_forward", "1\n").expect("ip_forward");
        Hosts {
            namespaces: Vec::new(),
            children: Vec::new(),
        }
    }

    /// A namespace `ns` holding `addr`/32, its veth's node end `link`.
    fn host(&mut self, ns: &str, addr: &str, link: &str) {
        let ok = |args: &[&str]| assert!(run(IP, args).status.success(), "ip {args:?}");
        let _ = run(IP, &["netns", "del", ns]);
        ok(&["netns", "add", ns]);
        self.namespaces.push(ns.to_owned());
        let peer = format!("{link}p");
        ok(&["link", "add", link, "type", "veth", "peer", "name", &peer]);
        ok(&["link", "set", &peer, "netns", ns]);
        ok(&["-n", ns, "link", "set", "lo", "up"]);
        ok(&["-n", ns, "link", "set", &peer, "up"]);
        ok(&["-n", ns, "addr", "add", &format!("{addr}/32"), "dev", &peer]);
        ok(&["-n", ns, "route", "add", "169.254.1.1", "dev", &peer]);
        ok(&[
            "-n",
            ns,
            "route",
            "add",
            "default",
            "via",
            "169.254.1.1",
            "dev",
            &peer,
        ]);
        ok(&["link", "set", link, "up"]);
        ok(&["addr", "add", "169.254.1.1/32", "dev", link]);
        ok(&["route", "add", &format!("{addr}/32"), "dev", link]);
    }

    /// An echo server on `port` in `ns`: it says its address, then copies lines back.
    fn echo_server(&mut self, ns: &str, port: u16) {
        self.server(ns, port, "SYSTEM:echo $SOCAT_SOCKADDR; exec cat");
    }

    /// A server on `port` in `ns` that says its address and closes, so [`Hosts::ask`] returns
    /// at once (an echo server keeps the connection until the client's idle timeout).
    fn answer_server(&mut self, ns: &str, port: u16) {
        self.server(ns, port, "SYSTEM:echo $SOCAT_SOCKADDR");
    }

    /// socat serving `port` in `ns` with `answer` (a literal of the test) per connection.
    fn server(&mut self, ns: &str, port: u16, answer: &str) {
        let listen = format!("TCP-LISTEN:{port},fork,reuseaddr");
        let child = Command::new(IP)
            .args(["netns", "exec", ns, "socat", &listen, answer])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("start socat");
        self.children.push(child);
    }

    /// One connection from `ns` to `target`: the server's first line, if any.
    fn ask(&self, ns: &str, target: &str) -> Option<String> {
        let remote = format!("TCP:{target},connect-timeout=3");
        let out = run(
            IP,
            &[
                "netns", "exec", ns, "socat", "-T", "3", "-u", &remote, "STDOUT",
            ],
        );
        let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (out.status.success() && !text.is_empty()).then_some(text)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for ns in &self.namespaces {
            let _ = run(IP, &["netns", "del", ns]);
        }
    }
}

/// A connection held open from a namespace, through which lines are echoed.
struct Held {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: std::sync::mpsc::Receiver<String>,
}

impl Held {
    fn open(ns: &str, target: &str) -> Held {
        use std::io::BufRead as _;
        let remote = format!("TCP:{target},connect-timeout=3");
        let mut child = Command::new(IP)
            .args(["netns", "exec", ns, "socat", "-", &remote])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start socat client");
        let stdin = child.stdin.take().expect("stdin");
        let out = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let held = Held {
            child,
            stdin,
            lines,
        };
        assert!(held.line().is_some(), "the server answered {target}");
        held
    }

    fn line(&self) -> Option<String> {
        self.lines.recv_timeout(Duration::from_secs(10)).ok()
    }

    fn echoes(&mut self, text: &str) -> bool {
        use std::io::Write as _;
        if writeln!(self.stdin, "{text}").is_err() {
            return false;
        }
        self.line().as_deref() == Some(text)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pinned kube-proxy, `--proxy-mode=ipvs`, as admin (its RBAC is not what is tested).
fn start_kube_proxy(log: &str) -> common::RunningAgent {
    let kubeconfig = format!("--kubeconfig={DIR}/admin.kubeconfig");
    common::RunningAgent::spawn_program(
        UPSTREAM_KUBE_PROXY,
        &[
            "--proxy-mode=ipvs",
            &kubeconfig,
            "--hostname-override=node-1",
            "--cluster-cidr=10.244.0.0/16",
            // nf_conntrack_max is read-only in the test's network namespace.
            "--conntrack-max-per-core=0",
            "--healthz-bind-address=127.0.0.1:10266",
            "--metrics-bind-address=127.0.0.1:10269",
        ],
        std::path::PathBuf::from(log),
    )
}

/// A tool's standard output, without echoing it to the console (these are polled).
fn quiet(bin: &str, args: &[&str]) -> String {
    Command::new(bin)
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

/// Every backend's `iptables-save` of `table` (both families).
fn saved(table: &str) -> String {
    [
        "iptables-nft-save",
        "iptables-legacy-save",
        "ip6tables-nft-save",
    ]
    .iter()
    .map(|tool| quiet(tool, &["-t", table]))
    .collect()
}

fn ipsets() -> String {
    quiet("/usr/sbin/ipset", &["list", "-n"])
}

/// The migration from kube-proxy's IPVS mode and back, on real traffic: the pinned kube-proxy
/// serves a Service to a client namespace; it stops and kube-ipvs starts on the same node; a
/// connection opened through kube-proxy keeps echoing, new ones work, kube-proxy's chains and
/// ipsets are gone, and a Service created afterwards answers (kube-proxy's stale
/// `KUBE-IPVS-FILTER` would reject its new ClusterIP). Then the roll-back: kube-ipvs stops,
/// `kube-ipvs cleanup` runs, kube-proxy starts again and serves, and nothing of ours is left.
#[test]
fn kube_proxy_is_replaced_with_open_connections_kept_and_rolled_back_clean() {
    let cluster = Cluster::new("migrate");
    let mut hosts = Hosts::new();
    hosts.host("mg-client", "192.168.56.100", "mgh1");
    hosts.host("mg-pod", "10.244.1.70", "mgh2");
    hosts.echo_server("mg-pod", 8080);
    let web = cluster.create_service_with("web", 80, &[("10.244.1.70", true)]);
    let web_vip = format!("{web}:80");
    // A Node with an address, as a kubelet registers it (kube-proxy waits 30 s for one).
    let address = cluster.node_address("192.168.56.10");

    let proxy = start_kube_proxy("/tmp/kube-proxy-migrate-1.log");
    wait_for_table("kube-proxy to program web", |t| {
        t.get(&web_vip) == Some(&rs(&["10.244.1.70"]))
    });
    wait_for("kube-proxy's rules", Duration::from_secs(60), || {
        saved("nat").contains(":KUBE-SERVICES ") && ipsets().contains("KUBE-CLUSTER-IP")
    });
    wait_for("web through kube-proxy", Duration::from_secs(30), || {
        hosts.ask("mg-client", &web_vip).is_some()
    });
    let mut held = Held::open("mg-client", &web_vip);
    assert!(held.echoes("before the swap"));
    println!("--- kube-proxy ---\n{}", proxy.log());
    // Deleted like its pod: SIGTERM (kube-proxy leaves its rules in place).
    let _ = proxy.terminate();
    assert!(
        saved("filter").contains(":KUBE-IPVS-FILTER "),
        "kube-proxy leaves its rules behind"
    );

    let mut agent = Agent::start("migrate");
    wait_for("check to exit 0", Duration::from_secs(60), || {
        check_exit() == Some(0)
    });
    wait_for(
        "kube-proxy's leftovers to go",
        Duration::from_secs(60),
        || {
            let (nat, filter, sets) = (saved("nat"), saved("filter"), ipsets());
            !nat.contains(":KUBE-SERVICES ")
                && !nat.contains(":KUBE-MARK-MASQ ")
                && !filter.contains(":KUBE-IPVS-FILTER ")
                && !filter.contains(":KUBE-FORWARD ")
                && !sets
                    .lines()
                    .any(|s| s == "KUBE-CLUSTER-IP" || s == "KUBE-IPVS-IPS")
        },
    );
    agent.assert_running();
    assert!(
        held.echoes("after the swap"),
        "the open connection survives"
    );
    assert!(
        hosts.ask("mg-client", &web_vip).is_some(),
        "a new connection"
    );
    let api = cluster.create_service_with("api", 8443, &[("10.244.1.70", true)]);
    let api_vip = format!("{api}:8443");
    wait_for(
        "a Service created after the swap",
        Duration::from_secs(30),
        || hosts.ask("mg-client", &api_vip).is_some(),
    );
    drop(held);
    println!("--- kube-ipvs ---\n{}", agent.log());

    // Roll back.
    assert_eq!(agent.terminate(), Some(0));
    let out = run(&common::kube_ipvs_bin(), &["cleanup"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let proxy = start_kube_proxy("/tmp/kube-proxy-migrate-2.log");
    wait_for(
        "web through kube-proxy again",
        Duration::from_secs(60),
        || hosts.ask("mg-client", &web_vip).is_some(),
    );
    let ours = kube_ipvs_host::masquerade::all_sets().collect::<Vec<_>>();
    let sets = ipsets();
    for set in &ours {
        assert!(!sets.lines().any(|s| s == *set), "{set} left behind");
    }
    let rules = saved("nat") + &saved("filter") + &saved("mangle");
    for chain in [
        "KUBE-IPVS-POSTROUTING",
        "KUBE-IPVS-MASQ",
        "KUBE-IPVS-SERVICES",
        "KUBE-IPVS-INPUT",
        "KUBE-IPVS-FORWARD",
        "KUBE-IPVS-LOCAL-PODS",
    ] {
        assert!(!rules.contains(chain), "{chain} left behind");
    }
    assert!(
        !ipvsadm(&["-Ln"]).contains("FWM"),
        "no fwmark service of ours"
    );
    let _ = proxy.terminate();
    drop(address);
    drop(cluster);
}

/// On a CPU without AES instructions the agent's TLS offers ChaCha20-Poly1305 first, and the API
/// server (Go's crypto/tls) takes it; with them, AES-GCM stays first and the server picks an
/// AES-GCM suite (`kube_ipvs_watch::tls`). This guest's CPU, TCG's `qemu64`, has none, so a
/// vm-test run proves the first case, which the agent's cost of reading the API rests on under
/// emulation (every list page and watch event is decrypted in software). The handshake is made
/// here with the agent's provider as it is.
#[test]
fn the_api_server_takes_chacha20_from_the_agent_when_the_cpu_has_no_aes() {
    use rustls::CipherSuite;
    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, ServerName};

    let ports = common::apiserver::ports();
    let _forwards = common::apiserver::Forwards::start(&[ports.apiserver]);
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(format!("{DIR}/ca.crt")).expect("reading ca.crt") {
        roots
            .add(cert.expect("a certificate in ca.crt"))
            .expect("the test CA");
    }
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(kube_ipvs_watch::tls::provider()))
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
    let name = ServerName::try_from("127.0.0.1").expect("server name");
    let mut tls = rustls::ClientConnection::new(Arc::new(config), name).expect("TLS client");
    let mut sock =
        std::net::TcpStream::connect(("127.0.0.1", ports.apiserver)).expect("connect to the relay");
    while tls.is_handshaking() {
        tls.complete_io(&mut sock)
            .expect("TLS handshake with the API server");
    }
    let got = tls
        .negotiated_cipher_suite()
        .expect("a negotiated cipher suite")
        .suite();
    if kube_ipvs_watch::tls::aes_hardware() {
        assert!(
            matches!(
                got,
                CipherSuite::TLS13_AES_128_GCM_SHA256 | CipherSuite::TLS13_AES_256_GCM_SHA384
            ),
            "this CPU has AES instructions, yet the API server chose {got:?}"
        );
    } else {
        assert_eq!(
            got,
            CipherSuite::TLS13_CHACHA20_POLY1305_SHA256,
            "this CPU has no AES instructions, yet the API server chose {got:?}"
        );
    }
}
