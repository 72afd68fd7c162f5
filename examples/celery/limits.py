"""What not to do behind a ladder: Celery's own retry() on top of it.

A task that calls self.retry() is retried by Celery first, with its own countdown; the ladder
sees the message only once Celery gave up (MaxRetriesExceededError). Behind a ladder of
max_attempts = 2, this task runs 1 + 2 + 2 = 5 times before it is parked, and its first
retries wait in the worker's memory or in Celery's own delay queues, not in the ladder's
(tests/it/examples/frameworks.rs, celery_own_retry_runs_before_the_ladder).

    cd examples/celery && FAIL_ALWAYS=1 celery -A limits worker -P solo

Each run prints `<task id> attempt=<retry-attempt or 0> retries=<Celery's retries>`.
"""

from tasks import FAIL_ALWAYS, app


@app.task(bind=True, max_retries=2)
def charge_with_own_retry(self, order):
    attempt = (self.request.headers or {}).get("retry-attempt", 0)
    print(f"{self.request.id} attempt={attempt} retries={self.request.retries}", flush=True)
    if FAIL_ALWAYS:
        exc = RuntimeError(f"payment service down, order {order}")
        raise self.retry(exc=exc, countdown=1)  # past max_retries: raises exc, to the ladder
