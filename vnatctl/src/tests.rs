//! Rendering and the JSON contract.

use std::path::PathBuf;

use serde_json::{json, Value};
use vnat_control::{
    datapath::{CgroupAttachment, ConnState, ConnectionInfo, DatapathStatus, Proto, TcAttachment},
    DaemonInfo, ErrorKind, ListedConnection, StatusReply,
};

use super::{output, select, ClientError, Failure, ProtoArg, StateArg};

fn conn(
    proto: Proto,
    vl: &str,
    vr: &str,
    pl: &str,
    state: ConnState,
    pid: Option<u32>,
) -> ListedConnection {
    let addr = |s: &str| {
        s.parse()
            .unwrap_or_else(|e| panic!("test address {s}: {e}"))
    };
    let info = ConnectionInfo {
        id: 7,
        proto,
        virtual_local: addr(vl),
        virtual_remote: addr(vr),
        physical_local: addr(pl),
        physical_remote: addr(vr),
        state,
        cookie: 99,
        cgroup_id: 5,
        cgroup: pid.map(|_| "/system.slice/app.service".into()),
        pid,
        command: pid.map(|_| "curl".into()),
        age_secs: 12,
        recorded_ns: 0,
        tcp_isns: None,
        adopted: false,
        hide_location: false,
        udp_inbound_only: false,
        guest: None,
    };
    // The native TCP one has a vnatd peer in this sample; the UDP one not.
    let mobile = proto == Proto::Tcp;
    ListedConnection {
        info,
        mobile,
        seen_by_peer_as: None,
        why_not_mobile: (!mobile).then(|| "no vnatd answered at the peer's address".into()),
        role: None,
        moving: false,
        keepalive_held: false,
        placed: None,
        helpers_asked: Vec::new(),
        helping: Vec::new(),
        // The TCP one's peer is moving (under way).
        last_move: mobile.then(|| vnat_control::LastMove {
            side: vnat_control::Side::Peer,
            from: addr(vr),
            to: addr("198.18.4.2:5001"),
            outcome: None,
            handover_ms: None,
            reason: None,
            started_ms: 1,
            ended_ms: None,
        }),
    }
}

fn sample() -> Vec<ListedConnection> {
    vec![
        conn(
            Proto::Udp,
            "[fd00:1::2]:5353",
            "[fd00:3::2]:53",
            "[fd00:2::2]:5353",
            ConnState::Translated,
            None,
        ),
        conn(
            Proto::Tcp,
            "198.18.1.2:40000",
            "198.18.3.2:5001",
            "198.18.1.2:40000",
            ConnState::Native,
            Some(42),
        ),
    ]
}

#[test]
fn ls_json_keys_are_the_contract() {
    let rows = select(sample(), None, None);
    let v = serde_json::to_value(&rows).expect("serializable");
    let array = v.as_array().expect("ls --json prints an array");
    assert_eq!(array.len(), 2);
    let keys: Vec<&str> = array[0]
        .as_object()
        .expect("object")
        .keys()
        .map(String::as_str)
        .collect();
    let mut expected = vec![
        "id",
        "proto",
        "virtual_local",
        "virtual_remote",
        "physical_local",
        "physical_remote",
        "state",
        "pid",
        "command",
        "cgroup",
        "cgroup_id",
        "cookie",
        "age_secs",
        "mobile",
        "behind_nat",
        "seen_by_peer_as",
        "why_not_mobile",
        "role",
        "moving",
        "keepalive_held",
        "placed",
        "helpers_asked",
        "helping",
        "adopted",
        "hide_location",
        "guest",
        "last_move",
    ];
    let mut keys_sorted = keys.clone();
    keys_sorted.sort_unstable();
    expected.sort_unstable();
    assert_eq!(
        keys_sorted, expected,
        "ls --json keys changed: scripts depend on them"
    );
    // Sorted by virtual local endpoint: the IPv4 one first.
    assert_eq!(
        array[0],
        json!({
            "id": 7, "proto": "tcp",
            "virtual_local": "198.18.1.2:40000", "virtual_remote": "198.18.3.2:5001",
            "physical_local": "198.18.1.2:40000", "physical_remote": "198.18.3.2:5001",
            "state": "native", "pid": 42, "command": "curl", "cgroup": "/system.slice/app.service",
            "cgroup_id": 5, "cookie": 99, "age_secs": 12, "mobile": true,
            "behind_nat": false, "seen_by_peer_as": null, "why_not_mobile": null,
            "role": null, "moving": false, "keepalive_held": false, "placed": null, "helpers_asked": [],
            "helping": [], "adopted": false, "hide_location": false,
            "guest": null,
            "last_move": {
                "side": "peer", "from": "198.18.3.2:5001", "to": "198.18.4.2:5001",
                "outcome": "moving", "handover_ms": null, "reason": null,
                "started_ms": 1, "ended_ms": null
            }
        })
    );
    assert_eq!(array[1]["proto"], "udp");
    assert_eq!(
        array[1]["virtual_local"], "[fd00:1::2]:5353",
        "IPv6 endpoints are [ip]:port"
    );
    assert_eq!(array[1]["physical_local"], "[fd00:2::2]:5353");
    assert_eq!(array[1]["state"], "translated");
    assert_eq!(array[1]["mobile"], false);
    assert_eq!(
        array[1]["why_not_mobile"],
        "no vnatd answered at the peer's address"
    );
    assert_eq!(
        (array[1]["pid"].clone(), array[1]["command"].clone()),
        (Value::Null, Value::Null)
    );
}

