"""The ``train-recipes`` command.

Argument parsing (``main``), the torchrun relaunch, preflight checks before any rank starts,
the ``config`` subcommands and the extras' install hints.
"""
