"""A Celery app behind a Ladder ladder (Celery 5.5 or newer, dead-letter mode).

    cd examples/celery && celery -A tasks worker -P solo --without-gossip --without-mingle
    celery -A tasks call tasks.charge --args '["order-1"]'

The task queue dead-letters into the ladder's exchange, and a task that raises is rejected
without requeue: the broker hands the task message to the ladder, which sends it back to this
queue after its backoff, and parks it after max_attempts. Celery's own retry() stays unused.

AMQP_URL names the broker (default amqp://guest:guest@127.0.0.1:5672/%2f), CELERY_QUEUE the
task queue (default orders), LADDER_EXCHANGE the ladder's exchange (default ladder.default),
and FAIL_ALWAYS=1 makes every task fail. Each run prints `<task id> attempt=<n>` on stdout,
and `<task id> done` once it succeeded.
"""

import os

from celery import Celery
from kombu import Exchange, Queue

AMQP_URL = os.environ.get("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/%2f")
QUEUE = os.environ.get("CELERY_QUEUE", "orders")  # the queue the workers consume
LADDER = os.environ.get("LADDER_EXCHANGE", "ladder.default")  # <namespace>.<ladder>
FAIL_ALWAYS = os.environ.get("FAIL_ALWAYS") == "1"  # every task fails

app = Celery("tasks", broker=AMQP_URL)

# README:dead-letter:start
# The queue dead-letters into the ladder; a task that raises is rejected, not acked.
app.conf.update(
    task_queues=[
        Queue(QUEUE, Exchange(""), routing_key=QUEUE, queue_arguments={
            "x-queue-type": "quorum",
            "x-dead-letter-exchange": LADDER,
        }),
    ],
    task_default_queue=QUEUE,
    task_default_exchange="",
    task_default_routing_key=QUEUE,
    task_acks_late=True,  # ack after the run, so that a failure can be rejected
    task_acks_on_failure_or_timeout=False,  # reject a failure, without requeue
    task_reject_on_worker_lost=False,  # a task that kills its process: rejected too
    worker_prefetch_multiplier=1,
)


@app.task(bind=True)
def charge(self, order):
    headers = self.request.headers or {}
    attempt = headers.get("retry-attempt", 0)  # 0 = first run; the ladder counts
    print(f"{self.request.id} attempt={attempt}", flush=True)
    if FAIL_ALWAYS:
        raise RuntimeError(f"payment service down, order {order}")
    print(f"{self.request.id} done", flush=True)
# README:dead-letter:end


app.conf.update(
    task_ignore_result=True,  # no result backend: the examples need none
    worker_redirect_stdouts=False,  # the task's lines stay on stdout
    worker_enable_remote_control=False,  # no pidbox queue per worker
    worker_send_task_events=False,
    broker_connection_retry_on_startup=True,
)
