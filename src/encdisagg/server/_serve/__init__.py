"""What ``encdisagg serve``'s process does around the app (the command line itself, its flags
and their checks, is ``encdisagg._cli``'s).

``_process`` serves until a signal, drains (``_drain``) and registers in the fleet registry
(``_registered``); ``_worker`` is a data-parallel worker process's entry point. ``_startup``,
``_noise``, ``_malloc`` and ``_stderr_lines`` name startup failures, quiet third-party logs,
tune glibc and carry native stderr lines into the logs.
"""
