"""README.md: every code block runs as written, and the README stays short.

* `make`: each target exists (`make -n`), `make example` installs waveplan alone (no torch,
  no extras) and its plan command succeeds; `make test` installs every extra the suite needs;
* `cli`: every `waveplan` line exits 0 (in-process, from the repository root);
* `loop`: the Python loop runs (in a scratch folder: it writes profiles.json).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from waveplan.planner.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 160

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def blocks() -> dict[str, tuple[str, str]]:
    found = re.findall(r"<!-- readme-test: ([\w-]+) -->\s*```(\w+)\n(.*?)```", README.read_text(), re.S)
    return {name: (lang, code) for name, lang, code in found}


def commands(code: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in code.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_readme_is_short_and_every_block_is_tested():
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_LINES
    fences = text.count("```")
    assert fences % 2 == 0 and fences // 2 == len(blocks()), "a README code block has no readme-test marker"
    for target in re.findall(r"\]\(((?:docs|examples)/[^)#]*)", text):
        assert (ROOT / target).exists(), target


def _recipe(makefile: str, target: str) -> list[str]:
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert match, f"Makefile has no target {target}"
    return [line.strip() for line in match.group(1).splitlines()]


def test_make_block(capsys):
    lang, code = blocks()["make"]
    assert lang == "bash"
    makefile = (ROOT / "Makefile").read_text()
    targets = []
    for line in commands(code):
        words = line.split()
        assert words[0] == "make" and len(words) == 2, line
        targets.append(words[1])
    assert targets == ["example", "test"]
    if shutil.which("make"):
        for target in targets:
            done = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
    # make example: waveplan alone (numpy + numba), then the plan
    assert re.search(r"^example: install-core$", makefile, re.M)
    assert re.search(r"^install-core: \$\(BIN\)/\.installed-core$", makefile, re.M)
    pip = [line for line in _recipe(makefile, "$(BIN)/.installed-core") if "pip " in line]
    assert pip and all("torch" not in line and "[" not in line for line in pip), pip
    (plan,) = [line for line in _recipe(makefile, "example") if "waveplan" in line]
    argv = shlex.split(plan)[1:]
    assert main(argv) == 0
    assert "proven optimal" in capsys.readouterr().out
    # make test: every extra the suite imports
    full = _recipe(makefile, "$(BIN)/.installed")
    assert any("torch==" in line for line in full)
    assert any("solver" in line and "megatron" in line and "dev" in line for line in full)


def test_cli_block(capsys, monkeypatch):
    lang, code = blocks()["cli"]
    assert lang == "bash"
    monkeypatch.chdir(ROOT)
    for line in commands(code):
        argv = shlex.split(line)
        assert argv[0] == "waveplan", line
        assert main(argv[1:]) == 0, line
        assert capsys.readouterr().out, line


def test_loop_block(tmp_path, monkeypatch, capsys):
    pytest.importorskip("torch")
    lang, code = blocks()["loop"]
    assert lang == "python"
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "README.md:loop", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out.splitlines()
    assert (tmp_path / "profiles.json").is_file()
    assert any(line.split()[2] in ("evidence", "conservative") for line in out if len(line.split()) == 4)


def test_make_example_plans_without_torch_or_extras(tmp_path):
    """What `make example` installs (numpy and numba) is enough: its plan command succeeds in a
    fresh process where torch, megatron-core, OR-Tools, matplotlib and tqdm cannot be imported."""
    makefile = (ROOT / "Makefile").read_text()
    (plan,) = [line for line in _recipe(makefile, "example") if "waveplan" in line]
    argv = shlex.split(plan)[1:]
    script = ("import sys\n"
              "for name in ('torch', 'megatron', 'ortools', 'matplotlib', 'tqdm', 'verl'):\n"
              "    sys.modules[name] = None   # import fails\n"
              "from waveplan.planner.cli import main\n"
              f"sys.exit(main({argv!r}))\n")
    env = dict(os.environ, WAVEPLAN_COLD_COMPILE="never")   # interpreted kernels: no compile wait
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "proven optimal" in done.stdout
