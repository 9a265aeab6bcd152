"""The package's layers import downward only: core (torch only) → models, data, rewards, rollout, envs → monitor →
runtime → trainers, feedback → cli. Read from the source's import statements, so a lazy import inside a function
counts as much as one at the top."""

import ast
from pathlib import Path

import posttrain

ROOT = Path(posttrain.__file__).parent
# a package may import its own modules and those of every layer listed after it here
LAYERS = [
    {"cli", "demo", "demo_real", "export", "__main__"},
    {"trainers", "feedback"},  # the labelling verbs sit beside the trainers, on runtime, rollout and data
    {"runtime"},
    {"monitor"},
    {"models", "data", "rewards", "rollout", "envs"},
    {"errors", "sections"},
    {"core"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
# within the middle layer, what each package may use of the others (rewards score with models and decode
# with data; rollout samples from models)
SIBLINGS = {
    "models": set(),
    "data": set(),
    "rewards": {"models", "data", "rollout"},
    "rollout": {"models"},
    # environments render with the data layer's tokenizer, sample through rollout, run tools like rewards
    "envs": {"models", "data", "rewards", "rollout"},
    # the commands call the demo and export; export never calls back into the command line (an import circle)
    "cli": {"demo", "demo_real", "export"},
    "demo_real": {"demo"},
    "demo": set(),
    "export": set(),
    # no trainer imports the labelling code, and it trains nothing
    "trainers": set(),
    "feedback": set(),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n.split(".")[1] for n in names if n.startswith("posttrain.") and len(n.split(".")) > 1}


def _package(path: Path) -> str:
    part = path.relative_to(ROOT).parts[0]
    return part.removesuffix(".py")


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        own = _package(path)
        if own == "__init__":
            continue
        for used in _imports(path):
            if used == own:
                continue
            if LEVEL[used] < LEVEL[own] or (LEVEL[used] == LEVEL[own] and used not in SIBLINGS[own]):
                upward.append(f"{path.relative_to(ROOT)} imports posttrain.{used}")
    assert not upward, "\n".join(upward)


def test_core_imports_torch_only():
    for path in sorted((ROOT / "core").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for module in modules:
                top = module.split(".")[0]
                assert top in {
                    "torch",
                    "posttrain",
                    "__future__",
                    "math",
                    "dataclasses",
                    "typing",
                    "collections",
                    "functools",
                }, f"{path.name} imports {module}"
                if top == "posttrain":
                    assert module.startswith("posttrain.core"), f"{path.name} imports {module}"
