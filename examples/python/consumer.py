#!/usr/bin/env python3
"""A complete Ladder consumer in Python (pika 1.2 or newer).

    consumer.py explicit|dead-letter [--queue orders] [--exchange ladder.default]
                                     [--prefetch 10] [--fail-always]

explicit: on failure, publish the message to the ladder's exchange with retry-to = the queue
(publisher confirms, mandatory), then ack the original; nack it with requeue if the publish is
not confirmed. dead-letter: declare the queue with x-dead-letter-exchange = the ladder's
exchange, and reject a failed message with requeue=false.

AMQP_URL names the broker (default amqp://guest:guest@127.0.0.1:5672/%2f). Each delivery
prints one line on stdout, `<message_id> attempt=<retry-attempt or 0>`; logs go to stderr.
"""

import argparse
import copy
import logging
import os
import sys

import pika

log = logging.getLogger("consumer")
QUEUE = "orders"  # the queue this service consumes
LADDER = "ladder.default"  # the ladder's exchange: <namespace>.<ladder>
PREFETCH = 10  # unacked deliveries at most
FAIL_ALWAYS = False  # --fail-always: handle fails every message


def handle(body):
    """The service's own work. Fails every message with --fail-always."""
    if FAIL_ALWAYS:
        raise RuntimeError("simulated failure (--fail-always)")


# README:explicit:start
# Explicit mode: on failure, publish the message to the ladder with retry-to = our queue.
def consume_explicit(channel):
    channel.queue_declare(QUEUE, durable=True, arguments={"x-queue-type": "quorum"})
    channel.confirm_delivery()  # basic_publish now returns once the broker confirmed it
    channel.basic_qos(prefetch_count=PREFETCH)
    channel.basic_consume(QUEUE, on_message_explicit)
    channel.start_consuming()


def on_message_explicit(ch, method, props, body):
    attempt = (props.headers or {}).get("retry-attempt", 0)  # 0 = first delivery
    print(f"{props.message_id} attempt={attempt}", flush=True)
    try:
        handle(body)
    except Exception as exc:
        log.warning("%s: attempt %s failed: %s", QUEUE, attempt, exc)
        headers = dict(props.headers or {})  # a copy: retry-attempt etc. travel along
        headers.update({"retry-to": QUEUE, "retry-reason": str(exc)[:200]})
        retry = copy.copy(props)  # as received, less expiration and user_id, persistent
        retry.expiration = retry.user_id = None
        retry.delivery_mode, retry.headers = 2, headers
        try:
            ch.basic_publish(LADDER, "", body, properties=retry, mandatory=True)
        except (pika.exceptions.NackError, pika.exceptions.UnroutableError) as refused:
            log.warning("%s: retry not confirmed, requeueing: %r", QUEUE, refused)
            ch.basic_nack(method.delivery_tag, requeue=True)  # keep it
            return
    ch.basic_ack(method.delivery_tag)  # after a failure: only once the retry is confirmed


# README:explicit:end

# README:dead-letter:start
# Dead-letter mode: the queue dead-letters into the ladder; on failure, reject the message.
def consume_dead_letter(channel):
    channel.queue_declare(QUEUE, durable=True, arguments={
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": LADDER,
    })
    channel.basic_qos(prefetch_count=PREFETCH)
    channel.basic_consume(QUEUE, on_message_dead_letter)
    channel.start_consuming()


def on_message_dead_letter(ch, method, props, body):
    attempt = (props.headers or {}).get("retry-attempt", 0)  # 0 = first delivery
    print(f"{props.message_id} attempt={attempt}", flush=True)
    try:
        handle(body)
    except Exception as exc:
        log.warning("%s: attempt %s failed: %s", QUEUE, attempt, exc)
        ch.basic_reject(method.delivery_tag, requeue=False)  # dead-letters it to the ladder
        return
    ch.basic_ack(method.delivery_tag)


# README:dead-letter:end


def main():
    global QUEUE, LADDER, PREFETCH, FAIL_ALWAYS
    parser = argparse.ArgumentParser(description="A Ladder consumer.")
    parser.add_argument("mode", choices=["explicit", "dead-letter"])
    parser.add_argument("--queue", default=QUEUE, help="the queue to consume (and to return failures to)")
    parser.add_argument("--exchange", default=LADDER, help="the ladder's exchange, <namespace>.<ladder>")
    parser.add_argument("--prefetch", type=int, default=PREFETCH, help="unacked deliveries at most")
    parser.add_argument("--fail-always", action="store_true", help="fail every message")
    args = parser.parse_args()
    QUEUE, LADDER, PREFETCH, FAIL_ALWAYS = args.queue, args.exchange, args.prefetch, args.fail_always
    logging.basicConfig(level=logging.INFO, format="consumer: %(message)s", stream=sys.stderr)
    logging.getLogger("pika").setLevel(logging.WARNING)

    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    log.info("%s mode: consuming %s, failures go to %s", args.mode, QUEUE, LADDER)
    try:
        if args.mode == "explicit":
            consume_explicit(channel)
        else:
            consume_dead_letter(channel)
    except KeyboardInterrupt:
        connection.close()


if __name__ == "__main__":
    main()