#[test]
fn ls_filters() {
    let only = |p, s| {
        select(sample(), p, s)
            .iter()
            .map(|r| r.proto.clone())
            .collect::<Vec<_>>()
    };
    assert_eq!(only(Some(ProtoArg::Udp), None), vec!["udp"]);
    assert_eq!(only(Some(ProtoArg::Tcp), None), vec!["tcp"]);
    assert_eq!(only(None, Some(StateArg::Translated)), vec!["udp"]);
    assert_eq!(
        only(Some(ProtoArg::Tcp), Some(StateArg::Translated)),
        Vec::<String>::new()
    );
}

#[test]
fn ls_table_has_the_documented_columns_and_dashes() {
    let text = output::ls_table(&select(sample(), None, None));
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    let header: Vec<&str> = lines[0].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "ID",
            "PROTO",
            "VIRTUAL-LOCAL",
            "VIRTUAL-REMOTE",
            "PHYSICAL-LOCAL",
            "PHYSICAL-REMOTE",
            "STATE",
            "MOBILE",
            "ROLE",
            "PID",
            "COMMAND",
            "CGROUP",
            "LAST-MOVE",
            "NOTE"
        ]
    );
    let tcp: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        tcp,
        [
            "7",
            "tcp",
            "198.18.1.2:40000",
            "198.18.3.2:5001",
            "198.18.1.2:40000",
            "198.18.3.2:5001",
            "native",
            "yes",
            "-",
            "42",
            "curl",
            "/system.slice/app.service",
            "peer",
            "moving",
            "-"
        ]
    );
    let udp: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(&udp[6..13], ["translated", "no", "-", "-", "-", "-", "-"]);
    let note = lines[0].find("NOTE").expect("NOTE column");
    assert_eq!(&lines[2][note..], "no vnatd answered at the peer's address");
    // Columns line up: every column starts at the header's offset.
    let col = |line: &str, n: usize| line.match_indices(char::is_whitespace).count() >= n;
    assert!(lines.iter().all(|l| col(l, 12)));
    let start = lines[0].find("STATE").expect("STATE column");
    assert_eq!(&lines[1][start..start + 6], "native");
    assert_eq!(&lines[2][start..start + 10], "translated");
    assert!(
        lines.iter().all(|l| !l.ends_with(' ')),
        "no trailing blanks"
    );
}

#[test]
fn empty_ls_is_just_the_header() {
    assert_eq!(output::ls_table(&[]).lines().count(), 1);
}

