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
    Certificate, Client, ConnectOptions, Identity, PutOptions, TlsOptions, Txn, TxnOp,
    TxnOpResponse,
};
use tokio::sync::Mutex;

use super::config::store::EtcdSettings;
use crate::vcmp::extstore::{StoreItem, Wanted};

/// Where vnat's records are.
pub const PREFIX: &str = "/vnat/loc/";

/// How long one etcd call may take before the step it serves counts as
/// failed (the chain then goes on without the store).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// A record's lifetime: the embedded store's (`vcmp::location`).
fn record_ttl() -> Duration {
    crate::vcmp::location::StoreLimits::default().ttl
}

/// A lease is used for this long after it was granted, so its records live
/// between the record lifetime and this much more.
const LEASE_REUSE: Duration = Duration::from_secs(30);

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
    #[error("etcd: {0}")]
    Client(#[from] etcd_client::Error),
    #[error("no etcd member answered within {} ms", .0.as_millis())]
    Timeout(Duration),
}

/// vnatd's connection to etcd: made when first needed and again after a
/// failure (the members may all have been down), so that etcd being down
/// at start delays nothing.
pub struct EtcdStore {
    endpoints: Vec<String>,
    options: ConnectOptions,
    client: Mutex<Option<Client>>,
    lease: Mutex<Option<(i64, Instant)>>,
}

fn read(what: &'static str, path: &Path) -> Result<Vec<u8>, EtcdError> {
    std::fs::read(path).map_err(|source| EtcdError::File {
        what,
        path: path.to_path_buf(),
        source,
    })
}

impl EtcdStore {
    /// Read the TLS files and the password now: a bad one stops vnatd at
    /// start, in one sentence.
    pub fn new(s: &EtcdSettings) -> Result<EtcdStore, EtcdError> {
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CALL_TIMEOUT / 2)
            .with_timeout(CALL_TIMEOUT);
        if let (Some(user), Some(pw)) = (&s.user, &s.password_file) {
            let text = read("the etcd password file", pw)?;
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
        if s.tls() {
            let mut tls = TlsOptions::new();
            if let Some(ca) = &s.ca {
                tls = tls.ca_certificate(Certificate::from_pem(read("the etcd CA", ca)?));
            }
            if let (Some(cert), Some(key)) = (&s.cert, &s.key) {
                tls = tls.identity(Identity::from_pem(
                    read("the etcd client certificate", cert)?,
                    read("the etcd client key", key)?,
                ));
            }
            options = options.with_tls(tls);
        }
        Ok(EtcdStore {
            endpoints: s.endpoints.clone(),
            options,
            client: Mutex::new(None),
            lease: Mutex::new(None),
        })
    }

    async fn client(&self) -> Result<Client, EtcdError> {
        let mut c = self.client.lock().await;
        if let Some(c) = c.as_ref() {
            return Ok(c.clone());
        }
        let made = Client::connect(&self.endpoints, Some(self.options.clone())).await?;
        *c = Some(made.clone());
        Ok(made)
    }

    /// After a failure, the next call connects (and logs in) again.
    async fn forget_client(&self) {
        *self.client.lock().await = None;
        *self.lease.lock().await = None;
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

    async fn bounded<T>(
        &self,
        f: impl std::future::Future<Output = Result<T, EtcdError>>,
    ) -> Result<T, EtcdError> {
        let r = match tokio::time::timeout(CALL_TIMEOUT, f).await {
            Ok(r) => r,
            Err(_) => Err(EtcdError::Timeout(CALL_TIMEOUT)),
        };
        if r.is_err() {
            self.forget_client().await;
        }
        r
    }

    /// Keep `items`, each under its writer's key, with a lease.
    pub async fn put(&self, items: &[StoreItem]) -> Result<(), EtcdError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let lease = self.lease(&mut client).await?;
            let ops: Vec<TxnOp> = items
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
            Ok(())
        })
        .await
    }

    /// The values stored for `wanted` (those found).
    pub async fn get(&self, wanted: &[Wanted]) -> Result<Vec<Vec<u8>>, EtcdError> {
        self.bounded(async {
            let mut client = self.client().await?;
            let ops: Vec<TxnOp> = wanted
                .iter()
                .map(|w| TxnOp::get(record_key(&w.host, &w.locator), None))
                .collect();
            let r = client.txn(Txn::new().and_then(ops)).await?;
            let mut values = Vec::new();
            for op in r.op_responses() {
                if let TxnOpResponse::Get(g) = op {
                    values.extend(g.kvs().iter().map(|kv| kv.value().to_vec()));
                }
            }
            Ok(values)
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_hosts_records_share_a_prefix() {
        let host = [0xab; 32];
        let k = record_key(&host, &[1, 2, 3]);
        assert!(k.starts_with(&host_prefix(&host)));
        assert_eq!(k, format!("/vnat/loc/{}/010203", "ab".repeat(32)));
    }
}
