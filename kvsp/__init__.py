"""KVSP protocol core: plain Python with no Django, no sockets and no database.

Functions take bytes, dicts and tensors and return values; clocks and randomness are passed in.
An engine, a router, a holder or a test imports this package alone.
"""

__version__ = "0.1.0"
