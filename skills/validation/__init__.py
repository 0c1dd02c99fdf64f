"""Named validation patterns and their standard expansions (`PATTERNS.md`)."""

from .expand import PATTERNS, AnnotationError, expand_file, expand_source, unexpanded

__all__ = ["PATTERNS", "AnnotationError", "expand_file", "expand_source", "unexpanded"]
