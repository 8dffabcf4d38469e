//! Where `plan`, `check` and `explain` get the desired state: manifest files (`--manifests`)
//! or one complete listing from the API server, plus the node context flags they share.
//!
//! Both sources go through `kube-ipvs-watch`'s tracker, so translation and "bad objects are
//! skipped" are exactly the daemon's. The result is the engine's [`Inputs`]. This module never
//! touches the kernel.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;

use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube_ipvs_diff::{Cidr, Inputs, MarkSpace, NodeContext, Options, Scheduler};
use kube_ipvs_watch::lean::{LeanService, LeanSlice};
use kube_ipvs_watch::translate::SERVICE_NAME_LABEL;
use kube_ipvs_watch::{ChangeSet, Skipped, Tracker, TranslateOptions};

/// The scheduler of Services without the annotation when neither a flag nor the file names one.
pub const DEFAULT_SCHEDULER: &str = "rr";

/// Why the desired state could not be read.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// A flag's value is unusable.
    #[error("--{flag} {value:?}: {reason}")]
    Flag {
        /// The flag, without dashes.
        flag: &'static str,
        /// The value given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The manifests could not be read or parsed.
    #[error(transparent)]
    Manifest(#[from] kube_ipvs_watch::Error),
    /// The API server could not be reached or answered with an error.
    #[error("{what}: {source}")]
    Api {
        /// What was being done.
        what: String,
        /// The client's error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The node context was refused by the model.
    #[error("node context: {0}")]
    Node(kube_ipvs_diff::Error),
    /// `--config`, or a setting it gives, is unusable (the error names the file or key).
    #[error(transparent)]
    Config(Box<crate::agent::config::ConfigError>),
    /// The async runtime for the API client could not start.
    #[error("starting the API client runtime: {0}")]
    Runtime(std::io::Error),
}

/// The desired-state flags shared by `plan`, `check` and `explain`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SourceArgs {
    /// kube-proxy's `KubeProxyConfiguration` file, read as `run --config` reads it (in the
    /// agent's pod: `/var/lib/kube-ipvs/config.conf`): the node name, kubeconfig, scheduler,
    /// cluster CIDR, exclude CIDRs, NodePort addresses and service-proxy name come from it
    /// where no flag gives them, so the desired state is the agent's.
    #[arg(long, value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Read Services and EndpointSlices (and optionally this node's Node) from YAML manifests:
    /// a file or a directory of `.yaml`/`.yml` files. Without it, the API server is asked.
    #[arg(long, value_name = "PATH")]
    pub manifests: Option<PathBuf>,
    /// The kubeconfig for the API server; default: in-cluster config, then `$KUBECONFIG`,
    /// then `~/.kube/config`.
    #[arg(long, value_name = "PATH", conflicts_with = "manifests")]
    pub kubeconfig: Option<PathBuf>,
    /// The API server's address, overriding the kubeconfig's (kube-proxy's `--master`); without
    /// `--kubeconfig` it is the whole connection, with no credentials.
    #[arg(long, value_name = "URL", conflicts_with = "manifests")]
    pub master: Option<String>,
    /// This node's name (default: the kernel's hostname, lowercased).
    #[arg(long, value_name = "NAME")]
    pub hostname_override: Option<String>,
    /// This node's zone; default: the Node object's `topology.kubernetes.io/zone` label.
    #[arg(long, value_name = "ZONE")]
    pub node_zone: Option<String>,
    /// An address NodePorts listen on (repeatable), instead of the choice of
    /// `--nodeport-addresses`.
    #[arg(long = "node-ip", value_name = "IP")]
    pub node_ips: Vec<IpAddr>,
    /// NodePorts listen on the node's addresses inside these networks, comma-separated, or on
    /// `primary` (the Node's InternalIP of each family); a family with no network takes every
    /// local address (the default). Chosen among the kernel's addresses; without them (e.g.
    /// `plan --from-empty`), among the Node's InternalIPs.
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub nodeport_addresses: Option<String>,
    /// The IPVS scheduler for Services without a `kube-ipvs.io/scheduler` annotation (default
    /// rr).
    #[arg(long, value_name = "NAME")]
    pub scheduler: Option<String>,
    /// The Pod network(s), comma-separated. Accepted and checked for kube-proxy
    /// compatibility; it does not change the IPVS table (it matters to masquerade rules).
    #[arg(long, value_name = "CIDR[,CIDR]")]
    pub cluster_cidr: Option<String>,
    /// Networks whose virtual servers and addresses belong to someone else and are never
    /// touched, comma-separated (kube-proxy's `--ipvs-exclude-cidrs`).
    #[arg(long = "exclude-cidrs", value_name = "CIDR[,CIDR]")]
    pub exclude_cidrs: Option<String>,
    /// Take only Services labelled `service.kubernetes.io/service-proxy-name` with this value
    /// (default: only unlabelled Services, as kube-proxy).
    #[arg(long, value_name = "NAME")]
    pub service_proxy_name: Option<String>,
    /// How long a removed TCP or SCTP real server with open connections keeps weight 0 before
    /// it is deleted anyway (e.g. `1h`; default `15m`); `0s` deletes at once. Each deletion at
    /// the cap is logged and counted (`kube_ipvs_drain_timeouts_total`).
    #[arg(long, value_name = "DURATION")]
    pub graceful_termination_timeout: Option<String>,
    /// The packet-mark bits (one run, e.g. `0x3ff00000`, the default) the Local-policy short
    /// circuit gives its fwmark virtual servers, so this node's Pods and the node itself reach
    /// every endpoint of an `externalTrafficPolicy: Local` Service's NodePorts, external and
    /// load-balancer IPs; `0` turns it off (local clients then get local endpoints only, as in
    /// kube-proxy's IPVS mode). Must not hold the masquerade bit or bits another agent marks.
    #[arg(long, value_name = "MASK")]
    pub local_fwmark_mask: Option<String>,
}

/// The mark space of `--local-fwmark-mask`: the default when unset, none for `0`.
pub fn mark_space(value: Option<&str>) -> Result<Option<MarkSpace>, SourceError> {
    match value.map(str::trim) {
        None => Ok(Some(MarkSpace::DEFAULT)),
        Some("0" | "0x0") => Ok(None),
        Some(v) => v.parse().map(Some).map_err(|reason| SourceError::Flag {
            flag: "local-fwmark-mask",
            value: v.to_owned(),
            reason,
        }),
    }
}

fn cidr_list(flag: &'static str, value: Option<&str>) -> Result<Vec<Cidr>, SourceError> {
    value
        .into_iter()
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<Cidr>().map_err(|e| SourceError::Flag {
                flag,
                value: s.to_owned(),
                reason: e.to_string(),
            })
        })
        .collect()
}

