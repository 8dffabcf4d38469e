//! A real control plane on the host's loopback: etcd and kube-apiserver from `cargo xtask tools`,
//! for the kernel tests that need an API server (`tests/kernel_apiserver*.rs`) and for
//! `cargo xtask bench e2e`.
//!
//! The API server serves HTTPS with a certificate from a throwaway CA (subject alternative names
//! 127.0.0.1 and 10.0.2.100, the addresses the host and the guest use), authenticates static
//! tokens and authorises with RBAC. Two identities:
//! * `admin` (group `system:masters`) for tests that create Services and EndpointSlices;
//! * `system:serviceaccount:kube-system:kube-ipvs`, the identity the DaemonSet runs as; RBAC
//!   gives it exactly what `deploy/clusterrole.yaml` grants once that is applied, so an agent
//!   run with this token proves the manifest's rules suffice.
//!
//! The guest reaches the API server through the VM's forwarded ports; a small control port lets
//! a test in the guest restart, stop and start the API server and compact etcd's history (the
//! API server restart and outage tests).
//! Everything lives in a fresh directory per run and is killed when [`ControlPlane`] drops.

use std::fs;
use std::io::{BufRead as _, BufReader, Write as _};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::tools::Tools;
use crate::util::{self, Fnv, secs};
use crate::vm::HOST_ALIAS;

/// Where the guest finds the files of [`ControlPlane::guest_files`].
pub(crate) const GUEST_DIR: &str = "/etc/kube-ipvs-test";

/// The Service CIDR the API server allocates ClusterIPs from (room for 65k Services).
pub(crate) const SERVICE_CIDR: &str = "10.96.0.0/16";

/// The ServiceAccount user the DaemonSet runs as (see the module docs).
const AGENT_USER: &str = "system:serviceaccount:kube-system:kube-ipvs";

struct Processes {
    etcd: Child,
    apiserver: Option<Child>,
}

/// etcd and kube-apiserver, running until dropped.
pub(crate) struct ControlPlane {
    dir: PathBuf,
    apiserver_bin: PathBuf,
    kubectl: PathBuf,
    apiserver_args: Vec<String>,
    /// Added to kube-apiserver's environment (`bench e2e --apiserver-memory-limit`).
    apiserver_env: Vec<(String, String)>,
    etcd_bin: PathBuf,
    etcd_args: Vec<String>,
    processes: Arc<Mutex<Processes>>,
    /// The API server's HTTPS port on 127.0.0.1 (and the guest's forwarded port).
    pub(crate) port: u16,
    /// The restart-control port (see [`ControlPlane::serve_control`]).
    pub(crate) control_port: u16,
    /// etcd's client port on 127.0.0.1.
    etcd_port: u16,
    admin_token: String,
    agent_token: String,
    /// `(node name, token)` of a lab's kubelets.
    node_tokens: Vec<(String, String)>,
}

/// A free TCP port on loopback (the kernel picks it; nothing holds it afterwards).
pub(crate) fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A token nobody can guess across runs: a hash of the time, the process and a counter. These
/// tokens guard a loopback test server that lives for one run, not anything of value.
fn token(label: &str) -> String {
    let mut key = Fnv::default();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    key.str(label)
        .str(now.as_nanos().to_string())
        .str(std::process::id().to_string());
    let mut second = Fnv::default();
    second.str(key.hex()).str(label);
    format!("{}{}", key.hex(), second.hex())
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let mut cmd = Command::new("openssl");
    cmd.current_dir(dir).args(args);
    util::output(&mut cmd).map(drop)
}

/// CA, serving certificate and service-account key pair in `dir`, with openssl; `extra_sans`
/// are added to the serving certificate's (`IP:...`, `DNS:...`).
fn certificates(dir: &Path, extra_sans: &[String]) -> Result<()> {
    let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
    let mut args = vec!["req", "-x509", "-nodes", "-days", "2"];
    args.extend(ec);
    args.extend([
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-subj",
        "/CN=kube-ipvs-test-ca",
    ]);
    openssl(dir, &args)?;
    let mut sans = format!("IP:127.0.0.1,IP:{HOST_ALIAS},DNS:localhost");
    for san in extra_sans {
        sans.push(',');
        sans.push_str(san);
    }
    issue(
        dir,
        "serving",
        "/CN=kube-apiserver",
        &format!("subjectAltName={sans}\nextendedKeyUsage=serverAuth\n"),
    )?;
    openssl(
        dir,
        &[
            "ecparam",
            "-name",
            "prime256v1",
            "-genkey",
            "-noout",
            "-out",
            "sa.key",
        ],
    )?;
    openssl(dir, &["ec", "-in", "sa.key", "-pubout", "-out", "sa.pub"])?;
    Ok(())
}

