# kube-ipvs, for registries and builders that have a Docker engine. The release pipeline does not
# need one: `cargo xtask image` builds the same contents (the release binary, iptables and kmod
# from Debian bookworm) into an OCI/docker-save archive. Build: docker build -t kube-ipvs:0.1.0 .

# Build stage: the same Debian release as the runtime, so the binary's glibc matches.
FROM rust:1.89-bookworm AS build
WORKDIR /src
COPY . .
# Under the name kube-proxy the binary is `kube-ipvs run` with kube-proxy's flags, so a kube-proxy
# DaemonSet whose image alone is swapped keeps its command (as `cargo xtask image` links it).
RUN cargo build --release --locked -p kube-ipvs \
 && install -D -m 0755 target/release/kube-ipvs /out/usr/local/bin/kube-ipvs \
 && ln -s kube-ipvs /out/usr/local/bin/kube-proxy

# Runtime stage: iptables for the masquerade rules (both backends; the nft one is the default
# alternative, as in Debian) and kmod so modprobe can load ip_vs* from the host's /lib/modules.
FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends iptables kmod \
 && rm -rf /var/lib/apt/lists/* /usr/share/doc /usr/share/man
COPY --from=build /out/ /
ENTRYPOINT ["/usr/local/bin/kube-ipvs"]
CMD ["run"]
