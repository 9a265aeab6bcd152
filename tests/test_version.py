"""The version is written once (posttrain/__init__.py): the command line, the package metadata and
CHANGELOG.md's newest release agree."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import posttrain
from posttrain.cli import main

ROOT = Path(__file__).resolve().parent.parent
RELEASE = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", re.M)


def newest_release() -> str:
    releases = RELEASE.findall((ROOT / "CHANGELOG.md").read_text(encoding="utf-8"))
    assert releases, "CHANGELOG.md has no '## [X.Y.Z] - YYYY-MM-DD' heading"
    return releases[0]


def test_version_flag_prints_the_changelogs_newest_release(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"posttrain {newest_release()}"


def test_package_metadata_reads_the_one_version():
    installed = importlib.metadata.version("posttrain")
    assert installed == posttrain.__version__, (
        f"the installed metadata says {installed}, posttrain/__init__.py {posttrain.__version__}: "
        "reinstall (pip install -e .) after a version change"
    )
