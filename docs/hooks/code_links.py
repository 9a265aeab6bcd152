"""mkdocs hook: the pages' links out of docs/, for the built site.

The pages link to the code (``../posttrain/core/losses.py``) and to other files of the repository
(``../bench/README.md``), so that a reader of the repository lands on them; tests/test_docs.py checks that
each resolves. The built site holds docs/ only, where mkdocs would report each such link as a page not
found. So before mkdocs reads a page, this hook points a link to a module at that module's section of the
API reference (docs/api/, its ``::: posttrain.x.y`` blocks) and keeps the text of a link to any other file
of the repository, unlinked. A link out of docs/ whose file does not exist is a warning (so
``mkdocs build --strict`` fails); links inside docs/ are left to mkdocs' own checks.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

log = logging.getLogger("mkdocs.hooks.code_links")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^)\s]+)((?:\s+\"[^\"]*\")?)\)")
MODULE_BLOCK = re.compile(r"^::: (posttrain(?:\.\w+)*)\s*$", re.M)

_api: dict[str, tuple[str, str]] = {}  # module file, from the repository root -> (API page, anchor)


def on_config(config):
    """Which API page documents each module: the ``::: posttrain.x.y`` blocks of docs/api/*.md."""
    docs, root = Path(config["docs_dir"]), Path(config["config_file_path"]).parent
    _api.clear()
    for page in sorted((docs / "api").glob("*.md")):
        for dotted in MODULE_BLOCK.findall(page.read_text(encoding="utf-8")):
            stem = Path(*dotted.split("."))
            uri = page.relative_to(docs).as_posix()
            if (root / stem).with_suffix(".py").is_file():
                _api[stem.with_suffix(".py").as_posix()] = (uri, dotted)
            elif (root / stem / "__init__.py").is_file():  # a package's own docstring: no heading of its own
                _api.setdefault((stem / "__init__.py").as_posix(), (uri, ""))
    return config


def _rewrite(match: re.Match, page_uri: str, docs: Path, root: Path) -> str:
    bang, text, target, title = match.groups()
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
        return match.group(0)
    path_part, _, fragment = target.partition("#")
    linked = ((docs / page_uri).parent / path_part).resolve()
    if linked.is_relative_to(docs.resolve()) or not path_part:
        return match.group(0)  # inside docs/: mkdocs checks it
    if not linked.exists():
        log.warning("Doc file '%s' links to '%s', which does not exist", page_uri, target)
        return match.group(0)
    source = linked.relative_to(root.resolve()).as_posix() if linked.is_relative_to(root.resolve()) else ""
    if source in _api:
        api_uri, anchor = _api[source]
        href = posixpath.relpath(api_uri, posixpath.dirname(page_uri) or ".")
        return f"{bang}[{text}]({href}{'#' + anchor if anchor else ''}{title})"
    return text  # another file of the repository: the site does not hold it


def on_page_markdown(markdown, page, config, files):
    docs, root = Path(config["docs_dir"]), Path(config["config_file_path"]).parent
    out, last = [], 0
    for fence in FENCE.finditer(markdown):  # a link in a fenced block is text, not a link
        out.append(LINK.sub(lambda m: _rewrite(m, page.file.src_uri, docs, root), markdown[last : fence.start()]))
        out.append(fence.group(0))
        last = fence.end()
    out.append(LINK.sub(lambda m: _rewrite(m, page.file.src_uri, docs, root), markdown[last:]))
    return "".join(out)
