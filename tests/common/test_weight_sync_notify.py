"""Redis notice of new weight versions, and a follower that fetches on the notice."""

from __future__ import annotations

import threading

import redis
import torch

from services.common.weight_sync import (
    VersionListener,
    WeightFollower,
    WeightSyncClient,
    WeightSyncServer,
    notify_new_version,
    version_key,
)


def test_listener_hears_notices_and_reads_late_ones(redis_url, namespace):
    client = redis.Redis.from_url(redis_url)
    notify_new_version(client, namespace, 3)  # before anyone listens: the key remembers it
    listener = VersionListener(client, namespace)
    try:
        assert listener.latest() == 3
        assert listener.wait(0.1) == 3
        assert listener.wait(0.1) is None  # nothing newer
        timer = threading.Timer(0.2, notify_new_version, args=(client, namespace, 5))
        timer.start()
        assert listener.wait(5.0) == 5
        timer.join()
        notify_new_version(client, "other-" + namespace, 9)  # other runs do not leak in
        assert listener.wait(0.2) is None
        client.delete(version_key("other-" + namespace))
    finally:
        listener.close()
        client.close()


def test_follower_fetches_when_notified(redis_url, namespace):
    rclient = redis.Redis.from_url(redis_url)
    server = WeightSyncServer(chunk_bytes=1024).start()
    listener = VersionListener(rclient, namespace)
    try:
        weights = {"w": torch.zeros(300, dtype=torch.bfloat16)}
        loaded: list[int] = []

        def apply(version, tensors):
            weights.update(tensors)
            loaded.append(version)

        client = WeightSyncClient(server.address, timeout_s=10)
        follower = WeightFollower(client, apply, listener=listener, expect=lambda: weights)
        assert follower.poll(wait_s=0.05) is False  # nothing published yet
        server.publish({"w": torch.full((300,), 2.0, dtype=torch.bfloat16)}, 1)
        notify_new_version(rclient, namespace, 1)
        assert follower.poll(wait_s=5.0) is True
        assert loaded == [1] and follower.version == 1
        assert torch.equal(weights["w"], torch.full((300,), 2.0, dtype=torch.bfloat16))
        assert follower.poll(wait_s=0.05) is False  # already current
        client.close()
    finally:
        listener.close()
        rclient.close()
        server.stop(0)
