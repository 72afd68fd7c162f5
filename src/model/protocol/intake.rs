//! The intake's decisions: a failure validated, its attempt counted and its wait chosen, or
//! a scheduled delivery's first wait; and the checks every hop that takes a failure in makes
//! (size, destination, sender).

use std::borrow::Cow;
use std::time::Duration;

use ladder_amqp::{BasicProperties, FieldTable, FieldValue, LongString, ShortString};

use super::*;

impl<'a> HopContext<'a> {
    /// Intake at `now_ms` (see [`HopContext::intake_at`]), a forward's headers all in its
    /// properties ([`Decision::materialized`]).
    pub fn intake(&self, props: &BasicProperties, now_ms: u64) -> Decision<'a> {
        self.intake_at(props, &Arrival::at(now_ms)).materialized(props)
    }

    /// Intake: a scheduled delivery (`x-delay`, `delay-until`) waits its exact delay; a failure
    /// is validated, its attempt counted, and it waits its retry's delay — or it is parked.
    pub fn intake_at(&self, props: &BasicProperties, arrival: &Arrival<'_>) -> Decision<'a> {
        self.take_in(props, arrival, 0)
    }

    /// The intake's decision on a failure at `arrival` whose newest `skip` `x-death` entries are
    /// the ladder's own (the wait a failure the broker routed has already had), so they neither
    /// name its destination nor say how it came back.
    pub(super) fn take_in(&self, props: &BasicProperties, arrival: &Arrival<'_>, skip: usize) -> Decision<'a> {
        let headers = props.headers_or_empty();
        let h: &FieldTable = &headers;
        if h.contains_key(header::X_DELAY) || h.contains_key(header::DELAY_UNTIL) {
            return self.schedule(props, h, arrival);
        }
        let failure = match self.read_failure(props, h, skip) {
            Ok(failure) => failure,
            Err(park) => return Decision::Park(*park),
        };
        let park = |reason, detail: String| {
            let park = Park::carrying(reason, detail, h).to(Some(failure.destination.clone()));
            Decision::Park(park.after(Some(failure.previous), failure.first_failed_at))
        };
        let attempt = failure.previous.saturating_add(1);
        if attempt > u64::from(self.spec.max_attempts) {
            let detail = format!(
                "failed after {} retries; ladder {} allows {}",
                failure.previous, self.spec.name, self.spec.max_attempts
            );
            return park(ParkReason::MaxAttempts, detail);
        }
        if arrival.cancelled {
            return park(ParkReason::Cancelled, cancelled_detail(props));
        }
        self.wait_for_retry(props, h, failure, attempt, arrival)
    }

    /// Validates a failure with headers `h`: where it goes, the retries it had, and the delay
    /// and reason it asks for — or the park that says what is wrong.
    fn read_failure(&self, props: &BasicProperties, h: &FieldTable, skip: usize) -> Result<Failure, Box<Park>> {
        // Read what can be read before validating, so every park record says where the
        // message was headed (operators search the parking lot by destination).
        let destination = match h.get(header::RETRY_TO) {
            Some(value) => check_queue_name(value),
            None => death_queue(h, skip).ok_or_else(|| {
                format!(
                    "no {} header and no x-death entry naming the queue it failed in",
                    header::RETRY_TO
                )
            }),
        };
        // what a park record needs is read only when parking (this runs on every retry)
        let known_destination = || destination.as_ref().ok().cloned();
        if let Some((reason, detail)) = self.check_size(h) {
            return Err(Box::new(Park::carrying(reason, detail, h).to(known_destination())));
        }
        let previous = match optional_u64(h, header::RETRY_ATTEMPT) {
            Ok(n) => n.unwrap_or(0),
            Err(problem) => {
                let park = Park::carrying(ParkReason::InvalidHeader, problem, h);
                return Err(Box::new(park.to(known_destination())));
            }
        };
        let first_failed_at = optional_u64(h, header::RETRY_FIRST_FAILED_AT).ok().flatten();
        let park = |reason, detail: String, destination: Option<String>| {
            let park = Park::carrying(reason, detail, h).to(destination);
            Box::new(park.after(Some(previous), first_failed_at))
        };
        let destination = match destination {
            Ok(queue) => queue,
            Err(problem) if h.contains_key(header::RETRY_TO) => {
                return Err(park(ParkReason::InvalidHeader, problem, None));
            }
            Err(problem) => return Err(park(ParkReason::NoDestination, problem, None)),
        };
        if let Some(detail) = self.refuse_destination(&destination) {
            return Err(park(ParkReason::DestinationNotAllowed, detail, Some(destination)));
        }
        if let Some(detail) = self.refuse_sender(props, h, &destination, skip) {
            return Err(park(ParkReason::SenderNotAllowed, detail, Some(destination)));
        }
        let min_delay = match h.get(header::RETRY_DELAY).map(parse_delay) {
            None => None,
            Some(Ok(delay)) if delay > MAX_DELAY => {
                let problem = format!(
                    "{} is {} ms, beyond the longest delay ({} ms, 49 days)",
                    header::RETRY_DELAY,
                    delay.as_millis(),
                    MAX_DELAY.as_millis()
                );
                return Err(park(ParkReason::InvalidHeader, problem, Some(destination)));
            }
            Some(Ok(delay)) => Some(delay),
            Some(Err(problem)) => return Err(park(ParkReason::InvalidHeader, problem, Some(destination))),
        };
        let reason = match h.get(header::RETRY_REASON) {
            None => None,
            Some(value) => match as_text(value) {
                Some(text) => Some(truncate(text, self.limits.max_reason_bytes)),
                None => {
                    let problem = format!("{} must be a string, got {}", header::RETRY_REASON, describe(value));
                    return Err(park(ParkReason::InvalidHeader, problem, Some(destination)));
                }
            },
        };
        Ok(Failure {
            destination,
            previous,
            first_failed_at,
            min_delay,
            reason,
        })
    }

    /// The wait of retry `attempt` of `failure`: its delay, its tier, and the headers the
    /// intake writes (the rest is carried over as received, `Carry`).
    fn wait_for_retry(
        &self,
        props: &BasicProperties,
        h: &FieldTable,
        failure: Failure,
        attempt: u64,
        arrival: &Arrival<'_>,
    ) -> Decision<'a> {
        let now_ms = arrival.now_ms;
        let delay = self.spec.retry_delay(attempt as u32, failure.min_delay, arrival.draw);
        let tier = self.spec.next_wait(delay);
        let mut out = FieldTable::with_capacity(INTAKE_WRITES.len() + 1);
        if let Some(reason) = failure.reason {
            out.push(ShortString::from_static(header::RETRY_REASON), long_string(&reason));
        }
        // a user id to move replaces a `retry-original-user-id` received (rare)
        let except = if props.user_id.is_some() {
            INTAKE_WRITES_WITH_USER
        } else {
            INTAKE_WRITES
        };
        move_user_id(props, &mut out);
        out.push(
            ShortString::from_static(header::RETRY_TO),
            long_string(&failure.destination),
        );
        out.push(
            ShortString::from_static(header::RETRY_ATTEMPT),
            FieldValue::LongLongInt(attempt as i64),
        );
        out.push(
            ShortString::from_static(header::RETRY_FIRST_FAILED_AT),
            FieldValue::LongLongInt(failure.first_failed_at.unwrap_or(now_ms) as i64),
        );
        out.push(
            ShortString::from_static(header::RETRY_LADDER),
            long_string(&self.spec.name),
        );
        out.push(ShortString::from_static(header::RETRY_TIER), long_string(&tier.name));
        let due_at_ms = now_ms.saturating_add(delay.as_millis() as u64);
        out.push(
            ShortString::from_static(header::RETRY_DUE_AT),
            FieldValue::LongLongInt(due_at_ms as i64),
        );
        // the tier's own name when the delay is the tier's (no jitter, no retry-delay)
        let step = if delay == tier.delay {
            Cow::Borrowed(tier.name.as_str())
        } else {
            Cow::Owned(crate::model::ladder::compact_duration(delay))
        };
        out.push(
            ShortString::from_static(header::RETRY_HISTORY),
            appended_history(h.get(header::RETRY_HISTORY), attempt, &step, now_ms),
        );
        let (properties, carry) = carrying(props, Some(out), except);
        let (exchange, routing_key, kind) = self.wait_in(tier);
        Decision::Forward(Box::new(Forward {
            exchange,
            routing_key,
            properties,
            carry: Some(carry),
            destination: failure.destination,
            attempt,
            late_ms: 0,
            due_at_ms,
            kind,
            counted: Counted::Before,
        }))
    }

    /// Intake of a scheduled delivery: where to (a queue, or an exchange with the routing key
    /// it came with), and when; then the first wait. No attempt is counted.
    fn schedule(&self, props: &BasicProperties, h: &FieldTable, arrival: &Arrival<'_>) -> Decision<'a> {
        let now_ms = arrival.now_ms;
        let target = scheduled_target(h);
        let park = |reason, detail: String, destination: Option<String>| {
            Decision::Park(Park {
                replayed_from: carried_replayed_from(h),
                ..Park::new(reason, detail).to(destination)
            })
        };
        let target = match target {
            Ok(target) => target,
            Err((reason, detail)) => return park(reason, detail, None),
        };
        let queue = target.queue().map(str::to_string);
        if let Some((reason, detail)) = self.check_size(h) {
            return park(reason, detail, queue);
        }
        if let Some(detail) = self.refuse_target(&target) {
            return park(ParkReason::DestinationNotAllowed, detail, queue);
        }
        if !self.spec.exact_delays {
            let detail = format!(
                "ladder {} has exact_delays = false: it schedules no deliveries",
                self.spec.name
            );
            return park(ParkReason::InvalidDelay, detail, queue);
        }
        let due_at = match scheduled_due_at(h, now_ms) {
            Ok(due_at) => due_at,
            Err(detail) => return park(ParkReason::InvalidDelay, detail, queue),
        };
        if arrival.cancelled {
            return park(ParkReason::Cancelled, cancelled_detail(props), queue);
        }
        let mut out = republished_headers(h);
        // the request is answered by `retry-due-at`: a delivered message that fails later and
        // comes back as received is a retry, not another scheduled delivery
        out.remove(header::X_DELAY);
        out.remove(header::DELAY_UNTIL);
        // a delivered retry republished with a delay carries where its next failure was to
        // wait: the scheduled wait must come due as a delivery, not as a routed failure
        out.remove(header::RETRY_NEXT);
        move_user_id(props, &mut out);
        out.set(header::RETRY_SCHEDULED, FieldValue::Boolean(true));
        out.set(header::RETRY_LADDER, long_string(&self.spec.name));
        out.set(header::RETRY_DUE_AT, FieldValue::LongLongInt(due_at as i64));
        if let Target::Exchange(_) = target {
            out.set(
                header::RETRY_ROUTING_KEY,
                FieldValue::LongString(LongString::from(arrival.routing_key)),
            );
        }
        let remaining = due_at.saturating_sub(now_ms);
        let (exchange, routing_key, kind) = if remaining == 0 {
            // due already: through the due queue, which delivers it at once
            (
                Cow::Borrowed(""),
                Cow::Borrowed(self.names.due.as_str()),
                ForwardKind::Wait { tier: "" },
            )
        } else {
            let tier = self.spec.next_wait(Duration::from_millis(remaining));
            out.set(header::RETRY_TIER, long_string(&tier.name));
            self.wait_in(tier)
        };
        Decision::Forward(Box::new(Forward {
            exchange,
            routing_key,
            properties: republished_properties(props, out),
            carry: None,
            destination: target.into_key(),
            attempt: 0,
            late_ms: 0,
            due_at_ms: due_at,
            kind,
            counted: Counted::Before,
        }))
    }

    /// Why the ladder may not deliver to `target`, or `None` if it may.
    pub(super) fn refuse_target(&self, target: &Target) -> Option<String> {
        match target {
            Target::Queue(queue) => self.refuse_destination(queue),
            Target::Exchange(exchange) if exchange.is_empty() || exchange.starts_with("amq.") => Some(format!(
                "exchange {exchange:?} is the broker's; name a queue with retry-to instead"
            )),
            Target::Exchange(exchange) if exchange.starts_with(&self.names.namespace.prefix) => Some(format!(
                "exchange {exchange:?} lies in Ladder's namespace {:?}",
                self.names.namespace.prefix
            )),
            Target::Exchange(exchange) if !self.spec.allow_exchanges.is_match(exchange) => Some(format!(
                "exchange {exchange:?} is not in ladder {}'s allow_exchanges",
                self.spec.name
            )),
            Target::Exchange(_) => None,
        }
    }

    pub(super) fn check_size(&self, headers: &FieldTable) -> Option<(ParkReason, String)> {
        // what is republished: the broker's annotations (x-death, nested and growing with
        // every dead-lettering) are stripped, so they are neither counted nor walked
        let republished = encoded_entries_size(headers.iter().filter(|(k, _)| !is_stripped(k.as_bytes())), 0);
        match republished {
            Err(TooDeep) => Some((
                ParkReason::InvalidHeader,
                format!("headers nest deeper than {MAX_HEADER_DEPTH} levels"),
            )),
            Ok(size) if size > self.limits.max_header_bytes => Some((
                ParkReason::HeaderTooLarge,
                format!(
                    "headers take {size} bytes, above max_header_bytes = {}",
                    self.limits.max_header_bytes
                ),
            )),
            Ok(_) => None,
        }
    }

    /// Why the ladder may not deliver to `queue`, or `None` if it may.
    pub(super) fn refuse_destination(&self, queue: &str) -> Option<String> {
        refuse_destination(self.spec, self.names, queue)
    }

    /// Why the message's sender may not target `destination`, or `None` if it may (or the
    /// ladder lists no senders). Intake only: the sender is the `user_id` property, which the
    /// broker checked against the publishing connection; on later hops it is Ladder's own
    /// publish, and `retry-original-user-id` is a header anyone can write.
    pub(super) fn refuse_sender(
        &self,
        props: &BasicProperties,
        h: &FieldTable,
        destination: &str,
        skip: usize,
    ) -> Option<String> {
        let senders = self.spec.senders.as_ref()?;
        // Dead-lettered out of the very queue it is headed back to. Not "no retry-to": from
        // the second pass on, the message carries the retry-to the ladder set on the first.
        let mode = if death_queue(h, skip).as_deref() == Some(destination) {
            Mode::DeadLetter
        } else {
            Mode::Explicit
        };
        // a user name that is not UTF-8 cannot be one the config lists
        let user = props.user_id.as_ref().map(|u| u.to_string_lossy());
        senders.refuse(&self.spec.name, user.as_deref(), mode, destination)
    }
}

/// Where a scheduled delivery goes: the queue of `retry-to` or the exchange of
/// `retry-to-exchange`, exactly one of them; else why not.
fn scheduled_target(h: &FieldTable) -> Result<Target, (ParkReason, String)> {
    match (h.get(header::RETRY_TO), h.get(header::RETRY_TO_EXCHANGE)) {
        (Some(_), Some(_)) => Err((
            ParkReason::InvalidHeader,
            format!(
                "{} and {} name two targets; give one",
                header::RETRY_TO,
                header::RETRY_TO_EXCHANGE
            ),
        )),
        (Some(queue), None) => check_queue_name(queue)
            .map(Target::Queue)
            .map_err(|p| (ParkReason::InvalidHeader, p)),
        (None, Some(exchange)) => check_exchange_name(exchange)
            .map(Target::Exchange)
            .map_err(|p| (ParkReason::InvalidHeader, p)),
        (None, None) => Err((
            ParkReason::NoDestination,
            format!(
                "a scheduled delivery needs {} (a queue) or {} (an exchange)",
                header::RETRY_TO,
                header::RETRY_TO_EXCHANGE
            ),
        )),
    }
}

/// A failure as the intake read it, every header valid.
struct Failure {
    /// The queue it failed in, where its retry goes.
    destination: String,
    /// Retries it had already (`retry-attempt` as received).
    previous: u64,
    /// `retry-first-failed-at` as received.
    first_failed_at: Option<u64>,
    /// The shortest delay it asks for (`retry-delay`).
    min_delay: Option<Duration>,
    /// Why it failed (`retry-reason`), cut to the bound.
    reason: Option<String>,
}
