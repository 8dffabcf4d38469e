//! What a kube-proxy in nftables or iptables mode programmed, read back for the end-to-end
//! bench (`examples/e2e-bench.rs`): for each ClusterIP and port, the endpoints a new
//! connection can be sent to. The IPVS agents are read through `kube-ipvs-netlink`; these two
//! modes keep their Services in rules, so they are read with the tools that print them
//! (`nft`, `iptables-save`, `iptables -S`), whole for convergence and one Service's chain at a
//! time for an update.
//!
//! The shapes parsed are those kube-proxy v1.37 writes (`pkg/proxy/nftables` and
//! `pkg/proxy/iptables`):
//!
//! * nftables, table `ip kube-proxy`: the verdict map `service-ips` holds
//!   `CLUSTER-IP . tcp . PORT : goto service-HASH-ns/name/tcp/port`, and that chain picks an
//!   endpoint with `dnat to numgen random mod N map { 0 : IP . PORT, ... }`, `dnat to IP:PORT`
//!   for a single endpoint, or (with session affinity) `goto endpoint-HASH-...__IP/PORT`;
//! * iptables, table `nat`: `-A KUBE-SERVICES -d CLUSTER-IP/32 ... --dport PORT -j KUBE-SVC-X`,
//!   `-A KUBE-SVC-X ... -j KUBE-SEP-Y` per endpoint, and `-A KUBE-SEP-Y ... -j DNAT
//!   --to-destination IP:PORT` (comments are left out above 1,000 endpoints, so the endpoint
//!   chains are followed rather than the comments read).

