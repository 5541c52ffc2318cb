"""The repository stands on its own, and its front door stays a front door.

No engine needed: these read the files ``git ls-files`` lists.

* The README is short (at most 250 lines), opens with the two commands, and holds no dated lab
  paragraph: experiments live in ``docs/lab-notes/``.
* No tracked file names a path outside the repository or on a developer's machine (a shared
  design document, a coordination folder, a home directory): a reader of the repo could not
  follow such a reference.
* Every relative link in the README and ``docs/`` points to a tracked file (and, for a link into
  a Markdown file, to a heading that exists), every ``make`` target they name exists, every
  ``python -m`` module they name is in the package, and every repository path they name (a
  command's argument as much as a link) is a tracked file or folder.
* Every ``import vllm`` of the package lives in one folder (``session_gate/engine`` for the
  product, ``session_gate/lab/engine`` for the lab), and every ``extern "C"`` of the crate in
  ``src/ffi``.
"""

from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 250

# Built from parts so that this file does not match its own patterns.
OUTSIDE_PATHS = [
    "../" + "shared",
    "shared/" + "baselines",
    "DESIGN" + ".md",
    "/" + "work/",
    "/" + "root/",
    "/" + "home/",
    "coord" + "/",
    "TWIN_" + "CONTRACT",
]

MONTHS = "Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec"
DATED_LAB_TEXT = [
    re.compile(r"\btried on\b", re.IGNORECASE),
    re.compile(r"\bnot kept\b", re.IGNORECASE),
    re.compile(rf"\b\d{{1,2}} ({MONTHS})[a-z]*\b"),
    re.compile(rf"\b({MONTHS})[a-z]* \d{{1,2}}\b"),
    re.compile(r"\b(19|20)\d\d-\d\d-\d\d\b"),
]


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:  # not a git checkout
        pytest.skip(f"git ls-files unavailable here: {exc}")
    return [p for p in out.decode().split("\0") if p]


def doc_files() -> list[Path]:
    """The README and every tracked Markdown file under docs/."""
    docs = [ROOT / p for p in tracked_files() if p.startswith("docs/") and p.endswith(".md")]
    return [README, *sorted(docs)]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def test_readme_is_at_most_250_lines():
    count = len(README.read_text().splitlines())
    assert count <= MAX_README_LINES, f"README.md has {count} lines (at most {MAX_README_LINES})"


def test_readme_opens_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# "), "the README starts with its title"
    start = lines.index("```bash")
    block = lines[start + 1 : lines.index("```", start + 1)]
    assert start <= 3, "the commands block comes straight after the title"
    assert [line.split()[:2] for line in block] == [["make", "demo"], ["make", "test"]]


def test_readme_has_no_dated_lab_paragraph():
    found = [
        f"README.md:{number}: {match.group(0)!r}"
        for number, line in enumerate(README.read_text().splitlines(), 1)
        for pattern in DATED_LAB_TEXT
        if (match := pattern.search(line))
    ]
    assert not found, "dated lab text belongs in docs/lab-notes/:\n" + "\n".join(found)


def test_no_tracked_file_names_an_outside_path():
    found = []
    for rel in tracked_files():
        path = ROOT / rel
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{rel}:{number}: {p}" for p in OUTSIDE_PATHS if p in line]
    assert not found, "tracked files cite paths outside the repo:\n" + "\n".join(found)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for a Markdown file's headings (lowercase, punctuation dropped)."""
    anchors = set()
    for _, line in prose_lines(markdown):
        if match := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            anchors.add(slug)
    return anchors


def test_every_relative_link_in_readme_and_docs_resolves():
    tracked = set(tracked_files())
    tracked_dirs = {str(Path(p).parent) for p in tracked}
    tracked_dirs |= {str(parent) for p in tracked for parent in Path(p).parents}
    broken = []
    for doc in doc_files():
        text = doc.read_text()
        for number, line in prose_lines(text):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                    continue
                where = f"{doc.relative_to(ROOT)}:{number}: {target}"
                path_part, _, anchor = target.partition("#")
                dest = (doc.parent / path_part).resolve() if path_part else doc
                try:
                    rel = dest.relative_to(ROOT).as_posix()
                except ValueError:
                    broken.append(f"{where} (outside the repository)")
                    continue
                if rel not in tracked and rel not in tracked_dirs:
                    broken.append(f"{where} (no such tracked file)")
                elif anchor and rel.endswith(".md"):
                    if anchor not in heading_anchors(dest.read_text()):
                        broken.append(f"{where} (no heading #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z0-9][\w.-]*):(?!=)", makefile, re.MULTILINE))


def test_every_make_target_the_docs_name_exists():
    targets = make_targets()
    missing = []
    for doc in doc_files():
        text = doc.read_text()
        for target in set(re.findall(r"`make ([a-z][\w-]*)", text)):
            if target not in targets:
                missing.append(f"{doc.relative_to(ROOT)}: make {target}")
    assert not missing, "named make targets that do not exist:\n" + "\n".join(missing)


def module_exists(module: str) -> bool:
    base = ROOT / "python" / Path(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_every_python_module_the_docs_name_exists():
    missing = []
    named = re.compile(r"(?:python -m\s+|from\s+)(session_gate(?:\.\w+)*)")
    for doc in doc_files():
        for module in set(named.findall(doc.read_text())):
            if not module_exists(module):
                missing.append(f"{doc.relative_to(ROOT)}: {module}")
    assert not missing, "named modules that are not in python/:\n" + "\n".join(missing)


VLLM_IMPORT = re.compile(r"^\s*(import vllm\b|from vllm\b)", re.MULTILINE)
VLLM_FOLDERS = ("python/session_gate/engine/", "python/session_gate/lab/engine/")
EXTERN_C = re.compile(r'^\s*(pub\s+)?(unsafe\s+)?extern\s+"C"', re.MULTILINE)


def test_vllm_is_imported_in_one_folder_and_extern_c_declared_in_one():
    files = tracked_files()
    stray_imports = [
        p
        for p in files
        if p.startswith("python/session_gate/")
        and p.endswith(".py")
        and not p.startswith(VLLM_FOLDERS)
        and VLLM_IMPORT.search((ROOT / p).read_text())
    ]
    assert not stray_imports, f"import vllm outside {VLLM_FOLDERS}: {stray_imports}"
    stray_externs = [
        p
        for p in files
        if p.startswith("src/")
        and p.endswith(".rs")
        and not p.startswith("src/ffi/")
        and EXTERN_C.search((ROOT / p).read_text())
    ]
    assert not stray_externs, f'extern "C" outside src/ffi/: {stray_externs}'


#: A path into the repository as the docs write one, in prose or in a command: a top-level
#: folder, then more path, possibly a glob.
REPO_PATH = re.compile(
    r"(?<![\w./*-])((?:examples|python|src|tests|include|docs|scripts|grafana|\.ci)/[\w./*-]*[\w/*])"
)


def test_every_repository_path_the_docs_name_exists():
    tracked = set(tracked_files())
    folders = {str(Path(p).parent) for p in tracked}
    folders |= {str(parent) for f in list(folders) for parent in Path(f).parents}
    missing = []
    for doc in doc_files():
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for match in REPO_PATH.finditer(line):
                path = match.group(1).rstrip("/.")
                if "*" in path:
                    found = any(fnmatch.fnmatch(t, path) for t in tracked)
                else:
                    found = path in tracked or path in folders
                if not found:
                    missing.append(f"{doc.relative_to(ROOT)}:{lineno}: {path}")
    assert not missing, "paths the docs name that the repository does not have:\n" + "\n".join(
        missing
    )
