//! The sysctls vnat changes and their values from before. The values are
//! recorded in the state directory (`sysctl-saved.json`) just before vnat
//! first changes them, so that a clean stop and `vnatd --cleanup` can put
//! them back, also after a crash in between. Only the keys vnat writes
//! are ever written back, whatever else the file says.

use std::{
    collections::BTreeMap,
    io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use super::{net, KernelDatapath};
use crate::datapath::{DatapathError, SysctlRestore, SysctlsAtStop};

/// The record's name in the state directory.
pub const RECORD_FILE: &str = "sysctl-saved.json";

/// Where vnatd records the sysctls' values for state directory `state_dir`.
pub fn record_path(state_dir: &Path) -> PathBuf {
    state_dir.join(RECORD_FILE)
}

/// What an IPv4 address kept on `lo` needs, and vnat's values.
/// arp_ignore=1: answer ARP only for addresses of the receiving interface;
/// arp_announce=2: never use a source address outside the interface's own
/// subnets in ARP. The kernel takes the larger of `all` and the
/// interface's value (`IN_DEV_ARP_IGNORE`, `IN_DEV_ARP_ANNOUNCE`), so
/// `all` is enough.
const ARP: [(&str, &str); 2] = [
    ("net.ipv4.conf.all.arp_ignore", "1"),
    ("net.ipv4.conf.all.arp_announce", "2"),
];

/// One key of the record.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Saved {
    /// Its value before vnat first set it.
    before: String,
    /// The value vnat set.
    set: String,
}

type Record = BTreeMap<String, Saved>;

fn proc_path(key: &str) -> PathBuf {
    Path::new("/proc/sys").join(key.replace('.', "/"))
}

fn kernel(what: String) -> impl FnOnce(io::Error) -> DatapathError {
    move |source| DatapathError::Kernel { what, source }
}

fn read(key: &str) -> Result<String, DatapathError> {
    std::fs::read_to_string(proc_path(key))
        .map(|v| v.trim().to_string())
        .map_err(kernel(format!("reading sysctl {key}")))
}

fn write(key: &str, value: &str) -> Result<(), DatapathError> {
    std::fs::write(proc_path(key), value).map_err(kernel(format!("setting sysctl {key}")))
}

fn load(path: &Path) -> Result<Record, DatapathError> {
    let what = || format!("reading {}", path.display());
    match std::fs::read(path) {
        // What a power loss can leave of a record written without a sync;
        // the values it held went back to the boot values with the power.
        Ok(bytes) if bytes.is_empty() => Ok(Record::new()),
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map_err(|e| kernel(what())(io::Error::new(io::ErrorKind::InvalidData, e))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Record::new()),
        Err(e) => Err(kernel(what())(e)),
    }
}

/// Add to the record at `path` the value of each of `keys` it does not
/// hold yet: the value from before vnat's first change, whatever vnat did
/// since.
fn remember(path: &Path, keys: &[(&str, &str)]) -> Result<(), DatapathError> {
    let mut record = load(path)?;
    let mut added = false;
    for (key, set) in keys {
        if !record.contains_key(*key) {
            let before = read(key)?;
            record.insert(
                key.to_string(),
                Saved {
                    before,
                    set: set.to_string(),
                },
            );
            added = true;
        }
    }
    if !added {
        return Ok(());
    }
    let what = || format!("recording sysctls in {}", path.display());
    let json =
        serde_json::to_vec_pretty(&record).map_err(|e| kernel(what())(io::Error::other(e)))?;
    // Not synced to disk: the record only has to outlive vnatd (a crash,
    // a restart), not the machine, whose sysctls go back to their boot
    // values with it; and it is written on the way to a move's first
    // message to the peer.
    crate::daemon::identity::write_atomic_unsynced(path, &json)
        .map_err(|e| kernel(what())(io::Error::other(e)))
}

/// Set the ARP sysctls an IPv4 address on `lo` needs, recording their
/// values first in `record` (None: no record, for tools and tests).
fn set_arp(record: Option<&Path>) -> Result<(), DatapathError> {
    if let Some(path) = record {
        // The address is what keeps a connection alive: a record that
        // cannot be written costs the values from before, not the move.
        if let Err(e) = remember(path, &ARP) {
            tracing::warn!(error = %e, "cannot record the ARP sysctls before changing them; they will not be put back");
        }
    }
    for (key, value) in ARP {
        write(key, value)?;
    }
    Ok(())
}

