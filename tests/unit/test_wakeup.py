"""The feed's hand-off to the worker's event loop, on a real kombu Hub: prompt on every kombu
(5.6's ``call_soon`` from another thread waits for the loop's next poll, up to a second)."""
import threading
import time

from kombu.asynchronous import Hub

from celery_delayed.worker.wakeup import Wakeup


def test_a_wake_up_from_another_thread_runs_on_the_loop_at_once():
    hub = Hub()
    ran = threading.Event()
    on_loop: list[int] = []
    wakeup = Wakeup(hub, lambda: (on_loop.append(threading.get_ident()), ran.set()))
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            hub.run_once()  # nothing else to do: each poll sleeps up to a second

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    time.sleep(0.3)  # the loop is asleep in its poll
    woken = time.monotonic()
    wakeup.wake()
    assert ran.wait(2), "the callback never ran"
    delay = time.monotonic() - woken
    stop.set()
    wakeup.wake()  # let the loop see stop
    thread.join(timeout=3)
    wakeup.unwatch()
    wakeup.close()
    assert on_loop and on_loop[0] == thread.ident, "the callback ran off the loop thread"
    assert delay < 0.5, f"the loop woke {delay * 1000:.0f} ms after the hand-off"
