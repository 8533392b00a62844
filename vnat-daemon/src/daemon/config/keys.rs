//! Every config file key, once: its default as TOML, the flag that
//! overrides it and what it does. The example file the package installs
//! (`packaging/vnatd.toml`, every key commented out with its default) and
//! the vnatd.toml(5) man page are rendered from this table (`vnatd
//! --generate config` and `--generate man-config`), and tests keep the
//! table, the file and `FileConfig` in step.

/// One key of the config file.
pub struct Key {
    pub name: &'static str,
    /// Its default, as TOML (what the example file shows, commented out).
    pub default: &'static str,
    /// The flag that overrides it.
    pub flag: &'static str,
    /// What it does, in sentences.
    pub about: &'static str,
    /// Read at start only: a reload that changes it warns and keeps the
    /// running value (`ReloadPlan::restart_only`).
    pub start_only: bool,
}

/// The config file's keys, in the example file's order.
pub const KEYS: &[Key] = &[
    Key {
        name: "control",
        default: "\"/run/vnat/vnatd.sock\"",
        flag: "--control",
        about: "Control socket for vnatctl, created 0600 in a directory made 0700.",
        start_only: true,
    },
    Key {
        name: "state_dir",
        default: "\"/var/lib/vnat\"",
        flag: "--state-dir",
        about: "Saved state: this host's identity key (identity.key) and the pinned keys of its peers \
                (peers.json). Created 0700; one that others may write is refused.",
        start_only: true,
    },
    Key {
        name: "bpffs",
        default: "\"/sys/fs/bpf/vnat\"",
        flag: "--bpffs",
        about: "Where the eBPF programs, maps and links are pinned (on bpffs). Each vnatd needs its own \
                when several run in different network namespaces.",
        start_only: true,
    },
    Key {
        name: "listen",
        default: "\"0.0.0.0:2031\"",
        flag: "--listen",
        about: "Address and UDP port of VCMP, the protocol vnatd speaks with its peers' vnatd. \
                0.0.0.0 means IPv4 and IPv6. The peers must be able to reach this port.",
        start_only: true,
    },
    Key {
        name: "cgroups",
        default: "[\"/sys/fs/cgroup\"]",
        flag: "--cgroup",
        about: "cgroup v2 directories whose connections vnat manages. The default is the root of the \
                cgroup2 mount (the whole host), wherever it is mounted; for one service only, e.g. \
                [\"/sys/fs/cgroup/system.slice/app.service\"].",
        start_only: false,
    },
    Key {
        name: "preempt_cgroups",
        default: "[]",
        flag: "--preempt-cgroup",
        about: "When a connection would move onto the endpoints of another connection of this host, \
                the move is refused, unless the moving connection's cgroup is one of these (or below \
                one): then the older of the two (by the connection's age) is reset: the other one, \
                and the move goes on, or the moving one, whose move then ends.",
        start_only: false,
    },
    Key {
        name: "hide_location_cgroups",
        default: "[]",
        flag: "--hide-location-cgroup",
        about: "Applications of these cgroups keep seeing a host that moved at its old address, in new \
                connections and datagrams too (FTP-like applications that compare addresses). Each is \
                enabled too unless one of cgroups covers it.",
        start_only: false,
    },
    Key {
        name: "peer_helpers",
        default: "[\"zero-window\", \"hold\"]",
        flag: "--peer-helper",
        about: "Keep-alive helpers this host runs when a peer about to be away asks for them: \
                zero-window (answer for the absent end so this host's TCP waits), stop (stop this \
                host's processes of the connection until the peer is back), hold (keep this host's \
                packets of the connection unsent until the peer is back), or the name of an executable \
                in helpers_dir. [] for none.",
        start_only: true,
    },
    Key {
        name: "helpers_dir",
        default: "\"/etc/vnat/helpers\"",
        flag: "--helpers-dir",
        about: "Where installed keep-alive helpers are: executables owned by root and writable by no \
                one else, run as nobody.",
        start_only: true,
    },
    Key {
        name: "log_level",
        default: "\"info\"",
        flag: "--log-level",
        about: "A level (error, warn, info, debug, trace) or a filter such as \
                \"info,vnat_daemon=debug\" (the protocol core logs as vnat_vcmp). RUST_LOG overrides \
                the file, the flag overrides both.",
        start_only: false,
    },
    Key {
        name: "log_format",
        default: "\"text\"",
        flag: "--log-format",
        about: "text or json. Under systemd, text goes to the journal with each line's priority.",
        start_only: true,
    },
    Key {
        name: "location_servers",
        default: "[]",
        flag: "--location-server",
        about: "Other vnatd (ADDR:PORT) asked where a peer went when both ends of a connection moved \
                and neither old address answers. Point both hosts of a connection at the same one.",
        start_only: false,
    },
    Key {
        name: "location_store",
        default: "\"embedded\"",
        flag: "--location-store",
        about: "Where location records are kept and looked up. embedded: this vnatd's own store, which \
                also serves other vnatd's records (kept across restarts in state_dir/locations.json). \
                etcd: also an etcd cluster (its v3 API, etcd_endpoints), where each host's records are \
                under /vnat/loc/HOST-KEY/ and expire through leases; records stay signed by the \
                connection's keys, so etcd stores them but cannot forge or replay one.",
        start_only: true,
    },
    Key {
        name: "etcd_endpoints",
        default: "[]",
        flag: "--etcd-endpoint",
        about: "Client URLs of the etcd members (http://HOST:PORT or https://HOST:PORT), for \
                location_store = \"etcd\". A member that is down is skipped; with none answering, \
                a move goes on as without a location server, and says so in the log.",
        start_only: true,
    },
    Key {
        name: "etcd_ca",
        default: "\"/etc/vnat/etcd-ca.pem\"",
        flag: "none",
        about: "TLS: the CA certificate (PEM) that signed the etcd members' certificates (etcd's \
                --trusted-ca-file). Needs https:// endpoints. Default: none (the system's roots).",
        start_only: true,
    },
    Key {
        name: "etcd_cert",
        default: "\"/etc/vnat/etcd-client.pem\"",
        flag: "none",
        about: "TLS: this host's client certificate (PEM), with etcd_key, for members that ask for one \
                (etcd's --client-cert-auth). Default: none.",
        start_only: true,
    },
    Key {
        name: "etcd_key",
        default: "\"/etc/vnat/etcd-client.key\"",
        flag: "none",
        about: "TLS: the private key (PEM) of etcd_cert. Default: none.",
        start_only: true,
    },
    Key {
        name: "etcd_user",
        default: "\"vnat\"",
        flag: "none",
        about: "etcd's user authentication: the user vnatd logs in as (a role may restrict it to \
                /vnat/loc/). Needs etcd_password_file. Default: none (no authentication).",
        start_only: true,
    },
    Key {
        name: "etcd_password_file",
        default: "\"/etc/vnat/etcd-password\"",
        flag: "none",
        about: "The file holding etcd_user's password (its first line; keep it 0600). The password is \
                never written in this file. Default: none.",
        start_only: true,
    },
    Key {
        name: "standby_tc",
        default: "true",
        flag: "--standby-tc, --no-standby-tc",
        about: "Keep the tc translators attached to every interface while this host has connections \
                paired with a peer, so that a move does not wait the 10-25 ms the kernel takes to \
                attach them. false attaches them only where moved connections need them.",
        start_only: false,
    },
    Key {
        name: "tc_attach",
        default: "\"auto\"",
        flag: "--tc-attach (environment VNAT_TC_ATTACH)",
        about: "How the tc translators attach: auto (TCX where the kernel has it, Linux 6.6, else \
                clsact), tcx, or clsact (cls_bpf filters on a clsact qdisc, any kernel).",
        start_only: true,
    },
    Key {
        name: "keepalive_secs",
        default: "25",
        flag: "--keepalive-secs",
        about: "How often (seconds) a host behind a NAT probes each peer it holds mobile connections \
                with, so that the NAT keeps the mapping the peer reaches it by. 0 turns keepalives \
                off; a host that is not behind a NAT sends none.",
        start_only: false,
    },
    Key {
        name: "sleep_inhibit",
        default: "true",
        flag: "--sleep-inhibit, --no-sleep-inhibit",
        about: "Hold a logind delay inhibitor for sleep: before the host sleeps, settle roles and keys \
                of every mobile connection with its peer while the network is still up (as vnatctl \
                suspend --all), release the inhibitor before logind's delay runs out, and resume at \
                wake. Without a system bus, sleep is left to vnatctl suspend and resume.",
        start_only: true,
    },
];

