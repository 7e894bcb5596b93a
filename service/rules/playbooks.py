"""Declarative playbooks from YAML: validated at load time, every problem reported as FILE:LINE: message."""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit
from importlib import resources
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

import yaml

from ...client.wire.actions import CATALOGUE
from ...client.wire.durations import parse_duration
from ...client.wire.keys import TARGET_KINDS
from ..store.decision import Step

from . import conditions
from .matchers import Matcher, MatcherError, parse_matcher

# The shipped playbooks: package data of trainmedic.playbooks (the repository's playbooks/ folder).
SHIPPED = Path(str(resources.files("trainmedic.playbooks")))
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_FIELDS = ("name", "matchers", "target", "actions", "on_resolved", "cooldown", "max_runs", "approval",
           "approval_timeout", "dry_run", "expire_after", "resolve_timeout", "verify", "escalate", "silence",
           "notify", "description", "max_active")
# A remediation needs about this long to show in its alert: Prometheus evaluates the rule again (its `for:`
# too), and Alertmanager batches the resolve. A shorter `after` may escalate past a stage that worked.
MIN_AFTER = 60.0
# A silence lasts this much longer than the whole ladder and its verify (README: "Did it work?", silences).
SILENCE_MARGIN = 600.0
# Keys an action item may carry beside its one action key.
_STEP_KEYS = ("optional", "when")


@dataclass(frozen=True)
class Stage:
    """One step of an escalation ladder: its actions, run if the alert still fires `after` the previous stage."""

    after: float
    actions: tuple[Step, ...]