fn status() -> StatusReply {
    StatusReply {
        daemon: DaemonInfo {
            version: "0.1.0".into(),
            pid: 321,
            uptime_secs: 3725,
            control: "/run/vnat/vnatd.sock".into(),
            state_dir: "/var/lib/vnat".into(),
            listen: "0.0.0.0:2031".parse().expect("addr"),
            configured_cgroups: vec!["/sys/fs/cgroup/unified".into()],
        },
        datapath: DatapathStatus {
            kernel: "6.1.0-50-amd64".into(),
            tc_mode: vnat_control::datapath::TcMode::Clsact,
            degraded: vec![vnat_control::datapath::Degraded {
                feature: "tcx".into(),
                needs: "TCX (Linux 6.6)".into(),
                effect: "tc attaches as clsact filters".into(),
            }],
            bpffs: "/sys/fs/bpf/vnat".into(),
            netns_cookie: 4096,
            programs_loaded: vec!["vnat_sockops".into(), "vnat_tc_egress".into()],
            cgroups: vec![CgroupAttachment {
                path: "/sys/fs/cgroup/unified".into(),
                id: 1,
                hide_location: true,
            }],
            tc: vec![TcAttachment {
                ifname: "eth0".into(),
                ifindex: 2,
                mode: vnat_control::datapath::TcMode::Tcx,
                users: 3,
            }],
            connections: 10,
            translations: 3,
            counters: vec![
                ("tc_rewritten".into(), 1500),
                ("tc_drop_no_route".into(), 2),
            ],
        },
        vcmp: Some(vnat_control::VcmpCounters {
            host_key: "ab".repeat(32),
            events: [("datagrams_received".to_string(), 12)]
                .into_iter()
                .collect(),
            rejected: [("bad_mac".to_string(), 2)].into_iter().collect(),
        }),
        location: Some(vnat_control::LocationStatus {
            store: "etcd".into(),
            description: "etcd at http://198.18.6.2:2379".into(),
            servers: vec!["198.18.6.9:2031".parse().unwrap()],
            etcd: Some(vnat_control::EtcdHealth {
                state: "failing".into(),
                answered: 3,
                failed: 2,
                last_answer_secs_ago: Some(70),
                last_error: Some("etcd at http://198.18.6.2:2379 does not answer".into()),
                last_error_secs_ago: Some(4),
            }),
        }),
    }
}

#[test]
fn status_text_says_where_locations_are_kept_and_whether_etcd_answers() {
    let text = output::status_text(&status());
    for needle in [
        "locations    etcd at http://198.18.6.2:2379",
        "etcd: FAILING, moves go on without it (2 of 5 calls failed, the last 4s ago): etcd at http://198.18.6.2:2379 does not answer",
        "location servers: 198.18.6.9:2031",
    ] {
        assert!(text.contains(needle), "status lacks {needle:?}:\n{text}");
    }
    let mut ok = status();
    let l = ok.location.as_mut().unwrap();
    l.servers.clear();
    let h = l.etcd.as_mut().unwrap();
    h.state = "answering".into();
    h.last_answer_secs_ago = Some(2);
    let text = output::status_text(&ok);
    assert!(
        text.contains("etcd: answering (3 of 5 calls, the last 2s ago)"),
        "{text}"
    );
    assert!(!text.contains("location servers"), "{text}");
    ok.location = None;
    assert!(!output::status_text(&ok).contains("locations"));
}

#[test]
fn status_text_shows_attachments_counts_and_counters() {
    let text = output::status_text(&status());
    for needle in [
        "vnatd 0.1.0, pid 321, up 1h02m05s",
        "/sys/fs/cgroup/unified (id 1, hides location)",
        "eth0 (ifindex 2, tcx, 3 translated flows)",
        "10 (3 translated)",
        "vnat_sockops, vnat_tc_egress",
        "0.0.0.0:2031",
    ] {
        assert!(text.contains(needle), "status lacks {needle:?}:\n{text}");
    }
    let counters: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("COUNTER"))
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert_eq!(counters.len(), 3, "{text}");
    let vcmp: Vec<Vec<&str>> = text
        .lines()
        .skip_while(|l| !l.starts_with("VCMP"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        vcmp.get(1).map(Vec::as_slice),
        Some(&["datagrams_received", "12"][..]),
        "{text}"
    );
    assert_eq!(
        vcmp.get(2).map(Vec::as_slice),
        Some(&["rejected:", "bad_mac", "2"][..]),
        "{text}"
    );
    assert_eq!(
        counters[1].split_whitespace().collect::<Vec<_>>(),
        ["tc_rewritten", "1500"]
    );

    let mut empty = status();
    empty.datapath.cgroups.clear();
    empty.datapath.tc.clear();
    empty.datapath.counters.clear();
    let text = output::status_text(&empty);
    assert!(text.contains("vnatctl enable --cgroup DIR"), "{text}");
    assert!(text.contains("no counters yet"), "{text}");
}

