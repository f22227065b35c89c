"""Contract: the README and docs/ point only at files a user of the repository has (issue 16): no paths of the
machine they were written on, no files outside the repository, and every relative link resolves."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OUTSIDE = re.compile(r"\.\./shared|/work/|\.library|DESIGN(\.md| §)|STYLE\.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_point_only_at_files_in_the_repository(doc):
    text = doc.read_text()
    assert not [m.group(0) for m in OUTSIDE.finditer(text)], doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (doc.parent / target).exists(), f"{doc.name}: link to {target}"
