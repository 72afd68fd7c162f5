//! Destination holds, a circuit breaker per destination queue. Here are the record format
//! `ladder.hold/v1` of the hold stream `N.L.holds`, the state every replica rebuilds by
//! following it ([`Holds`]), and the automatic hold's [`Breaker`]: a sliding window of
//! deliveries and failures per destination, its thresholds and its damping.
//!
//! Pure: the caller hands in the time and the records; nothing here reads a clock or talks to
//! the broker. The state is a cache of the stream, never the truth.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::model::leaving::DueCounts;
use crate::model::lot::pace::Rate;

/// The record format of a hold, a resume or the end of a release in `N.L.holds`.
pub const HOLD_FORMAT: &str = "ladder.hold/v1";

/// Destinations one ladder tracks in its hold state at most (held, releasing, or with a held
/// queue that may still hold a straggler); the oldest free one goes first. Every one costs a
/// consumer while it is not held, so the bound is also a bound on those.
pub const MAX_HOLDS: usize = 1_000;

/// Destinations the automatic hold watches at most per ladder; the least recently seen go
/// first. A window costs up to twice [`WINDOW_BUCKETS`] × 16 bytes (its past and a window
/// ahead) plus the name.
pub const MAX_WATCHED: usize = 10_000;

/// A window is counted in this many buckets: it slides by a tenth of itself.
pub const WINDOW_BUCKETS: u64 = 10;

/// Transitions kept for the page and the API, newest last.
pub const MAX_RECENT: usize = 50;

/// `why` is cut to this many bytes.
pub const MAX_WHY_BYTES: usize = 512;

/// Who an automatic hold or resume is recorded as.
pub const AUTO: &str = "auto";

/// What a hold record says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HoldAction {
    /// Due messages for the destination go into its held queue instead.
    Held,
    /// The held queue is released at `rate`; new due messages queue behind it until it is empty.
    Resumed,
    /// The release named by `of` (the resume's `at_ms`) found the held queue empty: due
    /// messages flow straight to the destination again.
    Released,
    /// The automatic hold's prober (the replica whose held-queue consumer is the single active
    /// one, named in `by`) releases one message as a probe, marked `retry-probe: <at_ms>`; `of`
    /// names the hold (its `at_ms`).
    Probed,
    /// A replica's intake saw the probe named by `of` come back failed: the next probe goes
    /// out a probe period later.
    ProbeFailed,
    /// The held queue of a free destination was deleted (empty since the release that `of`
    /// names ended — the `at_ms` of the `released` record): the destination is forgotten.
    Deleted,
}

impl HoldAction {
    /// Every action.
    pub const ALL: [HoldAction; 6] = [
        HoldAction::Held,
        HoldAction::Resumed,
        HoldAction::Released,
        HoldAction::Probed,
        HoldAction::ProbeFailed,
        HoldAction::Deleted,
    ];

    /// The schema of [`HoldAction::code`]: one of the codes.
    pub fn schema() -> utoipa::openapi::Object {
        crate::model::words_schema(HoldAction::ALL.map(HoldAction::code))
    }

    /// The metric label and the log word.
    pub fn code(self) -> &'static str {
        match self {
            HoldAction::Held => "held",
            HoldAction::Resumed => "resumed",
            HoldAction::Released => "released",
            HoldAction::Probed => "probed",
            HoldAction::ProbeFailed => "probe_failed",
            HoldAction::Deleted => "deleted",
        }
    }
}

/// One record of `N.L.holds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HoldRecord {
    /// [`HOLD_FORMAT`].
    pub format: String,
    /// The destination queue.
    pub destination: String,
    /// What happened.
    pub action: HoldAction,
    /// Who: a token's name, the CLI's user, or [`AUTO`].
    pub by: String,
    /// Why (at most [`MAX_WHY_BYTES`]).
    #[serde(default)]
    pub why: String,
    /// When, ms since the epoch.
    pub at_ms: u64,
    /// Resume: the release rate (`10/s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// Released: the `at_ms` of the resume whose release ended. Probed: the hold's `at_ms`.
    /// ProbeFailed: the probe's `at_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub of: Option<u64>,
    /// An automatic hold: the wait before each probe, in ms (the first, and after a failed one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ms: Option<u64>,
}

impl HoldRecord {
    /// A record of `action` on `destination`.
    pub fn new(destination: &str, action: HoldAction, by: &str, why: &str, at_ms: u64) -> Self {
        HoldRecord {
            format: HOLD_FORMAT.into(),
            destination: destination.into(),
            action,
            by: by.into(),
            why: cut(why, MAX_WHY_BYTES).into(),
            at_ms,
            rate: None,
            of: None,
            hold_ms: None,
        }
    }

    /// The record body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record body back, if it is a hold record.
    pub fn from_slice(body: &[u8]) -> Option<Self> {
        serde_json::from_slice::<HoldRecord>(body)
            .ok()
            .filter(|r| r.format == HOLD_FORMAT && !r.destination.is_empty())
    }

    /// The release rate a resume asked for, if it names a valid one.
    pub fn release_rate(&self) -> Option<Rate> {
        self.rate.as_deref().and_then(|r| r.parse().ok())
    }
}

fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// Where one destination stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldState {
    /// Its due messages go into its held queue; nothing is delivered to it.
    Held,
    /// Its held queue is being released at `rate`; due messages go behind the release.
    Releasing {
        /// The release rate.
        rate: Rate,
        /// The resume's `at_ms`, which the end of this release names.
        since_ms: u64,
    },
    /// Due messages are delivered; its held queue (if anything straggled into it) drains at the
    /// default rate.
    Free,
}

/// What a replica knows about one destination's hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestinationHold {
    /// The destination queue.
    pub destination: String,
    /// Where it stands.
    pub state: HoldState,
    /// Who made the last transition.
    pub by: String,
    /// Why.
    pub why: String,
    /// When the last hold began (ms since the epoch); kept through the release.
    pub held_since_ms: u64,
    /// When the last transition happened.
    pub changed_at_ms: u64,
    /// An automatic hold's half-open state, the same on every replica (it is read from the
    /// stream, never counted locally).
    pub probing: Option<Probing>,
}

/// The half-open state of an automatic hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probing {
    /// The wait before each probe (ms).
    pub hold_ms: u64,
    /// No probe before this (ms since the epoch).
    pub next_probe_ms: u64,
    /// The probe out (its `at_ms`, the value of its `retry-probe` header) and its prober.
    pub probe: Option<(u64, String)>,
    /// Probes that failed during this hold.
    pub failures: u32,
}

/// What the automatic hold of one destination wants now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeStep {
    /// Nothing yet.
    Wait,
    /// Time for a probe of the hold `of`.
    Probe {
        /// The hold's `at_ms`.
        of: u64,
        /// No one probed for a whole probe period after it was due (no prober holds a
        /// message: the held queue may be empty).
        overdue: bool,
    },
    /// The probe (sent by `prober`) had no failure back within a probe period: resume.
    Resume {
        /// The replica that sent the probe.
        prober: String,
        /// A probe period more went by (the prober may be gone).
        overdue: bool,
    },
}

