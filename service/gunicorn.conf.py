"""gunicorn settings for `trainmedic serve` (the values come from the environment serve sets)."""
import gc
import logging
import os
import shutil

from trainmedic.client.logs import gunicorn_config
from trainmedic.service.settings import ServiceSettings

_settings = ServiceSettings.from_env()
bind = _settings.bind
workers = _settings.workers
# Reads each request whole (within TRAINMEDIC_REQUEST_DEADLINE) before a thread serves it: see worker.py.
worker_class = "trainmedic.service.worker.WholeRequestWorker"
threads = _settings.threads
timeout = 30
graceful_timeout = 10
keepalive = 5
accesslog = None
errorlog = "-"
loglevel = _settings.log_level

# One JSON object per line from the master, the workers and the app. trainmedic.client.logs imports nothing
# of the app, so the master creates no metrics before on_starting.
logconfig_dict = gunicorn_config(loglevel)
logging.captureWarnings(True)
wsgi_app = "trainmedic.service:create_app()"
# gunicorn 23+ opens a control socket at one fixed path per user; several services (or test runs) on one
# host would fight over it, and trainmedic does not use it.
control_socket_disable = True


def on_starting(server):
    # prometheus_client multiprocess mode: a fresh directory, so counters start at zero.
    d = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if d:
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d, exist_ok=True)


def post_worker_init(worker):
    # Every worker runs a reconciler thread; a lease in Redis lets one tick at a time, and another take
    # over when a worker (or a whole replica) dies.
    worker.wsgi.extensions["trainmedic"].reconciler.start()
    # What the worker loaded to serve (modules, the app, its clients) lives as long as the worker: out of the
    # collector's sight, a full collection walks only what requests made since. Otherwise one walks every
    # object, tens of milliseconds in the middle of some request (GET /'s p99 at a million records).
    gc.collect()  # what start-up left as garbage goes first, rather than frozen with the rest
    gc.freeze()


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