/// Whether `value` can be a value of the sysctls vnat writes (a small
/// number): the record lives in a file, and a sysctl takes what it is given.
fn plausible(value: &str) -> bool {
    !value.is_empty() && value.len() <= 4 && value.bytes().all(|b| b.is_ascii_digit())
}

/// Put back each sysctl the record at `path` holds that vnat writes, then
/// delete the record; None when there is no record. A key someone changed
/// since vnat set it keeps their value. On an error the record stays, for
/// the next try.
pub fn restore(path: &Path) -> Result<Option<Vec<SysctlRestore>>, DatapathError> {
    if !path.exists() {
        return Ok(None);
    }
    let record = load(path)?;
    let mut out = Vec::new();
    for (key, _) in ARP {
        let Some(saved) = record.get(key) else {
            continue;
        };
        let now = read(key)?;
        if now == saved.set && plausible(&saved.before) {
            write(key, &saved.before)?;
            out.push(SysctlRestore::PutBack {
                key: key.to_string(),
                value: saved.before.clone(),
            });
        } else if now == saved.before {
            out.push(SysctlRestore::PutBack {
                key: key.to_string(),
                value: now,
            });
        } else {
            out.push(SysctlRestore::LeftChanged {
                key: key.to_string(),
                value: now,
            });
        }
    }
    std::fs::remove_file(path).map_err(kernel(format!("removing {}", path.display())))?;
    Ok(Some(out))
}

impl KernelDatapath {
    /// Keep `a` on `lo` (`net::add_lo_addr`), with the ARP settings an
    /// IPv4 address there needs so that the host never answers for it or
    /// announces it on its other links.
    pub(super) fn add_lo_addr(&self, a: IpAddr) -> Result<(), DatapathError> {
        if a.is_ipv4() {
            set_arp(self.sysctl_record.as_deref())?;
        }
        net::add_lo_addr(a)
    }

    /// See [`crate::datapath::Datapath::restore_sysctls`].
    pub(super) fn sysctls_at_stop(&self) -> Result<SysctlsAtStop, DatapathError> {
        let Some(path) = self.sysctl_record.as_deref() else {
            return Ok(SysctlsAtStop::Unchanged);
        };
        if !path.exists() {
            return Ok(SysctlsAtStop::Unchanged);
        }
        // Ours by their tag, or by a translation's record for an untagged
        // one (`lo_ours`). IPv6 addresses need no ARP setting.
        let mut kept: std::collections::BTreeSet<IpAddr> = net::lo_addrs()?
            .into_iter()
            .filter(|(_, ours)| *ours)
            .map(|(a, _)| a)
            .collect();
        kept.extend(self.lo_ours.iter().copied());
        let lo_addresses = kept.iter().filter(|a| a.is_ipv4()).count();
        if lo_addresses > 0 {
            return Ok(SysctlsAtStop::Kept { lo_addresses });
        }
        Ok(restore(path)?.map_or(SysctlsAtStop::Unchanged, SysctlsAtStop::Restored))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_record_reads_back_and_refuses_unknown_fields() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = record_path(dir.path());
        assert_eq!(load(&path).expect("no record"), Record::new());
        let mut r = Record::new();
        r.insert(
            ARP[0].0.to_string(),
            Saved {
                before: "0".into(),
                set: "1".into(),
            },
        );
        std::fs::write(&path, serde_json::to_vec(&r).expect("json")).expect("write");
        assert_eq!(load(&path).expect("valid"), r);
        std::fs::write(
            &path,
            r#"{"net.ipv4.conf.all.arp_ignore": {"before": "0", "set": "1", "x": 1}}"#,
        )
        .expect("write");
        assert!(load(&path).is_err());
        // Empty, as a power loss can leave the unsynced write: no record
        // (the machine's sysctls are at their boot values), not an error
        // that would keep every later stop from putting anything back.
        std::fs::write(&path, b"").expect("write");
        assert_eq!(load(&path).expect("empty"), Record::new());
    }

    #[test]
    fn only_small_numbers_are_written_back() {
        assert!(plausible("0") && plausible("2"));
        for bad in ["", "1\n0", "../x", "12345", "-1"] {
            assert!(!plausible(bad), "{bad:?}");
        }
    }
}
