"""In-loop detectors, training signals through poll(), and the service's side of detections."""
from __future__ import annotations

import math
import random
import time
from typing import Any

import pytest
import requests
import torch

from tests.conftest import AUTH, post_json, write_playbooks
from tests.support.receiver import Receiver
from tests.support.stack import Alertmanager
from tests.support import jobs
from tests.support.jobs import episode
from trainmedic.client import RemediationClient
from trainmedic.client.trainer.detect import DetectSettings, Detector
from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import rfc3339
from trainmedic.service import signals
from trainmedic.service.decide.detections import Detections, fingerprint, labels_of

JOB = "detect-job"


def test_a_nan_or_infinite_loss_is_detected_at_the_first_one() -> None:
    d = Detector(DetectSettings())
    assert not d.observe(1.0)
    assert d.observe(float("nan")) and d.nan
    assert not d.observe(float("inf"))  # already on: no second change
    e = Detector(DetectSettings())
    assert e.observe(float("-inf")) and e.nan


def test_a_spike_needs_three_observations_over_twice_the_median_and_clears_after_twenty() -> None:
    d = Detector(DetectSettings())
    for _ in range(30):
        assert not d.observe(1.0)
    assert [d.observe(5.0) for _ in range(3)] == [False, False, True] and d.spike
    changes = [d.observe(1.0) for _ in range(20)]
    assert changes == [False] * 19 + [True] and not d.spike


def test_spikes_are_not_judged_before_the_twentieth_observation() -> None:
    d = Detector(DetectSettings())
    assert not any(d.observe(v) for v in [1.0] * 10 + [50.0] * 5)
    d = Detector(DetectSettings())
    assert not any(d.observe(1.0) for _ in range(19))
    assert [d.observe(9.0) for _ in range(3)] == [False, False, True]


def test_detect_settings_are_checked_and_can_turn_detection_off() -> None:
    assert DetectSettings.of(False) is None
    assert DetectSettings.of({"window": 10, "factor": 3}) == DetectSettings(window=10, factor=3.0)
    for bad in ({"windw": 1}, {"factor": 1}, {"window": 0}, {"nan": "yes"}, "on"):
        with pytest.raises(ValueError):
            DetectSettings.of(bad)
    with pytest.raises(ValueError, match="RemediationClient: detect has unknown settings"):
        RemediationClient(job=JOB, redis_url="redis://127.0.0.1:1", start=False, detect={"x": 1})


