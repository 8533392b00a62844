//! `monitor` over a real control socket: a subscriber that never reads
//! fills its socket and is left behind; publishing never waits for it, a
//! subscriber that reads keeps receiving to the last event, and the stuck
//! one is told what it lost once it reads.

use std::time::{Duration, Instant};

use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::UnixStream,
};
use vnat_control::monitor::{EventKind, MonitorEvent};

use super::{events::EventHub, tests::TempDir, ControlClient, ControlListener, Handler};
use crate::datapath::{fake::FakeDatapath, owner::spawn};

fn ev(id: u64) -> MonitorEvent {
    MonitorEvent {
        id: Some(id),
        reason: Some("x".repeat(200)),
        ..MonitorEvent::new(EventKind::MoveEnded, 1)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_monitor_that_never_reads_holds_nothing_up() {
    let dir = TempDir::new();
    let path = dir.path().join("vnatd.sock");
    let listener = ControlListener::bind(&path).expect("bind");
    let hub = EventHub::new();
    let info = vnat_control::DaemonInfo {
        version: "test".into(),
        pid: 1,
        uptime_secs: 0,
        control: path.clone(),
        state_dir: "/var/lib/vnat".into(),
        listen: "0.0.0.0:2031".parse().expect("addr"),
        configured_cgroups: Vec::new(),
    };
    let handler = Handler::new(
        spawn(Box::new(FakeDatapath::new())).expect("datapath"),
        info,
    )
    .with_events(hub.clone());
    let server = tokio::spawn(listener.serve(handler, std::future::pending()));

    // Subscribes, then never reads.
    let mut stuck = UnixStream::connect(&path).await.expect("connect");
    stuck
        .write_all(b"{\"version\":1,\"request\":{\"type\":\"monitor\"}}\n")
        .await
        .expect("send");
    let mut reader = ControlClient::connect(&path)
        .await
        .expect("connect")
        .subscribe()
        .await
        .expect("subscribe");
    let deadline = Instant::now() + Duration::from_secs(5);
    while hub.subscribers() < 2 {
        assert!(
            Instant::now() < deadline,
            "the stuck client never subscribed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Far more than its socket buffer and the ring hold (about 8 MB).
    let n = (super::events::CAPACITY * 4) as u64;
    let t0 = Instant::now();
    let publisher = {
        let hub = hub.clone();
        tokio::spawn(async move {
            for id in 0..n {
                hub.publish(ev(id));
                if id % 256 == 0 {
                    // Let the reading subscriber's task run.
                    tokio::task::yield_now().await;
                }
            }
        })
    };
    let mut next = 0u64;
    while next < n {
        let e = tokio::time::timeout(Duration::from_secs(10), reader.next())
            .await
            .expect("the reading monitor stalled")
            .expect("read")
            .expect("an event");
        // (It may lose some too, on a busy machine: a `lost` event.)
        if e.event != EventKind::Lost {
            next = e.id.expect("id") + 1;
        }
    }
    publisher.await.expect("publisher");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "publishing waited for the stuck subscriber: {:?}",
        t0.elapsed()
    );
    // The stuck one, read at last: what fitted in its socket, then how
    // many it lost, then the newest.
    let mut lines = BufReader::new(stuck).lines();
    let mut saw_lost = false;
    while let Ok(Ok(Some(line))) =
        tokio::time::timeout(Duration::from_millis(500), lines.next_line()).await
    {
        if line.contains("\"event\":\"lost\"") {
            saw_lost = true;
            break;
        }
    }
    assert!(saw_lost, "the stuck monitor was never told what it lost");
    server.abort();
}
