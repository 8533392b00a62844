//! Location records kept in a store outside VCMP (issue 34: etcd), which
//! the daemon reaches on its own. The core stays sans-IO: the chain treats
//! that store as one more location server, at the address
//! [`EXTERNAL_STORE`], and what it would send there comes out of
//! [`Endpoint::poll_store_request`] instead of `poll_transmit`; the
//! daemon's answers go back in through [`Endpoint::handle_store_answer`],
//! where they meet exactly the checks a location server's LOOKUP_R and
//! STORE_R meet (`migrate.rs`): each record found is verified with the
//! connection's key and refused if older than one already seen. The store
//! is trusted to keep records, never to vouch for them.
//!
//! A record is kept as the one-record STORE datagram a location server
//! would get (`wire::begin_records` and `wire::push_record`), under its
//! writer's host key and its locator, so a store can list and remove one
//! host's records, and only the connection's two ends can compute where a
//! record is.

use std::collections::VecDeque;
use std::net::{Ipv6Addr, SocketAddr, SocketAddrV6};

use rand_core::{CryptoRng, RngCore};

use super::ctx::Ctx;
use super::endpoint::Endpoint;
use super::flow::VirtualFlow;
use super::location::{LocKey, SavedRecord};
use super::wire::{self, Ext, Kind, Message, Record, TAG_LEN};
use super::Timestamp;

/// Where the chain's steps at the external store are addressed: `[::]:0`,
/// which no VCMP datagram is ever sent to.
pub const EXTERNAL_STORE: SocketAddr =
    SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::UNSPECIFIED, 0, 0, 0));

/// One record to keep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreItem {
    /// The public key of the host that wrote it (this host).
    pub host: [u8; 32],
    pub locator: LocKey,
    /// The signed record, as a one-record STORE datagram.
    pub value: Vec<u8>,
}

/// One record to look up: the peer that writes it, and its locator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub host: [u8; 32],
    pub locator: LocKey,
}

/// What the daemon is asked to do at the external store. `id` is given
/// back with the answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreRequest {
    Put { id: u32, items: Vec<StoreItem> },
    Get { id: u32, wanted: Vec<Wanted> },
}

impl StoreRequest {
    pub fn id(&self) -> u32 {
        match self {
            StoreRequest::Put { id, .. } | StoreRequest::Get { id, .. } => *id,
        }
    }
}

/// The daemon's answer to a [`StoreRequest`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreAnswer {
    /// Every record of a `Put` was kept.
    Stored,
    /// The values found for a `Get` (none: nothing stored there).
    Found(Vec<Vec<u8>>),
    /// The store could not be reached or did not answer in time: the step
    /// counts as failed, as a location server's refusal does, and the
    /// chain goes on without it.
    Unavailable,
}

/// Requests for the external store, batched as a location server's
/// datagrams are: records of one call that share a request id go in one
/// request.
#[derive(Default)]
pub(crate) struct ExtQueue {
    queue: VecDeque<StoreRequest>,
}

/// Most requests queued before older ones are dropped (their steps then
/// time out and are sent again, as a lost datagram's would be).
const MAX_QUEUED: usize = 4096;

impl ExtQueue {
    fn push_put(&mut self, id: u32, item: StoreItem) {
        if let Some(StoreRequest::Put { items, .. }) = self
            .queue
            .iter_mut()
            .find(|r| r.id() == id && matches!(r, StoreRequest::Put { .. }))
        {
            items.push(item);
            return;
        }
        self.push(StoreRequest::Put {
            id,
            items: vec![item],
        });
    }

    fn push_get(&mut self, id: u32, w: Wanted) {
        if let Some(StoreRequest::Get { wanted, .. }) = self
            .queue
            .iter_mut()
            .find(|r| r.id() == id && matches!(r, StoreRequest::Get { .. }))
        {
            if !wanted.contains(&w) {
                wanted.push(w);
            }
            return;
        }
        self.push(StoreRequest::Get {
            id,
            wanted: vec![w],
        });
    }

    fn push(&mut self, r: StoreRequest) {
        if self.queue.len() >= MAX_QUEUED {
            self.queue.pop_front();
        }
        self.queue.push_back(r);
    }
}

