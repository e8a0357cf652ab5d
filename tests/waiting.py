"""How tests wait: on a state or an event, never on a wall-clock limit a loaded machine can miss.

``HANG_S`` is no timing: no wait comes near it unless something hangs. It only keeps a hung test (a server that
never starts, a subprocess stuck) from holding CI forever, so it bounds every poll, join, event wait, HTTP
client and subprocess in the suite.
"""

import time

HANG_S = 600.0


def wait_until(predicate, what: str, poll_s: float = 0.02):
    """Poll ``predicate`` until it holds (a state another thread changes); fail only if it hangs."""
    deadline = time.monotonic() + HANG_S
    while not predicate():
        assert time.monotonic() < deadline, f"hung waiting for {what}"
        time.sleep(poll_s)
