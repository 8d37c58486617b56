"""mkdocs hooks (``mkdocs.yml``): the settings reference generated from :class:`Settings`, so it is never
out of date, and the benchmark and chaos results the pages show, taken from where the runs write them."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

from celery_delayed.settings import PREFIX, RANGES, Settings

ROOT = Path(__file__).resolve().parents[1]
#: Folders of the repository whose files the pages link to (plots and tables), served at the same paths.
RESULTS = ("bench/results", "tests/chaos/results")
PLACEHOLDER = "<!-- settings reference -->"
_FIELD = re.compile(r"^    (\w+): ")


def settings_reference() -> str:
    """A Markdown table of every setting: its Celery name, type (and range), default and the ``#:`` comment
    above it in :class:`Settings` (a setting without one is a KeyError: every setting is documented)."""
    docs, comment = {}, []
    for line in inspect.getsource(Settings).splitlines():
        if line.strip().startswith("#:"):
            comment.append(line.strip()[2:].strip())
        elif match := _FIELD.match(line):
            if comment:
                docs[match[1]] = " ".join(comment)
            comment = []
        else:
            comment = []
    rows = ["| setting | type | default | what |", "|---|---|---|---|"]
    for field in dataclasses.fields(Settings):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        what = docs[field.name].replace("``", "`").replace("|", "\\|")
        kind = str(field.type).replace("|", "\\|")
        bounds = f" {RANGES[field.name]}" if field.name in RANGES else ""
        rows.append(f"| `{PREFIX}{field.name}` | `{kind}`{bounds} | `{default!r}` | {what} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, **_: object) -> str:
    return markdown.replace(PLACEHOLDER, settings_reference())


def on_files(files, config, **_: object):  # mkdocs' Files and MkDocsConfig
    from mkdocs.structure.files import File

    for folder in RESULTS:
        for path in sorted((ROOT / folder).glob("*")):
            if path.suffix in (".png", ".md") and path.is_file():
                files.append(File(str(path.relative_to(ROOT)), str(ROOT), config["site_dir"],
                                  config["use_directory_urls"]))
    return files
