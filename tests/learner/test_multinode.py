"""The learner on two "nodes": two separate torchrun launches (`--nnodes 2`, one CPU rank each,
c10d rendezvous on loopback), as docs/deploy.md's bare-node commands start them.

- The fixed batches of dist_step_script.py under ZeRO-3 (every parameter partitioned across
  the nodes) give the loss, gradient norm and weights of one process (test_multirank.py's
  comparison).
- `forage learner train` across the nodes (rank 0 on node 0 drives Redis and serves weights;
  node 1's first rank answers /healthz for its node): node 1 is killed (its torchrun and its
  rank, as a lost machine takes both), node 0 stops in bounded time with a non-zero exit and
  one line saying why, and both nodes relaunched with --resume continue from the last complete
  checkpoint.
- A checkpoint directory that is not shared by every rank is refused at start, on every rank,
  and so is a rendezvous that put global rank 0 on another node than FORAGE_NODE_RANK=0.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from services.learner import distributed as D
from tests.process_tree import kill_tree


def _helpers(name: str):
    spec = importlib.util.spec_from_file_location(f"multinode_{name}",
                                                  Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


H = _helpers("test_loop")  # write_run, Script, start_torchrun, read_metrics
MR = _helpers("test_multirank")  # step_command, step_results, assert_same_updates
SHARED_DIR_SCRIPT = Path(__file__).with_name("dist_shared_dir_script.py")


def node_launch(node: int, port: int, run_id: str, nodes: int = 2) -> list[str]:
    """torchrun's arguments for `node` of `nodes` on loopback.

    c10d rendezvous at 127.0.0.1:`port`, hosted by node 0 (`is_host`, as the rendezvous
    endpoint's own machine would be). c10d ignores --node-rank and orders the nodes by
    --local-addr, so each node gets 127.0.0.<node + 1> (all loopback): node 0 sorts first and
    holds global rank 0, as pod 0's DNS name does in deploy/k8s/multinode-learner, and
    FORAGE_NODE_RANK (`node_env`) lets the learner check it."""
    return [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}", f"--rdzv-conf=is_host={int(node == 0)}",
            f"--local-addr=127.0.0.{node + 1}"]


def node_env(node: int) -> dict[str, str]:
    return {D.NODE_RANK_ENV: str(node)}


def kill_node(proc: subprocess.Popen) -> None:
    """SIGKILL a node: its torchrun and every process under it (a lost machine takes both)."""
    kill_tree(proc)


def test_placement_and_lost_peer_classification() -> None:
    """Rank 0 on a node other than FORAGE_NODE_RANK=0 is refused; only rank 0 is checked. A
    failure of a torch.distributed operation (also when wrapped by another exception) reads
    as lost ranks; an ordinary error does not."""
    import torch.distributed as dist

    assert D.driver_node_error(0, None) is None
    assert D.driver_node_error(0, "0") is None
    assert D.driver_node_error(1, "1") is None
    assert "FORAGE_NODE_RANK=1" in D.driver_node_error(0, "1")
    lost = dist.DistNetworkError("Connection closed by peer [127.0.0.1]:4711")
    try:
        try:
            raise lost
        except dist.DistError as inner:
            raise RuntimeError("step failed") from inner
    except RuntimeError as outer:
        assert "Connection closed by peer" in D.lost_peer(outer)
    assert D.lost_peer(RuntimeError("Connection closed by peer")) is None  # not from torch
    assert D.lost_peer(ValueError("bad")) is None


def test_process_group_is_destroyed_before_the_interpreter_exits() -> None:
    """A process that joined a group destroys it at exit, before exit-time destructors run
    (left to them, a gloo rank can abort with SIGABRT after its work is done). The probe is
    registered before the group, so it runs after `shutdown` (atexit runs last-in first-out)."""
    import sys

    probe = ("import atexit, torch.distributed as dist\n"
             "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
             "from services.learner import distributed as D\n"
             "D.ensure_distributed()\n"
             "assert dist.is_initialized()\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "initialized at exit: False", result.stdout


def test_rank_variables_without_a_rendezvous_address() -> None:
    """RANK / WORLD_SIZE left in the environment without MASTER_ADDR / MASTER_PORT (another
    tool set them; seen in the suite): one rank makes its own loopback group; several ranks get
    one line naming the missing variables and exit 2, not a traceback."""
    import os
    import sys

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    one = subprocess.run(
        [sys.executable, "-c", "from services.learner import distributed as D\n"
         "D.ensure_distributed(); print(D.world_size())"],
        env={**env, "RANK": "0", "WORLD_SIZE": "1"}, cwd=root, capture_output=True, text=True,
        timeout=120)
    assert one.returncode == 0 and one.stdout.strip() == "1", one.stderr[-2000:]
    two = subprocess.run(
        [sys.executable, "-c", "from services.common.config import ConfigError\n"
         "from services.learner import distributed as D\n"
         "try:\n    D.ensure_distributed()\nexcept ConfigError as exc:\n    print(exc)"],
        env={**env, "RANK": "0", "WORLD_SIZE": "2"}, cwd=root, capture_output=True, text=True,
        timeout=120)
    assert two.returncode == 0 and "MASTER_ADDR and MASTER_PORT not" in two.stdout, two.stderr


def test_checkpoint_dir_must_be_shared_by_every_rank(tmp_path) -> None:
    """One directory passes; a directory per rank is refused on both ranks (neither hangs), and
    so is one rank 0 cannot write; a checkpoint that rank 0 sees and the other rank cannot read
    is refused too."""
    cmd = [str(MR.TORCHRUN), "--standalone", "--nproc_per_node=2", str(SHARED_DIR_SCRIPT),
           str(tmp_path)]
    result = subprocess.run(cmd, env=MR.step_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"result_rank{rank}.json").read_text())
        assert seen["shared"] == "ok", rank
        assert seen["per_rank"].startswith("refused: ") and "1 of 2 ranks" in seen["per_rank"]
        assert "shared volume" in seen["per_rank"]
        assert seen["agreed_shared"] == str(tmp_path / "ckpt0" / "step_00000004")
    first = json.loads((tmp_path / "result_rank0.json").read_text())
    assert first["agreed"] == "ok"
    assert first["unwritable"].startswith("os error: ")
    second = json.loads((tmp_path / "result_rank1.json").read_text())
    assert second["unwritable"].startswith("refused: rank 0 could not write"), second
    agreed = json.loads((tmp_path / "result_rank1.json").read_text())["agreed"]
    assert agreed.startswith("refused: rank 1 cannot read"), agreed
    assert not list((tmp_path / "shared").glob(".shared-check-*"))  # rank 0 cleaned up


def test_rank_0_on_another_node_is_refused_on_every_rank(tmp_path) -> None:
    """The nodes' FORAGE_NODE_RANK swapped against their --local-addr order: global rank 0
    lands on the node that says 1, and both ranks stop when they join the group (before any
    model is loaded), neither waiting for the other."""
    port = H._free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [subprocess.Popen([str(MR.TORCHRUN), *node_launch(n, port, "swapped"),
                               "--nproc_per_node=1", str(SHARED_DIR_SCRIPT), str(tmp_path)],
                              env={**MR.step_env(), **node_env(1 - n)}, stdout=logs[n].open("w"),
                              stderr=subprocess.STDOUT) for n in (0, 1)]
    try:
        codes = [node.wait(timeout=120) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    assert all(code != 0 for code in codes), codes
    assert "NodePlacementError: global rank 0 (the weight server) started on the node with " \
           "FORAGE_NODE_RANK=1" in logs[0].read_text()
    assert "NodePlacementError: global rank 0 started on another node" in logs[1].read_text()
    assert not list(tmp_path.glob("result_rank*.json"))


@pytest.mark.slow
def test_two_nodes_equal_one_process(tiny_policy, tmp_path) -> None:
    one, m1 = MR._run(tiny_policy, tmp_path / "one", 1, 0)
    out = tmp_path / "nodes"
    out.mkdir()
    port = H._free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    # Node 1 starts first (the lower pid, c10d's next sort key after the address): rank 0 still
    # lands on node 0 only if the nodes are ordered by --local-addr, which the Kubernetes
    # variant relies on; FORAGE_NODE_RANK makes the trainer refuse any other order.
    nodes = [subprocess.Popen(MR.step_command(tiny_policy, out, 1, 3,
                                              launch=node_launch(n, port, "equal")),
                              env={**MR.step_env(), **node_env(n)}, stdout=logs[n].open("w"),
                              stderr=subprocess.STDOUT) for n in (1, 0)][::-1]
    try:
        for node, log in zip(nodes, logs, strict=True):
            assert node.wait(timeout=240) == 0, log.read_text()[-4000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    two, m2 = MR.step_results(out)
    MR.assert_same_updates(one, m1, two, m2)


@pytest.mark.slow
def test_lost_node_stops_the_run_and_both_resume(tmp_path, redis_url, namespace,
                                                 tiny_policy) -> None:
    config = H.write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=50,
                         save_every=2, zero_stage=2)
    run_dir = tmp_path / "run"
    script = H.Script(redis_url, namespace)
    opened = {"gate": False}

    def plan(group, nth: int) -> str:
        # 2 groups per step (synchronous): answer three steps' groups, then none until the
        # gate opens, so node 1 dies while rank 0 waits for step 4's batch.
        return "normal" if opened["gate"] or len(script.seen) <= 6 else "ignore"

    def start(node: int, port: int, log: Path, *extra: str) -> subprocess.Popen:
        return H.start_torchrun(config, log, 1, *extra, launch=node_launch(node, port, "run"),
                                env=node_env(node))

    port = H._free_port()
    logs = [tmp_path / f"node{n}.log" for n in (0, 1)]
    nodes = [start(n, port, logs[n]) for n in (0, 1)]
    metrics = run_dir / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and all(p.poll() is None for p in nodes):
            script.serve(nodes[0], plan, until=time.time() + 0.5)
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
        assert [p.poll() for p in nodes] == [None, None], logs[0].read_text()[-4000:]
        assert [m["step"] for m in H.read_metrics(run_dir)] == [1, 2, 3]
        # Node 1 answers its pod's probes itself; its /metrics is empty (rank 0's numbers only).
        [line] = [x for x in logs[1].read_text().splitlines() if "this node's /healthz" in x]
        health = f"http://127.0.0.1:{int(line.rsplit(' ', 1)[1])}"
        assert urllib.request.urlopen(f"{health}/healthz", timeout=5).status == 200
        assert urllib.request.urlopen(f"{health}/metrics", timeout=5).read() == b""
        assert "weights on" in logs[0].read_text() and "weights on" not in logs[1].read_text()

        kill_node(nodes[1])
        opened["gate"] = True  # step 4's batch arrives: rank 0's next collective fails
        killed = time.monotonic()
        while nodes[0].poll() is None and time.monotonic() - killed < 90:
            script.serve(nodes[0], plan, until=time.time() + 0.5)
        stopped_s = time.monotonic() - killed
        assert nodes[0].poll() not in (None, 0), logs[0].read_text()[-4000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    assert stopped_s < 60, stopped_s
    text = logs[0].read_text()
    assert "forage learner train: error: lost contact with the other ranks" in text, text[-4000:]
    assert "the last complete checkpoint is step 2" in text
    # one line, not a traceback through Forage's code calling it a bug
    assert f'File "{H.ROOT / "services"}' not in text and "internal error" not in text
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"

    # Both nodes again, with --resume: step 3 (trained, never checkpointed) is trained again.
    config = H.write_run(tmp_path, redis_url, namespace, tiny_policy, total_steps=4,
                         save_every=2, zero_stage=2)
    port = H._free_port()
    resumed = [tmp_path / f"resumed{n}.log" for n in (0, 1)]
    nodes = [start(n, port, resumed[n], "--resume") for n in (0, 1)]
    try:
        script.serve(nodes[0], plan, until=time.time() + 240)
        for node, log in zip(nodes, resumed, strict=True):
            assert node.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    assert [m["step"] for m in H.read_metrics(run_dir)] == [1, 2, 3, 4]
    for log in resumed:  # every rank loaded its part of the same checkpoint
        assert "resumed from" in log.read_text() and "step_00000002 at step 2" in log.read_text()
    last = run_dir / "checkpoints" / "step_00000004"
    assert (last / "rng_rank0.json").is_file() and (last / "rng_rank1.json").is_file()
