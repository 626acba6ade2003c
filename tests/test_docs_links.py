"""The reading stays true: every relative link in the README and docs/ resolves (to a file or
folder of the repository, and to a heading when it names one), no user-facing page names a path
outside the repository or an issue number, and every file kept in a results folder is named by
that folder's README (by name or glob pattern)."""
import fnmatch
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RESULTS = ROOT / "bench" / "results"
RESULT_READMES = sorted(RESULTS.glob("*/README.md"))

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# reference material beside the repository, issue numbers: meaningless to a reader of the repository
FORBIDDEN = [re.compile(r"\.\./shared"), re.compile(r"\b(DESIGN|STYLE|GPU)\.md\b"),
             re.compile(r"\bissue[ -]?#?\d+|\bissue #|\bmain before\b", re.I)]


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(path: Path) -> str:
    """The page without its fenced code blocks (a link there is an example, not a link)."""
    return FENCE.sub("", path.read_text())


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for h in HEADING.findall(prose(path)):
        s = slug(h)
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    return out


def links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"[a-z][a-z0-9+.-]*:", t, re.I)]


@pytest.mark.parametrize("page", PAGES + RESULT_READMES, ids=rel)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists() or ROOT not in (dest, *dest.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {rel(dest)}")
    assert not broken, f"{rel(page)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES + RESULT_READMES, ids=rel)
def test_names_no_outside_path_or_issue_number(page):
    text = page.read_text()
    hits = sorted({m.group(0) for p in FORBIDDEN for m in p.finditer(text)})
    assert not hits, f"{rel(page)} names {hits}"


def test_the_readme_links_every_docs_page():
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme)}
    missing = [rel(p) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"


def named_patterns(readme: Path) -> tuple[list[str], list[str]]:
    """(file patterns, folder prefixes) a results README names in backticks, line by line.
    `a_{b,c}.json` names a_b.json and a_c.json; an extension alone (`.png`, or `x.json/.png`)
    names that extension of the names just before it: `a.json`, `b.json` (`.png`) names a.png
    and b.png."""
    patterns, folders = [], []
    for line in readme.read_text().splitlines():
        stems, after_ext = [], False
        for span in re.findall(r"`([^`]+)`", line):
            for word in span.split():
                for w in expand_braces(word):
                    for part in re.split(r"[,;()]+", w):
                        for j, piece in enumerate(part.split("/.")):
                            piece = piece if j == 0 else "." + piece
                            if re.fullmatch(r"\.[A-Za-z0-9]+", piece):
                                patterns += [stem + piece for stem in stems]
                                after_ext = True
                            elif piece.endswith("/") and "." not in piece:
                                folders.append(piece.rstrip("/").rsplit("/", 1)[-1] + "/")
                            elif re.search(r"\.[A-Za-z0-9]+$", name := piece.rsplit("/", 1)[-1]):
                                if after_ext:
                                    stems, after_ext = [], False
                                patterns.append(name)
                                stems.append(name.rsplit(".", 1)[0])
    return patterns, folders


def expand_braces(word: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", word)
    if not m:
        return [word]
    return [x for alt in m.group(1).split(",")
            for x in expand_braces(word[:m.start()] + alt + word[m.end():])]


@pytest.mark.parametrize("readme", RESULT_READMES, ids=lambda p: p.parent.name)
def test_every_kept_result_file_is_named_by_its_readme(readme):
    folder = readme.parent
    patterns, folders = named_patterns(readme)
    unnamed = []
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p != readme):
        r = str(f.relative_to(folder))
        if any(r.startswith(d) for d in folders):
            continue
        if not any(fnmatch.fnmatch(r, p) or fnmatch.fnmatch(f.name, p) for p in patterns):
            unnamed.append(r)
    assert not unnamed, f"{rel(readme)} does not name {unnamed}"


def test_every_results_folder_has_a_readme():
    bare = [rel(d) for d in RESULTS.iterdir() if d.is_dir() and not (d / "README.md").is_file()]
    assert not bare, f"results folders without a README: {bare}"
