"""The skills library: SKILL.md knowledge per technique and the recipes the offline implementer composes."""
