"""The project's import structure (docs/architecture.md, "Floors"): every import of numloss, data_prep,
recipes and launch, those inside functions included (`if TYPE_CHECKING:` blocks left out), read with `ast`
and held to the floors:

- an import points down or sideways inside its own floor, never up;
- no cycle between sub-packages (an engine's `pure` and `runtime` folders are one each);
- an import inside a function is of a heavy optional package (HEAVY), of a project module whose top
  level imports one (directly or through project modules), or of the standard library; nothing else
  hides inside a function;
- the pure floors (recipes.planning, recipes.parallel_dims, the engine contracts) import no torch,
  deepspeed or megatron at module level;
- at module level each floor imports only the third-party packages it may (MODULE_LEVEL_ALLOWED: numloss
  torch and numpy, the pure floors numpy);
- numloss imports no other project package.

An import made by a call counts as an import statement: `importlib.import_module("name")`,
`import_module("name")` and `__import__("name")` with a string literal or a module-level string constant.

Each failure lists the offending imports as file:line.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("numloss", "data_prep", "recipes", "launch")

# third-party packages that may be imported inside a function: optional ones (not every install has them),
# and torch, which the pure floors (recipes.planning, the engine contracts), the launchers' drivers and
# data_prep's workers (forked: they must not inherit torch's thread pool) import only where a tensor is made
HEAVY = {"torch", "tqdm", "deepspeed", "megatron", "transformer_engine", "ray", "triton", "trl", "peft", "transformers", "datasets",
         "vllm", "lm_eval", "wandb", "mlflow", "matplotlib", "tensorboard", "torch_tensorrt", "flash_attn", "apex",
         "fused_weight_gradient_mlp_cuda", "huggingface_hub", "safetensors", "tokenizers", "gguf", "math_verify",
         "PIL", "pyarrow", "scipy", "torchvision", "accelerate"}
# what the pure floors may never import at module level
RUNTIME_PACKAGES = {"torch", "deepspeed", "megatron", "transformer_engine"}

# the third-party packages a floor may import at module level (None: any); the rest only inside functions
MODULE_LEVEL_ALLOWED = {"numloss": {"torch", "numpy"}, "data_prep": {"torch", "numpy", "pyarrow"},
                        "pure": {"numpy"}}

# an engine's folder, recipes/engines/<engine>/, holds its pure part in pure/ and its runtime in runtime/
ENGINE_FOLDERS = {"pure": 4, "runtime": 7}

# module prefix -> floor (bottom 1 .. top 11); sub-floors order sideways imports inside floor 6
FLOORS = [
    ("numloss", 1),
    ("data_prep", 2),
    ("recipes.planning", 3), ("recipes.parallel_dims", 3),
    ("recipes.config", 5), ("recipes.sections", 5), ("recipes.recipe_yaml", 5), ("recipes.plugins", 5),
    ("recipes.inputs", 6.0), ("recipes.training", 6.1), ("recipes.reliability", 6.2),
    ("recipes.engines.runtime", 7),
    ("recipes.checks", 8), ("recipes.evaluation", 8),
    ("recipes.validation", 9), ("recipes.train", 9), ("recipes.convert", 9), ("recipes.validate", 9),
    ("recipes.evaluate", 9),
    ("recipes.experiments", 10), ("recipes.demo", 10), ("recipes.study", 10), ("recipes.regimes", 10), ("recipes.lowdata", 10),
    ("launch", 11),
]


def floor_of(module: str) -> float | None:
    parts = module.split(".")
    if module == "recipes":
        return 3  # the package's own __init__: imports nothing of the project
    if parts[:2] == ["recipes", "engines"]:
        if len(parts) == 2 or parts[2] == "contract":
            return 4
        if parts[2] == "runtime":
            return 7
        # an engine's package (floor 4: it imports nothing), then its pure/ or runtime/ folder; nothing else
        return 4 if len(parts) == 3 else ENGINE_FOLDERS.get(parts[3])
    for prefix, floor in FLOORS:
        if module == prefix or module.startswith(prefix + "."):
            return floor
    return None


def group_of(module: str) -> str:
    """The unit cycles are judged between: a sub-package (recipes.checks), a top-level module
    (recipes.config), an engine's pure or runtime folder (recipes.engines.megatron.pure)."""
    parts = module.split(".")
    if parts[:2] == ["recipes", "engines"]:
        if len(parts) <= 3 or parts[2] in ("contract", "runtime"):
            return module  # the registry, the contract protocol, build_engine, an engine's package: one each
        return ".".join(parts[:4])
    return ".".join(parts[:2]) if len(parts) >= 3 or _is_package(module) else module


def _module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _module_files()