/// The desired state a debugging command works from.
#[derive(Debug)]
pub struct Desired {
    /// The engine's inputs.
    pub inputs: Inputs,
    /// The model's rejections (unexpected: translation screens for them).
    pub warnings: Vec<String>,
    /// What translation left out, whole objects or some of their endpoints.
    pub skipped: Vec<Skipped>,
}

impl Desired {
    /// Prints the warnings and one line per reason something was left out on stderr, each
    /// after `command: ` (the same words the agent logs).
    pub fn report(&self, command: &str) {
        for w in &self.warnings {
            eprintln!("{command}: warning: {w}");
        }
        for s in &self.skipped {
            for m in &s.messages {
                eprintln!("{command}: {m}");
            }
        }
    }
}

impl SourceArgs {
    /// These flags with `--config`'s settings where no flag gives them: the settings `run`
    /// would resolve from the same flags and file ([`crate::agent::Settings::resolve`], so the
    /// file is checked as strictly and a flag wins over its key as there). Without `--config`,
    /// the flags as they are.
    pub fn with_config_file(&self) -> Result<SourceArgs, SourceError> {
        let Some(path) = &self.config else {
            return Ok(self.clone());
        };
        let run = crate::agent::RunArgs {
            config: Some(path.clone()),
            manifests: self.manifests.clone(),
            kubeconfig: self.kubeconfig.clone(),
            master: self.master.clone(),
            hostname_override: self.hostname_override.clone(),
            node_zone: self.node_zone.clone(),
            node_ips: self.node_ips.clone(),
            nodeport_addresses: self.nodeport_addresses.clone(),
            scheduler: self.scheduler.clone(),
            cluster_cidr: self.cluster_cidr.clone(),
            exclude_cidrs: self.exclude_cidrs.clone(),
            service_proxy_name: self.service_proxy_name.clone(),
            graceful_termination_timeout: self.graceful_termination_timeout.clone(),
            local_fwmark_mask: self.local_fwmark_mask.clone(),
            ..crate::agent::RunArgs::default()
        };
        let settings =
            crate::agent::Settings::resolve(&run).map_err(|e| SourceError::Config(Box::new(e)))?;
        Ok(SourceArgs {
            config: None,
            ..settings.source
        })
    }

