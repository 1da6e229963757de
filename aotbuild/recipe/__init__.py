"""Recipes: the data and its schema (schema: ``Recipe``, ``Shape``, the structural checks), reading a
recipe file (files: bounded YAML, finding files), the rules that need the registries (rules:
``parse_recipe``, ``load_recipe``) and read-only recipe data (frozen)."""
