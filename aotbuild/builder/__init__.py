"""Building: ``build()`` and its report (build), the build's loader processes (loader), the job's
worker process (worker), the proof in a fresh process (proof) and the child-process protocol they
all run under (child). Named ``builder``, not ``build``: ``aotbuild.build`` is the facade's function,
which a subpackage of that name would shadow once imported."""
