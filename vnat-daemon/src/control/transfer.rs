//! Sealing and checking the export document (its shapes are in
//! `vnat_control::transfer`, re-exported here): what `vnatctl export`
//! writes and `vnatctl import` reads, the VCMP state of connections that
//! travel with a checkpointed process (paper section 3.3.1.1).
//!
//! The seal authenticates a document: the exporting host's key (`from`),
//! the key of the host it is for (`to`), and a MAC of the document's
//! canonical bytes ([`sealed_bytes`]) under a key only those two hosts can
//! derive (their static Diffie-Hellman; `vcmp::crypto::export_seal`). The
//! importing vnatd refuses a document without a seal, sealed for another
//! host, sealed by a host other than the one named on import (this host by
//! default), or changed since it was sealed.

use std::net::SocketAddr;

pub use vnat_control::transfer::{ExportDocument, ExportedConnection, Seal, EXPORT_FORMAT};

use crate::{
    datapath::{DatapathError, VirtualFlow},
    vcmp::{
        crypto::{key_hex, parse_key_hex},
        endpoint::EndpointError,
        Endpoint,
    },
};

/// The bytes the seal covers: the document without its seal, as this
/// vnatd serializes it (so whitespace or key order changed in the file do
/// not matter, and every value does).
/// `None` if it cannot be serialized (then it is neither sealed nor
/// accepted). The bytes hold the connections' keys: wiped when dropped.
pub fn sealed_bytes(doc: &ExportDocument) -> Option<zeroize::Zeroizing<Vec<u8>>> {
    let unsealed = ExportDocument {
        seal: None,
        ..doc.clone()
    };
    serde_json::to_vec(&unsealed)
        .ok()
        .map(zeroize::Zeroizing::new)
}

/// Check what can be checked without VCMP, so that a bad file is refused
/// before anything changes.
pub fn validate(doc: &ExportDocument) -> Result<(), TransferError> {
    if doc.vnat_export != EXPORT_FORMAT {
        return Err(TransferError::Format {
            found: doc.vnat_export,
        });
    }
    if doc.connections.is_empty() {
        return Err(TransferError::Empty);
    }
    for c in &doc.connections {
        if c.vcmp.flow.id() != c.id {
            return Err(TransferError::IdMismatch {
                id: c.id,
                flow: describe(&c.vcmp.flow),
            });
        }
    }
    Ok(())
}

/// Seal `doc` (see the module documentation) for the host `to`; `false`
/// (and no seal) if `to` is not a valid key or the document cannot be
/// serialized.
pub fn seal(doc: &mut ExportDocument, endpoint: &Endpoint, to: &[u8; 32]) -> bool {
    doc.seal = None;
    let Some(mac) = sealed_bytes(doc).and_then(|body| endpoint.seal_export(to, &body)) else {
        return false;
    };
    doc.seal = Some(Seal {
        from: key_hex(&endpoint.public_key()),
        to: key_hex(to),
        mac: key_hex(&mac),
    });
    true
}

/// Whether `doc` is sealed for this host (`endpoint`'s) by `from` (this
/// host when `None`), and unchanged since.
pub fn check_seal(
    doc: &ExportDocument,
    endpoint: &Endpoint,
    from: Option<[u8; 32]>,
) -> Result<(), TransferError> {
    let me = endpoint.public_key();
    let seal = doc.seal.as_ref().ok_or(TransferError::Unsealed)?;
    let key = |s: &str, what| parse_key_hex(s).ok_or(TransferError::BadKey { what });
    let sealed_from = key(&seal.from, "the seal's `from`")?;
    let sealed_to = key(&seal.to, "the seal's `to`")?;
    let mac = key(&seal.mac, "the seal's `mac`")?;
    if sealed_to != me {
        return Err(TransferError::SealedForAnotherHost {
            to: seal.to.clone(),
            me: key_hex(&me),
        });
    }
    if sealed_from != from.unwrap_or(me) {
        return Err(TransferError::SealedByAnotherHost {
            from: seal.from.clone(),
        });
    }
    let body = sealed_bytes(doc).ok_or(TransferError::BadSeal)?;
    if !endpoint.check_export_seal(&sealed_from, &body, &mac) {
        return Err(TransferError::BadSeal);
    }
    Ok(())
}

