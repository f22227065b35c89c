"""Contract of `placement.ray_session` for a local Ray (issue 15.13): Ray's own servers listen on all interfaces
(Ray 2.60 has no loopback setting for them), so a local session must run with Ray's token authentication, which it
does unless RAY_AUTH_MODE turns it off, and then the driver says so loudly; the dashboard is off or on 127.0.0.1."""

import logging
import os

import ray

from miles_vl.orchestration import placement


def test_a_local_session_runs_with_token_authentication(monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert not ray.is_initialized()
    with placement.ray_session(None, num_cpus=1):
        assert os.environ.get("RAY_AUTH_MODE") == "token"  # what Ray's processes of this session inherit
    assert not ray.is_initialized()


def test_turning_authentication_off_is_warned_about(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with caplog.at_level(logging.WARNING, logger="miles_vl.orchestration.placement"):
        with placement.ray_session(None, num_cpus=1, dashboard=True):
            pass
    assert "RAY_AUTH_MODE=disabled" in caplog.text and "without authentication" in caplog.text
    assert calls[0]["dashboard_host"] == "127.0.0.1" and calls[0]["include_dashboard"] is True
