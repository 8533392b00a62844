//! The control socket: creation (permissions, liveness check of a previous
//! vnatd), the accept loop and one task per client connection.

use std::{
    future::Future,
    io,
    os::{
        fd::{AsRawFd, OwnedFd},
        unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt},
    },
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use nix::{
    errno::Errno,
    sys::{
        socket::{self, AddressFamily, Backlog, SockFlag, SockType, UnixAddr},
        stat::{fchmod, Mode},
    },
};
use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::{unix::OwnedWriteHalf, UnixListener, UnixStream},
    sync::Semaphore,
    task::JoinSet,
};

use super::{
    handler::Handler,
    lines::{read_line_bounded, Line},
    proto::{ErrorKind, Outcome, Reply, ResponseEnvelope, MAX_REQUEST_LINE},
};

/// Clients served at once; more are closed at accept. vnatctl holds a
/// connection for one request, so this only bounds a misbehaving client.
const MAX_CLIENTS: usize = 64;

/// A client that sends nothing for this long is disconnected, so that idle
/// connections cannot pin the client slots.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why the control socket could not be created.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("another vnatd is already running on the control socket {path}; stop it first (systemctl stop vnatd) or give this one its own --control path")]
    AlreadyRunning { path: PathBuf },
    #[error(
        "the control socket must be created inside a tokio runtime; this is a bug in the caller"
    )]
    NoRuntime,
    #[error("{path} exists and is not a socket; remove it or pass another --control path")]
    NotASocket { path: PathBuf },
    #[error("the control socket path {path} has no parent directory; pass an absolute path such as /run/vnat/vnatd.sock")]
    NoParent { path: PathBuf },
    #[error("cannot create the control socket directory {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot check whether a vnatd is already listening on {path}: {source}")]
    Probe {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error(
        "cannot remove the stale control socket {path} left by a vnatd that is gone: {source}"
    )]
    RemoveStale {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the control socket {path} is not the private socket vnatd created (mode {mode:o}): someone else can write its directory; give --control a path in a directory only root can write, such as /run/vnat")]
    NotPrivate { path: PathBuf, mode: u32 },
    #[error("cannot create the control socket {path}: {source}")]
    Bind {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A bound, listening control socket. Dropping it removes the socket file
/// (only if the file is still the one this listener created).
pub struct ControlListener {
    listener: UnixListener,
    path: PathBuf,
    /// (device, inode) of the socket file we created.
    identity: (u64, u64),
}

impl ControlListener {
    /// Create the socket at `path`, mode 0600, in a directory created 0700 if
    /// it is missing. Refuses if a live vnatd answers on `path`; removes a
    /// socket file nobody listens on. Must be called inside a tokio runtime.
    pub fn bind(path: &Path) -> Result<Self, ServerError> {
        // tokio's from_std would panic without a reactor; check before any
        // file is touched.
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(ServerError::NoRuntime);
        }
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty());
        let parent = parent.ok_or_else(|| ServerError::NoParent {
            path: path.to_path_buf(),
        })?;
        if !parent.exists() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(|source| ServerError::CreateDir {
                    path: parent.to_path_buf(),
                    source,
                })?;
        }
        remove_if_stale(path)?;
        let bind_err = |source: io::Error| ServerError::Bind {
            path: path.to_path_buf(),
            source,
        };
        let fd = bind_socket(path).map_err(|e| match e.raw_os_error() {
            // Another vnatd bound between our probe and our bind.
            Some(code) if code == Errno::EADDRINUSE as i32 => ServerError::AlreadyRunning {
                path: path.to_path_buf(),
            },
            _ => bind_err(e),
        })?;
        // The file took its mode from the socket (fchmod before bind, see
        // `bind_socket`). Nothing is changed by path after the bind: whoever
        // may write the directory could have put a link there by now, and
        // a chmod would follow it. Looking (lstat) follows nothing.
        let meta = std::fs::symlink_metadata(path).map_err(bind_err)?;
        if !meta.file_type().is_socket() || meta.mode() & 0o077 != 0 {
            return Err(ServerError::NotPrivate {
                path: path.to_path_buf(),
                mode: meta.mode() & 0o7777,
            });
        }
        let listener =
            UnixListener::from_std(std::os::unix::net::UnixListener::from(fd)).map_err(bind_err)?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            identity: (meta.dev(), meta.ino()),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serve clients until `shutdown` completes, then close every client
    /// connection and remove the socket file.
    pub async fn serve(self, handler: Handler, shutdown: impl Future<Output = ()>) {
        let slots = Arc::new(Semaphore::new(MAX_CLIENTS));
        let mut clients = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            while clients.try_join_next().is_some() {}
            tokio::select! {
                () = &mut shutdown => break,
                accepted = self.listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                            tracing::warn!("control: {MAX_CLIENTS} clients already connected; closing a new one");
                            continue;
                        };
                        let handler = handler.clone();
                        clients.spawn(async move {
                            serve_client(stream, handler).await;
                            drop(slot);
                        });
                    }
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "control: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        clients.abort_all();
        tracing::info!(path = %self.path.display(), "control socket closed");
    }
}

impl Drop for ControlListener {
    fn drop(&mut self) {
        // Only remove the file if it is still ours: a second vnatd that was
        // refused must not delete the live one's socket.
        let ours =
            std::fs::symlink_metadata(&self.path).map(|m| (m.dev(), m.ino()) == self.identity);
        if ours.unwrap_or(false) {
            if let Err(e) = std::fs::remove_file(&self.path) {
                tracing::warn!(path = %self.path.display(), error = %e, "cannot remove the control socket");
            }
        }
    }
}

