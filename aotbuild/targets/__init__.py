"""Targets: where compiled code runs and how its compiler is driven. The interface is
``aotbuild.targets.base``, the name -> implementation table ``aotbuild.targets.registry``; the
compilers' remote caches kept out of every build child ``aotbuild.targets.side_channels``."""
