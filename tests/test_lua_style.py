"""Every Lua script names its wiring first: its KEYS and ARGV are bound to commented locals at the top, used
nowhere else, and no script assigns a global (nor shares state through lua/common.lua's chunk)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

LUA = Path(__file__).resolve().parents[1] / "client" / "wire" / "lua"
SCRIPTS = sorted(LUA.glob("*.lua"))

KEYWORDS = frozenset("and break do else elseif end false for function goto if in local nil not or repeat return "
                     "then true until while".split())
# A name after one of these begins a new statement (two expressions cannot stand side by side in Lua).
ENDS_EXPRESSION = frozenset({")", "]", "}", "end", "true", "false", "nil", "...", "break", "do", "then", "else",
                             "repeat", ";"})
STATEMENT_KEYWORDS = frozenset({"if", "for", "while", "repeat", "return", "do", "function", "break", "goto", "local"})
_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>--(?:\[(?P<ceq>=*)\[[\s\S]*?\](?P=ceq)\]|[^\n]*))
  | (?P<long>\[(?P<leq>=*)\[[\s\S]*?\](?P=leq)\])
  | (?P<string>"(?:\\[\s\S]|[^"\\\n])*"|'(?:\\[\s\S]|[^'\\\n])*')
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<name>[A-Za-z_]\w*)
  | (?P<op>\.\.\.|\.\.|==|~=|<=|>=|[-+*/%^#<>=(){}\[\];:,.])
""", re.VERBOSE)


@dataclass
class Token:
    kind: str  # name, keyword, string, number, op
    text: str
    line: int


def tokenize(source: str) -> tuple[list[Token], set[int], set[int]]:
    """The script's tokens (comments and spaces left out), the lines that carry a comment, and those that carry
    nothing else."""
    tokens, commented, pos, line = [], set(), 0, 1
    while pos < len(source):
        m = _TOKEN.match(source, pos)
        if m is None:
            raise SyntaxError(f"line {line}: cannot read {source[pos:pos + 20]!r}")
        kind, text = m.lastgroup, m.group()
        if kind == "ceq":
            kind = "comment"
        elif kind == "leq":
            kind = "long"
        if kind == "comment":
            commented.add(line)
        elif kind != "space":
            if kind == "long":
                kind = "string"
            elif kind == "name" and text in KEYWORDS:
                kind = "keyword"
            tokens.append(Token(kind, text, line))
        line += text.count("\n")
        pos = m.end()
    return tokens, commented, commented - {t.line for t in tokens}


@dataclass
class Block:
    opener: str
    names: set[str] = field(default_factory=set)
    in_function: bool = False
    brackets: int = 0  # open ( [ { within this block
    loop_do_seen: bool = False


@dataclass
class Report:
    wiring_outside_top: list[str] = field(default_factory=list)
    uncommented_wiring: list[str] = field(default_factory=list)
    globals_assigned: list[str] = field(default_factory=list)
    chunk_state_written: list[str] = field(default_factory=list)


