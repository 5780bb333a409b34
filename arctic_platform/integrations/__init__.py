"""Integrations with RL frameworks that keep their own loop and hand the heavy compute to us.

Each subpackage imports its framework only when used, so this package imports nothing.
"""