/// Remove `path` if it is a socket nobody listens on; refuse if someone
/// does (`vnatd --cleanup` asks too).
pub fn remove_if_stale(path: &Path) -> Result<(), ServerError> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(ServerError::Probe {
                path: path.to_path_buf(),
                source,
            })
        }
    };
    if !meta.file_type().is_socket() {
        return Err(ServerError::NotASocket {
            path: path.to_path_buf(),
        });
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(ServerError::AlreadyRunning {
            path: path.to_path_buf(),
        }),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!(path = %path.display(), "removing the stale control socket of a vnatd that is gone");
            std::fs::remove_file(path).map_err(|source| ServerError::RemoveStale {
                path: path.to_path_buf(),
                source,
            })
        }
        Err(source) => Err(ServerError::Probe {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// socket + fchmod 0600 + bind + listen. On Linux a Unix socket file takes
/// its mode from the socket inode at bind time (`unix_bind`), so there is no
/// window in which the file is more open than 0600, and no process-wide umask
/// change that would race with other threads.
fn bind_socket(path: &Path) -> io::Result<OwnedFd> {
    let fd = socket::socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )?;
    fchmod(fd.as_raw_fd(), Mode::from_bits_truncate(0o600))?;
    socket::bind(fd.as_raw_fd(), &UnixAddr::new(path)?)?;
    socket::listen(&fd, Backlog::new(128)?)?;
    Ok(fd)
}

/// Answer request lines until the client closes, idles out or oversteps.
async fn serve_client(stream: UnixStream, handler: Handler) {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    loop {
        let line = match tokio::time::timeout(
            IDLE_TIMEOUT,
            read_line_bounded(&mut reader, MAX_REQUEST_LINE),
        )
        .await
        {
            Err(_elapsed) => return,
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "control: client read failed");
                return;
            }
            Ok(Ok(Line::Eof)) => return,
            Ok(Ok(Line::TooLong)) => {
                let message = format!(
                    "the request line is longer than {MAX_REQUEST_LINE} bytes; requests are small JSON objects, one per line"
                );
                // The rest of the line is still unread, so the stream cannot be
                // resynchronised: answer, then close.
                let _ = send(
                    &mut write,
                    &ResponseEnvelope::error(ErrorKind::RequestTooLarge, message),
                )
                .await;
                return;
            }
            Ok(Ok(Line::Data(line))) => line,
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let h = handler.clone();
        // Datapath calls are synchronous syscalls: keep them off the reactor.
        // So is writing the answer out: a listing of 100,000 connections is
        // tens of megabytes of JSON, a few hundred milliseconds that the
        // runtime's worker (which the driver's moves need) must not spend.
        let answered = tokio::task::spawn_blocking(move || {
            let response = h.handle_line(&line);
            let monitoring = matches!(&response.outcome, Outcome::Ok(Reply::Monitoring));
            (monitoring, encode(&response))
        })
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "control: request handler panicked");
            let response = ResponseEnvelope::error(
                ErrorKind::Internal,
                "vnatd failed while handling this request; see its log",
            );
            (false, encode(&response))
        });
        let (monitoring, bytes) = answered;
        // A `monitor` request turns the connection into a subscription,
        // made before the answer leaves so that nothing after it is missed.
        let subscription = if monitoring {
            handler.subscribe()
        } else {
            None
        };
        let (size, started) = (
            bytes.as_ref().map_or(0, Vec::len),
            std::time::Instant::now(),
        );
        let written = write_answer(&mut write, bytes).await;
        if size > 1 << 20 {
            tracing::debug!(
                bytes = size,
                took_ms = started.elapsed().as_millis() as u64,
                "control: a large answer written"
            );
        }
        if let Err(e) = written {
            tracing::debug!(error = %e, "control: client write failed");
            return;
        }
        if let Some(sub) = subscription {
            stream_events(reader, write, sub).await;
            return;
        }
    }
}

/// Write each event to a monitoring client until it closes. Its requests
/// end here: anything it sends (or its EOF) ends the subscription. No idle
/// timeout: a monitor may wait for hours. A client that stops reading only
/// blocks this task; the driver never waits for it (`events`).
async fn stream_events(
    mut reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    mut write: OwnedWriteHalf,
    mut sub: super::events::Subscriber,
) {
    use tokio::io::AsyncReadExt;
    let mut byte = [0u8; 1];
    loop {
        tokio::select! {
            ev = sub.next() => {
                let Some(ev) = ev else { return };
                if let Err(e) = send(&mut write, &ResponseEnvelope::ok(Reply::Event(ev))).await {
                    tracing::debug!(error = %e, "control: monitoring client went away");
                    return;
                }
            }
            _ = reader.read(&mut byte) => return,
        }
    }
}

async fn send(write: &mut OwnedWriteHalf, response: &ResponseEnvelope) -> io::Result<()> {
    write_answer(write, encode(response)).await
}

/// One answer as a JSON line.
fn encode(response: &ResponseEnvelope) -> io::Result<Vec<u8>> {
    let mut bytes = serde_json::to_vec(response).map_err(io::Error::other)?;
    bytes.push(b'\n');
    Ok(bytes)
}

async fn write_answer(write: &mut OwnedWriteHalf, bytes: io::Result<Vec<u8>>) -> io::Result<()> {
    write.write_all(&bytes?).await?;
    write.flush().await
}
