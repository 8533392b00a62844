//! `restore echo --listen ADDR`: the echo server of the restoration
//! benchmark, run in the server host's namespace and cgroup (so that the
//! server's vnatd records and moves every accepted connection).
//!
//! One thread and one epoll set for every connection: socat's `fork` would
//! make one process per connection, too heavy for thousands of them. Every
//! byte read is written back on the same connection, in order; what the
//! socket does not take at once waits in a per-connection buffer. It prints
//! `{"listening":"ADDR"}` once it accepts, and runs until killed.

use std::{
    collections::HashMap,
    io::{self, Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd,
};

use super::sys::{raise_nofile_limit, Epoll, IN, OUT};

/// Listener `i` has the epoll token `LISTENER - i`; connections use their
/// fd (far below).
const LISTENER: u64 = u64::MAX;

struct Conn {
    stream: TcpStream,
    /// Bytes read but not yet written back.
    pending: Vec<u8>,
    /// Whether epoll reports writability (only while bytes wait).
    want_out: bool,
}

pub fn run(listen: &[SocketAddr]) -> i32 {
    match serve(listen) {
        Ok(()) => 0,
        Err(e) => {
            println!("{}", serde_json::json!({ "error": e.to_string() }));
            1
        }
    }
}

fn serve(listen: &[SocketAddr]) -> io::Result<()> {
    raise_nofile_limit()?;
    let epoll = Epoll::new()?;
    let mut listeners = Vec::new();
    for (i, addr) in listen.iter().enumerate() {
        let l = TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        epoll.add(l.as_raw_fd(), IN, LISTENER - i as u64)?;
        listeners.push(l);
    }
    println!(
        "{}",
        serde_json::json!({ "listening": listen.iter().map(|a| a.to_string()).collect::<Vec<_>>() })
    );
    io::stdout().flush()?;

    let mut conns: HashMap<u64, Conn> = HashMap::new();
    let mut chunk = vec![0u8; 1 << 16];
    let mut events = Epoll::buffer(1024);
    loop {
        let ready = epoll.wait(&mut events, -1)?;
        for &(token, flags) in &ready {
            if token > LISTENER - listeners.len() as u64 {
                accept_all(&listeners[(LISTENER - token) as usize], &epoll, &mut conns)?;
                continue;
            }
            let Some(c) = conns.get_mut(&token) else {
                continue;
            };
            let mut alive = true;
            if flags & OUT != 0 {
                alive = flush(c).unwrap_or(false);
            }
            if alive && flags & !OUT != 0 {
                alive = echo(c, &mut chunk).unwrap_or(false);
            }
            if alive {
                if c.want_out == c.pending.is_empty() {
                    c.want_out = !c.pending.is_empty();
                    epoll.modify(
                        c.stream.as_raw_fd(),
                        if c.want_out { IN | OUT } else { IN },
                        token,
                    )?;
                }
            } else {
                // The peer closed or reset: forget it (dropping closes).
                conns.remove(&token);
            }
        }
    }
}

fn accept_all(
    listener: &TcpListener,
    epoll: &Epoll,
    conns: &mut HashMap<u64, Conn>,
) -> io::Result<()> {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(true)?;
                stream.set_nodelay(true)?;
                let token = stream.as_raw_fd() as u64;
                epoll.add(stream.as_raw_fd(), IN, token)?;
                conns.insert(
                    token,
                    Conn {
                        stream,
                        pending: Vec::new(),
                        want_out: false,
                    },
                );
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e)
                if e.kind() == io::ErrorKind::Interrupted
                    || e.kind() == io::ErrorKind::ConnectionAborted => {}
            Err(e) => return Err(e),
        }
    }
}

/// Reads what is there and writes it back. `Ok(false)`: the peer closed.
fn echo(c: &mut Conn, chunk: &mut [u8]) -> io::Result<bool> {
    let n = match c.stream.read(chunk) {
        Ok(0) => return Ok(false),
        Ok(n) => n,
        Err(e)
            if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted =>
        {
            return Ok(true)
        }
        Err(e) => return Err(e),
    };
    c.pending.extend_from_slice(&chunk[..n]);
    flush(c)
}

fn flush(c: &mut Conn) -> io::Result<bool> {
    while !c.pending.is_empty() {
        match c.stream.write(&c.pending) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                c.pending.drain(..n);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}
