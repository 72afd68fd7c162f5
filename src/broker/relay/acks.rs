//! A hop's acks, batched: one `basic.ack` with `multiple` for every run of settled deliveries
//! at the front of what the hop holds, instead of one per delivery.
//!
//! Under load the broker confirms publishes in batches, so several deliveries settle in one
//! turn of the hop loop; acking each was one frame to encode and one wake of the connection's
//! writer per delivery. A delivery is acked only once it is settled (its replacement
//! confirmed), as before: a multiple ack names the last of a run whose every delivery is
//! settled. A delivery that stays unsettled for long (its destination's slot, a refused
//! publish held with backoff, a missing parking lot) does not hold up the acks of those behind
//! it — they would keep their prefetch slots and stall the hop: what settles behind an
//! unsettled delivery is acked on its own, at once.
//!
//! It must not publish or decide anything; it only remembers delivery tags. The broker's rule
//! it keeps: the tag of an ack — multiple or not — must be one not acked yet on the channel
//! (RabbitMQ closes the channel with "unknown delivery tag" otherwise), and a multiple ack
//! covers every unacked tag up to it.

use std::collections::VecDeque;

/// The deliveries of one channel received and not yet acked, in delivery-tag order.
#[derive(Debug, Default)]
pub(crate) struct Acks {
    /// Each with whether it is settled.
    open: VecDeque<(u64, bool)>,
    /// How many settled deliveries wait behind an unsettled one.
    behind: usize,
}

impl Acks {
    /// A delivery came (tags rise on a channel).
    pub(crate) fn received(&mut self, tag: u64) {
        debug_assert!(
            self.open.back().is_none_or(|(last, _)| *last < tag),
            "delivery tags rise"
        );
        self.open.push_back((tag, false));
    }

    /// The delivery `tag` is settled: its replacement confirmed.
    pub(crate) fn settled(&mut self, tag: u64) {
        // the tags of a channel with one consumer follow one another: found by its distance
        // from the front, else searched
        let at = self
            .open
            .front()
            .and_then(|(first, _)| usize::try_from(tag.wrapping_sub(*first)).ok())
            .filter(|at| self.open.get(*at).is_some_and(|(found, _)| *found == tag))
            .or_else(|| self.open.binary_search_by_key(&tag, |(tag, _)| *tag).ok());
        if let Some(at) = at
            && !self.open[at].1
        {
            self.open[at].1 = true;
            if at > 0 {
                self.behind += 1;
            }
        }
    }

    /// Calls `ack(tag, multiple)` for everything settled: once with `multiple` for the run at
    /// the front, and once without for each settled delivery behind an unsettled one.
    pub(crate) fn flush<E>(&mut self, mut ack: impl FnMut(u64, bool) -> Result<(), E>) -> Result<(), E> {
        let mut last = None;
        while let Some(&(tag, true)) = self.open.front() {
            self.open.pop_front();
            last = Some(tag);
        }
        if let Some(tag) = last {
            ack(tag, true)?;
        }
        if self.behind > 0 {
            // the front is unsettled (the run above ended at it); counted again from here
            self.behind = 0;
            let mut failed = None;
            self.open.retain(|&(tag, settled)| {
                if settled && failed.is_none() {
                    failed = ack(tag, false).err();
                }
                !settled
            });
            if let Some(e) = failed {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Deliveries received and not acked.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.open.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flushed(acks: &mut Acks) -> Vec<(u64, bool)> {
        let mut sent = Vec::new();
        acks.flush(|tag, multiple| {
            sent.push((tag, multiple));
            Ok::<(), ()>(())
        })
        .unwrap();
        sent
    }

    #[test]
    fn a_settled_run_at_the_front_is_one_multiple_ack() {
        let mut acks = Acks::default();
        for tag in 1..=5 {
            acks.received(tag);
        }
        for tag in [2, 1, 3] {
            acks.settled(tag);
        }
        assert_eq!(flushed(&mut acks), vec![(3, true)]);
        assert_eq!(acks.len(), 2);
        assert_eq!(flushed(&mut acks), vec![], "nothing settled since");
        acks.settled(5);
        acks.settled(4);
        assert_eq!(flushed(&mut acks), vec![(5, true)]);
        assert_eq!(acks.len(), 0);
    }

    #[test]
    fn what_settles_behind_an_unsettled_delivery_is_acked_on_its_own_at_once() {
        let mut acks = Acks::default();
        for tag in 10..=14 {
            acks.received(tag);
        }
        acks.settled(12);
        acks.settled(14);
        assert_eq!(flushed(&mut acks), vec![(12, false), (14, false)]);
        // the held one settles: a multiple ack from it covers only unacked tags, and its own
        // tag is one not acked yet
        acks.settled(10);
        assert_eq!(flushed(&mut acks), vec![(10, true)]);
        acks.settled(11);
        acks.settled(13);
        assert_eq!(flushed(&mut acks), vec![(13, true)]);
        assert_eq!(acks.len(), 0);
    }

    #[test]
    fn tags_with_gaps_are_found_too() {
        let mut acks = Acks::default();
        for tag in [3, 4, 9, 12] {
            acks.received(tag);
        }
        acks.settled(9);
        acks.settled(7); // never received: nothing
        assert_eq!(flushed(&mut acks), vec![(9, false)]);
        acks.settled(3);
        acks.settled(4);
        assert_eq!(flushed(&mut acks), vec![(4, true)]);
        acks.settled(12);
        assert_eq!(flushed(&mut acks), vec![(12, true)]);
        assert_eq!(acks.len(), 0);
    }

    #[test]
    fn every_tag_is_acked_exactly_once_whatever_the_order() {
        // each received tag covered by exactly one ack (its own or a multiple one naming a
        // tag not acked before), and never before it settled
        for seed in 0..200 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let mut acks = Acks::default();
            let n = rng.u64(1..60);
            let mut order: Vec<u64> = (1..=n).collect();
            rng.shuffle(&mut order);
            for tag in 1..=n {
                acks.received(tag);
            }
            let mut settled = std::collections::BTreeSet::new();
            let mut acked = std::collections::BTreeSet::new();
            for tag in order {
                acks.settled(tag);
                acks.settled(tag); // twice is once
                settled.insert(tag);
                if rng.bool() {
                    continue;
                }
                for (tag, multiple) in flushed(&mut acks) {
                    assert!(acked.insert(tag), "seed {seed}: {tag} acked twice");
                    if multiple {
                        for below in 1..tag {
                            if !acked.contains(&below) {
                                acked.insert(below);
                            }
                        }
                    }
                }
                assert!(acked.is_subset(&settled), "seed {seed}: acked before settled");
            }
            for (tag, multiple) in flushed(&mut acks) {
                assert!(acked.insert(tag), "seed {seed}: {tag} acked twice");
                if multiple {
                    acked.extend(1..tag);
                }
            }
            assert_eq!(acked, settled, "seed {seed}");
            assert_eq!(acks.len(), 0);
        }
    }
}