def _is_package(module: str) -> bool:
    return MODULES.get(module, Path()).name == "__init__.py"


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # a project module, or a third-party top-level name
    project: bool
    in_function: bool
    where: str  # file:line

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}{' (inside a function)' if self.in_function else ''}"


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _targets(module: str, node: ast.AST) -> list[tuple[str, bool]]:
    """(target, is a project module) for one import statement of `module`."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [(_project(name) or name.split(".")[0], _project(name) is not None) for name in names]
    if node.level:
        package = module if _is_package(module) else module.rsplit(".", 1)[0]
        base_parts = package.split(".")
        base_parts = base_parts[:len(base_parts) - (node.level - 1)]
        base = ".".join(base_parts + ([node.module] if node.module else []))
    else:
        base = node.module
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in MODULES:
            out.append((sub, True))
        elif _project(base):
            out.append((_project(base), True))
        else:
            out.append((base.split(".")[0], False))
    return out


def _project(name: str) -> str | None:
    """The project module `name` names (or its nearest enclosing package that exists), None if not ours."""
    if name.split(".")[0] not in PACKAGES:
        return None
    parts = name.split(".")
    while parts:
        if ".".join(parts) in MODULES:
            return ".".join(parts)
        parts.pop()
    return None


IMPORT_CALLS = {"import_module", "__import__"}  # importlib.import_module / import_module / __import__


def _called_name(call: ast.Call, constants: dict[str, str]) -> str | None:
    """The module an import call names, when it is a string literal or a module-level string constant."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in IMPORT_CALLS or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    return constants.get(arg.id) if isinstance(arg, ast.Name) else None


def _imports(module: str, path: Path) -> list[Import]:
    return _imports_of_source(module, path.read_text(), str(path.relative_to(REPO)))


def _imports_of_source(module: str, text: str, where: str) -> list[Import]:
    tree = ast.parse(text, where)
    found: list[Import] = []
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for other in child.orelse:
                    visit_one(other, in_function)
                continue
            visit_one(child, in_function)

    def visit_one(child: ast.AST, in_function: bool) -> None:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target, project in _targets(module, child):
                if target != module:
                    found.append(Import(module, target, project, in_function, f"{where}:{child.lineno}"))
            return
        if isinstance(child, ast.Call) and (name := _called_name(child, constants)) is not None:
            target = _project(name) or name.split(".")[0]
            found.append(Import(module, target, _project(name) is not None, in_function, f"{where}:{child.lineno}"))
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        visit(child, inner)

    visit(tree, False)
    return found


IMPORTS = list(dict.fromkeys(imp for module, path in MODULES.items() for imp in _imports(module, path)))
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _heavy_modules() -> set[str]:
    """Project modules whose own top level imports a HEAVY package, and the engines' runtime modules
    (floor 7: they are where deepspeed and megatron are reached)."""
    heavy = {imp.source for imp in IMPORTS if not imp.in_function and not imp.project and imp.target in HEAVY}
    return heavy | {m for m in MODULES if floor_of(m) == 7}


def _report(problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"{len(problems)} {what}:\n" + "\n".join(problems), pytrace=False)


def test_every_module_has_a_floor():
    _report([f"{MODULES[m].relative_to(REPO)}: {m} has no floor (add it to FLOORS, docs/architecture.md)"
             for m in MODULES if floor_of(m) is None], "modules without a floor")


def test_imports_point_down_or_sideways():
    problems = []
    for imp in IMPORTS:
        if not imp.project:
            continue
        mine, theirs = floor_of(imp.source), floor_of(imp.target)
        if mine is not None and theirs is not None and theirs > mine:
            problems.append(f"{imp}: up from floor {mine:g} to {theirs:g}")
    _report(problems, "imports point up a floor")


def test_no_cycle_between_sub_packages():
    edges: dict[str, dict[str, list[Import]]] = {}
    for imp in IMPORTS:
        if imp.project:
            a, b = group_of(imp.source), group_of(imp.target)
            if a != b:
                edges.setdefault(a, {}).setdefault(b, []).append(imp)
    cycles = _strongly_connected(edges)
    problems = []
    for component in cycles:
        problems.append(f"cycle between {', '.join(sorted(component))}:")
        for a in sorted(component):
            for b, imps in sorted(edges.get(a, {}).items()):
                if b in component:
                    problems += [f"  {imp}" for imp in imps]
    _report(problems, "import cycles (each followed by the imports that make it)")