def test_five_thousand_steps_of_a_noisy_run_raise_no_detection(redis_url: str, r: Any) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.randn(16, 1)
    with RemediationClient(job=JOB, redis_url=redis_url, optimizer=opt) as rc:
        for step in range(5000):
            x = torch.randn(32, 16)  # small batches: the loss varies by about a quarter from step to step
            loss = torch.nn.functional.mse_loss(model(x), x @ w + 0.5 * torch.randn(32, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            rc.poll(step=step, loss=loss.item())
        assert rc.detected == () and rc._detector is not None and rc._detector.changed == 0
    assert r.xlen(keys.detections(keys.Target("job", JOB))) == 0


class CountedLoss(torch.Tensor):
    """A 0-dim tensor that counts its .item() calls (each one a device synchronisation on a GPU)."""

    items = 0

    def item(self) -> Any:  # type: ignore[override]
        CountedLoss.items += 1
        return super().item()


def test_a_tensor_loss_is_read_once_in_ten_steps(redis_url: str) -> None:
    CountedLoss.items = 0
    with RemediationClient(job=JOB, redis_url=redis_url, start=False) as rc:
        for step in range(100):
            loss = torch.tensor(float(step)).as_subclass(CountedLoss)
            grad = torch.tensor(2.0).as_subclass(CountedLoss)
            rc.poll(step=step, loss=loss, grad_norm=grad, samples=32)
        assert CountedLoss.items == 2 * 10  # loss and grad norm, on 10 of 100 steps
        assert rc.loss == 99.0 and rc.grad_norm == 2.0 and rc.samples == 3200
        rc.poll(step=100, loss=torch.tensor(float("nan")).as_subclass(CountedLoss))
        assert rc.detected == ()  # read at the tenth call only
        for step in range(101, 110):
            rc.poll(step=step, loss=torch.tensor(float("nan")).as_subclass(CountedLoss))
        assert rc._detector is not None and rc._detector.nan


def test_the_heartbeat_carries_signals_to_metrics(redis_url: str, r: Any, http: Any) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.125)
    with RemediationClient(job=JOB, redis_url=redis_url, optimizer=opt, heartbeat_interval=0.2) as rc:
        for step in range(5):
            rc.poll(step=step, loss=1.5, grad_norm=0.75, samples=64)
            time.sleep(0.1)
        deadline = time.monotonic() + 10
        want = f'trainmedic_training_step{{job_name="{JOB}"}} 4.0\n'.encode()
        while want not in http.get("/metrics").data and time.monotonic() < deadline:
            time.sleep(0.1)
    text = http.get("/metrics").data.decode()
    assert f'trainmedic_training_loss{{job_name="{JOB}"}} 1.5\n' in text
    assert f'trainmedic_training_step{{job_name="{JOB}"}} 4\n' in text
    assert f'trainmedic_training_learning_rate{{job_name="{JOB}"}} 0.125\n' in text
    assert f'trainmedic_training_grad_norm{{job_name="{JOB}"}} 0.75\n' in text
    assert "# TYPE trainmedic_training_samples_per_second gauge" in text
    # The line goes with its TTL (two minutes after the last heartbeat): the series goes with it.
    r.delete(keys.signals(keys.Target("job", JOB)))
    assert "trainmedic_training_loss{" not in http.get("/metrics").data.decode()


def report(r: Any, name: str, line: str, now: float) -> None:
    """What a job's heartbeat writes for the scrape (its line), and the service's note that the job is live."""
    t = keys.Target("job", name)
    r.set(keys.signals(t), line, px=120_000)
    r.zadd(keys.live("job"), {t.label: int((now + 60) * 1000)})


def samples(text: bytes) -> dict[str, str]:
    """Each sample of a scrape by its series (checks every line is a sample, a HELP or a TYPE)."""
    out = {}
    for line in text.decode().splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            continue
        series, value = line.rsplit(" ", 1)
        assert series.count('"') == 2 and series.endswith('"}'), line
        assert math.isfinite(float(value)), line
        out[series] = value
    return out


def test_a_hostile_signals_line_never_reaches_the_scrape(r: Any) -> None:
    now = time.time()
    report(r, "honest", "7 1 1.25 0.5 - -", now)
    for name, line in (("inject", '1 2 3 4 5 6"}\nfake_metric 1'), ("words", "1 2 nan inf 5 6"),
                       ("huge", "1 2 1e999 4 5 6"), ("short", "1 2 3"), ("spaces", "1  2 3 4 5 6"),
                       ("syntax", "1 2 1e+ 4 5 6")):
        report(r, name, line, now)
        text = signals.metrics_text(r, now)
        assert b"fake_metric" not in text and b"nan" not in text.lower() and b"inf" not in text.lower()
        got = samples(text)  # every line still a valid sample: the honest job's are all there
        assert got['trainmedic_training_loss{job_name="honest"}'] == "1.25"
        assert got['trainmedic_training_step{job_name="honest"}'] == "7"
        assert 'trainmedic_training_grad_norm{job_name="honest"}' not in got  # unknown: no series
        r.delete(keys.signals(keys.Target("job", name)))


def test_a_label_in_the_index_that_is_not_a_plain_jobs_is_left_out(r: Any) -> None:
    now = time.time()
    report(r, "honest", "7 1 1.25 0.5 - -", now)
    r.zadd(keys.live("job"), {'node:x': int((now + 60) * 1000), 'job:a"b': int((now + 60) * 1000)})
    r.set("trainmedic:{node:x}:signals", "1 2 3 4 5 6")
    r.set('trainmedic:{job:a"b}:signals', "1 2 3 4 5 6")
    got = samples(signals.metrics_text(r, now))
    assert set(got) == {f'{name}{{job_name="honest"}}' for name in (
        "trainmedic_training_loss", "trainmedic_training_step", "trainmedic_training_learning_rate")}


def test_the_scrape_reads_the_live_jobs_and_drops_a_job_once_its_heartbeat_has_lapsed(
        redis_url: str, r: Any, http: Any) -> None:
    now = time.time()
    for n in range(50):  # live jobs that report nothing have no line: no series
        r.zadd(keys.live("job"), {f"job:idle-{n}": int((now + 30) * 1000)})
    with RemediationClient(job=JOB, redis_url=redis_url, heartbeat_interval=0.2) as rc:
        rc.poll(step=3, loss=0.5)
        jobs.wait_until(lambda: r.zscore(keys.live("job"), f"job:{JOB}") is not None
                        and r.get(keys.signals(keys.Target("job", JOB))), what="the job to be live and report")
        expires = r.zscore(keys.live("job"), f"job:{JOB}") / 1000
        assert 0 < expires - time.time() <= 61  # live while its heartbeat lasts, at most a minute ahead
        got = samples(signals.metrics_text(r))
    assert {s.split("{")[1] for s in got} == {f'job_name="{JOB}"}}'}
    assert got[f'trainmedic_training_loss{{job_name="{JOB}"}}'] == "0.5"
    # Past that, the job is not live: the scrape leaves it out (its line may last longer).
    assert b"job_name" not in signals.metrics_text(r, expires + 1)


def test_a_non_finite_loss_is_left_out_of_the_scrape(redis_url: str, r: Any, http: Any) -> None:
    with RemediationClient(job=JOB, redis_url=redis_url, heartbeat_interval=0.2, detect=False) as rc:
        rc.poll(step=3, loss=float("nan"))
        jobs.wait_until(lambda: r.zscore(keys.live("job"), f"job:{JOB}") is not None
                        and r.get(keys.signals(keys.Target("job", JOB))), what="the job to be live and report")
        got = samples(signals.metrics_text(r))
    assert got[f'trainmedic_training_step{{job_name="{JOB}"}}'] == "3"
    assert f'trainmedic_training_loss{{job_name="{JOB}"}}' not in got


def test_the_fingerprint_is_alertmanagers(tmp_path: Any) -> None:
    am = Alertmanager(tmp_path, "http://127.0.0.1:9/webhook", "t")
    try:
        sets = [labels_of(keys.Target("job", "llama-ft-01"), "TrainingLossNaN"),
                {"alertname": "X", "job_name": "é-ünïcode", "a": ""}, {"alertname": "Y"}]
        for labels in sets:
            am.push(labels)
        listed = requests.get(am.url + "/api/v2/alerts", timeout=5).json()
        by_name = {a["labels"]["alertname"]: a["fingerprint"] for a in listed}
        assert by_name == {s["alertname"]: fingerprint(s) for s in sets}
    finally:
        am.stop()


def detections(app: Any) -> Detections:
    return app.extensions["trainmedic"].reconciler.detections


def test_a_detection_is_decided_for_its_own_job_only_and_once(app: Any, r: Any) -> None:
    t = keys.Target("job", JOB)
    start = rfc3339()
    # The entry names another job in every field it could: the job is the stream's, never the payload's.
    r.xadd(keys.detections(t), {"alertname": "TrainingLossNaN", "status": "firing", "starts_at": start,
                                "ends_at": "", "step": "7", "value": "nan", "job_name": "other-job"})
    r.xadd(keys.detections(t), {"alertname": "GPUXidError", "status": "firing", "starts_at": start})
    [out] = detections(app).handle(t)
    assert out.status == "no_live_target" or out.new
    assert detections(app).handle(t) == []  # the cursor moved: nothing twice
    rec = app.test_client().get(f"/remediations/{out.record_id}").get_json()
    assert rec["requested_by"] == "detector" and rec["target"] == {"kind": "job", "name": JOB}
    assert rec["alert"]["labels"]["job_name"] == JOB


def test_a_spike_seen_by_the_client_and_the_prometheus_rule_halves_the_lr_once(app: Any, http: Any, r: Any) -> None:
    t = keys.Target("job", JOB)
    [first] = detections(app).decide(t, "TrainingLossSpike", "firing", rfc3339())
    assert first.new and first.status != "skipped"
    body = {"version": "4", "status": "firing", "receiver": "trainmedic", "groupKey": "{}:{}", "groupLabels": {},
            "commonLabels": {}, "commonAnnotations": {}, "externalURL": "http://am", "alerts": [{
                "status": "firing", "labels": {"alertname": "TrainingLossSpike", "job_name": JOB,
                                               "severity": "critical", "component": "training"},
                "annotations": {}, "startsAt": rfc3339(), "endsAt": "0001-01-01T00:00:00Z",
                "fingerprint": "0123456789abcdef"}]}
    answer = post_json(http, "/webhook", body, AUTH).get_json()
    assert [(x["status"], x["reason"]) for x in answer["remediations"]] == [("skipped", "cooldown")]


def test_a_job_whose_step_stops_gets_training_hang_and_it_resolves_when_the_step_moves(app: Any, r: Any) -> None:
    t = keys.Target("job", JOB)
    now = time.time()
    r.zadd(keys.live("job"), {t.label: int((now + 30) * 1000)})
    r.set(keys.signals(t), f"12 {int((now - 700) * 1000)} 1.0 - - -")
    [fired] = detections(app).scan_hangs(now, force=True)
    assert fired.playbook == "training-hang" and fired.status == "skipped" and fired.reason == "no_actions"
    assert detections(app).scan_hangs(now + 1, force=True) == []  # the same hang: raised once
    r.set(keys.signals(t), f"13 {int(now * 1000)} 1.0 - - -")
    detections(app).scan_hangs(now + 2, force=True)
    assert r.zcard(keys.HUNG) == 0
    ep = episode(r, t, "training-hang", fingerprint(labels_of(t, "TrainingHang")))
    assert ep.get("closed") and not ep.get("open")


def test_a_job_that_never_passes_a_step_is_never_judged_hung(app: Any, r: Any) -> None:
    t = keys.Target("job", JOB)
    now = time.time()
    r.zadd(keys.live("job"), {t.label: int((now + 30) * 1000)})
    r.set(keys.signals(t), f"- {int((now - 7000) * 1000)} 1.0 - - -")
    assert detections(app).scan_hangs(now, force=True) == []


def hang(app: Any, r: Any, name: str) -> list[Any]:
    """A live job whose step has stayed put for longer than TRAINMEDIC_HANG_AFTER: the hang scan raises it."""
    t = keys.Target("job", name)
    now = time.time()
    r.zadd(keys.live("job"), {t.label: int((now + 30) * 1000)})
    r.set(keys.signals(t), f"12 {int((now - 700) * 1000)} 1.0 - - -")
    return detections(app).scan_hangs(now, force=True)


def test_a_training_hang_record_is_notified_once_to_the_notify_url(make_app: Any, r: Any) -> None:
    hook = Receiver()
    try:
        app = make_app(notify_url=hook.url, public_url="http://trainmedic.example")
        [fired] = hang(app, r, JOB)
        assert (fired.playbook, fired.status, fired.reason) == ("training-hang", "skipped", "no_actions")
        reconciler = app.extensions["trainmedic"].reconciler
        reconciler.tick()
        [text] = hook.wait(1)
        assert f"training-hang on job:{JOB}" in text and "TrainingHang" in text and "no actions" in text
        assert f"http://trainmedic.example/records/{fired.record_id}" in text
        reconciler.tick(time.time() + 120)
        time.sleep(0.3)
        assert len(hook.bodies) == 1  # one notification, and the record is no longer followed
        assert fired.record_id not in r.zrange(keys.due_items(keys.Target("job", JOB)), 0, -1)
        rec = app.test_client().get(f"/remediations/{fired.record_id}").get_json()
        assert rec["status"] == "skipped" and rec["reason"] == "no_actions" and rec["requested_by"] == "detector"
    finally:
        hook.close()


def test_a_playbook_without_actions_notifies_its_own_url(make_app: Any, r: Any, tmp_path: Any) -> None:
    hook = Receiver()
    try:
        path = write_playbooks(tmp_path / "hang.yaml", f"""\
playbooks:
  - name: hang-to-people
    matchers: ['alertname="TrainingHang"']
    target: job
    actions: []
    notify: {hook.url}
""")
        app = make_app(playbooks=str(path))
        [fired] = hang(app, r, JOB)
        assert (fired.status, fired.reason) == ("skipped", "no_actions")
        app.extensions["trainmedic"].reconciler.tick()
        [text] = hook.wait(1)
        assert f"hang-to-people on job:{JOB}" in text and fired.record_id in text
    finally:
        hook.close()


def test_without_a_notify_url_a_no_actions_record_is_left_after_one_look(app: Any, r: Any) -> None:
    [fired] = hang(app, r, JOB)
    assert fired.status == "skipped"
    app.extensions["trainmedic"].reconciler.tick()
    assert fired.record_id not in r.zrange(keys.due_items(keys.Target("job", JOB)), 0, -1)
    assert r.hget(keys.record(fired.record_id), "follow") in (None, "", "0")
    assert r.hget(keys.record(fired.record_id), "status") == "skipped"


# -- a healthy run is never touched: the rise must be large against the loss's own scale

def sgd_losses(noise: float, batch: int = 4, steps: int = 10_000, seed: int = 0, teacher: float = 1.0,
               spike_at: int | None = None) -> list[float]:
    """A real SGD loop on the CPU learning a linear teacher from small batches; targets carry `noise`.

    With noise 0 it converges to float32's noise floor (about 1e-14, often exactly 0); with 1e-4 to 1e-8; with
    0.03 to 1e-3; with teacher 0 and noise 1 it cannot learn anything: a noisy plateau at 1. From `spike_at`
    on, the targets are 30 times larger (a corrupt shard): a real spike.
    """
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = teacher * torch.randn(16, 1, generator=gen)
    out = []
    for step in range(steps):
        x = torch.randn(batch, 16, generator=gen)
        y = x @ w + noise * torch.randn(batch, 1, generator=gen)
        if spike_at is not None and step >= spike_at:
            y = 30 * y
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def hinge_losses(batch: int, steps: int = 10_000, seed: int = 0) -> list[float]:
    """A real SGD loop on separable data with a hinge loss: once the margin holds, the loss is exactly 0 for
    long stretches, with small positive batches in between."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.randn(8, 1, generator=gen)
    out = []
    for _ in range(steps):
        x = torch.randn(batch, 8, generator=gen)
        loss = torch.relu(1 - torch.sign(x @ w) * model(x)).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def converging(floor: float, seed: int, steps: int = 10_000, start: float = 2.0) -> list[float]:
    """A seeded loss that falls from about `start` to `floor`, with the batch-to-batch noise of four samples (a
    chi-squared with 4 degrees of freedom, over 4); at 1e-14 rounded as float32's noise floor rounds it."""
    rng = random.Random(seed)
    out = []
    for t in range(steps):
        level = max(floor, start * math.exp(-t / 300))
        v = level * sum(rng.gauss(0, 1) ** 2 for _ in range(4)) / 4
        out.append(round(v / 2 ** -46) * 2 ** -46 if floor < 1e-12 else v)
    return out


def zero_stretches(seed: int, steps: int = 10_000) -> list[float]:
    """A seeded loss that learns for 500 steps, then is exactly 0 for long stretches, with short bursts of
    small losses in between (a margin or clipped loss once the data are fitted)."""
    rng = random.Random(seed)
    out = [2.0 * math.exp(-t / 100) * (0.5 + rng.random()) for t in range(500)]
    while len(out) < steps:
        out += [0.0] * rng.randint(50, 1500)
        out += [1e-5 * rng.expovariate(1.0) for _ in range(rng.randint(1, 60))]
    return out[:steps]


def plateau(seed: int, steps: int = 10_000) -> list[float]:
    """A seeded loss stuck at 2.3 with the noise of batches of four, and a lone bad batch now and then."""
    rng = random.Random(seed)
    return [2.3 * sum(rng.gauss(0, 1) ** 2 for _ in range(4)) / 4 * (8.0 if rng.random() < 0.002 else 1.0)
            for _ in range(steps)]


def spikes_in(losses: list[float], settings: DetectSettings | None = None) -> list[tuple[int, float]]:
    """The observation (and its loss) at which each spike detection began."""
    d = Detector(settings or DetectSettings())
    return [(i, v) for i, v in enumerate(losses) if d.observe(v) and d.spike]


HEALTHY_SGD = {
    "converged to 1e-3, batches of 4": lambda: sgd_losses(0.03),
    "converged to 1e-8, batches of 4": lambda: sgd_losses(1e-4),
    "converged to 1e-14, batches of 4": lambda: sgd_losses(0.0),
    "converged to 1e-8, batches of 8": lambda: sgd_losses(1e-4, batch=8, seed=1),
    "converged to 1e-14, batches of 8": lambda: sgd_losses(0.0, batch=8, seed=1),
    "a noisy plateau, batches of 4": lambda: sgd_losses(1.0, teacher=0.0),
    "a hinge loss, exactly 0 for long stretches": lambda: hinge_losses(4),
    "a hinge loss with batches of 16": lambda: hinge_losses(16),
}


@pytest.mark.parametrize("run", HEALTHY_SGD)
def test_a_healthy_sgd_run_raises_no_spike_in_ten_thousand_steps(run: str) -> None:
    losses = HEALTHY_SGD[run]()
    assert len(losses) == 10_000
    assert spikes_in(losses) == []
    # The floor is what keeps it quiet: twice the median alone calls the noise of this run a spike.
    assert spikes_in(losses, DetectSettings(min_rise=0.0, noise=0.0)) != []


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("losses", [
    pytest.param(lambda s: converging(1e-3, s), id="converging to 1e-3"),
    pytest.param(lambda s: converging(1e-8, s), id="converging to 1e-8"),
    pytest.param(lambda s: converging(1e-14, s), id="converging to 1e-14"),
    # A process resumed from a checkpoint of a converged run: its early losses are at the floor already.
    pytest.param(lambda s: converging(1e-8, s, start=1e-8), id="resumed at 1e-8"),
    pytest.param(lambda s: converging(1e-3, s, start=1e-3), id="resumed at 1e-3"),
    pytest.param(zero_stretches, id="exactly 0 for long stretches"),
    pytest.param(plateau, id="a noisy plateau"),
])
def test_a_seeded_healthy_sequence_raises_no_spike_in_ten_thousand_steps(losses: Any, seed: int) -> None:
    assert spikes_in(losses(seed)) == []


@pytest.mark.parametrize(("noise", "teacher"), [(0.03, 1.0), (1e-4, 1.0), (0.0, 1.0), (1.0, 0.0)],
                         ids=["1e-3", "1e-8", "1e-14", "plateau"])
def test_a_corrupt_shard_in_a_converged_run_is_still_a_spike_on_its_third_step(noise: float, teacher: float) -> None:
    losses = sgd_losses(noise, teacher=teacher, steps=3000, spike_at=2500)
    assert [i for i, _ in spikes_in(losses)] == [2502]


def test_a_loop_at_float32s_noise_floor_is_never_touched_through_the_client(redis_url: str, r: Any) -> None:
    """A plain SGD loop converged to about 1e-14: once, the client rolled it back and halved its LR."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    w = torch.randn(16, 1, generator=gen)
    with RemediationClient(job=JOB, redis_url=redis_url, optimizer=opt) as rc:
        for step in range(3000):
            x = torch.randn(4, 16, generator=gen)
            loss = torch.nn.functional.mse_loss(model(x), x @ w)
            opt.zero_grad()
            loss.backward()
            opt.step()
            rc.poll(step=step, loss=loss.item())
        assert rc.loss is not None and rc.loss < 1e-12
        assert rc.detected == () and rc._detector is not None and rc._detector.changed == 0
    assert r.xlen(keys.detections(keys.Target("job", JOB))) == 0


def test_the_floor_and_the_noise_rule_are_tunable_and_checked() -> None:
    assert DetectSettings.of({"min_rise": 0, "noise": 1.5}) == DetectSettings(min_rise=0.0, noise=1.5)
    for bad in ({"min_rise": -0.1}, {"noise": float("inf")}, {"noise": True}, {"min_rise": "1%"}):
        with pytest.raises(ValueError, match="must be a finite number of 0 or more"):
            DetectSettings.of(bad)
    # A loss at 1e-6 of the run's start that triples: a spike by the median, not by the run's scale.
    losses = [1.0] * 20 + [1e-6] * 100 + [3e-6] * 5
    assert spikes_in(losses) == []
    assert [i for i, _ in spikes_in(losses, DetectSettings(min_rise=1e-7))] == [122]
