//! Cancelled message ids: what every replica's relay checks before it forwards a waiting
//! message. The set is a cache of the ladder's cancellation stream (`N.L.cancels`), rebuilt by
//! following it, like the parking-lot index; it is bounded in entries and in time.

use std::collections::{HashMap, VecDeque};
use std::sync::{PoisonError, RwLock};

use serde::{Deserialize, Serialize};

use crate::model::ladder::MAX_DELAY;

/// The record format of a cancellation in `N.L.cancels`.
pub const CANCEL_FORMAT: &str = "ladder.cancel/v1";

/// Cancellations kept at most; the oldest go first. A million ids of up to 64 bytes stay under
/// about 150 MB; a typical id (a UUID) takes about 100 bytes with its bookkeeping.
pub const MAX_CANCELLATIONS: usize = 1_000_000;

/// A message id longer than this cannot be cancelled (it could not have been meant).
pub const MAX_CANCEL_ID_BYTES: usize = 255;

/// One cancellation as recorded: which message id, by whom, when; it holds until `until_ms`
/// (nothing waits longer than [`MAX_DELAY`], so a cancellation older than that has nothing left
/// to stop).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cancellation {
    /// [`CANCEL_FORMAT`].
    pub format: String,
    /// The `message_id` to stop.
    pub message_id: String,
    /// Who asked.
    pub by: String,
    /// When, ms since the epoch.
    pub at_ms: u64,
    /// It holds until then.
    pub until_ms: u64,
}

impl Cancellation {
    /// A cancellation of `message_id` by `by` at `at_ms`, holding as long as anything can wait.
    pub fn new(message_id: &str, by: &str, at_ms: u64) -> Result<Self, String> {
        if message_id.is_empty() || message_id.len() > MAX_CANCEL_ID_BYTES {
            return Err(format!("a message id to cancel has 1 to {MAX_CANCEL_ID_BYTES} bytes"));
        }
        Ok(Cancellation {
            format: CANCEL_FORMAT.into(),
            message_id: message_id.into(),
            by: by.into(),
            at_ms,
            until_ms: at_ms.saturating_add(MAX_DELAY.as_millis() as u64),
        })
    }

    /// The record body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A record body back, if it is a cancellation.
    pub fn from_slice(body: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Cancellation>(body)
            .ok()
            .filter(|c| c.format == CANCEL_FORMAT && !c.message_id.is_empty())
    }
}

/// The cancelled ids of one ladder, oldest first, bounded by [`MAX_CANCELLATIONS`].
#[derive(Debug, Default)]
pub struct Cancellations {
    until: HashMap<Vec<u8>, u64>,
    order: VecDeque<(Vec<u8>, u64)>,
}

impl Cancellations {
    /// Adds one (again: the later `until` holds).
    pub fn add(&mut self, c: &Cancellation) {
        let id = c.message_id.as_bytes().to_vec();
        let until = self.until.entry(id.clone()).or_insert(0);
        *until = (*until).max(c.until_ms);
        self.order.push_back((id, c.until_ms));
        while self.order.len() > MAX_CANCELLATIONS {
            self.pop_oldest();
        }
    }

    /// Whether `message_id` is cancelled at `now_ms`.
    pub fn contains(&self, message_id: &[u8], now_ms: u64) -> bool {
        self.until.get(message_id).is_some_and(|until| *until > now_ms)
    }

    /// Drops what no longer holds at `now_ms` (from the oldest on).
    pub fn expire(&mut self, now_ms: u64) {
        while self.order.front().is_some_and(|(_, until)| *until <= now_ms) {
            self.pop_oldest();
        }
    }

    /// Ids held.
    pub fn len(&self) -> usize {
        self.until.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.until.is_empty()
    }

    fn pop_oldest(&mut self) {
        if let Some((id, until)) = self.order.pop_front()
            && self.until.get(&id) == Some(&until)
        {
            self.until.remove(&id);
        }
    }
}

