"""The import layering docs/architecture.md draws: a module imports its own layer or lower ones,
never a higher one. Every import counts (module level, inside functions, under TYPE_CHECKING),
so the check is an AST walk over the source, not what happens to be imported at run time."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagedllm"

LAYERS: list[list[str]] = [  # lowest first; names are pagedllm's top-level modules, or module.sub
    [
        "version",
        "limits",
        "json_schema",
        "logger",
        "outputs",
        "pooling_params",
        "lora_request",
        "rerank_prompt",
        "sampling_params",
        "cpu_features",
        "cache_dir",
        "host_pages",
        "forkserver",
        "flags",
        "config",
        "workload",
        "chat_template",
        "tokenizer",
        "speculative_config",
    ],
    ["structured_output", "metrics", "request"],
    ["core"],
    ["kernels", "attention", "distributed"],
    ["layers"],
    ["model", "sample", "spec_decode"],
    ["quantization"],  # the format families read files through model/
    ["model_loader"],  # builds a model/ and fills it through quantization/
    ["lora"],  # adapters read through model/'s GGUF reader, applied around layers/' projections
    ["worker"],
    ["executor"],
    ["engine"],
    ["analysis", "planner", "eval"],
    ["bench", "entrypoints", "__main__"],
    ["__init__"],
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _rank(module: str) -> int:
    """module: dotted, without the leading 'pagedllm.'; '__init__' for the package itself."""
    parts = module.split(".")
    return RANK.get(".".join(parts[:2]), RANK[parts[0]])


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == "pagedllm":  # `from pagedllm import limits` names a module; `LLM` the package
            return [alias.name if alias.name in RANK else "__init__" for alias in node.names]
        names = [node.module]
    else:
        return []
    return [name.removeprefix("pagedllm.") for name in names if name.startswith("pagedllm.")]


def test_every_module_has_a_layer():
    unplaced = {_module_of(path).split(".")[0] for path in PACKAGE.rglob("*.py")} - set(RANK)
    assert not unplaced, f"place these in LAYERS (and docs/architecture.md's map): {sorted(unplaced)}"


def test_no_import_runs_up_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_of(path)
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node):
                if _rank(target) > _rank(module):
                    upward.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {module} -> {target}")
    assert not upward, "imports that run up the layers:\n" + "\n".join(upward)


def _module_map() -> str:
    """docs/architecture.md's module map: the code block under its "## Module map"."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    return text.split("## Module map", 1)[1].split("```", 2)[1]


def test_the_module_map_names_every_package_and_only_files_that_exist():
    module_map = _module_map()
    packages = {path.parent.name for path in PACKAGE.rglob("__init__.py")} - {PACKAGE.name}
    unnamed = sorted(name for name in packages if f"{name}/" not in module_map)
    assert not unnamed, f"packages docs/architecture.md's module map leaves out: {unnamed}"
    files = {path.name for path in PACKAGE.rglob("*")}
    named = set(re.findall(r"\b\w+\.(?:py|cpp|h)\b", module_map)) - {"llama.cpp"}  # the project
    stale = sorted(named - files)
    assert not stale, f"files docs/architecture.md's module map names that are not in pagedllm/: {stale}"


def test_tests_mirror_the_packages():
    """A test folder under tests/ is named for a pagedllm package; test files at the top are for
    top-level modules and the package as a whole (CONTRIBUTING.md, "Where things go")."""
    tests = Path(__file__).resolve().parent
    packages = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    folders = {path.parent.name for path in tests.glob("*/test_*.py")}
    assert folders <= packages, f"test folders named for no pagedllm package: {sorted(folders - packages)}"
    top = {path.stem.removeprefix("test_") for path in tests.glob("test_*.py")}
    by_package = sorted(name for name in top if name.split("_")[0] in packages)
    assert not by_package, f"move these into their package's test folder: {by_package}"
