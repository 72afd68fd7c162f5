//! The due hop's bound on deliveries in flight to one destination queue.
//!
//! At most `limit` publishes to one destination wait for their confirms at a time. A delivery
//! for a destination at its bound waits for a slot, for at most [`BUSY_WAIT`] and beside at
//! most `waiting` others, while the destination is moving (it freed a slot within the last
//! [`BUSY_WAIT`]). Otherwise it is deferred: put back into a tier. So a healthy queue that is
//! merely busy is not sent round a tier, which costs a publish, a second pass and a tier's
//! delay. And a queue that stops confirming keeps at most `limit` of the prefetch.
//!
//! It only counts; it publishes and decides nothing. It sits on every due delivery's path, so a
//! destination below its bound costs one map lookup to enter and one to leave, and no
//! allocation: an idle destination's entry is kept, up to [`KEEP_IDLE`] of them.
//!
//! A waiting delivery has no timer of its own, since a timer per delivery was a cost on every
//! one. One task per gate, the sweeper, runs only while some delivery waits: every
//! [`SWEEP_EVERY`] it wakes the waiting ones, and those whose wait is over give up. So a wait
//! ends within [`SWEEP_EVERY`] after its [`BUSY_WAIT`].

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tracing::{debug, warn};

/// How long a delivery for a destination at its bound may wait for a slot, and how recently
/// the destination must have freed one for a delivery to wait at all. It is longer than a busy
/// broker's occasional stalls, so that a burst costs lateness, not a round trip through a tier,
/// and short enough that a queue that stopped confirming gives its slots back within a second.
pub(crate) const BUSY_WAIT: Duration = Duration::from_secs(1);

/// How often the sweeper wakes the waiting deliveries, while there are any, to end the waits
/// that are over: the most a wait can outlast the gate's `wait`.
pub(crate) const SWEEP_EVERY: Duration = Duration::from_millis(250);

/// Idle destinations (nothing in flight, none waiting) whose entries are kept, so that the next
/// delivery to one allocates nothing; beyond this many, an entry is removed once idle.
const KEEP_IDLE: usize = 256;

/// A destination's first refusal after this long without one is logged at WARN; the others at
/// DEBUG (the metric counts them all), so a full queue does not flood the log.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);

/// Bounds the due hop's deliveries in flight per destination queue.
#[derive(Debug)]
pub(crate) struct DestinationGate {
    limit: usize,
    waiting: usize,
    wait: Duration,
    state: Arc<Mutex<GateState>>,
    /// Told when a delivery begins to wait while the sweeper is idle.
    sweep: Arc<Notify>,
    /// The sweeper; it ends with the gate.
    _sweeper: tokio_util::task::AbortOnDropHandle<()>,
}

#[derive(Debug, Default)]
struct GateState {
    /// Destinations with a delivery in flight or waiting, and up to [`KEEP_IDLE`] idle ones.
    slots: HashMap<Arc<str>, Slots, foldhash::fast::RandomState>,
    last_refusal: HashMap<String, Instant, foldhash::fast::RandomState>,
    /// The sweeper is running (or told to): some delivery waits, or did at its last sweep.
    sweeping: bool,
}

/// One destination's count, beside its name (the map's key, shared with the permits).
#[derive(Debug)]
struct Slots {
    destination: Arc<str>,
    taken: usize,
    waiting: usize,
    /// When the destination last reached its bound or freed a slot at it: a delivery waits
    /// only for a destination that did within the last [`BUSY_WAIT`].
    moved: tokio::time::Instant,
    freed: Arc<Notify>,
}

/// One delivery's slot for its destination, given back when dropped.
#[derive(Debug)]
pub(crate) struct GatePermit {
    destination: Arc<str>,
    limit: usize,
    state: Arc<Mutex<GateState>>,
}

impl Drop for GatePermit {
    fn drop(&mut self) {
        let mut state = lock(&self.state);
        let crowded = state.slots.len() > KEEP_IDLE;
        let Some(slots) = state.slots.get_mut(&*self.destination) else {
            return;
        };
        if slots.taken == self.limit {
            slots.moved = tokio::time::Instant::now();
        }
        slots.taken -= 1;
        if slots.waiting > 0 {
            slots.freed.notify_one();
        } else if slots.taken == 0 && crowded {
            state.slots.remove(&*self.destination);
        }
    }
}

