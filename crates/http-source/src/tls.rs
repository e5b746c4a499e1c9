//! TLS on a listener: a certificate chain and its private key, read from PEM files and
//! served through a resolver that a reload replaces whole.
//!
//! Invariants:
//! - What a listener serves is always a pair that loaded whole: every certificate of the
//!   chain parsed, the key parsed, and the key is the one of the chain's first (leaf)
//!   certificate. A load that fails in any way changes nothing and says why, naming the
//!   file ([`TlsError::file`]).
//! - A reload replaces the pair for handshakes that start after it; connections already
//!   open keep theirs. At most one reload of a listener reads its files at a time
//!   ([`ListenerTls::begin_reload`]): a read a file system never answers holds one
//!   thread, not one per SIGHUP.
//! - TLS 1.2 and 1.3 only, and ALPN offers `http/1.1` alone (the listeners speak
//!   HTTP/1.1): a client that offers only other protocols fails its handshake.
//! - The handshake is bounded by the listener's header-read timeout (`server.rs`), so a
//!   client that connects and never finishes its handshake cannot hold a slot.
//! - `iggy_ingest_tls_reloads_total{listener, outcome}` counts reloads (`loaded`,
//!   `failed`) and `iggy_ingest_tls_reload_failed{listener}` is 1 from a failed reload
//!   until the next one that loads: while it is 1, the files on disk are not what the
//!   listener serves. `iggy_ingest_tls_certificate_expiry_timestamp_seconds{listener}` is
//!   the served leaf certificate's `notAfter` (0 until one is loaded whose date reads).
//!   Every series of a listener is registered when its `ListenerTls` is made.

use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

/// The two files a listener's TLS is read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM: the certificate chain, the listener's own (leaf) certificate first.
    pub cert_file: PathBuf,
    /// PEM: the leaf certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
}

/// Which of the two files a load failed on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsFile {
    Cert,
    Key,
}

impl TlsFile {
    /// The configuration key that names the file.
    pub fn key(self) -> &'static str {
        match self {
            TlsFile::Cert => "cert_file",
            TlsFile::Key => "key_file",
        }
    }
}

/// Why a certificate and key could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", file.key())]
pub struct TlsError {
    pub file: TlsFile,
    pub message: String,
}

impl TlsError {
    fn new(file: TlsFile, message: impl Into<String>) -> TlsError {
        TlsError { file, message: message.into() }
    }
}

/// The crypto provider every listener uses (and the CLI's client of the admin
/// listener), named rather than left to the process-wide default (the `iggy` client's
/// dependencies build more than one into the binary, and rustls refuses to pick
/// between them).
pub fn provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// Reads `files` into the pair a listener serves, checking everything the invariants
/// name.
pub fn load(files: &TlsFiles) -> Result<Arc<CertifiedKey>, TlsError> {
    let chain = read_chain(&files.cert_file)?;
    let key = read_key(&files.key_file)?;
    let provider = provider();
    let signing_key = provider.key_provider.load_private_key(key).map_err(|e| {
        TlsError::new(
            TlsFile::Key,
            format!("{} holds a private key this server cannot use: {e}", show(&files.key_file)),
        )
    })?;
    let pair = CertifiedKey::new(chain, signing_key);
    match pair.keys_match() {
        Ok(()) => Ok(Arc::new(pair)),
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::KeyMismatch)) => Err(TlsError::new(
            TlsFile::Key,
            format!(
                "{} is not the private key of the first certificate in {} (the chain must start with the listener's own certificate)",
                show(&files.key_file),
                show(&files.cert_file)
            ),
        )),
        // Every key the provider loads can tell its public half; should one not, the
        // handshake's own signature check is what remains, and a client would refuse a
        // wrong pair there.
        Err(rustls::Error::InconsistentKeys(rustls::InconsistentKeys::Unknown)) => Ok(Arc::new(pair)),
        Err(e) => Err(TlsError::new(
            TlsFile::Cert,
            format!("the first certificate in {} cannot be used: {e}", show(&files.cert_file)),
        )),
    }
}

/// When the leaf certificate of a pair is valid, in seconds since the Unix epoch: from
/// its `notBefore` to its `notAfter`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    pub not_before_unix_secs: i64,
    pub not_after_unix_secs: i64,
}