/// A key `NAME.key` and a certificate `NAME.crt` for `subject`, signed by the CA in `dir`
/// with `extensions` (openssl's extension file syntax).
fn issue(dir: &Path, name: &str, subject: &str, extensions: &str) -> Result<()> {
    let key = format!("{name}.key");
    let csr = format!("{name}.csr");
    openssl(
        dir,
        &[
            "req",
            "-nodes",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-keyout",
            &key,
            "-out",
            &csr,
            "-subj",
            subject,
        ],
    )?;
    fs::write(dir.join(format!("{name}.ext")), extensions)?;
    sign(dir, name)
}

/// Signs `NAME.csr` with the CA in `dir`, with the extensions in `NAME.ext`, into `NAME.crt`
/// (valid two days: the certificates live for one run).
fn sign(dir: &Path, name: &str) -> Result<()> {
    let (csr, ext, crt) = (
        format!("{name}.csr"),
        format!("{name}.ext"),
        format!("{name}.crt"),
    );
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            &csr,
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            &ext,
            "-out",
            &crt,
        ],
    )
}

/// What a lab control plane differs in (`cargo xtask cluster`): it runs in the lab's own
/// network namespace, where fixed ports are free, and real kubelets register with it.
#[derive(Debug, Clone)]
pub(crate) struct Lab {
    /// The address the guests reach the API server on (the lab bridge's).
    pub(crate) address: String,
    pub(crate) port: u16,
    /// Node names: each gets a token as `system:node:NAME` in `system:nodes`, for the Node
    /// authorizer and the NodeRestriction admission plugin.
    pub(crate) nodes: Vec<String>,
    /// The `kubernetes` Service's ClusterIP (the first of the Service CIDR), for the
    /// certificate: Pods reach the API server through it.
    pub(crate) service_ip: String,
}

/// A kubeconfig for `server` with the CA at `ca` and a bearer token.
pub(crate) fn kubeconfig(server: &str, ca: &str, token: &str, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    token: {token}\n\
         contexts:\n- name: test\n  context:\n    cluster: test\n    user: {user}\n\
         current-context: test\n"
    )
}

fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Starts a long-running child, registered with the reaper until [`terminate`] stops it.
pub(crate) fn spawn_logged(bin: &Path, args: &[String], log: &Path) -> Result<Child> {
    spawn_logged_with(bin, args, &[], log)
}

/// As [`spawn_logged`], with `env` added to the inherited environment.
fn spawn_logged_with(
    bin: &Path,
    args: &[String],
    env: &[(String, String)],
    log: &Path,
) -> Result<Child> {
    let file = fs::File::create(log)?;
    let err = file.try_clone()?;
    let child = Command::new(bin)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    // Unregistered by `terminate`, which every owner calls.
    crate::reaper::track(child.id());
    Ok(child)
}

/// Stops a child with SIGTERM (a clean shutdown, as kubelet would), then SIGKILL after 20 s.
pub(crate) fn terminate(child: &mut Child) {
    let pid = child.id();
    terminate_untracked(child);
    crate::reaper::untrack(pid);
}

