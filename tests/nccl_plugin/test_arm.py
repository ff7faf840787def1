"""Arming the NCCL profiler plugin for a traced job (``ingest.nccl_profiler.arm``, ``ingest.autotrace.session``):
environment only, no process, no library loaded."""
from __future__ import annotations

import os

import pytest

import ingest.nccl_profiler as plugin
from ingest.autotrace import session
from ingest.autotrace.session import TraceSettings


@pytest.fixture
def built(tmp_path, monkeypatch):
    lib = tmp_path / plugin.LIB_NAME
    lib.write_bytes(b"")
    monkeypatch.setattr(plugin, "library_path", lambda: lib)
    return lib


def test_arm_points_nccl_at_the_library_and_the_plugin_at_a_folder(tmp_path, built):
    env: dict[str, str] = {}
    assert plugin.arm(env, str(tmp_path / "peers")) is None
    assert env == {"NCCL_PROFILER_PLUGIN": str(built), "STRAGGLERSCOPE_NCCL_PEERS_DIR": str(tmp_path / "peers")}
    assert (tmp_path / "peers").is_dir()


def test_a_missing_library_or_the_users_own_plugin_leaves_the_job_as_it_was(tmp_path, built, monkeypatch):
    env = {"NCCL_PROFILER_PLUGIN": "/opt/theirs.so"}
    note = plugin.arm(env, str(tmp_path / "peers"))
    assert "kept" in note and env == {"NCCL_PROFILER_PLUGIN": "/opt/theirs.so"}
    monkeypatch.setattr(plugin, "library_path", lambda: None)
    env = {}
    assert "not built" in plugin.arm(env, str(tmp_path / "peers")) and env == {}


def test_the_session_arms_nccl_jobs_only_once_per_process(tmp_path, built, monkeypatch):
    monkeypatch.setattr(session, "_armed", TraceSettings(job_id="j", bootstrap="x:1", run_dir=str(tmp_path)))
    monkeypatch.setattr(session, "_nccl_checked", False)
    monkeypatch.setattr(session, "_nccl_note", None)
    for key in ("NCCL_PROFILER_PLUGIN", "STRAGGLERSCOPE_NCCL_PEERS_DIR"):
        monkeypatch.delenv(key, raising=False)
    session._arm_nccl(("gloo",), {})  # a CPU job: nothing set, and a later NCCL init may still arm
    assert "NCCL_PROFILER_PLUGIN" not in os.environ and not session._nccl_checked
    session._arm_nccl((), {"backend": "cpu:gloo,cuda:nccl"})
    assert os.environ["NCCL_PROFILER_PLUGIN"] == str(built)
    assert os.environ["STRAGGLERSCOPE_NCCL_PEERS_DIR"] == str(tmp_path / "nccl-peers")
    assert session._nccl_checked and session._nccl_note is None
