//! The capacity of the maps the recorders fill.
//!
//! The programs declare each map's capacity; `VNAT_MAP_ENTRIES` (for
//! tests: `VNAT_CONNS=2048,VNAT_GUESTS=1024`) makes a new map smaller, so
//! that a test fills one user's share of a real map in the kernel in
//! seconds rather than minutes. It only applies when the map is created:
//! a map already pinned keeps the size it has.

use vnat_common::{MAP_CONNS, MAP_GUESTS};

/// The environment variable read at load.
pub const MAP_ENTRIES_ENV: &str = "VNAT_MAP_ENTRIES";

/// The maps whose size `VNAT_MAP_ENTRIES` may set.
const SIZED: [&str; 2] = [MAP_CONNS, MAP_GUESTS];

/// The smallest size accepted: a map must hold a few connections of every
/// user for the budgets derived from it to mean anything.
const MIN_ENTRIES: u32 = 256;

/// `NAME=ENTRIES` pairs of a `VNAT_MAP_ENTRIES` value; a pair that names
/// another map or a size below [`MIN_ENTRIES`] is an error (a typo must not
/// pass silently).
pub fn parse(value: &str) -> Result<Vec<(&'static str, u32)>, String> {
    let mut out = Vec::new();
    for pair in value.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, n) = pair
            .split_once('=')
            .ok_or_else(|| format!("{MAP_ENTRIES_ENV}: `{pair}` is not NAME=ENTRIES"))?;
        let name = SIZED.iter().find(|m| **m == name.trim()).ok_or_else(|| {
            format!(
                "{MAP_ENTRIES_ENV}: `{}` is not one of {}",
                name.trim(),
                SIZED.join(", ")
            )
        })?;
        let n: u32 = n
            .trim()
            .parse()
            .ok()
            .filter(|n| *n >= MIN_ENTRIES)
            .ok_or_else(|| {
                format!(
                    "{MAP_ENTRIES_ENV}: {name} needs a number of entries of at least {MIN_ENTRIES}"
                )
            })?;
        out.push((*name, n));
    }
    Ok(out)
}

/// Apply `VNAT_MAP_ENTRIES` to a loader, if set.
pub fn apply(loader: &mut aya::EbpfLoader<'_>) -> Result<(), crate::datapath::DatapathError> {
    let Ok(value) = std::env::var(MAP_ENTRIES_ENV) else {
        return Ok(());
    };
    let pairs =
        parse(&value).map_err(|e| crate::datapath::DatapathError::Load { source: e.into() })?;
    for (name, n) in pairs {
        tracing::info!(map = name, entries = n, "map size set by {MAP_ENTRIES_ENV}");
        loader.map_max_entries(name, n);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_parsed_and_typos_refused() {
        assert_eq!(
            parse("VNAT_CONNS=2048, VNAT_GUESTS=1024").unwrap(),
            vec![(MAP_CONNS, 2048), (MAP_GUESTS, 1024)]
        );
        assert_eq!(parse("").unwrap(), vec![]);
        assert!(parse("VNAT_CONN=2048").is_err());
        assert!(parse("VNAT_CONNS").is_err());
        assert!(parse("VNAT_CONNS=12").is_err());
        assert!(parse("VNAT_CONNS=lots").is_err());
    }
}
