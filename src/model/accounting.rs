//! The accounting identity of one ladder: every message the ladder took in is waiting in it,
//! in flight in the service, or has left it (delivered or parked). Pure: the poller hands in
//! the service's counters and the broker's queue depths; this module decides, and does no I/O.
//!
//! The identity, per ladder:
//!
//! ```text
//! entered = intake deliveries settled (+ failures the due hop takes in past the intake)
//! left    = delivered + parked
//! waiting = ready messages in every tier queue it uses (N.delay.<tier>) + N.L.due + N.L.quarantine
//! balance = entered − left − in_flight(intake, due, quarantine) − waiting
//! ```
//!
//! The tier queues are the namespace's, shared by its ladders, and a shared queue's depth
//! cannot be split by ladder. So with more than one ladder the identity is checked for all of
//! them together ([`Observation::together`]: counters summed, every queue counted once), and
//! each ladder reports that verdict.
//!
//! `balance` stays constant while nothing is lost; a message that vanishes from a tier raises it
//! by one. The service's counters start at 0 in each process, so the check anchors at the first
//! quiet poll and compares later balances with that one (`missing = balance − anchor`).
//!
//! It rests on the relay's settle rule: a delivery stays in flight (a refused publish is held
//! and published again, not requeued) until it is scheduled, delivered or parked, and goes back
//! to its queue only when its channel dies.
//!
//! The system it accounts for starts at the intake hop, not at the tier queues, because the
//! parked counter is not split by hop: a message parked at intake and one parked at due both
//! count as `left`. Intake parks balance out against intake receipts, so this is the
//! tier-system identity (`waiting + in_flight(due) = waiting₀ + scheduled − delivered −
//! parked at due`) with the intake hop folded in.
//!
//! What cannot be exact, and how the check copes:
//! - Counters and depths are not read at one instant, and a message in transit (dead-lettered
//!   from a tier to `N.L.due`, or delivered to the service and not yet handled) is briefly in no
//!   queue. So the check only decides on **quiet** polls — counters unchanged during the poll and
//!   since the previous one, nothing in flight — and flags a discrepancy only when it persists
//!   over `polls` consecutive quiet polls. A busy poll neither counts nor resets the streak: a
//!   ladder that is never quiet is never checked.
//! - A reconnect hands unacked deliveries back to their queues. A delivery enters once its hop
//!   settled it, so one handed back unsettled counts once, when its redelivery is settled. (The
//!   broker's `redelivered` flag cannot tell: RabbitMQ 4.x sets it on a message's first
//!   delivery after dead-lettering.) A due delivery goes back to `N.L.due`, which is waiting.
//!   So the anchor survives reconnects, and a message the broker drops meanwhile shows as
//!   missing. A delivery whose ack was lost comes back as a duplicate: a lasting *surplus*
//!   (more found than counted) becomes the new anchor, so it cannot hide a later loss. Polls
//!   while the service is not ready are skipped, the anchor kept.
//! - A failure the broker routes straight into a wait (by its `retry-next`) enters the ladder
//!   when it comes due, at the due hop. Until then it waits uncounted, a surplus. So a surplus
//!   becomes the new anchor only on a poll that finds nothing waiting, where no uncounted
//!   failure can hide. A duplicate made while messages wait can therefore hide a loss of as
//!   many until the ladder is next empty. A loss is never reported where there is none.
//! - A partition leaves some messages' fate unknown for a while. Deliveries the service held
//!   when its connection died stay checked out to the dead consumer on the queue's leader, in
//!   no ready count. A publish unconfirmed when the connection died may or may not be in its
//!   tier. A delivery settled just before the cut may come back and count as entering again.
//!   So a shortfall first judged after a **disruption** (a lost session, a poll that could not read
//!   the broker, the service not ready) is **in doubt**, not lost: reported as
//!   `InDoubt` (`ladder_in_doubt_messages`, a warning), never as unaccounted. It stays in doubt
//!   until the ladder balances again; a shortfall beyond it, found later, is unaccounted as
//!   before.
//! - The counters are this process's. With several replicas each sees every queue but only its
//!   own traffic, so a poll is `exclusive` only while this process is the only consumer of the
//!   ladder's intake and due queues. Across replicas, sum the counters in Prometheus instead.

