"""Launcher environment (``env``, torch-free), process-group lifetime and collectives."""
