"""The layers of docs/design.md §1, read from the source: the floor imports no framework, tower, app or bench; a tower
imports its own framework and the floor only; bench reaches the towers only through the app layer. Every import
counts, those inside functions too. And the repository's own references hold: each "docs/design.md §N" names a
section (or a numbered item of one) that exists, and nothing cites a file outside the repository.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# package -> top-level modules it must never import
FORBIDDEN = {
    "twincache": {"torch", "jax", "jaxlib", "flax", "transformers", "torch_cache", "jax_cache", "twincache_app",
                  "bench"},
    "torch_cache": {"jax", "jaxlib", "flax", "transformers", "jax_cache", "twincache_app", "bench"},
    "jax_cache": {"torch", "transformers", "torch_cache", "twincache_app", "bench"},
    "bench": {"torch_cache", "jax_cache"},
}
# The one file of a layer that may import a module its layer may not, and the only module path it may import from it:
# the floor renders chat templates with transformers' own renderer (pure Jinja; a tokenizing use, no framework)
EXCEPTIONS = {"twincache/chat.py": ("transformers", "transformers.utils.chat_template_utils")}


def module_paths(path: Path) -> set[str]:
    """The full dotted names of the modules `path` imports with `import` / `from ... import`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


def imported_modules(path: Path, source: str | None = None) -> set[str]:
    """Top-level names of every module the file (or `source`, read as that file) imports, anywhere in it: `import`,
    `from` (a relative one resolved against the file's own package) and `importlib.import_module` / `__import__` of
    a literal name."""
    package = path.relative_to(REPO).parent.parts  # ("torch_cache",) for torch_cache/model.py
    found = set()
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else ()
            named = (*base, *(node.module.split(".") if node.module else ()))
            found.update([named[0]] if named else [alias.name for alias in node.names])
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and ast.unparse(node.func) in ("importlib.import_module",
                                                                                    "import_module", "__import__")):
            found.add(node.args[0].value.split(".")[0])
    return found


def test_imports_are_resolved_relative_and_dynamic_ones_included():
    """The reader above must see a tower reaching the other by a relative or a dynamic import."""
    source = ("from ..jax_cache import cache\nfrom . import model\nfrom .generate import sample\n"
              "import importlib\nimportlib.import_module('flax.nnx')\n__import__('jax')\n")
    found = imported_modules(REPO / "torch_cache" / "example.py", source)
    assert found == {"jax_cache", "torch_cache", "importlib", "flax", "jax"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_each_layer_imports_only_what_it_may(package):
    files = sorted((REPO / package).rglob("*.py"))
    assert files, f"{package} has no source files: the check would be empty"
    crossings = {f"{path.relative_to(REPO)} imports {name}" for path in files
                 for name in imported_modules(path) & FORBIDDEN[package]
                 if EXCEPTIONS.get(str(path.relative_to(REPO)), (None,))[0] != name}
    assert not crossings, sorted(crossings)
    for relative, (name, allowed) in EXCEPTIONS.items():
        if relative.startswith(f"{package}/"):
            reached = {module for module in module_paths(REPO / relative) if module.split(".")[0] == name}
            assert reached == {allowed}, f"{relative} may import {allowed} only, not {sorted(reached - {allowed})}"


def test_the_command_line_parser_imports_no_framework():
    """`twincache --help` and every refusal before a model loads cost no torch or jax import."""
    code = ("import sys; from twincache_app.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'jax', 'flax', 'transformers') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def design_sections() -> dict[str, set[str]]:
    """'N' -> the numbered items of docs/design.md's section §N ("1." ... at the start of a line)."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in (REPO / "docs" / "design.md").read_text().splitlines():
        heading = re.match(r"## §(\d+) ", line)
        if heading:
            current = sections.setdefault(heading.group(1), set())
        elif current is not None and (item := re.match(r"(\d+)\. ", line)):
            current.add(item.group(1))
    return sections


def repository_texts() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in tracked
            if name.endswith((".py", ".md", ".sh", ".toml", ".cfg", ".txt", ".yml")) and (REPO / name).is_file()]


def test_every_design_reference_names_an_existing_section_and_none_leads_outside():
    sections = design_sections()
    assert len(sections) >= 8, sections.keys()
    checked, broken, outside = 0, [], []
    for path in repository_texts():
        text = path.read_text(errors="replace")
        for match in re.finditer(r"design\.md §(\d+)(?:\.(\d+))?", text):
            checked += 1
            section, item = match.groups()
            if section not in sections or (item is not None and item not in sections[section]):
                broken.append(f"{path.relative_to(REPO)}: {match.group(0)}")
        if re.search(r"\bNOTES (§|section)", text):
            outside.append(str(path.relative_to(REPO)))
    assert checked >= 20, f"only {checked} references found; the scan reads nothing"
    assert not broken, broken
    assert not outside, f"references to a notebook outside the repository: {outside}"
