//! The driver's side of the location stores: the embedded store's records
//! saved across a restart (`daemon::locations`), and the external store
//! (etcd): each request
//! the core queues (`Endpoint::poll_store_request`) runs as a task of its
//! own with a bounded time, and its answer comes back to the loop as an
//! event, so a slow or dead etcd never holds the driver up. Whether etcd
//! answers is said in the log when it changes, not per request.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rand_core::OsRng;
use tokio::sync::mpsc;

use super::super::etcd::{EtcdError, EtcdStore};
use super::super::locations;
use super::{now, Driver, DriverConfig, DriverError};
use crate::vcmp::extstore::{StoreAnswer, StoreRequest};
use crate::vcmp::Endpoint;

/// Requests in flight at once; beyond, a request is answered as failed at
/// once (its step goes on without the store, as when etcd is down).
const MAX_IN_FLIGHT: usize = 256;

pub(super) type Answer = (u32, Result<StoreAnswer, EtcdError>);

pub(super) struct ExtStore {
    store: Arc<EtcdStore>,
    answers: mpsc::Sender<Answer>,
    in_flight: usize,
    /// Whether the last call failed (said once until one works again).
    down: bool,
    /// How the calls went, for `vnatctl status`; the warm-up writes it too.
    health: Arc<Mutex<Health>>,
}

/// How vnatd's calls to etcd went (`vnatctl status`).
#[derive(Debug, Default)]
struct Health {
    answered: u64,
    failed: u64,
    last_answer: Option<Instant>,
    last_error: Option<(Instant, String)>,
    /// Whether the last call to finish failed.
    failing: bool,
}

impl Health {
    fn record(&mut self, r: Result<(), &EtcdError>) {
        let now = Instant::now();
        match r {
            Ok(()) => {
                self.answered += 1;
                self.last_answer = Some(now);
                self.failing = false;
            }
            Err(e) => {
                self.failed += 1;
                self.last_error = Some((now, e.to_string()));
                self.failing = true;
            }
        }
    }

    fn report(&self) -> crate::control::EtcdHealth {
        let state = if self.answered + self.failed == 0 {
            "untried"
        } else if self.failing {
            "failing"
        } else {
            "answering"
        };
        crate::control::EtcdHealth {
            state: state.into(),
            answered: self.answered,
            failed: self.failed,
            last_answer_secs_ago: self.last_answer.map(|t| t.elapsed().as_secs()),
            last_error: self.last_error.as_ref().map(|(_, e)| e.clone()),
            last_error_secs_ago: self.last_error.as_ref().map(|(t, _)| t.elapsed().as_secs()),
        }
    }
}

fn lock(h: &Mutex<Health>) -> std::sync::MutexGuard<'_, Health> {
    h.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ExtStore {
    /// The store and the receiving end of its answers (the driver loop's).
    pub(super) fn new(store: EtcdStore) -> (ExtStore, mpsc::Receiver<Answer>) {
        let (tx, rx) = mpsc::channel(MAX_IN_FLIGHT);
        let store = Arc::new(store);
        let warm = store.clone();
        let health = Arc::new(Mutex::new(Health::default()));
        let warm_health = health.clone();
        tokio::spawn(async move {
            let r = warm.warm_up().await;
            lock(&warm_health).record(r.as_ref().map(|_| ()));
            match r {
                Ok(()) => {}
                // A setting to fix, said now rather than at the first move.
                Err(e) if e.is_refusal() => {
                    tracing::warn!(error = %e, "vnatd cannot use the etcd location store: moves go on without it until this is fixed")
                }
                Err(e) => {
                    tracing::info!(error = %e, "etcd does not answer yet; the first move tries again")
                }
            }
        });
        (
            ExtStore {
                store,
                answers: tx,
                in_flight: 0,
                down: false,
                health,
            },
            rx,
        )
    }

    /// Run `reqs` (what the core queued in one turn) one after the other
    /// in one task. In order, because the core puts a move's STORE before
    /// its LOOKUP, as at a location server: etcd being linearizable, of
    /// two ends that each put then get, at least one gets the other's
    /// record (if both gets came before both puts, each get would precede
    /// its own put). Beyond [`MAX_IN_FLIGHT`], requests fail at once.
    fn dispatch(&mut self, reqs: Vec<StoreRequest>) -> Vec<Answer> {
        let room = MAX_IN_FLIGHT.saturating_sub(self.in_flight);
        let mut reqs = reqs;
        let refused: Vec<Answer> = if reqs.len() > room {
            reqs.split_off(room)
                .into_iter()
                .map(|r| (r.id(), Ok(StoreAnswer::Unavailable)))
                .collect()
        } else {
            Vec::new()
        };
        if reqs.is_empty() {
            return refused;
        }
        self.in_flight += reqs.len();
        let store = self.store.clone();
        let tx = self.answers.clone();
        tokio::spawn(async move {
            for req in reqs {
                let id = req.id();
                let r = match req {
                    StoreRequest::Put { items, .. } => {
                        store.put(&items).await.map(|()| StoreAnswer::Stored)
                    }
                    StoreRequest::Get { wanted, .. } => {
                        store.get(&wanted).await.map(StoreAnswer::Found)
                    }
                };
                // The loop's receiver only goes when vnatd stops.
                let _ = tx.send((id, r)).await;
            }
        });
        refused
    }
}

