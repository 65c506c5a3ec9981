"""MkDocs hooks for the docs site (mkdocs.yml): pages kept outside docs/, and GitHub's anchors.

Why: README.md, RESULTS.md, CHANGELOG.md and bench/README.md are read on GitHub at their
repository paths, and every page links by repository path (`docs/learner.md`,
`../bench/README.md#efficacy-…`). The site mounts those four files as pages and rewrites each
relative link that names a page by its repository path into the page's place on the site, so
one set of files reads right in both places. A link to anything else is left as written: the
strict build (mkdocs.yml's `validation`) reports it if it does not resolve.

Headings get GitHub's anchors (lower case, punctuation dropped, each space a hyphen, nothing
collapsed), so `#does-it-learn-sft--grpo-on-smollm2-full-and-lora-benchreal_learnpy` names the
same heading on GitHub and on the site; tests/test_docs_truth.py checks links by that rule.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

# Repository path -> the page it becomes on the site (docs/X.md becomes X.md).
MOUNTED = {
    "README.md": "index.md",
    "RESULTS.md": "results.md",
    "CHANGELOG.md": "changelog.md",
    "bench/README.md": "benchmarks.md",
}
LINK = re.compile(r"(\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^[ \t]*```.*?^[ \t]*```[ \t]*$", re.S | re.M)
SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.I)


def github_slug(text: str, separator: str = "-") -> str:
    """GitHub's anchor for a heading's text (toc's `slugify(value, separator)` signature)."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", separator)


def repository_path(site_page: str) -> str:
    """Where a site page lives in the repository."""
    mounted = {page: path for path, page in MOUNTED.items()}
    return mounted.get(site_page, f"docs/{site_page}")


def site_page(repo_path: str) -> str | None:
    """The site page a repository path becomes, or None if it is not a page."""
    if repo_path in MOUNTED:
        return MOUNTED[repo_path]
    if repo_path.startswith("docs/") and repo_path.endswith(".md"):
        return repo_path.removeprefix("docs/")
    return None


def rewrite_target(target: str, page: str) -> str:
    """A link target written for the repository, as the site page `page` must write it."""
    if SCHEME.match(target) or target.startswith(("#", "/")):
        return target
    path, hash_, anchor = target.partition("#")
    here = posixpath.dirname(repository_path(page))
    goes_to = site_page(posixpath.normpath(posixpath.join(here, path)))
    if goes_to is None:
        return target
    return posixpath.relpath(goes_to, posixpath.dirname(page) or ".") + hash_ + anchor


def rewrite_links(markdown: str, page: str) -> str:
    """Every relative link outside fenced blocks, rewritten by `rewrite_target`."""
    def links(text: str) -> str:
        return LINK.sub(lambda m: m.group(1) + rewrite_target(m.group(2), page) + m.group(3),
                        text)

    out, last = [], 0
    for fence in FENCE.finditer(markdown):
        out += [links(markdown[last:fence.start()]), fence.group(0)]
        last = fence.end()
    return "".join([*out, links(markdown[last:])])


def on_config(config):
    config.mdx_configs.setdefault("toc", {})["slugify"] = github_slug
    return config


def on_files(files: Files, config) -> Files:
    root = Path(config.config_file_path).parent
    for repo_path, page in MOUNTED.items():
        files.append(File.generated(config, page, abs_src_path=str(root / repo_path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return rewrite_links(markdown, page.file.src_uri)
