"""Strategies: what an entry is and how it is served. The interface is ``aotbuild.strategies.base``,
the name -> implementation table ``aotbuild.strategies.registry``, the order ``strategy: auto`` tries
them in ``aotbuild.strategies.order``."""
