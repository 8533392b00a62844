//! The anti-amplification budget of a flow that sends to a peer address
//! not validated yet (`NAT_F_BUDGET`), run by the kernel on crafted packets
//! through BPF_PROG_TEST_RUN: the egress translator lets out at most what
//! the flow's allowance holds, counting whole IP packets, and drops the
//! rest with a named counter; every packet that comes in from that address
//! adds three times its length; a flow whose allowance is missing sends
//! nothing; a flow without the bit is not limited. What is over the
//! allowance goes to the flow's last validated placement when the
//! allowance names one (untranslated, or an earlier translation), where a
//! drop would be a local failure that TCP gives up on after 7.5 s; but
//! only once the fallback's wait is over (a TCP flow's first second).

mod support;

use std::{thread, time::Duration};

use support::packet::Spec;
use support::{counter, run};
use vnat_common::NAT_F_BUDGET;
use vnat_daemon::datapath::{kernel::pair_for, Proto, Translation, VirtualFlow};

const PASS: u32 = -1i32 as u32;
const TC_ACT_SHOT: u32 = 2;

use support::open_datapath as open;

/// The server's side of the laptop's connection after the laptop announced
/// 198.18.2.2 (from 198.18.1.2): the server sends there while it validates
/// the address.
fn server_sends_to_new_laptop_address() -> Translation {
    Translation {
        flow: VirtualFlow {
            proto: Proto::Tcp,
            local: "198.18.3.2:5001".parse().unwrap(),
            remote: "198.18.1.2:40000".parse().unwrap(),
        },
        physical_local: "198.18.3.2:5001".parse().unwrap(),
        physical_remote: "198.18.2.2:40000".parse().unwrap(),
    }
}

/// A segment the server's socket sends (virtual endpoints) with `payload`
/// bytes: an IP packet of 40 + `payload` bytes.
fn from_server(payload: usize) -> Vec<u8> {
    let mut s = Spec::tcp("198.18.3.2:5001", "198.18.1.2:40000");
    s.payload = vec![7; payload];
    s.frame()
}

/// A segment from the laptop's announced address, `payload` bytes.
fn from_laptop(payload: usize) -> Vec<u8> {
    let mut s = Spec::tcp("198.18.2.2:40000", "198.18.3.2:5001");
    s.payload = vec![9; payload];
    s.frame()
}

#[test]
fn an_unvalidated_address_gets_at_most_three_times_what_came_from_it() {
    let (mut dp, _pins) = open("tc-budget");
    let t = server_sends_to_new_laptop_address();
    dp.insert_nat_pair(&pair_for(&t, 1, NAT_F_BUDGET)).unwrap();
    // What the update that announced the address allowed: 300 bytes.
    dp.insert_unvalidated_budget(&t.flow, 300, None).unwrap();
    let dropped = counter(&dp, "drop_unvalidated");

    // 140-byte packets: two fit in 300, the third does not.
    assert_eq!(run(&dp, true, &from_server(100)).verdict, PASS);
    assert_eq!(run(&dp, true, &from_server(100)).verdict, PASS);
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), Some((300, 280)));
    let out = run(&dp, true, &from_server(100));
    assert_eq!(
        out.verdict, TC_ACT_SHOT,
        "a packet over the budget, with no validated placement to go to, must be dropped"
    );
    assert_eq!(counter(&dp, "drop_unvalidated"), dropped + 1);
    // A dropped packet is not counted as sent.
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), Some((300, 280)));

    // A 40-byte ACK from the address adds 120 bytes: 420 in all, and
    // the packet is translated as usual.
    let ack = run(&dp, false, &from_laptop(0));
    assert_eq!(ack.verdict, PASS);
    let p = support::packet::parse_checked(&ack.packet);
    assert_eq!((p.src, p.dst), (t.flow.remote, t.flow.local));
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), Some((420, 280)));
    let out = run(&dp, true, &from_server(100));
    assert_eq!(out.verdict, PASS, "exactly the budget may leave");
    let p = support::packet::parse_checked(&out.packet);
    assert_eq!((p.src, p.dst), (t.physical_local, t.physical_remote));
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), Some((420, 420)));
    assert_eq!(run(&dp, true, &from_server(0)).verdict, TC_ACT_SHOT);

    // Whatever is sent and dropped, never more than three times what came
    // from there.
    for _ in 0..20 {
        run(&dp, true, &from_server(1000));
    }
    let (allowed, sent) = dp.unvalidated_budget(&t.flow).unwrap().unwrap();
    assert!(
        sent <= allowed && allowed == 300 + 3 * 40,
        "{sent} of {allowed}"
    );
}