use std::collections::VecDeque;

use serde::Serialize;

/// What the service counted for one ladder, read from its metrics at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, utoipa::ToSchema)]
pub struct Counters {
    /// First deliveries from `N.L.intake`: messages that entered the ladder.
    pub entered: u64,
    /// Deliveries taken from `N.L.intake`, redeliveries included.
    pub received_intake: u64,
    /// Publishes (or parks) of intake deliveries the broker refused; each is held and retried.
    pub refused_intake: u64,
    /// Deliveries taken from `N.L.due`, redeliveries included.
    pub received_due: u64,
    /// Publishes (or parks) of due deliveries the broker refused; each is held and retried.
    pub refused_due: u64,
    /// Retries the broker confirmed into a tier.
    pub scheduled: u64,
    /// Retries the broker confirmed to their destination queue.
    pub delivered: u64,
    /// Messages the broker confirmed into the parking lot, from either hop.
    pub parked: u64,
    /// Intake deliveries taken and not yet settled.
    pub in_flight_intake: u64,
    /// Due deliveries taken and not yet settled.
    pub in_flight_due: u64,
    /// Quarantine deliveries taken and not yet parked.
    pub in_flight_quarantine: u64,
}

impl Counters {
    /// `entered − left − in flight − waiting`: constant while no message is lost.
    pub fn balance(&self, waiting: u64) -> i128 {
        let entered = i128::from(self.entered);
        let left = i128::from(self.delivered) + i128::from(self.parked);
        let in_flight =
            i128::from(self.in_flight_intake) + i128::from(self.in_flight_due) + i128::from(self.in_flight_quarantine);
        entered - left - in_flight - i128::from(waiting)
    }

    fn idle(&self) -> bool {
        self.in_flight_intake == 0 && self.in_flight_due == 0 && self.in_flight_quarantine == 0
    }

    /// Both ladders' counts together: the ladders of a namespace share their tiers, so their
    /// identity holds for them together (see [`Observation::together`]).
    pub fn plus(&self, o: &Counters) -> Counters {
        Counters {
            entered: self.entered + o.entered,
            received_intake: self.received_intake + o.received_intake,
            refused_intake: self.refused_intake + o.refused_intake,
            received_due: self.received_due + o.received_due,
            refused_due: self.refused_due + o.refused_due,
            scheduled: self.scheduled + o.scheduled,
            delivered: self.delivered + o.delivered,
            parked: self.parked + o.parked,
            in_flight_intake: self.in_flight_intake + o.in_flight_intake,
            in_flight_due: self.in_flight_due + o.in_flight_due,
            in_flight_quarantine: self.in_flight_quarantine + o.in_flight_quarantine,
        }
    }
}

/// One poll of one ladder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observation {
    /// The counters read just before the queue depths.
    pub before: Counters,
    /// The counters read just after the queue depths.
    pub after: Counters,
    /// Ready messages in the tier queues, the due queue and the quarantine.
    pub waiting: u64,
    /// The poll can be judged: the service was ready throughout and every depth was read.
    pub checkable: bool,
    /// Another process consumes the ladder's intake or due queue (a replica): this process's
    /// counters are not the whole traffic, so the check is off and its anchor dropped.
    pub shared: bool,
    /// Since the previous poll the service lost its session, a poll could not read the broker,
    /// or the service was not ready: what a shortfall is judged next is in doubt, not lost.
    pub disrupted: bool,
    /// When the poll was taken (ms since the epoch, the caller's clock).
    pub at_ms: u64,
}

impl Observation {
    /// The observation of several ladders as one system: counters summed, and `waiting` the
    /// ready messages of every queue they use, each counted once (a tier two ladders share must
    /// not count twice). It is checkable only if every one is, and shared or disrupted if any
    /// is. A namespace's ladders share their tier queues, whose depth cannot be split by ladder,
    /// so with more than one ladder this is what is checked.
    pub fn together(ladders: &[Observation], waiting: u64) -> Observation {
        let mut out = Observation {
            before: Counters::default(),
            after: Counters::default(),
            waiting,
            checkable: true,
            shared: false,
            disrupted: false,
            at_ms: 0,
        };
        for o in ladders {
            out.at_ms = out.at_ms.max(o.at_ms);
            out.before = out.before.plus(&o.before);
            out.after = out.after.plus(&o.after);
            out.checkable &= o.checkable;
            out.shared |= o.shared;
            out.disrupted |= o.disrupted;
        }
        out
    }
}

