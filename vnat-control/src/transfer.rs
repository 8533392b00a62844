//! The document `vnatctl export` writes and `vnatctl import` reads: the VCMP
//! state of connections that travel with a checkpointed process (paper
//! section 3.3.1.1), plus the translation each had on the exporting host.
//!
//! ```json
//! {"vnat_export": 1,
//!  "connections": [{"id": 123, "vcmp": {...}, "translation": {...} | null}],
//!  "seal": {"from": "...", "to": "...", "mac": "..."}}
//! ```
//!
//! `vcmp` is [`ConnectionExport`], which holds the connection's root key:
//! whoever holds the document can move the connection, so it is a secret
//! like the process image it travels with.
//!
//! `seal` authenticates it: the exporting host's key (`from`), the key of
//! the host it is for (`to`), and a MAC of the document's canonical bytes
//! under a key only those two hosts can derive (their static
//! Diffie-Hellman; `vcmp::crypto::export_seal`). vnatd seals and checks it
//! (`vnat_daemon::control::transfer`); this module only holds the shapes, so
//! that vnatctl can read and write the file.

use serde::{Deserialize, Serialize};
use vnat_vcmp::export::ConnectionExport;

use crate::datapath::Translation;

/// Version of the document (the `vnat_export` key). Bump it on any
/// incompatible change; [`ConnectionExport`] carries its own version too.
pub const EXPORT_FORMAT: u32 = 1;

/// A whole export: what `export` answers and `import` takes.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportDocument {
    pub vnat_export: u32,
    pub connections: Vec<ExportedConnection>,
    /// Who sealed it for whom, and the MAC (absent only in documents of
    /// vnatd before the seal, which are refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal: Option<Seal>,
}

/// See the module documentation: keys and MAC as 64 hex digits.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Seal {
    pub from: String,
    pub to: String,
    pub mac: String,
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
    use vnat_vcmp::{export::ConnectionExport, replay::ReplayWindow};

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

#[cfg(test)]
mod tests {
    use vnat_vcmp::{
        export::{HexKey, EXPORT_VERSION},
        replay::ReplayWindow,
        roles::RoleState,
    };

    use super::*;
    use crate::{
        datapath::{Proto, VirtualFlow},
        proto::{Reply, Request, RequestEnvelope, ResponseEnvelope, PROTOCOL_VERSION},
    };

    fn document() -> ExportDocument {
        let flow = VirtualFlow {
            proto: Proto::Tcp,
            local: "10.0.0.1:40000".parse().expect("test address"),
            remote: "10.0.0.2:22".parse().expect("test address"),
        };
        let mut replay = ReplayWindow::default();
        // Far enough apart that the bitmap needs more than 64 bits.
        replay.commit(3);
        replay.commit(100);
        ExportDocument {
            vnat_export: EXPORT_FORMAT,
            connections: vec![ExportedConnection {
                id: flow.id(),
                vcmp: ConnectionExport {
                    version: EXPORT_VERSION,
                    flow,
                    local_phys: flow.local,
                    remote_phys: flow.remote,
                    peer_key: Some("cd".repeat(32)),
                    root_key: HexKey("01".repeat(32)),
                    send_seq: 5,
                    replay,
                    binding_seq: 1,
                    location_seq: 0,
                    role: RoleState::default(),
                    tcp_isns: None,
                    udp_ends: None,
                    peer_named: None,
                    prev_root_key: None,
                    send_prev: false,
                    keyx_answer: None,
                },
                translation: Some(Translation {
                    flow,
                    physical_local: "10.0.9.1:40000".parse().expect("test address"),
                    physical_remote: flow.remote,
                }),
            }],
            seal: Some(Seal {
                from: "aa".repeat(32),
                to: "bb".repeat(32),
                mac: "cc".repeat(32),
            }),
        }
    }

    #[test]
    fn the_replay_window_is_hex_text_and_survives_a_request_and_an_answer() {
        let doc = document();
        let v = serde_json::to_value(&doc).expect("serializable without u128");
        let bitmap = v["connections"][0]["vcmp"]["replay"]["bitmap"]
            .as_str()
            .unwrap_or_else(|| panic!("the bitmap is not a string: {v}"));
        assert_eq!(bitmap.len(), 32, "{bitmap}");

        // Inside the internally tagged request and reply enums, whose
        // buffering has no u128.
        let request = RequestEnvelope {
            version: PROTOCOL_VERSION,
            request: Request::Import {
                state: doc.clone(),
                from: None,
            },
        };
        let line = serde_json::to_string(&request).expect("serializable");
        let back: RequestEnvelope = serde_json::from_str(&line).expect("parses back");
        assert_eq!(back, request);
        let answer = ResponseEnvelope::ok(Reply::Exported { state: doc.clone() });
        let line = serde_json::to_string(&answer).expect("serializable");
        let back: ResponseEnvelope = serde_json::from_str(&line).expect("parses back");
        assert_eq!(back, answer);
    }

    #[test]
    fn a_damaged_document_does_not_parse() {
        let good = serde_json::to_value(document()).expect("serializable");
        let mut bad_bitmap = good.clone();
        bad_bitmap["connections"][0]["vcmp"]["replay"]["bitmap"] = "xyz".into();
        let mut unknown_key = good.clone();
        unknown_key["connections"][0]["extra"] = 1.into();
        let mut no_replay = good;
        if let Some(vcmp) = no_replay["connections"][0]["vcmp"].as_object_mut() {
            vcmp.remove("replay");
        }
        for bad in [bad_bitmap, unknown_key, no_replay] {
            assert!(
                serde_json::from_value::<ExportDocument>(bad.clone()).is_err(),
                "{bad} must not parse"
            );
        }
    }
}