fn terminate_untracked(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

impl ControlPlane {
    /// Starts etcd and kube-apiserver in a fresh `dir` and waits until the API server is ready.
    pub(crate) fn start(tools: &Tools, dir: &Path) -> Result<ControlPlane> {
        Self::start_with(tools, dir, None, None, false, Vec::new())
    }

    /// As [`ControlPlane::start`], for `bench e2e`: etcd on a copy of `store` if given (a data
    /// directory saved by [`ControlPlane::save_store`]), so the objects of an earlier run are
    /// there from the start; with `every_address` (only inside a network namespace of xtask's own
    /// whose bridge holds [`HOST_ALIAS`]) kube-apiserver listens on every address there, so
    /// guests on the bridge reach it at `HOST_ALIAS` as they would through QEMU's user
    /// networking. `apiserver_env` goes into kube-apiserver's environment.
    pub(crate) fn start_for_bench(
        tools: &Tools,
        dir: &Path,
        store: Option<&Path>,
        every_address: bool,
        apiserver_env: Vec<(String, String)>,
    ) -> Result<ControlPlane> {
        Self::start_with(tools, dir, None, store, every_address, apiserver_env)
    }

    /// As [`ControlPlane::start`], set up for the lab cluster's kubelets.
    pub(crate) fn start_lab(tools: &Tools, dir: &Path, lab: &Lab) -> Result<ControlPlane> {
        Self::start_with(tools, dir, Some(lab), None, true, Vec::new())
    }

    fn start_with(
        tools: &Tools,
        dir: &Path,
        lab: Option<&Lab>,
        store: Option<&Path>,
        // Only inside a network namespace of xtask's own, which holds nothing else.
        every_address: bool,
        apiserver_env: Vec<(String, String)>,
    ) -> Result<ControlPlane> {
        let started = Instant::now();
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir)?;
        if let Some(store) = store {
            copy_dir(store, &dir.join("etcd"))
                .with_context(|| format!("copying the kept store {}", store.display()))?;
        }
        let sans: Vec<String> = lab
            .map(|lab| {
                let mut sans = vec![
                    format!("IP:{}", lab.address),
                    format!("IP:{}", lab.service_ip),
                ];
                for name in [
                    "kubernetes",
                    "kubernetes.default",
                    "kubernetes.default.svc",
                    "kubernetes.default.svc.cluster.local",
                ] {
                    sans.push(format!("DNS:{name}"));
                }
                sans
            })
            .unwrap_or_default();
        certificates(dir, &sans).context("making the test certificates (is openssl installed?)")?;
        let admin_token = token("admin");
        let agent_token = token("agent");
        let mut tokens = format!(
            "{admin_token},admin,admin-uid,system:masters\n\
             {agent_token},{AGENT_USER},kube-ipvs-uid\n"
        );
        let mut node_tokens = Vec::new();
        for node in lab.map(|l| l.nodes.as_slice()).unwrap_or_default() {
            let t = token(&format!("node {node}"));
            tokens.push_str(&format!(
                "{t},system:node:{node},node-{node}-uid,system:nodes\n"
            ));
            node_tokens.push((node.clone(), t));
        }
        fs::write(dir.join("tokens.csv"), tokens)?;
        if lab.is_some() {
            // The API server's identity towards kubelets.
            issue(
                dir,
                "kubelet-client",
                "/O=system:masters/CN=kube-apiserver-kubelet-client",
                "extendedKeyUsage=clientAuth\n",
            )?;
        }
        let etcd_client = free_port()?;
        let etcd_peer = free_port()?;
        let port = match lab {
            Some(lab) => lab.port,
            None => free_port()?,
        };
        let control_port = free_port()?;
        let etcd_args: Vec<String> = [
            "--name=default".to_owned(),
            format!("--data-dir={}", dir.join("etcd").display()),
            format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
            format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
            format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
            format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
            format!("--initial-cluster=default=http://127.0.0.1:{etcd_peer}"),
            // A test store: losing it on a host crash is fine, waiting for fsync is not.
            "--unsafe-no-fsync".to_owned(),
            "--quota-backend-bytes=4294967296".to_owned(),
        ]
        .into();
        let etcd = spawn_logged(&tools.etcd, &etcd_args, &dir.join("etcd.log"))?;
        let d = |name: &str| dir.join(name).display().to_string();
        let mut apiserver_args: Vec<String> = vec![
            format!("--etcd-servers=http://127.0.0.1:{etcd_client}"),
            // A namespace of xtask's own holds nothing else: all its addresses are the run's.
            format!(
                "--bind-address={}",
                if every_address {
                    "0.0.0.0"
                } else {
                    "127.0.0.1"
                }
            ),
            format!("--secure-port={port}"),
            // The address the `kubernetes` Service's endpoint points at; the guest reaches the
            // host there, so it is a real route for anything in the VM.
            format!(
                "--advertise-address={}",
                lab.map_or(HOST_ALIAS, |l| l.address.as_str())
            ),
            format!("--tls-cert-file={}", d("serving.crt")),
            format!("--tls-private-key-file={}", d("serving.key")),
            format!("--token-auth-file={}", d("tokens.csv")),
            "--authorization-mode=RBAC".to_owned(),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local".to_owned(),
            format!("--service-account-key-file={}", d("sa.pub")),
            format!("--service-account-signing-key-file={}", d("sa.key")),
            format!("--service-cluster-ip-range={SERVICE_CIDR}"),
            // deploy/daemonset.yaml's init container is privileged; `kubectl apply --dry-run=server`
            // checks it.
            "--allow-privileged=true".to_owned(),
            format!("--cert-dir={}", d("apiserver-certs")),
            "--profiling=false".to_owned(),
        ];
        if lab.is_some() {
            apiserver_args.retain(|a| a != "--authorization-mode=RBAC");
            apiserver_args.extend([
                "--authorization-mode=Node,RBAC".to_owned(),
                "--enable-admission-plugins=NodeRestriction".to_owned(),
                format!("--client-ca-file={}", d("ca.crt")),
                format!("--kubelet-client-certificate={}", d("kubelet-client.crt")),
                format!("--kubelet-client-key={}", d("kubelet-client.key")),
                // Kubelets serve a self-signed certificate; the lab has no CSR approver.
                "--kubelet-preferred-address-types=InternalIP".to_owned(),
            ]);
        }
        let plane = ControlPlane {
            dir: dir.to_owned(),
            apiserver_bin: tools.kube_apiserver.clone(),
            kubectl: tools.kubectl.clone(),
            apiserver_args,
            apiserver_env,
            etcd_bin: tools.etcd.clone(),
            etcd_args,
            processes: Arc::new(Mutex::new(Processes {
                etcd,
                apiserver: None,
            })),
            port,
            control_port,
            etcd_port: etcd_client,
            admin_token,
            agent_token,
            node_tokens,
        };
        plane.start_apiserver()?;
        eprintln!(
            "xtask: control plane (etcd, kube-apiserver {}) ready on 127.0.0.1:{port} in {} ({})",
            tools.kubernetes_version,
            secs(started.elapsed()),
            dir.display()
        );
        Ok(plane)
    }

    /// Starts kube-apiserver and waits until it is ready; one already running is left as it
    /// is (a second would fail to bind while readiness answered from the first, orphaning it).
    fn start_apiserver(&self) -> Result<()> {
        let log = self.dir.join("kube-apiserver.log");
        {
            let mut processes = self
                .processes
                .lock()
                .map_err(|_| anyhow::anyhow!("control plane lock poisoned"))?;
            let running = processes
                .apiserver
                .as_mut()
                .is_some_and(|c| matches!(c.try_wait(), Ok(None)));
            if !running {
                let child = spawn_logged_with(
                    &self.apiserver_bin,
                    &self.apiserver_args,
                    &self.apiserver_env,
                    &log,
                )?;
                processes.apiserver = Some(child);
            }
        }
        self.wait_ready(&log)
    }

    fn wait_ready(&self, log: &Path) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let ready = Command::new(&self.kubectl)
                .arg(format!(
                    "--kubeconfig={}",
                    self.host_kubeconfig()?.display()
                ))
                .args(["get", "--raw", "/readyz"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return Ok(());
            }
            {
                let mut processes = self
                    .processes
                    .lock()
                    .map_err(|_| anyhow::anyhow!("control plane lock poisoned"))?;
                if let Ok(Some(status)) = processes.etcd.try_wait() {
                    bail!(
                        "etcd exited ({status}):\n{}",
                        log_tail(&self.dir.join("etcd.log"))
                    );
                }
                if let Some(Ok(Some(status))) = processes.apiserver.as_mut().map(|c| c.try_wait()) {
                    bail!("kube-apiserver exited ({status}):\n{}", log_tail(log));
                }
            }
            if Instant::now() > deadline {
                bail!("kube-apiserver not ready after 120 s:\n{}", log_tail(log));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Stops the API server (SIGTERM) and starts it again on the same port and store.
    pub(crate) fn restart_apiserver(&self) -> Result<()> {
        self.stop_apiserver()?;
        self.start_apiserver()
    }

    /// Saves etcd's data directory to `to` (replacing what is there) for
    /// [`ControlPlane::start_for_bench`]: the API server and etcd stop (SIGTERM, so etcd's
    /// files are whole), the directory is copied, and both start again on the same ports.
    pub(crate) fn save_store(&self, to: &Path) -> Result<()> {
        self.stop_apiserver()?;
        let log = self.dir.join("etcd.log");
        let saved = {
            let mut processes = self
                .processes
                .lock()
                .map_err(|_| anyhow::anyhow!("control plane lock poisoned"))?;
            terminate(&mut processes.etcd);
            let partial = to.with_extension("partial");
            let _ = fs::remove_dir_all(&partial);
            let saved = copy_dir(&self.dir.join("etcd"), &partial)
                .with_context(|| format!("saving the store to {}", partial.display()))
                .and_then(|()| {
                    let _ = fs::remove_dir_all(to);
                    Ok(fs::rename(&partial, to)?)
                });
            // etcd comes back whether or not the copy succeeded: a failed save leaves the
            // control plane as it was.
            let _ = fs::rename(&log, self.dir.join("etcd-before-save.log"));
            processes.etcd = spawn_logged(&self.etcd_bin, &self.etcd_args, &log)?;
            saved
        };
        self.start_apiserver()?;
        saved
    }

    /// Stops the API server (SIGTERM, then SIGKILL after a grace period); etcd keeps running.
    fn stop_apiserver(&self) -> Result<()> {
        let old = {
            let mut processes = self
                .processes
                .lock()
                .map_err(|_| anyhow::anyhow!("control plane lock poisoned"))?;
            processes.apiserver.take()
        };
        if let Some(mut child) = old {
            terminate(&mut child);
        }
        Ok(())
    }

    /// Compacts etcd's history up to its current revision (through etcd's JSON gateway), so a
    /// watch resuming from any earlier resourceVersion gets 410 Gone. Returns the revision.
    fn compact_etcd(&self) -> Result<u64> {
        // `AA==` is the key "\0": any range answers with the store's revision in its header.
        let range = etcd_post(self.etcd_port, "/v3/kv/range", r#"{"key":"AA=="}"#)?;
        let revision: u64 = range["header"]["revision"]
            .as_str()
            .and_then(|r| r.parse().ok())
            .with_context(|| format!("etcd's range answer has no revision: {range}"))?;
        let body = format!(r#"{{"revision":"{revision}","physical":true}}"#);
        etcd_post(self.etcd_port, "/v3/kv/compaction", &body)?;
        Ok(revision)
    }

    /// The admin kubeconfig for the host (written once into the run directory).
    pub(crate) fn host_kubeconfig(&self) -> Result<PathBuf> {
        let path = self.dir.join("admin.kubeconfig");
        if !path.exists() {
            let ca = self.dir.join("ca.crt").display().to_string();
            let text = kubeconfig(
                &format!("https://127.0.0.1:{}", self.port),
                &ca,
                &self.admin_token,
                "admin",
            );
            fs::write(&path, text)?;
        }
        Ok(path)
    }

    /// Files for the guest under [`GUEST_DIR`]: `ca.crt`, `admin.kubeconfig` and
    /// `agent.kubeconfig` (server `https://127.0.0.1:PORT`, reachable in a test's namespace
    /// through a relay to `/run/host-PORT.sock`; `ports` names both forwarded ports), and the
    /// same pair for the guest's initial namespace (`*-direct.kubeconfig`, server
    /// `https://10.0.2.100:PORT`).
    pub(crate) fn guest_files(&self) -> Result<Vec<(String, Vec<u8>)>> {
        let ca_guest = format!("{GUEST_DIR}/ca.crt");
        let local = format!("https://127.0.0.1:{}", self.port);
        let direct = format!("https://{HOST_ALIAS}:{}", self.port);
        Ok(vec![
            (ca_guest.clone(), fs::read(self.dir.join("ca.crt"))?),
            (
                format!("{GUEST_DIR}/admin.kubeconfig"),
                kubeconfig(&local, &ca_guest, &self.admin_token, "admin").into_bytes(),
            ),
            (
                format!("{GUEST_DIR}/agent.kubeconfig"),
                kubeconfig(&local, &ca_guest, &self.agent_token, "kube-ipvs").into_bytes(),
            ),
            (
                format!("{GUEST_DIR}/admin-direct.kubeconfig"),
                kubeconfig(&direct, &ca_guest, &self.admin_token, "admin").into_bytes(),
            ),
            (
                format!("{GUEST_DIR}/agent-direct.kubeconfig"),
                kubeconfig(&direct, &ca_guest, &self.agent_token, "kube-ipvs").into_bytes(),
            ),
            (
                format!("{GUEST_DIR}/ports"),
                format!("apiserver={}\ncontrol={}\n", self.port, self.control_port).into_bytes(),
            ),
        ])
    }

    /// The run directory (logs, certificates, kubeconfigs).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    /// A lab kubelet's kubeconfig (`system:node:NODE`).
    pub(crate) fn node_kubeconfig(&self, node: &str, server: &str, ca: &str) -> Result<String> {
        let (_, token) = self
            .node_tokens
            .iter()
            .find(|(n, _)| n == node)
            .with_context(|| format!("the control plane has no token for node {node}"))?;
        Ok(kubeconfig(
            server,
            ca,
            token,
            &format!("system:node:{node}"),
        ))
    }

    /// `kubectl` with the admin kubeconfig.
    pub(crate) fn kubectl(&self) -> Result<Command> {
        let mut cmd = Command::new(&self.kubectl);
        cmd.arg(format!(
            "--kubeconfig={}",
            self.host_kubeconfig()?.display()
        ));
        Ok(cmd)
    }

    /// Applies the RBAC part of `deploy/` for real, so the agent token has the DaemonSet's
    /// permissions and nothing more.
    pub(crate) fn apply_rbac(&self) -> Result<()> {
        let deploy = util::workspace_root().join("deploy");
        let mut cmd = self.kubectl()?;
        cmd.args(["apply", "-f"])
            .arg(deploy.join("serviceaccount.yaml"))
            .arg("-f")
            .arg(deploy.join("clusterrole.yaml"))
            .arg("-f")
            .arg(deploy.join("clusterrolebinding.yaml"));
        util::output(&mut cmd).map(drop)
    }

    /// Serves the control port on 127.0.0.1 in a background thread: each connection sends one
    /// line, `restart-apiserver`, `stop-apiserver`, `start-apiserver` (answered `ok` once the API
    /// server is ready) or `compact-etcd` (answered `ok REVISION`), or gets `error: ...`.
    ///
    /// The thread holds only a weak reference: the caller's `Arc` is the owner, and dropping it
    /// stops etcd and kube-apiserver (a strong reference here kept them running after xtask
    /// exited, orphaned).
    pub(crate) fn serve_control(self: &Arc<Self>) -> Result<()> {
        let listener = TcpListener::bind(("127.0.0.1", self.control_port))?;
        let plane = Arc::downgrade(self);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let Some(plane) = plane.upgrade() else {
                    return;
                };
                if let Err(e) = plane.control(stream) {
                    eprintln!("xtask: control connection: {e:#}");
                }
            }
        });
        Ok(())
    }

    fn control(&self, stream: TcpStream) -> Result<()> {
        let mut line = String::new();
        BufReader::new(stream.try_clone()?).read_line(&mut line)?;
        let mut stream = stream;
        let command = line.trim();
        eprintln!("xtask: control: {command} (asked by the guest)");
        let done = match command {
            "restart-apiserver" => self.restart_apiserver().map(|()| String::new()),
            "stop-apiserver" => self.stop_apiserver().map(|()| String::new()),
            "start-apiserver" => self.start_apiserver().map(|()| String::new()),
            "compact-etcd" => self.compact_etcd().map(|rev| format!(" {rev}")),
            other => {
                writeln!(stream, "error: unknown command {other:?}")?;
                return Ok(());
            }
        };
        match done {
            Ok(detail) => writeln!(stream, "ok{detail}")?,
            Err(e) => writeln!(stream, "error: {e:#}")?,
        }
        Ok(())
    }
}

/// A JSON POST to etcd's gRPC gateway on 127.0.0.1:`port`: the answer's body.
fn etcd_post(port: u16, path: &str, body: &str) -> Result<serde_json::Value> {
    use std::io::Read as _;
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to etcd on port {port}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        stream,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    let (head, rest) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("etcd's answer to {path} has no body: {answer:?}"))?;
    if !head.starts_with("HTTP/1.1 200") {
        bail!("etcd answered {path} with {head:?}: {rest}");
    }
    // The gateway may answer chunked: the JSON object lies between the first `{` and last `}`.
    let json = rest
        .find('{')
        .zip(rest.rfind('}'))
        .map(|(a, b)| &rest[a..=b])
        .with_context(|| format!("etcd's answer to {path} is not JSON: {rest:?}"))?;
    serde_json::from_str(json).with_context(|| format!("etcd's answer to {path}: {json}"))
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        if let Ok(mut processes) = self.processes.lock() {
            if let Some(mut child) = processes.apiserver.take() {
                terminate(&mut child);
            }
            terminate(&mut processes.etcd);
        }
        // etcd preallocates tens of MiB of WAL; the logs and certificates stay for debugging.
        let _ = fs::remove_dir_all(self.dir.join("etcd"));
    }
}

