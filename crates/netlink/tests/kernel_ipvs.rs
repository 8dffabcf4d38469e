#![cfg(feature = "kernel-tests")]
//! Programs the kernel through the crate and reads it back with the crate and with `ipvsadm -Ln` / `ipvsadm -S -n`;
//! checks every typed error, batching with failures in the middle, and recovery from a receive buffer overrun.

mod common;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;

use common::{
    cases, dest, expected_save, ip, ipvsadm, parse_list, parse_save, program, same_dest,
    same_service,
};
use kube_ipvs_netlink::Error;
use kube_ipvs_netlink::ipvs::{
    AckMode, Destination, Family, Flags, ForwardMethod, Ipvs, IpvsConfig, Request, Service,
    ServiceKey, Timeouts, cmd, flags,
};

fn ipvs() -> Ipvs {
    Ipvs::new().expect("open IPVS handle")
}

fn fwd_name(f: ForwardMethod) -> &'static str {
    match f {
        ForwardMethod::Masq => "Masq",
        ForwardMethod::Local => "Local",
        ForwardMethod::Tunnel => "Tunnel",
        _ => "Route",
    }
}

fn endpoint(a: &IpAddr, p: u16) -> String {
    match a {
        IpAddr::V4(a) => format!("{a}:{p}"),
        IpAddr::V6(a) => format!("[{a}]:{p}"),
    }
}

/// Checks the crate's table against `ipvsadm -S -n` and the destination columns of `ipvsadm -Ln`.
fn assert_matches_ipvsadm(table: &[(Service, Vec<Destination>)]) {
    let mut want: Vec<_> = table.iter().map(|(s, d)| expected_save(s, d)).collect();
    want.sort();
    assert_eq!(
        parse_save(&ipvsadm(&["-S", "-n"])),
        want,
        "ipvsadm -S -n disagrees with the crate"
    );

    let listed = parse_list(&ipvsadm(&["-Ln"]));
    assert_eq!(listed.len(), table.len(), "ipvsadm -Ln service count");
    let got: BTreeSet<(String, String, i64)> = listed.into_iter().flat_map(|(_, d)| d).collect();
    let want: BTreeSet<(String, String, i64)> = table
        .iter()
        .flat_map(|(_, ds)| ds.iter())
        .map(|d| {
            (
                endpoint(&d.addr, d.port),
                fwd_name(d.forward).to_owned(),
                i64::from(d.weight),
            )
        })
        .collect();
    assert_eq!(
        got, want,
        "ipvsadm -Ln destination columns disagree with the crate"
    );
}

#[test]
fn every_kind_reads_back_through_crate_and_ipvsadm() {
    let mut h = ipvs();
    let cases = cases();
    for (i, r) in h.apply(&program(&cases)).into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("request {i}: {e}"));
    }
    let table = h.table().expect("read table");
    assert_eq!(table.len(), cases.len());
    for c in &cases {
        let (s, ds) = table
            .iter()
            .find(|(s, _)| s.key == c.service.key)
            .unwrap_or_else(|| panic!("{} missing from the dump", c.service.key));
        same_service(s, &c.service);
        assert_eq!(ds.len(), c.dests.len(), "destinations of {}", c.name);
        for want in &c.dests {
            let got = ds
                .iter()
                .find(|d| d.addr == want.addr && d.port == want.port)
                .unwrap_or_else(|| panic!("{} of {} missing", want.addr, c.name));
            same_dest(got, want);
        }
        let single = h
            .service(&c.service.key)
            .expect("get service")
            .expect("service exists");
        assert_eq!(&single.key, &c.service.key);
    }
    assert_matches_ipvsadm(&table);
}

