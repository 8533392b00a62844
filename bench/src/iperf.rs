//! Driving iperf3: a server kept for the whole benchmark, and one client run
//! with its JSON report (`-J`) read back.
//!
//! iperf3 (3.12, Debian 12) opens a control connection from an ephemeral
//! port, then one data connection per stream; `--cport` binds only the data
//! connections. With one stream the data connection's 4-tuple is therefore
//! known before the client starts, which is what lets a benchmark install a
//! translation for exactly that flow.

use std::{
    net::{IpAddr, SocketAddr},
    process::{Child, Command, Stdio},
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context, Result};
use nix::{
    sys::signal::{kill, Signal},
    unistd::Pid,
};
use serde_json::Value;
use vnat_tests::Netns;

/// iperf3's default port.
pub const PORT: u16 = 5201;

/// `iperf3 -s` bound to one address; killed on drop.
///
/// Not the harness's `Iperf3Server`: that one starts in the namespace's
/// current cgroup, and a listening socket keeps the cgroup it was created in
/// (so do the sockets it accepts), so moving the server into a vnat-enabled
/// cgroup afterwards would not put its connections under vnat.
pub struct IperfServer {
    child: Child,
}

impl IperfServer {
    /// Starts `cmd` (an `iperf3` command already placed in its namespace and
    /// cgroup) as a server on `addr`:[`PORT`] and waits until it listens.
    pub fn start(mut cmd: Command, ns: &Netns, addr: IpAddr) -> Result<IperfServer> {
        cmd.args(["-s", "-B", &addr.to_string(), "-p", &PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd.spawn().context("starting the iperf3 server")?;
        let mut server = IperfServer { child };
        // Polling the listen table rather than connecting: iperf3 takes any
        // connection for a test's control connection and logs an error.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !listening(ns, PORT)? {
            if let Some(status) = server.child.try_wait()? {
                bail!(
                    "the iperf3 server in {} exited at start ({status})",
                    ns.name()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the iperf3 server in {} did not listen within 10 s",
                    ns.name()
                );
            }
            thread::sleep(Duration::from_millis(50));
        }
        Ok(server)
    }
}

impl Drop for IperfServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn listening(ns: &Netns, port: u16) -> Result<bool> {
    let out = ns
        .cmd("ss")
        .args(["-Hltn", &format!("sport = :{port}")])
        .output()
        .context("running ss (iproute2)")?;
    Ok(!String::from_utf8_lossy(&out.stdout).trim().is_empty())
}

/// What one client run measured (the client sends, the server receives).
#[derive(Clone, Debug, PartialEq)]
pub struct ClientRun {
    /// The data connection as the client's socket sees it.
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// Goodput at the receiver, bits per second.
    pub received_bps: f64,
    pub retransmits: u64,
    /// CPU use of the sending (client) and receiving (server) process as
    /// iperf3 reports it: the process's user + system time over the test's
    /// wall time, in percent (100 = one CPU busy throughout).
    pub sender_cpu_percent: f64,
    pub receiver_cpu_percent: f64,
}

/// Runs `cmd` (an `iperf3 -c ... -J` command) and parses its report; fails
/// with iperf3's own error message, or if it runs longer than `timeout`.
pub fn run_client(mut cmd: Command, timeout: Duration) -> Result<ClientRun> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().context("starting the iperf3 client")?;
    let pid = Pid::from_raw(child.id() as i32);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || tx.send(child.wait_with_output()));
    let out = match rx.recv_timeout(timeout) {
        Ok(out) => out.context("waiting for the iperf3 client")?,
        Err(_) => {
            let _ = kill(pid, Signal::SIGKILL);
            let _ = rx.recv();
            bail!(
                "the iperf3 client did not finish within {} s",
                timeout.as_secs()
            );
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report: Value = match serde_json::from_str(&stdout) {
        Ok(v) => v,
        Err(_) => bail!(
            "the iperf3 client printed no JSON report ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ),
    };
    if let Some(e) = report.get("error").and_then(Value::as_str) {
        bail!("iperf3 failed: {e}");
    }
    if !out.status.success() {
        bail!("the iperf3 client exited with {}", out.status);
    }
    parse_report(&report)
}

/// Reads a one-stream TCP report of `iperf3 -J`.
pub fn parse_report(report: &Value) -> Result<ClientRun> {
    let connected = report["start"]["connected"]
        .as_array()
        .ok_or_else(|| anyhow!("the iperf3 report has no start.connected"))?;
    let [stream] = &connected[..] else {
        bail!(
            "the iperf3 report has {} streams, expected one",
            connected.len()
        );
    };
    let endpoint = |host: &str, port: &str| -> Result<SocketAddr> {
        let ip: IpAddr = str_at(stream, host)?
            .parse()
            .with_context(|| format!("start.connected[0].{host} is not an address"))?;
        let port = u16::try_from(u64_at(stream, port)?)
            .with_context(|| format!("start.connected[0].{port} is not a port"))?;
        Ok(SocketAddr::new(ip, port))
    };
    let end = &report["end"];
    Ok(ClientRun {
        local: endpoint("local_host", "local_port")?,
        remote: endpoint("remote_host", "remote_port")?,
        bytes_sent: u64_at(&end["sum_sent"], "bytes")?,
        bytes_received: u64_at(&end["sum_received"], "bytes")?,
        received_bps: f64_at(&end["sum_received"], "bits_per_second")?,
        retransmits: u64_at(&end["sum_sent"], "retransmits")?,
        sender_cpu_percent: f64_at(&end["cpu_utilization_percent"], "host_total")?,
        receiver_cpu_percent: f64_at(&end["cpu_utilization_percent"], "remote_total")?,
    })
}

fn field<'v>(v: &'v Value, key: &str) -> Result<&'v Value> {
    v.get(key)
        .ok_or_else(|| anyhow!("the iperf3 report lacks the field `{key}`"))
}

