//! The bytes of BIND and BIND_REQ (`vcmp::bind`).
//!
//! BIND ([`BIND_LEN`] bytes, its layout fixed by the datapath, which finds
//! it by length, head and magic): version, kind 19, the flow port the
//! diverting tc program writes (zero as sent), the magic; the sender's
//! host key; one CLAIM entry whose commitment field carries the BIND's
//! token and whose names are the sender's for the flow; the request's
//! nonce; the tag under the pairing's claim key (over bytes 2..4 as zero).
//!
//! BIND_REQ: version, kind 20, 0, the count of commitments (0 to
//! [`MAX_CLAIMS`]: none asks for every UDP flow toward the requester), four
//! zero bytes; the requester's host key; the nonce; the commitments; the
//! tag.

use crate::stats::Reject;

use vnat_common::{BIND_HEAD, BIND_LEN, BIND_MAGIC};

use super::super::wire::{
    decode_claim_entry, encode_claim_entry, ClaimEntry, CLAIM_ENTRY_LEN, HEADER_LEN, MAX_CLAIMS,
    PAIR_TAG_LEN, TAG_LEN, VERSION,
};

/// Kind byte of a BIND_REQ ("send me BINDs for these").
pub(crate) const KIND_BIND_REQ: u8 = 20;

/// A BIND as received.
pub(super) struct Bind {
    pub static_pub: [u8; 32],
    pub entry: ClaimEntry,
    /// The flow's names as the sender gives them (its end first).
    pub names: [std::net::SocketAddr; 2],
    pub nonce: u64,
    /// The port it was sent to, written by the diverting tc program.
    pub port: u16,
}

pub(super) fn encode_bind(static_pub: &[u8; 32], entry: &ClaimEntry, nonce: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(BIND_LEN);
    out.extend_from_slice(&[BIND_HEAD[0], BIND_HEAD[1], 0, 0]);
    out.extend_from_slice(&BIND_MAGIC);
    out.extend_from_slice(static_pub);
    encode_claim_entry(&mut out, entry);
    out.extend_from_slice(&nonce.to_be_bytes());
    out.extend_from_slice(&[0; PAIR_TAG_LEN]);
    debug_assert_eq!(out.len(), BIND_LEN);
    out
}

pub(super) fn decode_bind(b: &[u8]) -> Result<Bind, Reject> {
    if b.len() != BIND_LEN || b[..2] != BIND_HEAD || b[4..8] != BIND_MAGIC {
        return Err(Reject::BindMalformed);
    }
    let mut static_pub = [0u8; 32];
    static_pub.copy_from_slice(&b[HEADER_LEN..HEADER_LEN + 32]);
    let at = HEADER_LEN + 32;
    let entry =
        decode_claim_entry(&b[at..at + CLAIM_ENTRY_LEN]).map_err(|_| Reject::BindMalformed)?;
    // A BIND names its flow: it is sent on it, to its other end.
    let names = entry.names.ok_or(Reject::BindMalformed)?;
    let mut nonce = [0u8; 8];
    nonce.copy_from_slice(&b[at + CLAIM_ENTRY_LEN..at + CLAIM_ENTRY_LEN + 8]);
    Ok(Bind {
        static_pub,
        entry,
        names,
        nonce: u64::from_be_bytes(nonce),
        port: u16::from_be_bytes([b[2], b[3]]),
    })
}

pub(super) fn encode_bind_req(
    static_pub: &[u8; 32],
    nonce: u64,
    commitments: &[[u8; TAG_LEN]],
) -> Vec<u8> {
    let mut out = vec![
        VERSION,
        KIND_BIND_REQ,
        0,
        commitments.len() as u8,
        0,
        0,
        0,
        0,
    ];
    out.extend_from_slice(static_pub);
    out.extend_from_slice(&nonce.to_be_bytes());
    for c in commitments {
        out.extend_from_slice(c);
    }
    out.extend_from_slice(&[0; PAIR_TAG_LEN]);
    out
}

/// A BIND_REQ: the requester's host key, its nonce, the commitments (none:
/// every UDP flow toward the requester).
pub(super) type BindReq = ([u8; 32], u64, Vec<[u8; TAG_LEN]>);

pub(super) fn decode_bind_req(b: &[u8]) -> Result<BindReq, Reject> {
    if b.len() < HEADER_LEN + 32 + 8 + PAIR_TAG_LEN || b[0] != VERSION || b[1] != KIND_BIND_REQ {
        return Err(Reject::BindReqMalformed);
    }
    let count = usize::from(b[3]);
    if count > MAX_CLAIMS
        || b[2] != 0
        || b[4..8] != [0; 4]
        || b.len() != HEADER_LEN + 32 + 8 + count * TAG_LEN + PAIR_TAG_LEN
    {
        return Err(Reject::BindReqMalformed);
    }
    let mut static_pub = [0u8; 32];
    static_pub.copy_from_slice(&b[HEADER_LEN..HEADER_LEN + 32]);
    let mut nonce = [0u8; 8];
    nonce.copy_from_slice(&b[HEADER_LEN + 32..HEADER_LEN + 40]);
    let at = HEADER_LEN + 40;
    let commitments = b[at..at + count * TAG_LEN]
        .chunks_exact(TAG_LEN)
        .map(|c| {
            let mut x = [0u8; TAG_LEN];
            x.copy_from_slice(c);
            x
        })
        .collect();
    Ok((static_pub, u64::from_be_bytes(nonce), commitments))
}

/// Whether `bytes` is a BIND or a BIND_REQ (which `Message::decode` does
/// not parse).
pub(crate) fn is_bind(bytes: &[u8]) -> bool {
    bytes.len() >= 2
        && bytes[0] == VERSION
        && (bytes[1] == BIND_HEAD[1] || bytes[1] == KIND_BIND_REQ)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flow::Proto;

    #[test]
    fn a_bind_req_for_every_flow_has_no_commitment_and_round_trips() {
        let b = encode_bind_req(&[7; 32], 42, &[]);
        assert_eq!(b.len(), HEADER_LEN + 32 + 8 + PAIR_TAG_LEN);
        let (key, nonce, wanted) = decode_bind_req(&b).expect("decode");
        assert_eq!((key, nonce, wanted.len()), ([7; 32], 42, 0));
        let mut long = encode_bind_req(&[7; 32], 42, &[[1; TAG_LEN]]);
        long[3] = 0;
        assert!(decode_bind_req(&long).is_err(), "count and length disagree");
    }

    #[test]
    fn a_bind_without_names_is_refused() {
        let entry = ClaimEntry {
            commitment: [3; TAG_LEN],
            proto: Proto::Udp,
            names: None,
        };
        let b = encode_bind(&[7; 32], &entry, 1);
        assert!(matches!(decode_bind(&b), Err(Reject::BindMalformed)));
    }
}
