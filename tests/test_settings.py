"""TRAINMEDIC_* settings: the client's (training jobs, node agents) and the service's, their defaults and errors."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from trainmedic.client import RemediationClient
from trainmedic.client.settings import Settings, SettingsError
from trainmedic.service.settings import ServiceSettings

from tests.conftest import ROOT, SIGNING_KEY

CLIENT_FIELDS = {"redis_url", "signing_key", "verify_keys", "dry_run", "job", "log_level"}
# What a duration's error says it may be.
DURATION = "(use e.g. 30s, 10m, 1h30m, 7d; at most three terms and 3650d in all) or a number of seconds"
# Variables only the service reads, each with a value it refuses.
BAD_SERVICE_VALUES = {"TRAINMEDIC_REQUEST_DEADLINE": "abc", "TRAINMEDIC_HISTORY_MAX": "0",
                      "TRAINMEDIC_REDIS_FSYNC": "sometimes", "TRAINMEDIC_PUBLIC_URL": "ftp://x",
                      "TRAINMEDIC_HANG_AFTER": "soon", "TRAINMEDIC_WEBHOOK_TOKEN_FILE": "/nonexistent/token",
                      "TRAINMEDIC_WORKER_BUFFER": "1"}


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_clients_settings_are_only_what_training_jobs_and_node_agents_read() -> None:
    assert names(Settings) == CLIENT_FIELDS
    # The service reads the client's settings too, and its own beside them.
    assert issubclass(ServiceSettings, Settings) and CLIENT_FIELDS < names(ServiceSettings)
    assert {"webhook_token", "operator_token", "operator_tokens_file", "read_token", "allowed_hosts", "public_url",
            "alertmanager_urls", "alertmanager_trust_after", "prometheus_url", "notify_url", "history_max",
            "hang_after", "redis_fsync", "resync_after", "url", "bind", "workers", "threads", "request_deadline",
            "worker_buffer", "data_dir", "playbooks"} == names(ServiceSettings) - CLIENT_FIELDS


def test_unset_variables_give_the_documented_defaults() -> None:
    assert Settings.from_env({}) == Settings()
    s = ServiceSettings.from_env({})
    assert s == ServiceSettings()
    assert (s.url, s.bind, s.workers, s.threads, s.request_deadline) == ("http://127.0.0.1:9095", "127.0.0.1:9095",
                                                                         2, 4, 5.0)
    assert (s.history_max, s.alertmanager_trust_after, s.hang_after, s.resync_after) == (1_000_000, 120.0, 600.0,
                                                                                         300.0)
    assert s.worker_buffer == 32 * 1024 * 1024
    assert (s.redis_fsync, s.log_level, s.dry_run, s.verify_keys, s.allowed_hosts) == ("everysec", "info", False,
                                                                                        (), ())


def test_every_variable_is_read_into_its_field(tmp_path: Path) -> None:
    (tmp_path / "read.token").write_text("read-token-from-a-file\n")
    env = {"TRAINMEDIC_REDIS_URL": "redis://h:6379/0", "TRAINMEDIC_SIGNING_KEY": SIGNING_KEY,
           "TRAINMEDIC_VERIFY_KEY": " a , b ", "TRAINMEDIC_DRY_RUN": "yes", "TRAINMEDIC_JOB": "llama",
           "TRAINMEDIC_LOG_LEVEL": "DEBUG", "TRAINMEDIC_PLAYBOOKS": "/etc/pb", "TRAINMEDIC_WEBHOOK_TOKEN": "w" * 20,
           "TRAINMEDIC_OPERATOR_TOKEN": "o" * 20, "TRAINMEDIC_OPERATOR_TOKENS_FILE": "/etc/people",
           "TRAINMEDIC_READ_TOKEN_FILE": str(tmp_path / "read.token"), "TRAINMEDIC_ALLOWED_HOSTS": "A.example, b",
           "TRAINMEDIC_PUBLIC_URL": "https://tm.example/", "TRAINMEDIC_ALERTMANAGER_URL": "http://a:9093,http://b/",
           "TRAINMEDIC_ALERTMANAGER_TRUST_AFTER": "30", "TRAINMEDIC_PROMETHEUS_URL": "http://p:9090",
           "TRAINMEDIC_NOTIFY_URL": "https://hooks.example/x", "TRAINMEDIC_HISTORY_MAX": "50",
           "TRAINMEDIC_HANG_AFTER": "5m", "TRAINMEDIC_REDIS_FSYNC": "ALWAYS", "TRAINMEDIC_RESYNC_AFTER": "90",
           "TRAINMEDIC_URL": "http://svc:9095/", "TRAINMEDIC_BIND": "0.0.0.0:80", "TRAINMEDIC_WORKERS": "8",
           "TRAINMEDIC_THREADS": "16", "TRAINMEDIC_REQUEST_DEADLINE": "2.5", "TRAINMEDIC_WORKER_BUFFER": "64",
           "TRAINMEDIC_DATA_DIR": "/var/tm"}
    client = Settings.from_env(env)
    assert client == Settings(redis_url="redis://h:6379/0", signing_key=SIGNING_KEY, verify_keys=("a", "b"),
                              dry_run=True, job="llama", log_level="debug")
    assert ServiceSettings.from_env(env) == ServiceSettings(
        **{f: getattr(client, f) for f in CLIENT_FIELDS}, playbooks="/etc/pb", webhook_token="w" * 20,
        operator_token="o" * 20, operator_tokens_file="/etc/people", read_token="read-token-from-a-file",
        allowed_hosts=("a.example", "b"), public_url="https://tm.example",
        alertmanager_urls=("http://a:9093", "http://b"), alertmanager_trust_after=30.0,
        prometheus_url="http://p:9090", notify_url="https://hooks.example/x", history_max=50, hang_after=300.0,
        redis_fsync="always", resync_after=90.0, url="http://svc:9095", bind="0.0.0.0:80", workers=8, threads=16,
        request_deadline=2.5, worker_buffer=64 * 1024 * 1024, data_dir="/var/tm")


@pytest.mark.parametrize("variable, value, sentence", [
    ("TRAINMEDIC_LOG_LEVEL", "loud", "TRAINMEDIC_LOG_LEVEL must be one of debug, info, warning, error, critical, "
                                     "not 'loud'"),
    ("TRAINMEDIC_DRY_RUN", "maybe", "TRAINMEDIC_DRY_RUN must be 1, true, yes or on (or 0, false, no, off), "
                                    "not 'maybe'"),
    ("TRAINMEDIC_VERIFY_KEY_FILE", "/nonexistent/key", "cannot read TRAINMEDIC_VERIFY_KEY_FILE /nonexistent/key: "
                                                       "No such file or directory"),
])
def test_a_client_setting_that_cannot_be_used_is_one_sentence_on_both_sides(variable: str, value: str,
                                                                           sentence: str) -> None:
    for cls in (Settings, ServiceSettings):
        with pytest.raises(SettingsError) as err:
            cls.from_env({variable: value})
        assert str(err.value) == sentence


@pytest.mark.parametrize("variable, value, sentence", [
    ("TRAINMEDIC_PUBLIC_URL", "http://a,http://b", "TRAINMEDIC_PUBLIC_URL takes one URL, not 2"),
    ("TRAINMEDIC_ALERTMANAGER_URL", "ftp://am", "TRAINMEDIC_ALERTMANAGER_URL must be http:// or https:// URLs "
                                                "(comma-separated), not 'ftp://am'"),
    ("TRAINMEDIC_ALERTMANAGER_TRUST_AFTER", "-1", "TRAINMEDIC_ALERTMANAGER_TRUST_AFTER must be a number of seconds "
                                                  "of at least 0, not '-1'"),
    ("TRAINMEDIC_REQUEST_DEADLINE", "301", "TRAINMEDIC_REQUEST_DEADLINE must be a number of seconds above 0 and "
                                           "at most 300, not '301'"),
    ("TRAINMEDIC_HISTORY_MAX", "0", "TRAINMEDIC_HISTORY_MAX must be a whole number of at least 1, not '0'"),
    ("TRAINMEDIC_WORKER_BUFFER", "1", "TRAINMEDIC_WORKER_BUFFER must be a whole number of MiB of at least 2, not '1'"),
    ("TRAINMEDIC_WORKER_BUFFER", "32MiB", "TRAINMEDIC_WORKER_BUFFER must be a whole number of MiB of at least 2, "
                                          "not '32MiB'"),
    ("TRAINMEDIC_WORKERS", "two", "TRAINMEDIC_WORKERS must be a whole number of at least 1, not 'two'"),
    ("TRAINMEDIC_REDIS_FSYNC", "never", "TRAINMEDIC_REDIS_FSYNC must be everysec or always, not 'never'"),
    ("TRAINMEDIC_HANG_AFTER", "0s", f"TRAINMEDIC_HANG_AFTER must be a positive duration {DURATION}, not '0s'"),
    ("TRAINMEDIC_RESYNC_AFTER", "soon", f"TRAINMEDIC_RESYNC_AFTER must be a positive duration {DURATION}, "
                                        "not 'soon'"),
    ("TRAINMEDIC_OPERATOR_TOKEN_FILE", "/nonexistent/t", "cannot read TRAINMEDIC_OPERATOR_TOKEN_FILE /nonexistent/t: "
                                                         "No such file or directory"),
])
def test_a_service_setting_that_cannot_be_used_is_one_sentence(variable: str, value: str, sentence: str) -> None:
    with pytest.raises(SettingsError) as err:
        ServiceSettings.from_env({variable: value})
    assert str(err.value) == sentence
    # The client never reads it.
    assert Settings.from_env({variable: value}) == Settings()


def test_secrets_stay_out_of_repr() -> None:
    s = ServiceSettings(signing_key="sk-" + "s" * 40, webhook_token="wt-" + "w" * 20, operator_token="ot-" + "o" * 20,
                        read_token="rt-" + "r" * 20)
    shown = repr(s) + repr(Settings(signing_key="sk-" + "s" * 40))
    assert not any(secret in shown for secret in ("sk-", "wt-", "ot-", "rt-")), shown
    assert "ServiceSettings(" in repr(s) and "history_max=1000000" in repr(s)


def test_a_training_job_is_not_stopped_by_a_service_setting_it_never_reads(redis_url: str,
                                                                             monkeypatch: Any) -> None:
    for variable, value in BAD_SERVICE_VALUES.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv("TRAINMEDIC_REDIS_URL", redis_url)
    with RemediationClient(job="settings-job", start=False) as rc:
        assert rc.url == redis_url
    monkeypatch.setenv("TRAINMEDIC_VERIFY_KEY_FILE", "/nonexistent/key")
    with pytest.raises(SettingsError, match="cannot read TRAINMEDIC_VERIFY_KEY_FILE /nonexistent/key"):
        RemediationClient(job="settings-job", start=False)


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINMEDIC_")}
    return subprocess.run([sys.executable, "-m", "trainmedic.service.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**clean, **env})


def test_trainmedic_agent_reads_only_the_clients_settings_and_the_service_commands_all(
        agents: Any, r: redis.Redis, redis_url: str, tmp_path: Path) -> None:
    # The agent starts and heartbeats beside service settings it could not use.
    agents("settings-node", env=BAD_SERVICE_VALUES).wait_ready(r)
    state = ["--state-dir", str(tmp_path / "state")]
    bad_level = cli("agent", "--node", "n1", "--redis-url", redis_url, *state, env={"TRAINMEDIC_LOG_LEVEL": "loud"})
    assert bad_level.returncode == 2 and bad_level.stderr == ("trainmedic: TRAINMEDIC_LOG_LEVEL must be one of debug, "
                                                              "info, warning, error, critical, not 'loud'\n")
    # The service's commands read every setting: the first that cannot be used is one line, exit 2.
    for command in (["history"], ["check"], ["serve", "--data-dir", str(tmp_path / "data")]):
        out = cli(*command, env={"TRAINMEDIC_HISTORY_MAX": "0"})
        assert out.returncode == 2, (command, out)
        assert out.stderr == "trainmedic: TRAINMEDIC_HISTORY_MAX must be a whole number of at least 1, not '0'\n"
