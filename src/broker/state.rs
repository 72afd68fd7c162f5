//! What the service shares with the admin server, its watchdog and the tests: readiness,
//! metrics, tracing, the ladders' runtimes and the drift last seen. Plain data, so that every
//! side imports it and none imports another.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::broker::relay::LadderRuntime;
use crate::metrics::Metrics;
use crate::telemetry::Telemetry;

/// Shared, cheap-to-read state of the service for health checks.
#[derive(Debug, Default)]
pub struct Health {
    ready: AtomicBool,
    /// Why a serving session is not ready, by kind (`blocked`, …): each kind is set and cleared
    /// by its own watcher; `/ready` reports them all.
    reasons: std::sync::Mutex<std::collections::BTreeMap<&'static str, String>>,
}

impl Health {
    /// True once topology is declared and every consumer runs, and nothing holds the service
    /// up (no [`Health::reasons`]); false while reconnecting.
    pub fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Relaxed) && self.lock_reasons().is_empty()
    }

    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
    }

    /// Why the service is not ready though connected, as `kind: detail` (e.g. `blocked: low on
    /// memory`), sorted by kind; empty when nothing holds it up.
    pub fn reasons(&self) -> Vec<String> {
        self.lock_reasons()
            .iter()
            .map(|(kind, detail)| format!("{kind}: {detail}"))
            .collect()
    }

    /// Marks the service not ready because of `kind` (replacing that kind's detail).
    pub fn set_reason(&self, kind: &'static str, detail: impl Into<String>) {
        self.lock_reasons().insert(kind, detail.into());
    }

    /// The detail of reason `kind`, if it holds the service up.
    pub fn reason_of(&self, kind: &'static str) -> Option<String> {
        self.lock_reasons().get(kind).cloned()
    }

    /// `kind` no longer holds the service up.
    pub fn clear_reason(&self, kind: &'static str) {
        self.lock_reasons().remove(kind);
    }

    /// Why the service is not ready: every reason that holds it up (`kind: detail`, joined by
    /// `; `), or `connecting` while no session serves; `None` when ready.
    pub fn reason(&self) -> Option<String> {
        let reasons = self.reasons();
        if !reasons.is_empty() {
            return Some(reasons.join("; "));
        }
        (!self.ready.load(Ordering::Relaxed)).then(|| "connecting".to_string())
    }

    /// Marks a hop stalled (`Some(reason)`, `stalled: …`) or clears it: the [`STALLED`] reason,
    /// set by the session's watchdog ([`crate::broker::watchdog`]).
    pub(crate) fn set_stalled(&self, reason: Option<String>) {
        match reason {
            Some(reason) => {
                let detail = reason.strip_prefix("stalled: ").unwrap_or(&reason).to_string();
                self.set_reason(STALLED, detail);
            }
            None => self.clear_reason(STALLED),
        }
    }

    fn lock_reasons(&self) -> std::sync::MutexGuard<'_, std::collections::BTreeMap<&'static str, String>> {
        self.reasons.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The readiness reason while a hop makes no progress with work waiting (the watchdog's).
pub const STALLED: &str = "stalled";

/// The readiness reason while the broker blocks the service's publishes (a resource alarm).
pub const BLOCKED: &str = "blocked";

/// The readiness reason while a session starts: the step it waits for (connecting, declaring,
/// reading the streams, subscribing).
pub const STARTING: &str = "starting";

/// The readiness reason after a session failed, until one is ready again: why (the broker
/// refused or did not answer, e.g. one out of file descriptors, or the connection was lost).
pub const DISCONNECTED: &str = "disconnected";

/// What the service shares with the admin server and the tests: readiness, metrics, tracing.
#[derive(Debug, Default)]
pub struct State {
    /// Readiness.
    pub health: Health,
    /// Prometheus metrics.
    pub metrics: Metrics,
    /// OpenTelemetry tracing (off unless configured).
    pub telemetry: Telemetry,
    /// Every ladder's runtime once `run` made them: the admin side reads their holds and
    /// breakers (never the other way round).
    pub ladders: std::sync::RwLock<Vec<Arc<LadderRuntime>>>,
    /// The namespace's drift as last seen: written by the service after it declared its
    /// topology, its counts refreshed by the admin side (`None` before the first look).
    pub drift: std::sync::RwLock<Option<Arc<DriftSeen>>>,
}

/// The namespace's drift ([`crate::broker::drift`]) at one moment.
#[derive(Debug, Clone)]
pub struct DriftSeen {
    /// What the topology stream said.
    pub registry: crate::model::drift::Registry,
    /// What is retired and what differs.
    pub survey: crate::broker::drift::Survey,
    /// When (Unix ms).
    pub at_ms: u64,
}

impl State {
    /// The runtime of ladder `name`, once the service runs.
    pub fn ladder(&self, name: &str) -> Option<Arc<LadderRuntime>> {
        self.ladders
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .find(|l| l.spec.name == name)
            .cloned()
    }
}
