//! A namespace host with its own vnat datapath: pins in a private bpffs
//! directory and a cgroup whose processes are recorded.
//!
//! Every datapath call opens the datapath afresh inside the namespace and
//! drops it afterwards, exactly as a restarted owner would: the pins are the
//! only state, so each call also exercises reconciliation with the pins.

use std::{
    process::Command,
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

use super::{BpffsDir, Cgroup, LaptopRouterServer, Netns, TempDir};
use vnat_daemon::datapath::{
    kernel::{pinlock::PinLock, KernelDatapath, KernelOptions},
    ConnectionInfo, Datapath, Proto,
};

pub struct Host<'a> {
    pub ns: &'a Netns,
    pub pins: BpffsDir,
    pub cgroup: Cgroup,
}

impl<'a> Host<'a> {
    /// Creates the pins and cgroup and attaches the recorders to the cgroup.
    pub fn new(ns: &'a Netns, tag: &str) -> Host<'a> {
        let h = Host {
            ns,
            pins: BpffsDir::new(tag),
            cgroup: Cgroup::new(tag),
        };
        h.datapath(|_| ());
        h
    }

    pub fn options(&self) -> KernelOptions {
        KernelOptions {
            bpffs: self.pins.path().to_path_buf(),
            cgroups: vec![self.cgroup.path().to_path_buf()],
            tc_attach: super::tc_attach(),
            sysctl_record: None,
            tc_load: vnat_daemon::datapath::kernel::TcLoad::OnFirstUse,
        }
    }

    /// Run `f` on a freshly opened datapath inside the namespace (the tc
    /// translators loaded only if `f` or the opening attaches them): owned
    /// (the pins' lock taken, the config written) when no vnatd runs on
    /// these pins, only observed (nothing of the running vnatd's written:
    /// `KernelDatapath::observe`) when one does.
    pub fn datapath<T: Send>(&self, f: impl FnOnce(&mut KernelDatapath) -> T + Send) -> T {
        let opts = self.options();
        let name = self.ns.name().to_string();
        self.ns.run_in(move || {
            let mut dp = if PinLock::held(&opts.bpffs) {
                KernelDatapath::observe(&opts)
            } else {
                KernelDatapath::open(&opts)
            }
            .unwrap_or_else(|e| panic!("opening the datapath in {name}: {e}"));
            f(&mut dp)
        })
    }

    /// The datapath opened once and held, owned, as a running vnatd holds
    /// its own: calls on it ([`OpenDatapath::call`]) load nothing, where
    /// each [`Host::datapath`] loads the programs afresh (a second or more
    /// under a loaded suite). For tests that time what follows a call.
    /// While it is held, `Host::datapath` only observes.
    pub fn open(&self) -> OpenDatapath {
        // Everything loaded now, so that no call the test times waits for
        // the verifier.
        let opts = KernelOptions {
            tc_load: vnat_daemon::datapath::kernel::TcLoad::AtOpen,
            ..self.options()
        };
        let name = self.ns.name().to_string();
        let (jobs, queue) = mpsc::channel::<Job>();
        let (opened, ready) = mpsc::channel();
        let worker = self.ns.spawn_in(move || {
            let mut dp = match KernelDatapath::open(&opts) {
                Ok(dp) => dp,
                Err(e) => {
                    let _ = opened.send(Err(format!("opening the datapath in {name}: {e}")));
                    return;
                }
            };
            let _ = opened.send(Ok(()));
            for job in queue {
                job(&mut dp);
            }
        });
        if let Err(e) = ready
            .recv()
            .expect("the datapath's thread died while opening")
        {
            panic!("{e}");
        }
        OpenDatapath {
            jobs: Some(jobs),
            worker: Some(worker),
        }
    }

    /// How many entries the pinned NAT maps hold, egress and ingress, read
    /// from the pins alone: no datapath is opened, so nothing is
    /// reconciled (the crash-safety tests check what vnatd left).
    pub fn pinned_nat_entries(&self) -> usize {
        use vnat_common::{FlowKey, NatRewrite, MAP_EGRESS_NAT, MAP_INGRESS_NAT};
        [MAP_EGRESS_NAT, MAP_INGRESS_NAT]
            .iter()
            .map(|name| {
                let pin = self.pins.path().join(name);
                let data = aya::maps::MapData::from_pin(&pin)
                    .unwrap_or_else(|e| panic!("opening the pinned map {}: {e}", pin.display()));
                let map: aya::maps::HashMap<_, FlowKey, NatRewrite> =
                    aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data))
                        .unwrap_or_else(|e| panic!("{name} is not a hash map: {e}"));
                let mut n = 0;
                for k in map.keys() {
                    k.unwrap_or_else(|e| panic!("reading {name}: {e}"));
                    n += 1;
                }
                n
            })
            .sum()
    }

    /// A command that runs in this host's namespace and cgroup.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = self.ns.cmd(program);
        self.cgroup.join_on_spawn(&mut cmd);
        cmd
    }

    /// socat with `args` in this host's namespace and cgroup, in its own
    /// process group (killed on drop), stdin as given, output discarded.
    pub fn socat(&self, args: &[&str], stdin: std::process::Stdio) -> super::ProcessGroup {
        let mut cmd = self.command("socat");
        cmd.args(args)
            .stdin(stdin)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        super::ProcessGroup::spawn(cmd, &format!("socat in {}", self.ns.name()))
    }

    /// Run `f` on the datapath's pinned maps, read without loading its
    /// programs (`KernelDatapath::inspect`): for looking (connections,
    /// counters), where an opening's verifier work would be most of the
    /// cost, ten seconds a call in an emulated VM. Changes go through
    /// [`Host::datapath`].
    pub fn read<T: Send>(&self, f: impl FnOnce(&mut KernelDatapath) -> T + Send) -> T {
        let opts = self.options();
        let name = self.ns.name().to_string();
        self.ns.run_in(move || {
            let mut dp = KernelDatapath::inspect(&opts)
                .unwrap_or_else(|e| panic!("reading the datapath in {name}: {e}"));
            f(&mut dp)
        })
    }

    /// Wait until the datapath has recorded a connection matching `pred`.
    pub fn wait_connection(
        &self,
        what: &str,
        pred: impl Fn(&ConnectionInfo) -> bool + Send + Sync,
    ) -> ConnectionInfo {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let found = self.read(|dp| {
                dp.sync_udp().expect("sync_udp");
                dp.connections()
                    .expect("listing connections")
                    .into_iter()
                    .find(|c| pred(c))
            });
            if let Some(c) = found {
                return c;
            }
            assert!(Instant::now() < deadline, "{what} was never recorded");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn counter(&self, name: &str) -> u64 {
        let name = name.to_string();
        self.read(move |dp| {
            dp.counters()
                .expect("counters")
                .into_iter()
                .find(|(n, _)| *n == name)
                .expect("no such counter")
                .1
        })
    }

    pub fn connections(&self, proto: Proto) -> Vec<ConnectionInfo> {
        self.read(move |dp| {
            dp.sync_udp().expect("sync_udp");
            dp.connections()
                .expect("listing connections")
                .into_iter()
                .filter(|c| c.proto == proto)
                .collect()
        })
    }
}

