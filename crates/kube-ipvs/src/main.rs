//! `kube-ipvs`: the node agent and its debugging tools.

fn main() {
    println!("kube-ipvs {}", env!("CARGO_PKG_VERSION"));
}