    /// The node name these flags give.
    pub fn node_name(&self) -> Result<String, SourceError> {
        match &self.hostname_override {
            Some(n) if !n.trim().is_empty() => Ok(n.trim().to_lowercase()),
            Some(n) => Err(SourceError::Flag {
                flag: "hostname-override",
                value: n.clone(),
                reason: "empty node name".to_owned(),
            }),
            None => kube_ipvs_host::setup::hostname().ok_or_else(|| SourceError::Flag {
                flag: "hostname-override",
                value: String::new(),
                reason: "the hostname cannot be read; give the node name".to_owned(),
            }),
        }
    }

    /// The node context from the flags alone (before the Node object fills in the gaps).
    pub fn node_context(&self) -> Result<NodeContext, SourceError> {
        let scheduler = self.scheduler.as_deref().unwrap_or(DEFAULT_SCHEDULER);
        let default_scheduler: Scheduler =
            scheduler
                .parse()
                .map_err(|e: kube_ipvs_diff::Error| SourceError::Flag {
                    flag: "scheduler",
                    value: scheduler.to_owned(),
                    reason: e.to_string(),
                })?;
        cidr_list("cluster-cidr", self.cluster_cidr.as_deref())?;
        let mut ctx = NodeContext::new(self.node_name()?);
        ctx.zone.clone_from(&self.node_zone);
        self.override_ips(&mut ctx);
        ctx.default_scheduler = default_scheduler;
        let defaults = Options::default();
        let graceful_termination_timeout = match &self.graceful_termination_timeout {
            None => defaults.graceful_termination_timeout,
            Some(v) => {
                crate::agent::config::parse_duration(v).map_err(|reason| SourceError::Flag {
                    flag: "graceful-termination-timeout",
                    value: v.clone(),
                    reason,
                })?
            }
        };
        ctx.options = Options {
            exclude_cidrs: cidr_list("exclude-cidrs", self.exclude_cidrs.as_deref())?,
            graceful_termination_timeout,
            local_marks: mark_space(self.local_fwmark_mask.as_deref())?,
        };
        Ok(ctx)
    }

    /// `--nodeport-addresses`, parsed.
    pub fn nodeports(&self) -> Result<crate::agent::nodeports::NodePortAddresses, SourceError> {
        let value = self.nodeport_addresses.as_deref().unwrap_or_default();
        crate::agent::nodeports::NodePortAddresses::parse(value.split(',')).map_err(|e| {
            SourceError::Flag {
                flag: "nodeport-addresses",
                value: e.entry,
                reason: e.reason,
            }
        })
    }

    fn override_ips(&self, ctx: &mut NodeContext) {
        if self.node_ips.is_empty() {
            return;
        }
        ctx.set_node_ips(self.node_ips.iter().copied());
    }

    fn translate_options(&self) -> TranslateOptions {
        TranslateOptions {
            service_proxy_name: self.service_proxy_name.clone(),
        }
    }

    /// Reads the desired state: the manifests, or one complete listing from the API server,
    /// with what translation left out. Model rejections (which translation screens for, so they
    /// are unexpected) are returned as warnings.
    pub fn load(&self) -> Result<Desired, SourceError> {
        self.load_with(HashMap::new(), None)
    }

    /// [`SourceArgs::load_with`] with the hints and addresses read from `kernel` when it could be opened
    /// (best effort, so the desired state's errors come before the kernel's): what `check`
    /// and `plan` compare with the kernel.
    pub fn load_beside<K: crate::kernel::Kernel, E>(
        &self,
        kernel: &mut Result<K, E>,
    ) -> Result<Desired, SourceError> {
        let hints = kernel
            .as_mut()
            .map(|k| crate::agent::sets::mark_hints(k))
            .unwrap_or_default();
        let local = kernel.as_mut().ok().and_then(|k| k.node_addresses().ok());
        self.load_with(hints, local)
    }

