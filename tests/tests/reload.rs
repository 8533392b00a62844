//! SIGHUP (what `systemctl reload` and log rotation send) reloads vnatd's
//! config file instead of stopping it (issue 16, item 8): cgroups are
//! enabled and disabled to match, a connection it tracked survives, and a
//! bad file changes nothing and leaves vnatd running.

use std::{net::SocketAddr, path::Path, time::Duration};

use nix::sys::signal::Signal;
use vnat_tests::{Cgroup, EchoServer, Host, LaptopRouterServer, TempDir, Vnatd};

fn cgroups(d: &Vnatd) -> Vec<String> {
    let st = d.ctl(&["status"]).expect("vnatd unreachable");
    let mut out: Vec<String> = st["datapath"]["cgroups"]
        .as_array()
        .expect("cgroups")
        .iter()
        .filter_map(|c| c["path"].as_str().map(str::to_string))
        .collect();
    out.sort();
    out
}

/// What `vnatctl status` says the configuration asks for.
fn configured(d: &Vnatd) -> Vec<String> {
    let st = d.ctl(&["status"]).expect("vnatd unreachable");
    let mut out: Vec<String> = st["daemon"]["configured_cgroups"]
        .as_array()
        .expect("configured_cgroups")
        .iter()
        .filter_map(|c| c.as_str().map(str::to_string))
        .collect();
    out.sort();
    out
}

fn write_config(path: &Path, cgroups: &[&Path], extra: &str) {
    let list: Vec<String> = cgroups
        .iter()
        .map(|c| format!("\"{}\"", c.display()))
        .collect();
    std::fs::write(path, format!("cgroups = [{}]\n{extra}", list.join(", ")))
        .expect("writing the config");
}

fn wait_for(what: &str, f: impl FnMut() -> bool) {
    vnat_tests::wait_until(Duration::from_secs(10), f, || what.to_string());
}

#[test]
fn sighup_reloads_the_config_without_stopping_vnatd() {
    let topo = LaptopRouterServer::builder().tag("rld").build();
    let lap = Host::new(&topo.laptop, "rldl");
    let srv = Host::new(&topo.server, "rlds");
    let other = Cgroup::new("rldo");
    let dir = TempDir::new("rldl");
    let sdir = TempDir::new("rlds");
    let conf = dir.path().join("vnatd.toml");
    let (a, b) = (lap.cgroup.path(), other.path());
    write_config(&conf, &[a], "log_level = \"info\"\n");
    let mut d = Vnatd::start_with_config(&lap, dir.path(), &conf, &[]);
    let _srvd = Vnatd::start(&srv, sdir.path());
    assert_eq!(cgroups(&d), vec![a.display().to_string()]);

    // A live connection, tracked and paired before the reload.
    let server = SocketAddr::new(topo.server_addr.v4.into(), 5001);
    let _echo = EchoServer::tcp_in(&srv, server);
    let mut cmd = vnat_tests::StreamOptions::tcp(server)
        .rate(100_000)
        .command(&topo.laptop);
    lap.cgroup.join_on_spawn(&mut cmd);
    let client = vnat_tests::StreamClient::from_command(cmd);
    client.wait_verified_at_least(20_000, Duration::from_secs(10));
    d.wait_paired("the laptop's vnatd");

    // Add a cgroup, a location server, keepalives and a log level.
    write_config(
        &conf,
        &[a, b],
        "log_level = \"debug\"\nlocation_servers = [\"198.18.3.9:2031\"]\nkeepalive_secs = 7\n",
    );
    d.signal(Signal::SIGHUP);
    wait_for("the reload did not enable the new cgroup", || {
        cgroups(&d).len() == 2
    });
    assert!(d.alive(), "SIGHUP stopped vnatd");
    let mut both = vec![a.display().to_string(), b.display().to_string()];
    both.sort();
    wait_for("status does not show the reloaded configuration", || {
        configured(&d) == both
    });

    // A bad file: refused, nothing changes, vnatd keeps running.
    std::fs::write(&conf, "cgroups = 5\n").expect("writing");
    d.signal(Signal::SIGHUP);
    std::thread::sleep(Duration::from_secs(1));
    assert!(d.alive(), "a bad file on SIGHUP stopped vnatd");
    assert_eq!(cgroups(&d).len(), 2, "a refused reload changed the cgroups");
    assert_eq!(
        configured(&d),
        both,
        "a refused reload changed the configuration shown"
    );

    // Dropping a cgroup from the file disables it.
    write_config(&conf, &[a], "");
    d.signal(Signal::SIGHUP);
    wait_for("the reload did not disable the removed cgroup", || {
        cgroups(&d) == vec![a.display().to_string()]
    });
    wait_for("status does not show the reloaded configuration", || {
        configured(&d) == vec![a.display().to_string()]
    });

    // The connection tracked before the reloads is still there and mobile.
    let ls = d.ctl(&["ls", "--proto", "tcp"]).expect("ls");
    assert!(
        ls.as_array()
            .expect("array")
            .iter()
            .any(|r| r["virtual_remote"] == server.to_string() && r["mobile"] == true),
        "the connection lost its mobility across reloads: {ls}"
    );
    let fin = client.stop();
    assert_eq!(fin.error, None, "{:?}", fin.json);
    assert!(d.alive());
}