/// When the leaf certificate of `pair` is valid; `None` if it does not read as X.509.
pub fn validity(pair: &CertifiedKey) -> Option<Validity> {
    let leaf = pair.cert.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(leaf.as_ref()).ok()?;
    Some(Validity {
        not_before_unix_secs: cert.validity().not_before.timestamp(),
        not_after_unix_secs: cert.validity().not_after.timestamp(),
    })
}

/// What to say of a certificate chain that clients may not verify: a certificate that is
/// not the issuer of the one before it (intermediates out of order, or an old one left
/// in the file), or a lone certificate that is not self-signed (`cert.pem` where
/// `fullchain.pem` was meant: a client that does not hold its issuer cannot verify it).
/// A warning, never a refusal: a certificate signed by a root its clients hold needs
/// nothing after it. `None` too for a chain that does not read as X.509 (refused before).
pub fn chain_warning(chain: &[CertificateDer<'_>]) -> Option<String> {
    let parsed = chain
        .iter()
        .map(|c| x509_parser::parse_x509_certificate(c.as_ref()).ok().map(|(_, x)| x))
        .collect::<Option<Vec<_>>>()?;
    for (i, pair) in parsed.windows(2).enumerate() {
        if pair[0].issuer().as_raw() != pair[1].subject().as_raw() {
            return Some(format!(
                "certificate {} of the chain is not the issuer of certificate {}: clients may not verify the chain \
                 (intermediates out of order, or an old one left in the file?)",
                i + 2,
                i + 1
            ));
        }
    }
    match parsed.as_slice() {
        [only] if only.issuer().as_raw() != only.subject().as_raw() => Some(
            "the file holds the listener's certificate alone, and it is not self-signed: a client that does not \
             hold its issuer's certificate cannot verify it (fullchain.pem rather than cert.pem?)"
                .to_string(),
        ),
        _ => None,
    }
}

fn show(path: &Path) -> String {
    format!("{:?}", path.display().to_string())
}

/// The most bytes a certificate, key or CA file may hold. A chain of ten 4096-bit
/// certificates is under 20 KiB; the bound keeps a path pointed at the wrong file
/// (`/dev/zero`, a log) from filling the daemon's memory at a reload, where the PEM
/// reader alone bounds neither a line nor the number of blocks.
pub const TLS_FILE_MAX_BYTES: u64 = 1 << 20;

/// The bytes of the PEM file at `path`, refused past [`TLS_FILE_MAX_BYTES`].
pub fn read_pem_file(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(TLS_FILE_MAX_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > TLS_FILE_MAX_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("it is larger than {TLS_FILE_MAX_BYTES} bytes, more than any certificate chain or key"),
        ));
    }
    Ok(bytes)
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes =
        read_pem_file(path).map_err(|e| TlsError::new(TlsFile::Cert, format!("{} cannot be read: {e}", show(path))))?;
    let unreadable = |e: rustls::pki_types::pem::Error| {
        TlsError::new(TlsFile::Cert, format!("{} cannot be read as PEM: {e}", show(path)))
    };
    let chain = CertificateDer::pem_slice_iter(&bytes).collect::<Result<Vec<_>, _>>().map_err(unreadable)?;
    if chain.is_empty() {
        return Err(TlsError::new(
            TlsFile::Cert,
            format!("{} holds no certificate (a PEM \"BEGIN CERTIFICATE\" block)", show(path)),
        ));
    }
    // Every certificate, not the leaf alone: a client parses the whole chain it is sent,
    // and refuses the handshake over one it cannot.
    for (i, cert) in chain.iter().enumerate() {
        if let Err(e) = x509_parser::parse_x509_certificate(cert.as_ref()) {
            return Err(TlsError::new(
                TlsFile::Cert,
                format!("certificate {} in {} does not parse as X.509: {e}", i + 1, show(path)),
            ));
        }
    }
    Ok(chain)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes =
        read_pem_file(path).map_err(|e| TlsError::new(TlsFile::Key, format!("{} cannot be read: {e}", show(path))))?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        rustls::pki_types::pem::Error::NoItemsFound => TlsError::new(
            TlsFile::Key,
            format!("{} holds no private key (a PEM \"BEGIN PRIVATE KEY\", \"BEGIN RSA PRIVATE KEY\" or \"BEGIN EC PRIVATE KEY\" block)", show(path)),
        ),
        e => TlsError::new(TlsFile::Key, format!("{} cannot be read as PEM: {e}", show(path))),
    })
}

