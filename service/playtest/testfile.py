"""Playbook test files (`*.test.yaml`): read and checked whole before anything runs, every problem reported as
FILE:LINE: message, like `trainmedic check` reports playbooks."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from collections.abc import Mapping, Sequence

import yaml

from ...client.wire import keys
from ...client.wire.actions import CATALOGUE
from ...client.wire.status import ActionStatus, Outcome, RecordStatus

from ..rules import conditions as promql
from ..rules.playbooks import (Playbook, _did_you_mean, _duration, _mapping, _Problems, _scalar, check,
                               files_of, is_warning, read_yaml)
from .cases import EXPECT_KEYS, Case, Event, Expected, TestFile, span
from .outside import Answer, Live, default_actions, same_query

SUFFIX = ".test.yaml"
TOP = ("playbooks", "targets", "tests")
TARGET_KEYS = ("kind", "name", "node", "actions")
TEST_KEYS = ("name", "events", "acks", "conditions", "until", "expect")
EVENT_KEYS = ("at", "firing", "resolved", "approve", "reject")
LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*\Z")
# The clock runs on this long after the last event when a test does not say `until`.
DEFAULT_TAIL = 3600.0


def test_files(paths: list[str]) -> tuple[list[Path], list[str]]:
    """The test files named, or found in the folders named (*.test.yaml, sorted), and paths that are neither."""
    files: list[Path] = []
    problems: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            found = sorted(q for q in path.iterdir() if q.name.endswith(SUFFIX) and q.is_file())
            if not found:
                problems.append(f"{raw}:0: no test files (*{SUFFIX}) in this folder")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            problems.append(f"{raw}:0: no such file or folder")
    return files, problems


class _Reader:
    """Reads one test file's nodes into its dataclasses, noting every problem with its line."""

    def __init__(self, path: Path, loader: yaml.SafeLoader):
        self.path = path
        self.loader = loader
        self.p = _Problems(str(path))
        self.playbooks: tuple[Playbook, ...] = ()
        self.targets: tuple[Live, ...] = ()

    def add(self, node: yaml.Node, message: str) -> None:
        self.p.add(node, message)

    def value(self, node: yaml.Node) -> Any:
        return _scalar(self.loader, node)

    def keys_of(self, node: yaml.Node, where: str, allowed: tuple[str, ...]) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """A mapping's entries, with a problem for each key it may not have ("did you mean" one it may)."""
        fields = _mapping(node, where, self.p) or {}
        for key, (knode, _) in fields.items():
            if key not in allowed:
                self.add(knode, f"unknown key {key!r} in {where} ({_did_you_mean(key, allowed)}allowed: "
                                f"{', '.join(allowed)})")
        return {k: v for k, v in fields.items() if k in allowed}

    def listed(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.add(node, f"{what} must be a list")
            return []
        return list(node.value)

    def text(self, node: yaml.Node, what: str) -> str | None:
        v = self.value(node)
        if not isinstance(v, str) or not v:
            self.add(node, f"{what} must be text")
            return None
        return v

    def duration(self, node: yaml.Node, what: str) -> float | None:
        return _duration(self.loader, node, what, self.p)

    def playbook_name(self, node: yaml.Node, what: str) -> str | None:
        name = self.text(node, what)
        names = [pb.name for pb in self.playbooks]
        if name is not None and name not in names:
            self.add(node, f"{what}: no playbook named {name!r} in this test's playbooks "
                           f"({_did_you_mean(name, names)}known: {', '.join(names) or 'none'})")
            return None
        return name

    # -- the file's parts
    def read_playbooks(self, node: yaml.Node) -> list[str]:
        """The playbooks the file names (relative to it), and their own problems."""
        items = [node] if isinstance(node, yaml.ScalarNode) else self.listed(node, "playbooks")
        paths = []
        for item in items:
            name = self.text(item, "each item of playbooks (a file or folder)")
            if name is not None and not (self.path.parent / name).exists():
                self.add(item, f"playbooks: no such file or folder: {self.path.parent / name}")
            elif name is not None:
                paths.append(str(self.path.parent / name))
        if self.p.items:
            return []
        if not paths:
            if not self.p.items:
                self.add(node, "playbooks must name at least one playbook file or folder")
            return []
        found, problems = check(paths)
        if not problems and not files_of(paths):
            self.add(node, f"no playbook files (*.yaml) found in {', '.join(paths)}")
        self.playbooks = tuple(found)
        return [x for x in problems if not is_warning(x)]

    def read_targets(self, node: yaml.Node) -> None:
        out: list[Live] = []
        for item in self.listed(node, "targets"):
            fields = self.keys_of(item, "a target", TARGET_KEYS)
            kind = self.value(fields["kind"][1]) if "kind" in fields else None
            name = self.value(fields["name"][1]) if "name" in fields else None
            if kind not in keys.TARGET_KINDS:
                self.add(fields["kind"][1] if "kind" in fields else item, f"a target's kind must be job or node "
                         f"({_did_you_mean(str(kind), keys.TARGET_KINDS).strip() or f'not {kind!r}'})")
                continue
            if not isinstance(name, str) or not keys.TARGET_NAME_RE.match(name):
                self.add(fields["name"][1] if "name" in fields else item,
                         "a target's name must be 1 to 128 letters, digits or _.:@-")
                continue
            node_name = None
            if "node" in fields:
                node_name = self.value(fields["node"][1])
                if kind != "job":
                    self.add(fields["node"][0], "node is where a job's process runs: only a job target has one")
                elif not isinstance(node_name, str) or not keys.TARGET_NAME_RE.match(node_name):
                    self.add(fields["node"][1], "node must be 1 to 128 letters, digits or _.:@-")
                    node_name = None
            actions = self.read_actions(fields["actions"][1], kind) if "actions" in fields else None
            target = keys.Target(kind, name)
            if any(t.target == target for t in out):
                self.add(item, f"target {target.label} is listed twice")
            out.append(Live(target, node_name, actions))
        self.targets = tuple(out)

    def words(self, node: yaml.Node, field: str, what: str, allowed: Sequence[str],
              sep: str | None = None) -> tuple[str, ...]:
        """A list of words from `allowed` (with `sep`, the part before it), a problem for each other item."""
        out = []
        for item in self.listed(node, field):
            value = self.value(item)
            head = str(value).split(sep, 1)[0] if sep else str(value)
            if not isinstance(value, str) or head not in allowed:
                self.add(item, f"{value!r} is not {what} ({_did_you_mean(head, allowed)}known: {', '.join(allowed)})")
                continue
            out.append(value)
        return tuple(out)

    def read_actions(self, node: yaml.Node, kind: str) -> tuple[str, ...]:
        """A target's `actions:` (what its heartbeat lists)."""
        return self.words(node, "actions", f"an action a {kind} applies", default_actions(kind))

    def read_case(self, node: yaml.Node) -> Case | None:
        before = len(self.p.items)
        fields = self.keys_of(node, "a test", TEST_KEYS)
        if len(self.p.items) > before and not isinstance(node, yaml.MappingNode):
            return None
        for required in ("name", "events", "expect"):
            if required not in fields:
                self.add(node, f"a test needs {required}:")
        name = self.text(fields["name"][1], "a test's name") if "name" in fields else None
        events = self.read_events(fields["events"][1]) if "events" in fields else ()
        answer = Answer.APPLIED
        if "acks" in fields:
            raw = self.value(fields["acks"][1])
            if raw not in {a.value for a in Answer}:
                self.add(fields["acks"][1], f"acks must be applied, failed or none, not {raw!r}")
            else:
                answer = Answer(raw)
        conds = self.read_conditions(fields["conditions"][1], events) if "conditions" in fields else {}
        last = events[-1].at if events else 0.0
        until = last + DEFAULT_TAIL
        if "until" in fields:
            got = self.duration(fields["until"][1], "until")
            if got is not None and got < last:
                self.add(fields["until"][1], f"until ({span(got)}) is before the last event ({span(last)})")
            until = got if got is not None else until
        expect = tuple(self.read_expected(x) for x in self.listed(fields["expect"][1], "expect")) \
            if "expect" in fields else ()
        if len(self.p.items) > before or name is None:
            return None
        return Case(name, node.start_mark.line + 1, events, answer, conds, until,
                    tuple(x for x in expect if x is not None))

    def read_events(self, node: yaml.Node) -> tuple[Event, ...]:
        out: list[Event] = []
        for item in self.listed(node, "events"):
            fields = self.keys_of(item, "an event", EVENT_KEYS)
            at = None
            if "at" not in fields:
                self.add(item, "an event needs at: (when it happens, from the test's start)")
            else:
                at = self.duration(fields["at"][1], "at")
            if at is not None and out and at < out[-1].at:
                self.add(fields["at"][1], f"events go in time order: at {span(at)} comes before the event above "
                                          f"it ({span(out[-1].at)})")
            said = [k for k in ("firing", "resolved", "approve", "reject") if k in fields]
            if not said or ({"approve", "reject"} & set(said) and len(said) > 1):
                self.add(item, "an event is a notification (firing: and/or resolved:, lists of alerts' labels) "
                               "or one person's decision (approve: or reject: a playbook's name)")
                continue
            line = item.start_mark.line + 1
            if said[0] in ("approve", "reject"):
                pb = self.playbook_name(fields[said[0]][1], said[0])
                if pb is not None and at is not None:
                    out.append(Event(at, line, verb=said[0], playbook=pb))
                continue
            firing = self.read_alerts(fields["firing"][1]) if "firing" in fields else ()
            resolved = self.read_alerts(fields["resolved"][1]) if "resolved" in fields else ()
            if at is not None:
                out.append(Event(at, line, firing, resolved))
        return tuple(out)

    def read_alerts(self, node: yaml.Node) -> tuple[Mapping[str, str], ...]:
        out = []
        for item in self.listed(node, "an event's alerts"):
            if not isinstance(item, yaml.MappingNode):
                self.add(item, "each alert is a mapping of its labels, like {alertname: TrainingLossSpike, "
                               "job_name: llama-ft-01}")
                continue
            labels: dict[str, str] = {}
            for knode, vnode in item.value:
                name, value = self.value(knode), self.value(vnode)
                if not isinstance(name, str) or not LABEL_NAME.match(name):
                    self.add(knode, f"{name!r} is not a label name (letters, digits and _, not starting with a digit)")
                elif not isinstance(value, str):
                    shown = "true" if value is True else "false" if value is False else value
                    self.add(vnode, f"label {name} must be a string: quote it ({name}: \"{shown}\")")
                elif name in labels:
                    self.add(knode, f"label {name} is given twice")
                else:
                    labels[name] = value
            if "alertname" not in labels and not any(k.value == "alertname" for k, _ in item.value
                                                     if isinstance(k, yaml.ScalarNode)):
                self.add(item, "an alert needs an alertname label")
            out.append(labels)
        return tuple(out)

    def read_conditions(self, node: yaml.Node, events: tuple[Event, ...]) -> dict[str, bool]:
        """`conditions:` as given; a key no step of the playbooks sends for these targets is a problem."""
        fields = _mapping(node, "conditions", self.p)
        if fields is None:
            return {}
        sent = self.sent_conditions(events)
        out = {}
        for expr, (knode, vnode) in fields.items():
            value = self.value(vnode)
            if not isinstance(value, bool):
                self.add(vnode, "a condition's result must be true or false")
                continue
            if same_query(expr) not in sent:
                hint = _did_you_mean(same_query(expr), sent) if sent else ""
                self.add(knode, "no `when:` of these playbooks sends this query for these targets"
                                + (f" ({hint.strip()})" if hint else ""))
                continue
            out[expr] = value
        return out

    def sent_conditions(self, events: tuple[Event, ...]) -> list[str]:
        """Every query the playbooks' `when:` conditions would send, with $job, $node and $gpu filled in from
        the targets and the events' alerts."""
        whens = {st.when for pb in self.playbooks for stage in range(len(pb.escalate) + 1)
                 for st in pb.steps_of(stage) if st.when}
        gpus = {a.get(k) for e in events for a in e.firing + e.resolved for k in ("gpu_id", "gpu_uuid")} | {None}
        out = set()
        for t in self.targets:
            node = t.host
            for gpu in gpus:
                values = {"job": t.target.name if t.target.kind == "job" else None, "node": node, "gpu": gpu}
                for w in whens:
                    try:
                        out.add(same_query(promql.fill(w, values)))
                    except promql.MissingVariable:
                        pass
        return sorted(out)

    def read_expected(self, node: yaml.Node) -> Expected | None:
        fields = self.keys_of(node, "an expected record", EXPECT_KEYS)
        before = len(self.p.items)
        out: dict[str, Any] = {}
        for key, (_, vnode) in fields.items():
            out[key] = getattr(self, f"expect_{key}")(vnode)
        if len(self.p.items) > before:
            return None
        return Expected(node.start_mark.line + 1, out)

    # -- an expected record's fields, each as the record shows it
    def expect_at(self, node: yaml.Node) -> float | None:
        return self.duration(node, "at")

    def expect_playbook(self, node: yaml.Node) -> str | None:
        return self.playbook_name(node, "playbook")

    def expect_target(self, node: yaml.Node) -> str | None:
        label = self.value(node)
        kind, _, name = str(label).partition(":")
        if not isinstance(label, str) or kind not in keys.TARGET_KINDS or (
                name and not keys.TARGET_NAME_RE.match(name)):
            self.add(node, f"target must be written kind:name, like job:llama-ft-01 or node:gpu-a1, not {label!r}")
            return None
        return label

    def expect_alertname(self, node: yaml.Node) -> str | None:
        return self.text(node, "alertname")

    def expect_status(self, node: yaml.Node) -> str | None:
        return self.member(node, "status", [s.value for s in RecordStatus])

    def expect_outcome(self, node: yaml.Node) -> str | None:
        if self.value(node) is None:
            return None
        return self.member(node, "outcome", [o.value for o in Outcome])

    def expect_reason(self, node: yaml.Node) -> str | None:
        value = self.value(node)
        if value is not None and not isinstance(value, str):
            self.add(node, "reason must be text, or null for none")
        return value if isinstance(value, str) else None

    def expect_stage(self, node: yaml.Node) -> int | None:
        value = self.value(node)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            self.add(node, "stage must be a whole number: 0 for the playbook's own actions, 1 for its first "
                           "escalate stage...")
            return None
        return value

    def expect_actions(self, node: yaml.Node) -> tuple[Any, ...]:
        """Names, or {name: params} to compare the parameters too."""
        out: list[Any] = []
        for item in self.listed(node, "actions"):
            value = self.value(item)
            if isinstance(value, dict) and len(value) == 1:
                name, params = next(iter(value.items()))
                if not isinstance(params, dict):
                    self.add(item, f"the parameters of {name} must be a mapping, like {{{name}: {{...}}}}")
                    continue
            elif isinstance(value, str):
                name, params = value, None
            else:
                self.add(item, "each action is a name, or {name: params} to compare its parameters")
                continue
            if name not in CATALOGUE:
                self.add(item, f"unknown action {name!r} ({_did_you_mean(str(name), CATALOGUE)}known: "
                               f"{', '.join(sorted(CATALOGUE))})")
                continue
            out.append(name if params is None else (name, params))
        return tuple(out)

    def expect_action_statuses(self, node: yaml.Node) -> tuple[str, ...]:
        """Each action's status, or status/reason: [applied, skipped/condition_false]."""
        return self.words(node, "action_statuses", "an action's status, or status/reason",
                          [s.value for s in ActionStatus], sep="/")

    def member(self, node: yaml.Node, what: str, allowed: list[str]) -> str | None:
        value = self.value(node)
        if value not in allowed:
            self.add(node, f"{what} {value!r} is not a record's {what} ({_did_you_mean(str(value), allowed)}"
                           f"known: {', '.join(allowed)})")
            return None
        return str(value)


def read(path: Path) -> tuple[TestFile | None, list[str]]:
    """A test file, or None and every problem it has (FILE:LINE: message, in file order)."""
    got = read_yaml(path)
    if isinstance(got, str):
        return None, [got]
    loader, root = got
    if root is None:
        return None, [f"{path}:1: the file is empty; expected playbooks:, targets: and tests:"]
    r = _Reader(path, loader)
    top = r.keys_of(root, "the file", TOP)
    if not isinstance(root, yaml.MappingNode):
        return None, r.p.sorted()
    outside: list[str] = []
    if "playbooks" in top:
        outside = r.read_playbooks(top["playbooks"][1])
    else:
        r.add(root, "the file needs playbooks: (the playbook files or folders under test, relative to it)")
    if "targets" in top:
        r.read_targets(top["targets"][1])
    cases: list[Case] = []
    if "tests" not in top:
        r.add(root, "the file needs tests:")
    elif not outside:
        items = r.listed(top["tests"][1], "tests")
        if not items and not r.p.items:
            r.add(top["tests"][1], "tests must list at least one test")
        for item in items:
            case = r.read_case(item)
            if case is not None:
                if any(c.name == case.name for c in cases):
                    r.add(item, f"two tests are named {case.name!r}")
                cases.append(case)
    problems = outside + r.p.sorted()
    if problems:
        return None, problems
    return TestFile(str(path), r.playbooks, r.targets, tuple(cases)), []
