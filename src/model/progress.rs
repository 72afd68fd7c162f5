//! Whether a hop makes progress while work waits for it: the pure half of the session's
//! watchdog (`broker::watchdog`). A hop that has publishes the broker has not confirmed, or
//! ready messages in its queue that it is not given, and whose counters do not move for the
//! stall timeout is stalled: the node it is connected to cannot reach the queues' leaders (a
//! minority node in a partition), or has stopped serving it. An idle hop is never stalled.

/// What the watchdog saw of one hop at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Look {
    /// What the broker answered the hop so far, summed: deliveries settled (their publishes
    /// confirmed), publishes refused or returned. Any change is progress.
    pub activity: u64,
    /// Deliveries taken and not yet settled (their publishes wait for the broker's confirm).
    pub in_flight: u64,
    /// Ready messages in the hop's queue, if read at this look.
    pub ready: Option<u64>,
}

/// One hop's progress across looks.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    activity: Option<u64>,
    /// Since when (ms) work has waited without any progress.
    waiting_since: Option<u64>,
}

impl Progress {
    /// Takes one look at `now_ms`; `Some(ms)` when work has waited for at least `limit_ms`
    /// without progress (how long it has).
    pub fn look(&mut self, now_ms: u64, look: Look, limit_ms: u64) -> Option<u64> {
        let moved = self.activity.is_some_and(|a| a != look.activity);
        self.activity = Some(look.activity);
        let waiting = look.in_flight > 0 || look.ready.unwrap_or(0) > 0;
        if !waiting {
            self.waiting_since = None;
            return None;
        }
        if moved {
            // progress now: work that still waits is timed from here
            self.waiting_since = Some(now_ms);
            return None;
        }
        let since = *self.waiting_since.get_or_insert(now_ms);
        let stalled_for = now_ms.saturating_sub(since);
        (stalled_for >= limit_ms).then_some(stalled_for)
    }

    /// Forgets what it saw (the broker blocks publishers: waiting is expected then).
    pub fn reset(&mut self) {
        *self = Progress::default();
    }

    /// The activity seen at the latest look.
    pub fn last_activity(&self) -> Option<u64> {
        self.activity
    }

    /// Whether work waited without progress at the latest look.
    pub fn is_waiting(&self) -> bool {
        self.waiting_since.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look(activity: u64, in_flight: u64, ready: Option<u64>) -> Look {
        Look {
            activity,
            in_flight,
            ready,
        }
    }

    #[test]
    fn an_idle_hop_is_never_stalled() {
        let mut p = Progress::default();
        for t in 0..100 {
            assert_eq!(p.look(t * 1000, look(7, 0, Some(0)), 3000), None);
        }
        assert!(!p.is_waiting());
    }

    #[test]
    fn unconfirmed_publishes_without_progress_stall_after_the_limit() {
        let mut p = Progress::default();
        assert_eq!(p.look(0, look(10, 5, None), 3000), None);
        assert_eq!(p.look(1000, look(10, 5, None), 3000), None);
        assert_eq!(p.look(3000, look(10, 5, None), 3000), Some(3000));
        assert_eq!(p.look(3500, look(10, 5, None), 3000), Some(3500));
        // a confirm arrives: progress, the clock restarts
        assert_eq!(p.look(4000, look(11, 4, None), 3000), None);
        assert_eq!(p.look(6000, look(11, 4, None), 3000), None);
        assert_eq!(p.look(7000, look(11, 4, None), 3000), Some(3000));
    }

    #[test]
    fn ready_messages_that_are_not_delivered_stall() {
        let mut p = Progress::default();
        assert_eq!(p.look(0, look(3, 0, Some(0)), 3000), None);
        // due messages wait in the queue, none comes
        assert_eq!(p.look(500, look(3, 0, Some(40)), 3000), None);
        assert_eq!(p.look(3000, look(3, 0, Some(80)), 3000), None);
        assert_eq!(p.look(3500, look(3, 0, Some(90)), 3000), Some(3000));
        // the queue empties by another consumer (a replica): idle again
        assert_eq!(p.look(4000, look(3, 0, Some(0)), 3000), None);
        assert!(!p.is_waiting());
    }

    #[test]
    fn a_busy_hop_that_keeps_moving_is_not_stalled() {
        let mut p = Progress::default();
        for t in 0..50 {
            assert_eq!(p.look(t * 500, look(t, 50, Some(100)), 3000), None);
        }
    }

    #[test]
    fn reset_forgets_the_wait() {
        let mut p = Progress::default();
        p.look(0, look(1, 1, None), 3000);
        p.look(2000, look(1, 1, None), 3000);
        p.reset();
        assert_eq!(p.look(4000, look(1, 1, None), 3000), None);
        assert_eq!(p.look(6000, look(1, 1, None), 3000), None);
        assert_eq!(p.look(7000, look(1, 1, None), 3000), Some(3000));
    }
}
