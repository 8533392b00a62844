//! rtnetlink for the harness: one NETLINK_ROUTE socket per namespace,
//! requests that wait for the kernel's acknowledgement, and dumps. The
//! links, addresses and routes the tests ask for and read back, as typed
//! netlink-packet-route messages, are in `objects`.
//!
//! A netlink socket talks to the network namespace it was created in,
//! whatever namespace the thread that uses it is in later: [`Rtnl::open`]
//! runs on a thread inside the namespace (see `Netns::new`).
mod objects;

use std::io;

use netlink_packet_core::{
    NetlinkBuffer, NetlinkHeader, NetlinkMessage, NetlinkPayload, NlasIterator, NLM_F_ACK,
    NLM_F_ACK_TLVS, NLM_F_CAPPED, NLM_F_DUMP, NLM_F_DUMP_INTR, NLM_F_REQUEST,
};
use netlink_packet_route::RouteNetlinkMessage;
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

pub(crate) use objects::NewRoute;
pub use objects::{Address, Link, Route, Rule};

/// Why a request failed: the socket, the kernel's answer, or an answer the
/// crate could not decode.
#[derive(Debug, thiserror::Error)]
pub enum RtnlError {
    #[error("netlink socket: {0}")]
    Socket(#[from] io::Error),
    /// The kernel refused the request with `errno` (its extended-ack text,
    /// when it gave one, in `message`).
    #[error("{}", refused_text(*.errno, .message.as_deref()))]
    Refused { errno: i32, message: Option<String> },
    #[error("cannot decode the kernel's answer: {0}")]
    Decode(String),
    #[error("the kernel sent no answer")]
    NoAnswer,
    #[error("every dump was interrupted by changes (NLM_F_DUMP_INTR)")]
    Interrupted,
}

/// A NETLINK_ROUTE socket and the sequence number of its last request.
pub(crate) struct Rtnl {
    socket: Socket,
    seq: u32,
}

impl Rtnl {
    /// Opens a socket in the calling thread's network namespace.
    pub(crate) fn open() -> io::Result<Rtnl> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        // Error answers carry only the request's header, then the kernel's
        // own explanation (NLMSGERR_ATTR_MSG) when it has one.
        socket.set_cap_ack(true)?;
        socket.set_ext_ack(true)?;
        // An answer the kernel dropped must fail the test that waited for
        // it, not hang it.
        vnat_daemon::datapath::kernel::set_receive_timeout(
            std::os::fd::AsFd::as_fd(&socket),
            std::time::Duration::from_secs(10),
        )?;
        Ok(Rtnl { socket, seq: 0 })
    }

    /// Sends `msg` and waits for the kernel's acknowledgement.
    fn request(&mut self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), RtnlError> {
        self.exchange(msg, NLM_F_REQUEST | NLM_F_ACK | flags)
            .map(drop)
    }

    /// Sends the RTM_GET* request `msg` for one object and returns the
    /// kernel's answer.
    fn get(&mut self, msg: RouteNetlinkMessage) -> Result<RouteNetlinkMessage, RtnlError> {
        let (answers, _) = self.exchange(msg, NLM_F_REQUEST | NLM_F_ACK)?;
        answers.into_iter().next().ok_or(RtnlError::NoAnswer)
    }

    /// Dumps the objects `msg` asks for. A dump that raced a change comes
    /// back flagged NLM_F_DUMP_INTR and may miss objects: ask again.
    fn dump(&mut self, msg: RouteNetlinkMessage) -> Result<Vec<RouteNetlinkMessage>, RtnlError> {
        for _ in 0..10 {
            let (answers, interrupted) = self.exchange(msg.clone(), NLM_F_REQUEST | NLM_F_DUMP)?;
            if !interrupted {
                return Ok(answers);
            }
        }
        Err(RtnlError::Interrupted)
    }

    /// Sends `msg` and collects the answers up to the acknowledgement (or
    /// NLMSG_DONE for a dump); also says whether a dump was interrupted.
    fn exchange(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> Result<(Vec<RouteNetlinkMessage>, bool), RtnlError> {
        self.send(msg, flags)?;
        let (mut answers, mut interrupted) = (Vec::new(), false);
        loop {
            let (datagram, _) = self.socket.recv_from_full()?;
            for reply in messages(&datagram)? {
                // Left over from an earlier request that failed half-way.
                if reply.header.sequence_number != self.seq {
                    continue;
                }
                interrupted |= reply.header.flags & NLM_F_DUMP_INTR != 0;
                match reply.payload {
                    NetlinkPayload::InnerMessage(m) => answers.push(m),
                    NetlinkPayload::Error(e) => {
                        let Some(code) = e.code else {
                            return Ok((answers, interrupted));
                        };
                        return Err(RtnlError::Refused {
                            errno: -code.get(),
                            message: ext_ack_message(&e.header, reply.header.flags),
                        });
                    }
                    NetlinkPayload::Done(d) if d.code < 0 => {
                        let message = None;
                        return Err(RtnlError::Refused {
                            errno: -d.code,
                            message,
                        });
                    }
                    NetlinkPayload::Done(_) => return Ok((answers, interrupted)),
                    _ => {}
                }
            }
        }
    }

    /// Sends `msg` as the next request.
    fn send(&mut self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), RtnlError> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut req = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        req.finalize();
        let mut buf = vec![0; req.buffer_len()];
        req.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        Ok(())
    }
}