impl DestinationHold {
    /// Whether the due hop must put its messages into the held queue.
    pub fn holds_back(&self) -> bool {
        !matches!(self.state, HoldState::Free)
    }

    /// Whether an automatic hold holds it.
    pub fn auto(&self) -> bool {
        self.by == AUTO
    }

    /// What the automatic hold wants at `now_ms`; nothing unless automatically held.
    pub fn probe_step(&self, now_ms: u64, probe_every: Duration) -> ProbeStep {
        let (HoldState::Held, Some(p)) = (self.state, &self.probing) else {
            return ProbeStep::Wait;
        };
        let every = duration_ms(probe_every);
        match &p.probe {
            Some((at, prober)) if now_ms >= at.saturating_add(every) => ProbeStep::Resume {
                prober: prober.clone(),
                overdue: now_ms >= at.saturating_add(every.saturating_mul(2)),
            },
            Some(_) => ProbeStep::Wait,
            None if now_ms >= p.next_probe_ms => ProbeStep::Probe {
                of: self.held_since_ms,
                overdue: now_ms >= p.next_probe_ms.saturating_add(every),
            },
            None => ProbeStep::Wait,
        }
    }

    /// The state's word: `held`, `releasing`, `free`.
    pub fn state_code(&self) -> &'static str {
        match self.state {
            HoldState::Held => "held",
            HoldState::Releasing { .. } => "releasing",
            HoldState::Free => "free",
        }
    }
}

/// The holds of one ladder, by destination.
#[derive(Debug, Default, Clone)]
pub struct Holds {
    by_destination: BTreeMap<String, DestinationHold>,
    recent: VecDeque<HoldRecord>,
}

impl Holds {
    /// Applies one record (in stream order); `default_rate` releases a resume that names none.
    /// Returns whether it changed anything.
    pub fn apply(&mut self, record: &HoldRecord, default_rate: Rate) -> bool {
        let current = self.by_destination.get(&record.destination);
        let next = match (record.action, current.map(|c| c.state)) {
            (HoldAction::Held, Some(HoldState::Held)) => return false,
            (HoldAction::Held, _) => DestinationHold {
                destination: record.destination.clone(),
                state: HoldState::Held,
                by: record.by.clone(),
                why: record.why.clone(),
                held_since_ms: record.at_ms,
                changed_at_ms: record.at_ms,
                probing: (record.by == AUTO).then(|| {
                    let hold_ms = record.hold_ms.unwrap_or(0);
                    Probing {
                        hold_ms,
                        next_probe_ms: record.at_ms.saturating_add(hold_ms),
                        probe: None,
                        failures: 0,
                    }
                }),
            },
            (HoldAction::Probed, Some(HoldState::Held)) => {
                let current = current.expect("matched Some");
                match &current.probing {
                    Some(p) if p.probe.is_none() && record.of == Some(current.held_since_ms) => {
                        let mut next = current.clone();
                        if let Some(p) = &mut next.probing {
                            p.probe = Some((record.at_ms, record.by.clone()));
                        }
                        next
                    }
                    // a second prober lost the race, or a probe of an earlier hold
                    _ => return false,
                }
            }
            (HoldAction::ProbeFailed, Some(HoldState::Held)) => {
                let current = current.expect("matched Some");
                match &current.probing {
                    Some(p) if p.probe.as_ref().map(|(at, _)| *at) == record.of && record.of.is_some() => {
                        let mut next = current.clone();
                        if let Some(p) = &mut next.probing {
                            p.failures = p.failures.saturating_add(1);
                            p.probe = None;
                            p.next_probe_ms = record.at_ms.saturating_add(p.hold_ms);
                        }
                        next
                    }
                    // a failure of an older probe (counted already) or of none
                    _ => return false,
                }
            }
            (HoldAction::Resumed, Some(HoldState::Held)) => {
                let current = current.expect("matched Some");
                DestinationHold {
                    state: HoldState::Releasing {
                        rate: record.release_rate().unwrap_or(default_rate),
                        since_ms: record.at_ms,
                    },
                    by: record.by.clone(),
                    why: record.why.clone(),
                    changed_at_ms: record.at_ms,
                    probing: None,
                    ..current.clone()
                }
            }
            (HoldAction::Released, Some(HoldState::Releasing { since_ms, .. })) if record.of == Some(since_ms) => {
                DestinationHold {
                    state: HoldState::Free,
                    changed_at_ms: record.at_ms,
                    ..current.expect("matched Some").clone()
                }
            }
            (HoldAction::Deleted, Some(HoldState::Free)) if record.of == current.map(|c| c.changed_at_ms) => {
                self.by_destination.remove(&record.destination);
                self.push_recent(record);
                return true;
            }
            // a resume of what is not held, the end of another release, the deletion of a held
            // queue that was used again: nothing to do
            _ => return false,
        };
        self.by_destination.insert(record.destination.clone(), next);
        self.push_recent(record);
        if self.by_destination.len() > MAX_HOLDS {
            let oldest_free = self
                .by_destination
                .values()
                .filter(|h| h.state == HoldState::Free)
                .min_by_key(|h| h.changed_at_ms)
                .map(|h| h.destination.clone());
            if let Some(oldest) = oldest_free {
                self.by_destination.remove(&oldest);
            }
        }
        true
    }

    fn push_recent(&mut self, record: &HoldRecord) {
        self.recent.push_back(record.clone());
        if self.recent.len() > MAX_RECENT {
            self.recent.pop_front();
        }
    }

    /// The hold of `destination`, if it has one.
    pub fn get(&self, destination: &str) -> Option<&DestinationHold> {
        self.by_destination.get(destination)
    }

    /// Whether the due hop must put `destination`'s messages into its held queue.
    pub fn holds_back(&self, destination: &str) -> bool {
        self.by_destination
            .get(destination)
            .is_some_and(DestinationHold::holds_back)
    }

    /// Every destination known, by name.
    pub fn all(&self) -> impl Iterator<Item = &DestinationHold> {
        self.by_destination.values()
    }

    /// The latest transitions (at most [`MAX_RECENT`]), newest first.
    pub fn recent(&self) -> impl Iterator<Item = &HoldRecord> {
        self.recent.iter().rev()
    }

    /// How many are held or releasing.
    pub fn held_count(&self) -> usize {
        self.all().filter(|h| h.holds_back()).count()
    }

    /// Whether nothing is held back.
    pub fn none_held(&self) -> bool {
        self.by_destination.values().all(|h| !h.holds_back())
    }
}

/// The record format of a checkpoint in `N.L.holds`: the whole hold state up to a record. A
/// follower that starts where retention cut the stream rebuilds from it exactly the state of one
/// that read every record.
pub const CHECKPOINT_FORMAT: &str = "ladder.holds-checkpoint/v1";

