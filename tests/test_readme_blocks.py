"""Run every README code block marked runnable, so the docs cannot drift from the code.

A fenced block whose info string is ``python runnable`` or ``bash runnable`` (in README.md or
packages/*/README.md) becomes one test, id ``<readme>:<line>``. Python blocks run with the venv's
interpreter in a fresh process, bash blocks with ``bash -e`` and the venv's bin first on PATH; both in
an empty temporary folder, offline, with a 120 s timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\S*)(.*)$")
TIMEOUT_S = 120


@dataclass(frozen=True)
class Block:
    """One runnable fenced block: where it starts, its language and its text."""

    readme: str
    line: int
    lang: str
    code: str


def readme_blocks(path: Path) -> list[Block]:
    """Return the blocks of ``path`` whose info string carries the word ``runnable``."""
    blocks: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    rel = path.relative_to(ROOT).as_posix()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, rest = m.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if "runnable" in rest.split():
            blocks.append(Block(rel, start + 1, lang, "\n".join(body) + "\n"))
    return blocks


def all_blocks() -> list[Block]:
    readmes = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
    return [b for r in readmes if r.exists() for b in readme_blocks(r)]


BLOCKS = all_blocks()


def test_every_package_readme_has_a_runnable_quick_start() -> None:
    """Each user-facing package README carries at least one block this file runs."""
    with_blocks = {b.readme for b in BLOCKS}
    for pkg in ("streaming", "checkpoint", "health", "moe", "llm"):
        assert f"packages/{pkg}/README.md" in with_blocks, f"packages/{pkg}/README.md has no runnable block"


@pytest.mark.parametrize("block", BLOCKS, ids=[f"{b.readme}:{b.line}" for b in BLOCKS])
def test_readme_block_runs(block: Block, tmp_path: Path) -> None:
    """The block exits 0; otherwise the test fails showing the block's output."""
    bindir = str(Path(sys.executable).parent)
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PATH=bindir + os.pathsep + env.get("PATH", ""),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    env.pop("SMALTI_RUN_NAME", None)
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code, encoding="utf-8")
        cmd = [sys.executable, str(script)]
    elif block.lang == "bash":
        script = tmp_path / "block.sh"
        script.write_text(block.code, encoding="utf-8")
        cmd = ["bash", "-e", str(script)]
    else:
        pytest.fail(f"{block.readme}:{block.line}: runnable block of unknown language {block.lang!r}")
    work = tmp_path / "work"
    work.mkdir()
    try:
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.readme}:{block.line}: timed out after {TIMEOUT_S} s\n{e.stdout}\n{e.stderr}")
    if proc.returncode != 0:
        pytest.fail(
            f"{block.readme}:{block.line}: exit code {proc.returncode}\n"
            f"--- block ---\n{block.code}--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-6000:]}",
            pytrace=False,
        )