fn lock(state: &Mutex<GateState>) -> MutexGuard<'_, GateState> {
    state.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DestinationGate {
    /// A gate of `limit` slots per destination (at least 1), with up to `waiting` deliveries
    /// per destination waiting up to `wait` for one (and up to [`SWEEP_EVERY`] more). Spawns
    /// its sweeper: call within a tokio runtime.
    pub(crate) fn new(limit: usize, waiting: usize, wait: Duration) -> Self {
        let state: Arc<Mutex<GateState>> = Arc::default();
        let sweep = Arc::new(Notify::new());
        let sweeper = tokio::spawn(sweeper(state.clone(), sweep.clone()));
        DestinationGate {
            limit: limit.max(1),
            waiting,
            wait,
            state,
            sweep,
            _sweeper: tokio_util::task::AbortOnDropHandle::new(sweeper),
        }
    }

    /// A slot for `destination`, at once or after a wait; `None` when it has its bound in
    /// flight and cannot wait (it is not moving, or enough wait already) or no slot freed in time.
    pub(crate) async fn enter(&self, destination: &str) -> Option<GatePermit> {
        let (name, freed) = {
            let mut state = lock(&self.state);
            let Some(slots) = state.slots.get_mut(destination) else {
                let name: Arc<str> = Arc::from(destination);
                let slots = Slots {
                    destination: name.clone(),
                    taken: 1,
                    waiting: 0,
                    moved: tokio::time::Instant::now(),
                    freed: Arc::default(),
                };
                state.slots.insert(name.clone(), slots);
                return Some(self.permit(name));
            };
            if slots.taken < self.limit {
                slots.taken += 1;
                if slots.taken == self.limit {
                    slots.moved = tokio::time::Instant::now();
                }
                return Some(self.permit(slots.destination.clone()));
            }
            if slots.waiting >= self.waiting || slots.moved.elapsed() >= self.wait {
                return None;
            }
            slots.waiting += 1;
            let waiting = (slots.destination.clone(), slots.freed.clone());
            if !state.sweeping {
                state.sweeping = true;
                self.sweep.notify_one();
            }
            waiting
        };
        // counted as waiting from here on: the guard uncounts it however the wait ends
        let waiting = Waiting { gate: self, name };
        // boxed: waiting is rare, and its state would make every delivery's future larger
        Box::pin(self.wait_for(waiting, freed)).await
    }

    /// Waits for a slot of the destination `waiting` counts the delivery as waiting for, until
    /// a sweep finds its wait over.
    async fn wait_for(&self, waiting: Waiting<'_>, freed: Arc<Notify>) -> Option<GatePermit> {
        let deadline = tokio::time::Instant::now() + self.wait;
        loop {
            // made before the check, so a slot freed in between still wakes it
            let notified = freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(permit) = waiting.take() {
                return Some(permit);
            }
            // woken by a freed slot, or by the sweeper
            notified.await;
            if tokio::time::Instant::now() >= deadline {
                // a last look: a slot may have freed just as the wait ran out
                return waiting.take();
            }
        }
    }

    fn permit(&self, destination: Arc<str>) -> GatePermit {
        GatePermit {
            destination,
            limit: self.limit,
            state: self.state.clone(),
        }
    }

    /// Logs a destination's refusal: at WARN the first after [`REFUSAL_LOG_EVERY`], else DEBUG.
    pub(crate) fn log_refusal(&self, ladder: &str, destination: &str, trace_id: impl FnOnce() -> String) {
        let now = Instant::now();
        let loud = {
            let mut state = lock(&self.state);
            // forget quiet destinations, so the map stays as small as the set of refusing ones
            if state.last_refusal.len() > 1024 {
                state
                    .last_refusal
                    .retain(|_, at| now.duration_since(*at) < REFUSAL_LOG_EVERY);
            }
            match state.last_refusal.insert(destination.to_string(), now) {
                Some(before) => now.duration_since(before) >= REFUSAL_LOG_EVERY,
                None => true,
            }
        };
        if loud {
            warn!(%ladder, %destination, trace_id = %trace_id(),
                  "the destination refuses deliveries (full, or unavailable); they wait in a tier again without counting an attempt");
        } else {
            debug!(%ladder, %destination, trace_id = %trace_id(), "the destination refused a delivery; deferred");
        }
    }
}