use std::collections::{BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::Command;
use std::time::{Duration, Instant};

/// The endpoints a Service's new connections can reach.
pub type Backends = BTreeSet<SocketAddrV4>;

/// Which kube-proxy mode's rules to read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Nftables,
    Iptables,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("running {command}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("{command} exited with {status}: {stderr}")]
    Failed {
        command: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
    /// The program had not returned by the reader's deadline: `nft` waits behind the
    /// transaction kube-proxy is committing, which at 50,000 Services ran for more than 15
    /// minutes. The program is left running (blocked in the kernel, it cannot be killed).
    #[error("{command} had not returned after {:.0} s (it waits behind the agent's transaction)", waited.as_secs_f64())]
    TimedOut { command: String, waited: Duration },
}

/// The least a read is waited for, even past the deadline: a read that returns a moment late
/// is still an answer.
const LEAST_WAIT: Duration = Duration::from_secs(5);

const NFT: &str = "/usr/sbin/nft";
const IPTABLES: &str = "/usr/sbin/iptables";
const IPTABLES_SAVE: &str = "/usr/sbin/iptables-save";
const NFT_TABLE: [&str; 2] = ["ip", "kube-proxy"];

/// Runs `program`, waiting for it at most `wait` (`None`: as long as it takes).
fn run(program: &str, args: &[&str], wait: Option<Duration>) -> Result<String, ReadError> {
    let command = format!("{program} {}", args.join(" "));
    let mut cmd = Command::new(program);
    cmd.args(args);
    let out = match wait {
        None => cmd.output(),
        Some(waited) => {
            // On its own thread, so the wait can end: a read given up leaves it there.
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(cmd.output());
            });
            rx.recv_timeout(waited).map_err(|_| ReadError::TimedOut {
                command: command.clone(),
                waited,
            })?
        }
    }
    .map_err(|source| ReadError::Spawn {
        command: command.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(ReadError::Failed {
            command,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Reads one kube-proxy's rules. Remembers each Service's chain from the last whole read, so
/// an update is checked by listing that chain alone.
pub struct Reader {
    mode: Mode,
    /// ClusterIP:port -> the chain it is sent to.
    chains: HashMap<SocketAddrV4, String>,
    /// iptables: endpoint chain -> its DNAT target (the name is a hash of the endpoint, so
    /// it never changes meaning).
    endpoint_chains: HashMap<String, Option<SocketAddrV4>>,
    /// When a read is given up ([`ReadError::TimedOut`]); `None`: never.
    deadline: Option<Instant>,
}

impl Reader {
    pub fn new(mode: Mode) -> Reader {
        Reader {
            mode,
            chains: HashMap::new(),
            endpoint_chains: HashMap::new(),
            deadline: None,
        }
    }

    /// Every read from now on is given up at `deadline` (`None`: waited for however long).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.deadline = deadline;
    }

    /// How long the next read may take: until the deadline, but at least [`LEAST_WAIT`].
    fn wait(&self) -> Option<Duration> {
        self.deadline
            .map(|d| d.saturating_duration_since(Instant::now()).max(LEAST_WAIT))
    }

    /// Every Service's backends, from one whole read of the mode's table (empty before the
    /// agent created it).
    pub fn snapshot(&mut self) -> Result<HashMap<SocketAddrV4, Backends>, ReadError> {
        let parsed = match self.mode {
            Mode::Nftables => {
                let mut args = vec!["list", "table"];
                args.extend(NFT_TABLE);
                match run(NFT, &args, self.wait()) {
                    Ok(text) => parse_nft_table(&text),
                    // No table yet.
                    Err(ReadError::Failed { .. }) => Parsed::default(),
                    Err(e) => return Err(e),
                }
            }
            Mode::Iptables => {
                parse_iptables_save(&run(IPTABLES_SAVE, &["-t", "nat"], self.wait())?)
            }
        };
        self.chains = parsed.chains;
        self.endpoint_chains.extend(parsed.endpoints);
        Ok(parsed.services)
    }

    /// One Service's backends, listing only its chain (known from an earlier
    /// [`snapshot`](Self::snapshot); `None` if it was not there then).
    pub fn service(&mut self, vip: SocketAddrV4) -> Result<Option<Backends>, ReadError> {
        let Some(chain) = self.chains.get(&vip).cloned() else {
            return Ok(None);
        };
        match self.mode {
            Mode::Nftables => {
                let mut args = vec!["list", "chain"];
                args.extend(NFT_TABLE);
                args.push(&chain);
                let text = run(NFT, &args, self.wait())?;
                Ok(Some(chain_backends(&tokens(&text))))
            }
            Mode::Iptables => {
                let text = run(IPTABLES, &["-t", "nat", "-S", &chain], self.wait())?;
                let mut out = Backends::new();
                for sep in iptables_jumps(&text, &chain) {
                    if !self.endpoint_chains.contains_key(&sep) {
                        let body = run(IPTABLES, &["-t", "nat", "-S", &sep], self.wait())?;
                        let target = iptables_dnat(&body, &sep);
                        self.endpoint_chains.insert(sep.clone(), target);
                    }
                    if let Some(Some(addr)) = self.endpoint_chains.get(&sep) {
                        out.insert(*addr);
                    }
                }
                Ok(Some(out))
            }
        }
    }
}

/// What one whole read found.
#[derive(Debug, Default, PartialEq)]
struct Parsed {
    services: HashMap<SocketAddrV4, Backends>,
    chains: HashMap<SocketAddrV4, String>,
    /// iptables only: endpoint chain -> DNAT target.
    endpoints: HashMap<String, Option<SocketAddrV4>>,
}

/// Whitespace-separated words with the punctuation nft puts around them removed.
fn tokens(text: &str) -> Vec<&str> {
    text.split(|c: char| c.is_whitespace() || c == ',' || c == '{' || c == '}' || c == ';')
        .map(|t| t.trim_matches('"'))
        .filter(|t| !t.is_empty())
        .collect()
}

/// The endpoints an nft chain's rules send to (see the module docs for the three shapes).
fn chain_backends(words: &[&str]) -> Backends {
    let mut out = Backends::new();
    for (i, w) in words.iter().enumerate() {
        // `dnat to 10.244.0.5:8080` (one endpoint).
        if i > 0
            && words[i - 1] == "to"
            && let Ok(addr) = w.parse::<SocketAddrV4>()
        {
            out.insert(addr);
            continue;
        }
        // `N : 10.244.0.5 . 8080` in the numgen map.
        if i >= 1
            && words[i - 1] == ":"
            && words.get(i + 1) == Some(&".")
            && let (Ok(ip), Some(Ok(port))) = (
                w.parse::<Ipv4Addr>(),
                words.get(i + 2).map(|p| p.parse::<u16>()),
            )
        {
            out.insert(SocketAddrV4::new(ip, port));
            continue;
        }
        // `goto endpoint-HASH-ns/name/tcp/port__10.244.0.5/8080` (session affinity).
        if w.starts_with("endpoint-")
            && let Some((_, ep)) = w.rsplit_once("__")
            && let Some((ip, port)) = ep.split_once('/')
            && let (Ok(ip), Ok(port)) = (ip.parse::<Ipv4Addr>(), port.parse::<u16>())
        {
            out.insert(SocketAddrV4::new(ip, port));
        }
    }
    out
}

/// `nft list table ip kube-proxy`: the `service-ips` elements and each chain's endpoints.
fn parse_nft_table(text: &str) -> Parsed {
    // Chain bodies: from `chain NAME {` to the brace closing it. Braces are counted, since nft
    // wraps a long anonymous map over several lines and closes it on a line of its own.
    let mut bodies: HashMap<&str, Vec<&str>> = HashMap::new();
    let mut current: Option<(&str, i64)> = None;
    for line in text.lines() {
        let t = line.trim();
        let opens = line.matches('{').count() as i64;
        let closes = line.matches('}').count() as i64;
        match current {
            None => {
                if let Some(rest) = t.strip_prefix("chain ") {
                    let name = rest.trim_end_matches('{').trim().trim_matches('"');
                    bodies.entry(name).or_default();
                    current = Some((name, opens - closes));
                }
            }
            Some((chain, depth)) => {
                let depth = depth + opens - closes;
                if depth <= 0 {
                    current = None;
                } else {
                    bodies.entry(chain).or_default().push(line);
                    current = Some((chain, depth));
                }
            }
        }
    }
    // `10.96.0.5 . tcp . 80 : goto CHAIN` anywhere (the map's elements).
    let words = tokens(text);
    let mut parsed = Parsed::default();
    for w in words.windows(8) {
        if let [ip, ".", "tcp", ".", port, ":", "goto" | "jump", chain] = *w
            && let (Ok(ip), Ok(port)) = (ip.parse::<Ipv4Addr>(), port.parse::<u16>())
            && chain.starts_with("service-")
        {
            let vip = SocketAddrV4::new(ip, port);
            let body = bodies
                .get(chain)
                .map(|lines| chain_backends(&tokens(&lines.join("\n"))))
                .unwrap_or_default();
            parsed.services.insert(vip, body);
            parsed.chains.insert(vip, (*chain).to_owned());
        }
    }
    parsed
}

/// The words of an `iptables -S`/`iptables-save` rule line (`-A CHAIN ...`), quotes kept
/// together as one word.
fn rule_words(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = line.trim();
    while !rest.is_empty() {
        if let Some(quoted) = rest.strip_prefix('"') {
            let end = quoted.find('"').unwrap_or(quoted.len());
            out.push(&quoted[..end]);
            rest = quoted.get(end + 1..).unwrap_or("").trim_start();
        } else {
            let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
            out.push(&rest[..end]);
            rest = rest[end..].trim_start();
        }
    }
    out
}

/// The value after `flag` in a rule's words.
fn after<'a>(words: &[&'a str], flag: &str) -> Option<&'a str> {
    words
        .iter()
        .position(|w| *w == flag)
        .and_then(|i| words.get(i + 1).copied())
}

/// The `KUBE-SEP-` chains `chain` jumps to.
fn iptables_jumps(text: &str, chain: &str) -> Vec<String> {
    text.lines()
        .map(rule_words)
        .filter(|w| w.len() > 2 && w[0] == "-A" && w[1] == chain)
        .filter_map(|w| after(&w, "-j").filter(|j| j.starts_with("KUBE-SEP-")))
        .map(str::to_owned)
        .collect()
}

/// The DNAT target of the endpoint chain `chain`.
fn iptables_dnat(text: &str, chain: &str) -> Option<SocketAddrV4> {
    text.lines()
        .map(rule_words)
        .filter(|w| w.len() > 2 && w[0] == "-A" && w[1] == chain)
        .find_map(|w| after(&w, "--to-destination").and_then(|d| d.parse().ok()))
}

/// `iptables-save -t nat`: ClusterIP rules in `KUBE-SERVICES`, their `KUBE-SVC-` chains and
/// the endpoint chains' DNAT targets.
fn parse_iptables_save(text: &str) -> Parsed {
    let mut parsed = Parsed::default();
    let mut jumps: HashMap<&str, Vec<&str>> = HashMap::new();
    for line in text.lines() {
        let w = rule_words(line);
        if w.len() < 3 || w[0] != "-A" {
            continue;
        }
        let chain = w[1];
        let target = after(&w, "-j");
        if chain == "KUBE-SERVICES"
            && let Some(svc) = target.filter(|t| t.starts_with("KUBE-SVC-"))
            && let Some(Ok(ip)) = after(&w, "-d").map(|d| d.trim_end_matches("/32").parse())
            && let Some(Ok(port)) = after(&w, "--dport").map(str::parse::<u16>)
        {
            parsed
                .chains
                .insert(SocketAddrV4::new(ip, port), svc.to_owned());
        } else if chain.starts_with("KUBE-SVC-")
            && let Some(sep) = target.filter(|t| t.starts_with("KUBE-SEP-"))
        {
            jumps.entry(chain).or_default().push(sep);
        } else if chain.starts_with("KUBE-SEP-") && target == Some("DNAT") {
            let to = after(&w, "--to-destination").and_then(|d| d.parse().ok());
            parsed.endpoints.insert(chain.to_owned(), to);
        }
    }
    for (vip, svc) in &parsed.chains {
        let backends = jumps
            .get(svc.as_str())
            .into_iter()
            .flatten()
            .filter_map(|sep| parsed.endpoints.get(*sep).copied().flatten())
            .collect();
        parsed.services.insert(*vip, backends);
    }
    parsed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_that_does_not_return_in_its_wait_is_given_up_and_one_that_does_is_read() {
        let started = Instant::now();
        let err = run("/bin/sleep", &["5"], Some(Duration::from_millis(200))).unwrap_err();
        assert!(
            matches!(&err, ReadError::TimedOut { command, .. } if command == "/bin/sleep 5"),
            "{err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "waited for the program"
        );
        let out = run("/bin/echo", &["ready"], Some(Duration::from_secs(30)));
        assert_eq!(out.ok().as_deref(), Some("ready\n"));
        assert!(matches!(
            run("/bin/false", &[], Some(Duration::from_secs(30))),
            Err(ReadError::Failed { .. })
        ));
    }

    fn addr(s: &str) -> SocketAddrV4 {
        s.parse().expect("test address")
    }

    fn set(addrs: &[&str]) -> Backends {
        addrs.iter().map(|a| addr(a)).collect()
    }

    /// As `nft list table ip kube-proxy` prints kube-proxy's table (abridged: the chains that
    /// matter here, one Service with two endpoints, one with one, one with affinity, one whose map
    /// nft wrapped).
    const NFT_TABLE_TEXT: &str = r#"table ip kube-proxy {
	comment "rules for kube-proxy"
	map service-ips {
		type ipv4_addr . inet_proto . inet_service : verdict
		comment "ClusterIP, ExternalIP and LoadBalancer IP traffic"
		elements = { 10.96.0.5 . tcp . 80 : goto service-AAAAAAAA-bench/svc-00000/tcp/http,
			     10.96.0.6 . tcp . 80 : goto service-BBBBBBBB-bench/svc-00001/tcp/http,
			     10.96.0.7 . tcp . 80 : goto service-CCCCCCCC-bench/svc-00002/tcp/http,
			     10.96.0.8 . tcp . 80 : goto service-EEEEEEEE-bench/svc-00003/tcp/http }
	}

	chain services {
		ip daddr . meta l4proto . th dport vmap @service-ips
	}

	chain service-AAAAAAAA-bench/svc-00000/tcp/http {
		ip daddr 10.96.0.5 tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade
		meta l4proto tcp dnat to numgen random mod 2 map { 0 : 10.244.0.1 . 8080, 1 : 10.244.0.2 . 8080 }
	}

	chain service-BBBBBBBB-bench/svc-00001/tcp/http {
		meta l4proto tcp dnat to 10.244.0.11:8080
	}

	chain service-EEEEEEEE-bench/svc-00003/tcp/http {
		meta l4proto tcp dnat to numgen random mod 3 map { 0 : 10.244.123.201 . 8080, 1 : 10.244.123.202 . 8080,
								   2 : 10.244.123.203 . 8080
		}
		counter packets 0 bytes 0
	}

	chain service-CCCCCCCC-bench/svc-00002/tcp/http {
		ip saddr @affinity-DDDDDDDD-bench/svc-00002/tcp/http__10.244.0.21/8080 goto endpoint-DDDDDDDD-bench/svc-00002/tcp/http__10.244.0.21/8080
		numgen random mod 1 vmap { 0 : goto endpoint-DDDDDDDD-bench/svc-00002/tcp/http__10.244.0.21/8080 }
	}

	chain endpoint-DDDDDDDD-bench/svc-00002/tcp/http__10.244.0.21/8080 {
		ip saddr 10.244.0.21 jump mark-for-masquerade
		meta l4proto tcp dnat to 10.244.0.21:8080
	}
}
"#;

    #[test]
    fn nft_services_map_to_their_chains_endpoints() {
        let p = parse_nft_table(NFT_TABLE_TEXT);
        assert_eq!(p.services.len(), 4);
        assert_eq!(
            p.services[&addr("10.96.0.5:80")],
            set(&["10.244.0.1:8080", "10.244.0.2:8080"])
        );
        assert_eq!(
            p.services[&addr("10.96.0.6:80")],
            set(&["10.244.0.11:8080"])
        );
        assert_eq!(
            p.services[&addr("10.96.0.7:80")],
            set(&["10.244.0.21:8080"])
        );
        assert_eq!(
            p.chains[&addr("10.96.0.6:80")],
            "service-BBBBBBBB-bench/svc-00001/tcp/http"
        );
        // The masquerade rule's source range is not an endpoint.
        assert!(
            !p.services
                .values()
                .flatten()
                .any(|a| a.ip().octets()[3] == 0)
        );
    }

    #[test]
    fn an_nft_chain_listed_alone_gives_its_endpoints() {
        let text = "table ip kube-proxy {\n\tchain service-AAAAAAAA-bench/svc-00000/tcp/http {\n\t\tmeta l4proto tcp dnat to numgen random mod 3 map { 0 : 10.244.0.1 . 8080, 1 : 10.244.0.2 . 8080, 2 : 10.244.250.7 . 8080 }\n\t}\n}\n";
        assert_eq!(
            chain_backends(&tokens(text)),
            set(&["10.244.0.1:8080", "10.244.0.2:8080", "10.244.250.7:8080"])
        );
        assert!(parse_nft_table("").services.is_empty());
    }

    /// As `iptables-save -t nat` prints kube-proxy's rules in large-cluster mode (no
    /// comments), abridged.
    const IPTABLES_SAVE_TEXT: &str = r#"# Generated by iptables-nft-save v1.8.9 (nf_tables)
*nat
:KUBE-SERVICES - [0:0]
:KUBE-SVC-AAAAAAAAAAAAAAAA - [0:0]
:KUBE-SEP-1111111111111111 - [0:0]
:KUBE-SEP-2222222222222222 - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A KUBE-SERVICES -d 10.96.0.5/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-AAAAAAAAAAAAAAAA
-A KUBE-SERVICES -d 10.96.0.6/32 -p tcp -m comment --comment "bench/svc-00001:http cluster IP" -m tcp --dport 80 -j KUBE-SVC-BBBBBBBBBBBBBBBB
-A KUBE-SERVICES -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS
-A KUBE-SVC-AAAAAAAAAAAAAAAA ! -s 10.244.0.0/16 -d 10.96.0.5/32 -p tcp -m tcp --dport 80 -j KUBE-MARK-MASQ
-A KUBE-SVC-AAAAAAAAAAAAAAAA -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-1111111111111111
-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-2222222222222222
-A KUBE-SVC-BBBBBBBBBBBBBBBB -m comment --comment "bench/svc-00001:http -> 10.244.0.11:8080" -j KUBE-SEP-3333333333333333
-A KUBE-SEP-1111111111111111 -s 10.244.0.1/32 -j KUBE-MARK-MASQ
-A KUBE-SEP-1111111111111111 -p tcp -m tcp -j DNAT --to-destination 10.244.0.1:8080
-A KUBE-SEP-2222222222222222 -p tcp -m tcp -j DNAT --to-destination 10.244.0.2:8080
-A KUBE-SEP-3333333333333333 -p tcp -m comment --comment "bench/svc-00001:http" -m tcp -j DNAT --to-destination 10.244.0.11:8080
COMMIT
"#;

    #[test]
    fn iptables_services_follow_their_endpoint_chains() {
        let p = parse_iptables_save(IPTABLES_SAVE_TEXT);
        assert_eq!(p.services.len(), 2);
        assert_eq!(
            p.services[&addr("10.96.0.5:80")],
            set(&["10.244.0.1:8080", "10.244.0.2:8080"])
        );
        assert_eq!(
            p.services[&addr("10.96.0.6:80")],
            set(&["10.244.0.11:8080"])
        );
        assert_eq!(p.chains[&addr("10.96.0.5:80")], "KUBE-SVC-AAAAAAAAAAAAAAAA");
    }

    #[test]
    fn one_iptables_chain_lists_its_jumps_and_an_endpoint_chain_its_target() {
        let svc = "-N KUBE-SVC-AAAAAAAAAAAAAAAA\n-A KUBE-SVC-AAAAAAAAAAAAAAAA ! -s 10.244.0.0/16 -d 10.96.0.5/32 -p tcp -m tcp --dport 80 -j KUBE-MARK-MASQ\n-A KUBE-SVC-AAAAAAAAAAAAAAAA -m statistic --mode random --probability 0.50000000000 -j KUBE-SEP-1111111111111111\n-A KUBE-SVC-AAAAAAAAAAAAAAAA -j KUBE-SEP-2222222222222222\n";
        assert_eq!(
            iptables_jumps(svc, "KUBE-SVC-AAAAAAAAAAAAAAAA"),
            vec!["KUBE-SEP-1111111111111111", "KUBE-SEP-2222222222222222"]
        );
        let sep = "-N KUBE-SEP-1111111111111111\n-A KUBE-SEP-1111111111111111 -s 10.244.0.1/32 -j KUBE-MARK-MASQ\n-A KUBE-SEP-1111111111111111 -p tcp -m comment --comment \"a -> b\" -m tcp -j DNAT --to-destination 10.244.0.1:8080\n";
        assert_eq!(
            iptables_dnat(sep, "KUBE-SEP-1111111111111111"),
            Some(addr("10.244.0.1:8080"))
        );
    }

    #[test]
    fn quoted_comments_are_one_word() {
        assert_eq!(
            rule_words(r#"-A X -m comment --comment "a b -j KUBE-SEP-X" -j DNAT"#),
            vec![
                "-A",
                "X",
                "-m",
                "comment",
                "--comment",
                "a b -j KUBE-SEP-X",
                "-j",
                "DNAT"
            ]
        );
    }
}