/// One destination in a [`Checkpoint`]: [`DestinationHold`] with its state spelled out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointEntry {
    /// The destination queue.
    pub destination: String,
    /// `held`, `releasing` or `free`.
    pub state: String,
    /// Releasing: the rate (`10/s`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate: Option<String>,
    /// Releasing: the resume's `at_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since_ms: Option<u64>,
    /// [`DestinationHold::by`].
    pub by: String,
    /// [`DestinationHold::why`].
    pub why: String,
    /// [`DestinationHold::held_since_ms`].
    pub held_since_ms: u64,
    /// [`DestinationHold::changed_at_ms`].
    pub changed_at_ms: u64,
    /// [`DestinationHold::probing`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probing: Option<Probing>,
}

/// A checkpoint record: the state folded from the stream's first record up to and including the
/// record at offset `upto`. Appended now and then by a follower that is caught up, so that the
/// stream can have a retention without losing a hold that is still live, however old it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// [`CHECKPOINT_FORMAT`].
    pub format: String,
    /// The stream offset of the last record folded in.
    pub upto: u64,
    /// When it was written, ms since the epoch.
    pub at_ms: u64,
    /// Every destination known, held or not.
    pub holds: Vec<CheckpointEntry>,
    /// [`Holds::recent`], oldest first.
    pub recent: Vec<HoldRecord>,
}

impl Checkpoint {
    /// The record body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record body back, if it is a checkpoint.
    pub fn from_slice(body: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Checkpoint>(body)
            .ok()
            .filter(|c| c.format == CHECKPOINT_FORMAT)
    }
}

fn rate_text(rate: Rate) -> String {
    let unit = match rate.per.as_secs() {
        60 => "m",
        3600 => "h",
        _ => "s",
    };
    format!("{}/{unit}", rate.count)
}

impl Holds {
    /// The state as a checkpoint of the stream up to offset `upto`, written at `at_ms`.
    pub fn checkpoint(&self, upto: u64, at_ms: u64) -> Checkpoint {
        let holds = self
            .all()
            .map(|h| {
                let (state, rate, since_ms) = match h.state {
                    HoldState::Held => ("held", None, None),
                    HoldState::Releasing { rate, since_ms } => ("releasing", Some(rate_text(rate)), Some(since_ms)),
                    HoldState::Free => ("free", None, None),
                };
                CheckpointEntry {
                    destination: h.destination.clone(),
                    state: state.into(),
                    rate,
                    since_ms,
                    by: h.by.clone(),
                    why: h.why.clone(),
                    held_since_ms: h.held_since_ms,
                    changed_at_ms: h.changed_at_ms,
                    probing: h.probing.clone(),
                }
            })
            .collect();
        Checkpoint {
            format: CHECKPOINT_FORMAT.into(),
            upto,
            at_ms,
            holds,
            recent: self.recent.iter().cloned().collect(),
        }
    }

    /// The state a checkpoint holds; `default_rate` for a rate it cannot read (none it wrote).
    pub fn restore(checkpoint: &Checkpoint, default_rate: Rate) -> Holds {
        let by_destination = checkpoint
            .holds
            .iter()
            .filter(|e| !e.destination.is_empty())
            .filter_map(|e| {
                let state = match e.state.as_str() {
                    "held" => HoldState::Held,
                    "releasing" => HoldState::Releasing {
                        rate: e.rate.as_deref().and_then(|r| r.parse().ok()).unwrap_or(default_rate),
                        since_ms: e.since_ms.unwrap_or(e.changed_at_ms),
                    },
                    "free" => HoldState::Free,
                    _ => return None,
                };
                let hold = DestinationHold {
                    destination: e.destination.clone(),
                    state,
                    by: e.by.clone(),
                    why: e.why.clone(),
                    held_since_ms: e.held_since_ms,
                    changed_at_ms: e.changed_at_ms,
                    probing: e.probing.clone(),
                };
                Some((e.destination.clone(), hold))
            })
            .take(MAX_HOLDS)
            .collect();
        let skip = checkpoint.recent.len().saturating_sub(MAX_RECENT);
        Holds {
            by_destination,
            recent: checkpoint.recent.iter().skip(skip).cloned().collect(),
        }
    }
}

/// How a follower folds the hold stream when its first record may not be the stream's first
/// (retention removed the oldest segments). Reading from offset 0 it applies every record as it
/// comes. Reading from a cut it keeps the records it reads until a checkpoint that covers the
/// cut (`upto + 1 >= first offset`). Then the state is the checkpoint's, with the kept records
/// after `upto` applied on top in order: exactly the fold of the whole stream.
#[derive(Debug, Default)]
pub struct Catchup {
    first: Option<u64>,
    /// While reading from a cut without a checkpoint that covers it yet: the records read.
    kept: Option<Vec<(u64, HoldRecord)>>,
}

/// What a follower does with what it read.
#[derive(Debug)]
pub enum Fold {
    /// Apply these records, in order.
    Apply(Vec<HoldRecord>),
    /// Replace the state with this one, then apply these records, in order.
    Restore(Holds, Vec<HoldRecord>),
}

impl Catchup {
    fn start(&mut self, offset: u64) {
        if self.first.is_none() {
            self.first = Some(offset);
            if offset > 0 {
                self.kept = Some(Vec::new());
            }
        }
    }

    /// A hold record at stream offset `offset`.
    pub fn record(&mut self, offset: u64, record: HoldRecord) -> Fold {
        self.start(offset);
        match &mut self.kept {
            Some(kept) => {
                kept.push((offset, record));
                Fold::Apply(Vec::new())
            }
            None => Fold::Apply(vec![record]),
        }
    }

    /// Any other record (a marker, a record of another kind) at `offset`.
    pub fn other(&mut self, offset: u64) {
        self.start(offset);
    }

    /// A checkpoint at `offset`. Reading from a cut, the first one that covers it restores the
    /// state; every other one changes nothing (the state already is what it says).
    pub fn checkpoint(&mut self, offset: u64, checkpoint: &Checkpoint, default_rate: Rate) -> Fold {
        self.start(offset);
        let first = self.first.unwrap_or(0);
        match self.kept.take() {
            Some(kept) if checkpoint.upto.saturating_add(1) >= first && checkpoint.upto < offset => {
                let after = kept
                    .into_iter()
                    .filter(|(o, _)| *o > checkpoint.upto)
                    .map(|(_, r)| r)
                    .collect();
                Fold::Restore(Holds::restore(checkpoint, default_rate), after)
            }
            kept => {
                self.kept = kept;
                Fold::Apply(Vec::new())
            }
        }
    }

    /// Whether the reading started at a cut and no checkpoint covered it yet.
    pub fn uncovered(&self) -> bool {
        self.kept.is_some()
    }

    /// Gives up waiting for a checkpoint (the follower reached its own marker without one, which
    /// only a retention smaller than [`CHECKPOINT_EVERY_BYTES`] allows): the records read, to be
    /// applied as they are.
    pub fn give_up(&mut self) -> Vec<HoldRecord> {
        self.kept
            .take()
            .unwrap_or_default()
            .into_iter()
            .map(|(_, r)| r)
            .collect()
    }
}

