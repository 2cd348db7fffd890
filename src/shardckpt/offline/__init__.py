"""Offline tools over the read interface (``formats``): ``convert``, ``export`` and ``diff``."""
