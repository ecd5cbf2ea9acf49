"""How recipe files and `key=value` overrides are read: YAML, with the two traps of YAML 1.1 closed.

- A key given twice in one mapping is an error naming the key and both lines (PyYAML keeps the last
  value without a word: `lr: 1e-5` ... `lr: 1e-3` trained at the second).
- Numbers in exponent form without a dot (`3e-4`, `1e5`) are floats, as in YAML 1.2 and JSON; YAML 1.1,
  PyYAML's, reads them as strings. Recipes therefore never need to accept a string where a number is
  expected, and do not: `optim.lr: "3e-4"` (quoted) and a term weight `"3"` are refused alike
  (`recipes.config`, `numloss.ObjectiveConfig`).

A syntax error (a tab in the indentation, an unclosed bracket, a key where a value belongs) becomes a
`ValueError` that says `file:line:column: what is wrong`, never a traceback.
"""

from __future__ import annotations

import re

import yaml

_FLOAT_TAG = "tag:yaml.org,2002:float"
# YAML 1.2's exponent floats that YAML 1.1's resolver misses: digits, an optional dot, a signed exponent
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


class RecipeLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses duplicate keys and reads exponent numbers as floats (module docstring)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    earlier = first.get(key)
                except TypeError:  # an unhashable key: the constructor below says so
                    continue
                if earlier is not None:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (first at line {earlier.line + 1}); YAML would keep "
                        "the last value silently: keep one", key_node.start_mark)
                first[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


RecipeLoader.add_implicit_resolver(_FLOAT_TAG, _EXPONENT_FLOAT, list("-+0123456789."))


def load_yaml(text, source: str):
    """The YAML document `text` (a string or an open file) read with RecipeLoader; a ValueError
    `source:line:column: problem` for anything that is not valid YAML or has a duplicate key."""
    try:
        return yaml.load(text, Loader=RecipeLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = err.problem or "not valid YAML"
        if "'\\t'" in problem:
            problem = "a tab character: YAML indents with spaces only, never tabs"
        context = f" ({err.context})" if err.context and "'\\t'" not in (err.problem or "") else ""
        raise ValueError(f"{where}: {problem}{context}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"{source}: not valid YAML: {err}") from None
