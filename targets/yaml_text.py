"""YAML a person wrote (a target spec, a workload profile, a ``--config`` file, a price list), read strictly: a
key given twice in one mapping is refused with both lines, where PyYAML keeps the last silently (a
``batch_size`` set twice ran with whichever came second), and errors name the file, not ``<unicode string>``."""

from __future__ import annotations

from typing import Any

import yaml
from yaml.constructor import ConstructorError

MERGE = "tag:yaml.org,2002:merge"  # ``<<: *base``: the keys it brings may be overridden, by design


class _StrictLoader(yaml.SafeLoader):
    def construct_document(self, node: yaml.Node) -> Any:
        self._refuse_duplicates(node)
        return super().construct_document(node)

    def _refuse_duplicates(self, root: yaml.Node) -> None:
        """Each mapping of the document as written (before merges rewrite any), once: a scalar key twice in it
        is refused, compared as the value it is (``1`` and ``01``), within its type (``1`` is not ``true``)."""
        seen: set[int] = set()
        todo = [root]
        while todo:
            node = todo.pop()
            if id(node) in seen:  # an anchor's node, aliased again
                continue
            seen.add(id(node))
            if isinstance(node, yaml.SequenceNode):
                todo += node.value
            if not isinstance(node, yaml.MappingNode):
                continue
            first: dict[tuple[str, Any], int] = {}
            for key_node, value_node in node.value:
                todo += [key_node, value_node]
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == MERGE:
                    continue  # a complex key: the base loader names an unhashable one
                key = (key_node.tag, self.construct_object(key_node))
                if key in first:
                    raise ConstructorError(
                        "while reading a mapping",
                        node.start_mark,
                        f"found the key {key[1]!r} twice (first on line {first[key]})",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark.line + 1


def load_yaml(text: str, name: str) -> Any:
    """The document in ``text`` (read from ``name``, which errors cite); ``yaml.YAMLError`` if it is none."""
    loader = _StrictLoader(text)  # read from a string, its errors quote the line they point at
    loader.name = name  # which they cite by this name
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