#[test]
fn status_json_shape() {
    let v = serde_json::to_value(output::StatusJson::from(&status())).expect("serializable");
    assert_eq!(v["daemon"]["pid"], 321);
    assert_eq!(v["daemon"]["listen"], "0.0.0.0:2031");
    assert_eq!(
        v["daemon"]["configured_cgroups"],
        json!(["/sys/fs/cgroup/unified"])
    );
    assert_eq!(
        v["datapath"]["cgroups"],
        json!([{ "path": "/sys/fs/cgroup/unified", "id": 1, "hide_location": true }])
    );
    assert_eq!(
        v["datapath"]["tc"],
        json!([{ "ifname": "eth0", "ifindex": 2, "mode": "tcx", "users": 3 }])
    );
    assert_eq!(
        v["datapath"]["counters"],
        json!({ "tc_rewritten": 1500, "tc_drop_no_route": 2 })
    );
    assert_eq!(
        (
            v["datapath"]["connections"].clone(),
            v["datapath"]["translations"].clone()
        ),
        (json!(10), json!(3))
    );
    assert_eq!(v["datapath"]["bpffs"], "/sys/fs/bpf/vnat");
    assert_eq!(v["location"]["store"], "etcd");
    assert_eq!(v["location"]["servers"], json!(["198.18.6.9:2031"]));
    assert_eq!(v["location"]["etcd"]["state"], "failing");
    assert_eq!(v["location"]["etcd"]["failed"], 2);
    assert_eq!(v["location"]["etcd"]["last_error_secs_ago"], 4);
}

#[test]
fn durations() {
    assert_eq!(output::duration(0), "0s");
    assert_eq!(output::duration(61), "1m01s");
    assert_eq!(output::duration(3725), "1h02m05s");
    assert_eq!(output::duration(90061), "1d01h01m");
}

#[test]
fn failures_map_to_exit_codes_and_json_kinds() {
    let unreachable = Failure::Client(ClientError::Unreachable {
        path: PathBuf::from("/run/vnat/vnatd.sock"),
        source: std::io::Error::from_raw_os_error(2),
    });
    assert_eq!(
        (unreachable.exit_code(), unreachable.kind()),
        (3, "unreachable")
    );
    let daemon = Failure::Client(ClientError::Daemon {
        kind: ErrorKind::Datapath,
        message: "m".into(),
    });
    assert_eq!((daemon.exit_code(), daemon.kind()), (1, "datapath"));
    let v: Value =
        serde_json::from_str(&output::error_json("datapath", "cgroup /x is not enabled"))
            .expect("JSON");
    assert_eq!(
        v,
        json!({ "error": { "kind": "datapath", "message": "cgroup /x is not enabled" } })
    );
}

#[test]
fn import_text_says_what_happens_next() {
    let row = |moving| output::ImportRow {
        id: 7,
        proto: "tcp".into(),
        virtual_local: "198.18.1.2:40000".into(),
        virtual_remote: "198.18.3.2:5001".into(),
        physical_local: "198.18.2.2:40000".into(),
        physical_remote: "198.18.3.2:5001".into(),
        moving,
    };
    let text = output::import_text(&[row(true), row(false)]);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "imported 2 connection(s)");
    assert!(
        lines[1].ends_with("moving to 198.18.2.2:40000, the peer is being updated"),
        "{text}"
    );
    assert!(
        lines[2].contains("once the restored socket appears"),
        "{text}"
    );
    let v = serde_json::to_value(row(true)).expect("serializable");
    assert_eq!(
        v,
        json!({ "id": 7, "proto": "tcp", "virtual_local": "198.18.1.2:40000",
                "virtual_remote": "198.18.3.2:5001", "physical_local": "198.18.2.2:40000",
                "physical_remote": "198.18.3.2:5001", "moving": true })
    );
}

#[test]
fn ls_shows_where_a_nat_put_our_end() {
    let mut rows = sample();
    for r in rows.iter_mut().filter(|r| r.info.proto == Proto::Tcp) {
        r.seen_by_peer_as = Some("203.0.113.9:61000".parse().expect("addr"));
    }
    let rows = select(rows, Some(ProtoArg::Tcp), None);
    assert!(rows[0].behind_nat);
    let v = serde_json::to_value(&rows[0]).expect("json");
    assert_eq!(v["seen_by_peer_as"], "203.0.113.9:61000");
    let text = output::ls_table(&rows);
    assert!(
        text.lines()
            .nth(1)
            .is_some_and(|l| l.ends_with("NAT: the peer sees 203.0.113.9:61000")),
        "{text}"
    );
}