/// `kubectl apply --dry-run=server` of exactly the install commands the docs give operators
/// (README.md and docs/operations.md; `crates/kube-ipvs/tests/deploy.rs` fails when the two lists
/// differ): the API server's own validation and admission of what we ship, in the form we tell
/// people to apply it. Each command's output follows a `$ kubectl ...` line naming it.
pub(crate) fn dry_run_deploy(plane: &ControlPlane) -> Result<String> {
    // (flag, path from the workspace root), as written in the docs.
    const INSTALL: [(&str, &str); 3] = [
        ("-f", "deploy/"),
        ("-k", "deploy/"),
        ("-f", "deploy/replace-kube-proxy/"),
    ];
    let root = util::workspace_root();
    let mut out = String::new();
    for (flag, path) in INSTALL {
        out.push_str(&format!("$ kubectl apply --dry-run=server {flag} {path}\n"));
        let mut cmd = plane.kubectl()?;
        cmd.args(["apply", "--dry-run=server", flag])
            .arg(root.join(path));
        out.push_str(&util::output(&mut cmd)?);
    }
    Ok(out)
}

/// The Helm chart, from the workspace root.
const CHART: &str = "deploy/helm/kube-ipvs";

/// The YAML documents of a stream (`---`-separated), empty ones dropped, as JSON values.
fn yaml_docs(text: &str, what: &str) -> Result<Vec<serde_json::Value>> {
    let docs: Vec<serde_json::Value> =
        serde_saphyr::from_multiple(text).with_context(|| format!("{what} is not YAML"))?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// Objects by (kind, name), each ConfigMap's `config.conf` parsed (its text may differ in
/// comments and key order only).
fn by_kind_and_name(
    docs: Vec<serde_json::Value>,
    what: &str,
) -> Result<std::collections::BTreeMap<(String, String), serde_json::Value>> {
    let mut out = std::collections::BTreeMap::new();
    for mut doc in docs {
        let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
        let name = doc["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if let Some(conf) = doc["data"]["config.conf"].as_str() {
            let parsed = yaml_docs(conf, &format!("{what}: ConfigMap {name} config.conf"))?;
            doc["data"]["config.conf"] = parsed.into_iter().next().unwrap_or_default();
        }
        if out.insert((kind.clone(), name.clone()), doc).is_some() {
            bail!("{what}: {kind} {name} twice");
        }
    }
    Ok(out)
}

/// Renders the chart with `helm template` into `dir`, checks that the default values give the
/// objects of `kubectl apply -k deploy/` and that the values land where they say, and dry-runs
/// the renders against the API server.
fn check_chart(plane: &ControlPlane, helm: &Path, dir: &Path) -> Result<String> {
    let root = util::workspace_root();
    let chart = root.join(CHART);
    let mut out = String::new();
    let render = |extra: &[&str]| -> Result<String> {
        let mut cmd = Command::new(helm);
        cmd.args(["template", "kube-ipvs"])
            .arg(&chart)
            .args(["--namespace", "kube-system"])
            .args(extra)
            // No repository cache, config or plugins of the machine's user.
            .env("HELM_CACHE_HOME", dir.join("helm/cache"))
            .env("HELM_CONFIG_HOME", dir.join("helm/config"))
            .env("HELM_DATA_HOME", dir.join("helm/data"));
        util::output(&mut cmd)
    };
    let defaults = render(&[])?;
    let mut kustomize = plane.kubectl()?;
    kustomize.arg("kustomize").arg(root.join("deploy"));
    let base = util::output(&mut kustomize)?;
    let rendered = by_kind_and_name(yaml_docs(&defaults, "helm template")?, "helm template")?;
    let wanted = by_kind_and_name(yaml_docs(&base, "kubectl kustomize deploy/")?, "deploy/")?;
    if rendered != wanted {
        let names = |m: &std::collections::BTreeMap<(String, String), serde_json::Value>| {
            m.keys().cloned().collect::<Vec<_>>()
        };
        for (key, doc) in &rendered {
            if wanted.get(key) != Some(doc) {
                bail!(
                    "{CHART} with its default values renders {key:?} unlike deploy/:\n{}\n\
                     deploy/ has:\n{}",
                    serde_json::to_string_pretty(doc)?,
                    serde_json::to_string_pretty(&wanted.get(key))?
                );
            }
        }
        bail!(
            "{CHART} renders {:?}, deploy/ holds {:?}",
            names(&rendered),
            names(&wanted)
        );
    }
    out.push_str(&format!(
        "$ helm template kube-ipvs {CHART} --namespace kube-system: the {} objects of \
         `kubectl apply -k deploy/`\n",
        rendered.len()
    ));
    let set = [
        "--set",
        "scheduler=lc",
        "--set",
        "image.tag=test",
        "--set",
        "resources.limits.memory=1Gi",
        "--set",
        "tolerations=null",
    ];
    let custom = render(&set)?;
    let objects = by_kind_and_name(yaml_docs(&custom, "helm template --set")?, "helm --set")?;
    let config = &objects[&("ConfigMap".to_owned(), "kube-ipvs".to_owned())]["data"]["config.conf"];
    let ds =
        &objects[&("DaemonSet".to_owned(), "kube-ipvs".to_owned())]["spec"]["template"]["spec"];
    let container = &ds["containers"][0];
    if config["ipvs"]["scheduler"] != "lc"
        || container["image"] != "kube-ipvs:test"
        || container["resources"]["limits"]["memory"] != "1Gi"
        || !ds["tolerations"].is_null()
    {
        bail!("helm template {set:?} did not carry the values:\n{custom}");
    }
    for (what, text) in [("defaults", &defaults), ("--set", &custom)] {
        let file = dir.join(format!("chart-{}.yaml", what.trim_start_matches('-')));
        fs::write(&file, text)?;
        out.push_str(&format!(
            "$ helm template kube-ipvs {CHART} ({what}) | kubectl apply --dry-run=server -f -\n"
        ));
        let mut cmd = plane.kubectl()?;
        cmd.args(["apply", "--dry-run=server", "-f"]).arg(&file);
        out.push_str(&util::output(&mut cmd)?);
    }
    Ok(out)
}

/// `cargo xtask deploy-check`: starts the control plane and dry-runs `deploy/` and the Helm
/// chart against it.
pub(crate) fn command(args: &[String]) -> Result<()> {
    if let Some(arg) = args.first() {
        bail!("deploy-check: unexpected argument {arg:?}");
    }
    let tools = match crate::tools::ensure()? {
        Ok(t) => t,
        Err(crate::tools::Unavailable(why)) => {
            println!("SKIPPED kubectl apply --dry-run=server -f deploy/: {why}");
            return Ok(());
        }
    };
    let helm = match crate::tools::helm()? {
        Ok(h) => h,
        Err(crate::tools::Unavailable(why)) => bail!("deploy-check: {why}"),
    };
    let dir = util::target_dir()?.join("control-plane/deploy-check");
    let plane = ControlPlane::start(&tools, &dir)?;
    let out = dry_run_deploy(&plane)?;
    print!("{out}");
    print!("{}", check_chart(&plane, &helm, &dir)?);
    Ok(())
}

/// Copies the directory tree `from` to `to` (files and directories only: etcd's data).
fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    fs::create_dir_all(to)?;
    for entry in fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            fs::copy(entry.path(), &target)
                .with_context(|| format!("copying {}", entry.path().display()))?;
        }
    }
    Ok(())
}
