//! The document `vnatctl export` writes and `vnatctl import` reads: the VCMP
//! state of connections that travel with a checkpointed process (paper
//! section 3.3.1.1), plus the translation each had on the exporting host.
//!
//! ```json
//! {"vnat_export": 1,
//!  "connections": [{"id": 123, "vcmp": {...}, "translation": {...} | null}]}
//! ```
//!
//! `vcmp` is [`ConnectionExport`], which holds the connection's root key:
//! whoever holds the document can move the connection, so it is a secret
//! like the process image it travels with.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::{
    datapath::{DatapathError, Translation, VirtualFlow},
    vcmp::{endpoint::EndpointError, export::ConnectionExport},
};

/// Version of the document (the `vnat_export` key). Bump it on any
/// incompatible change; [`ConnectionExport`] carries its own version too.
pub const EXPORT_FORMAT: u32 = 1;

/// A whole export: what `export` answers and `import` takes.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportDocument {
    pub vnat_export: u32,
    pub connections: Vec<ExportedConnection>,
}

/// One exported connection.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportedConnection {
    /// The id `vnatctl ls` showed (derived from the virtual endpoints).
    pub id: u64,
    #[serde(with = "vcmp_text")]
    pub vcmp: ConnectionExport,
    /// The translation installed on the exporting host, if the connection
    /// had moved; for people reading the file (the importing host derives
    /// its own from `vcmp`'s physical endpoints and its addresses).
    pub translation: Option<Translation>,
}

// The control protocol's request type derives `Eq` (its tests compare
// requests); the export holds a key type without `PartialEq` on purpose, so
// compare documents by their serialized form (a string: `serde_json::Value`
// cannot hold the replay window's u128).
impl PartialEq for ExportDocument {
    fn eq(&self, other: &Self) -> bool {
        match (serde_json::to_string(self), serde_json::to_string(other)) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        }
    }
}
impl Eq for ExportDocument {}

impl ExportDocument {
    /// Check what can be checked without VCMP, so that a bad file is refused
    /// before anything changes.
    pub fn validate(&self) -> Result<(), TransferError> {
        if self.vnat_export != EXPORT_FORMAT {
            return Err(TransferError::Format {
                found: self.vnat_export,
            });
        }
        if self.connections.is_empty() {
            return Err(TransferError::Empty);
        }
        for c in &self.connections {
            if c.vcmp.flow.id() != c.id {
                return Err(TransferError::IdMismatch {
                    id: c.id,
                    flow: describe(&c.vcmp.flow),
                });
            }
        }
        Ok(())
    }
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
    #[error("cannot import connection {id}: {source}; nothing was imported")]
    Import {
        id: u64,
        #[source]
        source: EndpointError,
    },
}

/// [`ConnectionExport`] as the document holds it: as VCMP serializes it,
/// except the replay window's 128-bit bitmap, which is written as 32 hex
/// digits. Why: the control protocol's messages are internally tagged serde
/// enums, which buffer their content in a form that has no 128-bit integers
/// (and `serde_json::Value` has none either), so a u128 inside an `import`
/// request or an `export` answer could not be read back.
mod vcmp_text {
    use serde::{
        de::Error as _, ser::Error as _, Deserialize, Deserializer, Serialize, Serializer,
    };
    use serde_json::{json, Value};

    use crate::vcmp::{export::ConnectionExport, replay::ReplayWindow};

    /// The window as VCMP serializes it, read with serde_json's own parser
    /// (which does handle u128).
    #[derive(Deserialize)]
    struct Native {
        highest: u64,
        bitmap: u128,
    }

    /// The window as the document holds it.
    #[derive(Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Text {
        highest: u64,
        bitmap: String,
    }

    pub fn serialize<S: Serializer>(e: &ConnectionExport, s: S) -> Result<S::Ok, S::Error> {
        let native = serde_json::to_string(&e.replay)
            .and_then(|w| serde_json::from_str::<Native>(&w))
            .map_err(S::Error::custom)?;
        let mut plain = e.clone();
        plain.replay = ReplayWindow::default();
        let mut v = serde_json::to_value(&plain).map_err(S::Error::custom)?;
        v["replay"] = json!(Text {
            highest: native.highest,
            bitmap: format!("{:032x}", native.bitmap),
        });
        v.serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<ConnectionExport, D::Error> {
        let mut v = Value::deserialize(d)?;
        let text = v
            .get_mut("replay")
            .map(Value::take)
            .ok_or_else(|| D::Error::missing_field("replay"))?;
        let text: Text = serde_json::from_value(text).map_err(D::Error::custom)?;
        let bitmap = u128::from_str_radix(&text.bitmap, 16)
            .map_err(|_| D::Error::custom("the replay bitmap is not 32 hex digits"))?;
        let native = format!(r#"{{"highest":{},"bitmap":{bitmap}}}"#, text.highest);
        let replay: ReplayWindow = serde_json::from_str(&native).map_err(D::Error::custom)?;
        // The rest through serde_json's parser too (ConnectionExport's own
        // window field is a u128, which `from_value` refuses even when 0).
        v["replay"] = json!({ "highest": 0, "bitmap": 0 });
        let mut e: ConnectionExport =
            serde_json::from_str(&v.to_string()).map_err(D::Error::custom)?;
        e.replay = replay;
        Ok(e)
    }
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
}