#[test]
fn a_containers_connection_shows_its_namespace_and_private_end() {
    let mut listed = conn(
        Proto::Tcp,
        "198.18.1.2:40001",
        "198.18.3.2:5001",
        "198.18.1.2:40001",
        ConnState::Native,
        Some(42),
    );
    listed.info.guest = Some(vnat_control::datapath::GuestInfo {
        netns_cookie: 4099,
        netns: Some("net:[4026532999]".into()),
        private_local: "10.88.0.2:40000".parse().unwrap(),
        private_remote: "198.18.3.2:5001".parse().unwrap(),
        routed_via: None,
    });
    let rows = select(vec![listed], None, None);
    let v = serde_json::to_value(&rows).expect("serializable");
    assert_eq!(
        v[0]["guest"],
        json!({
            "netns": "net:[4026532999]", "netns_cookie": 4099,
            "private_local": "10.88.0.2:40000", "private_remote": "198.18.3.2:5001",
            "routed_via": null
        })
    );
    assert_eq!(v[0]["virtual_local"], "198.18.1.2:40001", "the public end");
    let table = crate::output::ls_table(&rows);
    assert!(
        table.contains("container net:[4026532999] at 10.88.0.2:40000"),
        "{table}"
    );
}

/// A connection `migrate` placed says where, in NOTE and in JSON.
#[test]
fn ls_shows_where_migrate_placed_a_connection() {
    let mut listed = conn(
        Proto::Tcp,
        "198.18.1.2:40001",
        "198.18.3.2:5001",
        "198.18.2.2:40001",
        ConnState::Translated,
        Some(42),
    );
    listed.placed = Some("198.18.2.2".parse().unwrap());
    let rows = select(vec![listed], None, None);
    let v = serde_json::to_value(&rows).expect("serializable");
    assert_eq!(v[0]["placed"], "198.18.2.2");
    let table = crate::output::ls_table(&rows);
    assert!(table.contains("placed at 198.18.2.2 by migrate"), "{table}");
}

/// A suspended connection whose keepalive vnatd holds says so in NOTE and
/// in JSON.
#[test]
fn ls_shows_a_held_keepalive() {
    let mut listed = conn(
        Proto::Tcp,
        "198.18.1.2:40001",
        "198.18.3.2:5001",
        "198.18.1.2:40001",
        ConnState::Native,
        Some(42),
    );
    listed.keepalive_held = true;
    listed.helpers_asked = vec!["zero-window".into()];
    let rows = select(vec![listed], None, None);
    let v = serde_json::to_value(&rows).expect("serializable");
    assert_eq!(v[0]["keepalive_held"], true);
    assert_eq!(v[0]["helpers_asked"], serde_json::json!(["zero-window"]));
    let table = crate::output::ls_table(&rows);
    assert!(table.contains("keepalive held until resume"), "{table}");
    assert!(
        table.contains("peer asked to keep it alive (zero-window)"),
        "{table}"
    );
}

/// A connection vnatd adopted says so in NOTE and in JSON.
#[test]
fn ls_shows_an_adopted_connection() {
    let mut listed = conn(
        Proto::Tcp,
        "198.18.1.2:40001",
        "198.18.3.2:5001",
        "198.18.1.2:40001",
        ConnState::Native,
        Some(42),
    );
    listed.info.adopted = true;
    let rows = select(vec![listed], None, None);
    let v = serde_json::to_value(&rows).expect("serializable");
    assert_eq!(v[0]["adopted"], true);
    let table = crate::output::ls_table(&rows);
    assert!(
        table.contains("adopted (open before vnat recorded its cgroup)"),
        "{table}"
    );
}

/// A container whose address the host routes (not NATed): its own address
/// is the public one, and the NOTE says which host address its network
/// is reached by.
#[test]
fn ls_shows_a_routed_containers_connection() {
    let mut listed = conn(
        Proto::Tcp,
        "[2001:db8:88::2]:40000",
        "[fd00:5e:3::2]:5001",
        "[2001:db8:88::2]:40000",
        ConnState::Native,
        Some(42),
    );
    listed.info.guest = Some(vnat_control::datapath::GuestInfo {
        netns_cookie: 4099,
        netns: Some("net:[4026532999]".into()),
        private_local: "[2001:db8:88::2]:40000".parse().unwrap(),
        private_remote: "[fd00:5e:3::2]:5001".parse().unwrap(),
        routed_via: Some("fd00:5e:1::2".parse().unwrap()),
    });
    let rows = select(vec![listed], None, None);
    let v = serde_json::to_value(&rows).expect("serializable");
    assert_eq!(v[0]["guest"]["routed_via"], "fd00:5e:1::2");
    let table = crate::output::ls_table(&rows);
    assert!(
        table.contains("container net:[4026532999], its address routed here via fd00:5e:1::2"),
        "{table}"
    );
}