/// When a discrepancy is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    /// Missing messages up to this many are not reported.
    pub tolerance: u64,
    /// Consecutive quiet polls a discrepancy must last before it is reported (at least 1).
    pub polls: usize,
    /// And for how long at least (ms), from the first quiet poll that found it. It is longer
    /// than a lost session takes to be noticed, so a shortfall a partition causes is judged
    /// after the disruption: in doubt, not lost.
    pub settle_ms: u64,
}

/// What one poll concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not checked, anchor dropped: the service is not ready, shares its queues with another
    /// consumer, or reconnected.
    Unchecked,
    /// Traffic moved during or since the previous poll; nothing decided.
    Busy,
    /// This quiet poll is the new reference.
    Anchored,
    /// Everything is accounted for.
    Balanced,
    /// Messages are missing, on fewer than `Rules::polls` consecutive quiet polls so far.
    Suspect {
        /// Missing on this poll.
        missing: u64,
    },
    /// At least `missing` messages were missing on `Rules::polls` consecutive quiet polls.
    Unaccounted {
        /// The smallest shortfall over those polls.
        missing: u64,
    },
    /// Messages were missing on `Rules::polls` consecutive quiet polls, first judged after a
    /// disruption (a partition, a lost session): their fate is not known yet, and no alarm is
    /// raised.
    InDoubt {
        /// How many are in doubt.
        missing: u64,
    },
    /// More messages were found than counted, persistently, on a poll with nothing waiting
    /// (duplicates after a lost ack, or messages published straight into a tier); they became
    /// part of the reference.
    Rebased {
        /// How many more than counted.
        surplus: u64,
    },
}

impl Verdict {
    /// A short name for logs and `/api/ladders`.
    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Unchecked => "unchecked",
            Verdict::Busy => "busy",
            Verdict::Anchored => "anchored",
            Verdict::Balanced => "balanced",
            Verdict::Suspect { .. } => "suspect",
            Verdict::Unaccounted { .. } => "unaccounted",
            Verdict::InDoubt { .. } => "in_doubt",
            Verdict::Rebased { .. } => "rebased",
        }
    }
}

/// The schema of [`Verdict::name`]: one of the names.
pub fn verdict_schema() -> utoipa::openapi::Object {
    let all = [
        Verdict::Unchecked,
        Verdict::Busy,
        Verdict::Anchored,
        Verdict::Balanced,
        Verdict::Suspect { missing: 0 },
        Verdict::Unaccounted { missing: 0 },
        Verdict::InDoubt { missing: 0 },
        Verdict::Rebased { surplus: 0 },
    ];
    crate::model::words_schema(all.map(|v| v.name()))
}

#[derive(Debug, Clone, Copy)]
struct Anchor {
    balance: i128,
}

/// The check's memory across polls, for one ladder.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    anchor: Option<Anchor>,
    previous: Option<Counters>,
    /// `missing` of the latest consecutive quiet polls (negative: surplus), newest last.
    recent: VecDeque<i128>,
    unaccounted: u64,
    /// The shortfall taken as in doubt (not lost) after a disruption.
    in_doubt: u64,
    /// When (ms) the quiet polls first found the current shortfall.
    short_since: Option<u64>,
    /// A disruption happened since the last judged shortfall: the next one is in doubt.
    doubt_pending: bool,
    last: Option<Verdict>,
}