#[test]
fn updates_and_deletes_show_in_crate_and_ipvsadm() {
    let mut h = ipvs();
    let key = ServiceKey::tcp(ip("10.0.0.9"), 8080);
    let mut svc = Service::new(key, "rr");
    h.new_service(&svc).expect("add service");
    let dests: Vec<Destination> = (1..=3)
        .map(|i| dest(&format!("10.9.0.{i}"), 80, ForwardMethod::Masq, i))
        .collect();
    for d in &dests {
        h.new_dest(&key, d).expect("add destination");
    }

    let mut heavier = dests[1].clone();
    heavier.weight = 77;
    h.set_dest(&key, &heavier).expect("update weight");
    let ds = h.destinations(&key).expect("list");
    assert_eq!(
        ds.iter().find(|d| d.addr == heavier.addr).map(|d| d.weight),
        Some(77)
    );
    assert!(ipvsadm(&["-S", "-n"]).contains("-r 10.9.0.2:80 -m -w 77"));

    svc.scheduler = "sh".into();
    svc.flags = Flags::exactly(Flags::PERSISTENT | Flags::SCHED2);
    svc.timeout = 120;
    svc.netmask = kube_ipvs_netlink::ipvs::Netmask::V4(Ipv4Addr::new(255, 255, 0, 0));
    h.set_service(&svc).expect("update service");
    let got = h.service(&key).expect("get").expect("exists");
    same_service(&got, &svc);
    assert!(
        ipvsadm(&["-S", "-n"])
            .contains("-A -t 10.0.0.9:8080 -s sh -p 120 -M 255.255.0.0 -b sh-port")
    );

    h.del_dest(&key, dests[0].addr, 80)
        .expect("delete destination");
    let table = h.table().expect("table");
    assert_eq!(table[0].1.len(), 2);
    assert_matches_ipvsadm(&table);

    h.zero(Some(&key)).expect("zero one service");
    h.zero(None).expect("zero all");
    h.del_service(&key).expect("delete service");
    assert!(h.services().expect("list").is_empty());
    assert_eq!(ipvsadm(&["-S", "-n"]), "");

    h.apply(&program(&cases()))
        .into_iter()
        .for_each(|r| r.expect("program cases"));
    assert!(!h.services().expect("list").is_empty());
    h.flush().expect("flush");
    assert!(h.services().expect("list").is_empty());
    assert_eq!(ipvsadm(&["-S", "-n"]), "");
}