def _strongly_connected(edges: dict[str, dict[str, list]]) -> list[set[str]]:
    """Tarjan's algorithm: the components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(edges):
        if v not in index:
            connect(v)
    return out


def test_imports_inside_functions_are_heavy_ones_only():
    heavy = _heavy_modules()
    problems = []
    for imp in IMPORTS:
        if not imp.in_function:
            continue
        if imp.project:
            if imp.target not in heavy:
                problems.append(f"{imp}: a project module that imports no heavy package at its top level "
                                "(import it at the top)")
        elif imp.target not in HEAVY and imp.target not in STDLIB:
            problems.append(f"{imp}: {imp.target} is not a heavy optional package (import it at the top, or add "
                            "it to HEAVY with the reason)")
    _report(problems, "imports inside functions that are neither heavy nor the standard library")


def test_pure_floors_import_no_runtime_package_at_module_level():
    problems = [f"{imp}: floor {floor_of(imp.source):g} is pure (no torch, deepspeed or megatron at module level)"
                for imp in IMPORTS
                if not imp.project and not imp.in_function and imp.target in RUNTIME_PACKAGES
                and imp.source.startswith("recipes") and (floor_of(imp.source) or 0) <= 4]
    _report(problems, "runtime imports in the pure floors")


def module_level_rule(module: str) -> str | None:
    """Which MODULE_LEVEL_ALLOWED entry holds `module` (None: its floor may import any package)."""
    if (floor_of(module) or 0) in (3, 4) and module.startswith("recipes"):
        return "pure"
    top = module.split(".")[0]
    return top if top in MODULE_LEVEL_ALLOWED else None


def test_module_level_third_party_imports_are_what_each_floor_allows():
    problems = []
    for imp in IMPORTS:
        rule = module_level_rule(imp.source)
        if imp.project or imp.in_function or imp.target in STDLIB or rule is None:
            continue
        if imp.target not in MODULE_LEVEL_ALLOWED[rule]:
            problems.append(f"{imp}: at module level {rule} may import only "
                            f"{', '.join(sorted(MODULE_LEVEL_ALLOWED[rule]))} (import it inside the function)")
    _report(problems, "module-level imports of packages the floor does not allow")


def test_numloss_imports_no_other_project_package():
    _report([str(imp) for imp in IMPORTS if imp.project and imp.source.split(".")[0] == "numloss"
             and imp.target.split(".")[0] != "numloss"], "numloss imports of other project packages")


def test_the_floors_are_read_as_documented():
    """The reader itself, on known imports: a relative import inside a function, a project module
    reached through `from package import module`, and the floors of an engine's modules."""
    by_where = {(imp.source, imp.target): imp for imp in IMPORTS}
    engine, export = "recipes.engines.megatron.runtime.engine", "recipes.engines.megatron.runtime.export"
    assert (engine, export) in by_where and by_where[(engine, export)].in_function
    assert floor_of("recipes.engines.megatron.pure.contract") == 4 and floor_of(f"{export}") == 7
    assert floor_of("recipes.engines.deepspeed.pure.config") == 4 and floor_of("recipes.engines") == 4
    # a module of an engine's folder outside pure/ and runtime/ has no floor (test_every_module_has_a_floor)
    assert floor_of("recipes.engines.megatron.step") is None and floor_of("recipes.engines.megatron") == 4
    assert group_of("recipes.checks.preflight") == "recipes.checks" and group_of("recipes.config") == "recipes.config"
    assert group_of("recipes.engines.megatron.runtime.step") == "recipes.engines.megatron.runtime"
    assert engine in _heavy_modules() and "recipes.config" not in _heavy_modules()
    # the TE probe's import of megatron-core, named by a module constant, is read as an import inside a function
    assert any(imp.source == "recipes.engines.megatron.pure.kernels" and imp.target == "megatron" and imp.in_function
               for imp in IMPORTS)


def test_imports_made_by_calls_are_read_and_judged():
    """A pure module that reaches torch through importlib at its top, numloss importing transformers, and
    planning reaching recipes.train through __import__ inside a function: each is read as an import and
    fails the rule it breaks."""
    planning = _imports_of_source("recipes.planning.shape", (
        "import importlib\nTORCH = 'torch'\nimportlib.import_module(TORCH)\nimport transformers\n"
        "def f():\n    return __import__('recipes.train')\n"), "recipes/planning/shape.py")
    assert [(i.target, i.project, i.in_function) for i in planning] == [
        ("importlib", False, False), ("torch", False, False), ("transformers", False, False),
        ("recipes.train", True, True)]
    assert module_level_rule("recipes.planning.shape") == "pure" and module_level_rule("numloss.vocab") == "numloss"
    assert module_level_rule("recipes.config") is None
    up = [i for i in planning if i.project and floor_of(i.target) > floor_of(i.source)]
    assert [i.target for i in up] == ["recipes.train"]
    assert {i.target for i in planning if not i.project and not i.in_function} - STDLIB - MODULE_LEVEL_ALLOWED["pure"] \
        == {"torch", "transformers"}
    vocab = _imports_of_source("numloss.vocab", "import numpy\nimport transformers\n", "numloss/vocab.py")
    assert {i.target for i in vocab} - MODULE_LEVEL_ALLOWED["numloss"] == {"transformers"}
