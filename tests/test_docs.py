"""README is a newcomer's page that sends readers to docs/: its two commands are the ones
that exist and that CI runs, and what README and docs/ name (links, repository paths)
is there."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# A markdown link's target: [text](target), without a URL scheme or a bare #anchor.
LINK = re.compile(r"\]\((?![a-z]+:|#)([^)\s#]+)(?:#[^)]*)?\)")
# A repository path in the text: docs/X.md, bench/x.py, deploy/..., tests/x.py, scripts/x,
# tapd/x/ or tapd/x.py. A path with a wildcard or a placeholder is a pattern, not a file;
# one without an extension or a final "/" may be a name (W&B's `tapd/step` metric).
PATH = re.compile(r"(?<![\w./-])((?:docs|bench|deploy|scripts|tests|tapd|client)/[\w./-]*\w/?)")


def named_paths(text: str) -> set[str]:
    found = set()
    for path in PATH.findall(text):
        last = path.rstrip("/").rsplit("/", 1)[-1]
        if path.endswith("/") or "." in last or path.startswith("scripts/"):
            found.add(path)
    return found


def test_readme_gives_the_two_commands_and_ci_runs_its_test_command() -> None:
    text = README.read_text()
    section = text.split("## The two commands\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    assert commands == ["scripts/demo", "scripts/test"], block
    for command in commands:
        assert os.access(ROOT / command, os.X_OK), command
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^(\w+=\S+ )*scripts/test\b", ci, re.M), "CI runs README's test command"
    assert "tapd demo" in (ROOT / "scripts" / "demo").read_text()


def test_readme_names_the_fast_tier_and_the_suite_has_one() -> None:
    assert "`.venv/bin/pytest -m fast`" in README.read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\s*"fast: ', pyproject, re.M), "the fast mark is registered"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_and_path_a_page_names_is_in_the_repository(page: Path) -> None:
    text = page.read_text()
    missing = [
        target for target in LINK.findall(text) if not (page.parent / target).resolve().exists()
    ]
    missing += [path for path in named_paths(text) if not (ROOT / path).exists()]
    assert not missing, f"{page.relative_to(ROOT)} names what is not there: {missing}"


def test_readme_links_every_docs_page() -> None:
    links = set(LINK.findall(README.read_text()))
    pages = {f"docs/{page.name}" for page in PAGES[1:]}
    assert pages <= links, f"README does not link {sorted(pages - links)}"


# A section a page or a module sends readers to: `docs/PROTOCOL.md, "Barrier"`, or a
# markdown link to the page followed by `, "Section"`.
SECTION_REFERENCE = re.compile(
    r"((?:docs|bench)/[A-Z_]+\.md)(?:\]\([^)\s]*\))?`?\)?,? \"([^\"\n]+)\""
)
SOURCES = [
    *PAGES,
    *sorted((ROOT / "bench").glob("*.md")),
    *sorted((ROOT / "tapd").rglob("*.py")),
    *sorted((ROOT / "client").rglob("*.py")),
    *sorted(path for path in (ROOT / "deploy").rglob("*") if path.is_file()),
]


def _labels(page: Path) -> set[str]:
    """What a reader finds on `page` by name: its headings, its bold labels (`**Security**:`)
    and the first cell of its table rows (a message kind: | `hello` |)."""
    text = page.read_text()
    found = re.findall(r"(?m)^#+\s+(.*)$", text)
    found += re.findall(r"\*\*([^*\n]+)\*\*", text)
    found += re.findall(r"(?m)^\|\s*([^|\n]+?)\s*\|", text)
    return {re.sub(r"[`*]", "", label).strip().lower() for label in found}


def test_every_section_a_reference_names_is_on_its_page() -> None:
    """`docs/X.md, "Section"` leads to a heading (or label) that contains those words."""
    broken = []
    for source in SOURCES:
        for page_name, section in SECTION_REFERENCE.findall(source.read_text(errors="replace")):
            page = ROOT / page_name
            wanted = re.sub(r"[`*]", "", section).strip().lower()
            if not page.exists() or not any(wanted in label for label in _labels(page)):
                broken.append(f"{source.relative_to(ROOT)}: {page_name}, {section!r}")
    assert not broken, "references to sections that are not there:\n" + "\n".join(broken)