#[test]
fn each_kernel_error_is_typed_and_names_the_operation() {
    let mut h = ipvs();
    let key = ServiceKey::tcp(ip("10.96.0.1"), 80);
    let svc = Service::new(key, "rr");
    h.new_service(&svc).expect("add service");

    let e = h.new_service(&svc).expect_err("duplicate service");
    assert!(
        matches!(
            e,
            Error::Exists {
                object: "service",
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "add service TCP 10.96.0.1:80: service already exists"
    );

    let d = dest("10.1.0.1", 80, ForwardMethod::Masq, 1);
    h.new_dest(&key, &d).expect("add destination");
    let e = h.new_dest(&key, &d).expect_err("duplicate destination");
    assert!(
        matches!(
            e,
            Error::Exists {
                object: "destination",
                ..
            }
        ),
        "{e:?}"
    );
    assert!(
        e.to_string()
            .starts_with("add destination 10.1.0.1:80 to service TCP 10.96.0.1:80"),
        "{e}"
    );

    let missing = ServiceKey::udp(ip("10.96.0.2"), 53);
    let e = h
        .set_service(&Service::new(missing, "rr"))
        .expect_err("update missing service");
    assert!(matches!(e, Error::NoSuchService { .. }), "{e:?}");
    let e = h.del_service(&missing).expect_err("delete missing service");
    assert!(matches!(e, Error::NoSuchService { .. }), "{e:?}");
    let e = h
        .new_dest(&missing, &d)
        .expect_err("destination of missing service");
    assert!(matches!(e, Error::NoSuchService { .. }), "{e:?}");
    let e = h.zero(Some(&missing)).expect_err("zero missing service");
    assert!(matches!(e, Error::NoSuchService { .. }), "{e:?}");
    assert_eq!(h.service(&missing).expect("get missing"), None);
    assert!(
        h.destinations(&missing)
            .expect("dump of a missing service is empty")
            .is_empty()
    );

    let other = dest("10.1.0.2", 80, ForwardMethod::Masq, 1);
    let e = h
        .set_dest(&key, &other)
        .expect_err("update missing destination");
    assert!(matches!(e, Error::NoSuchDestination { .. }), "{e:?}");
    let e = h
        .del_dest(&key, other.addr, 80)
        .expect_err("delete missing destination");
    assert!(matches!(e, Error::NoSuchDestination { .. }), "{e:?}");
    assert_eq!(
        e.to_string(),
        "delete destination 10.1.0.2:80 from service TCP 10.96.0.1:80: no such destination"
    );

    let e = h
        .new_service(&Service::new(
            ServiceKey::tcp(ip("10.96.0.3"), 80),
            "nosuchsched",
        ))
        .expect_err("unknown scheduler");
    assert!(matches!(e, Error::UnknownScheduler { .. }), "{e:?}");

    let config = IpvsConfig {
        family_name: "IPVS_ABSENT",
        ..IpvsConfig::default()
    };
    let e = Ipvs::with_config(config).err().expect("absent family");
    assert!(matches!(e, Error::ModuleMissing), "{e:?}");
    assert_eq!(
        e.to_string(),
        "ip_vs not loaded: the generic netlink family IPVS is unknown to this kernel"
    );

    let mut bad = dest("10.1.0.3", 80, ForwardMethod::Masq, 1);
    bad.lower_threshold = 5;
    let e = h
        .new_dest(&key, &bad)
        .expect_err("lower above upper threshold");
    assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
    let e = h
        .new_service(&Service::new(
            ServiceKey::tcp(ip("10.96.0.4"), 80),
            "a-scheduler-name-too-long",
        ))
        .expect_err("long scheduler name");
    assert!(matches!(e, Error::Invalid { .. }), "{e:?}");
    // Validation happens before sending: nothing of the above reached the table.
    assert_eq!(h.services().expect("list").len(), 1);
}

/// Runs this test binary's `permission_child` in a new user namespace, where the process has no CAP_NET_ADMIN
/// over the test's network namespace.
#[test]
fn permission_denied_without_cap_net_admin() {
    let exe = std::env::current_exe().expect("own path");
    let out = Command::new("unshare")
        .arg("-U")
        .arg("--")
        .arg(&exe)
        .args([
            "--exact",
            "permission_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("KUBE_IPVS_PERMISSION_CHILD", "1")
        .output()
        .expect("spawn unshare");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed");
    assert!(
        stdout.contains("PERMISSION-CHECKED"),
        "child did not run its check"
    );
}

/// Helper for `permission_denied_without_cap_net_admin`; does nothing unless started by it.
#[test]
fn permission_child() {
    if std::env::var_os("KUBE_IPVS_PERMISSION_CHILD").is_none() {
        return;
    }
    let mut h = ipvs();
    let e = h
        .new_service(&Service::new(ServiceKey::tcp(ip("10.96.0.1"), 80), "rr"))
        .expect_err("adding a service without CAP_NET_ADMIN");
    assert!(matches!(e, Error::Permission { .. }), "{e:?}");
    let e = h.services().expect_err("listing without CAP_NET_ADMIN");
    assert!(matches!(e, Error::Permission { .. }), "{e:?}");
    println!("PERMISSION-CHECKED {e}");
}

/// 1,100 good requests with five bad ones spread through them: every good one is applied, and exactly the bad
/// ones are reported, each with its own error.
fn batch_with_failures(mode: AckMode) {
    let mut h = Ipvs::with_config(IpvsConfig {
        ack_mode: mode,
        ..IpvsConfig::default()
    })
    .expect("open");
    let mut reqs = Vec::new();
    let mut want = Vec::new();
    for s in 0..100u32 {
        let key = ServiceKey::tcp(IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + s)), 80);
        let svc = Service::new(key, "wrr");
        reqs.push(Request::NewService(svc.clone()));
        let mut ds = Vec::new();
        for d in 0..10u32 {
            let dst = dest(
                &Ipv4Addr::from(0x0a01_0000 + s * 16 + d).to_string(),
                8080,
                ForwardMethod::Masq,
                d + 1,
            );
            reqs.push(Request::NewDest {
                service: key,
                dest: dst.clone(),
            });
            ds.push(dst);
        }
        want.push((svc, ds));
    }
    let first = want[0].0.clone();
    let mut bad: Vec<(usize, Request)> = vec![
        (150, Request::NewService(first.clone())),
        (
            400,
            Request::NewDest {
                service: ServiceKey::tcp(ip("10.200.0.1"), 80),
                dest: want[0].1[0].clone(),
            },
        ),
        (
            600,
            Request::NewService(Service::new(ServiceKey::tcp(ip("10.200.0.2"), 80), "bogus")),
        ),
        (
            800,
            Request::DelDest {
                service: first.key,
                addr: ip("10.250.0.1"),
                port: 1,
            },
        ),
        (
            1000,
            Request::NewService(Service::new(ServiceKey::tcp(ip("10.200.0.3"), 0), "rr")),
        ),
    ];
    for (at, r) in bad.iter().cloned() {
        reqs.insert(at, r);
    }
    let results = h.apply(&reqs);
    assert_eq!(results.len(), 1105);
    let failed: Vec<usize> = results
        .iter()
        .enumerate()
        .filter(|(_, r)| r.is_err())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(
        failed,
        bad.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
        "{:?}",
        failed.iter().map(|&i| &results[i]).collect::<Vec<_>>()
    );
    assert!(
        matches!(results[150], Err(Error::Exists { .. })),
        "{:?}",
        results[150]
    );
    assert!(
        matches!(results[400], Err(Error::NoSuchService { .. })),
        "{:?}",
        results[400]
    );
    assert!(
        matches!(results[600], Err(Error::UnknownScheduler { .. })),
        "{:?}",
        results[600]
    );
    assert!(
        matches!(results[800], Err(Error::NoSuchDestination { .. })),
        "{:?}",
        results[800]
    );
    assert!(
        matches!(results[1000], Err(Error::Invalid { .. })),
        "{:?}",
        results[1000]
    );
    bad.clear();

    let mut table = h.table().expect("table");
    table.sort_by_key(|a| a.0.key);
    assert_eq!(table.len(), 100);
    for ((s, ds), (ws, wds)) in table.iter().zip(&want) {
        same_service(s, ws);
        let got: BTreeSet<_> = ds.iter().map(|d| (d.addr, d.weight)).collect();
        let exp: BTreeSet<_> = wds.iter().map(|d| (d.addr, d.weight)).collect();
        assert_eq!(got, exp, "destinations of {}", s.key);
    }
    assert_matches_ipvsadm(&table);
    println!(
        "batch stats ({mode:?}): {:?}, limits {:?}",
        h.batch_stats(),
        h.batch_limits()
    );
}

#[test]
fn batch_applies_good_and_reports_exactly_the_bad_every_ack() {
    batch_with_failures(AckMode::Every);
}

#[test]
fn batch_applies_good_and_reports_exactly_the_bad_errors_only() {
    batch_with_failures(AckMode::ErrorsOnly);
}

/// With a receive buffer far too small for the batch, acknowledgements are dropped (ENOBUFS). Every request the
/// crate reports as done must really be in the kernel, and the others must be reported as lost, not as done.
#[test]
fn receive_buffer_overrun_reports_lost_acks() {
    let rcvbuf = 32 * 1024;
    let mut h = Ipvs::with_config(IpvsConfig {
        rcvbuf,
        ack_cost: 1,
        // Every request acknowledged, so the acknowledgements overflow the tiny buffer.
        ack_mode: AckMode::Every,
        ..IpvsConfig::default()
    })
    .expect("open");
    let n = 2000u32;
    let reqs: Vec<Request> = (1..=n)
        .map(|m| {
            Request::NewService(Service::new(
                ServiceKey::Fwmark {
                    family: Family::Inet,
                    mark: m,
                },
                "rr",
            ))
        })
        .collect();
    let results = h.apply(&reqs);
    let ok: Vec<u32> = (1..=n)
        .filter(|m| results[(m - 1) as usize].is_ok())
        .collect();
    let lost = results
        .iter()
        .filter(|r| matches!(r, Err(Error::AckLost { .. })))
        .count();
    assert_eq!(
        ok.len() + lost,
        n as usize,
        "only successes and lost acknowledgements are possible here"
    );
    let stats = h.batch_stats();
    assert!(
        stats.overruns > 0 && lost > 0,
        "the tiny buffer must overflow: {stats:?}"
    );
    let present: BTreeSet<ServiceKey> = h
        .services()
        .expect("list")
        .into_iter()
        .map(|s| s.key)
        .collect();
    for m in &ok {
        assert!(
            present.contains(&ServiceKey::Fwmark {
                family: Family::Inet,
                mark: *m
            }),
            "fwmark {m} reported done"
        );
    }
    // NEW_SERVICE on fresh marks cannot fail, so the kernel applied all of them, acknowledged or not.
    assert_eq!(present.len(), n as usize);
    let granted = h.socket_buffers().0;
    println!(
        "MEASURE ack_cost: {} acks fit in a {}-byte (doubled) receive buffer = {} bytes per ack; stats {stats:?}",
        ok.len(),
        granted,
        granted / ok.len().max(1)
    );
}

#[test]
fn info_timeouts_and_probes() {
    let mut h = ipvs();
    let info = h.info().expect("info");
    let (a, b, c) = info.version_triplet();
    let header = format!(
        "IP Virtual Server version {a}.{b}.{c} (size={})",
        info.conn_tab_size
    );
    assert_eq!(ipvsadm(&["-Ln"]).lines().next(), Some(header.as_str()));

    h.set_timeouts(Timeouts {
        tcp: 901,
        tcp_fin: 121,
        udp: 301,
    })
    .expect("set timeouts");
    h.set_timeouts(Timeouts {
        tcp: 0,
        tcp_fin: 0,
        udp: 302,
    })
    .expect("set udp only");
    let t = h.timeouts().expect("get timeouts");
    assert_eq!(
        t,
        Timeouts {
            tcp: 901,
            tcp_fin: 121,
            udp: 302
        }
    );
    assert_eq!(
        ipvsadm(&["-Ln", "--timeout"]).trim(),
        "Timeout (tcp tcpfin udp): 901 121 302"
    );

    // The specification leaves these unverified; this is where they are checked.
    let key = ServiceKey::tcp(ip("10.0.0.1"), 80);
    let errno = h
        .probe_command(cmd::GET_DEST, flags::REQUEST | flags::ACK, Some(&key))
        .expect("probe");
    println!("MEASURE GET_DEST without NLM_F_DUMP answers errno {errno}");
    assert_eq!(errno, EOPNOTSUPP);
    let errno = h
        .probe_command(cmd::GET_DEST, flags::REQUEST | flags::DUMP, Some(&key))
        .expect("probe");
    assert_eq!(
        errno, 0,
        "a destination dump of a missing service ends cleanly"
    );
    let errno = h
        .probe_command(cmd::GET_SERVICE, flags::REQUEST | flags::ACK, Some(&key))
        .expect("probe");
    assert_eq!(errno, 3, "GET_SERVICE doit of a missing service is ESRCH");
}

const EOPNOTSUPP: i32 = 95;

/// The SIP persistence engine is a separate module; when the kernel has it, pe_name must round-trip through the
/// crate and ipvsadm, and when it does not, the error must be the typed one.
#[test]
fn persistence_engine_round_trips_or_is_reported_unknown() {
    let mut h = ipvs();
    let key = ServiceKey::udp(ip("10.0.0.5"), 5060);
    let mut svc = Service::new(key, "rr");
    svc.flags = Flags::exactly(Flags::PERSISTENT);
    svc.timeout = 30;
    svc.pe_name = Some("sip".into());
    match h.new_service(&svc) {
        Ok(()) => {
            let got = h.service(&key).expect("get").expect("exists");
            assert_eq!(got.pe_name.as_deref(), Some("sip"));
            assert!(ipvsadm(&["-S", "-n"]).contains("--pe sip"));
            println!("MEASURE pe sip: available");
        }
        Err(Error::UnknownScheduler { .. }) => {
            assert!(h.services().expect("list").is_empty());
            println!("MEASURE pe sip: not available in this kernel");
        }
        Err(e) => panic!("unexpected error {e:?}"),
    }
}

/// A table with services whose destinations need several dump batches reads back the same through `table` as
/// through one dump per service, in dump order.
#[test]
fn table_equals_one_dump_per_service() {
    let mut h = ipvs();
    let mut reqs = Vec::new();
    for s in 0..600u32 {
        let key = ServiceKey::tcp(IpAddr::V4(Ipv4Addr::from(0x0a60_0000 + s)), 80);
        reqs.push(Request::NewService(Service::new(key, "rr")));
        // A few services get 300 destinations (more than one dump batch); the rest get 0 to 4.
        let n = if s % 100 == 7 { 300 } else { s % 5 };
        for d in 0..n {
            let addr = IpAddr::V4(Ipv4Addr::from(0x0b00_0000 + s * 1024 + d));
            reqs.push(Request::NewDest {
                service: key,
                dest: dest(&addr.to_string(), 80, ForwardMethod::Route, 1),
            });
        }
    }
    assert!(h.apply(&reqs).iter().all(Result::is_ok));
    let services = h.services().expect("services");
    let table = h.table().expect("table");
    assert_eq!(
        table.iter().map(|(s, _)| s.key).collect::<Vec<_>>(),
        services.iter().map(|s| s.key).collect::<Vec<_>>()
    );
    let mut total = 0;
    for (s, ds) in &table {
        assert_eq!(
            ds,
            &h.destinations(&s.key).expect("single dump"),
            "destinations of {}",
            s.key
        );
        total += ds.len();
    }
    assert_eq!(total, reqs.len() - 600);
}
