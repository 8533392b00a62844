//! Pairing under attack (issue 16, item 3): spoofed PAIR_INIT floods cost
//! the responder a MAC each, not a Diffie-Hellman or a table entry, cannot
//! overwrite a handshake under way, and a pairing that failed is tried
//! again, so its connections become mobile once the peer answers.

use std::net::SocketAddr;
use std::time::Duration;

use super::crypto::{DrbgRng, HostIdentity};
use super::endpoint::Config;
use super::sim::{self, reverse, sa, tcp, Link, Sim};
use super::wire::{Kind, Message};
use crate::stats::{Counter, Reject};
use rand_core::RngCore;

const L: usize = 0;
const S: usize = 1;

/// A PAIR_INIT with a fresh random host key, ephemeral value and id, as a
/// flooder sends them.
fn spoofed_init(rng: &mut DrbgRng) -> Vec<u8> {
    let mut k = [0u8; 32];
    rng.fill_bytes(&mut k);
    let static_pub = HostIdentity::from_bytes(k).public();
    rng.fill_bytes(&mut k);
    let eph_pub = HostIdentity::from_bytes(k).public();
    Message::PairInit {
        request_id: rng.next_u32(),
        static_pub,
        eph_pub,
        cookie: None,
    }
    .encode()
    .unwrap()
}

/// `f` recorded at its own endpoints, bound by them.
fn added(
    ep: &mut super::endpoint::Endpoint,
    now: super::Timestamp,
    rng: &mut DrbgRng,
    f: crate::flow::VirtualFlow,
) {
    let b = super::binding::Binding::endpoints(&f);
    ep.connection_added(now, rng, f, f.local, f.remote, b)
        .unwrap();
}

fn kinds(ts: &[super::tx::Transmit]) -> Vec<u8> {
    ts.iter().map(|t| t.payload[1]).collect()
}

