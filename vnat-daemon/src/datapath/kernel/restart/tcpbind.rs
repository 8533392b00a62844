//! Sending a TCP BIND (`vnat_common::TCP_BIND_OPT`): the segment by which a
//! host that moved behind a NAT tells its peer's tc program which of the
//! NAT's ports is its connection's. It leaves on the connection's own
//! 5-tuple (our new physical address and the connection's port, to the
//! peer's physical endpoint), so the NAT maps it as it maps the
//! connection's segments, and it carries the socket's own numbers (a pure
//! ACK at `snd_nxt`, with the window the socket advertises), so that a NAT
//! that tracks TCP windows takes it for one of the connection's segments.
//! It acknowledges one byte less than the socket has received: a host that
//! does not expect it (no rebinding entry, so no tc program takes it)
//! answers an unknown 4-tuple with a reset whose sequence number is the
//! segment's acknowledgment number, and one byte before `rcv_nxt` that
//! reset is outside our socket's window and ignored (RFC 5961), where at
//! `rcv_nxt` exactly it would end the connection. The peer's tc program
//! drops it; if it ever reached the peer's socket, it would be an old,
//! ignored ACK.

use std::net::SocketAddr;

use vnat_common::{ConnRecord, TCP_BIND_HDR_LEN, TCP_BIND_OPT, TCP_BIND_TOKEN_LEN};

use super::checksum;
use super::rawsock::{pseudo_header, send_ip};
use super::sockdiag::SockDiag;
use crate::datapath::{DatapathError, VirtualFlow};

/// Send the TCP BIND with `token` for `flow` (its socket's record
/// `record`) from `local` to `remote`. `Ok(false)`: the socket is gone.
pub fn send_tcp_bind(
    flow: &VirtualFlow,
    record: &ConnRecord,
    local: SocketAddr,
    remote: SocketAddr,
    token: [u8; TCP_BIND_TOKEN_LEN],
) -> Result<bool, DatapathError> {
    let Some(state) = SockDiag::with_shared(|d| d.query(flow, record.cookie))? else {
        return Ok(false);
    };
    let snd_una = record.snd_una_base.wrapping_add(state.bytes_acked as u32);
    // idiag_wqueue is write_seq - snd_una, tcpi_notsent_bytes write_seq -
    // snd_nxt: their difference is snd_nxt - snd_una.
    let snd_nxt = snd_una.wrapping_add(state.send_queue.saturating_sub(state.notsent_bytes));
    let rcv_nxt = record
        .rcv_nxt_base
        .wrapping_add(state.bytes_received as u32);
    let seg = segment(
        local,
        remote,
        snd_nxt,
        rcv_nxt.wrapping_sub(1),
        state.advertised_window(),
        &token,
    )
    .ok_or(DatapathError::InvalidTranslation {
        flow: *flow,
        reason: "the connection's new endpoints are of two address families",
    })?;
    send_ip(
        local.ip(),
        remote.ip(),
        libc::IPPROTO_TCP as u8,
        &seg,
        || format!("sending a TCP BIND from {local} to {remote} on a raw socket"),
    )?;
    Ok(true)
}

/// The TCP BIND's header, checksum included; `None` if `local` and
/// `remote` are of two families.
pub(super) fn segment(
    local: SocketAddr,
    remote: SocketAddr,
    seq: u32,
    ack: u32,
    window: u16,
    token: &[u8; TCP_BIND_TOKEN_LEN],
) -> Option<Vec<u8>> {
    if local.is_ipv4() != remote.is_ipv4() {
        return None;
    }
    let mut t = Vec::with_capacity(TCP_BIND_HDR_LEN);
    t.extend_from_slice(&local.port().to_be_bytes());
    t.extend_from_slice(&remote.port().to_be_bytes());
    t.extend_from_slice(&seq.to_be_bytes());
    t.extend_from_slice(&ack.to_be_bytes());
    // Data offset in 32-bit words; ACK alone.
    t.extend_from_slice(&[((TCP_BIND_HDR_LEN / 4) as u8) << 4, 0x10]);
    t.extend_from_slice(&window.to_be_bytes());
    t.extend_from_slice(&[0, 0, 0, 0]); // checksum, urgent pointer
    t.extend_from_slice(&TCP_BIND_OPT);
    t.extend_from_slice(token);
    debug_assert_eq!(t.len(), TCP_BIND_HDR_LEN);
    let mut pseudo = pseudo_header(local.ip(), remote.ip(), libc::IPPROTO_TCP as u8, t.len());
    pseudo.extend_from_slice(&t);
    let c = checksum(&pseudo);
    t[16..18].copy_from_slice(&c.to_be_bytes());
    Some(t)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The header the tc program looks for: data offset 8, ACK only, the
    /// option first with its id and the token, and a checksum that sums to
    /// zero over the pseudo-header (IPv4 and IPv6).
    #[test]
    fn a_tcp_bind_is_an_ack_with_the_option_first() {
        let token = [1, 2, 3, 4, 5, 6, 7, 8];
        for (l, r) in [
            ("198.18.1.2:40000", "198.18.3.2:5001"),
            ("[fd00:5e:1::2]:40000", "[fd00:5e:3::2]:5001"),
        ] {
            let (l, r): (SocketAddr, SocketAddr) = (l.parse().unwrap(), r.parse().unwrap());
            let t = segment(l, r, 0x0102_0304, 0x0506_0708, 512, &token).unwrap();
            assert_eq!(t.len(), 32);
            assert_eq!(
                &t[..16],
                &[0x9c, 0x40, 0x13, 0x89, 1, 2, 3, 4, 5, 6, 7, 8, 0x80, 0x10, 2, 0]
            );
            assert_eq!(&t[20..24], &[253, 12, b'v', b'n']);
            assert_eq!(&t[24..], &token);
            let mut pseudo = pseudo_header(l.ip(), r.ip(), 6, t.len());
            pseudo.extend_from_slice(&t);
            assert_eq!(checksum(&pseudo), 0, "checksum does not verify");
        }
        let mixed = segment(
            "198.18.1.2:1".parse().unwrap(),
            "[fd00::1]:2".parse().unwrap(),
            0,
            0,
            0,
            &token,
        );
        assert!(mixed.is_none());
    }
}
