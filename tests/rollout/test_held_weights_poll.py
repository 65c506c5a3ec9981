"""A replica holding groups that need newer weights fetches them at its next engine step, not
at its next regular poll (`rollout.weight_poll_s`): the slots kept for those groups would
otherwise stay empty that long. Real WeightSync server and client, the real transformers
engine over the tiny policy, the real worker without its process wrapper."""

from __future__ import annotations

import time

import torch

from services.common.config import load_config
from services.common.trajectory import PromptGroup


def test_held_groups_fetch_their_version_between_steps(engine, tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    from services.common.weight_sync.server import WeightSyncServer
    from services.rollout.worker import HELD_POLL_S, RolloutWorker

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    server = WeightSyncServer(port=0).start()
    server.publish(weights, version=1)
    config = load_config(None, [
        f"model.path={tiny_policy_dir}", "rollout.use_search=false", "rollout.weight_sync=true",
        "rollout.weight_relay=off", "rollout.weight_poll_s=600",
        "learner.weight_sync_host=127.0.0.1", f"learner.weight_sync_port={server.port}"])
    worker = RolloutWorker(config, engine=engine)
    try:
        assert worker._poll_weights(force=True, first=True)
        assert engine.policy_version == 1
        server.publish(weights, version=2)
        # Nothing held: the next poll is the regular one, 600 s away.
        worker._between_steps()
        assert engine.policy_version == 1
        group = PromptGroup(uid="g", data_source="nq", prompt="q", ground_truth={"target": ["x"]},
                            n=2, policy_version_min=2)
        worker._held = [(group, None)]
        worker._last_poll = time.monotonic()
        worker._between_steps()  # polled just now: not again before HELD_POLL_S
        assert engine.policy_version == 1
        time.sleep(HELD_POLL_S)
        worker._between_steps()
        assert engine.policy_version == 2
    finally:
        worker.loop.close()
        server.stop()


def test_a_replica_started_before_the_learner_waits_quietly(engine, tiny_policy_dir, caplog):
    """`forage up` starts every service at once, so a replica may ask for its first weights
    before the learner listens: it keeps asking, says so once at INFO (not a warning a second),
    and loads the weights when they come."""
    import logging
    import threading

    from transformers import AutoModelForCausalLM

    from services.common.ports import free_port
    from services.common.weight_sync.server import WeightSyncServer
    from services.rollout.worker import RolloutWorker

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir), dtype=torch.float32)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    port = free_port()
    config = load_config(None, [
        f"model.path={tiny_policy_dir}", "rollout.use_search=false", "rollout.weight_sync=true",
        "rollout.weight_relay=off", "rollout.weight_poll_s=0.2", "rollout.weight_wait_s=60",
        "learner.weight_sync_host=127.0.0.1", f"learner.weight_sync_port={port}"])
    worker = RolloutWorker(config, engine=engine)
    servers: list[WeightSyncServer] = []

    def learner_comes_up() -> None:
        time.sleep(2.0)
        servers.append(WeightSyncServer(port=port).start())
        servers[0].publish(weights, version=1)

    late = threading.Thread(target=learner_comes_up)
    late.start()
    try:
        with caplog.at_level(logging.INFO, logger="forage"):
            worker._wait_for_first_weights()
        assert engine.policy_version == 1
        ours = [r for r in caplog.records if r.name.startswith("forage.rollout")]
        assert not [r for r in ours if r.levelno >= logging.WARNING], ours
        assert sum("no weights from the learner yet" in r.getMessage() for r in ours) == 1
        assert worker._waiting_since is None  # later failures are warnings again
    finally:
        late.join()
        worker.loop.close()
        for server in servers:
            server.stop()