fn str_at<'v>(v: &'v Value, key: &str) -> Result<&'v str> {
    field(v, key)?
        .as_str()
        .ok_or_else(|| anyhow!("`{key}` in the iperf3 report is not a string"))
}

fn u64_at(v: &Value, key: &str) -> Result<u64> {
    field(v, key)?
        .as_u64()
        .ok_or_else(|| anyhow!("`{key}` in the iperf3 report is not a whole number"))
}

fn f64_at(v: &Value, key: &str) -> Result<f64> {
    field(v, key)?
        .as_f64()
        .ok_or_else(|| anyhow!("`{key}` in the iperf3 report is not a number"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fields read from a real `iperf3 -c 127.0.0.1 -B 127.0.0.1
    /// --cport 20001 -t 1 -J` report of iperf 3.12 (others trimmed).
    const REPORT: &str = r#"{
      "start": {"connected": [{"socket": 5, "local_host": "127.0.0.1", "local_port": 20001,
                               "remote_host": "127.0.0.1", "remote_port": 5201}]},
      "intervals": [],
      "end": {
        "sum_sent": {"start": 0, "end": 1.000269, "seconds": 1.000269, "bytes": 2475950080,
                     "bits_per_second": 19802273828.340176, "retransmits": 1, "sender": true},
        "sum_received": {"start": 0, "end": 1.005523, "seconds": 1.005523, "bytes": 2474639360,
                         "bits_per_second": 19688375979.465412, "sender": true},
        "cpu_utilization_percent": {"host_total": 48.25508032280864, "host_user": 0.99,
                                    "host_system": 47.26, "remote_total": 44.88659756905286,
                                    "remote_user": 0.78, "remote_system": 44.10}
      }
    }"#;

    #[test]
    fn reads_a_one_stream_report() {
        let r = parse_report(&serde_json::from_str(REPORT).unwrap()).unwrap();
        assert_eq!(r.local, "127.0.0.1:20001".parse().unwrap());
        assert_eq!(r.remote, "127.0.0.1:5201".parse().unwrap());
        assert_eq!(
            (r.bytes_sent, r.bytes_received, r.retransmits),
            (2475950080, 2474639360, 1)
        );
        assert_eq!(r.received_bps, 19688375979.465412);
        assert_eq!(
            (r.sender_cpu_percent, r.receiver_cpu_percent),
            (48.25508032280864, 44.88659756905286)
        );
    }

    #[test]
    fn refuses_reports_it_cannot_read() {
        let mut v: Value = serde_json::from_str(REPORT).unwrap();
        v["end"]["sum_received"]
            .as_object_mut()
            .unwrap()
            .remove("bits_per_second");
        let e = parse_report(&v).unwrap_err().to_string();
        assert!(e.contains("bits_per_second"), "{e}");
        let two = serde_json::json!({"start": {"connected": [{}, {}]}});
        assert!(parse_report(&two)
            .unwrap_err()
            .to_string()
            .contains("2 streams"));
    }
}
