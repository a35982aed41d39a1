"""Devices and processes: the mesh and its logical-axis rules (`mesh`), host rows <-> global arrays
(`host_arrays`), `jax.distributed` start-up (`distributed`), the per-platform defaults of the "auto" switches
(`platform_defaults`), and an entrypoint's process start-up: logging and the compilation cache (`startup`).
"""
