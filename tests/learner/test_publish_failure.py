"""The learner's weight publish when it fails (issue 14, item 4): the version that was serving
keeps serving (replicas fetch it), the publish is tried again, and a failure that persists
stops the run with one error naming the cause. Real trainer (the session's tiny policy), real
weight-sync server on loopback, real Redis."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from services.common.config import load_config
from services.common.ports import free_port as _free_port
from services.common.weight_sync import WeightSyncClient
from services.common.weight_sync.notify import version_key
from services.learner.loop import LearnerLoop


def test_a_publish_that_keeps_failing_stops_the_run_and_the_old_version_keeps_serving(
        tmp_path, redis_url, namespace, tiny_policy, caplog):
    rows = [{"data_source": "synth_single", "prompt": [{"role": "user", "content": "q"}],
             "reward_model": {"style": "rule", "ground_truth": {"target": ["a"]}}}]
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    port = _free_port()
    cfg = load_config(None, [
        f"run_dir={tmp_path / 'run'}", f"redis.url={redis_url}", f"redis.namespace={namespace}",
        f"model.path={tiny_policy}", f"data.train_files=[{data}]",
        f"learner.weight_sync_port={port}", "learner.metrics_port=0",
    ])
    loop = LearnerLoop(cfg)
    loop.PUBLISH_RETRY_S = 0.05
    loop._build_trainer()
    loop._start_driver()
    client = WeightSyncClient(f"127.0.0.1:{port}", timeout_s=10, tune_malloc=False)
    module = loop.trainer.policy.module
    try:
        loop._publish_weights()
        version, before = client.fetch()
        assert version == loop.version
        # A model the wire cannot carry (a complex buffer): every attempt fails.
        module.register_buffer("phase", torch.zeros(2, dtype=torch.complex64))
        first = loop.version
        loop.version += 1
        with pytest.raises(RuntimeError, match=rf"publishing policy version {first + 1} failed "
                                               rf"3 times \(replicas keep version {first}\)"
                                               r": ValueError: .*complex"):
            loop._publish_weights()
        assert "trying again (2/3)" in caplog.text
        assert client.get_version()[0] == first  # not "not_published"
        version, after = client.fetch()
        assert version == first and all(torch.equal(before[k], after[k]) for k in before)
        assert int(loop.streams.client.get(version_key(namespace))) == first  # no notice
        del module._buffers["phase"]
        loop._publish_weights()  # the model is publishable again: the version goes out
        assert client.get_version()[0] == first + 1
    finally:
        client.close()
        loop.server.stop(0)
        loop.metrics_server.stop()
        loop.streams.close()
