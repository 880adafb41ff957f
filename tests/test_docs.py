"""The documents a user reads: README stays a front page (reference material lives in docs/), and
every relative link in README, BENCHMARKS and docs/ reaches a file, and a heading where it names
one."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 25_000
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but hyphens and underscores
    dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)  # no headings in code
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_a_front_page():
    assert (ROOT / "README.md").stat().st_size <= README_MAX_BYTES


def test_every_relative_link_reaches_its_file_and_heading():
    broken = []
    for doc in documents():
        text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            file, _, anchor = target.partition("#")
            dest = (doc.parent / file).resolve() if file else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_slug_is_githubs():
    assert slug("Your own checkpoint and a GPU") == "your-own-checkpoint-and-a-gpu"
    assert slug("docproc stats and docproc eval") == "docproc-stats-and-docproc-eval"
    assert slug("On several GPUs and machines (Ray)") == "on-several-gpus-and-machines-ray"
