//! vnatd's persistent state: the host identity key and the pinned peer keys,
//! written atomically (temp file, fsync, rename, fsync of the directory) so
//! a crash never leaves a torn file.

use std::{
    collections::BTreeMap,
    fs,
    io::Write,
    net::IpAddr,
    os::unix::fs::{OpenOptionsExt, PermissionsExt},
    path::{Path, PathBuf},
};

use rand_core::{OsRng, RngCore};

/// Keys are written as 64 hex digits everywhere (`peers.json`, `vnatctl peers`).
pub use crate::vcmp::crypto::{key_hex, parse_key_hex};

/// Errors of the state files.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot write {path}: {source}")]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a 32-byte key; move it away to have vnatd make a new identity (peers will see a changed key)")]
    BadKey { path: PathBuf },
    #[error("{path} is readable by others (mode {mode:o}); it holds a secret key: chmod 600 it")]
    Exposed { path: PathBuf, mode: u32 },
    #[error("{path} is not valid peer state: {reason}")]
    BadPeers { path: PathBuf, reason: String },
}

/// Write `bytes` to `path` atomically with mode 0600, on disk when this
/// returns.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    write_replacing(path, bytes, true)
}

/// [`write_atomic`] without waiting for the disk: for state that only has
/// to outlive the process, not the machine (two fsyncs cost a millisecond
/// or more, which a move must not wait for). After a power loss the file
/// may be missing or empty.
pub fn write_atomic_unsynced(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
    write_replacing(path, bytes, false)
}

fn write_replacing(path: &Path, bytes: &[u8], sync: bool) -> Result<(), StateError> {
    let err = |source| StateError::Write {
        path: path.to_path_buf(),
        source,
    };
    let tmp = path.with_extension("tmp");
    // A leftover of a crash, or something planted: remove it (a link is
    // removed, not followed) and create the file anew, refusing to follow
    // or reuse whatever appears there meanwhile (O_EXCL, O_NOFOLLOW).
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o600)
        .open(&tmp)
        .map_err(err)?;
    f.write_all(bytes).map_err(err)?;
    if sync {
        f.sync_all().map_err(err)?;
    }
    drop(f);
    fs::rename(&tmp, path).map_err(err)?;
    if let (true, Some(dir)) = (sync, path.parent()) {
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(err)?;
    }
    Ok(())
}

/// The host's x25519 identity secret, made on first start.
pub fn load_or_create_identity(state_dir: &Path) -> Result<[u8; 32], StateError> {
    let path = state_dir.join("identity.key");
    match fs::read(&path) {
        Ok(bytes) => {
            let mode = fs::metadata(&path)
                .map_err(|source| StateError::Read {
                    path: path.clone(),
                    source,
                })?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                return Err(StateError::Exposed {
                    path,
                    mode: mode & 0o777,
                });
            }
            bytes.try_into().map_err(|_| StateError::BadKey { path })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut key = [0u8; 32];
            OsRng.fill_bytes(&mut key);
            write_atomic(&path, &key)?;
            Ok(key)
        }
        Err(source) => Err(StateError::Read { path, source }),
    }
}

/// Peer host keys pinned on first use (or pre-configured), by address.
#[derive(Debug, Default)]
pub struct PeerStore {
    path: PathBuf,
    /// Host keys this host paired with, and the address each last paired
    /// from (for `vnatctl peers`; a key is never tied to its address).
    pub peers: BTreeMap<[u8; 32], IpAddr>,
}

