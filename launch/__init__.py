"""Launchers: local sweeps, XManager, TPU VMs, ahead-of-time memory plans, multi-host setup."""
