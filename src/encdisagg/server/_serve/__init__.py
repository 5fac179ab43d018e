"""``encdisagg serve``: the command, its options, and what the process does around the app.

The options (flag, environment, TOML file: ``_flag_table``, ``_config_file``, ``_resolve``)
are checked before torch loads. ``_command`` then binds, serves, drains (``_drain``) and
registers in the fleet registry (``_registered``); ``_worker`` is a data-parallel worker
process's entry point. ``_startup``, ``_noise``, ``_malloc`` and ``_stderr_lines`` name startup
failures, quiet third-party logs, tune glibc and carry native stderr lines into the logs.
"""
