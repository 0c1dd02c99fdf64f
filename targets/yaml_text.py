"""YAML a person wrote (a target spec, a workload profile, a ``--config`` file, a price list), read strictly: a
key given twice in one mapping is refused with both lines, where PyYAML keeps the last silently (a
``batch_size`` set twice ran with whichever came second), and errors name the file, not ``<unicode string>``."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError


class _StrictLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<: *base``: its keys may be overridden, by design
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.get(key)
            except TypeError:  # an unhashable key: the base loader names it
                continue
            if seen is not None:
                raise ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"found the key {key!r} twice (first on line {seen})",
                    key_node.start_mark,
                )
            first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, name: str) -> Any:
    """The document in ``text`` (read from ``name``, which errors cite); ``yaml.YAMLError`` if it is none."""
    loader = _StrictLoader(text)  # read from a string, its errors quote the line they point at
    loader.name = name  # which they cite by this name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
