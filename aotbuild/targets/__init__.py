"""Targets: where compiled code runs and how its compiler is driven. The interface is
``aotbuild.targets.base``, the name -> implementation table ``aotbuild.targets.registry``."""