/// Wakes the deliveries waiting at `state`'s destinations every [`SWEEP_EVERY`] while there are
/// any (each looks at its own deadline); idle until `sweep` is told again once there are none.
async fn sweeper(state: Arc<Mutex<GateState>>, sweep: Arc<Notify>) {
    loop {
        sweep.notified().await;
        loop {
            tokio::time::sleep(SWEEP_EVERY).await;
            let mut state = lock(&state);
            let mut any = false;
            for slots in state.slots.values().filter(|s| s.waiting > 0) {
                slots.freed.notify_waiters();
                any = true;
            }
            if !any {
                // a delivery that waits from now on tells `sweep` again (a stored permit, if
                // this task has not reached its wait yet)
                state.sweeping = false;
                break;
            }
        }
    }
}

/// A delivery waiting for a slot: counted while it waits, also when the wait is cancelled.
struct Waiting<'a> {
    gate: &'a DestinationGate,
    name: Arc<str>,
}

impl Waiting<'_> {
    /// The destination's free slot, if it has one now.
    fn take(&self) -> Option<GatePermit> {
        let mut state = lock(&self.gate.state);
        let slots = state.slots.get_mut(&*self.name)?;
        if slots.taken < self.gate.limit {
            slots.taken += 1;
            if slots.taken == self.gate.limit {
                slots.moved = tokio::time::Instant::now();
            }
            return Some(self.gate.permit(self.name.clone()));
        }
        None
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.gate.state);
        let crowded = state.slots.len() > KEEP_IDLE;
        let Some(slots) = state.slots.get_mut(&*self.name) else {
            return;
        };
        slots.waiting -= 1;
        if slots.taken == 0 && slots.waiting == 0 && crowded {
            state.slots.remove(&*self.name);
        } else if slots.waiting > 0 && slots.taken < self.gate.limit {
            // a wake-up this wait took without using it goes on to the next
            slots.freed.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gate(limit: usize, waiting: usize) -> DestinationGate {
        DestinationGate::new(limit, waiting, Duration::from_secs(1))
    }

    /// Destinations with a delivery in flight or waiting.
    fn tracked(gate: &DestinationGate) -> usize {
        lock(&gate.state)
            .slots
            .values()
            .filter(|s| s.taken > 0 || s.waiting > 0)
            .count()
    }

    #[tokio::test(start_paused = true)]
    async fn idle_destinations_are_kept_up_to_a_bound() {
        let gate = gate(2, 0);
        for i in 0..1_000 {
            let permit = gate.enter(&format!("q{i}")).await.unwrap();
            drop(permit);
        }
        assert_eq!(tracked(&gate), 0);
        let kept = lock(&gate.state).slots.len();
        assert!(kept <= KEEP_IDLE + 1, "{kept} entries kept");
        // a kept idle destination is entered again as a fresh one
        let a = gate.enter("q999").await.unwrap();
        let _b = gate.enter("q999").await.unwrap();
        assert!(gate.enter("q999").await.is_none(), "its bound still holds");
        drop(a);
        assert!(gate.enter("q999").await.is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_bounds_each_destination_alone_and_frees_slots_on_drop() {
        let gate = gate(2, 0);
        let a1 = gate.enter("a").await.unwrap();
        let _a2 = gate.enter("a").await.unwrap();
        assert!(gate.enter("a").await.is_none(), "a third for a, with no room to wait");
        let b = gate.enter("b").await;
        assert!(b.is_some(), "b is not held up by a");
        drop(a1);
        assert!(gate.enter("a").await.is_some());
        drop(b);
        let state = lock(&gate.state);
        let b = state.slots.get("b").expect("an idle destination's entry is kept");
        assert_eq!((b.taken, b.waiting), (0, 0), "b is idle");
    }

    #[tokio::test(start_paused = true)]
    async fn permits_share_the_destination_name_they_count_under() {
        let gate = gate(3, 0);
        let a1 = gate.enter("a").await.unwrap();
        let a2 = gate.enter("a").await.unwrap();
        assert!(
            Arc::ptr_eq(&a1.destination, &a2.destination),
            "one name, not a copy per delivery"
        );
        assert_eq!(lock(&gate.state).slots["a"].taken, 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_destination_hands_its_next_free_slot_to_a_waiting_delivery() {
        let gate = gate(1, 1);
        let first = gate.enter("a").await.unwrap();
        let started = tokio::time::Instant::now();
        let (second, ()) = tokio::join!(gate.enter("a"), async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(first);
        });
        assert!(second.is_some(), "a slot freed within the wait is taken");
        assert_eq!(started.elapsed(), Duration::from_millis(30));
        drop(second);
        assert_eq!(tracked(&gate), 0, "nothing left behind");
    }

    #[tokio::test(start_paused = true)]
    async fn a_destination_that_stops_confirming_defers_after_the_wait_then_at_once() {
        let gate = gate(2, 2);
        let _held = [gate.enter("a").await.unwrap(), gate.enter("a").await.unwrap()];
        let started = tokio::time::Instant::now();
        let (w1, w2, over) = tokio::join!(gate.enter("a"), gate.enter("a"), async {
            // both waits are counted before this one asks
            tokio::task::yield_now().await;
            gate.enter("a").await.is_none()
        });
        assert!(over, "beyond as many waiting, a delivery is deferred at once");
        assert!(w1.is_none() && w2.is_none(), "no slot freed within the wait");
        let waited = started.elapsed();
        assert!(
            (Duration::from_secs(1)..=Duration::from_secs(1) + SWEEP_EVERY).contains(&waited),
            "the waits ended by the sweep after their second: {waited:?}"
        );
        assert_eq!(lock(&gate.state).slots["a"].waiting, 0);
        let before = tokio::time::Instant::now();
        assert!(gate.enter("a").await.is_none(), "not moving: no wait any more");
        assert_eq!(before.elapsed(), Duration::ZERO);
        assert!(gate.enter("b").await.is_some(), "another destination is served");
    }

    #[tokio::test(start_paused = true)]
    async fn the_sweeper_ends_the_waits_of_every_stall_and_rests_between() {
        let gate = gate(1, 3);
        let mut held = gate.enter("a").await.unwrap();
        for round in 0..3 {
            let started = tokio::time::Instant::now();
            let (w1, w2) = tokio::join!(gate.enter("a"), gate.enter("a"));
            let waited = started.elapsed();
            assert!(w1.is_none() && w2.is_none(), "round {round}: nothing freed");
            assert!(
                (Duration::from_secs(1)..=Duration::from_secs(1) + SWEEP_EVERY).contains(&waited),
                "round {round}: the waits ended by a sweep after their second: {waited:?}"
            );
            // the next sweep finds no one waiting, and the sweeper rests
            tokio::time::sleep(SWEEP_EVERY * 2).await;
            assert!(!lock(&gate.state).sweeping, "round {round}: the sweeper rests");
            // the destination moves again: its slot freed and taken
            drop(held);
            held = gate.enter("a").await.unwrap();
        }
        // and a slot that frees while a delivery waits still goes to it at once
        let started = tokio::time::Instant::now();
        let (waited, ()) = tokio::join!(gate.enter("a"), async {
            tokio::time::sleep(Duration::from_millis(30)).await;
            drop(held);
        });
        assert!(waited.is_some());
        assert_eq!(started.elapsed(), Duration::from_millis(30));
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_wait_is_not_counted_and_leaves_nothing_behind() {
        let gate = gate(1, 4);
        let held = gate.enter("a").await.unwrap();
        let cancelled = tokio::time::timeout(Duration::from_millis(10), gate.enter("a")).await;
        assert!(cancelled.is_err());
        assert_eq!(lock(&gate.state).slots["a"].waiting, 0);
        drop(held);
        assert_eq!(tracked(&gate), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn every_waiting_delivery_gets_a_slot_as_they_free() {
        let gate = Arc::new(gate(2, 8));
        let held: Vec<GatePermit> = vec![gate.enter("a").await.unwrap(), gate.enter("a").await.unwrap()];
        let waits: Vec<_> = (0..6)
            .map(|_| {
                let gate = gate.clone();
                tokio::spawn(async move {
                    let permit = gate.enter("a").await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    permit.is_some()
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(1)).await;
        drop(held);
        for w in waits {
            assert!(w.await.unwrap(), "each waiting delivery got a slot");
        }
        assert_eq!(tracked(&gate), 0);
    }
}