/// Registers every TLS series of `listener` at zero, so each is there from the first
/// scrape on (a no-op without an installed recorder).
pub fn register_metrics(listener: &'static str) {
    metrics::gauge!("iggy_ingest_tls_reload_failed", "listener" => listener).set(0.0);
    drop(metrics::gauge!("iggy_ingest_tls_certificate_expiry_timestamp_seconds", "listener" => listener));
    for outcome in ["loaded", "failed"] {
        drop(metrics::counter!("iggy_ingest_tls_reloads_total", "listener" => listener, "outcome" => outcome));
    }
    for reason in ["refused", "timed_out"] {
        drop(metrics::counter!("iggy_ingest_tls_handshake_failures_total", "listener" => listener, "reason" => reason));
    }
}

/// The expiry of `pair`, about to be served by `listener`, set in its gauge (0 when it
/// does not read). How near it is is said by whoever loaded the pair (`config check`
/// and the start, each reload), by one rule (the runtime's `tls_validity_warning`).
fn served_expiry(listener: &'static str, pair: &CertifiedKey) -> Option<i64> {
    let expiry = validity(pair).map(|v| v.not_after_unix_secs);
    metrics::gauge!("iggy_ingest_tls_certificate_expiry_timestamp_seconds", "listener" => listener)
        .set(expiry.unwrap_or(0) as f64);
    expiry
}

/// The pair handshakes are answered with; a reload replaces it.
#[derive(Debug)]
struct Served(RwLock<Arc<CertifiedKey>>);

impl ResolvesServerCert for Served {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.read().unwrap_or_else(PoisonError::into_inner).clone())
    }
}

/// One listener's TLS: its files, the pair it serves, and the acceptor built on them.
/// Cloning shares all three, so a reload through any clone is what every clone serves.
#[derive(Clone)]
pub struct ListenerTls {
    inner: Arc<Inner>,
}

struct Inner {
    files: TlsFiles,
    served: Arc<Served>,
    acceptor: TlsAcceptor,
    listener: &'static str,
    loads: std::sync::Mutex<Loads>,
    /// A reload is reading the files ([`ListenerTls::begin_reload`]).
    reloading: std::sync::atomic::AtomicBool,
}

/// What the loads of a listener's pair left: the part of [`TlsView`] that changes.
#[derive(Debug)]
struct Loads {
    loaded_at_unix_ms: u64,
    expires_at_unix_secs: Option<i64>,
    reload_failed: Option<ReloadFailure>,
}

/// What a listener's TLS serves, for the status API: when the pair served was loaded,
/// and the last reload that failed since (cleared by one that loads).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct TlsView {
    pub cert_file: String,
    pub key_file: String,
    pub loaded_at_unix_ms: u64,
    /// The served leaf certificate's `notAfter`, when it reads.
    pub expires_at_unix_secs: Option<i64>,
    /// The last reload's failure, while the pair served is older than the files.
    pub reload_failed: Option<ReloadFailure>,
}

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ReloadFailure {
    pub at_unix_ms: u64,
    pub error: String,
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls").field("files", &self.inner.files).field("listener", &self.inner.listener).finish()
    }
}

impl ListenerTls {
    /// Loads `files` for the listener named `listener` (a metric label).
    pub fn new(files: TlsFiles, listener: &'static str) -> Result<ListenerTls, TlsError> {
        let pair = load(&files)?;
        register_metrics(listener);
        let expires_at_unix_secs = served_expiry(listener, &pair);
        let served = Arc::new(Served(RwLock::new(pair)));
        let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::new(TlsFile::Cert, format!("no TLS version to serve: {e}")))?
            .with_no_client_auth()
            .with_cert_resolver(served.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let loads = std::sync::Mutex::new(Loads {
            loaded_at_unix_ms: ingest::time::now_unix_ms(),
            expires_at_unix_secs,
            reload_failed: None,
        });
        let reloading = std::sync::atomic::AtomicBool::new(false);
        Ok(ListenerTls { inner: Arc::new(Inner { files, served, acceptor, listener, loads, reloading }) })
    }