impl Ledger {
    /// Takes one poll into account.
    pub fn observe(&mut self, observation: &Observation, rules: Rules) -> Verdict {
        let polls = rules.polls.max(1);
        let quiet = observation.before == observation.after
            && self.previous == Some(observation.after)
            && observation.after.idle();
        self.previous = Some(observation.after);
        if observation.disrupted && self.anchor.is_some() {
            self.doubt_pending = true;
        }

        let verdict = if observation.shared {
            self.anchor = None;
            self.recent.clear();
            self.unaccounted = 0;
            self.in_doubt = 0;
            self.doubt_pending = false;
            self.short_since = None;
            Verdict::Unchecked
        } else if !observation.checkable {
            Verdict::Unchecked
        } else if !quiet {
            Verdict::Busy
        } else {
            let balance = observation.after.balance(observation.waiting);
            match self.anchor {
                None => {
                    self.anchor = Some(Anchor { balance });
                    self.short_since = None;
                    self.recent.clear();
                    self.unaccounted = 0;
                    self.in_doubt = 0;
                    self.doubt_pending = false;
                    Verdict::Anchored
                }
                Some(anchor) => {
                    let missing = balance - anchor.balance;
                    self.recent.push_back(missing);
                    while self.recent.len() > polls {
                        self.recent.pop_front();
                    }
                    self.judge(missing, balance, observation, rules, polls)
                }
            }
        };
        self.last = Some(verdict);
        verdict
    }

    fn judge(
        &mut self,
        missing: i128,
        balance: i128,
        observation: &Observation,
        rules: Rules,
        polls: usize,
    ) -> Verdict {
        let (waiting, tolerance) = (observation.waiting, i128::from(rules.tolerance));
        let full = self.recent.len() == polls;
        if missing > tolerance {
            let since = *self.short_since.get_or_insert(observation.at_ms);
            let settled = observation.at_ms.saturating_sub(since) >= rules.settle_ms;
            if full && settled && self.recent.iter().all(|m| *m > tolerance) {
                let least = clamp(self.recent.iter().copied().min().unwrap_or(missing));
                if self.doubt_pending {
                    // the first shortfall judged after a disruption: in doubt, not lost
                    self.doubt_pending = false;
                    self.in_doubt = least;
                }
                if least <= self.in_doubt.saturating_add(clamp(tolerance)) {
                    // messages in doubt come back a few at a time: what is left stays in doubt
                    self.in_doubt = least;
                    self.unaccounted = 0;
                    Verdict::InDoubt { missing: least }
                } else {
                    self.unaccounted = least - self.in_doubt;
                    Verdict::Unaccounted {
                        missing: self.unaccounted,
                    }
                }
            } else {
                Verdict::Suspect {
                    missing: clamp(missing),
                }
            }
        } else if missing < 0 && full && self.recent.iter().all(|m| *m < 0) && waiting == 0 {
            self.short_since = None;
            let surplus = self.recent.iter().map(|m| -m).min().unwrap_or(0);
            if let Some(anchor) = self.anchor.as_mut() {
                anchor.balance = balance;
            }
            self.recent.clear();
            self.unaccounted = 0;
            self.in_doubt = 0;
            self.doubt_pending = false;
            Verdict::Rebased {
                surplus: clamp(surplus),
            }
        } else {
            self.short_since = None;
            self.unaccounted = 0;
            if missing <= tolerance && (missing <= 0 || !self.doubt_pending) {
                // balanced on a quiet poll: whatever was in doubt is accounted for
                self.in_doubt = 0;
                self.doubt_pending = false;
            }
            Verdict::Balanced
        }
    }

    /// What `ladder_unaccounted_messages` should show: the shortfall of the latest decided poll
    /// (busy and suspect polls keep the previous value).
    pub fn unaccounted(&self) -> u64 {
        self.unaccounted
    }

    /// What `ladder_in_doubt_messages` should show: messages whose fate is not known yet after
    /// a disruption (neither lost nor accounted for).
    pub fn in_doubt(&self) -> u64 {
        self.in_doubt
    }

    /// The verdict of the latest poll, if any.
    pub fn last(&self) -> Option<Verdict> {
        self.last
    }

    /// The latest shortfall measured against the anchor (negative: surplus), if any.
    pub fn missing(&self) -> Option<i128> {
        self.recent.back().copied()
    }

    /// Whether a reference balance is set.
    pub fn anchored(&self) -> bool {
        self.anchor.is_some()
    }
}