/// `text` folded into lines of at most `width` characters, each with
/// `prefix`.
fn wrap(text: &str, prefix: &str, width: usize) -> String {
    let mut out = String::new();
    let mut line = String::from(prefix);
    for word in text.split_whitespace() {
        if line.len() > prefix.len() && line.len() + 1 + word.len() > width {
            out.push_str(line.trim_end());
            out.push('\n');
            line = String::from(prefix);
        }
        if line.len() > prefix.len() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if line.len() > prefix.len() {
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// The example config file: every key commented out with its default.
pub fn example_file() -> String {
    let mut out = String::from(
        "# /etc/vnat/vnatd.toml: vnatd's configuration (vnatd.toml(5)).\n\
         #\n\
         # Every key is optional; each is shown commented out with its default.\n\
         # Flags given to vnatd override the file; unknown keys are refused.\n\
         # After a change: systemctl reload vnatd (keys read at start only\n\
         # need systemctl restart vnatd).\n",
    );
    for k in KEYS {
        out.push('\n');
        let when = if k.start_only {
            " Read at start only."
        } else {
            ""
        };
        out.push_str(&wrap(
            &format!("{}{when} Flag: {}.", k.about, k.flag),
            "# ",
            76,
        ));
        out.push_str(&format!("# {} = {}\n", k.name, k.default));
    }
    out
}

/// Escape text for roff: backslashes, and a leading dot or quote.
fn roff(text: &str) -> String {
    let t = text.replace('\\', "\\e").replace('-', "\\-");
    if t.starts_with('.') || t.starts_with('\'') {
        format!("\\&{t}")
    } else {
        t
    }
}

/// vnatd.toml(5), in roff.
pub fn man_page(version: &str) -> String {
    let mut out = format!(
        ".TH VNATD.TOML 5 \"\" \"vnat {version}\" \"File Formats\"\n\
         .SH NAME\n\
         vnatd.toml \\- configuration file of vnatd(8)\n\
         .SH SYNOPSIS\n\
         /etc/vnat/vnatd.toml\n\
         .SH DESCRIPTION\n\
         vnatd reads this TOML file at start and again on SIGHUP (systemctl reload vnatd). \
         Every key is optional and has a default; a flag given to vnatd overrides the file. \
         Unknown keys, bad values and relative paths are refused with a message that names \
         the key, and a reload with a bad file changes nothing.\n\
         .SH KEYS\n"
    );
    for k in KEYS {
        out.push_str(&format!(
            ".TP\n.B {}\n{}{}\n.br\nDefault: {}.\n.br\nFlag: {}.\n",
            roff(k.name),
            roff(k.about),
            if k.start_only {
                " Read at start only: a reload that changes it warns and keeps the running value."
            } else {
                ""
            },
            roff(k.default),
            roff(k.flag)
        ));
    }
    out.push_str(
        ".SH FILES\n\
         .TP\n/etc/vnat/vnatd.toml\nThe file; the package installs it with every key commented out.\n\
         .SH SEE ALSO\n\
         vnatd(8), vnatctl(8)\n",
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_once_and_the_defaults_parse_into_every_field() {
        let mut names: Vec<&str> = KEYS.iter().map(|k| k.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), KEYS.len(), "a key is listed twice");
        let text: String = KEYS
            .iter()
            .map(|k| format!("{} = {}\n", k.name, k.default))
            .collect();
        let file = crate::daemon::config::parse_file(std::path::Path::new("/dev/null"), &text)
            .unwrap_or_else(|e| panic!("the table's defaults are refused: {e}"));
        // Every field set: a key missing from the table would be None.
        let shown = format!("{file:?}");
        assert!(
            !shown.contains("None"),
            "FileConfig has a key the table lacks: {shown}"
        );
    }

    #[test]
    fn the_example_file_is_all_comments_and_names_every_key() {
        let text = example_file();
        for line in text.lines() {
            assert!(line.is_empty() || line.starts_with('#'), "{line}");
            assert!(line.len() <= 80, "too long: {line}");
        }
        for k in KEYS {
            assert!(text.contains(&format!("\n# {} = {}\n", k.name, k.default)));
        }
        let uncommented: String = text
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| {
                KEYS.iter()
                    .any(|k| l.starts_with(&format!("{} = ", k.name)))
            })
            .map(|l| format!("{l}\n"))
            .collect();
        crate::daemon::config::parse_file(std::path::Path::new("/dev/null"), &uncommented)
            .unwrap_or_else(|e| panic!("uncommented, the example is refused: {e}"));
    }

    #[test]
    fn the_packaged_example_is_the_rendered_one() {
        let shipped = include_str!("../../../../packaging/vnatd.toml");
        assert!(
            shipped == example_file(),
            "packaging/vnatd.toml is out of step with the key table: run \
             `vnatd --generate config > packaging/vnatd.toml`"
        );
    }

    #[test]
    fn the_man_page_has_every_key() {
        let page = man_page("0.1.0");
        assert!(page.starts_with(".TH VNATD.TOML 5"));
        for k in KEYS {
            assert!(
                page.contains(&format!(".B {}\n", roff(k.name))),
                "{}",
                k.name
            );
        }
    }
}