    /// Reads the files again and serves what they hold from the next handshake on; on
    /// any failure the pair served before stays, and the error says why.
    pub fn reload(&self) -> Result<(), TlsError> {
        let listener = self.inner.listener;
        // Read before the lock: `view` (what `/status` shows) never waits for a file
        // read, which a hung mount can make last. Held across the swap: two reloads at
        // once leave the view saying what is served.
        let loaded = load(&self.inner.files);
        let mut view = self.inner.loads.lock().unwrap_or_else(PoisonError::into_inner);
        match loaded {
            Ok(pair) => {
                view.expires_at_unix_secs = served_expiry(listener, &pair);
                *self.inner.served.0.write().unwrap_or_else(PoisonError::into_inner) = pair;
                view.loaded_at_unix_ms = ingest::time::now_unix_ms();
                view.reload_failed = None;
                metrics::counter!("iggy_ingest_tls_reloads_total", "listener" => listener, "outcome" => "loaded")
                    .increment(1);
                metrics::gauge!("iggy_ingest_tls_reload_failed", "listener" => listener).set(0.0);
                Ok(())
            }
            Err(e) => {
                self.failed(&mut view, e.to_string());
                Err(e)
            }
        }
    }

    /// A reload to run on a blocking thread, unless one is still reading the files (a
    /// file system that does not answer holds its thread in the read): `None` then, and
    /// no second thread joins the first. The reload's end, however late, lets the next
    /// begin.
    pub fn begin_reload(&self) -> Option<Reload> {
        let taken = self.inner.reloading.compare_exchange(
            false,
            true,
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
        );
        taken.is_ok().then(|| Reload(self.clone()))
    }

    /// Says that a reload did not happen because reading the files has not returned
    /// (`why`): counted and shown as a failed reload (the files on disk may not be what
    /// is served), until a reload loads. The reading thread, if it ever returns, applies
    /// what it read as any reload does.
    pub fn reload_not_returned(&self, why: &str) {
        let mut view = self.inner.loads.lock().unwrap_or_else(PoisonError::into_inner);
        self.failed(&mut view, why.to_string());
    }

    /// A reload that failed with `error`, under the view's lock: counted, the gauge 1,
    /// and the view says why until a reload loads.
    fn failed(&self, view: &mut Loads, error: String) {
        let listener = self.inner.listener;
        metrics::counter!("iggy_ingest_tls_reloads_total", "listener" => listener, "outcome" => "failed").increment(1);
        metrics::gauge!("iggy_ingest_tls_reload_failed", "listener" => listener).set(1.0);
        view.reload_failed = Some(ReloadFailure { at_unix_ms: ingest::time::now_unix_ms(), error });
    }

    /// The listener's name, as its metrics label it.
    pub fn listener(&self) -> &'static str {
        self.inner.listener
    }

    pub fn view(&self) -> TlsView {
        let loads = self.inner.loads.lock().unwrap_or_else(PoisonError::into_inner);
        TlsView {
            cert_file: self.inner.files.cert_file.display().to_string(),
            key_file: self.inner.files.key_file.display().to_string(),
            loaded_at_unix_ms: loads.loaded_at_unix_ms,
            expires_at_unix_secs: loads.expires_at_unix_secs,
            reload_failed: loads.reload_failed.clone(),
        }
    }

    pub fn files(&self) -> &TlsFiles {
        &self.inner.files
    }

    /// The pair served now.
    pub fn served(&self) -> Arc<CertifiedKey> {
        self.inner.served.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.inner.acceptor
    }
}

/// A reload [`ListenerTls::begin_reload`] let begin: the next may begin once it ended.
pub struct Reload(ListenerTls);

impl Reload {
    /// [`ListenerTls::reload`].
    pub fn run(self) -> Result<(), TlsError> {
        self.0.reload()
    }
}

impl Drop for Reload {
    fn drop(&mut self) {
        self.0.inner.reloading.store(false, std::sync::atomic::Ordering::Release);
    }
}

/// Test certificates and a client that trusts them (shared with `server.rs`'s tests).
#[cfg(test)]
pub(crate) mod testing {
    use std::path::Path;
    use std::sync::Arc;

    use rustls::pki_types::{CertificateDer, ServerName};
    use tokio_rustls::TlsConnector;

    use super::TlsFiles;

    /// A self-signed certificate for `localhost` valid until the start of `year`.
    pub fn pair_until(year: i32) -> TestPair {
        pair_valid(1975, year)
    }