/// Why an export or import was refused; nothing was changed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    #[error("the export format version is {found} but this vnatd reads version {EXPORT_FORMAT}; export with a vnatd of the same release")]
    Format { found: u32 },
    #[error("the export holds no connection; export some with: vnatctl export --all")]
    Empty,
    #[error("the export is damaged: connection id {id} does not match its endpoints {flow}")]
    IdMismatch { id: u64, flow: String },
    #[error("connection {id} ({flow}) is not managed by VCMP (its peer runs no vnatd, or it is local traffic), so it cannot be exported")]
    NotTracked { id: u64, flow: String },
    #[error("connection {id} ({flow}) has no keys yet, so it cannot be exported; wait until `vnatctl ls` shows it as mobile")]
    NoKeys { id: u64, flow: String },
    #[error("cannot read the installed translations: {0}")]
    Datapath(#[source] DatapathError),
    #[error("cannot export connection {id}: {source}")]
    Export {
        id: u64,
        #[source]
        source: EndpointError,
    },
    #[error("the export is not sealed (it comes from a vnatd older than this one, or was edited); export it again with this release")]
    Unsealed,
    #[error("the export is sealed for another host ({to}); export it again with --to {me} (this host's key, shown by `vnatctl status`)")]
    SealedForAnotherHost { to: String, me: String },
    #[error(
        "the export was sealed by the host {from}; if you trust it, import with --from {from}"
    )]
    SealedByAnotherHost { from: String },
    #[error("the export's seal does not match its content: it was changed after the export, or forged; nothing was imported")]
    BadSeal,
    #[error("{what} is not a host key (64 hex digits, as `vnatctl status` shows it)")]
    BadKey { what: &'static str },
    #[error("cannot import connection {id}: {source}; nothing was imported")]
    Import {
        id: u64,
        #[source]
        source: EndpointError,
    },
}

/// "tcp 198.18.1.2:40000 -> 198.18.3.2:5001", for messages.
pub fn describe(flow: &VirtualFlow) -> String {
    format!("{} {} -> {}", flow.proto, flow.local, flow.remote)
}

/// Where an imported connection continues, for the import answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImportOutcome {
    pub flow: VirtualFlow,
    pub physical_local: SocketAddr,
    pub physical_remote: SocketAddr,
    pub moving: bool,
    /// A move starts once the restored socket appears here.
    pub move_pending: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::Proto;
    use crate::vcmp::{crypto::HostIdentity, Config};

    fn host(seed: u8) -> Endpoint {
        Endpoint::new(Config::default(), HostIdentity::from_bytes([seed; 32]))
    }

    fn document() -> ExportDocument {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: "10.0.0.1:40000".parse().unwrap(),
            remote: "10.0.0.2:22".parse().unwrap(),
        };
        let vcmp = super::super::handler_tests::export_of(&flow);
        ExportDocument {
            vnat_export: EXPORT_FORMAT,
            connections: vec![ExportedConnection {
                id: flow.id(),
                vcmp,
                translation: None,
            }],
            seal: None,
        }
    }

    /// The file as a user's tools would handle it: written, read back.
    fn through_a_file(doc: &ExportDocument) -> ExportDocument {
        let text = serde_json::to_string_pretty(doc).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn a_sealed_export_imports_on_its_host_from_its_host_only() {
        let (a, b, c) = (host(1), host(2), host(3));
        let mut doc = document();
        seal(&mut doc, &a, &b.public_key());
        let doc = through_a_file(&doc);
        assert!(check_seal(&doc, &b, Some(a.public_key())).is_ok());
        // Not without naming its sender, and not on another host.
        assert!(matches!(
            check_seal(&doc, &b, None),
            Err(TransferError::SealedByAnotherHost { .. })
        ));
        assert!(matches!(
            check_seal(&doc, &b, Some(c.public_key())),
            Err(TransferError::SealedByAnotherHost { .. })
        ));
        assert!(matches!(
            check_seal(&doc, &c, Some(a.public_key())),
            Err(TransferError::SealedForAnotherHost { .. })
        ));
        // Exported and imported on one host: no keys to name.
        let mut own = document();
        seal(&mut own, &a, &a.public_key());
        assert!(check_seal(&through_a_file(&own), &a, None).is_ok());
    }

    #[test]
    fn a_changed_unsealed_or_resealed_export_is_refused() {
        let (a, b, mallory) = (host(1), host(2), host(9));
        let mut doc = document();
        seal(&mut doc, &a, &b.public_key());
        let mut changed = doc.clone();
        changed.connections[0].vcmp.send_seq ^= 1;
        assert!(matches!(
            check_seal(&changed, &b, Some(a.public_key())),
            Err(TransferError::BadSeal)
        ));
        let mut redirected = doc.clone();
        redirected.connections[0].vcmp.remote_phys = "10.6.6.6:22".parse().unwrap();
        assert!(matches!(
            check_seal(&redirected, &b, Some(a.public_key())),
            Err(TransferError::BadSeal)
        ));
        let mut unsealed = doc.clone();
        unsealed.seal = None;
        assert!(matches!(
            check_seal(&unsealed, &b, Some(a.public_key())),
            Err(TransferError::Unsealed)
        ));
        // Someone else reseals it with their own key, claiming to be A.
        let mut forged = changed.clone();
        seal(&mut forged, &mallory, &b.public_key());
        if let Some(s) = &mut forged.seal {
            s.from = key_hex(&a.public_key());
        }
        assert!(matches!(
            check_seal(&forged, &b, Some(a.public_key())),
            Err(TransferError::BadSeal)
        ));
    }
}
