//! `vnatd --cleanup`'s share of `restart_state`: what a vnatd that died
//! changed on applications' sockets (keepalive turned off, TCP_USER_TIMEOUT
//! raised) and processes (stopped for an absent peer) is given back, for
//! the sockets and processes still there, as the next vnatd would at
//! start-up. Sockets are found by their cookie in one sock_diag dump and
//! taken from the process that holds them.

use std::{collections::HashMap, path::Path};

use super::{CleanupError, Kind, Report};
use crate::daemon::restart_state::{self, RestartState, Undo};
use crate::datapath::{kernel::procfs, kernel::restart, Proto};

/// Every TCP state but LISTEN (include/net/tcp_states.h).
const STATES: u32 = 0xfff & !(1 << 10);

pub(super) fn give_back(r: &mut Report, state_dir: &Path) {
    let mut state = RestartState::load(state_dir);
    let left = state.left_holds().to_vec();
    if left.is_empty() {
        return;
    }
    let sockets: HashMap<u64, u64> = match restart::list_sockets(Proto::Tcp, STATES) {
        Ok(l) => l.into_iter().map(|s| (s.cookie, s.inode)).collect(),
        Err(e) => {
            let what = "list the sockets whose settings vnatd changed".into();
            r.failed(Kind::Socket, what, e);
            return;
        }
    };
    let owners = procfs::inode_owners();
    // Per socket: keepalive to turn on, user timeout to give back.
    let mut per_socket: HashMap<u64, (bool, Option<u32>, String)> = HashMap::new();
    for h in &left {
        match h.undo {
            Undo::Continue { pid, start_time } => {
                if restart_state::let_go_on(pid, start_time) {
                    let what = format!(
                        "let process {pid} go on (stopped for the absent peer of {})",
                        h.flow
                    );
                    r.done(Kind::Socket, what);
                }
            }
            Undo::KeepaliveOn => {
                per_socket
                    .entry(h.cookie)
                    .or_insert((false, None, h.flow.to_string()))
                    .0 = true
            }
            Undo::UserTimeout { before } => {
                per_socket
                    .entry(h.cookie)
                    .or_insert((false, None, h.flow.to_string()))
                    .1 = Some(before.unwrap_or(0));
            }
        }
    }
    for (cookie, (keepalive, timeout, flow)) in per_socket {
        let Some(inode) = sockets.get(&cookie).copied() else {
            continue; // closed since
        };
        let Some(pid) = owners.get(&inode).copied() else {
            continue;
        };
        let what = match (keepalive, timeout) {
            (true, Some(ms)) => format!("turned the keepalive of {flow} on again and gave it its user timeout ({ms} ms) back"),
            (true, None) => format!("turned the keepalive of {flow} on again"),
            (false, Some(ms)) => format!("gave {flow} its user timeout ({ms} ms) back"),
            (false, None) => continue,
        };
        match restart::give_back(pid, inode, keepalive, timeout) {
            Ok(_) => r.done(Kind::Socket, what),
            Err(e) => r.failed(Kind::Socket, what, CleanupError::Datapath(e)),
        }
    }
    state.forget_left(|_| true);
    if let Err(e) = state.save(Vec::new(), Vec::new()) {
        let what = format!("forget what was given back ({})", restart_state::FILE);
        r.failed(
            Kind::Socket,
            what,
            CleanupError::Io(std::io::Error::other(e.to_string())),
        );
    }
}
