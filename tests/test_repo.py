"""The repository's own promises: lint, the README's test command is CI's, the lock keeps pyproject's floors,
every flag has help, every relative link in the docs leads somewhere."""

import ast
import importlib
import re
import subprocess
import sys

import pytest
import tyro
from helpers import REPO, SCRIPTS

ALGO_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("*_multigpu.py"))


def test_ruff_lint_and_format():
    for cmd in (["check", "."], ["format", "--check", "."]):
        proc = subprocess.run([sys.executable, "-m", "ruff", *cmd], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = (REPO / ".ci/run").read_text().splitlines()
    ci_command = ci_lines[ci_lines.index(next(line for line in ci_lines if "README test command" in line)) + 1]
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert blocks[1].strip() == ci_command.strip()  # the README's second command is the test command


def locked() -> dict:
    """requirements/lock.txt's pins for this Python and platform: {canonical name: version}."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins = {}
    for line in (REPO / "requirements" / "lock.txt").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            requirement = Requirement(line)
            (spec,) = requirement.specifier  # one exact version each
            assert spec.operator == "==", line
            if requirement.marker is None or requirement.marker.evaluate():
                assert canonicalize_name(requirement.name) not in pins, f"{requirement.name} pinned twice here"
                pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def test_the_lock_keeps_pyprojects_floors_and_the_torch_that_ci_installs():
    """Every requirement of pyproject.toml, extras included, is pinned in requirements/lock.txt at a version that its
    floor admits (a lock made before a floor was raised fails here); .ci/run's CPU torch is the locked one."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].values()
    pins = locked()
    for line in [*project["dependencies"], *(r for extra in extras for r in extra)]:
        requirement = Requirement(line)
        version = pins.get(canonicalize_name(requirement.name))
        assert version is not None, f"{requirement.name} is not in requirements/lock.txt: refresh it"
        assert requirement.specifier.contains(version, prereleases=True), f"{requirement.name}=={version}, not {line}"
    ci_torch = re.search(r"pip install --quiet torch==(\S+)", (REPO / ".ci/run").read_text()).group(1)
    assert ci_torch == pins["torch"], (ci_torch, pins["torch"])
    assert f"torch=={ci_torch}" in (REPO / "requirements" / "pins.in").read_text().splitlines()


@pytest.mark.parametrize("script", ALGO_SCRIPTS)
def test_every_flag_has_a_one_line_help(script, monkeypatch, capfd):
    """The script's --help (tyro's, from its Args, as main() parses it), here in this process."""
    monkeypatch.setenv("COLUMNS", "200")
    module = importlib.import_module(f"cleanrl_ddp.{script.removesuffix('.py')}")
    with pytest.raises(SystemExit) as exit_code:
        tyro.cli(module.Args, args=["--help"])
    help_text = capfd.readouterr().out
    assert exit_code.value.code == 0, help_text
    entries = []  # one per flag: the box row with the flag plus its continuation rows
    for line in help_text.splitlines():
        row = line.strip("│╭╰─╮╯ ")
        if row.startswith("--"):
            entries.append(row)
        elif entries and row and not row.startswith("-h"):
            entries[-1] += " " + row
    assert len(entries) > 20, help_text
    for entry in entries:
        flag = entry.split()[0].rstrip(",")
        text = re.sub(r"\(default: [^)]*\)", "", entry)
        text = " ".join(w for w in text.split() if not w.startswith("--") and not w.isupper() and "{" not in w)
        assert len(re.findall(r"[a-z]{2,}", text)) >= 2, f"{flag} has no help text: {entry!r}"


def test_the_flat_all_reduce_is_the_same_in_every_script():
    """Each script keeps its own copy (it is part of the algorithm a reader copies), byte for byte the same."""
    copies = {}
    for script in ALGO_SCRIPTS:
        source = (SCRIPTS / script).read_text()
        tree = ast.parse(source)
        found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "all_reduce_gradients_flat"]
        if found:
            copies[script] = ast.get_source_segment(source, found[0])
    assert len(copies) == len(ALGO_SCRIPTS), sorted(set(ALGO_SCRIPTS) - set(copies))
    reference = copies["ppo_multigpu.py"]
    assert [s for s, copy in copies.items() if copy != reference] == []


def anchors(page) -> set:
    """The anchors GitHub makes of a Markdown page's headings: lower case, punctuation dropped, spaces to hyphens,
    a repeated heading numbered -1, -2, ..."""
    seen, found = {}, set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    """README.md and every page under docs/ and benchmark/: each relative link names a file of the checkout, and
    each #anchor a heading of its page."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "benchmark").rglob("*.md"))]
    broken, links = [], 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            links += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert links > 100 and broken == [], "\n".join(broken)
