"""`replay --publish-only --wait` waits through a store outage until its timeout (issue 50).

It had published everything, then exited 2 with ClickHouse's "Code: 279. DB::NetException ... All connection
tries failed" while the store restarted; every window was stored a minute later.
"""
from stragglerscope.replay import wait_windows


class NetworkError(Exception):
    """What clickhouse-driver raises while the server is away (its own class: not ours to import here)."""


class Clock:
    def __init__(self):
        self.t = 0.0

    def sleep(self, s):
        self.t += s

    def monotonic(self):
        return self.t


class FlakyStore:
    """Refuses until ``up_at`` (seconds on the clock), then has the windows stored by ``stored_at``."""

    def __init__(self, clock, up_at, stored_at):
        self.clock, self.up_at, self.stored_at = clock, up_at, stored_at
        self.closed = 0

    def window_stored(self, key):
        if self.clock.t < self.up_at:
            raise NetworkError("Code: 279. DB::NetException: All connection tries failed. Log: \n\n")
        return self.clock.t >= self.stored_at

    def close(self):
        self.closed += 1


KEYS = [("j", 0, w) for w in range(3)]


def test_a_store_outage_is_waited_through_and_said(capsys):
    clock = Clock()
    store = FlakyStore(clock, up_at=40, stored_at=55)
    missing = wait_windows(lambda: store, KEYS, 120, sleep=clock.sleep, monotonic=clock.monotonic)
    assert missing == set()
    err = capsys.readouterr().err
    assert err.count("the store does not answer (NetworkError: Code: 279. DB::NetException: All connection tries "
                     "failed. Log:)") == 1, err
    assert "the store answers again; 3 of 3 windows to come" in err


def test_a_store_that_cannot_be_opened_is_waited_for_too():
    clock = Clock()
    store = FlakyStore(clock, up_at=0, stored_at=30)

    def open_store():
        if clock.t < 20:
            raise ConnectionRefusedError("[Errno 111] Connection refused")
        return store

    assert wait_windows(open_store, KEYS, 120, sleep=clock.sleep, monotonic=clock.monotonic) == set()


def test_the_timeout_still_ends_the_wait_with_what_is_missing():
    clock = Clock()
    store = FlakyStore(clock, up_at=1000, stored_at=1000)
    assert wait_windows(lambda: store, KEYS, 30, sleep=clock.sleep, monotonic=clock.monotonic) == set(KEYS)
    assert 30 <= clock.t <= 32
