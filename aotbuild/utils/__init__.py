"""Helpers with no aotbuild concern of their own: text for people (text), "did you mean" (suggest),
lazy name -> implementation tables (registry), the one reader and writer of outside files (safeio)
and the API's one-release shims (deprecated)."""
