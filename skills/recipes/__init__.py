"""Recipes: working stack components. A starter stack copies them into its own ``stack/`` package,
so a recipe imports only ``targets.api``, third-party libraries and sibling recipes (relatively)."""
