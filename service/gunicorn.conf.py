"""gunicorn settings for `trainmedic serve` (values come from the environment serve sets)."""
import importlib.util
import logging
import os
import shutil
from pathlib import Path

bind = os.environ.get("TRAINMEDIC_BIND", "127.0.0.1:9095")
workers = int(os.environ.get("TRAINMEDIC_WORKERS", "2"))
worker_class = "gthread"
threads = int(os.environ.get("TRAINMEDIC_THREADS", "4"))
timeout = 30
graceful_timeout = 10
keepalive = 5
accesslog = None
errorlog = "-"
loglevel = os.environ.get("TRAINMEDIC_LOG_LEVEL", "info")

# One JSON object per line from the master, the workers and the app (service/logs.py). Loaded by path:
# importing the `service` package here would create the app's metrics in the master before on_starting.
_spec = importlib.util.spec_from_file_location("trainmedic_logs", Path(__file__).with_name("logs.py"))
_logs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_logs)
logconfig_dict = _logs.gunicorn_config(loglevel)
logging.captureWarnings(True)
wsgi_app = "service:create_app()"
# gunicorn 23+ opens a control socket at one fixed path per user; several services (or test runs) on one
# host would fight over it, and trainmedic does not use it.
control_socket_disable = True


def on_starting(server):
    # prometheus_client multiprocess mode: a fresh directory, so counters start at zero.
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if d:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d, exist_ok=True)


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
