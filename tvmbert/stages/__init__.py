"""The stages, one module each (trace, convert, optimize, tune, build, verify, export, bench/),
the Job they take, their shared cache protocol (``cached``) and ``run`` (a config's stages in
order). Each is a plain function on a Job; the CLI only parses and prints. May import every
layer below it, never cli."""
