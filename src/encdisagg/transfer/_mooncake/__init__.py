"""The Mooncake transfer engine (``_engine``), the thread and the loop polls that wait for
its writes (``_waiter``), its listeners kept to the configured host (``_listen``), and its
own log lines kept quiet (``_native_logs``)."""
