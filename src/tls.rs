//! Process-wide TLS set-up. rustls 0.23 refuses to pick a crypto provider
//! when more than one is compiled in, so edgeway installs ring once, before
//! any TLS client or server is built.

use std::sync::Once;

pub fn install_default_provider() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err means another provider was installed first, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}