#[test]
fn a_flow_whose_allowance_is_missing_sends_nothing_and_receives() {
    let (mut dp, _pins) = open("tc-budget-none");
    let t = server_sends_to_new_laptop_address();
    dp.insert_nat_pair(&pair_for(&t, 1, NAT_F_BUDGET)).unwrap();
    let dropped = counter(&dp, "drop_unvalidated");
    assert_eq!(run(&dp, true, &from_server(0)).verdict, TC_ACT_SHOT);
    assert_eq!(counter(&dp, "drop_unvalidated"), dropped + 1);
    assert_eq!(run(&dp, false, &from_laptop(10)).verdict, PASS);
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), None);
}

#[test]
fn a_validated_address_is_not_limited() {
    let (mut dp, _pins) = open("tc-budget-off");
    let t = server_sends_to_new_laptop_address();
    dp.insert_nat_pair(&pair_for(&t, 1, 0)).unwrap();
    let dropped = counter(&dp, "drop_unvalidated");
    for _ in 0..10 {
        let out = run(&dp, true, &from_server(1400));
        assert_eq!(out.verdict, PASS);
    }
    assert_eq!(counter(&dp, "drop_unvalidated"), dropped);
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), None);
}

/// The laptop moved from 198.18.5.2, where the server's translation of its
/// connection sent until now (validated), to 198.18.2.2.
fn second_move() -> (Translation, Translation) {
    let new = server_sends_to_new_laptop_address();
    let old = Translation {
        physical_remote: "198.18.5.2:40000".parse().unwrap(),
        ..new
    };
    (old, new)
}

#[test]
fn what_is_over_the_budget_goes_to_the_last_validated_placement() {
    let (mut dp, _pins) = open("tc-budget-fallback");
    let (old, new) = second_move();
    dp.insert_nat_pair(&pair_for(&new, 1, NAT_F_BUDGET))
        .unwrap();
    dp.insert_unvalidated_budget(&new.flow, 150, Some((&old, Duration::ZERO)))
        .unwrap();
    let (dropped, fell_back) = (
        counter(&dp, "drop_unvalidated"),
        counter(&dp, "unvalidated_fallback"),
    );

    // Within the allowance: to the new address.
    let out = run(&dp, true, &from_server(100));
    assert_eq!(out.verdict, PASS);
    let p = support::packet::parse_checked(&out.packet);
    assert_eq!((p.src, p.dst), (new.physical_local, new.physical_remote));
    // Over it: to the old one, translated and with valid checksums
    // (`parse_checked`), not dropped, and not counted as sent to the new.
    for _ in 0..3 {
        let out = run(&dp, true, &from_server(100));
        assert_eq!(
            out.verdict, PASS,
            "over the budget: sent to the old placement"
        );
        let p = support::packet::parse_checked(&out.packet);
        assert_eq!(
            (p.src, p.dst),
            (old.physical_local, old.physical_remote),
            "a packet over the budget must go to the last validated address, never the new one"
        );
    }
    assert_eq!(dp.unvalidated_budget(&new.flow).unwrap(), Some((150, 140)));
    assert_eq!(dp.unvalidated_diverted(&new.flow).unwrap(), Some(3));
    assert_eq!(counter(&dp, "unvalidated_fallback"), fell_back + 3);
    assert_eq!(counter(&dp, "drop_unvalidated"), dropped);

    // What comes from the new address still opens the budget there.
    assert_eq!(run(&dp, false, &from_laptop(0)).verdict, PASS);
    let out = run(&dp, true, &from_server(50));
    let p = support::packet::parse_checked(&out.packet);
    assert_eq!(p.dst, new.physical_remote);
}

#[test]
fn over_the_budget_of_a_first_move_the_packet_leaves_untranslated() {
    let (mut dp, _pins) = open("tc-budget-untranslated");
    let t = server_sends_to_new_laptop_address();
    dp.insert_nat_pair(&pair_for(&t, 1, NAT_F_BUDGET)).unwrap();
    // The connection was never translated: its last validated placement
    // is its own endpoints.
    let home = Translation {
        physical_local: t.flow.local,
        physical_remote: t.flow.remote,
        ..t
    };
    dp.insert_unvalidated_budget(&t.flow, 0, Some((&home, Duration::ZERO)))
        .unwrap();
    let packet = from_server(100);
    let out = run(&dp, true, &packet);
    assert_eq!(out.verdict, PASS);
    assert_eq!(
        out.packet, packet,
        "over the budget of a first move, the packet must leave as the socket sent it"
    );
    assert_eq!(dp.unvalidated_budget(&t.flow).unwrap(), Some((0, 0)));
    assert_eq!(dp.unvalidated_diverted(&t.flow).unwrap(), Some(1));
}

