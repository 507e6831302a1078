"""Start-up against damaged or hostile files: the real CLI in a subprocess, each run
bounded in time and killed in cleanup. A start either serves or exits with a clear
message; it never hangs and never shows a traceback."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from tests.commandline import cli, finish, spawn, wait_ready


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    (home / "hermes.yaml").write_text(f"platforms:\n  http:\n    port: {free_port()}\n")
    return home


def _events(lines: list[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in lines if line.startswith("{")]


def _damage(path: Path, form: str) -> None:
    data = path.read_bytes()
    if form == "header-overwritten":
        path.write_bytes(b"\0" * 100 + data[100:])
    else:  # cut in half
        path.write_bytes(data[: len(data) // 2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index_db", ["memory.db", "search.db"])
@pytest.mark.parametrize("form", ["header-overwritten", "cut-in-half"])
def test_a_damaged_index_is_set_aside_and_the_daemon_starts(
    tmp_path: Path, procs: list[subprocess.Popen[str]], form: str, index_db: str
) -> None:
    home = _home(tmp_path)
    procs.append(first := spawn(home, "run", "--log-json"))
    wait_ready(first)
    code, out = finish(first)
    assert code == 0, out
    index = home / "sessions" / index_db
    assert index.stat().st_size > 4096  # a real index, with pages past the header
    _damage(index, form)

    procs.append(second := spawn(home, "run", "--log-json"))
    lines = wait_ready(second, within=30)
    [damaged] = [e for e in _events(lines) if e["event"] == "index_db_damaged"]
    assert damaged["path"] == str(index)
    aside = list(index.parent.glob(f"{index_db}.corrupt-*"))
    assert [p.name for p in aside] == [damaged["moved_to"]]
    code, out = finish(second)
    assert code == 0, out
    assert "Traceback" not in "".join(lines) + out


@pytest.mark.timeout(120)
def test_doctor_reports_a_damaged_memory_db_and_repair_sets_it_aside(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    home = _home(tmp_path)
    procs.append(first := spawn(home, "run"))
    wait_ready(first)
    assert finish(first)[0] == 0
    memory = home / "sessions" / "memory.db"
    ok = cli(home, "doctor", "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    findings = {f["name"]: f for f in json.loads(ok.stdout)}
    assert findings["memory.db"]["status"] == "ok"
    assert findings["search.db"]["status"] == "ok"

    _damage(memory, "cut-in-half")
    found = cli(home, "doctor")
    assert "[warn] memory.db: damaged" in found.stdout, found.stdout
    assert "[ok] search.db" in found.stdout

    repaired = cli(home, "doctor", "--repair", "--json")
    findings = {f["name"]: f for f in json.loads(repaired.stdout)}
    assert findings["memory.db"]["repaired"].startswith("set aside as memory.db.corrupt-")
    assert findings["memory.db"]["status"] == "ok"
    assert list(memory.parent.glob("memory.db.corrupt-*"))


@pytest.mark.timeout(120)
def test_an_index_that_cannot_be_opened_ends_the_start_with_an_exit_code(
    tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    # Not damage (nothing to set aside): SQLite cannot open memory.db's shared-memory
    # file. The start fails, and the process must exit, not linger on a worker thread.
    home = _home(tmp_path)
    (home / "sessions" / "memory.db-shm").mkdir(parents=True)
    procs.append(proc := spawn(home, "run", "--log-json"))
    code, out = finish(proc, within=30, interrupt=False)
    assert code == 1, out
    failed = [e for e in _events(out.splitlines()) if e["event"] == "gateway_start_failed"]
    assert failed, out
    assert "Traceback" not in out


def _alias_bomb(levels: int = 9) -> str:
    """Anchors of anchors, each alias nine of the last: a few hundred bytes that expand
    to 9**levels values."""
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join([*lines, f"agent:\n  bomb: *l{levels - 1}", ""])


HOSTILE_CONFIGS = {
    "alias-bomb": (_alias_bomb(), "aliases expand it to more than"),
    "recursive-alias": ("agent: &a\n  backend: [*a]\n", "recursive alias"),
    "too-many-aliases": (
        "x: &x 1\n" + "".join(f"k{i}: *x\n" for i in range(1_001)),
        "more than 1000 aliases",
    ),
    "nested-too-deeply": ("agent: " + "[" * 20_000 + "]" * 20_000 + "\n", "nested too deeply"),
    "over-a-mebibyte": ("# " + "x" * (1 << 20) + "\n", "larger than 1024 KiB"),
}


@pytest.mark.parametrize("command", ["check-config", "run"])
@pytest.mark.parametrize("case", sorted(HOSTILE_CONFIGS))
def test_a_hostile_config_is_refused_quickly_with_exit_78(
    tmp_path: Path, case: str, command: str
) -> None:
    text, reason = HOSTILE_CONFIGS[case]
    (tmp_path / "hermes.yaml").write_text(text)
    result = cli(tmp_path, command, timeout=60)  # the alias bomb ran past 120 s
    assert result.returncode == 78, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"configuration error: {tmp_path / 'hermes.yaml'}: refused: ")
    assert reason in line
    assert not (tmp_path / "sessions").exists()


def test_anchors_aliases_and_merge_keys_within_the_bounds_still_load(tmp_path: Path) -> None:
    lines = ["x-agent: &base", "  backend: json:loads", "agents:"]
    lines += ["  a:", "    <<: *base", "  b:", "    <<: *base"]
    (tmp_path / "hermes.yaml").write_text("\n".join(lines) + "\n")
    result = cli(tmp_path, "check-config")
    # `x-agent` is no key of the schema: the aliases resolved, and validation spoke.
    assert result.returncode == 78
    assert "x-agent: unknown key" in result.stderr
    assert "refused" not in result.stderr


@pytest.mark.parametrize("command", ["run", "doctor --repair"])
def test_a_directory_named_gateway_lock_is_a_clear_refusal(tmp_path: Path, command: str) -> None:
    home = _home(tmp_path)
    (home / "gateway.lock").mkdir()
    result = cli(home, *command.split(), timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == (78 if command == "run" else 1), out
    assert f"cannot lock {home / 'gateway.lock'}: it is a directory" in out
    assert "Traceback" not in out
    assert (home / "gateway.lock").is_dir()  # not removed behind the operator's back


def test_doctor_reports_a_directory_named_gateway_lock(tmp_path: Path) -> None:
    home = _home(tmp_path)
    (home / "gateway.lock").mkdir()
    result = cli(home, "doctor")
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"[error] gateway.lock: {home / 'gateway.lock'} is a directory" in result.stdout
