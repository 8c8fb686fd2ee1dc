"""MkDocs hook (mkdocs.yml `hooks:`): links from a page to repository files outside docs/.

The pages in docs/ are read on GitHub as well as in the built site, so a page links to a
repository file by its relative path (`[table](../benchmarks/results/allreduce_cpu.md)`): that
link works on GitHub but has no target in the site, and MkDocs' link validation reports it.
This hook renders each such link as the repository path in code font (the link's text, then
the path in brackets when the text is not the path itself), after checking that the file or
folder exists: a link to a missing repository file still fails `mkdocs build --strict`.

Links between pages (and to their anchors) are left alone: MkDocs validates them as configured
in mkdocs.yml `validation:`. Only links whose target, resolved from the page, lies outside
docs_dir but inside the repository are rewritten; nothing is fetched, nothing else changes.
"""
from __future__ import annotations

import logging
import posixpath
import xml.etree.ElementTree as etree
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from markdown import Extension, Markdown
from markdown.treeprocessors import Treeprocessor

log = logging.getLogger("mkdocs.hooks.repository_links")

_state: dict[str, Any] = {"page": None}


class _RepositoryLinks(Treeprocessor):
    def __init__(self, md: Markdown, docs_dir: Path, repo_root: Path) -> None:
        super().__init__(md)
        self.docs_dir = docs_dir
        self.repo_root = repo_root

    def run(self, root: etree.Element) -> None:
        page = _state["page"]
        if page is None:
            return
        page_dir = posixpath.dirname(page.file.src_uri)
        parents = {child: parent for parent in root.iter() for child in parent}
        for link in list(root.iter("a")):
            href = link.get("href", "")
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or not parts.path or parts.path.startswith("/"):
                continue
            rel = posixpath.normpath(posixpath.join(page_dir, unquote(parts.path)))
            if not rel.startswith("../"):
                continue  # inside docs_dir: MkDocs validates it
            target = (self.docs_dir / rel).resolve()
            try:
                repo_path = target.relative_to(self.repo_root).as_posix()
            except ValueError:
                log.warning("Doc file '%s' links to '%s', outside the repository", page.file.src_uri, href)
                continue
            if not target.exists():
                log.warning("Doc file '%s' links to '%s': no such repository file '%s'",
                            page.file.src_uri, href, repo_path)
                continue
            self._replace(link, parents[link], repo_path + ("/" if target.is_dir() else ""))

    @staticmethod
    def _replace(link: etree.Element, parent: etree.Element, repo_path: str) -> None:
        """Turn `<a href=..>text</a>` into `text (<code>path</code>)`, or `<code>path</code>`
        when the text is the path already."""
        text = "".join(link.itertext()).strip().strip("`")
        span = etree.Element("span", {"class": "repository-path"})
        span.tail = link.tail
        if text.rstrip("/") == repo_path.rstrip("/"):
            code = etree.SubElement(span, "code")
            code.text = repo_path
        else:
            span.text = link.text
            for child in link:
                span.append(child)
            last = span[-1] if len(span) else None
            suffix = " ("
            if last is not None:
                last.tail = (last.tail or "") + suffix
            else:
                span.text = (span.text or "") + suffix
            code = etree.SubElement(span, "code")
            code.text = repo_path
            code.tail = ")"
        index = list(parent).index(link)
        parent.remove(link)
        parent.insert(index, span)


class _RepositoryLinksExtension(Extension):
    def __init__(self, docs_dir: Path, repo_root: Path) -> None:
        super().__init__()
        self.docs_dir = docs_dir
        self.repo_root = repo_root

    def extendMarkdown(self, md: Markdown) -> None:  # Markdown's name
        # After toc (5), before MkDocs' own link validation and rewriting ("relpath", 0).
        md.treeprocessors.register(_RepositoryLinks(md, self.docs_dir, self.repo_root), "repository_links", 1)


def on_config(config: Any) -> Any:
    docs_dir = Path(config.docs_dir).resolve()
    repo_root = Path(config.config_file_path).resolve().parent
    config.markdown_extensions.append(_RepositoryLinksExtension(docs_dir, repo_root))
    return config


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    _state["page"] = page
    return markdown


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    _state["page"] = None
    return html
