//! Location records in etcd (issue 34, `location_store = "etcd"`): what
//! the protocol core asks of its external store (`vcmp::extstore`), done
//! with etcd's v3 API.
//!
//! Layout: `/vnat/loc/<writer's host key, hex>/<locator, hex>`, one key per
//! connection end, its value the signed record as the core made it. So
//! `etcdctl get --prefix /vnat/loc/<key>/` lists one host's records and
//! `etcdctl del --prefix` removes them, and an etcd role may let each host
//! write under its own prefix only. Records expire through a lease of the
//! embedded store's record lifetime. etcd is trusted to store, not to
//! vouch: the core checks every record it is given with the connection's
//! keys and refuses one older than what it already followed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, Identity, PutOptions, TlsOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio::sync::Mutex;

use super::config::store::EtcdSettings;
use crate::vcmp::extstore::{StoreItem, Wanted};

mod tls;

/// Where vnat's records are.
pub const PREFIX: &str = "/vnat/loc/";

/// How long one etcd call may take before the step it serves counts as
/// failed (the chain then goes on without the store).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// How long one member has to answer before the next is tried: a member
/// that is down refuses at once, one cut off from the others (no quorum)
/// or from us does not answer.
const MEMBER_TIMEOUT: Duration = Duration::from_millis(900);

/// How long asking a member why TLS failed may take (a handshake and one
/// read; only after a call failed below gRPC).
const DIAGNOSE_TIMEOUT: Duration = Duration::from_millis(300);

/// A record's lifetime: the embedded store's (`vcmp::location`).
fn record_ttl() -> Duration {
    crate::vcmp::location::StoreLimits::default().ttl
}

/// A lease is used for this long after it was granted, so its records live
/// between the record lifetime and this much more, and a move rarely pays
/// for a grant.
const LEASE_REUSE: Duration = Duration::from_secs(300);

/// The key of one record.
pub fn record_key(host: &[u8; 32], locator: &[u8]) -> String {
    format!("{PREFIX}{}/{}", hex(host), hex(locator))
}

