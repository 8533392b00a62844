//! The status line, the JOURNAL_STREAM check, and the connection id in
//! what vnatd logs (text and journal).

use std::sync::{Arc, Mutex};

use tracing_subscriber::{layer::SubscriberExt, Layer};

use super::{names_stream, summary, JournalLines};
use crate::{
    control::PeerInfo,
    datapath::{fake::FakeDatapath, DatapathStatus, Degraded, Proto, TcMode, VirtualFlow},
};

fn status(connections: u64, translations: u64, degraded: &[&str]) -> DatapathStatus {
    DatapathStatus {
        kernel: "6.1.0".into(),
        tc_mode: TcMode::Clsact,
        degraded: degraded
            .iter()
            .map(|f| Degraded {
                feature: f.to_string(),
                needs: "something newer".into(),
                effect: "something weaker".into(),
            })
            .collect(),
        bpffs: "/sys/fs/bpf/vnat".into(),
        netns_cookie: 1,
        programs_loaded: Vec::new(),
        cgroups: Vec::new(),
        tc: Vec::new(),
        connections,
        translations,
        counters: Vec::new(),
    }
}

fn peer(n: u8) -> PeerInfo {
    PeerInfo {
        address: format!("198.18.0.{n}").parse().unwrap(),
        key: Some(format!("{n:064x}")),
        connections: 1,
        mobile: 1,
        behind_nat: false,
        reflexive: None,
        last_heard_ms: None,
        addresses: Vec::new(),
    }
}

#[test]
fn summary_counts_connections_translated_peers_and_names_the_degraded() {
    assert_eq!(
        summary(
            Some(&status(12, 3, &["tcx", "tcp-info-windows"])),
            Some(&[peer(1), peer(2)])
        ),
        "12 connections, 3 translated, 2 peers; degraded: tcx, tcp-info-windows"
    );
    assert_eq!(
        summary(Some(&status(1, 0, &[])), Some(&[peer(1)])),
        "1 connection, 0 translated, 1 peer"
    );
    assert_eq!(
        summary(Some(&status(0, 0, &[])), Some(&[])),
        "0 connections, 0 translated, 0 peers"
    );
    // The VCMP driver did not answer: no peer count rather than a wrong 0.
    assert_eq!(
        summary(Some(&status(2, 1, &["tcx"])), None),
        "2 connections, 1 translated; degraded: tcx"
    );
    assert_eq!(summary(None, None), "the datapath does not answer");
}

#[test]
fn journal_stream_must_name_stderr_itself() {
    assert!(names_stream("8:12345", 8, 12345));
    assert!(names_stream("64769:4023", 64769, 4023));
    // Another stream (a child's inherited variable, stderr now a file).
    assert!(!names_stream("8:12345", 8, 12346));
    assert!(!names_stream("9:12345", 8, 12345));
    for bad in [
        "",
        "8",
        "8:",
        ":12345",
        "8:12345:1",
        "x:1",
        "8 : 12345",
        "-8:12345",
    ] {
        assert!(!names_stream(bad, 8, 12345), "{bad:?} taken for stderr");
    }
}

/// A `Write` into a shared buffer, for a formatter under test.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Buffer {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn flow() -> VirtualFlow {
    VirtualFlow {
        proto: Proto::Tcp,
        local: "198.18.1.2:40000".parse().unwrap(),
        remote: "198.18.1.3:5001".parse().unwrap(),
    }
}

/// A restart of one connection, logged as vnatd logs it.
fn restart_logged() {
    let mut dp = FakeDatapath::new();
    crate::daemon::moveops::restart_one(&mut dp, flow(), false, false);
}

#[test]
fn a_connections_text_log_line_carries_its_vnatctl_ls_id() {
    let out = Buffer::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, restart_logged);
    let text = out.text();
    let line = text
        .lines()
        .find(|l| l.contains("restart"))
        .unwrap_or_else(|| panic!("no restart line in {text:?}"));
    assert!(
        line.contains(&format!("id={} ", flow().id())),
        "the line does not carry the id `vnatctl ls` shows ({}): {line}",
        flow().id()
    );
}

/// One event's fields, as text.
type EventFields = Vec<(String, String)>;

/// The fields of each event an inner layer was handed.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<EventFields>>>);

struct Fields(EventFields);

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.push((field.name().into(), value.into()));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0.push((field.name().into(), format!("{value:?}")));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Captured {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        let mut f = Fields(Vec::new());
        event.record(&mut f);
        self.0.lock().unwrap().push(f.0);
    }
}

#[test]
fn a_journal_message_reads_like_the_text_line_with_the_id() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::registry()
        .with(JournalLines::new(captured.clone()))
        .with(tracing_subscriber::filter::LevelFilter::DEBUG);
    tracing::subscriber::with_default(subscriber, || {
        restart_logged();
        let span = tracing::info_span!("control", command = "peers", id = 7u64);
        let _in = span.enter();
        tracing::warn!(error = %"no driver", "cannot list peers");
    });
    let events = captured.0.lock().unwrap().clone();
    let field = |e: &[(String, String)], name: &str| {
        e.iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("no {name} in {e:?}"))
    };
    let id = flow().id();
    assert_eq!(
        field(&events[0], "message"),
        format!("restart id={id} flow=tcp 198.18.1.2:40000 -> 198.18.1.3:5001 sent=Nothing")
    );
    // The fields still go as fields (VNAT_ID=… in the journal).
    assert_eq!(field(&events[0], "id"), id.to_string());
    // A span's fields follow the event's own.
    assert_eq!(
        field(&events[1], "message"),
        "cannot list peers error=no driver command=peers id=7"
    );
}
