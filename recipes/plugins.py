"""A recipe's plugins: `loss.plugins: [mypkg.terms, ...]`, modules of the user's that register numeric terms
with `numloss.register_term` when they are imported.

`import_plugins` is the one place they are imported: `recipes.sections.LossConfig` calls it when a recipe
loads, before the objective is read, so every entry point that loads a recipe knows the user's terms:
`python -m recipes.train` on every rank, `recipes.validate`, `launch.sweep` (its jobs), `launch.slurm`
while it renders (and the job's ranks, which load the recipe themselves), `launch.ray`'s driver and each
of its workers (`recipe_from_dict` of the recipe sent to them).

A bad plugin is a ValueError naming its key, before anything else of the recipe is used:
`loss.plugins[0]: ...` for a name that is not a module name, a module that is not found, a module whose
import fails (a term whose registration numloss refuses among them: the terms it registered before the
failure are removed again, so the registry is as it was), and a module that registers no term.

Where a plugin must be importable: in every process that loads the recipe, on every node. `import_roots`
tells the launchers where each plugin was found: a directory that is neither an installed package's
(site-packages) nor the project's checkout, which the launchers pass on (launch.slurm: PYTHONPATH and a
container mount; launch.ray: each worker's sys.path). An installed package must be installed on the nodes
too (the container image, or the environment the job runs in).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import site
import sys
import sysconfig
import traceback
from pathlib import Path

from numloss.losses import registered_terms, term_spec, unregister_term

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
PROJECT = Path(__file__).resolve().parents[1]  # the checkout: `python -m` puts it on sys.path on every node

# plugin module -> the terms its import registered; a module already imported is not imported again
_REGISTERED: dict[str, tuple[str, ...]] = {}


def import_plugins(names, key: str = "loss.plugins") -> dict[str, tuple[str, ...]]:
    """Import each module of `names` (in order) and return {module: the terms it registered}. Raises a
    ValueError naming `key[i]` for the first bad one (see the module docstring)."""
    if not isinstance(names, (list, tuple)):
        raise ValueError(f"{key}: expected a list of module names, got {names!r}")
    found = {}
    for i, name in enumerate(names):
        where = f"{key}[{i}]"
        if not isinstance(name, str) or not _MODULE.fullmatch(name):
            raise ValueError(f"{where}: {name!r} is not a module name (dotted Python identifiers, e.g. mypkg.terms)")
        found[name] = _import_one(name, where)
    return found


def _import_one(name: str, where: str) -> tuple[str, ...]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    before = set(registered_terms())
    modules_before = set(sys.modules)
    imported_before = name in sys.modules
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        _unregister_new(before, modules_before)
        if err.name is not None and (name == err.name or name.startswith(err.name + ".")):
            raise ValueError(f"{where}: no module named {name!r} here (not found at {err.name!r}): a plugin must"
                             " be importable where the recipe is loaded, on every node (PYTHONPATH=<its directory>,"
                             " or pip install its package)") from None
        raise ValueError(f"{where}: importing {name!r} failed: {_failure(err)}") from None
    except Exception as err:  # noqa: BLE001  (a plugin may raise anything; a failed registration is a ValueError)
        _unregister_new(before, modules_before)
        raise ValueError(f"{where}: importing {name!r} failed: {_failure(err)}") from None
    terms = tuple(t for t in registered_terms() if t not in before)
    if not terms and imported_before:  # imported by the program before it loaded the recipe: its own terms
        terms = tuple(t for t in registered_terms() if not term_spec(t).builtin
                      and (term_spec(t).fn.__module__ == name or term_spec(t).fn.__module__.startswith(name + ".")))
    if not terms:
        raise ValueError(f"{where}: {name!r} registers no term (a plugin calls numloss.register_term when it is"
                         " imported)")
    _REGISTERED[name] = terms
    return terms


def _unregister_new(before: set, modules_before: set) -> None:
    """Remove the terms a failed import registered before it failed, and the modules it imported that
    registered them (imported again, they register them again)."""
    for name in registered_terms():
        if name not in before:
            module = term_spec(name).fn.__module__
            unregister_term(name)
            if module not in modules_before:
                sys.modules.pop(module, None)


# frames a plugin's failure passes through that are not the plugin's: importlib's, numloss's, this file's
_NOT_THE_PLUGINS = ("<frozen", importlib.__file__, str(Path(importlib.util.find_spec("numloss").origin).parent),
                    __file__)


def _failure(err: BaseException) -> str:
    """`Type: message (file:line)` of an exception, the line the innermost frame of the user's code (not
    importlib's, not numloss's: a refused `register_term` points at the plugin's call)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not f.filename.startswith(_NOT_THE_PLUGINS)] or traceback.extract_tb(err.__traceback__)
    at = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(err).__name__}: {err}{at}"


def registered_by(names) -> dict[str, tuple[str, ...]]:
    """{module: its terms} for plugins already imported by `import_plugins` (for error messages)."""
    return {name: _REGISTERED[name] for name in names if name in _REGISTERED}


def _installed_dirs() -> set[Path]:
    paths = sysconfig.get_paths()
    dirs = {paths["purelib"], paths["platlib"], *getattr(site, "getsitepackages", lambda: [])()}
    if site.ENABLE_USER_SITE:
        dirs.add(site.getusersitepackages())
    return {Path(d).resolve() for d in dirs}


def import_roots(names) -> list[str]:
    """The directories (absolute, in order, once each) that this process imported the plugins `names`
    from, leaving out installed packages' directories and the project's checkout: what another process
    (a SLURM rank, a Ray worker) needs on its sys.path to import them as this one did."""
    installed = _installed_dirs()
    roots: list[str] = []
    for name in names:
        spec = importlib.util.find_spec(name.split(".")[0])
        if spec is None:
            continue
        if spec.origin not in (None, "namespace") and spec.submodule_search_locations is None:
            found = [Path(spec.origin).parent]  # a module file: mypkg.py
        else:  # a package (its __init__'s folder) or a namespace package (each of its folders)
            found = [Path(p).parent for p in (spec.submodule_search_locations or [])]
        for root in (p.resolve() for p in found):
            if root not in installed and root != PROJECT and str(root) not in roots:
                roots.append(str(root))
    return roots
