"""The ``relaylm`` command: ``serve`` (everything), ``api`` and ``worker``."""