type Job = Box<dyn FnOnce(&mut KernelDatapath) + Send>;

/// A host's datapath held open on a thread in its namespace ([`Host::open`]);
/// dropped, it closes as a stopping vnatd's does.
pub struct OpenDatapath {
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<thread::JoinHandle<()>>,
}

impl OpenDatapath {
    /// Run `f` on the open datapath; a panic in `f` is re-raised here.
    pub fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KernelDatapath) -> T + Send + 'static,
    ) -> T {
        let (done, result) = mpsc::channel();
        let job: Job = Box::new(move |dp| {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(dp)));
            let _ = done.send(r);
        });
        self.jobs
            .as_ref()
            .expect("open until dropped")
            .send(job)
            .expect("the datapath's thread is gone");
        match result.recv().expect("the datapath's thread is gone") {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl Drop for OpenDatapath {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Something datapath calls go through: a [`Host`] (opened afresh for each
/// call) or an [`OpenDatapath`].
pub trait OnDatapath {
    fn on<T: Send + 'static>(&self, f: impl FnOnce(&mut KernelDatapath) -> T + Send + 'static)
        -> T;
}

impl OnDatapath for Host<'_> {
    fn on<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KernelDatapath) -> T + Send + 'static,
    ) -> T {
        self.datapath(f)
    }
}

impl OnDatapath for OpenDatapath {
    fn on<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut KernelDatapath) -> T + Send + 'static,
    ) -> T {
        self.call(f)
    }
}

/// The laptop and the server of a [`LaptopRouterServer`] as hosts, with a
/// directory for each one's vnatd and one for the test's own files, all
/// named after `tag`.
pub struct LaptopAndServer<'a> {
    pub lap: Host<'a>,
    pub srv: Host<'a>,
    /// The `dir` of the laptop's [`super::Vnatd`].
    pub lap_dir: TempDir,
    /// The `dir` of the server's [`super::Vnatd`].
    pub srv_dir: TempDir,
    pub work: TempDir,
}

impl<'a> LaptopAndServer<'a> {
    pub fn new(topo: &'a LaptopRouterServer, tag: &str) -> LaptopAndServer<'a> {
        LaptopAndServer {
            lap: Host::new(&topo.laptop, &format!("{tag}l")),
            srv: Host::new(&topo.server, &format!("{tag}s")),
            lap_dir: TempDir::new(&format!("{tag}l")),
            srv_dir: TempDir::new(&format!("{tag}s")),
            work: TempDir::new(&format!("{tag}w")),
        }
    }
}

/// Translate one flow after `mover`'s end of it moved to `new_local`, on
/// both ends, in the order the migration protocol uses: the mover becomes
/// receive-ready (prepare), the peer switches both directions (UPD), then
/// the mover switches its send side (UPD_R). In any other order one kernel
/// may see an untranslated packet for a socket it lacks and reset the
/// connection.
pub fn move_flow(
    mover: &impl OnDatapath,
    peer: &impl OnDatapath,
    flow: vnat_daemon::datapath::VirtualFlow,
    new_local: std::net::SocketAddr,
) {
    use vnat_daemon::datapath::{Datapath, Translation, VirtualFlow};
    let t = Translation {
        flow,
        physical_local: new_local,
        physical_remote: flow.remote,
    };
    mover
        .on(move |dp| dp.prepare_translation(&t))
        .unwrap_or_else(|e| panic!("mover, prepare: {e}"));
    let back = Translation {
        flow: VirtualFlow {
            proto: flow.proto,
            local: flow.remote,
            remote: flow.local,
        },
        physical_local: flow.remote,
        physical_remote: new_local,
    };
    peer.on(move |dp| dp.install_translation(&back))
        .unwrap_or_else(|e| panic!("peer, install: {e}"));
    mover
        .on(move |dp| dp.install_translation(&t))
        .unwrap_or_else(|e| panic!("mover, install: {e}"));
}
