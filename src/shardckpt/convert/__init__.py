"""Offline tools over the read interface (``formats``): ``diff`` now; ``convert`` and ``export`` next."""