/// [`Cancellations`] shared between the follower that fills it and the relay loops that read
/// it; the lock is never held across an await. `caught_up` says whether the follower has read
/// the stream to where it ended when following began. Until then no due message is delivered,
/// as a cancellation written before a restart could still be unread.
#[derive(Debug, Default)]
pub struct SharedCancellations {
    inner: RwLock<Cancellations>,
    /// How many ids `inner` holds, written under its write lock. Every hop of every message asks
    /// whether there are any, and an atomic load is cheaper than taking the read lock.
    held: std::sync::atomic::AtomicUsize,
    caught_up: std::sync::atomic::AtomicBool,
}

impl SharedCancellations {
    /// Adds one.
    pub fn add(&self, c: &Cancellation) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        inner.add(c);
        self.held.store(inner.len(), std::sync::atomic::Ordering::Release);
    }

    /// Whether `message_id` is cancelled at `now_ms`.
    pub fn contains(&self, message_id: &[u8], now_ms: u64) -> bool {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(message_id, now_ms)
    }

    /// Drops what no longer holds.
    pub fn expire(&self, now_ms: u64) {
        let mut inner = self.inner.write().unwrap_or_else(PoisonError::into_inner);
        inner.expire(now_ms);
        self.held.store(inner.len(), std::sync::atomic::Ordering::Release);
    }

    /// Ids held.
    pub fn len(&self) -> usize {
        self.inner.read().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Whether it is empty (without taking the lock).
    pub fn is_empty(&self) -> bool {
        self.held.load(std::sync::atomic::Ordering::Acquire) == 0
    }

    /// The follower read the stream as far as it went when following began.
    pub fn set_caught_up(&self, caught_up: bool) {
        self.caught_up.store(caught_up, std::sync::atomic::Ordering::Release);
    }

    /// See [`SharedCancellations::set_caught_up`].
    pub fn caught_up(&self) -> bool {
        self.caught_up.load(std::sync::atomic::Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cancellation_holds_until_nothing_can_wait_longer_then_goes() {
        let mut set = Cancellations::default();
        let c = Cancellation::new("order-7", "ops", 1_000).unwrap();
        assert_eq!(c.until_ms, 1_000 + MAX_DELAY.as_millis() as u64);
        set.add(&c);
        assert!(set.contains(b"order-7", 2_000));
        assert!(!set.contains(b"order-8", 2_000));
        set.expire(c.until_ms - 1);
        assert!(set.contains(b"order-7", c.until_ms - 1));
        set.expire(c.until_ms);
        assert!(!set.contains(b"order-7", c.until_ms) && set.is_empty());
        // a repeat keeps the later time
        set.add(&Cancellation::new("x", "a", 10).unwrap());
        set.add(&Cancellation::new("x", "b", 5_000).unwrap());
        set.expire(11 + MAX_DELAY.as_millis() as u64);
        assert!(set.contains(b"x", 11 + MAX_DELAY.as_millis() as u64));
    }

    #[test]
    fn the_shared_set_says_whether_it_holds_any_without_its_lock() {
        let shared = SharedCancellations::default();
        assert!(shared.is_empty());
        let c = Cancellation::new("order-7", "ops", 1_000).unwrap();
        shared.add(&c);
        shared.add(&Cancellation::new("order-8", "ops", 2_000).unwrap());
        assert!(!shared.is_empty() && shared.len() == 2);
        shared.expire(c.until_ms);
        assert!(!shared.is_empty() && shared.len() == 1, "order-8 still holds");
        shared.expire(c.until_ms + 1_000);
        assert!(shared.is_empty());
        assert_eq!(shared.len(), 0, "the count and the set agree");
    }

    #[test]
    fn records_round_trip_and_odd_ones_are_refused() {
        let c = Cancellation::new("id-1", "alice", 42).unwrap();
        assert_eq!(Cancellation::from_slice(&c.to_json()), Some(c));
        assert_eq!(Cancellation::from_slice(b"{}"), None);
        assert_eq!(Cancellation::from_slice(br#"{"format":"ladder.marker/v1"}"#), None);
        assert!(Cancellation::new("", "a", 1).is_err());
        assert!(Cancellation::new(&"x".repeat(256), "a", 1).is_err());
    }
}