/// The netlink messages of one datagram (a dump packs several).
fn messages(datagram: &[u8]) -> Result<Vec<NetlinkMessage<RouteNetlinkMessage>>, RtnlError> {
    let mut rest = datagram;
    let mut all = Vec::new();
    while !rest.is_empty() {
        let len = NetlinkBuffer::new_checked(rest)
            .map_err(|e| RtnlError::Decode(e.to_string()))?
            .length() as usize;
        let (one, next) = rest.split_at(len.next_multiple_of(4).min(rest.len()));
        rest = next;
        let message =
            NetlinkMessage::deserialize(one).map_err(|e| RtnlError::Decode(format!("{e:?}")))?;
        all.push(message);
    }
    Ok(all)
}

/// The kernel's explanation (NLMSGERR_ATTR_MSG) in an error answer: `body`
/// is what follows the error code, the request's header (or the whole
/// request when the answer is not NLM_F_CAPPED), then attributes when the
/// answer has NLM_F_ACK_TLVS.
fn ext_ack_message(body: &[u8], flags: u16) -> Option<String> {
    const NLMSGERR_ATTR_MSG: u16 = 1;
    if flags & NLM_F_ACK_TLVS == 0 {
        return None;
    }
    let request_len = if flags & NLM_F_CAPPED != 0 {
        16
    } else {
        NetlinkBuffer::new_checked(body).ok()?.length() as usize
    };
    let tlvs = body.get(request_len.next_multiple_of(4)..)?;
    NlasIterator::new(tlvs)
        .filter_map(Result::ok)
        .find(|nla| nla.kind() == NLMSGERR_ATTR_MSG)
        .map(|nla| {
            String::from_utf8_lossy(nla.value())
                .trim_end_matches('\0')
                .to_string()
        })
}

fn refused_text(errno: i32, message: Option<&str>) -> String {
    let error = io::Error::from_raw_os_error(errno);
    match message {
        Some(m) => format!("{error}: {m}"),
        None => error.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use netlink_packet_route::link::{LinkAttribute, LinkMessage};

    use super::*;

    /// A dump packs several messages in a datagram, each padded to 4 bytes.
    #[test]
    fn every_message_of_a_datagram_is_read() {
        let mut datagram = Vec::new();
        for name in ["eth0", "lo7"] {
            let mut link = LinkMessage::default();
            link.attributes.push(LinkAttribute::IfName(name.into()));
            let payload = NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(link));
            let mut msg = NetlinkMessage::new(NetlinkHeader::default(), payload);
            msg.finalize();
            let mut buf = vec![0; msg.buffer_len()];
            msg.serialize(&mut buf);
            datagram.extend(buf);
        }
        let names: Vec<_> = messages(&datagram)
            .unwrap()
            .into_iter()
            .map(|m| match m.payload {
                NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewLink(l)) => l.attributes,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            names,
            [
                vec![LinkAttribute::IfName("eth0".into())],
                vec![LinkAttribute::IfName("lo7".into())]
            ]
        );
    }

    /// An error answer as the kernel sends it to a socket with cap_ack and
    /// ext_ack: the request's header, then NLMSGERR_ATTR_MSG.
    #[test]
    fn the_kernels_explanation_is_read_from_an_error_answer() {
        let mut body = vec![0u8; 16];
        body[..4].copy_from_slice(&36u32.to_ne_bytes());
        let text = b"Nexthop has invalid gateway\0";
        let len = 4 + text.len();
        body.extend((len as u16).to_ne_bytes());
        body.extend(1u16.to_ne_bytes());
        body.extend(text);
        body.resize(body.len().next_multiple_of(4), 0);
        let flags = NLM_F_CAPPED | NLM_F_ACK_TLVS;
        assert_eq!(
            ext_ack_message(&body, flags).as_deref(),
            Some("Nexthop has invalid gateway")
        );
        assert_eq!(ext_ack_message(&body, NLM_F_CAPPED), None);
    }
}