def check(source: str) -> Report:
    """What a script does against the style: KEYS/ARGV used after the top block of local bindings, a binding
    with no comment, an assignment to a name that is not local, a function writing a chunk-level local."""
    tokens, commented, comment_only = tokenize(source)
    report = Report()
    stack = [Block("chunk")]
    top_block = True  # still in the leading run of `local` statements
    prev: Token | None = None
    i = 0

    def declared(name: str) -> int | None:
        for depth in range(len(stack) - 1, -1, -1):
            if name in stack[depth].names:
                return depth
        return None

    def assigned(name: str, line: int) -> None:
        depth = declared(name)
        if depth is None:
            report.globals_assigned.append(f"line {line}: {name}")
        elif depth == 0 and stack[-1].in_function:
            report.chunk_state_written.append(f"line {line}: {name}")

    def params(j: int) -> tuple[set[str], int]:
        # tokens[j] is the "(" of a parameter list: the names up to ")", and the index after it.
        names = set()
        while tokens[j].text != ")":
            if tokens[j].kind == "name":
                names.add(tokens[j].text)
            j += 1
        return names, j + 1

    while i < len(tokens):
        t = tokens[i]
        block = stack[-1]
        starts = (block.brackets == 0 and (t.kind == "name" or t.text in STATEMENT_KEYWORDS)
                  and (prev is None or prev.text in ENDS_EXPRESSION or prev.kind in ("name", "string", "number")))
        if starts and len(stack) == 1 and t.text != "local":
            top_block = False
        if t.text in ("KEYS", "ARGV") and t.kind == "name":
            if not top_block:
                report.wiring_outside_top.append(f"line {t.line}: {t.text}")
            elif t.line not in commented and t.line - 1 not in comment_only:
                report.uncommented_wiring.append(f"line {t.line}: {t.text}")
        if t.text == "local":
            if tokens[i + 1].text == "function":
                block.names.add(tokens[i + 2].text)
                names, i = params(i + 3)
                stack.append(Block("function", names, in_function=True))
                prev = tokens[i - 1]
                continue
            j = i + 1
            while True:
                block.names.add(tokens[j].text)
                if j + 1 < len(tokens) and tokens[j + 1].text == ",":
                    j += 2
                    continue
                break
            prev, i = tokens[j], j + 1
            continue
        if t.text == "function":
            j = i + 1
            if tokens[j].kind == "name":  # a statement `function NAME...`: an assignment to NAME
                if tokens[j + 1].text not in (".", ":"):
                    assigned(tokens[j].text, t.line)
                while tokens[j].text != "(":
                    j += 1
            names, i = params(j)
            stack.append(Block("function", names, in_function=True))
            prev = tokens[i - 1]
            continue
        if t.text == "for":
            names, j = set(), i + 1
            while tokens[j].text not in ("=", "in"):
                if tokens[j].kind == "name":
                    names.add(tokens[j].text)
                j += 1
            stack.append(Block("loop", names, in_function=block.in_function))
            prev, i = tokens[j], j + 1
            continue
        if t.text in ("while", "if", "repeat"):
            stack.append(Block("loop" if t.text == "while" else t.text, in_function=block.in_function))
        elif t.text == "do":
            if block.opener == "loop" and not block.loop_do_seen:
                block.loop_do_seen = True
            else:
                stack.append(Block("do", in_function=block.in_function))
        elif t.text in ("elseif", "else"):
            block.names = set()
        elif t.text in ("end", "until"):
            stack.pop()
        elif t.text in ("(", "[", "{"):
            block.brackets += 1
        elif t.text in (")", "]", "}"):
            block.brackets -= 1
        elif starts and t.kind == "name":
            # An assignment to plain names: NAME {, NAME} = ...
            names, j = [t], i + 1
            while tokens[j].text == "," and tokens[j + 1].kind == "name":
                names.append(tokens[j + 1])
                j += 2
            if tokens[j].text == "=":
                for n in names:
                    assigned(n.text, n.line)
        prev = t
        i += 1
    return report


def test_the_checker_finds_wiring_used_late_and_globals() -> None:
    bad = check("local rec = KEYS[1]  -- the record\n"
                "local a = ARGV[1]\n"
                "if redis.call('EXISTS', KEYS[2]) == 0 then return 0 end\n"
                "metrics_key = KEYS[3]\n"
                "local function f(x) helper = x; return ARGV[2] end\n"
                "function g() end\n")
    assert bad.wiring_outside_top == ["line 3: KEYS", "line 4: KEYS", "line 5: ARGV"]
    assert bad.uncommented_wiring == ["line 2: ARGV"]
    assert bad.globals_assigned == ["line 4: metrics_key", "line 5: helper", "line 6: g"]
    shared = check("local state = nil\nlocal function set(k)\n  if k then state = k end\nend\n")
    assert shared.chunk_state_written == ["line 3: state"]


def test_the_checker_accepts_locals_fields_and_loops() -> None:
    ok = check("-- the record\nlocal rec, n = KEYS[1], tonumber(ARGV[1])\n"
               "local t = {x = 1}\nt.y, t[2] = 2, 3\n"
               "for i = 1, n do local v = i; v = v + 1 end\n"
               "for k, v in pairs(t) do k = v end\n"
               "local function f(a) a = a or 1; return function(b) b = a end end\n"
               "while n > 0 do n = n - 1 end\nrepeat local z = 1; z = 2 until true\n")
    assert ok == Report()


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_a_script_binds_its_keys_and_argv_at_the_top_and_assigns_no_global(path: Path) -> None:
    report = check(path.read_text(encoding="utf-8"))
    assert report.wiring_outside_top == [], "KEYS/ARGV used below the bindings"
    assert report.uncommented_wiring == [], "each binding says what it is"
    assert report.globals_assigned == []
    if path.name == "common.lua":
        # Its functions run in every script: they take what they need as parameters and keep no state of
        # the chunk (each call's memo table is filled, never replaced).
        assert report.chunk_state_written == []


def test_every_script_is_checked() -> None:
    assert {p.stem for p in SCRIPTS} >= {"ack", "approve", "breaker", "claim", "common", "decide", "decide_many",
                                         "deferred", "fold", "reapply", "reconcile", "release", "verdict"}