    /// A self-signed certificate for `localhost` valid from the start of `from` to the
    /// start of `until`.
    pub fn pair_valid(from: i32, until: i32) -> TestPair {
        let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        params.not_before = rcgen::date_time_ymd(from, 1, 1);
        params.not_after = rcgen::date_time_ymd(until, 1, 1);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        TestPair { cert_pem: cert.pem(), key_pem: key.serialize_pem(), cert_der: cert.der().clone() }
    }

    /// A self-signed certificate for `localhost` and its key, as PEM and the
    /// certificate's DER.
    pub struct TestPair {
        pub cert_pem: String,
        pub key_pem: String,
        pub cert_der: CertificateDer<'static>,
    }

    pub fn pair() -> TestPair {
        let made = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        TestPair {
            cert_pem: made.cert.pem(),
            key_pem: made.signing_key.serialize_pem(),
            cert_der: made.cert.der().clone(),
        }
    }

    /// Writes `pair` as `cert.pem` and `key.pem` in `dir`.
    pub fn write(dir: &Path, pair: &TestPair) -> TlsFiles {
        let files = TlsFiles { cert_file: dir.join("cert.pem"), key_file: dir.join("key.pem") };
        std::fs::write(&files.cert_file, &pair.cert_pem).unwrap();
        std::fs::write(&files.key_file, &pair.key_pem).unwrap();
        files
    }

