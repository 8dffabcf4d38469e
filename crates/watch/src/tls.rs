//! The cipher order of the API client's TLS, chosen as Go's crypto/tls chooses it.
//!
//! rustls's *ring* provider offers AES-GCM first whatever the CPU. Without AES and carry-less
//! multiply instructions, AES-GCM runs in constant-time software, several times slower than
//! ChaCha20-Poly1305; a Go client (kube-proxy's) then offers ChaCha20-Poly1305 first, and a Go
//! server (the API server) takes ChaCha20-Poly1305 when it is the client's first choice. The
//! agent decrypts every list page and watch event it reads, so on such a CPU (an emulated one
//! included) the order decides much of what reading the API costs.

use rustls::CipherSuite;
use rustls::crypto::CryptoProvider;

/// Makes [`provider`] the process's default TLS provider, which kube-rs's client takes. Call
/// it before the first client is built: a provider already installed stays (so calling it
/// twice is harmless, and calling it after a client was built changes nothing).
pub fn install_default_provider() {
    if provider().install_default().is_ok() && !aes_hardware() {
        tracing::info!("TLS: ChaCha20-Poly1305 offered first (this CPU has no AES instructions)");
    }
}

/// *ring* with its suites in the order for this CPU: ChaCha20-Poly1305 first without AES
/// hardware ([`aes_hardware`]), *ring*'s own order with it.
pub fn provider() -> CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    cipher_order(&mut provider, aes_hardware());
    provider
}

/// Puts the ChaCha20-Poly1305 suites first when the CPU has no AES hardware; otherwise keeps
/// the provider's order. The order among the other suites is kept either way.
fn cipher_order(provider: &mut CryptoProvider, aes_hardware: bool) {
    if !aes_hardware {
        // A stable sort: ChaCha20 suites first, each group in the provider's order.
        provider
            .cipher_suites
            .sort_by_key(|s| !is_chacha20(s.suite()));
    }
}

fn is_chacha20(suite: CipherSuite) -> bool {
    matches!(
        suite,
        CipherSuite::TLS13_CHACHA20_POLY1305_SHA256
            | CipherSuite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256
            | CipherSuite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256
    )
}

/// Whether AES-GCM runs in hardware here, by the test Go's crypto/tls makes (its
/// `hasAESGCMHardwareSupport`): AES-NI, PCLMULQDQ, SSE4.1 and SSSE3 on x86-64, AES and PMULL on
/// arm64. Elsewhere this says no (Go also says yes on s390x and ppc64, which offer ChaCha20
/// first here).
pub fn aes_hardware() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("aes")
            && std::arch::is_x86_feature_detected!("pclmulqdq")
            && std::arch::is_x86_feature_detected!("sse4.1")
            && std::arch::is_x86_feature_detected!("ssse3")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
            && std::arch::is_aarch64_feature_detected!("pmull")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn suites(p: &CryptoProvider) -> Vec<CipherSuite> {
        p.cipher_suites.iter().map(|s| s.suite()).collect()
    }

    #[test]
    fn without_aes_hardware_chacha20_comes_first_and_the_rest_keep_their_order() {
        let stock = rustls::crypto::ring::default_provider();
        let mut p = rustls::crypto::ring::default_provider();
        cipher_order(&mut p, false);
        let got = suites(&p);
        assert_eq!(got[0], CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
        // The same suites, none lost or added.
        let mut a = got.clone();
        let mut b = suites(&stock);
        a.sort_by_key(|s| u16::from(*s));
        b.sort_by_key(|s| u16::from(*s));
        assert_eq!(a, b);
        // Every ChaCha20 suite before every other, each group in the stock order.
        let split = got.iter().take_while(|s| is_chacha20(**s)).count();
        assert!(got[split..].iter().all(|s| !is_chacha20(*s)));
        let stock_rest: Vec<CipherSuite> = suites(&stock)
            .into_iter()
            .filter(|s| !is_chacha20(*s))
            .collect();
        assert_eq!(got[split..], stock_rest[..]);
    }

    #[test]
    fn with_aes_hardware_the_order_is_the_providers() {
        let mut p = rustls::crypto::ring::default_provider();
        cipher_order(&mut p, true);
        assert_eq!(
            suites(&p),
            suites(&rustls::crypto::ring::default_provider())
        );
        assert_ne!(suites(&p)[0], CipherSuite::TLS13_CHACHA20_POLY1305_SHA256);
    }
}