/// A caught-up follower appends a [`Checkpoint`] once this many bytes of records went by since
/// the last checkpoint in the stream, plus up to half again, drawn per follower so that replicas
/// do not all write one at once. Far below the
/// stream's retention (`model::plan::HOLDS_MAX_BYTES`, which keeps at least that less one
/// segment), so the retained part always holds a checkpoint that covers where it begins.
pub const CHECKPOINT_EVERY_BYTES: u64 = 1024 * 1024;

/// [`Holds`] shared between the follower that fills it, the relay loops that read it and the
/// releaser; the lock is never held across an await. `caught_up`: the follower has read the
/// stream to a marker it appended itself (until then a due message may not be delivered).
#[derive(Debug, Default)]
pub struct SharedHolds {
    inner: RwLock<Holds>,
    any_held: std::sync::atomic::AtomicBool,
    caught_up: std::sync::atomic::AtomicBool,
    /// Destinations whose held queue this process is deleting: a `held` record for one waits
    /// until the deletion ended (and its queue is declared again), so no due hop of this
    /// process routes into a queue being deleted.
    deleting: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl SharedHolds {
    /// Applies one record; whether it changed anything.
    pub fn apply(&self, record: &HoldRecord, default_rate: Rate) -> bool {
        self.apply_unless_deleting(record, default_rate).unwrap_or(false)
    }

    /// Applies one record, unless it holds a destination whose held queue is being deleted
    /// (`None`: declare the queue again once [`SharedHolds::end_delete`], then apply it).
    pub fn apply_unless_deleting(&self, record: &HoldRecord, default_rate: Rate) -> Option<bool> {
        let mut holds = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        if record.action == HoldAction::Held
            && self
                .deleting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&record.destination)
        {
            return None;
        }
        let changed = holds.apply(record, default_rate);
        self.any_held
            .store(!holds.none_held(), std::sync::atomic::Ordering::Release);
        Some(changed)
    }

    /// Starts deleting `destination`'s held queue, if it is free since `changed_at_ms` (nothing
    /// applied since holds it again); whether it may.
    pub fn begin_delete(&self, destination: &str, changed_at_ms: u64) -> bool {
        let holds = self.inner.read().unwrap_or_else(PoisonError::into_inner);
        let free = holds
            .get(destination)
            .is_some_and(|h| h.state == HoldState::Free && h.changed_at_ms == changed_at_ms);
        free && self
            .deleting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(destination.to_string())
    }

    /// The deletion [`SharedHolds::begin_delete`] started ended, whatever its outcome.
    pub fn end_delete(&self, destination: &str) {
        self.deleting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(destination);
    }

    /// Whether the due hop must put `destination`'s messages into its held queue (one atomic
    /// read while nothing is held).
    pub fn holds_back(&self, destination: &str) -> bool {
        self.any_held.load(std::sync::atomic::Ordering::Acquire)
            && self
                .inner
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .holds_back(destination)
    }

    /// Replaces the state (a follower restoring a [`Checkpoint`]).
    pub fn restore(&self, state: Holds) {
        let mut holds = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        *holds = state;
        self.any_held
            .store(!holds.none_held(), std::sync::atomic::Ordering::Release);
    }

