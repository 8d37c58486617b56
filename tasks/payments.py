"""How task code makes its side effects happen once: the task id is the idempotency key.

celery-delayed runs a task once per task_id, but delivery is at-least-once, so a
worker killed after charging a card and before recording the result runs the
task again.  Pass ``self.request.id`` to the outside system as its idempotency
key (Stripe's ``Idempotency-Key`` header, a unique column in your database...):
the second attempt then changes nothing.
"""
from __future__ import annotations

import time

from celery import shared_task

from .demo import _redis


class PaymentsAPI:
    """A stand-in for a payment provider that honours idempotency keys (kept in Redis)."""

    def charge(self, order_id: str, cents: int, idempotency_key: str) -> bool:
        """Charge once per key; returns False when this key was already charged."""
        r = _redis()
        if not r.set(f"payments:key:{idempotency_key}", order_id, nx=True):
            return False
        r.incrby(f"payments:charged:{order_id}", cents)
        return True


@shared_task(name="tasks.payments.charge", bind=True, acks_late=True)
def charge(self, order_id: str, cents: int, work_seconds: float = 0.0) -> bool:
    """Charge an order; safe to run twice because the task id is the idempotency key."""
    _redis().hincrby("payments:attempts", self.request.id, 1)
    charged = PaymentsAPI().charge(order_id, cents, idempotency_key=self.request.id)
    if work_seconds:
        time.sleep(work_seconds)  # e.g. recording the charge; a kill -9 here is the dangerous moment
    return charged