    /// [`SourceArgs::load`] with the short circuit's marks the kernel holds as `hints`, so the
    /// marks are those the running agent gave ([`Inputs::set_mark_hints`]), and the node's
    /// `local` addresses when they could be read: the NodePort addresses are then chosen among
    /// them as the agent chooses ([`crate::agent::nodeports`]); without them, the Node's
    /// InternalIPs.
    pub fn load_with(
        &self,
        hints: HashMap<kube_ipvs_diff::MarkHint, u32>,
        local: Option<Vec<IpAddr>>,
    ) -> Result<Desired, SourceError> {
        let this = self.with_config_file()?;
        let ctx = this.node_context()?;
        let opts = this.translate_options();
        let (cs, skipped) = match &this.manifests {
            Some(path) => {
                kube_ipvs_watch::manifest::snapshot_with_skipped(path, &opts, Some(&ctx.node_name))?
            }
            None => this.list_cluster(&opts, &ctx.node_name)?,
        };
        let (inputs, warnings) = this.inputs_from(ctx, &cs, hints, local.as_deref())?;
        Ok(Desired {
            inputs,
            warnings,
            skipped,
        })
    }

    /// Builds the inputs from a change set, letting the flags win over the Node object.
    fn inputs_from(
        &self,
        ctx: NodeContext,
        cs: &ChangeSet,
        hints: HashMap<kube_ipvs_diff::MarkHint, u32>,
        local: Option<&[IpAddr]>,
    ) -> Result<(Inputs, Vec<String>), SourceError> {
        let mut inputs = Inputs::new(ctx).map_err(SourceError::Node)?;
        inputs.set_mark_hints(hints);
        let warnings = cs
            .apply_to(&mut inputs)
            .into_iter()
            .map(|e| e.to_string())
            .collect();
        let mut ctx = inputs.node().clone();
        if self.node_zone.is_some() {
            ctx.zone.clone_from(&self.node_zone);
        }
        match local {
            Some(local) => {
                let how = self.nodeports()?;
                let primary: Vec<IpAddr> = ctx.node_ips().collect();
                crate::agent::nodeports::apply(&mut ctx, &how, &self.node_ips, local, &primary);
            }
            // Without the node's addresses, `--nodeport-addresses` chooses among the Node's
            // InternalIPs.
            None if self.node_ips.is_empty() && self.nodeport_addresses.is_some() => {
                let how = self.nodeports()?;
                let primary: Vec<IpAddr> = ctx.node_ips().collect();
                ctx.set_node_ips(how.select(&primary, &primary));
            }
            None => self.override_ips(&mut ctx),
        }
        inputs.set_node(ctx).map_err(SourceError::Node)?;
        Ok((inputs, warnings))
    }

