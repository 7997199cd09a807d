"""The package's shape (docs/ARCHITECTURE.md): dependencies point down, no circles, no family importing
another family, no private names across modules, cheap `import wan_tpu`, every public entry point
works, and the tree speaks of the product only."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "wan_tpu"
FAMILIES = ("wan_tpu.wan", "wan_tpu.matrix_game", "wan_tpu.unifolm")
# Entry modules that stand above the families (they only forward to one), and the serving package, which
# serves any family's pipeline and which no family imports.
ENTRY = {"wan_tpu", "wan_tpu.generate", "wan_tpu.commands"}
SERVE = "wan_tpu.serve"


def is_entry(module: str) -> bool:
    return module in ENTRY or module == SERVE or module.startswith(SERVE + ".")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[tuple[str, str | None]]]:
    """Module → the (module, imported name) pairs of every `import` in it, module level or not."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                deps |= {(a.name, None) for a in node.names if a.name.startswith("wan_tpu")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.startswith("wan_tpu"):
                    deps |= {(target, a.name) for a in node.names}
        graph[name] = deps
    return graph


def module_edges(graph) -> dict[str, set[str]]:
    """Module → the package modules it imports (`from pkg import submodule` counts as the submodule)."""
    edges = {}
    for name, deps in graph.items():
        targets = set()
        for module, imported in deps:
            if imported is not None and f"{module}.{imported}" in graph:
                targets.add(f"{module}.{imported}")
            elif module in graph:
                targets.add(module)
        targets.discard(name)
        edges[name] = targets
    return edges


def family(module: str) -> str | None:
    return next((f for f in FAMILIES if module == f or module.startswith(f + ".")), None)


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(module_edges(import_graph())) == []


def test_dependencies_point_down():
    """A family imports shared parts only, never another family nor the server; shared parts import neither."""
    wrong = []
    for module, targets in module_edges(import_graph()).items():
        if is_entry(module):
            continue
        for target in targets:
            if (family(target) is not None and family(target) != family(module)) or target.split(".")[:2] == ["wan_tpu", "serve"]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_private_names_across_modules():
    wrong = [f"{module}: from {target} import {name}"
             for module, deps in import_graph().items() for target, name in deps
             if name is not None and name.startswith("_") and not name.startswith("__") and target != module]
    assert wrong == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_wan_tpu_is_cheap():
    code = ("import sys, wan_tpu, wan_tpu.wan, wan_tpu.matrix_game, wan_tpu.unifolm; "
            "print(sorted(m for m in ('jax', 'torch', 'flax', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["WanPipeline", "MatrixGamePipeline", "UnifolmPipeline", "attention", "make_mesh",
                                  "load_transformer", "load_vae", "quantize_transformer", "WanInputError"])
def test_public_names(name):
    import wan_tpu

    assert getattr(wan_tpu, name) is not None
    assert name in wan_tpu.__all__


def test_family_packages_export_their_pipelines():
    import wan_tpu
    import wan_tpu.matrix_game
    import wan_tpu.unifolm
    import wan_tpu.wan

    assert wan_tpu.wan.WanPipeline is wan_tpu.WanPipeline
    assert wan_tpu.matrix_game.MatrixGamePipeline is wan_tpu.MatrixGamePipeline
    assert wan_tpu.unifolm.UnifolmPipeline is wan_tpu.UnifolmPipeline
    with pytest.raises(AttributeError):
        wan_tpu.NoSuchThing  # noqa: B018


@pytest.mark.parametrize("module", ["wan_tpu.generate", "wan_tpu.matrix_game", "wan_tpu.unifolm"])
def test_python_m_entry_points(module):
    done = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "--model" in done.stdout and "--no-compile-cache" in done.stdout


def console_scripts() -> dict[str, str]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_console_scripts(script):
    """Every console script runs `wan_tpu.commands.run(script)`, whose command line answers --help."""
    import importlib

    from wan_tpu import commands

    module, func = console_scripts()[script].split(":")
    assert module == "wan_tpu.commands" and callable(getattr(commands, func))
    main = importlib.import_module(commands.COMMANDS[script]).main
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0


def test_an_installed_command_runs():
    done = subprocess.run(["wan-generate", "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--prompt" in done.stdout, done.stderr


COMMON_FLAGS = ("--model", "--dtype", "--mesh", "--attention", "--seed", "--output", "--overwrite",
                "--no-compile-cache", "--profile", "--quiet")


@pytest.mark.parametrize("module", ["wan_tpu.wan.cli", "wan_tpu.matrix_game.cli", "wan_tpu.unifolm.cli"])
def test_the_three_clis_share_the_common_flags(module):
    import importlib

    from wan_tpu.runtime import cli

    assert cli.COMMON_FLAGS == COMMON_FLAGS
    parser = importlib.import_module(module).build_parser()
    assert isinstance(parser, cli.CliParser)
    flags = {s for action in parser._actions for s in action.option_strings}
    assert set(COMMON_FLAGS) <= flags


def test_common_flags_declared_once():
    """The shared flags are declared in the harness only, not again in a family's CLI."""
    declared = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "cli.py" and path.parent.name == "runtime":
            continue
        text = path.read_text(encoding="utf-8")
        for flag in COMMON_FLAGS:
            if re.search(rf"add_argument\([^)]*[\"']{flag}[\"']", text):
                declared.append(f"{path.relative_to(ROOT)}: {flag}")
    assert declared == []


# Words about how the work was organised, not about the product.
PROCESS_WORDS = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|[a-z]+teenth|"
    r"twentieth|this|next|later|previous|earlier|last) session\b|\bsessions? \d+\b|\bissue[- #]?\d+\b|\blent\b|"
    r"\bdevice time\b|\basked for an? H[12]00\b|\bH[12]00 was asked for\b|/work/", re.IGNORECASE)


def tracked_text_files():
    listed = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for name in listed.stdout.split():
        if name.startswith("tests/data/") or name == "tests/shared/test_layout.py":
            continue
        path = ROOT / name
        if path.suffix in (".py", ".md", ".toml", ".txt", ".html", ".js", ".css", ".cfg", ".yaml") or name == ".ci/run":
            if path.exists():
                yield name, path.read_text(encoding="utf-8", errors="replace")


def test_the_tree_speaks_of_the_product_only():
    hits = [f"{name}:{i + 1}: {m.group(0)}" for name, text in tracked_text_files()
            for i, line in enumerate(text.splitlines()) for m in [PROCESS_WORDS.search(line)] if m]
    assert hits == [], "\n".join(hits[:40])


def test_the_process_word_pattern():
    for bad in ("the eighteenth session measured", "issue 16's targets", "an H200 was asked for", "lent machines",
                "see /work/main", "device time ran out"):
        assert PROCESS_WORDS.search(bad), bad
    for good in ("session = mg.stream(image)", "MatrixGameSession", "a streaming session", "silent", "equivalent"):
        assert not PROCESS_WORDS.search(good), good


def test_performance_doc_is_a_reference():
    text = (ROOT / "docs" / "PERFORMANCE.md").read_text(encoding="utf-8")
    assert len(text) <= 30_000


def test_architecture_doc_lists_every_package_folder():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    folders = sorted(str(p.relative_to(ROOT)) + "/" for p in PACKAGE.rglob("*") if p.is_dir()
                     and (p / "__init__.py").exists())
    missing = [f for f in folders if not re.search(rf"^{re.escape(f)}\s", text, re.M)]
    assert missing == []
    assert os.path.isdir(ROOT / "benchmarks")