fn clamp(n: i128) -> u64 {
    u64::try_from(n.max(0)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: Rules = Rules {
        tolerance: 0,
        polls: 3,
        settle_ms: 0,
    };

    /// A ladder that took in `entered`, delivered `delivered` and parked `parked`, nothing in flight.
    fn counters(entered: u64, delivered: u64, parked: u64) -> Counters {
        Counters {
            entered,
            received_intake: entered,
            scheduled: entered - parked.min(entered),
            received_due: delivered,
            delivered,
            parked,
            ..Counters::default()
        }
    }

    fn quiet(c: Counters, waiting: u64) -> Observation {
        Observation {
            before: c,
            after: c,
            waiting,
            checkable: true,
            shared: false,
            disrupted: false,
            at_ms: 0,
        }
    }

    /// Observes the same quiet state `times` times and returns the verdicts.
    fn repeat(ledger: &mut Ledger, o: Observation, times: usize) -> Vec<Verdict> {
        (0..times).map(|_| ledger.observe(&o, RULES)).collect()
    }

    #[test]
    fn ladders_sharing_a_tier_are_checked_together_and_a_loss_still_shows() {
        // a took in 5 and b 3; all 8 wait in one shared tier (read once, as 8)
        let (a, b) = (counters(5, 0, 0), counters(3, 0, 0));
        let both = |a, b, waiting| Observation::together(&[quiet(a, 0), quiet(b, 0)], waiting);
        let mut l = Ledger::default();
        assert_eq!(repeat(&mut l, both(a, b, 8), 2), [Verdict::Busy, Verdict::Anchored]);
        // 2 of a's and 1 of b's delivered: balanced together
        let (a, b) = (counters(5, 2, 0), counters(3, 1, 0));
        assert_eq!(repeat(&mut l, both(a, b, 5), 4).last(), Some(&Verdict::Balanced));
        assert_eq!(l.unaccounted(), 0);
        // one vanishes from the shared tier: reported, whichever ladder it was
        let last = repeat(&mut l, both(a, b, 4), 4);
        assert_eq!(last.last(), Some(&Verdict::Unaccounted { missing: 1 }), "{last:?}");
        // anything not checkable, shared or disrupted makes the whole so
        let mut busy = quiet(a, 0);
        busy.checkable = false;
        let o = Observation::together(&[busy, quiet(b, 0)], 5);
        assert!(!o.checkable && o.after.entered == 8 && o.waiting == 5);
    }

    #[test]
    fn a_quiet_balanced_system_reports_nothing() {
        let mut l = Ledger::default();
        // messages waiting from an earlier process: the anchor absorbs them
        let o = quiet(counters(0, 0, 0), 4);
        assert_eq!(repeat(&mut l, o, 2), [Verdict::Busy, Verdict::Anchored]);
        // 10 in, 3 delivered, 2 parked: 4 + 10 − 5 = 9 wait
        let c = counters(10, 3, 2);
        let busy = Observation {
            before: counters(9, 3, 2),
            ..quiet(c, 9)
        };
        assert_eq!(l.observe(&busy, RULES), Verdict::Busy);
        assert_eq!(repeat(&mut l, quiet(c, 9), 5), [Verdict::Balanced; 5]);
        assert_eq!(l.unaccounted(), 0);
        // the earlier process's messages are delivered too
        let c = counters(10, 7, 2);
        l.observe(&quiet(c, 5), RULES);
        assert_eq!(repeat(&mut l, quiet(c, 5), 3), [Verdict::Balanced; 3]);
    }

    #[test]
    fn in_flight_messages_are_counted_but_make_the_poll_busy() {
        let c = Counters {
            in_flight_due: 2,
            ..counters(5, 0, 0)
        };
        // 5 in, 2 of them taken from due and not settled, 3 wait
        assert_eq!(c.balance(3), 0);
        let mut l = Ledger::default();
        assert_eq!(repeat(&mut l, quiet(c, 3), 3), [Verdict::Busy; 3]);
        assert!(!l.anchored());
    }

    #[test]
    fn a_vanished_message_is_flagged_after_n_quiet_polls() {
        let mut l = Ledger::default();
        let c = counters(5, 0, 0);
        repeat(&mut l, quiet(c, 5), 2);
        assert!(l.anchored());
        // someone purges a tier holding 2 of them
        let verdicts = repeat(&mut l, quiet(c, 3), 4);
        assert_eq!(
            verdicts,
            [
                Verdict::Suspect { missing: 2 },
                Verdict::Suspect { missing: 2 },
                Verdict::Unaccounted { missing: 2 },
                Verdict::Unaccounted { missing: 2 },
            ]
        );
        assert_eq!(l.unaccounted(), 2);
        // traffic moves: busy polls keep the alarm and do not reset the streak
        let moved = counters(6, 0, 0);
        let busy = Observation {
            before: c,
            ..quiet(moved, 4)
        };
        assert_eq!(l.observe(&busy, RULES), Verdict::Busy);
        assert_eq!(l.unaccounted(), 2);
        assert_eq!(l.observe(&quiet(moved, 4), RULES), Verdict::Unaccounted { missing: 2 });
    }

    #[test]
    fn a_transient_imbalance_is_not_flagged() {
        let mut l = Ledger::default();
        let c = counters(5, 0, 0);
        repeat(&mut l, quiet(c, 5), 2);
        // one message in transit between a tier and due, seen in neither, for two polls
        assert_eq!(repeat(&mut l, quiet(c, 4), 2), [Verdict::Suspect { missing: 1 }; 2]);
        assert_eq!(l.observe(&quiet(c, 5), RULES), Verdict::Balanced);
        assert_eq!(l.observe(&quiet(c, 4), RULES), Verdict::Suspect { missing: 1 });
        assert_eq!(l.observe(&quiet(c, 5), RULES), Verdict::Balanced);
        assert_eq!(l.unaccounted(), 0);
    }

    #[test]
    fn the_flag_reports_the_smallest_persistent_shortfall() {
        let mut l = Ledger::default();
        let c = counters(9, 0, 0);
        repeat(&mut l, quiet(c, 9), 2);
        l.observe(&quiet(c, 6), RULES);
        l.observe(&quiet(c, 7), RULES);
        assert_eq!(l.observe(&quiet(c, 6), RULES), Verdict::Unaccounted { missing: 2 });
        // a further loss shows once it, too, has lasted `polls` polls
        assert_eq!(l.observe(&quiet(c, 5), RULES), Verdict::Unaccounted { missing: 2 });
        assert_eq!(l.observe(&quiet(c, 5), RULES), Verdict::Unaccounted { missing: 3 });
        // the messages come back (they were only held up): the alarm clears
        assert_eq!(l.observe(&quiet(c, 9), RULES), Verdict::Balanced);
        assert_eq!(l.unaccounted(), 0);
    }

    #[test]
    fn tolerance_hides_small_shortfalls() {
        let rules = Rules {
            tolerance: 2,
            polls: 1,
            settle_ms: 0,
        };
        let mut l = Ledger::default();
        let c = counters(9, 0, 0);
        l.observe(&quiet(c, 9), rules);
        l.observe(&quiet(c, 9), rules);
        assert_eq!(l.observe(&quiet(c, 7), rules), Verdict::Balanced);
        assert_eq!(l.observe(&quiet(c, 6), rules), Verdict::Unaccounted { missing: 3 });
    }

    #[test]
    fn a_message_lost_while_the_service_reconnects_is_flagged() {
        let mut l = Ledger::default();
        let c = counters(5, 0, 0);
        repeat(&mut l, quiet(c, 5), 2);
        // reconnecting: one due delivery in flight goes back to due; polls are skipped
        let reconnecting = Observation {
            checkable: false,
            ..quiet(c, 5)
        };
        assert_eq!(repeat(&mut l, reconnecting, 2), [Verdict::Unchecked; 2]);
        assert!(l.anchored(), "the anchor survives the reconnect");
        // the broker dropped it (a delivery limit, no dead-letter target): 4 wait, not 5
        assert_eq!(repeat(&mut l, quiet(c, 4), 3)[2], Verdict::Unaccounted { missing: 1 });
        // a redelivery of an intake message never settled enters once, when it is settled:
        // received again, entered not yet; still one missing, no surplus
        let redelivered = Counters {
            received_intake: c.received_intake + 1,
            ..c
        };
        assert_eq!(
            repeat(&mut l, quiet(redelivered, 4), 2)[1],
            Verdict::Unaccounted { missing: 1 }
        );
    }

    #[test]
    fn another_consumer_drops_the_anchor() {
        let mut l = Ledger::default();
        let c = counters(5, 0, 0);
        repeat(&mut l, quiet(c, 5), 2);
        repeat(&mut l, quiet(c, 3), 3);
        assert_eq!(l.unaccounted(), 2);
        let shared = Observation {
            shared: true,
            ..quiet(c, 3)
        };
        assert_eq!(l.observe(&shared, RULES), Verdict::Unchecked);
        assert!(!l.anchored());
        assert_eq!(l.unaccounted(), 0);
    }

    #[test]
    fn a_persistent_surplus_is_absorbed_once_nothing_waits_so_it_cannot_hide_a_later_loss() {
        let mut l = Ledger::default();
        repeat(&mut l, quiet(counters(5, 5, 0), 0), 2);
        // a duplicate is delivered (an ack lost in a reconnect the session count did not show)
        let after = repeat(&mut l, quiet(counters(5, 6, 0), 0), 4);
        assert_eq!(after[3], Verdict::Rebased { surplus: 1 }, "{after:?}");
        // now one is lost: taken in, never delivered, waiting nowhere — flagged, not hidden
        let after = repeat(&mut l, quiet(counters(6, 6, 0), 0), 4);
        assert_eq!(after[3], Verdict::Unaccounted { missing: 1 }, "{after:?}");
    }

    #[test]
    fn a_failure_the_broker_routed_waits_uncounted_without_an_alarm() {
        let mut l = Ledger::default();
        repeat(&mut l, quiet(counters(5, 5, 0), 0), 2);
        // a delivered message fails again and the broker routes it into its tier: it waits,
        // not yet counted (a surplus), however many quiet polls pass
        let waiting = repeat(&mut l, quiet(counters(5, 5, 0), 1), 5);
        assert!(waiting.iter().all(|v| *v == Verdict::Balanced), "{waiting:?}");
        // it comes due: the due hop counts it in and delivers it — nothing reported missing
        let delivered = repeat(&mut l, quiet(counters(6, 6, 0), 0), 5);
        assert_eq!(delivered[1..], [Verdict::Balanced; 4], "{delivered:?}");
        assert_eq!(l.unaccounted(), 0);
    }

    #[test]
    fn a_shortfall_after_a_partition_is_in_doubt_not_lost_until_it_balances() {
        let mut l = Ledger::default();
        let c = counters(100, 0, 0);
        repeat(&mut l, quiet(c, 100), 2);
        assert!(l.anchored());
        // a partition: the session is lost, polls cannot read the broker (not ready)
        let cut = Observation {
            checkable: false,
            disrupted: true,
            ..quiet(c, 100)
        };
        assert_eq!(l.observe(&cut, RULES), Verdict::Unchecked);
        // after the heal 40 of them are checked out to the dead consumer, in no ready count
        // (or were settled just before the cut, came back and counted as entering again)
        let after = repeat(&mut l, quiet(c, 60), 4);
        assert_eq!(
            after,
            [
                Verdict::Suspect { missing: 40 },
                Verdict::Suspect { missing: 40 },
                Verdict::InDoubt { missing: 40 },
                Verdict::InDoubt { missing: 40 },
            ]
        );
        assert_eq!((l.unaccounted(), l.in_doubt()), (0, 40), "no loss alarm");
        // they come back a few at a time: fewer in doubt
        assert_eq!(l.observe(&quiet(c, 90), RULES), Verdict::InDoubt { missing: 10 });
        assert_eq!(repeat(&mut l, quiet(c, 90), 2)[1], Verdict::InDoubt { missing: 10 });
        assert_eq!((l.unaccounted(), l.in_doubt()), (0, 10));
        // all back: balanced, nothing in doubt
        assert_eq!(l.observe(&quiet(c, 100), RULES), Verdict::Balanced);
        assert_eq!((l.unaccounted(), l.in_doubt()), (0, 0));
        // a loss now, with no disruption, is an alarm again
        assert_eq!(repeat(&mut l, quiet(c, 97), 3)[2], Verdict::Unaccounted { missing: 3 });
    }

    #[test]
    fn a_shortfall_found_before_the_partition_was_noticed_is_in_doubt_not_lost() {
        // polls a second apart; a shortfall is judged once it lasted 10 s
        let rules = Rules {
            settle_ms: 10_000,
            ..RULES
        };
        let at = |c, waiting, s: u64| Observation {
            at_ms: s * 1000,
            ..quiet(c, waiting)
        };
        let mut l = Ledger::default();
        let c = counters(100, 0, 0);
        l.observe(&at(c, 100, 0), rules);
        assert_eq!(l.observe(&at(c, 100, 1), rules), Verdict::Anchored);
        // a cut nobody noticed yet: the node answers stale depths, 3 seem missing, for 4 quiet
        // polls — more than `polls`, less than the settle time
        for s in 2..6 {
            assert_eq!(
                l.observe(&at(c, 97, s), rules),
                Verdict::Suspect { missing: 3 },
                "at {s} s"
            );
        }
        assert_eq!(
            (l.unaccounted(), l.in_doubt()),
            (0, 0),
            "no alarm before the settle time"
        );
        // the lost session is noticed (a disruption), and after it the shortfall is in doubt
        let lost = Observation {
            disrupted: true,
            checkable: false,
            ..at(c, 97, 6)
        };
        assert_eq!(l.observe(&lost, rules), Verdict::Unchecked);
        let later: Vec<Verdict> = (7..14).map(|s| l.observe(&at(c, 97, s), rules)).collect();
        assert_eq!(later.last(), Some(&Verdict::InDoubt { missing: 3 }), "{later:?}");
        assert_eq!(l.unaccounted(), 0);
        // they turn up: balanced; a real loss later, with no disruption, is an alarm once settled
        assert_eq!(l.observe(&at(c, 100, 14), rules), Verdict::Balanced);
        let loss: Vec<Verdict> = (15..27).map(|s| l.observe(&at(c, 99, s), rules)).collect();
        assert_eq!(loss[9], Verdict::Suspect { missing: 1 }, "{loss:?}");
        assert_eq!(loss[10], Verdict::Unaccounted { missing: 1 }, "{loss:?}");
    }

    #[test]
    fn a_loss_beyond_what_is_in_doubt_is_still_an_alarm() {
        let mut l = Ledger::default();
        let c = counters(50, 0, 0);
        repeat(&mut l, quiet(c, 50), 2);
        let disrupted = Observation {
            disrupted: true,
            ..quiet(c, 45)
        };
        l.observe(&disrupted, RULES);
        assert_eq!(repeat(&mut l, quiet(c, 45), 2)[1], Verdict::InDoubt { missing: 5 });
        // two more vanish later, with nothing disrupted: those two are unaccounted
        assert_eq!(repeat(&mut l, quiet(c, 43), 3)[2], Verdict::Unaccounted { missing: 2 });
        assert_eq!((l.unaccounted(), l.in_doubt()), (2, 5));
    }

    #[test]
    fn a_disruption_with_nothing_missing_leaves_nothing_in_doubt() {
        let mut l = Ledger::default();
        let c = counters(50, 0, 0);
        repeat(&mut l, quiet(c, 50), 2);
        let disrupted = Observation {
            disrupted: true,
            ..quiet(c, 50)
        };
        assert_eq!(l.observe(&disrupted, RULES), Verdict::Balanced);
        assert_eq!(l.in_doubt(), 0);
        // a loss found later is an alarm: the disruption was judged (balanced) already
        assert_eq!(repeat(&mut l, quiet(c, 48), 4)[3], Verdict::Unaccounted { missing: 2 });
    }

    #[test]
    fn a_refused_publish_is_held_in_flight_and_still_balances() {
        // one message received, its publish refused twice: held, in flight, not yet in a tier
        let held = Counters {
            entered: 1,
            received_intake: 1,
            refused_intake: 2,
            in_flight_intake: 1,
            ..Counters::default()
        };
        assert_eq!(held.balance(0), 0);
        // the third publish is confirmed and the delivery acked
        let scheduled = Counters {
            in_flight_intake: 0,
            scheduled: 1,
            ..held
        };
        assert_eq!(scheduled.balance(1), 0);
    }
}