    /// A client that trusts `trusted` and offers ALPN `alpn` (none when empty).
    pub fn client(trusted: &[&TestPair], alpn: &[&[u8]]) -> TlsConnector {
        let mut roots = rustls::RootCertStore::empty();
        for p in trusted {
            roots.add(p.cert_der.clone()).unwrap();
        }
        let mut config =
            rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots)
                .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        TlsConnector::from(Arc::new(config))
    }

    pub fn localhost() -> ServerName<'static> {
        ServerName::try_from("localhost").unwrap()
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::testing::{TestPair, client, localhost, pair, write};
    use super::*;

    /// One handshake against `tls` over an in-memory pipe: the leaf certificate the
    /// client was shown, and both ends (to exchange bytes after), or the error.
    async fn handshake(
        tls: &ListenerTls,
        trusted: &[&TestPair],
        alpn: &[&[u8]],
    ) -> Result<
        (
            CertificateDer<'static>,
            tokio_rustls::client::TlsStream<tokio::io::DuplexStream>,
            tokio_rustls::server::TlsStream<tokio::io::DuplexStream>,
        ),
        String,
    > {
        let (near, far) = tokio::io::duplex(64 * 1024);
        let acceptor = tls.acceptor().clone();
        let server = tokio::spawn(async move { acceptor.accept(far).await });
        let client = client(trusted, alpn).connect(localhost(), near).await.map_err(|e| e.to_string());
        let server = server.await.unwrap().map_err(|e| e.to_string());
        let (client, server) = (client?, server?);
        let leaf = client.get_ref().1.peer_certificates().unwrap()[0].clone();
        Ok((leaf, client, server))
    }

    #[tokio::test]
    async fn a_reload_serves_the_new_pair_from_the_next_handshake_and_open_connections_keep_theirs() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (pair(), pair());
        let tls = ListenerTls::new(write(dir.path(), &a), "test").unwrap();
        let (leaf, mut client, mut server) = handshake(&tls, &[&a, &b], &[]).await.unwrap();
        assert_eq!(leaf, a.cert_der);
        let loaded_before = tls.view().loaded_at_unix_ms;

        write(dir.path(), &b);
        tls.reload().unwrap();
        let (leaf, ..) = handshake(&tls, &[&a, &b], &[]).await.unwrap();
        assert_eq!(leaf, b.cert_der, "the handshake after the reload was shown the old certificate");
        let view = tls.view();
        assert!(view.loaded_at_unix_ms >= loaded_before && view.reload_failed.is_none(), "{view:?}");
        // A client that trusts only the old certificate now fails.
        assert!(handshake(&tls, &[&a], &[]).await.is_err());

        // The connection made before the reload still carries bytes.
        client.write_all(b"ping").await.unwrap();
        client.flush().await.unwrap();
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
    }

    #[tokio::test]
    async fn a_reload_that_fails_keeps_the_pair_served_before_and_says_why_until_one_loads() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (pair(), pair());
        let files = write(dir.path(), &a);
        let tls = ListenerTls::new(files.clone(), "test").unwrap();

        // b's certificate with a's key: half a rotation, as a copy interrupted leaves it.
        std::fs::write(&files.cert_file, &b.cert_pem).unwrap();
        let e = tls.reload().unwrap_err();
        assert_eq!(e.file, TlsFile::Key, "{e}");
        assert!(e.message.contains("is not the private key of the first certificate"), "{e}");
        let (leaf, ..) = handshake(&tls, &[&a, &b], &[]).await.unwrap();
        assert_eq!(leaf, a.cert_der, "a failed reload changed what is served");
        let failure = tls.view().reload_failed.expect("the status does not say the reload failed");
        assert!(failure.error.starts_with("key_file: "), "{failure:?}");

        // The rest of the rotation: the next reload loads, and the failure is cleared.
        std::fs::write(&files.key_file, &b.key_pem).unwrap();
        tls.reload().unwrap();
        assert_eq!(handshake(&tls, &[&a, &b], &[]).await.unwrap().0, b.cert_der);
        assert_eq!(tls.view().reload_failed, None);
    }

    #[test]
    fn a_load_that_fails_names_the_file_at_fault() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (pair(), pair());
        let good = write(dir.path(), &a);
        let other = |name: &str, text: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, text).unwrap();
            p
        };
        let cases: Vec<(TlsFiles, TlsFile, &str)> = vec![
            (TlsFiles { cert_file: dir.path().join("absent.pem"), ..good.clone() }, TlsFile::Cert, "cannot be read"),
            (TlsFiles { cert_file: other("empty.pem", ""), ..good.clone() }, TlsFile::Cert, "holds no certificate"),
            // The key file given as the certificate: PEM, but no certificate in it.
            (TlsFiles { cert_file: good.key_file.clone(), ..good.clone() }, TlsFile::Cert, "holds no certificate"),
            (
                TlsFiles {
                    cert_file: other(
                        "garbage.pem",
                        "-----BEGIN CERTIFICATE-----\nAAECAwQFBgcICQ==\n-----END CERTIFICATE-----\n",
                    ),
                    ..good.clone()
                },
                TlsFile::Cert,
                "certificate 1 in",
            ),
            // A good leaf, then a block that is no certificate: a client parses the
            // whole chain, and would refuse the handshake.
            (
                TlsFiles {
                    cert_file: other(
                        "broken-chain.pem",
                        &format!(
                            "{}-----BEGIN CERTIFICATE-----\nAAECAwQFBgcICQ==\n-----END CERTIFICATE-----\n",
                            a.cert_pem
                        ),
                    ),
                    ..good.clone()
                },
                TlsFile::Cert,
                "certificate 2 in",
            ),
            // The wrong file: bounded, however large (or endless, as /dev/zero).
            (
                TlsFiles { cert_file: other("huge.pem", &"A".repeat(2 << 20)), ..good.clone() },
                TlsFile::Cert,
                "larger than",
            ),
            (
                TlsFiles { key_file: other("huge-key.pem", &"A".repeat(2 << 20)), ..good.clone() },
                TlsFile::Key,
                "larger than",
            ),
            (TlsFiles { key_file: good.cert_file.clone(), ..good.clone() }, TlsFile::Key, "holds no private key"),
            (TlsFiles { key_file: dir.path().join("absent-key.pem"), ..good.clone() }, TlsFile::Key, "cannot be read"),
            (
                TlsFiles { key_file: other("b-key.pem", &b.key_pem), ..good.clone() },
                TlsFile::Key,
                "is not the private key",
            ),
        ];
        for (files, file, says) in cases {
            let e = load(&files).expect_err(&format!("{files:?} loaded"));
            assert_eq!(e.file, file, "{files:?}: {e}");
            assert!(e.message.contains(says), "{files:?}: {e}");
        }
        assert!(load(&good).is_ok());
    }

    /// A chain whose certificates do not link, or a lone certificate that is not
    /// self-signed, is warned of; a self-signed one and a chain in order are not.
    #[test]
    fn a_chain_clients_may_not_verify_is_warned_of() {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let ca = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            let key = KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            (params, key, cert)
        };
        let (ca_params, ca_key, ca_cert) = ca("test ca");
        let (_, _, other_ca) = ca("other ca");
        let leaf = CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .signed_by(&KeyPair::generate().unwrap(), &Issuer::from_params(&ca_params, &ca_key))
            .unwrap();
        let (leaf, ca_cert, other_ca) = (leaf.der().clone(), ca_cert.der().clone(), other_ca.der().clone());
        assert_eq!(chain_warning(std::slice::from_ref(&testing::pair().cert_der)), None);
        assert_eq!(chain_warning(&[leaf.clone(), ca_cert.clone()]), None);
        let alone = chain_warning(std::slice::from_ref(&leaf)).expect("a warning");
        assert!(alone.contains("not self-signed"), "{alone}");
        let unlinked = chain_warning(&[leaf, other_ca]).expect("a warning");
        assert!(unlinked.starts_with("certificate 2 of the chain is not the issuer of certificate 1"), "{unlinked}");
    }

    /// A certificate's validity is read from both its ends, the served one's too.
    #[test]
    fn a_certificates_validity_is_read_from_both_its_ends() {
        use super::testing::pair_valid;
        let dir = tempfile::tempdir().unwrap();
        let tls = ListenerTls::new(write(dir.path(), &pair_valid(2100, 2101)), "test").unwrap();
        // 2100-01-01T00:00:00Z and 2101-01-01T00:00:00Z.
        assert_eq!(
            validity(&tls.served()),
            Some(Validity { not_before_unix_secs: 4_102_444_800, not_after_unix_secs: 4_133_980_800 })
        );
    }

    /// The served certificate's expiry is read from it, and a reload reads the new one's.
    #[test]
    fn the_served_certificates_expiry_is_read_and_follows_a_reload() {
        use super::testing::pair_until;
        let dir = tempfile::tempdir().unwrap();
        let tls = ListenerTls::new(write(dir.path(), &pair_until(2030)), "test").unwrap();
        // 2030-01-01T00:00:00Z and 2031-01-01T00:00:00Z.
        assert_eq!(tls.view().expires_at_unix_secs, Some(1_893_456_000));
        write(dir.path(), &pair_until(2031));
        tls.reload().unwrap();
        assert_eq!(tls.view().expires_at_unix_secs, Some(1_924_992_000));
    }

    /// A reload whose file read does not return (a certificate on a mount that hangs;
    /// here a FIFO no one writes) never holds the status view: `/status` reads it. With
    /// the read under the view's lock, every `/status` waited for the mount, each on an
    /// async worker.
    #[test]
    fn a_reload_stuck_reading_its_files_does_not_hold_the_status_view() {
        let dir = tempfile::tempdir().unwrap();
        let files = write(dir.path(), &pair());
        let tls = ListenerTls::new(files.clone(), "test").unwrap();
        std::fs::remove_file(&files.cert_file).unwrap();
        let status = std::process::Command::new("mkfifo").arg(&files.cert_file).status().expect("mkfifo");
        assert!(status.success());
        let reloading = tls.clone();
        let reload = std::thread::spawn(move || reloading.reload());
        std::thread::sleep(std::time::Duration::from_millis(200));
        let (tx, rx) = std::sync::mpsc::channel();
        let viewing = tls.clone();
        std::thread::spawn(move || tx.send(viewing.view()).unwrap());
        let view = rx.recv_timeout(std::time::Duration::from_secs(5));
        // Let the stuck read end: a writer that opens the FIFO and closes it at once.
        drop(std::fs::OpenOptions::new().write(true).open(&files.cert_file).unwrap());
        assert!(reload.join().unwrap().is_err(), "an empty certificate file loaded");
        assert!(view.is_ok(), "the status view waited for a reload stuck reading its files");
    }

    /// The listeners speak HTTP/1.1 alone: a client that offers only HTTP/2 is refused at
    /// the handshake rather than sent HTTP/1.1 it cannot read; one that offers both, or
    /// none, is served.
    #[tokio::test]
    async fn alpn_offers_http_1_1_alone() {
        let dir = tempfile::tempdir().unwrap();
        let a = pair();
        let tls = ListenerTls::new(write(dir.path(), &a), "test").unwrap();
        assert!(handshake(&tls, &[&a], &[b"h2"]).await.is_err());
        let (_, client, _) = handshake(&tls, &[&a], &[b"h2", b"http/1.1"]).await.unwrap();
        assert_eq!(client.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        assert!(handshake(&tls, &[&a], &[]).await.is_ok());
    }
}