    /// Lists Services, EndpointSlices and this node's Node once, as the daemon's first watch
    /// would, and stops.
    fn list_cluster(
        &self,
        opts: &TranslateOptions,
        node_name: &str,
    ) -> Result<(ChangeSet, Vec<Skipped>), SourceError> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(SourceError::Runtime)?;
        rt.block_on(async {
            let client = self.client().await?;
            let api_err = |what: &str| {
                let what = what.to_owned();
                move |e: kube::Error| SourceError::Api {
                    what,
                    source: Box::new(e),
                }
            };
            let selector = opts.label_selector();
            let lp = kube::api::ListParams::default().labels(&selector);
            // Decoded lean, as the agent's watch does: one list of a large cluster is hundreds
            // of MB of JSON, most of it metadata nothing here reads.
            let services: Vec<Service> = kube::Api::<LeanService>::all(client.clone())
                .list(&lp)
                .await
                .map_err(api_err("list Services"))?
                .items
                .into_iter()
                .map(Service::from)
                .collect();
            let slice_selector = format!("{SERVICE_NAME_LABEL},{selector}");
            let lp = kube::api::ListParams::default().labels(&slice_selector);
            let slices: Vec<EndpointSlice> = kube::Api::<LeanSlice>::all(client.clone())
                .list(&lp)
                .await
                .map_err(api_err("list EndpointSlices"))?
                .items
                .into_iter()
                .map(EndpointSlice::from)
                .collect();
            let node = kube::Api::<Node>::all(client)
                .get_opt(node_name)
                .await
                .map_err(api_err(&format!("get Node {node_name}")))?;
            let mut t = Tracker::new(opts.clone());
            t.relist_services(&services);
            t.relist_slices(&slices);
            if let Some(n) = &node {
                t.apply_node(n);
            }
            Ok((t.take_change_set().unwrap_or_default(), t.skipped()))
        })
    }

    /// The API client these flags describe (`--kubeconfig`, else the inferred config).
    pub async fn client(&self) -> Result<kube::Client, SourceError> {
        let config_err = |what: String| {
            move |e: Box<dyn std::error::Error + Send + Sync>| SourceError::Api { what, source: e }
        };
        let mut config = match &self.kubeconfig {
            Some(path) => {
                let what = format!("kubeconfig {}", path.display());
                let kc = kube::config::Kubeconfig::read_from(path)
                    .map_err(|e| config_err(what.clone())(Box::new(e)))?;
                kube::Config::from_custom_kubeconfig(
                    kc,
                    &kube::config::KubeConfigOptions::default(),
                )
                .await
                .map_err(|e| config_err(what)(Box::new(e)))?
            }
            // `--master` alone is the whole connection, as kube-proxy's (client-go's
            // BuildConfigFromFlags with no kubeconfig).
            None if self.master.is_some() => kube::Config::new(hyper::Uri::default()),
            None => kube::Config::infer()
                .await
                .map_err(|e| config_err("find the API server".to_owned())(Box::new(e)))?,
        };
        if let Some(master) = &self.master {
            config.cluster_url = master
                .parse::<hyper::Uri>()
                .map_err(|e| config_err(format!("--master {master:?}"))(Box::new(e)))?;
        }
        kube_ipvs_watch::tls::install_default_provider();
        kube::Client::try_from(config)
            .map_err(|e| config_err("create the API client".to_owned())(Box::new(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> SourceArgs {
        SourceArgs {
            hostname_override: Some("Node-1".into()),
            ..SourceArgs::default()
        }
    }

    #[test]
    fn flags_build_the_node_context() {
        let mut a = args();
        a.node_ips = vec!["192.168.1.10".parse().expect("literal")];
        a.exclude_cidrs = Some("10.200.0.0/16, fd00:1::/64".into());
        a.scheduler = Some("mh:fallback".into());
        let ctx = a.node_context().expect("valid flags");
        assert_eq!(ctx.node_name, "node-1");
        assert_eq!(
            ctx.node_ips_v4,
            vec![std::net::Ipv4Addr::new(192, 168, 1, 10)]
        );
        assert_eq!(ctx.options.exclude_cidrs.len(), 2);
        assert_eq!(ctx.default_scheduler.to_string(), "mh:fallback");
    }

    #[test]
    fn bad_flags_name_the_flag_and_value() {
        let mut a = args();
        a.scheduler = Some("roundrobin".into());
        let err = a.node_context().expect_err("bad scheduler");
        assert!(
            err.to_string().starts_with("--scheduler \"roundrobin\""),
            "{err}"
        );
        let mut a = args();
        a.exclude_cidrs = Some("10.0.0.0/40".into());
        let err = a.node_context().expect_err("bad cidr");
        assert!(
            err.to_string()
                .starts_with("--exclude-cidrs \"10.0.0.0/40\""),
            "{err}"
        );
        let mut a = args();
        a.cluster_cidr = Some("pods".into());
        assert!(a.node_context().is_err());
    }

    #[test]
    fn flags_win_over_the_node_object() {
        let mut a = args();
        a.node_zone = Some("zone-a".into());
        let cs = ChangeSet {
            node: Some(kube_ipvs_watch::NodeInfo {
                zone: Some("zone-b".into()),
                ips_v4: vec![std::net::Ipv4Addr::new(10, 0, 0, 7)],
                ips_v6: vec![],
                pod_cidrs: vec![],
                draining: false,
            }),
            ..ChangeSet::default()
        };
        let ctx = a.node_context().expect("valid");
        let (inputs, warnings) = a
            .inputs_from(ctx, &cs, HashMap::new(), None)
            .expect("valid");
        assert!(warnings.is_empty());
        assert_eq!(inputs.node().zone.as_deref(), Some("zone-a"));
        // The Node object supplies what the flags left out.
        assert_eq!(
            inputs.node().node_ips_v4,
            vec![std::net::Ipv4Addr::new(10, 0, 0, 7)]
        );
    }
}