#[test]
fn over_the_budget_a_packet_is_held_until_its_fallback_s_wait_is_over() {
    let (mut dp, _pins) = open("tc-budget-wait");
    let (old, new) = second_move();
    dp.insert_nat_pair(&pair_for(&new, 1, NAT_F_BUDGET))
        .unwrap();
    let wait = Duration::from_millis(300);
    dp.insert_unvalidated_budget(&new.flow, 0, Some((&old, wait)))
        .unwrap();
    let (dropped, fell_back) = (
        counter(&dp, "drop_unvalidated"),
        counter(&dp, "unvalidated_fallback"),
    );

    // Within the wait: dropped (the socket keeps it and sends it again),
    // neither to the new address nor to the old one.
    let out = run(&dp, true, &from_server(100));
    assert_eq!(
        out.verdict, TC_ACT_SHOT,
        "over the budget within the fallback's wait, a packet must stay in the socket"
    );
    assert_eq!(counter(&dp, "drop_unvalidated"), dropped + 1);
    assert_eq!(dp.unvalidated_diverted(&new.flow).unwrap(), Some(0));

    // After it: to the old placement.
    thread::sleep(wait + Duration::from_millis(100));
    let out = run(&dp, true, &from_server(100));
    assert_eq!(
        out.verdict, PASS,
        "after the wait: sent to the old placement"
    );
    let p = support::packet::parse_checked(&out.packet);
    assert_eq!((p.src, p.dst), (old.physical_local, old.physical_remote));
    assert_eq!(counter(&dp, "unvalidated_fallback"), fell_back + 1);
    assert_eq!(dp.unvalidated_diverted(&new.flow).unwrap(), Some(1));
}

/// The peer sent its update for the budgeted address again: vnatd credits
/// the allowance again in place (`Datapath::credit_unvalidated`) instead
/// of installing the translation again. Nothing sent counts any more, the
/// fallback and what it took stay, and the packet that went to the old
/// placement before the credit goes to the new address after it.
#[test]
fn a_credited_allowance_sends_to_the_new_address_again_and_keeps_the_fallback() {
    use vnat_daemon::datapath::Datapath;
    let (mut dp, _pins) = open("tc-budget-credit");
    let (old, new) = second_move();
    dp.insert_nat_pair(&pair_for(&new, 1, NAT_F_BUDGET))
        .unwrap();
    dp.insert_unvalidated_budget(&new.flow, 150, Some((&old, Duration::ZERO)))
        .unwrap();
    assert_eq!(run(&dp, true, &from_server(100)).verdict, PASS);
    let p = support::packet::parse_checked(&run(&dp, true, &from_server(100)).packet);
    assert_eq!(
        p.dst, old.physical_remote,
        "over the allowance: the fallback"
    );
    assert_eq!(dp.unvalidated_diverted(&new.flow).unwrap(), Some(1));

    assert!(dp.credit_unvalidated(&new.flow, 400).unwrap());
    assert_eq!(dp.unvalidated_budget(&new.flow).unwrap(), Some((400, 0)));
    assert_eq!(dp.unvalidated_diverted(&new.flow).unwrap(), Some(1));
    let out = run(&dp, true, &from_server(100));
    assert_eq!(out.verdict, PASS);
    let p = support::packet::parse_checked(&out.packet);
    assert_eq!(
        (p.src, p.dst),
        (new.physical_local, new.physical_remote),
        "credited: to the new address again"
    );
    // Over the new allowance the fallback is still there.
    for _ in 0..3 {
        run(&dp, true, &from_server(100));
    }
    let p = support::packet::parse_checked(&run(&dp, true, &from_server(100)).packet);
    assert_eq!(p.dst, old.physical_remote, "the fallback kept");

    // A flow without an allowance is not given one.
    let other = VirtualFlow {
        proto: Proto::Tcp,
        local: "198.18.3.2:5001".parse().unwrap(),
        remote: "198.18.1.2:40001".parse().unwrap(),
    };
    assert!(!dp.credit_unvalidated(&other, 400).unwrap());
    assert_eq!(dp.unvalidated_budget(&other).unwrap(), None);
}
