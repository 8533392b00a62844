//! The connection-setup tool of the overhead benchmark (netperf's TCP_CRR,
//! which Debian does not ship): every transaction opens a connection, sends
//! a request of `size` bytes, reads a response of the same size and closes.
//! The server closes first, so TIME_WAIT stays on its side and the client
//! never runs out of ports.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener, TcpStream},
    time::{Duration, Instant},
};

use anyhow::{Context, Result};
use serde_json::json;

/// Accept forever: read one request of `size` bytes, echo it, close.
pub fn serve(listen: SocketAddr, size: usize) -> Result<()> {
    let l = TcpListener::bind(listen).with_context(|| format!("listening on {listen}"))?;
    println!("listening");
    let mut buf = vec![0u8; size];
    loop {
        let (mut s, _) = match l.accept() {
            Ok(c) => c,
            Err(_) => continue,
        };
        let _ = s.set_nodelay(true);
        if s.read_exact(&mut buf).is_ok() {
            let _ = s.write_all(&buf);
        }
    }
}

/// Run transactions against `connect` for `seconds`; print one JSON line
/// with the count and this process's CPU time.
pub fn client(connect: SocketAddr, size: usize, seconds: f64) -> Result<()> {
    let request = vec![0x5au8; size];
    let mut response = vec![0u8; size];
    let mut done = 0u64;
    let mut failed = 0u64;
    let start = Instant::now();
    let limit = Duration::from_secs_f64(seconds);
    while start.elapsed() < limit {
        match transaction(connect, &request, &mut response) {
            Ok(()) => done += 1,
            Err(_) => failed += 1,
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let (user, system) = own_cpu();
    println!(
        "{}",
        json!({
            "transactions": done,
            "failed": failed,
            "seconds": elapsed,
            "cpu_user_s": user,
            "cpu_system_s": system,
        })
    );
    Ok(())
}

fn transaction(connect: SocketAddr, request: &[u8], response: &mut [u8]) -> std::io::Result<()> {
    let mut s = TcpStream::connect(connect)?;
    s.set_nodelay(true)?;
    s.write_all(request)?;
    s.read_exact(response)?;
    // Wait for the server's FIN, so that it closes first.
    let mut end = [0u8; 1];
    let _ = s.read(&mut end);
    Ok(())
}

/// User and system CPU seconds of this process so far.
fn own_cpu() -> (f64, f64) {
    // SAFETY: rusage is plain integers, for which all-zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes only the live rusage it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (secs(ru.ru_utime), secs(ru.ru_stime))
}
