//! The embedded location store's records across a restart of vnatd
//! (issue 34): `state_dir/locations.json`, written atomically whenever the
//! records changed (checked every few seconds) and when vnatd stops, read
//! at start. Expiry is kept in wall-clock time, so records outlive a
//! reboot for as long as they had left; expired ones are dropped on load.
//! Bounded: at most the store's own number of records, and a file larger
//! than any such is refused.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::identity::{write_atomic, StateError};
use crate::vcmp::location::{SavedRecord, StoreLimits};

pub const FILE: &str = "locations.json";

/// The largest file read: the store's most records, each well under 1 kB.
const MAX_FILE: u64 = 64 << 20;

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    records: Vec<Entry>,
}

#[derive(Serialize, Deserialize)]
struct Entry {
    source: std::net::IpAddr,
    expires_unix_ms: u64,
    value: String,
}

pub fn path(state_dir: &Path) -> PathBuf {
    state_dir.join(FILE)
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The file's bytes for `records`, as of wall-clock `now`.
pub fn encode(records: &[SavedRecord], now: SystemTime) -> Vec<u8> {
    let base = unix_ms(now);
    let file = File {
        version: 1,
        records: records
            .iter()
            .map(|r| Entry {
                source: r.source,
                expires_unix_ms: base + r.left.as_millis() as u64,
                value: hex(&r.value),
            })
            .collect(),
    };
    serde_json::to_vec(&file).unwrap_or_default()
}

/// The records of a file's bytes still live at wall-clock `now` (none of
/// a file that does not parse: the store starts empty, as before).
pub fn decode(bytes: &[u8], now: SystemTime) -> Vec<SavedRecord> {
    let Ok(file) = serde_json::from_slice::<File>(bytes) else {
        return Vec::new();
    };
    if file.version != 1 {
        return Vec::new();
    }
    let limits = StoreLimits::default();
    let now = unix_ms(now);
    file.records
        .into_iter()
        .filter(|e| e.expires_unix_ms > now)
        .filter_map(|e| {
            Some(SavedRecord {
                source: e.source,
                left: Duration::from_millis(e.expires_unix_ms - now).min(limits.ttl),
                value: unhex(&e.value)?,
            })
        })
        .take(limits.max_entries)
        .collect()
}

/// Read the saved records (none if there is no file).
pub fn load(state_dir: &Path) -> Vec<SavedRecord> {
    let p = path(state_dir);
    match std::fs::metadata(&p) {
        Ok(m) if m.len() > MAX_FILE => {
            tracing::warn!(path = %p.display(), "saved location records are larger than any store holds; not read");
            return Vec::new();
        }
        Ok(_) => {}
        Err(_) => return Vec::new(),
    }
    match std::fs::read(&p) {
        Ok(b) => decode(&b, SystemTime::now()),
        Err(e) => {
            tracing::warn!(path = %p.display(), error = %e, "cannot read the saved location records");
            Vec::new()
        }
    }
}

/// Write `bytes` (from [`encode`]) atomically.
pub fn save(state_dir: &Path, bytes: &[u8]) -> Result<(), StateError> {
    write_atomic(&path(state_dir), bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(left: u64, v: u8) -> SavedRecord {
        SavedRecord {
            source: "10.0.0.1".parse().expect("ip"),
            left: Duration::from_secs(left),
            value: vec![v; 40],
        }
    }

    #[test]
    fn records_come_back_with_their_time_left_and_expired_ones_go() {
        let t0 = UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let bytes = encode(&[rec(600, 1), rec(10, 2)], t0);
        let later = t0 + Duration::from_secs(100);
        let back = decode(&bytes, later);
        assert_eq!(back, vec![rec(500, 1)], "the one with 10 s left expired");
        assert!(decode(b"{not json", later).is_empty());
        assert!(
            decode(&bytes[..bytes.len() / 2], later).is_empty(),
            "a torn file is ignored"
        );
    }

    #[test]
    fn saved_atomically_in_the_state_dir() {
        let dir = tempfile::tempdir().expect("tempdir");
        let bytes = encode(&[rec(600, 3)], SystemTime::now());
        save(dir.path(), &bytes).expect("saved");
        let back = load(dir.path());
        assert_eq!(back.len(), 1);
        assert_eq!(back[0].value, vec![3; 40]);
        assert!(!dir.path().join("locations.tmp").exists());
    }
}
