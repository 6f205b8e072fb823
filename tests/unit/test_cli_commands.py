"""`cpn COMMAND …` imports the module of COMMAND alone (`cpn.cli.COMMAND_MODULES`).

The table must name, for every command `app` has, the module that registers it: a command
missing from it would still run (an unknown word registers every module), but a wrong
entry would make `cpn that-command` say "No such command". Each check runs in a fresh
interpreter, where nothing is imported yet.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cpn.cli import COMMAND_MODULES


def _python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


def test_the_table_names_every_command_s_own_module() -> None:
    found = json.loads(
        _python(
            "import json\n"
            "from cpn.cli import app, register\n"
            "register([])\n"
            "out = {c.callback.__name__: c.callback.__module__ for c in app.registered_commands}\n"
            "out |= {g.name: g.typer_instance.registered_commands[0].callback.__module__\n"
            "        for g in app.registered_groups}\n"
            "print(json.dumps(out))\n"
        )
    )
    assert {name: f"cpn.cli.{m}" for name, m in COMMAND_MODULES.items()} == found


@pytest.mark.parametrize("command", sorted(COMMAND_MODULES))
def test_a_command_imports_its_module_alone(command: str) -> None:
    loaded = json.loads(
        _python(
            "import json, sys\n"
            "from cpn.cli import register\n"
            f"register([{command!r}, '--help'])\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('cpn.cli.'))))\n"
        )
    )
    own = f"cpn.cli.{COMMAND_MODULES[command]}"
    others = {f"cpn.cli.{m}" for m in COMMAND_MODULES.values()} - {own}
    assert own in loaded
    assert not others & set(loaded), f"cpn {command} imported {sorted(others & set(loaded))}"


def _cpn(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cpn", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_and_an_unknown_command_still_list_every_command() -> None:
    helped = _cpn("--help")
    assert helped.returncode == 0
    for command in COMMAND_MODULES:
        assert command in helped.stdout, command
    wrong = _cpn("wroker")
    assert wrong.returncode == 2
    assert "No such command 'wroker'" in wrong.stderr