    /// A copy of the state.
    pub fn snapshot(&self) -> Holds {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The follower read the stream as far as it went when following began.
    pub fn set_caught_up(&self, caught_up: bool) {
        self.caught_up.store(caught_up, std::sync::atomic::Ordering::Release);
    }

    /// See [`SharedHolds::set_caught_up`].
    pub fn caught_up(&self) -> bool {
        self.caught_up.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The automatic hold of one ladder (config `[auto_hold]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AutoHoldPolicy {
    /// The sliding window failures are counted over.
    pub window: Duration,
    /// Deliveries in the window below this never trip.
    pub min_deliveries: u32,
    /// Failures per delivery, in thousandths, at or above which it trips (900 = 90 %).
    pub failure_permille: u32,
    /// While auto-held, one probe this often; a probe with no failure back within this time
    /// resumes the destination. So a recovered destination resumes within two of these.
    pub probe_every: Duration,
}

/// A sliding window of deliveries and failures, in [`WINDOW_BUCKETS`] buckets, each counted
/// at its **verdict time**: a failure when it comes back, a delivery when its failure would
/// have come back. A failure the broker routes into a tier comes back one tier later, so a
/// delivery is counted that much ahead (in a bucket of the future, at most a window ahead), and
/// the ratio compares each delivery with its own outcome, however its failure travels.
#[derive(Debug, Clone, Default)]
pub struct Window {
    /// (bucket number, deliveries, failures), oldest first; at most a window's worth in the
    /// past and a window's worth ahead.
    buckets: VecDeque<(u64, u32, u32)>,
}

impl Window {
    fn bucket_ms(window: Duration) -> u64 {
        (window.as_millis() as u64 / WINDOW_BUCKETS).max(1)
    }

    fn expire(&mut self, window: Duration, now_ms: u64) {
        let n = now_ms / Self::bucket_ms(window);
        while self.buckets.front().is_some_and(|b| b.0 + WINDOW_BUCKETS <= n) {
            self.buckets.pop_front();
        }
    }

    /// Counts deliveries and failures whose verdict is at `at_ms` (from `now_ms` to a window
    /// after it).
    fn add(&mut self, window: Duration, at_ms: u64, now_ms: u64, delivered: u32, failed: u32) {
        self.expire(window, now_ms);
        let n = at_ms / Self::bucket_ms(window);
        let at = self.buckets.partition_point(|b| b.0 < n);
        match self.buckets.get_mut(at) {
            Some(b) if b.0 == n => {
                b.1 = b.1.saturating_add(delivered);
                b.2 = b.2.saturating_add(failed);
            }
            _ => self.buckets.insert(at, (n, delivered, failed)),
        }
    }

    /// Counts a delivery whose verdict is at `at_ms`.
    pub fn delivered(&mut self, window: Duration, at_ms: u64, now_ms: u64) {
        self.add(window, at_ms, now_ms, 1, 0);
    }

    /// Counts a failure whose verdict is at `at_ms`.
    pub fn failed(&mut self, window: Duration, at_ms: u64, now_ms: u64) {
        self.add(window, at_ms, now_ms, 0, 1);
    }

    /// (deliveries, failures) with their verdict within the window ending at `now_ms`.
    pub fn totals(&mut self, window: Duration, now_ms: u64) -> (u64, u64) {
        self.expire(window, now_ms);
        let n = now_ms / Self::bucket_ms(window);
        self.buckets
            .iter()
            .take_while(|b| b.0 <= n)
            .fold((0, 0), |(d, f), b| (d + u64::from(b.1), f + u64::from(b.2)))
    }

    fn clear(&mut self) {
        self.buckets.clear();
    }

    /// Adds `other`'s counts, bucket by bucket, then drops what left the window by `now_ms`.
    fn absorb(&mut self, other: &Window, window: Duration, now_ms: u64) {
        let bucket_ms = Self::bucket_ms(window);
        for &(n, delivered, failed) in &other.buckets {
            self.add(window, n * bucket_ms, 0, delivered, failed);
        }
        self.expire(window, now_ms);
    }
}

#[derive(Debug, Clone)]
struct Watch {
    window: Window,
    /// Held (by anyone) at the last poll.
    held: bool,
    /// Every failure that came back, for a release's ramp ([`Breaker::failures`]).
    failures: u64,
    seen_ms: u64,
    /// Messages this replica put into a tier for it that are not due yet.
    waiting: DueCounts,
}

/// One destination as [`Breaker::busiest`] sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Busy {
    /// The destination queue (or exchange).
    pub destination: String,
    /// Deliveries in the window.
    pub delivered: u64,
    /// Failures (messages back at the intake) in the window.
    pub failed: u64,
    /// Messages put into a tier for it, not due yet ([`DueCounts`]).
    pub waiting: u64,
}

/// What the breaker wants done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BreakerAction {
    /// Hold it (record by [`AUTO`], with this reason and first wait before a probe).
    Hold {
        /// The destination.
        destination: String,
        /// Why, for the record.
        why: String,
    },
}

/// The tripping half of the automatic hold, as one replica sees it: every destination's window
/// of deliveries (the due hop) and failures (the intake: messages back for the destination).
/// What happens once held — probes, their failures, the resume — is the same on every replica:
/// it is read from the stream ([`DestinationHold::probe_step`]), never counted here.
#[derive(Debug, Clone)]
pub struct Breaker {
    policy: AutoHoldPolicy,
    /// Keyed with foldhash: looked up on every delivery and retry.
    watched: HashMap<String, Watch, foldhash::fast::RandomState>,
}

impl Breaker {
    /// A breaker with `policy`.
    pub fn new(policy: AutoHoldPolicy) -> Self {
        Breaker {
            policy,
            watched: HashMap::default(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &AutoHoldPolicy {
        &self.policy
    }

    fn watch(&mut self, destination: &str, now_ms: u64) -> &mut Watch {
        // the hot path: a destination seen before costs no allocation
        if self.watched.contains_key(destination) {
            let w = self.watched.get_mut(destination).expect("just looked");
            w.seen_ms = now_ms;
            return w;
        }
        if self.watched.len() >= MAX_WATCHED {
            // the stalest, among those not held and with nothing waiting if there are any
            let stalest = self
                .watched
                .iter()
                .filter(|(_, w)| !w.held)
                .min_by_key(|(_, w)| (w.waiting.any_after(now_ms), w.seen_ms))
                .map(|(d, _)| d.clone());
            if let Some(stalest) = stalest {
                self.watched.remove(&stalest);
            }
        }
        let w = self.watched.entry(destination.to_string()).or_insert_with(|| Watch {
            window: Window::default(),
            held: false,
            failures: 0,
            seen_ms: now_ms,
            waiting: DueCounts::default(),
        });
        w.seen_ms = now_ms;
        w
    }

    /// The due hop delivered a message to `destination`, whose failure would come back
    /// `lag_ms` later (see [`Window`]). One whose failure would come back after more than the
    /// window is not counted, nor is that failure: the breaker judges only what it can see
    /// within its window.
    pub fn delivered(&mut self, destination: &str, lag_ms: u64, now_ms: u64) {
        let window = self.policy.window;
        if lag_ms <= duration_ms(window) {
            let at_ms = now_ms.saturating_add(lag_ms);
            self.watch(destination, now_ms).window.delivered(window, at_ms, now_ms);
        }
    }

    /// A message for `destination`, due at `due_ms`, went into a tier (a retry, a scheduled
    /// delivery or a deferral; not the hops of one wait through the delay levels).
    pub fn scheduled(&mut self, destination: &str, due_ms: u64, now_ms: u64) {
        self.watch(destination, now_ms).waiting.entered(due_ms, now_ms);
    }

    /// A message delivered to `destination` at `delivered_ms` (0: not known) came back failed.
    /// `lag_ms` is what [`Breaker::delivered`] was told: the failure counts beside its delivery,
    /// at `delivered_ms + lag_ms`, or now if that is past. (A consumer that sends its failure
    /// back itself is faster than the tier the broker would have routed it into.)
    pub fn failed(&mut self, destination: &str, lag_ms: u64, delivered_ms: u64, now_ms: u64) {
        let window = self.policy.window;
        let window_ms = duration_ms(window);
        let w = self.watch(destination, now_ms);
        w.failures = w.failures.saturating_add(1);
        if lag_ms <= window_ms {
            let at_ms = delivered_ms
                .saturating_add(lag_ms)
                .clamp(now_ms, now_ms.saturating_add(window_ms));
            w.window.failed(window, at_ms, now_ms);
        }
    }

    /// The failures of `destination` that came back so far (0 if it is not watched).
    pub fn failures(&self, destination: &str) -> u64 {
        self.watched.get(destination).map_or(0, |w| w.failures)
    }

    /// Adds the deliveries and failures `shard` counted since it was last absorbed, and empties
    /// it. A shard is a breaker one hop counts into, so that two hops on two threads do not
    /// share a lock per message. What it counted as waiting is not carried (count that here). Before [`Breaker::poll`] and
    /// [`Breaker::busiest`]: they then see every count, as if made here.
    pub fn absorb(&mut self, shard: &mut Breaker, now_ms: u64) {
        let window = self.policy.window;
        for (destination, counted) in shard.watched.drain() {
            let seen_ms = self
                .watched
                .get(&destination)
                .map_or(0, |w| w.seen_ms)
                .max(counted.seen_ms);
            let w = self.watch(&destination, seen_ms);
            w.window.absorb(&counted.window, window, now_ms);
        }
    }

    /// What to do at `now_ms`. `held` says whether a destination is held (or releasing) now,
    /// by anyone (from the stream): a held destination is not counted.
    pub fn poll(&mut self, now_ms: u64, held: impl Fn(&str) -> bool) -> Vec<BreakerAction> {
        let policy = self.policy;
        let mut actions = Vec::new();
        for (destination, w) in &mut self.watched {
            if held(destination) {
                w.held = true;
                w.window.clear();
                continue;
            }
            if w.held {
                w.held = false;
                w.window.clear();
            }
            let (delivered, failed) = w.window.totals(policy.window, now_ms);
            if delivered >= u64::from(policy.min_deliveries)
                && delivered > 0
                && failed * 1000 >= u64::from(policy.failure_permille) * delivered
            {
                // until the stream says it is held: counting starts over when it is resumed
                w.held = true;
                w.window.clear();
                actions.push(BreakerAction::Hold {
                    destination: destination.clone(),
                    why: format!(
                        "{failed} of {delivered} deliveries failed within {}",
                        humantime::format_duration(policy.window)
                    ),
                });
            }
        }
        actions
    }

    /// Destinations watched, with deliveries and failures in the window and messages waiting,
    /// busiest first (deliveries and failures, then waiting), at most `limit`.
    pub fn busiest(&mut self, now_ms: u64, limit: usize) -> Vec<Busy> {
        let window = self.policy.window;
        let mut all: Vec<Busy> = self
            .watched
            .iter_mut()
            .map(|(d, w)| {
                let (delivered, failed) = w.window.totals(window, now_ms);
                Busy {
                    destination: d.clone(),
                    delivered,
                    failed,
                    waiting: w.waiting.waiting(now_ms),
                }
            })
            .filter(|b| b.delivered + b.failed + b.waiting > 0)
            .collect();
        all.sort_by(|a, b| {
            (b.delivered + b.failed, b.waiting)
                .cmp(&(a.delivered + a.failed, a.waiting))
                .then_with(|| a.destination.cmp(&b.destination))
        });
        all.truncate(limit);
        all
    }
}

fn duration_ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate() -> Rate {
        "10/s".parse().unwrap()
    }

    impl HoldRecord {
        fn with_of(mut self, of: u64) -> Self {
            self.of = Some(of);
            self
        }
    }

    fn record(dest: &str, action: HoldAction, at: u64) -> HoldRecord {
        HoldRecord::new(dest, action, "alice", "down", at)
    }

    /// A stream with every kind of transition: holds, a stale release, an automatic hold with a
    /// probe that failed and one that came through, a repeat hold, resumes and releases.
    fn history() -> Vec<HoldRecord> {
        let r = |dest: &str, action, at, of: Option<u64>| {
            let mut record = HoldRecord::new(dest, action, "alice", "down", at);
            record.of = of;
            record
        };
        let mut auto = HoldRecord::new("billing", HoldAction::Held, AUTO, "failing", 12);
        auto.hold_ms = Some(100);
        let mut slow = r("orders", HoldAction::Resumed, 20, None);
        slow.rate = Some("3/m".into());
        vec![
            r("orders", HoldAction::Held, 10, None),
            auto,
            r("orders", HoldAction::Held, 15, None),
            slow,
            r("orders", HoldAction::Released, 21, Some(5)),
            HoldRecord::new("billing", HoldAction::Probed, "replica-a", "", 113).with_of(12),
            HoldRecord::new("billing", HoldAction::Probed, "replica-b", "", 114).with_of(12),
            HoldRecord::new("billing", HoldAction::ProbeFailed, "replica-b", "", 130).with_of(113),
            r("orders", HoldAction::Released, 31, Some(20)),
            r("orders", HoldAction::Held, 40, None),
            HoldRecord::new("billing", HoldAction::Probed, "replica-b", "", 340).with_of(12),
            r("stock", HoldAction::Held, 50, None),
            r("stock", HoldAction::Resumed, 500, None),
        ]
    }

    fn fold(records: &[HoldRecord]) -> Holds {
        let mut holds = Holds::default();
        for r in records {
            holds.apply(r, rate());
        }
        holds
    }

    fn same(a: &Holds, b: &Holds) -> bool {
        a.all().eq(b.all()) && a.recent().eq(b.recent())
    }

    #[test]
    fn a_follower_from_any_cut_that_a_checkpoint_covers_rebuilds_the_whole_streams_state() {
        let records = history();
        let whole = fold(&records);
        let billing = whole.get("billing").and_then(|h| h.probing.clone()).expect("auto-held");
        assert_eq!((billing.failures, billing.probe), (1, Some((340, "replica-b".into()))));
        assert!(matches!(
            whole.get("stock").unwrap().state,
            HoldState::Releasing { since_ms: 500, .. }
        ));
        assert_eq!(whole.get("orders").unwrap().held_since_ms, 40);
        enum Entry {
            Record(HoldRecord),
            Checkpoint(Checkpoint),
            Marker,
        }
        // a checkpoint after every record k (and a marker before it, as followers append them)
        for k in 1..records.len() {
            let mut stream: Vec<Entry> = records[..k].iter().cloned().map(Entry::Record).collect();
            stream.push(Entry::Marker);
            let upto = stream.len() as u64 - 1;
            let checkpoint = fold(&records[..k]).checkpoint(upto, 99);
            let checkpoint = Checkpoint::from_slice(&checkpoint.to_json()).expect("reads back");
            stream.push(Entry::Checkpoint(checkpoint));
            stream.extend(records[k..].iter().cloned().map(Entry::Record));
            // retention cut the stream anywhere up to just after what the checkpoint covers
            for cut in 0..=upto as usize + 1 {
                let (shared, mut catchup) = (SharedHolds::default(), Catchup::default());
                for (offset, entry) in stream.iter().enumerate().skip(cut) {
                    let offset = offset as u64;
                    let fold = match entry {
                        Entry::Record(r) => catchup.record(offset, r.clone()),
                        Entry::Checkpoint(c) => catchup.checkpoint(offset, c, rate()),
                        Entry::Marker => {
                            catchup.other(offset);
                            continue;
                        }
                    };
                    match fold {
                        Fold::Apply(records) => records.iter().for_each(|r| {
                            shared.apply(r, rate());
                        }),
                        Fold::Restore(state, records) => {
                            shared.restore(state);
                            records.iter().for_each(|r| {
                                shared.apply(r, rate());
                            });
                        }
                    }
                }
                assert!(!catchup.uncovered(), "k={k} cut={cut}");
                let got = shared.snapshot();
                assert!(same(&got, &whole), "k={k} cut={cut}:\n{got:#?}\nwant\n{whole:#?}");
                assert_eq!(shared.holds_back("orders"), whole.holds_back("orders"));
            }
            // a cut past what the checkpoint covers is not covered
            let mut catchup = Catchup::default();
            catchup.other(upto + 2);
            let c = match &stream[upto as usize + 1] {
                Entry::Checkpoint(c) => c.clone(),
                _ => unreachable!(),
            };
            assert!(matches!(catchup.checkpoint(upto + 3, &c, rate()), Fold::Apply(v) if v.is_empty()));
            assert!(catchup.uncovered());
        }
    }

    #[test]
    fn a_hold_is_released_only_by_the_end_of_its_own_release() {
        let mut holds = Holds::default();
        assert!(!holds.holds_back("orders"));
        assert!(holds.apply(&record("orders", HoldAction::Held, 10), rate()));
        assert!(holds.holds_back("orders") && !holds.holds_back("billing"));
        assert!(
            !holds.apply(&record("orders", HoldAction::Held, 11), rate()),
            "a repeat changes nothing"
        );
        let mut resume = record("orders", HoldAction::Resumed, 20);
        resume.rate = Some("3/s".into());
        assert!(holds.apply(&resume, rate()));
        let h = holds.get("orders").unwrap();
        assert_eq!(
            h.state,
            HoldState::Releasing {
                rate: "3/s".parse().unwrap(),
                since_ms: 20
            }
        );
        assert_eq!(h.held_since_ms, 10);
        assert!(holds.holds_back("orders"), "new messages queue behind the release");
        // a stale end (of another release) is ignored
        let mut stale = record("orders", HoldAction::Released, 30);
        stale.of = Some(5);
        assert!(!holds.apply(&stale, rate()));
        let mut end = record("orders", HoldAction::Released, 31);
        end.of = Some(20);
        assert!(holds.apply(&end, rate()));
        assert!(!holds.holds_back("orders") && holds.none_held());
        assert_eq!(holds.get("orders").unwrap().state, HoldState::Free);
        // a resume of what is not held does nothing
        assert!(!holds.apply(&record("billing", HoldAction::Resumed, 40), rate()));
        // held again during a release: the release's end no longer frees it
        holds.apply(&record("x", HoldAction::Held, 50), rate());
        holds.apply(&record("x", HoldAction::Resumed, 60), rate());
        holds.apply(&record("x", HoldAction::Held, 70), rate());
        let mut late = record("x", HoldAction::Released, 80);
        late.of = Some(60);
        assert!(!holds.apply(&late, rate()));
        assert_eq!(holds.get("x").unwrap().state, HoldState::Held);
        assert_eq!(holds.held_count(), 1);
        // the transitions that changed something, newest first
        let recent: Vec<_> = holds
            .recent()
            .map(|r| (r.destination.as_str(), r.action, r.at_ms))
            .collect();
        assert_eq!(recent[0], ("x", HoldAction::Held, 70));
        assert_eq!(recent.len(), 6, "{recent:?}");
    }

    #[test]
    fn records_round_trip_and_odd_ones_are_refused() {
        let mut r = record("orders", HoldAction::Resumed, 42);
        r.rate = Some("5/s".into());
        assert_eq!(HoldRecord::from_slice(&r.to_json()), Some(r.clone()));
        assert_eq!(r.release_rate(), Some("5/s".parse().unwrap()));
        assert_eq!(HoldRecord::from_slice(b"{}"), None);
        assert_eq!(HoldRecord::from_slice(br#"{"format":"ladder.marker/v1"}"#), None);
        let long = HoldRecord::new("q", HoldAction::Held, "a", &"é".repeat(600), 1);
        assert!(long.why.len() <= MAX_WHY_BYTES);
        // the default rate covers a resume without one (or with a bad one)
        let mut holds = Holds::default();
        holds.apply(&record("q", HoldAction::Held, 1), rate());
        let mut bad = record("q", HoldAction::Resumed, 2);
        bad.rate = Some("fast".into());
        holds.apply(&bad, rate());
        assert_eq!(
            holds.get("q").unwrap().state,
            HoldState::Releasing {
                rate: rate(),
                since_ms: 2
            }
        );
    }

    #[test]
    fn the_hold_state_stays_bounded_dropping_free_destinations_first() {
        let mut holds = Holds::default();
        for i in 0..MAX_HOLDS as u64 + 5 {
            let d = format!("q{i}");
            holds.apply(&record(&d, HoldAction::Held, i), rate());
            holds.apply(&record(&d, HoldAction::Resumed, i), rate());
            let mut end = record(&d, HoldAction::Released, i);
            end.of = Some(i);
            holds.apply(&end, rate());
        }
        holds.apply(&record("kept", HoldAction::Held, 9_999), rate());
        assert!(holds.all().count() <= MAX_HOLDS);
        assert!(holds.holds_back("kept"));
    }

    fn policy() -> AutoHoldPolicy {
        AutoHoldPolicy {
            window: Duration::from_secs(60),
            min_deliveries: 50,
            failure_permille: 900,
            probe_every: Duration::from_secs(10),
        }
    }

    #[test]
    fn the_window_slides_by_buckets() {
        let w60 = Duration::from_secs(60);
        let mut w = Window::default();
        w.delivered(w60, 0, 0);
        w.failed(w60, 5_999, 5_999);
        w.delivered(w60, 30_000, 30_000);
        assert_eq!(w.totals(w60, 30_000), (2, 1));
        // the first bucket (0..6 s) leaves the window 60 s after it began
        assert_eq!(w.totals(w60, 59_999), (2, 1));
        assert_eq!(w.totals(w60, 60_000), (1, 0));
        assert_eq!(w.totals(w60, 90_000), (0, 0));
    }

    /// A delivery counts when its failure would come back: not before, and then beside it.
    #[test]
    fn a_delivery_counts_at_its_verdict_time() {
        let w60 = Duration::from_secs(60);
        let mut w = Window::default();
        w.delivered(w60, 30_000, 0);
        assert_eq!(w.totals(w60, 29_999), (0, 0), "no verdict yet");
        w.failed(w60, 30_000, 30_000);
        assert_eq!(w.totals(w60, 30_000), (1, 1));
        assert_eq!(w.totals(w60, 90_000), (0, 0));
    }

    #[test]
    fn the_breaker_trips_at_the_threshold_and_not_below() {
        let free = |_: &str| false;
        let mut b = Breaker::new(policy());
        // 49 deliveries all failing: too few to judge
        for i in 0..49 {
            b.delivered("orders", 0, i);
            b.failed("orders", 0, 0, i);
        }
        assert!(b.poll(100, free).is_empty());
        // 50 with 44 failures (88 %): below 90 %
        let mut c = Breaker::new(policy());
        for i in 0..50 {
            c.delivered("orders", 0, i);
            if i < 44 {
                c.failed("orders", 0, 0, i);
            }
        }
        assert!(c.poll(100, free).is_empty());
        c.failed("orders", 0, 0, 100); // 45 of 50 = 90 %
        let actions = c.poll(101, free);
        assert!(
            matches!(&actions[..], [BreakerAction::Hold { destination, why }] if destination == "orders" && why.contains("45 of 50")),
            "{actions:?}"
        );
        // a healthy neighbour is not touched
        for i in 0..100 {
            c.delivered("billing", 0, i);
        }
        assert!(c.poll(102, |d| d == "orders").is_empty());
    }

    /// Deliveries counted in a shard (the due hop's) and absorbed before a poll trip the
    /// breaker exactly as when counted in it, bucket by bucket; the shard is emptied.
    #[test]
    fn deliveries_counted_in_a_shard_count_as_if_counted_in_the_breaker() {
        let mut whole = Breaker::new(policy());
        let (mut main, mut shard) = (Breaker::new(policy()), Breaker::new(policy()));
        // 100 deliveries and 90 failures of orders over 90 s (the window is 60 s), billing healthy
        for i in 0..100u64 {
            let at = i * 900;
            for b in [&mut whole, &mut shard] {
                b.delivered("orders", 0, at);
                b.delivered("billing", 0, at);
            }
            if i % 10 != 0 {
                whole.failed("orders", 0, 0, at);
                main.failed("orders", 0, 0, at);
            }
            if i == 50 {
                // absorbed midway too, as the releaser does every tick
                main.absorb(&mut shard, at);
                assert!(shard.watched.is_empty());
            }
        }
        let now = 90_000;
        main.absorb(&mut shard, now);
        assert!(shard.watched.is_empty(), "emptied");
        assert_eq!(main.busiest(now, 10), whole.busiest(now, 10));
        let (trip_whole, trip_main) = (whole.poll(now, |_| false), main.poll(now, |_| false));
        assert_eq!(trip_main, trip_whole);
        assert!(
            matches!(&trip_main[..], [BreakerAction::Hold { destination, .. }] if destination == "orders"),
            "{trip_main:?}"
        );
    }

    fn auto_hold(at: u64, hold_ms: u64) -> HoldRecord {
        let mut r = HoldRecord::new("orders", HoldAction::Held, AUTO, "failing", at);
        r.hold_ms = Some(hold_ms);
        r
    }

    fn probe_record(action: HoldAction, by: &str, at: u64, of: u64) -> HoldRecord {
        let mut r = HoldRecord::new("orders", action, by, "", at);
        r.of = Some(of);
        r
    }

    #[test]
    fn half_open_is_read_from_the_stream_one_probe_at_a_time() {
        let every = Duration::from_secs(10);
        let mut holds = Holds::default();
        holds.apply(&auto_hold(1_000, 60_000), rate());
        let step = |h: &Holds, now| h.get("orders").unwrap().probe_step(now, every);
        assert_eq!(step(&holds, 60_999), ProbeStep::Wait, "held for its minimum first");
        assert_eq!(
            step(&holds, 61_000),
            ProbeStep::Probe {
                of: 1_000,
                overdue: false
            }
        );
        // two probers race: the first record wins, the second is ignored
        assert!(holds.apply(&probe_record(HoldAction::Probed, "a", 61_000, 1_000), rate()));
        assert!(!holds.apply(&probe_record(HoldAction::Probed, "b", 61_001, 1_000), rate()));
        // a probe of an earlier hold changes nothing
        assert!(!holds.apply(&probe_record(HoldAction::ProbeFailed, "x", 61_500, 999), rate()));
        assert_eq!(step(&holds, 70_999), ProbeStep::Wait);
        // it fails (seen by any replica): held again for as long, however many failed before
        assert!(holds.apply(&probe_record(HoldAction::ProbeFailed, "b", 62_000, 61_000), rate()));
        assert!(
            !holds.apply(&probe_record(HoldAction::ProbeFailed, "a", 62_001, 61_000), rate()),
            "once"
        );
        assert_eq!(step(&holds, 62_000 + 59_999), ProbeStep::Wait);
        assert!(matches!(step(&holds, 122_000), ProbeStep::Probe { .. }));
        assert!(matches!(step(&holds, 132_000), ProbeStep::Probe { overdue: true, .. }));
        holds.apply(&probe_record(HoldAction::Probed, "b", 122_000, 1_000), rate());
        // no failure back within a probe period: resume, by the prober (anyone, later)
        assert_eq!(step(&holds, 131_999), ProbeStep::Wait);
        assert_eq!(
            step(&holds, 132_000),
            ProbeStep::Resume {
                prober: "b".into(),
                overdue: false
            }
        );
        assert!(matches!(step(&holds, 142_000), ProbeStep::Resume { overdue: true, .. }));
        let mut resume = HoldRecord::new("orders", HoldAction::Resumed, AUTO, "", 132_000);
        resume.rate = Some("10/s".into());
        holds.apply(&resume, rate());
        assert_eq!(step(&holds, 300_000), ProbeStep::Wait, "released: nothing to probe");
    }

    /// Destination `orders` fails `failing` of every 1 000 of its deliveries from 0 ms on,
    /// under the defaults and a ladder of 1 s, 5 s and 30 s: each second 200 messages come due
    /// for their first retry, and each retry that fails is delivered again one step later. A
    /// failure comes back at once (`explicit`: to the intake) or one step later (dead-letter
    /// mode: the broker routes it into the next tier). Returns when the breaker tripped, if it
    /// did within `until_ms`.
    fn outage(failing: u64, explicit: bool, until_ms: u64) -> Option<u64> {
        let steps = [1_000u64, 5_000, 30_000];
        let mut b = Breaker::new(AutoHoldPolicy {
            probe_every: Duration::from_secs(4),
            ..policy()
        });
        // (due at, retry number, message number)
        let mut due: VecDeque<(u64, usize, u64)> = VecDeque::new();
        let mut back: Vec<(u64, u64, u64)> = vec![]; // (comes back at, lag, delivered at)
        for (n, now) in (0..until_ms).step_by(5).enumerate() {
            // one message every 5 ms comes due for its first retry
            due.push_back((now, 1, n as u64));
            while let Some(&(_, retry, id)) = due.front().filter(|d| d.0 <= now) {
                due.pop_front();
                // the step its failure waits in next; after the last, the intake
                let lag = steps.get(retry).copied().unwrap_or(0);
                b.delivered("orders", lag, now);
                // each delivery fails or not on its own
                if (id * 7_919 + retry as u64 * 104_729) % 1_000 < failing {
                    let at = if explicit { now } else { now + lag };
                    back.push((at, lag, now));
                    if retry < steps.len() {
                        let pos = due.partition_point(|d| d.0 <= now + lag);
                        due.insert(pos, (now + lag, retry + 1, id));
                    }
                }
            }
            back.retain(|&(at, lag, delivered)| {
                if at <= now {
                    b.failed("orders", lag, delivered, now);
                }
                at > now
            });
            if now % 200 == 0 && !b.poll(now, |_| false).is_empty() {
                return Some(now);
            }
        }
        None
    }

    #[test]
    fn a_total_outage_trips_within_the_window_however_failures_come_back() {
        for explicit in [true, false] {
            let tripped = outage(1_000, explicit, 120_000);
            assert!(
                tripped.is_some_and(|at| at < 60_000),
                "explicit {explicit}: tripped at {tripped:?}"
            );
        }
    }

    #[test]
    fn a_destination_failing_below_the_ratio_never_trips() {
        for explicit in [true, false] {
            for failing in [560, 850] {
                assert_eq!(
                    outage(failing, explicit, 300_000),
                    None,
                    "explicit {explicit}, {failing}‰"
                );
            }
        }
    }

    #[test]
    fn an_operator_hold_is_never_probed_or_resumed_automatically() {
        let mut b = Breaker::new(policy());
        for i in 0..60 {
            b.delivered("orders", 0, i);
            b.failed("orders", 0, 0, i);
        }
        assert!(b.poll(100, |_| true).is_empty());
        assert!(b.poll(1_000_000, |_| true).is_empty());
        // an operator's hold has no half-open state
        let mut holds = Holds::default();
        holds.apply(&HoldRecord::new("orders", HoldAction::Held, "alice", "", 0), rate());
        assert_eq!(
            holds
                .get("orders")
                .unwrap()
                .probe_step(10_000_000, Duration::from_secs(1)),
            ProbeStep::Wait
        );
    }
}
