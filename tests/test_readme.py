"""The README's two commands are the interface of the project: keep CI and the README in step."""

from __future__ import annotations

import re

from conftest import REPO_ROOT


def _readme_commands() -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    section = text.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section, flags=re.S)


def test_readme_gives_two_commands_that_set_up_first():
    cmds = _readme_commands()
    assert len(cmds) == 2, cmds
    for cmd in cmds:
        assert "\n" not in cmd.strip(), "each command is one line"
        # torch first, so the package's torch range does not pull a CUDA build
        assert cmd.index("pip install -q torch==2.13.0") < cmd.index("-e '.")
    assert cmds[0].endswith("entrain-data demo")
    assert cmds[1].endswith("python -m pytest")


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert _readme_commands()[1] in ci_lines
