"""The thread policy (services/common/threads.py): counts, wait policy, what children inherit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services.common.threads import (
    FILLED_VAR,
    ThreadSettingError,
    apply_thread_policy,
    child_environ,
    parse_cgroup_quota,
    plan_threads,
)

REPO = Path(__file__).resolve().parents[2]


def test_auto_uses_every_core_and_passive_waiting():
    plan = plan_threads({}, cores=2)
    assert plan.threads == 2
    assert plan.env == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                        "OPENBLAS_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE",
                        "TOKENIZERS_PARALLELISM": "false"}


@pytest.mark.parametrize(("cores", "share", "threads"), [(2, 4, 1), (64, 4, 16), (3, 2, 1),
                                                         (1, 1, 1), (96, 1, 96)])
def test_auto_splits_the_cores_between_processes(cores, share, threads):
    plan = plan_threads({"FORAGE_CPU_SHARE": str(share)}, cores=cores)
    assert plan.threads == threads
    assert plan.env["OMP_NUM_THREADS"] == str(threads)


def test_the_users_variables_win_and_are_not_rewritten():
    environ = {"OMP_NUM_THREADS": "3", "FORAGE_THREADS": "5", "OMP_WAIT_POLICY": "ACTIVE",
               "TOKENIZERS_PARALLELISM": "true"}
    plan = plan_threads(environ, cores=2)
    assert plan.threads == 3 and plan.reason == "OMP_NUM_THREADS"
    assert "OMP_NUM_THREADS" not in plan.env and "OMP_WAIT_POLICY" not in plan.env
    assert "TOKENIZERS_PARALLELISM" not in plan.env
    assert plan.env["MKL_NUM_THREADS"] == "3"  # unset ones follow the chosen count


def test_forage_threads_sets_the_count_and_auto_means_default():
    assert plan_threads({"FORAGE_THREADS": "4"}, cores=2).threads == 4
    assert plan_threads({"FORAGE_THREADS": "auto", "FORAGE_CPU_SHARE": "2"}, cores=8).threads == 4


@pytest.mark.parametrize(("name", "value"), [("OMP_NUM_THREADS", "0"), ("FORAGE_THREADS", "x"),
                                             ("FORAGE_CPU_SHARE", "-1"),
                                             ("FORAGE_THREADS", "1.5")])
def test_a_bad_value_names_the_variable(name, value):
    with pytest.raises(ThreadSettingError, match=f"{name}='{value}'"):
        plan_threads({name: value}, cores=2)


def test_values_a_parent_filled_in_are_recomputed_not_taken_as_the_users():
    parent = {}
    apply_thread_policy(parent, cores=2)
    assert parent["OMP_NUM_THREADS"] == "2" and "OMP_NUM_THREADS" in parent[FILLED_VAR]
    # A child that shares the cores with 3 others: the inherited 2 is the policy's, not a
    # user's, so it becomes 2 // 4 -> 1.
    plan = plan_threads({**parent, "FORAGE_CPU_SHARE": "4"}, cores=2)
    assert plan.threads == 1 and plan.env["OMP_NUM_THREADS"] == "1"


def test_child_environ_drops_filled_values_keeps_the_users():
    parent = {"OMP_NUM_THREADS": "6", "PATH": "/bin"}
    apply_thread_policy(parent, cores=2)
    child = child_environ(parent, share=4)
    assert child["OMP_NUM_THREADS"] == "6"  # the user's: kept for every child
    assert "OMP_WAIT_POLICY" not in child and "MKL_NUM_THREADS" not in child
    assert FILLED_VAR not in child and child["FORAGE_CPU_SHARE"] == "4"
    assert plan_threads(child, cores=2).threads == 6
    auto = child_environ(apply_thread_policy_env({}), share=4)
    assert "OMP_NUM_THREADS" not in auto and plan_threads(auto, cores=2).threads == 1


def apply_thread_policy_env(environ: dict[str, str]) -> dict[str, str]:
    apply_thread_policy(environ, cores=2)
    return environ


def test_apply_is_idempotent():
    environ: dict[str, str] = {}
    first = apply_thread_policy(environ, cores=2)
    snapshot = dict(environ)
    second = apply_thread_policy(environ, cores=2)
    assert environ == snapshot and first.threads == second.threads == 2


@pytest.mark.parametrize(("cpu_max", "v1", "expected"), [
    ("max 100000\n", None, None),
    ("200000 100000\n", None, 2),
    ("150000 100000", None, 2),  # 1.5 CPUs: 2 threads, not 1
    ("50000 100000", None, 1),
    ("garbage", None, None),
    (None, ("-1", "100000"), None),
    (None, ("400000", "100000"), 4),
    (None, None, None),
])
def test_cgroup_quota(cpu_max, v1, expected):
    quota_us, period_us = v1 if v1 else (None, None)
    assert parse_cgroup_quota(cpu_max, quota_us, period_us) == expected


def test_a_malformed_variable_stops_forage_with_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "services.cli", "retriever", "serve", "--index", "x"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "FORAGE_THREADS": "many"},
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "forage retriever: error: FORAGE_THREADS='many': must be a positive integer")
