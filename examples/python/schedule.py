#!/usr/bin/env python3
"""Scheduled deliveries with Ladder in Python (pika 1.2 or newer), in place of the
rabbitmq-delayed-message-exchange plugin.

    schedule.py [--queue orders] [--exchange ladder.default]

Publishes s1, s2 and s3 to the ladder's exchange with x-delay 300, 600 and 900 ms and
retry-to = the queue (publisher confirms, mandatory), then consumes the queue. Each delivery
prints one line on stdout, `<message_id> waited_ms=<ms since it was published>`; exits 0 once
all three came, 1 if they did not within 10 s. AMQP_URL names the broker (default
amqp://guest:guest@127.0.0.1:5672/%2f). The ladder needs exact_delays = true (the default).
"""

import argparse
import os
import sys
import time

import pika

DELAYS = {"s1": 300, "s2": 600, "s3": 900}  # message_id -> x-delay in ms
TIMEOUT = 10.0  # seconds to wait for all three deliveries


# README:schedule:start
# Plugin: exchange_declare(X, "x-delayed-message", arguments={"x-delayed-type": "direct"}),
# queue_bind(queue, X, key), publish to X. Ladder: nothing to declare or bind; publish to the
# ladder's exchange <namespace>.<ladder> and name the queue in retry-to.
def publish_scheduled(channel, ladder, queue, message_id, delay_ms, body):
    headers = {
        "x-delay": delay_ms,  # as with the plugin: ms from now (or "delay-until": epoch ms)
        "retry-to": queue,  # new: the queue to deliver to (or "retry-to-exchange": an exchange)
    }
    props = pika.BasicProperties(message_id=message_id, delivery_mode=2, headers=headers)
    # On a confirm_delivery() channel this returns once the ladder holds the message, and
    # raises NackError or UnroutableError (mandatory: the plugin could not do that) otherwise.
    channel.basic_publish(ladder, "", body, properties=props, mandatory=True)


# README:schedule:end


def main():
    parser = argparse.ArgumentParser(description="Scheduled deliveries through a Ladder ladder.")
    parser.add_argument("--queue", default="orders", help="the queue to deliver to and consume")
    parser.add_argument("--exchange", default="ladder.default", help="the ladder's exchange, <namespace>.<ladder>")
    args = parser.parse_args()

    url = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    # your own queue, as before; Ladder delivers to it through the default exchange
    channel.queue_declare(args.queue, durable=True, arguments={"x-queue-type": "quorum"})
    channel.confirm_delivery()

    sent = {}
    for message_id, delay_ms in DELAYS.items():
        sent[message_id] = time.monotonic()
        publish_scheduled(channel, args.exchange, args.queue, message_id, delay_ms, b"hello")

    deadline = time.monotonic() + TIMEOUT
    waiting = set(DELAYS)
    for method, props, _body in channel.consume(args.queue, inactivity_timeout=0.1):
        if method is not None:
            waited_ms = int((time.monotonic() - sent[props.message_id]) * 1000)
            print(f"{props.message_id} waited_ms={waited_ms}", flush=True)
            channel.basic_ack(method.delivery_tag)
            waiting.discard(props.message_id)
        if not waiting:
            break
        if time.monotonic() > deadline:
            print(f"schedule: {sorted(waiting)} not delivered within {TIMEOUT} s", file=sys.stderr)
            sys.exit(1)
    connection.close()


if __name__ == "__main__":
    main()
