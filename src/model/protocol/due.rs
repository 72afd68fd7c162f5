//! The due hop's decisions: a message whose wait is over is delivered, waits again, is
//! deferred, or is parked; and the quarantine's park.

use std::borrow::Cow;
use std::time::Duration;

use ladder_amqp::{BasicProperties, FieldTable, FieldValue, ShortString};

use super::*;

impl<'a> HopContext<'a> {
    /// Due at `now_ms` (see [`HopContext::due_at`]), a forward's headers all in its properties
    /// ([`Decision::materialized`]).
    pub fn due(&self, props: &BasicProperties, now_ms: u64) -> Decision<'a> {
        self.due_at(props, &Arrival::at(now_ms)).materialized(props)
    }

    /// Due: a message whose due time is still ahead waits again, in the longest tier that does
    /// not overshoot. One that is due is checked again (the allow-list may have changed),
    /// stripped of what the tier's dead-lettering added, and delivered, or parked.
    pub fn due_at(&self, props: &BasicProperties, arrival: &Arrival<'_>) -> Decision<'a> {
        if let Some(failure) = self.routed_failure(props, arrival.routing_key) {
            return self.take_in_after_wait(props, arrival, failure);
        }
        let now_ms = arrival.now_ms;
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        let attempts = optional_u64(h, header::RETRY_ATTEMPT).ok().flatten();
        let first_failed_at = optional_u64(h, header::RETRY_FIRST_FAILED_AT).ok().flatten();
        let park = |reason, detail: String, destination: Option<String>| {
            Decision::Park(
                Park::carrying(reason, detail, h)
                    .to(destination)
                    .after(attempts, first_failed_at),
            )
        };
        let scheduled = matches!(h.get(header::RETRY_SCHEDULED), Some(FieldValue::Boolean(true)));
        let target = match (h.get(header::RETRY_TO), h.get(header::RETRY_TO_EXCHANGE)) {
            (Some(queue), _) => check_queue_name(queue).map(Target::Queue),
            (None, Some(exchange)) if scheduled => check_exchange_name(exchange).map(Target::Exchange),
            _ => {
                let detail = format!("due message without a {} header", header::RETRY_TO);
                return park(ParkReason::NoDestination, detail, None);
            }
        };
        let target = match target {
            Ok(target) => target,
            Err(problem) => return park(ParkReason::InvalidHeader, problem, None),
        };
        let queue = || target.queue().map(str::to_string); // for a park record only
        // Only the intake checks headers, but anyone allowed to publish to the tiers exchange
        // could bypass it.
        if let Some((reason, detail)) = self.check_size(h) {
            return park(reason, detail, queue());
        }
        if let Some(detail) = self.refuse_target(&target) {
            return park(ParkReason::DestinationNotAllowed, detail, queue());
        }
        if arrival.cancelled {
            return park(ParkReason::Cancelled, cancelled_detail(props), queue());
        }
        let due_at = optional_u64(h, header::RETRY_DUE_AT).ok().flatten();
        if let Some(due) = due_at
            && due > now_ms
            && self.spec.exact_delays
        {
            let remaining = Duration::from_millis(due - now_ms);
            if remaining > MAX_DELAY {
                let detail = format!(
                    "{} is {} ms ahead, beyond the longest delay ({} ms, 49 days)",
                    header::RETRY_DUE_AT,
                    due - now_ms,
                    MAX_DELAY.as_millis()
                );
                return park(ParkReason::InvalidDelay, detail, queue());
            }
            let tier = self.spec.next_wait(remaining);
            let mut out = FieldTable::with_capacity(1);
            out.push(ShortString::from_static(header::RETRY_TIER), long_string(&tier.name));
            let (properties, carry) = carrying(props, Some(out), &[header::RETRY_TIER]);
            let (exchange, routing_key, kind) = self.wait_in(tier);
            return Decision::Forward(Box::new(Forward {
                exchange,
                routing_key,
                properties,
                carry: Some(carry),
                destination: target.into_key(),
                attempt: attempts.unwrap_or(0),
                late_ms: 0,
                due_at_ms: due,
                kind,
                counted: Counted::Before,
            }));
        }
        let late_ms = due_at.map_or(0, |due| now_ms.saturating_sub(due));
        self.deliver(props, h, target, scheduled, attempts, late_ms)
    }

    /// A due message out to `target`: as received, with where its next failure waits; a
    /// scheduled delivery as it was published, the ladder's bookkeeping leaving with the wait.
    fn deliver(
        &self,
        props: &BasicProperties,
        h: &FieldTable,
        target: Target,
        scheduled: bool,
        attempts: Option<u64>,
        late_ms: u64,
    ) -> Decision<'a> {
        let (exchange, routing_key, kind) = match &target {
            Target::Queue(queue) => (Cow::Borrowed(""), Cow::Owned(queue.clone()), ForwardKind::Deliver),
            Target::Exchange(exchange) => {
                let key = h
                    .get(header::RETRY_ROUTING_KEY)
                    .and_then(as_text)
                    .unwrap_or_default()
                    .to_string();
                (
                    Cow::Owned(exchange.clone()),
                    Cow::Owned(key),
                    ForwardKind::DeliverToExchange,
                )
            }
        };
        let (properties, carry) = if scheduled {
            carrying(props, None, SCHEDULED_BOOKKEEPING)
        } else {
            let mut out = FieldTable::with_capacity(1);
            out.push(
                ShortString::from_static(header::RETRY_NEXT),
                self.next_route(attempts.unwrap_or(0)),
            );
            carrying(props, Some(out), &[header::RETRY_NEXT])
        };
        Decision::Forward(Box::new(Forward {
            exchange,
            routing_key,
            properties,
            carry: Some(carry),
            destination: target.into_key(),
            attempt: attempts.unwrap_or(0),
            late_ms,
            due_at_ms: 0,
            kind,
            counted: Counted::Before,
        }))
    }

    /// Whether a message at the due hop, which arrived with `routing_key`, is a failure the
    /// broker routed past the intake:
    /// - a repeat failure carries `retry-next`, which the service writes only on what it
    ///   delivers (never on a wait it schedules), and by which `N.L` routed it into that
    ///   tier;
    /// - a first failure of an older ladder comes due from its first wait, `N.L.wait.<tier>`,
    ///   with the routing key that queue dead-letters with (`wait.<tier>`,
    ///   [`crate::model::upgrade::waited_tier`]).
    ///
    /// `skip` is 1 when its newest `x-death` entry is that wait's (the due hop's channel decodes
    /// `x-death` where the ladder lists `senders`, and on every delivery with a `wait.` key).
    pub fn routed_failure(&self, props: &BasicProperties, routing_key: &[u8]) -> Option<RoutedFailure> {
        let h = props.headers.as_ref();
        let Some(next) = h.and_then(|h| h.get(header::RETRY_NEXT)) else {
            let tier = crate::model::upgrade::waited_tier(routing_key)?;
            let queue = crate::model::upgrade::wait_queue(self.names, tier);
            let newest = h.and_then(newest_death_queue);
            let own = format!("{}.wait.", self.names.exchange);
            return Some(RoutedFailure {
                waited_ms: tier_ms(self.spec, tier),
                skip: usize::from(newest.is_some_and(|q| q.starts_with(&own))),
                queue: Some(queue),
                tier: tier.to_string(),
            });
        };
        let h = h?;
        let tier = as_text(next).unwrap_or_default();
        let queue = self.names.tier_queue_named(tier);
        // the ladder's own tier of that name, where an older Ladder routed it
        let newest = newest_death_queue(h);
        let skip = usize::from(
            newest.as_deref() == Some(queue.as_str())
                || newest.as_deref() == Some(self.names.own_tier_queue_named(tier).as_str()),
        );
        Some(RoutedFailure {
            waited_ms: tier_ms(self.spec, tier),
            skip,
            queue: Some(queue),
            tier: tier.to_string(),
        })
    }

    /// The `retry-next` value for a delivery of retry `attempt`.
    fn next_route(&self, attempt: u64) -> FieldValue {
        long_string(
            self.spec
                .next_route(attempt)
                .map_or(header::NEXT_INTAKE, |tier| tier.name.as_str()),
        )
    }

    /// A failure the broker routed past the intake, taken in as the intake would have taken it
    /// when it failed (`failure.waited_ms` before now): validated, its attempt counted, its delay
    /// chosen. It is then delivered if that delay is over, or waits for what remains.
    fn take_in_after_wait(
        &self,
        props: &BasicProperties,
        arrival: &Arrival<'_>,
        failure: RoutedFailure,
    ) -> Decision<'a> {
        let now_ms = arrival.now_ms;
        let at_failure = Arrival {
            now_ms: now_ms.saturating_sub(failure.waited_ms),
            ..*arrival
        };
        let mut forward = match self.take_in(props, &at_failure, failure.skip) {
            Decision::Forward(forward) => forward,
            park @ Decision::Park(_) => return park,
        };
        forward.counted = Counted::Here;
        if forward.attempt == 0 {
            // a scheduled delivery (`x-delay`, `delay-until` added to a failure): the intake's
            // own first wait, to the due queue or a tier, which then delivers it as scheduled
            return Decision::Forward(forward);
        }
        if forward.due_at_ms > now_ms {
            let remaining = Duration::from_millis(forward.due_at_ms - now_ms);
            // with delay levels the rest is composed exactly; without, it waits the first step
            // at least that long in one leg (the due hop composes no further there)
            let tier = if self.spec.exact_delays {
                self.spec.next_wait(remaining)
            } else {
                self.spec.tier_for_min_delay(remaining)
            };
            if let Some(own) = forward.properties.headers.as_mut() {
                own.set(header::RETRY_TIER, long_string(&tier.name));
            }
            (forward.exchange, forward.routing_key, forward.kind) = self.wait_in(tier);
            return Decision::Forward(forward);
        }
        // already due: out to its destination, as any retry is delivered
        Decision::Forward(self.due_now(forward, now_ms))
    }

    /// A retry decided to wait (`forward`), as the delivery it becomes when due at `now_ms`:
    /// to its destination, with the `retry-next` its failure takes. The due hop delivers a
    /// taken-in failure that is already due so; the intake sends a failure of a held destination
    /// so straight to its held queue, where it waits instead of in a tier (the hold replaces the
    /// wait, and its release delivers it).
    pub fn due_now(&self, mut forward: Box<Forward<'a>>, now_ms: u64) -> Box<Forward<'a>> {
        forward.late_ms = now_ms.saturating_sub(forward.due_at_ms);
        forward.due_at_ms = 0;
        forward.exchange = Cow::Borrowed("");
        forward.routing_key = Cow::Owned(forward.destination.clone());
        forward.kind = ForwardKind::Deliver;
        if let Some(own) = forward.properties.headers.as_mut() {
            own.set(
                header::RETRY_DUE_AT,
                FieldValue::LongLongInt(now_ms.min(i64::MAX as u64) as i64),
            );
            own.push(
                ShortString::from_static(header::RETRY_NEXT),
                self.next_route(forward.attempt),
            );
        }
        forward
    }

    /// Due: the message cannot be delivered now (`reason`), so it waits in a tier again, no
    /// attempt counted. A busy destination's waits in the shortest tier; a refused one waits one
    /// tier longer for each refusal of the same attempt (`retry-deferrals`).
    pub fn defer(&self, props: &BasicProperties, reason: DeferReason, now_ms: u64) -> Forward<'a> {
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        let deferrals = optional_u64(h, header::RETRY_DEFERRALS)
            .ok()
            .flatten()
            .unwrap_or(0)
            .saturating_add(1);
        let tiers = &self.spec.steps;
        let tier = match reason {
            DeferReason::Busy => &tiers[0],
            DeferReason::Refused => &tiers[(deferrals as usize - 1).min(tiers.len() - 1)],
        };
        let mut out = republished_headers(h);
        // a wait the service schedules never carries it (see `routed_failure`)
        out.remove(header::RETRY_NEXT);
        out.set(header::RETRY_DEFERRALS, FieldValue::LongLongInt(deferrals as i64));
        out.set(header::RETRY_TIER, long_string(&tier.name));
        let due_at_ms = now_ms.saturating_add(tier.ttl_ms());
        out.set(header::RETRY_DUE_AT, FieldValue::LongLongInt(due_at_ms as i64));
        let (exchange, routing_key, kind) = self.wait_in(tier);
        Forward {
            exchange,
            routing_key,
            properties: republished_properties(props, out),
            carry: None,
            destination: h
                .get(header::RETRY_TO)
                .and_then(as_text)
                .unwrap_or_default()
                .to_string(),
            attempt: optional_u64(h, header::RETRY_ATTEMPT).ok().flatten().unwrap_or(0),
            late_ms: 0,
            due_at_ms,
            kind,
            counted: Counted::Before,
        }
    }

    /// Quarantine: the broker dead-lettered the message out of the ladder's intake or due queue
    /// (its `x-death` says why). It is parked as received, with what its headers tell.
    pub fn dead_lettered(&self, props: &BasicProperties) -> Park {
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        let deaths: &[FieldValue] = match h.get(header::X_DEATH) {
            Some(FieldValue::FieldArray(deaths)) => deaths,
            _ => &[],
        };
        let field = |entry: &FieldValue, key: &str| match entry {
            FieldValue::FieldTable(t) => t.get(key).and_then(as_text).map(str::to_string),
            _ => None,
        };
        let newest = deaths.first();
        let queue = newest.and_then(|d| field(d, "queue")).unwrap_or_else(|| "?".into());
        let why = newest
            .and_then(|d| field(d, "reason"))
            .unwrap_or_else(|| "no x-death reason".into());
        let count = match newest {
            Some(FieldValue::FieldTable(t)) => t.get("count").and_then(as_u64),
            _ => None,
        };
        let detail = match count {
            Some(n) => format!("the broker dead-lettered it out of {queue}: {why} ({n} times)"),
            None => format!("the broker dead-lettered it out of {queue}: {why}"),
        };
        // retry-to, or the consumer's queue it was dead-lettered from before it reached the ladder
        let destination = match h.get(header::RETRY_TO).map(check_queue_name) {
            Some(Ok(queue)) => Some(queue),
            _ => deaths
                .iter()
                .filter_map(|d| field(d, "queue"))
                .find(|q| !q.is_empty() && !q.starts_with(&self.names.namespace.prefix)),
        };
        Park::carrying(ParkReason::DeadLettered, detail, h)
            .to(destination)
            .after(
                optional_u64(h, header::RETRY_ATTEMPT).ok().flatten(),
                optional_u64(h, header::RETRY_FIRST_FAILED_AT).ok().flatten(),
            )
    }
}