@dataclass(frozen=True)
class Playbook:
    """What to do when an alert matches."""

    name: str
    matchers: tuple[Matcher, ...]
    target: str
    actions: tuple[Step, ...]
    on_resolved: tuple[Step, ...] = ()
    cooldown: float = 0.0
    max_runs: tuple[int, float] | None = None
    approval: bool = False
    approval_timeout: float = 3600.0
    dry_run: bool = False
    expire_after: float = 3600.0
    # Without a resolve (Alertmanager never sent it), on_resolved runs this long after the last firing.
    resolve_timeout: float = 12 * 3600.0
    # How long after its last ack a remediation has to make the alert resolve before it counts as ineffective.
    verify: float = 900.0
    escalate: tuple[Stage, ...] = ()
    silence: bool = False
    notify: str | None = None
    description: str = ""
    source: str = ""
    # The breaker (README: Guardrails): ("count", N) or ("percent", P) of the live targets of its kind.
    max_active: tuple[str, int] | None = None

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(m.matches(labels) for m in self.matchers)

    def steps_of(self, stage: int) -> tuple[Step, ...]:
        """The actions of a ladder's stage: 0 is `actions`, 1 the first `escalate` item, and so on."""
        return self.actions if stage == 0 else self.escalate[stage - 1].actions

    @property
    def silence_seconds(self) -> float:
        """How long a silence lasts from dispatch: every stage's `after`, `verify`, and a margin."""
        return sum(s.after for s in self.escalate) + self.verify + SILENCE_MARGIN

    def settings(self) -> dict[str, Any]:
        """The playbook as loaded, for GET /playbooks: durations in seconds, a notify URL as its host only."""
        def steps(items: tuple[Step, ...]) -> list[dict[str, Any]]:
            return [{"action": st.action, "params": st.params, **({"optional": True} if st.optional else {}),
                     **({"when": st.when} if st.when else {})} for st in items]
        return {
            "matchers": [str(m) for m in self.matchers], "target": self.target, "actions": steps(self.actions),
            "on_resolved": steps(self.on_resolved), "cooldown_s": self.cooldown,
            "max_runs": {"count": self.max_runs[0], "per_s": self.max_runs[1]} if self.max_runs else None,
            "approval": self.approval, "approval_timeout_s": self.approval_timeout, "dry_run": self.dry_run,
            "expire_after_s": self.expire_after, "resolve_timeout_s": self.resolve_timeout,
            "verify_s": self.verify, "escalate": [{"after_s": s.after, "actions": steps(s.actions)}
                                                  for s in self.escalate],
            "silence": self.silence, "notify": urlsplit(self.notify).hostname if self.notify else None,
            "description": self.description, "source": self.source,
            "max_active": {self.max_active[0]: self.max_active[1]} if self.max_active else None,
        }

    def breaker_limit(self, live: int) -> int:
        """How many targets may have an open remediation of this playbook with `live` live targets of its kind
        (0: no bound). A percent of no live target bounds nothing: no agent or job can apply anything until one
        heartbeats, and the commands wait in their mailboxes until then (or their expiry)."""
        if self.max_active is None:
            return 0
        form, n = self.max_active
        if form == "count":
            return n
        return max(1, live * n // 100) if live else 0


class PlaybookError(Exception):
    """Invalid playbooks; `problems` holds one "FILE:LINE: message" per problem."""

    def __init__(self, problems: list[str]):
        super().__init__(problems[0] if len(problems) == 1 else f"{problems[0]} (and {len(problems) - 1} more)")
        self.problems = problems


class _Problems:
    def __init__(self, file: str):
        self.file = file
        self.items: list[str] = []
        self.warnings: list[str] = []
        # Every `when:` of the file with its node: parsed together once the file is read.
        self.conditions: list[tuple[yaml.Node, str]] = []
        self._lines: list[int] = []

    def add(self, node: yaml.Node, message: str) -> None:
        self.items.append(f"{self.file}:{node.start_mark.line + 1}: {message}")
        self._lines.append(node.start_mark.line + 1)

    def warn(self, node: yaml.Node, message: str) -> None:
        """A problem that does not make the file invalid (`trainmedic check` prints it and exits 0)."""
        self.warnings.append(f"{self.file}:{node.start_mark.line + 1}: warning: {message}")

    def sorted(self) -> list[str]:
        """The problems in file order (a playbook's fields are checked out of order)."""
        return [item for _, _, item in sorted(zip(self._lines, range(len(self.items)), self.items))]


def _name_of(node: yaml.Node) -> str | None:
    """The `name:` of a playbook node if it is a plain string, whatever else is wrong with it."""
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == "name" and isinstance(v, yaml.ScalarNode):
                return v.value
    return None


def _scalar(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    return loader.construct_object(node, deep=True)


def _mapping(node: yaml.Node, where: str, p: _Problems) -> dict[str, tuple[yaml.Node, yaml.Node]] | None:
    """Keys of a mapping node to (key node, value node), reporting duplicates."""
    if not isinstance(node, yaml.MappingNode):
        p.add(node, f"{where} must be a mapping")
        return None
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for k, v in node.value:
        key = k.value if isinstance(k, yaml.ScalarNode) else None
        if key in out:
            p.add(k, f"duplicate key {key!r} in {where}")
        out[str(key)] = (k, v)
    return out


def _steps(loader: yaml.SafeLoader, node: yaml.Node, kind: str | None, where: str, p: _Problems,
           stage: bool = False) -> tuple[Step, ...]:
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
        return ()
    if not isinstance(node, yaml.SequenceNode):
        p.add(node, f"{where} must be a list of actions")
        return ()
    steps = []
    for item in node.value:
        extra: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        if isinstance(item, yaml.ScalarNode):
            name, params_node = str(_scalar(loader, item)), None
        elif isinstance(item, yaml.MappingNode):
            pairs = [(k, v) for k, v in item.value if isinstance(k, yaml.ScalarNode)]
            extra = {k.value: (k, v) for k, v in pairs if k.value in _STEP_KEYS}
            named = [(k, v) for k, v in pairs if k.value not in _STEP_KEYS]
            misspelt = [k for k, _ in named if k.value not in CATALOGUE and _did_you_mean(k.value, _STEP_KEYS)]
            if len(named) > 1 and misspelt:  # `optinal: true` beside the action: say which field it meant
                for k in misspelt:
                    p.add(k, f"unknown field {k.value!r} in an item of {where}: "
                             f"{_did_you_mean(k.value, _STEP_KEYS).rstrip()} (an item is one action, with optional: "
                             "or when: beside it)")
                named = [(k, v) for k, v in named if k not in misspelt]
            if len(named) != 1 or len(pairs) != len(item.value):
                p.add(item, f"each item of {where} is one action, optionally with optional: or when: beside it: "
                            "`- scale_lr: {factor: 0.5}`")
                continue
            name, params_node = str(named[0][0].value), named[0][1]
        else:
            p.add(item, f"each item of {where} is one action: `- scale_lr: {{factor: 0.5}}`")
            continue
        spec = CATALOGUE.get(name)
        if spec is None:
            p.add(item, f"unknown action {name!r} ({_did_you_mean(name, CATALOGUE)}known: "
                        f"{', '.join(sorted(CATALOGUE))})")
            continue
        ok = True
        if kind in TARGET_KINDS and spec.kind != kind:
            p.add(item, f"action {name} runs on a {spec.kind}, but this playbook targets a {kind}")
        if stage and spec.undoes:
            p.add(item, f"{name} undoes a remediation: it belongs in on_resolved, not in an escalation stage")
        params = _scalar(loader, params_node) if params_node is not None else {}
        for key, msg in spec.problems(params):
            # Say which action a bare "factor must be a number" belongs to, on the line of its parameter.
            p.add(_key_node(params_node, key) or params_node or item, msg if name in msg else f"{name}: {msg}")
            ok = False
        optional = _bool(loader, extra["optional"][1], "optional", p) if "optional" in extra else False
        when = None
        if "when" in extra:
            when = _when(loader, extra["when"][1], p)
        if ok:
            steps.append(Step(name, dict(params or {}), optional, when))
    return tuple(steps)


def _key_node(node: yaml.Node | None, key: Any) -> yaml.Node | None:
    """The node of `key` in a mapping node (None when the node is no mapping or has no such key)."""
    if key is None or not isinstance(node, yaml.MappingNode):
        return None
    return next((k for k, _ in node.value if isinstance(k, yaml.ScalarNode) and k.value == str(key)), None)


def _did_you_mean(word: str, choices: Iterable[str]) -> str:
    """"did you mean X? " when a choice is close to the word, else nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f"did you mean {close[0]}? " if close else ""


def _listed(node: yaml.Node | None) -> bool:
    """Whether a node is a list with at least one item."""
    return isinstance(node, yaml.SequenceNode) and bool(node.value)


def _when(loader: yaml.SafeLoader, node: yaml.Node, p: _Problems) -> str | None:
    value = _scalar(loader, node)
    if not isinstance(value, str) or not value.strip():
        p.add(node, "when must be a PromQL expression (text)")
        return None
    p.conditions.append((node, value.strip()))
    return value.strip()


def _duration(loader: yaml.SafeLoader, node: yaml.Node, field: str, p: _Problems) -> float | None:
    try:
        return parse_duration(_scalar(loader, node))
    except ValueError as exc:
        p.add(node, f"{field}: {exc}")
        return None


def _bool(loader: yaml.SafeLoader, node: yaml.Node, field: str, p: _Problems) -> bool:
    v = _scalar(loader, node)
    if not isinstance(v, bool):
        p.add(node, f"{field} must be true or false")
        return False
    return v


def _playbook(loader: yaml.SafeLoader, node: yaml.Node, file: str, p: _Problems) -> Playbook | None:
    fields = _mapping(node, "a playbook", p)
    if fields is None:
        return None
    before = len(p.items)
    suggested = set()
    for key, (knode, _) in fields.items():
        if key not in _FIELDS:
            hint = _did_you_mean(key, _FIELDS)
            suggested.add(hint[len("did you mean "):-2])
            p.add(knode, f"unknown playbook field {key!r} ({hint}allowed: {', '.join(_FIELDS)})")
    for required in ("name", "matchers", "target"):
        # A misspelt field that was taken for this one has said so already.
        if required not in fields and required not in suggested:
            p.add(node, f"playbook is missing {required!r}")
    # Every field present is checked, whatever else is missing or wrong, so one run reports every problem.
    name = _scalar(loader, fields["name"][1]) if "name" in fields else None
    if "name" in fields and (not isinstance(name, str) or not _NAME.match(name)):
        p.add(fields["name"][1], "name must be 1 to 64 letters, digits, '_', '.' or '-'")
    kind = _scalar(loader, fields["target"][1]) if "target" in fields else None
    if "target" in fields and kind not in TARGET_KINDS:
        p.add(fields["target"][1], f"target must be 'job' or 'node', not {kind!r}")
    matchers: list[Matcher] = []
    mnode = fields["matchers"][1] if "matchers" in fields else None
    if mnode is None:
        pass
    elif not isinstance(mnode, yaml.SequenceNode) or not mnode.value:
        p.add(mnode, 'matchers must be a non-empty list like - alertname="GPUTemperatureHigh"')
    else:
        for m in mnode.value:
            try:
                matchers.append(parse_matcher(_scalar(loader, m)))
            except MatcherError as exc:
                p.add(m, str(exc))
    actions = _steps(loader, fields["actions"][1], kind, "actions", p) if "actions" in fields else ()
    on_resolved = _steps(loader, fields["on_resolved"][1], kind, "on_resolved", p) if "on_resolved" in fields else ()
    opts: dict[str, Any] = {}
    if "escalate" in fields:
        opts["escalate"] = _ladder(loader, fields["escalate"][1], kind, p)
        # Only when there are none: actions that are listed but invalid have said what is wrong with them.
        if _listed(fields["escalate"][1]) and not _listed(fields["actions"][1] if "actions" in fields else None):
            p.add(fields["escalate"][0], "escalate needs actions: a ladder starts from the playbook's own actions")
    if "notify" in fields:
        opts["notify"] = _notify(loader, fields["notify"][1], p)
    for field in ("cooldown", "approval_timeout", "expire_after", "resolve_timeout", "verify"):
        if field in fields:
            opts[field] = _duration(loader, fields[field][1], field, p)
            if field != "cooldown" and opts[field] is not None and opts[field] <= 0:
                # A zero expiry would expire every command (or approval) the moment it is made.
                p.add(fields[field][1], f"{field} must be longer than zero")
    for field in ("approval", "dry_run", "silence"):
        if field in fields:
            opts[field] = _bool(loader, fields[field][1], field, p)
    if "max_runs" in fields:
        opts["max_runs"] = _max_runs(loader, fields["max_runs"][1], p)
    if "description" in fields:
        opts["description"] = str(_scalar(loader, fields["description"][1]) or "")
    if "max_active" in fields:
        opts["max_active"] = _max_active(loader, fields["max_active"][1], p)
    _check_timeouts(fields, actions, opts.get("expire_after"), p)
    # A playbook with a problem is not made (its name and target are then known to be valid text).
    if len(p.items) > before or not isinstance(name, str) or not isinstance(kind, str):
        return None
    return Playbook(name=name, matchers=tuple(matchers), target=kind, actions=actions, on_resolved=on_resolved,
                    source=f"{file}:{node.start_mark.line + 1}", **opts)


def _ladder(loader: yaml.SafeLoader, node: yaml.Node, kind: str | None, p: _Problems) -> tuple[Stage, ...]:
    """`escalate:`, a list of {after, actions}; problems and warnings go to p."""
    if isinstance(node, yaml.ScalarNode) and node.value in ("", "null", "~"):
        return ()
    if not isinstance(node, yaml.SequenceNode):
        p.add(node, "escalate must be a list of stages like - {after: 10m, actions: [{scale_lr: {factor: 0.5}}]}")
        return ()
    stages = []
    for i, item in enumerate(node.value):
        where = f"escalate[{i}]"
        fields = _mapping(item, where, p)
        if fields is None:
            continue
        if set(fields) != {"after", "actions"}:
            p.add(item, f"{where} needs exactly after and actions, e.g. {{after: 10m, actions: [...]}}")
            continue
        after = _duration(loader, fields["after"][1], f"{where}.after", p)
        steps = _steps(loader, fields["actions"][1], kind, f"{where}.actions", p, stage=True)
        if after is None:
            continue
        if after <= 0:
            p.add(fields["after"][1], f"{where}.after must be longer than zero")
            continue
        if after < MIN_AFTER:
            p.warn(fields["after"][1], f"{where}.after is {after:g}s, shorter than a remediation needs to show in "
                                       "its alert (Prometheus evaluates the rule again and Alertmanager sends the "
                                       f"resolve, about {MIN_AFTER:g}s at least): this stage may run although the "
                                       "previous one worked")
        if not steps and isinstance(fields["actions"][1], yaml.SequenceNode) and not fields["actions"][1].value:
            p.add(fields["actions"][1], f"{where}.actions must list at least one action")
            continue
        stages.append(Stage(after, steps))
    return tuple(stages)


def _notify(loader: yaml.SafeLoader, node: yaml.Node, p: _Problems) -> str | None:
    value = _scalar(loader, node)
    problem = notify_problem(value)
    if problem:
        p.add(node, f"notify {problem}")
        return None
    return str(value)


def notify_problem(value: object) -> str | None:
    """Why a notification URL cannot be used (None when it can): it must be http(s) with a host."""
    if not isinstance(value, str):
        return "must be the URL of a Slack-compatible incoming webhook"
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in value):
        return "must be an http:// or https:// URL of a Slack-compatible incoming webhook"
    return None


def missing_alertmanager(playbooks: Iterable[Playbook], alertmanager_urls: Iterable[str]) -> str | None:
    """Why these playbooks cannot run without Alertmanager's API (one sentence), or None."""
    silenced = [p.name for p in playbooks if p.silence]
    if silenced and not list(alertmanager_urls):
        return (f"playbook {silenced[0]} has silence: true, which needs TRAINMEDIC_ALERTMANAGER_URL: Alertmanager "
                "sends nothing for a silenced alert, not even its resolve, so trainmedic must ask its API")
    return None


def is_warning(problem: str) -> bool:
    """A problem line that does not make the playbooks invalid."""
    return ": warning: " in problem


def _max_runs(loader: yaml.SafeLoader, node: yaml.Node, p: _Problems) -> tuple[int, float] | None:
    fields = _mapping(node, "max_runs", p)
    if fields is None:
        return None
    if set(fields) != {"count", "per"}:
        p.add(node, "max_runs needs exactly count and per, e.g. {count: 3, per: 24h}")
        return None
    count = _scalar(loader, fields["count"][1])
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        p.add(fields["count"][1], "max_runs.count must be an integer >= 1")
        return None
    per = _duration(loader, fields["per"][1], "max_runs.per", p)
    if per is not None and per <= 0:
        p.add(fields["per"][1], "max_runs.per must be longer than zero")
        return None
    return (count, per) if per else None


def _max_active(loader: yaml.SafeLoader, node: yaml.Node, p: _Problems) -> tuple[str, int] | None:
    """`max_active: {count: N}` or `{percent: P}` (1 to 100)."""
    fields = _mapping(node, "max_active", p)
    if fields is None:
        return None
    if len(fields) != 1 or not set(fields) <= {"count", "percent"}:
        p.add(node, "max_active needs exactly one of count or percent, e.g. {count: 2} or {percent: 10}")
        return None
    form, (_, vnode) = next(iter(fields.items()))
    n = _scalar(loader, vnode)
    hi = 100 if form == "percent" else 1_000_000
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= hi:
        p.add(vnode, f"max_active.{form} must be an integer from 1 to {hi}")
        return None
    return form, n


def _check_timeouts(fields: dict[str, tuple[yaml.Node, yaml.Node]], actions: tuple[Step, ...],
                    expire_after: float | None, p: _Problems) -> None:
    """A checkpoint_jobs wait must end before the actions after it expire."""
    expiry = expire_after if expire_after is not None else Playbook.expire_after
    for st in actions:
        if st.action != "checkpoint_jobs":
            continue
        timeout = CATALOGUE["checkpoint_jobs"].parse(st.params).timeout
        if timeout >= expiry:
            p.add(fields["actions"][1], f"checkpoint_jobs timeout ({timeout:g}s) must be shorter than expire_after "
                                        f"({expiry:g}s): the actions after it would expire before they are sent")
    if sum(st.action == "checkpoint_jobs" for st in actions) > 1:
        p.add(fields["actions"][1], "checkpoint_jobs may appear once among a playbook's actions")


def read_yaml(path: Path) -> tuple[yaml.SafeLoader, yaml.Node | None] | str:
    """A YAML file's loader and root node (None for an empty file), or its one problem as FILE:LINE: message."""
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return f"{file}:1: cannot read the file ({exc.__class__.__name__}: {exc})"
    try:
        loader = yaml.SafeLoader(text)
        try:
            return loader, loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", 0) + 1
        problem = getattr(exc, "problem", None) or str(exc)
        return f"{file}:{line}: invalid YAML: {problem}"


def parse_file(path: Path, seen: dict[str, str] | None = None) -> tuple[list[Playbook], list[str]]:
    """Playbooks of one file and its problems; `seen` (name -> place) catches duplicates across files."""
    seen = {} if seen is None else seen
    file = str(path)
    p = _Problems(file)
    read = read_yaml(path)
    if isinstance(read, str):
        return [], [read]
    loader, root = read
    if root is None:
        return [], [f"{file}:1: the file is empty; expected a top-level `playbooks:` list"]
    top = _mapping(root, "the file", p)
    if top is None:
        return [], p.items
    for key, (knode, _) in top.items():
        if key != "playbooks":
            p.add(knode, f"unknown top-level key {key!r} (expected `playbooks:`)")
    if "playbooks" not in top:
        if not p.items:
            p.add(root, "expected a top-level `playbooks:` list")
        return [], p.items
    lst = top["playbooks"][1]
    if not isinstance(lst, yaml.SequenceNode):
        p.add(lst, "playbooks must be a list")
        return [], p.items
    out = []
    for node in lst.value:
        pb = _playbook(loader, node, file, p)
        # Duplicates are found by name even when a playbook is invalid, so one run reports both.
        name = _name_of(node)
        if name is not None:
            if name in seen:
                p.add(node, f"duplicate playbook name {name!r} (first at {seen[name]})")
                continue
            seen[name] = f"{file}:{node.start_mark.line + 1}"
        if pb is not None:
            out.append(pb)
    if p.conditions:
        checked = conditions.check([expr for _, expr in p.conditions])
        for i, why in sorted(checked.problems.items()):
            p.add(p.conditions[i][0], why)
    return out, p.sorted() + p.warnings


def files_of(paths: Iterable[str | Path]) -> list[Path]:
    """YAML files named, or found in the folders named (sorted)."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            out.extend(sorted(q for q in path.iterdir() if q.suffix in (".yaml", ".yml") and q.is_file()))
        else:
            out.append(path)
    return out


def check(paths: Iterable[str | Path]) -> tuple[list[Playbook], list[str]]:
    """All playbooks and all problems of the given files and folders."""
    playbooks: list[Playbook] = []
    problems: list[str] = []
    seen: dict[str, str] = {}
    files = files_of(paths)
    for path in files:
        if not path.exists():
            problems.append(f"{path}: no such file or folder")  # no line to name
            continue
        pbs, probs = parse_file(path, seen)
        playbooks.extend(pbs)
        problems.extend(probs)
    return playbooks, problems


def load(paths: Iterable[str | Path]) -> list[Playbook]:
    """All playbooks, or PlaybookError listing every problem."""
    paths = list(paths)
    playbooks, problems = check(paths)
    errors = [x for x in problems if not is_warning(x)]
    if errors:
        raise PlaybookError(errors)
    if not files_of(paths):
        raise PlaybookError([f"{', '.join(map(str, paths))}: no playbook files (*.yaml) found"])
    return playbooks
