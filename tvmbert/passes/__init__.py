"""The graph passes, one a file, and ``pipeline``: the one compile pipeline (its phases, the
PASSES table optimize, build, tune and training read); ``bounded_takes``, which convert runs
on every import. May import core, deploy, frontend, ir and kernels."""
