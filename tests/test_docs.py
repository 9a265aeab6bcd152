"""The documentation points at things that exist (issue 11).

For README.md and every markdown file under docs/:
- every code span naming a definition, ``path/to/file.py::Name``, ``path.py::Class.method`` or
  ``tests/x.py::test_name``, resolves: the file exists and defines that name (for ``Class.method``,
  the method inside that class);
- every relative link points to an existing file, and a ``#fragment`` into a markdown file to one of
  its headings (GitHub's anchors).
The config tables list every knob with its default; ``docs/pitfalls.md #n`` in the code names a note
that exists, and no reference to the old notes file is left.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
DEFINITION = re.compile(r"^([\w./-]+\.py)::([\w.:]+?)(\[[^\]]*\])?$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (commands there are not references)."""
    return FENCE.sub("", text)


def _spans(text: str) -> list[str]:
    return [m.group(2).strip() for m in CODE_SPAN.finditer(_prose(text))]


@cache
def _module(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _names(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body defines: functions, classes and assigned names."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
    return names


def resolve(reference: str) -> str | None:
    """None when ``path.py::A.b`` names something defined there, else what is wrong."""
    match = DEFINITION.match(reference)
    path, dotted = ROOT / match.group(1), match.group(2)
    if not path.is_file():
        return f"no file {match.group(1)}"
    body: list[ast.stmt] = _module(path).body
    parts = dotted.replace("::", ".").split(".")
    for depth, part in enumerate(parts):
        node = _names(body).get(part)
        if node is None:
            where = ".".join(parts[:depth]) or match.group(1)
            return f"{part} is not defined in {where}"
        if depth < len(parts) - 1:
            if not isinstance(node, ast.ClassDef):
                return f"{'.'.join(parts[: depth + 1])} is not a class"
            body = node.body
    return None


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its text lower-cased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        slug = github_anchor(heading)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(out)


def broken_links(page: Path) -> list[str]:
    problems = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        linked = (page.parent / path_part).resolve() if path_part else page
        if not linked.exists():
            problems.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            shown = linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked.name
            problems.append(f"{target}: no heading #{fragment} in {shown}")
    return problems


def _id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_named_definition_exists(page):
    references = [s for s in _spans(page.read_text(encoding="utf-8")) if DEFINITION.match(s)]
    problems = [f"`{r}`: {why}" for r in references if (why := resolve(r))]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=_id)
def test_every_relative_link_resolves(page):
    problems = broken_links(page)
    assert problems == [], "\n".join(problems)


def test_the_checks_catch_what_they_are_for(tmp_path):
    """A broken link, a missing anchor and a misnamed definition are each reported."""
    page = tmp_path / "page.md"
    fenced = "```\n[x](in-a-fence.md)\n```\n"
    page.write_text("# Top\n\n[ok](page.md#top) [gone](missing.md) [bad](page.md#nowhere)\n" + fenced)
    assert broken_links(page) == ["missing.md: no such file", "page.md#nowhere: no heading #nowhere in page.md"]
    assert resolve("posttrain/core/advantages.py::gae") is None
    assert resolve("posttrain/core/advantages.py::gea") == "gea is not defined in posttrain/core/advantages.py"
    assert resolve("posttrain/models/roles.py::Reference.logprobs") is None
    assert resolve("posttrain/models/roles.py::Reference.log_probs") == "log_probs is not defined in Reference"
    assert resolve("posttrain/core/missing.py::x") == "no file posttrain/core/missing.py"
    assert github_anchor("7. EOS is trained, and every EOS stops") == "7-eos-is-trained-and-every-eos-stops"
    assert github_anchor("`rewards[]`") == "rewards"


# --------------------------------------------------------------------------------------------------
# config tables
# --------------------------------------------------------------------------------------------------


def _shown(value) -> str:
    """A default as the tables write it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):  # a newline as the escape YAML and Python write it (a table cell holds one line)
        return value.replace("\n", "\\n") or '""'
    if isinstance(value, list):
        return "[" + ", ".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return str(value) if value else "{}"
    return repr(value)


def _rows(page: Path, section: str | None = None) -> dict[str, list[str]]:
    """{knob: cells after the first} of every table row whose first cell is a code span (within the ``## ``
    section whose heading starts with ``section``, when given)."""
    rows = {}
    text = page.read_text(encoding="utf-8")
    if section is not None:
        text = text[text.index(f"\n## {section}") + 1 :]
        end = text.find("\n## ")
        text = text if end < 0 else text[:end]
    for line in text.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if cells and re.fullmatch(r"`[^`]+`", cells[0]):
            rows[cells[0].strip("`")] = [c.replace("\\|", "|") for c in cells[1:]]
    return rows


def _trainer_configs():
    from posttrain.trainers.distill import DistillConfig
    from posttrain.trainers.dpo import DPOConfig
    from posttrain.trainers.grpo import GRPOConfig
    from posttrain.trainers.kto import KTOConfig
    from posttrain.trainers.online_dpo import OnlineDPOConfig
    from posttrain.trainers.ppo import PPOConfig
    from posttrain.trainers.prm import PRMConfig
    from posttrain.trainers.rm import RMConfig
    from posttrain.trainers.sft import SFTConfig

    return {
        "sft": SFTConfig,
        "reward_model": RMConfig,
        "dpo": DPOConfig,
        "ppo": PPOConfig,
        "grpo": GRPOConfig,
        "distill": DistillConfig,
        "kto": KTOConfig,
        "online_dpo": OnlineDPOConfig,
        "prm": PRMConfig,
    }


# a trainer whose knobs are tabled in one section of a page that tables other trainers' too: (page, section heading)
SECTION_PAGES = {
    "dpo": ("dpo", "Config knobs"),
    "kto": ("dpo", "KTO"),
    "online_dpo": ("dpo", "Online DPO"),
    "prm": ("process_rewards", "Config knobs"),
}


@pytest.mark.parametrize("name", ["sft", "reward_model", "dpo", "ppo", "grpo", "distill", "kto", "online_dpo", "prm"])
def test_algorithm_page_lists_every_knob_with_its_default(name):
    cls = _trainer_configs()[name]
    page, section = SECTION_PAGES.get(name, (name, None))
    rows = _rows(ROOT / "docs" / "algorithms" / f"{page}.md", section)
    config = cls()
    problems = []
    for f in dataclasses.fields(cls):
        value = getattr(config, f.name)
        if f.name not in rows:
            problems.append(f"{f.name}: not in the table")
        elif not dataclasses.is_dataclass(value) and rows[f.name][0] != f"`{_shown(value)}`":
            problems.append(f"{f.name}: the table says {rows[f.name][0]}, the default is {_shown(value)}")
    assert problems == [], "\n".join(problems)


def test_config_page_lists_every_section_field():
    from posttrain.data import DataConfig
    from posttrain.envs import EnvConfig
    from posttrain.models import ModelConfig
    from posttrain.monitor import AlertConfig, EvalConfig
    from posttrain.rewards import RewardSpec
    from posttrain.rewards.process import ProcessRewardConfig
    from posttrain.rollout import RolloutConfig, SamplingParams, ScoringConfig
    from posttrain.runtime.config import OptimConfig, RunConfig
    from posttrain.runtime.entropy_control import EntropyControlConfig

    sections = {
        "model": ModelConfig,
        "data": DataConfig,
        "optim": OptimConfig,
        "run": RunConfig,
        "sampling": SamplingParams,
        "rollout": RolloutConfig,
        "teacher_scoring": ScoringConfig,
        "rewards[]": RewardSpec,
        "env": EnvConfig,
        "process_reward_model": ProcessRewardConfig,
        "entropy_control": EntropyControlConfig,
        "eval": EvalConfig,
        "alerts": AlertConfig,
    }
    rows = _rows(ROOT / "docs" / "config.md")
    problems = []
    for section, cls in sections.items():
        instance = cls()
        for f in dataclasses.fields(cls):
            key, value = f"{section}.{f.name}", _shown(getattr(instance, f.name))
            if key not in rows:
                problems.append(f"{key}: not in docs/config.md")
            elif rows[key][0] != f"`{value}`":
                problems.append(f"{key}: docs/config.md says {rows[key][0]}, the default is {value}")
    assert problems == [], "\n".join(problems)


# --------------------------------------------------------------------------------------------------
# references from the code to docs/pitfalls.md
# --------------------------------------------------------------------------------------------------


def _code_files() -> list[Path]:
    return sorted(p for folder in ("posttrain", "tests", "examples", "bench") for p in (ROOT / folder).rglob("*.py"))


def test_pitfall_numbers_named_in_the_code_exist():
    notes = {int(n) for n in re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "pitfalls.md").read_text(), re.M)}
    assert notes == set(range(1, len(notes) + 1)), sorted(notes)
    cited = re.compile(r"docs/pitfalls\.md ((?:#\d+(?:, )?)+)")
    problems = []
    for path in _code_files():
        for line_no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for group in cited.findall(line):
                for number in map(int, re.findall(r"#(\d+)", group)):
                    if number not in notes:
                        problems.append(f"{path.relative_to(ROOT)}:{line_no}: #{number}")
    assert problems == [], "\n".join(problems)


def test_no_reference_to_the_old_notes_file_is_left():
    old = re.compile(r"\bPITFALLS #\d")
    left = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in _code_files()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if old.search(line)
    ]
    assert left == [], "say docs/pitfalls.md #n instead:\n" + "\n".join(left)
