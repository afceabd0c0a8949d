"""The feed folder a fed training job reads its rollout batches from (no workers here)."""

from __future__ import annotations

import threading
import time

from _factories import rollouts

from varbatch_kit.train.runs.rollout_feed import FeedBatch, RolloutFeed


def test_batches_arrive_in_order_and_stop_ends_the_feed(tmp_path):
    feed = RolloutFeed(str(tmp_path / "feed"), horizon=10)
    first = FeedBatch(rollouts([3, 4]), steps=["s1"], log_prob_steps=["l1"])
    feed.put(0, first)
    got = feed.next_batch(0)
    assert got.steps == ["s1"] and got.log_prob_steps == ["l1"]
    assert list(got.rollouts.response_len) == [3, 4]
    assert feed.done(0) is None
    feed.mark_done(0, {"first_step": 1, "last_step": 1, "params": "p"})
    assert feed.done(0) == {"first_step": 1, "last_step": 1, "params": "p"}
    # nothing put yet: the reader waits (calling `wait` about once a second), then the stop
    calls = []
    threading.Timer(1.3, feed.stop).start()
    t0 = time.monotonic()
    assert feed.next_batch(1, wait=lambda: calls.append(1)) is None
    assert time.monotonic() - t0 >= 1.2 and len(calls) >= 1
    # a batch put before the stop is still read: the stop ends the feed after it
    feed.put(1, first)
    assert feed.next_batch(1) is not None
    assert not list((tmp_path / "feed").glob(".*tmp"))  # every file written whole, renamed
