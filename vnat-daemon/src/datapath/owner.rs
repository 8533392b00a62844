//! The datapath's one owner: a thread that holds it and runs the commands
//! the driver, the control handler, the housekeeping and the reloads send
//! it, one at a time and each as one batch (`begin_batch`/`end_batch`), so
//! that nothing else ever touches the kernel state and no caller can see it
//! in the middle of another's batch. Callers hold a [`DatapathHandle`]: no
//! lock to take, no lock order to keep.
//!
//! A command that panics leaves the datapath in an unknown state: the owner
//! then refuses every later command ([`DatapathGone`]) but keeps the object,
//! so pinned programs and maps stay as they are and translation continues
//! until vnatd restarts.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::mpsc;

use super::Datapath;

type Command = Box<dyn FnOnce(&mut dyn Datapath) + Send>;

/// Why a command did not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("an earlier datapath operation crashed inside vnatd, or it is stopping; restart vnatd (translation continues meanwhile)")]
pub struct DatapathGone;

/// Sends commands to the datapath's owner. Cheap to clone.
#[derive(Clone)]
pub struct DatapathHandle {
    tx: mpsc::Sender<Command>,
}

/// Start the owner thread with `datapath`. The thread ends, and drops the
/// datapath, once every handle is gone.
pub fn spawn(datapath: Box<dyn Datapath + Send>) -> std::io::Result<DatapathHandle> {
    let (tx, rx) = mpsc::channel::<Command>();
    std::thread::Builder::new()
        .name("vnat-datapath".into())
        .spawn(move || own(datapath, rx))?;
    Ok(DatapathHandle { tx })
}

fn own(mut datapath: Box<dyn Datapath + Send>, rx: mpsc::Receiver<Command>) {
    let mut crashed = false;
    for cmd in rx {
        if crashed {
            // Dropping the command drops its reply sender: the caller
            // gets `DatapathGone`.
            continue;
        }
        let dp = datapath.as_mut();
        let r = catch_unwind(AssertUnwindSafe(|| {
            dp.begin_batch();
            cmd(&mut *dp);
            dp.end_batch();
        }));
        if r.is_err() {
            tracing::error!(
                "a datapath operation panicked; refusing datapath commands until vnatd restarts"
            );
            crashed = true;
        }
    }
}

impl DatapathHandle {
    /// Run `f` on the datapath and wait for its result, from an async task.
    pub async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Datapath) -> T + Send + 'static,
    ) -> Result<T, DatapathGone> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.send(f, move |r| {
            let _ = reply.send(r);
        })?;
        answer.await.map_err(|_| DatapathGone)
    }

    /// Run `f` on the datapath and wait for its result, from a thread that
    /// may block (never from an async task).
    pub fn run_blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Datapath) -> T + Send + 'static,
    ) -> Result<T, DatapathGone> {
        let (reply, answer) = mpsc::sync_channel(1);
        self.send(f, move |r| {
            let _ = reply.send(r);
        })?;
        answer.recv().map_err(|_| DatapathGone)
    }

    fn send<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Datapath) -> T + Send + 'static,
        reply: impl FnOnce(T) + Send + 'static,
    ) -> Result<(), DatapathGone> {
        self.tx
            .send(Box::new(move |dp: &mut dyn Datapath| reply(f(dp))))
            .map_err(|_| DatapathGone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::fake::FakeDatapath;

    #[test]
    fn every_command_runs_inside_a_batch() {
        let h = spawn(Box::new(FakeDatapath::new())).unwrap();
        // The fake panics on an end_batch without a batch open: closing and
        // reopening the command's own batch works only inside one.
        for _ in 0..3 {
            let r = h.run_blocking(|dp| {
                dp.end_batch();
                dp.begin_batch();
            });
            assert_eq!(r, Ok(()));
        }
    }

    #[test]
    fn a_command_that_panics_stops_later_ones_but_keeps_the_datapath() {
        let h = spawn(Box::new(FakeDatapath::new())).unwrap();
        let r: Result<(), _> = h.run_blocking(|_| panic!("bug in a datapath operation"));
        assert_eq!(r, Err(DatapathGone));
        assert_eq!(h.run_blocking(|_| 1), Err(DatapathGone));
    }

    #[tokio::test]
    async fn async_callers_get_their_result() {
        let h = spawn(Box::new(FakeDatapath::new())).unwrap();
        let status = h.run(|dp| dp.status().is_ok()).await;
        assert_eq!(status, Ok(true));
    }
}
