"""The history page's inline SVG charts, computed from records."""
from __future__ import annotations

from trainmedic.client.wire.protocol import rfc3339
from trainmedic.service.web import charts

NOW = 1_800_000_000.0


def record(rid: str, t: float, playbook: str = "loss-spike", status: str = "applied",
           actions: list | None = None) -> dict:
    return {"id": rid, "created_at": rfc3339(t), "playbook": playbook, "status": status, "actions": actions or []}


def lr_action(old: list, new: list, at: float, status: str = "applied", action: str = "scale_lr") -> dict:
    return {"action": action, "status": status, "acked_at": rfc3339(at),
            "result": {"old_lr": old, "new_lr": new, "step": 7}}


def test_it_draws_nothing_without_records() -> None:
    assert charts.timeline([], NOW) is None
    assert charts.lr_chart([], NOW) is None


def test_dots_run_left_to_right_in_time_one_lane_per_playbook() -> None:
    recs = [record("c", NOW - 60), record("a", NOW - 7200, "gpu-memory-high"), record("b", NOW - 3600)]
    tl = charts.timeline(recs, NOW)
    assert [lane.label for lane in tl.lanes] == ["gpu-memory-high", "loss-spike"]
    assert [d.anchor for d in tl.dots] == ["rec-a", "rec-b", "rec-c"]
    assert tl.dots[0].x < tl.dots[1].x < tl.dots[2].x
    assert tl.frame.left <= tl.dots[0].x and tl.dots[2].x <= tl.frame.x1
    ys = {lane.label: lane.y for lane in tl.lanes}
    assert tl.dots[0].y == ys["gpu-memory-high"] and tl.dots[1].y == ys["loss-spike"]
    assert len(tl.ticks) >= 2 and all(tl.frame.left <= t.pos <= tl.frame.x1 for t in tl.ticks)


def test_a_burst_fans_out_instead_of_hiding_dots_under_each_other() -> None:
    tl = charts.timeline([record(str(i), NOW - 3600 + i) for i in range(3)], NOW)
    points = {(d.x, d.y) for d in tl.dots}
    assert len({y for _, y in points}) == 3
    ys = sorted(d.y for d in tl.dots)
    assert ys[1] - ys[0] > charts.DOT_R and ys[2] - ys[1] > charts.DOT_R


def test_lr_changes_come_from_applied_acks_only() -> None:
    recs = [
        record("r1", NOW - 600, actions=[lr_action([1e-3, 2e-3], [5e-4, 1e-3], NOW - 590)]),
        record("r2", NOW - 300, actions=[lr_action([5e-4], [2.5e-4], NOW - 290, status="failed")]),
        record("r3", NOW - 200, actions=[{"action": "scale_lr", "status": "applied", "acked_at": rfc3339(NOW),
                                          "result": {"old_lr": "oops", "new_lr": [1]}}]),
        record("r4", NOW - 100, actions=[lr_action([5e-4], [1e-2], NOW - 95, action="set_lr")]),
    ]
    changes = charts.lr_changes(recs)
    assert [(c.record_id, c.action, c.before, c.after, c.step) for c in changes] == [
        ("r1", "scale_lr", (1e-3, 2e-3), (5e-4, 1e-3), 7), ("r4", "set_lr", (5e-4,), (1e-2,), 7)]


def test_the_lr_chart_steps_down_where_the_lr_was_halved() -> None:
    changes = charts.lr_changes([record("r1", NOW - 600, actions=[lr_action([1e-3], [5e-4], NOW - 590)]),
                                 record("r2", NOW - 300, actions=[lr_action([4e-4], [2e-4], NOW - 290)])])
    chart = charts.lr_chart(changes, NOW, current=[1.5e-4])
    assert chart.log_scale
    for (bx, by), (ax, ay) in zip(chart.befores, chart.afters):
        assert bx == ax and ay > by  # same moment; lower LR is drawn lower (larger y)
    assert chart.path.startswith("M") and chart.path.count("L") == 4  # 2 changes x 2 points + now, joined
    labels = [t.label for t in chart.yticks]
    assert labels[0] == "0.001" and labels[-1] == "0.00015"
    gaps = [b.pos - a.pos for a, b in zip(chart.yticks, chart.yticks[1:])]
    assert all(g >= 14 for g in gaps)


def test_a_zero_lr_falls_back_to_a_linear_scale() -> None:
    changes = charts.lr_changes([record("r1", NOW - 60, actions=[lr_action([0.1], [0.0], NOW - 50)])])
    chart = charts.lr_chart(changes, NOW)
    assert not chart.log_scale
    assert chart.afters[0][1] > chart.befores[0][1]