impl PeerStore {
    /// `peers.json`: `{"<key hex>": "<address>"}`. The format of vnatd
    /// before identity by key, `{"<address>": "<key hex>"}`, is read too.
    pub fn load(state_dir: &Path) -> Result<PeerStore, StateError> {
        let path = state_dir.join("peers.json");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(PeerStore {
                    path,
                    peers: BTreeMap::new(),
                })
            }
            Err(source) => return Err(StateError::Read { path, source }),
        };
        let raw: BTreeMap<String, String> =
            serde_json::from_str(&text).map_err(|e| StateError::BadPeers {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let mut peers = BTreeMap::new();
        for (a, b) in raw {
            let (key, ip) = match (parse_key_hex(&a), b.parse::<IpAddr>()) {
                (Some(k), Ok(ip)) => (k, ip),
                _ => match (a.parse::<IpAddr>(), parse_key_hex(&b)) {
                    (Ok(ip), Some(k)) => (k, ip),
                    _ => {
                        return Err(StateError::BadPeers {
                            path: path.clone(),
                            reason: format!(
                                "entry {a:?}: {b:?} is not a 64-hex-digit key and an address"
                            ),
                        })
                    }
                },
            };
            peers.insert(key, ip);
        }
        Ok(PeerStore { path, peers })
    }

    /// Remember that the host `key` paired from `ip`.
    pub fn remember(&mut self, ip: IpAddr, key: [u8; 32]) -> Result<(), StateError> {
        if self.peers.get(&key) == Some(&ip) {
            return Ok(());
        }
        self.peers.insert(key, ip);
        self.save()
    }

    /// Forget the host `key`; false if it was not known.
    pub fn forget(&mut self, key: &[u8; 32]) -> Result<bool, StateError> {
        if self.peers.remove(key).is_none() {
            return Ok(false);
        }
        self.save().map(|()| true)
    }

    fn save(&self) -> Result<(), StateError> {
        let raw: BTreeMap<String, String> = self
            .peers
            .iter()
            .map(|(k, ip)| (key_hex(k), ip.to_string()))
            .collect();
        let text = serde_json::to_string_pretty(&raw).map_err(|e| StateError::BadPeers {
            path: self.path.clone(),
            reason: e.to_string(),
        })?;
        write_atomic(&self.path, text.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_made_once_private_and_stable() {
        let dir = tempfile::tempdir().unwrap();
        let a = load_or_create_identity(dir.path()).unwrap();
        let b = load_or_create_identity(dir.path()).unwrap();
        assert_eq!(a, b);
        let mode = fs::metadata(dir.path().join("identity.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        fs::set_permissions(
            dir.path().join("identity.key"),
            fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        assert!(matches!(
            load_or_create_identity(dir.path()),
            Err(StateError::Exposed { .. })
        ));
        fs::write(dir.path().join("identity.key"), b"short").unwrap();
        fs::set_permissions(
            dir.path().join("identity.key"),
            fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        assert!(matches!(
            load_or_create_identity(dir.path()),
            Err(StateError::BadKey { .. })
        ));
    }

    #[test]
    fn known_peers_survive_a_reload_and_bad_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = PeerStore::load(dir.path()).unwrap();
        let ip: IpAddr = "198.18.3.2".parse().unwrap();
        s.remember(ip, [7; 32]).unwrap();
        // A second host behind the same address is another entry.
        s.remember(ip, [8; 32]).unwrap();
        let mut s2 = PeerStore::load(dir.path()).unwrap();
        assert_eq!(s2.peers.get(&[7; 32]), Some(&ip));
        assert_eq!(s2.peers.get(&[8; 32]), Some(&ip));
        assert!(s2.forget(&[7; 32]).unwrap());
        assert!(!s2.forget(&[7; 32]).unwrap());
        let s3 = PeerStore::load(dir.path()).unwrap();
        assert_eq!(s3.peers.len(), 1);
        // The format before identity by key (address to key) still loads.
        fs::write(
            dir.path().join("peers.json"),
            format!(r#"{{"198.18.3.2": "{}"}}"#, "07".repeat(32)),
        )
        .unwrap();
        let old = PeerStore::load(dir.path()).unwrap();
        assert_eq!(old.peers.get(&[7; 32]), Some(&ip));
        fs::write(dir.path().join("peers.json"), r#"{"198.18.3.2": "zz"}"#).unwrap();
        assert!(matches!(
            PeerStore::load(dir.path()),
            Err(StateError::BadPeers { .. })
        ));
    }
}