#[test]
fn a_flood_of_spoofed_pair_inits_from_the_client_s_address_costs_no_dh_and_pairing_completes() {
    let mut sim = Sim::new(61, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    sim.connect(L, S, f);
    // Before either host's PAIR_INIT is delivered: 2,000 PAIR_INITs that
    // claim to come from the client's VCMP address, each with its own key.
    let mut rng = DrbgRng::from_seed(99);
    let from = sa("10.0.0.1:2031");
    let burst = u64::from(Config::default().pair_dh_burst);
    let mut answered = 0u64;
    for _ in 0..2000 {
        let init = spoofed_init(&mut rng);
        let replies = sim.inject(S, from, &init);
        answered += kinds(&replies)
            .iter()
            .filter(|k| **k == Kind::PairResp as u8)
            .count() as u64;
    }
    // At most the source's burst is answered (the first one leaves a
    // handshake with that address, and the rest would replace it: they get
    // cookies).
    assert!(answered <= burst, "{answered} spoofed PAIR_INITs answered");
    let st = sim.hosts[S].ep.stats();
    assert!(st.get(Counter::PairDhComputed) <= burst, "{st:?}");
    assert!(
        st.get(Counter::PairCookiesSent) + st.get(Counter::PairCrossingIgnored) >= 2000 - burst,
        "each one got a cookie (or was a crossing initiation): {:?}",
        st
    );
    // The real pairing still completes, and the connection gets its keys.
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    assert!(sim.hosts[S].ep.connection(&reverse(&f)).unwrap().has_keys);
    assert!(
        sim.hosts[S].ep.stats().get(Counter::PairDhComputed) <= burst + 1,
        "beyond the burst, only the real initiator's DH: {:?}",
        sim.hosts[S].ep.stats()
    );
}

#[test]
fn an_unloaded_responder_limits_dh_per_source_and_then_asks_for_cookies() {
    let mut sim = Sim::new(62, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    sim.connect(L, S, f);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    // Paired, no handshake under way: spoofed PAIR_INITs from the client's
    // address, each from its own port (no handshake to replace).
    let mut rng = DrbgRng::from_seed(5);
    let before = sim.hosts[S].ep.stats().get(Counter::PairDhComputed);
    for port in 0..100u16 {
        let init = spoofed_init(&mut rng);
        sim.inject(
            S,
            SocketAddr::new(sa("10.0.0.1:1").ip(), 10_000 + port),
            &init,
        );
    }
    let st = sim.hosts[S].ep.stats();
    let dh = st.get(Counter::PairDhComputed) - before;
    assert_eq!(
        u64::from(Config::default().pair_dh_burst),
        dh,
        "the source's burst, then cookies"
    );
    assert!(st.get(Counter::PairCookiesSent) >= 95);
    // The existing session is untouched: the connection keeps its keys and
    // a move still works.
    assert!(sim.hosts[S].ep.connection(&reverse(&f)).unwrap().has_keys);
}

#[test]
fn a_handshake_under_way_is_not_replaced_by_a_spoofed_pair_init() {
    let mut sim = Sim::new(63, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let (bl, bs) = sim.bindings(&f);
    // Both ends record the connection; what each sends is kept off the
    // wire, and only the client's PAIR_INIT is delivered, so the server
    // holds one handshake: the client's, as responder.
    let out = sim.capture(L, |ep, now, rng| {
        ep.connection_added(now, rng, f, f.local, f.remote, bl)
            .unwrap()
    });
    let g = reverse(&f);
    sim.capture(S, |ep, now, rng| {
        ep.connection_added(now, rng, g, g.local, g.remote, bs)
            .unwrap()
    });
    sim.hosts[S].ep.pairing.clear_handshakes();
    let real = out
        .iter()
        .find(|t| t.payload[1] == Kind::PairInit as u8)
        .expect("the client's PAIR_INIT")
        .payload
        .clone();
    let answer = sim.inject(S, sa("10.0.0.1:2031"), &real);
    assert_eq!(kinds(&answer), vec![Kind::PairResp as u8]);
    // A spoofed PAIR_INIT from the client's address gets a cookie, and
    // nothing else happens.
    let mut rng = DrbgRng::from_seed(7);
    let spoofed = spoofed_init(&mut rng);
    let replies = sim.inject(S, sa("10.0.0.1:2031"), &spoofed);
    assert_eq!(kinds(&replies), vec![Kind::PairCookie as u8]);
    assert_eq!(sim.hosts[S].ep.stats().get(Counter::PairDhComputed), 1);
    // The client's handshake is still the one held: pairing completes on
    // it (its PAIR_RESP again, retransmitted), with no other DH.
    sim.run_for(Duration::from_secs(10));
    assert_eq!(sim.hosts[S].ep.stats().get(Counter::PairDhComputed), 1);
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    assert!(sim.hosts[S].ep.connection(&g).unwrap().has_keys);
}

#[test]
fn a_loaded_responder_pairs_a_real_initiator_through_its_cookie() {
    let mut sim = Sim::new(64, Link::default());
    let cfg = Config {
        max_pending_pairings: 2,
        ..Config::default()
    };
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", cfg);
    // The server answers one handshake already (a spoofed PAIR_INIT from an
    // address it has a connection with): with a table of 2, it is loaded.
    let other = tcp("10.0.0.2:5000", "10.0.0.9:53");
    sim.capture(S, |ep, now, rng| added(ep, now, rng, other));
    sim.hosts[S].ep.pairing.clear_handshakes();
    let mut rng = DrbgRng::from_seed(8);
    let replies = sim.inject(S, sa("10.0.0.9:2031"), &spoofed_init(&mut rng));
    assert_eq!(kinds(&replies), vec![Kind::PairResp as u8]);
    // Only the laptop initiates (the server's own PAIR_INIT is kept off the
    // wire and forgotten): no crossing, so any cookie is the load's.
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let g = reverse(&f);
    let (bl, bs) = sim.bindings(&f);
    sim.capture(S, |ep, now, rng| {
        ep.connection_added(now, rng, g, g.local, g.remote, bs)
            .unwrap()
    });
    let pairing = &mut sim.hosts[S].ep.pairing;
    pairing.remove_handshake(sa("10.0.0.1:2031"), super::pairing::Side::Ours);
    pairing.remove_handshake(sa("10.0.0.1:2031"), super::pairing::Side::Theirs);
    sim.with(L, |ep, now, rng| {
        ep.connection_added(now, rng, f, f.local, f.remote, bl)
            .unwrap()
    });
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    let (l, s) = (sim.hosts[L].ep.stats(), sim.hosts[S].ep.stats());
    assert!(
        s.get(Counter::PairCookiesSent) >= 1 && l.get(Counter::PairCookieEchoed) >= 1,
        "paired through a cookie: server {s:?}, client {l:?}"
    );
    assert_eq!(s.rejected(Reject::PairBadCookie), 0);
}

#[test]
fn crossing_pairings_need_no_cookie_and_no_extra_round_trip() {
    let mut sim = Sim::new(67, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    sim.connect(L, S, f);
    sim.run_for(Duration::from_secs(10));
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    for h in [L, S] {
        let st = sim.hosts[h].ep.stats();
        assert_eq!(st.get(Counter::PairCookiesSent), 0, "{st:?}");
    }
}

#[test]
fn a_failed_pairing_is_tried_again_with_backoff_until_the_peer_answers() {
    let mut sim = Sim::new(65, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    // The path is down both ways at first: every handshake times out.
    sim.hosts[L].mute = true;
    sim.hosts[S].mute = true;
    sim.connect(L, S, f);
    sim.run_for(Duration::from_secs(60));
    let st = sim.hosts[L].ep.stats();
    assert!(st.get(Counter::PairingTimedOut) >= 1);
    assert!(st.get(Counter::PairingRetried) >= 1, "{st:?}");
    assert!(!sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    // Retries are spaced out: far fewer PAIR_INITs than a tight loop.
    let inits = sim
        .wire_log
        .iter()
        .filter(|(_, _, _, k)| *k == Kind::PairInit as u8)
        .count();
    assert!(inits < 60, "{inits} PAIR_INITs in a minute");
    // The path comes back: the next retry pairs, with no other input.
    sim.hosts[L].mute = false;
    sim.hosts[S].mute = false;
    sim.run_for(Duration::from_secs(120));
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    assert!(sim.hosts[S].ep.connection(&reverse(&f)).unwrap().has_keys);
}

#[test]
fn new_pairings_start_at_a_bounded_rate_whatever_the_number_of_peers() {
    let mut sim = Sim::new(66, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    // 300 flows to 300 addresses nobody answers at (a UDP server that
    // answered 300 spoofed sources, say).
    for i in 0..300u32 {
        let remote = format!(
            "10.{}.{}.{}:5000",
            100 + i / 65_536,
            (i / 256) % 256,
            i % 256
        );
        let f = tcp("10.0.0.1:53", &remote);
        sim.with(L, |ep, now, rng| added(ep, now, rng, f));
    }
    let first_inits = |sim: &Sim, upto: Duration| {
        let start = sim.wire_log.first().map_or(sim.now, |w| w.0);
        let mut dsts = std::collections::HashSet::new();
        for (t, _, dst, k) in &sim.wire_log {
            if *k == Kind::PairInit as u8 && t.since(start) <= upto {
                dsts.insert(*dst);
            }
        }
        dsts.len()
    };
    sim.run_for(Duration::from_secs(1));
    let cfg = Config::default();
    let in_1s = first_inits(&sim, Duration::from_secs(1));
    assert!(
        in_1s <= (cfg.pair_starts_burst + cfg.pair_starts_per_sec + 1) as usize,
        "{in_1s} pairings started in the first second"
    );
    assert!(sim.hosts[L].ep.stats().get(Counter::PairingDeferred) > 0);
    // None is dropped: every address gets its PAIR_INIT in time.
    sim.run_for(Duration::from_secs(30));
    assert_eq!(first_inits(&sim, Duration::from_secs(31)), 300);
}

/// A retry that falls due while a handshake of ours with that address is
/// under way (the answering side of a crossing timed out first) marks the
/// attempt as under way instead of staying due, which would make every
/// loop turn come back to it.
#[test]
fn a_retry_due_while_our_handshake_is_under_way_does_not_stay_due() {
    let mut sim = Sim::new(68, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    sim.hosts[S].alive = false;
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    sim.capture(L, |ep, now, rng| added(ep, now, rng, f));
    let ip = sa("10.0.0.2:1").ip();
    sim.with(L, |ep, now, _| ep.retry_pairing_later(now, ip));
    // The retry is due after 5 s; our handshake retransmits until about
    // 15 s. Step to just past the retry by hand (a simulator run would spin
    // with the defect instead of failing).
    sim.run_for(Duration::from_secs(4));
    sim.now = sim.now.plus(Duration::from_secs(2));
    sim.with(L, |ep, now, rng| ep.handle_timeout(now, rng));
    let ep = &sim.hosts[L].ep;
    assert!(ep
        .pairing
        .has_handshake(sa("10.0.0.2:2031"), super::pairing::Side::Ours));
    let next = ep
        .poll_timeout()
        .expect("a handshake under way has a deadline");
    assert!(
        next > sim.now,
        "a deadline in the past: the loop would spin"
    );
}

/// The server's vnatd restarts while the laptop moves: the new one knows
/// neither the laptop's session nor its new address, and the connection it
/// finds again names the laptop's old address, where nobody answers. The
/// laptop's update draws an ERROR (unknown connection), the laptop pairs
/// again, the new server accepts the known host key from the new address
/// (after a cookie), both claim the connection, and the move completes.
#[test]
fn a_move_completes_when_the_peer_s_vnatd_restarted_meanwhile() {
    restart_while_moving(67, 0);
}

/// The same after moves under the old session: the new session numbers
/// its updates from the start, which the laptop must not take for stale
/// ones (its record of the old session's numbers goes with it).
#[test]
fn a_move_completes_when_the_peer_restarted_after_earlier_moves() {
    restart_while_moving(69, 10);
}

fn restart_while_moving(seed: u64, moves_before: u8) {
    let mut sim = Sim::new(seed, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    let (lb, sb) = sim.bindings(&f);
    sim.with(L, |ep, now, rng| {
        ep.connection_added(now, rng, f, f.local, f.remote, lb)
            .unwrap()
    });
    let back = reverse(&f);
    let add_on_server = |sim: &mut Sim, remote: SocketAddr| {
        sim.with(S, |ep, now, rng| {
            ep.connection_added(now, rng, back, back.local, remote, sb)
                .unwrap()
        })
    };
    add_on_server(&mut sim, back.remote);
    sim.run_for(Duration::from_secs(5));
    assert!(sim.hosts[S].ep.connection(&back).unwrap().has_keys);
    let laptop_key = sim.hosts[L].ep.public_key();
    let move_to = |sim: &mut Sim, ip: &str| {
        sim.move_host_keeping_old_local(L, ip);
        let to = SocketAddr::new(sim::ip(ip), 40000);
        sim.with(L, |ep, now, rng| ep.resume(now, rng, &[(f, to)]).unwrap());
        to
    };
    let mut at = back.remote;
    for i in 0..moves_before {
        at = move_to(&mut sim, &format!("10.0.{}.1", 2 + i));
        sim.run_for(Duration::from_secs(5));
        let s = sim.hosts[S].ep.connection(&back).unwrap();
        assert_eq!(s.remote_phys, at, "move {i} before the restart");
    }

    // The server's vnatd restarts (knowing the laptop's key from its peer
    // store, and the connection, at its current translation, from the
    // kernel) while the laptop moves.
    sim.restart_host(S, Config::default());
    sim.hosts[S]
        .ep
        .know_hosts([(laptop_key, sim::ip("10.0.0.1"))]);
    add_on_server(&mut sim, at);
    let new_local = move_to(&mut sim, "10.0.1.1");
    sim.run_for(Duration::from_secs(20));

    let l = sim.hosts[L].ep.stats();
    assert!(l.get(Counter::PairingRenewed) >= 1, "{l:?}");
    // The new session's updates are not taken for the old one's.
    assert_eq!(l.rejected(Reject::StaleUpdate), 0, "{l:?}");
    let s = sim.hosts[S]
        .ep
        .connection(&back)
        .expect("server's connection");
    assert_eq!(
        s.remote_phys, new_local,
        "the server follows the move: {s:?}"
    );
    assert!(s.has_keys && s.peer_key == Some(laptop_key), "{s:?}");
    let v = sim.hosts[L].ep.connection(&f).expect("laptop's connection");
    assert_eq!(v.local_phys, new_local, "{l:?}");
    assert!(!v.migrating, "{v:?}");
}

/// Anyone can send an ERROR: while none of our moves waits for the peer
/// it names, it gets nothing (no new pairing, no key reset), and never
/// anything from an address we are not paired with. (While a move waits,
/// at most one renewal per interval: the test above.)
#[test]
fn forged_unknown_connection_errors_renew_nothing_unless_a_move_waits() {
    let mut sim = Sim::new(71, Link::default());
    sim.add_host("10.0.0.1", Config::default());
    sim.add_host("10.0.0.2", Config::default());
    sim.connect(L, S, tcp("10.0.0.1:40000", "10.0.0.2:443"));
    sim.run_for(Duration::from_secs(5));
    let error = |id| {
        Message::Error {
            request_id: id,
            code: super::wire::ErrorCode::UnknownConnection,
        }
        .encode()
        .unwrap()
    };
    for id in 0..50 {
        sim.inject(L, sa("10.0.0.2:2031"), &error(id));
        sim.inject(L, sa("10.6.6.6:2031"), &error(id));
    }
    sim.run_for(Duration::from_secs(5));
    let st = sim.hosts[L].ep.stats();
    assert_eq!(st.get(Counter::PairingRenewed), 0, "{st:?}");
    assert_eq!(st.get(Counter::PeerError), 100);
    // The renewed pairing works: the connection still has keys at both ends.
    let f = tcp("10.0.0.1:40000", "10.0.0.2:443");
    assert!(sim.hosts[L].ep.connection(&f).unwrap().has_keys);
    assert!(sim.hosts[S].ep.connection(&reverse(&f)).unwrap().has_keys);
}

/// A host key we paired with before opens the door from any address, but
/// keys travel in clear: whoever quotes one from an address we share
/// nothing with must prove that address with a cookie before we compute a
/// DH or keep anything.
#[test]
fn a_known_key_from_a_new_address_must_echo_a_cookie() {
    let mut sim = Sim::new(73, Link::default());
    sim.add_host("10.0.0.2", Config::default());
    let known = HostIdentity::from_bytes([5; 32]).public();
    sim.hosts[0].ep.know_hosts([(known, sim::ip("10.0.0.1"))]);
    let mut rng = DrbgRng::from_seed(5);
    let init = |rng: &mut DrbgRng| {
        let mut k = [0u8; 32];
        rng.fill_bytes(&mut k);
        Message::PairInit {
            request_id: 7,
            static_pub: known,
            eph_pub: HostIdentity::from_bytes(k).public(),
            cookie: None,
        }
        .encode()
        .unwrap()
    };
    let replies = sim.inject(0, sa("10.6.6.6:2031"), &init(&mut rng));
    assert_eq!(kinds(&replies), vec![Kind::PairCookie as u8]);
    let st = sim.hosts[0].ep.stats();
    assert_eq!(st.get(Counter::PairDhComputed), 0, "{st:?}");
    // A stranger's key from a stranger's address: dropped, as before.
    let mut other = init(&mut rng);
    other[12] ^= 0xff; // inside static_pub
    assert!(sim.inject(0, sa("10.6.6.7:2031"), &other).is_empty());
}

/// An update naming a connection we have no keys for is answered (ERROR
/// unknown-connection, so a peer that lost our session pairs again) only
/// if the connection is with a host we were paired with: for any other,
/// an answer would tell a stranger which connections exist.
#[test]
fn only_a_known_host_s_connections_draw_an_unknown_connection_error() {
    use super::wire::{Ext, Family, Record};
    let mut sim = Sim::new(79, Link::default());
    sim.add_host("10.0.0.2", Config::default());
    let f = tcp("10.0.0.2:443", "10.0.0.1:40000");
    sim.with(0, |ep, now, r| added(ep, now, r, f));
    let upd = Message::Records {
        kind: Kind::Upd,
        request_id: 0,
        family: Family::V4,
        records: vec![Record {
            command: Kind::Upd,
            proto: f.proto,
            receiver_vir: f.local,
            sender_vir: f.remote,
            sender_phys: sa("10.0.9.9:40000"),
            ext: Ext::None,
            seq: 1,
            tag: [0; 16],
        }],
    }
    .encode()
    .unwrap();
    // Credit for the anti-amplification budget, as a real sender has.
    let from = sa("10.6.6.6:2031");
    sim.inject(0, from, &[0u8; 200]);
    assert!(
        sim.inject(0, from, &upd).is_empty(),
        "a stranger's probe was answered"
    );
    sim.hosts[0].ep.know_hosts([(
        HostIdentity::from_bytes([6; 32]).public(),
        sim::ip("10.0.0.1"),
    )]);
    let replies = sim.inject(0, from, &upd);
    assert_eq!(kinds(&replies), vec![Kind::Error as u8]);
}