/// A record as a store value (a one-record STORE datagram).
pub fn encode_value(rec: &Record) -> Option<Vec<u8>> {
    let mut signed = [0u8; wire::MAX_SIGNED_LEN];
    let n = rec.write_signed(&mut signed).ok()?;
    let mut value = Vec::with_capacity(wire::HEADER_LEN + n + TAG_LEN);
    wire::begin_records(&mut value, Kind::Store, rec.family(), 0);
    wire::push_record(&mut value, &signed[..n], &rec.tag).ok()?;
    Some(value)
}

/// A record read back from a store value (a one-record STORE datagram).
pub fn decode_value(value: &[u8]) -> Result<Record, wire::WireError> {
    match Message::decode(value)? {
        Message::Records {
            kind: Kind::Store,
            records,
            ..
        } if records.len() == 1 => Ok(records[0]),
        _ => Err(wire::WireError::BadCount {
            kind: Kind::Store,
            count: 0,
        }),
    }
}

impl Endpoint {
    /// The location servers the chain asks, the external store last.
    pub(crate) fn location_targets(&self) -> Vec<SocketAddr> {
        let mut t = self.cfg.location_servers.clone();
        if self.cfg.external_store {
            t.push(EXTERNAL_STORE);
        }
        t
    }

    /// Queue a signed STORE or LOOKUP record for the external store instead
    /// of a datagram.
    pub(crate) fn push_external(
        &mut self,
        rec: &Record,
        signed: &[u8],
        tag: &[u8; TAG_LEN],
        req: u32,
    ) {
        let Ext::Locator(locator) = rec.ext else {
            return;
        };
        match rec.command {
            Kind::Store => {
                let mut value = Vec::with_capacity(wire::HEADER_LEN + signed.len() + TAG_LEN);
                wire::begin_records(&mut value, Kind::Store, rec.family(), 0);
                if wire::push_record(&mut value, signed, tag).is_err() {
                    return;
                }
                let host = self.identity.public();
                self.ext.push_put(
                    req,
                    StoreItem {
                        host,
                        locator,
                        value,
                    },
                );
            }
            Kind::Lookup => {
                let flow = VirtualFlow {
                    proto: rec.proto,
                    local: rec.sender_vir,
                    remote: rec.receiver_vir,
                };
                let Some(host) = self.conns.get(&flow).and_then(|c| c.peer_key) else {
                    return;
                };
                self.ext.push_get(req, Wanted { host, locator });
            }
            _ => {}
        }
    }

    /// The embedded store's records, to be saved across a restart
    /// (`LocationStore::saved`).
    pub fn saved_locations(&self, now: Timestamp) -> Vec<SavedRecord> {
        self.store.saved(now)
    }

    /// Records saved by a previous vnatd, back into the embedded store.
    pub fn restore_locations(&mut self, now: Timestamp, saved: &[SavedRecord]) -> usize {
        self.store.restore(now, saved)
    }

    /// The next request for the external store, if any.
    pub fn poll_store_request(&mut self) -> Option<StoreRequest> {
        self.ext.queue.pop_front()
    }

    /// The daemon's answer to request `id` at the external store.
    pub fn handle_store_answer<R: RngCore + CryptoRng>(
        &mut self,
        now: Timestamp,
        rng: &mut R,
        id: u32,
        answer: StoreAnswer,
    ) {
        let mut ctx = Ctx::new(now, rng);
        let Some(kind) = self.requests.get(&id).map(|r| r.kind) else {
            return;
        };
        match (kind, answer) {
            (Kind::Lookup, StoreAnswer::Found(values)) => {
                let mut records = Vec::with_capacity(values.len());
                for v in values {
                    match decode_value(&v) {
                        Ok(r) => records.push(r),
                        Err(e) => self.stats.reject(e.reason()),
                    }
                }
                self.on_lookup_r(&mut ctx, id, &records);
            }
            (Kind::Lookup, _) => self.on_lookup_r(&mut ctx, id, &[]),
            (Kind::Store, StoreAnswer::Stored) => self.on_store_r(&mut ctx, id, 1),
            (Kind::Store, _) => self.on_store_r(&mut ctx, id, 0),
            _ => {}
        }
        self.tx.flush(&mut self.stats);
    }
}

/// Whether `addr` is the external store's placeholder address.
pub fn is_external(addr: &SocketAddr) -> bool {
    *addr == EXTERNAL_STORE
}