/// The prefix of one host's records.
pub fn host_prefix(host: &[u8; 32]) -> String {
    format!("{PREFIX}{}/", hex(host))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[derive(Debug, thiserror::Error)]
pub enum EtcdError {
    #[error("cannot read {what} {}: {source}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the etcd password file {} is empty", path.display())]
    EmptyPassword { path: PathBuf },
    #[error("{what} {} can be read by other users (mode {mode:04o}); it is a secret: chmod 600 {}", path.display(), path.display())]
    Exposed {
        what: &'static str,
        path: PathBuf,
        mode: u32,
    },
    #[error("{what} {} holds no {want}", path.display())]
    NotPem {
        what: &'static str,
        path: PathBuf,
        want: &'static str,
    },
    #[error("{what} {}: {why}", path.display())]
    BadTlsFile {
        what: &'static str,
        path: PathBuf,
        why: String,
    },
    #[error("cannot set up TLS for etcd: {0}")]
    TlsSetup(String),
    #[error("etcd refused the login of user {user} (check etcd_user and the password in etcd_password_file)")]
    Login { user: String },
    #[error("etcd denied access to {PREFIX} (the role of etcd_user, or without one of the client certificate's CN, needs readwrite on that prefix)")]
    Denied,
    #[error("etcd refused this host's TLS client certificate (etcd_cert must be signed by a CA in the members' --trusted-ca-file): {detail}")]
    ClientCert { detail: String },
    #[error("etcd's TLS certificate is not one etcd_ca vouches for: {detail}")]
    ServerCert { detail: String },
    #[error("etcd: {}", describe(.0))]
    Client(#[from] etcd_client::Error),
    #[error("no etcd member answered within {} ms", .0.as_millis())]
    Timeout(Duration),
    #[error("cannot start the async runtime to reach etcd: {0}")]
    Runtime(#[source] std::io::Error),
}

/// What etcd-client's error says, with its causes: its transport errors
/// say only "transport error" and keep the reason (a refused connection,
/// a TLS alert) in their sources.
fn describe(e: &etcd_client::Error) -> String {
    use std::error::Error as _;
    let (mut text, mut source) = match e {
        etcd_client::Error::GRpcStatus(s) => (s.message().to_string(), s.source()),
        etcd_client::Error::TransportError(t) => (t.to_string(), t.source()),
        other => (other.to_string(), None),
    };
    while let Some(s) = source {
        let t = s.to_string();
        if !text.contains(&t) {
            text = format!("{text}: {t}");
        }
        source = s.source();
    }
    text
}

/// gRPC status codes (grpc/doc/statuscodes.md), as etcd answers them.
const GRPC_INVALID_ARGUMENT: i32 = 3;
const GRPC_PERMISSION_DENIED: i32 = 7;

impl EtcdError {
    /// A client error as what the user must fix, where it is a refusal
    /// rather than etcd not answering: the login, the role, either side's
    /// certificate.
    fn explained(self, user: Option<&str>) -> EtcdError {
        let EtcdError::Client(e) = &self else {
            return self;
        };
        let detail = describe(e);
        if let etcd_client::Error::GRpcStatus(s) = e {
            match i32::from(s.code()) {
                // etcd's ErrGRPCAuthFailed.
                GRPC_INVALID_ARGUMENT if s.message().contains("authentication failed") => {
                    return EtcdError::Login {
                        user: user.unwrap_or_default().to_string(),
                    }
                }
                // etcd's ErrGRPCPermissionDenied.
                GRPC_PERMISSION_DENIED => return EtcdError::Denied,
                _ => {}
            }
        }
        // rustls's words: the member's alert about our certificate, or
        // our verdict on the member's.
        if ["BadCertificate", "CertificateRequired", "UnknownCA"]
            .iter()
            .any(|a| detail.contains(&format!("received fatal alert: {a}")))
        {
            EtcdError::ClientCert { detail }
        } else if detail.contains("invalid peer certificate") {
            EtcdError::ServerCert { detail }
        } else {
            self
        }
    }

    /// Whether the call failed below gRPC (the connection, TLS), where
    /// [`tls::diagnose`] may tell more.
    fn transport_failure(&self) -> bool {
        use std::error::Error as _;
        match self {
            EtcdError::Client(etcd_client::Error::TransportError(_)) => true,
            EtcdError::Client(etcd_client::Error::GRpcStatus(s)) => s.source().is_some(),
            _ => false,
        }
    }

    /// Whether etcd answered but refused: a setting must change, waiting
    /// does not help.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            EtcdError::Login { .. }
                | EtcdError::Denied
                | EtcdError::ClientCert { .. }
                | EtcdError::ServerCert { .. }
        )
    }
}

/// vnatd's connections to etcd, one per member: made when first needed
/// and again after a failure, so that etcd being down at start delays
/// nothing. A call goes to the member that answered last and, if that one
/// fails, to the next, each within [`MEMBER_TIMEOUT`]: one member down
/// costs a move nothing (etcd-client's own balancing would send some calls
/// to the dead member and fail them).
pub struct EtcdStore {
    endpoints: Vec<String>,
    options: ConnectOptions,
    clients: std::sync::Mutex<Vec<Option<Client>>>,
    preferred: std::sync::atomic::AtomicUsize,
    lease: Mutex<Option<(i64, Instant)>>,
    /// `etcd_user`, for what a refused login says.
    user: Option<String>,
    /// The TLS files as rustls takes them, to tell why TLS failed.
    tls: Option<tls::Files>,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|source| EtcdError::File {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// [`read`] for a file holding a secret (the password, the client's private
/// key): refused if group or others may read or write it, as ssh refuses an
/// exposed private key, so that a mistake is found before the secret leaks
/// further rather than never.
fn read_secret(what: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path)
        .map_err(|source| EtcdError::File {
            what,
            path: path.to_path_buf(),
            source,
        })?
        .permissions()
        .mode();
    if mode & 0o077 != 0 {
        return Err(EtcdError::Exposed {
            what,
            path: path.to_path_buf(),
            mode: mode & 0o7777,
        });
    }
    read(what, path)
}

impl EtcdStore {
    /// Read the TLS files and the password now: a bad one stops vnatd at
    /// start, in one sentence.
    pub fn new(s: &EtcdSettings) -> Result<EtcdStore, EtcdError> {
        // A login token expires after etcd's --auth-token-ttl unused (300 s
        // by default): a call on a connection kept longer logs in again
        // instead of failing. (A move reconnects from the host's new
        // addresses anyway, `forget_connections`; a call with them
        // unchanged does not.)
        let mut options = ConnectOptions::new()
            .with_connect_timeout(MEMBER_TIMEOUT / 2)
            .with_timeout(MEMBER_TIMEOUT)
            .with_auto_token_refresh(true);
        if let (Some(user), Some(pw)) = (&s.user, &s.password_file) {
            let text = read_secret("the etcd password file", pw)?;
            let password = String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .to_string();
            if password.is_empty() {
                return Err(EtcdError::EmptyPassword { path: pw.clone() });
            }
            options = options.with_user(user.clone(), password);
        }
        let mut files = None;
        if s.tls() {
            let mut tls = TlsOptions::new();
            let ca = match &s.ca {
                Some(p) => Some((p.as_path(), read("the etcd CA", p)?)),
                None => None,
            };
            let identity = match (&s.cert, &s.key) {
                (Some(c), Some(k)) => Some((
                    (c.as_path(), read("the etcd client certificate", c)?),
                    (k.as_path(), read_secret("the etcd client key", k)?),
                )),
                _ => None,
            };
            // Their contents checked now, so that a wrong file stops vnatd
            // at start rather than failing every move.
            files = Some(tls::Files::check(
                ca.as_ref().map(tls::Pem::of),
                identity
                    .as_ref()
                    .map(|(c, k)| (tls::Pem::of(c), tls::Pem::of(k))),
            )?);
            if let Some((_, pem)) = ca {
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            if let Some(((_, cert), (_, key))) = identity {
                tls = tls.identity(Identity::from_pem(cert, key));
            }
            options = options.with_tls(tls);
        }
        Ok(EtcdStore {
            endpoints: s.endpoints.clone(),
            options,
            clients: std::sync::Mutex::new(vec![None; s.endpoints.len()]),
            preferred: Default::default(),
            lease: Mutex::new(None),
            user: s.user.clone(),
            tls: files,
        })
    }

    /// The client of member `i`, connected (and logged in) if need be.
    async fn client(&self, i: usize) -> Result<Client, EtcdError> {
        let cached = self
            .clients
            .lock()
            .ok()
            .and_then(|v| v.get(i).cloned().flatten());
        if let Some(c) = cached {
            return Ok(c);
        }
        let made = Client::connect([&self.endpoints[i]], Some(self.options.clone())).await?;
        if let Some(slot) = self.clients.lock().ok().as_mut().and_then(|v| v.get_mut(i)) {
            *slot = Some(made.clone());
        }
        Ok(made)
    }

    /// After member `i` failed, the next call to it connects again.
    fn forget_client(&self, i: usize) {
        if let Some(slot) = self.clients.lock().ok().as_mut().and_then(|v| v.get_mut(i)) {
            *slot = None;
        }
    }

    /// This host's addresses changed: its connections may be from an
    /// address it no longer has, where they would hang until a member's
    /// timeout; the next call connects from where the host is now.
    pub fn forget_connections(&self) {
        if let Ok(mut v) = self.clients.lock() {
            v.iter_mut().for_each(|c| *c = None);
        }
    }

    /// Run `op` at the members in turn, from the one that answered last,
    /// until one answers; the whole within [`CALL_TIMEOUT`].
    async fn at_some_member<T, F, Fut>(&self, op: F) -> Result<T, EtcdError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, EtcdError>>,
    {
        use std::sync::atomic::Ordering;
        let n = self.endpoints.len().max(1);
        let first = self.preferred.load(Ordering::Relaxed);
        let deadline = tokio::time::Instant::now() + CALL_TIMEOUT;
        let mut last = EtcdError::Timeout(CALL_TIMEOUT);
        for k in 0..n {
            let i = (first + k) % n;
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            if left.is_zero() {
                break;
            }
            let attempt = async {
                let c = self.client(i).await?;
                op(c).await
            };
            match tokio::time::timeout(MEMBER_TIMEOUT.min(left), attempt).await {
                Ok(Ok(v)) => {
                    self.preferred.store(i, Ordering::Relaxed);
                    return Ok(v);
                }
                Ok(Err(e)) => {
                    let e = e.explained(self.user.as_deref());
                    last = match &self.tls {
                        Some(files) if e.transport_failure() => {
                            let left =
                                deadline.saturating_duration_since(tokio::time::Instant::now());
                            tls::diagnose(&self.endpoints[i], files, DIAGNOSE_TIMEOUT.min(left))
                                .await
                                .unwrap_or(e)
                        }
                        _ => e,
                    };
                }
                Err(_) => last = EtcdError::Timeout(MEMBER_TIMEOUT.min(left)),
            }
            self.forget_client(i);
        }
        Err(last)
    }

    async fn lease(&self, client: &mut Client) -> Result<i64, EtcdError> {
        let mut l = self.lease.lock().await;
        if let Some((id, at)) = *l {
            if at.elapsed() < LEASE_REUSE {
                return Ok(id);
            }
        }
        let ttl = (record_ttl() + LEASE_REUSE).as_secs() as i64;
        let id = client.lease_grant(ttl, None).await?.id();
        *l = Some((id, Instant::now()));
        Ok(id)
    }

    /// Connect to a member and take a lease ahead of the first move, so
    /// that the move does not pay for them (TCP, HTTP/2, the login, the
    /// grant: a few round trips). Failing changes nothing: the first move
    /// tries again.
    pub async fn warm_up(&self) -> Result<(), EtcdError> {
        self.at_some_member(|mut client| async move { self.lease(&mut client).await.map(|_| ()) })
            .await
    }

    /// Keep `items`, each under its writer's key, with a lease: in
    /// transactions of at most [`TXN_OPS_MAX`] operations, so that a mass
    /// move stays within etcd's limits (`--max-txn-ops`, 128 by default,
    /// and 1.5 MiB a request).
    pub async fn put(&self, items: &[StoreItem]) -> Result<(), EtcdError> {
        self.at_some_member(|mut client| async move {
            let lease = self.lease(&mut client).await?;
            for chunk in items.chunks(TXN_OPS_MAX) {
                let ops: Vec<TxnOp> = chunk
                    .iter()
                    .map(|i| {
                        TxnOp::put(
                            record_key(&i.host, &i.locator),
                            i.value.clone(),
                            Some(PutOptions::new().with_lease(lease)),
                        )
                    })
                    .collect();
                client.txn(Txn::new().and_then(ops)).await?;
            }
            Ok(())
        })
        .await
    }

    /// The values stored for `wanted` (those found).
    pub async fn get(&self, wanted: &[Wanted]) -> Result<Vec<Vec<u8>>, EtcdError> {
        self.at_some_member(|mut client| async move {
            let mut values = Vec::new();
            for chunk in wanted.chunks(TXN_OPS_MAX) {
                let ops: Vec<TxnOp> = chunk
                    .iter()
                    .map(|w| TxnOp::get(record_key(&w.host, &w.locator), None))
                    .collect();
                let r = client.txn(Txn::new().and_then(ops)).await?;
                for op in r.op_responses() {
                    if let TxnOpResponse::Get(g) = op {
                        values.extend(g.kvs().iter().map(|kv| kv.value().to_vec()));
                    }
                }
            }
            Ok(values)
        })
        .await
    }
}

/// `vnatd --check`'s word on etcd: read the files, then log in and read
/// vnat's prefix at some member as vnatd would, within [`CALL_TIMEOUT`]
/// (nothing is written). Blocks: for `vnatd --check`, outside any runtime.
pub fn check(s: &EtcdSettings) -> Result<(), EtcdError> {
    let store = EtcdStore::new(s)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(EtcdError::Runtime)?;
    rt.block_on(store.at_some_member(|mut client| async move {
        let only_count = GetOptions::new().with_prefix().with_count_only();
        client.get(PREFIX, Some(only_count)).await?;
        Ok(())
    }))
}

/// Operations in one etcd transaction: half etcd's default limit
/// (`--max-txn-ops` 128); 64 records of a few hundred bytes stay far below
/// its 1.5 MiB request limit too.
const TXN_OPS_MAX: usize = 64;

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    /// Settings with TLS files holding `ca` (none if empty) and `cert` (no
    /// key is needed to show what is refused).
    fn with_files(tag: &str, ca: &str, cert: &str) -> (EtcdSettings, PathBuf) {
        let dir = std::env::temp_dir().join(format!("vnat-etcd-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        for (name, text) in [("ca.pem", ca), ("client.pem", cert), ("client.key", "")] {
            std::fs::write(dir.join(name), text).expect("writing a test file");
        }
        let key = std::fs::Permissions::from_mode(0o600);
        std::fs::set_permissions(dir.join("client.key"), key).expect("chmod 600");
        let s = EtcdSettings {
            endpoints: vec!["https://192.0.2.10:2379".into()],
            ca: (!ca.is_empty()).then(|| dir.join("ca.pem")),
            cert: Some(dir.join("client.pem")),
            key: Some(dir.join("client.key")),
            user: None,
            password_file: None,
        };
        (s, dir)
    }

    #[test]
    fn tls_files_that_hold_no_pem_stop_vnatd_at_start_in_one_sentence() {
        for (tag, ca, cert, want) in [
            ("ca", "not a certificate\n", "", "the etcd CA"),
            // A private key where the certificate belongs (files swapped).
            (
                "cert",
                "",
                "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n",
                "the etcd client certificate",
            ),
        ] {
            let (s, dir) = with_files(tag, ca, cert);
            let e = EtcdStore::new(&s).err().expect("refused").to_string();
            let _ = std::fs::remove_dir_all(&dir);
            assert!(e.starts_with(want), "{tag}: {e}");
            assert!(e.contains("holds no PEM certificate"), "{tag}: {e}");
            assert!(!e.contains('\n'), "one sentence: {e}");
        }
    }

    #[test]
    fn a_password_or_key_others_can_read_stops_vnatd_at_start() {
        let (mut s, dir) = with_files("exposed", "", "");
        let pw = dir.join("password");
        std::fs::write(&pw, "secret\n").expect("writing the password");
        s.user = Some("vnat".into());
        s.password_file = Some(pw.clone());
        let says = |s: &EtcdSettings| match EtcdStore::new(s) {
            Err(e) => e.to_string(),
            Ok(_) => "accepted".into(),
        };
        for (file, what) in [
            (&pw, "the etcd password file"),
            (&dir.join("client.key"), "the etcd client key"),
        ] {
            for mode in [0o644, 0o640, 0o604, 0o660] {
                std::fs::set_permissions(&pw, std::fs::Permissions::from_mode(0o600))
                    .expect("chmod");
                std::fs::set_permissions(file, std::fs::Permissions::from_mode(mode))
                    .expect("chmod");
                let e = says(&s);
                assert!(
                    e.starts_with(what)
                        && e.contains(&format!("mode {mode:04o}"))
                        && e.contains("chmod 600"),
                    "{what} at {mode:o}: {e}"
                );
            }
            std::fs::set_permissions(file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        }
        // Both private: what is refused next is the empty certificate, not
        // the modes.
        let e = says(&s);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!e.contains("read by other users"), "{e}");
    }

    #[test]
    fn one_hosts_records_share_a_prefix() {
        let host = [0xab; 32];
        let k = record_key(&host, &[1, 2, 3]);
        assert!(k.starts_with(&host_prefix(&host)));
        assert_eq!(k, format!("/vnat/loc/{}/010203", "ab".repeat(32)));
    }
}