/// How often the embedded store's records are saved, if they changed.
const SAVE_EVERY: Duration = Duration::from_secs(5);

/// The location stores' part of the driver.
pub(super) struct Stores {
    ext: Option<ExtStore>,
    answers: Option<mpsc::Receiver<Answer>>,
    /// The saved file's bytes as last written (nothing is written while
    /// they stay the same).
    saved: Vec<u8>,
    next_save: Instant,
}

impl Stores {
    /// Connect nothing yet (etcd is reached at the first move), but read
    /// etcd's TLS files and password now, and take back the embedded
    /// store's saved records.
    pub(super) fn open(cfg: &DriverConfig, endpoint: &mut Endpoint) -> Result<Stores, DriverError> {
        let (ext, answers) = match &cfg.location_store {
            Some(etcd) => {
                let (e, rx) = ExtStore::new(EtcdStore::new(etcd)?);
                (Some(e), Some(rx))
            }
            None => (None, None),
        };
        let saved = locations::load(&cfg.state_dir);
        if !saved.is_empty() {
            let kept = endpoint.restore_locations(now(), &saved);
            tracing::info!(
                records = kept,
                "location records kept before the restart are served again"
            );
        }
        Ok(Stores {
            ext,
            answers,
            saved: Vec::new(),
            next_save: Instant::now() + SAVE_EVERY,
        })
    }

    /// This host's addresses changed: etcd is reached again from the
    /// addresses it has now (see `EtcdStore::forget_connections`).
    pub(super) fn addresses_changed(&self) {
        if let Some(e) = &self.ext {
            e.store.forget_connections();
        }
    }

    /// The stores for `vnatctl status`.
    pub(super) fn status(&self, cfg: &DriverConfig) -> crate::control::LocationStatus {
        crate::control::LocationStatus {
            store: if cfg.location_store.is_some() {
                "etcd"
            } else {
                "embedded"
            }
            .into(),
            description: super::super::config::store::describe(&cfg.location_store),
            servers: cfg.location_servers.clone(),
            etcd: self.ext.as_ref().map(|e| lock(&e.health).report()),
        }
    }

    /// The receiving end of the external store's answers, for the loop.
    pub(super) fn take_answers(&mut self) -> Option<mpsc::Receiver<Answer>> {
        self.answers.take()
    }
}

/// The next answer, when there is a store; never otherwise.
pub(super) async fn next_answer(rx: &mut Option<mpsc::Receiver<Answer>>) -> Option<Answer> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

impl Driver {
    /// Save the embedded store's records if due (or `now`) and changed.
    pub(super) fn save_locations(&mut self, now_: bool) {
        if !now_ && Instant::now() < self.stores.next_save {
            return;
        }
        self.stores.next_save = Instant::now() + SAVE_EVERY;
        let records = self.endpoint.saved_locations(now());
        if records.is_empty() && self.stores.saved.is_empty() {
            return;
        }
        // Compared without the times (they move on every call).
        let shape: Vec<u8> = records
            .iter()
            .flat_map(|r| r.value.iter().copied())
            .collect();
        if shape == self.stores.saved && !now_ {
            return;
        }
        let bytes = locations::encode(&records, SystemTime::now());
        match locations::save(&self.cfg.state_dir, &bytes) {
            Ok(()) => self.stores.saved = shape,
            Err(e) => {
                tracing::warn!(error = %e, "cannot save the location records this host keeps; tried again in 5 s")
            }
        }
    }

    /// Start a task for every request the core queued for the store.
    pub(super) fn send_store_requests(&mut self) {
        let Some(ext) = self.stores.ext.as_mut() else {
            return;
        };
        let mut reqs = Vec::new();
        while let Some(req) = self.endpoint.poll_store_request() {
            reqs.push(req);
        }
        if reqs.is_empty() {
            return;
        }
        let refused = ext.dispatch(reqs);
        for (id, a) in refused {
            self.endpoint.handle_store_answer(
                now(),
                &mut OsRng,
                id,
                a.unwrap_or(StoreAnswer::Unavailable),
            );
        }
    }

    /// An answer from the store, into the core.
    pub(super) fn store_answer(&mut self, (id, r): Answer) {
        let Some(ext) = self.stores.ext.as_mut() else {
            return;
        };
        ext.in_flight = ext.in_flight.saturating_sub(1);
        lock(&ext.health).record(r.as_ref().map(|_| ()));
        let answer = match r {
            Ok(a) => {
                if ext.down {
                    ext.down = false;
                    tracing::info!("the etcd location store answers again");
                }
                a
            }
            Err(e) => {
                if !ext.down {
                    ext.down = true;
                    if e.is_refusal() {
                        tracing::warn!(error = %e, "the etcd location store refuses vnatd: moves go on without it, as without a location server (each end's old location only)");
                    } else {
                        tracing::warn!(error = %e, "the etcd location store does not answer: moves go on without it, as without a location server (each end's old location only)");
                    }
                } else {
                    tracing::debug!(error = %e, "etcd location store call failed");
                }
                StoreAnswer::Unavailable
            }
        };
        self.endpoint
            .handle_store_answer(now(), &mut OsRng, id, answer);
    }
}
